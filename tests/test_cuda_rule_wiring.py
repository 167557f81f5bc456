"""The CUDA attention rules' generated code, run without a GPU: PyTorch's CUDA flash and
memory-efficient attention ops get CPU implementations for the test (each computed by
PyTorch's math attention and autograd, with the CUDA kernels' signatures and output
shapes), and the rules treat the CPU as a CUDA device.  What this checks is the wiring:
which kernel a call selects, argument order, the outputs saved for the backward kernels,
the causal-mask rewrite of :mod:`fxad.training.masks` on these kernels and before
differentiation; the kernels themselves are checked against eager on a GPU in
``tests/test_cuda.py``."""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxad
from fxad.rules.nn import attention

aten = torch.ops.aten


def _scores(q, k, bias, is_causal, scale):
    """Attention logits in float32 (the kernels' accumulation) and the scale."""
    sc = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = (q.float() @ k.float().mT) * sc
    if bias is not None:
        s = s + bias.float()
    if is_causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return s, sc


def _reference(q, k, v, bias, is_causal, scale):
    """Math attention: output (in q's dtype) and logsumexp (float32)."""
    s, _ = _scores(q, k, bias, is_causal, scale)
    return (torch.softmax(s, -1) @ v.float()).to(q.dtype), torch.logsumexp(s, -1)


def _grads(grad, q, k, v, bias, is_causal, scale):
    """The closed-form attention backward (no autograd: the kernels run below it)."""
    s, sc = _scores(q, k, bias, is_causal, scale)
    p, g = torch.softmax(s, -1), grad.float()
    d_v = p.mT @ g
    dp = g @ v.float().mT
    ds = p * (dp - (dp * p).sum(-1, keepdim=True))
    d_q, d_k = (ds @ k.float()) * sc, (ds.mT @ q.float()) * sc
    return tuple(t.to(q.dtype) for t in (d_q, d_k, d_v))


def efficient(q, k, v, bias, compute_lse, dropout_p=0.0, is_causal=False, *, scale=None):
    assert dropout_p == 0.0 and compute_lse
    out, lse = _reference(q, k, v, bias, is_causal, scale)
    L = lse.shape[-1]
    lse = F.pad(lse, (0, math.ceil(L / 32) * 32 - L))
    seed, offset = torch.zeros((), dtype=torch.int64), torch.zeros((), dtype=torch.int64)
    return out, lse, seed, offset


def efficient_backward(grad, q, k, v, bias, out, lse, seed, offset, dropout_p, mask,
                       is_causal=False, *, scale=None):
    assert not mask[3]
    return (*_grads(grad, q, k, v, bias, is_causal, scale), torch.empty(0))


def flash(q, k, v, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
    assert dropout_p == 0.0 and not return_debug_mask
    assert q.dtype in (torch.float16, torch.bfloat16)
    out, lse = _reference(q, k, v, None, is_causal, scale)
    empty = torch.empty(0, dtype=torch.int32)
    return (out, lse, empty, empty, q.shape[-2], k.shape[-2],
            torch.zeros(2, dtype=torch.int64), torch.zeros((), dtype=torch.int64),
            torch.empty(0, dtype=q.dtype))


def flash_backward(grad, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, dropout_p,
                   is_causal, seed, offset, *, scale=None):
    assert (max_q, max_k) == (q.shape[-2], k.shape[-2])
    return _grads(grad, q, k, v, None, is_causal, scale)


@pytest.fixture
def cpu_as_cuda(monkeypatch):
    lib = torch.library.Library("aten", "IMPL")
    for name, fn in [("_scaled_dot_product_efficient_attention", efficient),
                     ("_scaled_dot_product_efficient_attention_backward", efficient_backward),
                     ("_scaled_dot_product_flash_attention", flash),
                     ("_scaled_dot_product_flash_attention_backward", flash_backward)]:
        lib.impl(name, fn, "CPU")
    monkeypatch.setattr(attention, "CUDA_DEVICE_TYPES", ("cpu",))
    # eager's choice on a GPU is not known here: the rules' own conditions decide
    monkeypatch.setattr(attention, "_eager_choice", lambda *a: -1)
    monkeypatch.setattr(attention, "_capability", lambda device: (9, 0))
    monkeypatch.setattr(attention, "_cpu_flash_shapes_ok", lambda *a: False)
    yield
    lib._destroy()


class Attend(nn.Module):
    def __init__(self, mask=None, causal=False, E=16, H=2, dtype=torch.float32):
        super().__init__()
        self.H, self.mask, self.causal = H, mask, causal
        self.qkv = nn.Linear(E, 3 * E, dtype=dtype)

    def forward(self, x):
        B, L, E = x.shape
        q, k, v = (t.view(B, L, self.H, E // self.H).transpose(1, 2)
                   for t in self.qkv(x).chunk(3, -1))
        mask = self.mask(L) if callable(self.mask) else self.mask
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=self.causal)
        return y.float().pow(2).mean()


def _causal(L):  # built in the forward from constants, as transformers builds it
    return torch.ones(L, L, dtype=torch.bool).tril()


def _compare(model, x, tol, autocast=None):
    ref_m, c = copy.deepcopy(model), fxad.compile(copy.deepcopy(model))
    results = []
    for m in (ref_m, c):
        with torch.autocast("cpu", dtype=autocast or torch.bfloat16,
                            enabled=autocast is not None):
            loss = m(x)
        loss.backward()
        results.append((loss.detach(), [p.grad for p in m.parameters()]))
    (ref_loss, ref), (loss, got) = results
    torch.testing.assert_close(loss, ref_loss, **tol)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, **tol)
    return c.fwd_gm.code, c.bwd_gm.code


def _calls(code, kernel):
    return [ln.strip() for ln in code.splitlines()
            if f"aten.{kernel}(" in ln or f"aten.{kernel}.default(" in ln]


def _causal_flag(line):
    """The kernel call on ``line`` passes ``is_causal=True`` (by keyword, or positionally
    after the backward's ``grad_input_mask``)."""
    return "is_causal = True" in line or "False], True)" in line


F32 = dict(rtol=1e-4, atol=1e-5)
HALF = dict(rtol=3e-2, atol=3e-3)


@pytest.mark.parametrize("causal", [False, True])
def test_no_mask_float32_calls_the_efficient_kernels(cpu_as_cuda, causal):
    torch.manual_seed(0)
    fwd, bwd = _compare(Attend(causal=causal), torch.randn(2, 20, 16), F32)
    (f,), (b,) = (_calls(fwd, "_scaled_dot_product_efficient_attention"),
                  _calls(bwd, "_scaled_dot_product_efficient_attention_backward"))
    for ln in (f, b):
        assert _causal_flag(ln) == causal, ln


def test_no_mask_bfloat16_calls_the_flash_kernels(cpu_as_cuda):
    torch.manual_seed(0)
    fwd, bwd = _compare(Attend(causal=True, dtype=torch.bfloat16),
                        torch.randn(2, 20, 16, dtype=torch.bfloat16), HALF)
    assert len(_calls(fwd, "_scaled_dot_product_flash_attention")) == 1
    assert len(_calls(bwd, "_scaled_dot_product_flash_attention_backward")) == 1
    assert not _calls(fwd, "_scaled_dot_product_efficient_attention")


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_mask_calls_the_efficient_kernels_with_a_padded_bias(cpu_as_cuda, kind):
    torch.manual_seed(0)
    L = 20  # not a multiple of 16: the bias is padded and sliced back
    mask = torch.rand(L, L) > 0.3 if kind == "bool" else torch.randn(1, 1, L, L)
    if kind == "bool":
        mask[:, 0] = True
    fwd, bwd = _compare(Attend(mask=mask), torch.randn(2, L, 16), F32)
    assert len(_calls(fwd, "_scaled_dot_product_efficient_attention")) == 1
    assert len(_calls(bwd, "_scaled_dot_product_efficient_attention_backward")) == 1
    assert "pad(" in fwd


def test_constant_causal_mask_becomes_the_flag_on_the_kernels(cpu_as_cuda):
    torch.manual_seed(0)
    L = 20
    fwd, bwd = _compare(Attend(mask=_causal),
                        torch.randn(2, L, 16), F32)
    calls = (_calls(fwd, "_scaled_dot_product_efficient_attention")
             + _calls(bwd, "_scaled_dot_product_efficient_attention_backward"))
    assert len(calls) == 2 and "tril" not in fwd and "pad(" not in fwd, fwd
    for ln in calls:
        assert _causal_flag(ln), ln


def test_causal_mask_under_autocast_is_rewritten_before_differentiation(cpu_as_cuda):
    """Under autocast the captured graph is rewritten first: the rule sees ``is_causal``
    without a mask and picks the flash kernels (bfloat16)."""
    torch.manual_seed(0)
    L = 20
    fwd, bwd = _compare(Attend(mask=_causal),
                        torch.randn(2, L, 16), HALF, autocast=torch.bfloat16)
    assert len(_calls(fwd, "_scaled_dot_product_flash_attention")) == 1
    assert len(_calls(bwd, "_scaled_dot_product_flash_attention_backward")) == 1


def test_flash_where_eager_picks_cudnn(cpu_as_cuda, monkeypatch):
    monkeypatch.setattr(attention, "_eager_choice", lambda *a: attention._CUDNN)
    torch.manual_seed(0)
    fwd, bwd = _compare(Attend(causal=True, dtype=torch.bfloat16),
                        torch.randn(2, 20, 16, dtype=torch.bfloat16), HALF)
    assert len(_calls(fwd, "_scaled_dot_product_flash_attention")) == 1
    assert len(_calls(bwd, "_scaled_dot_product_flash_attention_backward")) == 1
    assert "cudnn" not in fwd + bwd


def test_math_where_eager_picks_it(cpu_as_cuda, monkeypatch):
    monkeypatch.setattr(attention, "_eager_choice", lambda *a: 0)  # SDPBackend.MATH
    torch.manual_seed(0)
    fwd, bwd = _compare(Attend(causal=True), torch.randn(2, 20, 16), F32)
    assert "torch.ops.aten._scaled_dot_product" not in fwd + bwd
