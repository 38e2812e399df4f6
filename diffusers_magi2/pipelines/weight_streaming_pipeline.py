"""``Magi2Pipeline.enable_weight_streaming``: both transformers' blocks streamed through a device ring
(:mod:`~diffusers_magi2.models.weight_streaming`), every other component resident on the device.

The weights the device holds, checked against ``vram_gb`` before any weight moves::

    sum over streamed models (weights outside the blocks + ring_size * largest block) + sum of the other components

Activations are not counted here.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..models.weight_streaming import check_weight_streaming_args


__all__ = ["Magi2WeightStreamingPipelineMixin"]

#: The components whose blocks stream (either may be absent).
STREAMED_COMPONENTS = ("transformer", "refiner")


def _weight_nbytes(module: torch.nn.Module) -> int:
    return sum(t.nbytes for t in [*module.parameters(), *module.buffers()])


class Magi2WeightStreamingPipelineMixin:
    """``enable_weight_streaming`` for :class:`~diffusers_magi2.pipelines.pipeline_magi2.Magi2Pipeline`."""

    def enable_weight_streaming(
        self,
        vram_gb: float,
        host_memory: str = "pinned",
        device: Optional[str] = None,
        ring_size: int = 2,
    ) -> None:
        """Stream the transformer's and the refiner's blocks from host memory through a ring of ``ring_size``
        device buffers (:meth:`~diffusers_magi2.Magi2Transformer3DModel.enable_weight_streaming`); move every other
        component to ``device``. Call it instead of ``pipe.to(device)``; inference only.

        Args:
            vram_gb: the card's memory in GB (10^9 bytes), e.g. 24 or 32.
            host_memory: ``"pinned"`` (the streamed weights held once in page-locked host memory) or ``"disk"``
                (not built yet: raises ``NotImplementedError``).
            device: the compute device (default ``"cuda"``; ``"cpu"`` runs the same ring in host memory).
            ring_size: device slots per streamed model (2 or 3).

        Raises:
            ValueError: ``vram_gb`` not positive, bad streaming arguments (see
                :meth:`~diffusers_magi2.Magi2Transformer3DModel.enable_weight_streaming`), or the weights the device
                would hold above ``vram_gb`` (naming the largest component), all before any weight moves.
            NotImplementedError: ``host_memory="disk"``.
        """
        if not isinstance(vram_gb, (int, float)) or isinstance(vram_gb, bool) or not vram_gb > 0:
            raise ValueError(f"vram_gb must be a positive number of GB (e.g. 24 or 32), got {vram_gb!r}")
        device = "cuda" if device is None else device
        check_weight_streaming_args(device, ring_size, host_memory, None)
        streamed, resident = {}, {}
        for name, component in self.components.items():
            if isinstance(component, torch.nn.Module):
                if name in STREAMED_COMPONENTS:
                    streamed[name] = component.weight_streaming_device_nbytes(ring_size)
                else:
                    resident[name] = _weight_nbytes(component)
        need = sum(streamed.values()) + sum(resident.values())
        if need > vram_gb * 1e9:
            largest = max({**streamed, **resident}.items(), key=lambda kv: kv[1])
            raise ValueError(
                f"vram_gb={vram_gb}: the device would hold {need / 1e9:.2f} GB of weights (the streamed "
                f"{', '.join(streamed)} with {ring_size}-block rings, the other components resident); the largest is "
                f"{largest[0]} at {largest[1] / 1e9:.2f} GB (streaming the text encoder is not built yet)"
            )
        for name in resident:
            getattr(self, name).to(device)
        for name in streamed:
            getattr(self, name).enable_weight_streaming(device, ring_size=ring_size, host_memory=host_memory)

    def disable_weight_streaming(self) -> None:
        """Stop streaming the transformer's and the refiner's blocks: their weights become resident on the device
        they streamed to; the pipeline can then be moved or cast again."""
        for name in STREAMED_COMPONENTS:
            component = getattr(self, name, None)
            if component is not None:
                component.disable_weight_streaming()

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
