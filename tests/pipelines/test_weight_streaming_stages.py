"""Stage-sequential host memory under weight streaming, on a tiny pipeline saved and loaded with ``from_pretrained``:
one streamed model holds its weights at a time, the others re-read from their files; calls equal the resident ones
bit for bit; weights that are not the files' are refused before anything moves."""

from __future__ import annotations

import json
import os

import pytest
import torch
from helpers.memory_plan_streaming import preview_streamed_weights, text_encoder_streamed_weights
from helpers.modular_testing_utils import tiny_pipelines
from helpers.streaming_calls import two_stage_call

import diffusers_magi2.models.weight_streaming_ring as ring
from diffusers_magi2 import Magi2Pipeline
from diffusers_magi2.pipelines.weight_streaming_pipeline import streamed_blocks
from diffusers_magi2.pipelines.weight_streaming_stages import plan_reread


STREAMED = ("text_encoder", "transformer", "refiner")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    pipe, _ = tiny_pipelines(with_refiner=True)
    folder = tmp_path_factory.mktemp("tiny_pipeline")
    pipe.save_pretrained(folder)
    return folder


def _load(folder):
    pipe = Magi2Pipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _holds(pipe, name) -> bool:
    """Whether a streamed model holds weights: any tensor, in its blocks or outside them, not empty."""
    model = getattr(pipe, name)
    return any(t.numel() for t in [*model.parameters(), *model.buffers()] if t.dim() > 1)


def test_one_streamed_model_held_at_a_time_and_calls_equal_resident(saved):
    pipe = _load(saved)
    resident = two_stage_call(pipe)
    file_nbytes = {n: sum(t.nbytes for t in getattr(pipe, n).state_dict().values()) for n in STREAMED}
    pipe.enable_weight_streaming(vram_gb=24, device="cpu", release_between_stages=True)
    stages = pipe._weight_streaming_stages
    assert set(stages.parts) == set(STREAMED)
    assert stages.held is None and not any(_holds(pipe, n) for n in STREAMED)  # none held before its stage
    entered, enter = [], stages.enter

    def record(name):
        enter(name)
        if not entered or entered[-1][0] != name:
            entered.append((name, [n for n in STREAMED if _holds(pipe, n)]))

    stages.enter = record
    for _ in range(2):  # the second call re-reads every model from its files
        for a, b in zip(two_stage_call(pipe), resident):
            assert torch.equal(torch.as_tensor(a), torch.as_tensor(b))
    assert entered == [(n, [n]) for n in STREAMED] * 2
    # each re-read reads every tensor of the model from its files once (fp32 as saved)
    assert {n: p.file_nbytes for n, p in stages.parts.items()} == file_nbytes
    pipe.disable_weight_streaming()  # every model read back and resident again
    assert all(_holds(pipe, n) for n in STREAMED)
    for a, b in zip(two_stage_call(pipe), resident):
        assert torch.equal(torch.as_tensor(a), torch.as_tensor(b))


def test_weights_not_the_files_are_refused_or_held_and_release_frees_both_as_a_stage_does(saved, monkeypatch):
    pipe = _load(saved)
    # a cast after loading is re-read as the same cast
    pipe.text_encoder.to(torch.bfloat16)
    reread = plan_reread("text_encoder", pipe.text_encoder, streamed_blocks("text_encoder", pipe.text_encoder))
    assert reread.file_nbytes == sum(4 * t.numel() for t in pipe.text_encoder.state_dict().values())  # fp32 files
    # a weight changed after loading cannot be re-read
    weight = next(streamed_blocks("transformer", pipe.transformer)[0].parameters())
    with torch.no_grad():
        weight.add_(1.0)
    before = [t.data_ptr() for t in pipe.transformer.parameters()]
    with pytest.raises(ValueError, match=r"release_between_stages=True: transformer's .* transformed after loading"):
        pipe.enable_weight_streaming(vram_gb=24, device="cpu", release_between_stages=True)
    assert [t.data_ptr() for t in pipe.transformer.parameters()] == before
    pipe.enable_weight_streaming(vram_gb=24, device="cpu")  # default: release what can be re-read, hold the rest
    assert set(pipe._weight_streaming_stages.parts) == {"text_encoder", "refiner"}
    assert _holds(pipe, "transformer") and not _holds(pipe, "text_encoder")
    # release_weight_streaming frees the held transformer and the text encoder held after its stage, each returning
    # its pinned buffers (the refiner, freed when it was released, has none), and drops the three
    with torch.no_grad():
        pipe.encode_prompt("a fox", device="cpu")
    assert pipe._weight_streaming_stages.held == "text_encoder" and _holds(pipe, "text_encoder")
    returned, models = [], {n: getattr(pipe, n) for n in STREAMED}
    monkeypatch.setattr(ring, "return_pinned_memory", lambda pinned: returned.append(pinned))
    pipe.release_weight_streaming()
    assert returned == [False, False]  # the CPU ring: nothing pinned, the path run once per held model
    assert all(getattr(pipe, n) is None for n in STREAMED) and pipe.vae is not None and pipe.audio_vae is not None
    assert not any(t.numel() for n, m in models.items() for b in streamed_blocks(n, m) for t in b.parameters())
    assert not models["text_encoder"].get_input_embeddings().weight.numel()  # freed outside its blocks too, as a stage
    pipe.to("cpu")  # streaming is off


# a reduced text encoder (4 equal decoder layers, 105 MB in bf16) and a reduced MoE transformer (115 MB): each a
# tenth of the other's host memory or more, so holding both would miss the one-stage figure by over 10 %
TEXT_CONFIG = {
    "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 4, "layer_types": ["full_attention"] * 4,
    "full_attention_interval": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 128,
    "vocab_size": 8192, "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                                            "mrope_section": [4, 4, 8], "mrope_interleaved": True},
}  # fmt: skip
TRANSFORMER_CONFIG = {
    "num_layers": 6, "num_attention_heads": 4, "attention_head_dim": 64, "num_key_value_heads": 4,
    "text_in_channels": 256, "multimodal_layers": (0,), "moe_layers": (1, 2, 3, 4, 5), "moe_num_heads": 2,
    "moe_num_experts": 16, "moe_top_k": 2, "moe_expert_intermediate_size": 512, "shared_expert_intermediate_size": 64,
    "modality_specific_expert_intermediate_size": 64, "intermediate_factor": 2,
}  # fmt: skip
_STAGES_SCRIPT = """
import gc, json, sys, tempfile, torch
from transformers import Qwen3_5TextConfig, Qwen3_5TextModel
from diffusers_magi2 import Magi2Transformer3DModel
from diffusers_magi2.models.weight_streaming import apply_weight_streaming
from diffusers_magi2.pipelines.weight_streaming_pipeline import STREAMED_RING_SIZE, streamed_blocks
from diffusers_magi2.pipelines.weight_streaming_stages import StagedHostMemory, plan_reread

def anon():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))

text_config, transformer_config = json.loads(sys.argv[1]), json.loads(sys.argv[2])
folder = tempfile.mkdtemp()
Qwen3_5TextModel(Qwen3_5TextConfig(**text_config)).to(torch.bfloat16).save_pretrained(folder + "/text_encoder")
Magi2Transformer3DModel(**transformer_config, params_dtype=torch.bfloat16).save_pretrained(folder + "/transformer")
gc.collect()
models = {
    "text_encoder": Qwen3_5TextModel.from_pretrained(folder + "/text_encoder", dtype=torch.bfloat16),
    "transformer": Magi2Transformer3DModel.from_pretrained(folder + "/transformer", torch_dtype=torch.bfloat16),
}
models["transformer"].set_moe_backend("torch_grouped")
parts = {}
for name, model in models.items():
    blocks = streamed_blocks(name, model)
    parts[name] = plan_reread(name, model, blocks)
    parts[name].streamer = apply_weight_streaming(model, list(blocks), "cpu", ring_size=STREAMED_RING_SIZE, allocate=False)
stages = StagedHostMemory(parts, models)
stages.install()


def run(name):
    with torch.no_grad():
        if name == "text_encoder":
            models[name](input_ids=torch.arange(16)[None])
        else:  # through forward, where the stage begins
            config = models[name].config
            models[name](
                hidden_states=torch.randn(1, config.in_channels, 1, 4, 4), timestep=torch.tensor([500.0]),
                encoder_hidden_states=torch.randn(1, 3, config.text_in_channels),
                audio_hidden_states=torch.randn(1, 2, config.audio_in_channels),
            )


for name in models:  # torch's lazy set-up, not counted
    run(name)
stages.parts[stages.held].free()
stages.held = None
gc.collect()
before = anon()
measured = []
for name in models:
    run(name)
    gc.collect()
    measured.append(anon() - before)
print(*measured)
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads RssAnon from /proc (Linux)")
@pytest.mark.host_memory_checks(
    {"stages": (_STAGES_SCRIPT, [json.dumps(TEXT_CONFIG), json.dumps(TRANSFORMER_CONFIG)])}
)
def test_host_memory_is_the_largest_stage_in_a_fresh_process_within_10_percent(host_memory_checks):
    # the plan's host memory of each streamed stage on the CPU (its weights outside the blocks, its blocks held
    # once, its ring) against the anonymous RSS a fresh process holds in that stage, the other model released
    from transformers import Qwen3_5TextConfig, Qwen3_5TextModel

    config = Qwen3_5TextConfig(**TEXT_CONFIG)
    with torch.device("meta"):
        parameters = sum(p.numel() for p in Qwen3_5TextModel(config).parameters())
    text = text_encoder_streamed_weights(parameters, config.hidden_size, config.num_hidden_layers, config.vocab_size)
    transformer = preview_streamed_weights(None, None, transformer_config=TRANSFORMER_CONFIG)
    planned = [w.resident + w.streamed + w.ring for w in (text, transformer)]
    out = host_memory_checks["stages"]  # glibc: no dynamic threshold, frees go back to the OS
    assert out.returncode == 0, out.stderr[-3000:]
    measured = [int(v) for v in out.stdout.split()[-2:]]
    print(f"host per stage: measured {measured} B, planned {planned} B")
    for m, p in zip(measured, planned):
        assert abs(p - m) <= 0.10 * m
