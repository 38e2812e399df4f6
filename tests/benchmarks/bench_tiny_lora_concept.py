"""A LoRA that teaches the trained tiny MAGI-2 a motion it never saw (not collected by pytest): judge accuracy on the
new motion and on the old concepts, before and after, and the LoRA's training time.

    OMP_NUM_THREADS=1 .venv/bin/python -m tests.benchmarks.bench_tiny_lora_concept --model FOLDER \\
        [--max_steps 400] [--learning_rate 5e-4] [--rank 16] [--out lora_concept.json]

The concept: "stays still" (``tiny_world.NEW_MOTIONS``: the shape rests at the centre), a motion of no training
caption. (A new colour cannot be taught to the transformer alone: the tiny video decoder, trained on the four
colours, decodes the Wan latents of a purple clip, ``tiny_world.NEW_COLOURS``, as blue.) The data folder, written as
a user would write one for ``examples/train_lora.py`` (videos and ``<stem>.txt`` captions, encoded by its
``--cache``): the world's clips of ``"a {colour} {shape} stays still"`` for the 4 colours and 2 shapes at
``--clips_per_triple`` jitter seeds, plus one clip of each of the 8 seen prompts of ``bench_tiny_prompt_following``
(so that the LoRA keeps the old motions), as 2 s clips at 32x32 and 12.5 fps (lossless H.264, 4:4:4).
``train_lora.py`` runs in a subprocess with one thread (``OMP_NUM_THREADS=1``) and its defaults otherwise (LoRA on
``linear_qkv`` and ``linear_proj``, fp32, uniform sigma, video loss only); its time is the child's CPU time.

Prompt sets, noise seed 0, 16 steps, CFG 5: "still set", the 8 still triples; "old set", the first ``--seen`` (8)
seen and ``--held_out`` (4) held-out prompts of the benchmark. The base pipeline is scored, then the same pipeline
with the LoRA loaded (``pipe.load_lora_weights(output_dir)``).
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import tempfile
import time
from fractions import Fraction
from pathlib import Path

import numpy as np

from diffusers_magi2.pipelines.tiny_world import (
    COLOURS,
    NEW_MOTIONS,
    SHAPES,
    caption,
    parse_caption,
    render_audio,
    render_frames,
)
from tests.benchmarks.tiny_quality import (
    JUDGED,
    SEEN_PROMPTS,
    common_parser,
    generate,
    load_pipeline,
    mean_scores,
    pipeline_folder,
    print_table,
    prompt_set,
    write_json,
)


STEPS, GUIDANCE = 16, 5.0
FPS, NUM_FRAMES, SIZE = Fraction(25, 2), 25, 32
TRAIN_LORA = Path(__file__).resolve().parents[2] / "examples" / "train_lora.py"
MOTION = next(iter(NEW_MOTIONS))
CONCEPT_PROMPTS = [caption(colour, shape, MOTION) for colour in COLOURS for shape in SHAPES]


def write_video(path: Path, frames: np.ndarray) -> None:
    """Frames ``[F, H, W, 3]`` in [0, 1] as a lossless H.264 (4:4:4) ``.mp4`` at :data:`FPS`."""
    import av

    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=FPS, options={"crf": "0"})
        stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], "yuv444p"
        for frame in np.round(np.clip(frames, 0.0, 1.0) * 255.0).astype(np.uint8):
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())


def write_dataset(folder: Path, clips_per_triple: int) -> list[tuple[str, int]]:
    """The LoRA's data folder (module docstring); returns each clip's caption and jitter seed."""
    captions = [(p, 1000 + s) for p in CONCEPT_PROMPTS for s in range(clips_per_triple)]
    captions += [(p, 2000) for p in SEEN_PROMPTS]
    for i, (text, seed) in enumerate(captions):
        frames = render_frames(*parse_caption(text), height=SIZE, width=SIZE, num_frames=NUM_FRAMES, seed=seed)
        write_video(folder / f"clip{i:03d}.mp4", frames)
        (folder / f"clip{i:03d}.txt").write_text(text + "\n", encoding="utf-8")
    return captions


def add_audio_latents(model: str, folder: Path, captions: list[tuple[str, int]]) -> None:
    """Write each clip's audio latents (the Oobleck encoder's posterior mean of the world's tone, as the base model
    was trained on) into the caches ``train_lora.py --cache`` wrote."""
    import torch
    from safetensors.torch import load_file, save_file

    pipe = load_pipeline(model)
    rate = 2048 * int(pipe.config.audio_latent_fps)  # the audio VAE's own rate, as the tiny training's
    samples = pipe.latent_geometry().num_audio_latents * 2048
    for i, (text, seed) in enumerate(captions):
        wave = torch.from_numpy(render_audio(parse_caption(text)[0], num_samples=samples, sample_rate=rate, seed=seed))
        with torch.no_grad():
            latents = pipe.audio_vae.encode(wave[None]).latent_dist.mean[0].T.contiguous()
        path = folder / f"clip{i:03d}.magi2.safetensors"
        tensors = {**load_file(str(path)), "audio_latents": latents}
        save_file(tensors, str(path) + ".tmp")
        os.replace(str(path) + ".tmp", path)


def train_lora(model: str, data_dir: Path, output_dir: Path, args, cache: bool = True, max_steps=None) -> dict:
    """Run ``examples/train_lora.py`` (module docstring); its CPU and wall seconds."""
    max_steps = max_steps or args.max_steps
    command = [
        sys.executable,
        str(TRAIN_LORA),
        "--model",
        model,
        "--data_dir",
        str(data_dir),
        *(["--cache"] if cache else []),
        "--output_dir",
        str(output_dir),
        "--max_steps",
        str(max_steps),
        "--checkpoint_every",
        str(max_steps),
        "--learning_rate",
        str(args.learning_rate),
        "--rank",
        str(args.rank),
        "--seed",
        "0",
    ]
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    subprocess.run(command, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return {"cpu_seconds": cpu, "wall_seconds": time.perf_counter() - start, "command": command[1:]}


def score(pipe, seen: list[str], held_out: list[str]) -> dict:
    """Judge scores on the still set and on the old set's ``seen`` and ``held_out`` prompts."""
    nothing = dict.fromkeys((*JUDGED, "flicker"), float("nan"))
    return {
        name: mean_scores([generate(pipe, p, 0, STEPS, GUIDANCE) for p in prompts]) if prompts else nothing
        for name, prompts in (("still", CONCEPT_PROMPTS), ("seen", seen), ("held_out", held_out))
    }


def main(argv=None) -> int:
    p = common_parser(__doc__)
    p.add_argument("--clips_per_triple", type=int, default=3, help="training clips per still triple")
    p.add_argument("--max_steps", type=int, default=400)
    p.add_argument("--learning_rate", type=float, default=5e-4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument(
        "--audio_latents",
        action="store_true",
        help="train with the clips' audio latents in the caches (default: none, train_lora.py's zeros)",
    )
    args = p.parse_args(argv)
    seen, held_out = prompt_set(p, args)
    if args.clips_per_triple < 1 or args.max_steps < 1 or args.rank < 1:
        p.error("--clips_per_triple, --max_steps and --rank must be >= 1")
    with pipeline_folder(args.model) as folder, tempfile.TemporaryDirectory(prefix="lora-concept-") as work:
        data_dir, output_dir = Path(work) / "data", Path(work) / "lora"
        data_dir.mkdir()
        captions = write_dataset(data_dir, args.clips_per_triple)
        clips = len(captions)
        if args.audio_latents:  # --cache on a 1-step run, the audio latents added, then the training run
            encoding = train_lora(folder, data_dir, Path(work) / "encode", args, max_steps=1)
            add_audio_latents(folder, data_dir, captions)
            training = train_lora(folder, data_dir, output_dir, args, cache=False)
            for key in ("cpu_seconds", "wall_seconds"):
                training[key] += encoding[key]
        else:
            training = train_lora(folder, data_dir, output_dir, args)
        pipe = load_pipeline(folder)
        before = score(pipe, seen, held_out)
        pipe.load_lora_weights(str(output_dir))
        after = score(pipe, seen, held_out)
    results = {
        "model": args.model or "random control",
        "training": {**training, "clips": clips, "max_steps": args.max_steps, "rank": args.rank},
        "audio_latents": args.audio_latents,
        "before": before,
        "after": after,
    }
    print(
        f"model: {results['model']}; LoRA: {clips} clips (audio latents: {args.audio_latents}), {args.max_steps} "
        f"steps, rank {args.rank}, lr "
        f"{args.learning_rate}: {training['cpu_seconds']:.0f} CPU s ({training['wall_seconds']:.0f} s wall)"
    )
    rows = [
        [name, *(r["still"][k] for k in ("colour", "shape", "motion"))]
        + [*(r["seen"][k] for k in JUDGED), r["held_out"]["colour"], r["held_out"]["motion"]]
        for name, r in (("base", before), ("base + LoRA", after))
    ]
    columns = ["model", "still: colour", "still: shape", "still: motion"]
    columns += [f"old seen: {k}" for k in JUDGED] + ["old held-out: colour", "old held-out: motion"]
    print_table(columns, rows)
    write_json(args.out, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
