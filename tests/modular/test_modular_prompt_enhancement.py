"""The modular prompt enhancer step (``Magi2AutoPromptEnhancerStep``, run when ``enable_prompt_enhancement`` is true,
after the input step and before the text encoder) against ``Magi2Pipeline``: the same enhancer reply gives the same
enhanced prompt, the same text-encoder input and the same frames, text-to-video and image-to-video; skipped when the
flag is false; the input step refuses the flag without a ``prompt_enhancer`` under both loaders' blocks."""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
import torch
from helpers.enhancer_stubs import ScriptedPromptEnhancer
from helpers.modular_testing_utils import IMAGE, PROMPT, tiny_pipelines

from diffusers_magi2.modular_pipelines import Magi2AutoBlocks
from diffusers_magi2.pipelines import text_conditioning


CALLS = {
    "t2v": {"height": 32, "width": 32, "num_inference_steps": 2},
    "i2v": {"height": 64, "width": 64, "num_inference_steps": 1, "image": IMAGE},
}


@pytest.fixture(scope="module")
def pipes():
    pipe, modular = tiny_pipelines()
    pipe.prompt_enhancer = ScriptedPromptEnhancer()
    modular.update_components(prompt_enhancer=pipe.prompt_enhancer)
    return pipe, modular


def test_the_block_sits_after_the_input_step_and_before_the_text_encoder():
    names = list(Magi2AutoBlocks().sub_blocks)
    assert names[:4] == ["input", "prompt_enhancer", "image_encoder", "text_encoder"]


@pytest.mark.parametrize("task", ["t2v", "i2v"])
def test_modular_block_and_classic_pipeline_give_the_same_prompt_and_frames(pipes, task):
    pipe, modular = pipes
    call = CALLS[task]
    enhancer = pipe.prompt_enhancer
    seen = {}
    encode = text_conditioning.encode_prompt_text
    for name, run in (
        ("classic", lambda: pipe(PROMPT, generator=torch.Generator().manual_seed(5), **call).frames),
        (
            "modular",
            lambda: modular(prompt=PROMPT, generator=torch.Generator().manual_seed(5), **call, output="videos"),
        ),
    ):
        enhancer.calls.clear()
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
        seen[name] = (list(enhancer.calls), texts, plain, enhanced)
    classic, modular_seen = seen["classic"], seen["modular"]
    assert [p for p, _ in classic[0]] == [PROMPT]  # the plain call asked nothing, the enhanced one once
    assert [p for p, _ in modular_seen[0]] == [PROMPT]
    assert classic[1] == modular_seen[1] and any(text.startswith(f"# {task}\n") for text in classic[1])
    np.testing.assert_array_equal(classic[2], modular_seen[2])
    np.testing.assert_array_equal(classic[3], modular_seen[3])
    assert not np.array_equal(classic[2], classic[3])  # the rewrite changed the conditioning
    state = modular(prompt=PROMPT, enable_prompt_enhancement=True, **call, output="prompt")
    assert state == [pipe.enhance_prompt(PROMPT, image=call.get("image"))]


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
