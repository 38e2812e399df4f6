"""The local transformers client on CPU, with tiny models built here: a Qwen2 causal LM (text-to-video) and a Llava
image-text model (image-to-video), sharing a byte-level BPE tokenizer trained on the fixture replies. A logits
processor forces the greedy output to a fixture reply's tokens, so the reply, and so the Markdown, are known."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.fixtures import golden_path, golden_text
from PIL import Image
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    CLIPImageProcessorPil,
    CLIPVisionConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaProcessor,
    LogitsProcessor,
    LogitsProcessorList,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from diffusers_magi2.pipelines.prompt_enhancement import Magi2PromptEnhancer
from diffusers_magi2.pipelines.prompt_enhancement_local import pil_image
from diffusers_magi2.pipelines.prompt_enhancement_tasks import image_url


TEMPLATE = "Caption: {user_input_text}{variation_seed}"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for p in m['content'] %}{% if p['type'] == 'text' %}{{ p['text'] }}{% else %}<image>{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
IMAGE_SIDE, PATCH = 28, 14  # one 2x2 grid of patches: 4 image tokens


class ForceReply(LogitsProcessor):
    """Leaves one finite logit per step: the reply's next token, then end-of-sequence. Records the prompt."""

    def __init__(self, token_ids: list[int], eos_token_id: int):
        self.token_ids, self.eos_token_id = token_ids, eos_token_id
        self.prompt_ids = None

    def __call__(self, input_ids, scores):
        if self.prompt_ids is None:
            self.prompt_ids = input_ids[0].tolist()
        step = input_ids.shape[1] - len(self.prompt_ids)
        forced = self.token_ids[step] if step < len(self.token_ids) else self.eos_token_id
        out = torch.full_like(scores, float("-inf"))
        out[:, forced] = 0.0
        return out


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    # BPE merges learned on the replies themselves (no word split): a fixture reply is a few hundred tokens
    replies = [
        path.read_text(encoding="utf-8") for path in sorted(golden_path("prompt_enhancement").glob("*.input.json"))
    ]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    bpe.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>"]
    trainer = trainers.BpeTrainer(
        vocab_size=4000,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(replies, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE
    )


def _text_config(tokenizer) -> Qwen2Config:
    return Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32768,  # the default max_new_tokens, 16,384, fits
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def _with_generation_ids(model, tokenizer):
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model.eval()


@pytest.fixture(scope="module")
def causal_lm(tokenizer) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    return _with_generation_ids(Qwen2ForCausalLM(_text_config(tokenizer)), tokenizer)


@pytest.fixture(scope="module")
def image_text_folder(tokenizer, tmp_path_factory):
    """A saved Llava model and its processor: loaded back through AutoModelForImageTextToText and AutoProcessor."""
    vision = CLIPVisionConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=IMAGE_SIDE,
        patch_size=PATCH,
    )
    config = LlavaConfig(
        vision_config=vision,
        text_config=_text_config(tokenizer),
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
    )
    torch.manual_seed(0)
    model = _with_generation_ids(LlavaForConditionalGeneration(config), tokenizer)
    image_processor = CLIPImageProcessorPil(
        size={"shortest_edge": IMAGE_SIDE}, crop_size={"height": IMAGE_SIDE, "width": IMAGE_SIDE}
    )
    processor = LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=PATCH,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=CHAT_TEMPLATE,
    )
    folder = tmp_path_factory.mktemp("tiny_llava")
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


def _forcing(tokenizer, reply: str) -> ForceReply:
    return ForceReply(tokenizer(reply, add_special_tokens=False).input_ids, tokenizer.eos_token_id)


def test_text_to_video_with_a_causal_lm_and_its_chat_template(causal_lm, tokenizer):
    force = _forcing(tokenizer, golden_text("prompt_enhancement/t2v_chinese_teahouse.input.json"))
    enhancer = Magi2PromptEnhancer.from_local_model(
        causal_lm, tokenizer, template=TEMPLATE, generate_kwargs={"logits_processor": LogitsProcessorList([force])}
    )
    rng_before = torch.get_rng_state()
    assert enhancer("茶馆里的老人 {variation_seed}") == golden_text(
        "prompt_enhancement/t2v_chinese_teahouse.render_markdown.md"
    )
    assert torch.equal(torch.get_rng_state(), rng_before)  # seeded in a fork: the caller's generator is untouched
    prompt = tokenizer.decode(force.prompt_ids)
    assert prompt == "<|im_start|>user\nCaption: 茶馆里的老人 <|im_end|>\n<|im_start|>assistant\n"


def test_image_to_video_with_an_image_text_model_loaded_from_its_folder(image_text_folder, tokenizer):
    force = _forcing(tokenizer, golden_text("prompt_enhancement/i2v_cooking.input.json"))
    enhancer = Magi2PromptEnhancer.from_local_model(
        str(image_text_folder), template=TEMPLATE, generate_kwargs={"logits_processor": LogitsProcessorList([force])}
    )
    image = Image.new("RGB", (40, 30), (200, 120, 10))
    seen = []
    enhancer.client._load()
    model, processor = enhancer.client.model, enhancer.client.tokenizer_or_processor
    assert (type(model).__name__, type(processor).__name__) == ("LlavaForConditionalGeneration", "LlavaProcessor")
    model.model.vision_tower.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(args[0] if args else kwargs["pixel_values"]), with_kwargs=True
    )
    assert enhancer("cook an egg", image=image) == golden_text("prompt_enhancement/i2v_cooking.render_markdown.md")
    expected_pixels = processor.image_processor(images=image, return_tensors="pt")["pixel_values"]
    (pixels,) = seen  # the image reached the vision tower once, as the processor prepares it
    torch.testing.assert_close(pixels, expected_pixels, rtol=0, atol=0)
    assert tokenizer.decode(force.prompt_ids) == (
        "<|im_start|>user\nCaption: cook an egg" + "<image>" * 4 + "<|im_end|>\n<|im_start|>assistant\n"
    )


def test_a_text_model_loaded_from_its_folder_enhances_text_and_refuses_an_image(causal_lm, tokenizer, tmp_path):
    causal_lm.save_pretrained(tmp_path / "lm")
    tokenizer.save_pretrained(tmp_path / "lm")
    force = _forcing(tokenizer, golden_text("prompt_enhancement/t2v_cooking_multiline.input.json"))
    enhancer = Magi2PromptEnhancer.from_local_model(
        tmp_path / "lm",
        template=TEMPLATE,
        generate_kwargs={"logits_processor": LogitsProcessorList([force])},
        device_map="cpu",
    )
    assert enhancer("an omelette") == golden_text("prompt_enhancement/t2v_cooking_multiline.render_markdown.md")
    assert type(enhancer.client.model).__name__ == "Qwen2ForCausalLM" and enhancer.client.model.device.type == "cpu"
    with pytest.raises(
        ValueError, match=rf"local model {tmp_path / 'lm'} reads text only .*AutoModelForImageTextToText"
    ):
        enhancer("an omelette", image=Image.new("RGB", (8, 8)))

    enhancer.save_pretrained(tmp_path / "enhancer")  # the path, not the weights
    config = json.loads((tmp_path / "enhancer" / "prompt_enhancer_config.json").read_text())
    assert (config["kind"], config["model"], config["max_new_tokens"], config["seed"], config["device_map"]) == (
        "local",
        str(tmp_path / "lm"),
        16384,
        0,
        "cpu",
    )
    assert sorted(path.name for path in (tmp_path / "enhancer").iterdir()) == [
        "i2v.md",
        "prompt_enhancer_config.json",
        "t2v.md",
    ]
    assert Magi2PromptEnhancer.from_pretrained(tmp_path / "enhancer").client.path == str(tmp_path / "lm")


@pytest.mark.parametrize(
    ("reply", "max_new_tokens", "message"),
    [
        ('{"global_layer": {"context": "snow"}}\n', 16384, r"lacks the required key\(s\) \['dynamic_layer'\]"),
        ("A fox in the snow.", 16384, "not JSON"),
        ('{"global_layer": {}, "dynamic_layer": {"timeline_segments": []}}', 5, "not JSON"),  # cut by the length
    ],
    ids=["missing-key", "prose", "truncated"],
)
def test_a_bad_local_reply_is_one_error_naming_the_model(causal_lm, tokenizer, reply, max_new_tokens, message):
    enhancer = Magi2PromptEnhancer.from_local_model(
        causal_lm,
        tokenizer,
        template=TEMPLATE,
        max_new_tokens=max_new_tokens,
        generate_kwargs={"logits_processor": LogitsProcessorList([_forcing(tokenizer, reply)])},
    )
    with pytest.raises(ValueError, match=rf"local model Qwen2ForCausalLM.*{message}|{message}.*Qwen2ForCausalLM"):
        enhancer("a fox")


def test_bad_local_arguments_are_refused_when_built(causal_lm, tokenizer):
    with pytest.raises(ValueError, match="max_new_tokens is an int >= 1"):
        Magi2PromptEnhancer.from_local_model(causal_lm, tokenizer, max_new_tokens=0)
    with pytest.raises(ValueError, match="seed is an int"):
        Magi2PromptEnhancer.from_local_model(causal_lm, tokenizer, seed=1.5)
    with pytest.raises(ValueError, match=r"may not set \['do_sample'\]"):
        Magi2PromptEnhancer.from_local_model(causal_lm, tokenizer, generate_kwargs={"do_sample": True})
    with pytest.raises(ValueError, match="needs a model"):
        Magi2PromptEnhancer.from_local_model(None)
    with pytest.raises(ValueError, match=r"no \{user_input_text\} placeholder"):
        Magi2PromptEnhancer.from_local_model(causal_lm, tokenizer, template="Describe it.")
    without_path = Magi2PromptEnhancer.from_local_model(causal_lm)
    with pytest.raises(ValueError, match="without its tokenizer or processor"):
        without_path("a fox")


def test_images_reach_the_processor_as_rgb_from_every_form_the_endpoint_takes(tmp_path):
    image = Image.new("RGBA", (6, 4), (10, 200, 30, 90))
    image.save(tmp_path / "frame.png")
    rgb = image.convert("RGB").tobytes()
    assert pil_image(image).tobytes() == rgb
    assert pil_image(tmp_path / "frame.png").tobytes() == rgb
    assert pil_image(image_url(tmp_path / "frame.png")).tobytes() == rgb  # a data URL of the PNG's bytes
    assert pil_image(str(tmp_path / "frame.png")).mode == "RGB"
    with pytest.raises(ValueError, match="is not a file"):
        pil_image(tmp_path / "missing.png")
    with pytest.raises(TypeError, match="PIL image, a local path"):
        pil_image(b"bytes")
