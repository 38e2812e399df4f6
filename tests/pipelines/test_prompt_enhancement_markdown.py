"""The enhanced prompt's Markdown: SandAI's renderer output (the shared fixtures, byte for byte) and its rules on
cases the fixtures do not hold (expected texts written from the rules in the fixtures' README)."""

from __future__ import annotations

import json

import pytest
from helpers.fixtures import golden, golden_path, golden_text

from diffusers_magi2.pipelines.prompt_enhancement import render_enhanced_prompt
from diffusers_magi2.pipelines.text_encoding import add_figure_reference, normalize_prompt


try:
    CASES = golden("prompt_enhancement/manifest.json")["cases"]
    MISSING = None
except FileNotFoundError as error:  # no fixtures: the coverage test below fails naming them, the rest has no cases
    CASES, MISSING = [], error


def _reply(case: str):
    return json.loads(golden_text(f"prompt_enhancement/{case}.input.json"))


@pytest.mark.parametrize("case", [case["name"] for case in CASES])
def test_every_public_case_renders_byte_for_byte(case):
    markdown = render_enhanced_prompt(_reply(case))
    assert markdown.encode("utf-8") == golden_path(f"prompt_enhancement/{case}.render_markdown.md").read_bytes()
    # what reaches the text encoder: the Markdown is no JSON, so the encoder leaves it as it is
    assert normalize_prompt(markdown) == markdown


@pytest.mark.parametrize("case", [case["name"] for case in CASES if case["task"] == "i2v"])
def test_image_to_video_cases_with_the_figure_reference_byte_for_byte(case):
    with_figure = add_figure_reference(render_enhanced_prompt(_reply(case)))
    assert with_figure == golden_text(f"prompt_enhancement/{case}.with_figure_reference.txt")
    assert with_figure.endswith("\nreference_layer:The first frame refers to <Figure 1>")


def test_both_tasks_are_covered_by_the_fixtures():
    if MISSING is not None:
        raise MISSING
    assert {case["task"] for case in CASES} == {"t2v", "i2v"}


def test_everything_empty_renders_the_empty_string():
    assert render_enhanced_prompt({"a": None, "b": "  \u3000\u00a0", "c": [], "d": {"e": [{"f": ""}]}}) == ""


def test_zero_and_false_stay_and_numbers_keep_their_spelling():
    reply = json.loads('{"a": {"n": 0, "f": false, "t": true, "i": 10, "x": 10.0, "y": 2.50, "z": 1e16}}')
    assert render_enhanced_prompt(reply) == "# a\n\nn:0\nf:false\nt:true\ni:10\nx:10.0\ny:2.5\nz:1e+16\n"


def test_one_line_fields_come_first_and_containers_get_a_blank_line_before_them():
    reply = {"root": {"obj": {"k": "v"}, "s": "text", "lst": ["a", "b"], "n": 1, "more": {"k2": "v2"}}}
    assert render_enhanced_prompt(reply) == (
        "# root\n\ns:text\n\nlst:a | b\nn:1\n\n## obj\n\nk:v\n\n## more\n\nk2:v2\n"
    )


def test_a_root_list_of_primitives_is_one_line_without_a_heading():
    assert render_enhanced_prompt({"tags": ["x", " ", "y"], "o": {"k": "v"}}) == "tags:x | y\n\n# o\n\nk:v\n"


def test_list_items_are_numbered_after_the_empty_ones_are_dropped():
    reply = {"items": [{"a": ""}, {"a": "first"}, "plain", ["p", "q"], {"a": "second"}]}
    assert render_enhanced_prompt(reply) == (
        "# items\n\n## items1\n\na:first\n\nitems2:plain\n## items3\n\nitem1:p\nitem2:q\n## items4\n\na:second\n"
    )


def test_headings_deeper_than_six_become_emphasis():
    reply = {"l1": {"l2": {"l3": {"l4": {"l5": {"l6": {"l7": {"leaf": "v"}}}}}}}}
    assert render_enhanced_prompt(reply) == (
        "# l1\n\n## l2\n\n### l3\n\n#### l4\n\n##### l5\n\n###### l6\n\n*l7*\n\nleaf:v\n"
    )


def test_line_breaks_and_tabs_are_escaped_and_trailing_spaces_stripped():
    reply = {"s": {"a": "one\r\ntwo\nthree\rfour\tfive", "b": 'quote " colon : pipe | hash # back \\ ', "c": "x   "}}
    assert render_enhanced_prompt(reply) == (
        '# s\n\na:one\\ntwo\\nthree\\rfour\\tfive\nb:quote " colon : pipe | hash # back \\\nc:x\n'
    )


def test_duplicate_keys_and_unicode_escapes_follow_json_loads():
    reply = json.loads('{"s": {"k": "first", "other": "o", "k": "last \\u4f60\\ud83d\\ude00"}}')
    assert render_enhanced_prompt(reply) == "# s\n\nk:last 你😀\nother:o\n"


def test_a_root_that_is_not_an_object_renders_without_a_key():
    assert render_enhanced_prompt("text") == "text\n"
    assert render_enhanced_prompt([{"a": "b"}, "c"]) == "## item1\n\na:b\n\nitem2:c\n"
