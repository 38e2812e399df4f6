"""The tiny random pipeline saved as a repo, shared by the LoRA training test modules."""

from __future__ import annotations

import pytest

from diffusers_magi2 import build_tiny_random_pipeline


@pytest.fixture(scope="session")
def tiny_repo(tmp_path_factory):
    """The tiny random pipeline saved as a repo (bf16-style experts: quantized while reading)."""
    folder = tmp_path_factory.mktemp("tiny_repo")
    build_tiny_random_pipeline().save_pretrained(folder)
    return folder
