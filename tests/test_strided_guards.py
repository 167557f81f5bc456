"""``as_strided`` / ``as_strided_scatter`` read the memory layout of the tensor they are
given: the derivative code is written for the layout seen at build time, and a guard line
(``fxad_expect_layout``) refuses, naming the user's line, a call whose tensor is laid out
otherwise (transposed, permuted, a view with a storage offset).  Every value that comes back
is checked against torch.autograd in float64."""
from __future__ import annotations

import pytest
import torch

import fxad
from fxad.eject import load
from fxad.errors import InputError

D = torch.float64


def _autograd(f, *xs):
    """(value, grads) of ``f`` by torch.autograd, the inputs kept with their layout."""
    leaves = [x.detach().requires_grad_() for x in xs]
    out = f(*leaves)
    return out.detach(), torch.autograd.grad(out, leaves)


def _close(got, want):
    v, gs = got
    rv, rgs = want
    assert torch.allclose(v, rv)
    assert len(gs) == len(rgs) and all(torch.allclose(a, b) for a, b in zip(gs, rgs))


def window(x):
    y = x.as_strided((3, 2), (1, 3), 1)  # the guarded line
    return (y * torch.arange(1.0, 7.0, dtype=D).reshape(3, 2)).sin().sum()


def window_of_product(x):
    return torch.as_strided(x * 2, (2, 2), (4, 1)).pow(2).sum()  # the guarded line


W = 2


def _chunk(h):
    """Longformer's ``_chunk``: overlapping windows of ``2 W`` positions, strides read from
    the tensor itself."""
    h = h.view(h.size(0), h.size(1) // (2 * W), 2 * W, h.size(2))
    size = list(h.size())
    size[1] = size[1] * 2 - 1
    stride = list(h.stride())
    stride[1] = stride[1] // 2
    return h.as_strided(size=size, stride=stride)  # the guarded line


def sliding_chunks(q, k):
    s = torch.einsum("bcxd,bcyd->bcxy", _chunk(q), _chunk(k))
    return (s.tanh() ** 2).sum()


def _transposed(shape):
    """A (B, T, D) tensor that is a transpose of a contiguous (T, B, D) one."""
    b, t, d = shape
    return torch.randn(t, b, d, dtype=D).transpose(0, 1)


@pytest.mark.parametrize("f", [window, window_of_product])
def test_as_strided_gradient_on_build_layout_matches_autograd(f):
    x = torch.randn(4, 4, dtype=D)
    _close(fxad.grad(f, x)(x), _autograd(f, x))


@pytest.mark.parametrize("f", [window, window_of_product])
def test_as_strided_refuses_a_transposed_input_naming_the_line(f):
    g = fxad.grad(f, torch.randn(4, 4, dtype=D))
    with pytest.raises(InputError, match=r"test_strided_guards\.py:\d+ .*the guarded line"
                       r".*stride \(1, 4\)"):
        g(torch.randn(4, 4, dtype=D).t())


def test_as_strided_refuses_a_view_with_a_storage_offset():
    g = fxad.grad(window, torch.randn(4, 4, dtype=D))
    base = torch.randn(20, dtype=D)
    with pytest.raises(InputError, match="storage offset 2"):
        g(base[2:18].view(4, 4))


def test_as_strided_built_on_a_transposed_input():
    x = torch.randn(4, 4, dtype=D).t()
    g = fxad.grad(window, x)
    _close(g(x), _autograd(window, x))
    other = torch.randn(4, 4, dtype=D).t()  # the same layout: accepted
    _close(g(other), _autograd(window, other))
    with pytest.raises(InputError, match=r"permute\(1, 0\)"):
        g(torch.randn(4, 4, dtype=D))


@pytest.mark.parametrize("build_on", ["contiguous", "transposed"])
def test_sliding_chunks_on_permuted_inputs(build_on):
    """Longformer's sliding chunks: built on one layout, right on that layout, refused on the
    other (eager reads the strides of the actual tensor, the code has them as constants)."""
    shape = (3, 8, 5)
    qt, kt = _transposed(shape), _transposed(shape)
    qc, kc = qt.contiguous(), kt.contiguous()
    (bq, bk), (oq, ok) = ((qc, kc), (qt, kt)) if build_on == "contiguous" else \
        ((qt, kt), (qc, kc))
    g = fxad.grad(sliding_chunks, bq, bk)
    _close(g(bq, bk), _autograd(sliding_chunks, bq, bk))
    # the layout read (`h.stride()`, fxad.capture.decisions.read_layout) is checked first
    with pytest.raises(InputError,
                       match=r"test_strided_guards\.py:\d+ .*(the guarded line|h\.stride\(\))"):
        g(oq, ok)


def test_as_strided_jvp_and_hvp_guarded():
    x = torch.randn(4, 4, dtype=D)
    t = torch.randn(4, 4, dtype=D)
    out, tan = fxad.jvp(window, x)(x, t)
    want, want_t = torch.func.jvp(window, (x,), (t,))
    assert torch.allclose(out, want) and torch.allclose(tan, want_t)
    grads, hvps = fxad.hvp(window, x)(x, t)
    _, want_h = torch.func.jvp(torch.func.grad(window), (x,), (t,))
    assert torch.allclose(hvps[0], want_h)
    xt = torch.randn(4, 4, dtype=D).t()
    with pytest.raises(InputError, match="the guarded line"):
        fxad.jvp(window, x)(xt, t)
    with pytest.raises(InputError, match="the guarded line"):
        fxad.hvp(window, x)(xt, t)


def test_as_strided_guard_in_compiled_training_step():
    class Windows(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(3, 2, dtype=D))

        def forward(self, x):
            return (x.as_strided((3, 2), (1, 3), 1) * self.w).sin().sum()  # the guarded line

    model = Windows()
    x = torch.randn(4, 4, dtype=D, requires_grad=True)
    m = fxad.compile(model, x)
    m(x).backward()
    got_w = model.w.grad.clone()
    model.w.grad = None
    xr = x.detach().requires_grad_()
    model(xr).backward()
    assert torch.allclose(x.grad, xr.grad) and torch.allclose(got_w, model.w.grad)
    with pytest.raises(InputError, match="the guarded line"):
        m(torch.randn(4, 4, dtype=D).t().requires_grad_())


def scatter_window(x, src):
    return torch.as_strided_scatter(x, src, (2, 2), (1, 2)).pow(2).sum()  # the guarded line


def test_as_strided_scatter_refuses_a_transposed_input():
    """``as_strided_scatter`` writes into a clone that keeps its input's strides, so the
    positions depend on the layout (not on the storage offset)."""
    x, src = torch.randn(3, 3, dtype=D), torch.randn(2, 2, dtype=D)
    g = fxad.grad(scatter_window, x, src)
    v, (dx, dsrc) = g(x, src)
    rv, (rx, rsrc) = _autograd(scatter_window, x, src)
    # PyTorch's own d_x for as_strided_scatter is the complement of the derivative (see
    # fxad.rules.views): compare the value and d_src with autograd, d_x with its formula
    assert torch.allclose(v, rv) and torch.allclose(dsrc, rsrc)
    mask = torch.ones(9, dtype=D).index_fill(0, torch.tensor([0, 2, 1, 3]), 0).view(3, 3)
    assert torch.allclose(dx, 2 * x * mask)
    base = torch.randn(10, dtype=D)
    v2, _ = g(base[1:].view(3, 3), src)  # a storage offset does not matter here
    assert torch.allclose(v2, scatter_window(base[1:].view(3, 3), src))
    with pytest.raises(InputError, match="the guarded line"):
        g(torch.randn(3, 3, dtype=D).t(), src)


def test_eject_with_layout_guard():
    x = torch.randn(4, 4, dtype=D)
    text = fxad.eject(window, x, kind="grad")
    assert "fxad_expect_layout(x" in text
    mod = load(text)
    _close(mod.grad(x), _autograd(window, x))
    with pytest.raises(InputError, match="the guarded line"):
        mod.grad(torch.randn(4, 4, dtype=D).t())


def attention(q, k, v):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v).pow(2).sum()  # guarded


def masked_attention(q, k, v, mask):
    return torch.nn.functional.scaled_dot_product_attention(  # the guarded line
        q, k, v, attn_mask=mask).pow(2).sum()


def _qkv(seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(2, 3, n, 4, dtype=D, generator=g) for n in (5, 6, 6))


def test_flash_attention_code_refuses_a_last_dimension_of_another_stride():
    """fxad.grad of attention calls PyTorch's CPU flash kernels (chosen for inputs of unit
    stride in the last dimension, as eager chooses them); the kernels compute garbage on any
    other stride, where eager takes its math path: the code refuses such a call."""
    q, k, v = _qkv()
    g = fxad.grad(attention, q, k, v)
    assert "_scaled_dot_product_flash_attention_for_cpu" in g.code
    _close(g(q, k, v), _autograd(attention, q, k, v))
    # other strides outside the last dimension: the kernels take them
    q2 = torch.randn(5, 2, 3, 4, dtype=D).permute(1, 2, 0, 3)
    _close(g(q2, k, v), _autograd(attention, q2, k, v))
    q3 = torch.randn(2, 3, 4, 5, dtype=D).transpose(-1, -2)
    with pytest.raises(InputError, match=r"test_strided_guards\.py:\d+ .*guarded.*stride \("):
        g(q3, k, v)


def test_flash_attention_with_mask_guards_q_k_v_not_the_mask():
    """The kernels take a mask of any strides (and compute the same), but not a key whose
    last dimension has another stride."""
    q, k, v = _qkv(1)
    mask = torch.randn(5, 6, dtype=D)
    with fxad.fused_kernels("all"):
        g = fxad.grad(masked_attention, q, k, v, mask, argnums=(0, 1, 2))
    assert "_scaled_dot_product_flash_attention_for_cpu" in g.code
    for m in (mask, torch.randn(6, 5, dtype=D).t()):
        got = g(q, k, v, m)
        want = _autograd(lambda q, k, v: masked_attention(q, k, v, m), q, k, v)
        _close((got[0], got[1][:3]), want)
    with pytest.raises(InputError, match="the guarded line"):
        g(q, torch.randn(2, 3, 4, 6, dtype=D).transpose(-1, -2), v, mask)
