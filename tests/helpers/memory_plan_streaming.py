"""Memory and time plan of MAGI-2 on one 24 GB or 32 GB card with its weights streamed from host memory
(``bench_memory --gpu_gb 24|32``), built on the traced stages of :mod:`helpers.memory_plan`.

A streamed model keeps its non-block weights on the device and its transformer blocks in host memory; each block's
weights (int4 codes and scales, FP8-stored dense weights, fp32 islands) are copied into a ring of ``RING_DEPTH``
preallocated device buffers, each the size of the largest block. A stage's device peak is::

    peak = resident (non-block) weights + RING_DEPTH x largest block + activations (traced, as the 80 GB plan)

Host memory is anonymous RSS plus pinned bytes, each pinned allocation rounded up to a power of two (torch's pinned
host allocator), plus ``PROCESS_BYTES`` for Python, torch and the CUDA context (assumed; not measured on a GPU).
``host_memory="pinned"`` packs the blocks' flat buffers into a few pinned arenas of consecutive blocks, sized so the
rounding costs least (``diffusers_magi2.models.weight_streaming``'s rule; one allocation per block would round a
1.67 GB MoE block up to 2.15 GB);
``"disk"`` holds a pinned staging ring of the same depth
and reads the blocks from the safetensors files every step (the page cache is file-backed: reported apart, not
counted). Stages run one after the other (the text encoder is released before the transformer's weights come in),
so a run's host memory is its largest stage's.

Stages run one after the other, and a streamed model's weights are freed when the next streamed model's stage
begins and re-read from its safetensors files when its own begins again
(``enable_weight_streaming(release_between_stages=...)``), so every generation reads each streamed model once:
``reread_s = (resident + blocks) / nvme`` per model at each of ``NVME_GBPS`` (the files assumed to hold the storage
dtypes the streamer holds: int4 experts, FP8 dense weights as the converter writes them).

Time per step: copy ``h2d / pcie`` at each of ``PCIE_GBPS``, against compute ``flops / card peak``, where
``flops = 2 x active parameters x tokens`` (a multimodal layer's modality-specific weights counted once per token,
the routed experts ``top_k / num_experts`` of theirs) plus dense attention ``4 x S^2 x Hq x D`` per CFG half and
layer. The copy hides when it is no longer than the compute. The disk mode also reads the step's blocks from the
files, ``read = disk_read / nvme``, on a reader thread ahead of the blocks, so the three overlap (the stages of a
pipeline) and the step takes the slowest::

    disk step = max(read at nvme, copy at 25 GB/s, compute)

An autoencoder stage copies the autoencoder host -> device once (``module.to(device)``), ``weights / pcie``; in the
disk mode its weights are views of its files, read at ``nvme`` where the page cache does not hold them (counted).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import List, Optional

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from diffusers_magi2.models.weight_streaming import pinned_bytes as arena_pinned_bytes
from diffusers_magi2.pipelines.weight_streaming_pipeline import STREAMED_RING_SIZE

from .memory_plan import (
    DEFAULT_TEXT_TOKENS,
    GB,
    PLAN_RESOLUTIONS,
    REFINER_LATENT_FRAMES,
    build_traced_preview,
    preview_block_bytes,
    preview_kinds,
    preview_token_counts,
)
from .memory_plan_codecs import TEXT_ENCODER_HIDDEN, TEXT_ENCODER_LAYERS, TEXT_ENCODER_PARAMETERS
from .memory_trace import module_bytes


__all__ = [
    "CARDS",
    "NVME_GBPS",
    "PCIE_GBPS",
    "PROCESS_BYTES",
    "RING_DEPTH",
    "StreamedStage",
    "StreamedWeights",
    "pinned_bytes",
    "preview_step_flops",
    "preview_streamed_weights",
    "refiner_step_flops",
    "refiner_streamed_weights",
    "text_encoder_streamed_weights",
    "time_model",
]


#: Device slots per streamed model: ``enable_weight_streaming``'s default ``ring_size``, which the recipes use.
RING_DEPTH = STREAMED_RING_SIZE
PCIE_GBPS = (25.0, 56.0)
#: NVMe sequential reads (GB/s) of the disk mode and the re-reads: a PCIe Gen3 x4 and a Gen4 x4 drive (assumed).
NVME_GBPS = (3.5, 7.0)
#: Python, torch and the CUDA context's host memory (assumed).
PROCESS_BYTES = 2 * GB
#: Cards: name, dense bf16 tensor peak with fp32 accumulation (FLOP/s), its source.
CARDS = {
    24: ("RTX 4090", 165.2e12, "NVIDIA Ada Lovelace architecture whitepaper (FP16/BF16 tensor, FP32 accumulate)"),
    32: (
        "RTX 5090",
        209.5e12,
        "NVIDIA RTX Blackwell architecture whitepaper (FP16/BF16 tensor, FP32 accumulate, dense: 838.4 sparse "
        "FP16-accumulate / 4)",
    ),
}
#: Qwen3.5-27B's vocabulary (assumed: its config is not in this repository); its embedding stays in host memory.
TEXT_ENCODER_VOCAB = 248_320


def pinned_bytes(nbytes: int) -> int:
    """Bytes torch's pinned host allocator takes for ``nbytes``: the next power of two."""
    return 0 if nbytes <= 0 else 1 << (int(nbytes) - 1).bit_length()


@dataclass
class StreamedWeights:
    """A streamed model's weight bytes: ``resident`` (kept on the device) and one entry per block (streamed)."""

    resident: int
    blocks: List[int]

    @property
    def ring(self) -> int:
        """Device bytes of the ring: ``RING_DEPTH`` buffers of the largest block."""
        return RING_DEPTH * max(self.blocks)

    @property
    def streamed(self) -> int:
        """Bytes copied host -> device by one pass over the blocks."""
        return sum(self.blocks)

    def host(self, mode: str, pinned: bool = True) -> int:
        """Host bytes the streamer holds for the blocks in ``mode``: ``"pinned"``, the blocks packed into its arenas;
        ``"disk"``, its staging ring; with ``pinned`` (CUDA), each allocation rounded as the pinned allocator does
        (the arenas by the streamer's own rule)."""
        if mode == "disk":
            return RING_DEPTH * (pinned_bytes(max(self.blocks)) if pinned else max(self.blocks))
        return arena_pinned_bytes(self.blocks) if pinned else sum(self.blocks)

    @property
    def host_pinned(self) -> int:
        """Pinned host bytes of the blocks packed into the streamer's arenas, rounded (its own rule)."""
        return self.host("pinned")

    @property
    def host_staging(self) -> int:
        """Pinned host bytes of the disk mode's staging ring."""
        return self.host("disk")


def preview_streamed_weights(
    expert_dtype: Optional[str] = "int4",
    storage_dtype: Optional[torch.dtype] = torch.float8_e4m3fn,
    *,
    transformer_config: Optional[dict] = None,
    ep_degree: int = 1,
    compute_dtype: torch.dtype = torch.bfloat16,
) -> StreamedWeights:
    """:class:`StreamedWeights` of the preview transformer: the adapters resident, each layer's block streamed (the
    dense weights stored in ``storage_dtype`` by layerwise casting, the routed experts split among ``ep_degree``)."""
    sizes = []

    def measure(meta_model):
        model = meta_model
        if storage_dtype is not None:
            model = copy.deepcopy(meta_model)
            model.enable_layerwise_casting(storage_dtype=storage_dtype, compute_dtype=compute_dtype)
        sizes.append(preview_block_bytes(model, kinds, ep_degree))
        sizes.append(module_bytes(model.pre_adapter) + module_bytes(model.post_adapter))

    kinds, per_layer = preview_kinds(transformer_config)
    build_traced_preview(
        transformer_config,
        expert_dtype,
        compute_dtype,
        fake_mode=FakeTensorMode(allow_non_fake_inputs=True),
        prepare=measure,
    )
    block_bytes, resident = sizes
    return StreamedWeights(resident, [block_bytes[k] for k in per_layer])


def _meta_refiner(compute_dtype: torch.dtype = torch.bfloat16, storage_dtype: Optional[torch.dtype] = None):
    from diffusers_magi2.models.transformer_magi2_refiner import Magi2RefinerTransformer3DModel

    from .memory_trace import default_dtype

    dense = None if storage_dtype is None else str(storage_dtype).removeprefix("torch.")
    with torch.device("meta"), default_dtype(compute_dtype):  # its linears take the default dtype (islands: fp32)
        return Magi2RefinerTransformer3DModel(dense_storage_dtype=dense)


def refiner_streamed_weights(storage_dtype: Optional[torch.dtype] = torch.float8_e4m3fn) -> StreamedWeights:
    """:class:`StreamedWeights` of the released refiner as ``from_pretrained`` holds it: bf16 with fp32 islands, the
    dense projections stored in ``storage_dtype`` (``--dense_storage_dtype fp8_e4m3``: FP8 weights beside fp32
    per-channel scales; ``None``: bf16); adapters resident, blocks streamed."""
    model = _meta_refiner(storage_dtype=storage_dtype)
    resident = module_bytes(model.pre_adapter) + module_bytes(model.post_adapter)
    return StreamedWeights(resident, [module_bytes(b) for b in model.transformer_blocks])


def refiner_step_flops(text_tokens: int = DEFAULT_TEXT_TOKENS) -> float:
    """FLOPs of one 1080p refiner forward (one CFG branch): linear layers by their active parameters, block-window
    attention over each query's window (its blocks within the radius, clipped at the latent's edges)."""
    model = _meta_refiner()
    cfg = model.config
    t, h, w = REFINER_LATENT_FRAMES, *(s // 16 for s in PLAN_RESOLUTIONS["1080p"])
    tokens = t * h * w + text_tokens
    linear = 0
    for block in model.transformer_blocks:
        linear += sum(p.numel() for p in block.parameters()) / block.attention.num_modality
    kv = 1.0
    for size, block, radius in zip((t, h, w), cfg.window_block_size, cfg.window_radius):
        n = math.ceil(size / block)
        kv *= block * sum(min(n - 1, i + radius) - max(0, i - radius) + 1 for i in range(n)) / n
    attention = len(model.transformer_blocks) * 4 * tokens * kv * cfg.num_attention_heads * cfg.attention_head_dim
    return 2 * tokens * linear + attention


def text_encoder_streamed_weights(
    parameters: int = TEXT_ENCODER_PARAMETERS,
    hidden: int = TEXT_ENCODER_HIDDEN,
    layers: int = TEXT_ENCODER_LAYERS,
    vocab: int = TEXT_ENCODER_VOCAB,
) -> StreamedWeights:
    """Qwen3.5-27B in bf16 streamed layer by layer (an estimate from its size; other sizes for the tests): the token
    embedding and the final norm resident on the device (``Magi2Pipeline.enable_weight_streaming`` streams the
    decoder layers only), the layers share the other parameters equally; no LM head."""
    resident = vocab * hidden + hidden
    return StreamedWeights(resident * 2, [(parameters - resident) * 2 // layers] * layers)


def preview_step_flops(
    resolution: str, transformer_config: Optional[dict] = None, text_tokens: int = DEFAULT_TEXT_TOKENS
) -> float:
    """FLOPs of one CFG preview step (module docstring): linear layers by their active parameters, dense attention
    within each CFG half."""
    counts = preview_token_counts(resolution, text_tokens)
    tokens = sum(counts.values())
    half = tokens // 2
    model, kinds, per_layer = build_traced_preview(
        transformer_config, None, fake_mode=FakeTensorMode(allow_non_fake_inputs=True)
    )
    active = {}
    for kind, block in zip(kinds, model.transformer_blocks):
        routed = 0
        moe = getattr(block.mlp, "moe_mlp", None)
        if moe is not None:
            routed = sum(getattr(moe, n).numel() for n in ("W_gate", "W_up", "W_down"))
        rest = sum(p.numel() for p in block.parameters()) - routed
        experts = routed * moe.top_k / moe.num_experts if moe is not None else 0
        active[kind] = rest / block.num_modality + experts
    adapters = sum(p.numel() for p in list(model.pre_adapter.parameters()) + list(model.post_adapter.parameters()))
    linear = 2 * tokens * (sum(active[k] for k in per_layer) + adapters / 3)
    heads_width = model.config.num_attention_heads * model.config.attention_head_dim
    attention = len(per_layer) * 2 * 4 * half**2 * heads_width
    return linear + attention


def gbps_key(gbps: float) -> str:
    """A rate in a JSON key: ``25GBps``, ``3.5GBps``."""
    return f"{gbps:g}GBps"


def time_model(h2d_bytes: int, flops: Optional[float], card_gb: int, disk_bytes: int = 0) -> dict:
    """Copy and compute estimates (seconds) and whether the copy hides behind the compute; with ``disk_bytes``, the
    disk mode's reads and its step (module docstring). ``flops=None``: copies and reads only (an autoencoder)."""
    name, peak, _ = CARDS[card_gb]
    compute = 0.0 if flops is None else flops / peak
    out = {"card": name}
    if flops is not None:
        out.update({"compute_s": round(compute, 2), "flops": float(f"{flops:.4g}")})
    for gbps in PCIE_GBPS:
        copy_s = h2d_bytes / (gbps * GB)
        out[f"copy_s_at_{gbps_key(gbps)}"] = round(copy_s, 2)
        if flops is not None:
            out[f"hides_at_{gbps_key(gbps)}"] = copy_s <= compute
    for gbps in NVME_GBPS if disk_bytes else ():
        read_s = disk_bytes / (gbps * GB)
        out[f"disk_read_s_at_{gbps_key(gbps)}"] = round(read_s, 2)
        if flops is not None:
            out[f"disk_hides_at_{gbps_key(gbps)}"] = read_s <= compute
            out[f"disk_step_s_at_{gbps_key(gbps)}"] = round(max(read_s, h2d_bytes / (PCIE_GBPS[0] * GB), compute), 2)
    return out


@dataclass
class StreamedStage:
    """One stage of a streamed recipe: device peak parts, host memory per mode, copies and time per step."""

    name: str
    what: str
    resident: int
    ring: int
    activations: int
    host_pinned: int
    host_disk: int
    used: bool = True
    why_unused: Optional[str] = None
    h2d: Optional[int] = None
    timing: Optional[dict] = None
    peak_at: Optional[str] = None
    streams: bool = True
    notes: List[str] = field(default_factory=list)
    disk_read: Optional[int] = None
    model: Optional[str] = None  # the pipeline component whose weights the stage counts (a streamed one: re-read)
    per: str = "step"  # what h2d, timing and disk_read count: a step, or the stage (an autoencoder, once)
    reread: Optional[int] = None  # its bytes in the files
    tiled: Optional[bool] = None  # a decode: traced with the decoder's enable_tiling() (its default tiles)
    whole_frames_peak: Optional[int] = None  # a tiled decode: its device peak with whole frames (tiling off)

    @property
    def peak(self) -> int:
        """Device peak bytes."""
        return self.resident + self.ring + self.activations

    def as_json(self) -> dict:
        """The plan's JSON row (GB = 10^9 bytes)."""
        row = {
            "stage": self.name,
            "used": self.used,
            "peak_GB": round(self.peak / GB, 2),
            "resident_GB": round(self.resident / GB, 2),
            "ring_GB": round(self.ring / GB, 2),
            "activations_GB": round(self.activations / GB, 2),
            "host_GB": round(self.host_pinned / GB, 2),
            "host_disk_mode_GB": round(self.host_disk / GB, 2),
            "streams": self.streams,
            "what": self.what,
        }
        if self.model is not None:
            row["component"] = self.model
        if self.tiled is not None:
            row["tiled"] = self.tiled
        if self.whole_frames_peak is not None:
            row["whole_frames_peak_GB"] = round(self.whole_frames_peak / GB, 2)
        if not self.used:
            row["why_unused"] = self.why_unused
        if self.h2d is not None:
            row[f"h2d_GB_per_{self.per}"] = round(self.h2d / GB, 2)
        if self.timing is not None:
            row[f"time_per_{self.per}"] = self.timing
        if self.disk_read is not None:
            row[f"disk_read_GB_per_{self.per}"] = round(self.disk_read / GB, 2)
        if self.reread is not None:
            row["model"] = self.model
            row["reread_GB_per_generation"] = round(self.reread / GB, 2)
            row["reread_s_per_generation"] = {gbps_key(g): round(self.reread / (g * GB), 2) for g in NVME_GBPS}
        if self.peak_at:
            row["peak_at"] = self.peak_at
        if self.notes:
            row["notes"] = list(self.notes)
        return row


def fits(stage: StreamedStage, limit_gb: float) -> bool:
    """Whether a used stage's peak is within ``limit_gb`` (an unused stage always passes)."""
    return not stage.used or stage.peak <= limit_gb * GB


def ceil_gb(nbytes: int) -> float:
    """``nbytes`` in GB rounded up to 0.01 (a budget never below the plan)."""
    return math.ceil(nbytes / GB * 100) / 100
