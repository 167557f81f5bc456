"""Constant causal attention masks run as ``is_causal=True`` (fxad.training.masks): the code
built to run drops the mask where its constant value is exactly the causal pattern, and
leaves every other mask; gradients equal autograd's in float64."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxad
from fxad.training import joint_step
from fxad.training.masks import causal_masks_as_flags, is_causal_pattern

D = torch.float64


class Attend(nn.Module):
    """q, k, v projections of x (L queries) and of x's first S rows (keys); attention with
    the mask ``make_mask(x)`` returns (built inside the forward, as transformers does)."""

    def __init__(self, make_mask, S=None, E=8):
        super().__init__()
        self.make_mask = make_mask
        self.S = S
        self.q, self.k, self.v = (nn.Linear(E, E, dtype=D) for _ in range(3))

    def forward(self, x):
        B, L, E = x.shape
        kv = x if self.S is None else x[:, :self.S]
        q = self.q(x).view(B, L, 2, E // 2).transpose(1, 2)
        k = self.k(kv).view(B, kv.shape[1], 2, E // 2).transpose(1, 2)
        v = self.v(kv).view(B, kv.shape[1], 2, E // 2).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=self.make_mask(x, L, kv.shape[1]))
        return (y * y).sum()


def bool_causal(x, L, S):
    # transformers' way: positions compared, broadcast over batch and heads
    i = torch.arange(L, device=x.device)[:, None]
    j = torch.arange(S, device=x.device)[None, :]
    return (j <= i)[None, None].expand(x.shape[0], 1, L, S)


def float_causal(x, L, S):
    allowed = torch.ones(L, S, dtype=torch.bool).tril()
    return torch.zeros(L, S, dtype=x.dtype).masked_fill(~allowed, float("-inf"))


def shifted(x, L, S):  # not causal: the diagonal masked too (row 0 keeps key 0)
    m = torch.ones(L, S, dtype=torch.bool).tril(-1)
    m[:, 0] = True
    return m


def bottom_right(x, L, S):  # causal aligned at the bottom right: not SDPA's is_causal
    return torch.ones(L, S, dtype=torch.bool).tril(S - L)


def large_negative(x, L, S):  # -1e9 instead of -inf: another function, left alone
    allowed = torch.ones(L, S, dtype=torch.bool).tril()
    return torch.zeros(L, S, dtype=x.dtype).masked_fill(~allowed, -1e9)


def from_input(x, L, S):  # depends on the input's values
    return (x[0, :, :1] > -10.0).expand(L, S) & torch.ones(L, S, dtype=torch.bool).tril()


def _grads(model, x):
    loss = model(x)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def _compiled(make_mask, S=None, L=6):
    torch.manual_seed(0)
    return _compiled_like_eager(Attend(make_mask, S), torch.randn(2, L, 8, dtype=D))


def _compiled_like_eager(m, x):
    """fxad.compile(m), after checking its loss and gradients at ``x`` against eager's."""
    ref_loss, ref = _grads(copy.deepcopy(m), x)
    c = fxad.compile(m)
    loss, got = _grads(c, x)
    torch.testing.assert_close(loss, ref_loss)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b)
    return c


def _kernel_calls(code):
    return [ln for ln in code.splitlines() if "_scaled_dot_product_flash_attention_for_cpu" in ln
            and not ln.lstrip().startswith("#")]


@pytest.mark.parametrize("make_mask", [bool_causal, float_causal])
@pytest.mark.parametrize("S", [None, 4])  # L = S, and L = 6 queries over S = 4 keys
def test_constant_causal_mask_runs_as_is_causal(make_mask, S):
    c = _compiled(make_mask, S)
    fwd, bwd = c.fwd_gm.code, c.bwd_gm.code
    calls = _kernel_calls(fwd) + _kernel_calls(bwd)
    assert len(calls) == 2
    for ln in calls:
        assert "attn_mask" not in ln and "True" in ln
    # the constant subgraph that built the mask is gone, nothing saved for it
    assert "arange" not in fwd and "tril" not in fwd and "masked_fill" not in fwd


@pytest.mark.parametrize("make_mask", [shifted, bottom_right, large_negative, from_input])
def test_other_masks_are_kept(make_mask):
    c = _compiled(make_mask, S=4 if make_mask is bottom_right else None)
    calls = _kernel_calls(c.fwd_gm.code) + _kernel_calls(c.bwd_gm.code)
    assert len(calls) == 2
    for ln in calls:
        assert "attn_mask" in ln and "True" not in ln


def test_readable_vjp_keeps_the_mask():
    torch.manual_seed(0)
    m = Attend(bool_causal)
    x = torch.randn(2, 6, 8, dtype=D)
    code = fxad.vjp(m, x).code
    assert "scaled_dot_product_attention" in code and "attn_mask" in code


def test_pattern_check():
    L, S = 3, 5
    causal = torch.ones(L, S, dtype=torch.bool).tril()
    q = (2, 4, L, 8)
    assert is_causal_pattern(causal, q, L, S)
    assert is_causal_pattern(causal[None, None].expand(2, 4, L, S), q, L, S)
    assert is_causal_pattern(torch.zeros(L, S).masked_fill(~causal, float("-inf")), q, L, S)
    assert not is_causal_pattern(~causal, q, L, S)
    assert not is_causal_pattern(torch.ones(L, S, dtype=torch.bool).tril(1), q, L, S)
    assert not is_causal_pattern(causal.float(), q, L, S)  # 1/0 is not 0/-inf
    assert not is_causal_pattern(causal[None, None].expand(3, 1, L, S), q, L, S)  # batch 3
    assert not is_causal_pattern(causal[None, None, None], q, L, S)  # more dims than q
    differ = causal[None].repeat(2, 1, 1)
    differ[1, 0, 1] = True
    assert not is_causal_pattern(differ[:, None], q, L, S)  # one batch row not causal


def test_mask_not_read_by_attention_alone_is_kept_for_its_other_reader():
    class Two(nn.Module):
        def forward(self, q, k, v):
            mask = torch.ones(4, 4, dtype=torch.bool).tril()
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            return (y * y).sum() + (q * mask).sum()

    q, k, v = (torch.randn(1, 2, 4, 4, dtype=D, requires_grad=True) for _ in range(3))
    ref = torch.autograd.grad(Two()(q, k, v), (q, k, v))
    c = fxad.compile(Two())
    loss = c(q, k, v)
    got = torch.autograd.grad(loss, (q, k, v))
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b)
    assert all("attn_mask" not in ln for ln in _kernel_calls(c.fwd_gm.code))
    assert "tril" in c.fwd_gm.code  # still read by the product


def test_joint_step_uncompiled_uses_is_causal():
    torch.manual_seed(0)
    m = Attend(bool_causal)
    x = torch.randn(2, 6, 8, dtype=D)
    _, ref = _grads(copy.deepcopy(m), x)
    step = joint_step(m, x, compile=False)
    loss, _, grads = step(x)
    for (name, _), r in zip(m.named_parameters(), ref):
        torch.testing.assert_close(grads[name], r)


def test_pass_counts_rewrites():
    m = Attend(bool_causal)
    x = torch.randn(2, 6, 8, dtype=D)
    gm = fxad.trace(m, x)
    assert causal_masks_as_flags(gm) == 1
    assert "is_causal = True" in gm.code and "arange" not in gm.code
    torch.testing.assert_close(gm(x), m(x))
    gm2 = fxad.trace(Attend(shifted), x)
    assert causal_masks_as_flags(gm2) == 0


def test_tiny_gpt2_runs_causal_and_matches_autograd():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=0,
        attn_implementation="sdpa")
    torch.manual_seed(0)

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = transformers.GPT2LMHeadModel(cfg).to(D)

        def forward(self, ids):
            return self.model(input_ids=ids, labels=ids).loss

    m = LM()
    c = _compiled_like_eager(m, torch.randint(0, 64, (2, 10)))
    calls = _kernel_calls(c.fwd_gm.code) + _kernel_calls(c.bwd_gm.code)
    assert len(calls) == 4
    assert all("attn_mask" not in ln and "True" in ln for ln in calls)
    assert "torch.where" not in c.fwd_gm.code and "cumsum" not in c.fwd_gm.code
