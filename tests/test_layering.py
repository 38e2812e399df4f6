"""The package's layers read bottom-up: no module imports from a layer above its own.

Order: ``utils`` -> ``parallel`` -> ``moe`` -> ``loaders`` -> ``models`` -> ``pipelines`` -> ``modular_pipelines``
-> ``conversion``.
Every import counts: module-level, inside a function (lazy), and ``importlib.import_module`` with a literal
name. The top-level ``diffusers_magi2/__init__.py`` is the public facade and may import any layer.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest


PACKAGE = Path(__file__).resolve().parents[1] / "diffusers_magi2"
LAYERS = ("utils", "parallel", "moe", "loaders", "models", "pipelines", "modular_pipelines", "conversion")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(source: str, module: str, is_package: bool) -> list[tuple[int, str]]:
    """``(line, absolute module name)`` of every import in ``source``, relative ones resolved against ``module``."""
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module
            found.append((node.lineno, target))
            if node.module is None:  # ``from . import x``: x may be a submodule
                found += [(node.lineno, f"{target}.{alias.name}") for alias in node.names]
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name == "import_module" and node.args and isinstance(node.args[0], ast.Constant):
                found.append((node.lineno, str(node.args[0].value)))
    return found


def layer_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "diffusers_magi2" and len(parts) > 1 else None


def upward_imports(source: str, module: str, is_package: bool) -> list[str]:
    own = LAYERS.index(layer_of(module))
    return [
        f"{module}:{line} ({LAYERS[own]}) imports {target} ({layer_of(target)})"
        for line, target in imported_modules(source, module, is_package)
        if layer_of(target) in LAYERS and LAYERS.index(layer_of(target)) > own
    ]


def test_every_subpackage_has_a_layer():
    subpackages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    assert subpackages == set(LAYERS)
    top_level_modules = {p.name for p in PACKAGE.glob("*.py")}
    assert top_level_modules == {"__init__.py"}, "a top-level module would sit outside every layer"


def test_no_import_runs_from_a_lower_layer_to_a_higher_one():
    violations = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_name(path)
        if module == "diffusers_magi2":
            continue  # the public facade
        violations += upward_imports(path.read_text(), module, path.name == "__init__.py")
    assert violations == []


@pytest.mark.parametrize(
    "source",
    [
        "from ..models.transformer_magi2 import Magi2Transformer3DModel",
        "def f():\n    from diffusers_magi2.conversion import cli\n",
        "import importlib\nimportlib.import_module('diffusers_magi2.pipelines.pipeline_magi2')",
        "from .. import models",
    ],
)
def test_the_walk_sees_module_level_lazy_and_importlib_imports(source):
    assert len(upward_imports(source, "diffusers_magi2.parallel.expert_parallel", False)) == 1
    assert upward_imports(source, "diffusers_magi2.conversion.cli", False) == []


def import_graph() -> dict[str, set[str]]:
    """Package module -> the package modules it imports (every import counts, as above; a name that is not a
    module resolves to the module defining it)."""
    paths = {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}
    graph = {}
    for module, path in paths.items():
        targets = set()
        for _, target in imported_modules(path.read_text(), module, path.name == "__init__.py"):
            while target and target not in paths:
                target = target.rpartition(".")[0]
            if target and target != module:
                targets.add(target)
        graph[module] = targets
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of modules that import each other, directly or through a loop (strongly connected, > 1 module)."""
    order, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(module: str) -> None:
        order[module] = low[module] = len(order)
        stack.append(module)
        on_stack.add(module)
        for target in graph[module]:
            if target not in order:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], order[target])
        if low[module] == order[module]:
            group = []
            while not group or group[-1] != module:
                group.append(stack.pop())
                on_stack.discard(group[-1])
            if len(group) > 1:
                cycles.append(sorted(group))

    for module in graph:
        if module not in order:
            visit(module)
    return cycles


def test_no_two_modules_import_each_other():
    assert import_cycles(import_graph()) == []


def test_the_cycle_walk_finds_direct_and_indirect_loops():
    graph = {"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"e"}, "e": {"c"}, "f": {"a"}}
    assert sorted(import_cycles(graph)) == [["a", "b"], ["c", "d", "e"]]
