"""Unusual but legal inputs (issue: operator coverage, "bad input"): zero-size and 0-d
tensors, non-contiguous and broadcast (expanded) inputs, integer and boolean arguments mixed
with floats, in-place variants and ``out=``.  Each gives autograd's gradients or fxad's clear
error — never a silent wrong answer."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fxad

D = torch.float64


def _agree(f, *xs):
    """fxad's VJP equals autograd's for a random cotangent (floating inputs only)."""
    g = fxad.vjp(f, *xs)
    out = f(*xs)
    gen = torch.Generator().manual_seed(0)
    cot = torch.randn(out.shape, dtype=out.dtype, generator=gen)
    got_out, got = g(*xs, cot)[:2]
    torch.testing.assert_close(got_out, out)
    diff = [i for i, x in enumerate(xs) if x.is_floating_point()]
    req = [x.detach().clone().requires_grad_() if i in diff else x for i, x in enumerate(xs)]
    want = torch.autograd.grad(f(*req), [req[i] for i in diff], cot, allow_unused=True)
    for i, w in zip(diff, want):
        w = torch.zeros_like(xs[i]) if w is None else w
        torch.testing.assert_close(got[i], w)
        assert got[i].shape == xs[i].shape
    for i, x in enumerate(xs):
        if i not in diff:
            assert got[i] is None


FUNCS = {
    "sin": lambda x: torch.sin(x),
    "mul_sum": lambda x: (x * x).sum(-1) if x.dim() else x * x,
    "softmax": lambda x: torch.softmax(x, -1) if x.dim() else torch.softmax(x, 0),
    "index": lambda x: x[..., :1] * 2 if x.dim() else x * 2,
    "cat": lambda x: torch.cat([x, x.exp()], -1) if x.dim() else torch.stack([x, x.exp()]),
    "layer_norm": lambda x: F.layer_norm(x, x.shape[-1:]) if x.dim() else x.tanh(),
}
SHAPES = {
    "zero-size": lambda: torch.randn(0, 3, dtype=D),
    "zero-size last dim": lambda: torch.randn(3, 0, dtype=D),
    "0-d": lambda: torch.randn((), dtype=D),
    "non-contiguous": lambda: torch.randn(4, 3, dtype=D).t(),
    "strided": lambda: torch.randn(3, 8, dtype=D)[:, ::2],
    "broadcast view": lambda: torch.randn(1, 4, dtype=D).expand(3, 4),
}


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("fn", list(FUNCS))
def test_unusual_shapes_and_layouts(fn, shape):
    _agree(FUNCS[fn], SHAPES[shape]())


def test_matmul_and_conv_of_zero_size_and_noncontiguous():
    _agree(lambda a, b: a @ b, torch.randn(0, 3, dtype=D), torch.randn(3, 2, dtype=D))
    _agree(lambda a, b: a @ b, torch.randn(3, 4, dtype=D).t(), torch.randn(3, 2, dtype=D)[:, :1])
    _agree(lambda x, w: F.conv2d(x, w), torch.randn(0, 2, 5, 5, dtype=D),
           torch.randn(3, 2, 3, 3, dtype=D))
    x = torch.randn(2, 5, 5, 2, dtype=D).permute(0, 3, 1, 2)  # channels-last layout
    _agree(lambda x, w: F.conv2d(x, w), x, torch.randn(3, 2, 3, 3, dtype=D))


def test_integer_and_boolean_arguments_mixed_with_floats():
    x = torch.randn(3, 4, dtype=D)
    i = torch.randint(0, 5, (3, 4))
    b = torch.rand(3, 4) > 0.5
    _agree(lambda x, i: x * i + i, x, i)                    # int tensor promotes to float
    _agree(lambda x, b: x * b, x, b)                        # bool tensor
    _agree(lambda x, b: torch.where(b, x, 2), x, b)         # Python int in where
    _agree(lambda x: x + True, x)                           # Python bool
    _agree(lambda x, i: x.gather(1, i % 4), x, i)           # integer index tensor
    _agree(lambda i, x: i / 2 + x, i, x)                    # int tensor divided first


def test_inplace_variants_are_rewritten():
    x = torch.randn(3, 4, dtype=D)

    def f(x):
        y = x * 1.0
        y += x.sin()
        y.mul_(2)
        torch.relu_(y)
        y[0] = y[1] * 3
        return y

    def f_ref(x):  # the same values written out of place (autograd refuses f itself:
        y = torch.relu((x * 1.0 + x.sin()) * 2)  # relu_'s saved output is overwritten)
        return torch.cat([y[1:2] * 3, y[1:]])

    g = fxad.vjp(f, x)
    cot = torch.randn(3, 4, dtype=D)
    out, (d_x,) = g(x, cot)
    xr = x.clone().requires_grad_()
    want_out = f_ref(xr)
    torch.testing.assert_close(out, want_out.detach())
    torch.testing.assert_close(d_x, torch.autograd.grad(want_out, xr, cot)[0])


def test_out_argument_is_refused_clearly():
    x = torch.randn(3, dtype=D)

    def f(x):
        buf = torch.empty(3, dtype=D)
        torch.sin(x, out=buf)
        return buf

    with pytest.raises(fxad.InplaceError, match="out="):
        fxad.vjp(f, x)
