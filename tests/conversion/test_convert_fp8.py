"""``magi2-convert --expert_dtype fp8_e4m3``: the FP8 repo equals quantize-at-load of the bf16 repo bit for bit,
its expert weights take half the bytes on disk, bad combinations are refused before anything is written."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.convert_testing_utils import checkpoint_dir, config_path, expert_bytes, run_cli

from diffusers_magi2 import Magi2Transformer3DModel
from diffusers_magi2.conversion.cli import main


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("convert_fp8")
    common = [
        "--preview_dir",
        checkpoint_dir("preview_h4"),
        "--config",
        config_path("preview_h4"),
        "--components",
        "transformer",
        "--dtype",
        "bf16",
        "--max_shard_size",
        "300KB",
    ]
    rc, _, err = run_cli([*common, "--output_path", root / "bf16"])
    assert rc == 0, err
    rc, _, err = run_cli([*common, "--output_path", root / "fp8", "--expert_dtype", "fp8_e4m3"])
    assert rc == 0, err
    return root / "bf16" / "transformer", root / "fp8" / "transformer"


def test_converter_fp8_repo_equals_quantize_at_load_bit_for_bit(converted):
    bf16_repo, fp8_repo = converted
    assert json.loads((fp8_repo / "config.json").read_text())["expert_dtype"] == "float8_e4m3fn"
    assert json.loads((bf16_repo / "config.json").read_text())["expert_dtype"] is None
    from_repo = Magi2Transformer3DModel.from_pretrained(fp8_repo, dtype=torch.bfloat16)
    at_load = Magi2Transformer3DModel.from_pretrained(bf16_repo, dtype=torch.bfloat16, expert_dtype="float8_e4m3fn")
    a, b = from_repo.state_dict(), at_load.state_dict()
    assert a.keys() == b.keys()
    assert sum(t.dtype == torch.float8_e4m3fn for t in a.values()) == 2 * 3  # 2 MoE layers x 3 banks
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(_bits(a[k]), _bits(b[k])), k


def test_converter_fp8_expert_weights_take_at_most_055_of_bf16_on_disk(converted):
    bf16_repo, fp8_repo = converted
    (bf16_banks, bf16_scales), (fp8_banks, fp8_scales) = expert_bytes(bf16_repo), expert_bytes(fp8_repo)
    ratio = fp8_banks / bf16_banks
    print(
        f"\nrouted-expert weights on disk: FP8 {fp8_banks} B / bf16 {bf16_banks} B = {ratio:.3f} "
        f"(+ {fp8_scales} B of fp32 scales, not counted)"
    )
    assert bf16_scales == 0 and fp8_scales > 0
    assert ratio <= 0.55


def test_converter_expert_dtype_bad_choices_are_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:  # argparse: bad usage
        main(
            [
                "--preview_dir",
                str(checkpoint_dir("preview_h4")),
                "--components",
                "transformer",
                "--output_path",
                str(tmp_path / "x"),
                "--expert_dtype",
                "int8",
            ]
        )
    assert exit_info.value.code == 2 and "--expert_dtype: invalid choice: 'int8'" in capsys.readouterr().err
    rc, _, err = run_cli(
        [
            "--refiner_dir",
            checkpoint_dir("refiner"),
            "--components",
            "refiner",
            "--output_path",
            tmp_path / "y",
            "--expert_dtype",
            "fp8_e4m3",
        ]
    )
    assert rc == 2 and "--expert_dtype applies to the transformer's routed experts" in err
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_converter_dry_run_lays_out_fp8_banks_and_scales(tmp_path):
    rc, out, err = run_cli(
        [
            "--preview_dir",
            checkpoint_dir("preview_h4"),
            "--config",
            config_path("preview_h4"),
            "--components",
            "transformer",
            "--dry_run",
            "--output_path",
            tmp_path / "z",
            "--expert_dtype",
            "fp8_e4m3",
        ]
    )
    assert rc == 0, err
    assert not (tmp_path / "z").exists()
    lines = out.splitlines()
    assert "routed experts in FP8 (float8_e4m3fn): 6 banks, each with an fp32 _scale" in out
    assert ": 137 tensors," in out  # 131 + 6 scales
    fp8_total = int(next(line for line in lines if line.startswith("output transformer/")).split(", ")[1].split()[0])
    rc, out, err = run_cli(
        [
            "--preview_dir",
            checkpoint_dir("preview_h4"),
            "--config",
            config_path("preview_h4"),
            "--components",
            "transformer",
            "--dry_run",
            "--output_path",
            tmp_path / "z",
        ]
    )
    bf16_total = int(
        next(line for line in out.splitlines() if line.startswith("output transformer/")).split(", ")[1].split()[0]
    )
    banks = 2 * 3 * 4 * 8 * 32 * 64  # 2 MoE layers x 3 banks x H*E rows x Dh*De, 1 byte instead of 2
    scales = 2 * 4 * 8 * (64 + 64 + 32) * 4
    assert bf16_total - fp8_total == banks - scales


def test_converter_fp8_refuses_a_non_finite_expert_weight_naming_it_and_writes_nothing(tmp_path):
    from helpers.convert_testing_utils import copy_checkpoint, mutate_tensor

    from diffusers_magi2.loaders.key_plan import target_to_source_key

    ckpt = copy_checkpoint("preview_h4", tmp_path / "ckpt")
    key = target_to_source_key("transformer_blocks.1.mlp.moe_mlp.W_down")
    experts = Magi2Transformer3DModel.from_original_checkpoint(ckpt).transformer_blocks[1].mlp.moe_mlp.num_experts

    def poison(w):
        w = w.clone()
        w[2 * experts + 1, 4, 9] = float("nan")  # head 2, expert 1, input row 4, output column 9
        return w

    mutate_tensor(ckpt, key, poison)
    out = tmp_path / "out"
    args = ["--preview_dir", ckpt, "--config", config_path("preview_h4"), "--components", "transformer"]
    rc, _, err = run_cli([*args, "--output_path", out, "--expert_dtype", "fp8_e4m3"])
    assert rc != 0
    assert key in err and "non-finite weight (nan) in expert 1 of head 2" in err and "column 9" in err, err
    assert not out.exists() and not list(tmp_path.glob(".out*")), "a half-written repo was left behind"
