#!/usr/bin/env python
"""Train the tiny MAGI-2's autoencoders on the tiny world (``diffusers_magi2.pipelines.tiny_world``).

``--component video_decoder``: the Wan2.2 VAE (``AutoencoderKLWan``) keeps its seeded random init and serves as a
fixed encoder (its causal 3-D convolutions cost ~1 s per clip and step on a CPU, too slow to train here); its
latent statistics are measured on the world's clips (the seen triples x 4 jitter seeds) and written into both configs (``latents_mean``,
``latents_std``), so the pipeline's normalised latents ``(mu - mean) / std`` have unit scale per channel. The
TurboVAE decoder the pipeline decodes with is then trained to map those normalised latents of whole 2 s clips
(7 latent frames, one window) back to their pixels::

    loss = mean(w |D(z) - x|),   w = 1 + 4 [pixel inside the shape]       (the shape is ~10 % of the frame)

``--component audio_vae``: the Oobleck audio VAE is trained whole, encoder and decoder, as a deterministic
autoencoder on its posterior mean ``mu = E(a)`` (the pipeline never samples the posterior, so there is no KL term),
on random crops of ``--audio_crop_latents`` latents of the world's tones at the decoder's own rate (2048 samples per
latent, 25 latents/s: 51.2 kHz; the pipeline resamples by 441/512 to 44.1 kHz)::

    loss = mean |D(mu) - a|  +  0.01 mean_c (std_c(mu) - 1)^2      (std_c: channel c's std over the batch and time)

The second term keeps the latent channels near the unit scale of the flow's noise (the transformer trains on ``mu``
unnormalised; the shipped channels' std is 0.5-1.2). The world's tones are multiples of the latent rate with their
phase locked to the clip's start (:mod:`~diffusers_magi2.pipelines.tiny_world`), so every 40 ms window holds the
same waveform: the waveform loss has one answer per colour, and ``mu`` is nearly constant over a clip away from its
first and last two latents, which the transformer can predict from the caption. With a random phase, the L1-optimal
decoder output is silence, and latents that carry the phase leave the transformer nothing to predict but their
phase-blind mean. At the seeded random init the encoder separates the colours by ~1 % of its latents' spread, and a
decoder trained alone on it learns one hum for every tone; trained together the two separate the four tones within
~100 steps. The decoder's transposed
convolutions start at unit gain: torch's default init sizes a ``ConvTranspose1d``'s weights by ``out x kernel``
while each output sample sees ``in x kernel / stride`` of them, so every x8 upsampling shrinks the signal ~5x and the
random decoder's output hardly depends on its latents (weights scaled by ``sqrt(3 stride out / in)``).

Both start from the tiny model's seeded random weights (``build_tiny_random_pipeline(TINY_TRAINED_CONFIG)``, whose
own seed sets them; ``--seed`` seeds the batches and crops) and write ``<output_dir>/<component>/`` (and ``vae/`` with the measured statistics) in diffusers' format; checkpoints
go to ``<output_dir>/checkpoints/<component>/``.
Training clips: the seen triples (``SEEN``) x ``--num_seeds`` jitter seeds; held-out triples are never shown. A
decoder trained on them alone draws only them: the latents of a purple clip (``NEW_COLOURS``) decode as blue, a
still shape (``NEW_MOTIONS``) drifts as if it moved. ``--new_concepts`` adds the clips of the new concepts
(:func:`new_concept_triples`) to the video decoder's, a codec that draws whatever the world shows, so that a LoRA
can teach the transformer a concept the decoder can draw; their captions never reach the transformer, and the latent
statistics stay the seen triples' (the transformer's latents are unchanged, so the decoder fits any transformer
trained on them). ``--init_from FOLDER`` starts the video decoder from a trained one (e.g. to teach a trained
decoder the new concepts).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent))

from tiny_training import (  # noqa: E402
    DURATION_S,
    STATS_SEEDS,
    check_resume,
    common_parser,
    encode_world_video,
    lr_scheduler,
    positive_int,
    print_times,
    save_checkpoint,
    world_audio,
    write_folder,
)


COMPONENTS = ("video_decoder", "audio_vae")
#: Weight of the audio latents' unit-scale term (module docstring).
AUDIO_SCALE_WEIGHT = 0.01


def rescale_transposed_convolutions(decoder) -> None:
    """Scale each ``ConvTranspose1d`` of ``decoder`` by ``sqrt(3 stride out / in)``, to unit gain (module docstring)."""
    import torch

    for module in decoder.modules():
        if isinstance(module, torch.nn.ConvTranspose1d):
            scale = (3 * module.stride[0] * module.out_channels / module.in_channels) ** 0.5
            with torch.no_grad():
                getattr(module, "weight_g", module.weight).mul_(scale)


def audio_autoencoder_loss(vae, audio):
    """The audio VAE's loss of the module docstring on waveforms ``[N, 2, S]``."""
    mu = vae.encode(audio).latent_dist.mean
    reconstruction = (vae.decode(mu).sample - audio).abs().mean()
    channel_std = mu.transpose(0, 1).flatten(1).std(-1)
    return reconstruction + AUDIO_SCALE_WEIGHT * (channel_std - 1).pow(2).mean()


def parse_args(argv=None):
    p = common_parser(__doc__.split("\n")[1])
    p.add_argument("--component", choices=COMPONENTS, required=True)
    p.add_argument(
        "--num_seeds", type=positive_int, default=STATS_SEEDS, help=f"jitter seeds per seen triple (>= {STATS_SEEDS})"
    )
    p.add_argument("--audio_crop_latents", type=positive_int, default=8, help="audio crop length in latents")
    p.add_argument(
        "--new_concepts", action="store_true", help="video decoder: also the new concepts' clips (module docstring)"
    )
    p.add_argument("--init_from", default=None, help="video decoder: start from this trained video_decoder folder")
    args = p.parse_args(argv)
    if args.component != "video_decoder" and (args.new_concepts or args.init_from):
        p.error(f"--new_concepts and --init_from apply to --component video_decoder, not {args.component}")
    if args.init_from and not (Path(args.init_from) / "config.json").is_file():
        p.error(f"--init_from {args.init_from}: no config.json (a video_decoder folder of this script)")
    if args.num_seeds < STATS_SEEDS:
        p.error(f"--num_seeds must be >= {STATS_SEEDS} (the latent statistics' clips), got {args.num_seeds}")
    return args, check_resume(p, args, checkpoints_dir(args))


def checkpoints_dir(args) -> Path:
    """Each component's checkpoints: ``<output_dir>/checkpoints/<component>/checkpoint-<step>``."""
    return Path(args.output_dir) / "checkpoints" / args.component


def new_concept_triples() -> tuple:
    """The triples with a new colour or a new motion (``tiny_world.NEW_COLOURS`` / ``NEW_MOTIONS``) and every
    shape and other word: what no caption of the transformer's training shows."""
    import itertools

    from diffusers_magi2.pipelines.tiny_world import COLOURS, MOTIONS, NEW_COLOURS, NEW_MOTIONS, SHAPES

    colours, motions = (*COLOURS, *NEW_COLOURS), (*MOTIONS, *NEW_MOTIONS)
    triples = itertools.product(colours, SHAPES, motions)
    return tuple(t for t in triples if t[0] in NEW_COLOURS or t[2] in NEW_MOTIONS)


def _video_data(pipe, args):
    """Normalised latents, pixels and shape masks of the seen triples' clips and, with ``--new_concepts``, the new
    concepts' (the seen triples' statistics written)."""
    from diffusers_magi2.pipelines.tiny_world import SEEN

    extra = new_concept_triples() if args.new_concepts else ()
    pixels, latents = encode_world_video(pipe, SEEN, args.num_seeds, extra)
    background = pixels.new_tensor([0.08, 0.08, 0.10]).mul(2).sub(1).view(1, 3, 1, 1, 1)
    mask = (pixels - background).abs().amax(1, keepdim=True) > 0.05
    return latents, pixels, mask.float()


def train(args, resume):
    import torch
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from tqdm.auto import tqdm

    from diffusers_magi2.pipelines.tiny_default import TINY_TRAINED_CONFIG, build_tiny_random_pipeline

    start_wall, start_cpu = time.perf_counter(), time.process_time()
    set_seed(args.seed)
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    pipe = build_tiny_random_pipeline(TINY_TRAINED_CONFIG)
    output_dir = Path(args.output_dir)
    checkpoints_dir(args).mkdir(parents=True, exist_ok=True)

    if args.component == "video_decoder":
        if args.init_from:
            from diffusers_magi2.models.turbo_vae import Magi2TurboVAEDecoder

            pipe.video_decoder = Magi2TurboVAEDecoder.from_pretrained(args.init_from)
        latents, pixels, mask = _video_data(pipe, args)
        model = pipe.video_decoder.train()
    else:
        sr = 2048 * int(pipe.config.audio_latent_fps)
        num_samples = int(round(DURATION_S * pipe.config.audio_latent_fps)) * 2048
        from diffusers_magi2.pipelines.tiny_world import SEEN

        waves = world_audio(SEEN, range(args.num_seeds), num_samples, sr)
        rescale_transposed_convolutions(pipe.audio_vae.decoder)
        model = pipe.audio_vae.train()

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=0.0)
    schedule = lr_scheduler(args, optimizer)
    model, optimizer, schedule = accelerator.prepare(model, optimizer, schedule)
    start = 0
    if resume is not None:
        folder, start = resume
        accelerator.load_state(str(folder))

    bar = tqdm(range(start, args.max_train_steps), initial=start, total=args.max_train_steps)
    for step in bar:
        generator = torch.Generator().manual_seed(args.seed * 1_000_003 + step)  # a resumed run draws the same
        if args.component == "video_decoder":
            idx = torch.randint(len(latents), (args.train_batch_size,), generator=generator)
            decoded = accelerator.unwrap_model(model)._decode(latents[idx])
            loss = ((decoded - pixels[idx]).abs() * (1 + 4 * mask[idx])).mean()
        else:
            idx = torch.randint(len(waves), (args.train_batch_size,), generator=generator)
            crop = args.audio_crop_latents
            first = int(torch.randint(0, num_samples // 2048 - crop + 1, (1,), generator=generator))
            loss = audio_autoencoder_loss(
                accelerator.unwrap_model(model), waves[idx, :, first * 2048 : (first + crop) * 2048]
            )
        accelerator.backward(loss)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        bar.set_postfix(loss=f"{loss.item():.4f}")
        if (step + 1) % args.checkpointing_steps == 0 or step + 1 == args.max_train_steps:
            save_checkpoint(accelerator, checkpoints_dir(args), step + 1)

    trained = pipe.video_decoder if args.component == "video_decoder" else pipe.audio_vae
    trained.eval()
    write_folder(trained.save_pretrained, output_dir / args.component)
    if args.component == "video_decoder":
        write_folder(pipe.vae.save_pretrained, output_dir / "vae")
    print_times(time.perf_counter() - start_wall, time.process_time() - start_cpu, f"{args.component} training")
    return trained


def main(argv=None) -> int:
    args, resume = parse_args(argv)
    train(args, resume)
    return 0


if __name__ == "__main__":
    sys.exit(main())
