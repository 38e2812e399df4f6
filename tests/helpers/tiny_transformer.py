"""A tiny random ``Magi2Transformer3DModel`` whose every tensor matters, and matching inputs, for the model tests."""

from __future__ import annotations

import torch

from diffusers_magi2.models.transformer_magi2 import Magi2Transformer3DModel


TINY = {
    "num_layers": 2,
    "num_attention_heads": 4,
    "attention_head_dim": 16,
    "num_key_value_heads": 2,
    "in_channels": 8,
    "audio_in_channels": 12,
    "text_in_channels": 20,
    "intermediate_factor": 2,
    "multimodal_layers": [0],
    "moe_layers": [1],
    "num_streams": 4,
    "moe_num_heads": 2,
    "moe_num_experts": 4,
    "moe_top_k": 2,
    "moe_expert_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "modality_specific_expert_intermediate_size": 32,
}


def tiny_model(seed: int = 0, **overrides) -> Magi2Transformer3DModel:
    """TINY random model whose every tensor matters (random mHC, sinks, norms, router)."""
    torch.manual_seed(seed)
    model = Magi2Transformer3DModel(**{**TINY, **overrides})
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if leaf in ("phi_fused", "sinks") or "norm" in name or leaf.startswith("bias_"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
            elif leaf.startswith("alpha_"):
                p.fill_(0.5)
            elif name.endswith(("W_gate", "W_up", "W_down", "moe_mlp.gate")):
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[-2] ** -0.5)
        for name, b in model.named_parameters():
            if name.endswith("expert_bias"):  # the router's bias, which it routes with as expert_bias_ema
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)
                model.get_parameter(name + "_ema").copy_(b)
    return model.eval()


def tiny_inputs(batch: int = 2, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    text = torch.randn(batch, 3, TINY["text_in_channels"], generator=g, dtype=dtype)
    mask = torch.ones(batch, 3, dtype=torch.bool)
    mask[-1, 2:] = False
    return {
        "hidden_states": torch.randn(batch, TINY["in_channels"], 2, 4, 4, generator=g, dtype=dtype),
        "timestep": torch.full((batch,), 613.5, dtype=dtype),
        "encoder_hidden_states": text,
        "audio_hidden_states": torch.randn(batch, 4, TINY["audio_in_channels"], generator=g, dtype=dtype),
        "encoder_attention_mask": mask,
    }
