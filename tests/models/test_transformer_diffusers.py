"""Magi2Transformer3DModel as a diffusers model: save/load (fp32 islands kept), device moves, compile,
caching-hook registration, attention backends, gradient checkpointing, MoE backend plumbing,
offline from_pretrained, bad input."""

from __future__ import annotations

import functools
import weakref

import pytest
import torch
from helpers.tiny_transformer import TINY, tiny_inputs, tiny_model
from safetensors import safe_open
from safetensors.torch import load_file

from diffusers_magi2.models.attention_magi2 import Magi2Attention
from diffusers_magi2.models.transformer_magi2 import (
    Magi2MoEFeedForward,
    Magi2Transformer3DModel,
    Magi2TransformerBlock,
)


@functools.lru_cache(maxsize=None)
def _h4(fixtures_root: str, dtype: torch.dtype):
    return Magi2Transformer3DModel.from_original_checkpoint(
        f"{fixtures_root}/magi2_tiny/preview_h4/sandai_checkpoint", dtype=dtype
    )


def _h4_args(fixtures_dir, prec="bf16"):
    d = load_file(f"{fixtures_dir}/magi2_tiny/preview_h4/{prec}/transformer_case.safetensors")
    return (
        d["model.x"],
        d["model.coords_mapping"],
        d["model.modality_mapping"],
        d["model.cu_seqlens_q"],
        d["model.time_token_sequence"],
    )


# Families SandAI's model keeps in fp32.
def _expected_fp32(name: str) -> bool:
    parts = name.split(".")
    return (
        parts[0] in ("pre_adapter", "post_adapter")
        or any(p.endswith("norm") for p in parts)
        or parts[-1] == "sinks"
        or any(p.startswith("mhc_") for p in parts)
        or (parts[-1] == "gate" and parts[-2] == "moe_mlp")
        or "router" in parts
    )


def test_default_config_is_released_preview():
    from diffusers_magi2.loaders.sandai_config import (
        load_sandai_config,
        preview_config_from_sandai,
        released_config_path,
    )

    with torch.device("meta"):
        model = Magi2Transformer3DModel()
    released = preview_config_from_sandai(load_sandai_config(released_config_path("magi2_preview.json")))
    for key, value in released.items():
        got = model.config[key]
        assert (list(got) if isinstance(got, (list, tuple)) else got) == value, key
    # the refiner JSON extends the preview one: extends resolution keeps the preview arch
    refiner = load_sandai_config(released_config_path("magi2_refiner.json"))
    assert "extends" not in refiner and refiner["arch_config"]["num_layers"] == 40
    assert refiner["magi2_refiner_arch_config"]["num_layers"] == 30


def test_save_pretrained_sharded_bf16_round_trip_keeps_fp32_islands(fixtures_dir, tmp_path, monkeypatch):
    """fp32 islands survive from_pretrained(dtype=bf16) and save_pretrained; outputs identical."""
    model = _h4(str(fixtures_dir), torch.bfloat16)
    args = _h4_args(fixtures_dir)
    with torch.no_grad():
        ref = model.forward_packed(*args)
    model.save_pretrained(tmp_path / "a", max_shard_size="1MB")
    shards = sorted((tmp_path / "a").glob("diffusion_pytorch_model-*.safetensors"))
    assert len(shards) >= 2
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    loaded = Magi2Transformer3DModel.from_pretrained(tmp_path / "a", dtype=torch.bfloat16)
    n_fp32 = 0
    for name, t in list(loaded.named_parameters()) + list(loaded.named_buffers()):
        want = torch.float32 if _expected_fp32(name) else torch.bfloat16
        assert t.dtype == want, (name, t.dtype)
        n_fp32 += want == torch.float32
    assert n_fp32 > 50
    with torch.no_grad():
        out = loaded.forward_packed(*args)
    assert torch.equal(out, ref)
    loaded.save_pretrained(tmp_path / "b", max_shard_size="1MB")
    seen = 0
    for shard in (tmp_path / "b").glob("*.safetensors"):
        with safe_open(str(shard), "pt") as fh:
            for key in fh.keys():
                code = fh.get_slice(key).get_dtype()
                assert code == ("F32" if _expected_fp32(key) else "BF16"), (key, code)
                seen += 1
    assert seen == len(loaded.state_dict())


def test_from_pretrained_defaults_local_files_only_from_hf_hub_offline(monkeypatch, tmp_path):
    from diffusers.models.modeling_utils import ModelMixin

    captured = {}

    def fake(cls, path, output_loading_info=False, **kwargs):  # ModelMixin's contract, loading nothing
        captured.update(kwargs)
        return ("called", {"unexpected_keys": []}) if output_loading_info else "called"

    monkeypatch.setattr(ModelMixin, "from_pretrained", classmethod(fake))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert Magi2Transformer3DModel.from_pretrained(tmp_path) == "called"
    assert captured["local_files_only"] is True
    captured.clear()
    Magi2Transformer3DModel.from_pretrained(tmp_path, local_files_only=False)
    assert captured["local_files_only"] is False


def test_no_unregistered_tensor_attributes_and_float64_move():
    """Nothing tensor-valued hides outside parameters/buffers; a dtype move reaches everything
    but the fp32 islands, which stay fp32.

    The float64 run uses a dense-only TINY (the MoE core accepts fp32/bf16/fp16 only; its own
    device handling is tested with the MoE core)."""
    for name, module in tiny_model().named_modules():
        for attr, value in vars(module).items():
            if attr in ("_parameters", "_buffers"):
                continue
            assert not isinstance(value, torch.Tensor), f"{name}.{attr} is an unregistered tensor"
    model = tiny_model(moe_layers=[])
    for name, module in model.named_modules():
        for attr, value in vars(module).items():
            if attr in ("_parameters", "_buffers"):
                continue
            assert not isinstance(value, torch.Tensor), f"{name}.{attr} is an unregistered tensor"
    inputs = tiny_inputs()
    with torch.no_grad():
        ref = model(**inputs)
        model64 = model.to(torch.float64)
        dtypes = {n: t.dtype for n, t in model64.state_dict().items() if t.is_floating_point()}
        assert dtypes == {n: torch.float32 if model.is_fp32_island(n) else torch.float64 for n in dtypes}
        assert set(dtypes.values()) == {torch.float32, torch.float64}
        out = model64(**{k: (v.double() if v.is_floating_point() else v) for k, v in inputs.items()})
    assert out.sample.dtype == torch.float32  # the output buffer is fp32 by design (reference)
    torch.testing.assert_close(out.sample, ref.sample, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.audio_sample, ref.audio_sample, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_move_keeps_outputs(fixtures_dir):
    """On GPU: every tensor moves; fp32 outputs agree with the CPU ones."""
    model = Magi2Transformer3DModel.from_original_checkpoint(
        f"{fixtures_dir}/magi2_tiny/preview_h4/sandai_checkpoint", dtype=torch.float32
    )
    args = _h4_args(fixtures_dir, "fp32")
    with torch.no_grad():
        ref = model.forward_packed(*args)
        model.to("cuda")
        assert all(t.is_cuda for t in model.state_dict().values())
        out = model.forward_packed(*[a.cuda() for a in args]).cpu()
        model.to("cpu")
        back = model.forward_packed(*args)
    torch.testing.assert_close(out, ref, atol=2e-3, rtol=2e-3)
    assert torch.equal(back, ref)


def test_compile_repeated_blocks_really_compiles():
    """_repeated_blocks names a real class, compiled blocks are hit without a graph break (nothing in a block reads
    back to the host), outputs equal eager."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    model = tiny_model()
    assert model._repeated_blocks == ["Magi2TransformerBlock"]
    assert any(type(m).__name__ == "Magi2TransformerBlock" for m in model.modules())
    inputs = tiny_inputs()
    with torch.no_grad():
        ref = model(**inputs)
    torch._dynamo.reset()
    counters.clear()
    model.compile_repeated_blocks(backend="eager")
    assert all(getattr(b, "_compiled_call_impl", None) is not None for b in model.transformer_blocks)
    with torch.no_grad():
        out = model(**inputs)
    assert counters["stats"]["unique_graphs"] >= 1
    assert dict(counters["graph_break"]) == {}
    torch.testing.assert_close(out.sample, ref.sample, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.audio_sample, ref.audio_sample, atol=1e-5, rtol=1e-5)
    torch._dynamo.reset()


def test_block_registered_for_caching_hooks():
    from diffusers.hooks._helpers import TransformerBlockRegistry

    meta = TransformerBlockRegistry.get(Magi2TransformerBlock)
    assert meta.return_hidden_states_index == 0
    assert "hidden_states" in Magi2TransformerBlock.forward.__code__.co_varnames
    model = tiny_model()
    assert all(isinstance(b, Magi2TransformerBlock) for b in model.transformer_blocks)


def test_attention_backend_switch_and_sink_exactness():
    model = tiny_model()
    inputs = tiny_inputs()
    with torch.no_grad():
        ref = model(**inputs)
        model.set_attention_backend("_native_math")
        attns = [m for m in model.modules() if isinstance(m, Magi2Attention)]
        assert attns and all(str(a.processor._attention_backend.value) == "_native_math" for a in attns)
        out = model(**inputs)
    torch.testing.assert_close(out.sample, ref.sample, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError):
        model.set_attention_backend("no-such-backend")
    model.reset_attention_backend() if hasattr(model, "reset_attention_backend") else None


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
def test_sink_attention_equals_softmax_with_extra_logit(dtype, tol):
    """The extra-key sink equals softmax over keys ∪ {sink_h} with a zero value (per segment, GQA)."""
    from diffusers_magi2.models.attention_magi2 import magi2_attention_with_sinks

    g = torch.Generator().manual_seed(3)
    n, hq, hkv, d = 9, 4, 2, 16
    q, k, v = (torch.randn(n, h, d, generator=g) for h in (hq, hkv, hkv))
    sinks = torch.randn(1, hq, generator=g) * 2
    segments = [5, 4]
    scale = d**-0.5
    out = magi2_attention_with_sinks(q.to(dtype), k.to(dtype), v.to(dtype), sinks, segments, scale)
    ref = []
    start = 0
    for length in segments:
        qs, ks, vs = (t[start : start + length].double() for t in (q, k, v))
        ks, vs = ks.repeat_interleave(hq // hkv, 1), vs.repeat_interleave(hq // hkv, 1)
        logits = torch.einsum("qhd,khd->hqk", qs, ks) * scale
        sink_col = sinks.double()[0][:, None, None].expand(hq, length, 1)
        p = torch.softmax(torch.cat([logits, sink_col], dim=-1), dim=-1)[..., :length]
        ref.append(torch.einsum("hqk,khd->qhd", p, vs))
        start += length
    ref = torch.cat(ref)
    assert out.dtype == dtype
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert err <= tol, err
    # sinks matter: without them the result differs
    plain = magi2_attention_with_sinks(q.double(), k.double(), v.double(), None, segments, scale)
    assert (plain - ref).abs().max() > 1e-2


def test_gradient_checkpointing_same_gradients():
    model = tiny_model().train()  # one dense multimodal layer + one MoE layer
    inputs = tiny_inputs()

    def grads():
        model.zero_grad()
        out = model(**inputs)
        (out.sample.square().mean() + out.audio_sample.square().mean()).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain = grads()
    model.enable_gradient_checkpointing()
    assert model.gradient_checkpointing
    calls = []
    original = model._gradient_checkpointing_func
    model._gradient_checkpointing_func = lambda *a, **k: (calls.append(1), original(*a, **k))[1]
    ckpt = grads()
    assert len(calls) == TINY["num_layers"]
    assert plain.keys() == ckpt.keys() and len(plain) > 20
    assert any(n.endswith("moe_mlp.W_gate") for n in plain) and any(n.endswith("mhc_attn.phi_fused") for n in plain)
    for name in plain:
        torch.testing.assert_close(ckpt[name], plain[name], atol=1e-6, rtol=1e-5, msg=name)


def test_gradient_checkpointing_with_block_inputs_on_host_frees_them_and_gives_the_same_gradients():
    model = tiny_model().train()
    inputs = tiny_inputs()

    def step(**checkpointing):
        model.zero_grad()
        model.enable_gradient_checkpointing(**checkpointing)
        kept = []
        hooks = [
            b.register_forward_pre_hook(lambda m, a: kept.append(weakref.ref(a[0]))) for b in model.transformer_blocks
        ]
        out = model(**inputs)
        for hook in hooks:
            hook.remove()
        alive = sum(r() is not None for r in kept)  # the block inputs still held after the forward
        (out.sample.square().mean() + out.audio_sample.square().mean()).backward()
        return alive, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    kept_alive, plain = step()
    on_host_alive, on_host = step(offload_block_inputs=True)
    assert kept_alive == TINY["num_layers"] and on_host_alive == 0  # saved as host copies instead
    assert plain.keys() == on_host.keys()
    for name in plain:
        torch.testing.assert_close(on_host[name], plain[name], atol=0, rtol=0, msg=name)
    with pytest.raises(ValueError, match="not both"):
        model.enable_gradient_checkpointing(lambda *a: None, offload_block_inputs=True)


def test_set_moe_backend_reaches_every_moe_layer():
    model = tiny_model()
    moes = [b.mlp.moe_mlp for b in model.transformer_blocks if isinstance(b.mlp, Magi2MoEFeedForward)]
    assert len(moes) == len(TINY["moe_layers"])
    model.set_moe_backend("torch")
    assert all(m.backend == "torch" for m in moes)
    with pytest.raises(ValueError):
        model.set_mhc_backend("bogus")


def test_dtype_policy_fp32_islands_at_construction():
    model = Magi2Transformer3DModel(**TINY, params_dtype=torch.bfloat16)
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        want = torch.float32 if _expected_fp32(name) else torch.bfloat16
        assert t.dtype == want, name
        assert model.is_fp32_island(name) == _expected_fp32(name), name
    model32 = Magi2Transformer3DModel(**TINY)
    model32.to(torch.bfloat16)
    assert {n: t.dtype for n, t in model32.state_dict().items()} == {n: t.dtype for n, t in model.state_dict().items()}


@pytest.mark.parametrize(
    "change,match",
    [
        (lambda kw: kw.update(hidden_states=kw["hidden_states"][:, :5]), "hidden_states"),
        (lambda kw: kw.update(hidden_states=kw["hidden_states"][:, :, :, :, 0]), "hidden_states"),
        (lambda kw: kw.update(encoder_hidden_states=kw["encoder_hidden_states"][:1]), "encoder_hidden_states"),
        (lambda kw: kw.update(encoder_hidden_states=kw["encoder_hidden_states"][..., :7]), "encoder_hidden_states"),
        (lambda kw: kw.update(audio_hidden_states=kw["audio_hidden_states"][..., :3]), "audio_hidden_states"),
        (lambda kw: kw.update(audio_hidden_states=kw["audio_hidden_states"][:1]), "audio_hidden_states"),
        (lambda kw: kw.update(timestep=torch.ones(3)), "timestep"),
        (lambda kw: kw.update(encoder_attention_mask=torch.ones(2, 4, dtype=torch.bool)), "encoder_attention_mask"),
        (
            lambda kw: kw.update(encoder_attention_mask=torch.tensor([[1, 0, 1], [1, 1, 1]], dtype=torch.bool)),
            "prefix",
        ),
        (lambda kw: kw.update(image_latents=torch.zeros(2, 8, 1, 2, 2)), "together"),
        (
            lambda kw: kw.update(image_latents=torch.zeros(2, 8, 2, 2, 2), image_embeds=torch.zeros(2, 20)),
            "image_latents",
        ),
        (
            lambda kw: kw.update(image_latents=torch.zeros(2, 8, 1, 2, 2), image_embeds=torch.zeros(2, 19)),
            "image_embeds",
        ),
    ],
)
def test_bad_input_raises_value_error(change, match):
    model = tiny_model()
    kwargs = tiny_inputs()
    change(kwargs)
    with pytest.raises(ValueError, match=match):
        model(**kwargs)


def test_bad_packed_input_raises_value_error():
    model = tiny_model()
    packed = model.pack_inputs(**tiny_inputs())
    args = [packed.hidden_states, packed.coords, packed.modality_mapping, packed.cu_seqlens, packed.time_embedding]
    n = packed.hidden_states.shape[0]
    for i, bad, match in [
        (1, packed.coords[:, :8], "coords"),
        (2, packed.modality_mapping[:-1], "modality_mapping"),
        (3, torch.tensor([0, n - 1], dtype=torch.int32), "cu_seqlens"),
        (4, packed.time_embedding[:, :10], "time_embedding"),
        (0, packed.hidden_states[:, :10], "channels"),
    ]:
        call = list(args)
        call[i] = bad
        with pytest.raises(ValueError, match=match):
            model.forward_packed(*call)


def test_attention_kwargs_are_never_silently_dropped():
    """The transformer takes only the LoRA ``scale``: any other key raises ``ValueError`` (forward and
    forward_packed) instead of being ignored; ``None``, ``{}`` and a scale without LoRA give the same output."""
    model = tiny_model()
    kwargs = tiny_inputs()
    assert model.supported_attention_kwargs == ("scale",)
    for bad in ({"lora_rank": 1}, {"window_backend": "sdpa"}):
        with pytest.raises(ValueError, match=r"does not support attention_kwargs .*allowed keys: \['scale'\]"):
            model(**kwargs, attention_kwargs=bad)
    with pytest.raises(ValueError, match="attention_kwargs must be a dict"):
        model(**kwargs, attention_kwargs=[("scale", 1.0)])
    packed = model.pack_inputs(**kwargs)
    with pytest.raises(ValueError, match="does not support attention_kwargs"):
        model.forward_packed(
            packed.hidden_states,
            packed.coords,
            packed.modality_mapping,
            packed.cu_seqlens,
            packed.time_embedding,
            attention_kwargs={"lora_rank": 1},
        )
    with torch.no_grad():
        plain = model(**kwargs).sample
        empty = model(**kwargs, attention_kwargs={}).sample
        scaled = model(**kwargs, attention_kwargs={"scale": 0.5}).sample
    assert torch.equal(plain, empty) and torch.equal(plain, scaled)


def test_i2v_and_batch_rows_are_independent_segments():
    """Each batch row is its own attention segment: row 0's output does not depend on row 1."""
    model = tiny_model()
    kw = tiny_inputs()
    kw["image_latents"] = torch.randn(2, 8, 1, 2, 3)
    kw["image_embeds"] = torch.randn(2, 20)
    with torch.no_grad():
        full = model(**kw)
        kw2 = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
        kw2["hidden_states"][1] += 1.0
        kw2["image_latents"][1] -= 1.0
        other = model(**kw2)
    assert torch.equal(full.sample[0], other.sample[0])
    assert not torch.allclose(full.sample[1], other.sample[1])
    # padding dropped, not attended: extra zero padding on the text does not change anything
    with torch.no_grad():
        kw3 = dict(kw)
        kw3["encoder_hidden_states"] = torch.cat([kw["encoder_hidden_states"], torch.randn(2, 2, 20)], dim=1)
        kw3["encoder_attention_mask"] = torch.cat(
            [kw["encoder_attention_mask"], torch.zeros(2, 2, dtype=torch.bool)], 1
        )
        padded = model(**kw3)
    torch.testing.assert_close(padded.sample, full.sample, atol=1e-6, rtol=1e-6)


def test_first_block_cache_skips_the_tail_blocks():
    """diffusers' FirstBlockCache finds the registered blocks and really skips the tail on a hit."""
    from diffusers import FirstBlockCacheConfig

    model = tiny_model(num_layers=3, multimodal_layers=[0], moe_layers=[1])
    inputs = tiny_inputs()
    with torch.no_grad():
        ref = model(**inputs)
    calls = []
    for i, block in enumerate(model.transformer_blocks):
        # the cache hooks replace block.forward, so count the work inside the block
        block.attention.register_forward_pre_hook(lambda mod, args, i=i: calls.append(i))
    model.enable_cache(FirstBlockCacheConfig(threshold=0.5))
    nudged = dict(inputs, hidden_states=inputs["hidden_states"] * 1.001)
    with torch.no_grad(), model.cache_context("cond"):
        first = model(**inputs)
        n_first = len(calls)
        second = model(**nudged)
    model.disable_cache()
    with torch.no_grad():  # (calls 0, 1, 2 of this eager run follow the cached run's single 0)
        eager_second = model(**nudged)
    assert torch.equal(first.sample, ref.sample)
    assert n_first == 3 and calls[n_first:] == [0, 0, 1, 2]  # cache hit: only the first block ran on the cache hit
    assert not torch.equal(second.sample, eager_second.sample)
    torch.testing.assert_close(second.sample, eager_second.sample, atol=5e-2, rtol=5e-2)
