"""``Magi2Pipeline.enable_weight_streaming``: the text encoder's decoder layers and both transformers' blocks
streamed through a device ring (:mod:`~diffusers_magi2.models.weight_streaming`), the autoencoders in host memory
but for their own encode or decode (moved whole, ``module.to(device)``, as they read ``module.device``; after it,
each parameter and buffer points back at its host tensor as loaded: no copy back, and a view of the safetensors file
stays one, file-backed rather than anonymous memory), every other component resident on the device; with
``release_between_stages``, one streamed model holds its weights at a time
(:mod:`~diffusers_magi2.pipelines.weight_streaming_stages`).

Checked before any weight moves, in this order:

* the streamed models that can be re-read from their files (``release_between_stages``; refused for ``True``
  where one cannot);
* ``vram_gb`` against the planned stage peaks shipped in the package plus what stays resident on the device beside
  each (:func:`~.weight_streaming_budget.check_streaming_vram`: the stages every generation runs; its ``"released"``
  figures when every streamed model is released between stages, else ``"held"``), where the plan describes the
  pipeline: a transformer of the geometry the plan was made for (:func:`~.weight_streaming_budget.plan_applies`: the
  released Preview; the table records it) on one device (no context or expert parallelism: the figures are a single
  card's running the whole call, not a rank's). The peaks include activations, which only the plan knows.
* ``vram_gb`` against the weights the device holds, for any model::

      sum over held streamed models (weights outside the blocks + ring_size * largest block)
      + max over released streamed models (the same) + max over the autoencoders + sum of the other components

* the host: what the mode holds for the streamed models, from their own bytes
  (``weight_streaming_host_nbytes``: the packed blocks in the pinned mode, the staging ring in the disk mode)
  against the memory the OS says is available plus the streamed block weights now in host memory (streaming
  replaces them). The table's host figures are not used here: they count the released model and the text encoder.

At the start of a call (before any work), where the plan describes the pipeline: ``vram_gb`` against the planned peaks of the stages
that call runs (its preview size, the refiner, the decoder; ``planned_call_stages``); and where it refines and
decodes, a ``video_decoder`` with tiling off is refused where the recipe decodes the refined frames in tiles and
``vram_gb`` is below their whole frames' planned peak plus what stays resident (``planned_tiled_decodes``: the 32 GB
recipe's 1080p TurboVAE decode). Streaming never turns tiling on or off: the streamed call
equals the resident one bit for bit with the same tiling (what tiling itself changes: ``enable_tiling``).
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
from diffusers.utils import logging
from torch.nn.utils.weight_norm import WeightNorm

from ..models.turbo_vae import Magi2TurboVAEDecoder
from ..models.weight_streaming import (
    apply_weight_streaming,
    check_weight_streaming_args,
    plan_streamed_file_sources,
    remove_weight_streaming,
    streaming_device_nbytes,
    streaming_host_nbytes,
)
from ..models.weight_streaming_restore import check_restore
from .weight_streaming_budget import (
    available_host_bytes,
    check_streaming_vram,
    plan_applies,
    planned_call_stages,
    planned_tiled_decodes,
)
from .weight_streaming_stages import StagedHostMemory, plan_reread


logger = logging.get_logger(__name__)

__all__ = ["Magi2WeightStreamingPipelineMixin", "streamed_blocks"]

#: The components whose blocks stream (any may be absent), in the order a call runs them.
STREAMED_COMPONENTS = ("text_encoder", "transformer", "refiner")
#: Query tokens per chunk of the streamed refiner's layers (``enable_forward_chunking``): its 1080p activations
#: within a 32 GB card, as ``bench_memory --gpu_gb 32`` plans them.
STREAMED_REFINER_CHUNK_SIZE = 8192
#: Device slots per streamed model (``enable_weight_streaming``'s default ``ring_size``; the plan counts it).
STREAMED_RING_SIZE = 2
#: The autoencoders: kept in host memory while the streamed models run, each moved to the device for its own
#: encode or decode only (``Magi2WeightStreamingPipelineMixin._autoencoder_stage``).
AUTOENCODER_COMPONENTS = ("vae", "video_decoder", "audio_vae")


def _streamer(pipe, name: str):
    return getattr(getattr(pipe, name, None), "_weight_streamer", None)


def _weight_nbytes(module: torch.nn.Module) -> int:
    return sum(t.nbytes for t in [*module.parameters(), *module.buffers()])


def _host_tensors(module: torch.nn.Module) -> list:
    """``(owner, kind, name, tensor)`` of every parameter and buffer of ``module`` as it holds them now, and of every
    weight that ``torch.nn.utils.weight_norm`` computes into a plain attribute (diffusers' Oobleck audio VAE): its
    forward recomputes that one from the parameters wherever they are, and ``.to()`` does not move it back."""
    held = [
        (owner, kind, name, t.detach() if kind == "_parameters" else t)
        for owner in module.modules()
        for kind in ("_parameters", "_buffers")
        for name, t in getattr(owner, kind).items()
        if t is not None
    ]
    held += [
        (owner, "__dict__", hook.name, owner.__dict__[hook.name])
        for owner in module.modules()
        for hook in owner._forward_pre_hooks.values()
        if isinstance(hook, WeightNorm) and isinstance(owner.__dict__.get(hook.name), torch.Tensor)
    ]
    return held


def _point_back(tensors: list) -> None:
    """Point each parameter (its ``data``), buffer and computed weight back at the tensor :func:`_host_tensors`
    recorded."""
    for owner, kind, name, t in tensors:
        if kind == "_parameters":
            owner._parameters[name].data = t
        elif kind == "_buffers":
            owner._buffers[name] = t
        else:
            setattr(owner, name, t)


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
        ring_size: int = STREAMED_RING_SIZE,
        release_between_stages: Optional[bool] = None,
    ) -> None:
        """Stream the text encoder's decoder layers and the transformer's and the refiner's blocks from host memory
        through a ring of ``ring_size`` device buffers each (:func:`~diffusers_magi2.models.weight_streaming.
        apply_weight_streaming`; their other weights, e.g. the token embedding, resident on ``device``); keep the
        autoencoders (:data:`AUTOENCODER_COMPONENTS`) in host memory, each moved to ``device`` for its own encode or
        decode, then back to its host tensors as loaded (dtypes unchanged); move every other component to
        ``device``; run the refiner's layers in token chunks of :data:`STREAMED_REFINER_CHUNK_SIZE`
        (``enable_forward_chunking``). Call it instead of ``pipe.to(device)``; inference only. The TurboVAE's tiling
        stays as set: the refined (1080p) decode needs ``pipe.video_decoder.enable_tiling()`` on a card below its
        whole frames' planned need (a call that decodes them untiled is refused at its start there).

        Args:
            vram_gb: the card's memory in GB (10^9 bytes), e.g. 24 or 32.
            host_memory: ``"pinned"`` (the streamed weights held once in page-locked host memory) or ``"disk"``
                (each block read from the safetensors files the pipeline was loaded from into a staging ring of
                ``ring_size`` host buffers; a pipeline from ``Magi2Pipeline.from_pretrained``).
            device: the compute device (default ``"cuda"``; ``"cpu"`` runs the same ring in host memory).
            ring_size: device slots per streamed model (2 or 3).
            release_between_stages: ``True``: a streamed model's weights (host buffers or staging ring, device
                ring, resident weights) are freed when the next streamed model runs and re-read from its safetensors
                files when it runs again, so host memory is the largest model's, not the sum (the pinned mode reads
                every streamed model once per call), and the device holds one streamed model's ring and resident
                weights; needs a pipeline from ``from_pretrained`` whose streamed weights are the files' (or a cast
                of them). ``False``: every streamed model stays held. ``None`` (default): release each streamed
                model that can be re-read (a pipeline built in memory: none), logging the ones held.

        Raises:
            ValueError: ``vram_gb`` not positive, bad streaming arguments (see
                :func:`~diffusers_magi2.models.weight_streaming.check_weight_streaming_args`), the released model
                without a TurboVAE ``video_decoder`` (the recipes decode with it), a ``vram_gb`` below
                the planned peak of a stage every generation runs plus what stays resident beside it (the released
                model; naming the stage, its peak and what stays resident), the weights the device would hold above ``vram_gb`` (naming the largest component),
                ``release_between_stages=True`` with a streamed model that cannot be re-read (naming it and why),
                less host memory available than the mode needs (naming the disk
                mode), or a disk mode the models cannot stream (no files, or block tensors unlike the files', naming them), all
                before any weight moves.
        """
        if not isinstance(vram_gb, (int, float)) or isinstance(vram_gb, bool) or not vram_gb > 0:
            raise ValueError(f"vram_gb must be a positive number of GB (e.g. 24 or 32), got {vram_gb!r}")
        if release_between_stages not in (None, True, False):
            raise ValueError(f"release_between_stages must be True, False or None, got {release_between_stages!r}")
        device = "cuda" if device is None else device
        streamed_to = check_weight_streaming_args(device, ring_size, host_memory, None)[0]
        models = {n: c for n, c in self.components.items() if isinstance(c, torch.nn.Module)}
        blocks = {n: streamed_blocks(n, m) for n, m in models.items() if n in STREAMED_COMPONENTS}
        rereads, held_why = {}, {}
        for name in blocks if release_between_stages is not False else ():
            try:
                ep_size = max((getattr(m, "ep_size", 1) for m in models[name].modules()), default=1)
                if ep_size > 1:
                    raise ValueError(
                        f"{name}'s routed experts are sharded over {ep_size} expert-parallel ranks, and its files hold "
                        "every expert, so it cannot be re-read as this rank holds it"
                    )
                rereads[name] = plan_reread(name, models[name], blocks[name])
            except ValueError as error:
                if release_between_stages:
                    raise ValueError(
                        f"release_between_stages=True: {error}; load the pipeline with from_pretrained and stream it "
                        "as loaded, or pass release_between_stages=False (host memory is then the streamed models' sum)"
                    ) from error
                held_why[name] = str(error)
        released = bool(blocks) and rereads.keys() == blocks.keys()
        if self._plan_describes():
            if not isinstance(getattr(self, "video_decoder", None), Magi2TurboVAEDecoder):
                raise ValueError(
                    "the streamed recipes decode with the TurboVAE (video_decoder), which this pipeline lacks: convert "
                    "the release with magi2-convert --turbo_vae_dir, or pass video_decoder= to from_pretrained"
                )
            check_streaming_vram(vram_gb, release_between_stages=released)
        need = {n: streaming_device_nbytes(models[n], b, ring_size) for n, b in blocks.items()}
        need.update({n: _weight_nbytes(m) for n, m in models.items() if n not in blocks})
        autoencoders = [n for n in AUTOENCODER_COMPONENTS if n in models]
        one_at_a_time = [*rereads, *autoencoders]
        total = sum(v for n, v in need.items() if n not in one_at_a_time)
        total += max([need[n] for n in rereads], default=0) + max([need[n] for n in autoencoders], default=0)
        if total > vram_gb * 1e9:
            largest = max(need.items(), key=lambda kv: kv[1])
            raise ValueError(
                f"vram_gb={vram_gb}: the device would hold {total / 1e9:.2f} GB of weights (the streamed "
                f"{', '.join(blocks)} with {ring_size}-block rings, the other components resident); the largest is "
                f"{largest[0]} at {largest[1] / 1e9:.2f} GB"
            )
        self._check_streaming_host(models, blocks, rereads, host_memory, ring_size, pinned=streamed_to.type == "cuda")
        # the disk mode: every streamed block tensor against the files' bytes, before anything moves
        disk = {n: plan_streamed_file_sources(models[n], list(b)) for n, b in blocks.items() if host_memory == "disk"}
        self._weight_streaming_budget = (vram_gb, streamed_to, {n: _weight_nbytes(m) for n, m in models.items()})
        self._weight_streaming_released = released
        for name in models.keys() - blocks.keys():
            models[name].to("cpu" if name in autoencoders else device)
        self._weight_streaming_autoencoders = (torch.device(device), autoencoders)
        for name in STREAMED_COMPONENTS:
            if name in blocks:
                streamer = apply_weight_streaming(
                    models[name],
                    list(blocks[name]),
                    device,
                    ring_size,
                    host_memory,
                    allocate=name not in rereads,
                    sources=disk.get(name),
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

    def _plan_describes(self) -> bool:
        """Whether the plan's single-card figures describe this pipeline: the released transformer (and refiner), on
        one device."""
        transformer, refiner = getattr(self, "transformer", None), getattr(self, "refiner", None)
        if transformer is None or not plan_applies(transformer.config, None if refiner is None else refiner.config):
            return False
        models = [m for m in (transformer, refiner) if m is not None]
        parallel = [getattr(m, "context_parallel_degree", 1) for m in models]
        parallel += [getattr(layer, "ep_size", 1) for layer in transformer.modules()]
        return max(parallel) == 1

    def _streamed_plan(self) -> Optional[tuple]:
        """``(vram_gb, released)`` while weights are streamed and the plan describes the pipeline, else ``None``."""
        budget = getattr(self, "_weight_streaming_budget", None)
        if budget is None or not any(_streamer(self, n) for n in STREAMED_COMPONENTS) or not self._plan_describes():
            return None
        return budget[0], self._weight_streaming_released

    def _check_streamed_decode(self, refine: bool) -> None:
        """Refuse a call that decodes refined frames untiled where the plan tiles them (:func:`planned_tiled_decodes`)."""
        plan = self._streamed_plan()
        decoder = getattr(self, "video_decoder", None)
        if not refine or plan is None or not isinstance(decoder, Magi2TurboVAEDecoder) or decoder.use_tiling:
            return
        tiled = planned_tiled_decodes(*plan)
        if tiled:
            name, peak_gb = next(iter(tiled.items()))
            raise ValueError(
                f"vram_gb={plan[0]}: the plan decodes the refined frames in spatial tiles (stage '{name}', "
                f"{peak_gb} GB; the whole frames do not fit), and video_decoder tiling is off; call "
                "pipe.video_decoder.enable_tiling() first"
            )

    def _check_streamed_stages(self, refine, denoise_height, denoise_width, image, decode, height, width, videos):
        """Refuse a call whose own stages (:func:`planned_call_stages`) the plan does not fit within ``vram_gb``."""
        plan = self._streamed_plan()
        if plan is None:
            return
        turbovae = isinstance(getattr(self, "video_decoder", None), Magi2TurboVAEDecoder)
        stages = planned_call_stages(
            refine,
            denoise_height,
            denoise_width,
            image,
            turbovae,
            decode,
            height=height,
            width=width,
            batch_size=videos,
            duration_s=float(self.config.duration_s),
        )
        check_streaming_vram(plan[0], stages, release_between_stages=plan[1])

    @contextlib.contextmanager
    def _autoencoder_stage(self, name: str):
        """While streaming, the autoencoder ``name`` on the streaming device for the ``with`` body, then on its host
        tensors as loaded (inference: its weights unchanged); otherwise nothing moves."""
        device, autoencoders = getattr(self, "_weight_streaming_autoencoders", None) or (None, ())
        module = getattr(self, name, None) if name in autoencoders else None
        if module is None:
            yield
            return
        as_loaded = _host_tensors(module)
        try:
            module.to(device)  # inside: a move that fails part way is pointed back too
            yield
        finally:
            _point_back(as_loaded)

    def _check_streaming_host(self, models, blocks, rereads, host_memory: str, ring_size: int, pinned: bool) -> None:
        """Refuse a host with less available memory than ``host_memory`` holds for the streamed ``blocks`` (the held
        models' sum plus the largest released one's, as :class:`StagedHostMemory` holds them)."""

        def need(mode: str) -> int:
            each = {n: streaming_host_nbytes(models[n], b, mode, ring_size, pinned) for n, b in blocks.items()}
            released = rereads
            held = sum(v for n, v in each.items() if n not in released)
            return held + max([each[n] for n in released], default=0)

        needed = need(host_memory)
        on_host = sum(
            t.nbytes for b in blocks.values() for t in [*b.parameters(), *b.buffers()] if t.device.type == "cpu"
        )
        have = available_host_bytes() + on_host
        if needed <= have:
            return
        if host_memory == "pinned":
            try:
                disk = need("disk")
                hint = f"host_memory='disk' reads the blocks from the safetensors files and needs {disk / 1e9:.2f} GB"
            except ValueError:
                hint = (
                    "host_memory='disk' reads the blocks from the safetensors files (a pipeline from from_pretrained)"
                )
        else:
            hint = "the disk mode is the smallest host-memory mode; free host memory or use a larger host"
        raise ValueError(
            f"the host has {have / 1e9:.2f} GB of memory for the streamed {', '.join(blocks)} blocks (available "
            f"now plus {on_host / 1e9:.2f} GB of their weights in host memory); host_memory={host_memory!r} needs "
            f"{needed / 1e9:.2f} GB; {hint}"
        )

    def disable_weight_streaming(self, device: Optional[str] = None) -> None:
        """Stop streaming (a released model's weights read back from its files first): the streamed block weights come
        back as plain host tensors (default, as diffusers leaves offloaded weights when its hooks are removed; every
        other weight stays where it is, the autoencoders in host memory), or resident on ``device``; the pipeline can
        then be moved or cast again.

        Raises:
            ValueError: ``device`` without room for them (:func:`~diffusers_magi2.models.weight_streaming_restore.
                check_restore`: the device's free memory, or every component's weights above the ``vram_gb``
                streaming was enabled with), before any weight moves; streaming stays as it was.
        """
        stages = getattr(self, "_weight_streaming_stages", None)
        streamers = {n: getattr(self, n)._weight_streamer for n in STREAMED_COMPONENTS if _streamer(self, n)}
        if not streamers:
            self._weight_streaming_budget = None
            return
        vram_gb, streamed_to, nbytes = self._weight_streaming_budget
        moved = sum(nbytes[n] for n in streamers)
        device = check_restore(device, moved, sum(nbytes.values()), vram_gb, streamed_to)
        for name, streamer in streamers.items():
            part = stages.parts.get(name) if stages is not None else None
            if part is not None and not part.held:
                part.refill()
            remove_weight_streaming(streamer, device)
            if part is not None:
                stages.remove(name)
            getattr(self, name)._weight_streamer = None
        self._weight_streaming_stages = None
        self._weight_streaming_autoencoders = None
        self._weight_streaming_budget = None

    def release_weight_streaming(self) -> None:
        """Stop streaming and drop the streamed models instead of restoring them (:meth:`disable_weight_streaming`
        restores them): each one's weights are freed as a stage release frees them (host buffers, page-locked
        memory handed back to the OS, device ring, resident weights) and its component set to ``None``; the
        autoencoders stay in host memory. For a pipeline whose streamed models have done their work, e.g. the
        encoders after caching, where dropping the pipeline alone would leave the freed page-locked buffers cached
        by torch's host allocator. Nothing happens when no weights are streamed."""
        stages = getattr(self, "_weight_streaming_stages", None)
        for name in STREAMED_COMPONENTS:
            streamer = _streamer(self, name)
            if streamer is None:
                continue
            part = stages.parts.get(name) if stages is not None else None
            if part is None:
                streamer.free()
            elif part.held:  # a released model not held was freed when the next stage began
                part.free()
            getattr(self, name)._weight_streamer = None
            self.register_modules(**{name: None})
        self._weight_streaming_stages = None
        self._weight_streaming_autoencoders = None
        self._weight_streaming_budget = None

    def to(self, *args, **kwargs):
        """``DiffusionPipeline.to``, refused before any component moves while weights are streamed.

        Raises:
            RuntimeError: :meth:`enable_weight_streaming` is on (call :meth:`disable_weight_streaming` first).
        """
        streaming = [n for n in STREAMED_COMPONENTS if _streamer(self, n)]
        if streaming:
            raise RuntimeError(
                f"the {' and '.join(streaming)} block weights are streamed (enable_weight_streaming): moving or "
                "casting the pipeline would copy every block to the device; call pipe.disable_weight_streaming() first"
            )
        return super().to(*args, **kwargs)
