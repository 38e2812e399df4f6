"""The Modular Diffusers files of a MAGI-2 repository, written next to ``model_index.json``.

* ``modular_model_index.json``: what ``ModularPipeline.from_pretrained`` reads instead of ``model_index.json``:
  ``_class_name`` ``"ModularPipeline"``, ``_blocks_class_name`` ``"Magi2AutoBlocks"``, each component as
  ``[library, class, {"pretrained_model_name_or_path", "subfolder", "type_hint", "variant", "revision"}]`` (the
  library and class of its ``model_index.json`` entry) and the pipeline config values of ``model_index.json``.
  A component is named by the repo's Hub id when the writer knows it (``push_to_hub`` with ``repo_id``,
  ``magi2-convert --repo_id``), else by its ``subfolder`` alone (``pretrained_model_name_or_path`` null): never
  by the writer's folder. diffusers loads the components of a local copy (a folder, a Hub snapshot) from the
  copy whatever the index names, and those of a Hub id from the id the index names.
* ``modular_config.json``: the remote-code entry, ``auto_map: {"ModularPipelineBlocks":
  "magi2_modular_blocks.Magi2AutoBlocks"}`` and ``requirements: {"diffusers-magi2": ...}``.
* ``magi2_modular_blocks.py``: three lines that import the blocks from the installed ``diffusers_magi2``.

Both JSON files are derived from ``model_index.json`` alone, so :func:`check_modular_files` can tell a repo whose
files disagree (a hand edit, a component swapped in one file only) before anything loads.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


__all__ = [
    "MODULAR_BLOCKS_CLASS",
    "MODULAR_BLOCKS_FILE",
    "MODULAR_CONFIG_FILE",
    "MODULAR_INDEX_FILE",
    "Magi2ModularFilesMixin",
    "check_modular_files",
    "modular_config_dict",
    "modular_index_dict",
    "unsourced_components",
    "write_modular_files",
]

MODULAR_INDEX_FILE = "modular_model_index.json"
MODULAR_CONFIG_FILE = "modular_config.json"
MODULAR_BLOCKS_FILE = "magi2_modular_blocks.py"
MODULAR_BLOCKS_CLASS = "Magi2AutoBlocks"

_BLOCKS_SOURCE = f'''"""Remote-code entry of a MAGI-2 repository: ``ModularPipeline.from_pretrained(repo, trust_remote_code=True)``
loads these blocks from the installed ``diffusers-magi2`` package (``pip install diffusers-magi2``)."""

from diffusers_magi2.modular_pipelines import {MODULAR_BLOCKS_CLASS}


__all__ = ["{MODULAR_BLOCKS_CLASS}"]
'''


def _is_component_entry(value: Any) -> bool:
    """``[library, class]`` (names or ``None``), not a config value that is a pair (``trained_resolutions``)."""
    return isinstance(value, (list, tuple)) and len(value) == 2 and all(v is None or isinstance(v, str) for v in value)


def modular_index_dict(model_index: dict, repo: str | None) -> dict:
    """``modular_model_index.json`` of a repo whose ``model_index.json`` is ``model_index``.

    Args:
        model_index: the ``model_index.json`` content.
        repo: the repo's Hub id, or ``None`` (the components are named by subfolder only; module docstring).

    Returns:
        the JSON-ready dict; components that are ``[null, null]`` in ``model_index.json`` are left out.
    """
    import diffusers

    index: dict[str, Any] = {
        "_class_name": "ModularPipeline",
        "_diffusers_version": diffusers.__version__,
        "_blocks_class_name": MODULAR_BLOCKS_CLASS,
    }
    for name, value in model_index.items():
        if name.startswith("_"):
            continue
        if _is_component_entry(value):
            library, cls = value
            if library is None or cls is None:
                continue
            spec = {
                "pretrained_model_name_or_path": repo,
                "revision": None,
                "subfolder": name,
                "type_hint": [library, cls],
                "variant": None,
            }
            index[name] = [library, cls, spec]
        else:
            index[name] = value
    return index


def modular_config_dict() -> dict:
    """``modular_config.json``: the ``auto_map`` of the remote-code blocks and the package requirement."""
    from importlib.metadata import version

    import diffusers

    return {
        "_class_name": MODULAR_BLOCKS_CLASS,
        "_diffusers_version": diffusers.__version__,
        "auto_map": {"ModularPipelineBlocks": f"{Path(MODULAR_BLOCKS_FILE).stem}.{MODULAR_BLOCKS_CLASS}"},
        "requirements": {"diffusers-magi2": f">={version('diffusers-magi2')}"},
    }


def write_modular_files(folder: str | os.PathLike, repo: str | None = None) -> None:
    """Write the three modular files (module docstring) into ``folder``, from its ``model_index.json``.

    Each file goes to a temporary name first and is renamed into place, so a failure leaves no half-written file.

    Args:
        folder: a pipeline folder with ``model_index.json``.
        repo: the repo's Hub id, recorded as each component's ``pretrained_model_name_or_path`` (default
            ``None``: subfolders only).

    Raises:
        ValueError: ``folder`` has no ``model_index.json``.
    """
    folder = Path(folder)
    index_path = folder / "model_index.json"
    if not index_path.is_file():
        raise ValueError(f"{folder} has no model_index.json; write the pipeline first")
    model_index = json.loads(index_path.read_text())
    repo = None if repo is None else str(repo)
    contents = {
        MODULAR_INDEX_FILE: json.dumps(modular_index_dict(model_index, repo), indent=2, sort_keys=True) + "\n",
        MODULAR_CONFIG_FILE: json.dumps(modular_config_dict(), indent=2, sort_keys=True) + "\n",
        MODULAR_BLOCKS_FILE: _BLOCKS_SOURCE,
    }
    for name, text in contents.items():
        tmp = folder / f".{name}.tmp-{os.getpid()}"
        tmp.write_text(text)
        os.replace(tmp, folder / name)


def unsourced_components(modular_index: dict) -> list[str]:
    """The components ``modular_index`` names by subfolder only (no Hub id): they load from a local copy alone."""
    return sorted(
        name
        for name, entry in modular_index.items()
        if isinstance(entry, (list, tuple))
        and len(entry) == 3
        and not (entry[2] or {}).get("pretrained_model_name_or_path")
    )


def check_modular_files(model_index: dict, modular_index: dict, modular_config: dict | None = None) -> None:
    """Refuse a repo whose ``modular_model_index.json`` (or ``modular_config.json``) disagrees with its
    ``model_index.json``: every component and config value of ``model_index.json`` must appear unchanged.

    Raises:
        ValueError: naming both files, the key and both values.
    """
    problems = []
    for name, value in model_index.items():
        if name.startswith("_"):
            continue
        if _is_component_entry(value):
            if value[0] is None:
                continue
            entry = modular_index.get(name)
            have = None if not isinstance(entry, (list, tuple)) or len(entry) != 3 else list(entry[:2])
            if have != list(value):
                problems.append(f"component {name!r}: model_index.json has {list(value)}, {MODULAR_INDEX_FILE} {have}")
        elif name in modular_index and modular_index[name] != value:
            problems.append(f"{name!r}: model_index.json has {value!r}, {MODULAR_INDEX_FILE} {modular_index[name]!r}")
    for name, entry in modular_index.items():
        if isinstance(entry, (list, tuple)) and len(entry) == 3 and entry[0] is not None:
            if not _is_component_entry(model_index.get(name)) or model_index[name][0] is None:
                problems.append(
                    f"component {name!r}: in {MODULAR_INDEX_FILE} ({list(entry[:2])}), not in model_index.json"
                )
    blocks = modular_index.get("_blocks_class_name")
    if blocks is not None and blocks != MODULAR_BLOCKS_CLASS:
        problems.append(f"{MODULAR_INDEX_FILE} names blocks {blocks!r}, not {MODULAR_BLOCKS_CLASS!r}")
    if modular_config is not None:
        auto_map = (modular_config.get("auto_map") or {}).get("ModularPipelineBlocks")
        want = modular_config_dict()["auto_map"]["ModularPipelineBlocks"]
        if auto_map != want:
            problems.append(f"{MODULAR_CONFIG_FILE} auto_map ModularPipelineBlocks is {auto_map!r}, not {want!r}")
    if problems:
        raise ValueError(
            f"this repo's modular files disagree with its model_index.json ({len(problems)} problem(s)); rewrite "
            "them with Magi2Pipeline.save_pretrained or magi2-convert:\n  " + "\n  ".join(problems)
        )


class Magi2ModularFilesMixin:
    """``save_pretrained`` that also writes the modular files (module docstring) next to ``model_index.json``,
    before a ``push_to_hub`` upload; the components are named by ``repo_id`` when pushing, else by subfolder."""

    def save_pretrained(self, save_directory, *args, **kwargs):
        """``DiffusionPipeline.save_pretrained`` plus ``modular_model_index.json``, ``modular_config.json`` and
        ``magi2_modular_blocks.py``, so the folder also loads with ``ModularPipeline.from_pretrained(folder,
        trust_remote_code=True)`` and ``Magi2ModularPipeline.from_pretrained(folder)``."""
        object.__setattr__(self, "_modular_files_repo", kwargs.get("repo_id") if kwargs.get("push_to_hub") else None)
        try:
            return super().save_pretrained(save_directory, *args, **kwargs)
        finally:
            object.__delattr__(self, "_modular_files_repo")

    def save_config(self, save_directory, *args, **kwargs):
        """``model_index.json``, then the modular files derived from it."""
        super().save_config(save_directory, *args, **kwargs)
        write_modular_files(save_directory, getattr(self, "_modular_files_repo", None))
