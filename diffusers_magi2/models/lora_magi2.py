"""LoRA on every projection of both MAGI-2 models, managed by PEFT.

Three kinds of target, all ``W' = W + s * B @ A`` with ``A [r, in]``, ``B [rows, r]`` and ``s = alpha / r`` times the
runtime scale (``attention_kwargs={"scale": ...}``, ``set_adapters`` weights):

* single-modality projections (:class:`~.modality.Magi2Linear`, an ``nn.Linear``): PEFT's ``lora.Linear`` (DoRA
  too);
* modality-grouped projections (:class:`~.modality.Magi2ModalityGroupedLinear`, weight ``[M*out, in]`` with one
  block per modality): :func:`grouped_lora_layer_class` (``Magi2GroupedLoraLinear``), a small PEFT LoRA layer of
  ours (registered through ``LoraConfig._register_custom_module``). ``A`` is shared by the modalities and ``B``'s
  rows stack the video | audio | text blocks, as in the weight, so token ``t`` of modality ``m`` gets
  ``s * B[m*out:(m+1)*out] @ (A @ x_t)`` and the merged weight is exactly ``W + s * B @ A``;
* the router gate of a MoE layer (``Magi2MultiHeadMoE.gate`` ``[H*E, Dh]``, one ``A [r, Dh]`` shared by the ``H``
  heads): PEFT's ``ParamWrapper`` (``target_parameters``), which wraps ``mlp.moe_mlp`` for the call. Its LoRA
  keys are ``...mlp.moe_mlp.lora_A.weight`` / ``lora_B.weight``.

:func:`load_magi2_lora_adapter` is diffusers' ``PeftAdapterMixin.load_lora_adapter`` with two differences: the
config registers our grouped layer, and PEFT injects from the config rather than from the state dict (PEFT refuses
``target_parameters`` with a state dict). It checks the whole adapter first (every key matched, shapes, ranks,
finite values, the config's fields), then injects it and sets its weights with PEFT's ``inject_adapter_in_model`` /
``set_peft_model_state_dict``; on any failure the adapter is removed again. Fusing is diffusers' and PEFT's
(``unfuse_lora`` subtracts the delta again, exact up to fp32 rounding); :func:`check_lora_fusable` makes
``safe_fusing`` all or nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
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
    "lora_scale_for_call",
    "grouped_lora_layer_class",
    "LoraTarget",
    "plan_magi2_lora_targets",
    "magi2_lora_config",
    "register_magi2_lora_layers",
    "check_magi2_lora_adapter",
    "load_magi2_lora_adapter",
    "check_lora_fusable",
]

#: PEFT state-dict key suffixes of a target: the factors, DoRA's magnitude, the ``lora_bias`` bias.
_LORA_SUFFIXES = (".lora_A.weight", ".lora_B.weight", ".lora_magnitude_vector", ".lora_B.bias")


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


@contextlib.contextmanager
def lora_scale_for_call(model: nn.Module, attention_kwargs: Optional[dict]):
    """What :func:`lora_scale_from_attention_kwargs` does, as a ``with`` block inside the forward: the PEFT layers of
    ``model`` scaled by ``attention_kwargs["scale"]`` (1.0 without it) until the block ends. For a forward that frees
    an input it was handed: a decorator's ``*args`` would hold that input until the call returns.

    Raises:
        ValueError: ``attention_kwargs`` is neither a dict nor ``None``.
    """
    from diffusers.utils import USE_PEFT_BACKEND
    from diffusers.utils.peft_utils import scale_lora_layers, unscale_lora_layers

    if attention_kwargs is not None and not isinstance(attention_kwargs, dict):
        raise ValueError(f"attention_kwargs must be a dict or None, got {type(attention_kwargs).__name__}")
    scale = (attention_kwargs or {}).get("scale", 1.0)
    if USE_PEFT_BACKEND:
        scale_lora_layers(model, scale)
    try:
        yield
    finally:
        if USE_PEFT_BACKEND:
            unscale_lora_layers(model, scale)


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
    ``"router"``), the factors ``A [r, in]``, ``B [rows, r]``, and whether it has DoRA's magnitude and a bias."""

    def __init__(self, path: str, kind: str, a: torch.Tensor, b: torch.Tensor, dora: bool, bias: bool):
        self.path, self.kind, self.a, self.b, self.dora, self.bias = path, kind, a, b, dora, bias

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


def _target_kind(path: str, module: Optional[nn.Module]):
    """``(kind, rows, cols)`` of a LoRA-able module, else ``None``."""
    base = _base(module) if module is not None else None
    if isinstance(base, Magi2MultiHeadMoE):
        return "router", base.gate.shape[0], base.gate.shape[1]
    if isinstance(base, Magi2ModalityGroupedLinear):
        return "grouped", base.num_modality * base.out_features, base.in_features
    if isinstance(base, nn.Linear) and path.startswith("transformer_blocks."):
        return "linear", base.out_features, base.in_features
    return None


def _check_target(path: str, kind: str, rows: int, cols: int, parts: dict) -> Optional[str]:
    """What is wrong with one target's tensors (``parts``: suffix -> tensor), or ``None``."""
    a, b = parts.get(".lora_A.weight"), parts.get(".lora_B.weight")
    if a is None or b is None:
        return f"{path}: has only {'lora_A' if b is None else 'lora_B'}"
    if a.dim() != 2 or b.dim() != 2:
        return f"{path}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} must both be 2-D"
    if a.shape[0] != b.shape[1]:
        return f"{path}: rank mismatch, lora_A has rank {a.shape[0]} but lora_B {b.shape[1]}"
    if (b.shape[0], a.shape[1]) != (rows, cols):
        return f"{path}: B @ A would be {(b.shape[0], a.shape[1])}, the {kind} target's weight is {(rows, cols)}"
    for suffix in (".lora_magnitude_vector", ".lora_B.bias"):
        extra = parts.get(suffix)
        if extra is not None and tuple(extra.shape) != (rows,):
            return f"{path}: {suffix[1:]} is {tuple(extra.shape)}, the target has {rows} rows"
    if ".lora_magnitude_vector" in parts and kind != "linear":
        return f"{path}: DoRA (lora_magnitude_vector) is supported on the single-modality projections, not a {kind}"
    return None


def plan_magi2_lora_targets(model: nn.Module, state_dict: dict, layout: Optional[str] = None) -> list[LoraTarget]:
    """Group ``state_dict`` (PEFT keys of ``model``, no component prefix: ``<path>.lora_A.weight``,
    ``<path>.lora_B.weight``, optional ``<path>.lora_magnitude_vector`` / ``<path>.lora_B.bias``) into targets of
    ``model`` and check them all; ``layout``, the file's layout, is named in the messages.

    Raises:
        ValueError: keys that name no LoRA-able projection of ``model`` (the first ones are listed with ``layout``);
            NaN or inf values (the keys are named); a missing factor, factors that are not 2-D, a rank that differs
            between ``A`` and ``B``, shapes that do not fit the target, DoRA on a grouped projection or a router
            (all such problems in one message).
    """
    what = f"LoRA ({layout} layout)" if layout else "LoRA"
    groups: dict[str, dict[str, torch.Tensor]] = {}
    unmatched = []
    for key, value in state_dict.items():
        suffix = next((s for s in _LORA_SUFFIXES if key.endswith(s)), None)
        if suffix is None or not isinstance(value, torch.Tensor):
            unmatched.append(key)
            continue
        groups.setdefault(key[: -len(suffix)], {})[suffix] = value
    modules = dict(model.named_modules())
    found = {path: _target_kind(path, modules.get(path)) for path in groups}
    unmatched += [path + s for path, parts in groups.items() if found[path] is None for s in parts]
    if unmatched:
        raise ValueError(
            f"{what} has {len(unmatched)} keys that match no LoRA-able projection of "
            f"{type(model).__name__}, e.g. {sorted(unmatched)[:5]}; nothing was loaded"
        )
    non_finite = sorted(  # float8 factors (no isfinite kernel on CPU) are checked on an upcast copy
        k
        for k, v in state_dict.items()
        if v.is_floating_point() and not torch.isfinite(v.float() if v.element_size() == 1 else v).all()
    )
    if non_finite:
        raise ValueError(
            f"{what} holds NaN or inf values in {len(non_finite)} tensors of {type(model).__name__}, "
            f"e.g. {non_finite[:5]}; nothing was loaded"
        )
    targets, problems = [], []
    for path, parts in groups.items():
        kind, rows, cols = found[path]
        problem = _check_target(path, kind, rows, cols, parts)
        if problem is not None:
            problems.append(problem)
            continue
        a, b = parts[".lora_A.weight"], parts[".lora_B.weight"]
        targets.append(LoraTarget(path, kind, a, b, ".lora_magnitude_vector" in parts, ".lora_B.bias" in parts))
    if problems:
        raise ValueError(f"{what} does not fit {type(model).__name__}; nothing was loaded: " + "; ".join(problems[:8]))
    if not targets:
        raise ValueError(f"{what} holds no LoRA factors")
    return targets


def _pattern(name: str) -> str:
    return re.escape(name)


def _metadata_fields(metadata: dict) -> dict:
    """The saved adapter config as ``LoraConfig`` keyword arguments.

    Raises:
        ValueError: fields this PEFT's ``LoraConfig`` does not have (diffusers raises on them too).
    """
    import peft
    from peft import LoraConfig

    known = {f.name for f in dataclasses.fields(LoraConfig) if f.init}
    unknown = sorted(set(metadata) - known)
    if unknown:
        raise ValueError(
            f"the LoRA's adapter config has fields that peft {peft.__version__}'s LoraConfig does not know: "
            f"{unknown}; nothing was loaded (save it with this PEFT version, or drop those fields)"
        )
    return dict(metadata)


def _config_rank(config, name: str) -> int:
    from peft.utils.other import get_pattern_key

    key = get_pattern_key(config.rank_pattern.keys(), name) if config.rank_pattern else None
    return config.rank_pattern[key] if key is not None and key in config.rank_pattern else config.r


def magi2_lora_config(targets: list[LoraTarget], metadata: Optional[dict] = None):
    """A ``peft.LoraConfig`` injecting exactly ``targets``: the saved adapter config ``metadata`` (its ranks,
    alphas and options), else ranks from the tensors at scale 1 (``lora_alpha = r``: converted files carry their
    scale in the factors).

    Raises:
        ValueError: unknown fields in ``metadata``, values ``LoraConfig`` refuses, or a rank in ``metadata`` that
            disagrees with the tensors.
    """
    from peft import LoraConfig

    modules = sorted(t.path for t in targets if t.kind != "router")
    params = sorted(t.peft_name for t in targets if t.kind == "router")
    exact = {
        "target_modules": modules or None,
        "target_parameters": params or None,
        "exclude_modules": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "init_lora_weights": False,
    }
    if metadata:
        kwargs = {**_metadata_fields(metadata), **exact}
    else:
        r = Counter(t.rank for t in targets).most_common(1)[0][0]
        ranks = {_pattern(t.peft_name): t.rank for t in targets if t.rank != r}
        kwargs = {
            "r": r,
            "lora_alpha": r,
            "rank_pattern": ranks,
            "alpha_pattern": dict(ranks),
            "use_dora": any(t.dora for t in targets),
            "lora_bias": any(t.bias for t in targets),
            **exact,
        }
    try:
        config = LoraConfig(**kwargs)
    except (TypeError, ValueError) as error:
        raise ValueError(f"the LoRA's adapter config is not a valid LoraConfig: {error}; nothing was loaded") from None
    for t in targets:
        if _config_rank(config, t.peft_name) != t.rank:
            raise ValueError(
                f"{t.path}: rank mismatch, the adapter config says r={_config_rank(config, t.peft_name)} "
                f"but lora_A/lora_B have rank {t.rank}; nothing was loaded"
            )
    if not modules:
        config.target_modules = []
    return register_magi2_lora_layers(config)


def _tuner_layers(model: nn.Module):
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [(n, m) for n, m in model.named_modules() if isinstance(m, BaseTunerLayer)]


def _drop_adapter(model: nn.Module, adapter_name: str) -> None:
    """Remove a partly injected adapter: its layers, its config, and the wrappers if no adapter is left."""
    for _, module in _tuner_layers(model):
        if adapter_name in module.lora_A:
            module.delete_adapter(adapter_name)
    getattr(model, "peft_config", {}).pop(adapter_name, None)
    if not getattr(model, "peft_config", None):
        from diffusers.utils.peft_utils import recurse_remove_peft_layers

        recurse_remove_peft_layers(model)
        if hasattr(model, "peft_config"):
            del model.peft_config
        model._hf_peft_config_loaded = False


def check_magi2_lora_adapter(
    model: nn.Module,
    state_dict: dict,
    adapter_name: str,
    metadata: Optional[dict] = None,
    layout: Optional[str] = None,
):
    """Everything :func:`load_magi2_lora_adapter` checks, without changing the model; returns ``(targets, config)``.

    Raises:
        ValueError: see :func:`plan_magi2_lora_targets` and :func:`magi2_lora_config`; ``adapter_name`` already in
            use; the model is expert-parallel and the adapter targets a router gate; router gates other than a
            loaded adapter's.
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
    model: nn.Module,
    state_dict: dict,
    adapter_name: str,
    metadata: Optional[dict] = None,
    layout: Optional[str] = None,
) -> None:
    """Inject adapter ``adapter_name`` from ``state_dict`` (PEFT keys of ``model``, see
    :func:`plan_magi2_lora_targets`) with the saved adapter config ``metadata`` (module docstring).

    Raises:
        ValueError: see :func:`check_magi2_lora_adapter`; nothing is loaded then, and after any later failure the
            adapter is removed again.
    """
    from peft import inject_adapter_in_model, set_peft_model_state_dict

    _, config = check_magi2_lora_adapter(model, state_dict, adapter_name, metadata, layout)
    try:
        inject_adapter_in_model(config, model, adapter_name=adapter_name)
        result = set_peft_model_state_dict(model, state_dict, adapter_name=adapter_name)
        missing = [k for k in result.missing_keys if ".lora_" in k and f".{adapter_name}" in k]
        if result.unexpected_keys or missing:
            raise ValueError(
                f"PEFT left LoRA keys unloaded: unexpected {sorted(result.unexpected_keys)[:5]}, "
                f"missing {sorted(missing)[:5]}; nothing was loaded"
            )
        model._hf_peft_config_loaded = True
    except Exception:
        _drop_adapter(model, adapter_name)
        raise


def _tuned_param(layer: nn.Module) -> nn.Parameter:
    if hasattr(layer, "get_param"):  # ParamWrapper
        return layer.get_param()
    return layer.get_base_layer().weight


def check_lora_fusable(model: nn.Module, lora_scale: float = 1.0, adapter_names: Optional[list[str]] = None) -> None:
    """Check, before anything is fused, that fusing ``adapter_names`` (default: the active ones) at ``lora_scale``
    leaves every weight finite, as PEFT's ``safe_merge`` checks each layer while it merges; one layer at a time,
    so it needs one extra weight of memory.

    Raises:
        ValueError: naming the first module and adapter whose merged weight (or DoRA magnitude) is not finite.
    """
    for name, layer in _tuner_layers(model):
        names = adapter_names if adapter_names is not None else layer.active_adapters
        for adapter in [a for a in names if a in layer.lora_A and a not in layer.merged_adapters]:
            with torch.no_grad():
                weight = _tuned_param(layer)
                merged = weight + (lora_scale * layer.get_delta_weight(adapter)).to(weight.dtype)
                magnitude = getattr(layer, "lora_magnitude_vector", None) or {}
                ok = bool(torch.isfinite(merged).all())
                if adapter in magnitude:
                    ok = ok and bool(torch.isfinite(magnitude[adapter].weight).all())
                del merged
            if not ok:
                raise ValueError(
                    f"NaNs detected in the merged weights of {name}: adapter {adapter!r} holds NaN or inf values; "
                    "nothing was fused"
                )
