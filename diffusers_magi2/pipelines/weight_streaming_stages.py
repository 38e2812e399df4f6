"""Stage-sequential host memory under weight streaming: one streamed model holds its weights at a time.

A MAGI-2 call runs its streamed models one after the other, each to its end: the text encoder, the preview
transformer, the refiner. A diffusers :class:`~diffusers.hooks.ModelHook` on each streamed model's ``forward``
enters that model's stage: it frees the weights of the streamed model held before (its packed host buffers, its
device ring and its weights outside the blocks) and re-reads this model's from its safetensors files, straight into
fresh host buffers (and, for the weights outside the blocks, onto the device)::

    host memory    = max over the streamed models (their host buffers), not the sum
    time per call += sum over the streamed models (their bytes in the files) / the disk's read rate

A streamed model is released only if its weights can be re-read: a model loaded by ``from_pretrained`` (its folder
is ``config._name_or_path``) whose every tensor has a counterpart in the folder's safetensors files with the same
shape, and the same dtype or a floating-point one it is cast from (``torch_dtype``, layerwise casting); checked at
enable by name, shape and dtype, and byte for byte (after the cast) on the first block of each size and on every
weight outside the blocks. A pipeline built in memory has no files: its streamed models stay held (host memory is
their sum). A tensor the files lack (a non-persistent buffer, e.g. rotary ``inv_freq``) is kept: outside the
blocks it stays where it is; inside a block, as a host copy. Released weights are not held at all between stages,
so the first forward of each stage pays its read. The stage begins in the model's ``forward`` (what the pipeline
calls); a direct call to another entry point (e.g. ``forward_packed``) finds the model's weights freed.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import torch
from diffusers.hooks import HookRegistry, ModelHook

from ..models.weight_streaming import WeightStreamer
from ..models.weight_streaming_disk import check_file_bytes
from ..utils.safetensors_io import DTYPE_TO_TORCH, read_safetensors_header


__all__ = ["STAGE_HOOK", "Reread", "StagedHostMemory", "model_folder", "plan_reread"]

#: The :class:`~diffusers.hooks.HookRegistry` name of the stage hook on each released model.
STAGE_HOOK = "magi2_weight_streaming_stage"


def model_folder(model: torch.nn.Module) -> Optional[str]:
    """The local folder ``model`` was loaded from (transformers ``name_or_path``, diffusers ``_name_or_path``) when
    it holds safetensors files, else ``None``."""
    path = getattr(model, "name_or_path", None)
    if not path:
        config = getattr(model, "config", None)
        path = config.get("_name_or_path") if isinstance(config, dict) else None
    if path and os.path.isdir(path) and glob.glob(os.path.join(path, "*.safetensors")):
        return str(path)
    return None


def _unique_tensors(model: torch.nn.Module) -> List[torch.Tensor]:
    seen, out = set(), []
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


@dataclass
class _Outside:
    """A weight outside the blocks, re-read from the files onto the device it lives on."""

    tensor: torch.Tensor
    key: str


@dataclass
class Reread:
    """How one streamed model's weights are freed and read back from its files (built by :func:`plan_reread`)."""

    name: str
    folder: str
    files: Dict[str, str]  # file key -> path
    keys: Dict[int, str]  # id(tensor) -> file key, for the tensors read back
    outside: List[_Outside]
    file_nbytes: int  # bytes read from the files per re-read
    kept: Dict[int, torch.Tensor] = field(default_factory=dict)  # id(block tensor) -> host copy (no file key)
    streamer: Optional[WeightStreamer] = None
    held: bool = True

    def keep_keyless(self) -> None:
        """Copy the block tensors the files lack (before the first :meth:`free`)."""
        for block in self.streamer.blocks:
            for e in block.entries:
                if id(e.tensor) not in self.keys:
                    self.kept[id(e.tensor)] = e.tensor.data.detach().to("cpu", copy=True)

    def free(self) -> None:
        """Free the host buffers, the device ring and the weights outside the blocks."""
        self.streamer.free()
        for o in self.outside:
            o.tensor.data = torch.empty(0, dtype=o.tensor.dtype, device=o.tensor.device)
        self.held = False

    def refill(self) -> None:
        """Read the weights back from the files (each tensor cast as the loader cast it)."""
        from safetensors import safe_open

        handles = {}

        def load(key: str) -> torch.Tensor:
            path = self.files[key]
            if path not in handles:
                handles[path] = safe_open(path, framework="pt", device="cpu")
            return handles[path].get_tensor(key)

        def read(tensor: torch.Tensor, view: torch.Tensor) -> None:
            key = self.keys.get(id(tensor))
            view.copy_(self.kept[id(tensor)] if key is None else load(key))

        self.streamer.allocate(read)
        for o in self.outside:
            # a copy: on the CPU safetensors hands out views of the mapped file
            o.tensor.data = load(o.key).to(device=o.tensor.device, dtype=o.tensor.dtype, copy=True)
        handles.clear()
        self.held = True


def _nbytes(header) -> int:
    return header.data_offsets[1] - header.data_offsets[0]


def _file_key(name: str, files: Dict[str, str], by_suffix: Dict[str, List[str]]) -> Optional[str]:
    """``name`` in the files, or the one file key ending in ``.name`` (a checkpoint saved with a prefix)."""
    if name in files:
        return name
    found = by_suffix.get(name, [])
    return found[0] if len(found) == 1 else None


def plan_reread(name: str, model: torch.nn.Module, blocks: Sequence[torch.nn.Module]) -> Reread:
    """Check that ``model``'s weights can be re-read from the folder it was loaded from, before anything moves.

    Args:
        name: the pipeline component's name (for messages).
        model: the streamed model, as loaded.
        blocks: its streamed blocks.

    Returns:
        the :class:`Reread` (its ``streamer`` is set once streaming is applied).

    Raises:
        ValueError: no safetensors folder (a model built in memory), or a tensor whose file counterpart differs in
            shape, in a dtype it is not cast from, or in its bytes after the cast.
    """
    folder = model_folder(model)
    if folder is None:
        raise ValueError(f"{name} was not loaded from a folder of safetensors files (built in memory?)")
    headers, files = {}, {}
    for path in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        for key, header in read_safetensors_header(path).tensors.items():
            headers[key], files[key] = header, path
    by_suffix: Dict[str, List[str]] = {}
    for key in files:
        parts = key.split(".")
        for i in range(1, len(parts)):
            by_suffix.setdefault(".".join(parts[i:]), []).append(key)
    names = {}
    for tensor_name, t in model.state_dict(keep_vars=True).items():
        names.setdefault(id(t), tensor_name)
    keys = {}
    for t in _unique_tensors(model):
        key = _file_key(names[id(t)], files, by_suffix) if id(t) in names else None
        if key is None:
            continue
        header = headers[key]
        file_dtype = DTYPE_TO_TORCH.get(header.dtype)
        castable = file_dtype == t.dtype or (
            file_dtype is not None and file_dtype.is_floating_point and t.dtype.is_floating_point
        )
        if tuple(header.shape) != tuple(t.shape) or not castable:
            raise ValueError(
                f"{name}'s {names[id(t)]} ({tuple(t.shape)}, {t.dtype}) is not what {files[key]} holds as {key} "
                f"({tuple(header.shape)}, {header.dtype}): it was changed after loading"
            )
        keys[id(t)] = key
    block_ids = {id(t) for b in blocks for t in _unique_tensors(b)}
    outside = [_Outside(t, keys[id(t)]) for t in _unique_tensors(model) if id(t) not in block_ids and id(t) in keys]
    first_of_size = {}
    for b in blocks:
        first_of_size.setdefault(sum(t.nbytes for t in _unique_tensors(b)), b)
    checked = [t for b in first_of_size.values() for t in _unique_tensors(b) if id(t) in keys]
    checked += [o.tensor for o in outside]
    why = "it was transformed after loading (quantized, scaled, fused or trained), so it cannot be re-read"
    check_file_bytes(name, checked, keys, files, names, why)
    file_nbytes = sum(_nbytes(headers[k]) for k in set(keys.values()))
    return Reread(name, folder, files, keys, outside, file_nbytes)


class _StageHook(ModelHook):
    """Before a released model runs: its stage begins (the held model freed, this one read back)."""

    def __init__(self, stages: "StagedHostMemory", name: str) -> None:
        super().__init__()
        self.stages, self.name = stages, name

    @torch.compiler.disable
    def pre_forward(self, module, *args, **kwargs):
        self.stages.enter(self.name)
        return args, kwargs


class StagedHostMemory:
    """The released models of a streamed pipeline and the one whose stage runs (``held``)."""

    def __init__(self, parts: Dict[str, Reread], models: Dict[str, torch.nn.Module]) -> None:
        self.parts, self.models = parts, models
        self.held: Optional[str] = None

    def install(self) -> None:
        """Hook every released model and free its weights (none is held until its stage)."""
        for name, part in self.parts.items():
            part.keep_keyless()
            part.free()
            HookRegistry.check_if_exists_or_initialize(self.models[name]).register_hook(
                _StageHook(self, name), STAGE_HOOK
            )

    def enter(self, name: str) -> None:
        """Free the model held before and read ``name``'s weights back (nothing when ``name`` is held)."""
        if self.held == name:
            return
        if self.held is not None:
            self.parts[self.held].free()
        self.held = None
        self.parts[name].refill()
        self.held = name

    def remove(self, name: str) -> None:
        """Unhook ``name`` and read its weights back, so its streaming can be removed."""
        HookRegistry.check_if_exists_or_initialize(self.models[name]).remove_hook(STAGE_HOOK, recurse=False)
        if not self.parts[name].held:
            self.parts[name].refill()
        if self.held == name:
            self.held = None
