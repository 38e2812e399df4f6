"""diffusers' caching hooks (FirstBlockCache, TaylorSeer, MagCache) through ``Magi2Pipeline.__call__``,
in the preview stage (the tiny default transformer) and in the refiner stage (``magi2_tiny`` refiner).

The hooks replace a block's (or an attention module's) ``forward``; the work that really runs is
counted with a pre-hook on the first child of each block's attention module.
"""

from __future__ import annotations

import pytest
import torch
from diffusers import (
    FasterCacheConfig,
    FirstBlockCacheConfig,
    MagCacheConfig,
    PyramidAttentionBroadcastConfig,
    TaylorSeerCacheConfig,
)
from diffusers.hooks import HookRegistry
from helpers.pipeline_stubs import tiny_two_stage_pipeline

from diffusers_magi2 import build_tiny_random_pipeline  # noqa: E402


STEPS = 6


def count_attention_work(model) -> list:
    """Indices of the blocks whose attention really computes, in call order."""
    calls = []
    for i, block in enumerate(model.transformer_blocks):
        next(iter(block.attention.children())).register_forward_pre_hook(lambda m, a, i=i: calls.append(i))
    return calls


@pytest.fixture(scope="module")
def preview():
    pipe = build_tiny_random_pipeline()
    pipe.set_progress_bar_config(disable=True)
    calls = count_attention_work(pipe.transformer)
    g = torch.Generator().manual_seed(1)
    embeds = {
        "prompt_embeds": torch.randn(1, 5, 64, generator=g),
        "prompt_attention_mask": torch.ones(1, 5, dtype=torch.bool),
        "negative_prompt_embeds": torch.randn(1, 3, 64, generator=g),
        "negative_prompt_attention_mask": torch.ones(1, 3, dtype=torch.bool),
    }

    def run(cache=None):
        if cache is not None:
            pipe.transformer.enable_cache(cache)
        calls.clear()
        try:
            out = pipe(
                **embeds,
                height=32,
                width=48,
                num_inference_steps=STEPS,
                output_type="latent",
                generator=torch.Generator().manual_seed(0),
            )
        finally:
            if cache is not None:
                pipe.transformer.disable_cache()
        return out.frames, list(calls)

    reference, reference_calls = run()
    assert reference_calls == [0, 1] * STEPS
    return pipe, run, reference


def test_first_block_cache_through_the_pipeline(preview):
    """Threshold 0 never skips (the output is exactly the uncached one); a huge threshold skips
    every block after the first from step 1 on."""
    _, run, reference = preview
    never, calls = run(FirstBlockCacheConfig(threshold=0.0))
    assert torch.equal(never, reference) and calls == [0, 1] * STEPS
    always, calls = run(FirstBlockCacheConfig(threshold=1e9))
    assert calls == [0, 1] + [0] * (STEPS - 1)
    assert torch.isfinite(always).all() and not torch.equal(always, reference)


def test_taylorseer_default_identifiers_find_the_attention_modules(preview):
    """``TaylorSeerCacheConfig()`` without identifiers hooks every block's attention module; with
    interval 2 after 2 warm-up steps, steps 2 and 4 are first-order Taylor predictions."""
    pipe, run, reference = preview
    pipe.transformer.enable_cache(TaylorSeerCacheConfig())
    hooked = [
        name
        for name, module in pipe.transformer.named_modules()
        if HookRegistry.check_if_exists_or_initialize(module).get_hook("taylorseer_cache") is not None
    ]
    pipe.transformer.disable_cache()
    assert hooked == [f"transformer_blocks.{i}.attention" for i in range(len(pipe.transformer.transformer_blocks))]

    outputs = []
    handle = pipe.transformer.transformer_blocks[0].attention.register_forward_hook(
        lambda m, a, out: outputs.append(out.detach().clone())
    )
    try:
        cached, calls = run(
            TaylorSeerCacheConfig(cache_interval=2, disable_cache_before_step=2, taylor_factors_dtype=torch.float32)
        )
    finally:
        handle.remove()
    assert calls == [0, 1] * 2 + [0, 1] + [0, 1]  # computed at steps 0, 1, 3, 5 only
    f0, f1, p2, f3, p4, _ = outputs
    torch.testing.assert_close(p2, f1 + (f1 - f0), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(p4, f3 + (f3 - f1) / 2, rtol=1e-6, atol=1e-6)
    assert not torch.equal(cached, reference)


def hooked_by_taylorseer(model) -> list:
    return sorted(
        name
        for name, module in model.named_modules()
        if HookRegistry.check_if_exists_or_initialize(module).get_hook("taylorseer_cache") is not None
    )


def test_taylorseer_lite_mode_predicts_the_output_head(preview):
    """Lite mode skips every block and Taylor-predicts ``post_adapter`` (diffusers' lite patterns name ``proj_out``,
    which MAGI-2 does not have): on the predicted steps 2 and 4 no block computes, no transformer output is all zero,
    and the result is closer to the uncached one than FirstBlockCache's when it skips steps 1-5."""
    pipe, run, reference = preview
    config = TaylorSeerCacheConfig(
        use_lite_mode=True, cache_interval=2, disable_cache_before_step=2, taylor_factors_dtype=torch.float32
    )
    outputs = []
    handle = pipe.transformer.register_forward_hook(lambda m, a, out: outputs.append(out.sample.clone()))
    try:
        lite, calls = run(config)
    finally:
        handle.remove()
    assert len(outputs) == STEPS and all(torch.count_nonzero(v) > 0 for v in outputs)
    assert calls == [0, 1] * 4  # attention computed at steps 0, 1, 3, 5 only
    first_block, _ = run(FirstBlockCacheConfig(threshold=1e9))
    assert (lite - reference).abs().max() < (first_block - reference).abs().max()

    pipe.transformer.enable_cache(config)
    hooked = hooked_by_taylorseer(pipe.transformer)
    pipe.transformer.disable_cache()
    blocks = [f"transformer_blocks.{i}" for i in range(len(pipe.transformer.transformer_blocks))]
    assert hooked == ["post_adapter"] + blocks


def test_cache_patterns_that_match_nothing_are_refused_by_name(preview):
    pipe, run, reference = preview
    for config, message in (
        (TaylorSeerCacheConfig(cache_identifiers=["^blocks.*attn"]), r"cache_identifiers pattern\(s\) \['\^blocks"),
        (TaylorSeerCacheConfig(skip_predict_identifiers=["proj_out"]), r"skip_predict_identifiers .*\['proj_out'\]"),
        (
            PyramidAttentionBroadcastConfig(
                spatial_attention_block_skip_range=2,
                spatial_attention_block_identifiers=("attn1",),
                current_timestep_callback=lambda: pipe.current_timestep,
            ),
            r"spatial_attention_block_identifiers pattern\(s\) \['attn1'\]",
        ),
        (TaylorSeerCacheConfig(use_lite_mode=True, cache_identifiers=["post_adapter"]), "use_lite_mode"),
    ):
        with pytest.raises(ValueError, match=message):
            pipe.transformer.enable_cache(config)
        assert not pipe.transformer.is_cache_enabled


def test_faster_cache_is_refused_naming_what_is_missing(preview):
    """FasterCache's attention patterns match none of the MAGI-2 attention modules and its hooks need a
    ``[uncond; cond]`` batch with one output; enabling it raises, installs nothing, and ``pipe(...)`` runs uncached."""
    pipe, run, reference = preview
    config = FasterCacheConfig(current_timestep_callback=lambda: pipe.current_timestep)
    with pytest.raises(
        ValueError, match=r"FasterCache cannot run on Magi2Transformer3DModel.*\^transformer_blocks\.\*attn"
    ):
        pipe.transformer.enable_cache(config)
    assert not pipe.transformer.is_cache_enabled
    out, calls = run()
    assert torch.equal(out, reference) and calls == [0, 1] * STEPS


def test_pyramid_attention_broadcast_through_the_pipeline(preview):
    """Its default spatial patterns find the blocks' attention modules: with skip range 2 over every timestep, the
    attention computes at steps 0, 2 and 4 and returns its previous output at the others."""
    pipe, run, reference = preview
    config = PyramidAttentionBroadcastConfig(
        spatial_attention_block_skip_range=2,
        spatial_attention_timestep_skip_range=(-1, 1001),
        current_timestep_callback=lambda: pipe.current_timestep,
    )
    out, calls = run(config)
    assert calls == [0, 1] * 3
    assert torch.isfinite(out).all() and not torch.equal(out, reference)


def test_mag_cache_through_the_pipeline(preview):
    """Calibration never skips (output exactly uncached); flat ratios skip up to 3 steps in a row
    after the retained first step: steps 0 and 4 compute."""
    _, run, reference = preview
    calibrated, calls = run(MagCacheConfig(calibrate=True, num_inference_steps=STEPS))
    assert torch.equal(calibrated, reference) and calls == [0, 1] * STEPS
    skipping, calls = run(MagCacheConfig(mag_ratios=[1.0] * STEPS, num_inference_steps=STEPS))
    assert calls == [0, 1, 0, 1]
    assert torch.isfinite(skipping).all() and not torch.equal(skipping, reference)


@pytest.fixture(scope="module")
def two_stage(fixtures_dir):
    pipe = tiny_two_stage_pipeline(fixtures_dir)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_refiner_stage_runs_the_caching_hooks(two_stage):
    """The refiner is a ``CacheMixin`` model and its stage sets a cache context per branch: with a
    huge FirstBlockCache threshold, the cond and uncond forwards each run every block at step 0 and
    only the first block at steps 1-4; MagCache with flat ratios computes steps 0 and 4 of each."""
    pipe = two_stage
    layers = len(pipe.refiner.transformer_blocks)
    calls = count_attention_work(pipe.refiner)
    kwargs = {
        "prompt": "A red fox trots through fresh snow",
        "height": 32,
        "width": 32,
        "preview_height": 16,
        "preview_width": 16,
        "num_inference_steps": 1,
        "output_type": "latent",
    }
    reference = pipe(**kwargs, generator=torch.Generator().manual_seed(0)).frames
    assert len(calls) == 5 * 2 * layers

    for config, want in (
        (FirstBlockCacheConfig(threshold=1e9), list(range(layers)) * 2 + [0] * 8),
        (MagCacheConfig(mag_ratios=[1.0] * 5, num_inference_steps=5), list(range(layers)) * 4),
    ):
        pipe.refiner.enable_cache(config)
        calls.clear()
        try:
            out = pipe(**kwargs, generator=torch.Generator().manual_seed(0)).frames
        finally:
            pipe.refiner.disable_cache()
        assert calls == want, type(config).__name__
        assert torch.isfinite(out).all() and not torch.equal(out, reference)

    pipe.refiner.enable_cache(TaylorSeerCacheConfig())
    hooked = [
        name
        for name, module in pipe.refiner.named_modules()
        if HookRegistry.check_if_exists_or_initialize(module).get_hook("taylorseer_cache") is not None
    ]
    pipe.refiner.disable_cache()
    assert hooked == [f"transformer_blocks.{i}.attention" for i in range(layers)]
