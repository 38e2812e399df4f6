"""Accuracy of FP8 routed experts on the tiny fixtures: ``model.out`` of the FP8 model (bf16 dense + FP8 experts)
and of the bf16 model against the fp32 fixture, side by side, with the routing flips of each against fp32; the
torch and Triton (interpreter) expert paths on the FP8 model."""

from __future__ import annotations

import functools

import pytest
import torch
from safetensors.torch import load_file

from diffusers_magi2 import Magi2Transformer3DModel
from diffusers_magi2.moe.layer import Magi2MultiHeadMoE


FP8_REL_L2 = 0.15  # weight-only e4m3 experts, end to end (the fixtures README's loose bf16 bound)
TRITON_VS_TORCH_REL_L2 = 1e-2
CASES = [("preview_h4", ""), ("preview_h4", "i2v."), ("preview_h3", "")]


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


@functools.lru_cache(maxsize=None)
def _model(fixtures_root: str, case: str, kind: str) -> Magi2Transformer3DModel:
    """``kind``: ``fp32``, ``bf16`` (the released dtypes) or ``fp8`` (bf16 + FP8 experts, quantized at load)."""
    import tempfile

    path = f"{fixtures_root}/magi2_tiny/{case}/sandai_checkpoint"
    if kind != "fp8":
        return Magi2Transformer3DModel.from_original_checkpoint(
            path, dtype=getattr(torch, {"fp32": "float32"}.get(kind, "bfloat16"))
        )
    with tempfile.TemporaryDirectory() as folder:
        _model(fixtures_root, case, "bf16").save_pretrained(folder)
        return Magi2Transformer3DModel.from_pretrained(folder, dtype=torch.bfloat16, expert_dtype="float8_e4m3fn")


@functools.lru_cache(maxsize=None)
def _case(fixtures_root: str, case: str) -> dict:
    return load_file(f"{fixtures_root}/magi2_tiny/{case}/fp32/transformer_case.safetensors")


def _run(model, d: dict, prefix: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``model.out`` of the case and the top-k expert indices of every MoE layer (``[H, S, k]``, sorted along k)."""
    chosen: list[torch.Tensor] = []
    moes = [m for m in model.modules() if isinstance(m, Magi2MultiHeadMoE)]

    def recording(moe):
        route = moe.route

        def wrapped(x):
            probs, indices = route(x)
            chosen.append(indices.sort(dim=-1).values)
            return probs, indices

        return wrapped

    for moe in moes:
        moe.route = recording(moe)
    try:
        g = lambda k: d[prefix + "model." + k]  # noqa: E731
        with torch.no_grad():
            out = model.forward_packed(
                g("x"), g("coords_mapping"), g("modality_mapping"), g("cu_seqlens_q"), g("time_token_sequence")
            )
    finally:
        for moe in moes:
            del moe.route
    return out[:, : g("out").shape[1]].float(), chosen


def _flips(chosen, reference) -> list[tuple[int, int]]:
    """Per MoE layer: (token-heads whose expert set differs from the reference's, token-heads)."""
    return [(int((a != b).any(-1).sum()), a.shape[0] * a.shape[1]) for a, b in zip(chosen, reference)]


@pytest.mark.parametrize(("case", "prefix"), CASES, ids=["h4", "h4-i2v", "h3"])
def test_fp8_experts_rel_l2_and_routing_flips_against_the_fp32_fixture(fixtures_dir, case, prefix):
    root = str(fixtures_dir)
    d = _case(root, case)
    target = d[prefix + "model.out"]
    fp32_out, fp32_chosen = _run(_model(root, case, "fp32"), d, prefix)
    assert rel_l2(fp32_out, target) <= 1e-5  # the fp32 port reproduces the fixture, so its routing is the reference
    results = {}
    for kind in ("bf16", "fp8"):
        out, chosen = _run(_model(root, case, kind), d, prefix)
        assert torch.isfinite(out).all()
        results[kind] = (rel_l2(out, target), _flips(chosen, fp32_chosen))
    flips = lambda f: ", ".join(f"{n}/{t}" for n, t in f)  # noqa: E731
    print(
        f"\n{case} {prefix or 't2v.'}model.out rel-L2 vs fp32 fixture: bf16 {results['bf16'][0]:.4f} | FP8 experts "
        f"{results['fp8'][0]:.4f}; routing flips vs fp32 per MoE layer: bf16 {flips(results['bf16'][1])} | FP8 "
        f"{flips(results['fp8'][1])}"
    )
    assert results["fp8"][0] <= FP8_REL_L2


def test_fp8_model_torch_and_triton_paths_agree(fixtures_dir):
    root = str(fixtures_dir)
    model = _model(root, "preview_h4", "fp8")
    d = _case(root, "preview_h4")
    try:
        model.set_moe_backend("torch")
        torch_out, _ = _run(model, d, "")
        model.set_moe_backend("triton")
        triton_out, _ = _run(model, d, "")
    finally:
        model.set_moe_backend("auto")
    err = rel_l2(triton_out, torch_out)
    print(f"\nFP8 model, preview_h4 t2v: Triton (interpreter) vs torch rel-L2 {err:.2e}")
    assert err <= TRITON_VS_TORCH_REL_L2
