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
from helpers.fixtures import REPO_ROOT
from helpers.lora_testing_utils import (
    clone_state,
    fused_deltas,
    has_tuner_layers,
    merged_by_hand,
    mirai_state_dict,
    random_factors,
    rel_l2,
    state_within_fp32_rounding,
    within_fp32_rounding,
)
from helpers.pipeline_stubs import TWO_STAGE_CALL, tiny_two_stage_pipeline
from peft import LoraConfig, get_peft_model_state_dict
from safetensors.torch import load_file, save_file


TOL = 1e-6
#: a two-stage call small enough for a test
SMALL_CALL = {**TWO_STAGE_CALL, "output_type": "latent"}


@pytest.fixture(scope="module")
def base_pipe(fixtures_dir):
    return tiny_two_stage_pipeline(fixtures_dir)


@pytest.fixture
def pipe(base_pipe):
    """The module's pipeline, checked to be back to its base weights (no LoRA; fp32 rounding after a fuse) after each
    test."""
    before = {n: clone_state(getattr(base_pipe, n)) for n in ("transformer", "refiner")}
    yield base_pipe
    base_pipe.unfuse_lora()
    base_pipe.unload_lora_weights()
    for name, state in before.items():
        model = getattr(base_pipe, name)
        assert not has_tuner_layers(model) and state_within_fp32_rounding(model, state), name


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
    call = {"prompt": "A red fox trots through fresh snow at dawn", **SMALL_CALL}

    def run(**kw):
        return pipe(**call, generator=torch.Generator().manual_seed(0), **kw).frames

    plain = run()
    load_random(pipe, clean, "a", seed=10)
    full, half, zero = run(), run(attention_kwargs={"scale": 0.5}), run(attention_kwargs={"scale": 0.0})
    assert rel_l2(full, plain) > 1e-3 and rel_l2(half, plain) > 1e-3 and rel_l2(half, full) > 1e-3
    assert rel_l2(zero, plain) <= TOL


def test_fused_lora_equals_the_adapter_and_unfuse_restores_the_weights(pipe, inputs, clean):
    """``test_simple_inference_with_text_lora_denoiser_fused`` and ``..._denoiser_lora_unfused``: fusing keeps the
    outputs and copies no weight; unfusing (diffusers' own) gives every weight back up to fp32 rounding
    (``|W' - W| <= 2 eps (|W| + |s B @ A|)``, the deltas computed here in fp64) and the adapters act again."""
    before = {n: clone_state(getattr(pipe, n)) for n in ("transformer", "refiner")}
    plain = outputs(pipe, inputs)
    factors = load_random(pipe, clean, "a", seed=20)
    with_lora = outputs(pipe, inputs)
    pipe.fuse_lora()
    assert pipe.num_fused_loras == 1
    assert close(outputs(pipe, inputs), with_lora)
    kept = [n for c in before for n, m in getattr(pipe, c).named_modules() if any(_tensors_beside_params(m))]
    assert not kept  # no module keeps a copy of a weight beside its parameters and buffers
    pipe.unfuse_lora()
    assert pipe.num_fused_loras == 0
    assert close(outputs(pipe, inputs), with_lora)
    for name, state in before.items():
        model, deltas = getattr(pipe, name), fused_deltas(factors[name])
        base = {k.replace(".base_layer", ""): v for k, v in model.state_dict().items() if ".lora_" not in k}
        assert set(base) == set(state) and all(within_fp32_rounding(base[k], state[k], deltas.get(k)) for k in state)
        assert any(not torch.equal(base[k], state[k]) for k in deltas)  # the bound is not vacuous: PEFT rounds
    pipe.disable_lora()
    assert close(outputs(pipe, inputs), plain)
    pipe.enable_lora()


def _tensors_beside_params(module):
    return [k for k, v in vars(module).items() if isinstance(v, torch.Tensor)]


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


def test_safe_fusing_a_nan_adapter_fuses_nothing(pipe, clean):
    """``test_lora_fuse_nan``: ``safe_fusing`` refuses an adapter with NaNs, and checks every target of every
    component before it fuses any: the refiner's last target is broken, and no weight of either model changed."""
    load_random(pipe, clean, "a", seed=80)
    layer = pipe.refiner.transformer_blocks[-1].attention.linear_proj
    with torch.no_grad():
        layer.lora_A["a"].weight[0, 0] = float("nan")
    before = {n: clone_state(getattr(pipe, n)) for n in ("transformer", "refiner")}
    with pytest.raises(ValueError, match=r"NaNs detected in the merged weights of transformer_blocks\.\d+\.attention"):
        pipe.fuse_lora(safe_fusing=True)
    assert pipe.num_fused_loras == 0
    for name, state in before.items():
        model = getattr(pipe, name)
        assert not any(getattr(m, "merged", False) for m in model.modules()), name
        now = model.state_dict()
        assert all(torch.allclose(now[k], v, rtol=0, atol=0, equal_nan=True) for k, v in state.items()), name


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
    with pytest.raises(ValueError, match="hotswap=True is not supported"):
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


# ------------------------------------------------------------------------------------------------ one load path


def test_load_lora_weights_reads_and_converts_each_layout_once_and_folds_every_alpha(
    pipe, clean, tmp_path, monkeypatch
):
    """diffusers' path: one read and one conversion per ``load_lora_weights``, whatever the layout, and PEFT gets
    plain keys only (no ``.alpha``: Kohya's ``alpha / rank`` is in the factors, every adapter at scaling 1)."""
    import peft

    from diffusers_magi2.loaders import lora_conversion_magi2 as conversion
    from diffusers_magi2.loaders import lora_pipeline_magi2 as pipeline_loader

    calls = {"read": 0, "convert": []}
    to_peft = []
    read, convert, set_state = (
        conversion.read_lora_file,
        conversion.convert_lora_state_dict,
        peft.set_peft_model_state_dict,
    )

    def counting_read(*args, **kwargs):
        calls["read"] += 1
        return read(*args, **kwargs)

    def counting_convert(state_dict, layout=None, *args, **kwargs):
        calls["convert"].append(layout or conversion.detect_lora_layout(state_dict))
        return convert(state_dict, layout, *args, **kwargs)

    def recording_set_state(model, state_dict, *args, **kwargs):
        to_peft.append(dict(state_dict))
        return set_state(model, state_dict, *args, **kwargs)

    monkeypatch.setattr(conversion, "read_lora_file", counting_read)
    monkeypatch.setattr(conversion, "convert_lora_state_dict", counting_convert)
    monkeypatch.setattr(pipeline_loader, "convert_lora_state_dict", counting_convert)
    monkeypatch.setattr(peft, "set_peft_model_state_dict", recording_set_state)
    factors = random_factors(clean.transformer, rank=4, seed=110)
    comfy = {}
    for native, a, b in factors.values():
        comfy.update({f"diffusion_model.{native}.lora_A.weight": a, f"diffusion_model.{native}.lora_B.weight": b})
        comfy[f"diffusion_model.{native}.alpha"] = torch.tensor(2.0)
    files = {"comfyui": comfy}
    for layout in ("mirai_kohya", "mirai_diffusers"):
        files[layout] = mirai_state_dict(factors, layout, alpha=2.0)
    for i, (layout, sd) in enumerate(files.items()):
        save_file(sd, str(tmp_path / f"{layout}.safetensors"))
        calls.update(read=0, convert=[])
        pipe.load_lora_weights(str(tmp_path / f"{layout}.safetensors"), adapter_name=layout, mirai_scale=None)
        assert calls["read"] == 1 and [c for c in calls["convert"] if c != "peft"] == [layout], calls
        assert not any(k.endswith(".alpha") for k in to_peft[-1])
        config = pipe.transformer.peft_config[layout]
        assert config.lora_alpha == config.r == 4
        layer = pipe.transformer.transformer_blocks[0].attention.linear_qkv
        assert layer.scaling[layout] == 1.0
        a, b = factors["transformer_blocks.0.attention.linear_qkv.weight"][1:]
        loaded = layer.lora_B[layout].weight.double() @ layer.lora_A[layout].weight.double()
        assert rel_l2(loaded, 0.5 * (b.double() @ a.double())) <= 1e-6  # alpha 2 at rank 4
    assert len(to_peft) == len(files)


def test_a_saved_adapter_reloads_with_its_scale(pipe, clean, inputs, tmp_path):
    """An adapter at scale 0.75 (``mirai_scale=0.75``), saved with its adapter config, reloads at that scale;
    its layers without the config are refused (they would reload at scale 1) and nothing is written."""
    load_random(pipe, clean, "a", seed=120, scale=0.75)
    with_lora = outputs(pipe, inputs)
    layers = {n: get_peft_model_state_dict(getattr(pipe, n), adapter_name="a") for n in ("transformer", "refiner")}
    with pytest.raises(ValueError, match=r"transformer_lora_layers needs transformer_lora_adapter_metadata"):
        pipe.save_lora_weights(tmp_path / "bare", transformer_lora_layers=layers["transformer"])
    assert not (tmp_path / "bare").exists()
    pipe.save_lora_weights(
        tmp_path / "kept",
        transformer_lora_layers=layers["transformer"],
        refiner_lora_layers=layers["refiner"],
        transformer_lora_adapter_metadata=pipe.transformer.peft_config["a"].to_dict(),
        refiner_lora_adapter_metadata=pipe.refiner.peft_config["a"].to_dict(),
    )
    pipe.unload_lora_weights()
    pipe.load_lora_weights(tmp_path / "kept", adapter_name="b")
    assert all(torch.equal(x, y) for x, y in zip(outputs(pipe, inputs).values(), with_lora.values()))


def test_non_finite_factors_are_refused_by_the_pipeline_and_nothing_is_applied(pipe, clean):
    """The preview's last target sits after its last router, so a NaN there would give all-NaN frames; the load
    refuses it (the key named) and neither transformer takes the adapter."""
    fa = random_factors(clean.transformer, seed=130)
    sd = {f"transformer.{k}": v for k, v in _diffusers(fa).items()}
    sd.update({f"refiner.{k}": v for k, v in _diffusers(random_factors(clean.refiner, seed=131)).items()})
    last = len(pipe.transformer.transformer_blocks) - 1
    key = f"transformer.transformer_blocks.{last}.attention.linear_proj.lora_B.weight"
    sd[key] = sd[key].clone()
    sd[key][0, 0] = float("nan")
    with pytest.raises(ValueError, match=rf"NaN or inf values .*'transformer_blocks\.{last}\.attention\.linear_proj"):
        pipe.load_lora_weights(sd, adapter_name="bad")
    assert not has_tuner_layers(pipe.transformer) and not has_tuner_layers(pipe.refiner)


def test_a_lora_stored_in_float8_loads_as_its_upcast_factors(pipe, clean, inputs, tmp_path):
    """LoRA layers stored in float8 e4m3 (diffusers' ``apply_layerwise_casting`` on them) and saved so reload into
    fp32 factors that give the outputs of the adapter with its factors rounded to float8 by hand, exactly; a NaN
    among float8 factors is refused naming its key (the non-finite check upcasts: CPU has no float8
    ``isfinite``)."""
    from diffusers.hooks import apply_layerwise_casting

    fp8 = torch.float8_e4m3fn
    load_random(pipe, clean, "a", seed=140)
    layers = {}
    for name in ("transformer", "refiner"):
        model = getattr(pipe, name)
        with torch.no_grad():
            for path, p in model.named_parameters():
                if ".lora_" in path:
                    p.copy_(p.to(fp8).float())
    rounded = outputs(pipe, inputs)
    for name in ("transformer", "refiner"):
        model = getattr(pipe, name)
        for path, module in model.named_modules():
            if path.endswith((".lora_A.a", ".lora_B.a")):
                apply_layerwise_casting(module, storage_dtype=fp8, compute_dtype=torch.float32)
        layers[name] = get_peft_model_state_dict(model, adapter_name="a")
    assert {v.dtype for state in layers.values() for v in state.values()} == {fp8}
    pipe.save_lora_weights(
        tmp_path,
        transformer_lora_layers=layers["transformer"],
        refiner_lora_layers=layers["refiner"],
        transformer_lora_adapter_metadata=pipe.transformer.peft_config["a"].to_dict(),
        refiner_lora_adapter_metadata=pipe.refiner.peft_config["a"].to_dict(),
    )
    pipe.unload_lora_weights()
    pipe.load_lora_weights(tmp_path, adapter_name="b")
    assert all(torch.equal(x, y) for x, y in zip(outputs(pipe, inputs).values(), rounded.values()))
    assert differ(rounded, outputs(clean, inputs))
    pipe.unload_lora_weights()

    sd = load_file(str(tmp_path / "pytorch_lora_weights.safetensors"))
    key = next(k for k in sorted(sd) if k.startswith("transformer.") and ".lora_B." in k)
    sd[key] = sd[key].clone()
    sd[key].view(torch.uint8)[0, 0] = 0x7F  # e4m3fn NaN
    with pytest.raises(ValueError, match=rf"NaN or inf values .*'{key.removeprefix('transformer.')}"):
        pipe.load_lora_weights(sd, adapter_name="bad")
    assert not has_tuner_layers(pipe.transformer) and not has_tuner_layers(pipe.refiner)


def _readme_lora_block() -> str:
    readme = (REPO_ROOT / "README.md").read_text()
    return readme.split("<!-- lora -->", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]


def test_readme_lora_lines_run_as_written_and_the_saved_adapter_keeps_its_scale(
    pipe, clean, inputs, tmp_path, monkeypatch
):
    """The README's LoRA block, run in a folder holding its two files (a trained diffusers-format adapter at scale
    0.75 for the transformer, a mirai Kohya file for the refiner); the only edit is a small call. The adapter it
    saves reloads at 0.75 and acts as the file it came from, bit for bit."""
    monkeypatch.chdir(tmp_path)
    config = LoraConfig(r=4, lora_alpha=3, target_modules=["linear_qkv", "linear_proj"], init_lora_weights=False)
    pipe.transformer.add_adapter(config, "trained")
    pipe.save_lora_weights(  # as examples/train_lora.py writes it
        "lora_out",
        transformer_lora_layers=get_peft_model_state_dict(pipe.transformer, adapter_name="trained"),
        transformer_lora_adapter_metadata=pipe.transformer.peft_config["trained"].to_dict(),
    )
    pipe.unload_lora_weights()
    save_file(mirai_state_dict(random_factors(clean.refiner, seed=140), "mirai_kohya"), "refiner_lora.safetensors")
    code = _readme_lora_block()
    assert code.count("pipe(prompt, ") == 1
    code = code.replace("pipe(prompt, ", "pipe(prompt, **call, ")
    namespace = {"pipe": pipe, "prompt": "A red fox trots through fresh snow at dawn", "call": SMALL_CALL}
    exec(compile(code, "README.md:lora", "exec"), namespace)
    assert namespace["out"].frames is not None
    assert not has_tuner_layers(pipe.transformer) and not has_tuner_layers(pipe.refiner)

    pipe.load_lora_weights("style_lora", adapter_name="again")
    assert {m.scaling["again"] for m in pipe.transformer.modules() if hasattr(m, "scaling")} == {0.75}
    again = outputs(pipe, inputs)["transformer"]
    pipe.unload_lora_weights()
    pipe.load_lora_weights("lora_out/pytorch_lora_weights.safetensors", adapter_name="from_file")
    assert torch.equal(outputs(pipe, inputs)["transformer"], again)
