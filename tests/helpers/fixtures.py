"""Where the read-only golden fixtures live, for the tests and for every process they start.

The root is ``$MAGI2_FIXTURES`` when set, else ``../shared/fixtures`` beside the checkout. It is read from the
environment on every call, so the gloo workers (which run each call in the caller's environment) and ``accelerate
launch`` scripts (which inherit it) resolve the same root as the test that started them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_FIXTURES = REPO_ROOT.parent / "shared" / "fixtures"


def fixtures_root() -> Path:
    """The golden fixtures' root: ``$MAGI2_FIXTURES`` or ``../shared/fixtures`` beside the repository."""
    return Path(os.environ.get("MAGI2_FIXTURES", DEFAULT_FIXTURES))


def golden_path(name: str) -> Path:
    """Path of the golden fixture ``name`` (relative to the root); raises ``FileNotFoundError`` naming the root."""
    path = fixtures_root() / name
    if not path.exists():
        raise FileNotFoundError(
            f"golden fixture {name!r} not found under {fixtures_root()} (set MAGI2_FIXTURES to the fixtures' root)"
        )
    return path


def golden(name: str):
    """Load the golden fixture ``name``: a ``.safetensors`` file as a dict of tensors, a ``.json`` file parsed.

    Raises:
        FileNotFoundError: if the file is not under the fixtures' root.
        ValueError: for any other suffix (use ``golden_path`` for folders and other files).
    """
    path = golden_path(name)
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    if path.suffix == ".json":
        return json.loads(path.read_text())
    raise ValueError(f"golden() loads .safetensors and .json files, not {name!r}; use golden_path() for it")


def golden_text(name: str) -> str:
    """The golden fixture ``name`` as text: its bytes decoded as strict UTF-8, line endings as stored."""
    return golden_path(name).read_bytes().decode("utf-8")
