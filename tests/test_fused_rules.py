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
