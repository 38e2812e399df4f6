"""The pipeline under context parallelism (2 gloo ranks): CP rank 0 alone encodes the text and the I2V image and
broadcasts them; both ranks' latents are equal and match the single-process call's. (Decoding on rank 0 only, and the other
ranks' ``frames=None``, are checked by the launch test, ``test_cp_launch.py``.)"""

from __future__ import annotations

import torch
from cp_pipeline_workers import i2v_latents
from ep_spawn_utils import run_on_ranks


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
