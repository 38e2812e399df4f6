"""Budgets of weight streaming, checked before any weight moves.

A streamed stage's device peak, planned at the released size by ``tests/benchmarks/bench_memory.py --gpu_gb 24|32``
(the model code traced on fake tensors), is::

    peak = resident weights (non-block) + ring (ring_size x the largest block's weights) + activations of the stage
    need = peak + what stays resident beside it (co_resident_GB: the pipeline's other components, per policy)

with ``enable_weight_streaming``'s default ring of 2 slots. What stays resident is the plan's arithmetic on the
recipe's rows: the autoencoders sit in host memory but for their own stage, and beside any stage stay the other
streamed models' resident weights and rings, unless each streamed model is freed when the next one's stage begins
(then a streamed stage is alone, and an autoencoder's stage shares the device with the streamed model run last);
and a recipe's host memory is its largest stage's (the text encoder is released before the transformer's weights
come in): anonymous RSS plus pinned bytes, each pinned buffer rounded up to a power of two as torch's pinned host
allocator does (``host_memory="pinned"``), or a bounded staging ring read from the safetensors files
(``host_memory="disk"``; the page cache is file-backed and not counted). The planned figures ship in
``weight_streaming_budgets.json`` (written by ``bench_memory --write_budgets``; a test keeps it equal to the plan),
so a budget is checked from the table, not from a trace at run time. Units: GB = 10^9 bytes.
"""

from __future__ import annotations

import functools
import json
import math
import os
from typing import Dict, Iterable, List, Optional

from .presets_magi2 import REFINER_RESOLUTION, RESOLUTION_PRESETS


__all__ = [
    "HOST_MEMORY_MODES",
    "PLANNED_CONFIG_KEYS",
    "PLANNED_REFINER_CONFIG_KEYS",
    "available_host_bytes",
    "check_streaming_budget",
    "check_streaming_vram",
    "plan_applies",
    "planned_call_stages",
    "planned_tiled_decodes",
    "streaming_budgets",
]


HOST_MEMORY_MODES = ("pinned", "disk")
#: the clip length the plan traces (the released model's ``duration_s``)
PLANNED_DURATION_S = 10.0
BUDGETS_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "weight_streaming_budgets.json")
_GB = 10**9
#: the transformer config fields the table records under ``planned_for`` (the geometry the peaks were planned for)
PLANNED_CONFIG_KEYS = (
    "num_layers",
    "num_attention_heads",
    "attention_head_dim",
    "num_key_value_heads",
    "in_channels",
    "audio_in_channels",
    "text_in_channels",
    "intermediate_factor",
    "multimodal_layers",
    "moe_layers",
    "num_streams",
    "moe_num_heads",
    "moe_num_experts",
    "moe_top_k",
    "moe_expert_intermediate_size",
    "shared_expert_intermediate_size",
    "modality_specific_expert_intermediate_size",
)
#: the refiner config fields the table records under ``planned_for`` (its 1080p stage's geometry)
PLANNED_REFINER_CONFIG_KEYS = (
    "num_layers",
    "num_attention_heads",
    "attention_head_dim",
    "num_key_value_heads",
    "in_channels",
    "text_in_channels",
    "multimodal_layers",
    "window_attention_layers",
    "window_block_size",
    "window_radius",
    "mlp_intermediate_size",
)


@functools.lru_cache(maxsize=None)
def _load(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def streaming_budgets() -> dict:
    """The shipped table: ``{"recipes": {"24": {...}, "32": {...}}, ...}``, each recipe with its ``card_gb``,
    ``stages`` (``{name: {"peak_GB", "used", ...}}``), ``required_stages`` and ``host_ram_GB`` per host-memory mode.
    """
    return _load(BUDGETS_FILE)


def available_host_bytes() -> int:
    """Host memory the OS can give without swapping: ``MemAvailable`` of ``/proc/meminfo`` (Linux), else the free
    physical pages (``os.sysconf``).

    Raises:
        OSError: neither can be read on this system.
    """
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError) as error:
        raise OSError("cannot read the available host memory (no /proc/meminfo MemAvailable, no sysconf)") from error


def plan_applies(transformer_config, refiner_config=None) -> bool:
    """Whether the table's peaks apply to a preview transformer of ``transformer_config`` (a mapping) and, where
    given, a refiner of ``refiner_config``: their :data:`PLANNED_CONFIG_KEYS` / :data:`PLANNED_REFINER_CONFIG_KEYS`
    equal those the plan was made for (the released Preview; lists and tuples alike)."""
    planned = streaming_budgets()["planned_for"]
    checks = [(transformer_config, planned["transformer"], PLANNED_CONFIG_KEYS)]
    if refiner_config is not None:
        checks.append((refiner_config, planned["refiner"], PLANNED_REFINER_CONFIG_KEYS))
    return all(json.loads(json.dumps(c.get(k))) == p[k] for c, p, keys in checks for k in keys)


def _recipe(table: dict, vram_gb: float) -> dict:
    """The largest planned recipe whose card is no larger than ``vram_gb`` (the smallest one below all)."""
    recipes = sorted(table["recipes"].values(), key=lambda r: r["card_gb"])
    fitting = [r for r in recipes if r["card_gb"] <= vram_gb]
    return fitting[-1] if fitting else recipes[0]


def planned_call_stages(
    refine: bool,
    denoise_height: int,
    denoise_width: int,
    image: bool = False,
    turbovae: bool = True,
    decode: bool = True,
    *,
    height: Optional[int] = None,
    width: Optional[int] = None,
    batch_size: int = 1,
    duration_s: float = PLANNED_DURATION_S,
) -> List[str]:
    """The plan's stages (``bench_memory``'s names) that one call runs.

    Args:
        refine: whether the call runs the 1080p refiner after the preview.
        denoise_height, denoise_width: the preview's pixels (272p up to 256x448, else 540p).
        image: an I2V call (the reference image's encode).
        turbovae: the video decode is the TurboVAE's (else the Wan2.2 VAE's).
        decode: whether the call decodes (the video, at 1080p after the refiner else 540p, and the audio).
        height, width: the refined output's pixels (``None``: the 1080p preset).
        batch_size: videos the call generates.
        duration_s: the clip's length in seconds (the pipeline's ``config.duration_s``).

    Raises:
        ValueError: a preview larger than 512x896, a refined output larger than 1088x1920, a ``batch_size`` above 1
            or a clip longer than 10 s: the plan's stages are one 10 s video at those sizes.
    """
    area, largest = denoise_height * denoise_width, RESOLUTION_PRESETS["540p"]
    if area > math.prod(largest):
        raise ValueError(
            f"a {denoise_height}x{denoise_width} preview is larger than the plan's 540p stage "
            f"({'x'.join(map(str, largest))}): the streamed "
            "recipes denoise at 272p or 540p, and reach 1080p through the refiner (resolution='1080p')"
        )
    if refine and height is not None and height * width > math.prod(REFINER_RESOLUTION):
        raise ValueError(
            f"a {height}x{width} refined output is larger than the plan's 1080p refiner stage "
            f"({'x'.join(map(str, REFINER_RESOLUTION))}); generate at most that (output_height/output_width resize the frames)"
        )
    if duration_s > PLANNED_DURATION_S:
        raise ValueError(
            f"a {duration_s} s clip is longer than the plan's {PLANNED_DURATION_S} s (its tokens and activations "
            "grow with the clip); set config.duration_s to at most that"
        )
    if batch_size != 1:
        raise ValueError(
            f"the plan's stages are one video per call; this call generates {batch_size}: call once per video"
        )
    stages = ["text_encode", *(["image_encode_540p"] if image else [])]
    stages += [
        "preview_272p" if area <= math.prod(RESOLUTION_PRESETS["272p"]) else "preview_540p",
        *(["refiner_1080p"] if refine else []),
    ]
    if decode:
        stages += [f"{'turbovae' if turbovae else 'wan'}_decode_{'1080p' if refine else '540p'}", "audio_decode"]
    return stages


def planned_tiled_decodes(vram_gb: float, release_between_stages: bool = True) -> Dict[str, float]:
    """The ``video_decoder`` stages a card must decode in spatial tiles (``enable_tiling()``).

    Args:
        vram_gb: the card's memory in GB; its recipe is the largest planned card no larger.
        release_between_stages: which figures of what stays resident apply (see :func:`check_streaming_vram`).

    Returns:
        ``{stage: peak_GB}`` (the tiled peak) of the recipe's used decodes traced tiled (``"tiled"``) whose whole
        frames' peak (``"whole_frames_peak_GB"``) plus what stays resident beside them exceeds ``vram_gb``; empty if
        none.
    """
    policy = "released" if release_between_stages else "held"
    stages = _recipe(streaming_budgets(), vram_gb)["stages"]
    return {
        n: s["peak_GB"]
        for n, s in stages.items()
        if s["used"]
        and s.get("component") == "video_decoder"
        and s.get("tiled")
        and vram_gb < s["whole_frames_peak_GB"] + sum(s["co_resident_GB"][policy].values())
    }


def check_streaming_budget(
    vram_gb: float,
    host_memory: str = "pinned",
    stages: Optional[Iterable[str]] = None,
    *,
    host_bytes: Optional[int] = None,
    release_between_stages: bool = True,
) -> Dict[str, float]:
    """Refuse a weight-streaming budget the plan says cannot work, before any weight moves.

    Args:
        vram_gb: the device memory the run may use, in GB (10^9 bytes; a positive number).
        host_memory: ``"pinned"`` (every block's weights in pinned host buffers) or ``"disk"`` (read from the
            safetensors files into a bounded staging ring).
        stages: plan stage names to check (e.g. ``("text_encode", "preview_540p", "turbovae_decode_540p")``);
            ``None``: the recipe's ``required_stages``, those every generation runs (text encoding, the 272p preview
            step, the audio decode).
        host_bytes: the host memory available, in bytes; ``None``: read from the OS (:func:`available_host_bytes`).
        release_between_stages: see :func:`check_streaming_vram`.

    Returns:
        ``{stage: GB}`` of the checked stages (the planned peak plus what stays resident beside it), and
        ``"host_ram_GB"``: the mode's planned host peak.

    Raises:
        ValueError: ``vram_gb`` not a positive number, an unknown ``host_memory`` or stage name, a stage the recipe
            does not run, a ``vram_gb`` below a checked stage's planned peak plus what stays resident beside it
            (naming the stage, its planned peak and what stays resident), or less host memory than the mode's
            planned peak (naming the disk mode).
    """
    if host_memory not in HOST_MEMORY_MODES:
        raise ValueError(f"host_memory must be one of {HOST_MEMORY_MODES}; got {host_memory!r}")
    result = check_streaming_vram(vram_gb, stages, release_between_stages)
    recipe = _recipe(streaming_budgets(), vram_gb)
    need = recipe["host_ram_GB"][host_memory]
    have = available_host_bytes() if host_bytes is None else int(host_bytes)
    if have < need * _GB:
        hint = (
            f"host_memory='disk' reads the weights from the safetensors files instead and needs "
            f"{recipe['host_ram_GB']['disk']} GB"
            if host_memory == "pinned"
            else "the disk mode is the smallest host-memory mode; free host memory or use a larger host"
        )
        raise ValueError(
            f"the host has {have / _GB:.2f} GB of memory available; host_memory={host_memory!r} needs {need} GB "
            f"(the {recipe['card_gb']} GB recipe's planned host peak); {hint}"
        )
    result["host_ram_GB"] = need
    return result


def check_streaming_vram(
    vram_gb: float, stages: Optional[Iterable[str]] = None, release_between_stages: bool = True
) -> Dict[str, float]:
    """The device half of :func:`check_streaming_budget`: ``{stage: GB}``, each checked stage's planned peak plus
    what stays resident on the device beside it (the table's ``co_resident_GB`` of the release policy: the
    pipeline's other components, e.g. the VAEs, and the streamed models it holds).

    Args:
        vram_gb, stages: as :func:`check_streaming_budget`.
        release_between_stages: whether each streamed model is freed when the next one's stage begins (the table's
            ``"released"`` figures), or every component stays on the device (``"held"``).

    Raises:
        ValueError: ``vram_gb`` not a positive number, an unknown stage name, a stage the recipe does not run, or a
            ``vram_gb`` below a checked stage's planned peak plus what stays resident (naming the stage with the
            largest sum, its planned peak and each component that stays resident).
    """
    if (
        isinstance(vram_gb, bool)
        or not isinstance(vram_gb, (int, float))
        or not math.isfinite(vram_gb)
        or vram_gb <= 0
    ):
        raise ValueError(f"vram_gb must be a positive number of GB; got {vram_gb!r}")
    recipe = _recipe(streaming_budgets(), vram_gb)
    planned = recipe["stages"]
    names = list(recipe["required_stages"] if stages is None else stages)
    if isinstance(stages, str) or not names:
        raise ValueError(f"stages must be a non-empty list of stage names; got {stages!r}")
    known = {n for r in streaming_budgets()["recipes"].values() for n in r["stages"]}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown stages {unknown}; the plan has {sorted(known)}")
    skipped = [n for n in names if n not in planned or not planned[n]["used"]]
    if skipped:  # a stage of another recipe only, or planned here and not used
        why = next((planned[n]["why_unused"] for n in skipped if n in planned), "")
        raise ValueError(f"the {recipe['card_gb']} GB recipe does not run {skipped}" + (f" ({why})" if why else ""))
    policy = "released" if release_between_stages else "held"
    beside = {n: planned[n]["co_resident_GB"][policy] for n in names}
    need = {n: round(planned[n]["peak_GB"] + sum(beside[n].values()), 2) for n in names}
    largest = max(names, key=need.get)
    if vram_gb < need[largest]:
        what = ", ".join(f"{c} {gb} GB" for c, gb in beside[largest].items()) or "nothing"
        how = (
            "each streamed model freed when the next one's stage begins"
            if release_between_stages
            else "every streamed model held"
        )
        raise ValueError(
            f"vram_gb={vram_gb} is below the planned peak of stage {largest!r}: {planned[largest]['peak_GB']} GB, plus "
            f"{round(need[largest] - planned[largest]['peak_GB'], 2)} GB that stays resident on the device meanwhile "
            f"({what}; {how}) = {need[largest]} GB (the {recipe['card_gb']} GB recipe); raise vram_gb to at least "
            f"{need[largest]}"
        )
    return need
