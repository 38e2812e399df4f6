"""``Magi2Pipeline.enable_weight_streaming``: the text encoder's decoder layers and both transformers' blocks
streamed through a device ring (:mod:`~diffusers_magi2.models.weight_streaming`), every other component resident on
the device; with ``release_between_stages``, one streamed model holds its weights at a time
(:mod:`~diffusers_magi2.pipelines.weight_streaming_stages`).

The weights the device holds, checked against ``vram_gb`` before any weight moves::

    sum over held streamed models (weights outside the blocks + ring_size * largest block)
    + max over released streamed models (the same)  + sum of the other components

Activations are not counted here.
"""

from __future__ import annotations

from typing import Optional

import torch
from diffusers.utils import logging

from ..models.weight_streaming import (
    apply_weight_streaming,
    check_weight_streaming_args,
    remove_weight_streaming,
    streaming_device_nbytes,
)
from .weight_streaming_stages import StagedHostMemory, plan_reread


logger = logging.get_logger(__name__)

__all__ = ["Magi2WeightStreamingPipelineMixin", "streamed_blocks"]

#: The components whose blocks stream (any may be absent), in the order a call runs them.
STREAMED_COMPONENTS = ("text_encoder", "transformer", "refiner")
#: Query tokens per chunk of the streamed refiner's layers (``enable_forward_chunking``): its 1080p activations
#: within a 32 GB card, as ``bench_memory --gpu_gb 32`` plans them.
STREAMED_REFINER_CHUNK_SIZE = 8192


def _weight_nbytes(module: torch.nn.Module) -> int:
    return sum(t.nbytes for t in [*module.parameters(), *module.buffers()])


def streamed_blocks(name: str, model: torch.nn.Module) -> torch.nn.ModuleList:
    """The blocks streamed of a pipeline component: the transformers' ``transformer_blocks``; the text encoder's
    decoder layers (``layers`` of a transformers text model, or of its ``model`` / ``language_model``).

    Raises:
        ValueError: a text encoder with no decoder layer list.
    """
    if name != "text_encoder":
        return model.transformer_blocks
    for path in ("layers", "model.layers", "language_model.layers", "model.language_model.layers"):
        module = model
        for part in path.split("."):
            module = getattr(module, part, None)
        if isinstance(module, torch.nn.ModuleList):
            return module
    raise ValueError(f"cannot stream the text encoder {type(model).__name__}: it has no decoder layer list (`layers`)")


class Magi2WeightStreamingPipelineMixin:
    """``enable_weight_streaming`` for :class:`~diffusers_magi2.pipelines.pipeline_magi2.Magi2Pipeline`."""

    def enable_weight_streaming(
        self,
        vram_gb: float,
        host_memory: str = "pinned",
        device: Optional[str] = None,
        ring_size: int = 2,
        release_between_stages: Optional[bool] = None,
    ) -> None:
        """Stream the text encoder's decoder layers and the transformer's and the refiner's blocks from host memory
        through a ring of ``ring_size`` device buffers each (:func:`~diffusers_magi2.models.weight_streaming.
        apply_weight_streaming`; their other weights, e.g. the token embedding, resident on ``device``); move every
        other component to ``device``; run the refiner's layers in token chunks of :data:`STREAMED_REFINER_CHUNK_SIZE`
        (``enable_forward_chunking``). Call it instead of ``pipe.to(device)``; inference only.

        Args:
            vram_gb: the card's memory in GB (10^9 bytes), e.g. 24 or 32.
            host_memory: ``"pinned"`` (the streamed weights held once in page-locked host memory) or ``"disk"``
                (not built yet: raises ``NotImplementedError``).
            device: the compute device (default ``"cuda"``; ``"cpu"`` runs the same ring in host memory).
            ring_size: device slots per streamed model (2 or 3).
            release_between_stages: ``True``: a streamed model's weights (host buffers, ring, resident weights)
                are freed when the next streamed model runs and re-read from its safetensors files when it runs
                again, so host memory is the largest model's, not the sum (each call reads every streamed model
                once); needs a pipeline from ``from_pretrained`` whose streamed weights are the files' (or a cast
                of them). ``False``: every streamed model stays held. ``None`` (default): release each streamed
                model that can be re-read (a pipeline built in memory: none), logging the ones held.

        Raises:
            ValueError: ``vram_gb`` not positive, bad streaming arguments (see
                :func:`~diffusers_magi2.models.weight_streaming.check_weight_streaming_args`), the weights the device
                would hold above ``vram_gb`` (naming the largest component), or ``release_between_stages=True`` with
                a streamed model that cannot be re-read (naming it and why), all before any weight moves.
            NotImplementedError: ``host_memory="disk"``.
        """
        if not isinstance(vram_gb, (int, float)) or isinstance(vram_gb, bool) or not vram_gb > 0:
            raise ValueError(f"vram_gb must be a positive number of GB (e.g. 24 or 32), got {vram_gb!r}")
        if release_between_stages not in (None, True, False):
            raise ValueError(f"release_between_stages must be True, False or None, got {release_between_stages!r}")
        device = "cuda" if device is None else device
        check_weight_streaming_args(device, ring_size, host_memory, None)
        models = {n: c for n, c in self.components.items() if isinstance(c, torch.nn.Module)}
        blocks = {n: streamed_blocks(n, m) for n, m in models.items() if n in STREAMED_COMPONENTS}
        rereads, held_why = {}, {}
        for name in blocks if release_between_stages is not False else ():
            try:
                rereads[name] = plan_reread(name, models[name], blocks[name])
            except ValueError as error:
                if release_between_stages:
                    raise ValueError(
                        f"release_between_stages=True: {error}; load the pipeline with from_pretrained and stream it "
                        "as loaded, or pass release_between_stages=False (host memory is then the streamed models' sum)"
                    ) from error
                held_why[name] = str(error)
        need = {n: streaming_device_nbytes(models[n], b, ring_size) for n, b in blocks.items()}
        need.update({n: _weight_nbytes(m) for n, m in models.items() if n not in blocks})
        total = sum(v for n, v in need.items() if n not in rereads) + max([need[n] for n in rereads], default=0)
        if total > vram_gb * 1e9:
            largest = max(need.items(), key=lambda kv: kv[1])
            raise ValueError(
                f"vram_gb={vram_gb}: the device would hold {total / 1e9:.2f} GB of weights (the streamed "
                f"{', '.join(blocks)} with {ring_size}-block rings, the other components resident); the largest is "
                f"{largest[0]} at {largest[1] / 1e9:.2f} GB"
            )
        for name in models.keys() - blocks.keys():
            models[name].to(device)
        for name in STREAMED_COMPONENTS:
            if name in blocks:
                streamer = apply_weight_streaming(
                    models[name], list(blocks[name]), device, ring_size, host_memory, allocate=name not in rereads
                )
                models[name]._weight_streamer = streamer
                if name in rereads:
                    rereads[name].streamer = streamer
        for name, why in held_why.items():
            logger.info(f"weight streaming: {name} stays held between stages ({why})")
        self._weight_streaming_stages = StagedHostMemory(rereads, {n: models[n] for n in rereads})
        self._weight_streaming_stages.install()
        if "refiner" in blocks:
            models["refiner"].enable_forward_chunking(STREAMED_REFINER_CHUNK_SIZE)

    def disable_weight_streaming(self) -> None:
        """Stop streaming: the streamed models' weights become resident on the device they streamed to (a released
        model's read back from its files first); the pipeline can then be moved or cast again."""
        stages = getattr(self, "_weight_streaming_stages", None)
        for name in STREAMED_COMPONENTS:
            model = getattr(self, name, None)
            streamer = getattr(model, "_weight_streamer", None)
            if streamer is None:
                continue
            if stages is not None and name in stages.parts:
                stages.remove(name)
            remove_weight_streaming(streamer)
            model._weight_streamer = None
        self._weight_streaming_stages = None

    def to(self, *args, **kwargs):
        """``DiffusionPipeline.to``, refused before any component moves while weights are streamed.

        Raises:
            RuntimeError: :meth:`enable_weight_streaming` is on (call :meth:`disable_weight_streaming` first).
        """
        streaming = [n for n in STREAMED_COMPONENTS if getattr(getattr(self, n, None), "_weight_streamer", None)]
        if streaming:
            raise RuntimeError(
                f"the {' and '.join(streaming)} block weights are streamed (enable_weight_streaming): moving or "
                "casting the pipeline would copy every block to the device; call pipe.disable_weight_streaming() first"
            )
        return super().to(*args, **kwargs)
