"""Shared helpers of the LoRA tests (imported by file path; not a test module): LoRA files written in each
seruva19/mirai key layout from random factors, and the same deltas merged by hand into a model copy."""

from __future__ import annotations

import copy
import functools

import torch
from peft.tuners.tuners_utils import BaseTunerLayer
from safetensors.torch import save_file


FP32_EPS = torch.finfo(torch.float32).eps


@functools.lru_cache(maxsize=None)
def tiny_sandai_model(fixtures_root: str, case: str):
    """The tiny SandAI preview (``preview_h4``, ...) or ``refiner`` of the fixtures, fp32, built once per process
    (callers deep-copy it before changing it)."""
    from diffusers_magi2 import Magi2RefinerTransformer3DModel, Magi2Transformer3DModel

    path = f"{fixtures_root}/magi2_tiny/{case}/sandai_checkpoint"
    if case == "refiner":
        return Magi2RefinerTransformer3DModel.from_original_checkpoint(path, torch_dtype=torch.float32)
    return Magi2Transformer3DModel.from_original_checkpoint(path, dtype=torch.float32)


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def lora_targets(model, router: bool = True) -> dict[str, str]:
    """``{parameter name: SandAI native module path}`` of mirai's default targets: ``linear_qkv`` and
    ``linear_proj`` in every layer (grouped in the multimodal ones) and the MoE layers' router gate."""
    out = {}
    for name, _ in model.named_parameters():
        layer = name.split(".")[1] if name.startswith("transformer_blocks.") else None
        if name.endswith(("attention.linear_qkv.weight", "attention.linear_proj.weight")):
            out[name] = f"block.layers.{layer}." + name.split(".", 2)[2].removesuffix(".weight")
        elif router and name.endswith("mlp.moe_mlp.gate"):
            out[name] = f"block.layers.{layer}.mlp.moe_mlp"
    return out


def random_factors(model, rank: int = 3, seed: int = 0, std: float = 0.05, router: bool = True):
    """``{parameter name: (native path, A [r, in], B [rows, r])}`` for :func:`lora_targets`."""
    g = torch.Generator().manual_seed(seed)
    params = dict(model.named_parameters())
    out = {}
    for name, native in lora_targets(model, router).items():
        rows, cols = params[name].shape
        out[name] = (native, torch.randn(rank, cols, generator=g) * std, torch.randn(rows, rank, generator=g) * std)
    return out


def mirai_state_dict(factors: dict, layout: str, alpha: float = 1.0) -> dict:
    """The factors under mirai's keys for ``layout`` (``.alpha`` written as mirai does, 1.0)."""
    sd = {}
    for native, a, b in factors.values():
        param = "gate" if native.endswith("moe_mlp") else "weight"
        if layout == "mirai_native":
            stem = f"{native}.parametrizations.{param}.0"
            sd[f"{stem}.lora_a"], sd[f"{stem}.lora_b"] = a, b
        elif layout == "mirai_kohya":
            sd[f"lora_unet.{native}.lora_down.weight"], sd[f"lora_unet.{native}.lora_up.weight"] = a, b
            sd[f"lora_unet.{native}.alpha"] = torch.tensor(alpha)
        elif layout == "mirai_diffusers":
            sd[f"unet.{native}.lora_A.weight"], sd[f"unet.{native}.lora_B.weight"] = a, b
            sd[f"unet.{native}.alpha"] = torch.tensor(alpha)
        else:
            raise ValueError(layout)
    return sd


def write_mirai_file(factors: dict, layout: str, folder) -> str:
    """Write the factors as mirai does: ``adapter.pt`` (native) or ``adapter.safetensors``; returns the path."""
    sd = mirai_state_dict(factors, layout)
    if layout == "mirai_native":
        path = folder / "adapter.pt"
        torch.save(sd, path)
    else:
        path = folder / "adapter.safetensors"
        save_file(sd, str(path), metadata={"alpha": "1.0", "format": "pt"})
    return str(path)


def merged_by_hand(base, factors: dict, scale: float = 1.0):
    """A copy of ``base`` with ``scale * B @ A`` (computed in fp64) added to each target weight."""
    merged = copy.deepcopy(base)
    params = dict(merged.named_parameters())
    with torch.no_grad():
        for name, (_, a, b) in factors.items():
            params[name] += (scale * (b.double() @ a.double())).to(params[name].dtype)
    return merged


def has_tuner_layers(model) -> bool:
    return any(isinstance(m, BaseTunerLayer) for m in model.modules())


def clone_state(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def within_fp32_rounding(now: torch.Tensor, before: torch.Tensor, delta=None) -> bool:
    """``now`` is ``before`` up to the two fp32 roundings of adding and subtracting a delta (fuse, then unfuse):
    ``|now - before| <= 2 eps (|before| + |delta|)`` elementwise; an unknown ``delta`` is taken as large as
    ``before``'s largest entry."""
    now, before = now.double(), before.double()
    size = delta.double().abs() if delta is not None else before.abs().max()
    return bool(((now - before).abs() <= 2 * FP32_EPS * (before.abs() + size)).all())


def state_within_fp32_rounding(model, state: dict, deltas: dict | None = None) -> bool:
    """:func:`within_fp32_rounding` for every tensor of ``model.state_dict()`` against ``state`` (same names);
    ``deltas``: the fused delta of some of them."""
    now, deltas = model.state_dict(), deltas or {}
    return set(now) == set(state) and all(within_fp32_rounding(now[k], state[k], deltas.get(k)) for k in state)


def fused_deltas(factors: dict, scale: float = 1.0) -> dict:
    """``{parameter name: scale * B @ A}`` (fp64) of :func:`random_factors`' factors."""
    return {name: scale * (b.double() @ a.double()) for name, (_, a, b) in factors.items()}


def assert_untouched(model, state: dict) -> None:
    """``model`` has no LoRA layer or adapter config, and every tensor equals ``state`` bit for bit."""
    assert not has_tuner_layers(model)
    assert not getattr(model, "peft_config", None)
    assert same_state(model, state)


def same_state(model, state: dict) -> bool:
    """Every tensor of ``model.state_dict()`` equals ``state`` bit for bit, under the same names."""
    now = model.state_dict()
    return set(now) == set(state) and all(torch.equal(now[k], state[k]) for k in state)
