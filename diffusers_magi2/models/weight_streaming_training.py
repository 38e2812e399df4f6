"""Training under weight streaming: per-block gradient checkpointing, the backward streaming the blocks again in
reverse order.

With gradient checkpointing each block is called through ``torch.utils.checkpoint``: its forward keeps no tensor
made inside the block (the checkpoint saves the block's inputs only), and the backward, on reaching block ``i``,
calls it again (the recompute) to remake the tensors its autograd nodes read, weights among them. For ``n`` blocks
and a ring of ``r`` slots (:mod:`.weight_streaming_ring`) one training step runs::

    forward    i = 0 .. n-1:  acquire(i), prefetch i+1 .. i+r-1;  block i;  release(i)
    backward   i = n-1 .. 0:  release the slot held by block i+1 (its backward is done)
                              acquire(i), prefetch i-1 .. i-r+1   (reverse order)
                              recompute block i: its saved tensors may be views of slot(i): the slot is held
                              block i's backward nodes

Autograd runs a node only after every node that consumes its output, and on one device it takes the newest ready
node first, so every node of block ``i+1`` has run before the first node of block ``i`` (whose saved tensors
trigger the recompute of block ``i``): holding a recomputed block's slot until the next acquire never lets the ring
overwrite weights a node still reads. On CUDA that release records the slot's event on the compute stream after
block ``i+1``'s backward kernels, so the copy into it waits for them. Each step copies every block twice (forward
and recompute) less the ``r`` blocks the backward finds still in the ring, and from the second step on less the
``r`` the forward finds there (the backward ends with blocks ``0 .. r-1``).

Without checkpointing a block's autograd nodes would save views of its slot during the forward, which later blocks
overwrite before the backward reads them: a forward with grad enabled is refused unless it runs through the
checkpoint (:class:`StreamedCheckpointCall`, which also tells the streamer the forward from the recompute). The
parameters of PEFT adapter layers (the LoRA factors) are not streamed: they stay resident on the device, where
their gradients accumulate and the optimizer updates them; a streamed weight that requires grad is refused.
"""

from __future__ import annotations

import contextlib


class StreamedCheckpointCall:
    """What gradient checkpointing calls in place of a streamed block: the block, with the streamer's ``phase`` set
    to ``"forward"`` for the first call and ``"recompute"`` for the later ones (torch's checkpoint calls the function
    again in the backward; any ``gradient_checkpointing_func`` that calls ``module.__call__`` or ``module(...)``
    works)."""

    def __init__(self, streamer, block) -> None:
        self.streamer = streamer
        self.block = block
        self.calls = 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        with _phase(self.streamer, "forward" if self.calls == 1 else "recompute"):
            return self.block(*args, **kwargs)


@contextlib.contextmanager
def _phase(streamer, phase: str):
    outer, streamer.phase = streamer.phase, phase
    try:
        yield
    finally:
        streamer.phase = outer


def check_streamed_training(block, phase) -> None:
    """Refuse a call with grad enabled on streamed ``block`` (a :class:`~.weight_streaming_layout.StreamedBlock`)
    outside the checkpoint, or one whose streamed weights require grad.

    Raises:
        RuntimeError: grad enabled without gradient checkpointing (``phase`` ``None``), or a streamed weight that
            requires grad.
    """
    if phase is None:
        raise RuntimeError(
            "a forward with grad enabled under weight streaming needs per-block gradient checkpointing: call "
            "enable_gradient_checkpointing() first (each block is then recomputed in the backward, its weights "
            "streamed again in reverse order); without it autograd would keep views of ring slots that the next "
            "blocks overwrite. For inference run under torch.no_grad() or torch.inference_mode()"
        )
    trainable = [e for e in block.entries if e.tensor.requires_grad]
    if trainable:
        e = trainable[0]
        raise RuntimeError(
            f"block {block.index}: {len(trainable)} streamed weight(s) require grad (the first {tuple(e.shape)} "
            f"{e.dtype}); under weight streaming only the PEFT adapters' parameters (resident) train: freeze the "
            "others (model.requires_grad_(False) before adding the adapter, or requires_grad_(False) on them)"
        )
