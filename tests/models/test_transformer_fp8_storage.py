"""FP8 storage for the dense weights beside quantised routed experts: ``enable_fp8_storage`` (per-output-channel
scales, the 80 GB recipe's transformer) and diffusers' ``enable_layerwise_casting`` (unscaled).

``enable_fp8_storage``: each dense projection becomes e4m3 codes with an fp32 ``weight_scale`` of ``amax / 448`` per
output channel, and the model computes exactly as the same model with its weights rounded so by hand; the islands
and the routed experts stay bit for bit; ``.to(dtype)``, group offload and a LoRA keep the stored tensors; a saved
model reloads them as they are (fp32 and bf16 loads); a bad ``dense_storage_dtype`` or a NaN weight is refused
before anything is stored.

``enable_layerwise_casting``: The casting stores every dense projection (attention, dense MLP, shared experts,
split/merge) in FP8 and runs it in bf16, computing exactly as the same model with those weights rounded to e4m3 by
hand (unscaled); the fp32 islands and the quantised expert banks and their scales are left as they are; at the released size on meta the weights shrink by the dense bytes' half (int4 experts: 66.7 -> 61.6 GB,
within the 64 GB the 80 GB plan allows)."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers.file_mappings import file_mapped
from helpers.tiny_transformer import TINY, tiny_inputs, tiny_model
from safetensors.torch import load_file

from diffusers_magi2 import Magi2Transformer3DModel
from diffusers_magi2.models.modality import Magi2ModalityGroupedLinear
from diffusers_magi2.moe.layer import Magi2MultiHeadMoE


FP8 = torch.float8_e4m3fn
QUANTISED = ["float8_e4m3fn", "int4"]
#: int4 at group 32 on the tiny model (its MoE heads are 32 wide); the released size keeps the default 128.
TINY_INT4 = {"expert_int4_group_size": 32}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == FP8 else t


def _expert_tensors(model) -> dict:
    return {
        f"{i}.{n}": t
        for i, moe in enumerate(m for m in model.modules() if isinstance(m, Magi2MultiHeadMoE))
        for n, t in list(moe.named_parameters()) + list(moe.named_buffers())
    }


def _dense(model) -> dict:
    """``{name: module}`` of the dense projections (the tiny model's empty dense MLP of layer 0 left out)."""
    return {n: m for n, m in model._dense_projections() if m.weight.numel()}


def _rounded_by_hand(model, *, per_row_scale: bool = True):
    """A copy of ``model`` with every dense weight rounded to e4m3 at ``amax / 448`` per row (or unscaled), kept in
    its dtype."""
    model = copy.deepcopy(model)
    with torch.no_grad():
        for module in _dense(model).values():
            w = module.weight.float()
            s = w.abs().amax(dim=1, keepdim=True) / 448 if per_row_scale else torch.ones(w.shape[0], 1)
            module.weight.copy_((w / torch.where(s > 0, s, torch.ones_like(s))).to(FP8).float() * s)
    return model


@pytest.mark.parametrize("expert_dtype", QUANTISED)
def test_layerwise_casting_stores_the_dense_weights_in_fp8_and_leaves_quantised_experts_alone(expert_dtype):
    torch.manual_seed(0)
    extra = TINY_INT4 if expert_dtype == "int4" else {}
    model = Magi2Transformer3DModel(**TINY, **extra, params_dtype=torch.bfloat16, expert_dtype=expert_dtype).eval()
    experts = {n: t.clone() for n, t in _expert_tensors(model).items()}
    islands = {n: t.clone() for n, t in model.state_dict().items() if model.is_fp32_island(n)}
    by_hand = _rounded_by_hand(model, per_row_scale=False)
    with torch.no_grad():
        reference, want = model(**tiny_inputs()).sample, by_hand(**tiny_inputs()).sample
    model.enable_layerwise_casting(storage_dtype=FP8, compute_dtype=torch.bfloat16)

    dense = [
        m for m in model.transformer_blocks.modules() if isinstance(m, (torch.nn.Linear, Magi2ModalityGroupedLinear))
    ]
    assert dense and all(m.weight.dtype == FP8 for m in dense)  # every dense projection, single and grouped
    with torch.no_grad():
        out = model(**tiny_inputs()).sample
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    assert not torch.equal(out, reference)  # the rounding moved the output ...
    torch.testing.assert_close(out, want, atol=0, rtol=0)  # ... exactly as the dense weights rounded by hand
    assert all(m.weight.dtype == FP8 for m in dense)  # back in storage after the forward
    after = _expert_tensors(model)
    for name, t in experts.items():  # the routed experts and their scales: untouched, bit for bit
        assert after[name].dtype == t.dtype and torch.equal(_bits(after[name]), _bits(t)), name
    state = model.state_dict()
    assert islands and all(state[n].dtype == torch.float32 and torch.equal(state[n], t) for n, t in islands.items())


@pytest.mark.parametrize("expert_dtype", QUANTISED)
def test_released_size_with_fp8_storage_for_the_dense_weights_on_meta(expert_dtype):
    with torch.device("meta"):
        model = Magi2Transformer3DModel(params_dtype=torch.bfloat16, expert_dtype=expert_dtype)
    experts = {id(t) for t in _expert_tensors(model).values()}

    def parts() -> dict:
        out = {"experts": 0, "fp32 islands": 0, "dense": 0}
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            kind = "experts" if id(t) in experts else "fp32 islands" if model.is_fp32_island(name) else "dense"
            out[kind] += t.numel() * t.element_size()
        return out

    before = parts()
    dense_dtypes = {
        t.dtype for n, t in model.named_parameters() if id(t) not in experts and not model.is_fp32_island(n)
    }
    assert dense_dtypes == {torch.bfloat16}
    model.enable_layerwise_casting(storage_dtype=FP8, compute_dtype=torch.bfloat16)
    experts = {id(t) for t in _expert_tensors(model).values()}
    stored = parts()
    total = sum(stored.values())
    print(
        f"\nreleased transformer, {expert_dtype} experts, FP8-stored dense weights, on meta: "
        + ", ".join(f"{k} {v / 1e9:.2f} GB" for k, v in stored.items())
        + f"; total {total / 1e9:.2f} GB"
    )
    assert stored["dense"] * 2 == before["dense"]  # bf16 -> FP8, every dense weight
    assert stored["experts"] == before["experts"] and stored["fp32 islands"] == before["fp32 islands"]
    assert before["dense"] > 10e9
    if expert_dtype == "int4":  # the 80 GB recipe's transformer
        assert sum(before.values()) <= 70e9 and total <= 64e9


# ------------------------------------------------------------------------------------------------ enable_fp8_storage


@pytest.mark.parametrize("expert_dtype", [None, "float8_e4m3fn"])
def test_fp8_storage_scales_each_output_channel_and_computes_as_the_weights_rounded_by_hand(expert_dtype):
    model = tiny_model(expert_dtype=expert_dtype) if expert_dtype else tiny_model()
    by_hand = _rounded_by_hand(model)
    experts = {n: t.clone() for n, t in _expert_tensors(model).items()}
    islands = {n: t.clone() for n, t in model.state_dict().items() if model.is_fp32_island(n)}
    amax = {n: m.weight.detach().abs().amax(dim=1) for n, m in _dense(model).items()}
    model.enable_fp8_storage()

    assert model.config.dense_storage_dtype == "float8_e4m3fn" and model.dtype == torch.float32
    dense = _dense(model)
    assert dense and len(dense) == len(amax)
    assert all(m.weight.dtype == FP8 and not m.weight.requires_grad for m in dense.values())
    assert all(torch.equal(m.weight_scale, amax[n] / 448) for n, m in dense.items())  # fp32, amax / 448 per row
    banks = ("W_gate", "W_up", "W_down")
    stored = {n for n, t in model.named_parameters() if t.dtype == FP8 and not n.endswith(banks)}
    assert stored == {f"{n}.weight" for n in dense}
    with torch.no_grad():
        out, want = model(**tiny_inputs()).sample, by_hand(**tiny_inputs()).sample
    torch.testing.assert_close(out, want, atol=0, rtol=0)
    assert all(m.weight.dtype == FP8 for m in dense.values())  # stored again after the call
    state = model.state_dict()
    assert all(torch.equal(state[n], t) for n, t in islands.items())
    after = _expert_tensors(model)
    assert all(torch.equal(_bits(after[n]), _bits(t)) for n, t in experts.items())

    model.to(torch.bfloat16)  # a dtype move: the stored codes and their scales stay as they are
    assert all(m.weight.dtype == FP8 and m.weight_scale.dtype == torch.float32 for m in dense.values())
    assert all(model.state_dict()[n].dtype == torch.float32 for n in islands)


def test_fp8_storage_with_group_offload_and_a_lora_keeps_the_stored_tensors():
    """Group offload (block level) gives the same output; a LoRA added on top wraps the stored projections, trains
    (gradients reach its factors, none the stored weights) and computes as the LoRA over the weights rounded by
    hand."""
    from peft import LoraConfig

    model = tiny_model()
    model.enable_fp8_storage()
    with torch.no_grad():
        reference = model(**tiny_inputs()).sample
    offloaded = copy.deepcopy(model)
    offloaded.enable_group_offload(torch.device("cpu"), offload_type="block_level", num_blocks_per_group=1)
    with torch.no_grad():
        torch.testing.assert_close(offloaded(**tiny_inputs()).sample, reference, atol=0, rtol=0)

    by_hand = _rounded_by_hand(tiny_model())
    config = LoraConfig(r=4, target_modules=["linear_qkv", "linear_proj"], init_lora_weights=False)
    for m in (model, by_hand):
        torch.manual_seed(7)
        m.add_adapter(config, "default")
    lora = {n: p for n, p in model.named_parameters() if ".lora_" in n}
    assert lora and all(p.dtype == torch.float32 and p.requires_grad for p in lora.values())
    out = model(**tiny_inputs()).sample  # (both with autograd on: the same kernels)
    torch.testing.assert_close(out, by_hand(**tiny_inputs()).sample, atol=0, rtol=0)
    out.square().mean().backward()
    assert all(p.grad is not None and bool(p.grad.abs().sum() > 0) for p in lora.values())
    assert all(m.weight.grad is None and m.weight.dtype == FP8 for m in _dense(model).values())


@pytest.mark.parametrize("torch_dtype", [torch.float32, torch.bfloat16])
def test_a_saved_fp8_stored_model_reloads_its_codes_and_scales_as_they_are(tmp_path, torch_dtype):
    """The file holds each stored ``weight`` in e4m3 beside its fp32 ``weight_scale`` and the config records
    ``dense_storage_dtype``; ``from_pretrained`` (any ``torch_dtype``) gives back the same keys and bits, computing
    in ``torch_dtype``."""
    model = tiny_model()
    model.enable_fp8_storage()
    model.save_pretrained(tmp_path)
    saved = load_file(str(tmp_path / "diffusion_pytorch_model.safetensors"))
    names = list(_dense(model))
    assert {saved[f"{n}.weight"].dtype for n in names} == {FP8}
    assert {saved[f"{n}.weight_scale"].dtype for n in names} == {torch.float32}

    loaded = Magi2Transformer3DModel.from_pretrained(tmp_path, torch_dtype=torch_dtype)
    state = loaded.state_dict()
    assert loaded.config.dense_storage_dtype == "float8_e4m3fn" and loaded.dtype == torch_dtype
    assert set(state) == set(saved)
    for n in names:
        assert state[f"{n}.weight"].dtype == FP8 and torch.equal(
            _bits(state[f"{n}.weight"]), _bits(saved[f"{n}.weight"])
        )
        assert torch.equal(state[f"{n}.weight_scale"], saved[f"{n}.weight_scale"])
    if torch_dtype == torch.float32:
        with torch.no_grad():
            torch.testing.assert_close(loaded(**tiny_inputs()).sample, model(**tiny_inputs()).sample, atol=0, rtol=0)
    # placed as stored, not cast to torch_dtype and back: views of the file's memory map, no anonymous copy
    assert all(file_mapped({n: state[f"{n}.weight"] for n in names}).values())


def test_bad_dense_storage_dtype_and_a_nan_weight_are_refused_before_anything_is_stored():
    with pytest.raises(
        ValueError, match=r"dense_storage_dtype must be one of \(None, 'float8_e4m3fn'\); got 'float8_e5m2'"
    ):
        Magi2Transformer3DModel(**TINY, dense_storage_dtype="float8_e5m2")
    model = tiny_model()
    name = "transformer_blocks.1.attention.linear_proj"
    with torch.no_grad():
        model.get_submodule(name).weight[3, 5] = float("nan")
    with pytest.raises(ValueError, match=rf"{name}\.weight holds a non-finite weight \(nan\)"):
        model.enable_fp8_storage()
    assert all(m.weight.dtype == torch.float32 and "weight_scale" not in m._buffers for m in _dense(model).values())
    assert model.config.get("dense_storage_dtype") is None


def test_released_size_with_scaled_fp8_storage_on_meta():
    """The 80 GB recipe's transformer (int4 experts, ``enable_fp8_storage``) on meta: the dense weights take half
    their bf16 bytes plus 4 bytes per output channel (the fp32 scales), and the whole is within 64 GB."""
    with torch.device("meta"):
        model = Magi2Transformer3DModel(params_dtype=torch.bfloat16, expert_dtype="int4")
    dense = [m for n, m in model._dense_projections() if m.weight.numel()]
    bf16 = sum(m.weight.numel() * 2 for m in dense)
    total_before = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    model.enable_fp8_storage(compute_dtype=torch.bfloat16)
    stored = sum(m.weight.numel() * m.weight.element_size() + m.weight_scale.numel() * 4 for m in dense)
    total = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    print(f"\nreleased transformer, int4 experts, scaled FP8 dense weights, on meta: {total / 1e9:.2f} GB")
    assert stored == bf16 // 2 + 4 * sum(m.weight.shape[0] for m in dense)
    assert total == total_before - bf16 + stored and total <= 64e9
    assert model.dtype == torch.bfloat16


def test_weight_streaming_streams_the_stored_codes_and_gives_the_resident_output():
    """``enable_weight_streaming`` (CPU ring) over an FP8-stored model copies the e4m3 codes and their scales and
    gives the resident model's output bit for bit."""
    model = tiny_model()
    model.enable_fp8_storage()
    with torch.no_grad():
        resident = model(**tiny_inputs()).sample
    model.enable_weight_streaming(device="cpu")
    with torch.no_grad():
        torch.testing.assert_close(model(**tiny_inputs()).sample, resident, atol=0, rtol=0)
    assert all(m.weight.dtype == FP8 for m in _dense(model).values())
