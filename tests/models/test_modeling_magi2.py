"""Magi2ModelMixin, shared by both transformers: dtype moves keep the fp32 islands, saves keep other variants."""

from __future__ import annotations

import copy
import inspect
import logging

import pytest
import torch
from helpers.tiny_transformer import TINY, tiny_inputs, tiny_model
from safetensors.torch import load_file

from diffusers_magi2 import Magi2RefinerTransformer3DModel, Magi2Transformer3DModel
from diffusers_magi2.models.mhc import Magi2HyperConnection
from diffusers_magi2.moe.layer import Magi2MultiHeadMoE
from diffusers_magi2.pipelines.tiny_default import build_tiny_random_pipeline


REFINER = "magi2_tiny/refiner"

MOVES = {
    "to(dtype)": (lambda m: m.to(torch.bfloat16), torch.bfloat16),
    "to(dtype=)": (lambda m: m.to(dtype=torch.bfloat16), torch.bfloat16),
    "to(device, dtype)": (lambda m: m.to("cpu", torch.bfloat16), torch.bfloat16),
    "to(None, dtype)": (lambda m: m.to(None, torch.bfloat16), torch.bfloat16),  # what DiffusionPipeline.to calls
    "bfloat16()": (lambda m: m.bfloat16(), torch.bfloat16),
    "half()": (lambda m: m.half(), torch.float16),
    "type(dtype)": (lambda m: m.type(torch.bfloat16), torch.bfloat16),
}


@pytest.fixture(scope="module")
def refiner_fp32(fixtures_dir):
    return Magi2RefinerTransformer3DModel.from_original_checkpoint(
        fixtures_dir / REFINER / "sandai_checkpoint", torch_dtype=torch.float32
    )


@pytest.fixture(scope="module")
def refiner_case(fixtures_dir):
    return load_file(str(fixtures_dir / REFINER / "bf16/transformer_case.safetensors"))


@pytest.fixture
def model_and_call(request, refiner_fp32, refiner_case):
    """``(fp32 model, call)`` for ``"preview"`` or ``"refiner"``; ``call(model)`` runs one forward on fixed inputs."""
    if request.param == "preview":
        inputs = tiny_inputs()
        return tiny_model(), lambda m: m(**inputs)
    case = {k: refiner_case["noaudio.pipeline." + k] for k in ("latent", "txt_feat")}
    return copy.deepcopy(refiner_fp32), lambda m: m(
        hidden_states=case["latent"], encoder_hidden_states=case["txt_feat"]
    )


def _floating(model):
    return {n: t for n, t in model.state_dict().items() if t.is_floating_point()}


def _island_names(model):
    names = {n for n in _floating(model) if model.is_fp32_island(n)}
    assert names and len(names) < len(_floating(model))
    return names


@pytest.mark.parametrize("move", list(MOVES))
@pytest.mark.parametrize("model_and_call", ["preview", "refiner"], indirect=True)
def test_dtype_move_keeps_every_fp32_island_fp32_and_exact(model_and_call, move):
    model, _ = model_and_call
    before = {n: t.clone() for n, t in _floating(model).items()}
    islands = _island_names(model)
    cast, dtype = MOVES[move]
    assert cast(model) is model
    after = _floating(model)
    assert {n: t.dtype for n, t in after.items()} == {n: torch.float32 if n in islands else dtype for n in after}
    # the islands were not rounded through the low dtype on the way
    assert all(torch.equal(after[n], before[n]) for n in islands)
    assert model.dtype == dtype
    model.float()
    assert all(torch.equal(_floating(model)[n], before[n]) for n in islands)


def test_preview_island_families_are_covered():
    names = _island_names(tiny_model())
    families = ("pre_adapter", "post_adapter", "sinks", "router", "gate", "q_norm", "k_norm", "pre_norm")
    families += ("mhc_attn", "mhc_mlp", "mhc_norm")
    assert all(any(f in n.split(".") for n in names) for f in families)
    assert "pre_adapter.rope.bands" in names


@pytest.mark.parametrize("model_and_call", ["preview", "refiner"], indirect=True)
def test_keep_in_fp32_modules_names_only_what_the_model_has(model_and_call):
    """Every ``_keep_in_fp32_modules`` entry is a module (or, for sinks, the router gate and FP8 scales, a
    parameter) of the model; the preview's mHC islands are its ``Magi2HyperConnection`` sites and ``mhc_norm``."""
    model, _ = model_and_call
    if isinstance(model, Magi2Transformer3DModel):
        model = tiny_model(expert_dtype="float8_e4m3fn")  # the FP8 scales exist only with FP8 experts
    model.enable_fp8_storage()  # and the dense projections' scales only with FP8 storage
    modules = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    tensors = {name.rsplit(".", 1)[-1] for name, _ in [*model.named_parameters(), *model.named_buffers()]}
    unknown = [m for m in model._keep_in_fp32_modules if m not in modules | tensors]
    assert not unknown
    if isinstance(model, Magi2Transformer3DModel):
        sites = [(n, m) for n, m in model.named_modules() if isinstance(m, Magi2HyperConnection)]
        assert len(sites) == 2 * TINY["num_layers"]
        assert {n.rsplit(".", 1)[-1] for n, _ in sites} == {"mhc_attn", "mhc_mlp"}
        assert {"mhc_attn", "mhc_mlp", "mhc_norm"} <= set(model._keep_in_fp32_modules)
        # the islands are listed by module: no entry is an mHC parameter's own name
        assert not {n for m in (s for _, s in sites) for n, _ in m.named_parameters()} & set(
            model._keep_in_fp32_modules
        )


def _mhc_parameters(model) -> dict:
    """Every mHC parameter: the two sites' and ``mhc_norm``'s, by name."""
    names = [n for n, m in model.named_modules() if isinstance(m, Magi2HyperConnection) or n.endswith(".mhc_norm")]
    params = {f"{n}.{p}": t for n in names for p, t in model.get_submodule(n).named_parameters()}
    assert len(params) == TINY["num_layers"] * (2 * 7 + 1)
    return params


def test_every_mhc_parameter_stays_fp32_through_moves_loads_and_layerwise_casting(tmp_path):
    model = tiny_model()
    before = {n: t.detach().clone() for n, t in _mhc_parameters(model).items()}
    assert all(t.dtype == torch.float32 for t in before.values())

    def fp32_and_exact(m):
        now = _mhc_parameters(m)
        return now.keys() == before.keys() and all(
            t.dtype == torch.float32 and torch.equal(t, before[n]) for n, t in now.items()
        )

    model.save_pretrained(tmp_path)
    assert fp32_and_exact(model.to(torch.bfloat16))
    assert fp32_and_exact(Magi2Transformer3DModel.from_pretrained(tmp_path, torch_dtype=torch.bfloat16))

    cast = tiny_model()
    cast.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)
    assert fp32_and_exact(cast)
    seen = []  # the dtypes each site's parameters have while it runs: no cast hook touches them
    for module in cast.modules():
        if isinstance(module, Magi2HyperConnection):
            module.register_forward_pre_hook(lambda m, _: seen.extend(p.dtype for p in m.parameters()))
    with torch.no_grad():
        cast(**tiny_inputs(dtype=torch.bfloat16))
    assert len(seen) == 2 * TINY["num_layers"] * 7 and set(seen) == {torch.float32}
    assert fp32_and_exact(cast)


@pytest.mark.parametrize("model_and_call", ["preview", "refiner"], indirect=True)
def test_dtype_move_equals_from_pretrained_dtype(model_and_call, tmp_path, monkeypatch):
    """``.to(bf16)`` gives the model ``from_pretrained(dtype=bf16)`` loads: same tensors, routing and output."""
    model, call = model_and_call
    model.save_pretrained(tmp_path)
    loaded = type(model).from_pretrained(tmp_path, dtype=torch.bfloat16, local_files_only=True).eval()
    moved = model.to(torch.bfloat16)
    a, b = moved.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys()
    assert all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)

    routes: list[torch.Tensor] = []
    route = Magi2MultiHeadMoE.route

    def recording_route(self, x_local):
        probs, indices = route(self, x_local)
        routes.append(indices)
        return probs, indices

    monkeypatch.setattr(Magi2MultiHeadMoE, "route", recording_route)
    with torch.no_grad():
        out_moved, out_loaded = call(moved), call(loaded)
    assert torch.equal(out_moved.sample, out_loaded.sample)
    if isinstance(model, Magi2Transformer3DModel):
        assert len(routes) == 2 and torch.equal(routes[0], routes[1])


def test_dtype_move_does_not_warn_about_fp32_modules():
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("diffusers.models.modeling_utils")
    logger.addHandler(handler)
    try:
        tiny_model().to(torch.bfloat16)
    finally:
        logger.removeHandler(handler)
    assert not [r for r in records if "float32" in r.getMessage()]


def test_pipeline_to_dtype_keeps_the_transformer_fp32_islands():
    pipe = build_tiny_random_pipeline()
    before = {n: t.clone() for n, t in _floating(pipe.transformer).items()}
    islands = _island_names(pipe.transformer)
    pipe.to(torch.bfloat16)
    after = _floating(pipe.transformer)
    assert {n: t.dtype for n, t in after.items()} == {
        n: torch.float32 if n in islands else torch.bfloat16 for n in after
    }
    assert all(torch.equal(after[n], before[n]) for n in islands)
    # the tiny default's own bf16 build is the same move
    built = build_tiny_random_pipeline(dtype=torch.bfloat16).transformer.state_dict()
    assert all(
        t.dtype == built[n].dtype and torch.equal(t, built[n]) for n, t in pipe.transformer.state_dict().items()
    )


@pytest.mark.parametrize("model_and_call", ["preview", "refiner"], indirect=True)
def test_layerwise_casting_and_group_offload_keep_fp32_islands(model_and_call):
    model, call = model_and_call
    islands = _island_names(model)
    before = {n: t.clone() for n, t in _floating(model).items() if n in islands}
    model.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32)
    after = _floating(model)
    assert all(after[n].dtype == torch.float32 and torch.equal(after[n], before[n]) for n in islands)
    assert any(t.dtype == torch.float8_e4m3fn for t in after.values())  # the dense projections are stored in FP8
    with torch.no_grad():
        reference = call(model).sample
    # group offload moves what layerwise casting stores, dtypes and values as they are
    model.enable_group_offload(torch.device("cpu"), offload_type="leaf_level")
    with torch.no_grad():
        out = call(model).sample
    after = _floating(model)
    assert all(after[n].dtype == torch.float32 and torch.equal(after[n], before[n]) for n in islands)
    torch.testing.assert_close(out, reference, atol=0, rtol=0)


# ------------------------------------------------------------------------------------------------ save_pretrained

SAVE_ARGS = (
    "save_directory",
    "is_main_process",
    "save_function",
    "safe_serialization",
    "variant",
    "max_shard_size",
    "push_to_hub",
)


@pytest.mark.parametrize("cls", [Magi2Transformer3DModel, Magi2RefinerTransformer3DModel])
def test_save_pretrained_names_the_diffusers_arguments(cls):
    params = inspect.signature(cls.save_pretrained).parameters
    assert tuple(params)[1 : 1 + len(SAVE_ARGS)] == SAVE_ARGS
    assert params["variant"].default is None and params["safe_serialization"].default is True


def _shards(folder, variant=None):
    infix = f".{variant}-" if variant else "-"
    return sorted(p.name for p in folder.glob(f"diffusion_pytorch_model{infix}*-of-*.safetensors"))


@pytest.mark.parametrize("model_and_call", ["preview", "refiner"], indirect=True)
def test_saving_one_variant_keeps_the_other_variants_files(model_and_call, tmp_path):
    model, _ = model_and_call
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    bf16.save_pretrained(tmp_path, variant="bf16", max_shard_size="100KB")
    default_files, bf16_files = _shards(tmp_path), _shards(tmp_path, "bf16")
    assert len(default_files) >= 2 and len(bf16_files) >= 2
    model.save_pretrained(tmp_path, max_shard_size="100KB")  # diffusers 0.42.1 alone deletes the bf16 shards here
    assert _shards(tmp_path, "bf16") == bf16_files and _shards(tmp_path) == default_files
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    for variant, dtype, source in ((None, torch.float32, model), ("bf16", torch.bfloat16, bf16)):
        loaded = type(model).from_pretrained(tmp_path, variant=variant, dtype=dtype, local_files_only=True)
        assert all(
            torch.equal(a, b) and a.dtype == b.dtype
            for a, b in zip(loaded.state_dict().values(), source.state_dict().values())
        )


def test_pipeline_save_forwards_variant_shard_size_and_serialization(tmp_path):
    from diffusers_magi2 import Magi2Pipeline

    pipe = build_tiny_random_pipeline()
    pipe.save_pretrained(tmp_path / "sharded", variant="bf16", max_shard_size="200KB")
    folder = tmp_path / "sharded" / "transformer"
    assert len(_shards(folder, "bf16")) >= 2 and not _shards(folder)
    assert (folder / "diffusion_pytorch_model.safetensors.index.bf16.json").is_file()
    loaded = Magi2Pipeline.from_pretrained(tmp_path / "sharded", variant="bf16")
    ref = pipe.transformer.state_dict()
    assert all(torch.equal(t, ref[n]) for n, t in loaded.transformer.state_dict().items())

    pipe.save_pretrained(tmp_path / "pickled", safe_serialization=False)
    names = {p.name for p in (tmp_path / "pickled" / "transformer").iterdir()}
    assert "diffusion_pytorch_model.bin" in names and not any(n.endswith(".safetensors") for n in names)


@pytest.mark.parametrize("checked", ["before loading", "before loading, sharded", "from the unexpected keys"])
def test_a_repo_with_flat_mhc_names_is_refused_not_left_unloaded(tmp_path, monkeypatch, checked):
    """A repo written when the mHC tensors were flat block parameters would load with those parameters unset."""
    import json
    import re

    from safetensors.torch import save_file

    from diffusers_magi2.models import transformer_magi2

    def flat(key):
        return re.sub(r"\.mhc_(attn|mlp)\.(\w+)$", r".mhc_\2_\1", key)

    tiny_model().save_pretrained(tmp_path, max_shard_size="200KB" if "sharded" in checked else "10GB")
    for path in tmp_path.glob("*.safetensors"):
        save_file({flat(k): v for k, v in load_file(path).items()}, path, metadata={"format": "pt"})
    for index in tmp_path.glob("*.index.json"):
        data = json.loads(index.read_text())
        data["weight_map"] = {flat(k): v for k, v in data["weight_map"].items()}
        index.write_text(json.dumps(data))
    assert ("sharded" in checked) == any(tmp_path.glob("*.index.json"))
    if checked == "from the unexpected keys":  # as for a Hub id: no local file to read first
        monkeypatch.setattr(transformer_magi2, "_check_local_mhc_names", lambda path, kwargs: False)
    with pytest.raises(ValueError, match=r"names 28 mHC tensors the flat way .*mhc_\{site\}\.\{param\}"):
        Magi2Transformer3DModel.from_pretrained(tmp_path)
    for path in [*tmp_path.glob("*.safetensors"), *tmp_path.glob("*.index.json")]:
        path.unlink()
    tiny_model().save_pretrained(tmp_path)
    model, info = Magi2Transformer3DModel.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert all(not p.is_meta for p in model.parameters())


def test_a_local_bin_repo_with_flat_mhc_names_is_refused_from_the_loading_info(tmp_path):
    """Local weights other than safetensors have no header to read first: the loading info still names them."""
    import re

    def flat(key):
        return re.sub(r"\.mhc_(attn|mlp)\.(\w+)$", r".mhc_\2_\1", key)

    tiny_model().save_pretrained(tmp_path, safe_serialization=False)
    (path,) = tmp_path.glob("*.bin")
    torch.save({flat(k): v for k, v in torch.load(path, weights_only=True).items()}, path)
    with pytest.raises(ValueError, match=r"names 28 mHC tensors the flat way"):
        Magi2Transformer3DModel.from_pretrained(tmp_path)
