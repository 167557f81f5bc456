"""Capture behaves like PyTorch for the program being traced (issue: real models).

Traced values are real ``torch.Tensor`` objects (fake tensors under a TorchFunctionMode):
``isinstance``/``torch.is_tensor`` hold, unbound ``torch.Tensor`` methods work, metadata reads
as for a tensor, library code sees ``torch.compiler.is_compiling()``; ``torch.nn`` layers that
check their arguments (``Transformer`` with a causal mask, ``MultiheadAttention`` with a
tensor mask, ``TransformerEncoder`` with a padding mask in eval mode) capture and match
autograd."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fxad

D = torch.float64


def _grads_match(model, *inputs, loss=lambda out: (out ** 2).sum()):
    """fxad.grad of ``loss(model(*inputs))`` vs autograd: value, floating inputs, parameters."""
    class Wrapped(nn.Module):
        def __init__(self):
            super().__init__()
            self.m = model

        def forward(self, *xs):
            out = self.m(*xs)
            return loss(out[0] if isinstance(out, tuple) else out)

    w = Wrapped()
    g = fxad.grad(w, *inputs)
    value, d_inputs, d_params = g(*inputs)
    req = [x.detach().clone().requires_grad_() if x.is_floating_point() else x for x in inputs]
    w.zero_grad(set_to_none=True)
    ref = w(*req)
    ref.backward()
    torch.testing.assert_close(value, ref.detach())
    for x, d in zip(req, d_inputs):
        if x.is_floating_point():
            torch.testing.assert_close(d, x.grad)
    for name, p in w.named_parameters():
        want = p.grad if p.grad is not None else torch.zeros_like(p)
        torch.testing.assert_close(d_params[name], want, msg=name)
    return g


def test_traced_values_are_tensors():
    seen = {}

    def f(x):
        seen["isinstance"] = isinstance(x, torch.Tensor)
        seen["is_tensor"] = torch.is_tensor(x)
        seen["meta"] = (x.dtype, x.device, tuple(x.shape), x.layout, x.requires_grad, x.dim())
        y = x * 2
        seen["y"] = (isinstance(y, torch.Tensor), y.requires_grad, y.is_leaf)
        return y.sum()

    x = torch.randn(3, 4, dtype=D)
    fxad.trace(f, x)
    assert seen["isinstance"] and seen["is_tensor"]
    assert seen["meta"] == (D, torch.device("cpu"), (3, 4), torch.strided, True, 2)
    assert seen["y"] == (True, True, False)


def test_unbound_tensor_methods_and_dunders():
    def f(x):
        a = torch.Tensor.__radd__(x, 1)            # 1 + x
        b = torch.Tensor.__getitem__(x, 0)         # x[0]
        c = torch.Tensor.cfloat(x).real            # a cast and a view
        d = torch.Tensor.__rsub__(x, 2.0)          # 2 - x
        return (a * b + c * d).sum()

    x = torch.randn(3, dtype=D)
    gm = fxad.trace(f, x)
    code = gm.code
    assert ("1 + x" in code or "x + 1" in code) and "x[0]" in code and "2.0 - x" in code
    fxad.check(f, x)


def test_compiler_is_compiling_during_capture_only():
    flags = []

    def f(x):
        flags.append(torch.compiler.is_compiling())
        return x.sin()

    fxad.trace(f, torch.randn(2))
    assert flags == [True] and not torch.compiler.is_compiling()


def test_same_object_results_stay_the_same_object():
    def f(x):
        y = x * 2
        assert y.contiguous() is y and y.to(y.dtype) is y
        return y

    fxad.trace(f, torch.randn(3))


def test_transformer_with_causal_tgt_mask():
    torch.manual_seed(0)
    t = nn.Transformer(d_model=8, nhead=2, num_encoder_layers=1, num_decoder_layers=1,
                       dim_feedforward=16, dropout=0.0, batch_first=True).to(D)

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.t = t

        def forward(self, s, tgt):
            mask = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1], dtype=s.dtype)
            return self.t(s, tgt, tgt_mask=mask, tgt_is_causal=True)

    _grads_match(M(), torch.randn(2, 5, 8, dtype=D), torch.randn(2, 4, 8, dtype=D))


def test_multihead_attention_with_tensor_attn_mask():
    torch.manual_seed(0)
    a = nn.MultiheadAttention(8, 2, batch_first=True).to(D)

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = a

        def forward(self, x, mask):
            return self.a(x, x, x, attn_mask=mask)[0]

    mask = torch.triu(torch.ones(5, 5, dtype=torch.bool), 1)
    _grads_match(M(), torch.randn(2, 5, 8, dtype=D), mask)


def test_transformer_encoder_padding_mask_eval_mode():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=True).to(D).eval()

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.e = enc

        def forward(self, s, pad):
            return self.e(s, src_key_padding_mask=pad)

    pad = torch.zeros(2, 5, dtype=torch.bool)
    pad[0, 3:] = True
    _grads_match(M(), torch.randn(2, 5, 8, dtype=D), pad)


def test_no_grad_region_has_no_derivative():
    def f(x):
        with torch.no_grad():
            scale = x.abs().max()
        return (x * scale).sum()

    x = torch.randn(4, dtype=D)
    _, (d_x,) = fxad.grad(f, x)(x)
    xr = x.clone().requires_grad_()
    torch.testing.assert_close(d_x, torch.autograd.grad(f(xr), xr)[0])


def test_detach_and_data_have_no_derivative():
    def f(x):
        return (x * x.detach() + x * x.data).sum()

    x = torch.randn(4, dtype=D)
    _, (d_x,) = fxad.grad(f, x)(x)
    torch.testing.assert_close(d_x, 2 * x)


def test_inplace_keeps_the_tensors_dtype():
    def f(x):
        y = x.half() * 1          # half
        y.mul_(torch.ones(3, dtype=torch.float32) * 1.5)   # in place: stays half
        return y

    gm = fxad.trace(f, torch.randn(3))
    out = [n for n in gm.graph.nodes if n.op == "output"][0].args[0]
    assert out.meta["val"].dtype == torch.float16
    x = torch.randn(3)
    torch.testing.assert_close(gm(x), f(x))


def test_inplace_errors_as_in_eager():
    def f(x):
        i = torch.arange(3)
        i.add_(x)  # eager: result type Float can't be cast to Long
        return i

    with pytest.raises(fxad.CaptureError, match="can't be cast"):
        fxad.trace(f, torch.randn(3))


def test_tensor_hooks_are_refused():
    def f(x):
        y = x * 2
        y.register_hook(lambda g: g * 0)
        return y.sum()

    with pytest.raises(fxad.CaptureError, match="register_hook"):
        fxad.trace(f, torch.randn(3))


def test_generator_argument_is_refused_clearly():
    g = torch.Generator().manual_seed(0)

    def f(x):
        return x + torch.randn(3, generator=g)

    with pytest.raises(fxad.CaptureError, match="Generator"):
        fxad.trace(f, torch.randn(3))


def test_checkpoint_regions_are_marked():
    from torch.utils.checkpoint import checkpoint

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
            self.b = nn.Linear(4, 1)

        def forward(self, x):
            h = checkpoint(self.a, x, use_reentrant=False)
            h = checkpoint(self.a, h, use_reentrant=True)
            return self.b(h).sum()

    torch.manual_seed(0)
    m = M().to(D)
    gm = fxad.trace(m, torch.randn(3, 4, dtype=D))
    regions = {n.name: n.meta.get("fxad_checkpoint") for n in gm.graph.nodes
               if n.op == "call_function"}
    assert regions["tanh"] == 1 and regions["tanh_1"] == 2
    assert regions["linear_2"] is None
    x = torch.randn(3, 4, dtype=D)
    _, _, grads = fxad.grad(m, x)(x)
    m.zero_grad()
    torch.autograd.backward(m(x))
    for n, p in m.named_parameters():
        torch.testing.assert_close(grads[n], p.grad)


def test_tensor_type_cast_is_normalized_to_to():
    # x.type(torch.float32) (DeepSeek-V3, RecurrentGemma) and x.type("torch.DoubleTensor")
    def f(x):
        return (x.type(torch.float32).type(torch.float64) * x.type("torch.DoubleTensor")
                + x.type(dtype=torch.float64)).sum()

    x = torch.randn(5, dtype=torch.float64)
    g = fxad.grad(f, x)
    assert ".type(" not in g.code and ".to(torch.float32)" in g.code
    rx = x.clone().requires_grad_()
    f(rx).backward()
    torch.testing.assert_close(g(x)[1][0], rx.grad)


def test_requires_grad_assignment_inside_the_program():
    # `h.requires_grad = True` on a value fxad already differentiates through (transformers'
    # feature encoders) is a no-op; `= False` on a non-leaf fails as in eager, as an fxad error
    lin = torch.nn.Linear(3, 3).double()

    def f(x):
        h = x[:, None]
        h.requires_grad = True
        return lin(h).sum()

    x = torch.randn(4, 3, dtype=torch.float64)
    g = fxad.grad(f, x)
    rx = x.clone().requires_grad_()
    torch.testing.assert_close(g(x)[1][0], torch.autograd.grad(lin(rx[:, None]).sum(), rx)[0])

    def bad(x):
        h = x * 2
        h.requires_grad = False
        return h.sum()

    with pytest.raises(fxad.CaptureError, match="requires_grad") as e:
        fxad.grad(bad, x)
    assert "test_capture_fidelity.py" in str(e.value)


def test_numpy_scalars_become_python_numbers_in_the_code():
    import numpy as np

    def f(x):
        return (x * np.sqrt(np.float64(2.0)) + np.int64(3)).sum()

    x = torch.randn(3, dtype=torch.float64)
    g = fxad.grad(f, x)
    assert "np." not in g.code and "1.414213562373095" in g.code
    torch.testing.assert_close(g(x)[1][0], torch.full_like(x, 2.0 ** 0.5))


class _Stateful(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)
        self.register_buffer("ema", torch.zeros(3))
        self.register_buffer("pe", torch.ones(3))

    def forward(self, x):
        self.pe = self.pe.to(x.dtype)  # a no-op rebinding: silent
        self.ema = 0.9 * self.ema + 0.1 * x.mean(0).detach()
        self.cache = x * 2
        return (self.lin(x) * self.ema * self.pe).sum() + self.cache.sum()


def test_module_attributes_assigned_by_the_program_are_restored_and_reported():
    m = _Stateful().double()
    x = torch.randn(4, 3, dtype=torch.float64)
    with pytest.warns(UserWarning, match=r"assigns to module attributes \(`ema`, `cache`\)"):
        g = fxad.grad(m, x)
    # the user's module keeps its own tensors, never a traced value
    assert type(m.ema) is torch.Tensor and torch.equal(m.ema, torch.zeros(3, dtype=torch.float64))
    assert not hasattr(m, "cache") and "ema" in dict(m.named_buffers())
    value, (d_x,), d_params = g(x)
    rx = x.clone().requires_grad_()
    ref = _Stateful().double()
    ref.load_state_dict(m.state_dict())
    out = ref(rx)
    out.backward()
    torch.testing.assert_close(value, out.detach())
    torch.testing.assert_close(d_x, rx.grad)
    torch.testing.assert_close(d_params["lin.weight"], ref.lin.weight.grad)


class _MaskOnEagerPathOnly(nn.Module):
    """As transformers' SwitchTransformers / LongT5 encoders: the mask made only on the eager
    path (``not is_compiling()``), then indexed on both."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, mask=None):
        if mask is None and not torch.compiler.is_compiling():
            mask = torch.ones(x.shape[0], x.shape[1], dtype=x.dtype)
        return torch.tanh(self.lin(x)) * mask[:, :, None]


def test_a_program_failing_on_its_compile_path_is_captured_on_its_eager_path():
    torch.manual_seed(0)
    _grads_match(_MaskOnEagerPathOnly().double(), torch.randn(2, 3, 4, dtype=D))
    # with the mask given, the compile path serves (is_compiling() stays True)
    mask = torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 0.0]], dtype=D)
    _grads_match(_MaskOnEagerPathOnly().double(), torch.randn(2, 3, 4, dtype=D), mask)


def test_a_program_failing_on_both_paths_reports_the_compile_paths_error():
    def f(x):
        if torch.compiler.is_compiling():
            raise ValueError("compile path")
        raise KeyError("eager path")

    with pytest.raises(ValueError, match="compile path"):
        fxad.grad(f, torch.randn(3))

    def g(x):  # never asks is_compiling(): its error, without a second capture
        calls.append(1)
        raise KeyError("no path")

    calls = []
    with pytest.raises(KeyError, match="no path"):
        fxad.grad(g, torch.randn(3))
    assert len(calls) == 1


def test_a_fxad_error_on_the_eager_path_is_the_one_reported():
    def f(x):
        if torch.compiler.is_compiling():
            raise ValueError("compile path")
        return x[x > 0].sum()  # a data-dependent size: fxad's refusal names the fix

    with pytest.raises(fxad.errors.DataDependentError, match="guard\\+sizes"):
        fxad.grad(f, torch.randn(5))


class _ConvertsItsRouter(nn.Module):
    """As SwitchTransformers' router: ``self.classifier = self.classifier.to(self.dtype)``."""

    def __init__(self, dtype):
        super().__init__()
        self.dtype = dtype
        self.classifier = nn.Linear(4, 3)

    def forward(self, x):
        self.classifier = self.classifier.to(self.dtype)
        return self.classifier(x.to(self.dtype))


def test_module_to_that_converts_nothing_inside_forward():
    torch.manual_seed(0)
    m = _ConvertsItsRouter(torch.float64).double()
    _grads_match(m, torch.randn(2, 4, dtype=D))
    # a conversion that changes the parameters is refused, naming the line
    m = _ConvertsItsRouter(torch.float32).double()
    with pytest.raises(fxad.errors.CaptureError, match="nn.Parameter is created"):
        fxad.grad(m, torch.randn(2, 4, dtype=D))
