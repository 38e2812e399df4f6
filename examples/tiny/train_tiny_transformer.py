#!/usr/bin/env python
"""Train the tiny MAGI-2 Preview transformer from scratch on the tiny world, then write the whole pipeline.

Data: the seen triples (``SEEN``; the held-out ones are never shown) x ``--num_seeds`` jitter seeds of 2 s clips at
32x32: video latents from the Wan2.2 VAE (its seeded random init, a fixed encoder; normalised with the statistics
``train_tiny_autoencoders.py`` measured, recomputed here the same way) and audio latents (the posterior mean of the
Oobleck encoder ``train_tiny_autoencoders.py`` trained, unnormalised); captions ``"a {colour} {shape} {motion}"`` through the pipeline's own
text encoder, which stays at its seeded random init (frozen).

Objective: the flow matching the sampler integrates (SandAI's ``v = eps - x0``; ``x0 = x - sigma v``)::

    x_t = (1 - sigma) x0 + sigma eps,  a_t = (1 - sigma) a0 + sigma eps_a     (one sigma per sample, as the sampler)
    timestep = floor(1000 sigma)                                                (0-1000 scale, as the scheduler's)
    loss = mean((v - (eps - x0))^2) + 0.5 mean((v_a - (eps_a - a0))^2)          (video weight 1, audio 0.5)

``sigma = u`` or, for half of each batch, ``sigma = 7u / (1 + 6u)`` (the scheduler's ``flow_shift = 7``, so the
high-noise steps the sampler spends most of its steps on are covered as densely), ``u ~ U(0.001, 0.999)``.
Classifier-free guidance: each sample's text is replaced with probability ``--cfg_dropout`` (0.1) by the
embedding of the pipeline's own negative prompt (``config.negative_prompt``), which is what the sampler's
unconditional branch feeds. Routers: no load-balancing update; the routers learn through their gate gradients and
``expert_bias`` / ``expert_bias_ema`` stay 0 (the CPU expert path has no capacity limit, so an unbalanced expert
costs time, never tokens).

``--autoencoders_dir`` (required) holds ``video_decoder/``, ``vae/`` and ``audio_vae/`` from
``train_tiny_autoencoders.py``; with ``--pipeline_output_dir`` the trained pipeline (those components, this transformer, the tiny tokenizer and
text encoder, the scheduler, ``duration_s = 2``) is written there with ``save_pretrained`` (under a temporary
name, then renamed).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent))

from tiny_training import (  # noqa: E402
    STATS_SEEDS,
    check_resume,
    common_parser,
    encode_world_video,
    lr_scheduler,
    positive_float,
    positive_int,
    print_times,
    save_checkpoint,
    world_audio,
    write_folder,
)


VIDEO_WEIGHT, AUDIO_WEIGHT = 1.0, 0.5


def parse_args(argv=None):
    p = common_parser(__doc__.split("\n")[1])
    p.add_argument("--num_seeds", type=positive_int, default=6, help="jitter seeds per seen triple (>= 4)")
    p.add_argument("--cfg_dropout", type=positive_float, default=0.1, help="probability of the negative prompt")
    p.add_argument("--autoencoders_dir", required=True, help="train_tiny_autoencoders.py's --output_dir")
    p.add_argument("--pipeline_output_dir", default=None, help="write the trained pipeline here")
    args = p.parse_args(argv)
    if args.num_seeds < STATS_SEEDS:
        p.error(f"--num_seeds must be >= {STATS_SEEDS} (the latent statistics' clips), got {args.num_seeds}")
    if not args.cfg_dropout < 1:
        p.error(f"--cfg_dropout must be < 1, got {args.cfg_dropout}")
    for name in ("video_decoder", "vae", "audio_vae"):
        if not (Path(args.autoencoders_dir) / name / "config.json").is_file():
            p.error(f"--autoencoders_dir {args.autoencoders_dir}: no {name}/config.json")
    return args, check_resume(p, args)


def build_dataset(pipe, num_seeds: int):
    """``(video [N, 48, 7, 2, 2], audio [N, 50, A], caption index [N], captions)``; also sets the VAE statistics."""
    import torch

    from diffusers_magi2.pipelines.tiny_world import SEEN, caption

    _, video = encode_world_video(pipe, SEEN, num_seeds)
    rate = 2048 * int(pipe.config.audio_latent_fps)
    waves = world_audio(SEEN, range(num_seeds), pipe.latent_geometry().num_audio_latents * 2048, rate)
    with torch.no_grad():
        audio = torch.cat([pipe.audio_vae.encode(w).latent_dist.mean for w in waves.split(16)]).transpose(1, 2)
    index = torch.arange(len(SEEN)).repeat_interleave(num_seeds)
    return video, audio, index, [caption(*t) for t in SEEN]


def shifted_sigmas(u, shift: float):
    """The scheduler's shift ``s u / (1 + (s - 1) u)``."""
    return shift * u / (1 + (shift - 1) * u)


def train(args, resume):
    import torch
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from tqdm.auto import tqdm

    from diffusers_magi2.pipelines.sampling_magi2 import pad_text_batch
    from diffusers_magi2.pipelines.tiny_default import TINY_TRAINED_CONFIG, build_tiny_random_pipeline

    start_wall, start_cpu = time.perf_counter(), time.process_time()
    set_seed(args.seed)
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    pipe = assemble(build_tiny_random_pipeline(TINY_TRAINED_CONFIG), Path(args.autoencoders_dir))
    video, audio, index, captions = build_dataset(pipe, args.num_seeds)
    with torch.no_grad():
        cond, cond_mask, neg, neg_mask = pipe.encode_prompt(captions, device="cpu")
    text, text_mask = pad_text_batch([cond, neg[:1]], [cond_mask, neg_mask[:1]])
    negative = len(captions)  # the row of the negative prompt
    shift = float(pipe.scheduler.config.flow_shift)

    model = pipe.transformer.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=0.01)
    schedule = lr_scheduler(args, optimizer)
    model, optimizer, schedule = accelerator.prepare(model, optimizer, schedule)
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    start = 0
    if resume is not None:
        folder, start = resume
        accelerator.load_state(str(folder))

    bar = tqdm(range(start, args.max_train_steps), initial=start, total=args.max_train_steps)
    for step in bar:
        g = torch.Generator().manual_seed(args.seed * 1_000_003 + step)  # a resumed run draws the same
        b = args.train_batch_size
        pick = torch.randint(len(video), (b,), generator=g)
        rows = torch.where(torch.rand(b, generator=g) < args.cfg_dropout, negative, index[pick])
        u = torch.rand(b, generator=g) * 0.998 + 0.001
        sigma = torch.where(torch.arange(b) < b // 2, shifted_sigmas(u, shift), u)
        x0, a0 = video[pick], audio[pick]
        eps, eps_a = torch.randn(x0.shape, generator=g), torch.randn(a0.shape, generator=g)
        s_v, s_a = sigma.view(-1, 1, 1, 1, 1), sigma.view(-1, 1, 1)
        out = model(
            hidden_states=(1 - s_v) * x0 + s_v * eps,
            timestep=torch.floor(1000 * sigma),
            encoder_hidden_states=text[rows],
            audio_hidden_states=(1 - s_a) * a0 + s_a * eps_a,
            encoder_attention_mask=text_mask[rows],
            return_dict=True,
        )
        loss_v = (out.sample.float() - (eps - x0)).pow(2).mean()
        loss_a = (out.audio_sample.float() - (eps_a - a0)).pow(2).mean()
        loss = VIDEO_WEIGHT * loss_v + AUDIO_WEIGHT * loss_a
        accelerator.backward(loss)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        bar.set_postfix(video=f"{loss_v.item():.4f}", audio=f"{loss_a.item():.4f}")
        if (step + 1) % args.checkpointing_steps == 0 or step + 1 == args.max_train_steps:
            save_checkpoint(accelerator, output_dir, step + 1)

    pipe.transformer = accelerator.unwrap_model(model).eval()
    write_folder(pipe.transformer.save_pretrained, output_dir / "transformer")
    if args.pipeline_output_dir:
        write_folder(pipe.save_pretrained, Path(args.pipeline_output_dir))
    print_times(time.perf_counter() - start_wall, time.process_time() - start_cpu, "transformer training")
    return pipe


def assemble(pipe, autoencoders_dir: Path):
    """``pipe`` with the trained autoencoders of ``autoencoders_dir`` (the video VAE carrying the statistics)."""
    from diffusers import AutoencoderKLWan, AutoencoderOobleck

    from diffusers_magi2.models.turbo_vae import Magi2TurboVAEDecoder

    pipe.vae = AutoencoderKLWan.from_pretrained(autoencoders_dir / "vae").eval()
    pipe.video_decoder = Magi2TurboVAEDecoder.from_pretrained(autoencoders_dir / "video_decoder").eval()
    pipe.audio_vae = AutoencoderOobleck.from_pretrained(autoencoders_dir / "audio_vae").eval()
    for name in ("vae", "video_decoder", "audio_vae"):
        pipe.register_modules(**{name: getattr(pipe, name)})
    return pipe


def main(argv=None) -> int:
    args, resume = parse_args(argv)
    train(args, resume)
    return 0


if __name__ == "__main__":
    sys.exit(main())
