"""SandAI's prompt-enhancement set-up in a converted repo (``magi2-convert --sandai_code_dir``): the task templates of
SandAI's code (``prompts/t2v.md`` and ``prompts/i2v.md``, ≈ 77k and 12k characters) and its endpoint defaults (the
model name and base URL ``inference/prompt_enhancement/enhancer.py`` sets) become the repo's ``prompt_enhancer/``
folder, a saved ``Magi2PromptEnhancer``, so ``Magi2Pipeline.from_pretrained`` loads an enhancer that asks as SandAI's
code does (the API key from ``OPENAI_API_KEY`` at use; never written).

Standard library only: the command line checks the folder (:func:`sandai_code_problems`) before torch is imported.
"""

from __future__ import annotations

import ast
import json
import os
from importlib.metadata import version
from pathlib import Path


__all__ = [
    "PROMPT_ENHANCER_ENTRY",
    "sandai_code_problems",
    "sandai_endpoint_defaults",
    "sandai_template_folder",
    "write_sandai_prompt_enhancer",
]

#: The ``model_index.json`` entry of the written folder.
PROMPT_ENHANCER_ENTRY = ("diffusers_magi2.pipelines.prompt_enhancement", "Magi2PromptEnhancer")
#: Where SandAI's code keeps its templates (its enhancer's ``PROMPT_DIR``; the repository root's ``prompts/``).
TEMPLATE_FOLDERS = ("inference/prompt_enhancement/prompts", "prompts")
TEMPLATE_FILES = ("t2v.md", "i2v.md")
ENHANCER_SOURCE = "inference/prompt_enhancement/enhancer.py"
#: enhancer.py's module constants -> the saved enhancer's config keys.
ENDPOINT_CONSTANTS = {"DEFAULT_MODEL": "model", "DEFAULT_BASE_URL": "base_url"}


def sandai_template_folder(code_dir: str | os.PathLike) -> Path | None:
    """The first of :data:`TEMPLATE_FOLDERS` under ``code_dir`` that holds both templates, else ``None``."""
    for relative in TEMPLATE_FOLDERS:
        folder = Path(code_dir) / relative
        if all((folder / name).is_file() for name in TEMPLATE_FILES):
            return folder
    return None


def sandai_endpoint_defaults(code_dir: str | os.PathLike) -> dict[str, str]:
    """``{"model", "base_url"}`` from the string constants of SandAI's ``enhancer.py`` (read, never run).

    Raises:
        ValueError: the file is missing or does not assign both constants a string.
    """
    path = Path(code_dir) / ENHANCER_SOURCE
    if not path.is_file():
        raise ValueError(f"--sandai_code_dir: {path} does not exist (SandAI's prompt enhancer)")
    found = {}
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            for target in node.targets:
                if isinstance(target, ast.Name) and target.id in ENDPOINT_CONSTANTS:
                    found[ENDPOINT_CONSTANTS[target.id]] = node.value.value
    missing = [name for name, key in ENDPOINT_CONSTANTS.items() if not found.get(key)]
    if missing:
        raise ValueError(f"--sandai_code_dir: {path} assigns no string to {missing}")
    return found


def sandai_code_problems(code_dir: str | os.PathLike) -> list[str]:
    """Every problem of ``--sandai_code_dir`` found from the file system (empty when it can be copied)."""
    root = Path(code_dir)
    if not root.is_dir():
        return [f"--sandai_code_dir {root} is not a directory"]
    folder = sandai_template_folder(root)
    if folder is None:
        where = " or ".join(str(root / relative) for relative in TEMPLATE_FOLDERS)
        return [f"--sandai_code_dir: neither {where} holds both {' and '.join(TEMPLATE_FILES)}"]
    problems = [
        f"--sandai_code_dir: {folder / name} has no {{user_input_text}} placeholder"
        for name in TEMPLATE_FILES
        if "{user_input_text}" not in (folder / name).read_text(encoding="utf-8")
    ]
    try:
        sandai_endpoint_defaults(root)
    except ValueError as err:
        problems.append(str(err))
    return problems


def write_sandai_prompt_enhancer(repo_folder: str | os.PathLike, code_dir: str | os.PathLike) -> tuple[str, str]:
    """Write ``<repo_folder>/prompt_enhancer/``: SandAI's two templates, copied byte for byte, and the enhancer's
    config (an endpoint enhancer with SandAI's model and base URL; the other settings at the class defaults).

    Returns:
        the ``model_index.json`` entry (:data:`PROMPT_ENHANCER_ENTRY`).

    Raises:
        ValueError: a problem of :func:`sandai_code_problems`.
    """
    problems = sandai_code_problems(code_dir)
    if problems:
        raise ValueError("; ".join(problems))
    folder = Path(repo_folder) / "prompt_enhancer"
    folder.mkdir(parents=True, exist_ok=True)
    templates = sandai_template_folder(code_dir)
    config = {
        "_class_name": PROMPT_ENHANCER_ENTRY[1],
        "_diffusers_version": version("diffusers"),
        "kind": "endpoint",
        **sandai_endpoint_defaults(code_dir),
    }
    files = {name: (templates / name).read_bytes() for name in TEMPLATE_FILES}
    files["prompt_enhancer_config.json"] = (json.dumps(config, indent=2, sort_keys=True) + "\n").encode("utf-8")
    for name, data in files.items():
        tmp = folder / f".{name}.tmp-{os.getpid()}"
        tmp.write_bytes(data)
        os.replace(tmp, folder / name)
    return PROMPT_ENHANCER_ENTRY
