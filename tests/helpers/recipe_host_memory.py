"""The 24 GB recipe's host memory at reduced width, loading included: a repo saved as the recipe's (a bf16 text
encoder, int4 routed experts and FP8-stored dense weights in the transformer, FP8-stored dense weights in the
refiner, fp32 VAEs), then, in a fresh process, ``Magi2Pipeline.from_pretrained`` with the recipe's dtypes,
``enable_weight_streaming(vram_gb=24, device="cpu", host_memory=...)`` and a forward of each streamed model in the
order a call runs them (each begins its stage).

Run as ``python -m helpers.recipe_host_memory FOLDER MODE...`` (``tests/`` on ``PYTHONPATH``): prints one JSON line,
per mode the process's anonymous RSS (``/proc/self/status`` ``RssAnon``) above its level before loading: its peak
while loading and while enabling (sampled every 1 ms by a forked process and read at the end of each), and what each
stage holds after its forward (on the CPU a forward's activations are host memory too); its file-backed RSS
(``RssFile``) after each, reported apart; and ``planned_<stage>``, the host memory the plan gives that stage at this
width (:class:`~helpers.memory_plan_streaming.StreamedWeights` of the stage's model: its blocks' bytes and the
weights outside them), on the CPU, where the device ring and the weights outside the blocks are host memory too and
nothing is pinned (no rounding)::

    pinned:  packed blocks + weights outside the blocks + ring          (of the stage's model alone: the models
    disk:    staging ring + weights outside the blocks + ring            run before it are released)

On a GPU host the pinned buffers and the device ring are resident from their allocation; on the CPU an allocation's
pages count once written, and a ring slot that never receives the largest block is never written in full, so after
each stage every ring and staging buffer that exists (of any streamed model) is written once before RSS is read.
"""

from __future__ import annotations

import gc
import json
import sys
import time

import torch

from diffusers_magi2 import Magi2Pipeline
from diffusers_magi2.models.transformer_magi2_refiner import Magi2RefinerTransformer3DModel
from diffusers_magi2.models.weight_streaming import streaming_device_nbytes
from diffusers_magi2.pipelines.tiny_default import build_tiny_random_pipeline, init_tiny_weights
from diffusers_magi2.pipelines.weight_streaming_pipeline import STREAMED_COMPONENTS, streamed_blocks

from .int4_models import int4_transformer
from .memory_plan_streaming import StreamedWeights
from .weight_streaming_testing import refiner_inputs


# widths where the FP8-stored dense weights are most of the transformer and the refiner, as the text encoder's
# layers are of it, so that holding every component's loaded copies at once would exceed any one stage
TEXT_ENCODER = {
    "hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 8, "layer_types": ["full_attention"] * 8,
    "full_attention_interval": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128,
}  # fmt: skip
TRANSFORMER = {
    "num_layers": 6, "num_attention_heads": 8, "attention_head_dim": 64, "num_key_value_heads": 8,
    "text_in_channels": 512, "multimodal_layers": [0], "moe_layers": [1, 2, 3, 4, 5], "moe_num_heads": 2,
    "moe_num_experts": 8, "moe_top_k": 2, "moe_expert_intermediate_size": 256, "shared_expert_intermediate_size": 256,
    "modality_specific_expert_intermediate_size": 256, "intermediate_factor": 4,
}  # fmt: skip
REFINER = {
    "num_layers": 8, "num_attention_heads": 8, "attention_head_dim": 64, "num_key_value_heads": 8, "in_channels": 48,
    "audio_in_channels": 64, "text_in_channels": 512, "multimodal_layers": [0], "mlp_intermediate_size": 2048,
}  # fmt: skip
#: ``from_pretrained``'s dtypes in the recipe
RECIPE_DTYPES = ("bfloat16", "float32", "float32")  # default, vae, audio_vae
INT4_GROUP_SIZE = 16


def save_recipe_repo(folder: str) -> None:
    """Write the reduced recipe repo to ``folder`` (module docstring)."""
    pipe = build_tiny_random_pipeline(config={"text_encoder": TEXT_ENCODER, "transformer": TRANSFORMER})
    transformer = int4_transformer(pipe.transformer.to(torch.bfloat16), INT4_GROUP_SIZE)
    refiner = init_tiny_weights(Magi2RefinerTransformer3DModel(**REFINER), torch.Generator().manual_seed(5))
    refiner.to(torch.bfloat16)
    for model in (transformer, refiner):
        model.enable_fp8_storage(torch.bfloat16)
    pipe.register_modules(transformer=transformer, refiner=refiner.eval())
    pipe.text_encoder.to(torch.bfloat16)
    pipe.save_pretrained(folder)


def _status() -> dict:
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f if line.startswith(("RssAnon:", "RssFile:")))
    return {k: int(v.split()[0]) * 1024 for k, v in fields.items()}


class _AnonPeak:
    """The largest ``RssAnon`` of this process, sampled every 1 ms by a forked process (a thread would take the
    GIL from the work it measures), and read at :meth:`phase`'s calls."""

    def __init__(self) -> None:
        import multiprocessing as mp
        import os

        context = mp.get_context("fork")
        self.peak, self.stop = context.Value("q", 0), context.Event()
        self.process = context.Process(target=_sample, args=(os.getpid(), self.peak, self.stop), daemon=True)
        self.process.start()

    def phase(self) -> int:
        """The peak since the last call (or the start), then a new peak from now."""
        with self.peak.get_lock():
            peak, self.peak.value = max(self.peak.value, _status()["RssAnon"]), 0
        return peak

    def close(self) -> None:
        self.stop.set()
        self.process.join()


def _sample(pid: int, peak, stop) -> None:
    path = f"/proc/{pid}/status"
    while not stop.is_set():
        with open(path) as f:
            anon = next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))
        with peak.get_lock():
            peak.value = max(peak.value, anon)
        time.sleep(0.001)


def _planned(pipe, mode: str) -> dict:
    """Per streamed model, the host memory its stage plans on the CPU (module docstring)."""
    planned = {}
    for name in STREAMED_COMPONENTS:
        model = getattr(pipe, name)
        blocks = list(streamed_blocks(name, model))
        sizes = [sum(t.nbytes for t in {id(t): t for t in [*b.parameters(), *b.buffers()]}.values()) for b in blocks]
        weights = StreamedWeights(streaming_device_nbytes(model, blocks, 0), sizes)
        planned[name] = weights.host(mode, pinned=False) + weights.resident + weights.ring
    return planned


def _write_rings(pipe) -> None:
    """Write every ring slot and staging buffer that exists once (module docstring)."""
    for name in STREAMED_COMPONENTS:
        streamer = getattr(getattr(pipe, name), "_weight_streamer", None)
        for buffer in [s.buffer for s in streamer.slots] + list(getattr(streamer, "staging", [])):
            buffer.fill_(0xFF)


def _stage_forward(name: str, model) -> None:
    """A no-grad forward of streamed model ``name`` on a few tokens: its stage begins and every block runs once."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        if name == "text_encoder":
            model(input_ids=torch.arange(16)[None])
        elif name == "refiner":
            model(**refiner_inputs(model.config))
        else:
            config = model.config
            model(
                hidden_states=torch.randn(1, config.in_channels, 1, 4, 4, generator=g).bfloat16(),
                timestep=torch.tensor([500.0]),
                encoder_hidden_states=torch.randn(1, 3, config.text_in_channels, generator=g).bfloat16(),
                audio_hidden_states=torch.randn(1, 2, config.audio_in_channels, generator=g).bfloat16(),
            )


def _load(folder: str, dtypes: dict) -> Magi2Pipeline:
    """The recipe's pipeline from ``folder``, its transformer on the CPU's MoE backend (not Triton's interpreter)."""
    pipe = Magi2Pipeline.from_pretrained(folder, dtype=dtypes)
    pipe.transformer.set_moe_backend("torch_grouped")
    return pipe


def measure(folder: str, mode: str, dtypes: dict) -> dict:
    """The recipe in ``mode`` from ``folder``: the anonymous RSS above the level before loading at its peak while
    loading (``load``) and enabling (``enable``), and held after each stage's forward (``text_encoder``,
    ``transformer``, ``refiner``); ``file_*`` the file-backed RSS after each; ``planned_*`` each stage's plan."""
    gc.collect()
    base = _status()
    peak = _AnonPeak()
    result = {}

    def phase(name: str, peaked: bool = True) -> None:
        gc.collect()
        now = _status()
        result[name] = (peak.phase() if peaked else now["RssAnon"]) - base["RssAnon"]
        result[f"file_{name}"] = now["RssFile"] - base["RssFile"]

    pipe = _load(folder, dtypes)
    phase("load")
    result.update({f"planned_{k}": v for k, v in _planned(pipe, mode).items()})
    pipe.enable_weight_streaming(vram_gb=24, device="cpu", host_memory=mode)
    phase("enable")
    for name in STREAMED_COMPONENTS:  # the stages, in the order a call runs them; on the CPU a forward's
        _stage_forward(name, getattr(pipe, name))  # activations are host memory too: held weights only
        _write_rings(pipe)
        phase(name, peaked=False)
    peak.close()
    return result


def main(folder: str, *modes: str) -> None:
    dtypes = dict(zip(("default", "vae", "audio_vae"), (getattr(torch, d) for d in RECIPE_DTYPES)))
    pipe = _load(folder, dtypes)  # its lazy imports and set-up, and the warm-up of each stage's forward, resident
    for name in STREAMED_COMPONENTS:  # (helpers.fresh_interpreter.run_host_memory_checks); not counted (dropped)
        _stage_forward(name, getattr(pipe, name))
    del pipe
    print(json.dumps({mode: measure(folder, mode, dtypes) for mode in modes}))


if __name__ == "__main__":
    main(*sys.argv[1:])
