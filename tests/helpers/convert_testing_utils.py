"""Helpers shared by the converter tests (``tests/conversion/test_convert_*.py``).

Everything works on copies of the read-only golden fixtures in a ``tmp_path``; nothing here
changes a fixture.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .fixtures import fixtures_root


TINY = fixtures_root() / "magi2_tiny"
FULL = fixtures_root() / "full_size"
INDEX = "model.safetensors.index.json"


def checkpoint_dir(variant: str) -> Path:
    """``magi2_tiny/<variant>/sandai_checkpoint`` (variant: preview_h4, preview_h3, refiner)."""
    return TINY / variant / "sandai_checkpoint"


def config_path(variant: str) -> Path:
    """The SandAI JSON stored beside a tiny checkpoint (without the fixtures, a path that names the missing folder, so
    each test that reads it fails on its own instead of the collection)."""
    return next(iter(sorted(checkpoint_dir(variant).glob("magi2_*.json"))), checkpoint_dir(variant) / "magi2_*.json")


def copy_checkpoint(variant: str, dst: Path) -> Path:
    """Copy a tiny SandAI checkpoint folder (shards, index, config) to ``dst`` (writable copies)."""
    dst.mkdir(parents=True, exist_ok=True)
    for p in checkpoint_dir(variant).iterdir():
        shutil.copyfile(p, dst / p.name)
    return dst


def read_index(ckpt: Path) -> dict:
    return json.loads((ckpt / INDEX).read_text())


def write_index(ckpt: Path, index: dict) -> None:
    (ckpt / INDEX).write_text(json.dumps(index, indent=2))


def shard_of(ckpt: Path, key: str) -> str:
    return read_index(ckpt)["weight_map"][key]


def rewrite_shard(
    ckpt: Path, fname: str, mutate: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]
) -> None:
    """Load one shard, apply ``mutate`` to its tensor dict and save it back (``{"format": "pt"}``)."""
    tensors = load_file(str(ckpt / fname))
    save_file(mutate(dict(tensors)), str(ckpt / fname), metadata={"format": "pt"})


def mutate_tensor(ckpt: Path, key: str, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Replace tensor ``key`` (in the shard the index names) by ``fn(tensor)``."""

    def mutate(t):
        t[key] = fn(t[key]).contiguous()
        return t

    rewrite_shard(ckpt, shard_of(ckpt, key), mutate)


def load_case(variant: str, precision: str = "fp32") -> dict[str, torch.Tensor]:
    return load_file(str(TINY / variant / precision / "transformer_case.safetensors"))


def preview_forward(model, case: dict[str, torch.Tensor], prefix: str = "model.") -> torch.Tensor:
    """Run ``Magi2Transformer3DModel.forward_packed`` on a fixture case's packed inputs (reference
    ``Transformer.forward`` arguments, README "transformer_case"); returns ``[S, C_out]`` fp32."""
    with torch.no_grad():
        out = model.forward_packed(
            case[prefix + "x"],
            case[prefix + "coords_mapping"],
            case[prefix + "modality_mapping"],
            case[prefix + "cu_seqlens_q"],
            case[prefix + "time_token_sequence"],
        )
    return out[:, : case[prefix + "out"].shape[1]].float()


def run_cli(args: list[str]) -> tuple[int, str, str]:
    """Run ``magi2-convert`` in-process; returns ``(exit status, stdout, stderr)``."""
    from diffusers_magi2.conversion.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main([str(a) for a in args])
    return rc, out.getvalue(), err.getvalue()


def read_tsv(name: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """A full-size key table: SandAI key -> (shape, safetensors dtype code)."""
    codes = {"float32": "F32", "bfloat16": "BF16"}
    rows = {}
    for line in (FULL / name).read_text().splitlines():
        if not line or line.startswith("#"):
            continue
        key, shape, dtype = line.split("\t")
        rows[key] = (tuple(json.loads(shape)), codes[dtype])
    return rows


def write_header_only_checkpoint(rows: dict[str, tuple[tuple[int, ...], str]], dst: Path, num_shards: int) -> Path:
    """Write a SandAI-layout checkpoint of header-only stub shards (8-byte length + JSON, no data).

    Keys are spread round-robin by position over ``num_shards`` files named like the release
    (``model-0000i-of-0000n.safetensors``); the index carries the full ``weight_map``.
    """
    itemsize = {"F32": 4, "BF16": 2}
    dst.mkdir(parents=True, exist_ok=True)
    names = [f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors" for i in range(num_shards)]
    per_shard: list[dict] = [{} for _ in names]
    weight_map = {}
    for i, (key, (shape, dtype)) in enumerate(rows.items()):
        s = i * num_shards // len(rows)
        weight_map[key] = names[s]
        per_shard[s][key] = (shape, dtype)
    total = 0
    for fname, entries in zip(names, per_shard):
        header, pos = {"__metadata__": {"format": "pt"}}, 0
        for key, (shape, dtype) in entries.items():
            n = itemsize[dtype]
            for d in shape:
                n *= d
            header[key] = {"dtype": dtype, "shape": list(shape), "data_offsets": [pos, pos + n]}
            pos += n
        total += pos
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        (dst / fname).write_bytes(struct.pack("<Q", len(raw)) + raw)
    write_index(dst, {"metadata": {"total_size": total}, "weight_map": weight_map})
    return dst


def expert_bytes(folder: Path) -> tuple[int, int]:
    """(bytes of the routed-expert banks, bytes of their scales: FP8 ``*_scale``, int4 ``*_group_scale``) in a
    converted repo's shards."""
    from diffusers_magi2.utils.safetensors_io import read_safetensors_header

    banks = scales = 0
    for shard in Path(folder).glob("*.safetensors"):
        for name, t in read_safetensors_header(shard).tensors.items():
            leaf = name.rsplit(".", 1)[-1]
            banks += t.nbytes if leaf in ("W_gate", "W_up", "W_down") else 0
            scales += t.nbytes if leaf.endswith("_scale") else 0
    return banks, scales
