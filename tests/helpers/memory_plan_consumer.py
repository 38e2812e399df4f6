"""The 24 GB and 32 GB recipes of the memory plan, stage by stage (``bench_memory --gpu_gb 24|32``): the streamed
stages of :mod:`helpers.memory_plan_streaming` on the activations traced by :mod:`helpers.memory_plan`,
:mod:`helpers.memory_plan_codecs` and :mod:`helpers.memory_plan_training`.

Recipes. 24 GB (RTX 4090, 3090): a 540p clip; text encoder and preview transformer streamed (int4 experts,
FP8-stored dense weights), the TurboVAE decode and the audio decode resident, and a 272p LoRA step (block inputs in
pinned host memory; its weights read from disk on a 64 GB host), its clips cached first in the same process by a
pipeline of the encoders released before training (``lora_cache_272p``); no refiner. 32 GB (RTX 5090): the same plus
the 1080p refiner (streamed, its MLP and attention chunked) and the tiled TurboVAE decode at 1080p. The Wan2.2 VAE
decode is in the plan but not used (the recipes decode with the TurboVAE). Targets: every used stage <= ``card - 2`` GB.
"""

from __future__ import annotations

import functools
import json
from typing import Dict, List, Optional

import torch

from diffusers_magi2.pipelines.weight_streaming_pipeline import AUTOENCODER_COMPONENTS, STREAMED_REFINER_CHUNK_SIZE

from .memory_plan import (
    DEFAULT_TEXT_TOKENS,
    GB,
    LATENT_FRAMES,
    PLAN_RESOLUTIONS,
    plan_preview_step,
    plan_refiner_step,
)
from .memory_plan_codecs import (
    plan_audio_decode,
    plan_audio_encode,
    plan_clip_encode,
    plan_image_encode,
    plan_text_encode,
    plan_video_decode,
    plan_wan_decode,
)
from .memory_plan_streaming import (
    CARDS,
    NVME_GBPS,
    PROCESS_BYTES,
    StreamedStage,
    gbps_key,
    pinned_bytes,
    preview_step_flops,
    preview_streamed_weights,
    refiner_step_flops,
    refiner_streamed_weights,
    text_encoder_streamed_weights,
    time_model,
)
from .memory_plan_training import plan_lora_training_step


__all__ = ["CONSUMER_CARDS", "REFINER_CHUNK", "plan_consumer", "plan_per_rank_24gb"]


CONSUMER_CARDS = (24, 32)
FP8 = torch.float8_e4m3fn
#: The refiner's token chunk under weight streaming (``enable_forward_chunking``, set by ``enable_weight_streaming``).
REFINER_CHUNK = STREAMED_REFINER_CHUNK_SIZE
_TEXT_TOKENS = 7000  # the text encoder row's longest prompt


@functools.lru_cache(maxsize=None)
def _traced(kind: str, *args):
    """Each traced row once per process (the recipes share them)."""
    if kind == "preview":
        resolution, cp, ep = args
        return plan_preview_step(resolution, "int4", storage_dtype=FP8, cp_degree=cp, ep_degree=ep)
    if kind == "refiner":
        chunk, cp = args
        return plan_refiner_step(forward_chunk_size=chunk, cp_degree=cp, storage_dtype=FP8)
    if kind == "turbovae":
        resolution, tiled = args
        return plan_video_decode(resolution, tiled=tiled)
    if kind == "wan":
        return plan_wan_decode(args[0])
    if kind == "lora":
        return plan_lora_training_step("272p", "int4", storage_dtype=FP8, offload_block_inputs=True)
    if kind == "text":
        return plan_text_encode(_TEXT_TOKENS)
    if kind == "image":
        return plan_image_encode("540p")
    if kind == "audio":
        return plan_audio_decode()
    if kind == "clip_encode":
        return plan_clip_encode("272p")
    if kind == "audio_encode":
        return plan_audio_encode()
    raise ValueError(kind)


def _resident(
    name: str, model: str, row, card_gb: int, *, used: bool = True, why=None, notes=(), tiled=None, whole_frames=None
) -> StreamedStage:
    """A stage of the pipeline component ``model`` (an autoencoder) that sits on the device whole for the stage:
    copied host -> device once (``module.to(device)``; in the disk mode read from its files first); ``tiled``: a
    decode traced with ``enable_tiling()`` or not; ``whole_frames``: a tiled decode's row traced with tiling off."""
    host = PROCESS_BYTES + row.weights
    return StreamedStage(
        name, row.stage, row.weights, 0, row.activations, host, host, used, why, row.weights,
        time_model(row.weights, None, card_gb, disk_bytes=row.weights), row.peak_at, streams=False,
        notes=list(row.notes) + list(notes) + ["h2d and time: once per stage (the weights onto the device)"],
        disk_read=row.weights, model=model, per="stage", tiled=tiled,
        whole_frames_peak=None if whole_frames is None else whole_frames.weights + whole_frames.activations,
    )  # fmt: skip


def _streamed(name, model, what, weights, row, card_gb, flops, *, passes=1, used=True, why=None, notes=()):
    """A stage of the pipeline component ``model`` whose blocks stream through the ring ``passes`` times a step (the
    model re-read from its files once per generation)."""
    h2d = passes * weights.streamed
    timing = time_model(h2d, flops, card_gb, disk_bytes=h2d)
    return StreamedStage(
        name, what, weights.resident, weights.ring, row.activations,
        PROCESS_BYTES + weights.host_pinned, PROCESS_BYTES + weights.host_staging,
        used, why, h2d, timing, row.peak_at, notes=list(row.notes) + list(notes), disk_read=h2d,
        model=model, reread=weights.resident + weights.streamed,
    )  # fmt: skip


def _text_stage(card_gb: int) -> StreamedStage:
    weights = text_encoder_streamed_weights()
    row = _traced("text")
    flops = 2 * sum(weights.blocks) / 2 * _TEXT_TOKENS  # bf16: 2 bytes per parameter
    return _streamed(
        "text_encode", "text_encoder", "text encoding, Qwen3.5-27B bf16 streamed by layer (estimate)", weights, row,
        card_gb, flops, notes=["the token embedding resident on the device; freed before the transformer's stage",
                               "h2d and time per prompt (once per generation)"],
    )  # fmt: skip


def _preview_stage(resolution: str, card_gb: int) -> StreamedStage:
    weights = preview_streamed_weights("int4", FP8)
    row = _traced("preview", resolution, 1, 1)
    what = f"preview step {resolution} with CFG, int4 experts, FP8-stored dense weights, streamed by block"
    return _streamed(
        f"preview_{resolution}", "transformer", what, weights, row, card_gb, preview_step_flops(resolution)
    )


def _refiner_stage(card_gb: int, used: bool) -> StreamedStage:
    weights = refiner_streamed_weights(FP8)
    row = _traced("refiner", REFINER_CHUNK, 1)
    why = None if used else "the 24 GB recipe stops at 540p"
    what = f"refiner step 1080p, FP8-stored dense weights, streamed by block, token chunks of {REFINER_CHUNK}"
    notes = ["peak: one CFG branch; h2d and time: both branches (two passes over the blocks)"]
    return _streamed(
        "refiner_1080p", "refiner", what, weights, row, card_gb, 2 * refiner_step_flops(), passes=2, used=used, why=why,
        notes=notes,
    )  # fmt: skip


def _lora_stage(card_gb: int) -> StreamedStage:
    """272p LoRA step: forward and the checkpointed recompute each stream the blocks; the block inputs wait in
    pinned host memory (one pinned tensor per layer) and come back for the backward."""
    weights = preview_streamed_weights("int4", FP8)
    row = _traced("lora")
    plain = preview_streamed_weights("int4", FP8)
    lora_resident = row.weights - (plain.resident + plain.streamed)  # LoRA weights + AdamW moments stay resident
    height, width = PLAN_RESOLUTIONS["272p"]
    tokens = LATENT_FRAMES * (height // 16) * (width // 16) + 250 + DEFAULT_TEXT_TOKENS
    block_input = tokens * 4 * 3072 * 2  # [N, n*C] bf16
    layers = len(weights.blocks)
    inputs_host = layers * pinned_bytes(block_input)
    h2d = 2 * weights.streamed + layers * block_input
    flops = 3 * preview_step_flops("272p") / 2  # one half (no CFG): forward, recompute, input gradients
    timing = time_model(h2d, flops, card_gb, disk_bytes=2 * weights.streamed)
    return StreamedStage(
        "lora_train_272p", "LoRA training step 272p, int4 experts, FP8-stored dense weights, streamed forward and "
        "recompute", weights.resident + lora_resident, weights.ring, row.activations,
        PROCESS_BYTES + weights.host_pinned + inputs_host, PROCESS_BYTES + weights.host_staging + inputs_host,
        True, None, h2d, timing, row.peak_at,
        notes=list(row.notes) + ["h2d: the blocks twice (forward, recompute) + the 40 block inputs back"],
        disk_read=2 * weights.streamed,
    )  # fmt: skip


def _cache_stage(card_gb: int) -> StreamedStage:
    """``train_lora.py --cache`` before a LoRA run (a process of its own, released before training loads): the text
    encoder streamed as in ``text_encode`` (that row: its peak), the autoencoders each on the device for its own
    encode beside the text encoder's resident weights and ring (``co_resident_GB``). The row's peak is the larger
    encode (the clip's Wan2.2 VAE encode); host memory the text encoder's in each mode plus both autoencoders."""
    video, audio = _traced("clip_encode"), _traced("audio_encode")
    row = max(video, audio, key=lambda r: r.total)
    text = text_encoder_streamed_weights()
    autoencoders = video.weights + audio.weights
    notes = [
        f"{video.stage}: {video.total / GB:.2f} GB, {audio.stage}: {audio.total / GB:.2f} GB (the row: the larger)",
        "the text encoding: the text_encode row; h2d and time: once per clip (the autoencoder onto the device)",
    ]
    return StreamedStage(
        "lora_cache_272p", "caching a 272p training clip (train_lora.py --cache): " + row.stage, row.weights, 0,
        row.activations, PROCESS_BYTES + text.host_pinned + autoencoders, PROCESS_BYTES + text.host_staging + autoencoders,
        True, None, autoencoders, time_model(autoencoders, None, card_gb, disk_bytes=autoencoders), row.peak_at,
        streams=False, notes=list(row.notes) + notes, disk_read=autoencoders, model="vae", per="stage",
    )  # fmt: skip


def plan_consumer(card_gb: int) -> Dict[str, object]:
    """The recipe of a ``card_gb`` card (24 or 32): ``{"stages": [StreamedStage...], "host_ram": ...}``.

    Raises:
        ValueError: a card the plan has no recipe for.
    """
    if card_gb not in CONSUMER_CARDS:
        raise ValueError(f"the streamed plan has recipes for {CONSUMER_CARDS} GB cards; got {card_gb!r}")
    big = card_gb >= 32
    stages: List[StreamedStage] = [_text_stage(card_gb)]
    stages.append(_resident("image_encode_540p", "vae", _traced("image"), card_gb, notes=["I2V only"]))
    stages += [_preview_stage(res, card_gb) for res in ("272p", "540p")]
    stages.append(_refiner_stage(card_gb, used=big))
    for res in ("540p", "1080p") if big else ("540p",):  # a 540p clip's frames whole, the refined ones in tiles
        tiled = res == "1080p"
        whole = _traced("turbovae", res, False) if tiled else None
        turbovae = _traced("turbovae", res, tiled)
        stages.append(
            _resident(f"turbovae_decode_{res}", "video_decoder", turbovae, card_gb, tiled=tiled, whole_frames=whole)
        )
    for res in ("540p", "1080p") if big else ("540p",):
        stages.append(
            _resident(
                f"wan_decode_{res}",
                "vae",
                _traced("wan", res),
                card_gb,
                used=False,
                why="the recipe decodes with the TurboVAE",
                tiled=False,
            )
        )
    stages.append(_resident("audio_decode", "audio_vae", _traced("audio"), card_gb))
    stages.append(_cache_stage(card_gb))
    stages.append(_lora_stage(card_gb))
    return {"stages": stages}


def host_ram_gb(rows, mode: str) -> float:
    """The generation's peak host memory in ``mode`` (``"pinned"`` or ``"disk"``), GB: its largest used stage's, from
    the JSON rows (a LoRA training run is a process of its own: its row shows its own host memory)."""
    key = "host_GB" if mode == "pinned" else "host_disk_mode_GB"
    return max(r[key] for r in rows if r["used"] and not r["stage"].startswith(LORA_RUN))


def plan_per_rank_24gb() -> List[dict]:
    """Per-rank rows of 8 x 24 GB cards, CP8 x EP4 x 2 (int4 experts, FP8-stored dense weights): each stage resident
    when it fits ``22`` GB whole, else streamed."""
    rows = []
    for res in ("272p", "540p"):
        row = _traced("preview", res, 8, 4)
        weights = preview_streamed_weights("int4", FP8, ep_degree=4)
        whole = weights.resident + weights.streamed + row.activations
        streams = whole > 22 * GB
        peak = weights.resident + weights.ring + row.activations if streams else whole
        rows.append({
            "stage": f"preview_{res}", "layout": "CP8 x EP4 x 2, per rank", "streams": streams,
            "peak_GB": round(peak / GB, 2), "resident_whole_GB": round(whole / GB, 2),
            "weights_GB": round((weights.resident + weights.streamed) / GB, 2),
            "activations_GB": round(row.activations / GB, 2),
            "host_GB_per_rank": round((PROCESS_BYTES + (weights.host_pinned if streams else 0)) / GB, 2),
            "h2d_GB_per_step": round(weights.streamed / GB, 2) if streams else 0.0,
        })  # fmt: skip
    refiner = _traced("refiner", REFINER_CHUNK, 8)
    weights = refiner_streamed_weights(FP8)
    whole = weights.resident + weights.streamed + refiner.activations
    streams = whole > 22 * GB
    rows.append({
        "stage": "refiner_1080p", "layout": "CP8, per rank", "streams": streams,
        "peak_GB": round((weights.resident + weights.ring + refiner.activations if streams else whole) / GB, 2),
        "resident_whole_GB": round(whole / GB, 2), "activations_GB": round(refiner.activations / GB, 2),
    })  # fmt: skip
    text = _text_stage(24)
    rows.append(
        {
            "stage": "text_encode",
            "layout": "rank 0",
            "streams": True,
            "peak_GB": round(text.peak / GB, 2),
            "resident_whole_GB": round(
                (text.resident + sum(text_encoder_streamed_weights().blocks) + text.activations) / GB, 2
            ),
        }
    )
    decode = _traced("turbovae", "1080p", True)
    rows.append(
        {
            "stage": "turbovae_decode_1080p",
            "layout": "rank 0, tiled",
            "streams": False,
            "peak_GB": round(decode.total / GB, 2),
        }
    )
    return rows


def summary(card_gb: int, rows) -> dict:
    """The card's name, peak and its source, and the generation's host memory per mode (from the JSON rows)."""
    name, peak, source = CARDS[card_gb]
    generation = [r for r in rows if r["used"] and not r["stage"].startswith(LORA_RUN)]
    return {
        "card": name,
        "bf16_peak_TFLOPs": peak / 1e12,
        "bf16_peak_source": source,
        "host_ram_GB": host_ram_gb(rows, "pinned"),
        "host_ram_disk_mode_GB": host_ram_gb(rows, "disk"),
        "largest_host_stage": max(generation, key=lambda r: r["host_GB"])["stage"],
        "reread_per_generation": reread_per_generation(generation),
        "target_GB": card_gb - 2,
        "all_used_stages_fit": all(r["peak_GB"] <= card_gb - 2 for r in rows if r["used"]),
        "over_target_with_resident": {
            p: [r["stage"] for r in rows if r["used"] and with_resident_gb(r, p) > card_gb - 2] for p in POLICIES
        },
    }


def reread_per_generation(rows) -> dict:
    """What a generation re-reads from the files (each streamed model once, its stages freed in turn): GB and
    seconds at each of ``NVME_GBPS``, per model and in all."""
    models = {r["model"]: r["reread_GB_per_generation"] for r in rows if "reread_GB_per_generation" in r}
    total = round(sum(models.values()), 2)
    return {"models_GB": models, "GB": total, **{f"s_at_{gbps_key(g)}": round(total / g, 2) for g in NVME_GBPS}}


#: Host memory, as the plan counts it.
HOST_MEMORY = (
    "anonymous RSS + pinned bytes (each pinned buffer rounded up to a power of two, torch's pinned host allocator) "
    "+ 2 GB assumed for Python, torch and the CUDA context; the generation's largest stage's, not the sum: each "
    "streamed model (text encoder, transformer, refiner) is freed when the next one's stage begins and re-read from "
    "its files when its own begins (reread_per_generation; a LoRA training run is a process of its own). File-backed "
    "pages (the disk mode's page cache of the safetensors files, "
    "disk_read_GB_per_step) are not counted, nor are the autoencoders' weights outside their own stages: views of "
    "their files for a repo stored in the dtypes the recipe loads, which their stage moves to the device and then "
    "points back at (an autoencoder's own row counts its weights)"
)
#: Stage-name prefixes of a LoRA run's rows (``train_lora.py``: caching, then training), a process of its own.
LORA_RUN, LORA_CACHE = "lora_", "lora_cache"
#: Stages every generation runs, checked by default before weights move.
REQUIRED_STAGES = ("text_encode", "preview_272p", "audio_decode")


#: The release policies of ``enable_weight_streaming`` the plan counts what stays resident for.
POLICIES = ("released", "held")


def co_resident(rows: List[dict]) -> Dict[str, dict]:
    """What ``enable_weight_streaming`` keeps on the device while each stage runs, besides the stage's own component,
    from a recipe's JSON rows: ``{stage: {policy: {component: GB}}}``.

    The recipe's components are those of its used generation stages; each one's device share is its largest used
    row's resident weights plus ring. The autoencoders (``AUTOENCODER_COMPONENTS``) sit in host memory except during
    their own stage, so they are beside no other stage. ``released`` (``release_between_stages``): each streamed
    model is freed when the next one's stage begins, so a streamed stage has the device to itself, and an autoencoder
    stage shares it with the streamed model that ran last (counted as the largest). ``held`` (a pipeline built in
    memory): every other streamed model stays. A LoRA training step is a process of its own: nothing; caching for
    it (another process) keeps the text encoder's share beside the autoencoders' encodes.
    """
    share, streamed = {}, set()
    for r in rows:
        if r["used"] and r.get("component") and not r["stage"].startswith(LORA_RUN):
            c = r["component"]
            share[c] = max(share.get(c, 0.0), round(r["resident_GB"] + r["ring_GB"], 2))
            if r["streams"]:
                streamed.add(c)
    out = {}
    for r in rows:
        own = r.get("component")
        if r["stage"].startswith(LORA_CACHE):  # the caching process streams the text encoder alone
            out[r["stage"]] = {p: {"text_encoder": share["text_encoder"]} for p in POLICIES}
            continue
        if own is None or r["stage"].startswith(LORA_RUN):
            out[r["stage"]] = {p: {} for p in POLICIES}
            continue
        held = {c: gb for c, gb in share.items() if c != own and c not in AUTOENCODER_COMPONENTS}
        released = {c: gb for c, gb in held.items() if c not in streamed}
        last = max((c for c in held if c in streamed), key=held.get, default=None)
        if last is not None and not r["streams"]:
            released[last] = held[last]
        out[r["stage"]] = {"released": released, "held": held}
    return out


def with_resident_gb(row: dict, policy: str) -> float:
    """A row's planned peak plus what stays resident beside it under ``policy``, GB."""
    return round(row["peak_GB"] + sum(row["co_resident_GB"][policy].values()), 2)


def consumer_result(card_gb: int) -> dict:
    """``bench_memory --gpu_gb 24|32 --json``'s object."""
    rows = [s.as_json() for s in plan_consumer(card_gb)["stages"]]
    for row, (name, co) in zip(rows, co_resident(rows).items()):
        row["co_resident_GB"] = co
        row["with_resident_GB"] = {p: with_resident_gb(row, p) for p in POLICIES}
    result = {"stages": rows, **summary(card_gb, rows), "host_memory": HOST_MEMORY}
    if card_gb == 24:
        result["per_rank_8x24GB"] = plan_per_rank_24gb()
    return result


_BUDGET_KEYS = (
    "used", "peak_GB", "resident_GB", "ring_GB", "activations_GB", "host_GB", "host_disk_mode_GB", "streams",
    "component", "tiled", "whole_frames_peak_GB", "co_resident_GB",
)  # fmt: skip


def budget_table(results: Optional[Dict[int, dict]] = None) -> dict:
    """The package's ``weight_streaming_budgets.json``, from the recipes' results (default: planned now)."""
    results = results or {card: consumer_result(card) for card in CONSUMER_CARDS}
    recipes = {}
    for card, result in results.items():
        stages = {}
        for row in result["stages"]:
            stages[row["stage"]] = {k: row[k] for k in _BUDGET_KEYS if k in row}
            if not row["used"]:
                stages[row["stage"]]["why_unused"] = row["why_unused"]
        recipes[str(card)] = {
            "card_gb": card,
            "card": result["card"],
            "stages": stages,
            "required_stages": list(REQUIRED_STAGES),
            "host_ram_GB": {"pinned": result["host_ram_GB"], "disk": result["host_ram_disk_mode_GB"]},
        }
    return {
        "generated_by": "python -m tests.benchmarks.bench_memory --write_budgets",
        "units": "GB = 10^9 bytes",
        "host_memory": HOST_MEMORY,
        "planned_for": {"transformer": planned_transformer_config(), "refiner": planned_refiner_config()},
        "recipes": recipes,
    }


def planned_transformer_config() -> dict:
    """The released preview geometry the plan traces (``Magi2Transformer3DModel``'s defaults), as the table records
    it (``PLANNED_CONFIG_KEYS``)."""
    import inspect

    from diffusers_magi2 import Magi2Transformer3DModel
    from diffusers_magi2.pipelines.weight_streaming_budget import PLANNED_CONFIG_KEYS

    defaults = inspect.signature(Magi2Transformer3DModel.__init__).parameters
    return {k: json.loads(json.dumps(defaults[k].default)) for k in PLANNED_CONFIG_KEYS}


def planned_refiner_config() -> dict:
    """The released refiner geometry the plan traces (``Magi2RefinerTransformer3DModel``'s defaults), as the table
    records it (``PLANNED_REFINER_CONFIG_KEYS``)."""
    import inspect

    from diffusers_magi2.models.transformer_magi2_refiner import Magi2RefinerTransformer3DModel
    from diffusers_magi2.pipelines.weight_streaming_budget import PLANNED_REFINER_CONFIG_KEYS

    defaults = inspect.signature(Magi2RefinerTransformer3DModel.__init__).parameters
    return {k: json.loads(json.dumps(defaults[k].default)) for k in PLANNED_REFINER_CONFIG_KEYS}
