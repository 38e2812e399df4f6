"""The tasks' schemas, templates, request message and reply check, against SandAI's schema dumps and the request
shape the fixtures' README states."""

from __future__ import annotations

import base64
import io
import json

import pytest
from helpers.fixtures import golden, golden_path
from PIL import Image

from diffusers_magi2.pipelines.prompt_enhancement_tasks import (
    IMAGE_TO_VIDEO,
    TEXT_TO_VIDEO,
    fill_template,
    image_url,
    parse_reply,
    resolve_templates,
    task_for,
    user_message,
)


TEMPLATE = "Make it rich. {variation_seed}Idea: {user_input_text}"


@pytest.mark.parametrize("task", [TEXT_TO_VIDEO, IMAGE_TO_VIDEO], ids=["t2v", "i2v"])
def test_schemas_equal_sandai_schema_dumps_key_order_included(task):
    expected = golden(f"prompt_enhancement/{task.name}_response_schema.json")
    assert json.dumps(task.schema) == json.dumps(expected)


def test_required_keys_and_schema_names_per_task():
    assert TEXT_TO_VIDEO.required_keys == ("global_layer", "dynamic_layer")
    assert IMAGE_TO_VIDEO.required_keys == (
        "global_caption",
        "reference_bank",
        "shot_timeline",
        "audio_event_timeline",
        "visible_text",
        "generation_requirements",
    )
    assert TEXT_TO_VIDEO.response_format() == {
        "type": "json_schema",
        "json_schema": {"name": "T2VEnhanceResult", "schema": TEXT_TO_VIDEO.schema, "strict": True},
    }
    assert IMAGE_TO_VIDEO.response_format()["json_schema"]["name"] == "I2VEnhanceResult"
    assert task_for(None) is TEXT_TO_VIDEO and task_for("frame.png") is IMAGE_TO_VIDEO


def test_fill_template_replaces_the_prompt_first_then_drops_variation_seeds():
    prompt = "a fox {variation_seed} in snow "
    assert fill_template(TEMPLATE, prompt) == "Make it rich. Idea: a fox  in snow "
    assert fill_template("{user_input_text}|{user_input_text}", "x") == "x|x"


def _skeleton(schema: dict):
    """Each leaf's type; a list shows one item (the shape the package's templates print)."""
    if schema["type"] == "object":
        return {key: _skeleton(value) for key, value in schema["properties"].items()}
    if schema["type"] == "array":
        return [_skeleton(schema["items"])]
    return schema["type"]


@pytest.mark.parametrize("task", [TEXT_TO_VIDEO, IMAGE_TO_VIDEO], ids=["t2v", "i2v"])
def test_the_package_templates_name_every_field_of_their_schema(task):
    template = resolve_templates()[task.name]
    assert template.count("{user_input_text}") == 1
    assert template.count("{variation_seed}") == 1
    start = template.index("\n{\n") + 1
    shown, _ = json.JSONDecoder().raw_decode(template[start:])
    assert json.dumps(shown) == json.dumps(_skeleton(golden(f"prompt_enhancement/{task.name}_response_schema.json")))


def test_template_forms_text_file_folder_and_mapping(tmp_path):
    assert resolve_templates(TEMPLATE) == {"t2v": TEMPLATE, "i2v": TEMPLATE}
    file = tmp_path / "mine.md"
    file.write_text("file: {user_input_text}", encoding="utf-8")
    assert resolve_templates(file) == dict.fromkeys(["t2v", "i2v"], "file: {user_input_text}")
    assert resolve_templates(str(file))["i2v"] == "file: {user_input_text}"
    folder = tmp_path / "prompts"
    folder.mkdir()
    (folder / "i2v.md").write_text("image: {user_input_text}", encoding="utf-8")
    templates = resolve_templates(folder)
    assert templates["i2v"] == "image: {user_input_text}"
    assert templates["t2v"] == resolve_templates()["t2v"]  # a task the folder leaves out keeps the package's
    assert resolve_templates({"t2v": TEMPLATE}) == {"t2v": TEMPLATE, "i2v": resolve_templates()["i2v"]}
    assert resolve_templates(folder=folder)["i2v"] == "image: {user_input_text}"


def test_templates_without_the_prompt_placeholder_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"no \{user_input_text\} placeholder"):
        resolve_templates("Describe a video.")
    file = tmp_path / "bad.md"
    file.write_text("only {variation_seed}", encoding="utf-8")
    with pytest.raises(ValueError, match=r"bad\.md has no \{user_input_text\}"):
        resolve_templates(file)
    with pytest.raises(ValueError, match="holds neither"):
        resolve_templates(tmp_path)
    with pytest.raises(ValueError, match=r"keyed by task.*\['video'\]"):
        resolve_templates({"video": TEMPLATE})
    with pytest.raises(TypeError, match="got int"):
        resolve_templates({"t2v": 3})


def test_user_message_is_one_user_turn_with_a_list_of_parts():
    assert user_message("T") == [{"role": "user", "content": [{"type": "text", "text": "T"}]}]
    message = user_message("T", "https://example.invalid/a.png")
    assert message[0]["content"][1] == {"type": "image_url", "image_url": {"url": "https://example.invalid/a.png"}}


def test_image_urls_pil_as_jpeg_paths_as_their_own_bytes(tmp_path):
    image = Image.new("RGBA", (8, 6), (200, 30, 40, 128))
    jpeg = io.BytesIO()
    image.convert("RGB").save(jpeg, format="JPEG")
    assert image_url(image) == "data:image/jpeg;base64," + base64.b64encode(jpeg.getvalue()).decode()
    payload = b"\x00not really an image\xff"
    for suffix, mime in [
        (".PNG", "image/png"),
        (".webp", "image/webp"),
        (".gif", "image/jpeg"),
        (".jpg", "image/jpeg"),
    ]:
        path = tmp_path / f"frame{suffix}"
        path.write_bytes(payload)
        assert image_url(path) == f"data:{mime};base64," + base64.b64encode(payload).decode()
    for url in ("http://h/x.png", "https://h/x", "data:image/png;base64,AAAA"):
        assert image_url(url) == url
    with pytest.raises(ValueError, match="is not a file"):
        image_url(tmp_path / "missing.png")
    with pytest.raises(TypeError, match="PIL image, a local path"):
        image_url(3.0)


def test_parse_reply_accepts_extra_keys_and_refuses_what_sandai_refuses():
    source = "the endpoint http://127.0.0.1:1/v1/ (model 'm')"
    text = golden_path("prompt_enhancement/t2v_fox_snow.input.json").read_text(encoding="utf-8")
    assert parse_reply(text, TEXT_TO_VIDEO, source) == json.loads(text)
    extra = {"global_layer": {}, "dynamic_layer": {}, "more": 1}
    assert parse_reply(json.dumps(extra), TEXT_TO_VIDEO, source) == extra
    with pytest.raises(ValueError, match=r"http://127\.0\.0\.1:1/v1/ .*not JSON"):
        parse_reply("```json\n{}\n```", TEXT_TO_VIDEO, source)
    with pytest.raises(ValueError, match="not JSON"):
        parse_reply("\ufeff" + text, TEXT_TO_VIDEO, source)
    with pytest.raises(ValueError, match="JSON list, not an object"):
        parse_reply("[1]", TEXT_TO_VIDEO, source)
    with pytest.raises(ValueError, match=r"127\.0\.0\.1.* lacks the required key\(s\) \['dynamic_layer'\]"):
        parse_reply('{"global_layer": {}}', TEXT_TO_VIDEO, source)
    with pytest.raises(ValueError, match=r"i2v reply .* lacks .*'generation_requirements'\]"):
        parse_reply(text, IMAGE_TO_VIDEO, source)
