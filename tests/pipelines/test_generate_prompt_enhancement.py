"""``examples/generate.py --enhance_prompt``: the tiny default's main job asks a chat-completions server on 127.0.0.1
(the real ``openai`` client), prints the enhanced prompt, keeps it beside the clip as ``<clip>.prompt.md`` (no
temporary file left) and generates from it; an endpoint error is one ``error:`` line naming the endpoint, exit 2,
nothing written."""

from __future__ import annotations

import contextlib
import io
import re

from helpers.chat_completions_stub import ChatCompletionsStub
from helpers.fixtures import golden_text
from helpers.launch import load_generate


SMALL = ["--height", "32", "--width", "32", "--num_inference_steps", "1"]


def test_enhance_prompt_prints_saves_and_generates_from_the_enhanced_prompt(tmp_path, capsys, monkeypatch):
    generate = load_generate()
    reply = golden_text("prompt_enhancement/t2v_street_night_dialogue.input.json")
    markdown = golden_text("prompt_enhancement/t2v_street_night_dialogue.render_markdown.md")
    prompts = []
    load = generate.load_pipeline

    def load_recording(args):  # records the prompt each call of the pipeline is given
        pipe, defaults = load(args)
        pipe.register_to_config(duration_s=2.0)
        call = type(pipe).__call__
        monkeypatch.setattr(
            type(pipe), "__call__", lambda self, **kw: prompts.append(kw["prompt"]) or call(self, **kw)
        )
        return pipe, defaults

    monkeypatch.setattr(generate, "load_pipeline", load_recording)
    out = tmp_path / "clip.mp4"
    with ChatCompletionsStub(reply=reply) as server:
        rc = generate.main(
            ["--prompt", "two friends talk under neon", "--output", str(out), *SMALL, "--enhance_prompt",
             "--pe_base_url", server.base_url, "--pe_model", "stub", "--pe_api_key", "local"]
        )  # fmt: skip
    assert rc == 0 and out.is_file()
    assert len(server.requests) == 1 and server.requests[0]["model"] == "stub"
    assert (tmp_path / "clip.prompt.md").read_bytes() == markdown.encode("utf-8")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["clip.mp4", "clip.prompt.md"]
    assert prompts == [markdown]
    assert f"enhanced prompt (saved to {tmp_path / 'clip.prompt.md'}):\n{markdown}" in capsys.readouterr().out


PROGRESS_BAR = re.compile(r"\d+/\d+ \[[^\]]*\]")


def test_an_endpoint_error_is_one_line_and_exit_2_with_nothing_written(tmp_path):
    generate = load_generate()
    out = tmp_path / "clip.mp4"
    err = io.StringIO()
    with ChatCompletionsStub(status=400) as server, contextlib.redirect_stderr(err):
        rc = generate.run(
            ["--prompt", "a fox", "--output", str(out), *SMALL, "--enhance_prompt",
             "--pe_base_url", server.base_url, "--pe_model", "stub"]
        )  # fmt: skip
    # the tiny default loads from its package folder, whose progress bars (diffusers', transformers') share stderr
    lines = [line for line in err.getvalue().splitlines() if line.strip() and not PROGRESS_BAR.search(line)]
    assert rc == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"error: --enhance_prompt: Prompt enhancement failed: the endpoint {server.base_url}")
    assert "HTTP 400" in lines[0]
    assert list(tmp_path.iterdir()) == []
