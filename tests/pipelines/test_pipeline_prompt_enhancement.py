"""Prompt enhancement in ``Magi2Pipeline`` (``pipelines/enhancement_magi2.py``): each prompt of a call rewritten
once before encoding (never the negative prompt; a JSON prompt as its raw text), the rewrite being exactly what the
text encoder receives (with the ``<Figure 1>`` reference for I2V); the refusals before any work; ``enhance_prompt``;
and the optional ``prompt_enhancer`` component's save and load. (Under CP 2: ``tests/parallel/test_cp_pipeline.py``.)"""

from __future__ import annotations

import json
from unittest import mock

import numpy as np
import PIL.Image
import pytest
import torch
from helpers.chat_completions_stub import ChatCompletionsStub
from helpers.enhancer_stubs import ScriptedPromptEnhancer
from helpers.fixtures import golden_text

from diffusers_magi2 import Magi2Pipeline, Magi2PromptEnhancer, build_tiny_random_pipeline
from diffusers_magi2.pipelines import text_conditioning


CALL = {"height": 32, "width": 32, "num_inference_steps": 1, "output_type": "latent"}
IMAGE = np.random.default_rng(0).integers(0, 256, (40, 64, 3), dtype=np.uint8)
#: SandAI's figure reference, appended to a non-JSON I2V prompt with no separator
FIGURE_REFERENCE = "reference_layer:The first frame refers to <Figure 1>"
#: the ``model_index.json`` entry of a saved ``Magi2PromptEnhancer``
ENTRY = ("diffusers_magi2.pipelines.prompt_enhancement", "Magi2PromptEnhancer")


def rewrite(prompt: str, task: str = "t2v") -> str:
    """What :class:`ScriptedPromptEnhancer` returns for ``prompt`` by default."""
    return f"# {task}\n\nsubject:{prompt}\n"


@pytest.fixture(scope="module")
def tiny():
    pipe = build_tiny_random_pipeline()
    pipe.register_to_config(duration_s=2.0)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture()
def encoded_texts():
    """Every text the text encoder is given in the test, in order."""
    texts = []
    encode = text_conditioning.encode_prompt_text

    def spy(tokenizer, text_encoder, text, *args, **kwargs):
        texts.append(text)
        return encode(tokenizer, text_encoder, text, *args, **kwargs)

    with mock.patch.object(text_conditioning, "encode_prompt_text", spy):
        yield texts


@pytest.fixture()
def enhancer(tiny):
    tiny.prompt_enhancer = ScriptedPromptEnhancer()
    yield tiny.prompt_enhancer
    tiny.prompt_enhancer = None


def _seed():
    return torch.Generator().manual_seed(3)


@pytest.mark.parametrize("case", ["t2v_fox_snow", "i2v_street_night"])
def test_the_endpoints_reply_rendered_is_exactly_what_the_text_encoder_receives(tiny, encoded_texts, case):
    """The real enhancer and ``openai`` client against a chat-completions server on 127.0.0.1 answering a fixture
    reply: the text encoder receives SandAI's rendering byte for byte (T2V: the Markdown; I2V: the Markdown with the
    ``<Figure 1>`` reference, ``.with_figure_reference.txt``), and the server was asked once, for the call's task."""
    reply = golden_text(f"prompt_enhancement/{case}.input.json")
    i2v = case.startswith("i2v")
    want = golden_text(f"prompt_enhancement/{case}.{'with_figure_reference.txt' if i2v else 'render_markdown.md'}")
    call = {**CALL, "height": 64, "width": 64, "image": IMAGE} if i2v else CALL
    with ChatCompletionsStub(reply=reply) as server:
        tiny.prompt_enhancer = Magi2PromptEnhancer.from_endpoint(
            server.base_url, model="stub", timeout=0.9, max_retries=0
        )
        try:
            tiny(
                "a quiet street", enable_prompt_enhancement=True, guidance_scale=1.0, audio_guidance_scale=1.0, **call
            )
        finally:
            tiny.prompt_enhancer = None
    assert encoded_texts == [want]
    assert len(server.requests) == 1
    assert server.requests[0]["response_format"]["json_schema"]["name"] == (
        "I2VEnhanceResult" if i2v else "T2VEnhanceResult"
    )


def test_each_prompt_is_enhanced_once_and_its_rewrite_is_what_the_text_encoder_receives(tiny, enhancer, encoded_texts):
    """Two prompts, one a JSON object, two videos each, CFG: the enhancer sees each raw prompt once (the JSON as its
    text, not the compact Markdown it would be encoded as), never the negative prompt; the text encoder gets the two
    rewrites and the negative prompt as given, and the latents equal a call given the rewrites as its prompts."""
    prompts = ["a cat on a piano", json.dumps({"global_layer": {"scene": "snow"}, "dynamic_layer": []})]
    out = tiny(
        prompts, negative_prompt="blurry", num_videos_per_prompt=2, enable_prompt_enhancement=True,
        generator=_seed(), **CALL,
    )  # fmt: skip
    assert enhancer.calls == [(prompts[0], None), (prompts[1], None)]
    assert encoded_texts == [rewrite(prompts[0]), rewrite(prompts[1]), "blurry", "blurry"]
    tiny.prompt_enhancer = None
    direct = tiny(
        [rewrite(p) for p in prompts], negative_prompt="blurry", num_videos_per_prompt=2, generator=_seed(), **CALL
    )
    assert out.frames.shape[0] == 4
    assert torch.equal(out.frames, direct.frames) and torch.equal(out.audio, direct.audio)


def test_image_to_video_asks_the_i2v_task_with_the_image_and_encodes_the_rewrite_with_the_figure_reference(
    tiny, enhancer, encoded_texts
):
    """A numpy image reaches the enhancer as the same pixels in a PIL image (the image-to-video task); the text
    encoder gets the rewrite with SandAI's ``<Figure 1>`` reference appended, as ``enhance_prompt`` returns it plus
    that reference."""
    call = {**CALL, "height": 64, "width": 64, "guidance_scale": 1.0, "audio_guidance_scale": 1.0}
    tiny("a fox", image=IMAGE, enable_prompt_enhancement=True, **call)
    ((prompt, image),) = enhancer.calls
    assert prompt == "a fox" and isinstance(image, PIL.Image.Image)
    np.testing.assert_array_equal(np.asarray(image), IMAGE)
    assert encoded_texts == [rewrite("a fox", "i2v") + FIGURE_REFERENCE]
    assert tiny.enhance_prompt("a fox", image=IMAGE) + FIGURE_REFERENCE == encoded_texts[0]


def test_enhance_prompt_returns_a_str_for_a_str_and_a_list_for_a_list(tiny, enhancer):
    assert tiny.enhance_prompt("a cat") == rewrite("a cat")
    assert tiny.enhance_prompt(["a cat", "a dog"]) == [rewrite("a cat"), rewrite("a dog")]
    assert [p for p, _ in enhancer.calls] == ["a cat", "a cat", "a dog"]


@pytest.mark.parametrize(
    "set_up, kwargs, error, needle",
    [
        (None, {}, ValueError, r"needs a prompt enhancer and this pipeline has none: set one with "
         r"pipe.prompt_enhancer = Magi2PromptEnhancer.from_endpoint\(base_url=..., model=...\)"),
        (ScriptedPromptEnhancer(), {"prompt": None, "prompt_embeds": "embeds"}, ValueError,
         "enable_prompt_enhancement=True rewrites the prompt's text, so it takes prompt, not prompt_embeds"),
        (ScriptedPromptEnhancer(), {"enable_prompt_enhancement": "yes"}, ValueError,
         "enable_prompt_enhancement must be True or False; got 'yes'"),
        (ScriptedPromptEnhancer(failure="the endpoint http://127.0.0.1:9/v1 (model 'm') could not be reached"), {},
         RuntimeError, r"^the endpoint http://127.0.0.1:9/v1 \(model 'm'\) could not be reached$"),
    ],
)  # fmt: skip
def test_bad_enhancement_raises_before_any_encoding_or_denoising(tiny, set_up, kwargs, error, needle):
    """No enhancer, ``prompt_embeds``, a flag that is not a bool, an enhancer error (the endpoint's, unchanged):
    each raises before the text encoder or the transformer runs."""
    if kwargs.get("prompt_embeds") == "embeds":
        embeds, mask, *_ = tiny.encode_prompt("a cat", do_classifier_free_guidance=False, device="cpu")
        kwargs = {**kwargs, "prompt_embeds": embeds, "prompt_attention_mask": mask}
    call = {"prompt": "a cat", "enable_prompt_enhancement": True, **CALL, **kwargs}
    calls = []
    hooks = [m.register_forward_pre_hook(lambda *_: calls.append(1)) for m in (tiny.text_encoder, tiny.transformer)]
    tiny.prompt_enhancer = set_up
    try:
        with pytest.raises(error, match=needle):
            tiny(**call)
    finally:
        tiny.prompt_enhancer = None
        for hook in hooks:
            hook.remove()
    assert calls == []


def test_the_prompt_enhancer_is_an_optional_component_saved_and_loaded(tiny, tmp_path):
    """Absent by default (``model_index.json``: ``[null, null]``); set as an attribute, ``save_pretrained`` writes
    it into ``prompt_enhancer/`` with its ``[module, class]`` in both indexes, keeps it on the pipeline, and
    ``from_pretrained`` loads it back; ``prompt_enhancer=`` replaces or drops it; the other entries do not move."""
    plain = tmp_path / "plain"
    tiny.save_pretrained(plain)
    plain_index = json.loads((plain / "model_index.json").read_text())
    assert tiny.prompt_enhancer is None and plain_index["prompt_enhancer"] == [None, None]

    enhancer = Magi2PromptEnhancer.from_endpoint(
        "http://127.0.0.1:9/v1", model="m", template="Caption: {user_input_text}", max_retries=0
    )
    tiny.prompt_enhancer = enhancer
    try:
        tiny.save_pretrained(tmp_path / "with")
        assert tiny.prompt_enhancer is enhancer
        assert tiny.config.prompt_enhancer == ENTRY
    finally:
        tiny.prompt_enhancer = None
    index = json.loads((tmp_path / "with" / "model_index.json").read_text())
    assert index["prompt_enhancer"] == list(ENTRY)
    assert {k: v for k, v in index.items() if k != "prompt_enhancer"} == {
        k: v for k, v in plain_index.items() if k != "prompt_enhancer"
    }
    modular = json.loads((tmp_path / "with" / "modular_model_index.json").read_text())
    assert modular["prompt_enhancer"][:2] == index["prompt_enhancer"]

    loaded = Magi2Pipeline.from_pretrained(tmp_path / "with")
    assert isinstance(loaded.prompt_enhancer, Magi2PromptEnhancer)
    keys = ("kind", "base_url", "model", "timeout", "max_retries")
    assert [loaded.prompt_enhancer.config[k] for k in keys] == ["endpoint", "http://127.0.0.1:9/v1", "m", 180.0, 0]
    assert loaded.prompt_enhancer.templates == {
        "t2v": "Caption: {user_input_text}",
        "i2v": "Caption: {user_input_text}",
    }
    assert Magi2Pipeline.from_pretrained(tmp_path / "with", prompt_enhancer=None).prompt_enhancer is None
    other = ScriptedPromptEnhancer()
    assert Magi2Pipeline.from_pretrained(plain, prompt_enhancer=other).prompt_enhancer is other
