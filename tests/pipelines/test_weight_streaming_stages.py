"""Stage-sequential host memory under weight streaming, on a tiny pipeline saved and loaded with ``from_pretrained``:
one streamed model holds its weights at a time, the others re-read from their files; calls equal the resident ones
bit for bit; weights that are not the files' are refused before anything moves."""

from __future__ import annotations

import pytest
import torch
from helpers.modular_testing_utils import tiny_pipelines

from diffusers_magi2 import Magi2Pipeline
from diffusers_magi2.pipelines.weight_streaming_pipeline import streamed_blocks
from diffusers_magi2.pipelines.weight_streaming_stages import plan_reread


KWARGS = {
    "prompt": "A red fox trots through fresh snow",
    "height": 64,
    "width": 96,
    "preview_height": 32,
    "preview_width": 48,
    "num_inference_steps": 1,
    "output_type": "latent",
}
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


def _call(pipe):
    out = pipe(**KWARGS, generator=torch.Generator().manual_seed(0))
    return out.frames, out.audio


def _holds(pipe, name) -> bool:
    """Whether a streamed model holds weights: any tensor, in its blocks or outside them, not empty."""
    model = getattr(pipe, name)
    return any(t.numel() for t in [*model.parameters(), *model.buffers()] if t.dim() > 1)


def test_one_streamed_model_held_at_a_time_and_calls_equal_resident(saved):
    pipe = _load(saved)
    resident = _call(pipe)
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
        for a, b in zip(_call(pipe), resident):
            assert torch.equal(torch.as_tensor(a), torch.as_tensor(b))
    assert entered == [(n, [n]) for n in STREAMED] * 2
    # each re-read reads every tensor of the model from its files once (fp32 as saved)
    assert {n: p.file_nbytes for n, p in stages.parts.items()} == file_nbytes
    pipe.disable_weight_streaming()  # every model read back and resident again
    assert all(_holds(pipe, n) for n in STREAMED)
    for a, b in zip(_call(pipe), resident):
        assert torch.equal(torch.as_tensor(a), torch.as_tensor(b))


def test_weights_not_the_files_are_refused_or_held(saved):
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
