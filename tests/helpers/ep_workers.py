"""Per-rank bodies of the expert-parallel parity tests (run on gloo ranks by ``test_ep_parity.py``).

One spawn per EP size N runs all three groups of checks, and returns plain tensors / strings; the parent compares
them with single-process references:

* ``collectives``: an independent per-head stand-in (``tanh(x_h @ W_h)``) through layouts (a) and (b), fp32 and bf16,
  gradients in layout (b), and the errors raised before any collective.
* ``moe``: ``Magi2MultiHeadMoE`` on the golden SandAI checkpoints, each rank reading only its rows with
  ``take_rows``, layouts (a) and (b) with uneven counts and an empty rank.
* ``transformer``: ``Magi2Transformer3DModel.from_pretrained(..., expert_parallel=...)`` and
  ``enable_expert_parallel`` on diffusers-format folders, layout (a), on the fixture's packed inputs.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open

from diffusers_magi2.loaders.expert_parallel_loading import EP_SHARDED_SUFFIXES
from diffusers_magi2.loaders.key_plan import read_source_checkpoint
from diffusers_magi2.moe.layer import Magi2MultiHeadMoE, Magi2MultiHeadMoEConfig
from diffusers_magi2.parallel.exchanges import Magi2ExpertParallelExchange
from diffusers_magi2.parallel.expert_parallel import (
    Magi2ExpertParallelConfig,
    check_same_on_all_ranks,
    ep_head_layout,
    resolve_expert_parallel,
)
from diffusers_magi2.utils.safetensors_io import take_rows

from .fixtures import golden, golden_path


MODELS = {"preview_h4": {"hidden_size": 128, "num_heads": 4}, "preview_h3": {"hidden_size": 96, "num_heads": 3}}
MOE_LAYER = 1
DH = 8
# layout (b) token counts of the stand-in: uneven, one rank with zero tokens
TOKEN_COUNTS = {2: [5, 0], 3: [4, 0, 7], 4: [3, 6, 0, 1]}


# ------------------------------------------------------------------------------------------------ stand-in heads


def standin_weights(num_heads: int) -> torch.Tensor:
    return torch.randn(num_heads, DH, DH, generator=torch.Generator().manual_seed(100 + num_heads))


def standin_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.tanh(torch.einsum("shd,hde->she", x, w))


def standin_inputs(num_heads: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    x_all = torch.randn(12, num_heads, DH, generator=torch.Generator().manual_seed(7))
    x_tok = torch.randn(sum(TOKEN_COUNTS[world]), num_heads, DH, generator=torch.Generator().manual_seed(8))
    return x_all, x_tok


def _standin_local_fn(w: torch.Tensor, layout):
    def compute(local_x: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(local_x)
        n = layout.num_real_local_heads
        if n:
            ws = w[layout.local_head_start : layout.local_head_start + n]
            out[:, :n] = standin_reference(local_x[:, :n].float(), ws).to(local_x.dtype)
        return out

    return compute


def through_exchange(exchange, x: torch.Tensor, compute, **kwargs) -> torch.Tensor:
    """``exchange.dispatch`` -> ``compute`` -> ``exchange.combine``, as the MoE layer runs its local experts."""
    local, handle = exchange.dispatch(x, **kwargs)
    return exchange.combine(compute(local), handle)


def collectives_checks(rank: int, world: int, ep) -> dict:
    res, counts = {}, TOKEN_COUNTS[world]
    start = sum(counts[:rank])
    for num_heads in (4, 3):
        w = standin_weights(num_heads)
        layout = ep_head_layout(num_heads, ep.size, ep.rank)
        fn = _standin_local_fn(w, layout)
        exchange = Magi2ExpertParallelExchange(layout, ep.group)
        x_all, x_tok = standin_inputs(num_heads, world)
        mine = x_tok[start : start + counts[rank]]
        res["a", num_heads] = through_exchange(exchange, x_all, fn)
        res["b", num_heads] = through_exchange(exchange, mine, fn, ep_token_counts=counts)
        res["b_bf16", num_heads] = through_exchange(exchange, mine.bfloat16(), fn, ep_token_counts=counts)
        # autograd: the functional collectives carry gradients back (idle ranks included)
        xg = mine.detach().clone().requires_grad_(True)
        out = through_exchange(exchange, xg, fn, ep_token_counts=counts)
        (out * torch.linspace(-1, 1, DH)).sum().backward()
        res["grad_b", num_heads] = xg.grad
        res["grad_mode_a", num_heads] = through_exchange(exchange, x_all.clone().requires_grad_(True), fn).detach()
    errors = {}
    try:
        through_exchange(exchange, mine, fn, ep_token_counts=counts[:-1])
    except ValueError as e:
        errors["wrong_len"] = str(e)
    try:
        resolve_expert_parallel(Magi2ExpertParallelConfig(ep_degree=world + 1))
    except ValueError as e:
        errors["degree"] = str(e)
    try:  # ranks with different configs
        check_same_on_all_ranks({"num_heads": 4 + (rank == world - 1)}, ep, "transformer config")
    except ValueError as e:
        errors["mismatch"] = str(e)
    check_same_on_all_ranks({"num_heads": 4}, ep, "transformer config")  # identical: no error
    res["errors"] = errors
    return res


# ------------------------------------------------------------------------------------------------ MoE layer


def split_tokens(num_tokens: int, world: int) -> list[int]:
    """Uneven per-rank token counts of the MoE-layer case, rank 1 holding none."""
    counts = [num_tokens // 3] + [0] * (world - 1)
    rest = num_tokens - counts[0]
    for r in range(2, world):
        counts[r] = rest // (world - 2)
    counts[-1 if world > 2 else 0] += num_tokens - sum(counts)
    return counts


def moe_config(model: str) -> Magi2MultiHeadMoEConfig:
    return Magi2MultiHeadMoEConfig(
        **MODELS[model],
        num_experts=8,
        top_k=2,
        expert_intermediate_size=64,
        params_dtype=torch.float32,
        route_scale=4.9,
    )


def sandai_ckpt(model: str) -> Path:
    return golden_path(f"magi2_tiny/{model}/sandai_checkpoint")


def moe_case(model: str) -> dict[str, torch.Tensor]:
    path = golden_path(f"magi2_tiny/{model}/fp32/moe_layer_cases.safetensors")
    with safe_open(str(path), "pt") as f:
        return {k.split(".", 1)[1]: f.get_tensor(k) for k in f.keys() if k.startswith(f"layer{MOE_LAYER}.")}


def load_moe(moe: Magi2MultiHeadMoE, model: str, sharded: bool) -> None:
    """Fill ``moe`` from the SandAI checkpoint: EP tensors by rows (this rank's only) or whole; EMA router bias."""
    source = read_source_checkpoint(sandai_ckpt(model))
    prefix = f"block.layers.{MOE_LAYER}.mlp.moe_mlp."
    rows = moe.local_head_start * moe.num_experts
    sd = {}
    for suffix in EP_SHARDED_SUFFIXES:
        with safe_open(str(source.directory / source.weight_map[prefix + suffix]), "pt") as h:
            if sharded:
                t = take_rows(h.get_slice(prefix + suffix), rows, moe.local_flatten_num_experts)
            else:
                t = h.get_tensor(prefix + suffix)
        sd[suffix] = t.float()
    sd["router.expert_bias"] = sd["router.expert_bias_ema"]  # SandAI loader rule (_apply_router_bias_ema)
    moe.load_state_dict(sd, strict=True)


def moe_checks(rank: int, world: int, ep) -> dict:
    res = {}
    for model in MODELS:
        moe = Magi2MultiHeadMoE(moe_config(model), ep.group).eval()
        load_moe(moe, model, sharded=True)
        res[model, "W_gate"] = moe.W_gate.detach().clone()
        x = moe_case(model)["core.x"]
        counts = split_tokens(x.shape[0], world)
        start = sum(counts[:rank])
        with torch.no_grad():
            res[model, "a"] = moe(x)
            res[model, "b"] = moe(x[start : start + counts[rank]], ep_token_counts=counts)
        # an unsharded (all-heads) state dict fed to the sharded layer is sliced, never a bare size mismatch
        single = Magi2MultiHeadMoE(moe_config(model))
        load_moe(single, model, sharded=False)
        moe_from_full = Magi2MultiHeadMoE(moe_config(model), ep.group).eval()
        moe_from_full.load_state_dict(single.state_dict())
        with torch.no_grad():
            res[model, "a_from_full_state_dict"] = moe_from_full(x)
        bad = {k: v[:3] if k == "W_up" else v for k, v in single.state_dict().items()}
        try:
            moe_from_full.load_state_dict(bad)
        except ValueError as e:
            res[model, "bad_rows_error"] = str(e)
    # a mesh given by the caller: its "ep" dimension is the group
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    mesh_ep = resolve_expert_parallel(Magi2ExpertParallelConfig(ep_degree=world, mesh=mesh))
    res["mesh_group"] = (mesh_ep.size, mesh_ep.rank, torch.distributed.get_world_size(mesh_ep.group))
    try:
        Magi2ExpertParallelConfig(ep_degree=world + 1, mesh=mesh)
    except ValueError as e:
        res["mesh_error"] = str(e)
    return res


# ------------------------------------------------------------------------------------------------ transformer


def transformer_case(model: str) -> dict[str, torch.Tensor]:
    return golden(f"magi2_tiny/{model}/fp32/transformer_case.safetensors")


def packed_forward(transformer, d: dict) -> torch.Tensor:
    with torch.no_grad():
        return transformer.forward_packed(
            d["model.x"],
            d["model.coords_mapping"],
            d["model.modality_mapping"],
            d["model.cu_seqlens_q"],
            d["model.time_token_sequence"],
        )


def transformer_checks(rank: int, world: int, ep_cfg, folders: dict) -> dict:
    from diffusers_magi2.models.transformer_magi2 import Magi2Transformer3DModel

    res = {}
    for model, folder in folders.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            transformer = Magi2Transformer3DModel.from_pretrained(
                folder, torch_dtype=torch.float32, expert_parallel=ep_cfg
            )
        res[model, "warnings"] = [str(w.message) for w in caught if "owns only padding heads" in str(w.message)]
        res[model, "out"] = packed_forward(transformer, transformer_case(model))
        res[model, "moe_rows"] = {
            n: (m.W_gate.detach().clone(), m.router.expert_bias.clone())
            for n, m in transformer.named_modules()
            if isinstance(m, Magi2MultiHeadMoE)
        }
        res[model, "num_params"] = sum(p.numel() for p in transformer.parameters())
        res[model, "dtypes"] = {k: str(v.dtype) for k, v in transformer.state_dict().items()}
        if model == "preview_h4":  # the in-memory path: full model, then enable_expert_parallel
            full = Magi2Transformer3DModel.from_pretrained(folder, torch_dtype=torch.float32)
            # at model level: the full model's state dict loads into the EP-sharded model (sliced per rank)
            transformer.load_state_dict(full.state_dict())
            res[model, "out_after_full_state_dict"] = packed_forward(transformer, transformer_case(model))
            try:
                transformer.save_pretrained(str(Path(folder).parent / f"never_written_{rank}"))
            except ValueError as e:
                res["save_error"] = str(e)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                full.enable_expert_parallel(ep_cfg)
            res[model, "enable_out"] = packed_forward(full, transformer_case(model))
    if world == 2:  # ranks loading different checkpoints: clear error on every rank, raised before any tensor read
        names = list(folders)
        try:
            Magi2Transformer3DModel.from_pretrained(
                folders[names[rank % 2]], torch_dtype=torch.float32, expert_parallel=ep_cfg
            )
        except ValueError as e:
            res["mismatch_error"] = str(e)
    return res


def ep_worker(rank: int, world: int, folders: dict) -> dict:
    ep_cfg = Magi2ExpertParallelConfig(ep_degree=world)
    ep = resolve_expert_parallel(ep_cfg)
    assert (ep.size, ep.rank) == (world, rank)
    return {
        "collectives": collectives_checks(rank, world, ep),
        "moe": moe_checks(rank, world, ep),
        "transformer": transformer_checks(rank, world, ep_cfg, folders),
    }


#: the loads of ``quantized_experts_worker``: (checkpoint folder key, from_pretrained arguments)
QUANTIZED_LOADS = {
    "fp8_repo": ("fp8", {}),
    "fp8_quantize_at_load": ("bf16", {"expert_dtype": "float8_e4m3fn"}),
    "int4_repo": ("int4", {}),
    "int4_quantize_at_load": ("bf16", {"expert_dtype": "int4", "expert_int4_group_size": 32}),
}


def _moe_tensors(model) -> tuple[dict, dict]:
    """``({MoE layer: its state dict}, {MoE layer: (first local head, local heads)})`` of a loaded model."""
    moes = [(n, m) for n, m in model.named_modules() if isinstance(m, Magi2MultiHeadMoE)]
    return (
        {n: {k: v.clone() for k, v in m.state_dict().items()} for n, m in moes},
        {n: (m.local_head_start, m.local_num_heads) for n, m in moes},
    )


def quantized_experts_worker(rank: int, world: int, folders: dict) -> dict:
    """Quantized experts under EP: FP8 and int4 repos and bf16 repos quantized at load, each rank reading its rows
    and scales, and an int4 model loaded whole and then cut by ``enable_expert_parallel``; first, each rank's error
    (or ``None``) quantizing ``folders["bf16_non_finite"]`` at load, and a collective after those refusals."""
    from diffusers_magi2.models.transformer_magi2 import Magi2Transformer3DModel

    ep_cfg = Magi2ExpertParallelConfig(ep_degree=world)
    case = transformer_case("preview_h4")
    res = {}
    # a bf16 repo with a NaN in one rank's rows, quantized at load: every rank must refuse it, and the group serve on
    for name in ("fp8_quantize_at_load", "int4_quantize_at_load"):
        try:
            Magi2Transformer3DModel.from_pretrained(
                folders["bf16_non_finite"],
                torch_dtype=torch.float32,
                expert_parallel=ep_cfg,
                **QUANTIZED_LOADS[name][1],
            )
            res[name, "non_finite"] = None
        except ValueError as err:
            res[name, "non_finite"] = str(err)
    ranks = torch.tensor([rank])
    dist.all_reduce(ranks)
    res["rank_sum_after_refusals"] = int(ranks)
    for name, (folder, kwargs) in QUANTIZED_LOADS.items():
        model = Magi2Transformer3DModel.from_pretrained(
            folders[folder], torch_dtype=torch.float32, expert_parallel=ep_cfg, **kwargs
        )
        res[name, "out"] = packed_forward(model, case)
        res[name, "moe"], res[name, "rows"] = _moe_tensors(model)
    model = Magi2Transformer3DModel.from_pretrained(folders["int4"], torch_dtype=torch.float32)
    model.enable_expert_parallel(ep_cfg)
    res["int4_enable_expert_parallel", "out"] = packed_forward(model, case)
    res["int4_enable_expert_parallel", "moe"], res["int4_enable_expert_parallel", "rows"] = _moe_tensors(model)
    return res
