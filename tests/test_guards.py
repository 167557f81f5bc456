"""Guards and shape-generic code (issue: no silent wrong answer).  A generated module checks
what it specialized on at every call; dimensions marked ``dynamic=`` are read from the
inputs, verified at other sizes, and Python decisions on them are guarded."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

import fxad
from fxad.dynamic import DynamicWarning

D = torch.float64


def test_other_shape_is_refused_naming_the_argument():
    g = fxad.grad(lambda x: (x * 2).mean(), torch.randn(4))
    with pytest.raises(fxad.InputError, match=r"`x` has shape \(8,\).*traced for shape \(4,\)"):
        g(torch.randn(8))


def test_python_value_is_guarded():
    def f(x, flag):
        return x.sum() if flag else -x.sum()

    g = fxad.grad(f, torch.randn(3), True)
    g(torch.randn(3), True)
    with pytest.raises(fxad.InputError, match="`flag` is False.*traced with True"):
        g(torch.randn(3), False)


def test_loop_over_a_size_is_guarded():
    def f(x):
        s = 0
        for t in range(x.shape[0]):
            s = s + x[t].sin()
        return s.sum()

    g = fxad.grad(f, torch.randn(4, 3))
    with pytest.raises(fxad.InputError, match="shape"):
        g(torch.randn(6, 3))


def test_dtype_device_and_cotangent_are_guarded():
    g = fxad.vjp(lambda x: x * 2, torch.randn(3))
    with pytest.raises(fxad.InputError, match="dtype"):
        g(torch.randn(3, dtype=D), torch.randn(3, dtype=D))
    with pytest.raises(fxad.InputError, match="`cotangent` has shape"):
        g(torch.randn(3), torch.randn(()))
    j = fxad.jvp(lambda x: x * 2, torch.randn(3))
    with pytest.raises(fxad.InputError):
        j(torch.randn(5), torch.randn(5))


def test_module_batch_size_is_guarded():
    m = nn.Linear(3, 2)
    g = fxad.grad(lambda x: m(x).sum(), torch.randn(5, 3))
    with pytest.raises(fxad.InputError, match=r"`x` has shape \(6, 3\)"):
        g(torch.randn(6, 3))


def _gpt_like(x, w):
    B, T, C = x.shape
    h = (x.view(B * T, C) @ w).view(B, T, -1)
    pos = torch.arange(T, dtype=x.dtype) / T
    return (h.tanh() * pos[None, :, None]).mean()


@pytest.mark.parametrize("B,T", [(2, 5), (3, 7), (6, 9), (5, 11)])
def test_dynamic_dims_are_generic(B, T):
    x0, w = torch.randn(2, 5, 3, dtype=D), torch.randn(3, 4, dtype=D)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DynamicWarning)  # both dims must become generic
        g = fxad.grad(_gpt_like, x0, w, dynamic={"x": (0, 1)})
    assert "x_size_0 = x.size(0)" in g.code and "x_size_1 = x.size(1)" in g.code
    x = torch.randn(B, T, 3, dtype=D)
    value, (d_x, d_w) = g(x, w)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    want = torch.autograd.grad(_gpt_like(xr, wr), (xr, wr))
    torch.testing.assert_close(value, _gpt_like(x, w))
    torch.testing.assert_close(d_x, want[0])
    torch.testing.assert_close(d_w, want[1])
    with pytest.raises(fxad.InputError, match="verified for sizes >= "):
        g(torch.randn(1, T, 3, dtype=D), w)
    with pytest.raises(fxad.InputError, match="shape"):  # the static dimension stays guarded
        g(torch.randn(B, T, 4, dtype=D), torch.randn(4, 4, dtype=D))


def test_dynamic_true_marks_the_batch_dimension_of_a_module():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1)).double()
    g = fxad.grad(lambda x: m(x).pow(2).mean(), torch.randn(4, 3, dtype=D), dynamic=True)
    for n in (4, 9, 2):
        x = torch.randn(n, 3, dtype=D)
        xr = x.clone().requires_grad_()
        want = torch.autograd.grad(m(xr).pow(2).mean(), xr)[0]
        torch.testing.assert_close(g(x)[1][0], want)


def test_dims_the_program_ties_together_share_one_size():
    def f(x, y):
        return torch.cat([x, y], 1).sum()

    g = fxad.grad(f, torch.randn(4, 2, dtype=D), torch.randn(4, 3, dtype=D), dynamic=True)
    g(torch.randn(7, 2, dtype=D), torch.randn(7, 3, dtype=D))
    with pytest.raises(fxad.InputError, match="must agree"):
        g(torch.randn(7, 2, dtype=D), torch.randn(6, 3, dtype=D))


def test_loop_over_a_dynamic_size_stays_static_with_a_warning():
    def f(x):
        s = 0
        for t in range(x.shape[0]):
            s = s + x[t].sin()
        return s.sum()

    with pytest.warns(DynamicWarning, match="stays static"):
        g = fxad.grad(f, torch.randn(4, 3, dtype=D), dynamic=True)
    with pytest.raises(fxad.InputError):
        g(torch.randn(6, 3, dtype=D))


def test_branch_on_a_dynamic_size_is_guarded():
    def f(x):
        if x.shape[0] > 10:
            return x.sum()
        return (x * x.exp()).sum()

    g = fxad.grad(f, torch.randn(3, dtype=D), dynamic=True)
    assert "x_size_0" in g.code or "x.size(0)" in g.code or "expand" not in g.code
    for n in (3, 7, 10):
        x = torch.randn(n, dtype=D)
        xr = x.clone().requires_grad_()
        torch.testing.assert_close(g(x)[1][0], torch.autograd.grad(f(xr), xr)[0])
    with pytest.raises(fxad.InputError, match="<= 10"):
        g(torch.randn(12, dtype=D))


def test_dynamic_forward_mode():
    def f(x):
        return (x.softmax(-1) * torch.arange(x.shape[1], dtype=x.dtype)).sum(1)

    j = fxad.jvp(f, torch.randn(3, 5, dtype=D), dynamic={"x": 1})
    for T in (5, 9):
        x, t = torch.randn(3, T, dtype=D), torch.randn(3, T, dtype=D)
        torch.testing.assert_close(j(x, t)[1], torch.func.jvp(f, (x,), (t,))[1])


def test_bad_dynamic_specs_are_refused():
    x = torch.randn(3, 4)
    with pytest.raises(fxad.InputError, match="no such argument"):
        fxad.grad(lambda x: x.sum(), x, dynamic={"y": 0})
    with pytest.raises(fxad.InputError, match="no dimension 2"):
        fxad.grad(lambda x: x.sum(), x, dynamic={"x": 2})
    with pytest.raises(fxad.InputError, match="at least 2"):
        fxad.grad(lambda x: x.sum(), torch.randn(1, 4), dynamic={"x": 0})


def test_compile_retraces_on_a_guard_failure_with_a_cache():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 2)

        def forward(self, x, flag, extra):
            y = self.lin(x)
            y = y * extra["scale"]
            return (y.sum() if flag else y.pow(2).sum())

    torch.manual_seed(0)
    m, ref = M().double(), M().double()
    ref.load_state_dict(m.state_dict())
    cm = fxad.compile(m)
    calls = [(torch.randn(4, 3, dtype=D), True, {"scale": torch.tensor(2.0, dtype=D)}),
             (torch.randn(6, 3, dtype=D), True, {"scale": torch.tensor(3.0, dtype=D)}),
             (torch.randn(4, 3, dtype=D), False, {"scale": torch.tensor(2.0, dtype=D)}),
             (torch.randn(4, 3, dtype=D), True, {"scale": torch.tensor(5.0, dtype=D)})]
    for args in calls:
        m.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        cm(*args).backward()
        ref(*args).backward()
        for (n, p), q in zip(m.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=n)
    # a new shape and a new Python value re-traced; a new tensor *value* in a container did not
    assert len(cm._plans) == 3
