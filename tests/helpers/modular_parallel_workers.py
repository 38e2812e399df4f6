"""Per-rank body of ``test_modular_parallel.py``: a saved tiny default repo loaded under CP N x EP N (or alone)
as ``Magi2ModularPipeline`` (``load_components(expert_parallel=...)``, ``enable_context_parallel``; and the other
order: ``enable_context_parallel``, then ``transformer.enable_expert_parallel``) and as
``Magi2Pipeline`` (``from_pretrained(expert_parallel=..., context_parallel=...)``), counting the text-encoder and
decoder calls of the modular pipeline on this rank."""

from __future__ import annotations

import torch
from diffusers import ContextParallelConfig

from diffusers_magi2 import Magi2ExpertParallelConfig, Magi2Pipeline
from diffusers_magi2.modular_pipelines import Magi2ModularPipeline
from helpers.modular_testing_utils import PROMPT, T2V


#: two steps with CFG (video 5, audio 7: the scales amplify any per-forward difference of the layouts)
CALL = {**T2V, "num_inference_steps": 2}


def modular_and_classic(rank: int, world: int, folder: str) -> dict:
    parallel = {}
    modular = Magi2ModularPipeline.from_pretrained(folder)
    if world > 1:
        ep = Magi2ExpertParallelConfig(ep_degree=world)
        cp = ContextParallelConfig(ulysses_degree=world)
        parallel = {"expert_parallel": ep, "context_parallel": cp}
        modular.load_components(expert_parallel={"transformer": ep})
        modular.enable_context_parallel(cp)
    else:
        modular.load_components()
    modular.set_progress_bar_config(disable=True)
    calls = {"text_encoder": 0, "video_decoder": 0, "audio_decoder": 0}

    def count(name, fn):
        def wrapped(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapped

    modular.text_encoder.register_forward_pre_hook(
        lambda *a: calls.__setitem__("text_encoder", calls["text_encoder"] + 1)
    )
    modular.video_decoder.decode = count("video_decoder", modular.video_decoder.decode)
    modular.audio_vae.decode = count("audio_decoder", modular.audio_vae.decode)
    state = modular(prompt=PROMPT, generator=torch.Generator().manual_seed(7), **CALL)
    pipe = Magi2Pipeline.from_pretrained(folder, **parallel)
    pipe.set_progress_bar_config(disable=True)
    ref = pipe(PROMPT, generator=torch.Generator().manual_seed(7), output_type="latent", **CALL)
    experts = modular.transformer.transformer_blocks[1].mlp.moe_mlp
    other_order = {}
    if world > 1:  # context parallelism first, expert parallelism on the loaded transformer after it
        cp_first = Magi2ModularPipeline.from_pretrained(folder)
        cp_first.load_components()
        cp_first.enable_context_parallel(cp)
        cp_first.transformer.enable_expert_parallel(ep)
        cp_first.set_progress_bar_config(disable=True)
        other = cp_first(prompt=PROMPT, generator=torch.Generator().manual_seed(7), **CALL)
        other_order = {"cp_first_" + key: other.get(key) for key in ("latents", "audio_latents")}
    return {
        **other_order,
        "calls": calls,
        "latents": state.get("latents"),
        "audio_latents": state.get("audio_latents"),
        "videos_is_none": state.get("videos") is None,
        "audio_is_none": state.get("audio") is None,
        "classic_latents": ref.frames,
        "classic_audio_latents": ref.audio,
        "local_heads": int(getattr(experts, "local_num_heads", getattr(experts, "num_heads", -1))),
    }
