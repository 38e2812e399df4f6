"""``examples/generate.py --device``: a device this machine lacks is a clear ValueError before any model is built.

The machine is simulated (``torch.cuda`` patched), so the outcome does not depend on the test host.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from helpers.fixtures import REPO_ROOT


def load_generate():
    spec = importlib.util.spec_from_file_location("magi2_generate_device", REPO_ROOT / "examples" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cuda_devices(monkeypatch, count):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


@pytest.mark.parametrize(
    "device, count, message",
    [
        ("cuda", 0, "no CUDA device is available"),
        ("cuda:0", 0, "no CUDA device is available"),
        ("cuda:2", 2, "this machine has 2 CUDA device"),
        ("gpu", 0, "is not a torch device; use cpu, cuda or cuda:N"),
    ],
)
def test_unavailable_device_is_refused_before_any_model_is_built(tmp_path, monkeypatch, device, count, message):
    generate = load_generate()
    _cuda_devices(monkeypatch, count)

    def no_model(args):
        raise AssertionError("the device check must come before the pipeline is built")

    monkeypatch.setattr(generate, "load_pipeline", no_model)
    with pytest.raises(ValueError, match=message):
        generate.main(["--prompt", "x", "--output", str(tmp_path / "x.mp4"), "--device", device])
    assert list(tmp_path.iterdir()) == []


def test_available_devices_pass_the_check(monkeypatch):
    generate = load_generate()
    _cuda_devices(monkeypatch, 2)
    for device in ("cpu", "cuda", "cuda:1"):
        generate.check_device(device)
    _cuda_devices(monkeypatch, 0)
    generate.check_device("cpu")
