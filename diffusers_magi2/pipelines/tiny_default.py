"""The embedded tiny MAGI-2 pipelines (``Magi2Pipeline`` with tiny widths), built or loaded offline.

* The tiny random model (:func:`build_tiny_random_pipeline`): every component has the real structure and channel
  interfaces but tiny widths (:data:`TINY_DEFAULT_CONFIG`), seeded random weights built in code, and a byte-level
  BPE tokenizer trained here.
* The trained tiny model (:func:`load_tiny_trained_pipeline`, the default of :func:`build_tiny_default_pipeline`
  and of ``examples/generate.py`` without ``--model``): the same classes at :data:`TINY_TRAINED_CONFIG`'s shapes,
  trained by ``examples/tiny/`` on the synthetic world of :mod:`.tiny_world`, shipped in the package as a diffusers
  repo folder (:data:`TINY_TRAINED_DIR`).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

from .decoding_magi2 import WAN22_VAE_CONFIG


__all__ = [
    "TINY_DEFAULT_CONFIG",
    "TINY_TRAINED_CONFIG",
    "TINY_TRAINED_DIR",
    "TINY_WEIGHTS",
    "build_tiny_default_pipeline",
    "build_tiny_random_pipeline",
    "cast_pipeline_to_compute_dtype",
    "build_tiny_tokenizer",
    "init_tiny_weights",
    "load_tiny_trained_pipeline",
]

#: Everything the tiny default is made of. ``call`` holds the defaults ``examples/generate.py`` uses
#: for the tiny model (resolution and step count); the rest are component configs.
TINY_DEFAULT_CONFIG: dict[str, Any] = {
    "seed": 20250611,
    "call": {"height": 128, "width": 224, "num_inference_steps": 8},
    "tokenizer": {"vocab_size": 1024},
    "text_encoder": {
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 4,
        "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        "full_attention_interval": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 8,
        "linear_value_head_dim": 8,
        "linear_conv_kernel_dim": 4,
        "max_position_embeddings": 8192,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [1, 1, 0],
            "mrope_interleaved": True,
        },
    },
    "transformer": {
        "num_layers": 2,
        "num_attention_heads": 4,
        "attention_head_dim": 32,
        "num_key_value_heads": 4,
        "in_channels": 48,
        "audio_in_channels": 64,
        "text_in_channels": 64,
        "intermediate_factor": 2,
        "multimodal_layers": [0],
        "moe_layers": [1],
        "num_streams": 4,
        "num_sink_tokens": 1,
        "moe_num_heads": 2,
        "moe_num_experts": 8,
        "moe_top_k": 2,
        "moe_expert_intermediate_size": 64,
        "shared_expert_intermediate_size": 64,
        "modality_specific_expert_intermediate_size": 64,
    },
    "vae": {**WAN22_VAE_CONFIG, "base_dim": 4, "decoder_base_dim": 6, "num_res_blocks": 1},
    "video_decoder": {
        "latent_channels": 48,
        "decoder_block_out_channels": [8, 8, 12, 16],
        "decoder_layers_per_block": [1, 1, 1, 1, 1],
        "decoder_spatio_temporal_scaling": [False, True, True, True],
        "decoder_spatio_only": [False, True, False, False],
        "patch_size": 2,
        "use_unpatchify": True,
        "first_chunk_size": 7,
        "step_size": 7,
    },
    # the encoder's last conv emits mean and scale, encoder_hidden_size = 2 x decoder_input_channels
    "audio_vae": {
        "encoder_hidden_size": 128,
        "downsampling_ratios": [2, 4, 4, 8, 8],
        "channel_multiples": [1, 1, 1, 1, 1],
        "decoder_channels": 4,
        "decoder_input_channels": 64,
        "audio_channels": 2,
        "sampling_rate": 44100,
    },
    "scheduler": {
        "use_flow_sigmas": True,
        "flow_shift": 7.0,
        "prediction_type": "flow_prediction",
        "solver_order": 2,
        "solver_type": "bh2",
        "predict_x0": True,
        "lower_order_final": True,
        "final_sigmas_type": "zero",
    },
}

#: The trained tiny model's overrides of :data:`TINY_DEFAULT_CONFIG` (the shapes its weights were trained at): a
#: 2 s clip at 32x32 pixels (``pipeline.duration_s``; ``pipeline.trained_resolutions`` keeps the pipeline from
#: warning at that size), and 8 audio latent channels (the 64 of the random model need an
#: audio encoder 128 channels wide at the full sample rate, too slow to train on a CPU).
TINY_TRAINED_CONFIG: dict[str, Any] = {
    "call": {"height": 32, "width": 32, "num_inference_steps": 16},
    "pipeline": {"duration_s": 2.0, "trained_resolutions": [[32, 32]]},
    "transformer": {"audio_in_channels": 8},
    "audio_vae": {
        "encoder_hidden_size": 16,
        "decoder_input_channels": 8,
        "decoder_channels": 16,
        "channel_multiples": [1, 1, 1, 1, 1],
    },
}

# Text the tiny tokenizer's BPE merges are learned from: the built-in negative prompt (so that the
# unconditional branch stays short) plus ordinary scene descriptions and markdown-prompt field names.
_CORPUS_EXTRA = [
    "A red fox trots through fresh snow at dawn, wind howling.",
    "A woman walks along a quiet beach at sunset while waves roll in and gulls call overhead.",
    "A chef slices vegetables in a busy kitchen; pans sizzle and plates clatter.",
    "The camera slowly pans across a city street at night, rain falling on neon signs.",
    "context: aesthetics: style= mood= color= audio: language= speakers= ambience= subjects: objects: timeline:",
    "dialogue action objects The first frame refers to <Figure 1> reference_layer:",
    "一只小猫在阳光下睡觉 你好世界",
]


def build_tiny_tokenizer(vocab_size: int = 1024):
    """A deterministic Qwen3.5-style byte-level BPE tokenizer (same normaliser, split, specials), trained offline.

    Returns:
        ``transformers.PreTrainedTokenizerFast`` with right padding.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    from .pipeline_magi2 import DEFAULT_NEGATIVE_PROMPT

    qwen_split = (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
        r"|\s*[\r\n]+|\s+(?!\S)|\s+"
    )
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(qwen_split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([DEFAULT_NEGATIVE_PROMPT] + _CORPUS_EXTRA, trainer=trainer)
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token="<|endoftext|>",
        eos_token="<|im_end|>",
        padding_side="right",
        model_max_length=262144,
    )


@torch.no_grad()
def init_tiny_weights(module: torch.nn.Module, generator: torch.Generator) -> torch.nn.Module:
    """Deterministic init: matrices N(0, 1/fan_in), mHC ``alpha`` 0.5, norms, biases and sinks 0; buffers kept."""
    for name, param in module.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if "alpha" in leaf:
            param.fill_(0.5)
        elif "norm" in name or leaf in ("bias", "sinks") or leaf.startswith("bias_"):
            param.zero_()
        elif param.ndim >= 2:
            fan_in = param.shape[-1] if param.ndim == 2 else param.shape[-2]
            values = torch.randn(param.shape, generator=generator, dtype=torch.float32) / fan_in**0.5
            param.copy_(values.to(param.dtype))
        else:
            param.zero_()
    return module


#: Components kept in fp32 whatever the compute dtype, as the reference runs them.
FP32_COMPONENTS = ("vae", "audio_vae")


def cast_pipeline_to_compute_dtype(pipe, dtype: torch.dtype):
    """Cast a ``Magi2Pipeline``'s models to ``dtype`` in place, except :data:`FP32_COMPONENTS` (and fp32 islands).

    Args:
        pipe: a ``Magi2Pipeline`` (any device).
        dtype: floating-point compute dtype, e.g. ``torch.bfloat16``.

    Returns:
        ``pipe`` (cast in place).
    """
    for name, component in pipe.components.items():
        if isinstance(component, torch.nn.Module):
            component.to(dtype=torch.float32 if name in FP32_COMPONENTS else dtype)
    return pipe


#: The trained tiny ``Magi2Pipeline`` shipped in the package: a diffusers repo folder (``model_index.json``, one
#: sub-folder per component) trained on the tiny world at :data:`TINY_TRAINED_CONFIG`'s shapes.
TINY_TRAINED_DIR = Path(__file__).with_name("tiny_trained")
#: ``weights=`` values of :func:`build_tiny_default_pipeline`.
TINY_WEIGHTS = ("trained", "random")


def load_tiny_trained_pipeline(dtype: torch.dtype = torch.float32):
    """Load the shipped trained tiny pipeline (:data:`TINY_TRAINED_DIR`) offline.

    Args:
        dtype: compute dtype of the models (:func:`cast_pipeline_to_compute_dtype`).

    Returns:
        a ``Magi2Pipeline`` on CPU with ``pipe.tiny_call_defaults`` from :data:`TINY_TRAINED_CONFIG`.

    Raises:
        ValueError: ``dtype`` is not a floating-point ``torch.dtype``.
        FileNotFoundError: the folder is not in this installation.
    """
    _check_dtype(dtype)
    if not (TINY_TRAINED_DIR / "model_index.json").is_file():
        raise FileNotFoundError(
            f"the trained tiny pipeline is not in this installation (no model_index.json in {TINY_TRAINED_DIR}): "
            "install the package with its data (pip install .), or pass weights='random' for the seeded random "
            "model"
        )
    from .pipeline_magi2 import Magi2Pipeline

    pipe = Magi2Pipeline.from_pretrained(TINY_TRAINED_DIR, local_files_only=True)
    if dtype != torch.float32:
        cast_pipeline_to_compute_dtype(pipe, dtype)
    pipe.tiny_call_defaults = dict(TINY_TRAINED_CONFIG["call"])
    return pipe


def build_tiny_default_pipeline(
    config: dict[str, Any] | None = None, dtype: torch.dtype = torch.float32, weights: str | None = None
):
    """The tiny default ``Magi2Pipeline``, offline: the trained tiny model shipped in the package
    (:func:`load_tiny_trained_pipeline`), or with a shape override or ``weights="random"`` the seeded random model
    (:func:`build_tiny_random_pipeline`).

    Args:
        config: overrides merged over :data:`TINY_DEFAULT_CONFIG` (per component, shallow); builds the random
            model.
        dtype: compute dtype of the models (:func:`cast_pipeline_to_compute_dtype`).
        weights: ``"trained"`` or ``"random"``; default ``"random"`` with a ``config``, else ``"trained"``.

    Returns:
        a ``Magi2Pipeline`` on CPU; its tiny call defaults (``height``, ``width``, ``num_inference_steps``) are in
        ``pipe.tiny_call_defaults``.

    Raises:
        ValueError: ``dtype`` is not a floating-point ``torch.dtype``, ``weights`` is not one of
            :data:`TINY_WEIGHTS`, or ``weights="trained"`` with a ``config`` (the trained weights have fixed shapes).
        FileNotFoundError: ``"trained"`` and the shipped folder is missing (e.g. a source tree without it).
    """
    if weights is None:
        weights = "random" if config is not None else "trained"
    if weights not in TINY_WEIGHTS:
        raise ValueError(f"weights must be one of {TINY_WEIGHTS}, got {weights!r}")
    if weights == "random":
        return build_tiny_random_pipeline(config, dtype)
    if config is not None:
        raise ValueError(
            "weights='trained' takes no config: the trained tiny model has fixed shapes (TINY_TRAINED_CONFIG); "
            "pass weights='random' to build the random model with overrides"
        )
    return load_tiny_trained_pipeline(dtype)


def _check_dtype(dtype) -> None:
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point torch.dtype (e.g. torch.bfloat16), got {dtype!r}")


def build_tiny_random_pipeline(config: dict[str, Any] | None = None, dtype: torch.dtype = torch.float32):
    """Build the tiny ``Magi2Pipeline`` with seeded random weights, in memory and offline.

    Args:
        config: overrides merged over :data:`TINY_DEFAULT_CONFIG` (per component, shallow); a ``"pipeline"`` entry
            holds ``Magi2Pipeline`` config values (e.g. ``duration_s``).
        dtype: compute dtype of the models (:func:`cast_pipeline_to_compute_dtype`).

    Returns:
        a ``Magi2Pipeline`` on CPU; its tiny call defaults are in ``pipe.tiny_call_defaults``.

    Raises:
        ValueError: ``dtype`` is not a floating-point ``torch.dtype``.
    """
    _check_dtype(dtype)
    from diffusers import AutoencoderKLWan, AutoencoderOobleck, UniPCMultistepScheduler
    from transformers import Qwen3_5TextConfig, Qwen3_5TextModel

    from ..models.transformer_magi2 import Magi2Transformer3DModel
    from ..models.turbo_vae import Magi2TurboVAEDecoder
    from .pipeline_magi2 import Magi2Pipeline

    cfg = copy.deepcopy(TINY_DEFAULT_CONFIG)
    for key, value in (config or {}).items():
        if isinstance(value, dict) and isinstance(cfg.get(key), dict):
            cfg[key].update(value)
        else:
            cfg[key] = value
    generator = torch.Generator().manual_seed(int(cfg["seed"]))

    components = {}
    tokenizer = components["tokenizer"] = build_tiny_tokenizer(**cfg["tokenizer"])
    text_config = Qwen3_5TextConfig(
        vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, **cfg["text_encoder"]
    )
    torch.manual_seed(int(cfg["seed"]))
    components["text_encoder"] = Qwen3_5TextModel(text_config).eval()

    components["transformer"] = init_tiny_weights(Magi2Transformer3DModel(**cfg["transformer"]), generator)

    vae_cfg = dict(cfg["vae"])
    z_dim = vae_cfg["z_dim"]
    vae_cfg.setdefault("latents_mean", (torch.rand(z_dim, generator=generator) * 0.4 - 0.2).tolist())
    vae_cfg.setdefault("latents_std", (torch.rand(z_dim, generator=generator) * 0.5 + 0.75).tolist())
    torch.manual_seed(int(cfg["seed"]) + 1)
    components["vae"] = AutoencoderKLWan(**vae_cfg).eval()

    decoder_cfg = dict(cfg["video_decoder"])
    decoder_cfg.setdefault("latents_mean", vae_cfg["latents_mean"])
    decoder_cfg.setdefault("latents_std", vae_cfg["latents_std"])
    torch.manual_seed(int(cfg["seed"]) + 3)
    components["video_decoder"] = Magi2TurboVAEDecoder(**decoder_cfg).eval()  # PyTorch default conv init

    torch.manual_seed(int(cfg["seed"]) + 2)
    components["audio_vae"] = AutoencoderOobleck(**cfg["audio_vae"]).eval()
    components["scheduler"] = UniPCMultistepScheduler(**cfg["scheduler"])

    pipe = Magi2Pipeline(**components, **cfg.get("pipeline", {}))
    if dtype != torch.float32:
        cast_pipeline_to_compute_dtype(pipe, dtype)
    pipe.tiny_call_defaults = dict(cfg["call"])
    return pipe
