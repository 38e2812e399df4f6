"""``examples/train_lora.py`` with streamed weights on the tiny models (CPU ring): ``--vram_gb`` keeps the resident
run's losses and LoRA, ``--host_memory disk`` (a ``--model`` repo) caches and trains as the pinned mode bit for bit,
and the switches a run cannot stream with are refused before any work. (``--cache`` under ``--vram_gb``:
``test_train_lora.py``, beside the caching test it extends.)"""

from __future__ import annotations

import argparse

import pytest
import torch
from helpers.train_lora_testing import argv, synthetic_clip, write_video
from helpers.train_workers import load_train_script
from safetensors.torch import load_file


script = load_train_script()


def test_vram_gb_streams_the_blocks_and_trains_the_losses_and_lora_of_the_resident_run(tmp_path):
    """``--vram_gb`` (with ``--gradient_checkpointing --offload_block_inputs``, the 32 GB recipe): the transformer's
    blocks stream through the ring (here the CPU's), and the per-step losses and the LoRA file written equal the
    resident run's bit for bit (same seed)."""
    data = synthetic_clip(tmp_path / "data")
    runs = []
    for extra in ((), ("--vram_gb", "32")):
        out = tmp_path / f"out{len(extra)}"
        args = script.parse_args(
            argv(data, out, "--max_steps", "3", "--gradient_checkpointing", "--offload_block_inputs", *extra)
        )
        losses, pipe = script.train(args)
        streamed = getattr(pipe.transformer, "_weight_streamer", None) is not None
        runs.append((losses, load_file(str(out / "pytorch_lora_weights.safetensors")), streamed))
    (resident, resident_lora, was_streamed), (losses, lora, is_streamed) = runs
    assert not was_streamed and is_streamed
    assert len(losses) == 3 and losses == resident
    assert lora.keys() == resident_lora.keys() and all(torch.equal(lora[k], resident_lora[k]) for k in lora)


def test_vram_gb_without_gradient_checkpointing_is_refused_before_any_work(capsys):
    with pytest.raises(SystemExit):
        script.parse_args(["--data_dir", "d", "--output_dir", "o", "--vram_gb", "32"])
    err = capsys.readouterr().err
    assert "--vram_gb" in err and "add --gradient_checkpointing" in err


def test_host_memory_disk_caches_and_trains_as_the_pinned_mode_bit_for_bit(tmp_path, tiny_repo):
    """``--vram_gb 32 --host_memory disk`` on a ``--model`` repo: the text encoder streams from the repo's files for
    ``--cache`` (and the negative prompt of ``--cfg_dropout``) and the transformer's blocks for training; the caches,
    the losses and the LoRA file equal the pinned mode's bit for bit."""
    runs = []
    for mode in ("pinned", "disk"):
        data = tmp_path / mode
        data.mkdir()
        write_video(data / "clip.mp4", (32, 32), frames=5)
        (data / "clip.txt").write_text("A red fox trots through fresh snow")
        flags = argv(data, tmp_path / f"out_{mode}", "--max_steps", "2", "--learning_rate", "1e-2", "--cache")
        flags += ["--cfg_dropout", "0.5"]  # the negative prompt's states encoded by the caching pipeline too
        flags += ["--model", str(tiny_repo), "--gradient_checkpointing", "--vram_gb", "32", "--host_memory", mode]
        losses, pipe = script.train(script.parse_args(flags))
        assert type(pipe.transformer._weight_streamer).__name__ == (
            "DiskWeightStreamer" if mode == "disk" else "WeightStreamer"
        )
        lora = (tmp_path / f"out_{mode}" / "pytorch_lora_weights.safetensors").read_bytes()
        runs.append((losses, (data / "clip.magi2.safetensors").read_bytes(), lora))
    assert len(runs[0][0]) == 2 and runs[0] == runs[1]


@pytest.mark.parametrize(
    "extra, message",
    [
        (("--host_memory", "pinned"), "--host_memory goes with --vram_gb"),
        (("--vram_gb", "32", "--host_memory", "disk"), "pass --model"),
        (
            ("--model", "REPO", "--vram_gb", "32", "--host_memory", "disk", "--storage_dtype", "float8_e4m3fn"),
            "--storage_dtype float8_e4m3fn would change them after loading",
        ),
        (
            ("--model", "REPO", "--vram_gb", "32", "--host_memory", "disk", "--expert_dtype", "int4"),
            "--expert_dtype int4 would quantize them while reading",
        ),
    ],
)
def test_a_host_memory_the_run_cannot_stream_is_refused_before_any_work(tmp_path, tiny_repo, capsys, extra, message):
    out = tmp_path / "out"
    extra = [str(tiny_repo) if a == "REPO" else a for a in extra]
    with pytest.raises(SystemExit):
        script.main(["--data_dir", str(tmp_path), "--output_dir", str(out), "--gradient_checkpointing", *extra])
    err = capsys.readouterr().err
    assert "error: --host_memory" in err and message in err and not out.exists()


def test_host_memory_disk_compares_expert_dtypes_as_parsed_from_the_fetched_config(tmp_path, monkeypatch):
    """``--expert_dtype torch.float8_e4m3fn`` is the stored ``float8_e4m3fn``; a Hub id's config.json is fetched
    (not only looked up in the cache), so an unlike ``--expert_dtype`` is refused before the weights download."""
    from diffusers_magi2 import Magi2Transformer3DModel

    (tmp_path / "transformer").mkdir()
    (tmp_path / "transformer" / "config.json").write_text('{"expert_dtype": "float8_e4m3fn"}')
    args = argparse.Namespace(host_memory="disk", vram_gb=32, model=str(tmp_path), storage_dtype=None)
    for same in ("float8_e4m3fn", "torch.float8_e4m3fn"):
        script.check_host_memory(argparse.Namespace(**vars(args), expert_dtype=same))
    with pytest.raises(ValueError, match=r"stores them \(float8_e4m3fn\); --expert_dtype int4 would quantize"):
        script.check_host_memory(argparse.Namespace(**vars(args), expert_dtype="int4"))
    fetched = []
    monkeypatch.setattr(
        Magi2Transformer3DModel, "load_config", lambda *a, **kw: fetched.append(kw) or {"expert_dtype": None}
    )
    with pytest.raises(ValueError, match=r"org/magi2 stores them \(the load dtype\); --expert_dtype int4"):
        script.check_host_memory(argparse.Namespace(**{**vars(args), "model": "org/magi2"}, expert_dtype="int4"))
    assert fetched == [{"subfolder": "transformer"}]
