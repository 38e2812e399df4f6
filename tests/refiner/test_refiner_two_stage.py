"""Two-stage tiny run: converted preview_h4 -> Magi2Pipeline (latent output) -> refiner stage with the
converted tiny refiner -> TurboVAE decode -> 25 fps mp4 with the preview audio (spec §5.1, §5.7).

The refiner stage is called the way ``Magi2Pipeline`` is meant to call it once wired
(``run_refiner_stage(self.refiner, latents, prompt_embeds, negative_prompt_embeds, self.scheduler, ...)``).
Channel counts of the tiny models: video 12, audio 16, text 48.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch
from diffusers import AutoencoderOobleck, UniPCMultistepScheduler

from diffusers_magi2 import Magi2Pipeline, Magi2Transformer3DModel, export_to_video_with_audio
from diffusers_magi2.models.transformer_magi2_refiner import Magi2RefinerTransformer3DModel
from diffusers_magi2.models.turbo_vae import Magi2TurboVAEDecoder
from diffusers_magi2.pipelines.refiner_stage import run_refiner_stage
from diffusers_magi2.pipelines.tiny_default import build_tiny_tokenizer
from diffusers_magi2.utils.export import probe_streams


@pytest.fixture(scope="module")
def two_stage(fixtures_dir, tmp_path_factory):
    from transformers import Qwen3_5TextConfig, Qwen3_5TextModel

    from diffusers_magi2.conversion.convert_transformer import prepare_transformer_conversion, write_transformer

    root = tmp_path_factory.mktemp("two_stage")
    tiny = fixtures_dir / "magi2_tiny"
    src_p = tiny / "preview_h4/sandai_checkpoint"
    src_r = tiny / "refiner/sandai_checkpoint"
    write_transformer(prepare_transformer_conversion("transformer", src_p, src_p / "magi2_preview.json"), root / "transformer")
    write_transformer(prepare_transformer_conversion("refiner", src_r, src_r / "magi2_refiner.json"), root / "refiner")

    torch.manual_seed(0)
    tokenizer = build_tiny_tokenizer(vocab_size=512)
    text_encoder = Qwen3_5TextModel(
        Qwen3_5TextConfig(
            vocab_size=len(tokenizer), hidden_size=48, intermediate_size=64, num_hidden_layers=4,
            layer_types=["linear_attention"] * 3 + ["full_attention"], num_attention_heads=2,
            num_key_value_heads=1, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=2,
            linear_key_head_dim=8, linear_value_head_dim=8, pad_token_id=0,
        )
    ).eval()
    g = torch.Generator().manual_seed(1)
    mean = (torch.rand(12, generator=g) - 0.5).tolist()
    std = (torch.rand(12, generator=g) + 0.5).tolist()
    video_decoder = Magi2TurboVAEDecoder(
        latent_channels=12, decoder_block_out_channels=[4, 4, 4, 4], decoder_layers_per_block=[1, 1, 1, 1, 1],
        first_chunk_size=7, step_size=7, latents_mean=mean, latents_std=std,
    ).eval()
    audio_vae = AutoencoderOobleck(
        encoder_hidden_size=2, channel_multiples=[1, 2, 2, 2, 2], decoder_channels=2, decoder_input_channels=16,
    ).eval()
    scheduler = UniPCMultistepScheduler(
        use_flow_sigmas=True, flow_shift=7.0, prediction_type="flow_prediction", solver_order=2, solver_type="bh2",
        predict_x0=True, lower_order_final=True, final_sigmas_type="zero",
    )
    transformer = Magi2Transformer3DModel.from_pretrained(root / "transformer", torch_dtype=torch.float32)
    refiner = Magi2RefinerTransformer3DModel.from_pretrained(root / "refiner", torch_dtype=torch.float32)
    pipe = Magi2Pipeline(
        tokenizer=tokenizer, text_encoder=text_encoder, transformer=transformer, audio_vae=audio_vae,
        scheduler=scheduler, video_decoder=video_decoder, refiner=refiner,
    )
    return pipe, root


def test_two_stage_tiny_run_writes_25fps_mp4_with_audio(two_stage, tmp_path):
    pipe, _ = two_stage
    prompt = "A red fox trots through fresh snow at dawn, wind howling"
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        latents, audio_latents = pipe(
            prompt, height=32, width=48, num_inference_steps=2, generator=gen, output_type="latent", return_dict=False
        )
        assert latents.shape == (1, 12, 32, 2, 3) and audio_latents.shape == (1, 250, 16)
        cond, cond_mask, _ = pipe.encode_prompt([prompt], "cpu")
        neg, neg_mask, _ = pipe.encode_prompt([pipe.config.negative_prompt], "cpu")
        steps, calls = [], []
        hook = pipe.refiner.register_forward_hook(
            lambda m, args, kwargs, out: calls.append((kwargs["hidden_states"].shape[0], kwargs["encoder_hidden_states"].shape[1])),
            with_kwargs=True,
        )
        refined = run_refiner_stage(
            pipe.refiner, latents, cond, neg, pipe.scheduler, height=64, width=96,
            prompt_attention_mask=cond_mask, negative_prompt_attention_mask=neg_mask, generator=gen,
            callback_on_step_end=lambda i, t, x: steps.append(int(t)),
        )
        hook.remove()
        assert steps == [999, 952, 882, 768, 555]
        # two batch-1 refiner forwards per step: cond (prompt length) then uncond (negative-prompt length)
        assert cond.shape[1] != neg.shape[1]
        assert calls == [(1, cond.shape[1]), (1, neg.shape[1])] * 5
        assert refined.shape == (1, 12, 63, 4, 6) and torch.isfinite(refined).all()
        video = pipe.decode_video(refined)
        audio = pipe.decode_audio(audio_latents)  # preview audio decoded as is
    frames = pipe.video_processor.postprocess_video(video, output_type="np")
    assert frames.shape == (1, 249, 64, 96, 3)
    assert audio.shape == (1, 2, 441_000)
    path = export_to_video_with_audio(
        frames[0], tmp_path / "clip_1080p_preset.mp4", audio=audio[0], fps=Fraction(25), audio_sample_rate=44_100
    )
    info = probe_streams(path)
    assert info["video_frames"] == 249 and info["fps"] == Fraction(25)
    assert info["audio_sample_rate"] == 44_100 and info["audio_channels"] == 2
    assert abs(info["video_stream_duration_s"] - 249 / 25) <= 1 / 25
    assert abs(info["audio_stream_duration_s"] - 10.0) <= 1 / 25
    assert np.isfinite(frames).all()
