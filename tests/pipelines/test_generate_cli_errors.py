"""``examples/generate.py`` refuses bad input as ``magi2-convert`` does: one ``error: ...`` line on stderr (rank 0
only), exit status 2, and (where the check needs no model) before torch or diffusers is imported."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers.fixtures import REPO_ROOT


GENERATE = REPO_ROOT / "examples" / "generate.py"

# Calls generate.run(argv) for each case in one interpreter and reports (exit status, stderr, torch imported?).
DRIVER = """
import contextlib, importlib.util, io, json, sys
spec = importlib.util.spec_from_file_location("magi2_generate_cli", sys.argv[1])
generate = importlib.util.module_from_spec(spec)
spec.loader.exec_module(generate)
results = []
for argv in json.loads(sys.argv[2]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            rc = generate.run(argv)
        except SystemExit as exc:
            rc = exc.code
    results.append({"rc": rc, "stderr": err.getvalue(), "torch": "torch" in sys.modules})
print(json.dumps(results))
"""


def _cases(tmp_path):
    not_an_image = tmp_path / "notes.png"
    not_an_image.write_text("not a png")
    no_index = tmp_path / "raw_release"
    no_index.mkdir()
    out = str(tmp_path / "out" / "clip.mp4")
    base = ["--prompt", "a cat", "--output", out]
    return {
        "height not a multiple of 16": (base + ["--height", "100"], "--height: must be a positive multiple of 16"),
        "width 0": (base + ["--width", "0"], "--width: must be a positive multiple of 16"),
        "0 steps": (base + ["--num_inference_steps", "0"], "--num_inference_steps: must be an integer >= 1"),
        "missing model folder": (base + ["--model", str(tmp_path / "missing")], "no such folder"),
        "model folder not converted": (base + ["--model", str(no_index)], "without model_index.json"),
        "missing image": (base + ["--image", str(tmp_path / "missing.png")], "does not exist"),
        "image not an image": (base + ["--image", str(not_an_image)], "is not an image file"),
        "ep_degree 0": (base + ["--ep_degree", "0"], "--ep_degree: must be an integer >= 1"),
        "ep_degree without the processes": (base + ["--ep_degree", "2"], "--ep_degree 2 requested but this run has 1"),
        "ulysses_degree without the processes": (
            base + ["--ulysses_degree", "2"],
            "--ulysses_degree 2 requested but this run has 1",
        ),
        "resolution and height": (base + ["--resolution", "540p", "--height", "512"], "either --resolution or"),
        "output_height alone": (base + ["--output_height", "1080"], "--output_height and --output_width go together"),
        "output not mp4": (["--prompt", "a cat", "--output", str(tmp_path / "x.gif")], "must be an .mp4"),
        # no process, root included, can create a file in /proc, although os.access says root may write there
        "output folder not writable": (
            ["--prompt", "a cat", "--output", "/proc/magi2_clip.mp4"],
            "cannot create a file in '/proc'",
        ),
        "host_memory without vram_gb": (base + ["--host_memory", "pinned"], "--host_memory goes with --vram_gb"),
        "host_memory disk without model": (
            base + ["--vram_gb", "24", "--host_memory", "disk"],
            "--host_memory disk reads the streamed weights from the safetensors files of --model",
        ),
        "vram_gb 0": (base + ["--vram_gb", "0"], "--vram_gb: must be an integer >= 1"),
        "no prompt": (["--output", out], "the following arguments are required: --prompt"),
        "pe flags without --enhance_prompt": (
            base + ["--pe_model", "m", "--pe_api_key", "k"],
            "--pe_model, --pe_api_key configure --enhance_prompt",
        ),
        "enhance_prompt without a model": (base + ["--enhance_prompt"], "--enhance_prompt needs --pe_model"),
    }


def _clean_env(**extra) -> dict:
    import os

    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env.update(extra)
    return env


def test_each_bad_input_is_one_error_line_and_exit_2_before_torch_is_imported(tmp_path):
    cases = _cases(tmp_path)
    res = subprocess.run(
        [sys.executable, "-c", DRIVER, str(GENERATE), json.dumps([argv for argv, _ in cases.values()])],
        capture_output=True,
        text=True,
        timeout=120,
        env=_clean_env(),
    )
    assert res.returncode == 0, res.stderr
    for (name, (_, expected)), got in zip(cases.items(), json.loads(res.stdout)):
        lines = got["stderr"].splitlines()
        assert got["rc"] == 2, (name, got)
        assert len(lines) == 1 and lines[0].startswith("error: "), (name, got["stderr"])
        assert expected in lines[0], (name, lines[0])
        assert not got["torch"], f"{name}: torch was imported before the check"
    assert not (tmp_path / "out").exists()


def test_other_ranks_stay_silent(tmp_path):
    argv = ["--prompt", "a cat", "--output", str(tmp_path / "x.mp4"), "--height", "100"]
    res = subprocess.run(
        [sys.executable, "-c", DRIVER, str(GENERATE), json.dumps([argv])],
        capture_output=True,
        text=True,
        timeout=120,
        env=_clean_env(RANK="1", WORLD_SIZE="2"),
    )
    [got] = json.loads(res.stdout)
    assert got["rc"] == 2 and got["stderr"] == ""


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--height", "100"], "must be a positive multiple of 16"),
        (["--ep_degree", "2"], "--ep_degree 2 requested but this run has 1 process(es)"),
    ],
)
def test_the_script_itself_exits_2_with_one_line(tmp_path, args, expected):
    out = tmp_path / "never.mp4"
    res = subprocess.run(
        [sys.executable, str(GENERATE), "--prompt", "x", "--output", str(out), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=_clean_env(),
    )
    assert res.returncode == 2 and not out.exists()
    assert res.stderr.splitlines() == [res.stderr.strip()] and res.stderr.startswith("error: ")
    assert expected in res.stderr


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("ep", [None, 1, 2, 3])
@pytest.mark.parametrize("ulysses", [None, 1, 2, 4])
def test_early_launch_check_agrees_with_the_library_rules(monkeypatch, world, ep, ulysses):
    """The torch-free check in the script refuses exactly what the launch rules (``examples/launch_rules.py``) refuse."""
    import importlib.util

    from helpers.launch import load_launch_rules

    from diffusers_magi2.parallel import context_parallel, expert_parallel

    rules = load_launch_rules()

    spec = importlib.util.spec_from_file_location("magi2_generate_rules", GENERATE)
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    monkeypatch.setenv("WORLD_SIZE", str(world))
    # the library's rules resolve a real group when they accept a degree > 1; only their verdict matters here
    monkeypatch.setattr(expert_parallel, "resolve_expert_parallel", lambda config: None)
    monkeypatch.setattr(context_parallel, "resolve_context_parallel", lambda config: None)

    def verdict(fn):
        try:
            fn()
        except ValueError:
            return False
        return True

    library = verdict(
        lambda: (
            rules.expert_parallel_from_launch(ep),
            rules.context_parallel_from_launch(ulysses, ep),
        )
    )
    assert verdict(lambda: generate.check_launch_degrees(ep, ulysses)) == library


def test_a_rank_other_than_0_waits_before_exiting_so_rank_0_prints_first(monkeypatch, capsys):
    """Under a launcher only rank 0 prints; another rank waits before it exits, since a launcher stops every rank once
    one exits, and rank 0 (slower to start under load) would otherwise be stopped before it prints."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("magi2_generate_report", GENERATE)
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    waits = []
    monkeypatch.setattr(generate.time, "sleep", waits.append)
    monkeypatch.setenv("RANK", "1")
    generate.report_error("bad")
    assert waits == [generate.OTHER_RANK_EXIT_DELAY_S] and generate.OTHER_RANK_EXIT_DELAY_S >= 5
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("RANK", "0")
    generate.report_error("--image  'x.png'\n does not exist")
    assert len(waits) == 1 and capsys.readouterr().err == "error: --image 'x.png' does not exist\n"
