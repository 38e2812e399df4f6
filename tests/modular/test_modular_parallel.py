"""``Magi2ModularPipeline`` under context parallelism x expert parallelism (CP2 x EP2, two gloo processes, the
routed experts sharded at load): CP rank 0 alone encodes the text and decodes (the other rank gets
``videos=None``), both ranks' latents equal ``Magi2Pipeline``'s under the same layout bit for bit and one
process's within 1e-5 (two steps with CFG), whether EP is enabled before CP (at load) or after it."""

from __future__ import annotations

import pytest
import torch
from helpers.ep_spawn_utils import run_on_ranks
from helpers.modular_parallel_workers import modular_and_classic
from helpers.modular_testing_utils import tiny_pipelines


pytestmark = pytest.mark.distributed


def test_cp2_ep2_modular_equals_one_process(tmp_path):
    folder = str(tmp_path / "magi2-tiny")
    tiny_pipelines()[0].save_pretrained(folder)
    single = modular_and_classic(0, 1, folder)
    assert single["calls"] == {"text_encoder": 2, "video_decoder": 1, "audio_decoder": 1}  # prompt, negative prompt
    ranks = run_on_ranks(modular_and_classic, 2, folder, deadline_s=400.0)
    assert ranks[0]["calls"] == single["calls"]
    assert ranks[1]["calls"] == {"text_encoder": 0, "video_decoder": 0, "audio_decoder": 0}
    assert not ranks[0]["videos_is_none"] and ranks[1]["videos_is_none"] and ranks[1]["audio_is_none"]
    assert [r["local_heads"] for r in ranks] == [single["local_heads"] // 2] * 2  # each rank loaded half the heads
    for rank in ranks:
        for key in ("latents", "audio_latents"):
            assert torch.equal(rank[key], rank["classic_" + key])  # the modular pipeline is the classic one
            assert torch.equal(rank[key], rank["cp_first_" + key])  # EP enabled after CP: the same layout
            torch.testing.assert_close(rank[key], single[key], atol=1e-5, rtol=0)
