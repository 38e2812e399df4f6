"""One model family: both transformers are built from the same attention, feed-forward, adapters and
modality dispatch, and choose their attention kernels through processors, the diffusers way."""

from __future__ import annotations

import inspect

import pytest
import torch
from diffusers.models.attention import AttentionMixin, AttentionModuleMixin
from diffusers.models.cache_utils import CacheMixin
from helpers.tiny_transformer import TINY, tiny_inputs, tiny_model
from safetensors.torch import load_file

import diffusers_magi2.models.transformer_magi2_refiner as refiner_module
from diffusers_magi2.models.adapters_magi2 import Magi2PostAdapter, Magi2PreAdapter
from diffusers_magi2.models.attention_magi2 import Magi2Attention, Magi2AttnProcessor, Magi2WindowAttnProcessor
from diffusers_magi2.models.feedforward_magi2 import Magi2FeedForward
from diffusers_magi2.models.modality import Magi2ModalityDispatch
from diffusers_magi2.models.transformer_magi2 import Magi2Transformer3DModel
from diffusers_magi2.models.transformer_magi2_refiner import Magi2RefinerTransformer3DModel


@pytest.fixture(scope="module")
def refiner_root(fixtures_dir):
    return fixtures_dir / "magi2_tiny/refiner"


@pytest.fixture(scope="module")
def refiner_fp32(refiner_root):
    return Magi2RefinerTransformer3DModel.from_original_checkpoint(
        refiner_root / "sandai_checkpoint", torch_dtype=torch.float32
    )


@pytest.fixture(scope="module")
def refiner_case(refiner_root):
    return load_file(str(refiner_root / "fp32/transformer_case.safetensors"))


def _refine(model, d):
    with torch.no_grad():
        return model(
            hidden_states=d["pipeline.latent"],
            encoder_hidden_states=d["pipeline.txt_feat"],
            audio_hidden_states=d["pipeline.audio_latent"],
        )


def test_refiner_module_defines_no_attention_or_feedforward_of_its_own():
    own = [
        obj
        for _, obj in inspect.getmembers(refiner_module, inspect.isclass)
        if obj.__module__ == refiner_module.__name__
    ]
    assert own, "the refiner module defines its model classes"
    for cls in own:
        assert not issubclass(cls, AttentionModuleMixin), cls
        assert not any(word in cls.__name__ for word in ("Attention", "Attn", "MLP", "FeedForward")), cls


def test_both_models_share_the_family_and_the_diffusers_mixins():
    with torch.device("meta"):
        preview = Magi2Transformer3DModel(num_layers=2, multimodal_layers=[0], moe_layers=[])
        refiner = Magi2RefinerTransformer3DModel(num_layers=2, multimodal_layers=[0])
    for model in (preview, refiner):
        assert isinstance(model, AttentionMixin) and isinstance(model, CacheMixin)
        assert isinstance(model.pre_adapter, Magi2PreAdapter) and isinstance(model.post_adapter, Magi2PostAdapter)
        for block in model.transformer_blocks:
            assert type(block.attention) is Magi2Attention and type(block.mlp) is Magi2FeedForward
    assert {type(p) for p in preview.attn_processors.values()} == {Magi2AttnProcessor}
    assert {type(p) for p in refiner.attn_processors.values()} == {Magi2WindowAttnProcessor}
    assert all(b.attention.sinks is not None for b in preview.transformer_blocks)
    assert all(b.attention.sinks is None for b in refiner.transformer_blocks)
    # the refiner's dense layers (outside window_attention_layers) use the varlen processor, unsinked
    with torch.device("meta"):
        mixed = Magi2RefinerTransformer3DModel(num_layers=3, multimodal_layers=[], window_attention_layers=[1])
    kinds = [type(b.attention.processor) for b in mixed.transformer_blocks]
    assert kinds == [Magi2AttnProcessor, Magi2WindowAttnProcessor, Magi2AttnProcessor]


@pytest.mark.parametrize("backend", ["sdpa", "gather", "flex"])
def test_window_kernel_is_a_processor_option(refiner_fp32, refiner_case, backend):
    """``set_attn_processor(Magi2WindowAttnProcessor(backend=...))`` picks the kernel; each matches the fixture."""
    d = refiner_case
    try:
        refiner_fp32.set_attn_processor(Magi2WindowAttnProcessor(backend=backend))
        out = _refine(refiner_fp32, d)
    finally:
        refiner_fp32.set_attn_processor(Magi2WindowAttnProcessor())
    ref = d["pipeline.video_out"]
    assert (out.sample - ref).abs().max().item() <= 1e-4
    assert ((out.sample - ref).norm() / ref.norm()).item() <= 1e-5


def test_window_processor_options_reach_the_kernel(refiner_fp32, refiner_case):
    # an sdpa processor limited to tiny dense masks must refuse this sample's mask
    try:
        refiner_fp32.set_attn_processor(Magi2WindowAttnProcessor(backend="sdpa", max_dense_mask_elements=16))
        with pytest.raises(ValueError, match="refusing to build a dense"):
            _refine(refiner_fp32, refiner_case)
    finally:
        refiner_fp32.set_attn_processor(Magi2WindowAttnProcessor())
    with pytest.raises(ValueError, match="window_attn backend must be one of"):
        Magi2WindowAttnProcessor(backend="fa3")


def test_refiner_forward_chunking(refiner_fp32, refiner_case):
    full = _refine(refiner_fp32, refiner_case).sample
    try:
        refiner_fp32.enable_forward_chunking(7)
        assert all(b.mlp.chunk_size == 7 for b in refiner_fp32.transformer_blocks)
        chunked = _refine(refiner_fp32, refiner_case).sample
        refiner_fp32.disable_forward_chunking()
        assert all(b.mlp.chunk_size is None for b in refiner_fp32.transformer_blocks)
        unchunked = _refine(refiner_fp32, refiner_case).sample
    finally:
        refiner_fp32.enable_forward_chunking()
    assert (chunked - full).abs().max().item() <= 2e-5
    assert (unchunked - full).abs().max().item() <= 2e-5
    with pytest.raises(ValueError, match="dim 0"):
        refiner_fp32.enable_forward_chunking(8, dim=1)
    with pytest.raises(ValueError, match="positive int"):
        refiner_fp32.enable_forward_chunking(0)


def test_preview_upcast_is_a_processor_option(fixtures_dir):
    """The bf16 preview attends in fp32 off CUDA by default; ``Magi2AttnProcessor(upcast_off_cuda=False)``
    attends in bf16 and moves the output away from the fp32 fixture."""
    model = Magi2Transformer3DModel.from_original_checkpoint(
        fixtures_dir / "magi2_tiny/preview_h4/sandai_checkpoint", dtype=torch.bfloat16
    )
    d = load_file(str(fixtures_dir / "magi2_tiny/preview_h4/bf16/transformer_case.safetensors"))
    args = (
        d["model.x"],
        d["model.coords_mapping"],
        d["model.modality_mapping"],
        d["model.cu_seqlens_q"],
        d["model.time_token_sequence"],
    )
    with torch.no_grad():
        upcast = model.forward_packed(*args)
        model.set_attn_processor(Magi2AttnProcessor(upcast_off_cuda=False))
        plain = model.forward_packed(*args)
    ref = d["model.out"].float()

    def rel(a):
        return ((a.float() - ref).norm() / ref.norm()).item()

    assert not torch.equal(upcast, plain)
    assert rel(upcast) < rel(plain)


def test_identity_dispatch_equals_sorting_a_sorted_sequence():
    ids = torch.tensor([0, 0, 0, 1, 2, 2])
    sorted_dispatch = Magi2ModalityDispatch.from_modality_mapping(ids)
    identity = Magi2ModalityDispatch.from_sorted_group_sizes((3, 1, 2))
    assert identity.group_sizes == sorted_dispatch.group_sizes == (3, 1, 2)
    assert torch.equal(identity.modality_ids, ids) and torch.equal(identity.sorted_modality_ids, ids)
    x = torch.randn(6, 4)
    assert torch.equal(identity.sort(x), sorted_dispatch.sort(x))
    assert torch.equal(identity.unsort(x), sorted_dispatch.unsort(x))
    assert identity.to("cpu").permutation is None


def test_both_forwards_refuse_a_bad_shape_with_the_same_message():
    """The Preview and the refiner check video, text, audio and mask through one check: the same bad input gets
    the same ``ValueError``, naming the input, from either forward (a zero-length video axis included)."""
    preview = tiny_model()
    widths = {k: TINY[k] for k in ("in_channels", "audio_in_channels", "text_in_channels")}
    refiner = Magi2RefinerTransformer3DModel(
        num_layers=1,
        num_attention_heads=2,
        attention_head_dim=16,
        num_key_value_heads=2,
        multimodal_layers=[],
        **widths,
    )
    good = tiny_inputs()
    shared = ("hidden_states", "encoder_hidden_states", "audio_hidden_states", "encoder_attention_mask")
    for name, bad in [
        ("hidden_states", good["hidden_states"][:, :, :0]),
        ("hidden_states", good["hidden_states"][:, :5]),
        ("encoder_hidden_states", good["encoder_hidden_states"][..., :7]),
        ("audio_hidden_states", good["audio_hidden_states"][:1]),
        ("encoder_attention_mask", torch.ones(2, 1, dtype=torch.bool)),
    ]:
        messages = []
        for model, inputs in ((preview, good), (refiner, {k: good[k] for k in shared})):
            with pytest.raises(ValueError, match=name) as raised:
                model(**{**inputs, name: bad})
            messages.append(str(raised.value))
        assert messages[0] == messages[1], (name, messages)


def test_the_preview_refuses_missing_audio_with_a_clear_error():
    """The Preview always denoises audio (``L_audio`` may be 0): ``None`` audio is refused by name."""
    good = tiny_inputs()
    with pytest.raises(ValueError, match="audio_hidden_states is required by the Preview"):
        tiny_model()(**{**good, "audio_hidden_states": None})
