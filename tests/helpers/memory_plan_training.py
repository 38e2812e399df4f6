"""Device memory of one LoRA training step of ``examples/train_lora.py`` at the released size, traced as the
memory plan's inference stages are (:mod:`helpers.memory_plan`): the script's own ``add_lora`` and
``training_loss`` on one block of each kind, then the loss's ``backward``; the layers not traced add their
checkpointed block inputs unless those wait in host memory."""

from __future__ import annotations

import argparse
import functools
import math
from typing import Optional, Sequence

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from diffusers_magi2.models.transformer_magi2 import DEFAULT_FORWARD_CHUNK_SIZE

from .memory_plan import (
    AUDIO_LATENTS,
    DEFAULT_TEXT_TOKENS,
    EXPERT_NAMES,
    H100_BYTES,
    LATENT_FRAMES,
    SPARE_BYTES,
    Magi2StageMemory,
    build_traced_preview,
    check_plan_resolution,
    preview_kinds,
    preview_weights,
    stage_row,
    stored_weights,
)
from .memory_trace import Trace, check_kernels, set_kernels, tensor_bytes, traced


__all__ = ["LORA_TARGETS", "plan_lora_training_step", "trace_lora_training_step"]


#: ``examples/train_lora.py``'s default ``--targets``: LoRA on the attention's ``linear_qkv`` and ``linear_proj``.
LORA_TARGETS = ("linear_qkv", "linear_proj")


def _lora_bytes(module: torch.nn.Module) -> int:
    return tensor_bytes([p for n, p in module.named_parameters() if ".lora_" in n])


@functools.lru_cache(maxsize=None)
def _train_script():
    from .train_workers import load_train_script

    return load_train_script()


def trace_lora_training_step(
    video_shape: Sequence[int],
    expert_dtype: Optional[str] = None,
    *,
    transformer_config: Optional[dict] = None,
    text_tokens: int = DEFAULT_TEXT_TOKENS,
    audio_tokens: int = AUDIO_LATENTS,
    rank: int = 16,
    targets: Sequence[str] = LORA_TARGETS,
    storage_dtype: Optional[torch.dtype] = None,
    gradient_checkpointing: bool = True,
    offload_block_inputs: bool = False,
    kernels: str = "cuda",
    forward_chunk_size: Optional[int] = DEFAULT_FORWARD_CHUNK_SIZE,
    compute_dtype: torch.dtype = torch.bfloat16,
) -> Trace:
    """Weights and peak activations of one LoRA training step of ``examples/train_lora.py``: its ``add_lora``
    (the transformer frozen in ``compute_dtype``, routed experts in ``expert_dtype``; an fp32 LoRA of ``rank`` on
    ``targets``), its ``training_loss`` on one cached sample (fp32 video latent ``(T, H, W)``, ``audio_tokens``,
    ``text_tokens``; at sigma 0.5) and the loss's ``backward``. The weights include the LoRA's AdamW moments (two
    fp32 copies); the activations the LoRA gradients. Only one block of each kind is traced: with gradient
    checkpointing every other layer adds its saved block input ``[N, n*C]``, counted as live at the peak. An upper
    bound: the backward of layer ``L`` sees the ``L`` saved inputs of the layers before it, and with the traced
    blocks in the order of their kinds' last layers, the ``j``-th traced block's kind has its last layer at
    ``L <= j + (layers - kinds)`` (each kind after it has a later last layer of its own).

    Args:
        video_shape: latent ``(T, H, W)``; expert_dtype: as :func:`trace_preview_forward`.
        transformer_config: ``Magi2Transformer3DModel`` arguments (default: released).
        rank, targets: the script's ``--rank`` and ``--targets``.
        storage_dtype: FP8 storage of the frozen dense weights (``stored_weights``), or ``None``: the
            weights in that dtype, and the compute-dtype copies of the largest block's layers added to the peak.
        gradient_checkpointing: the script's ``--gradient_checkpointing``.
        offload_block_inputs: the script's ``--offload_block_inputs`` (``enable_gradient_checkpointing(
            offload_block_inputs=True)``): the saved inputs of the layers not traced are in host memory (not
            counted); the traced layers' are counted (an upper bound by one layer's input: the trace runs on one
            device, where the host copies cannot be told apart).
        kernels, forward_chunk_size, compute_dtype: as :func:`trace_preview_forward`.

    Raises:
        ValueError: unknown ``kernels``.
    """
    check_kernels(kernels)
    script = _train_script()
    args = argparse.Namespace(
        targets=list(targets),
        rank=rank,
        alpha=None,
        gradient_checkpointing=gradient_checkpointing,
        offload_block_inputs=offload_block_inputs,
    )
    kinds, per_layer = preview_kinds(transformer_config)
    stored = []

    def add_lora(model):
        script.add_lora(model, args)
        if storage_dtype is not None:
            stored.append(stored_weights(model, kinds, per_layer, storage_dtype, compute_dtype))

    fake = FakeTensorMode(allow_non_fake_inputs=True)
    model, kinds, per_layer = build_traced_preview(
        transformer_config, expert_dtype, compute_dtype, fake_mode=fake, prepare=add_lora
    )
    set_kernels(model, kernels)
    if forward_chunk_size is None:
        model.disable_forward_chunking()
    else:
        model.enable_forward_chunking(forward_chunk_size)
    lora = {kind: _lora_bytes(block) for kind, block in zip(kinds, model.transformer_blocks)}
    weights = stored[0].weights if stored else preview_weights(model, kinds, per_layer, 1)
    weights += 2 * sum(lora[k] for k in per_layer)  # the AdamW moments

    config = model.config
    with fake:
        sample = {
            "latents": torch.empty(config.in_channels, *video_shape),
            "audio_latents": torch.empty(audio_tokens, config.audio_in_channels),
            "text_states": torch.empty(text_tokens, config.text_in_channels),
        }
        noise = {
            "eps": torch.empty(1, config.in_channels, *video_shape),
            "eps_a": torch.empty(1, audio_tokens, config.audio_in_channels),
        }
    with traced(model, fake, kernels, grad=True) as tracker:
        tracker.count(list(sample.values()) + list(noise.values()))
        loss = script.training_loss(model, sample, None, torch.device("cpu"), {"sigma": 0.5, **noise})
        loss.backward()
        del loss
    saved = 0
    if gradient_checkpointing and not offload_block_inputs:  # the saved inputs of the layers not traced
        tokens = math.prod(video_shape) + audio_tokens + text_tokens
        saved = (
            (len(per_layer) - len(kinds)) * tokens * config.num_streams * model.hidden_size * compute_dtype.itemsize
        )
    copies = stored[0].block_copy if stored else 0
    return Trace(weights, tracker.activations + saved + copies, tracker.peak_op)


def plan_lora_training_step(
    resolution: str = "272p",
    expert_dtype: Optional[str] = None,
    *,
    storage_dtype: Optional[torch.dtype] = None,
    offload_block_inputs: bool = False,
    capacity: int = H100_BYTES,
    margin: int = SPARE_BYTES,
) -> Magi2StageMemory:
    """Peak device memory of one ``examples/train_lora.py`` step on one 10 s clip (:func:`trace_lora_training_step`
    with its defaults: rank 16 on ``linear_qkv`` and ``linear_proj``, gradient checkpointing, 512 text tokens).

    Raises:
        ValueError: an unknown resolution.
    """
    height, width = check_plan_resolution(resolution)
    video = (LATENT_FRAMES, height // 16, width // 16)
    trace = trace_lora_training_step(
        video,
        expert_dtype,
        storage_dtype=storage_dtype,
        offload_block_inputs=offload_block_inputs,
    )
    what = EXPERT_NAMES[expert_dtype] + ("" if storage_dtype is None else ", FP8-stored dense weights")
    notes = [
        f"{math.prod(video) + AUDIO_LATENTS + DEFAULT_TEXT_TOKENS} tokens, LoRA rank 16 on linear_qkv + linear_proj "
        "(fp32, with AdamW moments), gradient checkpointing",
        "block inputs in host memory" if offload_block_inputs else "block inputs on the device",
    ]
    name = f"lora_train_{resolution}" + ("" if offload_block_inputs else "_inputs_on_device")
    return stage_row(f"LoRA training step {resolution}, {what}", name, trace, capacity, margin, notes)
