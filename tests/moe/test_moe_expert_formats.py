"""The format registry (:mod:`diffusers_magi2.moe.expert_formats`): the only code that asks a weight its dtype.

The backends (``moe/experts*.py``) never ask: their code holds no format constant, no format check and no dtype
read of a weight, bank or scale (read here from their syntax trees, so a docstring may still name the formats);
and the registry maps every config value and stored dtype to its storage."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from diffusers_magi2.moe.expert_formats import WEIGHT_DTYPES, expert_storage, storage_of, stored_format
from diffusers_magi2.moe.expert_storage_fp8 import Fp8ExpertStorage
from diffusers_magi2.moe.expert_storage_int4 import Int4ExpertStorage
from diffusers_magi2.moe.expert_storage_unquantized import UnquantizedExpertStorage


MOE = Path(__file__).resolve().parents[2] / "diffusers_magi2" / "moe"
BACKENDS = ("experts.py", "experts_backward.py", "experts_triton.py")
#: names that hold a weight, a bank or a scale in the backends
WEIGHT_NAMES = {"w_gate", "w_up", "w_down", "weights", "weight", "w", "wg", "wu", "wd", "banks", "bank", "packed"}
WEIGHT_NAMES |= {"scales", "scale", "s", "bank_scales"}
#: what asks a tensor its format
DTYPE_READS = {"dtype", "element_size", "itemsize", "is_floating_point"}
FORMAT_NAMES = {"is_int4", "FP8_DTYPE", "INT4_PACKED_DTYPE", "INT4_SCALE_DTYPE", "float8_e4m3fn", "uint8", "INT4"}
FORMAT_MODULES = ("quantize", "quantize_int4", "dequantize", "dequantize_triton", "expert_storage_")


def _root_name(node: ast.AST) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def _reexports(tree: ast.Module) -> set[str]:
    """Names listed in ``__all__`` and never read: kept at a backend's path for its callers, not used there."""
    exported = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            exported = {e.value for e in node.value.elts}
    read = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    return exported - read


def format_questions(source: str) -> list[str]:
    """Every place in ``source`` that asks a weight its format: a dtype read of a weight-named value, a format
    constant or check, an import of a format's module (but for names only re-exported)."""
    found = []
    tree = ast.parse(source)
    reexported = _reexports(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and {a.asname or a.name for a in node.names} <= reexported:
            continue
        if isinstance(node, ast.Attribute) and node.attr in DTYPE_READS and _root_name(node.value) in WEIGHT_NAMES:
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, (ast.Name, ast.Attribute)):
            name = node.id if isinstance(node, ast.Name) else node.attr
            if name in FORMAT_NAMES:
                found.append(f"line {node.lineno}: {name}")
        elif isinstance(node, ast.ImportFrom) and node.level and (node.module or "").startswith(FORMAT_MODULES):
            if not (node.module or "").startswith("expert_storage") or node.module.startswith("expert_storage_"):
                found.append(f"line {node.lineno}: from .{node.module} import ...")
    return found


@pytest.mark.parametrize("backend", BACKENDS)
def test_backends_never_ask_a_weight_its_format(backend: str) -> None:
    assert format_questions((MOE / backend).read_text()) == []


def test_the_format_question_finder_finds_each_kind_of_question() -> None:
    """The finder itself: the questions the backends used to ask are all found (so the test above can fail)."""
    questions = """
from .dequantize import is_int4
from .quantize import FP8_DTYPE
int4 = is_int4(w_gate)
fp8 = w_gate.dtype == FP8_DTYPE
upcast = weights[0].dtype != torch.float32
grad = t.dtype if bank.is_floating_point() and bank.element_size() > 1 else torch.float32
kind = scale.dtype in (torch.bfloat16,)
codes = torch.uint8
"""
    found = format_questions(questions)
    assert len(found) == 10, found  # two imports, is_int4, FP8_DTYPE, uint8, five dtype reads
    assert format_questions("y = x.dtype\nstorage = storage_of(weights, scales)\nn = w_gate.shape[0]") == []
    reexport = "__all__ = ['check_fp8_device']\nfrom .expert_storage_fp8 import check_fp8_device\n"
    assert format_questions(reexport) == []
    assert len(format_questions(reexport + "check_fp8_device(x.device)")) == 1


@pytest.mark.parametrize(
    ("expert_dtype", "cls", "scales"),
    [
        (None, UnquantizedExpertStorage, ()),
        ("float8_e4m3fn", Fp8ExpertStorage, ("W_gate_scale", "W_up_scale", "W_down_scale")),
        (torch.float8_e4m3fn, Fp8ExpertStorage, ("W_gate_scale", "W_up_scale", "W_down_scale")),
        ("int4", Int4ExpertStorage, ("W_gate_group_scale", "W_up_group_scale", "W_down_group_scale")),
    ],
)
def test_a_config_value_names_one_storage_with_todays_scale_names(expert_dtype, cls, scales) -> None:
    storage = expert_storage(expert_dtype, torch.bfloat16, 32)
    assert type(storage) is cls and storage.scale_names == scales
    assert storage.keeps_dtype is bool(scales)  # quantized banks keep their dtypes through dtype moves
    if cls is Int4ExpertStorage:
        assert storage.group_size == 32
    if cls is UnquantizedExpertStorage:
        assert storage.dtype == torch.bfloat16


def test_a_raw_weight_names_its_storage_and_an_unknown_dtype_is_refused() -> None:
    assert WEIGHT_DTYPES == (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.uint8)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        storage = storage_of([torch.zeros(2, 4, 8, dtype=dtype)])
        assert type(storage) is UnquantizedExpertStorage and storage.dtype == dtype
    assert type(storage_of([torch.zeros(2, 4, 8).to(torch.float8_e4m3fn)])) is Fp8ExpertStorage
    codes, scale = torch.zeros(2, 64, 4, dtype=torch.uint8), torch.zeros(2, 4, 8, dtype=torch.bfloat16)
    storage = storage_of([codes], [scale])
    assert type(storage) is Int4ExpertStorage and storage.group_size == 16  # K = 64 over 4 groups
    with pytest.raises(ValueError, match=r"w_gate dtype must be one of .*; got torch.int8"):
        storage_of([torch.zeros(2, 4, 8, dtype=torch.int8)])
    with pytest.raises(ValueError, match="expert_dtype must be one of"):
        expert_storage("int8")


def test_a_checkpoint_tensor_is_told_its_stored_format() -> None:
    """By its dtype, or by another quantized format's scale beside it (a model's own scale beside a float bank is
    that model's float source, refused later as such)."""
    fp8, int4, none = expert_storage("float8_e4m3fn"), expert_storage("int4"), expert_storage(None)
    assert stored_format("W", torch.float8_e4m3fn, {}, none) is Fp8ExpertStorage
    assert stored_format("W", torch.uint8, {}, fp8) is Int4ExpertStorage
    assert stored_format("W", torch.bfloat16, {"W_scale"}, none) is Fp8ExpertStorage
    assert stored_format("W", torch.bfloat16, {"W_group_scale"}, fp8) is Int4ExpertStorage
    assert stored_format("W", torch.bfloat16, {"W_group_scale"}, int4) is UnquantizedExpertStorage
    assert stored_format("W", torch.bfloat16, {"W_scale"}, fp8) is UnquantizedExpertStorage
    assert stored_format("W", torch.int8, {}, fp8) is None
