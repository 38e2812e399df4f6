"""Magi2RefinerTransformer3DModel vs SandAI's golden refiner fixture (SandAI ``magi2_refiner.Transformer``)."""

from __future__ import annotations

import pytest
import torch
from diffusers.hooks import HookRegistry, ModelHook
from safetensors.torch import load_file

from diffusers_magi2.models.attention_magi2 import Magi2WindowAttnProcessor
from diffusers_magi2.models.transformer_magi2_refiner import (
    Magi2RefinerTransformer3DModel,
    refiner_mlp_intermediate_size,
)


CASES = ["", "noaudio."]


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.fixture(scope="module")
def refiner_root(fixtures_dir):
    return fixtures_dir / "magi2_tiny/refiner"


@pytest.fixture(scope="module")
def model_fp32(refiner_root):
    return Magi2RefinerTransformer3DModel.from_original_checkpoint(
        refiner_root / "sandai_checkpoint", torch_dtype=torch.float32
    )


@pytest.fixture(scope="module")
def model_bf16(refiner_root):
    return Magi2RefinerTransformer3DModel.from_original_checkpoint(refiner_root / "sandai_checkpoint")


@pytest.fixture(scope="module")
def fp32_case(refiner_root):
    return load_file(str(refiner_root / "fp32/transformer_case.safetensors"))


@pytest.fixture(scope="module")
def bf16_case(refiner_root):
    return load_file(str(refiner_root / "bf16/transformer_case.safetensors"))


def _diffusers_call(model, d, prefix, **kw):
    audio = d[prefix + "pipeline.audio_latent"]
    with torch.no_grad():
        return model(
            hidden_states=d[prefix + "pipeline.latent"],
            encoder_hidden_states=d[prefix + "pipeline.txt_feat"],
            audio_hidden_states=audio if audio.shape[1] else None,
            **kw,
        )


def test_checkpoint_dtypes_and_config(model_fp32, model_bf16):
    cfg = model_fp32.config
    assert (cfg.num_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.attention_head_dim) == (4, 6, 2, 16)
    assert list(cfg.window_block_size) == [2, 2, 2] and list(cfg.window_radius) == [1, 1, 1]
    assert model_fp32.compute_dtype == torch.float32
    assert model_bf16.compute_dtype == torch.bfloat16
    blk = model_bf16.transformer_blocks[0]
    assert blk.attention.linear_qkv.weight.dtype == torch.bfloat16
    assert blk.attention.q_norm.weight.dtype == torch.float32
    assert model_bf16.pre_adapter.video_embedder.weight.dtype == torch.float32
    assert refiner_mlp_intermediate_size(96) == 256 and refiner_mlp_intermediate_size(4096) == 10920


@pytest.mark.parametrize("prefix", CASES)
def test_fp32_packed_entry_with_reference_ranges(model_fp32, fp32_case, prefix):
    d = fp32_case
    with torch.no_grad():
        out = model_fp32.forward_packed(
            d[prefix + "model.x"],
            d[prefix + "model.coords_mapping"],
            d[prefix + "model.modality_mapping"],
            q_ranges=d[prefix + "model.local_attn.q_ranges"],
            k_ranges=d[prefix + "model.local_attn.k_ranges"],
        )
    ref = d[prefix + "model.out"]
    assert (out - ref).abs().max().item() <= 1e-4
    assert _rel(out, ref) <= 1e-5


@pytest.mark.parametrize("prefix", CASES)
@pytest.mark.parametrize("backend", ["sdpa", "gather", "flex"])
def test_fp32_packed_entry_with_config_geometry(model_fp32, fp32_case, prefix, backend):
    d = fp32_case
    ids = d[prefix + "model.modality_mapping"]
    geom = model_fp32.window_geometry(5, 4, 8, int((ids > 0).sum()))
    try:
        model_fp32.set_attn_processor(Magi2WindowAttnProcessor(backend=backend))
        with torch.no_grad():
            out = model_fp32.forward_packed(
                d[prefix + "model.x"], d[prefix + "model.coords_mapping"], ids, window_geometry=geom
            )
    finally:
        model_fp32.set_attn_processor(Magi2WindowAttnProcessor())
    ref = d[prefix + "model.out"]
    assert (out - ref).abs().max().item() <= 1e-4
    assert _rel(out, ref) <= 1e-5


def test_window_mask_matters(model_fp32, fp32_case):
    """Dense attention (no window) must NOT reproduce the fixture: the mask is load-bearing."""
    d = fp32_case
    with torch.no_grad():
        out = model_fp32.forward_packed(d["model.x"], d["model.coords_mapping"], d["model.modality_mapping"])
    assert (out - d["model.out"]).abs().max().item() > 1e-2


@pytest.mark.parametrize("prefix", CASES)
def test_fp32_diffusers_forward(model_fp32, fp32_case, prefix):
    d = fp32_case
    out = _diffusers_call(model_fp32, d, prefix)
    vref = d[prefix + "pipeline.video_out"]
    assert out.sample.shape == vref.shape and out.sample.dtype == torch.float32
    assert (out.sample - vref).abs().max().item() <= 1e-4
    assert _rel(out.sample, vref) <= 1e-5
    if prefix == "":
        aref = d["pipeline.audio_out"]
        assert (out.audio_sample - aref).abs().max().item() <= 1e-4
        assert _rel(out.audio_sample, aref) <= 1e-5
    else:
        assert out.audio_sample is None
        # zero-length audio tensor is the same as no audio
        with torch.no_grad():
            out0 = model_fp32(
                hidden_states=d[prefix + "pipeline.latent"],
                encoder_hidden_states=d[prefix + "pipeline.txt_feat"],
                audio_hidden_states=d[prefix + "pipeline.audio_latent"],
            )
        assert out0.audio_sample.shape == (1, 0, 16)
        assert torch.equal(out0.sample, out.sample)


@pytest.mark.parametrize("prefix", CASES)
def test_bf16_against_bf16_fixture(model_bf16, bf16_case, prefix):
    d = bf16_case
    with torch.no_grad():
        out = model_bf16.forward_packed(
            d[prefix + "model.x"],
            d[prefix + "model.coords_mapping"],
            d[prefix + "model.modality_mapping"],
            q_ranges=d[prefix + "model.local_attn.q_ranges"],
            k_ranges=d[prefix + "model.local_attn.k_ranges"],
        )
    assert _rel(out, d[prefix + "model.out"]) <= 2e-2
    res = _diffusers_call(model_bf16, d, prefix)
    assert _rel(res.sample, d[prefix + "pipeline.video_out"]) <= 2e-2


def test_bf16_residual_becomes_fp32_after_layer0(model_bf16, bf16_case):
    d = bf16_case
    seen = {}
    hooks = [
        blk.register_forward_hook(lambda m, a, o, i=i: seen.__setitem__(i, (a[0].dtype, o.dtype)))
        for i, blk in enumerate(model_bf16.transformer_blocks)
    ]
    try:
        _diffusers_call(model_bf16, d, "noaudio.")
    finally:
        for h in hooks:
            h.remove()
    assert seen[0] == (torch.bfloat16, torch.float32)
    assert all(seen[i] == (torch.float32, torch.float32) for i in range(1, 4))


def test_text_padding_mask_and_batching(model_fp32, fp32_case):
    d = fp32_case
    lat, txt, aud = d["pipeline.latent"], d["pipeline.txt_feat"], d["pipeline.audio_latent"]
    ref = _diffusers_call(model_fp32, d, "")
    torch.manual_seed(1)
    lat2 = torch.randn_like(lat)
    txt2 = torch.randn(1, 4, txt.shape[2])
    single2 = model_fp32(hidden_states=lat2, encoder_hidden_states=txt2, audio_hidden_states=aud)
    # batch of 2 with right-padded text (garbage in the padding) and a mask
    pad = torch.cat([txt2, 100 * torch.randn(1, 2, txt.shape[2])], dim=1)
    mask = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
    with torch.no_grad():
        out = model_fp32(
            hidden_states=torch.cat([lat, lat2]),
            encoder_hidden_states=torch.cat([txt, pad]),
            audio_hidden_states=torch.cat([aud, aud]),
            encoder_attention_mask=mask,
        )
    assert torch.allclose(out.sample[:1], ref.sample, atol=1e-6)
    assert torch.allclose(out.sample[1:], single2.sample, atol=1e-6)
    assert torch.allclose(out.audio_sample[1:], single2.audio_sample, atol=1e-6)
    tup = model_fp32(hidden_states=lat, encoder_hidden_states=txt, return_dict=False)
    assert isinstance(tup, tuple) and tup[1] is None


def test_bad_inputs_raise(model_fp32, fp32_case):
    d = fp32_case
    lat, txt = d["pipeline.latent"], d["pipeline.txt_feat"]
    with pytest.raises(ValueError, match="hidden_states"):
        model_fp32(hidden_states=lat[:, :5], encoder_hidden_states=txt)
    with pytest.raises(ValueError, match="encoder_hidden_states"):
        model_fp32(hidden_states=lat, encoder_hidden_states=txt[..., :10])
    with pytest.raises(ValueError, match="audio_hidden_states"):
        model_fp32(hidden_states=lat, encoder_hidden_states=txt, audio_hidden_states=torch.zeros(2, 3, 16))
    with pytest.raises(ValueError, match="encoder_attention_mask"):
        model_fp32(
            hidden_states=lat, encoder_hidden_states=txt, encoder_attention_mask=torch.ones(1, 3, dtype=torch.bool)
        )
    with pytest.raises(
        ValueError, match=r"does not support attention_kwargs \['lora_rank'\]; allowed keys: \['scale'\]"
    ):
        model_fp32(hidden_states=lat, encoder_hidden_states=txt, attention_kwargs={"lora_rank": 1})
    with pytest.raises(ValueError, match="attention_kwargs must be a dict"):
        model_fp32(hidden_states=lat, encoder_hidden_states=txt, attention_kwargs=[("window_backend", "sdpa")])
    assert Magi2RefinerTransformer3DModel.supported_attention_kwargs == ("scale",)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        Magi2RefinerTransformer3DModel(
            num_layers=1, num_attention_heads=6, attention_head_dim=16, num_key_value_heads=4
        )


def test_save_load_roundtrip_keeps_fp32_islands(model_bf16, bf16_case, tmp_path):
    model_bf16.save_pretrained(tmp_path, max_shard_size="200KB")
    assert len(list(tmp_path.glob("*.safetensors"))) >= 2
    loaded = Magi2RefinerTransformer3DModel.from_pretrained(
        tmp_path, torch_dtype=torch.bfloat16, local_files_only=True
    )
    for name, p in loaded.state_dict().items():
        assert p.dtype == model_bf16.state_dict()[name].dtype, name
    a = _diffusers_call(model_bf16, bf16_case, "noaudio.")
    b = _diffusers_call(loaded, bf16_case, "noaudio.")
    assert torch.equal(a.sample, b.sample)


def _rows_seen(model):
    """Hooks recording how many rows each layer's MLP is handed (a chunked layer hands it one chunk)."""
    rows = []
    hooks = [
        b.mlp.register_forward_pre_hook(lambda m, a: rows.append(a[0].shape[0])) for b in model.transformer_blocks
    ]
    return rows, hooks


@pytest.mark.parametrize("model_name", ["model_fp32", "model_bf16"])
def test_token_chunked_layers_equal_the_whole_layers(request, fp32_case, model_name):
    """``enable_forward_chunking(c)``: every layer's attention (queries over all keys) and MLP run ``c`` tokens at a
    time, on window-block borders (8 tokens here; 7 gives one block a chunk), also across modality borders. The
    rows meet the same math, so only a GEMM's rounding of a row given fewer rows can differ: fp32 to its rounding
    level, bf16 to a few bf16 roundings of the output's scale."""
    model = request.getfixturevalue(model_name)
    try:
        model.disable_forward_chunking()
        full = _diffusers_call(model, fp32_case, "")
        for chunk in (7, 24):
            model.enable_forward_chunking(chunk)
            assert all(b.chunk_size == chunk == b.mlp.chunk_size for b in model.transformer_blocks)
            rows, hooks = _rows_seen(model)
            chunked = _diffusers_call(model, fp32_case, "")
            for hook in hooks:
                hook.remove()
            assert max(rows) == max(chunk, 8) and sum(rows) == 4 * fp32_case["model.x"].shape[0]  # 4 layers
            tol = 2e-5 if model_name == "model_fp32" else 2e-3 * full.sample.abs().max().item()
            assert (chunked.sample - full.sample).abs().max().item() <= tol
            assert (chunked.audio_sample - full.audio_sample).abs().max().item() <= tol
    finally:
        model.enable_forward_chunking()
    with pytest.raises(ValueError, match="positive int"):
        model.enable_forward_chunking(0)


def test_token_chunked_layers_train_as_the_whole_layers(model_fp32, fp32_case):
    """The gradients of a chunked forward (the input's and a weight's) equal the whole forward's (fp32 rounding)."""
    d = fp32_case

    def grads():
        latent = d["pipeline.latent"].clone().requires_grad_(True)
        model_fp32.zero_grad()
        out = model_fp32(latent, d["pipeline.txt_feat"], d["pipeline.audio_latent"]).sample
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        return latent.grad, model_fp32.transformer_blocks[1].attention.linear_qkv.weight.grad.clone()

    try:
        model_fp32.disable_forward_chunking()
        whole = grads()
        model_fp32.enable_forward_chunking(16)
        chunked = grads()
    finally:
        model_fp32.zero_grad(set_to_none=True)
        model_fp32.enable_forward_chunking()
    for a, b in zip(chunked, whole):
        assert ((a - b).norm() / b.norm()).item() <= 1e-5


def test_token_chunked_layers_refuse_what_they_cannot_serve(model_fp32, fp32_case):
    """Chunks need the packed modality order (``forward_packed`` refuses another order before any work) and run the
    attention's processor directly (a hook on the attention would be passed by: refused)."""
    d = fp32_case
    x, coords, ids = d["model.x"], d["model.coords_mapping"], d["model.modality_mapping"]
    perm = torch.cat([torch.arange(1, ids.numel()), torch.tensor([0])])  # one video token moved behind the text
    try:
        model_fp32.enable_forward_chunking(16)
        with pytest.raises(ValueError, match="modality order"):
            model_fp32.forward_packed(x[perm], coords[perm], ids[perm])
        registry = HookRegistry.check_if_exists_or_initialize(model_fp32.transformer_blocks[0].attention)
        registry.register_hook(ModelHook(), "probe")
        try:
            with pytest.raises(RuntimeError, match="disable_forward_chunking"):
                _diffusers_call(model_fp32, d, "")
        finally:
            registry.remove_hook("probe")
    finally:
        model_fp32.enable_forward_chunking()


def test_converter_roundtrip_equals_original_loader(refiner_root, model_bf16, tmp_path):
    """magi2-convert's refiner component -> from_pretrained(bf16) holds exactly the tensors of from_original_checkpoint."""
    from diffusers_magi2.conversion.convert_transformer import prepare_transformer_conversion, write_transformer

    src = refiner_root / "sandai_checkpoint"
    prepared = prepare_transformer_conversion("refiner", src, src / "magi2_refiner.json")
    out = write_transformer(prepared, tmp_path / "refiner")
    loaded = Magi2RefinerTransformer3DModel.from_pretrained(out, torch_dtype=torch.bfloat16, local_files_only=True)
    ref = model_bf16.state_dict()
    got = loaded.state_dict()
    assert set(got) == set(ref) and len(got) == 47
    for k, t in ref.items():
        assert got[k].dtype == t.dtype and torch.equal(got[k], t), k
    assert dict(loaded.config)["window_block_size"] == [2, 2, 2]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_flex_on_cuda_matches_gather():
    """Compiled flex_attention + BlockMask (the CUDA default) vs the exact gather backend, bf16, GQA 4:1."""
    from diffusers_magi2.models.window_attention import Magi2WindowGeometry, block_window_attention

    geom = Magi2WindowGeometry((15, 12, 20), (8, 4, 4), (2, 2, 2), 37)
    n = geom.num_tokens
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(n, 32, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(n, 8, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(n, 8, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    a = block_window_attention(q, k, v, geom, backend="flex").float()
    b = block_window_attention(q.float(), k.float(), v.float(), geom, backend="gather")
    assert _rel(a, b) < 1e-2


def test_gradient_checkpointing_same_gradients(refiner_root, fp32_case):
    d = fp32_case
    grads = []
    for ckpt in (False, True):
        model = Magi2RefinerTransformer3DModel.from_original_checkpoint(
            refiner_root / "sandai_checkpoint", torch_dtype=torch.float32
        ).train()
        if ckpt:
            model.enable_gradient_checkpointing()
        out = model(hidden_states=d["pipeline.latent"], encoder_hidden_states=d["pipeline.txt_feat"])
        out.sample.square().mean().backward()
        grads.append(model.transformer_blocks[1].attention.linear_qkv.weight.grad.clone())
    assert grads[0].abs().max() > 0
    assert torch.allclose(grads[0], grads[1], atol=1e-6, rtol=1e-5)
