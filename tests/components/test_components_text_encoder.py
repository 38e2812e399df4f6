"""Text encoder conversion: text-only Qwen3.5 copied verbatim; multimodal layout rewritten.

Golden data: ``magi2_tiny_components/text_encoder/`` (SandAI ``Qwen35TextEncoder``, fp32 feature
``hidden_states[-3]``).
"""

from __future__ import annotations

import filecmp
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from diffusers_magi2.conversion.components import convert_text_encoder
from diffusers_magi2.conversion.components_text import text_encoder_layout


ATOL = 1e-4


@pytest.fixture(scope="module")
def te_root(fixtures_dir):
    return fixtures_dir / "magi2_tiny_components" / "text_encoder"


@pytest.fixture(scope="module")
def text_cases(te_root):
    return load_file(te_root / "text_cases.safetensors")


def _selected_feature(folder, ids, mask, dtype=torch.float32):
    from transformers import Qwen3_5TextModel

    model = Qwen3_5TextModel.from_pretrained(folder, dtype=dtype).eval()
    with torch.no_grad():
        out = model(input_ids=ids[None], attention_mask=mask[None], output_hidden_states=True)
    return out.hidden_states[-3]


def _multimodal_folder(te_root, path):
    """A Qwen3_5ForConditionalGeneration-layout copy of the tiny encoder: 2 shards, vision/LM-head/MTP extras."""
    src = te_root / "qwen35_tiny"
    path.mkdir()
    text_cfg = json.loads((src / "config.json").read_text())
    text_cfg.pop("architectures")
    config = {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "dtype": "bfloat16",
        "text_config": text_cfg,
        "vision_config": {"model_type": "qwen3_5", "depth": 1, "hidden_size": 8},
        "image_token_id": 5,
        "tie_word_embeddings": False,
    }
    (path / "config.json").write_text(json.dumps(config))
    weights = load_file(src / "model.safetensors")
    keys = sorted(weights)
    half = len(keys) // 2
    shard1 = {f"model.language_model.{k}": weights[k] for k in keys[:half]}
    shard2 = {f"model.language_model.{k}": weights[k] for k in keys[half:]}
    shard1["model.visual.patch_embed.proj.weight"] = torch.randn(8, 3, 2, 2)
    shard2["lm_head.weight"] = torch.randn(700, 64, dtype=torch.bfloat16)
    shard2["mtp.fc.weight"] = torch.randn(64, 128, dtype=torch.bfloat16)
    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    weight_map = {}
    for name, shard in zip(names, (shard1, shard2)):
        save_file(shard, str(path / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (path / name).write_bytes((src / name).read_bytes())
    return path


def test_text_only_is_copied_verbatim_and_reproduces_feature(te_root, text_cases, tmp_path):
    src = te_root / "qwen35_tiny"
    te, tok = convert_text_encoder(src, tmp_path / "text_encoder", tmp_path / "tokenizer")
    assert text_encoder_layout(src) == "text"
    for name in ("config.json", "model.safetensors"):
        assert filecmp.cmp(src / name, te / name, shallow=False)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert filecmp.cmp(src / name, tok / name, shallow=False)
    assert sorted(p.name for p in tok.iterdir()) == ["tokenizer.json", "tokenizer_config.json"]
    feature = _selected_feature(te, text_cases["ascii.input_ids"], text_cases["ascii.attention_mask"])
    assert (feature - text_cases["fp32.ascii.selected_hidden_state"]).abs().max() <= ATOL

    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(tok)("plain text")["input_ids"]
    assert ids == AutoTokenizer.from_pretrained(src)("plain text")["input_ids"]


def test_multimodal_layout_is_rewritten_and_loads(te_root, text_cases, tmp_path):
    src = _multimodal_folder(te_root, tmp_path / "mm")
    assert text_encoder_layout(src) == "multimodal"
    te, tok = convert_text_encoder(src, tmp_path / "te", tmp_path / "tok")
    cfg = json.loads((te / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_5_text" and cfg["architectures"] == ["Qwen3_5TextModel"]
    index = json.loads((te / "model.safetensors.index.json").read_text())
    written = {k for f in set(index["weight_map"].values()) for k in load_file(te / f)}
    assert written == set(index["weight_map"]) and len(written) == 108
    assert not any(k.startswith(("model.", "lm_head", "mtp", "visual")) for k in written)
    original = load_file(te_root / "qwen35_tiny" / "model.safetensors")
    for f in set(index["weight_map"].values()):
        for k, v in load_file(te / f).items():
            assert torch.equal(v, original[k])
    for case in ("ascii", "mixed_cjk"):
        feature = _selected_feature(te, text_cases[f"{case}.input_ids"], text_cases[f"{case}.attention_mask"])
        assert (feature - text_cases[f"fp32.{case}.selected_hidden_state"]).abs().max() <= ATOL


def test_dtype_cast_rewrites_text_only(te_root, tmp_path):
    te, _ = convert_text_encoder(te_root / "qwen35_tiny", tmp_path / "te", tmp_path / "tok", dtype="fp32")
    tensors = load_file(te / "model.safetensors")
    assert {t.dtype for t in tensors.values()} == {torch.float32}
    assert json.loads((te / "config.json").read_text())["dtype"] == "float32"


def test_bad_inputs_leave_nothing(te_root, tmp_path):
    # unknown tensor outside the language model
    src = _multimodal_folder(te_root, tmp_path / "mm")
    index = json.loads((src / "model.safetensors.index.json").read_text())
    extra = {"audio_tower.weight": torch.zeros(2)}
    save_file(extra, str(src / "model-extra.safetensors"))
    index["weight_map"]["audio_tower.weight"] = "model-extra.safetensors"
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="audio_tower.weight"):
        convert_text_encoder(src, tmp_path / "te", tmp_path / "tok")
    assert not (tmp_path / "te").exists() and not (tmp_path / "tok").exists()

    # a missing language-model tensor
    del index["weight_map"]["audio_tower.weight"]
    dropped = next(k for k in index["weight_map"] if k.endswith("norm.weight") and ".layers." not in k)
    del index["weight_map"][dropped]
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="missing"):
        convert_text_encoder(src, tmp_path / "te", tmp_path / "tok")
    assert not (tmp_path / "te").exists()

    # pickled weights only
    pk = tmp_path / "pickled"
    pk.mkdir()
    (pk / "config.json").write_text((te_root / "qwen35_tiny" / "config.json").read_text())
    (pk / "tokenizer.json").write_text((te_root / "qwen35_tiny" / "tokenizer.json").read_text())
    torch.save({"embed_tokens.weight": torch.zeros(1)}, pk / "pytorch_model.bin")
    with pytest.raises(ValueError, match="pickled weights"):
        convert_text_encoder(pk, tmp_path / "te", tmp_path / "tok")

    with pytest.raises(ValueError, match="dtype"):
        convert_text_encoder(te_root / "qwen35_tiny", tmp_path / "te", tmp_path / "tok", dtype="half")


def test_transformers_saved_multimodal_checkpoint_converts(te_root, tmp_path):
    """The layout transformers itself writes for ``Qwen3_5ForConditionalGeneration`` (one shard)."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration, Qwen3_5TextModel

    text_cfg = json.loads((te_root / "qwen35_tiny" / "config.json").read_text())
    vision = {
        "depth": 1,
        "hidden_size": 16,
        "num_heads": 2,
        "intermediate_size": 32,
        "out_hidden_size": 64,
        "patch_size": 2,
        "temporal_patch_size": 2,
        "spatial_merge_size": 1,
    }
    torch.manual_seed(0)
    full = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text_cfg, vision_config=vision)).eval()
    src = tmp_path / "saved"
    full.save_pretrained(src)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (src / name).write_bytes((te_root / "qwen35_tiny" / name).read_bytes())
    te, _ = convert_text_encoder(src, tmp_path / "te", tmp_path / "tok", dtype="fp32")
    text = Qwen3_5TextModel.from_pretrained(te).eval()
    ids = torch.arange(1, 20)[None]
    with torch.no_grad():
        want = full.float().model.language_model(input_ids=ids.clone()).last_hidden_state
        got = text(input_ids=ids).last_hidden_state
    assert got.dtype == torch.float32 and torch.equal(got, want)
