"""Half-precision matrix products of sizes that are not multiples of 8, padded in the code
built to run (:mod:`fxad.training.padding`).  The pass serves CUDA; here it is pointed at
the CPU (``PAD_DEVICE_TYPES``, ``MIN_MACS``) to check the rewrite: which products are
padded, that each padded operand is made once, and that values and gradients are those of
the unpadded code."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxad
from fxad.training import padding

BF16 = torch.bfloat16


@pytest.fixture
def pad_on_cpu(monkeypatch):
    monkeypatch.setattr(padding, "PAD_DEVICE_TYPES", ("cpu",))
    monkeypatch.setattr(padding, "MIN_MACS", 1)


class Head(nn.Module):
    """A linear layer and a tied output head (vocabulary 50, not a multiple of 8)."""

    def __init__(self, V=50, E=24, bias=True):
        super().__init__()
        self.emb = nn.Embedding(V, E)
        self.proj = nn.Linear(E, E, bias=bias)
        self.head = nn.Linear(E, V, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        h = torch.tanh(self.proj(self.emb(ids)))
        return F.cross_entropy(self.head(h).flatten(0, 1).float(), ids.flatten())


def _both(model, ids, autocast):
    out = []
    for m in (copy.deepcopy(model), fxad.compile(copy.deepcopy(model))):
        with torch.autocast("cpu", dtype=BF16, enabled=autocast):
            loss = m(ids)
        loss.backward()
        out.append((loss.detach(), [p.grad.clone() for p in m.parameters()], m))
    return out


def _lines(code, *names):
    return [ln.strip() for ln in code.splitlines()
            if not ln.strip().startswith("#") and any(k in ln for k in names)]


def test_unaligned_head_is_padded_and_matches(pad_on_cpu):
    torch.manual_seed(0)
    model, ids = Head(), torch.randint(0, 50, (4, 16))
    (ref_loss, ref, _), (loss, got, c) = _both(model, ids, autocast=True)
    torch.testing.assert_close(loss, ref_loss, rtol=2e-2, atol=2e-2)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=5e-2, atol=5e-3)
    fwd, bwd = c.fwd_gm.code, c.bwd_gm.code
    pads = _lines(fwd + bwd, "torch.nn.functional.pad(")
    # the head's weight (50 -> 56 rows) once for forward and backward; the head's
    # output cotangent (50 -> 56 columns) once for its two backward products
    assert len(pads) == 2, pads
    assert len(_lines(fwd, ".narrow(")) == 1
    assert len(_lines(bwd, ".narrow(")) == 1  # the weight gradient's 56 rows -> 50
    # the 24 x 24 projection (aligned? 24 = 3 * 8) is left alone
    assert all("proj" not in ln for ln in pads)


def test_float32_and_aligned_products_are_left_alone(pad_on_cpu):
    torch.manual_seed(0)
    ids = torch.randint(0, 48, (4, 16))
    for model, autocast in ((Head(), False), (Head(V=48), True)):
        (ref_loss, ref, _), (loss, got, c) = _both(model, ids, autocast)
        assert not _lines(c.fwd_gm.code + c.bwd_gm.code, "functional.pad(", ".narrow(")


def test_pass_values_equal_the_unpadded_product(pad_on_cpu):
    torch.manual_seed(0)
    a, b = torch.randn(13, 21, dtype=BF16), torch.randn(21, 10, dtype=BF16)
    bias = torch.randn(10, dtype=BF16)

    def f(a, b, bias):
        return torch.mm(a, b), torch.addmm(bias, a, b), F.linear(a, b.t(), bias), torch.mm(a.t(), a)

    gm = fxad.trace(f, a, b, bias)
    want = gm(a, b, bias)
    assert padding.pad_unaligned_matmuls(gm) == 4
    got = gm(a, b, bias)
    for x, y in zip(got, want):
        assert x.shape == y.shape
        torch.testing.assert_close(x, y, rtol=1e-2, atol=1e-2)
    assert "pad(" in gm.code and "narrow(" in gm.code


def test_a_returned_product_stays_contiguous(pad_on_cpu):
    """A padded product the program returns (logits) is handed back contiguous, as eager
    returns it, so that the caller's ``.view`` works."""
    torch.manual_seed(0)
    w = torch.randn(50, 24, dtype=BF16)

    def f(x, w):
        logits = F.linear(x, w)
        return logits, torch.tanh(logits).sum()

    x = torch.randn(4, 24, dtype=BF16)
    gm = fxad.trace(f, x, w)
    want = gm(x, w)
    assert padding.pad_unaligned_matmuls(gm) == 1
    logits, total = gm(x, w)
    assert logits.is_contiguous() and logits.view(-1).shape == (200,)
    torch.testing.assert_close(logits, want[0], rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(total, want[1], rtol=1e-2, atol=1e-1)
    assert "contiguous()" in gm.code and "tanh(narrow" in gm.code.replace(" ", "")
