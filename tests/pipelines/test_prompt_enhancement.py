"""``Magi2PromptEnhancer``: built, called, saved and loaded like a diffusers config; the API key is never written."""

from __future__ import annotations

import json

import pytest
from helpers.chat_completions_stub import ChatCompletionsStub
from helpers.fixtures import golden_text

import diffusers_magi2
from diffusers_magi2.pipelines.prompt_enhancement import Magi2PromptEnhancer, render_enhanced_prompt
from diffusers_magi2.pipelines.prompt_enhancement_tasks import resolve_templates


SECRET = "sk-secret-never-written-4242"
TEMPLATE = "Write the caption of: {user_input_text}{variation_seed}"


def _case(name: str) -> tuple[str, str]:
    """(the reply text, its rendered Markdown) of a fixture case."""
    return golden_text(f"prompt_enhancement/{name}.input.json"), golden_text(
        f"prompt_enhancement/{name}.render_markdown.md"
    )


def test_public_name_is_the_pipelines_class():
    assert diffusers_magi2.Magi2PromptEnhancer is Magi2PromptEnhancer
    reply, markdown = _case("t2v_chinese_teahouse")
    assert render_enhanced_prompt(json.loads(reply)) == markdown


def test_save_and_load_round_trip_keeps_the_config_and_templates_but_never_the_key(tmp_path):
    enhancer = Magi2PromptEnhancer.from_endpoint(
        "http://127.0.0.1:9/v1", model="qwen3", api_key=SECRET, template={"i2v": TEMPLATE}, timeout=42.0, max_retries=1
    )
    enhancer.save_pretrained(tmp_path / "enhancer")
    saved = sorted(path.name for path in (tmp_path / "enhancer").iterdir())
    assert saved == ["i2v.md", "prompt_enhancer_config.json", "t2v.md"]  # no temporary file left behind
    config = json.loads((tmp_path / "enhancer" / "prompt_enhancer_config.json").read_text())
    assert {key: config[key] for key in ("kind", "base_url", "model", "timeout", "max_retries")} == {
        "kind": "endpoint",
        "base_url": "http://127.0.0.1:9/v1",
        "model": "qwen3",
        "timeout": 42.0,
        "max_retries": 1,
    }
    for path in (tmp_path / "enhancer").iterdir():
        assert SECRET not in path.read_text(encoding="utf-8"), path.name
    assert SECRET not in repr(enhancer) and SECRET not in str(enhancer.config)

    loaded = Magi2PromptEnhancer.from_pretrained(tmp_path / "enhancer", api_key="other")
    assert loaded.templates == {"t2v": resolve_templates()["t2v"], "i2v": TEMPLATE}
    assert (loaded.client.base_url, loaded.client.model, loaded.client.timeout) == (
        "http://127.0.0.1:9/v1/",
        "qwen3",
        42.0,
    )
    assert loaded.client._client.api_key == "other"
    assert loaded.config.kind == "endpoint"


def test_a_loaded_enhancer_asks_with_the_saved_template_and_overrides(tmp_path):
    reply, markdown = _case("t2v_fox_snow")
    with ChatCompletionsStub(reply=reply) as server:
        Magi2PromptEnhancer.from_endpoint(
            "http://127.0.0.1:9/v1", model="m", template=TEMPLATE, timeout=0.9, max_retries=0
        ).save_pretrained(tmp_path / "repo" / "prompt_enhancer")
        loaded = Magi2PromptEnhancer.from_pretrained(
            tmp_path / "repo", subfolder="prompt_enhancer", base_url=server.base_url
        )
        assert loaded("a fox") == markdown
    assert server.requests[0]["messages"][0]["content"][0]["text"] == "Write the caption of: a fox"


def test_a_folder_of_sandai_style_templates_is_found_when_loading(tmp_path):
    # the converter's layout: SandAI's prompts/t2v.md and i2v.md copied beside the config
    Magi2PromptEnhancer.from_endpoint("http://127.0.0.1:9/v1", model="m").save_pretrained(tmp_path)
    (tmp_path / "t2v.md").write_text("SandAI text: {user_input_text}", encoding="utf-8")
    assert Magi2PromptEnhancer.from_pretrained(tmp_path).templates["t2v"] == "SandAI text: {user_input_text}"


def test_a_template_without_the_prompt_placeholder_is_refused_when_built(tmp_path):
    with pytest.raises(ValueError, match=r"no \{user_input_text\} placeholder"):
        Magi2PromptEnhancer.from_endpoint("http://127.0.0.1:9/v1", model="m", template="Describe {variation_seed}")
    Magi2PromptEnhancer.from_endpoint("http://127.0.0.1:9/v1", model="m").save_pretrained(tmp_path)
    (tmp_path / "i2v.md").write_text("no placeholder", encoding="utf-8")
    with pytest.raises(ValueError, match=r"i2v\.md has no \{user_input_text\}"):
        Magi2PromptEnhancer.from_pretrained(tmp_path)


def test_bad_kind_bad_prompt_and_unknown_arguments_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"kind is one of \('endpoint', 'local'\)"):
        Magi2PromptEnhancer(kind="remote", model="m")
    enhancer = Magi2PromptEnhancer.from_endpoint("http://127.0.0.1:9/v1", model="m")
    with pytest.raises(TypeError, match="prompt to enhance is a str"):
        enhancer(["a fox"])
    enhancer.save_pretrained(tmp_path)
    with pytest.raises(TypeError, match="unknown"):
        Magi2PromptEnhancer.from_pretrained(tmp_path, unknown=1)


def test_a_hub_id_downloads_only_the_enhancer_subfolder_with_the_pipelines_hub_options(tmp_path, monkeypatch):
    import huggingface_hub

    from diffusers_magi2.pipelines.enhancement_magi2 import load_saved_prompt_enhancer

    Magi2PromptEnhancer.from_endpoint("http://127.0.0.1:9/v1", model="m").save_pretrained(tmp_path / "prompt_enhancer")
    asked = []

    def snapshot_download(repo_id, allow_patterns, **options):
        asked.append((repo_id, allow_patterns, options))
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    loaded = Magi2PromptEnhancer.from_pretrained("org/magi2-repo", subfolder="prompt_enhancer")
    assert asked == [("org/magi2-repo", ["prompt_enhancer/*"], {"force_download": False, "local_files_only": False})]
    # a pipeline loaded at a revision, offline, with a token: the enhancer comes from the same place
    index = {"prompt_enhancer": ["diffusers_magi2.pipelines.prompt_enhancement", "Magi2PromptEnhancer"]}
    hub = {"revision": "v1", "local_files_only": True, "token": "t", "cache_dir": str(tmp_path), "proxies": {}}
    load_saved_prompt_enhancer("org/magi2-repo", index, hub)
    assert asked[1][2] == {
        "force_download": False,
        "local_files_only": True,
        "revision": "v1",
        "cache_dir": str(tmp_path),
        "token": "t",
    }
    assert loaded.client.model == "m"
