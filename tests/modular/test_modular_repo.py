"""The modular files of a saved MAGI-2 repo: ``Magi2Pipeline.save_pretrained`` writes ``modular_model_index.json``
(components named by subfolder, never by the writer's folder), ``modular_config.json`` (``auto_map`` +
``requirements``) and the remote-code blocks file; a copy of the folder, and the same repo in the HF cache layout
loaded by id, load in a fresh offline process through ``ModularPipeline.from_pretrained(...,
trust_remote_code=True)`` and ``Magi2ModularPipeline.from_pretrained`` and generate what ``Magi2Pipeline`` does,
with no path rewritten; a pipeline of the text blocks alone loads only the text encoder and tokenizer; a repo
whose modular files disagree with ``model_index.json`` is refused."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from helpers.modular_testing_utils import PROMPT, T2V, run_fresh_offline, tiny_pipelines

from diffusers_magi2.modular_pipelines import Magi2InputStep, Magi2ModularPipeline, Magi2TextEncoderStep
from diffusers_magi2.pipelines.modular_files import write_modular_files


REPO_ID = "org/magi2-tiny-modular"
COMMIT = "0123456789abcdef0123456789abcdef01234567"

LOAD_SCRIPT = """
import sys, numpy as np, torch
from diffusers.modular_pipelines import ModularPipeline
from huggingface_hub import snapshot_download
from diffusers_magi2.modular_pipelines import Magi2ModularPipeline
folder, repo_id, out = sys.argv[1:4]
loaders = {
    "remote_code_folder": lambda: ModularPipeline.from_pretrained(folder, trust_remote_code=True),
    "magi2_hub_id": lambda: Magi2ModularPipeline.from_pretrained(repo_id),
    # diffusers' remote-code loader asks the Hub API for a commit when given an id, so offline it takes the snapshot
    "remote_code_hub": lambda: ModularPipeline.from_pretrained(snapshot_download(repo_id), trust_remote_code=True),
}
results = {}
for name, load in loaders.items():
    pipe = load()
    pipe.load_components()
    missing = [n for n in ("tokenizer", "text_encoder", "transformer", "audio_vae", "scheduler", "vae", "video_decoder")
               if getattr(pipe, n, None) is None]
    assert not missing, (name, missing)
    pipe.set_progress_bar_config(disable=True)
    state = pipe(prompt=PROMPT, generator=torch.Generator().manual_seed(9), **CALL)
    results[name + "_frames"] = state.get("videos")
    results[name + "_audio"] = state.get("audio")
    results[name + "_class"] = np.array(type(pipe).__name__ + "/" + type(pipe.blocks).__name__)
np.savez(out, **results)
print("ok")
"""


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    pipe, _ = tiny_pipelines()
    folder = tmp_path_factory.mktemp("saved") / "magi2-tiny"
    pipe.save_pretrained(folder)
    reference = pipe(PROMPT, generator=torch.Generator().manual_seed(9), **T2V)
    return folder, reference


def test_save_pretrained_writes_the_modular_files(saved):
    folder, _ = saved
    index = json.loads((folder / "model_index.json").read_text())
    modular = json.loads((folder / "modular_model_index.json").read_text())
    config = json.loads((folder / "modular_config.json").read_text())
    assert modular["_class_name"] == "ModularPipeline" and modular["_blocks_class_name"] == "Magi2AutoBlocks"
    for name, entry in index.items():
        if name.startswith("_"):
            continue
        component = isinstance(entry, list) and len(entry) == 2 and all(v is None or isinstance(v, str) for v in entry)
        if component and entry[0] is not None:
            library, cls, spec = modular[name]
            assert [library, cls] == entry and spec["type_hint"] == entry and spec["subfolder"] == name
            assert spec["pretrained_model_name_or_path"] is None  # no Hub id given: the subfolder alone
        elif not component:
            assert modular[name] == entry, name  # config values, e.g. duration_s and trained_resolutions (a list)
    assert "refiner" not in modular  # [null, null] in model_index.json
    for name in ("modular_model_index.json", "modular_config.json"):
        assert str(folder.parent) not in (folder / name).read_text(), name  # nothing names the writer's folder
    assert config["auto_map"] == {"ModularPipelineBlocks": "magi2_modular_blocks.Magi2AutoBlocks"}
    assert list(config["requirements"]) == ["diffusers-magi2"]
    assert (
        "from diffusers_magi2.modular_pipelines import Magi2AutoBlocks"
        in (folder / "magi2_modular_blocks.py").read_text()
    )


def test_saved_repo_loads_offline_in_a_fresh_process_and_generates_the_same(saved, tmp_path):
    """A copy of the folder and the repo in the HF cache layout (its index naming the Hub id, as ``push_to_hub``
    writes it), loaded with ``HF_HUB_OFFLINE=1``."""
    folder, reference = saved
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    cache = tmp_path / "hub"
    snapshot = cache / f"models--{REPO_ID.replace('/', '--')}" / "snapshots" / COMMIT
    shutil.copytree(folder, snapshot)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text(COMMIT)
    write_modular_files(snapshot, repo=REPO_ID)
    script = f"PROMPT = {PROMPT!r}\nCALL = {T2V!r}\n" + LOAD_SCRIPT
    results = run_fresh_offline(script, [copy, REPO_ID], tmp_path, HF_HUB_CACHE=str(cache))
    assert str(results["remote_code_folder_class"]) == "ModularPipeline/Magi2AutoBlocks"
    assert str(results["remote_code_hub_class"]) == "ModularPipeline/Magi2AutoBlocks"
    assert str(results["magi2_hub_id_class"]) == "Magi2ModularPipeline/Magi2AutoBlocks"
    for name in ("remote_code_folder", "magi2_hub_id", "remote_code_hub"):
        assert np.array_equal(results[name + "_frames"], reference.frames), name
        assert np.array_equal(results[name + "_audio"], reference.audio), name


def test_hub_repo_saved_without_repo_id_is_refused_by_id_and_loads_from_its_snapshot(saved, tmp_path):
    """An index written without a Hub id names no source outside the repo: by id it is refused with the fix
    named; its snapshot folder loads its own files."""
    folder, _ = saved
    cache = tmp_path / "hub"
    snapshot = cache / f"models--{REPO_ID.replace('/', '--')}" / "snapshots" / COMMIT
    shutil.copytree(folder, snapshot)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text(COMMIT)
    with pytest.raises(ValueError, match=r"by subfolder only .*snapshot_download"):
        Magi2ModularPipeline.from_pretrained(REPO_ID, cache_dir=cache, local_files_only=True)
    pipe = Magi2ModularPipeline.from_pretrained(snapshot)
    assert pipe.get_component_spec("scheduler").pretrained_model_name_or_path == str(snapshot)
    pipe.load_components(["scheduler"])
    assert type(pipe.scheduler).__name__ == "UniPCMultistepScheduler"


def test_a_text_only_pipeline_loads_only_the_text_encoder_and_its_tokenizer(saved):
    """The text blocks declare the tokenizer, the text encoder and the two guiders (created from their config):
    ``load_components`` loads those two models and nothing else, and they encode what ``Magi2Pipeline`` does."""
    from diffusers.modular_pipelines import SequentialPipelineBlocks

    folder, _ = saved
    blocks = SequentialPipelineBlocks.from_blocks_dict({"input": Magi2InputStep(), "text": Magi2TextEncoderStep()})
    text = Magi2ModularPipeline.from_pretrained(folder, blocks=blocks)
    assert sorted(text.component_names) == ["audio_guider", "guider", "text_encoder", "tokenizer"]
    text.load_components()
    assert {n for n in text.component_names if getattr(text, n) is not None} == set(text.component_names)
    assert sorted(text.pretrained_component_names) == ["text_encoder", "tokenizer"]
    names = ["prompt_embeds", "prompt_attention_mask", "negative_prompt_embeds", "negative_prompt_attention_mask"]
    embeds = text(prompt=PROMPT, **T2V, output=names)
    classic, _ = tiny_pipelines()
    for name, want in zip(names, classic.encode_prompt(PROMPT, device="cpu")):
        assert torch.equal(embeds[name], want), name


@pytest.mark.parametrize(
    "edit, needle",
    [
        (lambda m: m["vae"].__setitem__(1, "AutoencoderKL"), "component 'vae': model_index.json has"),
        (lambda m: m.__setitem__("duration_s", 4.0), "'duration_s': model_index.json has 2.0"),
        (lambda m: m.pop("transformer"), "component 'transformer': model_index.json has"),
    ],
)
def test_modular_files_that_disagree_with_model_index_are_refused(saved, tmp_path, edit, needle):
    folder, _ = saved
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    path = copy / "modular_model_index.json"
    modular = json.loads(path.read_text())
    edit(modular)
    path.write_text(json.dumps(modular))
    with pytest.raises(ValueError, match="modular files disagree with its model_index.json") as error:
        Magi2ModularPipeline.from_pretrained(copy)
    assert needle in str(error.value) and "modular_model_index.json" in str(error.value)


@pytest.mark.parametrize("loader", ["ModularPipeline", "Magi2ModularPipeline"])
def test_both_loaders_refuse_a_guidance_scale_before_any_work(saved, loader):
    """The guidance scales are the guiders': the input step declares them and refuses them, so diffusers' own
    ``ModularPipeline`` (remote code) refuses ``guidance_scale=1.0`` as ``Magi2ModularPipeline`` does, naming the
    update, before the text encoder runs; another name no block takes is diffusers' warning there (the call goes on)
    and refused by ``Magi2ModularPipeline``."""
    import warnings

    from diffusers.modular_pipelines import ModularPipeline

    folder, reference = saved
    if loader == "ModularPipeline":
        pipe = ModularPipeline.from_pretrained(folder, trust_remote_code=True)
    else:
        pipe = Magi2ModularPipeline.from_pretrained(folder)
    pipe.load_components()
    pipe.set_progress_bar_config(disable=True)
    calls = []
    hook = pipe.text_encoder.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        for name, guider in (("guidance_scale", "guider"), ("audio_guidance_scale", "audio_guider")):
            with pytest.raises(
                ValueError, match=rf"^{name} is not an input .*\({guider}=pipe\.{guider}\.new\(guidance_scale=1\.0\)\)"
            ):
                pipe(prompt=PROMPT, **{name: 1.0}, **T2V)
        assert calls == []
        if loader == "Magi2ModularPipeline":
            with pytest.raises(ValueError, match=r"got \['num_frames'\], which none of its blocks takes"):
                pipe(prompt=PROMPT, num_frames=9, **T2V)
            assert calls == []
        else:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                frames = pipe(prompt=PROMPT, num_frames=9, generator=torch.Generator().manual_seed(9), **T2V).get(
                    "videos"
                )
            assert any("num_frames" in str(w.message) and "ignored" in str(w.message) for w in caught)
            np.testing.assert_array_equal(frames, reference.frames)
    finally:
        hook.remove()
