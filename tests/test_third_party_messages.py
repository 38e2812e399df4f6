"""Third-party messages that cannot apply to the run stay hidden, and only those: transformers' CUDA-kernel install
advice where torch sees no CUDA device, and torch's ``weight_norm`` deprecation raised inside diffusers'
``AutoencoderOobleck``."""

from __future__ import annotations

import logging
import subprocess
import sys

import torch

from diffusers_magi2.utils.third_party_messages import HUB_KERNELS_LOGGER, CudaKernelAdviceFilter


ADVICE = (
    "`causal_conv1d_fn` is falling back to its reference PyTorch implementation because `causal_conv1d` is not "
    "installed. This is correct but much slower; install `causal_conv1d` for the optimized kernel."
)


def _record(message: str) -> logging.LogRecord:
    return logging.LogRecord(HUB_KERNELS_LOGGER, logging.WARNING, __file__, 1, message, None, None)


def test_kernel_advice_is_dropped_without_cuda_and_kept_with_it(monkeypatch):
    flt = CudaKernelAdviceFilter()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not flt.filter(_record(ADVICE))
    assert flt.filter(_record("some other transformers warning"))
    assert flt.filter(_record("`foo` is falling back to its reference PyTorch implementation because `bar` is not"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert flt.filter(_record(ADVICE))


def test_a_tiny_run_prints_neither_message():
    """A fresh interpreter: build the tiny default (an ``AutoencoderOobleck`` inside) and encode a prompt (the text
    encoder's linear-attention layers run); stderr names neither package nor ``weight_norm``."""
    code = (
        "import torch\n"
        "from diffusers_magi2 import build_tiny_default_pipeline\n"
        "pipe = build_tiny_default_pipeline()\n"
        "with torch.no_grad():\n"
        "    pipe.encode_prompt('a red fox', negative_prompt=None, do_classifier_free_guidance=False)\n"
        "print('ENCODED')\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "ENCODED" in res.stdout, res.stderr[-2000:]
    if not torch.cuda.is_available():
        assert "causal_conv1d" not in res.stderr and "flash-linear-attention" not in res.stderr, res.stderr
    assert "weight_norm" not in res.stderr, res.stderr
