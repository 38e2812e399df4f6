"""``examples/generate.py --vram_gb``: the memory plan's side of a streamed run. Before loading, the plan's stages of
the asked call checked against the card from the repo's configs; once streaming is on, the line rank 0 prints; before
the call, the refined decode's tiling. The plan describes the released model on one card: another model, or a launched
context- or expert-parallel run, gets no planned figures.
"""

from __future__ import annotations

import sys
from typing import Optional


def streaming_summary(
    vram_gb: float, host_memory: str, ring_size: int, stages, ep_degree: int = 1, ulysses_degree: int = 1
) -> str:
    """The line ``--vram_gb`` prints once streaming is on: the mode and the ring, and for the released model on one
    card (its checked ``stages``, streamed with each model released between stages) the plan's device peak, with what
    stays resident beside it, and host memory (the public values of ``check_streaming_budget``); ``ep_degree`` or
    ``ulysses_degree`` above 1: a launched run, whose ranks the plan's single-card figures do not describe (under
    expert parallelism each rank's transformer is held); ``stages=None`` otherwise: a model the plan does not cover."""
    from diffusers_magi2.pipelines.weight_streaming_budget import check_streaming_budget

    line = f"weight streaming: host_memory {host_memory}, a ring of {ring_size} device buffers per streamed model"
    degrees = {"expert": ep_degree, "context": ulysses_degree}
    parallel = [f"{kind} parallelism over {n} ranks" for kind, n in degrees.items() if n > 1]
    if parallel:
        held = "; each rank's transformer held between stages" if ep_degree > 1 else ""
        return (
            f"{line}{held}; the memory plan's figures are a single card's, running the whole call, not a rank's under "
            f"{' and '.join(parallel)}: no planned peaks"
        )
    if stages is None:
        return line + "; the memory plan does not apply (not the released Preview's config): no planned peaks"
    # the plan's figures only: enable_weight_streaming has checked the host's memory against the weights it holds
    planned = check_streaming_budget(vram_gb, host_memory, stages, host_bytes=sys.maxsize)
    host_gb = planned.pop("host_ram_GB")
    peak = max(planned, key=planned.get)
    return (
        f"{line}; planned device peak {planned[peak]} GB ({peak}, with what stays resident beside it), host memory "
        f"{host_gb} GB, over the stages {', '.join(planned)}"
    )


def tile_streamed_refined_decode(pipe, args, height: int, width: int) -> bool:
    """With ``--vram_gb``, a call that refines (the 1080p preset) decodes in the TurboVAE's default 512-pixel tiles
    (``pipe.video_decoder.enable_tiling()``): for the released model on one card (``args.planned_stages`` set by
    ``generate.load_pipeline``) where the recipe plans it (``planned_tiled_decodes``: the whole 1080p frames do not fit
    the card), otherwise (no planned figures) always; a 540p call decodes whole frames. Returns whether tiling was
    turned on."""
    from diffusers_magi2.pipelines.weight_streaming_budget import planned_tiled_decodes

    decoder = getattr(pipe, "video_decoder", None)
    if args.vram_gb is None or decoder is None or not pipe.stage_sizes(height, width)[0]:
        return False
    if args.planned_stages is not None and not planned_tiled_decodes(args.vram_gb):
        return False
    decoder.enable_tiling()
    return True


def repo_streamed_stages(args, height: int, width: int) -> Optional[list]:
    """With ``--vram_gb`` on one card: the memory plan's stages of a call at ``height x width``, checked against the card
    (``check_streaming_vram``, each streamed model released between stages) from the repo's configs alone, before
    any weight loads; ``None`` where the plan does not apply (a transformer or refiner config other than the
    released Preview's)."""
    from diffusers import DiffusionPipeline

    from diffusers_magi2 import Magi2RefinerTransformer3DModel, Magi2Transformer3DModel
    from diffusers_magi2.pipelines.weight_streaming_budget import check_streaming_vram, plan_applies

    index = DiffusionPipeline.load_config(args.model)
    refiner = None
    if (index.get("refiner") or [None])[0] is not None:
        refiner = Magi2RefinerTransformer3DModel.load_config(args.model, subfolder="refiner")
    if not plan_applies(Magi2Transformer3DModel.load_config(args.model, subfolder="transformer"), refiner):
        return None
    video_decoder = index.get("video_decoder") or [None, None]
    stages = planned_stages(args, height, width, turbovae=video_decoder[0] is not None)
    check_streaming_vram(args.vram_gb, stages)
    return stages


def planned_stages(args, height: int, width: int, turbovae: bool) -> list:
    """The memory plan's stages a call at ``height x width`` runs (``planned_call_stages``; the TurboVAE decode where
    the repo has one, else the Wan VAE's)."""
    from diffusers_magi2.pipelines.presets_magi2 import resolve_stage_sizes
    from diffusers_magi2.pipelines.weight_streaming_budget import planned_call_stages

    refine, preview_height, preview_width = resolve_stage_sizes(height, width)
    return planned_call_stages(refine, preview_height, preview_width, image=args.image is not None, turbovae=turbovae)
