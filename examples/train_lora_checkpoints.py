"""``examples/train_lora.py``'s checkpoints: ``accelerator.save_state`` / ``load_state`` with the LoRA written as a
diffusers LoRA file, the noise generator checkpointed beside it, each checkpoint written under a temporary name and
renamed once whole, and ``--resume_from_checkpoint`` resolved to a folder."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


__all__ = [
    "LORA_FILE",
    "NoiseGenerator",
    "find_checkpoint",
    "register_checkpoint_hooks",
    "save_checkpoint",
    "save_lora",
]

LORA_FILE = "pytorch_lora_weights.safetensors"


class NoiseGenerator:
    """The noise generator, checkpointed by ``accelerator.save_state`` (``register_for_checkpointing``); the
    same seed on every rank, since every rank sees the same sample."""

    def __init__(self, seed: int):
        import torch

        self.generator = torch.Generator().manual_seed(seed)

    def state_dict(self) -> dict:
        return {"state": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["state"])


def save_lora(pipe, folder: Path) -> None:
    """``folder/pytorch_lora_weights.safetensors``: the adapter ``default`` in diffusers' LoRA format, with its
    adapter config (so it reloads at its scale)."""
    from peft import get_peft_model_state_dict

    t = pipe.transformer
    pipe.save_lora_weights(
        folder,
        transformer_lora_layers=get_peft_model_state_dict(t, adapter_name="default"),
        transformer_lora_adapter_metadata=t.peft_config["default"].to_dict(),
    )


def register_checkpoint_hooks(accelerator, pipe) -> None:
    """``accelerator.save_state`` writes the LoRA into the checkpoint as a diffusers LoRA file, and
    ``accelerator.load_state`` reads it back into the adapter (accelerate saves no weights of its own: the
    transformer does not go through ``accelerator.prepare``)."""
    from peft import set_peft_model_state_dict

    def save_hook(models, weights, output_dir):
        if accelerator.is_main_process:
            save_lora(pipe, Path(output_dir))

    def load_hook(models, input_dir):
        import torch
        from diffusers.training_utils import cast_training_params

        state = pipe.lora_state_dict(Path(input_dir) / LORA_FILE)
        state = {k.removeprefix("transformer."): v for k, v in state.items()}
        result = set_peft_model_state_dict(pipe.transformer, state, adapter_name="default")
        if getattr(result, "unexpected_keys", None):
            raise ValueError(f"{input_dir}: LoRA keys that this model has not: {result.unexpected_keys[:5]}")
        cast_training_params(pipe.transformer, dtype=torch.float32)

    accelerator.register_save_state_pre_hook(save_hook)
    accelerator.register_load_state_pre_hook(load_hook)


def save_checkpoint(accelerator, output_dir: Path, step: int) -> Path:
    """``accelerator.save_state`` into ``output_dir/checkpoint-<step>/``: written as ``.checkpoint-<step>.partial``
    and renamed once every rank is done, so a run cut short leaves no checkpoint that looks whole."""
    final, staging = output_dir / f"checkpoint-{step}", output_dir / f".checkpoint-{step}.partial"
    if accelerator.is_main_process:
        shutil.rmtree(staging, ignore_errors=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(staging))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(staging, final)
    accelerator.wait_for_everyone()
    return final


def find_checkpoint(output_dir: Path, resume: str) -> tuple[Path, int] | None:
    """``(folder, step)`` of ``--resume_from_checkpoint``: ``latest`` (the newest ``checkpoint-<step>`` in
    ``output_dir``; ``None`` when there is none, a new run) or a ``checkpoint-<step>`` folder (a bare name in
    ``output_dir``, as diffusers' training scripts resolve it; a path with a folder part as given); ``ValueError``
    when a named folder is not one."""
    flag = f"--resume_from_checkpoint {resume!r}"
    if resume == "latest":
        found = sorted(
            (p for p in output_dir.glob("checkpoint-*") if p.name.split("-")[-1].isdigit()),
            key=lambda p: int(p.name.split("-")[-1]),
        )
        if not found:
            return None
        folder = found[-1]
    else:
        folder = output_dir / resume if Path(resume).name == resume else Path(resume)
        if not folder.name.startswith("checkpoint-") or not folder.name.split("-")[-1].isdigit():
            raise ValueError(f"{flag}: expected a checkpoint-<step> folder (or 'latest')")
        if not folder.is_dir():
            raise ValueError(f"{flag}: no such folder ({folder})")
    if not (folder / LORA_FILE).is_file():
        raise ValueError(f"{flag}: {folder} holds no {LORA_FILE}")
    return folder, int(folder.name.split("-")[-1])
