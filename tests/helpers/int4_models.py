"""int4 twins of MoE layers and transformers in memory: the same weights with the routed experts quantized by
``quantize_int4`` (what quantize-at-load and ``magi2-convert --expert_dtype int4`` must give)."""

from __future__ import annotations

import dataclasses

from diffusers_magi2.moe.layer import Magi2MultiHeadMoE
from diffusers_magi2.moe.quantize_int4 import INT4_SCALE_NAMES, quantize_int4


BANKS = ("W_gate", "W_up", "W_down")


def _quantized_state(state: dict, prefix: str, group_size: int) -> None:
    """Replace the three banks under ``prefix`` of ``state`` by their codes and group scales."""
    for bank, scale in zip(BANKS, INT4_SCALE_NAMES):
        state[prefix + bank], state[prefix + scale] = quantize_int4(state[prefix + bank], group_size)


def int4_copy(module: Magi2MultiHeadMoE, group_size: int, **kwargs) -> Magi2MultiHeadMoE:
    """The same layer with int4 experts quantized from ``module``'s banks (``kwargs``: EP rank and size)."""
    config = dataclasses.replace(module.config, expert_dtype="int4", int4_group_size=group_size)
    quantized = Magi2MultiHeadMoE(config, **kwargs)
    state = module.state_dict()
    _quantized_state(state, "", group_size)
    quantized.load_state_dict(state)
    return quantized


def int4_transformer(model, group_size: int):
    """``model`` (a ``Magi2Transformer3DModel``) with int4 routed experts: dense weights and islands as they are."""
    config = {k: v for k, v in model.config.items() if not k.startswith("_")}  # _use_default_values would win
    config.update(expert_dtype="int4", expert_int4_group_size=group_size)
    twin = type(model).from_config(config).to(model.dtype)
    state = model.state_dict()
    for name, module in model.named_modules():
        if isinstance(module, Magi2MultiHeadMoE):
            _quantized_state(state, f"{name}.", group_size)
    twin.load_state_dict(state)
    return twin.eval()
