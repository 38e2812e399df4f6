"""MoE test cases shared by ``tests/moe``: the golden MoE-layer cases and modules built from the tiny SandAI
checkpoints, random expert-bank cases, a one-route SwiGLU7 bank, the tiny layer config, an allocation recorder, a
host-read counter, the expert-parallel check of a layer's ranks."""

from __future__ import annotations

import contextlib
import json

import torch
from safetensors import safe_open
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from diffusers_magi2.moe.layer import Magi2MultiHeadMoE, Magi2MultiHeadMoEConfig
from diffusers_magi2.moe.routing import compute_topk_probs_and_indices

from .fixtures import golden_path


MODELS = ("preview_h4", "preview_h3")
LAYERS = (1, 2)


def load_case(model: str, variant: str, layer: int) -> dict[str, torch.Tensor]:
    path = golden_path(f"magi2_tiny/{model}/{variant}/moe_layer_cases.safetensors")
    prefix = f"layer{layer}."
    with safe_open(str(path), "pt") as f:
        return {k[len(prefix) :]: f.get_tensor(k) for k in f.keys() if k.startswith(prefix)}


def load_moe_weights(model: str, layer: int) -> dict[str, torch.Tensor]:
    ckpt = golden_path(f"magi2_tiny/{model}/sandai_checkpoint")
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    prefix = f"block.layers.{layer}.mlp.moe_mlp."
    out = {}
    for key, shard in index.items():
        if key.startswith(prefix):
            with safe_open(str(ckpt / shard), "pt") as f:
                out[key[len(prefix) :]] = f.get_tensor(key)
    return out


def moe_config(model: str, params_dtype: torch.dtype) -> Magi2MultiHeadMoEConfig:
    cfg = json.loads((golden_path(f"magi2_tiny/{model}/sandai_checkpoint/magi2_preview.json")).read_text())
    arch = cfg["arch_config"]
    moe = arch["moe_config"]
    return Magi2MultiHeadMoEConfig(
        hidden_size=arch["hidden_size"],
        num_heads=moe["num_heads"],
        num_experts=moe["num_experts"],
        top_k=moe["top_k"],
        expert_intermediate_size=moe["expert_intermediate_size"],
        params_dtype=params_dtype,
        score_func=moe["score_func"],
        route_norm=moe["route_norm"],
        route_scale=moe["route_scale"],
    )


def build_module(model: str, layer: int, params_dtype: torch.dtype) -> Magi2MultiHeadMoE:
    """The module as a SandAI loader fills it: ``router.expert_bias`` <- ``expert_bias_ema``."""
    module = Magi2MultiHeadMoE(moe_config(model, params_dtype))
    weights = load_moe_weights(model, layer)
    state = dict(weights.items())
    state["router.expert_bias"] = weights["router.expert_bias_ema"]
    with torch.no_grad():
        for name, tensor in state.items():
            target = module.get_parameter(name)
            target.copy_(tensor.to(target.dtype))
    return module


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def random_case(num_tokens, num_heads, num_experts, top_k, head_dim, expert_dim, dtype, seed=0, scale=4.9):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(dtype)
    w_gate = (torch.randn(num_heads * num_experts, head_dim, expert_dim, generator=gen) * head_dim**-0.5).to(dtype)
    w_up = (torch.randn(num_heads * num_experts, head_dim, expert_dim, generator=gen) * 2 * head_dim**-0.5).to(dtype)
    w_down = (torch.randn(num_heads * num_experts, expert_dim, head_dim, generator=gen) * expert_dim**-0.5).to(dtype)
    logits = torch.randn(num_heads, num_tokens, num_experts, generator=gen)
    probs, idx = compute_topk_probs_and_indices(logits, top_k)
    return x, probs * scale, idx, w_gate, w_up, w_down


def unit_swiglu_layer(gate_vals, up_vals, dtype=torch.float32):
    """A 1-head, 1-expert bank whose single route outputs swiglu7(gate_vals, up_vals) (x = e0, W_down = I)."""
    width = 16
    x = torch.zeros(1, 1, width, dtype=dtype)
    x[0, 0, 0] = 1.0
    w_gate = torch.zeros(1, width, width, dtype=dtype)
    w_up = torch.zeros(1, width, width, dtype=dtype)
    w_gate[0, 0, : len(gate_vals)] = torch.tensor(gate_vals, dtype=dtype)
    w_up[0, 0, : len(up_vals)] = torch.tensor(up_vals, dtype=dtype)
    w_down = torch.eye(width, dtype=dtype).unsqueeze(0)
    gather_ids = torch.zeros(1, dtype=torch.int32)
    probs = torch.ones(1)
    offsets = torch.tensor([0, 1])
    return x, gather_ids, probs, offsets, w_gate, w_up, w_down


def tiny_config(num_heads=2, num_experts=8, top_k=2, head_dim=64, expert_dim=64, dtype=torch.float32, **kw):
    """known_failure_classes TINY MoE: 2 heads (Dh 64) x 8 experts, top-2, De 64; route_scale as released."""
    return Magi2MultiHeadMoEConfig(
        hidden_size=num_heads * head_dim,
        num_heads=num_heads,
        num_experts=num_experts,
        top_k=top_k,
        expert_intermediate_size=expert_dim,
        params_dtype=dtype,
        route_scale=kw.pop("route_scale", 4.9),
        **kw,
    )


class AllocationRecorder(TorchDispatchMode):
    """Records the numel (``allocations``) and shape (``shapes``) of every op output that does not share storage
    with an input (i.e. allocations). ``inside`` maps custom ops to their Python bodies, which then run under the
    recorder (a dispatch mode sees no op inside a custom op otherwise)."""

    def __init__(self, inside: dict | None = None) -> None:
        super().__init__()
        self.allocations: list[tuple[str, int]] = []
        self.shapes: list[tuple[str, tuple[int, ...]]] = []
        self.inside = inside or {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        body = self.inside.get(func)
        if body is not None:
            with self:
                return body(*args, **(kwargs or {}))
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.allocations.append((str(func), t.numel()))
                self.shapes.append((str(func), tuple(t.shape)))
        return out


def assert_ep_ranks_match(full: Magi2MultiHeadMoE, ep_size: int, sliced: tuple[str, ...]) -> None:
    """Every expert-parallel rank of ``full`` (``ep_size`` ranks) loads ``full``'s state dict, holds
    ``ep_slice`` of each tensor in ``sliced`` (codes, scales ...) and computes ``full``'s output for its heads."""
    num_heads, head_dim = full.num_heads, full.head_dim
    hidden = torch.randn(7, num_heads * head_dim)
    with torch.no_grad():
        ref = full(hidden).view(7, num_heads, head_dim)
    x, state = hidden.view(7, num_heads, head_dim), full.state_dict()
    for rank in range(ep_size):
        local = Magi2MultiHeadMoE(full.config, ep_rank=rank, ep_size=ep_size)
        local.load_state_dict(dict(state))  # full tensors are sliced to this rank's rows
        for name in sliced:
            held = local.state_dict()[name]
            assert held.dtype == state[name].dtype and torch.equal(held, local.ep_slice(state[name])), name
        start, n, real = local.local_head_start, local.local_num_heads, local.local_real_num_heads
        x_local = torch.zeros(7, n, head_dim)
        x_local[:, :real] = x[:, start : start + real]
        with torch.no_grad():
            out = local.forward_local_heads(x_local)
        torch.testing.assert_close(out[:, :real], ref[:, start : start + real], atol=1e-6, rtol=1e-6)


HOST_READS = ("item", "tolist", "cpu", "__bool__", "__int__", "__float__")


@contextlib.contextmanager
def count_host_reads():
    """Count calls of :data:`HOST_READS` on any tensor while active."""
    counts: dict = {}
    originals = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def wrap(name, orig):
        def counting(self, *args, **kwargs):
            counts[name] = counts.get(name, 0) + 1
            return orig(self, *args, **kwargs)

        return counting

    for name, orig in originals.items():
        setattr(torch.Tensor, name, wrap(name, orig))
    try:
        yield counts
    finally:
        for name, orig in originals.items():
            setattr(torch.Tensor, name, orig)
