"""Python decisions on a tensor's memory layout (``x.is_contiguous()``, ``x.stride()``,
``x.storage_offset()``): answered as eager PyTorch does on the example, and the layout of each
input the tensor is computed from re-checked on every call (fxad.capture.decisions.read_layout,
guard question ``'layout'`` of fxad.guards.expect); fxad.compile rebuilds on a miss.
Values and gradients in float64 against eager PyTorch / torch.autograd."""
import linecache

import pytest
import torch
import torch.nn as nn

import fxad
from fxad.errors import DataDependentError

D = torch.float64


def _line(fn, text):
    """``test_layout_guards.py:N`` of the first line of ``fn`` (from its def on) with ``text``."""
    n = fn.__code__.co_firstlineno
    while text not in linecache.getline(fn.__code__.co_filename, n):
        n += 1
    return f"test_layout_guards.py:{n}"


def contiguous_choice(x):
    if x.is_contiguous():
        return (x * 5).sum()
    return (x * 7).sum()


def stride_number(x):
    return (x * x.stride(0)).sum()  # a stride used as a number


def intermediate_choice(x):
    y = x.transpose(0, 1)
    if y.is_contiguous():
        return (y * 3).sum()
    return (y.sin() * 2).sum()


def offset_choice(x):
    return (x * (1 + x.storage_offset())).sum()


def channels_last_choice(x):
    if x.is_contiguous(memory_format=torch.channels_last):
        return (x * 2).sum()
    return (x * x).sum()


def no_layout(x):
    return (x.sin() * 5).sum()


def _x():
    return torch.randn(4, 5, dtype=D)


def _autograd(f, x):
    x = x.detach().clone().requires_grad_()
    out = f(x)
    return out.detach(), torch.autograd.grad(out, x)[0]


def _check(g, f, x):
    value, (grad,) = g(x)[:2]
    want, want_grad = _autograd(f, x)
    torch.testing.assert_close(value, want)
    torch.testing.assert_close(grad, want_grad)


@pytest.mark.parametrize("f, text", [
    (contiguous_choice, "if x.is_contiguous():"),
    (stride_number, "x.stride(0)"),
    (intermediate_choice, "if y.is_contiguous():"),
])
def test_grad_guards_the_layout_and_names_the_line(f, text):
    x = _x()
    g = fxad.grad(f, x)
    _check(g, f, x)
    _check(g, f, x.clone())  # the same layout: no rebuild needed
    xt = _x().t().contiguous().t()  # (4, 5), transposed strides
    with pytest.raises(fxad.ValueGuardError) as e:
        g(xt)
    assert isinstance(e.value, fxad.InputError)
    assert _line(f, text) in str(e.value) and "(1, 4)" in str(e.value)
    _check(fxad.grad(f, xt), f, xt)  # built on that layout: eager's other answer


def test_eager_answers_differ_on_the_two_layouts():
    """The programs above really decide on the layout (else the tests could not fail)."""
    x = _x()
    xt = x.t().contiguous().t()
    for f in (contiguous_choice, stride_number, intermediate_choice):
        assert not torch.allclose(f(x), f(xt))


def test_vjp_and_jvp_guard_the_layout():
    x = _x()
    v = fxad.vjp(contiguous_choice, x)
    j = fxad.jvp(contiguous_choice, x)
    ct = torch.ones((), dtype=D)
    out, (gx,) = v(x, ct)[:2]
    torch.testing.assert_close(gx, torch.full_like(x, 5.0))
    out, tangent = j(x, torch.ones_like(x))
    torch.testing.assert_close(tangent, torch.tensor(5.0 * x.numel(), dtype=D))
    xt = x.t().contiguous().t()
    where = _line(contiguous_choice, "if x.is_contiguous():")
    with pytest.raises(fxad.ValueGuardError, match=where):
        v(xt, ct)
    with pytest.raises(fxad.ValueGuardError, match=where):
        j(xt, torch.ones_like(xt))


class _Wrap(nn.Module):
    def __init__(self, f):
        super().__init__()
        self.f = f
        self.scale = nn.Parameter(torch.ones((), dtype=D))

    def forward(self, x):
        return self.f(x * self.scale)


@pytest.mark.parametrize("f", [contiguous_choice, stride_number])
def test_compile_rebuilds_for_a_new_layout(f):
    m, ref = _Wrap(f), _Wrap(f)
    c = fxad.compile(m)
    x = _x()
    xt = x.t().contiguous().t()
    for inp in (x, xt, x, xt):
        a = inp.clone().requires_grad_() if inp.is_contiguous() else \
            inp.t().clone().t().requires_grad_()
        b = a.detach().t().contiguous().t() if not a.is_contiguous() else a.detach().clone()
        b.requires_grad_()
        assert a.stride() == inp.stride() and b.stride() == inp.stride()
        m.zero_grad()
        ref.zero_grad()
        out = c(a)
        out.backward()
        want = ref(b)
        want.backward()
        torch.testing.assert_close(out, want)
        torch.testing.assert_close(m.scale.grad, ref.scale.grad)
        torch.testing.assert_close(a.grad, b.grad)
    assert len(c.builds) == 2  # one per layout; the later calls reuse them
    assert "test_layout_guards.py:" in c.builds[1].reason


def test_refuse_names_the_line():
    with pytest.raises(DataDependentError) as e:
        fxad.grad(contiguous_choice, _x(), values="refuse")
    assert _line(contiguous_choice, "if x.is_contiguous():") in str(e.value)
    assert "layout" in str(e.value)


def test_storage_offset_and_channels_last():
    base = torch.randn(30, dtype=D)
    x = base[3:23].view(4, 5)  # storage offset 3
    g = fxad.grad(offset_choice, x)
    _check(g, offset_choice, x)  # built on the example's real offset (the fake has none)
    with pytest.raises(fxad.ValueGuardError, match="storage offset 3"):
        g(_x())
    _check(fxad.grad(offset_choice, _x()), offset_choice, _x())
    y = torch.randn(2, 3, 4, 5, dtype=D)
    ycl = y.contiguous(memory_format=torch.channels_last)
    g = fxad.grad(channels_last_choice, y)
    _check(g, channels_last_choice, y)
    with pytest.raises(fxad.ValueGuardError):
        g(ycl)
    _check(fxad.grad(channels_last_choice, ycl), channels_last_choice, ycl)


def test_non_dense_example_is_answered_as_eager():
    x = torch.randn(4, 10, dtype=D)[:, ::2]  # not dense: strides (10, 2)
    for f in (contiguous_choice, stride_number):
        g = fxad.grad(f, x)
        _check(g, f, x)
        assert "((10, 2), 0)" in g.code


def test_no_layout_read_no_guard():
    g = fxad.grad(no_layout, _x())
    assert "fxad_expect" not in g.code
    _check(g, no_layout, _x().t().contiguous().t())  # any layout: the same code serves


def test_layout_of_a_fresh_tensor_or_parameter_is_not_guarded():
    w = nn.Parameter(torch.randn(5, 4, dtype=D).t())

    def f(x):
        z = torch.zeros(4, 5, dtype=D)
        k = 2.0 if z.is_contiguous() and not w.is_contiguous() else 3.0
        return (x * w * k).sum()

    g = fxad.grad(f, _x())
    assert "fxad_expect" not in g.code
    xt = _x().t().contiguous().t()
    _check(g, f, xt)


def test_guard_once_per_input():
    def f(x):
        a = 1.0 if x.is_contiguous() else 2.0
        b = x.stride(0)
        return (x * a * b).sum()

    g = fxad.grad(f, _x())
    assert g.code.count("fxad_expect('layout'") == 1


def test_symbolic_build_guards_contiguity_for_every_size():
    g = fxad.grad(contiguous_choice, _x(), dynamic=True)
    assert "fxad_expect('layout', (x,), 'contiguous'" in g.code
    for n in (4, 7):
        x = torch.randn(n, 5, dtype=D)
        _check(g, contiguous_choice, x)
    with pytest.raises(fxad.ValueGuardError):
        g(torch.randn(5, 6, dtype=D).t())


def test_hvp_guards_the_layout():
    x = _x()
    h = fxad.hvp(intermediate_choice, x)
    v = torch.randn_like(x)
    hv = h(x, v)[1]
    hv = hv[0] if isinstance(hv, tuple) else hv
    torch.testing.assert_close(hv, torch.autograd.functional.hvp(intermediate_choice, x, v)[1])
    with pytest.raises(fxad.ValueGuardError, match="y.is_contiguous"):
        h(x.t().contiguous().t(), v)


def _scaled_by_layout(x):
    return x * 5 if x.is_contiguous() else x * 7


def cond_body_choice(x):
    y = x.sin()  # the body's operand is computed from x: the guard is on x, outside the cond
    return torch.cond(x.sum() > 0, _scaled_by_layout, lambda y: y * 1.0, (y,)).sum()


def test_layout_read_inside_a_cond_body_is_guarded_outside():
    x = _x().abs()
    g = fxad.grad(cond_body_choice, x)
    _check(g, cond_body_choice, x)
    assert g.code.count("fxad_expect('layout', (x,)") == 1
    xt = x.t().contiguous().t()
    with pytest.raises(fxad.ValueGuardError, match=_line(_scaled_by_layout, "is_contiguous")):
        g(xt)
    _check(fxad.grad(cond_body_choice, xt), cond_body_choice, xt)
