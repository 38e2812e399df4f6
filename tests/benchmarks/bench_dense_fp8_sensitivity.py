"""Which dense projections can be FP8-stored within twice bf16's error (not collected by pytest): per-group
sensitivity of per-channel FP8 storage on the refiner fixture and the preview fixtures with the fp32 routes held fixed.

    OMP_NUM_THREADS=1 .venv/bin/python -m tests.benchmarks.bench_dense_fp8_sensitivity [--cases refiner preview_h4]

Each row stores one group of the projections ``enable_fp8_storage`` stores in per-channel e4m3, the rest bf16 (the
embedders, the final projection and the other fp32 islands are never stored; MAGI-2 has no adaLN), and prints
``model.out``'s rel-L2 against the fp32 fixture as a multiple of the bf16 model's, beside the group's share of the
stored projections' bytes on the fixture and at the released size; the "all but" column stores every other
projection. A group is a module-name pattern, as ``enable_layerwise_casting(skip_modules_pattern=...)`` takes.

Let ``e_b`` be the bf16 model's rel-L2 and ``d_p = ||out_p - out_bf16|| / ||target||`` the change when projection
``p`` alone is stored in FP8. Independent roundings add in quadrature, so storing a set ``S`` errs about

    e_S = sqrt(e_b^2 + sum_{p in S} d_p^2),

and ``e_S <= 2 e_b`` allows ``sum d_p^2 <= 3 e_b^2``. The sum overstates the whole model's error (the roundings
partly cancel), so the ``d_p^2`` are scaled by ``c`` to give the measured error with every projection stored. The
largest byte share within ``c sum d_p^2 <= 3 e_b^2`` (an exact 0/1 knapsack over the single projections) is printed
with its predicted and its measured multiple of ``e_b``.
"""

from __future__ import annotations

import argparse
import copy
import re

import torch

from diffusers_magi2 import Magi2RefinerTransformer3DModel, Magi2Transformer3DModel
from diffusers_magi2.models.fp8_storage_magi2 import apply_fp8_storage
from tests.helpers.fixture_forward import preview_out, refiner_out
from tests.helpers.fixtures import golden, golden_path


CASES = {"refiner": "", "preview_h4": "", "preview_h4_i2v": "i2v.", "preview_h3": ""}
GROUPS = {  # name: module-name regex of the projections stored in FP8
    "attention gate (linear_g)": r"linear_g$",
    "attention qkv": r"linear_qkv$",
    "attention out (linear_proj)": r"linear_proj$",
    "MLP in (up_gate_proj, shared fc1)": r"(up_gate_proj|fc1)$",
    "MLP out (down_proj, shared fc2)": r"(down_proj|fc2)$",
    "MoE split/merge": r"(split|merge)_linear$",
    "attention": r"\.attention\.",
    "MLP": r"\.mlp\.",
    "first block": r"^transformer_blocks\.0\.",
    "middle blocks": "MIDDLE",
    "last block": "LAST",
}


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b|| / ||b||`` in float64."""
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def load_case(case: str):
    """``(bf16 model, run(model) -> out, target)`` of a fixture case; the preview runs with the fp32 routes."""
    folder = case.removesuffix("_i2v")
    path = golden_path(f"magi2_tiny/{folder}/sandai_checkpoint")
    d = golden(f"magi2_tiny/{folder}/fp32/transformer_case.safetensors")
    if folder == "refiner":
        bf16 = Magi2RefinerTransformer3DModel.from_original_checkpoint(path, dtype=torch.bfloat16)
        return bf16, lambda m: refiner_out(m, d), d["noaudio.model.out"]
    prefix = CASES[case]
    fp32 = Magi2Transformer3DModel.from_original_checkpoint(path, dtype=torch.float32)
    _, routes = preview_out(fp32, d, prefix)
    bf16 = Magi2Transformer3DModel.from_original_checkpoint(path, dtype=torch.bfloat16)
    return bf16, lambda m: preview_out(m, d, prefix, forced=routes)[0], d[prefix + "model.out"]


def stored(model, names) -> torch.nn.Module:
    """A copy of ``model`` with the projections ``names`` FP8-stored (per-channel scales)."""
    model = copy.deepcopy(model)
    for name, module in model.named_modules():
        if name in names:
            apply_fp8_storage(module, torch.bfloat16, f"{name}.weight")
    return model


def matching(names, pattern: str, last: int) -> set:
    """The projection names a group's pattern selects (``LAST``: the last block's, ``MIDDLE``: the others but the
    first's)."""
    middle = "|".join(str(k) for k in range(1, last))
    pattern = {"LAST": rf"^transformer_blocks\.{last}\.", "MIDDLE": rf"^transformer_blocks\.({middle})\."}.get(
        pattern, pattern
    )
    return {n for n in names if re.search(pattern, n)}


def released_numel(case: str) -> tuple:
    """``({name: weight elements}, last block index)`` of the stored projections at the released size (on meta)."""
    cls = Magi2RefinerTransformer3DModel if case == "refiner" else Magi2Transformer3DModel
    with torch.device("meta"):
        model = cls()
    return {n: m.weight.numel() for n, m in model._dense_projections()}, len(model.transformer_blocks) - 1


def largest_share(numel: dict, d2: dict, budget: float) -> tuple:
    """The set of projections with the most elements whose ``sum d2 <= budget`` (exact 0/1 knapsack)."""
    best = {0: (0.0, ())}  # elements -> (least sum d2, names)
    for name, n in numel.items():
        for total, (s, names) in list(best.items()):
            if s + d2[name] <= budget and best.get(total + n, (budget + 1,))[0] > s + d2[name]:
                best[total + n] = (s + d2[name], names + (name,))
    return best[max(best)]


def measure(case: str) -> None:
    bf16, run, target = load_case(case)
    numel = {n: m.weight.numel() for n, m in bf16._dense_projections()}
    total, last = sum(numel.values()), len(bf16.transformer_blocks) - 1
    released, released_last = released_numel(case)
    out_b = run(bf16)
    e_b = rel_l2(out_b, target)
    err = lambda names: rel_l2(run(stored(bf16, names)), target) / e_b  # noqa: E731
    every = err(set(numel))
    print(f"\n{case}: bf16 rel-L2 {e_b:.4f}; every projection FP8: {every:.2f} x bf16")
    print("| FP8-stored | bytes (fixture / released) | only these FP8 | all but these FP8 |\n|---|---|---|---|")
    for group, pattern in GROUPS.items():
        names = matching(numel, pattern, last)
        if not names:
            continue
        share = sum(numel[n] for n in names) / total
        big = matching(released, pattern, released_last)
        share_released = sum(released[n] for n in big) / sum(released.values())
        print(
            f"| {group} | {share:.0%} / {share_released:.0%} | {err(names):.2f} x | {err(set(numel) - names):.2f} x |"
        )
    change = lambda out: ((out.double() - out_b.double()).norm() / target.double().norm()).item()  # noqa: E731
    d2 = {n: change(run(stored(bf16, {n}))) ** 2 for n in numel}
    c = (every**2 - 1) * e_b**2 / sum(d2.values())
    s, names = largest_share(numel, {n: c * v for n, v in d2.items()}, 3 * e_b**2)
    print(
        f"largest FP8 share within 2 x bf16 by quadrature (c = {c:.2f}): {sum(numel[n] for n in names) / total:.0%} "
        f"of the bytes, predicted {(e_b**2 + s) ** 0.5 / e_b:.2f} x, measured {err(set(names)):.2f} x: "
        + ", ".join(sorted(names))
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", choices=sorted(CASES), default=["refiner", "preview_h4"])
    for case in parser.parse_args().cases:
        measure(case)


if __name__ == "__main__":
    main()
