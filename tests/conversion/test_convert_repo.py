"""Repository-level conversion through ``magi2-convert``: bad inputs, the output folder contract,
``model_index.json``, the model card, ``--push_to_hub`` (mocked), the whole release layout,
and loading by repo id from a local Hugging Face cache with ``HF_HUB_OFFLINE=1``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from helpers.convert_testing_utils import (
    checkpoint_dir,
    config_path,
    copy_checkpoint,
    mutate_tensor,
    read_index,
    rewrite_shard,
    run_cli,
    write_index,
)
from helpers.fixtures import REPO_ROOT, fixtures_root
from helpers.fresh_interpreter import run_fresh_checks

from diffusers_magi2.conversion.model_card import format_parameter_count
from diffusers_magi2.models.transformer_magi2 import Magi2Transformer3DModel


COMPONENTS = fixtures_root() / "magi2_tiny_components"
H4_CONFIG = config_path("preview_h4")


def _transformer_args(ckpt, out, *extra):
    return ["--preview_dir", ckpt, "--config", H4_CONFIG, "--output_path", out, "--components", "transformer", *extra]


def _assert_failed_cleanly(tmp_path, rc, err, needle, out):
    assert rc != 0
    assert needle in err, err
    assert not out.exists()
    assert list(out.parent.glob(f".{out.name}.*")) == []  # no temporary folder left behind


# --------------------------------------------------------------------------- bad inputs, each a test


def _drop_second_shard(ckpt):
    (ckpt / sorted(set(read_index(ckpt)["weight_map"].values()))[1]).unlink()
    return "missing shard file"


def _truncate_first_shard(ckpt):
    path = ckpt / sorted(set(read_index(ckpt)["weight_map"].values()))[0]
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) - 1000])
    return "truncated shard"


def _key_missing_from_index(ckpt):
    index = read_index(ckpt)
    del index["weight_map"]["block.layers.2.mlp.moe_mlp.W_down"]
    write_index(ckpt, index)
    return "block.layers.2.mlp.moe_mlp.W_down: present in shard model-00002-of-00002.safetensors but absent from the index"


def _unexpected_key(ckpt):
    index = read_index(ckpt)
    fname = index["weight_map"]["pre_adapter.rope.bands"]
    rewrite_shard(ckpt, fname, lambda t: {**t, "pre_adapter.extra_embedder.weight": torch.zeros(2, 2)})
    index["weight_map"]["pre_adapter.extra_embedder.weight"] = fname
    write_index(ckpt, index)
    return "pre_adapter.extra_embedder.weight: unexpected key"


def _wrong_shape(ckpt):
    mutate_tensor(ckpt, "block.layers.1.mlp.moe_mlp.W_gate", lambda t: t[:, :, :-1])
    return "block.layers.1.mlp.moe_mlp.W_gate: shape [32, 32, 63]"


def _wrong_dtype(ckpt):
    mutate_tensor(ckpt, "block.layers.1.mlp.moe_mlp.gate", lambda t: t.to(torch.bfloat16))
    return "block.layers.1.mlp.moe_mlp.gate: dtype BF16 in model-00001-of-00002.safetensors, the model expects F32"


def _config_disagrees(ckpt):
    cfg = json.loads(H4_CONFIG.read_text())
    cfg["arch_config"]["moe_config"]["num_experts"] = 4  # the weights have 8 experts per head
    (ckpt / "magi2_preview.json").write_text(json.dumps(cfg))
    return "block.layers.1.mlp.moe_mlp.W_gate: shape [32, 32, 64] in model-00001-of-00002.safetensors, the model expects [16, 32, 64]"


@pytest.mark.parametrize(
    "breaker",
    [
        _drop_second_shard,
        _truncate_first_shard,
        _key_missing_from_index,
        _unexpected_key,
        _wrong_shape,
        _wrong_dtype,
        _config_disagrees,
    ],
    ids=lambda f: f.__name__.strip("_"),
)
def test_bad_checkpoint_exits_nonzero_and_writes_nothing(tmp_path, breaker):
    ckpt = copy_checkpoint("preview_h4", tmp_path / "ckpt")
    needle = breaker(ckpt)
    out = tmp_path / "out"
    args = _transformer_args(ckpt, out)
    args[args.index("--config") + 1] = ckpt / "magi2_preview.json"
    rc, _, err = run_cli(args)
    _assert_failed_cleanly(tmp_path, rc, err, needle, out)


def test_several_problems_are_reported_in_one_run(tmp_path):
    ckpt = copy_checkpoint("preview_h4", tmp_path / "ckpt")
    needles = [_wrong_shape(ckpt), _wrong_dtype(ckpt), _unexpected_key(ckpt)]
    out = tmp_path / "out"
    rc, _, err = run_cli(_transformer_args(ckpt, out))
    for needle in needles:
        _assert_failed_cleanly(tmp_path, rc, err, needle, out)


class _NotATensor:  # torch.load(weights_only=True) refuses arbitrary classes
    pass


def test_refused_pickle_exits_nonzero_and_writes_nothing(tmp_path):
    evil = tmp_path / "Wan2.2_VAE.pth"
    torch.save({"model": _NotATensor()}, evil)
    out = tmp_path / "out"
    rc, _, err = run_cli(["--vae_path", evil, "--output_path", out, "--components", "vae"])
    _assert_failed_cleanly(tmp_path, rc, err, "weights_only=True", out)
    assert str(evil) in err


def test_failure_while_writing_leaves_no_output(tmp_path, monkeypatch):
    """A fault after validation (here: in the middle of the transformer write) removes the temp folder."""
    from diffusers_magi2.utils.safetensors_io import ShardWriter

    real = ShardWriter.copy_bytes
    calls = {"n": 0}

    def flaky(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 40:
            raise OSError("disk full (simulated)")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(ShardWriter, "copy_bytes", flaky)
    out = tmp_path / "out"
    rc, _, err = run_cli(_transformer_args(checkpoint_dir("preview_h4"), out))
    _assert_failed_cleanly(tmp_path, rc, err, "OSError: disk full (simulated)", out)


def test_existing_output_needs_overwrite_and_survives_failures(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    rc, _, err = run_cli(_transformer_args(checkpoint_dir("preview_h4"), out))
    assert rc != 0 and "exists and is not empty; pass --overwrite" in err
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    # --overwrite with a broken checkpoint: the old OUT is untouched
    ckpt = copy_checkpoint("preview_h4", tmp_path / "ckpt")
    _wrong_shape(ckpt)
    rc, _, err = run_cli(_transformer_args(ckpt, out, "--overwrite"))
    assert rc != 0 and [p.name for p in out.iterdir()] == ["keep.txt"]
    # --overwrite that succeeds replaces the whole folder
    rc, _, err = run_cli(_transformer_args(checkpoint_dir("preview_h4"), out, "--overwrite"))
    assert rc == 0, err
    assert sorted(p.name for p in out.iterdir()) == [
        "README.md",
        "magi2_modular_blocks.py",
        "model_index.json",
        "modular_config.json",
        "modular_model_index.json",
        "transformer",
    ]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_dry_run_writes_nothing(tmp_path):
    out = tmp_path / "out"
    rc, stdout, err = run_cli(
        _transformer_args(checkpoint_dir("preview_h4"), out, "--dry_run", "--max_shard_size", "1MB")
    )
    assert rc == 0, err
    assert "131 output tensors from 2 source shard(s)" in stdout
    assert "diffusion_pytorch_model-00004-of-00004.safetensors" in stdout
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == []


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--output_path", "x"], "no components to convert"),
        (["--output_path", "x", "--components", "transformer"], "no input was given"),
        (["--output_path", "x", "--components", "transformer,unet"], "unknown ['unet']"),
        (["--output_path", "x", "--preview_dir", "/nonexistent/preview"], "does not exist"),
        (["--output_path", "x", "--preview_dir", ".", "--push_to_hub"], "--push_to_hub needs --repo_id"),
        (["--output_path", "x", "--preview_dir", ".", "--max_shard_size", "big"], "is not a size"),
    ],
)
def test_bad_arguments(tmp_path, args, needle):
    rc, _, err = run_cli(args)
    assert rc != 0 and needle in err


# --------------------------------------------------------------------------- output contract


@pytest.fixture(scope="module")
def release_root(tmp_path_factory):
    """The SandAI release layout built from the tiny fixtures (symlinks, nothing copied but configs).

    ``configs/magi2_refiner.json`` extends ``magi2_preview.json`` as in the release, so one
    ``--config`` describes both the tiny preview and the tiny refiner.
    """
    root = tmp_path_factory.mktemp("release")
    (root / "vae").mkdir()
    (root / "preview").symlink_to(checkpoint_dir("preview_h4"))
    (root / "refiner").symlink_to(checkpoint_dir("refiner"))
    (root / "vae" / "Wan2.2_VAE.pth").symlink_to(COMPONENTS / "wan22_vae" / "Wan2.2_VAE.pth")
    (root / "turbo_vae").symlink_to(COMPONENTS / "turbo_vae")
    (root / "stable-audio-open-1.0").symlink_to(COMPONENTS / "stable_audio_vae" / "stable-audio-open-tiny")
    (root / "text_encoder").symlink_to(COMPONENTS / "text_encoder" / "qwen35_tiny")
    configs = root / "configs"
    configs.mkdir()
    shutil.copyfile(H4_CONFIG, configs / "magi2_preview.json")
    refiner = json.loads(config_path("refiner").read_text())
    refiner["extends"] = "magi2_preview.json"
    # refiner-stage settings other than the released ones (5 steps, CFG 2): the converted repo must carry these
    refiner["evaluation_config"].update(
        magi2_refiner_num_inference_steps=3, magi2_refiner_video_txt_guidance_scale=2.5
    )
    (configs / "magi2_refiner.json").write_text(json.dumps(refiner))
    return root


@pytest.fixture(scope="module")
def full_repo(release_root, tmp_path_factory):
    out = tmp_path_factory.mktemp("full") / "MAGI-2-tiny-diffusers"
    rc, stdout, err = run_cli(
        [
            "--checkpoint_root",
            release_root,
            "--config",
            release_root / "configs" / "magi2_refiner.json",
            "--output_path",
            out,
            "--dtype",
            "bf16",
            "--max_shard_size",
            "1MB",
            "--repo_id",
            "org/magi2-tiny",
            "--audio_vae_encoder",
            "zeros",
        ]  # the tiny Stable Audio encoder has latent_dim != channels
    )
    assert rc == 0, err + stdout
    return out


def test_unrepresentable_audio_encoder_is_refused_before_anything_is_written(release_root, tmp_path):
    """The tiny Stable Audio encoder is refused in strict mode from its config alone, before the transformer is
    written, and the message names the CLI flag (and, for Python callers, the keyword) that allows it."""
    out = tmp_path / "out"
    rc, stdout, err = run_cli(
        [
            "--checkpoint_root",
            release_root,
            "--config",
            release_root / "configs" / "magi2_refiner.json",
            "--output_path",
            out,
            "--components",
            "transformer,vae,audio_vae",
        ]
    )
    assert "writing" not in stdout and "converting" not in stdout
    _assert_failed_cleanly(tmp_path, rc, err, "[audio_vae]", out)
    assert "--audio_vae_encoder zeros" in err and "audio_encoder='zeros'" in err
    assert list(tmp_path.iterdir()) == []


def test_whole_release_converts_every_component(full_repo):
    index = json.loads((full_repo / "model_index.json").read_text())
    assert index["_class_name"] == "Magi2Pipeline"
    expected = {
        "transformer": ["diffusers_magi2.models.transformer_magi2", "Magi2Transformer3DModel"],
        "refiner": ["diffusers_magi2.models.transformer_magi2_refiner", "Magi2RefinerTransformer3DModel"],
        "video_decoder": ["diffusers_magi2.models.turbo_vae", "Magi2TurboVAEDecoder"],
        "vae": ["diffusers", "AutoencoderKLWan"],
        "audio_vae": ["diffusers", "AutoencoderOobleck"],
        "scheduler": ["diffusers", "UniPCMultistepScheduler"],
        "text_encoder": ["transformers", "Qwen3_5TextModel"],
    }
    for name, entry in expected.items():
        assert index[name] == entry, name
        assert (full_repo / name).is_dir()
    assert index["tokenizer"][0] == "transformers" and index["tokenizer"][1]
    assert (full_repo / "tokenizer").is_dir()
    for name in ("transformer", "refiner"):
        assert len(list((full_repo / name).glob("diffusion_pytorch_model-*.safetensors"))) >= 2
    sched = json.loads((full_repo / "scheduler" / "scheduler_config.json").read_text())
    assert sched["prediction_type"] == "flow_prediction" and sched["use_flow_sigmas"] and sched["flow_shift"] == 7.0
    # the refiner stage's sampling settings, from the refiner JSON's evaluation_config
    settings = {k: index[k] for k in ("refiner_num_inference_steps", "refiner_guidance_scale", "refiner_shift")}
    assert settings == {"refiner_num_inference_steps": 3, "refiner_guidance_scale": 2.5, "refiner_shift": 5.0}
    assert index["refiner_noise_value"] == 220


def _float_dtypes(folder) -> set[str]:
    from safetensors import safe_open

    dtypes = set()
    for shard in folder.glob("*.safetensors"):
        with safe_open(str(shard), "pt") as f:
            dtypes |= {f.get_slice(k).get_dtype() for k in f.keys()}
    return dtypes - {"I64", "I32", "BOOL", "U8"}


def test_autoencoders_are_stored_in_fp32_whatever_the_dtype(full_repo):
    """With ``--dtype bf16`` the Wan2.2 VAE and the audio VAE are written in fp32 (they run in fp32); the
    transformer, the TurboVAE decoder and the text encoder in bf16 (the transformer's fp32 islands beside it)."""
    assert _float_dtypes(full_repo / "vae") == {"F32"}
    assert _float_dtypes(full_repo / "audio_vae") == {"F32"}
    assert _float_dtypes(full_repo / "transformer") == {"BF16", "F32"}
    assert _float_dtypes(full_repo / "video_decoder") == {"BF16"}
    assert _float_dtypes(full_repo / "text_encoder") == {"BF16"}


def test_scheduler_reproduces_the_reference_schedule(full_repo):
    """The shipped scheduler + the documented sigmas give SandAI's Flow-UniPC schedule (``Magi2PreviewSampler``)."""
    import numpy as np
    from diffusers import UniPCMultistepScheduler

    sched = UniPCMultistepScheduler.from_pretrained(full_repo, subfolder="scheduler")
    sched.set_timesteps(100, sigmas=np.linspace(0.999, 0, 101)[:-1])
    assert sched.timesteps[:5].tolist() == [999, 998, 996, 995, 993]
    assert sched.timesteps[-3:].tolist() == [177, 124, 65]
    assert abs(float(sched.sigmas[0]) - 0.999857) < 1e-6 and float(sched.sigmas[-1]) == 0.0


def test_model_card_is_rendered_from_the_single_source(full_repo):
    from diffusers_magi2.conversion.model_card import load_model_card_template, render_model_card

    top = (REPO_ROOT / "model_card.md").read_text()
    assert load_model_card_template() == top  # the packaged resource is the top-level file
    card = (full_repo / "README.md").read_text()
    front = card.split("---\n")[1]
    for line in (
        "library_name: diffusers",
        "pipeline_tag: text-to-video",
        "license: apache-2.0",
        "base_model: sand-ai/MAGI-2-preview",
        "- mixture-of-experts",
    ):
        assert line in front
    first_code = card.split("```bash\n", 1)[1].split("```", 1)[0]
    assert "pip install diffusers-magi2" in first_code  # the distribution name (pyproject)
    assert 'Magi2Pipeline.from_pretrained(\n    "org/magi2-tiny"' in card
    assert "{{" not in card and "| `refiner/` |" in card and "| `tokenizer/` |" in card
    # the tiny transformer's own parameter count, not the released model's 114B
    transformer = Magi2Transformer3DModel.from_pretrained(full_repo, subfolder="transformer")
    count = sum(p.numel() for p in transformer.parameters())
    assert count < 10**8 and f"a {format_parameter_count(count)}-parameter mixture-of-experts" in card
    assert "114B" not in card
    with pytest.raises(ValueError, match="missing values"):
        render_model_card({"title": "x"})


def test_parameter_count_of_the_released_transformer_renders_as_114b():
    from diffusers_magi2 import Magi2Transformer3DModel
    from diffusers_magi2.loaders.original_checkpoint import build_meta_model, original_format

    fmt = original_format(Magi2Transformer3DModel)
    model = build_meta_model(Magi2Transformer3DModel, fmt.model_kwargs(fmt.resolve_config(None)[0]))
    assert format_parameter_count(sum(p.numel() for p in model.parameters())) == "114B"
    assert [format_parameter_count(n) for n in (1_234_567, 45_600, 999_999, 999, 0)] == [
        "1.23M",
        "45.6K",
        "1M",
        "999",
        "0",
    ]


#: each runs in a fresh interpreter (``helpers.fresh_interpreter``) with ``HF_HUB_OFFLINE=1``; argv: the paths
#: ``fresh_checks`` gives it
MODEL_INDEX_SCRIPT = """
import json, sys
import diffusers_magi2
from diffusers.pipelines.pipeline_loading_utils import ALL_IMPORTABLE_CLASSES, get_class_obj_and_candidates
import diffusers_magi2.models.transformer_magi2, diffusers_magi2.models.transformer_magi2_refiner, diffusers_magi2.models.turbo_vae
snapshot = sys.argv[1]
index = json.load(open(snapshot + "/model_index.json"))
# [null, null]: a component not converted (the prompt enhancer without --sandai_code_dir), skipped by diffusers too
for name, (lib, cls) in sorted((k, v) for k, v in index.items() if isinstance(v, list) and v[0] is not None):
    obj, cands = get_class_obj_and_candidates(lib, cls, ALL_IMPORTABLE_CLASSES, None, False)
    methods = [ALL_IMPORTABLE_CLASSES[c][1] for c, k in cands.items() if k is not None and issubclass(obj, k)]
    assert methods, (name, lib, cls)  # diffusers finds how to load it (its base class is visible)
    sub = getattr(obj, methods[-1])(snapshot + "/" + name)
    assert type(sub).__name__ == cls, (name, type(sub))
print("ok")
"""

OFFLINE_BY_ID_SCRIPT = """
import torch
from diffusers_magi2 import Magi2Transformer3DModel
m = Magi2Transformer3DModel.from_pretrained("org/magi2-tiny-cached", subfolder="transformer", dtype=torch.bfloat16)
bad = [n for n, t in m.state_dict().items() if t.dtype != (torch.float32 if m.is_fp32_island(n) else torch.bfloat16)]
assert not bad, bad
assert m.transformer_blocks[1].mlp.moe_mlp.router.expert_bias.dtype == torch.float32
print("ok", len(m.state_dict()))
"""

# The tiny release is stitched from fixtures of different widths (Wan2.2 VAE z_dim 48, DiT 12 channels), so loading
# it raises the component fit error once every component is loaded; with that check switched off, the loaded classes
# are the ones model_index.json names.
PIPELINE_SCRIPT = """
import sys
from diffusers_magi2 import Magi2Pipeline
try:
    Magi2Pipeline.from_pretrained(sys.argv[1])
except ValueError as error:
    assert "vae.config.z_dim is 48 but transformer.config.in_channels is 12" in str(error), error
else:
    raise AssertionError("mismatched components were accepted")
Magi2Pipeline._check_components = lambda self: None
pipe = Magi2Pipeline.from_pretrained(sys.argv[1])
names = {k: type(v).__name__ for k, v in pipe.components.items()}
assert names["transformer"] == "Magi2Transformer3DModel" and names["video_decoder"] == "Magi2TurboVAEDecoder", names
assert names["refiner"] == "Magi2RefinerTransformer3DModel", names
stage = pipe.refiner_stage_config()
assert (stage.num_inference_steps, stage.guidance_scale) == (3, 2.5), stage  # model_index.json's, not the defaults
print("ok")
"""

MODULAR_SCRIPT = """
import json, sys
from diffusers.modular_pipelines import ModularPipeline
pipe = ModularPipeline.from_pretrained(sys.argv[1], trust_remote_code=True)
assert type(pipe.blocks).__name__ == "Magi2AutoBlocks", type(pipe.blocks)
pipe.load_components()
index = json.load(open(sys.argv[1] + "/model_index.json"))
parts = {n: v for n, v in index.items() if not n.startswith("_") and isinstance(v, list) and v[0]}
names = {n: type(getattr(pipe, n)).__name__ for n in parts}
want = {n: v[1] for n, v in parts.items()}
assert names == want, (names, want)
print("ok")
"""

HUB_COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def fresh_checks(full_repo, tmp_path_factory) -> dict:
    """The converted repo's fresh-interpreter checks, run once for the module's tests: a copy standing in for a Hub
    snapshot, and the repo (>= 2 shards) in a local HF cache layout, offline, with their own ``HF_HOME``. The cached
    copy's id is not the ``--repo_id`` the modular files name, so the cache holds nothing those could load."""
    work = tmp_path_factory.mktemp("fresh")
    snapshot = work / "snapshot"
    shutil.copytree(full_repo, snapshot)
    repo_dir = work / "hub" / "models--org--magi2-tiny-cached"
    shutil.copytree(full_repo, repo_dir / "snapshots" / HUB_COMMIT)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(HUB_COMMIT)
    checks = {
        "model_index": (MODEL_INDEX_SCRIPT, [snapshot]),
        "offline_by_id": (OFFLINE_BY_ID_SCRIPT, []),
        "pipeline": (PIPELINE_SCRIPT, [snapshot]),
        "modular": (MODULAR_SCRIPT, [snapshot]),
    }
    env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(work / "hub"), "HF_HOME": str(work / "home")}
    results = run_fresh_checks(checks, work, env, timeout=600)
    return {**results, "hub_snapshot": repo_dir / "snapshots" / HUB_COMMIT}


def test_model_index_entries_resolve_in_a_fresh_interpreter(fresh_checks):
    """Every entry resolves through diffusers' own loader rules after ``import diffusers_magi2``,
    from a copy standing in for a Hub snapshot, in a fresh process (the prompt enhancer, which diffusers' loader does
    not know, is ``[null, null]`` here and read by ``Magi2Pipeline.from_pretrained`` when converted)."""
    res = fresh_checks["model_index"]
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-3000:]


def test_push_to_hub_uses_huggingface_hub(tmp_path, monkeypatch):
    import huggingface_hub

    calls = []

    class FakeApi:
        def create_repo(self, repo_id, **kwargs):
            calls.append(("create_repo", repo_id, kwargs))
            return f"https://huggingface.co/{repo_id}"

        def upload_folder(self, **kwargs):
            calls.append(("upload_folder", kwargs["repo_id"], kwargs))
            assert kwargs["folder_path"] and os.path.isfile(os.path.join(kwargs["folder_path"], "model_index.json"))

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    out = tmp_path / "out"
    rc, stdout, err = run_cli(
        _transformer_args(checkpoint_dir("preview_h4"), out, "--push_to_hub", "--repo_id", "org/tiny", "--private")
    )
    assert rc == 0, err
    assert [c[0] for c in calls] == ["create_repo", "upload_folder"]
    assert calls[0][2]["private"] is True and calls[0][2]["exist_ok"] is True and calls[0][2]["repo_type"] == "model"
    assert calls[1][1] == "org/tiny" and calls[1][2]["folder_path"] == str(out.absolute())
    # a dry run uploads nothing
    calls.clear()
    rc, stdout, _ = run_cli(
        _transformer_args(
            checkpoint_dir("preview_h4"), tmp_path / "o2", "--dry_run", "--push_to_hub", "--repo_id", "org/tiny"
        )
    )
    assert rc == 0 and calls == [] and "nothing uploaded" in stdout


def test_offline_load_by_repo_id_from_the_hf_cache(fresh_checks):
    """The converted repo (>= 2 shards) in a local HF cache layout, loaded by repo id, bf16, offline."""
    res = fresh_checks["offline_by_id"]
    assert res.returncode == 0 and "ok 131" in res.stdout, res.stderr[-3000:]
    assert len(list((fresh_checks["hub_snapshot"] / "transformer").glob("*.safetensors"))) >= 2


def test_pipeline_loads_the_converted_repo_in_a_fresh_interpreter(fresh_checks):
    """A copy standing in for a Hub snapshot, ``import diffusers_magi2`` only, then
    ``Magi2Pipeline.from_pretrained(copy)`` in a fresh process."""
    res = fresh_checks["pipeline"]
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-3000:]


def test_converted_repo_loads_as_a_modular_pipeline_in_a_fresh_interpreter(full_repo, fresh_checks):
    """The converter writes the modular files (components pointing at ``--repo_id``, agreeing with
    ``model_index.json``); a copy loads offline through ``ModularPipeline.from_pretrained(copy,
    trust_remote_code=True)`` with the classes ``model_index.json`` names."""
    from diffusers_magi2.pipelines.modular_files import check_modular_files

    index = json.loads((full_repo / "model_index.json").read_text())
    modular = json.loads((full_repo / "modular_model_index.json").read_text())
    config = json.loads((full_repo / "modular_config.json").read_text())
    check_modular_files(index, modular, config)
    assert {modular[n][2]["pretrained_model_name_or_path"] for n in ("transformer", "vae", "tokenizer")} == {
        "org/magi2-tiny"
    }
    res = fresh_checks["modular"]
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-3000:]


def test_thin_cli_script_and_console_entry_point(tmp_path):
    """``conversion/convert_magi2_to_diffusers.py`` runs the same ``main`` as the ``magi2-convert`` script."""
    from importlib.metadata import entry_points

    (ep,) = [e for e in entry_points(group="console_scripts") if e.name == "magi2-convert"]
    assert ep.value == "diffusers_magi2.conversion.cli:main"
    out = tmp_path / "out"
    script = REPO_ROOT / "conversion" / "convert_magi2_to_diffusers.py"
    res = subprocess.run(
        [sys.executable, str(script), *map(str, _transformer_args(checkpoint_dir("preview_h4"), out, "--dry_run"))],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert "131 output tensors from 2 source shard(s)" in res.stdout and not out.exists()
    res = subprocess.run(
        [sys.executable, str(script), "--output_path", str(out), "--preview_dir", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert res.returncode == 2 and "does not exist" in res.stderr and not out.exists()


# Runs each argv through ``magi2-convert``'s entry (``cli.main``) and the thin script, in one fresh interpreter, and
# reports (exit status, stderr, whether torch or diffusers was imported).
_USAGE_DRIVER = """
import contextlib, io, json, runpy, sys
results = []
for how, argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            if how == "entry point":
                from diffusers_magi2.conversion.cli import main
                rc = main(argv)
            else:
                sys.argv = [how, *argv]
                runpy.run_path(how, run_name="__main__")
                rc = 0
        except SystemExit as exc:
            rc = exc.code
    results.append({"rc": rc, "stderr": err.getvalue(), "heavy": sorted({"torch", "diffusers"} & set(sys.modules))})
print(json.dumps(results))
"""


def test_bad_usage_is_one_error_line_before_torch_or_diffusers_is_imported(tmp_path):
    script = str(REPO_ROOT / "conversion" / "convert_magi2_to_diffusers.py")
    out = ["--output_path", str(tmp_path / "out")]
    missing = str(tmp_path / "nonexistent")
    cases = [
        ("entry point", ["--preview_dir", "p"], "the following arguments are required: --output_path"),
        ("entry point", [*out, "--dtype", "fp16"], "argument --dtype: invalid choice: 'fp16'"),
        ("entry point", [*out, "--no_such_flag"], "unrecognized arguments: --no_such_flag"),
        (script, [*out, "--expert_dtype", "int8"], "argument --expert_dtype: invalid choice: 'int8'"),
        (
            "entry point",
            [*out, "--expert_int4_group_size", "0"],
            "--expert_int4_group_size: must be a positive integer",
        ),
        # flags that parse but conflict, or name what is not there: refused before torch too, with argparse's status
        ("entry point", [*out, "--components", "foo"], "--components: unknown ['foo']; allowed: transformer,"),
        (script, [*out, "--preview_dir", ".", "--push_to_hub"], "--push_to_hub needs --repo_id"),
        ("entry point", [*out, "--checkpoint_root", missing], f"--checkpoint_root {missing} is not a directory"),
        ("entry point", [*out, "--preview_dir", missing], f"transformer: input {missing} does not exist"),
        (
            "entry point",
            [*out, "--preview_dir", ".", "--expert_int4_group_size", "64"],
            "--expert_int4_group_size applies to --expert_dtype int4; got --expert_dtype None",
        ),
        (
            "entry point",
            [*out, "--preview_dir", ".", "--max_shard_size", "big"],
            "--max_shard_size 'big' is not a size",
        ),
        # int4 experts whose widths (the config's MoE heads: 32 wide) the default group of 128 does not divide
        (
            "entry point",
            [*out, "--preview_dir", ".", "--config", str(H4_CONFIG), "--expert_dtype", "int4"],
            "--expert_int4_group_size 128 (the default) does not divide the transformer's MoE head width Dh=32",
        ),
    ]
    res = subprocess.run(
        [sys.executable, "-c", _USAGE_DRIVER, json.dumps([(how, argv) for how, argv, _ in cases])],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    for (how, argv, needle), got in zip(cases, json.loads(res.stdout)):
        assert got["rc"] == 2, (argv, got)
        assert got["stderr"].count("\n") == 1 and got["stderr"].startswith("magi2-convert: error: "), got["stderr"]
        assert needle in got["stderr"], got["stderr"]
        assert got["heavy"] == [], f"{how} {argv}: {got['heavy']} imported before the flags were parsed"
    assert not (tmp_path / "out").exists()
