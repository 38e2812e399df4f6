"""``magi2-convert --dense_storage_dtype fp8_e4m3``: the transformer's and the refiner's dense projections are written
as e4m3 ``weight`` codes beside fp32 ``weight_scale`` rows; ``from_pretrained`` of the repo equals
``enable_fp8_storage`` on the bf16 repo bit for bit (same keys), the dense weights take about half their bf16
bytes on disk, and a request without a model to store is refused before anything is written."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.convert_testing_utils import checkpoint_dir, config_path, run_cli
from safetensors import safe_open

from diffusers_magi2 import Magi2RefinerTransformer3DModel, Magi2Transformer3DModel


FP8 = torch.float8_e4m3fn
MODELS = {
    "transformer": ("preview_h4", "--preview_dir", Magi2Transformer3DModel),
    "refiner": ("refiner", "--refiner_dir", Magi2RefinerTransformer3DModel),
}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == FP8 else t


@pytest.fixture(scope="module", params=list(MODELS))
def converted(request, tmp_path_factory):
    component = request.param
    variant, flag, cls = MODELS[component]
    root = tmp_path_factory.mktemp(f"dense_fp8_{component}")
    common = [flag, checkpoint_dir(variant), "--config", config_path(variant), "--components", component]
    common += ["--dtype", "bf16", "--max_shard_size", "300KB"]
    rc, _, err = run_cli([*common, "--output_path", root / "bf16"])
    assert rc == 0, err
    rc, out, err = run_cli([*common, "--output_path", root / "fp8", "--dense_storage_dtype", "fp8_e4m3"])
    assert rc == 0, err
    return root / "bf16" / component, root / "fp8" / component, cls


def _file_tensors(folder) -> dict:
    out = {}
    for shard in folder.glob("*.safetensors"):
        with safe_open(str(shard), "pt") as f:
            out |= {k: f.get_tensor(k) for k in f.keys()}
    return out


def test_converted_repo_loads_as_fp8_storage_of_the_bf16_repo_bit_for_bit(converted):
    bf16_repo, fp8_repo, cls = converted
    assert json.loads((fp8_repo / "config.json").read_text())["dense_storage_dtype"] == "float8_e4m3fn"
    index = json.loads((fp8_repo / "diffusion_pytorch_model.safetensors.index.json").read_text())["weight_map"]
    files = _file_tensors(fp8_repo)
    assert set(index) == set(files)  # the index names every written tensor, the scales included
    scales = {k for k in files if k.endswith(".weight_scale")}
    assert scales and all(files[k].dtype == torch.float32 for k in scales)
    assert all(files[k.removesuffix("_scale")].dtype == FP8 for k in scales)

    from_repo = cls.from_pretrained(fp8_repo, torch_dtype=torch.bfloat16)
    stored_now = cls.from_pretrained(bf16_repo, torch_dtype=torch.bfloat16)
    stored_now.enable_fp8_storage()
    a, b = from_repo.state_dict(), stored_now.state_dict()
    assert a.keys() == b.keys() == files.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype == files[k].dtype and torch.equal(_bits(a[k]), _bits(b[k])), k
    assert from_repo.dtype == torch.bfloat16


def test_dense_weights_take_about_half_their_bf16_bytes_on_disk(converted):
    bf16_repo, fp8_repo, _ = converted
    fp8, bf16 = _file_tensors(fp8_repo), _file_tensors(bf16_repo)
    scales = [k for k in fp8 if k.endswith(".weight_scale")]
    dense_bf16 = sum(bf16[k.removesuffix("_scale")].nbytes for k in scales)
    dense_fp8 = sum(fp8[k.removesuffix("_scale")].nbytes + fp8[k].nbytes for k in scales)
    print(
        f"\ndense projections on disk: FP8 + scales {dense_fp8} B / bf16 {dense_bf16} B = {dense_fp8 / dense_bf16:.3f}"
    )
    assert dense_fp8 <= 0.55 * dense_bf16


def test_dense_storage_without_a_transformer_is_refused_before_anything_is_written(tmp_path):
    out = tmp_path / "out"
    rc, _, err = run_cli(
        ["--vae_path", tmp_path, "--components", "vae", "--output_path", out, "--dense_storage_dtype", "fp8_e4m3"]
    )
    assert rc != 0 and "--dense_storage_dtype applies to the transformer's and the refiner's" in err
    assert not out.exists()
