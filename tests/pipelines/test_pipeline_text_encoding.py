"""The Qwen3.5 prompt wrapper vs the reference fixture ``magi2_tiny_components/text_encoder/``."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.pipeline_stubs import StandInTransformer, preview_scheduler, tiny_oobleck
from safetensors.torch import load_file

from diffusers_magi2.pipelines.pipeline_magi2 import Magi2Pipeline  # noqa: E402
from diffusers_magi2.pipelines.text_encoding import (  # noqa: E402
    CJK_SPLIT_PATTERN,
    add_figure_reference,
    apply_cjk_pre_tokenizer_split,
    encode_prompt_features,
    find_target_token_indices,
    has_cjk_pre_tokenizer_split,
    json_to_compact_markdown,
    normalize_prompt,
    pool_target_features,
    tokenize_prompt,
)


PROMPTS = ["ascii", "mixed_cjk", "json_markdown", "json_passthrough"]


def rel_l2(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.fixture(scope="module")
def folder(fixtures_dir):
    return fixtures_dir / "magi2_tiny_components" / "text_encoder"


@pytest.fixture(scope="module")
def cases(folder):
    return json.loads((folder / "text_cases.json").read_text()), load_file(str(folder / "text_cases.safetensors"))


@pytest.fixture(scope="module")
def tokenizer(folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder / "qwen35_tiny")


@pytest.fixture(scope="module")
def encoders(folder):
    from transformers import Qwen3_5TextModel

    return {
        "fp32": Qwen3_5TextModel.from_pretrained(folder / "qwen35_tiny", dtype=torch.float32).eval(),
        "bf16": Qwen3_5TextModel.from_pretrained(folder / "qwen35_tiny", dtype=torch.bfloat16).eval(),
    }


def test_plain_tokenizer_differs_then_split_is_applied_once(tokenizer, cases):
    meta, tensors = cases
    plain = tokenize_prompt(tokenizer, meta["prompts"]["mixed_cjk"]["normalized"])["input_ids"][0]
    assert torch.equal(plain, tensors["mixed_cjk.input_ids_without_cjk_split"])
    assert not has_cjk_pre_tokenizer_split(tokenizer)
    apply_cjk_pre_tokenizer_split(tokenizer)
    apply_cjk_pre_tokenizer_split(tokenizer)  # idempotent
    state = json.loads(tokenizer.backend_tokenizer.to_str())["pre_tokenizer"]
    assert state == meta["pre_tokenizer"]
    assert state["pretokenizers"][0]["pattern"]["Regex"] == CJK_SPLIT_PATTERN


@pytest.mark.parametrize("key", PROMPTS)
def test_token_ids_and_offsets_with_cjk_split_quirk(tokenizer, cases, key):
    meta, tensors = cases
    apply_cjk_pre_tokenizer_split(tokenizer)
    case = meta["prompts"][key]
    text = normalize_prompt(case["prompt"])
    assert text == case["normalized"]
    enc = tokenize_prompt(tokenizer, text, return_offsets_mapping=True)
    assert torch.equal(enc["input_ids"][0], tensors[f"{key}.input_ids"])
    assert torch.equal(enc["attention_mask"][0], tensors[f"{key}.attention_mask"])
    assert torch.equal(enc["offset_mapping"][0], tensors[f"{key}.offsets"])
    assert tokenizer.convert_ids_to_tokens(enc["input_ids"][0].tolist()) == case["tokens"]


def test_regex_quirk_isolates_digits_and_capitals_a_to_u(tokenizer, cases):
    """The pattern as compiled by `tokenizers` isolates 0-9, :;<=>?@ and A-U, not V-Z (reference quirk)."""
    meta, _ = cases
    apply_cjk_pre_tokenizer_split(tokenizer)
    pre = tokenizer.backend_tokenizer.pre_tokenizer
    isolated = "".join(
        ch for ch in map(chr, range(0x21, 0x7F)) if [p for p, _ in pre.pre_tokenize_str("x" + ch + "y")][1:2] == [ch]
    )
    assert isolated == meta["cjk_split_isolates_ascii"]
    assert [p for p, _ in pre.pre_tokenize_str("The")][:2] == ["T", "he"]
    assert [p for p, _ in pre.pre_tokenize_str("Zebra")][0] == "Zebra"


@pytest.mark.parametrize("key", PROMPTS)
def test_selected_hidden_state_fp32_and_bf16(tokenizer, encoders, cases, key):
    meta, tensors = cases
    apply_cjk_pre_tokenizer_split(tokenizer)
    enc = tokenize_prompt(tokenizer, normalize_prompt(meta["prompts"][key]["prompt"]))
    got = encode_prompt_features(encoders["fp32"], enc["input_ids"], enc["attention_mask"])
    ref = tensors[f"fp32.{key}.selected_hidden_state"]
    assert got.shape == ref.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    last = encode_prompt_features(encoders["fp32"], enc["input_ids"], enc["attention_mask"], skip_layers=0)
    # last_hidden_state is post-final-norm (for orientation only; the norm amplifies fp32 noise)
    torch.testing.assert_close(last, tensors[f"fp32.{key}.last_hidden_state"], atol=5e-5, rtol=1e-4)
    got_bf16 = encode_prompt_features(encoders["bf16"], enc["input_ids"], enc["attention_mask"])
    assert got_bf16.dtype == torch.bfloat16
    assert rel_l2(got_bf16, tensors[f"bf16.{key}.selected_hidden_state"]) <= 0.05


def test_figure1_special_token_pooling(tokenizer, encoders, cases):
    meta, tensors = cases
    apply_cjk_pre_tokenizer_split(tokenizer)
    text = normalize_prompt(meta["prompts"]["json_markdown"]["prompt"])
    enc = tokenize_prompt(tokenizer, text, return_offsets_mapping=True)
    indices = find_target_token_indices(text, enc["offset_mapping"][0], "<Figure 1>")
    assert indices == meta["prompts"]["json_markdown"]["figure1_token_indices"]
    feats = encode_prompt_features(encoders["fp32"], enc["input_ids"], enc["attention_mask"])
    torch.testing.assert_close(
        pool_target_features(feats, indices),
        tensors["fp32.json_markdown.figure1_special_token"][0],
        atol=1e-5,
        rtol=1e-5,
    )
    assert torch.count_nonzero(pool_target_features(feats, [])) == 0
    assert find_target_token_indices(text, enc["offset_mapping"][0], "<Figure 2>") == []


def test_pipeline_encode_prompt_matches_fixture(folder, tokenizer, encoders, cases):
    """Through the pipeline: the tokenizer gets the split at construction; I2V pooling of <Figure 1>."""
    from transformers import AutoTokenizer

    meta, tensors = cases
    fresh = AutoTokenizer.from_pretrained(folder / "qwen35_tiny")
    pipe = Magi2Pipeline(
        tokenizer=fresh,
        text_encoder=encoders["fp32"],
        transformer=StandInTransformer(),
        audio_vae=tiny_oobleck(),
        scheduler=preview_scheduler(),
    )
    assert has_cjk_pre_tokenizer_split(pipe.tokenizer)
    prompts = [meta["prompts"][k]["prompt"] for k in ("ascii", "json_markdown")]
    embeds, mask, pooled = pipe.encode_text(prompts, "cpu", figure_target="<Figure 1>")
    assert embeds.shape == (2, 234, 64) and mask.sum(1).tolist() == [62, 234]
    torch.testing.assert_close(embeds[0, :62], tensors["fp32.ascii.selected_hidden_state"][0], atol=1e-5, rtol=1e-5)
    assert torch.count_nonzero(embeds[0, 62:]) == 0
    torch.testing.assert_close(embeds[1], tensors["fp32.json_markdown.selected_hidden_state"][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pooled[1], tensors["fp32.json_markdown.figure1_special_token"][0], atol=1e-5, rtol=1e-5)
    assert torch.count_nonzero(pooled[0]) == 0  # the ascii prompt has no <Figure 1>


def test_figure_reference_and_markdown_rules(cases):
    meta, _ = cases
    assert add_figure_reference("a cat") == "a catreference_layer:The first frame refers to <Figure 1>"
    as_json = json.loads(add_figure_reference('{"global_layer": {"context": "x"}, "reference_layer": ["old"]}'))
    assert as_json["reference_layer"] == ["The first frame refers to <Figure 1>"]
    # the fixture's markdown prompt is what the reference engine made of it (reference_layer added)
    source = json.loads(meta["prompts"]["json_markdown"]["prompt"])
    assert json_to_compact_markdown(source) == meta["prompts"]["json_markdown"]["normalized"]
    assert normalize_prompt("[1, 2]") == "[1, 2]" and normalize_prompt("42") == "42"
    assert json_to_compact_markdown({"a": None}) == '{"a": null}'
    md = json_to_compact_markdown(
        {
            "global_layer": {"description": "  two\n words "},
            "dynamic_layer": {"timeline_segments": [{"audio": {"dialogue_lines": [{"text": "hi"}]}}]},
        }
    )
    assert md == "context\ntwo words\ntimeline:\n -\n   - dialogue: hi"
