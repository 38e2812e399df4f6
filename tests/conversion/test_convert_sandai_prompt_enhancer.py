"""``magi2-convert --sandai_code_dir``: SandAI's prompt-enhancement templates (copied byte for byte) and endpoint
defaults (read from its ``enhancer.py``) become the repo's ``prompt_enhancer/``, named in both indexes, which the
pipeline's loader reads back as a ``Magi2PromptEnhancer``; a folder without them is refused before anything is
written (and before torch is imported); without the flag the entry is ``[null, null]``."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers.convert_testing_utils import run_cli

from diffusers_magi2 import Magi2PromptEnhancer
from diffusers_magi2.pipelines.enhancement_magi2 import load_saved_prompt_enhancer


T2V = "SandAI's long T2V instructions (stand-in) for: {user_input_text}{variation_seed}\n"
I2V = "SandAI's I2V instructions (stand-in), ü, for: {user_input_text}\n"
ENHANCER = '''"""stand-in of SandAI's enhancer.py"""
from pathlib import Path
PROMPT_DIR = Path(__file__).resolve().parent / "prompts"
DEFAULT_MODEL = "gemini-3.1-pro-preview"
API_KEY = ""
DEFAULT_BASE_URL = "https://generativelanguage.googleapis.com/v1beta/openai/"
MAX_OUTPUT_TOKENS = 16384
'''


def sandai_code(root, t2v=T2V, enhancer=ENHANCER):
    """A SandAI code folder: the templates in the repository's ``prompts/`` and the enhancer's module constants."""
    (root / "prompts").mkdir(parents=True)
    (root / "prompts" / "t2v.md").write_text(t2v, encoding="utf-8")
    (root / "prompts" / "i2v.md").write_text(I2V, encoding="utf-8")
    (root / "inference" / "prompt_enhancement").mkdir(parents=True)
    (root / "inference" / "prompt_enhancement" / "enhancer.py").write_text(enhancer, encoding="utf-8")
    return root


def test_the_templates_and_endpoint_defaults_become_a_loadable_prompt_enhancer(tmp_path):
    out = tmp_path / "repo"
    rc, _, err = run_cli(
        ["--components", "scheduler", "--output_path", out, "--sandai_code_dir", sandai_code(tmp_path / "code")]
    )
    assert rc == 0, err
    index = json.loads((out / "model_index.json").read_text())
    assert index["prompt_enhancer"] == ["diffusers_magi2.pipelines.prompt_enhancement", "Magi2PromptEnhancer"]
    assert (
        json.loads((out / "modular_model_index.json").read_text())["prompt_enhancer"][:2] == index["prompt_enhancer"]
    )
    assert sorted(p.name for p in (out / "prompt_enhancer").iterdir()) == [
        "i2v.md", "prompt_enhancer_config.json", "t2v.md"
    ]  # fmt: skip
    assert (out / "prompt_enhancer" / "t2v.md").read_bytes() == T2V.encode("utf-8")
    enhancer = load_saved_prompt_enhancer(out, index)  # what Magi2Pipeline.from_pretrained calls
    assert isinstance(enhancer, Magi2PromptEnhancer)
    assert enhancer.templates == {"t2v": T2V, "i2v": I2V}
    assert (enhancer.config.kind, enhancer.config.model, enhancer.config.base_url) == (
        "endpoint",
        "gemini-3.1-pro-preview",
        "https://generativelanguage.googleapis.com/v1beta/openai/",
    )
    assert enhancer.client.timeout == 180.0


def test_without_the_flag_the_entry_is_null(tmp_path):
    rc, _, err = run_cli(["--components", "scheduler", "--output_path", tmp_path / "repo"])
    assert rc == 0, err
    assert json.loads((tmp_path / "repo" / "model_index.json").read_text())["prompt_enhancer"] == [None, None]
    assert not (tmp_path / "repo" / "prompt_enhancer").exists()


@pytest.mark.parametrize(
    "make, needle",
    [
        (lambda root: root, "is not a directory"),
        (lambda root: sandai_code(root, t2v="no placeholder"), "t2v.md has no {user_input_text} placeholder"),
        (lambda root: sandai_code(root, enhancer="MODEL = 'x'\n"), "assigns no string to ['DEFAULT_MODEL', 'DEFAULT_"),
    ],
)
def test_a_folder_without_sandais_set_up_is_refused_before_torch_and_nothing_is_written(tmp_path, make, needle):
    code = make(tmp_path / "code")
    out = tmp_path / "repo"
    driver = (
        "import sys\nfrom diffusers_magi2.conversion.cli import main\nrc = main(sys.argv[1:])\n"
        "print(rc, sorted(m for m in ('torch', 'diffusers') if m in sys.modules))\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", driver, "--components", "scheduler", "--output_path", str(out),
         "--sandai_code_dir", str(code)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert res.stdout.split() == ["2", "[]"], res.stdout + res.stderr
    assert res.stderr.startswith("magi2-convert: error: ") and needle in res.stderr, res.stderr
    assert not out.exists()
