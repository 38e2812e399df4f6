"""Per-rank bodies of the context-parallel model tests (run on gloo ranks by ``test_cp_models.py``).

Every rank loads the same tiny SandAI checkpoint in fp32, enables ``ContextParallelConfig(ulysses_degree=N)``
(optionally with expert parallelism over the same ranks, enabled before or after), and runs the fixture's full packed
inputs; it returns
the full outputs, the collectives and host syncs seen inside each transformer block, and its FLOPs.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from diffusers import ContextParallelConfig

from diffusers_magi2.models.transformer_magi2 import Magi2Transformer3DModel
from diffusers_magi2.models.transformer_magi2_refiner import Magi2RefinerTransformer3DModel
from diffusers_magi2.parallel.expert_parallel import Magi2ExpertParallelConfig

from .ep_workers import split_tokens as uneven_with_empty_rank  # rank 1 holds no token
from .fixtures import golden, golden_path
from .flop_counter import count_flops


PREVIEWS = ("preview_h4", "preview_h3")
REFINER_CASES = ("", "noaudio.")
#: collectives whose calls are counted inside each transformer block
COLLECTIVES = ("all_to_all_single", "all_gather_into_tensor", "all_gather", "all_reduce", "broadcast", "all_to_all")
#: host reads of a tensor counted inside each block (each one a device-to-host sync on a GPU)
SYNC_METHODS = ("item", "tolist", "cpu", "__bool__", "__int__", "__float__")


def preview_case(model: str) -> dict:
    return golden(f"magi2_tiny/{model}/fp32/transformer_case.safetensors")


def case_prefixes(d: dict) -> list[str]:
    """The fixture's cases: t2v (``""``) and, where stored, i2v (``"i2v."``)."""
    return [p for p in ("", "i2v.") if p + "model.x" in d]


def refiner_case() -> dict:
    return golden("magi2_tiny/refiner/fp32/transformer_case.safetensors")


def preview_forward(model, d: dict, prefix: str) -> torch.Tensor:
    with torch.no_grad():
        return model.forward_packed(
            d[prefix + "model.x"],
            d[prefix + "model.coords_mapping"],
            d[prefix + "model.modality_mapping"],
            d[prefix + "model.cu_seqlens_q"],
            d[prefix + "model.time_token_sequence"],
        )


def refiner_forward(model, d: dict, prefix: str) -> torch.Tensor:
    ids = d[prefix + "model.modality_mapping"]
    geometry = model.window_geometry(5, 4, 8, int((ids > 0).sum()))
    with torch.no_grad():
        return model.forward_packed(
            d[prefix + "model.x"], d[prefix + "model.coords_mapping"], ids, window_geometry=geometry
        )


def refiner_batch_inputs(config, audio: bool, batch: int = 2) -> dict:
    """``forward`` inputs of the tiny refiner: ``batch`` samples (the second with 3 padded text tokens)."""
    g = torch.Generator().manual_seed(11)
    video = torch.randn(2, config.in_channels, 5, 4, 8, generator=g)
    text = torch.randn(2, 7, config.text_in_channels, generator=g)
    mask = torch.tensor([[True] * 7, [True] * 4 + [False] * 3])
    sound = torch.randn(2, 10, config.audio_in_channels, generator=g)
    return {
        "hidden_states": video[:batch],
        "encoder_hidden_states": text[:batch],
        "audio_hidden_states": sound[:batch] if audio else None,
        "encoder_attention_mask": mask[:batch],
    }


#: the refiner ``forward`` cases: (audio, batch)
REFINER_FORWARD_CASES = ((True, 2), (False, 1))


def refiner_batch_forward(model, audio: bool, batch: int) -> tuple:
    with torch.no_grad():
        out = model(**refiner_batch_inputs(model.config, audio, batch))
    return out.sample, out.audio_sample


def load_preview(model: str, dtype: torch.dtype = torch.float32) -> Magi2Transformer3DModel:
    return Magi2Transformer3DModel.from_original_checkpoint(
        golden_path(f"magi2_tiny/{model}/sandai_checkpoint"), dtype=dtype
    )


def preview_bf16_case() -> dict:
    return golden("magi2_tiny/preview_h4/bf16/transformer_case.safetensors")


def load_refiner() -> Magi2RefinerTransformer3DModel:
    return Magi2RefinerTransformer3DModel.from_original_checkpoint(
        golden_path("magi2_tiny/refiner/sandai_checkpoint"), torch_dtype=torch.float32
    )


class BlockProbe:
    """Counts collectives and host syncs issued while a transformer block runs (routed experts included), and
    how many collectives were issued with ``async_op=True``."""

    def __init__(self, model) -> None:
        self.model = model
        self.inside = 0
        self.blocks = 0
        self.counts: dict = {}
        self.async_calls = 0

    def _count(self, name: str, kwargs: dict):
        if self.inside:
            self.counts[name] = self.counts.get(name, 0) + 1
            self.async_calls += bool(kwargs.get("async_op"))

    @contextlib.contextmanager
    def active(self):
        patched = []

        def wrap(owner, name, label):
            orig = getattr(owner, name)

            def counting(*args, **kwargs):
                self._count(label, kwargs)
                return orig(*args, **kwargs)

            setattr(owner, name, counting)
            patched.append((owner, name, orig))

        for name in COLLECTIVES:
            if hasattr(dist, name):
                wrap(dist, name, name)
        for name in SYNC_METHODS:
            wrap(torch.Tensor, name, name)
        hooks = []
        for block in self.model.transformer_blocks:
            hooks.append(block.register_forward_pre_hook(lambda *a: self._enter()))
            hooks.append(block.register_forward_hook(lambda *a: self._leave()))
        try:
            yield self
        finally:
            for h in hooks:
                h.remove()
            for owner, name, orig in reversed(patched):
                setattr(owner, name, orig)

    def _enter(self):
        self.inside += 1
        self.blocks += 1

    def _leave(self):
        self.inside -= 1


def _probe(model, fn):
    probe = BlockProbe(model)
    with probe.active():
        fn()
    return {"blocks": probe.blocks, "counts": dict(probe.counts), "async": probe.async_calls}


def preview_checks(rank: int, world: int, ep_degrees) -> dict:
    res = {}
    for name in PREVIEWS:
        d = preview_case(name)
        prefixes = case_prefixes(d)
        for ep in ep_degrees:
            model = load_preview(name).eval()
            if ep is not None:
                model.enable_expert_parallel(Magi2ExpertParallelConfig(ep_degree=ep))
            model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=world))
            for prefix in prefixes:
                res[name, ep, prefix, "balanced"] = preview_forward(model, d, prefix)
            model.context_parallel_token_counts = uneven_with_empty_rank
            res[name, ep, "", "uneven"] = preview_forward(model, d, "")
            model.context_parallel_token_counts = None
            if ep == world or (ep is None and name == "preview_h4"):
                res[name, ep, "probe"] = _probe(model, lambda: preview_forward(model, d, ""))
                res[name, ep, "flops"] = count_flops(preview_forward, model, d, "")[1]
            if ep == world and name == "preview_h4":  # the probe sees the host read of an explicit "torch" backend
                model.set_moe_backend("torch")
                res[name, ep, "probe_torch_backend"] = _probe(model, lambda: preview_forward(model, d, ""))
                model.set_moe_backend("auto")
            if ep is not None:  # the other order: context parallelism first, then expert parallelism
                model = load_preview(name).eval()
                model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=world))
                model.enable_expert_parallel(Magi2ExpertParallelConfig(ep_degree=ep))
                for prefix in prefixes:
                    res[name, ep, prefix, "balanced", "cp_first"] = preview_forward(model, d, prefix)
                model.context_parallel_token_counts = uneven_with_empty_rank
                res[name, ep, "", "uneven", "cp_first"] = preview_forward(model, d, "")
    return res


def refiner_checks(rank: int, world: int) -> dict:
    res = {}
    d = refiner_case()
    model = load_refiner().eval()
    model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=world))
    for prefix in REFINER_CASES:
        res[prefix, "balanced"] = refiner_forward(model, d, prefix)
    model.context_parallel_token_counts = uneven_with_empty_rank
    res["", "uneven"] = refiner_forward(model, d, "")
    model.context_parallel_token_counts = None
    res["probe"] = _probe(model, lambda: refiner_forward(model, d, ""))
    res["flops"] = count_flops(refiner_forward, model, d, "")[1]
    for audio, batch in REFINER_FORWARD_CASES:  # the diffusers entry point shards the same way
        res["forward", audio, batch] = refiner_batch_forward(model, audio, batch)
    if world == 2:
        res["forward_flops"] = count_flops(refiner_batch_forward, model, *REFINER_FORWARD_CASES[0])[1]
    return res


def error_checks(rank: int, world: int) -> dict:
    """Set-up errors that need several ranks; each is raised on every rank before any forward."""
    from torch.distributed.device_mesh import DeviceMesh

    errors = {}
    model = load_preview("preview_h4")
    # EP groups {0, 2} and {1, 3}: not consecutive groups of the CP ranks
    mesh = DeviceMesh(
        "cpu", torch.arange(world).view(world // 2, 2).T.contiguous(), mesh_dim_names=("ep_replica", "ep")
    )
    model.enable_expert_parallel(Magi2ExpertParallelConfig(ep_degree=world // 2, mesh=mesh))
    try:
        model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=world))
    except ValueError as e:
        errors["other_ranks"] = str(e)
    model = load_preview("preview_h4")  # the other order refuses the same groups, before any layer is cut
    model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=world))
    full = model.transformer_blocks[1].mlp.moe_mlp
    try:
        model.enable_expert_parallel(Magi2ExpertParallelConfig(ep_degree=world // 2, mesh=mesh))
    except ValueError as e:
        errors["other_ranks_cp_first"] = str(e)
    errors["kept_full_layer"] = model.transformer_blocks[1].mlp.moe_mlp is full and full.ep_size == 1
    model = load_preview("preview_h4")
    model.enable_expert_parallel(Magi2ExpertParallelConfig(ep_degree=world))
    model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=world))
    try:
        model.save_pretrained("/nonexistent/never_written")
    except ValueError as e:
        errors["save"] = str(e)
    return errors


def cp_model_worker(rank: int, world: int, ep_degrees) -> dict:
    res = {"preview": preview_checks(rank, world, ep_degrees), "refiner": refiner_checks(rank, world)}
    if world == 3:  # 4 query heads over 3 ranks: rank 2 owns none
        model = load_preview("preview_h4", torch.bfloat16).eval()
        model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=world))
        res["preview_bf16"] = preview_forward(model, preview_bf16_case(), "")
    if world == 4:
        res["errors"] = error_checks(rank, world)
    return res


def cp_preview_h4_worker(rank: int, world: int) -> dict:
    """preview_h4 (t2v) under ``ulysses_degree=world``, loaded from wherever ``MAGI2_FIXTURES`` points."""
    model = load_preview("preview_h4").eval()
    model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=world))
    return {"out": preview_forward(model, preview_case("preview_h4"), "")}
