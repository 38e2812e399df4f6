"""Data of the ``examples/train_lora.py`` tests: a synthetic cached clip, a small video file, the common flags."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file


__all__ = ["argv", "synthetic_clip", "write_video"]


def synthetic_clip(folder: Path, seed: int = 0, frames: int = 2) -> Path:
    """One cached clip for the tiny random model: latents ``[48, T, 2, 2]``, 5 text states of width 64."""
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    save_file(
        {"latents": torch.randn(48, frames, 2, 2, generator=g), "text_states": torch.randn(5, 64, generator=g)},
        str(folder / "clip.magi2.safetensors"),
    )
    return folder


def argv(data: Path, out: Path, *extra: str) -> list[str]:
    return ["--data_dir", str(data), "--output_dir", str(out), "--rank", "4", "--seed", "3", *extra]


def write_video(path: Path, size: tuple[int, int], frames: int = 5) -> None:
    import av

    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=12)
        stream.width, stream.height, stream.pix_fmt = size[0], size[1], "yuv420p"
        for i in range(frames):
            img = np.full((size[1], size[0], 3), 40 * i, dtype=np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
