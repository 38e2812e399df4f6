"""The pipeline under context parallelism (2 gloo ranks): CP rank 0 alone encodes the text and the I2V image and
broadcasts them; both ranks' latents are equal and match the single-process call's. (Decoding on rank 0 only, and the other
ranks' ``frames=None``, are checked by the launch test, ``test_cp_launch.py``.)"""

from __future__ import annotations

import pytest
import torch
from helpers.cp_pipeline_workers import i2v_latents, refiner_stage_latents
from helpers.ep_spawn_utils import run_on_ranks


pytestmark = pytest.mark.distributed


def test_i2v_conditioning_encoded_once_and_broadcast():
    single = i2v_latents(0, 1)
    assert single["calls"] == {"text_encoder": 2, "image_encoder": 1}  # prompt + negative prompt, one image
    ranks = run_on_ranks(i2v_latents, 2, deadline_s=240.0)
    assert ranks[0]["calls"] == single["calls"]
    assert ranks[1]["calls"] == {"text_encoder": 0, "image_encoder": 0}
    for key in ("latents", "audio_latents"):
        assert torch.equal(ranks[0][key], ranks[1][key])  # same conditioning, same gathered outputs
        assert ranks[0][key].shape == single[key].shape
        # each forward is within 1e-5 of one process; two steps with CFG scale 5 amplify that to ~2e-5
        torch.testing.assert_close(ranks[0][key], single[key], atol=1e-4, rtol=0)


def test_refiner_stage_splits_across_ranks(fixtures_dir):
    """The pipeline's refiner stage under CP 2: each rank runs half of every refiner forward (<= 0.55 of one
    process's FLOPs, >= 0.95 together); every refiner forward a rank ran equals one process's on the same inputs
    within 1e-5, and the refined latents match the single-process call's."""
    from diffusers_magi2 import Magi2RefinerTransformer3DModel

    single = refiner_stage_latents(0, 1)
    ranks = run_on_ranks(refiner_stage_latents, 2, deadline_s=600.0)
    per_rank = [r["refiner_flops"] / single["refiner_flops"] for r in ranks]
    assert max(per_rank) <= 0.55 and sum(per_rank) >= 0.95, per_rank
    refiner = Magi2RefinerTransformer3DModel.from_original_checkpoint(
        fixtures_dir / "magi2_tiny" / "refiner" / "sandai_checkpoint", torch_dtype=torch.float32
    )
    for r in ranks:
        assert len(r["refiner_calls"]) == len(single["refiner_calls"]) == 2  # 1 step x (cond, uncond)
        for kwargs, got in r["refiner_calls"]:
            with torch.no_grad():
                ref = refiner(**kwargs).sample
            assert (got - ref).abs().max().item() <= 1e-5, (got - ref).abs().max().item()
        # one preview step and one refiner step with CFG scale 2 amplify the per-forward 1e-6 to ~1e-5
        # on latents of magnitude ~15 (rel 1e-6)
        torch.testing.assert_close(r["latents"], single["latents"], atol=1e-4, rtol=0)


def test_prompt_enhancement_asks_on_rank_0_only_and_an_endpoint_error_raises_on_every_rank():
    """Under CP 2 each rank's enhancer points at its own server on 127.0.0.1: only rank 0's is asked; its reply,
    rendered, is what is encoded (on CP rank 0, which encodes for both) and what ``enhance_prompt`` returns on both
    ranks, and the latents equal one process's. An HTTP error of rank 0's endpoint raises the same error, naming
    that endpoint, on both ranks before any transformer forward (no rank waits)."""
    from helpers.cp_pipeline_workers import enhanced_prompt_call
    from helpers.fixtures import golden_text

    markdown = golden_text("prompt_enhancement/t2v_fox_snow.render_markdown.md")
    single = enhanced_prompt_call(0, 1)
    assert single["requests"] == 2 and single["encoded"][0] == markdown  # the call, then enhance_prompt
    ranks = run_on_ranks(enhanced_prompt_call, 2, deadline_s=240.0)
    assert [r["requests"] for r in ranks] == [2, 0] and [r["failing_requests"] for r in ranks] == [1, 0]
    assert ranks[0]["encoded"] == single["encoded"] and ranks[1]["encoded"] == []
    assert ranks[0]["enhanced"] == ranks[1]["enhanced"] == markdown
    assert torch.equal(ranks[0]["latents"], ranks[1]["latents"])
    torch.testing.assert_close(ranks[0]["latents"], single["latents"], atol=1e-4, rtol=0)
    kind, message = ranks[0]["error"]
    assert ranks[1]["error"] == (kind, message) and kind == "RuntimeError"
    assert (
        message.startswith(f"Prompt enhancement failed: the endpoint {ranks[0]['urls'][1]}") and "HTTP 400" in message
    )
    assert [r["forwards_after_failure"] for r in (single, *ranks)] == [0, 0, 0]
