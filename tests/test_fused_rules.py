"""The run-form overloads of fused level "all" (code built to run: fxad.compile,
fxad.joint_step): CPU flash attention with a mask, tanh/sigmoid backward kernels, linear on a
flattened input.  Each against torch.autograd in float64 (values and every cotangent), the
kernel present at level "all" and absent from the readable code of the default level, and
the models' training steps through fxad.compile close to eager's in float32."""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxad

DT = torch.float64


def _rand(*shape, dtype=DT):
    return torch.randn(shape, dtype=dtype)


def _grads(f, xs, cot):
    """fxad.vjp's value and cotangents of the floating inputs."""
    g = fxad.vjp(f, *xs)
    out, grads = g(*xs, cot)[:2]
    return g.code, out, grads


def _autograd(f, xs, cot):
    req = [x.detach().clone().requires_grad_() if x.is_floating_point() else x for x in xs]
    out = f(*req)
    floats = [x for x in req if x.is_floating_point()]
    return out.detach(), torch.autograd.grad(out, floats, cot)


def _compare(f, xs, level="all"):
    torch.manual_seed(1)
    cot = torch.randn(f(*xs).shape, dtype=f(*xs).dtype)
    want_out, want = _autograd(f, xs, cot)
    with fxad.fused_kernels(level):
        code, out, grads = _grads(f, xs, cot)
    torch.testing.assert_close(out, want_out)
    got = [d for d, x in zip(grads, xs) if x.is_floating_point()]
    assert len(got) == len(want)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    return code


# --- attention with a mask ---------------------------------------------------------------------

def _keep(*shape):
    m = torch.rand(shape) > 0.4
    m[..., 0] = True
    return m


@pytest.mark.parametrize("mask_shape,kw", [
    ((2, 1, 4, 6), {}),
    ((4, 6), {"scale": 0.3}),
    ((2, 3, 4, 6), {}),
    ((3, 4, 6), {}),
])
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_sdpa_mask_uses_the_cpu_flash_kernels_and_matches_autograd(mask_shape, kw, kind):
    q, k, v = _rand(2, 3, 4, 5), _rand(2, 3, 6, 5), _rand(2, 3, 6, 5)
    m = _keep(*mask_shape)
    if kind == "float":
        m = torch.where(m, _rand(*mask_shape), torch.tensor(float("-inf"), dtype=DT))
    f = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=m, **kw)  # noqa: E731
    code = _compare(f, (q, k, v))
    assert "_scaled_dot_product_flash_attention_for_cpu_backward(" in code
    assert "attn_mask = " in code
    # the readable code of the default level keeps the formulas
    readable = _compare(f, (q, k, v), level=True)
    assert "_scaled_dot_product_flash_attention_for_cpu" not in readable
    assert "softmax" in readable


def test_sdpa_mask_with_causal():
    q, k, v = _rand(2, 3, 5, 4), _rand(2, 3, 5, 4), _rand(2, 3, 5, 4)
    m = _rand(5, 5)
    f = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=m,  # noqa: E731
                                                       is_causal=True)
    code = _compare(f, (q, k, v))
    assert "_scaled_dot_product_flash_attention_for_cpu_backward(" in code


@pytest.mark.parametrize("choice,flash_on,efficient_on,masked,want", [
    ("CUDNN_ATTENTION", True, True, False, "flash"),       # eager's cuDNN: flash computes it
    ("CUDNN_ATTENTION", False, False, False, "flash"),     # sdpa_kernel(CUDNN_ATTENTION)
    ("CUDNN_ATTENTION", False, True, False, "efficient"),  # flash switched off: respected
    ("CUDNN_ATTENTION", True, True, True, "efficient"),    # a mask: flash takes none
    ("CUDNN_ATTENTION", False, False, True, "efficient"),
    ("FLASH_ATTENTION", True, True, False, "flash"),
    ("EFFICIENT_ATTENTION", True, True, False, "efficient"),
    ("EFFICIENT_ATTENTION", True, True, True, "efficient"),
    ("EFFICIENT_ATTENTION", True, False, False, None),
    ("MATH", True, True, False, None),
    ("MATH", True, True, True, None),
])
def test_cuda_attention_kernel_choice(monkeypatch, choice, flash_on, efficient_on, masked,
                                      want):
    """Which CUDA kernel the attention rules call for eager's choice and the back-end
    switches (the decision alone, on meta tensors: the kernels are tested in test_cuda.py)."""
    from torch.nn.attention import SDPBackend

    from fxad.rules.nn import attention as A
    monkeypatch.setattr(A, "_cuda_shapes_ok", lambda *a: True)
    monkeypatch.setattr(A, "_eager_choice", lambda *a: int(getattr(SDPBackend, choice)))
    monkeypatch.setattr(A, "_capability", lambda device: (9, 0))
    monkeypatch.setattr(torch.backends.cuda, "flash_sdp_enabled", lambda: flash_on)
    monkeypatch.setattr(torch.backends.cuda, "mem_efficient_sdp_enabled", lambda: efficient_on)
    q = torch.empty(2, 4, 16, 64, dtype=torch.bfloat16, device="meta")
    mask = torch.empty(16, 16, dtype=torch.bool, device="meta") if masked else None
    assert A._cuda_kernel(q, q, q, mask, mask is None, None, False) == want


def test_sdpa_learned_float_mask_gets_its_cotangent():
    """A mask whose cotangent is needed (a learned bias) gets the math backward."""
    q, k, v, bias = _rand(2, 3, 4, 5), _rand(2, 3, 6, 5), _rand(2, 3, 6, 5), _rand(1, 3, 4, 6)
    f = lambda q, k, v, b: F.scaled_dot_product_attention(q, k, v, attn_mask=b)  # noqa: E731
    code = _compare(f, (q, k, v, bias))
    assert "_scaled_dot_product_flash_attention_for_cpu(" in code  # forward: the kernel
    assert "_scaled_dot_product_flash_attention_for_cpu_backward" not in code


def test_sdpa_learned_bias_parameter_through_compile():
    """A learned additive bias (T5's relative positions): the kernel's forward on the
    detached bias, the bias's gradient from the math backward, as autograd's."""
    class Biased(nn.Module):
        def __init__(self):
            super().__init__()
            self.bias = nn.Parameter(torch.randn(1, 3, 4, 6, dtype=DT))

        def forward(self, q, k, v):
            return (F.scaled_dot_product_attention(q, k, v, attn_mask=self.bias) ** 2).sum()

    q, k, v = _rand(2, 3, 4, 5), _rand(2, 3, 6, 5), _rand(2, 3, 6, 5)
    model = Biased()
    ref = copy.deepcopy(model)
    compiled = fxad.compile(model)
    assert "_scaled_dot_product_flash_attention_for_cpu(" in compiled.partition(q, k, v).fwd_gm.code
    compiled(q, k, v).backward()
    ref(q, k, v).backward()
    torch.testing.assert_close(model.bias.grad, ref.bias.grad)


def test_sdpa_fully_masked_rows_match_eager():
    """A query row with every key masked: eager's CPU flash attention gives 0 and zero
    cotangents; so does the run form (the formulas of the readable form give NaN there)."""
    q, k, v = _rand(2, 3, 4, 5), _rand(2, 3, 6, 5), _rand(2, 3, 6, 5)
    m = _keep(2, 1, 4, 6)
    m[0, 0, 1] = False
    f = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=m)  # noqa: E731
    _compare(f, (q, k, v))
    assert torch.equal(f(q, k, v)[0, :, 1], torch.zeros(3, 5, dtype=DT))


@pytest.mark.parametrize("level", [True, "all"])
def test_sdpa_kernel_refused_where_it_would_read_wrongly(level):
    """A strided last dimension (the CPU flash kernels read it as contiguous and give wrong
    numbers) and a value head size unlike the query's (they raise): the formulas instead."""
    q = _rand(2, 3, 5, 4).transpose(-1, -2)
    k, v = _rand(2, 3, 6, 5), _rand(2, 3, 6, 5)
    code = _compare(lambda q, k, v: F.scaled_dot_product_attention(q, k, v), (q, k, v), level)
    assert "_scaled_dot_product_flash_attention_for_cpu" not in code
    q, k, v = _rand(2, 3, 4, 5), _rand(2, 3, 6, 5), _rand(2, 3, 6, 3)
    m = _keep(4, 6)
    code = _compare(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=m),
                    (q, k, v), level)
    assert "_scaled_dot_product_flash_attention_for_cpu" not in code


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_mask_kernel_gradients_equal_autograd(dtype, kind, causal):
    """Eager autograd runs the same CPU flash kernels with a mask (in float64 too): the
    run form's value and cotangents equal autograd's to 1e-9 in float64, to float32
    rounding in float32, with and without is_causal, for a boolean and an additive mask."""
    torch.manual_seed(3)
    q, k, v = (_rand(2, 3, 6, 8, dtype=dtype) for _ in range(3))
    m = _keep(2, 1, 6, 6)
    if kind == "float":
        m = torch.where(m, _rand(2, 1, 6, 6, dtype=dtype), torch.tensor(float("-inf"),
                                                                        dtype=dtype))
    f = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=m,  # noqa: E731
                                                       is_causal=causal)
    cot = torch.randn(2, 3, 6, 8, dtype=dtype)
    want_out, want = _autograd(f, (q, k, v), cot)
    with fxad.fused_kernels("all"):
        code, out, got = _grads(f, (q, k, v), cot)
    assert "_scaled_dot_product_flash_attention_for_cpu_backward(" in code
    tol = {"atol": 1e-9, "rtol": 0.0} if dtype == torch.float64 else {}
    torch.testing.assert_close(out, want_out, **tol)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **tol)


def test_sdpa_mask_without_kernel_support_keeps_the_formulas(monkeypatch):
    """A torch whose CPU flash kernels take no ``attn_mask`` (read from their schemas):
    the run form writes the formulas, with autograd's gradients."""
    attention = pytest.importorskip("fxad.rules.nn.attention")
    monkeypatch.setattr(attention, "CPU_FLASH_TAKES_MASK", False)
    q, k, v = _rand(2, 3, 4, 5), _rand(2, 3, 6, 5), _rand(2, 3, 6, 5)
    m = _keep(2, 1, 4, 6)
    code = _compare(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=m),
                    (q, k, v))
    assert "_scaled_dot_product_flash_attention_for_cpu" not in code and "softmax" in code


def test_sdpa_mask_schema_is_read():
    attention = pytest.importorskip("fxad.rules.nn.attention")
    assert attention._takes_attn_mask("_scaled_dot_product_flash_attention_for_cpu") == any(
        a.name == "attn_mask" for a in
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default._schema.arguments)
    assert not attention._takes_attn_mask("no_such_kernel_here")


class _Dropped(nn.Module):
    def __init__(self, mask):
        super().__init__()
        self.mask = mask

    def forward(self, q, k, v):
        return (F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask, dropout_p=0.3)
                ** 2).sum()


def test_sdpa_mask_with_dropout_through_compile_draws_like_eager():
    """With dropout eager's CPU dispatch runs the math reference (no fused kernel); the run
    form writes the probabilities out and draws the same dropout mask from the same seed:
    the same loss and gradients in float64."""
    q, k, v = (_rand(2, 3, 5, 4).requires_grad_() for _ in range(3))
    m = _keep(5, 5)
    compiled = fxad.compile(_Dropped(m))
    code = compiled.partition(q, k, v).bwd_gm.code
    assert "_scaled_dot_product_flash_attention_for_cpu" not in code
    got, want = [], []
    for run, out in ((compiled, got), (_Dropped(m), want)):
        torch.manual_seed(11)
        loss = run(q, k, v)
        out.append(loss.detach())
        out.extend(torch.autograd.grad(loss, (q, k, v)))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=0.0)


# --- tanh, sigmoid -------------------------------------------------------------------------------

@pytest.mark.parametrize("op,kernel", [(torch.tanh, "tanh_backward"),
                                       (torch.sigmoid, "sigmoid_backward")])
def test_tanh_sigmoid_backward_kernels(op, kernel):
    x = _rand(3, 4)
    code = _compare(lambda x: op(x) * x, (x,))
    assert f"torch.ops.aten.{kernel}(" in code
    assert kernel not in _compare(lambda x: op(x) * x, (x,), level=True)


def test_tanh_complex_keeps_the_formula():
    x = torch.randn(3, 4, dtype=torch.complex128)
    with fxad.fused_kernels("all"):
        g = fxad.vjp(lambda x: torch.tanh(x), x)
    assert "tanh_backward" not in g.code
    cot = torch.randn(3, 4, dtype=torch.complex128)
    xr = x.clone().requires_grad_()
    want, = torch.autograd.grad(torch.tanh(xr), xr, cot)
    torch.testing.assert_close(g(x, cot)[1][0], want)


# --- linear on a flattened input -------------------------------------------------------------

@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_flat(transposed, bias):
    x = _rand(3, 2, 4).transpose(0, 1) if transposed else _rand(2, 3, 4)
    w, b = _rand(5, 4), _rand(5)
    if bias:
        f, xs = (lambda x, w, b: F.linear(x, w, b)), (x, w, b)
    else:
        f, xs = (lambda x, w: F.linear(x, w)), (x, w)
    code = _compare(f, xs)
    assert "torch.mm(" in code and "@" not in code
    assert "torch.mm(" not in _compare(f, xs, level=True)


# --- written-out formulas replaced by their kernel (fxad.rules.fused.fuse_formulas) -------------

def _gelu_new(x):
    inner = math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))
    return 0.5 * x * (1.0 + torch.tanh(inner))


def test_gelu_tanh_formula_becomes_the_kernel():
    x = _rand(3, 4)
    code = _compare(lambda x: _gelu_new(x) * x, (x,))
    assert "gelu(x, approximate = 'tanh')" in code and "gelu_backward" in code
    assert "tanh(" not in code.replace("approximate = 'tanh'", "")
    readable = _compare(lambda x: _gelu_new(x) * x, (x,), level=True)
    assert "gelu" not in readable and "torch.tanh(" in readable


def test_gelu_tanh_formula_operands_in_other_orders():
    x = _rand(3, 4)
    def f(x):
        return (x * 0.5) * (torch.tanh(((x ** 3) * 0.044715 + x) * math.sqrt(2 / math.pi)) + 1.0)
    assert "gelu(" in _compare(f, (x,))


def test_gelu_tanh_formula_with_an_intermediate_read_elsewhere():
    x = _rand(3, 4)

    def f(x):
        t = torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0)))
        return 0.5 * x * (1.0 + t) + t  # t is also read: it stays computed
    code = _compare(f, (x,))
    assert "gelu(" in code and "torch.tanh(" in code


@pytest.mark.parametrize("cast", ["float", "to"])
def test_gelu_tanh_formula_with_the_cube_upcast(cast):
    """CUDA autocast runs ``pow`` in float32 on a bfloat16 ``x`` (the cast explicit in the
    captured graph); type promotion takes the formula to float32: the kernel runs on the
    cast ``x`` and gives the formula's float32 values; its cotangent of ``x`` is rounded to
    bfloat16 once, where autograd rounds each path's share before summing them."""
    torch.manual_seed(0)
    x = torch.randn(64, 32, dtype=torch.bfloat16)

    def f(x):
        up = x.float() if cast == "float" else x.to(torch.float32)
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi)
                                           * (x + 0.044715 * torch.pow(up, 3.0))))
    with fxad.fused_kernels("all"):
        g = fxad.vjp(f, x)
    code = g.code
    assert "gelu(" in code and "gelu_backward" in code, code
    assert "tanh(" not in code.replace("approximate = 'tanh'", ""), code
    cot = torch.randn(64, 32)
    out, (d_x,) = g(x, cot)
    xr = x.clone().requires_grad_()
    want = f(xr)
    want_d, = torch.autograd.grad(want, xr, cot)
    assert out.dtype == torch.float32 and d_x.dtype == torch.bfloat16
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
    x64 = x.double().requires_grad_()  # the exact derivative, in float64
    exact, = torch.autograd.grad(F.gelu(x64, approximate="tanh"), x64, cot.double())
    ours, autograd = (d_x.double() - exact).abs(), (want_d.double() - exact).abs()
    assert (ours <= exact.abs() * 2.0 ** -8 + 1e-6).all()  # bfloat16's half ulp
    assert ours.max() <= autograd.max() and ours.sum() <= autograd.sum()


def test_gelu_tanh_formula_with_a_downcast_cube_is_kept():
    x = _rand(3, 4)

    def f(x):
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi)
                                           * (x + 0.044715 * torch.pow(x.float(), 3.0))))
    assert "gelu" not in _compare(f, (x,))


def test_other_constants_are_not_rewritten():
    x = _rand(3, 4)
    def f(x):
        return 0.5 * x * (1.0 + torch.tanh(0.8 * (x + 0.044715 * torch.pow(x, 3.0))))
    code = _compare(f, (x,))
    assert "gelu" not in code


# --- every row of a tensor read: the cotangent is one stack (fxad.training.passes) ------------

def _training_grads(f, x):
    from fxad.training.capture import _vjp_graph
    g = _vjp_graph(f, (x,), (0,), ())
    xr = x.detach().clone().requires_grad_()
    out = f(xr)
    out.backward()
    val, (d_x,) = g(x, torch.ones((), dtype=x.dtype))
    torch.testing.assert_close(val, out.detach())
    torch.testing.assert_close(d_x, xr.grad)
    return g.code


def test_rows_read_once_each_give_one_stack():
    def f(x):
        p = (x * 2).contiguous()
        q, k, v = p[0], p[1], p[2]
        return (q * k + v.sin()).sum()
    code = _training_grads(f, _rand(3, 4, 5))
    assert "torch.stack([" in code and "setitem" not in code and "zeros_like" not in code


def test_rows_not_all_read_keep_the_row_writes():
    def f(x):
        p = x * 2
        return (p[0] * p[2]).sum()  # row 1 unread: no stack
    code = _training_grads(f, _rand(3, 4))
    assert "torch.stack" not in code


def test_row_read_twice_or_with_another_term():
    def f(x):
        p = x * 2
        return (p[0] * p[1] + p[0] + p.sum(0)).sum()
    _training_grads(f, _rand(2, 3))


# --- work eager does not do (fxad.training.passes) ---------------------------------------------

def _compiled_step(model, *inputs):
    """fxad.compile's backward code for ``model``, after checking its loss and gradients
    against autograd's (float64, to 1e-9)."""
    ref = copy.deepcopy(model)
    compiled = fxad.compile(model)
    part = compiled.partition(*inputs)
    loss = compiled(*inputs)
    loss.backward()
    ref_loss = ref(*inputs)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, atol=1e-9, rtol=0.0)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-9, rtol=0.0, msg=name)
    return part


class _Head(nn.Module):
    """A layer norm, then a linear head on ``h[index]`` (ViT's first token, GPT-2's
    ``logits_to_keep`` slice), then a bias broadcast over the batch."""

    def __init__(self, index):
        super().__init__()
        self.index = index
        self.ln = nn.LayerNorm(8).double()
        self.lin = nn.Linear(8, 3).double()
        self.pos = nn.Parameter(torch.randn(1, 5, 8, dtype=DT))

    def forward(self, x):
        h = self.ln(x + self.pos)
        return (self.lin(h[self.index]) ** 2).sum()


def test_whole_slice_cotangent_is_the_cotangent():
    """``h[:, 0:]`` is ``h`` (eager's indexing returns it): no zero tensor, copy and write
    in the backward, and ``h`` is not saved for its shape."""
    x = _rand(2, 5, 8)
    part = _compiled_step(_Head((slice(None), slice(0, None))), x)
    code = part.bwd_gm.code
    assert "fxad_setitem" not in code and "zeros" not in code and "write_into" not in code


def test_selected_row_cotangent_written_into_fresh_zeros():
    """``h[:, 0]`` (ViT's classifier token): the cotangent's zero tensor is made from the
    static shape (``h`` not saved for it) and written in place, as autograd's
    SelectBackward does (no copy of the zeros)."""
    x = _rand(2, 5, 8)
    part = _compiled_step(_Head((slice(None), 0)), x)
    code = part.bwd_gm.code
    assert "fxad_write_into(" in code and "fxad_setitem" not in code
    assert "zeros_like" not in code and "torch.zeros((2, 5, 8)" in code


def test_broadcast_cotangents_are_one_sum():
    """A bias's and a broadcast parameter's cotangents: ``torch.sum`` over the broadcast
    dimensions (the kernel ``sum_to_size`` calls), not ``sum_to_size``."""
    x = _rand(2, 5, 8)
    part = _compiled_step(_Head((slice(None), 0)), x)
    code = part.bwd_gm.code
    assert "sum_to_size" not in code
    assert "keepdim = True" in code  # pos: (1, 5, 8) from (2, 5, 8)


class _Residual(nn.Module):
    """A linear layer on a 3-D activation beside a residual connection: the activation's
    cotangent is a sum with the linear layer's reshaped input cotangent."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8).double()
        self.w = nn.Parameter(torch.randn(8, dtype=DT))

    def forward(self, x):
        h = torch.tanh(x * self.w)
        return ((self.lin(h) + h) ** 2).sum()


def test_cotangent_sum_accumulates_into_the_reshaped_linear_cotangent():
    import re
    part = _compiled_step(_Residual(), _rand(2, 5, 8))
    code = part.bwd_gm.code
    assert re.search(r"= (reshape\w*)\.add_\(", code), code
    assert not re.search(r"= \w+ \+ \w+", code), code  # no out-of-place sum left


def test_whole_write_of_other_strides_stays():
    """The rules after a write were chosen for its result's layout: a cotangent of other
    strides keeps the write (which lays it out as the result)."""
    import torch.fx as fx
    from fxad import ops
    from fxad.training.passes import drop_whole_writes
    g = fx.Graph()
    x, d = g.placeholder("x"), g.placeholder("d")
    z = g.call_function(torch.zeros_like, (x,))
    w = g.call_function(ops.setitem, (z, (slice(None),), d))
    g.output(w)
    gm = fx.GraphModule(nn.Module(), g)
    for n in (x, z, w):
        n.meta["val"] = torch.empty(3, 4)
    d.meta["val"] = torch.empty(4, 3).t()
    assert drop_whole_writes(gm) == 0
    d.meta["val"] = torch.empty(3, 4)
    assert drop_whole_writes(gm) == 1
    dd = torch.randn(3, 4)
    assert gm(torch.randn(3, 4), dd) is dd


@pytest.mark.parametrize("index,whole", [
    ((slice(None),), True), ((slice(None), slice(0, None)), True), (Ellipsis, True),
    ((Ellipsis, slice(None, 9)), True), ((slice(-9, None), Ellipsis), True),
    ((slice(None, 4),), True), ((slice(1, None),), False), ((slice(None, 2),), False),
    ((slice(None, None, 2),), False), ((slice(None), 0), False), ((None,), False),
    ((Ellipsis, Ellipsis), False), ((slice(None),) * 4, False),
])
def test_selects_all(index, whole):
    from fxad.training.passes import _selects_all
    assert _selects_all(index, (3, 5, 7)) is whole
    x = torch.arange(105).reshape(3, 5, 7)
    if whole:  # what eager indexing gives: every element, in place
        assert x[index].shape == x.shape and torch.equal(x[index], x)


def _aten_counts(step, steps=2):
    """ATen ops per step (top-level and nested) under torch.profiler."""
    from torch.profiler import ProfilerActivity, profile
    step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    n = {}
    for e in prof.events():
        if e.name.startswith("aten::"):
            n[e.name[6:]] = n.get(e.name[6:], 0) + 1
    return {k: v // steps for k, v in n.items()}


def test_gpt2_step_does_no_copy_or_product_eager_does_not():
    """transformers' GPT-2 (SDPA attention, its own loss) trained through fxad.compile:
    per step, no more copies, clones, zero tensors, products or sums-to-size than eager
    autograd's step, the masked attention in the CPU flash kernels forward and backward
    (no batched products or softmax of the math form), as eager runs it."""
    torch.manual_seed(0)
    model, inputs = _gpt2()
    ref = copy.deepcopy(model)
    compiled = fxad.compile(model)

    def step(m):
        def run():
            m.zero_grad(set_to_none=True)
            m(*inputs).backward()
        return run
    eager, ours = _aten_counts(step(ref)), _aten_counts(step(compiled))
    layers = 2
    assert ours.get("_scaled_dot_product_flash_attention_for_cpu_backward") == layers
    assert ours.get("_scaled_dot_product_flash_attention_for_cpu") == layers
    for op in ("bmm", "_softmax", "_softmax_backward_data", "_scaled_dot_product_attention_math"):
        assert ours.get(op, 0) == 0, op
    for op in ("copy_", "clone", "zeros_like", "mul", "sum_to_size", "contiguous", "_to_copy"):
        assert ours.get(op, 0) <= eager.get(op, 0), (op, ours.get(op, 0), eager.get(op, 0))


# --- models through fxad.compile, float32 ----------------------------------------------------

class _Encoder(nn.Module):
    """nn.TransformerEncoder in train mode with causal and padding masks (float masks
    merged by F.multi_head_attention_forward, non-contiguous in_proj input)."""

    def __init__(self):
        super().__init__()
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        self.e = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)

    def forward(self, x, pad):
        causal = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        return (self.e(x, mask=causal, src_key_padding_mask=pad, is_causal=True) ** 2).mean()


def _gpt2():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=16,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                  use_cache=False, bos_token_id=0, eos_token_id=0)
    m = transformers.GPT2LMHeadModel(cfg)

    class Loss(nn.Module):
        def __init__(self):
            super().__init__()
            self.m = m

        def forward(self, ids):
            return self.m(input_ids=ids, labels=ids).loss
    return Loss(), (torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0)),)


def _encoder():
    pad = torch.zeros(2, 7, dtype=torch.bool)
    pad[0, 5:] = True
    return _Encoder(), (torch.randn(2, 7, 32, generator=torch.Generator().manual_seed(0)), pad)


@pytest.mark.parametrize("build", [_gpt2, _encoder], ids=["gpt2", "encoder"])
def test_models_train_through_compile_close_to_eager_float32(build):
    torch.manual_seed(0)
    model, inputs = build()
    ref = copy.deepcopy(model)
    compiled = fxad.compile(model)
    code = compiled.partition(*inputs).bwd_gm.code
    assert "_scaled_dot_product_flash_attention_for_cpu_backward(" in code
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(3):
        for m, o in ((compiled, opt), (ref, ref_opt)):
            o.zero_grad(set_to_none=True)
            m(*inputs).backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4, msg=name)
        opt.step()
        ref_opt.step()
