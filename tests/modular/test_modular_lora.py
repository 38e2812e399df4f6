"""``Magi2ModularPipeline``'s LoRA API (``Magi2LoraLoaderMixin``): an adapter loaded through the modular
pipeline, at the call's LoRA scale (``attention_kwargs={"scale": s}``), gives ``Magi2Pipeline``'s output bit for
bit, and unloading it restores the base output."""

from __future__ import annotations

import torch
from helpers.lora_testing_utils import mirai_state_dict, random_factors
from helpers.modular_testing_utils import PROMPT, T2V, tiny_pipelines


def test_lora_through_the_modular_pipeline_equals_the_classic_call():
    pipe, modular = tiny_pipelines()
    call = {**T2V, "num_inference_steps": 1, "output_type": "latent"}

    def classic(**kw):
        return pipe(PROMPT, generator=torch.Generator().manual_seed(1), **call, **kw).frames

    def modular_call(**kw):
        return modular(prompt=PROMPT, generator=torch.Generator().manual_seed(1), output="videos", **call, **kw)

    base = modular_call()
    factors = random_factors(modular.transformer, rank=3, seed=0, std=0.2)
    modular.load_lora_weights(mirai_state_dict(factors, "mirai_native"), adapter_name="a")
    assert modular.get_active_adapters() == ["a"]
    half = {"attention_kwargs": {"scale": 0.5}}
    with_lora, with_half = modular_call(), modular_call(**half)
    assert torch.equal(with_lora, classic()) and torch.equal(with_half, classic(**half))
    assert not torch.equal(with_lora, base) and not torch.equal(with_half, with_lora)
    modular.unload_lora_weights()
    assert torch.equal(modular_call(), base)
