"""The README's composed Modular example, run on a saved tiny default: the text blocks alone give the
embeddings, the remaining blocks run with two seeds from them, each seed's frames equal the full modular
pipeline's with that seed, the two seeds differ, the ``ComponentsManager`` holds every model once for all three
pipelines, and the text pipeline holds only the text encoder, its tokenizer and the guiders."""

from __future__ import annotations

import numpy as np
import torch
from helpers.fixtures import REPO_ROOT
from helpers.modular_testing_utils import T2V, tiny_pipelines


OFFLOAD_LINE = 'manager.enable_auto_cpu_offload(device="cuda")\n'
CALL_LINE = 'call = {"height": 512, "width": 896, "num_inference_steps": 100}  # the defaults\n'


def readme_python(marker: str) -> str:
    readme = (REPO_ROOT / "README.md").read_text()
    return readme.split(f"<!-- {marker} -->", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]


def test_readme_composed_example_runs_and_each_seed_equals_the_full_pipeline(tmp_path):
    classic, _ = tiny_pipelines()
    folder = tmp_path / "magi2-tiny"
    classic.save_pretrained(folder)
    code = readme_python("modular-composed")
    # the only edits: this repo, the tiny call, no GPU offload on a CPU
    for old, new in (
        ('"magi2-preview-diffusers"', repr(str(folder))),
        (CALL_LINE, f"call = {T2V!r}\n"),
        (OFFLOAD_LINE, ""),
    ):
        assert code.count(old) == 1, old
        code = code.replace(old, new)
    namespace: dict = {}
    exec(compile(code, "README.md:modular-composed", "exec"), namespace)
    pipe, embeds, frames, manager = (namespace[k] for k in ("pipe", "embeds", "frames", "manager"))

    assert sorted(embeds) == sorted(namespace["names"])
    assert all(isinstance(embeds[n], torch.Tensor) for n in embeds)
    assert embeds["prompt_embeds"].dtype == torch.bfloat16 and embeds["negative_prompt_embeds"] is not None
    assert not np.array_equal(frames[0], frames[1])
    call, prompt = namespace["call"], namespace["prompt"]
    assert frames[0].shape[1] == 25  # the repo's duration_s (2 s), not the default 10 s
    for seed in (0, 1):
        full = pipe(prompt=prompt, **call, generator=torch.Generator().manual_seed(seed), output="videos")
        assert np.array_equal(frames[seed], full), seed
    # the text stage ran alone: pipe's own blocks are whole; the video pipeline has no text encoder block
    assert "text_encoder" in pipe.blocks.sub_blocks and "text_encoder" not in namespace["video"].blocks.sub_blocks
    # one copy of each model, shared by the three pipelines
    models = [c for c in manager.components.values() if isinstance(c, torch.nn.Module)]
    assert len(models) == len({id(m) for m in models}) >= 5
    for name in ("transformer", "video_decoder", "audio_vae"):
        assert getattr(namespace["video"], name) is getattr(pipe, name)
    # the text pipeline has only what its blocks declare, shared with pipe
    text = namespace["text"]
    assert sorted(text.component_names) == ["audio_guider", "guider", "text_encoder", "tokenizer"]
    assert text.text_encoder is pipe.text_encoder and text.guider is pipe.guider


def test_readme_guider_swap_runs_and_sets_both_guiders():
    """The README's guider snippet on the tiny default: the video guider becomes APG, the audio guider CFG at 6,
    and the frames differ from the default guiders' with the same seed."""
    from diffusers.guiders import AdaptiveProjectedGuidance, ClassifierFreeGuidance

    _, pipe = tiny_pipelines()
    call = ", **CALL, generator=torch.Generator().manual_seed(2))"  # the only edit: the tiny call, a seed
    code = readme_python("modular-guider")
    assert code.count('output="videos")') == 1
    default = pipe(
        prompt="A red fox trots through fresh snow at dawn", **T2V, generator=torch.Generator().manual_seed(2)
    )
    namespace = {"pipe": pipe, "torch": torch, "CALL": T2V}
    exec(
        compile(code.replace('output="videos")', 'output="videos"' + call), "README.md:modular-guider", "exec"),
        namespace,
    )
    assert isinstance(pipe.guider, AdaptiveProjectedGuidance) and pipe.guider.guidance_scale == 5.0
    assert isinstance(pipe.audio_guider, ClassifierFreeGuidance) and pipe.audio_guider.guidance_scale == 6.0
    assert namespace["video"].shape == default.get("videos").shape
    assert not np.array_equal(namespace["video"], default.get("videos"))
