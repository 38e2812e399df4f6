"""Per-rank body of ``tests/parallel/test_ep_memory.py`` (run on 2 gloo ranks): the tiny expert-heavy config, and
the worker that loads it by every expert-parallel path and reports what each rank holds."""

from __future__ import annotations

import gc
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from diffusers_magi2.models.transformer_magi2 import Magi2Transformer3DModel
from diffusers_magi2.moe.layer import Magi2MultiHeadMoE
from diffusers_magi2.moe.quantize_int4 import INT4_SCALE_NAMES


CONFIG = {
    "num_layers": 4,
    "num_attention_heads": 4,
    "attention_head_dim": 32,
    "num_key_value_heads": 4,
    "in_channels": 8,
    "audio_in_channels": 8,
    "text_in_channels": 16,
    "intermediate_factor": 1,
    "multimodal_layers": [0, 3],
    "moe_layers": [1, 2],
    "num_streams": 2,
    "moe_num_heads": 4,
    "moe_num_experts": 64,
    "moe_top_k": 2,
    "moe_expert_intermediate_size": 128,
    "shared_expert_intermediate_size": 16,
    "modality_specific_expert_intermediate_size": 16,
    "time_embed_dim": 32,
}


# elements of one full bank [H E, Dh, De]; no storage on a rank may hold this many in the checkpoint's bank dtype
FULL_BANK_NUMEL = 4 * 64 * 32 * 128


EXPERT_KEYS = ("W_gate", "W_up", "W_down", "W_gate_scale", "W_up_scale", "W_down_scale", *INT4_SCALE_NAMES)
#: int4 experts of CONFIG (its MoE heads are 32 wide)
INT4 = {"expert_dtype": "int4", "expert_int4_group_size": 32}


class _LargeAllocations(TorchDispatchMode):
    """Records the ATen results with a new storage (not one of the op's inputs: views, detaches and the memory maps
    safetensors wraps are left out) of ``>= limit`` bytes, or of ``>= codes_limit`` bytes for ``uint8`` results
    (int4 codes: a full packed bank is smaller than some dense tensors)."""

    def __init__(self, limit: int, codes_limit: int | None = None):
        super().__init__()
        self.limit, self.codes_limit, self.seen = limit, codes_limit or limit, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            (a.untyped_storage() if isinstance(a, torch.Tensor) else a).data_ptr()
            for a in torch.utils._pytree.tree_leaves((args, kwargs))
            if isinstance(a, (torch.Tensor, torch.UntypedStorage, torch.TypedStorage))
            and not getattr(a, "is_meta", False)
        }
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and not t.is_meta:
                storage = t.untyped_storage()
                limit = self.codes_limit if t.dtype == torch.uint8 else self.limit
                if storage.nbytes() >= limit and storage.data_ptr() not in inputs:
                    self.seen.append(f"{func}: {t.dtype}{list(t.shape)}, a new storage of {storage.nbytes()} bytes")
        return out


def _mapped_resident_bytes(folder: str) -> int:
    """Resident bytes of this process's memory maps of files under ``folder``."""
    total, in_folder = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5 and ":" in head[3]:  # a mapping's header line
                in_folder = len(head) >= 6 and head[5].startswith(folder)
            elif in_folder and head[0] == "Rss:":
                total += int(head[1]) * 1024
    return total


def _expert_tensors(model) -> dict[str, torch.Tensor]:
    return {
        f"{n}.{k}": t
        for n, m in model.named_modules()
        if isinstance(m, Magi2MultiHeadMoE)
        for k, t in m.state_dict(keep_vars=True).items()
        if k in EXPERT_KEYS
    }


def _report(model, seen: list, folder: str) -> dict:
    tensors = _expert_tensors(model)
    return {
        "seen": seen,
        "storage_bytes": {k: t.untyped_storage().nbytes() for k, t in tensors.items()},
        "local_bytes": {k: t.numel() * t.element_size() for k, t in tensors.items()},
        "rows": {k: t.detach().clone() for k, t in tensors.items() if k.endswith("W_down")},
        "mapped_resident": _mapped_resident_bytes(folder) if folder else 0,
        "head_start": {n: m.local_head_start for n, m in model.named_modules() if isinstance(m, Magi2MultiHeadMoE)},
    }


def _ep_memory_worker(rank: int, world: int, folders: dict) -> dict:
    from diffusers_magi2.parallel.expert_parallel import Magi2ExpertParallelConfig

    cfg = Magi2ExpertParallelConfig(ep_degree=world)
    res = {}
    loads = {  # name: (folder, loader, bytes per weight of the folder's banks)
        "bf16_sharded": ("bf16_sharded", {}, 2),
        "bf16_single_file": ("bf16_single", {}, 2),
        "fp8_repo": ("fp8", {}, 1),
        "quantize_at_load": ("bf16_sharded", {"expert_dtype": "float8_e4m3fn"}, 2),
        "int4_repo": ("int4", {}, 1),  # and any uint8 tensor of a full bank's packed codes (half a byte per weight)
        "int4_quantize_at_load": ("bf16_sharded", INT4, 2),
        "original_checkpoint": ("sandai", None, 2),
    }
    for name, (folder, kwargs, itemsize) in loads.items():
        with _LargeAllocations(FULL_BANK_NUMEL * itemsize, FULL_BANK_NUMEL // 2) as mode:
            if kwargs is None:
                model = Magi2Transformer3DModel.from_original_checkpoint(folders[folder], expert_parallel=cfg)
            else:
                model = Magi2Transformer3DModel.from_pretrained(
                    folders[folder], torch_dtype=torch.bfloat16, expert_parallel=cfg, **kwargs
                )
        res[name] = _report(model, mode.seen, folders[folder])
        del model
        gc.collect()
    for name, kwargs in (("enable_expert_parallel", {}), ("int4_enable_expert_parallel", INT4)):
        model = in_memory_model(**kwargs)
        full_banks = [weakref.ref(t) for t in _expert_tensors(model).values()]
        with _LargeAllocations(FULL_BANK_NUMEL * 2, FULL_BANK_NUMEL // 2) as mode:
            model.enable_expert_parallel(cfg)
        gc.collect()
        res[name] = _report(model, mode.seen, "")
        res[name]["full_freed"] = all(ref() is None for ref in full_banks)
        del model
    return res


def in_memory_model(**kwargs) -> Magi2Transformer3DModel:
    """The seeded bf16 CONFIG model (``kwargs``: e.g. :data:`INT4`) that ``enable_expert_parallel`` cuts."""
    torch.manual_seed(0)
    return Magi2Transformer3DModel(**CONFIG, **kwargs).to(torch.bfloat16)
