"""What ``magi2-convert`` converts: the components of a MAGI-2 diffusers repository and where each one's input lies
in SandAI's release. No torch here, so the command line checks its flags before torch is imported."""

from __future__ import annotations


__all__ = ["ALL_COMPONENTS", "RELEASE_LAYOUT"]

#: the components ``--components`` names (``scheduler`` is written from defaults, it has no input).
ALL_COMPONENTS = ("transformer", "refiner", "vae", "video_decoder", "audio_vae", "text_encoder", "scheduler")

#: SandAI release layout under ``--checkpoint_root``: component -> relative input path.
RELEASE_LAYOUT = {
    "transformer": "preview",
    "refiner": "refiner",
    "vae": "vae/Wan2.2_VAE.pth",
    "video_decoder": "turbo_vae",
    "audio_vae": "stable-audio-open-1.0",
    "text_encoder": "text_encoder",
}
