"""What the weight-streaming tests share: a four-block bf16 model, a no-grad forward, a bit-for-bit comparison, a
LoRA with random factors and the refiner's inputs."""

from __future__ import annotations

import torch
from peft import LoraConfig

from helpers.tiny_transformer import tiny_model


#: four layers (two MoE, two multimodal) so a two-slot ring is reused within one forward
LAYERS = {"num_layers": 4, "multimodal_layers": [0, 3], "moe_layers": [1, 2]}


def bf16_model():
    """The tiny model with :data:`LAYERS`, in bf16."""
    return tiny_model(**LAYERS).to(torch.bfloat16)


def block_tensors(model):
    """Every parameter and buffer of ``model``'s ``transformer_blocks``."""
    return [t for b in model.transformer_blocks for t in [*b.parameters(), *b.buffers()]]


def block_ptrs(model):
    """The data pointers of :func:`block_tensors` (to tell that no weight moved)."""
    return [t.data_ptr() for t in block_tensors(model)]


def run_model(model, inputs):
    """``(sample, audio_sample)`` of ``model(**inputs)`` under ``torch.no_grad()``."""
    with torch.no_grad():
        out = model(**inputs)
    return out.sample, out.audio_sample


def assert_bitwise(a, b):
    """The outputs ``a`` and ``b`` (tuples of tensors or ``None``) are equal bit for bit, dtypes included."""
    for x, y in zip(a, b):
        assert (x is None) == (y is None)
        if x is not None:
            assert x.dtype == y.dtype and torch.equal(x, y)


def with_lora(model):
    """``model`` with a rank-2 LoRA on every ``linear_proj`` (the grouped projections excluded), factors drawn
    from a seeded generator so the adapter changes the output."""
    model.add_adapter(
        LoraConfig(
            r=2, lora_alpha=4, target_modules=["linear_proj"], exclude_modules=model.modality_grouped_linear_names()
        )
    )
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_A." in name or ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def refiner_inputs(config) -> dict:
    """Seeded bf16 inputs of a tiny refiner of ``config``: 2 latent frames of 4 x 4, 3 text tokens."""
    g = torch.Generator().manual_seed(0)
    return {
        "hidden_states": torch.randn(1, config.in_channels, 2, 4, 4, generator=g).bfloat16(),
        "encoder_hidden_states": torch.randn(1, 3, config.text_in_channels, generator=g).bfloat16(),
    }
