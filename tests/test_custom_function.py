"""Custom ``torch.autograd.Function``: fxad uses its ``backward`` (and ``jvp``), captured as
code, never the derivative of its forward ops (issue: no silent wrong answer)."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
from torch.autograd.function import once_differentiable

import fxad

D = torch.float64


class StraightThrough(torch.autograd.Function):
    """round in the forward, identity in the backward."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x)

    @staticmethod
    def backward(ctx, g):
        return g


class ScaledPair(torch.autograd.Function):
    """Two outputs, saved tensors, a Python attribute, needs_input_grad and a non-tensor
    argument."""

    @staticmethod
    def forward(ctx, x, w, k):
        ctx.save_for_backward(x, w)
        ctx.k = k
        return x * w * k, x + w

    @staticmethod
    def backward(ctx, g1, g2):
        x, w = ctx.saved_tensors
        d_x = g1 * w * ctx.k + g2 * 1.5          # deliberately not the true derivative
        d_w = g1 * x * ctx.k + g2 if ctx.needs_input_grad[1] else None
        return d_x, d_w, None


class SetupStyle(torch.autograd.Function):
    """``setup_context`` style with a ``jvp`` and a tensor kept as a ctx attribute."""

    @staticmethod
    def forward(x, y):
        return torch.sin(x) * y

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, y = inputs
        ctx.cos_x = torch.cos(x)
        ctx.save_for_backward(torch.sin(x), y)
        ctx.save_for_forward(x, y)

    @staticmethod
    def backward(ctx, g):
        sin_x, y = ctx.saved_tensors
        return g * ctx.cos_x * y, g * sin_x

    @staticmethod
    def jvp(ctx, tx, ty):
        x, y = ctx.saved_tensors
        return tx * torch.cos(x) * y + ty * torch.sin(x)


class Cube(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x ** 3

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        x, = ctx.saved_tensors
        return 3 * x * x * g


def _autograd(f, *xs):
    req = [x.detach().clone().requires_grad_() for x in xs]
    return torch.autograd.grad(f(*req), req)


def test_straight_through_estimator_uses_the_backward():
    f = lambda x: (StraightThrough.apply(x * 2) ** 2).sum()  # noqa: E731
    x = torch.randn(5, dtype=D)
    g = fxad.grad(f, x)
    assert "fxad_autograd_function('StraightThrough'" in g.code
    assert "# backward of: " in g.code
    _, (d_x,) = g(x)
    torch.testing.assert_close(d_x, _autograd(f, x)[0])
    assert d_x.abs().sum() > 0  # the traced round would have given zeros


def test_saved_tensors_attributes_two_outputs():
    def f(x, w):
        a, b = ScaledPair.apply(x, w, 3.0)
        return (a.tanh() * b).sum()

    x, w = torch.randn(4, dtype=D), torch.randn(4, dtype=D)
    _, grads = fxad.grad(f, x, w)(x, w)
    for got, want in zip(grads, _autograd(f, x, w)):
        torch.testing.assert_close(got, want)


def test_setup_context_style_and_forward_mode_uses_jvp():
    f = lambda x, y: SetupStyle.apply(x, y)  # noqa: E731
    x, y = torch.randn(3, dtype=D), torch.randn(3, dtype=D)
    cot = torch.randn(3, dtype=D)
    _, grads = fxad.vjp(f, x, y)(x, y, cot)
    req = [x.clone().requires_grad_(), y.clone().requires_grad_()]
    want = torch.autograd.grad(f(*req), req, cot)
    for a, b in zip(grads, want):
        torch.testing.assert_close(a, b)
    tx, ty = torch.randn(3, dtype=D), torch.randn(3, dtype=D)
    j = fxad.jvp(f, x, y)
    _, t_out = j(x, y, tx, ty)
    _, t_ref = torch.func.jvp(f, (x, y), (tx, ty))
    torch.testing.assert_close(t_out, t_ref)


def test_forward_mode_without_jvp_transposes_the_backward():
    f = lambda x: StraightThrough.apply(x * 3) * 2  # noqa: E731
    x, t = torch.randn(4, dtype=D), torch.randn(4, dtype=D)
    _, t_out = fxad.jvp(f, x)(x, t)
    torch.testing.assert_close(t_out, 6 * t)


def test_compile_fills_weight_grad_through_custom_function():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 3)

        def forward(self, x):
            return StraightThrough.apply(self.lin(x)).pow(2).sum()

    torch.manual_seed(0)
    m, ref = M(), M()
    ref.load_state_dict(m.state_dict())
    x = torch.randn(5, 4)
    fxad.compile(m)(x).backward()
    ref(x).backward()
    assert m.lin.weight.grad is not None
    torch.testing.assert_close(m.lin.weight.grad, ref.lin.weight.grad)
    torch.testing.assert_close(m.lin.bias.grad, ref.lin.bias.grad)


def test_once_differentiable_first_order_works_second_order_raises():
    f = lambda x: Cube.apply(x).sum()  # noqa: E731
    x = torch.randn(3, dtype=D)
    _, (d_x,) = fxad.grad(f, x)(x)
    torch.testing.assert_close(d_x, 3 * x * x)
    with pytest.raises(fxad.FxadError, match="once_differentiable"):
        fxad.hessian(f, x)


def test_second_order_through_a_differentiable_backward():
    f = lambda x: SetupStyle.apply(x, x * 2).sum()  # noqa: E731
    x = torch.randn(3, dtype=D)
    H = fxad.hessian(f, x)(x)
    torch.testing.assert_close(H, torch.autograd.functional.hessian(f, x))


def test_wrong_gradient_count_is_a_clear_error():
    class Bad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, y):
            return x * y

        @staticmethod
        def backward(ctx, g):
            return g

    with pytest.raises(fxad.CaptureError, match="returned 1 gradient"):
        fxad.grad(lambda x, y: Bad.apply(x, y).sum(), torch.randn(2), torch.randn(2))


def test_generated_code_runs_after_to_folder(tmp_path):
    import subprocess
    import sys

    f = lambda x: (StraightThrough.apply(x * 2) ** 2).sum()  # noqa: E731
    x = torch.randn(5, dtype=D)
    g = fxad.grad(f, x)
    g.to_folder(tmp_path / "mod", "Mod")
    code = ("import torch, sys; sys.path.insert(0, %r); from mod import Mod; "
            "x = torch.arange(5, dtype=torch.float64); print(Mod()(x)[1][0].tolist())"
            % str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    want = _autograd(f, torch.arange(5, dtype=D))[0]
    assert [float(v) for v in out.strip()[1:-1].split(",")] == want.tolist()


# -- operators of other libraries: torch.library.custom_op with register_autograd ------------

@torch.library.custom_op("fxad_test_lib::blend", mutates_args=())
def _blend(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, k: float, *,
           scale: float = 1.0) -> torch.Tensor:
    return x * w * (k * scale) + s


@_blend.register_fake
def _(x, w, s, k, *, scale=1.0):
    return torch.empty_like(x)


def _blend_setup(ctx, inputs, keyword_only_inputs, output):
    x, w, s, k = inputs
    ctx.save_for_backward(x, w)
    ctx.k = k * keyword_only_inputs["scale"]


def _blend_backward(ctx, d):
    x, w = ctx.saved_tensors
    # deliberately not the true derivative in x: the registered formula must be the one used
    return d * w * ctx.k + d, d * x * ctx.k, d, None


_blend.register_autograd(_blend_backward, setup_context=_blend_setup)


@torch.library.custom_op("fxad_test_lib::pair", mutates_args=())
def _pair(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x.sin(), x.cos()


@_pair.register_fake
def _(x):
    return torch.empty_like(x), torch.empty_like(x)


def _pair_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _pair_backward(ctx, d_sin, d_cos):
    (x,) = ctx.saved_tensors
    return d_sin * x.cos() - d_cos * x.sin()


_pair.register_autograd(_pair_backward, setup_context=_pair_setup)


def _blended(x, w, s):
    a, b = torch.ops.fxad_test_lib.pair(x)
    return (torch.ops.fxad_test_lib.blend(a, w, s, 2.0, scale=0.5).tanh() * b).sum()


def test_library_op_backward_is_captured_as_code():
    """Another library's ``custom_op`` with ``register_autograd`` is differentiated by its
    own formula, written into the VJP code (no autograd fallback, no recomputed forward),
    as eager autograd does: Python floats (one keyword-only), two outputs."""
    x, w, s = (torch.randn(5, dtype=D) for _ in range(3))
    with warnings.catch_warnings():
        warnings.simplefilter("error", fxad.FallbackWarning)
        g = fxad.grad(_blended, x, w, s, argnums=(0, 1, 2))
    code = g.code
    assert "fxad_autograd_vjp" not in code
    assert code.count("torch.ops.fxad_test_lib.blend(") == 1  # the forward, once
    assert code.count("torch.ops.fxad_test_lib.pair(") == 1
    assert "ctx" not in code and "d * w" not in code  # the formula's ops, as code
    value, grads = g(x, w, s)
    req = [t.clone().requires_grad_() for t in (x, w, s)]
    ref = _blended(*req)
    ref.backward()
    torch.testing.assert_close(value, ref.detach())
    for got, r in zip(grads, req):
        torch.testing.assert_close(got, r.grad if r.grad is not None else torch.zeros_like(r))


def test_library_op_forward_mode_and_compile():
    x, w, s = (torch.randn(5, dtype=D) for _ in range(3))
    tx, tw, ts = (torch.randn(5, dtype=D) for _ in range(3))
    _, t_out = fxad.jvp(_blended, x, w, s)(x, w, s, tx, tw, ts)
    # forward mode transposes the registered backward: the JVP of the same (wrong) formula
    _, (gx, gw, gs) = fxad.grad(_blended, x, w, s, argnums=(0, 1, 2))(x, w, s)
    torch.testing.assert_close(t_out, (gx * tx).sum() + (gw * tw).sum() + (gs * ts).sum())

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(5, dtype=D))

        def forward(self, x, s):
            return _blended(x, self.w, s)

    m = M()
    ref = M()
    ref.load_state_dict(m.state_dict())
    fxad.compile(m)(x, s).backward()
    ref(x, s).backward()
    torch.testing.assert_close(m.w.grad, ref.w.grad)


def test_a_rule_registered_in_fxad_wins_over_the_library_formula():
    op = torch.ops.fxad_test_lib.pair

    def fwd(x):
        return op(x), x

    def bwd(x, d):
        d_sin, d_cos = d
        return (d_sin * 0 + d_cos * 0 + 7,)

    fxad.register_vjp(op, fwd, bwd, source="test: a deliberately wrong rule")
    try:
        x = torch.randn(3, dtype=D)
        g = fxad.grad(lambda x: sum(op(x)).sum(), x)
        assert "autograd_function" not in g.code
        torch.testing.assert_close(g(x)[1][0], torch.full_like(x, 7.0))
    finally:
        from fxad.rules.registry import unregister
        unregister(op)
