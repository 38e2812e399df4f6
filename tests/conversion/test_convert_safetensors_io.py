"""Our safetensors header parser and streaming shard writer, checked against the safetensors library."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from diffusers_magi2.utils.safetensors_io import (
    OutputTensor,
    ShardWriter,
    check_data_present,
    parse_size,
    plan_shards,
    read_safetensors_header,
    sort_metadata,
    write_index,
)


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(37, 5, generator=g).to(torch.bfloat16),
        "b.bias": torch.randn(3, generator=g),
        "c.scalar": torch.randn(1, generator=g),
        "d.experts": torch.randn(6, 4, 3, generator=g).to(torch.bfloat16),
        "e.ids": torch.arange(10, dtype=torch.int64),
    }


def test_header_matches_safetensors_library(tmp_path):
    path = tmp_path / "x.safetensors"
    save_file(_tensors(), str(path), metadata={"format": "pt"})
    header = read_safetensors_header(path)
    assert header.metadata == {"format": "pt"}
    assert check_data_present(header) is None
    assert header.expected_file_size == path.stat().st_size
    with safe_open(str(path), "pt") as f:
        assert set(f.keys()) == set(header.tensors)
        for k in f.keys():
            sl = f.get_slice(k)
            assert header.tensors[k].shape == tuple(sl.get_shape())
            assert header.tensors[k].dtype == sl.get_dtype()


def test_header_only_and_sparse_stubs(tmp_path):
    full = tmp_path / "full.safetensors"
    save_file(_tensors(), str(full))
    raw = full.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    stub = tmp_path / "stub.safetensors"
    stub.write_bytes(raw[: 8 + n])  # header only
    header = read_safetensors_header(stub)
    assert set(header.tensors) == set(_tensors())
    problem = check_data_present(header)
    assert problem is not None and "truncated" in problem
    sparse = tmp_path / "sparse.safetensors"
    sparse.write_bytes(raw[: 8 + n])
    with open(sparse, "r+b") as fh:
        fh.truncate(len(raw))  # a hole where the data would be
    assert check_data_present(read_safetensors_header(sparse)) is None


@pytest.mark.parametrize(
    "payload, match",
    [
        (b"\x01\x00", "not a safetensors file"),
        (struct.pack("<Q", 1000) + b"{}", "truncated header"),
        (struct.pack("<Q", 4) + b"nope", "not valid JSON"),
        (struct.pack("<Q", 2 * 10**9), "exceeds"),
    ],
)
def test_bad_headers_raise_naming_the_file(tmp_path, payload, match):
    p = tmp_path / "bad.safetensors"
    p.write_bytes(payload)
    with pytest.raises(ValueError, match=match) as err:
        read_safetensors_header(p)
    assert "bad.safetensors" in str(err.value)


def test_inconsistent_offsets_raise(tmp_path):
    header = {"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 8]}}
    raw = json.dumps(header).encode()
    p = tmp_path / "off.safetensors"
    p.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(8))
    with pytest.raises(ValueError, match="needs 16 bytes"):
        read_safetensors_header(p)


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("10KB") == 10_000
    assert parse_size("2GiB") == 2 * 1024**3
    assert parse_size(123) == 123
    for bad in ("five", "0MB", "-1"):
        with pytest.raises(ValueError):
            parse_size(bad)


def test_plan_shards_sizes_names_and_alignment():
    ts = [OutputTensor(f"t{i}", "BF16" if i % 2 else "F32", (i + 1, 3)) for i in range(10)]
    layouts = plan_shards(ts, max_shard_size=60)
    assert all(lay.data_size <= 60 or len(lay.offsets) == 1 for lay in layouts)
    assert [lay.filename for lay in layouts] == [
        f"diffusion_pytorch_model-{i + 1:05d}-of-{len(layouts):05d}.safetensors" for i in range(len(layouts))
    ]
    assert sorted(n for lay in layouts for n in lay.offsets) == sorted(t.name for t in ts)
    by_name = {t.name: t for t in ts}
    for lay in layouts:
        assert (len(lay.header) - 8) % 8 == 0
        for name, (b, e) in lay.offsets.items():
            item = 4 if by_name[name].dtype == "F32" else 2
            assert b % item == 0 and e - b == by_name[name].nbytes
    single = plan_shards(ts, max_shard_size=10**9)
    assert [lay.filename for lay in single] == ["diffusion_pytorch_model.safetensors"]
    with pytest.raises(ValueError, match="duplicate"):
        plan_shards(ts + ts[:1], 100)


@pytest.mark.parametrize("chunk_bytes", [7, 64, 1 << 20])
def test_streamed_shards_load_bit_exactly(tmp_path, chunk_bytes):
    """Cast (chunked pread + copy_) or copy (kernel) every tensor into shards; read back with the library."""
    import os

    src = tmp_path / "src.safetensors"
    tensors = _tensors()
    save_file(tensors, str(src))
    header = read_safetensors_header(src)
    casts = {"a.weight": torch.float32, "d.experts": torch.float32, "b.bias": torch.bfloat16}
    code = {torch.float32: "F32", torch.bfloat16: "BF16", torch.int64: "I64"}
    outs = [OutputTensor(k, code[casts.get(k, v.dtype)], tuple(v.shape)) for k, v in tensors.items()]
    layouts = plan_shards(outs, max_shard_size=200)
    assert len(layouts) > 1
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    fd = os.open(src, os.O_RDONLY)
    try:
        with ShardWriter(out_dir, layouts) as w:
            for k in tensors:
                info = header.tensors[k]
                start = header.data_start + info.data_offsets[0]
                if k in casts:
                    w.cast_bytes(k, fd, start, info.nbytes, info.dtype, chunk_bytes)
                else:
                    w.copy_bytes(k, fd, start, info.nbytes)
    finally:
        os.close(fd)
    index = write_index(out_dir, layouts)
    weight_map = json.loads(index.read_text())["weight_map"]
    loaded = {}
    for fname in set(weight_map.values()):
        loaded.update(load_file(str(out_dir / fname)))
    assert set(loaded) == set(tensors)
    for k, v in tensors.items():
        expected = v.to(casts.get(k, v.dtype))
        assert loaded[k].dtype == expected.dtype and torch.equal(loaded[k], expected)


def test_writer_rejects_short_or_long_tensors(tmp_path):
    layouts = plan_shards([OutputTensor("w", "F32", (4,))], 100)
    with pytest.raises(ValueError, match="incomplete output tensors: w: 8 of 16"):
        with ShardWriter(tmp_path, layouts) as w:
            w.write_chunk("w", torch.zeros(2))
    (tmp_path / layouts[0].filename).unlink()
    with pytest.raises(ValueError, match="planned 16"):
        with ShardWriter(tmp_path, layouts) as w:
            w.write_chunk("w", torch.zeros(5))


@pytest.mark.parametrize("kernel_copy", [True, False])
def test_copy_bytes_is_byte_exact(tmp_path, kernel_copy):
    """Same-dtype tensors are copied file to file (``copy_file_range``, or the buffered path)."""
    import os

    src = tmp_path / "src.safetensors"
    tensors = _tensors()
    save_file(tensors, str(src))
    header = read_safetensors_header(src)
    outs = [OutputTensor(k, header.tensors[k].dtype, header.tensors[k].shape) for k in tensors]
    layouts = plan_shards(outs, max_shard_size=150)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    fd = os.open(src, os.O_RDONLY)
    try:
        with ShardWriter(out_dir, layouts) as w:
            w._kernel_copy = kernel_copy and hasattr(os, "copy_file_range")
            for k in tensors:
                info = header.tensors[k]
                half = info.nbytes // 2
                w.copy_bytes(k, fd, header.data_start + info.data_offsets[0], half)
                w.copy_bytes(k, fd, header.data_start + info.data_offsets[0] + half, info.nbytes - half)
    finally:
        os.close(fd)
    write_index(out_dir, layouts)
    loaded = {}
    for lay in layouts:
        loaded.update(load_file(str(out_dir / lay.filename)))
    assert all(torch.equal(loaded[k], v) and loaded[k].dtype == v.dtype for k, v in tensors.items())


def test_sort_metadata_makes_two_saves_of_the_same_tensors_the_same_bytes(tmp_path):
    """safetensors writes the metadata keys in hash order (it differs between calls); after ``sort_metadata`` every
    save is the same bytes, and the library reads back the same tensors and metadata (non-ASCII included: its
    header is re-encoded to another length)."""
    metadata = {f"key{i}": f"value {i}" for i in range(8)} | {"format": "pt"}
    files = []
    for i, extra in enumerate([{}] * 6 + [{"note": "\u00e9t\u00e9"}] * 2):
        path = tmp_path / f"{i}.safetensors"
        save_file(_tensors(), str(path), metadata=metadata | extra)
        files.append(path.read_bytes())
        sort_metadata(path)
    assert len(set(files[:6])) > 1  # so the check below can fail
    sorted_files = [(tmp_path / f"{i}.safetensors").read_bytes() for i in range(8)]
    assert len(set(sorted_files[:6])) == 1 and len(set(sorted_files[6:])) == 1
    for path in (tmp_path / "0.safetensors", tmp_path / "7.safetensors"):
        with safe_open(str(path), "pt") as f:
            assert f.metadata() == metadata | ({"note": "\u00e9t\u00e9"} if path.stem == "7" else {})
        assert all(torch.equal(load_file(str(path))[k], v) for k, v in _tensors().items())
