"""Package foundation: metadata and the public-name table."""

from __future__ import annotations

import pytest
import tomllib
from helpers.fixtures import REPO_ROOT

import diffusers_magi2


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
    # diffusers' linter settings (pyproject [tool.ruff]) gate the tests: both ruff steps run before pytest
    assert block.index("ruff check .") < block.index("ruff format --check .") < block.index("pytest")
    ruff = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["ruff"]
    assert ruff["line-length"] == 119 and ruff["lint"]["select"] == ["C", "E", "F", "I", "W"]
    assert "test-command" in (REPO_ROOT / ".ci" / "run").read_text()


@pytest.mark.slow  # a fresh interpreter
def test_public_names_and_component_modules_are_importable():
    import subprocess
    import sys

    for name in diffusers_magi2.__all__:
        assert getattr(diffusers_magi2, name) is not None, name
    # diffusers' loader resolves model_index.json module paths only from sys.modules: importing a pipeline class
    # registers every module its repository's index names, while ``import diffusers_magi2`` alone imports neither
    # torch nor diffusers (fresh interpreter)
    code = (
        "import sys, diffusers_magi2\n"
        "assert not {'torch', 'diffusers'} & set(sys.modules), sorted({'torch', 'diffusers'} & set(sys.modules))\n"
        "models = ['diffusers_magi2.models.transformer_magi2', 'diffusers_magi2.models.transformer_magi2_refiner',"
        " 'diffusers_magi2.models.turbo_vae']\n"
        "from diffusers_magi2 import Magi2ModularPipeline\n"
        "assert not [m for m in models if m not in sys.modules]\n"
        "from diffusers_magi2 import Magi2Pipeline\n"
        "missing = [m for m in models + ['diffusers_magi2.pipelines.pipeline_magi2'] if m not in sys.modules]\n"
        "assert not missing, missing\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.slow  # a fresh interpreter
def test_package_imports_without_triton():
    """Triton is Linux-only in pyproject: ``import diffusers_magi2`` and the torch MoE path must work without it,
    and asking for the Triton backend must raise rather than fall back."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "class _Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'triton' or name.startswith('triton.'):\n"
        "            raise ImportError('triton blocked for this test')\n"
        "sys.meta_path.insert(0, _Block())\n"
        "import torch, diffusers_magi2\n"
        "from diffusers_magi2 import Magi2MultiHeadMoE, Magi2MultiHeadMoEConfig\n"
        "cfg = Magi2MultiHeadMoEConfig(hidden_size=32, num_heads=2, num_experts=4, top_k=2,"
        " expert_intermediate_size=16, params_dtype=torch.float32)\n"
        "m = Magi2MultiHeadMoE(cfg); m.set_backend('torch')\n"
        "assert m(torch.randn(3, 32)).shape == (3, 32)\n"
        "try:\n"
        "    m.set_backend('triton')\n"
        "except ImportError:\n"
        "    print('RAISED')\n"
        "else:\n"
        "    try:\n"
        "        m(torch.randn(3, 32))\n"
        "    except ImportError:\n"
        "        print('RAISED')\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "RAISED" in res.stdout


def test_the_trained_tiny_folder_ships_as_package_data():
    """Every file of the trained tiny pipeline folder matches ``pyproject.toml``'s package-data globs (setuptools
    expands them with the same recursive glob from the package folder), and the folder stays under 25 MB."""
    from diffusers_magi2.pipelines.tiny_default import TINY_TRAINED_DIR

    package = REPO_ROOT / "diffusers_magi2"
    globs = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    shipped = {path for pattern in globs["diffusers_magi2"] for path in package.glob(pattern) if path.is_file()}
    files = {path for path in TINY_TRAINED_DIR.rglob("*") if path.is_file()}
    names = {path.relative_to(TINY_TRAINED_DIR).as_posix() for path in files}
    assert {"model_index.json", "tokenizer/tokenizer.json", "transformer/diffusion_pytorch_model.safetensors"} <= names
    assert files <= shipped, sorted(p.relative_to(package).as_posix() for p in files - shipped)
    assert sum(path.stat().st_size for path in files) <= 25 * 2**20
