"""What the tiny model's training scripts share: the one-line-error argument parser, the world's training clips,
and diffusers' checkpoint form (``accelerator.save_state`` into ``checkpoint-<step>/``, written under a temporary
name and renamed when complete; ``--resume_from_checkpoint latest`` continues from the newest complete one).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path


#: The size the tiny model is trained (and the main job generates) at: pixels, seconds.
HEIGHT, WIDTH, DURATION_S = 32, 32, 2.0


class OneLineParser(argparse.ArgumentParser):
    """argparse whose usage errors are one ``error: ...`` line on stderr and exit status 2."""

    def error(self, message: str):
        sys.stderr.write(f"error: {message} (see --help)\n")
        sys.exit(2)


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a finite float > 0."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0.0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value


def common_parser(description: str) -> OneLineParser:
    """The flags every tiny training script takes."""
    p = OneLineParser(description=description)
    p.add_argument("--output_dir", required=True, help="checkpoints and the trained weights")
    p.add_argument("--seed", type=int, default=0, help="seeds everything (accelerate.utils.set_seed)")
    p.add_argument("--max_train_steps", type=positive_int, required=True)
    p.add_argument("--train_batch_size", type=positive_int, default=8)
    p.add_argument("--learning_rate", type=positive_float, default=1e-3)
    p.add_argument(
        "--lr_scheduler",
        default="constant",
        choices=("constant", "constant_with_warmup", "cosine", "linear"),
        help="diffusers.optimization.get_scheduler's name",
    )
    p.add_argument("--lr_warmup_steps", type=int, default=0, help="steps of linear warm-up (>= 0)")
    p.add_argument("--checkpointing_steps", type=positive_int, default=100)
    p.add_argument("--resume_from_checkpoint", default=None, help="'latest' or a checkpoint-<step> folder")
    return p


def lr_scheduler(args, optimizer):
    """``diffusers.optimization.get_scheduler`` for ``--lr_scheduler`` over ``--max_train_steps``."""
    from diffusers.optimization import get_scheduler

    return get_scheduler(
        args.lr_scheduler,
        optimizer=optimizer,
        num_warmup_steps=args.lr_warmup_steps,
        num_training_steps=args.max_train_steps,
    )


def check_resume(parser: OneLineParser, args, checkpoints_dir: Path | None = None) -> tuple[Path, int] | None:
    """The checkpoint ``--resume_from_checkpoint`` names, as ``(folder, step)``, ``latest`` looking in
    ``checkpoints_dir`` (default ``--output_dir``: ``None`` when it holds none, a new run, as diffusers' training
    scripts do); a usage error for a named folder that is not a checkpoint."""
    if args.lr_warmup_steps < 0:
        parser.error(f"--lr_warmup_steps must be >= 0, got {args.lr_warmup_steps}")
    if args.resume_from_checkpoint is None:
        return None
    output_dir = Path(checkpoints_dir or args.output_dir)
    if args.resume_from_checkpoint == "latest":
        found = sorted(
            (p for p in output_dir.glob("checkpoint-*") if p.name.split("-")[-1].isdigit()),
            key=lambda p: int(p.name.split("-")[-1]),
        )
        if not found:
            print(f"--resume_from_checkpoint latest: no checkpoint-<step> folder in {output_dir}; starting a new run")
            return None
        folder = found[-1]
    else:
        folder = Path(args.resume_from_checkpoint)
        if not (folder.is_dir() and folder.name.startswith("checkpoint-") and folder.name.split("-")[-1].isdigit()):
            parser.error(f"--resume_from_checkpoint {str(folder)!r}: not a checkpoint-<step> folder")
    return folder, int(folder.name.split("-")[-1])


def save_checkpoint(accelerator, output_dir: Path, step: int) -> Path:
    """``accelerator.save_state`` into ``output_dir/checkpoint-<step>/``, written as ``.checkpoint-<step>.partial``
    and renamed once complete."""
    final, staging = output_dir / f"checkpoint-{step}", output_dir / f".checkpoint-{step}.partial"
    shutil.rmtree(staging, ignore_errors=True)
    accelerator.save_state(str(staging))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(staging, final)
    return final


def write_folder(save, final: Path) -> None:
    """Call ``save(staging)`` on a temporary folder beside ``final``, then rename it to ``final``."""
    staging = final.parent / f".{final.name}.partial"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    save(staging)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(staging, final)


def world_clips(triples, seeds, num_frames: int, height: int = HEIGHT, width: int = WIDTH):
    """Float32 pixels ``[N, 3, F, H, W]`` in [-1, 1] of every ``(triple, seed)`` pair, triples outer."""
    import numpy as np
    import torch

    from diffusers_magi2.pipelines.tiny_world import render_frames

    frames = [
        render_frames(*t, height=height, width=width, num_frames=num_frames, seed=s) for t in triples for s in seeds
    ]
    return torch.from_numpy(np.stack(frames)).permute(0, 4, 1, 2, 3).mul(2).sub(1).contiguous()


def world_audio(triples, seeds, num_samples: int, sample_rate: int):
    """Float32 waveforms ``[N, 2, S]`` of every ``(triple, seed)`` pair, triples outer."""
    import numpy as np
    import torch

    from diffusers_magi2.pipelines.tiny_world import render_audio

    audio = [
        render_audio(t[0], num_samples=num_samples, sample_rate=sample_rate, seed=s) for t in triples for s in seeds
    ]
    return torch.from_numpy(np.stack(audio))


#: Jitter seeds (per triple) whose clips give the video latent statistics.
STATS_SEEDS = 4


def encode_world_video(pipe, triples, num_seeds: int, extra_triples=()):
    """Pixels ``[N, 3, F, H, W]`` and normalised latents ``[N, C, T, h, w]`` of ``(triples + extra_triples)`` x
    ``range(num_seeds)`` (``num_seeds >= STATS_SEEDS``) through ``pipe.vae``'s encoder (posterior mode); the
    per-channel mean and std of ``triples``' first :data:`STATS_SEEDS` seeds' latents are written into ``pipe.vae``
    and ``pipe.video_decoder``'s configs (``latents_mean`` / ``latents_std``) and normalise the latents."""
    import torch

    geometry = pipe.latent_geometry()
    num_frames = 4 * (geometry.num_frames - 1) + 1
    pixels, mu = [], []
    for group in (triples, extra_triples) if extra_triples else (triples,):  # apart: the same batches as alone
        pixels.append(world_clips(group, range(num_seeds), num_frames))
        with torch.no_grad():
            mu.append(torch.cat([pipe.vae.encode(chunk).latent_dist.mode() for chunk in pixels[-1].split(32)]))
    stats = mu[0].view(len(triples), num_seeds, *mu[0].shape[1:])[:, :STATS_SEEDS].flatten(0, 1)
    pixels, mu = torch.cat(pixels), torch.cat(mu)
    mean, std = stats.mean(dim=(0, 2, 3, 4)), stats.std(dim=(0, 2, 3, 4)).clamp_min(1e-4)
    for model in (pipe.vae, pipe.video_decoder):
        model.register_to_config(latents_mean=mean.tolist(), latents_std=std.tolist())
    return pixels, (mu - mean.view(1, -1, 1, 1, 1)) / std.view(1, -1, 1, 1, 1)


def print_times(wall_s: float, cpu_s: float, what: str) -> None:
    """The run's wall and CPU time (CPU: this process's user + system, all threads)."""
    print(
        f"{what}: wall {wall_s / 60:.1f} min, CPU {cpu_s / 60:.1f} min (OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')})"
    )
