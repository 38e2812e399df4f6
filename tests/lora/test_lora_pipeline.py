"""``Magi2Pipeline``'s LoRA API (``Magi2LoraLoaderMixin``) on the tiny SandAI preview + refiner pipeline.

diffusers' PyPI package ships no test mixins, so each test here is our equivalent of one case of diffusers'
``tests/lora/utils.py::PeftLoraLoaderMixinTests`` (named in its docstring), with our targets (``linear_qkv``,
``linear_proj``, router gates) in place of ``to_q/to_k/to_v``. Outputs are the two transformers' forwards on the
fixture inputs; one test runs ``pipe(...)`` end to end with ``attention_kwargs={"scale": ...}``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers.lora_testing_utils import (
    clone_state,
    has_tuner_layers,
    merged_by_hand,
    mirai_state_dict,
    random_factors,
    rel_l2,
    same_state,
)
from helpers.pipeline_stubs import tiny_two_stage_pipeline
from peft import LoraConfig, get_peft_model_state_dict
from safetensors.torch import load_file


TOL = 1e-6


@pytest.fixture(scope="module")
def base_pipe(fixtures_dir):
    return tiny_two_stage_pipeline(fixtures_dir)


@pytest.fixture
def pipe(base_pipe):
    """The module's pipeline, checked to be back to its base weights (no LoRA) after each test."""
    before = {n: clone_state(getattr(base_pipe, n)) for n in ("transformer", "refiner")}
    yield base_pipe
    base_pipe.unfuse_lora()
    base_pipe.unload_lora_weights()
    for name, state in before.items():
        model = getattr(base_pipe, name)
        assert not has_tuner_layers(model) and same_state(model, state), name


@pytest.fixture(scope="module")
def inputs(fixtures_dir):
    return {
        "transformer": load_file(f"{fixtures_dir}/magi2_tiny/preview_h4/fp32/transformer_case.safetensors"),
        "refiner": load_file(f"{fixtures_dir}/magi2_tiny/refiner/fp32/transformer_case.safetensors"),
    }


def outputs(pipe, inputs, scale=None) -> dict:
    """Both transformers' outputs on the fixture inputs (``scale``: the call's LoRA scale)."""
    kw = {} if scale is None else {"attention_kwargs": {"scale": scale}}
    t, r = inputs["transformer"], inputs["refiner"]
    with torch.no_grad():
        preview = pipe.transformer.forward_packed(
            *(t["model." + k] for k in ("x", "coords_mapping", "modality_mapping", "cu_seqlens_q")),
            t["model.time_token_sequence"],
            **kw,
        )
        refined = pipe.refiner.forward_packed(
            *(r["noaudio.model." + k] for k in ("x", "coords_mapping", "modality_mapping")),
            q_ranges=r["noaudio.model.local_attn.q_ranges"],
            k_ranges=r["noaudio.model.local_attn.k_ranges"],
            **kw,
        )
    return {"transformer": preview, "refiner": refined}


def close(a: dict, b: dict, tol=TOL) -> bool:
    return all(rel_l2(a[k], b[k]) <= tol for k in a)


def differ(a: dict, b: dict) -> bool:
    return all(rel_l2(a[k], b[k]) > 1e-3 for k in a)


def load_random(pipe, clean, name: str, seed: int, scale: float = 1.0):
    """Load a random mirai-native LoRA into both transformers as adapter ``name``; returns the factors."""
    factors = {}
    for component in ("transformer", "refiner"):
        f = random_factors(getattr(clean, component), rank=3, seed=seed + (component == "refiner"))
        pipe.load_lora_weights(
            mirai_state_dict(f, "mirai_native"),
            adapter_name=name,
            load_into_refiner=component == "refiner",
            mirai_scale=scale,
        )
        factors[component] = f
    return factors


class _Models:
    """Two models under the attribute names :func:`outputs` reads."""

    def __init__(self, transformer, refiner):
        self.transformer, self.refiner = transformer, refiner


@pytest.fixture(scope="module")
def clean(base_pipe):
    """Copies of the two base models, never given a LoRA."""
    return _Models(copy.deepcopy(base_pipe.transformer), copy.deepcopy(base_pipe.refiner))


def merged_outputs(clean, inputs, weighted: list[tuple[dict, float]]) -> dict:
    """Outputs of copies of the base models with ``sum(w * B @ A)`` merged by hand."""
    models = {}
    for component in ("transformer", "refiner"):
        model = getattr(clean, component)
        for factors, w in weighted:
            model = merged_by_hand(model, factors[component], w)
        models[component] = model
    return outputs(_Models(**models), inputs)


# ------------------------------------------------------------------------------------------------ cases


def test_lora_save_load_round_trip_is_exact(pipe, inputs, tmp_path):
    """``test_simple_inference_with_text_denoiser_lora_save_load``: adapters added to both denoisers (training's
    path, ``add_adapter``), saved with ``save_lora_weights`` and loaded into the plain pipeline, give the same
    outputs bit for bit, with different ranks and alphas per module (``test_correct_lora_configs_with_different_ranks``,
    ``test_lora_adapter_metadata_save_load_inference``)."""
    torch.manual_seed(0)
    configs = {
        "transformer": LoraConfig(
            r=4,
            lora_alpha=8,
            rank_pattern={"linear_proj": 2},
            alpha_pattern={"linear_proj": 3},
            target_modules=["linear_qkv", "linear_proj"],
            target_parameters=["mlp.moe_mlp.gate"],
            init_lora_weights=False,
        ),
        "refiner": LoraConfig(
            r=2, lora_alpha=5, target_modules=["linear_qkv", "linear_proj"], init_lora_weights=False
        ),
    }
    for name, config in configs.items():
        getattr(pipe, name).add_adapter(config, "trained")
    with_lora = outputs(pipe, inputs)
    pipe.save_lora_weights(
        tmp_path,
        transformer_lora_layers=get_peft_model_state_dict(pipe.transformer, adapter_name="trained"),
        refiner_lora_layers=get_peft_model_state_dict(pipe.refiner, adapter_name="trained"),
        transformer_lora_adapter_metadata=pipe.transformer.peft_config["trained"].to_dict(),
        refiner_lora_adapter_metadata=pipe.refiner.peft_config["trained"].to_dict(),
    )
    saved = {n: get_peft_model_state_dict(getattr(pipe, n), adapter_name="trained") for n in configs}
    pipe.unload_lora_weights()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pytorch_lora_weights.safetensors"]

    pipe.load_lora_weights(tmp_path, adapter_name="reloaded")
    for name in configs:
        again = get_peft_model_state_dict(getattr(pipe, name), adapter_name="reloaded")
        assert saved[name].keys() == again.keys() and all(torch.equal(saved[name][k], again[k]) for k in again)
    reloaded = outputs(pipe, inputs)
    assert all(torch.equal(reloaded[k], with_lora[k]) for k in reloaded)


def test_lora_scale_through_the_pipeline_call(pipe, clean):
    """``test_simple_inference_with_text_denoiser_lora_and_scale``: ``pipe(..., attention_kwargs={"scale": s})``
    changes the output with ``s``, and ``s = 0`` is the pipeline without LoRA."""
    call = {
        "prompt": "A red fox trots through fresh snow at dawn",
        "height": 64,
        "width": 96,
        "preview_height": 32,
        "preview_width": 48,
        "num_inference_steps": 1,
        "refiner_num_inference_steps": 1,
        "output_type": "latent",
    }

    def run(**kw):
        return pipe(**call, generator=torch.Generator().manual_seed(0), **kw).frames

    plain = run()
    load_random(pipe, clean, "a", seed=10)
    full, half, zero = run(), run(attention_kwargs={"scale": 0.5}), run(attention_kwargs={"scale": 0.0})
    assert rel_l2(full, plain) > 1e-3 and rel_l2(half, plain) > 1e-3 and rel_l2(half, full) > 1e-3
    assert rel_l2(zero, plain) <= TOL


def test_fused_lora_equals_the_adapter_and_unfuse_restores_the_weights(pipe, inputs, clean):
    """``test_simple_inference_with_text_lora_denoiser_fused`` and ``..._denoiser_lora_unfused``: fusing keeps the
    outputs; unfusing gives every weight back bit for bit and the adapters act again."""
    plain = outputs(pipe, inputs)
    load_random(pipe, clean, "a", seed=20)
    with_lora = outputs(pipe, inputs)
    pipe.fuse_lora()
    assert pipe.num_fused_loras == 1
    assert close(outputs(pipe, inputs), with_lora)
    pipe.unfuse_lora()
    assert pipe.num_fused_loras == 0
    assert all(torch.equal(a, b) for a, b in zip(outputs(pipe, inputs).values(), with_lora.values()))
    pipe.disable_lora()
    assert all(torch.equal(a, b) for a, b in zip(outputs(pipe, inputs).values(), plain.values()))
    pipe.enable_lora()


def test_unloaded_lora_gives_the_base_outputs(pipe, inputs, clean):
    """``test_simple_inference_with_text_denoiser_lora_unloaded``."""
    plain = outputs(pipe, inputs)
    load_random(pipe, clean, "a", seed=30)
    assert differ(outputs(pipe, inputs), plain)
    pipe.unload_lora_weights()
    assert not has_tuner_layers(pipe.transformer) and not has_tuner_layers(pipe.refiner)
    assert all(torch.equal(a, b) for a, b in zip(outputs(pipe, inputs).values(), plain.values()))


def test_multi_adapter_weighted_and_deleted(pipe, inputs, clean):
    """``test_simple_inference_with_text_denoiser_multi_adapter``, ``..._multi_adapter_weighted``,
    ``..._multi_adapter_delete_adapter``, ``test_get_adapters``, ``test_get_list_adapters``,
    ``test_wrong_adapter_name_raises_error``: two adapters at once, with weights, equal their deltas merged by hand."""
    fa = load_random(pipe, clean, "a", seed=40)
    fb = load_random(pipe, clean, "b", seed=50)
    assert pipe.get_list_adapters() == {"transformer": ["a", "b"], "refiner": ["a", "b"]}
    pipe.set_adapters(["a", "b"])
    assert sorted(pipe.get_active_adapters()) == ["a", "b"]
    assert close(outputs(pipe, inputs), merged_outputs(clean, inputs, [(fa, 1.0), (fb, 1.0)]))
    pipe.set_adapters(["a", "b"], adapter_weights=[0.5, 0.25])
    assert close(outputs(pipe, inputs), merged_outputs(clean, inputs, [(fa, 0.5), (fb, 0.25)]))
    pipe.set_adapters("b")
    assert pipe.get_active_adapters() == ["b"]
    only_b = outputs(pipe, inputs)
    assert close(only_b, merged_outputs(clean, inputs, [(fb, 1.0)]))
    with pytest.raises(ValueError, match="not in the list of present adapters"):
        pipe.set_adapters("missing")
    pipe.set_adapters(["a", "b"])
    pipe.delete_adapters("a")
    assert pipe.get_list_adapters() == {"transformer": ["b"], "refiner": ["b"]}
    assert all(torch.equal(x, y) for x, y in zip(outputs(pipe, inputs).values(), only_b.values()))


def test_set_adapters_weight_matches_the_call_scale_and_fusion(pipe, inputs, clean):
    """``test_set_adapters_match_attention_kwargs`` and ``test_lora_scale_kwargs_match_fusion``: adapter weight
    0.5, call scale 0.5 and ``fuse_lora(lora_scale=0.5)`` give the same outputs, half the delta."""
    fa = load_random(pipe, clean, "a", seed=60)
    by_scale = outputs(pipe, inputs, scale=0.5)
    assert close(by_scale, merged_outputs(clean, inputs, [(fa, 0.5)]))
    pipe.set_adapters("a", adapter_weights=0.5)
    by_weight = outputs(pipe, inputs)
    assert close(by_weight, by_scale)
    pipe.set_adapters("a", adapter_weights=1.0)
    pipe.fuse_lora(lora_scale=0.5)
    assert close(outputs(pipe, inputs), by_scale)


def test_load_delete_load_and_unload_add(pipe, inputs, clean):
    """``test_inference_load_delete_load_adapters`` and ``test_lora_unload_add_adapter``."""
    fa = load_random(pipe, clean, "a", seed=70)
    first = outputs(pipe, inputs)
    pipe.delete_adapters("a")
    load_random(pipe, clean, "a", seed=70)
    assert all(torch.equal(x, y) for x, y in zip(outputs(pipe, inputs).values(), first.values()))
    pipe.unload_lora_weights()
    load_random(pipe, clean, "a2", seed=70)
    assert close(outputs(pipe, inputs), merged_outputs(clean, inputs, [(fa, 1.0)]))


def test_fuse_nan_is_refused_with_safe_fusing(pipe, clean):
    """``test_lora_fuse_nan``: ``safe_fusing`` refuses an adapter with NaNs."""
    load_random(pipe, clean, "a", seed=80)
    layer = pipe.transformer.transformer_blocks[1].attention.linear_qkv
    with torch.no_grad():
        layer.lora_A["a"].weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaNs detected"):
        pipe.fuse_lora(components=["transformer"], safe_fusing=True)


def test_bad_loads_change_nothing(pipe, clean):
    """A refiner LoRA into the preview, keys for a missing component, a used adapter name and an unknown layout
    raise before any component changes."""
    refiner_only = mirai_state_dict(random_factors(clean.refiner, seed=90), "mirai_native")
    with pytest.raises(ValueError, match="does not fit Magi2Transformer3DModel"):
        pipe.load_lora_weights(refiner_only)
    assert not has_tuner_layers(pipe.transformer) and not has_tuner_layers(pipe.refiner)
    fa = random_factors(clean.transformer, seed=91, router=False)
    mixed = {f"transformer.{k}": v for k, v in _diffusers(fa).items()}
    mixed.update({f"refiner.{k}": v for k, v in _diffusers(fa).items()})  # preview shapes under refiner.
    with pytest.raises(ValueError, match="does not fit Magi2RefinerTransformer3DModel"):
        pipe.load_lora_weights(mixed)
    assert not has_tuner_layers(pipe.transformer) and not has_tuner_layers(pipe.refiner)
    pipe.load_lora_weights(mirai_state_dict(fa, "mirai_native"), adapter_name="a")
    with pytest.raises(ValueError, match="'a' is already in use"):
        pipe.load_lora_weights(mirai_state_dict(fa, "mirai_native"), adapter_name="a")
    with pytest.raises(ValueError, match="hotswap is not supported"):
        pipe.load_lora_weights(mirai_state_dict(fa, "mirai_native"), adapter_name="a", hotswap=True)


def _diffusers(factors: dict) -> dict:
    out = {}
    for name, (_, a, b) in factors.items():
        path = name.removesuffix(".weight").removesuffix(".gate")
        out[f"{path}.lora_A.weight"], out[f"{path}.lora_B.weight"] = a, b
    return out


def test_merged_outputs_helper_is_independent_of_peft(pipe, inputs, clean):
    """The by-hand merge really changes the outputs (so the comparisons above can fail)."""
    fa = random_factors(clean.transformer, seed=99)
    fr = random_factors(clean.refiner, seed=98)
    assert differ(merged_outputs(clean, inputs, [({"transformer": fa, "refiner": fr}, 1.0)]), outputs(pipe, inputs))
