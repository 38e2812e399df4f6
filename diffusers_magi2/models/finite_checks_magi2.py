"""Non-finite router inputs, refused once per step on every rank together (:func:`check_router_inputs_finite`).

A NaN or inf that reaches a MoE router (from the latents, the text embeddings, a non-finite weight, or an activation
that overflowed) would give NaN routing weights. Refusing it inside the layer cannot work in a parallel run: under
context parallelism only the rank holding the bad tokens would raise, while the others wait in the next all-to-all
until the process group times out, and the group is then unusable; on CUDA the refusal would be a device-side assert,
which leaves the context unusable. So the layers only record it: each :class:`~diffusers_magi2.moe.layer.
Magi2MultiHeadMoE` ORs "a logit was not finite" into its device flag (no host read, nothing raised; the forward runs
to its end, collectives included, with NaNs). Once per denoising step the sampler (``Magi2Pipeline``'s loop, the
modular denoise loop) clears the flags before the step's forwards (:func:`clear_router_input_flags`, so that a
forward that never reached a check, such as a direct model call or one cut short by an exception, cannot fail the
next request) and calls :func:`check_router_inputs_finite` after them: one all-reduce of the flags over the model's
context-parallel group (else its expert-parallel group), one host read, and the same ``ValueError`` on every rank,
after which the flags are clear and the group serves the next request.

On the error path only, the message names the first layer whose router saw the values and the first non-finite
weight up to it (each rank scans the weights it holds, expert-parallel ranks their own experts; the ranks' findings
are gathered so that every rank raises the same message); with no such weight, the input or an activation is to blame.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from ..moe.layer import Magi2MultiHeadMoE
from ..parallel.distributed import first_message_of_ranks


__all__ = ["check_router_inputs_finite", "clear_router_input_flags"]

_EXPERT_BANKS = ("W_gate", "W_up", "W_down")
_SCAN_ELEMENTS = 1 << 24  # elements per chunk of the error-path weight scan (small temporaries)


def _routers(model: nn.Module) -> list[tuple[str, Magi2MultiHeadMoE]]:
    return [(name, module) for name, module in model.named_modules() if isinstance(module, Magi2MultiHeadMoE)]


def _agreement_group(model: nn.Module, routers) -> tuple[Optional[object], torch.device]:
    """The process group whose ranks must agree (CP, else EP; ``None`` alone) and the device its flags reduce on."""
    cp = getattr(model, "context_parallel_group", None)
    if cp is not None and cp.group is not None:
        return cp.group, cp.device
    for _, router in routers:
        if router.ep_group is not None:
            return router.ep_group, router.gate.device
    return None, routers[0][1].gate.device


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


def _feeds(module_name: str, layer: str) -> bool:
    """Whether module ``module_name`` runs before the router of ``layer`` can (the pre adapter, the blocks up to
    ``layer``'s; every module of a model without ``transformer_blocks``)."""
    block = layer.split(".")[:2]
    if block[0] != "transformer_blocks" or len(block) < 2:
        return True
    parts = module_name.split(".")
    if parts[0] == "transformer_blocks":
        return len(parts) < 2 or int(parts[1]) <= int(block[1])
    return parts[0] in ("", "pre_adapter")


def _non_finite_weight(model: nn.Module, layer: str) -> Optional[str]:
    """The first non-finite parameter or buffer (module order) of the modules that feed ``layer``'s router,
    described; ``None`` if every one is finite."""
    for module_name, module in model.named_modules():
        if not _feeds(module_name, layer):
            continue
        tensors = list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False))
        for name, tensor in tensors:
            found = _first_non_finite(tensor)
            if found is not None:
                full = f"{module_name}.{name}" if module_name else name
                return f"{full} holds {found[1]} at {_where(module, name, tensor, found[0])}"
    return None


def clear_router_input_flags(model: nn.Module) -> None:
    """Forget what the MoE routers of ``model`` recorded (on this rank; no collective). Call it on every rank before
    the forwards that :func:`check_router_inputs_finite` then checks, as the pipelines do before each denoising
    step's forwards.

    Args:
        model: a ``Magi2Transformer3DModel`` (any module holding ``Magi2MultiHeadMoE`` layers; none: nothing to do).
    """
    for _, router in _routers(model):
        router.non_finite_router_logits.clear()


def check_router_inputs_finite(model: nn.Module, step_index: Optional[int] = None) -> None:
    """Raise on every rank together if a MoE router of ``model`` saw a NaN or inf since the last call; then clear
    the flags (module docstring). Call it once per denoising step, on every rank, after the step's forwards; a model
    without MoE layers returns at once. ``Magi2Transformer3DModel.forward`` records only, so a caller of the model
    itself calls this after it (the pipelines do, once per step).

    Args:
        model: a ``Magi2Transformer3DModel`` (any module holding ``Magi2MultiHeadMoE`` layers).
        step_index: the step's index, for the message.

    Raises:
        ValueError: on every rank of the model's context- (else expert-) parallel group, with the same message:
            the step, the first layer whose router input held NaN/inf, and the first non-finite weight up to that
            layer (or that none is, so the input or an activation was to blame).
    """
    routers = _routers(model)
    if not routers:
        return
    group, device = _agreement_group(model, routers)
    no_flag = torch.zeros((), dtype=torch.bool, device=device)
    seen_by = [r.non_finite_router_logits.value for _, r in routers]
    flags = torch.stack([no_flag if v is None else v.to(device) for v in seen_by]).to(torch.int32)
    if group is not None:
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    seen = flags.nonzero().reshape(-1).tolist()  # the one host read of the step
    if not seen:
        return
    clear_router_input_flags(model)
    names = [routers[i][0] for i in seen]
    weight = first_message_of_ranks(_non_finite_weight(model, names[0]), group)
    step = "" if step_index is None else f" at step index {step_index}"
    layers = names[0] + (f" (then {len(names) - 1} more MoE layer(s))" if len(names) > 1 else "")
    cause = (
        f"the weight {weight}: repair or reload the checkpoint (or the adapter fused into it)"
        if weight is not None
        else "no weight up to that layer is NaN/inf, so the input (latents, text or image embeddings, timestep) "
        "held NaN/inf or an activation overflowed; check the inputs, or run in a wider dtype"
    )
    raise ValueError(f"MoE router inputs are not finite{step}: first in {layers}; {cause}")
