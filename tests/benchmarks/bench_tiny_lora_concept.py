"""A LoRA that teaches the trained tiny MAGI-2 a concept it never saw (not collected by pytest): judge accuracy on the
new concept and on the old ones, before and after, the decoder's ceiling on each, and the LoRA's training time.

    OMP_NUM_THREADS=1 .venv/bin/python -m tests.benchmarks.bench_tiny_lora_concept --model FOLDER [--concept purple] \\
        [--video_decoder FOLDER] [--max_steps 800] [--learning_rate 2e-3] [--rank 16] [--out lora_concept.json]

The concept (``--concept``): ``purple``, a colour (``tiny_world.NEW_COLOURS``) with a tone of its own, or ``still``,
the motion "stays still" (``tiny_world.NEW_MOTIONS``: the shape rests at the centre); no caption of the
transformer's training names either. The data folder, written as a user would write one for
``examples/train_lora.py`` (videos with their sound and ``<stem>.txt`` captions, encoded by its ``--cache``): the
world's clips of the concept's 8 triples (purple: 2 shapes x 4 motions; still: 4 colours x 2 shapes) at
``--clips_per_triple`` jitter seeds, plus one clip of each of the 8 seen prompts of ``bench_tiny_prompt_following``
(so that the LoRA keeps the old concepts), as 2 s clips at 32x32 and 12.5 fps (lossless H.264, 4:4:4) with the
world's tone as 44.1 kHz AAC. ``train_lora.py`` runs in a subprocess with one thread (``OMP_NUM_THREADS=1``), LoRA
on ``linear_qkv`` and ``linear_proj`` in fp32, with this benchmark's flags (by default the tiny transformer's own
objective: ``--flow_shift 7``, ``--audio_loss_weight 0.5``, ``--cfg_dropout 0.1``); its time is the child's CPU
time, cache encoding included.

Prompt sets, noise seed 0, 16 steps, CFG 5: "concept set", the concept's 8 triples; "old set", the first ``--seen``
(8) seen and ``--held_out`` (4) held-out prompts of the benchmark. The base pipeline is scored, then the same
pipeline with the LoRA loaded (``pipe.load_lora_weights(output_dir)``). The decoder's ceiling: the world's clips of
the same prompts (jitter seed 0) encoded by the pipeline's Wan VAE and decoded by its video decoder, judged (no
transformer can score above what the decoder draws from the true latents). A decoder trained on the seen triples
alone draws neither concept (purple comes out blue, a still shape drifts); ``--video_decoder`` scores the same base
and LoRA again with another decoder, e.g. one that ``train_tiny_autoencoders.py --new_concepts`` taught the new
concepts' clips.
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

from diffusers_magi2.pipelines.tiny_judge import judge_clip
from diffusers_magi2.pipelines.tiny_world import (
    COLOURS,
    MOTIONS,
    NEW_COLOURS,
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
AUDIO_RATE = 44_100
TRAIN_LORA = Path(__file__).resolve().parents[2] / "examples" / "train_lora.py"
#: The flags of this benchmark that go to ``train_lora.py`` as they are.
TRAIN_FLAGS = ("max_steps", "learning_rate", "rank", "flow_shift", "audio_loss_weight", "cfg_dropout")
#: The 8 prompts of each concept.
CONCEPTS = {
    "purple": [caption(colour, shape, motion) for colour in NEW_COLOURS for shape in SHAPES for motion in MOTIONS],
    "still": [caption(colour, shape, motion) for colour in COLOURS for shape in SHAPES for motion in NEW_MOTIONS],
}


def write_clip(path: Path, frames: np.ndarray, audio: np.ndarray) -> None:
    """Frames ``[F, H, W, 3]`` in [0, 1] as lossless H.264 (4:4:4) at :data:`FPS` and stereo ``audio [2, S]`` at
    :data:`AUDIO_RATE` as AAC, in one ``.mp4``."""
    import av

    with av.open(str(path), "w") as container:
        video = container.add_stream("libx264", rate=FPS, options={"crf": "0"})
        video.width, video.height, video.pix_fmt = frames.shape[2], frames.shape[1], "yuv444p"
        sound = container.add_stream("aac", rate=AUDIO_RATE, layout="stereo")
        for frame in np.round(np.clip(frames, 0.0, 1.0) * 255.0).astype(np.uint8):
            container.mux(video.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(video.encode())
        for start in range(0, audio.shape[1], 1024):
            chunk = av.AudioFrame.from_ndarray(np.ascontiguousarray(audio[:, start : start + 1024]), "fltp", "stereo")
            chunk.sample_rate, chunk.pts = AUDIO_RATE, start
            container.mux(sound.encode(chunk))
        container.mux(sound.encode())


def write_dataset(folder: Path, concept: str, clips_per_triple: int) -> list[tuple[str, int]]:
    """The LoRA's data folder (module docstring); returns each clip's caption and jitter seed."""
    captions = [(p, 1000 + s) for p in CONCEPTS[concept] for s in range(clips_per_triple)]
    captions += [(p, 2000) for p in SEEN_PROMPTS]
    for i, (text, seed) in enumerate(captions):
        triple = parse_caption(text)
        frames = render_frames(*triple, height=SIZE, width=SIZE, num_frames=NUM_FRAMES, seed=seed)
        audio = render_audio(
            triple[0], num_samples=round(NUM_FRAMES / FPS * AUDIO_RATE), sample_rate=AUDIO_RATE, seed=seed
        )
        write_clip(folder / f"clip{i:03d}.mp4", frames, audio)
        (folder / f"clip{i:03d}.txt").write_text(text + "\n", encoding="utf-8")
    return captions


def train_lora(model: str, data_dir: Path, output_dir: Path, args) -> dict:
    """Run ``examples/train_lora.py`` (module docstring); its CPU and wall seconds and its flags."""
    flags = {name: getattr(args, name) for name in TRAIN_FLAGS}
    command = [sys.executable, str(TRAIN_LORA), "--model", model, "--data_dir", str(data_dir), "--cache"]
    command += ["--output_dir", str(output_dir), "--checkpoint_every", str(args.max_steps), "--seed", "0"]
    command += [item for name, value in flags.items() for item in (f"--{name}", str(value))]
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    subprocess.run(command, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return {"cpu_seconds": cpu, "wall_seconds": time.perf_counter() - start, "flags": flags}


def score(pipe, sets: dict) -> dict:
    """Mean judge scores of generated clips on each prompt set of ``sets`` (``{name: prompts}``), with what the
    judge saw in each clip (``"judged"``)."""
    result = {}
    for name, prompts in sets.items():
        clips = [generate(pipe, p, 0, STEPS, GUIDANCE) for p in prompts]
        nothing = dict.fromkeys((*JUDGED, "flicker"), float("nan"))
        result[name] = {**(mean_scores(clips) if clips else nothing), "judged": [c.scores["seen"] for c in clips]}
    return result


def decoder_ceiling(pipe, sets: dict) -> dict:
    """Judge accuracy (colour, shape, motion) of each set's world clips (jitter seed 0) through the Wan VAE's
    encoder and the pipeline's video decoder (module docstring)."""
    import torch

    from diffusers_magi2.pipelines.decoding_magi2 import wan_latent_stats

    result = {}
    for name, prompts in sets.items():
        scores = []
        for prompt in prompts:
            frames = render_frames(*parse_caption(prompt), height=SIZE, width=SIZE, num_frames=NUM_FRAMES, seed=0)
            pixels = torch.from_numpy(frames).permute(3, 0, 1, 2)[None] * 2 - 1
            with torch.no_grad():
                mu = pipe.vae.encode(pixels).latent_dist.mode()
                mean, inv_std = wan_latent_stats(pipe.vae, mu.device)
                decoded = pipe.decode_video((mu - mean) * inv_std)[0].permute(1, 2, 3, 0)
            scores.append(judge_clip(((decoded.numpy() + 1) / 2).clip(0, 1), None, None, prompt))
        result[name] = {k: sum(s[k] for s in scores) / len(scores) for k in ("colour", "shape", "motion")}
    return result


def main(argv=None) -> int:
    p = common_parser(__doc__)
    p.add_argument("--concept", choices=sorted(CONCEPTS), default="purple", help="the new concept to teach")
    p.add_argument("--clips_per_triple", type=int, default=3, help="training clips per triple of the concept")
    p.add_argument("--max_steps", type=int, default=800)
    p.add_argument("--learning_rate", type=float, default=2e-3)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--flow_shift", type=float, default=7.0, help="train_lora.py's (the tiny scheduler's shift)")
    p.add_argument("--audio_loss_weight", type=float, default=0.5, help="train_lora.py's (the tiny training's)")
    p.add_argument("--cfg_dropout", type=float, default=0.1, help="train_lora.py's (the tiny training's)")
    p.add_argument(
        "--video_decoder",
        default=None,
        help="also score with this video_decoder folder in place of the pipeline's (e.g. one trained with "
        "train_tiny_autoencoders.py --new_concepts)",
    )
    args = p.parse_args(argv)
    seen, held_out = prompt_set(p, args)
    if args.clips_per_triple < 1 or args.max_steps < 1 or args.rank < 1:
        p.error("--clips_per_triple, --max_steps and --rank must be >= 1")
    if args.video_decoder and not (Path(args.video_decoder) / "config.json").is_file():
        p.error(f"--video_decoder {args.video_decoder}: no config.json")
    with pipeline_folder(args.model) as folder, tempfile.TemporaryDirectory(prefix="lora-concept-") as work:
        data_dir, output_dir = Path(work) / "data", Path(work) / "lora"
        data_dir.mkdir()
        clips = len(write_dataset(data_dir, args.concept, args.clips_per_triple))
        training = train_lora(folder, data_dir, output_dir, args)
        pipe = load_pipeline(folder)
        decoders = {"pipeline's decoder": pipe.video_decoder}
        if args.video_decoder:
            from diffusers_magi2.models.turbo_vae import Magi2TurboVAEDecoder

            decoders["--video_decoder"] = Magi2TurboVAEDecoder.from_pretrained(args.video_decoder).eval()
        sets = {"concept": CONCEPTS[args.concept], "seen": seen, "held_out": held_out}
        scores = {}
        for decoder in decoders.values():
            pipe.video_decoder = decoder
            scores[decoder] = {"decoder ceiling": decoder_ceiling(pipe, sets), "base": score(pipe, sets)}
        pipe.load_lora_weights(str(output_dir))
        for decoder in decoders.values():
            pipe.video_decoder = decoder
            scores[decoder]["base + LoRA"] = score(pipe, sets)
    results = {
        "model": args.model or "random control",
        "concept": args.concept,
        "video_decoder": args.video_decoder,
        "training": {**training, "clips": clips},
        "scores": {name: scores[decoder] for name, decoder in decoders.items()},
    }
    print(
        f"model: {results['model']}; LoRA: {clips} clips, train_lora.py "
        + " ".join(f"--{k} {v}" for k, v in training["flags"].items())
        + f": {training['cpu_seconds']:.0f} CPU s ({training['wall_seconds']:.0f} s wall)"
    )
    concept = ("colour", "shape", "motion") + (("sound",) if args.concept == "purple" else ())
    rows = [
        [decoder, name, *(r["concept"].get(k, float("nan")) for k in concept)]
        + [*(r["seen"].get(k, float("nan")) for k in JUDGED), r["held_out"]["colour"], r["held_out"]["motion"]]
        for decoder, by_row in results["scores"].items()
        for name, r in by_row.items()
    ]
    columns = ["video decoder", "model", *(f"{args.concept}: {k}" for k in concept)]
    columns += [f"old seen: {k}" for k in JUDGED] + ["old held-out: colour", "old held-out: motion"]
    print_table(columns, rows)
    write_json(args.out, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
