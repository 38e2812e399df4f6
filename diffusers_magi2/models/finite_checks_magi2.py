"""Non-finite values refused on every rank together: once per transformer forward at the MoE routers, once per
stage on its result, and never inside the blocks.

A NaN or inf (from the latents, the text embeddings, a non-finite weight, or an activation that overflowed) cannot
be refused where it appears: under context parallelism only the rank holding the bad tokens would raise, while the
others wait in the next all-to-all until the process group times out; on CUDA a device-side assert leaves the
context unusable. So the blocks only record, and two checks read the records back at the edges:

1. **Router inputs, per forward.** Each :class:`~diffusers_magi2.moe.layer.Magi2MultiHeadMoE` ORs "a logit was
   not finite" into its device flag (no host read). :class:`Magi2RouterInputCheckHook`, a diffusers ``ModelHook``
   on the transformer (:func:`apply_router_input_check`; the pipelines install it), clears the flags before the
   forward and checks them after it (:func:`check_router_inputs_finite`): one all-reduce of the flags over the
   model's context-parallel group (else its expert-parallel group), one host read, the same ``ValueError`` on every
   rank, and the group serves the next request. Classifier-free guidance runs its branches in one forward, so this
   is one check per denoising step; the step's index comes from the loop's cache context
   (``model.cache_context(name, step_index=i)``, which diffusers hands to every stateful hook). The hook sits on the
   model's own forward, so a gradient-checkpointed block recomputed in the backward runs no check.
2. **Each stage's result** (:func:`check_stage_result_finite`): the latents after the preview's last step and
   after the refiner's, one host read per stage, agreed over the same group. It catches what no router sees: a
   non-finite weight after the last MoE layer (its experts, the final projection) or in the refiner, which has no
   router.

On the error path only, the message names the first non-finite weight of the whole model: parameters in
``named_parameters()`` order, then buffers (FP8 and int4 scales), each rank scanning the tensors it holds
(expert-parallel ranks their own experts) and every rank reporting the lowest rank's finding; with none, the input
or an activation is to blame.
"""

from __future__ import annotations

from typing import Mapping, Optional

import torch
import torch.distributed as dist
from diffusers.hooks import HookRegistry, ModelHook
from diffusers.hooks.hooks import BaseState, StateManager
from torch import nn

from ..moe.layer import Magi2MultiHeadMoE
from ..parallel.distributed import first_message_of_ranks


__all__ = [
    "Magi2RouterInputCheckHook",
    "apply_router_input_check",
    "check_router_inputs_finite",
    "check_stage_result_finite",
    "clear_router_input_flags",
    "first_non_finite_weight",
]

#: the name of :class:`Magi2RouterInputCheckHook` in the model's diffusers ``HookRegistry``
ROUTER_INPUT_CHECK_HOOK = "magi2_router_input_check"
_EXPERT_BANKS = ("W_gate", "W_up", "W_down")
_SCAN_ELEMENTS = 1 << 24  # elements per chunk of the error-path weight scan (small temporaries)


def _routers(model: nn.Module) -> list[tuple[str, Magi2MultiHeadMoE]]:
    return [(name, module) for name, module in model.named_modules() if isinstance(module, Magi2MultiHeadMoE)]


def _agreement_group(model: nn.Module, routers, device: torch.device) -> tuple[Optional[object], torch.device]:
    """The process group whose ranks must agree (CP, else EP; ``None`` alone) and the device its flags reduce on
    (``device`` alone)."""
    cp = getattr(model, "context_parallel_group", None)
    if cp is not None and cp.group is not None:
        return cp.group, cp.device
    for _, router in routers:
        if router.ep_group is not None:
            return router.ep_group, router.gate.device
    return None, device


def _flags_on_any_rank(flags: torch.Tensor, group) -> list[int]:
    """The indices of ``flags`` (``[K]`` bool) set on some rank of ``group``: one all-reduce, one host read."""
    flags = flags.to(torch.int32)
    if group is not None:
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    return flags.nonzero().reshape(-1).tolist()


def _first_non_finite(tensor: torch.Tensor) -> Optional[tuple[int, float]]:
    """``(flat index, value)`` of the first NaN/inf of ``tensor``, scanned in chunks (FP8 upcast), or ``None``."""
    if not tensor.is_floating_point() or tensor.device.type == "meta":
        return None
    flat = tensor.detach().reshape(-1)
    for start in range(0, flat.numel(), _SCAN_ELEMENTS):
        chunk = flat[start : start + _SCAN_ELEMENTS].float()
        bad = torch.isfinite(chunk).logical_not_().nonzero()
        if bad.numel():
            index = int(bad[0, 0])
            return start + index, float(chunk[index])
    return None


def _where(module: nn.Module, name: str, tensor: torch.Tensor, flat_index: int) -> str:
    """Where element ``flat_index`` of ``module.<name>`` lies: the expert and head of an expert bank, else its index."""
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat_index), tensor.shape))
    if isinstance(module, Magi2MultiHeadMoE) and name in _EXPERT_BANKS + tuple(f"{b}_scale" for b in _EXPERT_BANKS):
        row = module.local_head_start * module.num_experts + index[0]
        return f"expert {row % module.num_experts} of head {row // module.num_experts} (element {list(index)})"
    return f"element {list(index)}"


def first_non_finite_weight(model: nn.Module) -> Optional[str]:
    """The first NaN/inf weight of ``model`` on this rank, described (its name, value and place; an expert bank's
    expert and head), or ``None``: parameters in ``named_parameters()`` order, then buffers. A full scan of the
    tensors this rank holds, meant for the error path.

    Args:
        model: any module (a ``Magi2Transformer3DModel`` or ``Magi2RefinerTransformer3DModel``).
    """
    for full in (dict(model.named_parameters()), dict(model.named_buffers())):
        for full_name, tensor in full.items():
            found = _first_non_finite(tensor)
            if found is not None:
                owner, _, name = full_name.rpartition(".")
                where = _where(model.get_submodule(owner), name, tensor, found[0])
                return f"{full_name} holds {found[1]} at {where}"
    return None


def _cause(model: nn.Module, group) -> str:
    """What to blame, the same on every rank of ``group``: the lowest rank's first non-finite weight, else the input."""
    weight = first_message_of_ranks(first_non_finite_weight(model), group)
    if weight is not None:
        return f"the weight {weight}: repair or reload the checkpoint (or the adapter fused into it)"
    return (
        "no weight of the model is NaN/inf, so the input (latents, text or image embeddings, timestep) held NaN/inf "
        "or an activation overflowed; check the inputs, or run in a wider dtype"
    )


def clear_router_input_flags(model: nn.Module) -> None:
    """Forget what the MoE routers of ``model`` recorded (on this rank; no collective). The router check's hook
    (:func:`apply_router_input_check`) calls it before each forward; without the hook, call it on every rank before
    the forwards that :func:`check_router_inputs_finite` then checks.

    Args:
        model: a ``Magi2Transformer3DModel`` (any module holding ``Magi2MultiHeadMoE`` layers; none: nothing to do).
    """
    for _, router in _routers(model):
        router.non_finite_router_logits.clear()


def check_router_inputs_finite(model: nn.Module, step_index: Optional[int] = None) -> None:
    """Raise on every rank together if a MoE router of ``model`` saw a NaN or inf since the flags were last cleared;
    then clear them (module docstring). The router check's hook (:func:`apply_router_input_check`, which the
    pipelines install) calls it after each forward; without the hook, call it on every rank after the forwards to
    check. A model without MoE layers returns at once.

    Args:
        model: a ``Magi2Transformer3DModel`` (any module holding ``Magi2MultiHeadMoE`` layers).
        step_index: the denoising step's index, for the message.

    Raises:
        ValueError: on every rank of the model's context- (else expert-) parallel group, with the same message:
            the step, the first layer whose router input held NaN/inf, and the first non-finite weight of the model
            (or that none is, so the input or an activation was to blame).
    """
    routers = _routers(model)
    if not routers:
        return
    group, device = _agreement_group(model, routers, routers[0][1].gate.device)
    no_flag = torch.zeros((), dtype=torch.bool, device=device)
    seen_by = [r.non_finite_router_logits.value for _, r in routers]
    seen = _flags_on_any_rank(torch.stack([no_flag if v is None else v.to(device) for v in seen_by]), group)
    if not seen:
        return
    clear_router_input_flags(model)
    names = [routers[i][0] for i in seen]
    step = "" if step_index is None else f" at step index {step_index}"
    layers = names[0] + (f" (then {len(names) - 1} more MoE layer(s))" if len(names) > 1 else "")
    raise ValueError(f"MoE router inputs are not finite{step}: first in {layers}; {_cause(model, group)}")


def check_stage_result_finite(model: nn.Module, latents: Mapping[str, torch.Tensor], stage: str) -> None:
    """Raise on every rank together unless every latent a stage produced is finite (module docstring, item 2):
    one host read, agreed over the model's context- (else expert-) parallel group. Call it on every rank after the
    stage's last step, as the pipelines do.

    Args:
        model: the stage's transformer (``Magi2Transformer3DModel`` or ``Magi2RefinerTransformer3DModel``), whose
            weights the message blames.
        latents: the stage's results by name, e.g. ``{"latents": [B, 48, T, h, w], "audio_latents": [B, L, 64]}``.
        stage: the stage's name for the message (``"preview"``, ``"refiner"``).

    Raises:
        ValueError: on every rank, with the same message: the stage, the latents holding NaN/inf, and the first
            non-finite weight of ``model`` (or that none is).
    """
    names = list(latents)
    if not names:
        return
    group, device = _agreement_group(model, _routers(model), latents[names[0]].device)
    finite = torch.stack([torch.isfinite(latents[n]).all().to(device) for n in names])
    bad = _flags_on_any_rank(finite.logical_not(), group)
    if not bad:
        return
    held = ", ".join(names[i] for i in bad)
    raise ValueError(f"the {stage} stage's result is not finite (NaN/inf in {held}); {_cause(model, group)}")


class _StepOfCacheContext(StateManager):
    """Keeps the ``step_index`` of the cache context a denoising loop sets (``model.cache_context(...)`` hands it to
    every stateful hook's ``StateManager``); ``None`` outside one."""

    def __init__(self) -> None:
        super().__init__(BaseState)
        self.step_index: Optional[int] = None

    def set_context(self, context) -> None:
        super().set_context(context)
        self.step_index = None if context is None else context.step_index


class Magi2RouterInputCheckHook(ModelHook):
    """The router check of each forward (module docstring, item 1): ``pre_forward`` clears the MoE routers' flags,
    ``post_forward`` raises on every rank if a router input was NaN/inf, naming the loop's step when the forward ran
    in a cache context. Install it with :func:`apply_router_input_check`."""

    _is_stateful = True  # so that cache contexts reach its StateManager

    def __init__(self) -> None:
        super().__init__()
        self.step = _StepOfCacheContext()

    def pre_forward(self, module: nn.Module, *args, **kwargs):
        clear_router_input_flags(module)
        return args, kwargs

    def post_forward(self, module: nn.Module, output):
        check_router_inputs_finite(module, self.step.step_index)
        return output

    def reset_state(self, module: nn.Module) -> nn.Module:
        clear_router_input_flags(module)
        self.step.reset()
        self.step.step_index = None
        return module


def apply_router_input_check(model: nn.Module) -> nn.Module:
    """Install :class:`Magi2RouterInputCheckHook` on ``model`` (once: a model that has it keeps it), so that every
    forward refuses NaN/inf router inputs on every rank together. ``Magi2Pipeline`` and the modular preview loop
    install it on their transformer; a caller of the model itself may install it too (or call
    :func:`clear_router_input_flags` and :func:`check_router_inputs_finite` around its forwards).

    Args:
        model: a ``Magi2Transformer3DModel``.

    Returns:
        ``model``.

    Example::

        apply_router_input_check(transformer)
        with transformer.cache_context("cond", step_index=i):  # optional: the message names step i
            out = transformer(**inputs)  # ValueError on every rank if a MoE router saw NaN/inf
    """
    registry = HookRegistry.check_if_exists_or_initialize(model)
    if registry.get_hook(ROUTER_INPUT_CHECK_HOOK) is None:
        registry.register_hook(Magi2RouterInputCheckHook(), ROUTER_INPUT_CHECK_HOOK)
    return model
