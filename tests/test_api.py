"""Public API contract: return conventions, parameters, user rules, leaf modules, modes."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

import fxad


def test_vjp_function_convention_with_nonfloat_input():
    def f(x, idx, scale):
        return (x[idx] * scale).sin()

    x, idx = torch.randn(5, 3), torch.tensor([0, 4, 4])
    g = fxad.vjp(f, x, idx, 2.0)
    ct = torch.randn(3, 3)
    out, grads = g(x, idx, 2.0, ct)
    assert len(grads) == 3 and grads[1] is None and grads[2] is None
    xr = x.clone().requires_grad_()
    ref = f(xr, idx, 2.0)
    (ref_grad,) = torch.autograd.grad(ref, xr, ct)
    torch.testing.assert_close(out, ref.detach())
    torch.testing.assert_close(grads[0], ref_grad)


def test_module_param_grads_keyed_like_named_parameters():
    m = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    m[0].bias.requires_grad_(False)
    x = torch.randn(6, 3)
    g = fxad.vjp(m, x)
    out, (dx,), pg = g(x, torch.ones(6, 1))
    assert list(pg) == [n for n, p in m.named_parameters() if p.requires_grad]
    m(x).sum().backward()
    for n, p in m.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(pg[n], p.grad)


def test_unused_parameter_gets_zero_gradient():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Parameter(torch.randn(3))
            self.b = nn.Parameter(torch.randn(3))

        def forward(self, x):
            return (x * self.a).sum()

    value, _, pg = fxad.grad(M(), torch.randn(3))(torch.randn(3))
    assert set(pg) == {"a", "b"} and torch.equal(pg["b"], torch.zeros(3))


def test_grad_scalar_convention_and_error():
    g = fxad.grad(lambda x: (x ** 2).sum(), torch.randn(4))
    x = torch.randn(4)
    value, (dx,) = g(x)
    torch.testing.assert_close(dx, 2 * x)
    with pytest.raises(fxad.InputError, match="scalar"):
        fxad.grad(lambda x: x * 2, torch.randn(4))


def test_generated_code_sees_parameter_updates():
    class Loss(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 1)

        def forward(self, x):
            return self.lin(x).sum()

    loss = Loss()
    g = fxad.grad(loss, torch.randn(2, 3))
    x = torch.randn(2, 3)
    v1 = g(x)[0]
    with torch.no_grad():
        loss.lin.bias += 1.0
    v2 = g(x)[0]
    torch.testing.assert_close(v2 - v1, torch.tensor(2.0))


def test_generated_code_does_not_record_autograd():
    m = nn.Linear(3, 1)
    _, _, pg = fxad.vjp(m, torch.randn(2, 3))(torch.randn(2, 3), torch.ones(2, 1))
    assert not pg["weight"].requires_grad


def test_mode_warning_when_called_in_other_mode():
    m = nn.Sequential(nn.Linear(3, 3), nn.Dropout(0.0))
    g = fxad.vjp(m, torch.randn(2, 3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        g(torch.randn(2, 3), torch.ones(2, 3))
    m.eval()
    with pytest.warns(fxad.ModeWarning, match="training mode"):
        g(torch.randn(2, 3), torch.ones(2, 3))


def my_cube(x):
    return x * x * x


def twice(x):
    return x * 2


# keep these user functions as single graph nodes (FX leaf functions)
torch.fx.wrap("my_cube")
torch.fx.wrap("twice")


def test_register_user_rule_for_a_function():
    @fxad.register_vjp(my_cube)
    class CubeRule:
        """d/dx x^3 = 3 x^2 (textbook)."""

        def fwd(x):
            return my_cube(x), x

        def bwd(x, d_out):
            return (3 * x * x * d_out,)

    try:
        def f(x):
            return my_cube(x).sum()

        x = torch.randn(4, dtype=torch.float64)
        g = fxad.grad(f, x)
        assert "3 * x" in g.code  # the user's backward formula, not the traced body's
        torch.testing.assert_close(g(x)[1][0], 3 * x * x)
        fxad.check(f, x)
    finally:
        fxad.unregister(my_cube)


def test_duplicate_and_malformed_rules_raise():
    with pytest.raises(fxad.RuleError, match="already registered"):
        fxad.register_vjp(torch.sin, fwd=lambda x: (torch.sin(x), x), bwd=lambda a, d: (d,))
    with pytest.raises(fxad.RuleError, match="give both"):
        fxad.register_vjp(my_cube, fwd=lambda x: (x, x))
    with pytest.raises(fxad.RuleError, match=r"\(aux, d_out\)"):
        fxad.register_vjp(my_cube, fwd=lambda x: (x, x), bwd=lambda d: d)
    with pytest.raises(fxad.RuleError, match="class defining fwd and bwd"):
        fxad.register_vjp(my_cube)(object)


def test_leaf_module_with_user_rule():
    class Scale(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.tensor(3.0))

        def forward(self, x):
            return x * self.w

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.s = Scale()

        def forward(self, x):
            return self.s(x).sum()

    @fxad.register_vjp(Scale)
    class ScaleRule:
        """y = w x: d_x = w d, d_w = sum(x d)."""

        def fwd(mod, x):
            return mod(x), (x, mod.param("w"))

        def bwd(aux, d):
            x, w = aux
            return {"w": (x * d).sum()}, d * w

    try:
        net = Net()
        x = torch.randn(5)
        g = fxad.grad(net, x, leaf_modules=(Scale,))
        assert "self.s(x)" in g.code
        value, (dx,), pg = g(x)
        torch.testing.assert_close(dx, torch.full((5,), 3.0))
        torch.testing.assert_close(pg["s.w"], x.sum())
    finally:
        fxad.unregister(Scale)


def test_bad_rule_output_is_reported():
    fxad.register_vjp(twice, fwd=lambda x: (twice(x), None), bwd=lambda a, d: (d, d, d))
    try:
        with pytest.raises(fxad.RuleError, match="returned 3 cotangents"):
            fxad.vjp(lambda x: twice(x), torch.randn(3))
    finally:
        fxad.unregister(twice)


def test_checker_catches_a_wrong_rule():
    """Negative test: a deliberately wrong rule must make fxad.check fail."""
    fxad.register_vjp(twice, fwd=lambda x: (twice(x), None), bwd=lambda a, d: (3 * d,))
    try:
        with pytest.raises(fxad.CheckError, match="disagrees with torch.autograd"):
            fxad.check(lambda x: twice(x).sin(), torch.randn(3))
    finally:
        fxad.unregister(twice)


def test_grad_of_grad_through_fused_kernels_rebuilds_plain_formulas():
    import torch.nn.functional as F

    def f(x, w):
        return F.gelu(F.layer_norm(x, (4,), w)).pow(2).sum()

    x = torch.randn(3, 4, dtype=torch.float64)
    w = torch.randn(4, dtype=torch.float64)
    g = fxad.grad(f, x, w)
    assert "torch.ops.aten" in g.code  # first order uses the fused kernels
    h = fxad.vjp(g, x, w)
    ct = ((torch.ones((), dtype=torch.float64), (torch.zeros_like(x), torch.ones_like(w))))
    _, (hx, hw) = h(x, w, ct)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    gx, gw = torch.autograd.grad(f(xr, wr), (xr, wr), create_graph=True)
    rx, rw = torch.autograd.grad(f(xr, wr) + gw.sum(), (xr, wr))
    torch.testing.assert_close(hx, rx)
    torch.testing.assert_close(hw, rw)
