"""Package foundation: metadata and the public-name table."""

from __future__ import annotations

import tomllib

import diffusers_magi2
from conftest import REPO_ROOT


def test_pyproject_keeps_torch_and_triton_loose():
    meta = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    assert meta["name"] == "diffusers-magi2"
    deps = {d.split(">")[0].split("<")[0].split("=")[0].split(";")[0].strip(): d for d in meta["dependencies"]}
    assert "==" not in deps["torch"] and "==" not in deps["triton"].split(";")[0]
    assert "sys_platform == 'linux'" in deps["triton"]
    assert deps["diffusers"] == "diffusers>=0.42,<0.43"
    pins = (REPO_ROOT / "ci-constraints.txt").read_text().split()
    assert "torch==2.13.0" in pins and "triton==3.9.0" in pins


def test_ci_runs_the_readme_test_command():
    readme = (REPO_ROOT / "README.md").read_text()
    block = readme.split("<!-- test-command -->", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0].strip()
    assert "pytest" in block and "ci-constraints.txt" in block
    assert "test-command" in (REPO_ROOT / ".ci" / "run").read_text()


def test_unknown_public_name_raises():
    try:
        diffusers_magi2.DoesNotExist  # noqa: B018
    except AttributeError as err:
        assert "DoesNotExist" in str(err)
    else:  # pragma: no cover
        raise AssertionError("expected AttributeError")
