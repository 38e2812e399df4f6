"""The block structure of ``Magi2AutoBlocks``: ``sub_blocks`` and the printed docs name every block with its
inputs and outputs; each step declares only the components it uses; no block reaches into ``Magi2Pipeline`` (its
private names, a subclass, borrowed attributes, ``weakref`` or ``object.__setattr__``); the auto blocks pick
text-to-video, image-to-video and the two-stage path from the inputs; bad input names the block, the input or the
violated ``ComponentSpec``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from helpers.modular_testing_utils import PROMPT, T2V, tiny_pipelines

import diffusers_magi2.modular_pipelines as modular_pipelines
from diffusers_magi2.modular_pipelines import Magi2AutoBlocks, Magi2DecodeStep


#: every block of Magi2AutoBlocks by path (loop sub-blocks included) and its class
EXPECTED_BLOCKS = {
    "input": "Magi2InputStep",
    "prompt_enhancer": "Magi2AutoPromptEnhancerStep",
    "prompt_enhancer.prompt_enhancer": "Magi2PromptEnhancerStep",
    "image_encoder": "Magi2AutoImageEncoderStep",
    "image_encoder.image_encoder": "Magi2ImageEncoderStep",
    "text_encoder": "Magi2TextEncoderStep",
    "denoise": "Magi2CoreDenoiseStep",
    "denoise.broadcast": "Magi2BroadcastConditioningStep",
    "denoise.set_timesteps": "Magi2SetTimestepsStep",
    "denoise.prepare_latents": "Magi2PrepareLatentsStep",
    "denoise.denoise": "Magi2DenoiseStep",
    "denoise.denoise.before_denoiser": "Magi2LoopBeforeDenoiser",
    "denoise.denoise.denoiser": "Magi2LoopDenoiser",
    "denoise.denoise.after_denoiser": "Magi2LoopAfterDenoiser",
    "refiner": "Magi2AutoRefinerStep",
    "refiner.refiner": "Magi2RefinerDenoiseStep",
    "refiner.refiner.before_denoiser": "Magi2LoopBeforeDenoiser",
    "refiner.refiner.denoiser": "Magi2RefinerLoopDenoiser",
    "refiner.refiner.after_denoiser": "Magi2LoopAfterDenoiser",
    "decode": "Magi2DecodeStep",
    "decode.video_decoder": "Magi2VideoDecoderStep",
    "decode.audio_decoder": "Magi2AudioDecoderStep",
}


def _walk(block, prefix=""):
    for name, sub in block.sub_blocks.items():
        path = f"{prefix}{name}"
        yield path, sub
        yield from _walk(sub, path + ".")


def test_sub_blocks_list_every_block():
    blocks = Magi2AutoBlocks()
    assert list(blocks.sub_blocks) == [
        "input", "prompt_enhancer", "image_encoder", "text_encoder", "denoise", "refiner", "decode"
    ]  # fmt: skip
    assert {path: type(b).__name__ for path, b in _walk(blocks)} == EXPECTED_BLOCKS


def test_printed_docs_name_every_block_input_and_output():
    blocks = Magi2AutoBlocks()
    printed = repr(blocks)
    for name in blocks.sub_blocks:
        assert f"{name} ({type(blocks.sub_blocks[name]).__name__})" in printed
    for path, block in _walk(blocks):
        doc = block.doc
        assert type(block).__name__ in doc and block.description.split(":")[0] in doc, path
        for param in block.inputs:
            assert f"{param.name} (" in doc, (path, param.name)
        for param in block.outputs:
            assert f"{param.name} (" in doc, (path, param.name)
    top = blocks.doc
    for name in ("prompt", "image", "generator", "num_inference_steps", "prompt_embeds", "callback_on_step_end"):
        assert f"{name} (" in top, name
    for name in ("videos", "audio", "audio_sample_rate", "fps"):
        assert f"{name} (" in top.split("Outputs:")[1], name
    # intermediate values produced inside are not top-level inputs
    assert "timesteps (" not in top.split("Outputs:")[0]


#: the components each leaf step declares (the guiders are created from their config: nothing loads)
DECLARED_COMPONENTS = {
    "input": [],
    "prompt_enhancer.prompt_enhancer": ["prompt_enhancer"],
    "image_encoder.image_encoder": ["vae"],
    "text_encoder": ["audio_guider", "guider", "text_encoder", "tokenizer"],
    "denoise.broadcast": [],
    "denoise.set_timesteps": ["scheduler"],
    "denoise.prepare_latents": [],
    "denoise.denoise.before_denoiser": [],
    "denoise.denoise.denoiser": ["audio_guider", "guider", "transformer"],
    "denoise.denoise.after_denoiser": [],
    "refiner.refiner.before_denoiser": [],
    "refiner.refiner.denoiser": ["guider", "refiner"],
    "refiner.refiner.after_denoiser": [],
    "decode.video_decoder": ["vae", "video_decoder"],
    "decode.audio_decoder": ["audio_vae"],
}


def test_each_step_declares_only_the_components_it_uses():
    leaves = {path: block for path, block in _walk(Magi2AutoBlocks()) if not block.sub_blocks}
    assert {path: sorted(s.name for s in block.expected_components) for path, block in leaves.items()} == (
        DECLARED_COMPONENTS
    )
    refiner = Magi2AutoBlocks().sub_blocks["refiner"].sub_blocks["refiner"]
    assert sorted(s.name for s in refiner.expected_components) == ["guider", "refiner", "scheduler"]


def _reaches_into_the_classic_pipeline(tree: ast.AST) -> list[str]:
    """What in a module's syntax tree uses ``Magi2Pipeline``'s internals (its public signatures may be read)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "Magi2Pipeline":
            if node.attr not in ("__init__", "__call__"):  # the signatures the blocks read their defaults from
                found.append(f"line {node.lineno}: Magi2Pipeline.{node.attr}")
        elif isinstance(node, ast.ClassDef) and any(getattr(b, "id", None) == "Magi2Pipeline" for b in node.bases):
            found.append(f"line {node.lineno}: class {node.name}(Magi2Pipeline)")
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names]
            module = getattr(node, "module", None) or ""
            if "weakref" in names or module == "weakref":
                found.append(f"line {node.lineno}: imports weakref")
            if "pipelines" in module.split(".") and any(n.startswith("_") for n in names):
                found.append(f"line {node.lineno}: imports a private name from {module}")
        elif (
            isinstance(node, ast.Attribute)
            and node.attr == "__setattr__"
            and getattr(node.value, "id", "") == "object"
        ):
            found.append(f"line {node.lineno}: object.__setattr__")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            name, owner = node.func.attr, getattr(node.func.value, "id", None)
            if name.startswith("_") and not name.startswith("__") and owner not in ("self", "components"):
                found.append(f"line {node.lineno}: calls {ast.unparse(node.func)}")  # another object's private method
    return found


def test_no_block_reaches_into_the_classic_pipeline():
    """The blocks call public functions with explicit arguments: a refactor of ``Magi2Pipeline``'s private methods
    cannot break them silently."""
    folder = Path(modular_pipelines.__file__).parent
    found = {}
    for path in sorted(folder.glob("*.py")):
        hits = _reaches_into_the_classic_pipeline(ast.parse(path.read_text()))
        if hits:
            found[path.name] = hits
    assert found == {}
    # the check sees what the blocks once did
    old = "class S(Magi2Pipeline):\n    def __init__(self, m):\n        object.__setattr__(self, 'm', weakref.proxy(m))\n"
    old += "import weakref\nx = Magi2Pipeline._video_latent_geometry\nv = classic_steps(c)._step_velocities(t)\n"
    assert len(_reaches_into_the_classic_pipeline(ast.parse(old))) == 5


def test_a_composite_step_states_its_description_once_and_a_subclass_inherits_it():
    """A composite step's description is its docstring on one line; a subclass without one keeps its base's."""

    class MyDecodeStep(Magi2DecodeStep):
        pass

    assert Magi2DecodeStep().description == " ".join(Magi2DecodeStep.__doc__.split())
    assert MyDecodeStep().description == Magi2DecodeStep().description
    assert "MyDecodeStep" in repr(MyDecodeStep())


def test_auto_blocks_select_the_path_from_the_inputs():
    blocks = Magi2AutoBlocks()
    t2v = blocks.get_execution_blocks(prompt=PROMPT)
    i2v = blocks.get_execution_blocks(prompt=PROMPT, image=object())
    assert "image_encoder" not in dict(_walk(t2v)) and "image_encoder" in dict(_walk(i2v))
    # the refiner runs when the input step plans it (refiner_config, set for 1088x1920 or a preview size)
    image_step = blocks.sub_blocks["image_encoder"]
    refiner_step = blocks.sub_blocks["refiner"]
    assert image_step.select_block(image=None) is None and image_step.select_block(image=object()) == "image_encoder"
    assert refiner_step.select_block(refiner_config=None) is None
    assert refiner_step.select_block(refiner_config=object()) == "refiner"


@pytest.fixture(scope="module")
def pipes():
    return tiny_pipelines()


def test_missing_required_input_names_the_block_and_the_input(pipes):
    decode = Magi2DecodeStep().init_pipeline()
    decode.update_components(video_decoder=pipes[0].video_decoder, audio_vae=pipes[0].audio_vae)
    with pytest.raises(ValueError, match=r"Magi2VideoDecoderStep: required input 'latents' is missing"):
        decode(output_type="np")
    with pytest.raises(ValueError, match=r"Magi2AudioDecoderStep: required input 'audio_latents' is missing"):
        decode(latents=torch.zeros(1, 48, 1, 1, 1), output_type="latent")


def test_component_of_the_wrong_type_names_the_spec_before_any_work(pipes):
    pipe, modular = pipes
    wrong = Magi2AutoBlocks().init_pipeline()
    wrong.update_components(**{**pipe.components, "video_decoder": pipe.audio_vae})
    calls = []
    hook = pipe.text_encoder.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        with pytest.raises(ValueError) as error:
            wrong(prompt=PROMPT, **T2V)
    finally:
        hook.remove()
    message = str(error.value)
    assert "Magi2InputStep: component 'video_decoder' is a diffusers.models" in message
    assert (
        "ComponentSpec(name='video_decoder', type_hint=diffusers_magi2.models.turbo_vae.Magi2TurboVAEDecoder)"
        in message
    )
    assert calls == []  # nothing was encoded


def test_bad_call_argument_raises_before_any_work(pipes):
    _, modular = pipes
    with pytest.raises(ValueError, match="height must be a positive multiple of 16"):
        modular(prompt=PROMPT, height=30, width=32)


def test_input_step_reads_the_trained_resolutions_from_the_config(pipes, caplog):
    """The modular input step warns outside the pipeline's ``trained_resolutions`` config value, as the classic."""
    import logging

    from diffusers.utils import logging as dlogging

    from diffusers_magi2.modular_pipelines.before_denoise import Magi2InputStep

    pipe, modular = pipes
    assert modular.config["trained_resolutions"] == pipe.config.trained_resolutions == [[256, 448], [512, 896]]
    texts = []
    for trained in (None, [[32, 32]]):
        step = Magi2InputStep().init_pipeline()
        step.update_components(**{k: v for k, v in pipe.components.items() if k in step.component_names})
        if trained is not None:
            step.update_components(trained_resolutions=trained)
        dlogging.enable_propagation()
        try:
            with caplog.at_level(logging.WARNING):
                caplog.clear()
                step(prompt=PROMPT, **T2V)
        finally:
            dlogging.disable_propagation()
        texts.append(caplog.text)
    assert "32x32 is outside the trained resolutions ((256, 448), (512, 896))" in texts[0]
    assert "outside the trained resolutions" not in texts[1]
