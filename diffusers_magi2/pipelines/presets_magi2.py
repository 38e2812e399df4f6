"""MAGI-2 pipeline presets: the component names, the built-in negative prompt, the trained and ``resolution=``
sizes, the allowed ``output_type`` values and the tensors a step callback may read.

Values follow SandAI ``inference_engine.py`` / ``entry.py`` at commit ``f68a0f9``.
"""

from __future__ import annotations


__all__ = [
    "CALLBACK_TENSOR_INPUTS",
    "COMPONENT_NAMES",
    "DEFAULT_NEGATIVE_PROMPT",
    "OUTPUT_TYPES",
    "REFINER_RESOLUTION",
    "RESOLUTION_PRESETS",
    "TRAINED_RESOLUTIONS",
    "apply_resolution_preset",
    "resolve_stage_sizes",
]

#: The pipeline's components, in ``Magi2Pipeline.__init__``'s order (the last four are optional).
COMPONENT_NAMES = (
    "tokenizer",
    "text_encoder",
    "transformer",
    "audio_vae",
    "scheduler",
    "vae",
    "video_decoder",
    "refiner",
    "prompt_enhancer",
)

#: The step tensors ``callback_on_step_end_tensor_inputs`` may name (both pipelines' ``_callback_tensor_inputs``).
CALLBACK_TENSOR_INPUTS = ("latents", "audio_latents", "prompt_embeds", "negative_prompt_embeds")

#: SandAI's built-in negative prompt (``inference_engine.py``): visual, audio and voice defects.
DEFAULT_NEGATIVE_PROMPT = (
    "Bright tones, overexposed, static, blurred details, subtitles, style, works, paintings, images, static, "
    "overall gray, worst quality, low quality, JPEG compression residue, ugly, incomplete, extra fingers, poorly "
    "drawn hands, poorly drawn faces, deformed, disfigured, misshapen limbs, fused fingers, still picture, messy "
    "background, three legs, many people in the background, walking backwards"
    ", low quality, worst quality, poor quality, noise, background noise, hiss, hum, buzz, crackle, static, "
    "compression artifacts, MP3 artifacts, digital clipping, distortion, muffled, muddy, unclear, echo, reverb, "
    "room echo, over-reverberated, hollow sound, distant, washed out, harsh, shrill, piercing, grating, tinny, "
    "thin sound, boomy, bass-heavy, flat EQ, over-compressed, abrupt cut, jarring transition, sudden silence, "
    "looping artifact, music, instrumental, sirens, alarms, crowd noise, unrelated sound effects, chaotic, "
    "disorganized, messy, cheap sound"
    ", emotionless, flat delivery, deadpan, lifeless, apathetic, robotic, mechanical, monotone, flat intonation, "
    "undynamic, boring, reading from a script, AI voice, synthetic, text-to-speech, TTS, insincere, fake emotion, "
    "exaggerated, overly dramatic, melodramatic, cheesy, cringey, hesitant, unconfident, tired, weak voice, "
    "stuttering, stammering, mumbling, slurred speech, mispronounced, bad articulation, lisp, vocal fry, creaky "
    "voice, mouth clicks, lip smacks, wet mouth sounds, heavy breathing, audible inhales, plosives, p-pops, "
    "coughing, clearing throat, sneezing, speaking too fast, rushed, speaking too slow, dragged out, unnatural "
    "pauses, awkward silence, choppy, disconnected, multiple speakers, two voices, background talking, out of tune, "
    "off-key, autotune artifacts"
)

#: (height, width) presets the preview was trained on (272p and 540p).
TRAINED_RESOLUTIONS = ((256, 448), (512, 896))
#: The 1080p preset: preview at 512x896 (``config.preview_height/preview_width``), then the refiner.
#: Needs the refiner component.
REFINER_RESOLUTION = (1088, 1920)
#: ``resolution=`` presets (SandAI ``entry.py`` ``RESOLUTION_PRESETS``) as (height, width) of the output.
RESOLUTION_PRESETS = {"272p": (256, 448), "540p": (512, 896), "1080p": REFINER_RESOLUTION}

#: ``output_type`` values ``Magi2Pipeline.__call__`` accepts.
OUTPUT_TYPES = ("np", "pil", "pt", "latent")


def apply_resolution_preset(resolution: str, height: int, width: int) -> tuple[int, int]:
    """``(height, width)`` of a ``resolution`` preset; ``height``/``width`` must be the defaults or the preset.

    Raises:
        ValueError: an unknown preset, or a conflicting explicit height/width.
    """
    if resolution not in RESOLUTION_PRESETS:
        raise ValueError(f"resolution must be one of {sorted(RESOLUTION_PRESETS)}; got {resolution!r}")
    preset = RESOLUTION_PRESETS[resolution]
    if (height, width) not in ((512, 896), preset):
        raise ValueError(
            f"resolution={resolution!r} means {preset[0]}x{preset[1]}; it conflicts with height={height!r}, "
            f"width={width!r} (pass either resolution or height/width)"
        )
    return preset


def resolve_stage_sizes(
    height: int,
    width: int,
    preview_height: int | None = None,
    preview_width: int | None = None,
    default_preview: tuple[int, int] = (512, 896),
) -> tuple[bool, int, int]:
    """Whether a call runs the refiner, and the preview stage's size: two stages for ``REFINER_RESOLUTION``
    (preview ``default_preview``) or an explicit preview size, else one stage at ``height x width``.

    Returns:
        ``(refine, denoise_height, denoise_width)`` in pixels.

    Raises:
        ValueError: only one of ``preview_height``/``preview_width`` given.
    """
    if (preview_height is None) != (preview_width is None):
        raise ValueError(
            "preview_height and preview_width go together (the preview size of the two-stage refiner path); "
            f"got preview_height={preview_height!r}, preview_width={preview_width!r}"
        )
    if preview_height is not None:
        return True, preview_height, preview_width
    if (height, width) == REFINER_RESOLUTION:
        return True, default_preview[0], default_preview[1]
    return False, height, width
