"""``docs/private_api.md`` lists every private third-party name the package uses, and nothing else.

Found in ``diffusers_magi2/``: imports from a third-party module whose path or name has an underscore part
(``torch._subclasses``, ``diffusers.utils._add_variant``), attribute chains on an imported third-party module
(``torch.ops.aten._scaled_dot_product_flash_attention``), underscore attributes the package reads but never defines
anywhere (``config._mesh``: a third party's), and underscore names a package class defines or assigns on ``self``
that one of its third-party base classes already has (overrides and settings such as ``Module._apply`` or
``ModelMixin._keep_in_fp32_modules``). Each must be a name in the doc's tables, each listed name must still be used,
and each test the doc says pins a name must exist.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import re

from helpers.fixtures import REPO_ROOT


PACKAGE = REPO_ROOT / "diffusers_magi2"
DOC = REPO_ROOT / "docs" / "private_api.md"
THIRD_PARTY = ("torch", "diffusers", "peft", "triton", "transformers", "accelerate", "huggingface_hub", "safetensors")


def _private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


def _first_private(parts: list[str]) -> str | None:
    """The dotted name up to its first underscore part, or ``None``."""
    for i, part in enumerate(parts):
        if _private(part):
            return ".".join(parts[: i + 1])
    return None


def _trees() -> dict:
    return {path: ast.parse(path.read_text()) for path in sorted(PACKAGE.rglob("*.py"))}


def _names_the_package_defines(trees) -> set[str]:
    defined = set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defined.add(node.name)
            elif isinstance(node, (ast.Name, ast.Attribute)) and isinstance(node.ctx, ast.Store):
                defined.add(node.id if isinstance(node, ast.Name) else node.attr)
            elif isinstance(node, ast.arg):
                defined.add(node.arg)
            elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) in (
                "__setattr__",
                "setattr",
            ):
                if len(node.args) >= 2 and isinstance(node.args[1], ast.Constant):
                    defined.add(str(node.args[1].value))
    return defined


def _used_statically(trees) -> dict[str, set[str]]:
    """Private third-party names found by reading the source: ``{name or ".attr": {file, ...}}``."""
    defined = _names_the_package_defines(trees)
    found: dict[str, set[str]] = {}
    for path, tree in trees.items():
        where = str(path.relative_to(REPO_ROOT))
        aliases = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] in THIRD_PARTY:
                        aliases[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else alias.name
                        name = _first_private(alias.name.split("."))
                        if name:
                            found.setdefault(name, set()).add(where)
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module.split(".")[0] in THIRD_PARTY:
                for alias in node.names:
                    aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
                    name = _first_private(node.module.split(".")) or _first_private([node.module, alias.name])
                    if name:
                        found.setdefault(name, set()).add(where)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                chain, root = [], node
                while isinstance(root, ast.Attribute):
                    chain.insert(0, root.attr)
                    root = root.value
                if isinstance(root, ast.Name) and root.id in aliases:
                    name = _first_private(aliases[root.id].split(".") + chain)
                    if name:
                        found.setdefault(name, set()).add(where)
                elif _private(node.attr) and node.attr not in defined:
                    found.setdefault("." + node.attr, set()).add(where)
            elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "hasattr"):
                if len(node.args) >= 2 and isinstance(node.args[1], ast.Constant):
                    attr = node.args[1].value
                    if isinstance(attr, str) and _private(attr) and attr not in defined:
                        found.setdefault("." + attr, set()).add(where)
    return found


def _self_assignments(trees) -> dict[str, set[str]]:
    """``{qualified class name: underscore attributes its methods assign on self}``."""
    out: dict[str, set[str]] = {}
    for path, tree in trees.items():
        module = ".".join(path.relative_to(REPO_ROOT).with_suffix("").parts).removesuffix(".__init__")
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                names = out.setdefault(f"{module}.{node.name}", set())
                for sub in ast.walk(node):
                    if (
                        isinstance(sub, ast.Attribute)
                        and isinstance(sub.ctx, ast.Store)
                        and isinstance(sub.value, ast.Name)
                        and sub.value.id in ("self", "cls")
                        and _private(sub.attr)
                    ):
                        names.add(sub.attr)
    return out


def _used_through_base_classes(trees) -> dict[str, set[str]]:
    """``{"Base.name": {package class, ...}}``: underscore names a package class (or a mixin of one) defines or sets
    on ``self`` that a third-party base class in the same MRO already has."""
    import diffusers_magi2

    assigned = _self_assignments(trees)
    found: dict[str, set[str]] = {}
    for info in pkgutil.walk_packages(diffusers_magi2.__path__, "diffusers_magi2."):
        for _, cls in inspect.getmembers(importlib.import_module(info.name), inspect.isclass):
            if cls.__module__ != info.name:
                continue
            mro = cls.__mro__
            for i, own in enumerate(mro):
                if not own.__module__.startswith("diffusers_magi2"):
                    continue
                names = {n for n in vars(own) if _private(n)} | assigned.get(f"{own.__module__}.{own.__name__}", set())
                for name in names:
                    base = next(
                        (b for b in mro[i + 1 :] if b.__module__.split(".")[0] in THIRD_PARTY and name in vars(b)),
                        None,
                    )
                    if base is not None:
                        found.setdefault(f"{base.__name__}.{name}", set()).add(f"{own.__module__}.{own.__name__}")
    return found


def _documented() -> dict[str, str]:
    """``{name: "pinned by" cell}`` from the doc's table rows (first cell a backticked name)."""
    rows = {}
    for line in DOC.read_text().splitlines():
        match = re.match(r"\|\s*`([^`]+)`\s*\|(.*)\|\s*$", line)
        if match:
            rows[match.group(1)] = match.group(2).split("|")[-1]
    return rows


def _listed(key: str, documented) -> bool:
    """A found name is listed when a documented name equals it or ends with it (``.attr``, ``Base.name``)."""
    suffix = key if key.startswith(".") else "." + key
    return any(name == key or name.endswith(suffix) for name in documented)


def test_every_private_third_party_name_in_the_package_is_documented():
    trees = _trees()
    documented = _documented()
    found = {**_used_statically(trees), **_used_through_base_classes(trees)}
    assert found, "the scan found nothing: it is broken"
    missing = {key: sorted(where) for key, where in found.items() if not _listed(key, documented)}
    assert not missing, f"private third-party names used but not in docs/private_api.md: {missing}"


def test_every_documented_name_is_still_used_and_its_pinning_tests_exist():
    source = "\n".join(path.read_text() for path in PACKAGE.rglob("*.py"))
    for name, pins in _documented().items():
        assert re.search(rf"\b{re.escape(name.rsplit('.', 1)[-1])}\b", source), f"{name} is no longer used"
        tests = re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", pins)
        assert tests or pins.strip().startswith("no test:"), f"{name}: no pinning test named (nor 'no test: why')"
        for path, test in tests:
            text = (REPO_ROOT / path).read_text()
            assert re.search(rf"def {test}\b", text), f"{name}: {path}::{test} does not exist"
