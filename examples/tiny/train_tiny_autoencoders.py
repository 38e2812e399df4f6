#!/usr/bin/env python
"""Train the tiny MAGI-2's autoencoders on the tiny world (``diffusers_magi2.pipelines.tiny_world``).

``--component video_decoder``: the Wan2.2 VAE (``AutoencoderKLWan``) keeps its seeded random init and serves as a
fixed encoder (its causal 3-D convolutions cost ~1 s per clip and step on a CPU, too slow to train here); its
latent statistics are measured on the world's clips (the seen triples x 4 jitter seeds) and written into both configs (``latents_mean``,
``latents_std``), so the pipeline's normalised latents ``(mu - mean) / std`` have unit scale per channel. The
TurboVAE decoder the pipeline decodes with is then trained to map those normalised latents of whole 2 s clips
(7 latent frames, one window) back to their pixels::

    loss = mean(w |D(z) - x|),   w = 1 + 4 [pixel inside the shape]       (the shape is ~10 % of the frame)

``--component audio_vae``: likewise the Oobleck audio VAE's encoder keeps its seeded random init (its posterior
mean defines the audio latents) and its decoder is trained on random crops of ``--audio_crop_latents`` latents of
the world's tones, at the decoder's own rate (2048 samples per latent, 25 latents/s: 51.2 kHz; the pipeline
resamples by 441/512 to 44.1 kHz). The decoder's transposed convolutions start at unit gain: torch's default init
sizes a ``ConvTranspose1d``'s weights by ``out x kernel`` while each output sample sees ``in x kernel / stride`` of
them, so every x8 upsampling shrinks the signal ~5x and the random decoder's output hardly depends on its latents
(weights scaled by ``sqrt(3 stride out / in)``)::

    loss = spectral(D(z), a)

    spectral(y, a) = sum over n in (2048, 1024, 512) of  ||S_n y| - |S_n a||_F / ||S_n a||_F
                                                + mean |log(1 + |S_n y|) - log(1 + |S_n a|)|
    (S_n: the n-point Hann STFT, hop n / 4; a multi-resolution spectral loss, blind to phase)

The loss compares magnitude spectra only (the tones start at a random phase, and a waveform loss trains a decoder
that misses the phase to output silence, its L1-optimal guess); its log term has a floor of 1 (a floor far below
the noise level makes every near-empty bin of a pure tone's spectrum pull the decoder to silence too).

Both start from the tiny model's seeded random weights (``build_tiny_random_pipeline(TINY_TRAINED_CONFIG)``, seed
``--seed``) and write ``<output_dir>/<component>/`` (and ``vae/`` with the measured statistics) in diffusers' format; checkpoints
go to ``<output_dir>/checkpoints/<component>/``.
Training clips: the seen triples (``SEEN``) x ``--num_seeds`` jitter seeds; held-out triples are never shown.
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
#: The STFT sizes of the audio decoder's multi-resolution spectral loss (module docstring).
SPECTRAL_FFT_SIZES = (2048, 1024, 512)


def rescale_transposed_convolutions(decoder) -> bool:
    """Scale each ``ConvTranspose1d`` of ``decoder`` by ``sqrt(3 stride out / in)``, to unit gain (module docstring)."""
    import torch

    for module in decoder.modules():
        if isinstance(module, torch.nn.ConvTranspose1d):
            scale = (3 * module.stride[0] * module.out_channels / module.in_channels) ** 0.5
            with torch.no_grad():
                getattr(module, "weight_g", module.weight).mul_(scale)
    return True


def spectral_loss(output, target, windows):
    """The multi-resolution spectral loss of the module docstring on waveforms ``[N, S]``."""
    import torch

    loss = 0.0
    for n, window in windows.items():
        mag = [torch.stft(x, n, n // 4, window=window, return_complex=True).abs() for x in (output, target)]
        loss = loss + torch.linalg.norm(mag[0] - mag[1]) / torch.linalg.norm(mag[1]).clamp_min(1e-8)
        loss = loss + (mag[0].log1p() - mag[1].log1p()).abs().mean()
    return loss


def parse_args(argv=None):
    p = common_parser(__doc__.split("\n")[1])
    p.add_argument("--component", choices=COMPONENTS, required=True)
    p.add_argument(
        "--num_seeds", type=positive_int, default=STATS_SEEDS, help=f"jitter seeds per seen triple (>= {STATS_SEEDS})"
    )
    p.add_argument("--audio_crop_latents", type=positive_int, default=8, help="audio crop length in latents")
    args = p.parse_args(argv)
    if args.num_seeds < STATS_SEEDS:
        p.error(f"--num_seeds must be >= {STATS_SEEDS} (the latent statistics' clips), got {args.num_seeds}")
    return args, check_resume(p, args, checkpoints_dir(args))


def checkpoints_dir(args) -> Path:
    """Each component's checkpoints: ``<output_dir>/checkpoints/<component>/checkpoint-<step>``."""
    return Path(args.output_dir) / "checkpoints" / args.component


def _video_data(pipe, args):
    """Normalised latents, pixels and shape masks of the seen triples' clips (the statistics written)."""
    from diffusers_magi2.pipelines.tiny_world import SEEN

    pixels, latents = encode_world_video(pipe, SEEN, args.num_seeds)
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
        latents, pixels, mask = _video_data(pipe, args)
        model = pipe.video_decoder.train()
    else:
        sr = 2048 * int(pipe.config.audio_latent_fps)
        num_samples = int(round(DURATION_S * pipe.config.audio_latent_fps)) * 2048
        from diffusers_magi2.pipelines.tiny_world import SEEN

        waves = world_audio(SEEN, range(args.num_seeds), num_samples, sr)
        with torch.no_grad():
            audio_latents = torch.cat([pipe.audio_vae.encode(w).latent_dist.mean for w in waves.split(16)])
        model = rescale_transposed_convolutions(pipe.audio_vae.decoder) and pipe.audio_vae.decoder.train()
        windows = {n: torch.hann_window(n) for n in SPECTRAL_FFT_SIZES}

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
            audio = waves[idx, :, first * 2048 : (first + crop) * 2048]
            out = model(audio_latents[idx, :, first : first + crop])
            loss = spectral_loss(out.reshape(-1, crop * 2048), audio.reshape(-1, crop * 2048), windows)
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
