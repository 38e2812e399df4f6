"""``magi2-convert --expert_dtype int4``: the int4 repo equals quantize-at-load of the bf16 repo bit for bit and loads
as int4 from its config alone, its routed experts take at most 0.30 of the bf16 bytes on disk (scales included), and
bad group sizes or weights are refused before anything is written."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.convert_testing_utils import (
    checkpoint_dir,
    config_path,
    copy_checkpoint,
    expert_bytes,
    mutate_tensor,
    run_cli,
)

from diffusers_magi2 import Magi2Transformer3DModel


GROUP = 32  # the tiny fixtures' MoE heads are 32 wide
SOURCE = ["--preview_dir", checkpoint_dir("preview_h4"), "--config", config_path("preview_h4")]
COMMON = [*SOURCE, "--components", "transformer", "--dtype", "bf16", "--max_shard_size", "300KB"]
INT4 = ["--expert_dtype", "int4", "--expert_int4_group_size", str(GROUP)]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("convert_int4")
    for name, extra in (("bf16", []), ("int4", INT4)):
        rc, _, err = run_cli([*COMMON, "--output_path", root / name, *extra])
        assert rc == 0, err
    return root / "bf16" / "transformer", root / "int4" / "transformer"


def test_converter_int4_repo_equals_quantize_at_load_bit_for_bit(converted):
    bf16_repo, int4_repo = converted
    config = json.loads((int4_repo / "config.json").read_text())
    assert (config["expert_dtype"], config["expert_int4_group_size"], config["expert_int4_packing"]) == (
        "int4",
        GROUP,
        "nf4_pairs_along_n",
    )
    from_repo = Magi2Transformer3DModel.from_pretrained(int4_repo, dtype=torch.bfloat16)  # no int4 argument
    at_load = Magi2Transformer3DModel.from_pretrained(
        bf16_repo, dtype=torch.bfloat16, expert_dtype="int4", expert_int4_group_size=GROUP
    )
    a, b = from_repo.state_dict(), at_load.state_dict()
    assert a.keys() == b.keys()
    assert sum(t.dtype == torch.uint8 for t in a.values()) == 2 * 3  # 2 MoE layers x 3 banks
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def test_converter_int4_expert_bytes_with_their_scales_take_at_most_030_of_bf16_on_disk(converted):
    (bf16_banks, bf16_scales), (codes, scales) = (expert_bytes(folder) for folder in converted)
    ratio = (codes + scales) / bf16_banks
    print(
        f"\nrouted-expert bytes on disk at group {GROUP}: int4 {codes} B + bf16 group scales {scales} B = "
        f"{ratio:.4f} of bf16 {bf16_banks} B (4 + 16/G bits per weight; at the default G = 128: "
        f"{(4 + 16 / 128) / 16:.4f})"
    )
    assert bf16_scales == 0 and codes == bf16_banks // 4 and scales == bf16_banks // GROUP
    assert ratio <= 0.30


def test_converter_dry_run_lays_out_int4_codes_and_group_scales(tmp_path):
    totals = {}
    for name, extra in (("bf16", []), ("int4", INT4)):
        rc, out, err = run_cli(
            [*SOURCE, "--components", "transformer", "--dry_run", "--output_path", tmp_path, *extra]
        )
        assert rc == 0, err
        line = next(line for line in out.splitlines() if line.startswith("output transformer/"))
        totals[name] = int(line.split(", ")[1].split()[0])
    assert f"routed experts in int4 (NF4, group size {GROUP}): 6 banks, each with a bf16 _group_scale" in out
    assert not list(tmp_path.iterdir())
    weights = 2 * 3 * 4 * 8 * 32 * 64  # 2 MoE layers x 3 banks x H*E rows x Dh*De, 2 bytes -> half a byte
    scales = 2 * 4 * 8 * (1 * 64 + 1 * 64 + 2 * 32) * 2  # [H*E, K/G, N] bf16 per bank
    assert totals["bf16"] - totals["int4"] == weights * 2 - weights // 2 - scales


def test_converter_int4_group_size_and_expert_dtype_errors_come_before_anything_is_written(tmp_path, capsys):
    from diffusers_magi2.conversion.cli import main

    out = tmp_path / "out"
    rc, _, err = run_cli([*COMMON, "--output_path", out, "--expert_dtype", "int4"])  # 128 does not divide 32
    allowed = "pass --expert_int4_group_size with one of 1, 2, 4, 8, 16, 32"  # the divisors of Dh = De = 32
    assert rc == 2 and "--expert_int4_group_size 128 (the default) does not divide" in err and allowed in err, err
    assert err.count("\n") == 1, err  # one line, argparse's form
    rc, _, err = run_cli([*COMMON, "--output_path", out, "--expert_int4_group_size", "16"])
    assert rc == 2 and "--expert_int4_group_size applies to --expert_dtype int4" in err, err
    with pytest.raises(SystemExit) as exit_info:  # bad usage (a bad group size: test_convert_repo.py)
        main([*(str(a) for a in COMMON), "--output_path", str(out), "--expert_dtype", "int8"])
    message = "--expert_dtype: invalid choice: int8 (choose from fp8_e4m3, int4)"  # quotes vary with Python
    assert exit_info.value.code == 2 and message in capsys.readouterr().err.replace("'", "")
    assert not out.exists() and not list(tmp_path.glob(".out*"))


def test_converter_int4_refuses_a_non_finite_expert_weight_naming_it_and_writes_nothing(tmp_path):
    from diffusers_magi2.loaders.key_plan import target_to_source_key

    ckpt = copy_checkpoint("preview_h4", tmp_path / "ckpt")
    key = target_to_source_key("transformer_blocks.1.mlp.moe_mlp.W_up")

    def poison(w):
        w = w.clone()
        w[8 + 3, 4, 9] = float("inf")  # head 1, expert 3 (8 experts per head), input row 4, output column 9
        return w

    mutate_tensor(ckpt, key, poison)
    out = tmp_path / "out"
    args = ["--preview_dir", ckpt, "--config", config_path("preview_h4"), "--components", "transformer"]
    rc, _, err = run_cli([*args, "--output_path", out, *INT4])
    assert rc != 0
    assert key in err and "non-finite weight (inf) in expert 3 of head 1" in err and "column 9" in err, err
    assert "its int4 group scale" in err
    assert not out.exists() and not list(tmp_path.glob(".out*")), "a half-written repo was left behind"


def test_the_request_check_uses_the_quantizers_default_group_and_passes_the_released_widths():
    """The torch-free request check assumes the quantizer's default group size, which divides the released MoE
    widths (Dh = 256, De = 1280): a released conversion to int4 needs no --expert_int4_group_size."""
    from diffusers_magi2.conversion.request import DEFAULT_INT4_GROUP_SIZE, ConversionRequest, request_problems
    from diffusers_magi2.moe.quantize_int4 import INT4_GROUP_SIZE

    assert DEFAULT_INT4_GROUP_SIZE == INT4_GROUP_SIZE
    req = ConversionRequest(output_path="unused", components=["transformer"], expert_dtype="int4")
    assert not [p for p in request_problems(req) if "expert_int4_group_size" in p]
    req.expert_int4_group_size = 96
    assert any("one of 1, 2, 4, 8, 16, 32, 64, 128, 256" in p for p in request_problems(req))
