"""``examples/train_lora.py`` on the tiny random pipeline (CPU): it overfits one synthetic clip, its LoRA loads into a
fresh pipeline, gradients reach exactly the LoRA parameters, gradient accumulation averages the micro-batch
gradients, the LR schedule warms up, it resumes exactly (``accelerator.save_state`` / ``load_state``; ``latest``
without a checkpoint starts a new run, a named folder that is not one is refused), CP2 x EP2 over two gloo processes
trains like one process, a LoRA trains over frozen FP8 and int4 experts (int4: with the gradients of the dequantized
model), ``--expert_dtype`` takes the model's values, ``--offload_block_inputs`` keeps the losses, ``--cache`` under
``--vram_gb`` writes the same caches from a streamed pipeline of the encoders released before training,
``--storage_dtype`` stores the dense weights in FP8 with the loss of FP8-rounded ones, and bad datasets and switches
stop it before training (streamed training: ``test_train_lora_streaming.py``)."""

from __future__ import annotations

import math
import shutil
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.ep_spawn_utils import run_on_ranks
from helpers.train_lora_testing import argv, synthetic_clip, write_video
from helpers.train_workers import load_train_script, train_on_rank
from safetensors.torch import load_file

import diffusers_magi2.models.weight_streaming_ring as ring  # noqa: E402
from diffusers_magi2 import build_tiny_random_pipeline  # noqa: E402


script = load_train_script()


def test_overfits_one_clip_and_its_lora_changes_a_fresh_pipeline(tmp_path):
    data = synthetic_clip(tmp_path / "data")
    out = tmp_path / "out"
    losses, trained_pipe = script.train(
        script.parse_args(argv(data, out, "--max_steps", "30", "--learning_rate", "1e-2", "--fixed_noise"))
    )
    print(f"\nloss step 1 {losses[0]:.4f}, step 30 {losses[-1]:.4f} ({losses[-1] / losses[0]:.2f} x)")
    assert len(losses) == 30 and losses[-1] <= 0.5 * losses[0]
    assert (out / "checkpoint-30" / "pytorch_lora_weights.safetensors").is_file()

    pipe = build_tiny_random_pipeline()
    clip = load_file(str(data / "clip.magi2.safetensors"))
    inputs = {
        "hidden_states": clip["latents"][None],
        "timestep": torch.tensor([500.0]),
        "encoder_hidden_states": clip["text_states"][None],
        "audio_hidden_states": torch.zeros(1, 4, 64),
    }
    with torch.no_grad():
        before = pipe.transformer(**inputs).sample
        pipe.load_lora_weights(out, adapter_name="trained")
        after = pipe.transformer(**inputs).sample
    assert ((after - before).norm() / before.norm()).item() > 1e-3
    saved = load_file(str(out / "pytorch_lora_weights.safetensors"))
    trained = train_state(trained_pipe.transformer)
    assert sorted(k.removeprefix("transformer.") for k in saved) == sorted(trained)
    assert all(torch.equal(saved["transformer." + k], v) for k, v in trained.items())


def train_state(transformer) -> dict:
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(transformer, adapter_name="default")


def test_gradients_reach_every_lora_parameter_and_no_frozen_weight(tmp_path):
    """All target kinds (single-modality and grouped projections, router gates, shared experts) get gradients;
    nothing else does."""
    args = script.parse_args(
        argv(tmp_path, tmp_path / "o", "--targets", "linear_qkv,linear_proj,router,shared_experts")
    )
    pipe = build_tiny_random_pipeline()
    trainable = script.add_lora(pipe.transformer, args)
    kinds = {type(m).__name__ for m in pipe.transformer.modules() if hasattr(m, "lora_A")}
    assert kinds == {"Linear", "Magi2GroupedLoraLinear", "ParamWrapper"}
    with torch.no_grad():  # B starts at zero, which would leave A without gradient
        for name, p in trainable.items():
            if ".lora_B." in name:
                p.normal_(0, 0.05)
    sample = script.load_cache(synthetic_clip(tmp_path / "d") / "clip.magi2.safetensors", pipe.transformer)
    loss = script.training_loss(pipe.transformer, sample, torch.Generator().manual_seed(0), torch.device("cpu"))
    loss.backward()
    missing = [n for n, p in trainable.items() if p.grad is None or not bool(p.grad.abs().sum() > 0)]
    assert not missing
    frozen = [n for n, p in pipe.transformer.named_parameters() if n not in trainable]
    assert frozen and all(
        not p.requires_grad and p.grad is None for n, p in pipe.transformer.named_parameters() if n in frozen
    )


def test_resume_continues_the_run_exactly_and_latest_without_a_checkpoint_starts_a_new_run(tmp_path, capsys):
    """``--resume_from_checkpoint latest`` on an output folder without checkpoints says so and trains from step 0,
    as diffusers' training scripts do; ``--resume latest`` (the same flag) then continues from the one written."""
    data = synthetic_clip(tmp_path / "data")
    full, _ = script.train(
        script.parse_args(argv(data, tmp_path / "a", "--max_steps", "4", "--checkpoint_every", "2"))
    )
    capsys.readouterr()
    first, _ = script.train(
        script.parse_args(
            argv(
                data,
                tmp_path / "b",
                "--max_steps",
                "2",
                "--checkpoint_every",
                "2",
                "--resume_from_checkpoint",
                "latest",
            )
        )
    )
    assert f"no checkpoint-<step> folder in {tmp_path / 'b'}; starting a new training run" in capsys.readouterr().out
    rest, _ = script.train(
        script.parse_args(
            argv(data, tmp_path / "b", "--max_steps", "4", "--checkpoint_every", "2", "--resume", "latest")
        )
    )
    assert first == full[:2] and rest == full[2:]


@pytest.mark.parametrize(
    "name, message",
    [("checkpoint-5", "no such folder"), ("lora_out", "expected a checkpoint-<step> folder (or 'latest')")],
)
def test_resume_from_a_folder_that_is_not_a_checkpoint_is_refused_before_any_work(tmp_path, capsys, name, message):
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_info:
        script.parse_args(argv(tmp_path / "data", out, "--resume_from_checkpoint", str(out / name)))
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and f"--resume_from_checkpoint {str(out / name)!r}: {message}" in err
    assert not out.exists()


def test_a_bare_checkpoint_name_is_looked_up_in_the_output_dir(tmp_path, monkeypatch, capsys):
    """As diffusers' training scripts: ``checkpoint-<step>`` names a folder of ``--output_dir`` whatever the cwd."""
    out, cwd = tmp_path / "out", tmp_path / "cwd"
    for folder in (out / "checkpoint-2", cwd / "checkpoint-3"):
        folder.mkdir(parents=True)
        (folder / "pytorch_lora_weights.safetensors").write_bytes(b"")
    monkeypatch.chdir(cwd)
    assert script.find_checkpoint(out, "checkpoint-2") == (out / "checkpoint-2", 2)
    assert script.find_checkpoint(out, "./checkpoint-3") == (Path("checkpoint-3"), 3)  # a folder part: the cwd's
    assert script.find_checkpoint(out, str(cwd / "checkpoint-3")) == (cwd / "checkpoint-3", 3)
    with pytest.raises(SystemExit) as exit_info:  # in the cwd, not in --output_dir
        script.parse_args(argv(tmp_path / "data", out, "--resume_from_checkpoint", "checkpoint-3"))
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and f"'checkpoint-3': no such folder ({out / 'checkpoint-3'})" in err


@pytest.mark.distributed
def test_cp2_ep2_over_two_gloo_processes_trains_like_one_process(tmp_path):
    """Same per-step losses with 2 micro-batches per step and a warming-up linear LR schedule: the gradients are
    averaged over the ranks at each optimizer step, and the schedule advances as in one process."""
    data = synthetic_clip(tmp_path / "data", frames=3)
    extra = ("--max_steps", "3", "--gradient_accumulation_steps", "2", "--lr_scheduler", "linear")
    extra += ("--lr_warmup_steps", "1", "--learning_rate", "1e-2")
    single, _ = script.train(script.parse_args(argv(data, tmp_path / "one", *extra)))
    ranks = run_on_ranks(train_on_rank, 2, argv(data, tmp_path / "two", *extra, "--ep_degree", "2"), deadline_s=240.0)
    print(f"\nper-step loss, 1 process {single}, CP2 x EP2 rank 0 {ranks[0]['losses']}")
    assert all(r["ulysses_degree"] == 2 and r["ep_sizes"] == [2] for r in ranks)
    assert ranks[0]["losses"] == ranks[1]["losses"]
    assert all(abs(a - b) <= 1e-4 * abs(a) for a, b in zip(single, ranks[0]["losses"]))


@pytest.mark.parametrize("case", ["missing caption", "unreadable video", "size the VAE cannot take"])
def test_bad_dataset_names_the_file_and_stops_before_training(tmp_path, case):
    data = tmp_path / "data"
    data.mkdir()
    if case == "missing caption":
        write_video(data / "a.mp4", (32, 32))
        bad, match = data / "a.mp4", "missing or empty caption a.txt"
    elif case == "unreadable video":
        (data / "b.mp4").write_bytes(b"not a video at all")
        (data / "b.txt").write_text("a caption")
        bad, match = data / "b.mp4", "unreadable video"
    else:
        write_video(data / "c.mp4", (40, 24))
        (data / "c.txt").write_text("a caption")
        bad, match = data / "c.mp4", "40x24 frames; the VAE takes heights and widths that are multiples of 16"
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=match) as error:
        script.train(script.parse_args(argv(data, out, "--cache", "--max_steps", "1")))
    assert str(bad) in str(error.value)
    assert not out.exists() and not list(data.glob("*.magi2.safetensors"))


def test_cache_encodes_videos_with_the_pipeline_vae_and_text_encoder(tmp_path, monkeypatch):
    """The caches hold the encoders' outputs; the VAE and the text encoder go to the device for the encoding and
    back to the host, the transformer alone trains there, and the decoders never leave the host. With ``--vram_gb``
    the text encoder streams (``Magi2Pipeline.enable_weight_streaming``) in a pipeline of the encoders alone, which
    is released before the training pipeline (no encoder in it) loads, and the caches are the same bit for bit."""
    data = tmp_path / "data"
    data.mkdir()
    write_video(data / "clip.mp4", (32, 32), frames=6)  # 6 frames: cut to 4k + 1 = 5
    (data / "clip.txt").write_text("A red fox trots through fresh snow")
    streamed_data = tmp_path / "streamed"
    shutil.copytree(data, streamed_data)
    moves = []
    module_to = torch.nn.Module.to
    monkeypatch.setattr(
        torch.nn.Module,
        "to",
        lambda self, *a, **kw: moves.append((self, a[0] if a else kw)) or module_to(self, *a, **kw),
    )
    losses, pipe = script.train(script.parse_args(argv(data, tmp_path / "out", "--cache", "--max_steps", "1")))
    cache = load_file(str(data / "clip.magi2.safetensors"))
    assert cache["latents"].shape == (48, 2, 2, 2) and cache["text_states"].shape[1] == 64
    with torch.no_grad():  # no audio track: the encoding of 5 / 12 s of silence, 10 latents
        silence = pipe.audio_vae.encode(torch.zeros(1, 2, 10 * 2048)).latent_dist.mean[0].T
    assert torch.allclose(cache["audio_latents"], silence, rtol=0, atol=1e-6)
    assert len(losses) == 1 and np.isfinite(losses[0])
    names = {id(m): n for n, m in pipe.components.items() if isinstance(m, torch.nn.Module)}
    moved = [(names[id(m)], str(to)) for m, to in moves if id(m) in names]
    assert moved == [
        ("vae", "cpu"),
        ("audio_vae", "cpu"),
        ("text_encoder", "cpu"),
        ("vae", "cpu"),
        ("audio_vae", "cpu"),
        ("text_encoder", "cpu"),
        ("transformer", "cpu"),
    ]

    loaded, load = [], script.load_pipeline

    def load_pipeline(args, without=()):  # each pipeline loaded, and whether those before it are released
        alive = [ref() is not None for ref in loaded]
        calls.append(len(returned))  # the pinned buffers returned before it loads
        pipe, device = load(args, without)
        loaded.append(weakref.ref(pipe))
        calls.append((sorted(n for n, c in pipe.components.items() if c is None), alive))
        if pipe.text_encoder is not None:  # record whether it streams when it encodes
            encode_text = pipe.encode_text
            pipe.encode_text = lambda *a, **k: (
                streams.append(pipe.text_encoder._weight_streamer) or encode_text(*a, **k)
            )
        return pipe, device

    calls, streams, returned = [], [], []
    monkeypatch.setattr(script, "load_pipeline", load_pipeline)
    monkeypatch.setattr(ring, "return_pinned_memory", lambda pinned: returned.append(pinned))
    flags = ("--cache", "--max_steps", "1", "--vram_gb", "32", "--gradient_checkpointing")
    losses, pipe = script.train(script.parse_args(argv(streamed_data, tmp_path / "out_streamed", *flags)))
    assert pipe.text_encoder is None and pipe.transformer._weight_streamer is not None
    assert calls == [  # the text encoder's streamer freed (release_weight_streaming) before the training load
        0,
        (["prompt_enhancer", "refiner", "transformer", "video_decoder"], []),
        1,
        (["audio_vae", "prompt_enhancer", "refiner", "text_encoder", "vae", "video_decoder"], [False]),
    ]
    assert len(streams) == 1 and streams[0] is not None
    streamed_cache = (streamed_data / "clip.magi2.safetensors").read_bytes()
    assert streamed_cache == (data / "clip.magi2.safetensors").read_bytes()


def test_cache_stores_the_clips_audio_latents_and_training_uses_them(tmp_path, monkeypatch):
    """``--cache`` on a 0.4 s clip (5 frames at 12.5 fps) with a 440 Hz tone as 44.1 kHz AAC: the cache holds 10
    audio latents (0.4 s x 25 latents/s), the audio VAE's posterior mean of the tone rendered straight at the VAE's
    own rate (51.2 kHz) to AAC and resampling error, far from zeros and from the encoding of silence; the training
    step feeds exactly the cached latents."""
    from diffusers_magi2 import export_to_video_with_audio

    data = tmp_path / "data"
    data.mkdir()
    tone = lambda rate: (0.3 * np.sin(2 * np.pi * 440.0 * np.arange(rate * 2 // 5) / rate)).astype(np.float32)  # noqa: E731
    export_to_video_with_audio(
        np.zeros((5, 32, 32, 3)), data / "tone.mp4", audio=np.stack([tone(44_100)] * 2), fps=12.5
    )
    (data / "tone.txt").write_text("a caption")
    fed = []
    inputs = script.flow_matching_inputs
    monkeypatch.setattr(script, "flow_matching_inputs", lambda sample, *a: fed.append(sample) or inputs(sample, *a))
    losses, pipe = script.train(script.parse_args(argv(data, tmp_path / "out", "--cache", "--max_steps", "1")))
    assert len(losses) == 1 and np.isfinite(losses[0])
    with torch.no_grad():
        waves = torch.from_numpy(np.stack([tone(51_200), np.zeros(10 * 2048, np.float32)]))
        reference, silence = pipe.audio_vae.encode(waves[:, None].expand(2, 2, -1)).latent_dist.mean.transpose(1, 2)
    cached = load_file(str(data / "tone.magi2.safetensors"))["audio_latents"]
    assert cached.shape == (10, 64)
    assert (cached - reference).norm() <= 0.01 * reference.norm()
    assert (cached - silence).norm() >= 0.1 * reference.norm() and cached.norm() >= 0.5 * reference.norm()
    assert len(fed) == 1 and torch.equal(fed[0]["audio_latents"], cached)


def test_gradient_checkpointing_gives_the_same_lora_gradients(tmp_path):
    sample = None
    grads = []
    for checkpointing in (False, True):
        extra = ("--targets", "linear_qkv,linear_proj,router") + (
            ("--gradient_checkpointing",) if checkpointing else ()
        )
        args = script.parse_args(argv(tmp_path, tmp_path / "o", *extra))
        pipe = build_tiny_random_pipeline()
        trainable = script.add_lora(pipe.transformer, args)
        with torch.no_grad():
            for name, p in trainable.items():
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.05)
        sample = sample or script.load_cache(
            synthetic_clip(tmp_path / "d") / "clip.magi2.safetensors", pipe.transformer
        )
        script.training_loss(
            pipe.transformer, sample, torch.Generator().manual_seed(0), torch.device("cpu")
        ).backward()
        grads.append({n: p.grad.clone() for n, p in trainable.items()})
    assert grads[0].keys() == grads[1].keys()
    assert all(torch.allclose(grads[0][n], grads[1][n], rtol=1e-5, atol=1e-7) for n in grads[0])


def test_bf16_training_with_frozen_fp8_experts_reaches_every_lora_parameter(tmp_path):
    """bf16 weights with FP8 routed experts (``expert_dtype`` while reading, as ``--expert_dtype`` does): the expert
    op's backward carries the gradient through the frozen FP8 banks to the LoRA of the layers below."""
    from diffusers_magi2 import Magi2Transformer3DModel
    from diffusers_magi2.moe.layer import Magi2MultiHeadMoE

    build_tiny_random_pipeline().transformer.save_pretrained(tmp_path / "bf16")
    model = Magi2Transformer3DModel.from_pretrained(
        tmp_path / "bf16", expert_dtype="float8_e4m3fn", torch_dtype=torch.bfloat16
    )
    assert {m.W_gate.dtype for m in model.modules() if isinstance(m, Magi2MultiHeadMoE)} == {torch.float8_e4m3fn}
    args = script.parse_args(argv(tmp_path, tmp_path / "o", "--targets", "linear_qkv,linear_proj,shared_experts"))
    trainable = script.add_lora(model, args)
    with torch.no_grad():
        for name, p in trainable.items():
            if ".lora_B." in name:
                p.normal_(0, 0.05)
    sample = script.load_cache(synthetic_clip(tmp_path / "d") / "clip.magi2.safetensors", model)
    loss = script.training_loss(model, sample, torch.Generator().manual_seed(0), torch.device("cpu"))
    loss.backward()
    assert torch.isfinite(loss)
    assert all(
        p.dtype == torch.float32 and p.grad is not None and bool(p.grad.abs().sum() > 0) for p in trainable.values()
    )
    assert all(p.grad is None for n, p in model.named_parameters() if n not in trainable)


def test_lora_trains_over_frozen_int4_experts_with_the_gradients_of_the_dequantized_model(tmp_path):
    """fp32 weights with int4 routed experts (quantized in memory; ``--expert_dtype int4`` reads them from a repo):
    the script's ``training_loss`` and ``train_step`` reach every LoRA parameter and no frozen one, the expert op's
    backward makes no expert-weight gradient, and the LoRA gradients equal fp32 autograd of the same model with its
    routed experts computed by the loop-over-experts reference on the dequantized banks (<= 1e-5)."""
    import types

    from accelerate import Accelerator
    from helpers.int4_models import BANKS, int4_transformer

    from diffusers_magi2.moe.dequantize import dequantize_bank
    from diffusers_magi2.moe.layer import Magi2MultiHeadMoE
    from diffusers_magi2.moe.reference import reference_mh_moe_forward

    model = int4_transformer(build_tiny_random_pipeline().transformer, 16)
    args = script.parse_args(argv(tmp_path, tmp_path / "o", "--targets", "linear_qkv,linear_proj,shared_experts"))
    trainable = script.add_lora(model, args)
    with torch.no_grad():  # B starts at zero, which would leave A without gradient
        for name, p in trainable.items():
            if ".lora_B." in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    sample = script.load_cache(synthetic_clip(tmp_path / "d") / "clip.magi2.safetensors", model)
    cpu, params = torch.device("cpu"), list(trainable.values())

    def lora_grads():
        loss = script.training_loss(model, sample, torch.Generator().manual_seed(0), cpu)
        return torch.autograd.grad(loss, params)

    got = lora_grads()
    moes = [m for m in model.modules() if isinstance(m, Magi2MultiHeadMoE)]
    assert moes and all(m.int4_experts for m in moes)
    for moe in moes:  # the oracle: plain autograd through the reference on this layer's dequantized banks
        dense = [
            dequantize_bank(moe.get_parameter(b), moe.get_buffer(s)) for b, s in zip(BANKS, moe.expert_scale_names)
        ]
        moe.run_experts = types.MethodType(
            lambda self, x, routes, weights, dense=dense, **kw: reference_mh_moe_forward(x, *routes, *dense), moe
        )
    try:
        want = lora_grads()
    finally:
        for moe in moes:
            del moe.run_experts
    worst = max(((g - w).abs().max() / w.abs().max()).item() for g, w in zip(got, want))
    print(f"\nint4 experts: LoRA gradients vs fp32 autograd of the dequantized model, worst rel {worst:.1e}")
    assert worst <= 1e-5 and all(bool(w.abs().sum() > 0) for w in want)

    accelerator = Accelerator(mixed_precision="no", cpu=True)
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    optimizer, schedule = accelerator.prepare(optimizer, schedule)
    before = [p.detach().clone() for p in params]
    loss = script.train_step(accelerator, model, optimizer, schedule, params, [sample], torch.Generator(), cpu)
    assert np.isfinite(loss) and all(not torch.equal(a, p) for a, p in zip(before, params))
    assert all(p.grad is None for n, p in model.named_parameters() if n not in trainable)


def test_gradient_accumulation_averages_the_micro_batch_gradients(tmp_path):
    """``train_step`` over two micro-batches steps the optimizer once, with the mean of the two gradients each
    micro-batch gives on its own (same noise draws)."""
    from accelerate import Accelerator

    pipe = build_tiny_random_pipeline()
    params = list(script.add_lora(pipe.transformer, script.parse_args(argv(tmp_path, tmp_path / "o"))).values())
    with torch.no_grad():  # B starts at zero, which would leave A without gradient
        for p in params:
            p.normal_(0, 0.05)
    clips = [synthetic_clip(tmp_path / f"d{i}", seed=i) / "clip.magi2.safetensors" for i in range(2)]
    samples = [script.load_cache(c, pipe.transformer) for c in clips]
    cpu, g = torch.device("cpu"), torch.Generator().manual_seed(5)
    each = [torch.autograd.grad(script.training_loss(pipe.transformer, s, g, cpu), params) for s in samples]
    mean = [(a + b) / 2 for a, b in zip(*each)]

    accelerator = Accelerator(gradient_accumulation_steps=2, mixed_precision="no", cpu=True)
    optimizer = torch.optim.SGD(params, lr=0.0)
    seen = []
    optimizer.register_step_pre_hook(lambda opt, a, kw: seen.append([p.grad.clone() for p in params]))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    optimizer, schedule = accelerator.prepare(optimizer, schedule)
    loss = script.train_step(
        accelerator, pipe.transformer, optimizer, schedule, params, samples, torch.Generator().manual_seed(5), cpu
    )
    assert np.isfinite(loss) and len(seen) == 1
    assert all(torch.allclose(s, m, rtol=1e-5, atol=1e-9) for s, m in zip(seen[0], mean))
    assert not all(torch.allclose(a, b, rtol=1e-3) for a, b in zip(*each))  # the two micro-batches differ


def test_a_nan_sample_is_refused_before_its_backward_and_nothing_is_updated(tmp_path):
    """A cached clip whose latents hold a NaN: ``train_step`` raises the router check's ``ValueError`` (as every
    rank does together under CP) before the backward, so no LoRA parameter gets a gradient or an update."""
    from accelerate import Accelerator

    pipe = build_tiny_random_pipeline()
    params = list(script.add_lora(pipe.transformer, script.parse_args(argv(tmp_path, tmp_path / "o"))).values())
    before = [p.detach().clone() for p in params]
    sample = script.load_cache(synthetic_clip(tmp_path / "d") / "clip.magi2.safetensors", pipe.transformer)
    sample["latents"][0, 0, 0, 0] = float("nan")
    accelerator = Accelerator(mixed_precision="no", cpu=True)
    optimizer = torch.optim.SGD(params, lr=1.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    optimizer, schedule = accelerator.prepare(optimizer, schedule)
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match=r"MoE router inputs are not finite: first in transformer_blocks\.\d+"):
        script.train_step(accelerator, pipe.transformer, optimizer, schedule, params, [sample], torch.Generator(), cpu)
    assert all(p.grad is None for p in params)
    assert all(torch.equal(p, b) for p, b in zip(params, before))


def test_a_nan_seen_before_the_step_does_not_fail_the_step(tmp_path):
    """A MoE layer called directly with NaN records it and no check follows: ``train_step`` clears the flags before
    its forward, so the step runs and updates the LoRA parameters."""
    from accelerate import Accelerator

    pipe = build_tiny_random_pipeline()
    params = list(script.add_lora(pipe.transformer, script.parse_args(argv(tmp_path, tmp_path / "o"))).values())
    before = [p.detach().clone() for p in params]
    sample = script.load_cache(synthetic_clip(tmp_path / "d") / "clip.magi2.safetensors", pipe.transformer)
    moe = next(m for m in pipe.transformer.modules() if hasattr(m, "non_finite_router_logits"))
    with torch.no_grad():
        moe(torch.full((4, moe.hidden_size), float("nan")))
    accelerator = Accelerator(mixed_precision="no", cpu=True)
    optimizer = torch.optim.SGD(params, lr=1.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    optimizer, schedule = accelerator.prepare(optimizer, schedule)
    cpu = torch.device("cpu")
    loss = script.train_step(
        accelerator, pipe.transformer, optimizer, schedule, params, [sample], torch.Generator(), cpu
    )
    assert math.isfinite(loss)
    assert any(not torch.equal(p, b) for p, b in zip(params, before))


def test_lr_schedule_warms_up_from_zero(tmp_path):
    """``--lr_scheduler constant_with_warmup --lr_warmup_steps 2`` (diffusers' ``get_scheduler``): the first step
    runs at LR 0, so with fixed noise the second step's loss equals the first bit for bit; the third differs."""
    data = synthetic_clip(tmp_path / "data")
    extra = ("--max_steps", "3", "--fixed_noise", "--learning_rate", "1e-2", "--lr_scheduler", "constant_with_warmup")
    losses, _ = script.train(script.parse_args(argv(data, tmp_path / "out", *extra, "--lr_warmup_steps", "2")))
    assert losses[0] == losses[1] and losses[2] != losses[1]


def test_expert_dtype_takes_the_values_the_model_takes():
    """``--expert_dtype`` accepts every ``EXPERT_DTYPES`` value of ``diffusers_magi2.moe.quantize`` and refuses
    others with the model's own message; it needs ``--model``."""
    from diffusers_magi2.moe.quantize import EXPERT_DTYPES

    base = ["--data_dir", "d", "--output_dir", "o", "--model", "repo"]
    for value in [v for v in EXPERT_DTYPES if v is not None]:
        assert script.parse_args([*base, "--expert_dtype", value]).expert_dtype == value
    with pytest.raises(SystemExit):
        script.parse_args([*base, "--expert_dtype", "float7"])
    with pytest.raises(SystemExit):
        script.parse_args(["--data_dir", "d", "--output_dir", "o", "--expert_dtype", EXPERT_DTYPES[-1]])


def test_offload_block_inputs_trains_the_losses_of_checkpointing_with_the_inputs_on_the_device(tmp_path, monkeypatch):
    """``--offload_block_inputs`` (``enable_gradient_checkpointing(offload_block_inputs=True)``): every block's
    saved input goes through the host copy, and the per-step losses equal checkpointing's without it (same seed)."""
    from diffusers_magi2.models import modeling_magi2

    copies = []
    to_host = modeling_magi2._to_host
    monkeypatch.setattr(modeling_magi2, "_to_host", lambda t: copies.append(t.shape) or to_host(t))
    data = synthetic_clip(tmp_path / "data")
    runs = []
    for extra in ((), ("--offload_block_inputs",)):
        args = script.parse_args(
            argv(data, tmp_path / f"out{len(extra)}", "--max_steps", "3", "--gradient_checkpointing", *extra)
        )
        losses, _ = script.train(args)
        runs.append((losses, len(copies)))
    assert runs[0][1] == 0 and runs[1][1] > 0  # host copies only with the switch
    assert len(runs[0][0]) == 3 and runs[1][0] == runs[0][0]


def test_offload_block_inputs_without_gradient_checkpointing_is_refused_before_any_work(capsys):
    with pytest.raises(SystemExit):
        script.parse_args(["--data_dir", "d", "--output_dir", "o", "--offload_block_inputs"])
    err = capsys.readouterr().err
    assert "--offload_block_inputs" in err and "add --gradient_checkpointing" in err


def stored_and_reference(args) -> list:
    """``[(model, trainable), (reference, its trainable)]``: two tiny transformers with the same random LoRA
    (``--targets`` of ``args``), the first with its dense weights stored as ``--storage_dtype`` says."""
    models = []
    for stored in (True, False):
        model = build_tiny_random_pipeline().transformer
        trainable = script.add_lora(model, args)
        with torch.no_grad():  # B starts at zero, which would leave the LoRA out of the loss
            for name, p in trainable.items():
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.05)
        if stored:
            script.store_dense_weights(model, args)
        models.append((model, trainable))
    return models


def test_fp8_storage_stores_the_dense_weights_in_fp8_and_gives_the_loss_of_fp8_rounded_weights(tmp_path):
    """``--storage_dtype float8_e4m3fn`` (the transformer's ``enable_layerwise_casting``): every dense projection
    of the blocks is stored in FP8 between calls; the fp32 islands, the routed experts and the LoRA keep fp32; the
    loss equals the same model's with those weights rounded to FP8 by hand; a training run keeps them so."""
    from diffusers_magi2.models.modality import Magi2ModalityGroupedLinear
    from diffusers_magi2.moe.layer import Magi2MultiHeadMoE

    fp8 = torch.float8_e4m3fn
    args = script.parse_args(argv(tmp_path, tmp_path / "o", "--storage_dtype", "float8_e4m3fn"))
    (model, trainable), (reference, _) = stored_and_reference(args)
    sample = script.load_cache(synthetic_clip(tmp_path / "d") / "clip.magi2.safetensors", reference)
    kept = {n: p.dtype for n, p in model.named_parameters() if p.dtype != fp8}
    stored_names = {n for n, p in model.named_parameters() if p.dtype == fp8}
    dense = {
        f"{n}.weight"
        for n, m in model.transformer_blocks.named_modules(prefix="transformer_blocks")
        if isinstance(m, (torch.nn.Linear, Magi2ModalityGroupedLinear)) and ".lora_" not in n
    }
    experts = {
        f"{n}.{w}"
        for n, m in model.named_modules()
        if isinstance(m, Magi2MultiHeadMoE)
        for w in ("W_gate", "W_up", "W_down")
    }
    assert dense and dense == stored_names  # nothing outside the blocks' dense projections
    assert all(kept[n] == torch.float32 for n in trainable) and experts and all(n in kept for n in experts)
    islands = [n for n in kept if model.is_fp32_island(n)]
    assert islands and all(kept[n] == torch.float32 for n in islands)
    with torch.no_grad():
        for name in stored_names:
            p = reference.get_parameter(name)
            p.copy_(p.to(fp8).float())
    cpu = torch.device("cpu")
    losses = [script.training_loss(m, sample, torch.Generator().manual_seed(0), cpu) for m in (model, reference)]
    assert torch.equal(losses[0], losses[1])
    losses[0].backward()
    assert all(p.grad is not None and bool(p.grad.abs().sum() > 0) for p in trainable.values())

    losses, pipe = script.train(
        script.parse_args(
            argv(
                synthetic_clip(tmp_path / "data"),
                tmp_path / "out",
                "--max_steps",
                "2",
                "--storage_dtype",
                "float8_e4m3fn",
            )
        )
    )
    assert len(losses) == 2 and np.isfinite(losses).all()
    assert {n for n, p in pipe.transformer.named_parameters() if p.dtype == fp8} == stored_names


def test_two_runs_with_the_same_flags_write_the_same_lora_bit_for_bit(tmp_path, tiny_repo):
    """``--seed`` seeds everything (``accelerate.utils.set_seed``), the LoRA's initial factors included: two runs of
    ``main`` on a ``--model`` repo with the same flags write byte-identical LoRA files (metadata too); another seed
    writes another LoRA."""
    data = synthetic_clip(tmp_path / "data")
    files = []
    for out, seed in (("a", "3"), ("b", "3"), ("c", "4")):
        flags = argv(data, tmp_path / out, "--max_steps", "2", "--learning_rate", "1e-2", "--model", str(tiny_repo))
        flags[flags.index("--seed") + 1] = seed
        torch.manual_seed(len(files))  # what came before the run must not matter
        assert script.main(flags) == 0
        files.append((tmp_path / out / "pytorch_lora_weights.safetensors").read_bytes())
    assert files[0] == files[1] and files[0] != files[2]


def test_expert_int4_group_size_trains_over_int4_experts_of_a_small_model(tmp_path, tiny_repo):
    """``--expert_dtype int4 --expert_int4_group_size 32`` on the tiny random model's repo (whose 64-wide experts the
    default group of 128 does not divide): every MoE layer holds int4 experts with one scale per 32 rows, and
    ``main`` trains a LoRA over them."""
    flags = argv(synthetic_clip(tmp_path / "data"), tmp_path / "out", "--max_steps", "1", "--model", str(tiny_repo))
    flags += ["--expert_dtype", "int4", "--expert_int4_group_size", "32"]
    losses, pipe = script.train(script.parse_args(flags))
    config = pipe.transformer.config
    assert (config.expert_dtype, config.expert_int4_group_size) == ("int4", 32)
    state = pipe.transformer.state_dict()
    down = {k: v.shape for k, v in state.items() if "W_down" in k and "scale" in k}  # [R, K / 32, N]
    assert len(down) == len(config.moe_layers)
    assert all(shape[1] * 32 == config.moe_expert_intermediate_size for shape in down.values())
    assert len(losses) == 1 and np.isfinite(losses[0])


@pytest.mark.parametrize(
    "extra, message",
    [
        (("--expert_dtype", "int4", "--expert_int4_group_size", "24"), "does not divide"),
        (("--expert_dtype", "int4", "--expert_int4_group_size", "0"), "must be a positive int"),
        (("--expert_dtype", "float8_e4m3fn", "--expert_int4_group_size", "32"), "applies to --expert_dtype int4"),
        (("--expert_int4_group_size", "32"), "applies to --expert_dtype int4"),
    ],
)
def test_a_bad_expert_int4_group_size_is_refused_before_any_work(tmp_path, tiny_repo, capsys, extra, message):
    out = tmp_path / "out"
    with pytest.raises(SystemExit):
        script.main(["--data_dir", str(tmp_path), "--output_dir", str(out), "--model", str(tiny_repo), *extra])
    err = capsys.readouterr().err
    assert "error: --expert_int4_group_size" in err and message in err and not out.exists()


def test_scaled_fp8_storage_gives_the_loss_of_weights_rounded_per_output_channel(tmp_path):
    """``--storage_dtype float8_e4m3fn_scaled`` (``enable_fp8_storage``): the dense projections are e4m3 codes beside
    fp32 per-channel scales, the LoRA stays fp32 and trains, and the loss equals the same model's with each weight
    row rounded to e4m3 at ``amax / 448`` by hand."""
    args = script.parse_args(argv(tmp_path, tmp_path / "o", "--storage_dtype", "float8_e4m3fn_scaled"))
    (model, trainable), (reference, _) = stored_and_reference(args)
    scales = {n.removesuffix("_scale"): b for n, b in model.named_buffers() if n.endswith(".weight_scale")}
    assert scales and all(model.get_parameter(n).dtype == torch.float8_e4m3fn for n in scales)
    with torch.no_grad():
        for name in scales:
            w = reference.get_parameter(name)
            s = w.abs().amax(dim=1, keepdim=True) / 448
            w.copy_((w / torch.where(s > 0, s, torch.ones_like(s))).to(torch.float8_e4m3fn).float() * s)
    sample = script.load_cache(synthetic_clip(tmp_path / "d") / "clip.magi2.safetensors", reference)
    cpu = torch.device("cpu")
    losses = [script.training_loss(m, sample, torch.Generator().manual_seed(0), cpu) for m in (model, reference)]
    assert torch.equal(losses[0], losses[1])
    losses[0].backward()
    assert all(
        p.dtype == torch.float32 and p.grad is not None and bool(p.grad.abs().sum() > 0) for p in trainable.values()
    )
