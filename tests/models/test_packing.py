"""``models/packing_magi2.py``: the packer's layout (segment lengths, modality runs) is what the packed tensors
hold, and it travels into ``forward_packed``, so one transformer forward after packing reads nothing back to the
host; without it, ``forward_packed`` checks what it is given (the edge for a direct caller)."""

from __future__ import annotations

import pytest
import torch
from helpers.tiny_transformer import tiny_inputs, tiny_model
from torch.utils._python_dispatch import TorchDispatchMode

from diffusers_magi2.models.packing_magi2 import Magi2PackedLayout


#: ops whose result needs a device value on the host (a scalar read, or an output size that depends on the data)
_HOST_READS = {
    torch.ops.aten._local_scalar_dense.default,
    torch.ops.aten.equal.default,
    torch.ops.aten.nonzero.default,
    torch.ops.aten.masked_select.default,
    torch.ops.aten.unique_consecutive.default,
    torch.ops.aten._unique2.default,
    torch.ops.aten.repeat_interleave.Tensor,
}


class _CountHostReads(TorchDispatchMode):
    """Records each host read: the ops above, and ``Tensor.tolist`` (which reads without dispatching)."""

    def __init__(self, monkeypatch) -> None:
        super().__init__()
        self.reads = []
        tolist = torch.Tensor.tolist

        def counted_tolist(tensor):
            self.reads.append("tolist")
            return tolist(tensor)

        monkeypatch.setattr(torch.Tensor, "tolist", counted_tolist)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in _HOST_READS:
            self.reads.append(str(func))
        return func(*args, **(kwargs or {}))


def _packed_args(packed) -> tuple:
    return packed.hidden_states, packed.coords, packed.modality_mapping, packed.cu_seqlens, packed.time_embedding


def test_the_layout_is_what_the_packed_tensors_hold():
    model, inputs = tiny_model(), tiny_inputs()
    packed = model.pack_inputs(*inputs.values())
    layout = packed.layout
    cu = packed.cu_seqlens.tolist()
    assert layout.segment_lengths == tuple(b - a for a, b in zip(cu, cu[1:]))
    ids = packed.modality_mapping.long().clamp(max=2)
    for start, stop in [(0, None), (0, 40), (17, 60), (33, 34), (45, 45)]:
        expected = torch.bincount(ids[start:stop], minlength=3).tolist()
        assert layout.group_sizes(start, stop) == tuple(expected), (start, stop)


def test_one_forward_after_packing_reads_nothing_back_to_the_host(monkeypatch):
    """With the packer's layout (as ``forward`` passes it) and the sync-free expert backend, the forward from the
    packed tensors to the output reads no device value; the same call without the layout reads them (its checks)
    and gives the same output bit for bit, which is ``forward``'s."""
    model, inputs = tiny_model(), tiny_inputs()
    model.set_moe_backend("torch_grouped")
    with torch.no_grad():
        expected = model(**inputs).sample
        packed = model.pack_inputs(*inputs.values())
        with _CountHostReads(monkeypatch) as counter:
            out = model.forward_packed(*_packed_args(packed), layout=packed.layout)
        assert counter.reads == []
        assert torch.equal(model.unpack_outputs(out, packed)[0], expected)
        with _CountHostReads(monkeypatch) as counter:
            checked = model.forward_packed(*_packed_args(packed))
        assert counter.reads and torch.equal(checked, out)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"cu_seqlens": torch.tensor([0, 5])}, r"cu_seqlens must rise from 0 to N="),
        ({"modality_mapping": 5}, r"modality_mapping must hold Modality ids"),
        ({"coords": None}, r"coords: a size of 1 needs a reference of 1"),
        ({"time_embedding": torch.zeros(3, 64)}, r"time_embedding must be \[\d+, 64\]"),
    ],
)
def test_forward_packed_without_the_layout_checks_its_inputs(change, message):
    model, inputs = tiny_model(), tiny_inputs()
    packed = model.pack_inputs(*inputs.values())
    args = dict(
        zip(("hidden_states", "coords", "modality_mapping", "cu_seqlens", "time_embedding"), _packed_args(packed))
    )
    ((name, value),) = change.items()
    if name == "modality_mapping":
        value = args[name].clone().index_fill_(0, torch.tensor([7]), value)
    elif name == "coords":  # the first token's axis 0: size 1, reference 2 (an infinite rope scale)
        value = args[name].clone()
        value[0, 3], value[0, 6] = 1.0, 2.0
    args[name] = value
    with torch.no_grad(), pytest.raises(ValueError, match=message):
        model.forward_packed(**args)


def test_layout_of_a_shard():
    layout = Magi2PackedLayout((6, 4), ((0, 3), (2, 3), (0, 2), (1, 2)))
    assert layout.group_sizes() == (5, 2, 3)
    assert layout.group_sizes(2, 7) == (2, 0, 3)
