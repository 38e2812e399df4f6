"""Group offload on CUDA (skipped without a GPU): the fp32 islands and the routed experts' storage dtype survive
``enable_group_offload(..., use_stream=True)``, and the output equals the model kept on the GPU."""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors.torch import load_file

from diffusers_magi2 import Magi2Transformer3DModel


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

EXPERTS = ("W_gate", "W_up", "W_down")


def _model(fixtures_dir, tmp_path, expert_dtype):
    """The bf16 tiny Preview; with ``expert_dtype``, its saved repo quantized at load (``from_pretrained``)."""
    model = Magi2Transformer3DModel.from_original_checkpoint(
        fixtures_dir / "magi2_tiny/preview_h4/sandai_checkpoint", dtype=torch.bfloat16
    )
    if expert_dtype is None:
        return model
    model.save_pretrained(tmp_path)
    fp8 = Magi2Transformer3DModel.from_pretrained(tmp_path, dtype=torch.bfloat16, expert_dtype=expert_dtype)
    assert all(getattr(m, name).dtype == torch.float8_e4m3fn for m in _moe(fp8) for name in EXPERTS)
    return fp8


def _moe(model):
    return [b.mlp.moe_mlp for b in model.transformer_blocks if hasattr(b.mlp, "moe_mlp")]


@pytest.mark.parametrize("expert_dtype", [None, "float8_e4m3fn"], ids=["bf16", "fp8_experts"])
def test_group_offload_keeps_fp32_islands_and_expert_dtype(fixtures_dir, tmp_path, expert_dtype):
    model = _model(fixtures_dir, tmp_path, expert_dtype)
    d = load_file(str(fixtures_dir / "magi2_tiny/preview_h4/bf16/transformer_case.safetensors"))
    args = [
        d["model." + k].cuda()
        for k in ("x", "coords_mapping", "modality_mapping", "cu_seqlens_q", "time_token_sequence")
    ]
    before = {n: (t.dtype, t.clone()) for n, t in model.state_dict().items()}
    islands = [n for n, t in model.state_dict().items() if t.is_floating_point() and model.is_fp32_island(n)]
    assert islands

    on_gpu = copy.deepcopy(model).cuda()
    on_gpu.set_moe_backend("torch")
    with torch.no_grad():
        reference = on_gpu.forward_packed(*args)
    del on_gpu

    model.enable_group_offload(
        onload_device=torch.device("cuda"), offload_type="block_level", num_blocks_per_group=1, use_stream=True
    )
    model.set_moe_backend("torch")
    with torch.no_grad():
        out = model.forward_packed(*args)
    after = model.state_dict()
    assert all(after[n].dtype == torch.float32 and torch.equal(after[n].cpu(), before[n][1]) for n in islands)
    experts = [n for n in before if n.endswith(EXPERTS)]
    assert experts and all(after[n].dtype == before[n][0] for n in experts)
    torch.testing.assert_close(out, reference, atol=0, rtol=0)
