"""LoRA on every projection of both MAGI-2 models, managed by PEFT.

Three kinds of target, all ``W' = W + s * B @ A`` with ``A [r, in]``, ``B [rows, r]`` and ``s = alpha / r`` times the
runtime scale (``attention_kwargs={"scale": ...}``, ``set_adapters`` weights):

* single-modality projections (:class:`~.modality.Magi2Linear`, an ``nn.Linear``): PEFT's ``lora.Linear``;
* modality-grouped projections (:class:`~.modality.Magi2ModalityGroupedLinear`, weight ``[M*out, in]`` with one
  block per modality): :func:`grouped_lora_layer_class` (``Magi2GroupedLoraLinear``), a small PEFT LoRA layer of
  ours (registered through ``LoraConfig._register_custom_module``). ``A`` is shared by the modalities and ``B``'s rows stack the
  video | audio | text blocks, as in the weight, so token ``t`` of modality ``m`` gets
  ``s * B[m*out:(m+1)*out] @ (A @ x_t)`` and the merged weight is exactly ``W + s * B @ A``;
* the router gate of a MoE layer (``Magi2MultiHeadMoE.gate`` ``[H*E, Dh]``, one ``A [r, Dh]`` shared by the ``H``
  heads): PEFT's ``ParamWrapper`` (``target_parameters``), which wraps ``mlp.moe_mlp`` for the call. Its LoRA
  keys are ``...mlp.moe_mlp.lora_A.weight`` / ``lora_B.weight``.

:func:`load_magi2_lora_adapter` validates a whole adapter (every key matched, shapes and ranks) before touching the
model, then injects it; :func:`keep_unfused_weights` keeps a copy of each weight it merges into so that
:func:`unfuse_magi2_lora` restores it bit for bit (PEFT's unmerge subtracts the delta, which rounds).
"""

from __future__ import annotations

import functools
import re
from collections import Counter
from typing import Any, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..moe.layer import Magi2MultiHeadMoE
from .modality import Magi2ModalityGroupedLinear


__all__ = [
    "lora_scale_from_attention_kwargs",
    "grouped_lora_layer_class",
    "LoraTarget",
    "plan_magi2_lora_targets",
    "magi2_lora_config",
    "register_magi2_lora_layers",
    "check_magi2_lora_adapter",
    "load_magi2_lora_adapter",
    "keep_unfused_weights",
    "unfuse_magi2_lora",
]

_LORA_SUFFIXES = (".lora_A.weight", ".lora_B.weight", ".alpha")
_UNFUSED_ATTR = "_magi2_unfused_weight"


def lora_scale_from_attention_kwargs(forward):
    """diffusers' ``apply_lora_scale("attention_kwargs")`` on ``forward``, after checking that ``attention_kwargs`` is
    a dict or ``None`` (the decorator would fail on anything else with an unclear error).

    Raises:
        ValueError: ``attention_kwargs`` is neither a dict nor ``None``.
    """
    from diffusers.utils.peft_utils import apply_lora_scale

    scaled = apply_lora_scale("attention_kwargs")(forward)

    @functools.wraps(forward)
    def wrapper(self, *args, **kwargs):
        attention_kwargs = kwargs.get("attention_kwargs")
        if attention_kwargs is not None and not isinstance(attention_kwargs, dict):
            raise ValueError(f"attention_kwargs must be a dict or None, got {type(attention_kwargs).__name__}")
        return scaled(self, *args, **kwargs)

    return wrapper


def _peft_lora_linear():
    from peft.tuners.lora.layer import Linear

    return Linear


@functools.lru_cache(maxsize=None)
def grouped_lora_layer_class() -> type:
    """``Magi2GroupedLoraLinear``, the PEFT LoRA layer of a :class:`Magi2ModalityGroupedLinear` (a subclass of
    ``peft.tuners.lora.layer.Linear``, built on first use since PEFT is an optional import)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    class _Magi2GroupedLoraLinear(_peft_lora_linear()):
        """PEFT LoRA layer of a modality-grouped projection (module docstring); merge/unmerge are ``lora.Linear``'s
        on the full ``[M*out, in]`` weight; no DoRA or other variants, no mixed-adapter batches."""

        @property
        def lora_variants(self):
            return {(): None}

        def _get_in_out_features(self, module: nn.Module):
            base = module.get_base_layer() if isinstance(module, BaseTunerLayer) else module
            return base.in_features, base.num_modality * base.out_features

        def forward(self, x: torch.Tensor, group_sizes=None, out_dtype=None, **kwargs) -> torch.Tensor:
            if kwargs.pop("adapter_names", None) is not None:
                raise ValueError("Magi2GroupedLoraLinear does not support mixed-adapter batches (adapter_names)")
            self._check_forward_args(x, **kwargs)
            if self.disable_adapters:
                if self.merged:
                    self.unmerge()
                return self.base_layer(x, group_sizes, out_dtype)
            result = self.base_layer(x, group_sizes, out_dtype)
            if self.merged:
                return result
            base = self.get_base_layer()
            m, out = base.num_modality, base.out_features
            sizes = [x.shape[0]] if m == 1 else list(group_sizes)
            for name in self.active_adapters:
                if name not in self.lora_A:
                    continue
                lora_a = self.lora_A[name]
                h = lora_a(self.lora_dropout[name](self._cast_input_dtype(x, lora_a.weight.dtype)))
                blocks = self.lora_B[name].weight.view(m, out, -1)
                parts = torch.split(h, sizes, dim=0)
                delta = torch.cat([F.linear(p, blocks[i]) for i, p in enumerate(parts)], dim=0)
                result = result + (delta * self.scaling[name]).to(result.dtype)
            return result

        def __repr__(self) -> str:
            return "magi2." + super().__repr__()

    _Magi2GroupedLoraLinear.__name__ = _Magi2GroupedLoraLinear.__qualname__ = "Magi2GroupedLoraLinear"
    return _Magi2GroupedLoraLinear


def register_magi2_lora_layers(config) -> Any:
    """Register ``Magi2GroupedLoraLinear`` (:func:`grouped_lora_layer_class`) for the grouped projections on a ``peft.LoraConfig``; returns it."""
    config._register_custom_module({Magi2ModalityGroupedLinear: grouped_lora_layer_class()})
    return config


class LoraTarget:
    """One LoRA target of a state dict: ``path`` (the module key prefix), ``kind`` (``"linear"``, ``"grouped"``,
    ``"router"``), the factors ``A [r, in]``, ``B [rows, r]`` and an optional ``alpha``."""

    def __init__(self, path: str, kind: str, a: torch.Tensor, b: torch.Tensor, alpha: Optional[float]):
        self.path, self.kind, self.a, self.b, self.alpha = path, kind, a, b, alpha

    @property
    def rank(self) -> int:
        return int(self.a.shape[0])

    @property
    def peft_name(self) -> str:
        """The name PEFT's ``target_modules`` / ``target_parameters`` and patterns use."""
        return f"{self.path}.gate" if self.kind == "router" else self.path


def _base(module: nn.Module) -> nn.Module:
    while hasattr(module, "base_layer"):
        module = module.base_layer
    return module


def plan_magi2_lora_targets(model: nn.Module, state_dict: dict, layout: str = "diffusers") -> list[LoraTarget]:
    """Group ``state_dict`` (model keys, no component prefix: ``<path>.lora_A.weight``, ``<path>.lora_B.weight``,
    optional ``<path>.alpha``) into targets of ``model`` and check them all.

    Raises:
        ValueError: keys that name no LoRA-able projection of ``model`` (the first ones are listed with ``layout``),
            a missing factor, non-tensor values, factors that are not 2-D, a rank that differs between ``A`` and
            ``B``, or shapes that do not fit the target (all problems in one message).
    """
    groups: dict[str, dict[str, Any]] = {}
    unmatched = []
    for key, value in state_dict.items():
        suffix = next((s for s in _LORA_SUFFIXES if key.endswith(s)), None)
        if suffix is None:
            unmatched.append(key)
            continue
        groups.setdefault(key[: -len(suffix)], {})[suffix] = value
    modules = dict(model.named_modules())
    targets, problems = [], []
    for path, parts in groups.items():
        module = modules.get(path)
        base = _base(module) if module is not None else None
        if isinstance(base, Magi2MultiHeadMoE):
            kind, rows, cols = "router", base.gate.shape[0], base.gate.shape[1]
        elif isinstance(base, Magi2ModalityGroupedLinear):
            kind, rows, cols = "grouped", base.num_modality * base.out_features, base.in_features
        elif isinstance(base, nn.Linear) and path.startswith("transformer_blocks."):
            kind, rows, cols = "linear", base.out_features, base.in_features
        else:
            unmatched += [path + s for s in parts]
            continue
        a, b, alpha = parts.get(".lora_A.weight"), parts.get(".lora_B.weight"), parts.get(".alpha")
        if a is None or b is None:
            problems.append(f"{path}: has only {'lora_A' if b is None else 'lora_B'}")
            continue
        if not all(isinstance(t, torch.Tensor) for t in (a, b)) or (
            alpha is not None and not isinstance(alpha, (torch.Tensor, int, float))
        ):
            problems.append(f"{path}: LoRA values must be tensors")
            continue
        if a.dim() != 2 or b.dim() != 2:
            problems.append(f"{path}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} must both be 2-D")
            continue
        if a.shape[0] != b.shape[1]:
            problems.append(f"{path}: rank mismatch, lora_A has rank {a.shape[0]} but lora_B {b.shape[1]}")
            continue
        if (b.shape[0], a.shape[1]) != (rows, cols):
            problems.append(
                f"{path}: B @ A would be {(b.shape[0], a.shape[1])}, the {kind} target's weight is {(rows, cols)}"
            )
            continue
        if alpha is not None:
            alpha = float(alpha.reshape(-1)[0]) if isinstance(alpha, torch.Tensor) else float(alpha)
        targets.append(LoraTarget(path, kind, a, b, alpha))
    if unmatched:
        raise ValueError(
            f"LoRA ({layout} layout) has {len(unmatched)} keys that match no LoRA-able projection of "
            f"{type(model).__name__}, e.g. {sorted(unmatched)[:5]}; nothing was loaded"
        )
    if problems:
        raise ValueError(
            f"LoRA ({layout} layout) does not fit {type(model).__name__}; nothing was loaded: "
            + "; ".join(problems[:8])
        )
    if not targets:
        raise ValueError(f"LoRA ({layout} layout) holds no LoRA factors")
    return targets


def _pattern(name: str) -> str:
    return re.escape(name)


def magi2_lora_config(targets: list[LoraTarget], metadata: Optional[dict] = None):
    """A ``peft.LoraConfig`` injecting exactly ``targets``: their ranks, and alpha from each target's ``alpha``,
    else from ``metadata`` (a saved adapter's ``LoraConfig`` fields), else alpha = rank (scale 1).

    Raises:
        ValueError: a rank in ``metadata`` that disagrees with the tensors.
    """
    from peft import LoraConfig
    from peft.utils.other import get_pattern_key

    meta = dict(metadata or {})
    ranks = Counter(t.rank for t in targets)
    r = ranks.most_common(1)[0][0]

    def meta_value(field, name, default):
        pattern = meta.get(f"{field}_pattern") or {}
        key = get_pattern_key(pattern.keys(), name) if pattern else None
        if key is not None and key in pattern:
            return pattern[key]
        return meta.get("r" if field == "rank" else "lora_alpha", default)

    rank_pattern, alpha_pattern, alphas = {}, {}, []
    for t in targets:
        if meta and meta_value("rank", t.peft_name, t.rank) != t.rank:
            raise ValueError(
                f"{t.path}: rank mismatch, the adapter config says r={meta_value('rank', t.peft_name, t.rank)} "
                f"but lora_A/lora_B have rank {t.rank}; nothing was loaded"
            )
        alpha = t.alpha if t.alpha is not None else (meta_value("alpha", t.peft_name, t.rank) if meta else t.rank)
        alphas.append(alpha)
        if t.rank != r:
            rank_pattern[_pattern(t.peft_name)] = t.rank
        alpha_pattern[_pattern(t.peft_name)] = alpha
    common_alpha = Counter(alphas).most_common(1)[0][0]
    alpha_pattern = {k: v for k, v in alpha_pattern.items() if v != common_alpha}
    modules = sorted(t.path for t in targets if t.kind != "router")
    params = sorted(t.peft_name for t in targets if t.kind == "router")
    kwargs = {k: meta[k] for k in ("use_rslora", "lora_dropout") if k in meta}
    config = LoraConfig(
        r=r,
        lora_alpha=common_alpha,
        rank_pattern=rank_pattern,
        alpha_pattern=alpha_pattern,
        target_modules=modules or None,
        target_parameters=params or None,
        init_lora_weights=False,
        **kwargs,
    )
    if not modules:
        config.target_modules = []
    return register_magi2_lora_layers(config)


def _tuner_layers(model: nn.Module):
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [m for m in model.modules() if isinstance(m, BaseTunerLayer)]


def _drop_adapter(model: nn.Module, adapter_name: str) -> None:
    """Remove a partly injected adapter: its layers, its config, and the wrappers if no adapter is left."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    for module in model.modules():
        if isinstance(module, BaseTunerLayer) and adapter_name in module.lora_A:
            module.delete_adapter(adapter_name)
    getattr(model, "peft_config", {}).pop(adapter_name, None)
    if not getattr(model, "peft_config", None):
        from diffusers.utils.peft_utils import recurse_remove_peft_layers

        recurse_remove_peft_layers(model)
        if hasattr(model, "peft_config"):
            del model.peft_config
        model._hf_peft_config_loaded = False


def check_magi2_lora_adapter(
    model: nn.Module, state_dict: dict, adapter_name: str, metadata: Optional[dict] = None, layout: str = "peft"
):
    """Everything :func:`load_magi2_lora_adapter` checks, without changing the model; returns ``(targets, config)``.

    Raises:
        ValueError: see :func:`plan_magi2_lora_targets`; ``adapter_name`` already in use; the model is expert-parallel
            and the adapter targets a router gate; router gates other than a loaded adapter's.
    """
    if adapter_name in (getattr(model, "peft_config", None) or {}):
        raise ValueError(f"adapter name {adapter_name!r} is already in use; choose another adapter_name")
    targets = plan_magi2_lora_targets(model, state_dict, layout)
    modules = dict(model.named_modules())
    for t in targets:
        if t.kind == "router" and getattr(_base(modules[t.path]), "ep_size", 1) > 1:
            raise ValueError(
                f"{t.path}: LoRA on the router gate of an expert-parallel model is not supported (each rank holds only "
                "its heads' rows); load it into a single-process model or leave the router out"
            )
    existing = [c for c in (getattr(model, "peft_config", None) or {}).values() if c.target_parameters]
    params = sorted(t.peft_name for t in targets if t.kind == "router")
    if params and any(sorted(c.target_parameters) != params for c in existing):
        raise ValueError(
            "PEFT needs every adapter that targets router gates to target the same gates; this one targets "
            f"{len(params)} gates that differ from the loaded adapters'"
        )
    return targets, magi2_lora_config(targets, metadata)


def load_magi2_lora_adapter(
    model: nn.Module, state_dict: dict, adapter_name: str, metadata: Optional[dict] = None, layout: str = "peft"
) -> None:
    """Inject adapter ``adapter_name`` from ``state_dict`` (model keys, see :func:`plan_magi2_lora_targets`).

    Everything is checked first (:func:`check_magi2_lora_adapter`); on a later failure the adapter is removed again,
    so the model is left as it was.
    """
    from peft import inject_adapter_in_model

    targets, config = check_magi2_lora_adapter(model, state_dict, adapter_name, metadata, layout)
    weights = {}
    for t in targets:
        weights[f"{t.path}.lora_A.weight"] = t.a
        weights[f"{t.path}.lora_B.weight"] = t.b
    try:
        inject_adapter_in_model(config, model, adapter_name=adapter_name)
        _copy_factors(model, weights, adapter_name)
        model._hf_peft_config_loaded = True
    except Exception:
        _drop_adapter(model, adapter_name)
        raise


def _copy_factors(model: nn.Module, weights: dict, adapter_name: str) -> None:
    """Copy ``<path>.lora_A.weight`` / ``lora_B.weight`` into adapter ``adapter_name`` (cast to the layer's dtype)."""
    modules = dict(model.named_modules())
    with torch.no_grad():
        for key, value in weights.items():
            path, _, rest = key.rpartition(".lora_")
            factor = modules[path].lora_A if rest.startswith("A") else modules[path].lora_B
            param = factor[adapter_name].weight
            param.copy_(value.to(device=param.device, dtype=param.dtype))


def _tuned_param(layer: nn.Module) -> nn.Parameter:
    if hasattr(layer, "get_param"):  # ParamWrapper
        return layer.get_param()
    return layer.get_base_layer().weight


def keep_unfused_weights(model: nn.Module) -> None:
    """Before diffusers' ``fuse_lora``: keep a copy of each adapted weight that is not merged yet (one extra copy of
    the adapted weights, on their device, until :func:`unfuse_magi2_lora`)."""
    for layer in _tuner_layers(model):
        if not layer.merged and not hasattr(layer, _UNFUSED_ATTR):
            setattr(layer, _UNFUSED_ATTR, _tuned_param(layer).detach().clone())


def unfuse_magi2_lora(model: nn.Module) -> None:
    """Undo diffusers' ``fuse_lora`` after :func:`keep_unfused_weights`: every merged weight gets its kept copy back, bit for bit."""
    for layer in _tuner_layers(model):
        kept = getattr(layer, _UNFUSED_ATTR, None)
        if kept is not None:
            with torch.no_grad():
                _tuned_param(layer).data.copy_(kept)
            layer.merged_adapters.clear()
            delattr(layer, _UNFUSED_ATTR)
        elif layer.merged:
            layer.unmerge()
