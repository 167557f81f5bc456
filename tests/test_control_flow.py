"""Data-dependent control flow as code: torch.cond and torch.while_loop (issue: programs as
PyTorch runs them).  One build is right for data that takes either branch and for any trip
count; both modes and second order are compared with autograd / finite differences."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fxad

D = torch.float64


def _w():
    return torch.linspace(-1.0, 1.5, 3, dtype=D)


def f_cond(x):
    w = _W
    y = x * 2
    out = torch.cond(y.sum() > 0, lambda a: (a.sin() * w).sum(), lambda a: (a.cos() + w).prod(),
                     (y,))
    return out * 3


_W = _w()


def h_loop(x):
    _, y = torch.while_loop(lambda i, y: i < 4, lambda i, y: (i + 1, torch.sin(y) * _W + y),
                            (torch.tensor(0), x))
    return y.sum()


def h_data_loop(x):
    # trip count decided by the data
    _, y = torch.while_loop(lambda i, y: y.abs().sum() < 30.0,
                            lambda i, y: (i + 1, y * 1.5 + 0.1), (torch.tensor(0), x))
    return (y ** 2).sum()


def h_data_loop_py(x):
    y = x
    while y.abs().sum() < 30.0:
        y = y * 1.5 + 0.1
    return (y ** 2).sum()


def h_loop_py(x):
    y = x
    for _ in range(4):
        y = torch.sin(y) * _W + y
    return y.sum()


def _autograd(f, x):
    xr = x.clone().requires_grad_()
    return torch.autograd.grad(f(xr), xr)[0]


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_cond_one_build_both_branches(sign):
    x0 = torch.rand(3, dtype=D) + 0.1
    g = fxad.grad(f_cond, x0)  # built on data that takes the true branch
    x = (torch.rand(3, dtype=D) + 0.1) * sign
    value, (d_x,) = g(x)
    torch.testing.assert_close(value, f_cond(x))
    torch.testing.assert_close(d_x, _autograd(f_cond, x))


def test_cond_generated_code_and_branch_derivatives():
    x = torch.rand(3, dtype=D)
    g = fxad.grad(f_cond, x)
    code = g.code
    assert "fxad_cond(gt, " in code and "_vjp_0" in code
    branch_vjp = next(m for n, m in g.named_children() if n.startswith("_fxad_true_branch_vjp"))
    assert "# backward of: " in branch_vjp.code  # each branch's derivative is readable code


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_cond_forward_mode(sign):
    x = (torch.rand(3, dtype=D) + 0.1) * sign
    j = fxad.jvp(f_cond, torch.rand(3, dtype=D))
    t = torch.randn(3, dtype=D)
    _, t_out = j(x, t)
    torch.testing.assert_close(t_out, (_autograd(f_cond, x) * t).sum())


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_second_order_through_cond(sign):
    x = (torch.rand(3, dtype=D) + 0.1) * sign
    H = fxad.hessian(f_cond, torch.rand(3, dtype=D))(x)
    # finite differences of autograd's gradient (eager double backward of torch.cond is not
    # available)
    eps = 1e-6
    cols = []
    for k in range(3):
        e = torch.zeros(3, dtype=D)
        e[k] = eps
        cols.append((_autograd(f_cond, x + e) - _autograd(f_cond, x - e)) / (2 * eps))
    torch.testing.assert_close(H, torch.stack(cols, 1), atol=1e-6, rtol=1e-6)


def test_check_on_control_flow():
    fxad.check(f_cond, torch.rand(3, dtype=D))
    fxad.check(f_cond, -torch.rand(3, dtype=D))
    fxad.check(h_loop, torch.randn(3, dtype=D))
    fxad.check(h_data_loop, torch.ones(3, dtype=D))
    fxad.check(f_cond, torch.rand(3), dtype=torch.float32)


@pytest.mark.parametrize("scale", [0.5, 2.0, 9.0])
def test_while_loop_any_trip_count(scale):
    g = fxad.grad(h_data_loop, torch.ones(3, dtype=D))
    x = torch.ones(3, dtype=D) * scale
    value, (d_x,) = g(x)
    torch.testing.assert_close(value, h_data_loop_py(x))
    torch.testing.assert_close(d_x, _autograd(h_data_loop_py, x))


def test_while_loop_forward_mode_and_lifted_parameter():
    x = torch.randn(3, dtype=D)
    j = fxad.jvp(h_loop, x)
    t = torch.randn(3, dtype=D)
    torch.testing.assert_close(j(x, t)[1], (_autograd(h_loop_py, x) * t).sum())

    class Loop(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)

        def forward(self, x):
            _, y = torch.while_loop(lambda i, y: i < 3,
                                    lambda i, y: (i + 1, torch.tanh(self.lin(y))),
                                    (torch.tensor(0), x))
            return y.sum()

    torch.manual_seed(0)
    m = Loop().double()
    value, _, grads = fxad.grad(m, x)(x)
    # reference: the loop unrolled in Python under autograd (eager torch.while_loop goes
    # through torch.compile, whose cached graphs gave wrong gradients in this session)
    y = x
    for _ in range(3):
        y = torch.tanh(m.lin(y))
    m.zero_grad()
    y.sum().backward()
    for n, p in m.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, msg=n)


def test_branches_with_different_shapes_are_refused():
    def f(x):
        return torch.cond(x.sum() > 0, lambda a: a.sum(), lambda a: a * 2, (x,))

    with pytest.raises(fxad.CaptureError, match="branches return different results"):
        fxad.trace(f, torch.randn(3))


def test_python_if_on_data_suggests_torch_cond():
    def f(x):
        if x.sum() > 0:
            return x
        return -x

    with pytest.raises(fxad.DataDependentError) as e:
        fxad.vjp(f, torch.randn(3), values="refuse")  # the default takes it and guards it
    assert "torch.cond(" in str(e.value) and "torch.where" in str(e.value)


def test_compile_trains_through_cond():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)

        def forward(self, x):
            return torch.cond(x.mean() > 0, lambda v: self.a(v), lambda v: self.b(v),
                              (x,)).pow(2).sum()

    torch.manual_seed(0)
    m, ref = M().double(), M().double()
    ref.load_state_dict(m.state_dict())
    cm = fxad.compile(m)
    for x in (torch.rand(4, 3, dtype=D), -torch.rand(4, 3, dtype=D)):
        m.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        cm(x).backward()
        (ref.a(x) if x.mean() > 0 else ref.b(x)).pow(2).sum().backward()
        for (n, p), q in zip(m.named_parameters(), ref.parameters()):
            if q.grad is None:
                assert p.grad is None or p.grad.abs().max() == 0
            else:
                torch.testing.assert_close(p.grad, q.grad, msg=n)


def test_scan_and_map_as_code():
    from torch._higher_order_ops.map import map as hop_map
    from torch._higher_order_ops.scan import scan

    W = torch.linspace(-0.5, 0.5, 9, dtype=D).reshape(3, 3)

    def f(init, xs):
        def comb(c, x):
            nc = torch.tanh(c @ W + x)
            return nc, nc * 2
        c, ys = scan(comb, init, xs)
        return c.sum() + (ys ** 2).sum()

    def f_py(init, xs):
        c, ys = init, []
        for i in range(xs.shape[0]):
            c = torch.tanh(c @ W + xs[i])
            ys.append(c * 2)
        return c.sum() + (torch.stack(ys) ** 2).sum()

    init, xs = torch.randn(3, dtype=D), torch.randn(5, 3, dtype=D)
    g = fxad.grad(f, init, xs)
    assert "fxad_scan(" in g.code and "fxad_scan_vjp(" in g.code
    value, (d_init, d_xs) = g(init, xs)
    ir, xr = init.clone().requires_grad_(), xs.clone().requires_grad_()
    want = torch.autograd.grad(f_py(ir, xr), (ir, xr))
    torch.testing.assert_close(value, f_py(init, xs))
    torch.testing.assert_close(d_init, want[0])
    torch.testing.assert_close(d_xs, want[1])
    ti, tx = torch.randn(3, dtype=D), torch.randn(5, 3, dtype=D)
    _, t_out = fxad.jvp(f, init, xs)(init, xs, ti, tx)
    torch.testing.assert_close(t_out, (want[0] * ti).sum() + (want[1] * tx).sum())

    def m(xs, w):
        return hop_map(lambda x, w: (x @ w).sin(), xs, w).sum()

    value, (d_xs, d_w) = fxad.grad(m, xs, W)(xs, W)
    xr, wr = xs.clone().requires_grad_(), W.clone().requires_grad_()
    want = torch.autograd.grad(torch.stack([(x @ wr).sin() for x in xr]).sum(), (xr, wr))
    torch.testing.assert_close(d_xs, want[0])
    torch.testing.assert_close(d_w, want[1])


def test_associative_scan_is_captured_as_a_scan():
    # torch._higher_order_ops.associative_scan (the path transformers' Mamba takes under
    # compilation): the inclusive scan of a linear recurrence, forward and reverse
    from torch._higher_order_ops.associative_scan import associative_scan

    def f(a, b):
        def combine(left, right):
            return left[0] * right[0], right[0] * left[1] + right[1]
        _, h = associative_scan(combine, (a, b), dim=1, combine_mode="generic")
        _, h_rev = associative_scan(combine, (a, b), dim=1, reverse=True,
                                    combine_mode="generic")
        return (h ** 2).sum() + (h_rev ** 3).sum()

    gen = torch.Generator().manual_seed(0)
    a = torch.rand(2, 5, 3, dtype=torch.float64, generator=gen)
    b = torch.randn(2, 5, 3, dtype=torch.float64, generator=gen)
    g = fxad.grad(f, a, b)
    assert "fxad_scan_vjp(" in g.code
    value, (d_a, d_b) = g(a, b)
    ra, rb = a.clone().requires_grad_(), b.clone().requires_grad_()
    ref = f(ra, rb)
    ref.backward()
    torch.testing.assert_close(value, ref.detach())
    torch.testing.assert_close(d_a, ra.grad)
    torch.testing.assert_close(d_b, rb.grad)
    ta, tb = torch.randn_like(a), torch.randn_like(b)
    _, t_out = fxad.jvp(f, a, b)(a, b, ta, tb)
    torch.testing.assert_close(t_out, torch.func.jvp(f, (a, b), (ta, tb))[1])


def test_scan_with_an_unused_output_has_zero_cotangents_for_it():
    # the scan's per-step output is never used: its cotangent is None, and the body's VJP
    # gets zeros for it instead of failing on None
    from torch._higher_order_ops.scan import scan

    def f(x, c0):
        def step(c, x_i):
            c = torch.sin(c) * x_i
            return c, c * 2
        c, _ = scan(step, c0, x)
        return c.sum()

    x = torch.randn(4, 3, dtype=torch.float64)
    c0 = torch.randn(3, dtype=torch.float64)
    value, (d_x, d_c0) = fxad.grad(f, x, c0)(x, c0)
    rx, rc = x.clone().requires_grad_(), c0.clone().requires_grad_()
    c = rc
    for i in range(4):
        c = torch.sin(c) * rx[i]
    c.sum().backward()
    torch.testing.assert_close(d_x, rx.grad)
    torch.testing.assert_close(d_c0, rc.grad)


def test_loop_body_updating_a_buffer_is_refused_naming_the_line():
    # PyTorch's own while_loop refuses the input mutation; the loop's derivative would also
    # run the body again and update the running statistics a second time
    class Loop(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.bn = torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)

        def forward(self, x):
            def cond_fn(i, h):
                return i < 3

            def body_fn(i, h):
                return i + 1, torch.tanh(self.bn(self.lin(h)))

            return torch.while_loop(cond_fn, body_fn, (torch.tensor(0), x))[1].sum()

    m = Loop().train()
    with pytest.raises(fxad.CaptureError, match=r"while_loop body updates a buffer in place"
                       r"(.|\n)*test_control_flow.py:\d+ in body_fn"):
        fxad.grad(m, torch.randn(5, 4))
    fxad.grad(m.eval(), torch.randn(5, 4))  # in eval mode the statistics are only read
