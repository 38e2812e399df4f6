"""The modular prompt enhancer step (``Magi2AutoPromptEnhancerStep``, run when ``enable_prompt_enhancement`` is true,
after the input step and before the text encoder) against ``Magi2Pipeline``, one ``Magi2PromptEnhancer`` asking a
chat-completions server on 127.0.0.1 that answers a fixture reply: the same enhanced prompt (SandAI's rendering),
the same text-encoder input and the same frames, text-to-video and image-to-video; nothing asked when the flag is
false; the input step refuses the flag without a ``prompt_enhancer``."""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
import torch
from helpers.chat_completions_stub import ChatCompletionsStub
from helpers.fixtures import golden_text
from helpers.modular_testing_utils import IMAGE, PROMPT, tiny_pipelines

from diffusers_magi2 import Magi2PromptEnhancer
from diffusers_magi2.modular_pipelines import Magi2AutoBlocks
from diffusers_magi2.pipelines import text_conditioning


#: the fixture case whose reply the server sends, per task
CASES = {"t2v": "t2v_cooking_multiline", "i2v": "i2v_chinese_teahouse"}
CALLS = {
    "t2v": {"height": 32, "width": 32, "num_inference_steps": 2},
    "i2v": {"height": 64, "width": 64, "num_inference_steps": 1, "image": IMAGE},
}


@pytest.fixture(scope="module")
def server():
    with ChatCompletionsStub() as stub:
        yield stub


@pytest.fixture(scope="module")
def pipes(server):
    pipe, modular = tiny_pipelines()
    pipe.prompt_enhancer = Magi2PromptEnhancer.from_endpoint(server.base_url, model="stub", timeout=0.9, max_retries=0)
    modular.update_components(prompt_enhancer=pipe.prompt_enhancer)
    return pipe, modular


def test_the_block_sits_after_the_input_step_and_before_the_text_encoder():
    names = list(Magi2AutoBlocks().sub_blocks)
    assert names[:4] == ["input", "prompt_enhancer", "image_encoder", "text_encoder"]


@pytest.mark.parametrize("task", ["t2v", "i2v"])
def test_modular_block_and_classic_pipeline_give_the_same_prompt_and_frames(pipes, server, task):
    pipe, modular = pipes
    call = CALLS[task]
    server.reply = golden_text(f"prompt_enhancement/{CASES[task]}.input.json")
    markdown = golden_text(f"prompt_enhancement/{CASES[task]}.render_markdown.md")
    seen = {}
    encode = text_conditioning.encode_prompt_text
    for name, run in (
        ("classic", lambda: pipe(PROMPT, generator=torch.Generator().manual_seed(5), **call).frames),
        (
            "modular",
            lambda: modular(prompt=PROMPT, generator=torch.Generator().manual_seed(5), **call, output="videos"),
        ),
    ):
        server.requests.clear()
        texts = []

        def spy(tokenizer, text_encoder, text, *args, **kwargs):
            texts.append(text)
            return encode(tokenizer, text_encoder, text, *args, **kwargs)

        with mock.patch.object(text_conditioning, "encode_prompt_text", spy):
            plain = run()
            call["enable_prompt_enhancement"] = True
            try:
                enhanced = run()
            finally:
                call.pop("enable_prompt_enhancement")
        seen[name] = (len(server.requests), texts, plain, enhanced)
    classic, modular_seen = seen["classic"], seen["modular"]
    assert classic[0] == modular_seen[0] == 1  # the plain call asked nothing, the enhanced one once
    assert classic[1] == modular_seen[1]
    figure = "reference_layer:The first frame refers to <Figure 1>" if task == "i2v" else ""
    assert classic[1][2] == markdown + figure  # plain call: prompt, negative; enhanced call: the rewrite, negative
    np.testing.assert_array_equal(classic[2], modular_seen[2])
    np.testing.assert_array_equal(classic[3], modular_seen[3])
    assert not np.array_equal(classic[2], classic[3])  # the rewrite changed the conditioning
    state = modular(prompt=PROMPT, enable_prompt_enhancement=True, **call, output="prompt")
    assert state == [pipe.enhance_prompt(PROMPT, image=call.get("image"))] == [markdown]


def test_the_flag_without_an_enhancer_is_refused_by_the_input_step(pipes):
    pipe, modular = pipes
    _, bare = tiny_pipelines()
    calls = []
    hook = bare.text_encoder.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        with pytest.raises(ValueError, match="needs a prompt enhancer and this pipeline has none"):
            bare(prompt=PROMPT, enable_prompt_enhancement=True, **CALLS["t2v"])
    finally:
        hook.remove()
    assert calls == []


@pytest.mark.parametrize("loader", ["ModularPipeline", "Magi2ModularPipeline"])
def test_a_saved_enhancer_loads_with_both_modular_loaders(tmp_path, loader):
    """``Magi2Pipeline.save_pretrained`` names the enhancer in ``modular_model_index.json`` too, and diffusers'
    ``load_components`` (which passes ``variant`` and ``revision`` to every component) reads it back."""
    from diffusers.modular_pipelines import ModularPipeline

    from diffusers_magi2.modular_pipelines import Magi2ModularPipeline

    pipe, _ = tiny_pipelines()
    pipe.prompt_enhancer = Magi2PromptEnhancer.from_endpoint("http://127.0.0.1:9/v1", model="saved-model")
    pipe.save_pretrained(tmp_path / "repo")
    if loader == "ModularPipeline":
        modular = ModularPipeline.from_pretrained(tmp_path / "repo", trust_remote_code=True)
    else:
        modular = Magi2ModularPipeline.from_pretrained(tmp_path / "repo")
    modular.load_components()
    assert isinstance(modular.prompt_enhancer, Magi2PromptEnhancer)
    assert (modular.prompt_enhancer.config.model, modular.prompt_enhancer.config.base_url) == (
        "saved-model",
        "http://127.0.0.1:9/v1",
    )
