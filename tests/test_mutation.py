"""Programs as PyTorch runs them: mutation through views and of inputs, captured as
PyTorch's functionalization defines it (issue: programs as PyTorch runs them).  Each program
is compared with eager autograd in float64 (value, input gradients, forward mode), in
fxad.compile and joint_step, and the input's own mutation is reflected."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fxad

D = torch.float64


def p_view_add(x):
    y = x * 2
    w = y.view(-1)
    w.add_(1.0)
    return y.sin()


def p_transpose_mul(x):
    y = x * 1
    y.t().mul_(2)
    return y * x


def p_column_iadd(x, v):
    y = x * 2.5
    y[:, 0] += v
    return y.cos()


def p_view_setitem(x):
    y = x + 0
    y.view(2, 6)[1] = y.view(2, 6)[0] * 3
    return y


def p_slices_and_diagonal(x):
    y = x.clone()
    a, b = y[:2], y[2:]
    b.mul_(2)
    y.diagonal().zero_()
    return y * a.sum()


def p_chain_of_views(x):
    y = x * 3
    z = y.unsqueeze(0).transpose(1, 2)[0, 1:]
    z.clamp_(min=-0.5)
    return (y ** 2).sum(0)


def p_select_and_narrow(x):
    y = x * 1.5
    r = y.select(1, 2)
    r.mul_(x[:, 0])
    y.narrow(0, 1, 2).add_(1.0)
    return y


def p_base_mutated_views_see_it(x):
    y = x * 1
    v = y[0]
    y.mul_(2)
    return v + y.sum()


def p_fill_copy(x):
    y = x * 1
    y[1].fill_(0.5)
    y[2].copy_(x[0] * 4)
    return y.tanh()


def p_mutates_input(x):
    x.mul_(2)
    x[0] = 0.0
    return x.sum(0) * 1


def p_mutates_input_view(x, v):
    x[:, 1].add_(v)
    return (x * x).sum()


def p_einsum_view_sees_its_operand_change(x):
    # torch.einsum returns a view of its operand for a permutation: the copy into the
    # operand changes the view (a program of the random-program fuzzer)
    y = x.square()
    t = torch.einsum("ij->ji", y)
    y.copy_(x * 3)
    return t * x.t()


def p_write_into_einsum_diagonal(x):
    y = x * 1
    torch.einsum("ii->i", y).mul_(2)  # the diagonal, a view of y
    return y.sin()


def p_write_into_broadcast_item(x, v):
    a, b = torch.broadcast_tensors(x * 1, v * 1)  # b views v * 1 (expanded: read only)
    c = v * 1
    _, d = torch.broadcast_tensors(x, c)
    c.add_(1.0)
    return a * b + d


PROGRAMS = [
    (p_einsum_view_sees_its_operand_change, [(3, 3)]),
    (p_write_into_einsum_diagonal, [(3, 3)]),
    (p_write_into_broadcast_item, [(4, 3), (3,)]),
    (p_view_add, [(4, 3)]), (p_transpose_mul, [(3, 3)]), (p_column_iadd, [(4, 3), (4,)]),
    (p_view_setitem, [(4, 3)]), (p_slices_and_diagonal, [(4, 4)]),
    (p_chain_of_views, [(4, 3)]), (p_select_and_narrow, [(3, 4)]),
    (p_base_mutated_views_see_it, [(3,)]), (p_fill_copy, [(4, 3)]),
    (p_mutates_input, [(4, 3)]), (p_mutates_input_view, [(4, 3), (4,)]),
]


def _inputs(shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, dtype=D, generator=g) for s in shapes]


@pytest.mark.parametrize("f,shapes", PROGRAMS, ids=[p[0].__name__ for p in PROGRAMS])
def test_reverse_mode_matches_autograd_and_input_mutation_is_reflected(f, shapes):
    xs = _inputs(shapes)
    g = fxad.vjp(f, *xs)
    eager_in = [x.clone() for x in xs]
    want_out = f(*eager_in)
    cot = torch.randn_like(want_out)
    fx_in = [x.clone() for x in xs]
    out, grads = g(*fx_in, cot)
    torch.testing.assert_close(out, want_out)
    for a, b in zip(fx_in, eager_in):  # the caller's tensors are mutated as in eager
        torch.testing.assert_close(a, b)
    req = [x.clone().requires_grad_() for x in xs]
    want = torch.autograd.grad(f(*[r * 1 for r in req]), req, cot, allow_unused=True)
    for got, w, x in zip(grads, want, xs):
        torch.testing.assert_close(got, torch.zeros_like(x) if w is None else w)


@pytest.mark.parametrize("f,shapes", PROGRAMS, ids=[p[0].__name__ for p in PROGRAMS])
def test_forward_mode_matches_torch_func(f, shapes):
    xs = _inputs(shapes)
    ts = _inputs(shapes, seed=1)
    j = fxad.jvp(f, *xs)
    out, t_out = j(*[x.clone() for x in xs], *ts)
    want_out, want_t = torch.func.jvp(lambda *a: f(*[v * 1 for v in a]), tuple(xs), tuple(ts))
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(t_out, want_t)


def test_check_passes_on_mutating_programs():
    for f, shapes in PROGRAMS[:6]:
        fxad.check(lambda *a, f=f: f(*[v * 1 for v in a]).sum(), *_inputs(shapes))


def test_generated_code_is_functional_and_names_the_inplace_line():
    x, v = _inputs([(4, 3), (4,)])
    code = fxad.grad(lambda x, v: p_column_iadd(x, v).sum(), x, v).code
    assert "# in place: y[:, 0] += v" in code
    assert "fxad_setitem(" in code and "add_(" not in code


def test_second_order_through_mutation():
    f = lambda x: p_chain_of_views(x).sum()  # noqa: E731
    x = _inputs([(4, 3)])[0]
    H = fxad.hessian(f, x)(x)
    torch.testing.assert_close(H, torch.autograd.functional.hessian(f, x))


class _Mutating(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = x * self.lin.bias          # reads x before its mutation
        x.mul_(2)                      # the input, mutated
        h = self.lin(x)
        h[:, 0] = h[:, 1] * 2          # through a view of an intermediate
        h.view(-1).mul_(1.5)
        return (h * h).sum() + (y ** 2).sum()


def test_compile_and_joint_step_with_mutation():
    torch.manual_seed(0)
    model = _Mutating().double()
    ref = _Mutating().double()
    ref.load_state_dict(model.state_dict())
    x = torch.randn(3, 4, dtype=D)
    for policy in ("save", "min_memory"):
        model.zero_grad(set_to_none=True)
        xa = x.clone()
        fxad.compile(model, policy=policy)(xa).backward()
        torch.testing.assert_close(xa, 2 * x)
        ref.zero_grad(set_to_none=True)
        # eager autograd refuses (x is saved, then mutated): the reference computes the same
        # function without the in-place write of the input
        xb = x.clone()
        y = xb * ref.lin.bias
        h = ref.lin(xb * 2)
        h = h.clone()
        h[:, 0] = h[:, 1] * 2
        h = h * 1.5
        ((h * h).sum() + (y ** 2).sum()).backward()
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=f"{policy}: {n}")
    step = fxad.joint_step(model, x.clone())
    xa = x.clone()
    loss, _, grads = step(xa)
    torch.testing.assert_close(xa, 2 * x)
    for n, q in zip(grads, ref.parameters()):
        torch.testing.assert_close(grads[n], q.grad, msg=n)


def test_inplace_on_a_multi_output_view_is_refused_as_pytorch_does():
    def f(x):
        y = x * 1
        a, b = y.chunk(2)
        b.mul_(2)  # eager: "Output 1 of SplitBackward0 is a view and is being modified inplace"
        return y

    with pytest.raises(fxad.InplaceError, match="PyTorch rejects"):
        fxad.vjp(f, torch.randn(4, 3, dtype=D))


def test_write_through_a_detached_alias_updates_the_value_not_the_derivative():
    # eager: the base sees the write (shared storage), its autograd history does not
    def f(x0):
        v0 = x0.square()
        v1 = v0.detach()
        v1 += x0
        return v0

    x = _inputs([(3,)])[0]
    out, (d_x,) = fxad.vjp(f, x)(x, torch.ones(3, dtype=D))
    xr = x.clone().requires_grad_()
    o = f(xr)
    torch.testing.assert_close(out, o)
    torch.testing.assert_close(d_x, torch.autograd.grad(o, xr, torch.ones(3, dtype=D))[0])


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_setitem_with_a_0d_boolean_mask(sign):
    def f(x0):
        v0 = x0 * 2
        v0[x0.sum() > 0] = 0.5
        return v0

    x = _inputs([(3,)])[0].abs() * sign
    g = fxad.vjp(f, _inputs([(3,)])[0])
    out, (d_x,) = g(x, torch.ones(3, dtype=D))
    xr = x.clone().requires_grad_()
    o = f(xr)
    torch.testing.assert_close(out, o)
    torch.testing.assert_close(d_x, torch.autograd.grad(o, xr, torch.ones(3, dtype=D))[0])


# -- out= ------------------------------------------------------------------------------------
def _written_under_no_grad(x, buf):
    y = torch.sin(x)
    with torch.no_grad():
        torch.mul(y, 2.0, out=buf)  # a buffer update, as eager allows it
    return (buf * x).sum() + y.sum()


def test_out_under_no_grad_writes_the_buffer_on_every_call():
    x = torch.randn(3, dtype=D)
    g = fxad.grad(_written_under_no_grad, x, torch.zeros(3, dtype=D))
    for seed in range(2):
        xs = torch.randn(3, dtype=D, generator=torch.Generator().manual_seed(seed))
        buf, ref_buf = torch.zeros(3, dtype=D), torch.zeros(3, dtype=D)
        value, (dx, _) = g(xs, buf)
        xr = xs.clone().requires_grad_()
        ref = _written_under_no_grad(xr, ref_buf)
        torch.testing.assert_close(value, ref.detach())
        torch.testing.assert_close(dx, torch.autograd.grad(ref, xr)[0])
        torch.testing.assert_close(buf, ref_buf)


def test_spectral_norm_trains_like_eager():
    import copy

    from torch.nn.utils.parametrizations import spectral_norm
    torch.manual_seed(0)
    m = nn.Sequential(spectral_norm(nn.Linear(4, 3)), nn.Tanh()).double()
    ref = copy.deepcopy(m)
    x = torch.randn(5, 4, dtype=D)
    cm = fxad.compile(m, x)
    for _ in range(3):  # its power iteration updates the buffers _u, _v in place (out=)
        m.zero_grad()
        ref.zero_grad()
        cm(x).pow(2).sum().backward()
        ref(x).pow(2).sum().backward()
        for p, q in zip(m.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad)
        for b, c in zip(m.buffers(), ref.buffers()):
            torch.testing.assert_close(b, c)


def test_out_of_another_shape_or_a_narrower_dtype_is_refused():
    def resized(x):
        with torch.no_grad():
            buf = torch.empty(2, dtype=D)
            torch.sin(x, out=buf)
        return x.sum() * buf.sum()

    with pytest.raises(fxad.InplaceError, match="another shape"):
        fxad.grad(resized, torch.randn(3, dtype=D))

    def narrowed(x):
        with torch.no_grad():
            buf = torch.zeros(3, dtype=torch.long)
            torch.add(x, x, out=buf)
        return x.sum() * buf.sum()

    with pytest.raises(RuntimeError, match="can't be cast to the desired output type"):
        fxad.grad(narrowed, torch.randn(3, dtype=D))
