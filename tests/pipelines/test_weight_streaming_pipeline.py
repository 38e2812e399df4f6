"""``Magi2Pipeline.enable_weight_streaming`` on the CPU ring: the two-stage call equals the resident one bit for bit
(host memory pinned, and read from the files, also inside ``torch.inference_mode()``); budgets (the planned stage
peaks, the device's weights, the host's memory read from the OS) and moves refused before any weight moves."""

from __future__ import annotations

import contextlib
import os

import PIL.Image
import pytest
import torch
from helpers.modular_testing_utils import tiny_pipelines
from helpers.streaming_calls import TWO_STAGE_CALL, two_stage_call

import diffusers_magi2.pipelines.weight_streaming_pipeline as streaming_pipeline
from diffusers_magi2.models.weight_streaming import streaming_host_nbytes
from diffusers_magi2.pipelines.weight_streaming_budget import streaming_budgets
from diffusers_magi2.pipelines.weight_streaming_pipeline import STREAMED_REFINER_CHUNK_SIZE, streamed_blocks


def _encode(pipe):
    with torch.no_grad():
        return pipe.encode_prompt(TWO_STAGE_CALL["prompt"], negative_prompt="blurry", device="cpu")


def _tiling(decoder):
    return decoder.use_tiling, decoder.tile_sample_min_height, decoder.tile_sample_min_width


def _decode_first_frame(pipe, latents):
    """The first latent frame of ``latents`` through the pipeline's decode step, and the decoder's forwards run."""
    calls = []
    hook = pipe.video_decoder.decoder.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        return pipe.decode_video(latents[:, :, :1]), len(calls)
    finally:
        hook.remove()


def test_two_stage_call_streamed_equals_resident_bit_for_bit():
    pipe, _ = tiny_pipelines(with_refiner=True)
    pipe.video_decoder.enable_tiling(64, 48)  # the 64 x 96 frames in two tiles, as the user set it
    tiling = _tiling(pipe.video_decoder)
    resident, resident_text = two_stage_call(pipe), _encode(pipe)
    resident_video, tiles = _decode_first_frame(pipe, resident[0])
    assert tiles == 2
    pipe.enable_weight_streaming(vram_gb=24, device="cpu")
    # built in memory: nothing to re-read, so every streamed model stays held
    assert pipe._weight_streaming_stages.parts == {}
    assert {b.chunk_size for b in pipe.refiner.transformer_blocks} == {STREAMED_REFINER_CHUNK_SIZE}  # the plan's
    assert _tiling(pipe.video_decoder) == tiling  # streaming leaves the decoder's tiling as the user set it
    released = {"text_encoder": 0, "transformer": 0, "refiner": 0}
    for name in released:
        streamer = getattr(pipe, name)._weight_streamer

        def poison(slot, name=name):
            slot.fill_(0xFF)  # NaN bytes into each slot as it is released
            released[name] += 1

        streamer.on_release = poison
    for a, b in zip(_encode(pipe), resident_text):
        assert torch.equal(a, b)
    layers = len(pipe.text_encoder.layers)
    assert released["text_encoder"] == 2 * layers  # the prompt and the negative prompt, every layer from the ring
    streamed = two_stage_call(pipe)
    for a, b in zip(streamed, resident):
        assert torch.equal(torch.as_tensor(a), torch.as_tensor(b))
    assert torch.equal(_decode_first_frame(pipe, streamed[0])[0], resident_video)  # the same tiles, bit for bit
    assert released["text_encoder"] % layers == 0 and released["text_encoder"] > 2 * layers
    # every block of both models ran from the ring: (cond + uncond) x steps x blocks releases
    assert released["transformer"] % len(pipe.transformer.transformer_blocks) == 0 < released["transformer"]
    assert released["refiner"] % len(pipe.refiner.transformer_blocks) == 0 < released["refiner"]
    # refused before any component moves or is cast; the pipeline's disable then lets it move
    dtypes = {n: c.dtype for n, c in pipe.components.items() if isinstance(c, torch.nn.Module)}
    with pytest.raises(RuntimeError, match=r"block weights are streamed .* call pipe.disable_weight_streaming\(\)"):
        pipe.to(torch.float16)
    assert {n: c.dtype for n, c in pipe.components.items() if isinstance(c, torch.nn.Module)} == dtypes
    pipe.disable_weight_streaming()
    assert all(getattr(pipe, n)._weight_streamer is None for n in released)
    assert _tiling(pipe.video_decoder) == tiling
    pipe.to("cpu")


def _device_bytes(pipe, name, ring_size=2):
    """A component's weights on the device under streaming: all of it, or outside its blocks + ``ring_size`` blocks."""
    model = getattr(pipe, name, None)
    if not isinstance(model, torch.nn.Module):
        return 0
    nbytes = lambda m: sum(t.nbytes for t in [*m.parameters(), *m.buffers()])  # noqa: E731
    if name not in ("text_encoder", "transformer", "refiner"):
        return nbytes(model)
    blocks = model.layers if name == "text_encoder" else model.transformer_blocks
    return nbytes(model) - sum(nbytes(b) for b in blocks) + ring_size * max(nbytes(b) for b in blocks)


def test_budgets_and_arguments_are_refused_before_any_weight_moves():
    pipe, _ = tiny_pipelines(with_refiner=True)
    before = [t.data_ptr() for t in pipe.transformer.parameters()]
    largest = max(
        ("text_encoder", "transformer", "refiner", "audio_vae", "vae", "video_decoder"),
        key=lambda n: _device_bytes(pipe, n),
    )
    with pytest.raises(ValueError, match=rf"vram_gb=0.001: the device would hold .* the largest is {largest} at"):
        pipe.enable_weight_streaming(vram_gb=0.001, device="cpu")
    with pytest.raises(ValueError, match=r"vram_gb must be a positive number of GB \(e.g. 24 or 32\), got 0"):
        pipe.enable_weight_streaming(vram_gb=0, device="cpu")
    with pytest.raises(ValueError, match=r"release_between_stages must be True, False or None, got 'yes'"):
        pipe.enable_weight_streaming(vram_gb=24, device="cpu", release_between_stages="yes")
    with pytest.raises(ValueError, match=r"release_between_stages=True: text_encoder was not loaded from a folder"):
        pipe.enable_weight_streaming(vram_gb=24, device="cpu", release_between_stages=True)
    with pytest.raises(
        ValueError, match=r"host_memory='disk' .* was not loaded with from_pretrained .*save_pretrained"
    ):
        pipe.enable_weight_streaming(vram_gb=24, host_memory="disk", device="cpu")
    if not torch.cuda.is_available():  # the default device is CUDA: a clear error, not torch's assertion
        with pytest.raises(ValueError, match=r"sees no CUDA device; pass device='cpu'"):
            pipe.enable_weight_streaming(vram_gb=24)
    assert [t.data_ptr() for t in pipe.transformer.parameters()] == before
    assert all(getattr(getattr(pipe, n), "_weight_streamer", None) is None for n in ("text_encoder", "transformer"))


def _from_files(pipe, tmp_path):
    """``pipe`` with its streamed models loaded from their saved folders (what the disk mode reads)."""
    for name in ("text_encoder", "transformer", "refiner"):
        getattr(pipe, name).save_pretrained(tmp_path / name)
        pipe.register_modules(**{name: type(getattr(pipe, name)).from_pretrained(tmp_path / name).eval()})
    return pipe


def test_two_stage_call_streamed_from_the_files_equals_resident_bit_for_bit(tmp_path):
    pipe = _from_files(tiny_pipelines(with_refiner=True)[0], tmp_path)
    resident = two_stage_call(pipe)
    pipe.enable_weight_streaming(vram_gb=24, host_memory="disk", device="cpu")
    assert type(pipe.refiner._weight_streamer).__name__ == "DiskWeightStreamer"
    assert not pipe.video_decoder.use_tiling  # off as loaded: streaming does not turn it on
    # loaded from files: each streamed model released between stages, its staging and device rings freed
    stages = pipe._weight_streaming_stages
    assert set(stages.parts) == {"text_encoder", "transformer", "refiner"} and stages.held is None
    for mode in (contextlib.nullcontext, torch.inference_mode):  # each stage refilled inside the call, either way
        with mode():
            out = two_stage_call(pipe)
        for a, b in zip(out, resident):
            assert torch.equal(torch.as_tensor(a), torch.as_tensor(b))
        rings = {n: bool(getattr(pipe, n)._weight_streamer.slots) for n in stages.parts}
        assert stages.held == "refiner" and rings == {"text_encoder": False, "transformer": False, "refiner": True}
    pipe.disable_weight_streaming()


def test_a_budget_below_a_planned_stage_is_refused_for_the_released_geometry(monkeypatch):
    pipe, _ = tiny_pipelines(with_refiner=True)
    pipe.enable_weight_streaming(vram_gb=1, device="cpu")  # the tiny geometry: the planned peaks do not apply
    pipe.disable_weight_streaming()
    before = [t.data_ptr() for t in pipe.transformer.parameters()]
    stages = streaming_budgets()["recipes"]["24"]["stages"]
    # built in memory, nothing is released: each stage's peak plus every other component held on the device
    need = {n: round(stages[n]["peak_GB"] + sum(stages[n]["co_resident_GB"]["held"].values()), 2) for n in stages}
    stage = max(streaming_budgets()["recipes"]["24"]["required_stages"], key=need.get)
    peak = stages[stage]["peak_GB"]
    seen = []
    monkeypatch.setattr(streaming_pipeline, "plan_applies", lambda *configs: seen.append(configs) or True)
    with pytest.raises(
        ValueError,
        match=rf"vram_gb={need[stage] - 0.5} is below the planned peak of stage '{stage}': {peak} GB, plus .* held",
    ):
        pipe.enable_weight_streaming(vram_gb=need[stage] - 0.5, device="cpu")
    assert seen == [(pipe.transformer.config, pipe.refiner.config)]  # the refiner's geometry checked too
    assert [t.data_ptr() for t in pipe.transformer.parameters()] == before


def test_a_refining_call_is_refused_untiled_where_the_plan_tiles_the_decode(monkeypatch, tmp_path):
    pipe = _from_files(tiny_pipelines(with_refiner=True)[0], tmp_path)  # re-readable: the "released" figures
    pipe.enable_weight_streaming(vram_gb=32, device="cpu")  # the tiny geometry: enabled without the planned peaks
    tiled = {n: s["peak_GB"] for n, s in streaming_budgets()["recipes"]["32"]["stages"].items() if s.get("tiled")}
    assert list(tiled) == ["turbovae_decode_1080p"]  # the 32 GB recipe's refined decode, planned tiled
    monkeypatch.setattr(streaming_pipeline, "plan_applies", lambda *configs: True)  # as the released geometry
    encoded = []
    pipe.text_encoder.register_forward_pre_hook(lambda *_: encoded.append(1))
    with pytest.raises(
        ValueError,
        match=r"vram_gb=32: the plan decodes the refined frames in spatial tiles \(stage 'turbovae_decode_1080p', "
        rf"{tiled['turbovae_decode_1080p']} GB; .* call pipe.video_decoder.enable_tiling\(\) first",
    ):
        pipe(**{**TWO_STAGE_CALL, "output_type": "np"})  # a call that decodes the refined frames
    assert encoded == []  # refused before any work
    pipe._check_streamed_decode(refine=False)  # a call that does not refine decodes the 540p preview whole
    pipe.video_decoder.enable_tiling()
    pipe._check_streamed_decode(refine=True)
    pipe.video_decoder.disable_tiling()
    pipe.disable_weight_streaming()
    pipe._check_streamed_decode(refine=True)  # no longer streamed
    pipe.enable_weight_streaming(vram_gb=24, device="cpu")
    pipe._check_streamed_decode(refine=True)  # the 24 GB recipe decodes whole frames
    pipe.disable_weight_streaming()
    row = streaming_budgets()["recipes"]["32"]["stages"]["turbovae_decode_1080p"]
    whole = row["whole_frames_peak_GB"] + sum(row["co_resident_GB"]["released"].values())
    pipe.enable_weight_streaming(vram_gb=whole, device="cpu")  # a card the whole refined frames fit
    pipe._check_streamed_decode(refine=True)
    pipe.disable_weight_streaming()


def test_a_call_is_refused_where_its_own_stages_exceed_the_card_before_any_work(monkeypatch, tmp_path):
    # enable checks the stages every call runs; a call checks its own: the refiner on the 24 GB recipe (which does
    # not run it), a preview above 540p, a refined output above 1080p, more than one video; a refining call that
    # returns latents decodes nothing, so tiling is not asked
    pipe = _from_files(tiny_pipelines(with_refiner=True)[0], tmp_path)
    pipe.enable_weight_streaming(vram_gb=24, device="cpu")  # the tiny geometry: enabled without the planned peaks
    monkeypatch.setattr(streaming_pipeline, "plan_applies", lambda *configs: True)  # as the released geometry
    encoded = []
    pipe.text_encoder.register_forward_pre_hook(lambda *_: encoded.append(1))
    with pytest.raises(ValueError, match="the 24 GB recipe does not run \\['refiner_1080p'\\]"):
        two_stage_call(pipe)
    with pytest.raises(ValueError, match=r"a 576x1024 preview is larger than the plan's 540p stage"):
        pipe(**{**TWO_STAGE_CALL, "height": 576, "width": 1024, "preview_height": None, "preview_width": None})
    pipe.disable_weight_streaming()
    pipe.enable_weight_streaming(vram_gb=32, device="cpu")
    with pytest.raises(ValueError, match=r"a 1152x2048 refined output is larger than the plan's 1080p refiner stage"):
        pipe(**{**TWO_STAGE_CALL, "height": 1152, "width": 2048})
    with pytest.raises(ValueError, match="one video per call; this call generates 2"):
        pipe(**{**TWO_STAGE_CALL, "num_videos_per_prompt": 2})
    with pytest.raises(ValueError, match="one video per call; this call generates 2"):
        pipe(**{**TWO_STAGE_CALL, "prompt": ["a", "b"]})
    duration = pipe.config.duration_s
    pipe.register_to_config(duration_s=12.0)
    with pytest.raises(ValueError, match=r"a 12.0 s clip is longer than the plan's 10.0 s"):
        two_stage_call(pipe)
    pipe.register_to_config(duration_s=duration)
    assert encoded == []  # refused before any work
    assert not pipe.video_decoder.use_tiling
    out = pipe(**{**TWO_STAGE_CALL, "output_type": "latent"}, generator=torch.Generator().manual_seed(0))
    assert encoded and out.frames is not None
    pipe.disable_weight_streaming()
    pipe(**{**TWO_STAGE_CALL, "num_videos_per_prompt": 2})  # resident: the plan's limits are streaming's


def test_a_refused_enable_leaves_no_streaming_state_behind(monkeypatch, tmp_path):
    # a disk mode refused at its last check (a block tensor unlike the files') leaves the pipeline as it was: a later
    # resident call is not checked against the refused budget
    pipe = _from_files(tiny_pipelines(with_refiner=True)[0], tmp_path)
    with torch.no_grad():
        next(streamed_blocks("refiner", pipe.refiner).parameters()).add_(1)
    monkeypatch.setattr(streaming_pipeline, "plan_applies", lambda *configs: True)  # as the released geometry
    monkeypatch.setattr(streaming_pipeline, "check_streaming_vram", lambda *a, **k: {})  # the tiny geometry's peaks
    with pytest.raises(ValueError, match="differs from"):
        pipe.enable_weight_streaming(vram_gb=24, host_memory="disk", device="cpu", release_between_stages=False)
    assert getattr(pipe, "_weight_streaming_budget", None) is None
    two_stage_call(pipe)  # refines: the 24 GB recipe's plan would refuse it


def test_the_released_model_without_a_turbovae_is_refused_at_enable(monkeypatch):
    pipe, _ = tiny_pipelines(with_refiner=True)
    pipe.register_modules(video_decoder=None)
    monkeypatch.setattr(streaming_pipeline, "plan_applies", lambda *configs: True)  # as the released geometry
    with pytest.raises(ValueError, match=r"the streamed recipes decode with the TurboVAE \(video_decoder\)"):
        pipe.enable_weight_streaming(vram_gb=24, device="cpu")
    assert not any(streaming_pipeline._streamer(pipe, n) for n in ("text_encoder", "transformer", "refiner"))


def test_a_host_short_of_the_mode_is_refused_naming_the_disk_mode(monkeypatch, tmp_path):
    pipe = _from_files(tiny_pipelines(with_refiner=True)[0], tmp_path)
    blocks = {n: streamed_blocks(n, getattr(pipe, n)) for n in ("text_encoder", "transformer", "refiner")}

    def need(mode):  # every streamed model held (release_between_stages=False)
        return sum(streaming_host_nbytes(getattr(pipe, n), b, mode, 2, False) for n, b in blocks.items())

    on_host = sum(t.nbytes for b in blocks.values() for t in [*b.parameters(), *b.buffers()])
    pinned, disk = need("pinned"), need("disk")
    before = [t.data_ptr() for b in blocks.values() for t in b.parameters()]
    # the OS's figure plus the block weights already in host memory, one byte short of each mode's need
    monkeypatch.setattr(streaming_pipeline, "available_host_bytes", lambda: pinned - on_host - 1)
    with pytest.raises(ValueError, match=rf"host_memory='pinned' needs .*; host_memory='disk' .* {disk / 1e9:.2f} GB"):
        pipe.enable_weight_streaming(vram_gb=24, device="cpu", release_between_stages=False)
    monkeypatch.setattr(streaming_pipeline, "available_host_bytes", lambda: disk - on_host - 1)
    held = {"release_between_stages": False}
    with pytest.raises(ValueError, match=r"host_memory='disk' needs .* the disk mode is the smallest"):
        pipe.enable_weight_streaming(vram_gb=24, host_memory="disk", device="cpu", **held)
    assert [t.data_ptr() for b in blocks.values() for t in b.parameters()] == before
    monkeypatch.setattr(streaming_pipeline, "available_host_bytes", lambda: disk - on_host)
    pipe.enable_weight_streaming(vram_gb=24, host_memory="disk", device="cpu", **held)


def test_disk_mode_refuses_files_changed_since_loading_and_weights_unlike_them_before_anything_streams(tmp_path):
    from diffusers_magi2 import Magi2Pipeline

    tiny_pipelines()[0].save_pretrained(tmp_path / "saved")
    # the text encoder's files are recorded as loaded (transformers records none): a later change is refused
    pipe = Magi2Pipeline.from_pretrained(tmp_path / "saved")
    (path, _, _), *_ = pipe.text_encoder._loaded_checkpoint_files
    os.utime(path, ns=(0, 0))  # (as a later save_pretrained there would)
    with pytest.raises(ValueError, match=rf"{path} changed since the model was loaded from it"):
        pipe.enable_weight_streaming(vram_gb=24, host_memory="disk", device="cpu")
    # a transformer block weight edited in memory: refused naming it, before the text encoder (streamed first) streams
    pipe = Magi2Pipeline.from_pretrained(tmp_path / "saved")
    blocks = pipe.transformer.transformer_blocks
    name, weight = next((n, p) for n, p in blocks[-1].named_parameters() if p.dim() == 2 and p.numel())
    name = f"transformer_blocks.{len(blocks) - 1}.{name}"
    with torch.no_grad():
        weight[0, 0] += 1
    with pytest.raises(ValueError, match=rf"Magi2Transformer3DModel's {name} differs from"):
        pipe.enable_weight_streaming(vram_gb=24, host_memory="disk", device="cpu", release_between_stages=False)
    assert all(getattr(getattr(pipe, n), "_weight_streamer", None) is None for n in ("text_encoder", "transformer"))


def _held_tensors(module, with_computed=True):
    # with the weights torch.nn.utils.weight_norm computes into plain attributes (the audio VAE's), which a
    # forward on the device recomputes there and .to() never moves back
    computed = [
        m.__dict__[h.name]
        for m in module.modules()
        for h in m._forward_pre_hooks.values()
        if hasattr(h, "compute_weight")
    ]
    return [t.data_ptr() for t in [*module.parameters(), *module.buffers(), *(computed if with_computed else [])]]


def test_autoencoders_are_on_the_device_only_for_their_own_stage():
    # on the CPU ring the device is host memory, so each autoencoder's .to() is made to copy its tensors, as a move
    # onto CUDA does; where each one sits is read from its tensors at every stage's entry point: a copy in its own
    # stage, and the very tensors it was loaded with everywhere else (moved back without a copy, so a view of its
    # files stays one rather than becoming anonymous memory)
    pipe, _ = tiny_pipelines(with_refiner=True)
    pipe.enable_weight_streaming(vram_gb=24, device="cpu")
    autoencoders = [n for n in ("vae", "video_decoder", "audio_vae") if getattr(pipe, n, None) is not None]
    assert set(autoencoders) == {"vae", "video_decoder", "audio_vae"}
    assert len(_held_tensors(pipe.audio_vae)) > len([*pipe.audio_vae.parameters(), *pipe.audio_vae.buffers()])
    dtypes = {n: {t.dtype for t in getattr(pipe, n).parameters()} for n in autoencoders}
    as_loaded = {n: _held_tensors(getattr(pipe, n)) for n in autoencoders}
    ran = []

    def check(name):
        ran.append(name)
        for other in autoencoders:
            held = _held_tensors(getattr(pipe, other), with_computed=other != name)
            if other == name:  # on the device: copies (the computed weights follow in the forward)
                assert not set(held) & set(as_loaded[other]), name
            else:
                assert held == as_loaded[other], (name, other)

    def on_run(name, fn):
        def wrapped(*args, **kwargs):
            check(name)
            return fn(*args, **kwargs)

        return wrapped

    for name in autoencoders:
        module = getattr(pipe, name)
        module.to = lambda *_, module=module, **__: module._apply(lambda t: t.clone())
        for entry in ("encode", "decode"):
            if hasattr(module, entry):
                setattr(module, entry, on_run(name, getattr(module, entry)))
    for name in ("text_encoder", "transformer", "refiner"):
        getattr(pipe, name).register_forward_pre_hook(lambda *_, name=name: check(name))
    call = {**TWO_STAGE_CALL, "output_type": "np", "image": PIL.Image.new("RGB", (48, 32), (90, 120, 30))}
    pipe(**call, generator=torch.Generator().manual_seed(0))
    assert set(ran) == {"vae", "video_decoder", "audio_vae", "text_encoder", "transformer", "refiner"}
    assert {n: {t.dtype for t in getattr(pipe, n).parameters()} for n in autoencoders} == dtypes  # fp32 stays fp32
    assert {n: _held_tensors(getattr(pipe, n)) for n in autoencoders} == as_loaded
    pipe.disable_weight_streaming()


def test_an_autoencoder_move_that_fails_part_way_is_pointed_back():
    # a device out of memory half way through the VAE's .to(): the tensors already moved come back to the host ones
    pipe, _ = tiny_pipelines()
    pipe.enable_weight_streaming(vram_gb=24, device="cpu")
    vae = pipe.vae
    as_loaded = _held_tensors(vae)
    moved = [0]

    def half_then_oom(t):
        moved[0] += 1
        if moved[0] > len(as_loaded) // 2:
            raise RuntimeError("CUDA out of memory (simulated)")
        return t.clone()

    vae.to = lambda *_, **__: vae._apply(half_then_oom)
    with pytest.raises(RuntimeError, match="simulated"), pipe._autoencoder_stage("vae"):
        pass
    assert moved[0] > 1 and _held_tensors(vae) == as_loaded
    pipe.disable_weight_streaming()


def test_an_expert_parallel_transformer_is_held_naming_its_sharding(monkeypatch, tmp_path):
    # a rank's transformer holds only its experts' rows, the files every expert: it cannot be released and re-read
    pipe = _from_files(tiny_pipelines(with_refiner=True)[0], tmp_path)
    moe = next(m for m in pipe.transformer.modules() if hasattr(m, "ep_size"))
    monkeypatch.setattr(moe, "ep_size", 2)  # as apply_expert_parallel leaves a rank's layer
    with pytest.raises(ValueError, match="transformer's routed experts are sharded over 2 expert-parallel ranks"):
        pipe.enable_weight_streaming(vram_gb=24, device="cpu", release_between_stages=True)
    pipe.enable_weight_streaming(vram_gb=24, device="cpu")  # automatic: the transformer held, the others released
    assert set(pipe._weight_streaming_stages.parts) == {"text_encoder", "refiner"}
    pipe.disable_weight_streaming()


def test_a_parallel_pipeline_is_not_held_to_the_single_card_plan(monkeypatch, tmp_path):
    # the plan's figures are a single card's running the whole call: a context- or expert-parallel rank's call is
    # checked only against the weights it holds (an 8 x 24 GB box runs the CP8 refiner at 1080p)
    pipe = _from_files(tiny_pipelines(with_refiner=True)[0], tmp_path)
    monkeypatch.setattr(streaming_pipeline, "plan_applies", lambda *configs: True)  # as the released geometry
    with pytest.raises(ValueError, match="the 24 GB recipe does not run"):  # one card: the refiner is not in it
        pipe.enable_weight_streaming(vram_gb=24, device="cpu")
        two_stage_call(pipe)
    pipe.disable_weight_streaming()
    monkeypatch.setattr(type(pipe.transformer), "context_parallel_degree", property(lambda self: 2))
    pipe.enable_weight_streaming(vram_gb=24, device="cpu")
    pipe._check_streamed_stages(True, 512, 896, False, True, 1088, 1920, 1)  # the 1080p preset on a rank
    pipe.disable_weight_streaming()
