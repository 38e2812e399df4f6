"""Attention sinks by log-sum-exp: the backend runs at the model's head dim and the output is corrected with its LSE.

``out_with_sinks = out * exp(lse - logaddexp(lse, logsumexp(sinks)))``. On CPU the default backend takes this path
through ``aten._scaled_dot_product_flash_attention_for_cpu`` (so every CPU test exercises it); the padded head dim
(``D + 8``, one extra key) stays for backends without an LSE. Checked: both paths agree on SandAI's tiny fixtures
(h4, h3, t2v and i2v; fp32 within 1e-6, bf16 within the bf16 bound of the fixture), the kernel sees head dim ``D``,
the gradients (q, k, v and the sinks; under autograd every backend takes the padded path) equal those of an explicit
softmax with the sink as one more logit, LSE layouts of dispatched backends, the refusal of a backend that can
serve sinks neither way, and that each head's output is bit for bit that of a call holding more heads (Ulysses).
"""

from __future__ import annotations

import functools

import pytest
import torch
from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry
from safetensors.torch import load_file
from torch.utils._python_dispatch import TorchDispatchMode

from diffusers_magi2.models import attention_sinks_magi2
from diffusers_magi2.models.attention_magi2 import magi2_attention_with_sinks, sink_attention_path
from diffusers_magi2.models.transformer_magi2 import Magi2Transformer3DModel


CASES = ["preview_h4", "preview_h3"]
CPU_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default


@functools.lru_cache(maxsize=None)
def _model(root: str, case: str, dtype: torch.dtype) -> Magi2Transformer3DModel:
    return Magi2Transformer3DModel.from_original_checkpoint(f"{root}/magi2_tiny/{case}/sandai_checkpoint", dtype=dtype)


def _forward(model, d: dict, prefix: str) -> torch.Tensor:
    with torch.no_grad():
        return model.forward_packed(
            d[prefix + "model.x"],
            d[prefix + "model.coords_mapping"],
            d[prefix + "model.modality_mapping"],
            d[prefix + "model.cu_seqlens_q"],
            d[prefix + "model.time_token_sequence"],
        )


class _RecordCpuFlash(TorchDispatchMode):
    """Records the head dim of every CPU flash-attention call."""

    def __init__(self):
        super().__init__()
        self.head_dims = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is CPU_FLASH:
            self.head_dims.append(args[0].shape[-1])
        return func(*args, **(kwargs or {}))


def _rel_l2(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("prec", ["fp32", "bf16"])
def test_lse_path_equals_padded_path_and_fixture(fixtures_dir, monkeypatch, case, prec):
    """Every attention call of the fixture forward gives the padded path's output within 1e-6 (fp32) on the same
    q/k/v; the whole model then stays within today's fixture bounds on either path."""
    dtype = torch.float32 if prec == "fp32" else torch.bfloat16
    model = _model(str(fixtures_dir), case, dtype)
    d = load_file(f"{fixtures_dir}/magi2_tiny/{case}/{prec}/transformer_case.safetensors")
    prefixes = [p for p in ("", "i2v.") if p + "model.x" in d]
    assert "i2v." in prefixes or case != "preview_h4"
    assert sink_attention_path(None, torch.device("cpu"), dtype, False) == "cpu_flash"
    by_lse = attention_sinks_magi2._attention_with_sinks_by_lse
    errors = []

    def compared(query, key, value, sink_logit, segments, scale, backend, kind):
        out = by_lse(query, key, value, sink_logit, segments, scale, backend, kind)
        with monkeypatch.context() as m:
            m.setitem(attention_sinks_magi2.SINK_ATTENTION_PATHS, "native", "padded")
            padded = magi2_attention_with_sinks(query, key, value, sink_logit[None], segments, scale, backend)
        errors.append((out.double() - padded.double()).abs().max().item())
        return out

    monkeypatch.setattr(attention_sinks_magi2, "_attention_with_sinks_by_lse", compared)
    lse = {p: _forward(model, d, p) for p in prefixes}
    monkeypatch.setattr(attention_sinks_magi2, "_attention_with_sinks_by_lse", by_lse)
    assert len(errors) >= len(prefixes) * len(model.transformer_blocks)
    if dtype == torch.float32:  # attention runs in fp32 on CPU in both precisions (upcast_off_cuda)
        assert max(errors) <= 1e-6, max(errors)
    monkeypatch.setitem(attention_sinks_magi2.SINK_ATTENTION_PATHS, "native", "padded")
    assert sink_attention_path(None, torch.device("cpu"), dtype, False) == "padded"
    for p in prefixes:
        padded = _forward(model, d, p)
        ref = d[p + "model.out"]
        if dtype == torch.float32:  # per-call rounding (~1e-7) compounds over the layers: rel-L2 ~8e-7 measured
            assert _rel_l2(lse[p], padded) <= 2e-6, (p, _rel_l2(lse[p], padded))
            assert _rel_l2(lse[p], ref) <= 1e-5, (p, _rel_l2(lse[p], ref))
        else:  # bf16 layers amplify a flipped rounding: 0 (t2v) and 1.6e-2 (h4 i2v) measured
            assert _rel_l2(lse[p], padded) <= 5e-2, (p, _rel_l2(lse[p], padded))
            assert _rel_l2(lse[p], ref) <= 0.15, (p, _rel_l2(lse[p], ref))


def test_backend_sees_the_unpadded_head_dim(fixtures_dir, monkeypatch):
    model = _model(str(fixtures_dir), "preview_h4", torch.float32)
    d = load_file(f"{fixtures_dir}/magi2_tiny/preview_h4/fp32/transformer_case.safetensors")
    head_dim = model.config.attention_head_dim
    with _RecordCpuFlash() as rec:
        _forward(model, d, "")
    assert len(rec.head_dims) >= len(model.transformer_blocks)
    assert set(rec.head_dims) == {head_dim}
    monkeypatch.setitem(attention_sinks_magi2.SINK_ATTENTION_PATHS, "native", "padded")
    with _RecordCpuFlash() as rec:
        _forward(model, d, "")
    assert set(rec.head_dims) == {head_dim + 8}  # the padded path, for contrast


def _inputs(dtype=torch.float64, requires_grad=False, num_sinks=2):
    g = torch.Generator().manual_seed(5)
    n, hq, hkv, d = 13, 4, 2, 16
    q, k, v = (torch.randn(n, h, d, generator=g, dtype=dtype) for h in (hq, hkv, hkv))
    sinks = torch.randn(num_sinks, hq, generator=g, dtype=dtype) * 2
    leaves = [t.requires_grad_(requires_grad) for t in (q, k, v, sinks)]
    return leaves, [5, 0, 8], d**-0.5


def _explicit_attention_with_sinks(q, k, v, sinks, segments, scale):
    """Each segment's softmax over its keys and the sink logit ``logsumexp_s sinks[s, h]`` (a zero value)."""
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    sink = torch.logsumexp(sinks, dim=0)  # [H]
    outs, start = [], 0
    for length in segments:
        qs, ks, vs = (t[start : start + length].transpose(0, 1) for t in (q, k, v))  # [H, L, D]
        logits = torch.cat([qs @ ks.transpose(1, 2) * scale, sink.view(-1, 1, 1).expand(-1, length, 1)], dim=-1)
        outs.append((torch.softmax(logits, dim=-1)[..., :length] @ vs).transpose(0, 1))
        start += length
    return torch.cat(outs, dim=0)


@pytest.mark.parametrize("num_sinks", [1, 2])
def test_gradients_with_sinks_equal_the_explicit_softmax_gradients(num_sinks):
    (q, k, v, sinks), segments, scale = _inputs(requires_grad=True, num_sinks=num_sinks)
    assert sink_attention_path(None, q.device, q.dtype, True) == "padded"  # the LSE kernels drop its gradient
    weights = torch.randn(q.shape, generator=torch.Generator().manual_seed(1), dtype=q.dtype)
    out = magi2_attention_with_sinks(q, k, v, sinks, segments, scale)
    grads = torch.autograd.grad((out * weights).sum(), (q, k, v, sinks))
    ref = _explicit_attention_with_sinks(q, k, v, sinks, segments, scale)
    expected = torch.autograd.grad((ref * weights).sum(), (q, k, v, sinks))
    for got, want, name in zip(grads, expected, "qkvs"):
        assert got.abs().max() > 0
        # the padded path carries the sink logit in fp32 (sinks are fp32 parameters): up to ~3e-7 measured
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0, msg=name)


def _fake_lse_backend(layout: str, seen: list):
    """A CPU stand-in for a flash-attn style backend: ``[B, S, H, D]`` in, ``(out, lse)`` with ``layout``."""

    def fn(query, key, value, scale=None, return_lse=False, **unused):
        seen.append(query.shape[-1])
        out, lse = CPU_FLASH(*(t.transpose(1, 2) for t in (query, key, value)), scale=scale)
        out = out.transpose(1, 2)
        return (out, lse if layout == "bhs" else lse.transpose(1, 2)) if return_lse else out

    return fn


@pytest.mark.parametrize("backend,layout", [("flash", "bhs"), ("_flash_3", "bsh")])
def test_dispatched_lse_backends_by_layout(monkeypatch, backend, layout):
    name = AttentionBackendName(backend)
    seen = []
    monkeypatch.setitem(_AttentionBackendRegistry._backends, name, _fake_lse_backend(layout, seen))
    (q, k, v, sinks), segments, scale = _inputs(torch.float32)
    assert sink_attention_path(backend, q.device, q.dtype, False) == f"lse_{layout}"
    got = magi2_attention_with_sinks(q, k, v, sinks, segments, scale, backend=backend)
    ref = magi2_attention_with_sinks(q, k, v, sinks, segments, scale, backend="_native_math")
    assert seen == [q.shape[-1]] * 2  # one call per non-empty segment, at the real head dim
    torch.testing.assert_close(got, ref, atol=1e-6, rtol=0)


def test_dispatched_backend_without_lse_raises(monkeypatch):
    seen = []
    fake = _fake_lse_backend("bhs", seen)
    monkeypatch.setitem(
        _AttentionBackendRegistry._backends, AttentionBackendName.FLASH, lambda **kw: fake(**{**kw, "return_lse": 0})
    )
    (q, k, v, sinks), segments, scale = _inputs(torch.float32)
    with pytest.raises(RuntimeError, match="returned no log-sum-exp"):
        magi2_attention_with_sinks(q, k, v, sinks, segments, scale, backend="flash")


def test_paths_per_backend_device_and_autograd():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert sink_attention_path("native", cpu, torch.float32, True) == "padded"  # the op drops the LSE gradient
    assert sink_attention_path("native", cuda, torch.bfloat16, False) == "aten_flash"
    assert sink_attention_path("native", cuda, torch.float32, False) == "aten_efficient"
    assert sink_attention_path("_native_cudnn", cuda, torch.bfloat16, False) == "aten_cudnn"
    assert sink_attention_path("_native_flash", cpu, torch.bfloat16, False) == "cpu_flash"
    assert sink_attention_path("flash", cuda, torch.bfloat16, False) == "lse_bhs"
    assert sink_attention_path("flash", cuda, torch.bfloat16, True) == "padded"  # kernels drop the LSE gradient
    for backend in ("_native_math", "xformers", "flex", "flash_varlen"):
        assert sink_attention_path(backend, cuda, torch.bfloat16, False) == "padded"


def test_backend_that_cannot_serve_sinks_raises_before_any_kernel(monkeypatch):
    (q, k, v, sinks), segments, scale = _inputs(torch.float32)
    calls = []
    monkeypatch.setitem(
        _AttentionBackendRegistry._backends,
        AttentionBackendName.SAGE_BLACKWELL_HUB,
        lambda **kw: calls.append(kw) or kw["query"],
    )
    with pytest.raises(ValueError, match="cannot serve attention sinks"):
        magi2_attention_with_sinks(q, k, v, sinks, segments, scale, backend="sage_blackwell_hub")
    assert calls == []
    magi2_attention_with_sinks(q, k, v, None, segments, scale, backend="sage_blackwell_hub")  # no sinks: its kernel
    assert len(calls) == 2


def test_each_head_is_bit_for_bit_that_of_the_whole_call():
    """A Ulysses rank attends a subset of the heads: each head's output must not depend on how many heads the call
    holds. The CPU flash op returns the LSE head-innermost; without a contiguous LSE the sink correction's ``exp``
    and ``logaddexp`` took the SIMD path for one head and the scalar path for several (last-bit differences)."""
    gen = torch.Generator().manual_seed(0)
    n, heads, d = 1024, 8, 32
    q, k, v = (torch.randn(n, heads, d, generator=gen) for _ in range(3))
    sinks = torch.randn(1, heads, generator=gen)
    segments = [600, 424]
    whole = magi2_attention_with_sinks(q, k, v, sinks, segments, d**-0.5)
    for lo, hi in [(h, h + 1) for h in range(heads)] + [(0, 4), (4, 8)]:
        part = magi2_attention_with_sinks(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], sinks[:, lo:hi], segments, d**-0.5)
        assert torch.equal(part, whole[:, lo:hi]), f"heads [{lo}, {hi})"
