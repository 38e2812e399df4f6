"""Safetensors I/O without MAGI-2 knowledge: a header parser, row readers, the checkpoint index reader and a
streaming writer.

Format: ``u64`` little-endian header length ``N``, ``N`` bytes of JSON ``{name: {dtype, shape, data_offsets}, "__metadata__"}``,
then the data (offsets relative to it, C order). The parser reads headers only, so ``--dry_run`` works on stub
files that ``safe_open`` refuses. :class:`ShardWriter` creates each planned shard at its final size and writes
every tensor at its offset: kept bytes are copied file to file by the kernel, cast ones in reused chunk buffers,
so no shard or tensor is held in memory. Headers are space-padded to 8 bytes, as safetensors does.
"""

from __future__ import annotations

import errno
import json
import math
import os
import shutil
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .byte_sizes import parse_size


__all__ = [
    "take_rows",
    "DTYPE_ITEMSIZE",
    "DTYPE_TO_TORCH",
    "TORCH_TO_DTYPE",
    "SafetensorsHeader",
    "ShardLayout",
    "ShardWriter",
    "TensorHeader",
    "OutputTensor",
    "check_data_present",
    "check_safetensors_file",
    "encode_header",
    "parse_size",
    "plan_shards",
    "read_index",
    "read_rows",
    "read_safetensors_header",
    "record_loaded_files",
    "sort_metadata",
    "write_index",
]

#: safetensors dtype code -> torch dtype (the codes the format defines that torch can hold).
DTYPE_TO_TORCH: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
TORCH_TO_DTYPE: dict[torch.dtype, str] = {v: k for k, v in DTYPE_TO_TORCH.items()}
#: bytes per element for each dtype code.
DTYPE_ITEMSIZE: dict[str, int] = {k: torch.empty((), dtype=v).element_size() for k, v in DTYPE_TO_TORCH.items()}

# A header larger than this is certainly not a safetensors header (the format caps it at 100 MB).
_MAX_HEADER_BYTES = 100 * 1024 * 1024
# Default chunk size for streaming a tensor: bounded so no tensor is ever fully materialised.
DEFAULT_CHUNK_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class OutputTensor:
    """A tensor to be written: name, safetensors dtype code and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_ITEMSIZE[self.dtype]


@dataclass(frozen=True)
class TensorHeader(OutputTensor):
    """One tensor entry of a safetensors header (``data_offsets`` relative to the data section)."""

    data_offsets: tuple[int, int]


@dataclass(frozen=True)
class SafetensorsHeader:
    """Parsed header of one safetensors file (``tensors`` in data-offset order, ``data_start`` = 8 + header length)."""

    path: Path
    data_start: int
    tensors: dict[str, TensorHeader]
    metadata: dict[str, str] = field(default_factory=dict)

    @property
    def data_size(self) -> int:
        """Bytes the data section must hold (the largest end offset)."""
        return max((t.data_offsets[1] for t in self.tensors.values()), default=0)

    @property
    def expected_file_size(self) -> int:
        return self.data_start + self.data_size


def read_safetensors_header(path: str | os.PathLike) -> SafetensorsHeader:
    """Read and validate (dtypes, shapes, offset lengths, no overlap) a safetensors header without its data.

    Raises:
        ValueError: the file is missing, shorter than its header, or the header is invalid (file and fault named).
    """
    path = Path(path)
    try:
        with open(path, "rb") as fh:
            prefix = fh.read(8)
            if len(prefix) < 8:
                raise ValueError(
                    f"{path}: not a safetensors file (only {len(prefix)} bytes; the 8-byte header length is missing)"
                )
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > _MAX_HEADER_BYTES:
                raise ValueError(
                    f"{path}: declared header length {header_len} bytes exceeds the 100 MB limit; not a safetensors file"
                )
            raw = fh.read(header_len)
    except FileNotFoundError:
        raise ValueError(f"{path}: file not found") from None
    except IsADirectoryError:
        raise ValueError(f"{path}: is a directory, expected a safetensors file") from None
    if len(raw) < header_len:
        raise ValueError(f"{path}: truncated header ({len(raw)} of {header_len} bytes present)")
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: header is not valid JSON ({err})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: header must be a JSON object, got {type(obj).__name__}")
    metadata = obj.pop("__metadata__", None) or {}
    entries: list[TensorHeader] = []
    for name, info in obj.items():
        try:
            dtype = info["dtype"]
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(o) for o in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(
                f"{path}: header entry {name!r} lacks a valid dtype/shape/data_offsets: {info!r}"
            ) from None
        if dtype not in DTYPE_ITEMSIZE:
            raise ValueError(
                f"{path}: tensor {name!r} has unsupported dtype {dtype!r}; allowed: {sorted(DTYPE_ITEMSIZE)}"
            )
        if any(d < 0 for d in shape) or begin < 0 or end < begin:
            raise ValueError(f"{path}: tensor {name!r} has a negative shape or bad offsets {shape} {[begin, end]}")
        nbytes = math.prod(shape) * DTYPE_ITEMSIZE[dtype]
        if end - begin != nbytes:
            raise ValueError(
                f"{path}: tensor {name!r} {dtype}{list(shape)} needs {nbytes} bytes but its offsets span {end - begin}"
            )
        entries.append(TensorHeader(name, dtype, shape, (begin, end)))
    entries.sort(key=lambda t: t.data_offsets)
    for prev, cur in zip(entries, entries[1:]):
        if cur.data_offsets[0] < prev.data_offsets[1]:
            raise ValueError(f"{path}: tensors {prev.name!r} and {cur.name!r} overlap in the data section")
    return SafetensorsHeader(path, 8 + header_len, {t.name: t for t in entries}, dict(metadata))


def read_rows(header: SafetensorsHeader, name: str, row_start: int, num_rows: int) -> torch.Tensor:
    """Rows ``[row_start, row_start + num_rows)`` (dim 0) of tensor ``name``, read from the file into a new CPU tensor.

    Only those rows' bytes are read (``readinto`` the result; no memory map, so no page of the other rows is ever
    resident in this process); rows past the tensor's end are zero.

    Args:
        header: the file's :func:`read_safetensors_header`.

    Returns:
        ``[num_rows, *shape[1:]]`` in the stored dtype, with its own storage.

    Raises:
        ValueError: ``name`` is not in the file or is 0-d, a negative ``row_start``/``num_rows``, or the file ends early.
    """
    entry = header.tensors.get(name)
    if entry is None or not entry.shape:
        raise ValueError(f"{header.path}: no tensor {name!r} with a row dimension to read rows of")
    if row_start < 0 or num_rows < 0:
        raise ValueError(f"row_start and num_rows must be >= 0, got {row_start}, {num_rows} for {name!r}")
    out = torch.empty((num_rows, *entry.shape[1:]), dtype=DTYPE_TO_TORCH[entry.dtype])
    row_bytes = math.prod(entry.shape[1:]) * DTYPE_ITEMSIZE[entry.dtype]
    present = max(0, min(entry.shape[0], row_start + num_rows) - row_start)
    out[present:] = 0
    if present:
        view = memoryview(out.reshape(-1).view(torch.uint8).numpy())[: present * row_bytes]
        with open(header.path, "rb") as fh:
            fh.seek(header.data_start + entry.data_offsets[0] + row_start * row_bytes)
            done = 0
            while done < len(view):
                got = fh.readinto(view[done:])
                if not got:
                    raise ValueError(f"{header.path}: file ends inside {name!r} (truncated shard?)")
                done += got
    return out


def take_rows(source: Any, row_start: int, num_rows: int, name: str = "tensor") -> torch.Tensor:
    """Rows ``[row_start, row_start + num_rows)`` of ``source`` along dim 0; rows past its end are zero.

    Args:
        source: a ``torch.Tensor`` or a ``safe_open(...).get_slice(key)`` slice (safetensors may map the whole tensor
            for a slice; to read only the rows from a file use :func:`read_rows`).
        name: the tensor's name, for the error message.

    Returns:
        ``[num_rows, *shape[1:]]``: a view when every row exists (of the memory map for a slice), else a new tensor.

    Raises:
        ValueError: negative ``row_start`` or ``num_rows``.
    """
    if row_start < 0 or num_rows < 0:
        raise ValueError(f"row_start and num_rows must be >= 0, got {row_start}, {num_rows} for {name!r}")
    is_tensor = isinstance(source, torch.Tensor)
    shape = tuple(source.shape) if is_tensor else tuple(source.get_shape())
    stop = min(shape[0], row_start + num_rows)
    if stop - row_start == num_rows:
        return source[row_start:stop]
    dtype = source.dtype if is_tensor else DTYPE_TO_TORCH[source.get_dtype()]
    device = source.device if is_tensor else "cpu"
    out = torch.zeros((num_rows, *shape[1:]), dtype=dtype, device=device)
    if stop > row_start:
        out[: stop - row_start] = source[row_start:stop]
    return out


def read_index(directory: str | os.PathLike, index_name: str, single_name: str) -> dict[str, str] | None:
    """The ``weight_map`` (tensor name -> shard file name) of the checkpoint in ``directory``.

    Args:
        index_name: the index file, e.g. ``"model.safetensors.index.json"``.
        single_name: the unsharded file, e.g. ``"model.safetensors"``.

    Returns:
        the index's ``weight_map``; ``None`` when there is no index but ``single_name`` exists.

    Raises:
        ValueError: neither file exists, or the index has no valid ``weight_map``.
    """
    directory = Path(directory)
    index_path = directory / index_name
    if not index_path.is_file():
        if (directory / single_name).is_file():
            return None
        raise ValueError(f"{directory} holds neither {index_name} nor {single_name}")
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise TypeError
    except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError):
        raise ValueError(
            f"{index_path}: not a valid safetensors index (needs a JSON object with a 'weight_map' of key -> file)"
        ) from None
    return dict(weight_map)


def check_safetensors_file(path: str | os.PathLike, index: str | os.PathLike | None = None) -> None:
    """Raise a ``ValueError`` naming ``path`` when it is missing or safetensors cannot open it (truncated, corrupt;
    a truncated file's message also names the tensors whose data is cut off).

    Args:
        index: the index file that names ``path``, for the message.
    """
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    named_by = "" if index is None else f", named by {Path(index).name}"
    if not path.is_file():
        raise ValueError(f"checkpoint shard {path} does not exist{named_by}")
    try:
        with safe_open(str(path), framework="pt"):
            pass
    except SafetensorError as err:
        size = path.stat().st_size
        try:  # name the tensors whose bytes are missing, where the header itself is whole
            header = read_safetensors_header(path)
            cut = [n for n, t in header.tensors.items() if header.data_start + t.data_offsets[1] > size]
        except ValueError:
            cut = []
        lost = f"; the data of {', '.join(cut)} is cut off" if cut else ""
        raise ValueError(
            f"checkpoint shard {path} ({size} bytes{named_by}) is not a complete safetensors file "
            f"(truncated by an interrupted download or copy?){lost}: {err}"
        ) from err


def check_data_present(header: SafetensorsHeader) -> str | None:
    """A problem message if the file is shorter than its header says (truncated), else ``None``."""
    actual = header.path.stat().st_size
    if actual < header.expected_file_size:
        return (
            f"{header.path.name}: truncated shard: its header needs {header.expected_file_size} bytes, "
            f"the file has {actual}"
        )
    return None


@dataclass(frozen=True)
class ShardLayout:
    """One output shard, fully determined before any data is read (``offsets`` absolute in the file)."""

    filename: str
    header: bytes
    offsets: dict[str, tuple[int, int]]
    file_size: int
    dtypes: dict[str, str] = field(default_factory=dict)

    @property
    def data_size(self) -> int:
        return self.file_size - len(self.header)


def encode_header(
    tensors: Sequence[OutputTensor], metadata: dict[str, str] | None = None
) -> tuple[bytes, dict[str, tuple[int, int]]]:
    """Encode a safetensors header for ``tensors`` laid out back to back in the given order.

    Returns:
        ``(prefix, rel_offsets)``: the 8-byte length + space-padded JSON, and each tensor's
        ``(begin, end)`` relative to the data section.
    """
    obj: dict[str, object] = {"__metadata__": dict(metadata or {"format": "pt"})}
    rel: dict[str, tuple[int, int]] = {}
    pos = 0
    for t in tensors:
        if t.name in rel:
            raise ValueError(f"tensor {t.name!r} appears twice in one shard")
        rel[t.name] = (pos, pos + t.nbytes)
        obj[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [pos, pos + t.nbytes]}
        pos += t.nbytes
    text = json.dumps(obj, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, rel


def sort_metadata(path: str | os.PathLike) -> None:
    """Rewrite ``path``'s header with its ``__metadata__`` keys sorted, so that two saves of the same tensors are the
    same bytes (the safetensors writer orders them by hash, differently on every call).

    Raises:
        ValueError: as :func:`read_safetensors_header`; tensors not laid out back to back in the data section.
    """
    header = read_safetensors_header(path)
    if len(header.metadata) < 2:
        return
    tensors = list(header.tensors.values())
    prefix, rel = encode_header(tensors, dict(sorted(header.metadata.items())))
    if any(rel[t.name] != t.data_offsets for t in tensors):
        raise ValueError(f"{path}: tensors are not laid out back to back; not rewritten")
    if len(prefix) == header.data_start:
        with open(path, "r+b") as fh:
            fh.write(prefix)
        return
    tmp = Path(f"{path}.sorted.tmp")
    with open(path, "rb") as src, open(tmp, "wb") as dst:
        src.seek(header.data_start)
        dst.write(prefix)
        shutil.copyfileobj(src, dst)
    os.replace(tmp, path)


def plan_shards(
    tensors: Sequence[OutputTensor],
    max_shard_size: int,
    weights_name: str = "diffusion_pytorch_model.safetensors",
    metadata: dict[str, str] | None = None,
) -> list[ShardLayout]:
    """Split ``tensors`` (in order) into shards of at most ``max_shard_size`` data bytes, named as ``save_pretrained``
    names them; inside a shard, larger elements first, so every tensor is aligned to its element size.

    Raises:
        ValueError: duplicate tensor names or a non-positive ``max_shard_size``.
    """
    if max_shard_size <= 0:
        raise ValueError(f"max_shard_size must be positive, got {max_shard_size}")
    names = [t.name for t in tensors]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"duplicate output tensor names: {dup}")
    groups: list[list[OutputTensor]] = []
    current: list[OutputTensor] = []
    size = 0
    for t in tensors:
        if current and size + t.nbytes > max_shard_size:
            groups.append(current)
            current, size = [], 0
        current.append(t)
        size += t.nbytes
    if current or not groups:
        groups.append(current)
    stem, ext = weights_name.rsplit(".", 1)
    layouts = []
    for i, group in enumerate(groups):
        ordered = sorted(group, key=lambda t: (-DTYPE_ITEMSIZE[t.dtype], t.name))
        header, rel = encode_header(ordered, metadata)
        offsets = {n: (b + len(header), e + len(header)) for n, (b, e) in rel.items()}
        filename = weights_name if len(groups) == 1 else f"{stem}-{i + 1:05d}-of-{len(groups):05d}.{ext}"
        layouts.append(
            ShardLayout(
                filename, header, offsets, len(header) + sum(t.nbytes for t in group), {t.name: t.dtype for t in group}
            )
        )
    return layouts


def write_index(
    folder: str | os.PathLike,
    layouts: Sequence[ShardLayout],
    weights_name: str = "diffusion_pytorch_model.safetensors",
) -> Path | None:
    """Write ``<weights_name>.index.json`` for a sharded layout; its path, or ``None`` for one file (no index)."""
    if len(layouts) == 1 and layouts[0].filename == weights_name:
        return None
    weight_map = {name: lay.filename for lay in layouts for name in sorted(lay.offsets)}
    index = {
        "metadata": {"total_size": sum(lay.data_size for lay in layouts)},
        "weight_map": dict(sorted(weight_map.items())),
    }
    path = Path(folder) / f"{weights_name}.index.json"
    path.write_text(json.dumps(index, indent=2) + "\n")
    return path


class ShardWriter:
    """Write planned shards chunk by chunk (a context manager; the caller writes into a temporary folder).

    Args:
        folder: existing directory to write into.
        layouts: from :func:`plan_shards`.
    """

    def __init__(self, folder: str | os.PathLike, layouts: Sequence[ShardLayout]):
        self.folder = Path(folder)
        self.layouts = list(layouts)
        self._where: dict[str, tuple[int, int, int]] = {}  # name -> (shard idx, begin, end)
        for i, lay in enumerate(self.layouts):
            for name, (b, e) in lay.offsets.items():
                self._where[name] = (i, b, e)
        self._written: dict[str, int] = dict.fromkeys(self._where, 0)
        self._dtypes: dict[str, str] = {name: lay.dtypes[name] for lay in self.layouts for name in lay.offsets}
        self._fds: list[int] = []
        self._kernel_copy = hasattr(os, "copy_file_range")

    def __enter__(self) -> ShardWriter:
        try:
            for lay in self.layouts:
                fd = os.open(self.folder / lay.filename, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
                self._fds.append(fd)
                os.pwrite(fd, lay.header, 0)
                os.ftruncate(fd, lay.file_size)
        except BaseException:
            self._close_fds()
            raise
        return self

    def write_chunk(self, name: str, chunk: torch.Tensor) -> None:
        """Append ``chunk`` (a contiguous tensor in the planned dtype) to tensor ``name``'s bytes.

        Raises:
            ValueError: unknown tensor name, or more bytes than planned.
        """
        if name not in self._where:
            raise ValueError(f"tensor {name!r} is not in the planned shard layout")
        idx, begin, end = self._where[name]
        data = chunk.contiguous().view(-1).view(torch.uint8).numpy() if chunk.numel() else b""
        n = len(data) if isinstance(data, bytes) else data.nbytes
        pos = begin + self._written[name]
        if pos + n > end:
            raise ValueError(f"tensor {name!r}: {self._written[name] + n} bytes written, planned {end - begin}")
        view = memoryview(data).cast("B") if n else b""
        while n:
            done = os.pwrite(self._fds[idx], view, pos)
            view, pos, n = view[done:], pos + done, n - done
        self._written[name] = pos - begin

    def copy_bytes(self, name: str, src_fd: int, src_offset: int, nbytes: int) -> None:
        """Append ``nbytes`` raw bytes of a source file to tensor ``name`` (``os.copy_file_range``, else one buffer).

        Raises:
            ValueError: unknown tensor name, more bytes than planned, or a source shorter than asked.
        """
        if name not in self._where:
            raise ValueError(f"tensor {name!r} is not in the planned shard layout")
        idx, begin, end = self._where[name]
        pos = begin + self._written[name]
        if pos + nbytes > end:
            raise ValueError(f"tensor {name!r}: {self._written[name] + nbytes} bytes written, planned {end - begin}")
        fd, src, left = self._fds[idx], src_offset, nbytes
        while left and self._kernel_copy:
            try:
                done = os.copy_file_range(src_fd, fd, min(left, 1 << 30), src, pos)
            except OSError as err:
                if err.errno not in (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
                    raise
                self._kernel_copy = False
                break
            if done == 0:
                raise ValueError(f"tensor {name!r}: source ended {left} bytes early")
            src, pos, left = src + done, pos + done, left - done
        if left:
            buf = bytearray(min(left, 16 * 1024 * 1024))
            view = memoryview(buf)
            while left:
                got = os.preadv(src_fd, [view[: min(left, len(buf))]], src)
                if got == 0:
                    raise ValueError(f"tensor {name!r}: source ended {left} bytes early")
                out = view[:got]
                while out:
                    w = os.pwrite(fd, out, pos)
                    out, pos = out[w:], pos + w
                src, left = src + got, left - got
        self._written[name] = pos - begin

    def cast_bytes(
        self,
        name: str,
        src_fd: int,
        src_offset: int,
        nbytes: int,
        src_dtype: str,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> None:
        """Append a source tensor's bytes to tensor ``name``, cast to its planned dtype ``chunk_bytes`` at a time.

        Args:
            src_dtype: safetensors dtype code of the source bytes (little-endian, C order).

        Raises:
            ValueError: unknown tensor name, more bytes than planned, or a source shorter than asked.
        """
        if name not in self._where:
            raise ValueError(f"tensor {name!r} is not in the planned shard layout")
        idx, begin, end = self._where[name]
        dst_dtype = self._dtypes[name]
        in_item, out_item = DTYPE_ITEMSIZE[src_dtype], DTYPE_ITEMSIZE[dst_dtype]
        count = nbytes // in_item
        pos = begin + self._written[name]
        if pos + count * out_item > end:
            raise ValueError(
                f"tensor {name!r}: {self._written[name] + count * out_item} bytes written, planned {end - begin}"
            )
        step = max(1, min(count, chunk_bytes // in_item))
        inbuf = bytearray(step * in_item)
        src_view = torch.frombuffer(inbuf, dtype=DTYPE_TO_TORCH[src_dtype]) if count else None
        out = torch.empty(step, dtype=DTYPE_TO_TORCH[dst_dtype])
        out_bytes = memoryview(out.view(torch.uint8).numpy())
        src, done = src_offset, 0
        while done < count:
            k = min(step, count - done)
            view = memoryview(inbuf)[: k * in_item]
            got = 0
            while got < len(view):
                n = os.preadv(src_fd, [view[got:]], src + got)
                if n == 0:
                    raise ValueError(f"tensor {name!r}: source ended early")
                got += n
            out[:k].copy_(src_view[:k])
            chunk = out_bytes[: k * out_item]
            while chunk:
                w = os.pwrite(self._fds[idx], chunk, pos)
                chunk, pos = chunk[w:], pos + w
            src, done = src + k * in_item, done + k
        self._written[name] = pos - begin

    def close(self) -> None:
        """Verify every tensor is complete, then close the files.

        Raises:
            ValueError: listing every tensor with a byte count other than planned.
        """
        self._close_fds()
        short = [
            f"{n}: {self._written[n]} of {e - b} bytes"
            for n, (_, b, e) in self._where.items()
            if self._written[n] != e - b
        ]
        if short:
            raise ValueError("incomplete output tensors: " + "; ".join(short))

    def _close_fds(self) -> None:
        while self._fds:
            os.close(self._fds.pop())

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self._close_fds()


#: attribute of a loaded model: ``[(path, size, mtime_ns)]`` of the checkpoint files it was loaded from
LOADED_FILES_ATTR = "_loaded_checkpoint_files"


def record_loaded_files(model, files) -> None:
    """Record on ``model`` (:data:`LOADED_FILES_ATTR`) the checkpoint files it is being loaded from, with their size
    and modification time; ``files`` other than a list of paths (a shard wrapper, state dicts) records nothing."""
    if isinstance(files, (list, tuple)) and files and all(isinstance(f, (str, os.PathLike)) for f in files):
        stats = [os.stat(f) for f in files]
        setattr(model, LOADED_FILES_ATTR, [(os.fspath(f), s.st_size, s.st_mtime_ns) for f, s in zip(files, stats)])
