"""``DEVELOPERS.md``'s public API list holds: every listed argument name, keyword, CLI flag and ``model_index.json``
entry is what the code has, and every test its diffusers-mixin table names exists."""

from __future__ import annotations

import importlib
import inspect
import re

import pytest
from helpers.fixtures import REPO_ROOT


DOC = REPO_ROOT / "DEVELOPERS.md"


def _api_lines() -> list[list[str]]:
    text = DOC.read_text()
    block = re.search(r"<!-- public-api -->\s*```text\n(.*?)```", text, re.S)
    assert block, "DEVELOPERS.md has no public-api block"
    return [line.split(None, 1) for line in block.group(1).splitlines() if line.strip()]


def _lines(kind: str) -> list[str]:
    return [rest for k, rest in _api_lines() if k == kind]


def _resolve(dotted: str):
    """``pkg.mod.Name.attr`` -> the object (the longest importable module prefix, then attributes)."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for name in parts[i:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(dotted)


def test_the_block_lists_every_kind():
    kinds = {k for k, _ in _api_lines()}
    assert kinds == {"call", "kwarg", "tiny_call_defaults", "flag", "index"}


@pytest.mark.parametrize("line", _lines("call"))
def test_listed_arguments_keep_their_names_and_order(line):
    target, args = re.fullmatch(r"(\S+)\((.*)\)", line).groups()
    listed = [a.strip() for a in args.split(",") if a.strip()]
    actual = [p for p in inspect.signature(_resolve(target)).parameters if p != "self"]
    missing = [a for a in listed if a not in actual]
    assert not missing, f"{target} lost {missing}"
    positions = [actual.index(a) for a in listed]
    assert positions == sorted(positions), f"{target}: listed order {listed} but the code has {actual}"


@pytest.mark.parametrize("line", _lines("kwarg"))
def test_listed_keywords_are_documented_and_read(line):
    target, name = line.split()
    method = _resolve(target)
    assert re.search(rf"^\s+{name}:", inspect.getdoc(method) or "", re.M), f"{target} documents no {name}"
    # read by this method or by the same method of a class it inherits from (a loader mixin)
    owner, attr = _resolve(target.rsplit(".", 1)[0]), target.rsplit(".", 1)[1]
    sources = [
        inspect.getsource(inspect.unwrap(getattr(klass, attr)))
        for klass in owner.__mro__
        if attr in vars(klass) and klass.__module__.startswith("diffusers_magi2")
    ]
    assert any(f'"{name}"' in src for src in sources), f"{target} does not read {name}"


def test_tiny_call_defaults_carry_the_listed_keys():
    from diffusers_magi2 import build_tiny_default_pipeline

    [line] = _lines("tiny_call_defaults")
    defaults = build_tiny_default_pipeline().tiny_call_defaults
    assert set(line.split()) <= set(defaults)


def test_listed_cli_flags_are_the_converter_flags():
    from diffusers_magi2.conversion.cli import build_parser

    [line] = _lines("flag")
    prog, *flags = line.split()
    assert prog == "magi2-convert"
    actual = {s for a in build_parser()._actions for s in a.option_strings} - {"-h", "--help"}
    assert set(flags) == actual, f"not in the code: {set(flags) - actual}; not listed: {actual - set(flags)}"


def test_listed_model_index_entries_are_what_the_converter_writes():
    from diffusers_magi2.conversion.repo import MODEL_INDEX_ENTRIES, PIPELINE_ENTRY

    listed = {name: (module, cls) for name, module, cls in (line.split() for line in _lines("index"))}
    assert listed.pop("_pipeline") == PIPELINE_ENTRY
    assert listed == dict(MODEL_INDEX_ENTRIES)
    for module, cls in [PIPELINE_ENTRY, *MODEL_INDEX_ENTRIES.values()]:
        assert inspect.isclass(getattr(importlib.import_module(module), cls)), (module, cls)


def test_the_mixin_table_names_existing_tests():
    named = re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", DOC.read_text())
    assert len(named) >= 10
    for path, test in named:
        source = (REPO_ROOT / path).read_text()
        assert re.search(rf"^def {test}\(", source, re.M), f"{path}::{test} does not exist"
