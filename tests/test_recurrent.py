"""Recurrent networks as code (src/fxad/rules/nn/recurrent.py): nn.RNN (tanh, relu),
nn.LSTM, nn.GRU and their cells against torch.autograd in float64 (values, input, initial
state and parameter gradients), across layers, directions, batch_first, initial states,
packed sequences, proj_size and dropout; forward mode against torch.func.jvp; fxad.check;
oneDNN's LSTM kernels in code built to run; fxad.compile training matching eager.  No
generated code calls the autograd fallback."""
from __future__ import annotations

import copy
import operator
import sys
from pathlib import Path

import pytest
import torch
import torch.fx as fx
import torch.nn as nn

import fxad

DT = torch.float64
FALLBACK = "fxad_autograd_vjp"
CLASSES = {"rnn_tanh": (nn.RNN, {}), "rnn_relu": (nn.RNN, {"nonlinearity": "relu"}),
           "lstm": (nn.LSTM, {}), "gru": (nn.GRU, {})}


def _module(kind, *args, **kwargs):
    cls, extra = CLASSES[kind]
    return cls(*args, **extra, **kwargs)


def _leaves(x):
    return list(x) if isinstance(x, (tuple, list)) else [x]


def _flat_out(out):
    """(output, h_n) or (output, (h_n, c_n)) as a flat tuple of tensors."""
    y, h = out
    return (y, *_leaves(h))


class _Call(nn.Module):
    """``fn(*inputs)`` as a module owning ``modules`` (fxad returns parameter cotangents for
    a module; a function's closure modules are constants)."""

    def __init__(self, fn, modules):
        super().__init__()
        self.fn = fn
        self.mods = nn.ModuleList(modules)

    def forward(self, *inputs):
        return self.fn(*inputs)


def _compare_with_autograd(f, inputs, modules, *, atol=1e-10):
    """fxad.vjp of ``f`` (a function of ``inputs`` returning a tuple of tensors, calling
    ``modules``) against autograd: values, input cotangents and parameter cotangents, for
    random cotangents."""
    model = _Call(f, _leaves(modules))
    params = dict(model.named_parameters())
    g = fxad.vjp(model, *inputs)
    assert FALLBACK not in g.code
    ref_in = [t.clone().requires_grad_() for t in inputs]
    for p in params.values():
        p.grad = None
    ref = f(*ref_in)
    torch.manual_seed(1)
    cots = tuple(torch.randn_like(r) for r in ref)
    torch.autograd.backward(ref, cots)
    out, d_in, d_params = g(*inputs, cots)
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b.detach(), atol=atol, rtol=0)
    for a, b in zip(d_in, ref_in):
        torch.testing.assert_close(a, b.grad, atol=atol, rtol=0)
    assert set(d_params) == set(params)
    for name, p in params.items():
        torch.testing.assert_close(d_params[name], p.grad, atol=atol, rtol=0, msg=name)
    return g


# --- the layer stacks ------------------------------------------------------------------------

@pytest.mark.parametrize("init_state", [False, True], ids=["zero_state", "h0"])
@pytest.mark.parametrize("batch_first", [False, True], ids=["time_major", "batch_first"])
@pytest.mark.parametrize("bidirectional", [False, True], ids=["uni", "bi"])
@pytest.mark.parametrize("layers", [1, 2])
@pytest.mark.parametrize("kind", list(CLASSES))
def test_stack_matches_autograd(kind, layers, bidirectional, batch_first, init_state):
    torch.manual_seed(0)
    T, B, F, H = 4, 3, 3, 5
    m = _module(kind, F, H, num_layers=layers, bidirectional=bidirectional,
                batch_first=batch_first).to(DT)
    x = torch.randn((B, T, F) if batch_first else (T, B, F), dtype=DT)
    D = 2 if bidirectional else 1
    if not init_state:
        def f(x):
            return _flat_out(m(x))
        inputs = (x,)
    elif kind == "lstm":
        def f(x, h0, c0):
            return _flat_out(m(x, (h0, c0)))
        inputs = (x, torch.randn(layers * D, B, H, dtype=DT), torch.randn(layers * D, B, H,
                                                                          dtype=DT))
    else:
        def f(x, h0):
            return _flat_out(m(x, h0))
        inputs = (x, torch.randn(layers * D, B, H, dtype=DT))
    g = _compare_with_autograd(f, inputs, m)
    assert "torch.addmm(" in g.code  # the loop written out


@pytest.mark.parametrize("kind", list(CLASSES))
def test_stack_without_bias_and_unbatched(kind):
    torch.manual_seed(0)
    m = _module(kind, 3, 4, num_layers=2, bias=False).to(DT)
    x = torch.randn(5, 3, dtype=DT)  # unbatched (T, F): the module adds the batch dimension
    _compare_with_autograd(lambda x: _flat_out(m(x)), (x,), m)


def test_lstm_proj_size():
    torch.manual_seed(0)
    m = nn.LSTM(3, 5, num_layers=2, bidirectional=True, proj_size=2).to(DT)
    x = torch.randn(4, 2, 3, dtype=DT)
    h0, c0 = torch.randn(4, 2, 2, dtype=DT), torch.randn(4, 2, 5, dtype=DT)
    _compare_with_autograd(lambda x, h0, c0: _flat_out(m(x, (h0, c0))), (x, h0, c0),
                           m)


def test_only_the_final_state_is_used():
    """The output sequence's cotangent is absent (None): the backward starts from h_n."""
    torch.manual_seed(0)
    for kind in CLASSES:
        m = _module(kind, 3, 4, num_layers=2).to(DT)
        x = torch.randn(5, 2, 3, dtype=DT)

        def f(x):
            h = m(x)[1]
            return (h[1] if kind == "lstm" else h,)  # c_n for the LSTM
        _compare_with_autograd(f, (x,), m)


@pytest.mark.parametrize("kind", list(CLASSES))
def test_fxad_check(kind):
    torch.manual_seed(0)
    m = _module(kind, 3, 4, num_layers=2, bidirectional=True, batch_first=True).to(DT)
    x = torch.randn(2, 4, 3, dtype=DT)
    report = fxad.check(lambda x: m(x)[0].sin().sum(), x)
    assert report.fd_rel_err < 1e-6


@pytest.mark.parametrize("level", [False, "all"])
@pytest.mark.parametrize("kind", list(CLASSES))
def test_other_fused_levels(kind, level):
    """The formulas with fused kernels off, and at level "all" (sigmoid_backward /
    tanh_backward in the backward's gate factors; float64, so no oneDNN)."""
    torch.manual_seed(0)
    m = _module(kind, 3, 4, num_layers=2, bidirectional=True).to(DT)
    cell = CELLS[kind][0](3, 4, **CELLS[kind][1]).to(DT)
    x, h0 = torch.randn(4, 2, 3, dtype=DT), torch.randn(4, 2, 4, dtype=DT)

    def f(x, h0):
        out = m(x, (h0, h0.cos())) if kind == "lstm" else m(x, h0)
        c = cell(x[0], (h0[0], h0[1])) if kind == "lstm" else cell(x[0], h0[0])
        return _flat_out(out) + tuple(_leaves(c))
    with fxad.fused_kernels(level):
        g = _compare_with_autograd(f, (x, h0), [m, cell])
    assert ("sigmoid_backward" in g.code or "tanh_backward" in g.code) == \
        (level == "all" and kind in ("lstm", "gru"))


# --- cells -----------------------------------------------------------------------------------

CELLS = {"rnn_tanh": (nn.RNNCell, {}), "rnn_relu": (nn.RNNCell, {"nonlinearity": "relu"}),
         "lstm": (nn.LSTMCell, {}), "gru": (nn.GRUCell, {})}


@pytest.mark.parametrize("batched", [True, False], ids=["batched", "unbatched"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("init_state", [False, True], ids=["zero_state", "hx"])
@pytest.mark.parametrize("kind", list(CELLS))
def test_cell_matches_autograd(kind, init_state, bias, batched):
    torch.manual_seed(0)
    cls, extra = CELLS[kind]
    cell = cls(3, 4, bias=bias, **extra).to(DT)
    lead = (2,) if batched else ()
    x = torch.randn(*lead, 3, dtype=DT)
    if not init_state:
        def f(x):
            return tuple(_leaves(cell(x)))
        inputs = (x,)
    elif kind == "lstm":
        def f(x, h, c):
            return tuple(cell(x, (h, c)))
        inputs = (x, torch.randn(*lead, 4, dtype=DT), torch.randn(*lead, 4, dtype=DT))
    else:
        def f(x, h):
            return (cell(x, h),)
        inputs = (x, torch.randn(*lead, 4, dtype=DT))
    _compare_with_autograd(f, inputs, cell)


def test_cell_unrolled_by_the_user():
    """A Python loop over an LSTMCell and a GRUCell: one cell rule per step."""
    torch.manual_seed(0)
    lstm, gru = nn.LSTMCell(3, 4).to(DT), nn.GRUCell(4, 4).to(DT)
    xs = torch.randn(5, 2, 3, dtype=DT)

    def f(xs):
        h = c = g = torch.zeros(2, 4, dtype=DT)
        for x in xs:
            h, c = lstm(x, (h, c))
            g = gru(h, g)
        return (g, c)
    g = _compare_with_autograd(f, (xs,), [lstm, gru])
    assert g.code.count("# backward of") >= 10
    fxad.check(lambda xs: sum(t.sum() for t in f(xs)), xs)


# --- packed sequences ------------------------------------------------------------------------
# Capture cannot record pack_padded_sequence yet (its batch sizes are tensor data): the rules'
# packed overloads are checked on graphs built by hand, with the batch sizes a graph constant
# (get_attr) or known to capture (meta['fxad_value']), as capture will record them.

def _packed_vjp(kind, data, batch_sizes, hx, params, layers, bidirectional, via, dropout=0.0,
                train=False):
    from fxad.ad.reverse import build_vjp_graph
    from fxad.graph.proxy import to_fake

    op = getattr(torch, kind)
    root, g = nn.Module(), fx.Graph()
    ph = g.placeholder("data")
    ph.meta["val"] = to_fake(data)
    hx_nodes = []
    for i, h in enumerate(_leaves(hx)):
        n = g.placeholder(f"h{i}")
        n.meta["val"] = to_fake(h)
        hx_nodes.append(n)
    if via == "get_attr":
        root.register_buffer("batch_sizes", batch_sizes)
        bs = g.get_attr("batch_sizes")
    else:
        bs = g.placeholder("batch_sizes")
        if via == "meta":
            bs.meta["fxad_value"] = batch_sizes
    bs.meta["val"] = to_fake(batch_sizes)
    w_nodes = []
    for i, p in enumerate(params):
        root.register_parameter(f"w{i}", nn.Parameter(p.clone()))
        n = g.get_attr(f"w{i}")
        n.meta["val"] = to_fake(p)
        w_nodes.append(n)
    hx_arg = tuple(hx_nodes) if isinstance(hx, tuple) else hx_nodes[0]
    args = (True, layers, dropout, train, bidirectional)
    value = op(data, batch_sizes, hx, params, *args)
    node = g.call_function(op, (ph, bs, hx_arg, w_nodes) + args)
    node.meta["val"] = to_fake(tuple(v.detach() for v in value))
    items = []
    for i, v in enumerate(value):
        it = g.call_function(operator.getitem, (node, i))
        it.meta["val"] = to_fake(v.detach())
        items.append(it)
    g.output(tuple(items))
    gm = fx.GraphModule(root, g)
    graph, _ = build_vjp_graph(gm, with_params=True)
    return fx.GraphModule(gm, graph)


@pytest.mark.parametrize("via", ["get_attr", "meta"])
@pytest.mark.parametrize("bidirectional", [False, True], ids=["uni", "bi"])
@pytest.mark.parametrize("layers", [1, 2])
@pytest.mark.parametrize("kind", list(CLASSES))
def test_packed_sequence(kind, layers, bidirectional, via):
    torch.manual_seed(0)
    m = _module(kind, 3, 4, num_layers=layers, bidirectional=bidirectional).to(DT)
    lengths = [5, 3, 3, 1]
    packed = nn.utils.rnn.pack_padded_sequence(torch.randn(5, 4, 3, dtype=DT), lengths)
    D = 2 if bidirectional else 1
    h0 = torch.randn(layers * D, 4, 4, dtype=DT)
    hx = (h0, torch.randn_like(h0)) if kind == "lstm" else h0
    params = [w.detach() for w in m._flat_weights]
    gm = _packed_vjp(kind, packed.data, packed.batch_sizes, hx, params, layers, bidirectional,
                     via)
    assert FALLBACK not in gm.code
    data = packed.data.clone().requires_grad_()
    hx_r = tuple(t.clone().requires_grad_() for t in _leaves(hx))
    ps = [w.clone().requires_grad_() for w in params]
    ref = getattr(torch, kind)(data, packed.batch_sizes, hx_r if kind == "lstm" else hx_r[0],
                               ps, True, layers, 0.0, False, bidirectional)
    cots = [torch.randn_like(r) for r in ref]
    torch.autograd.backward(ref, cots)
    args = [packed.data, *_leaves(hx)] + ([packed.batch_sizes] if via == "meta" else [])
    with torch.no_grad():
        out, d_in, d_params = gm(*args, *cots)
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b.detach(), atol=1e-10, rtol=0)
    for a, b in zip(d_in, (data,) + hx_r):
        torch.testing.assert_close(a, b.grad, atol=1e-10, rtol=0)
    for i, p in enumerate(ps):
        torch.testing.assert_close(d_params[f"w{i}"], p.grad, atol=1e-10, rtol=0)


def test_packed_sequence_needs_known_batch_sizes():
    torch.manual_seed(0)
    m = nn.GRU(3, 4).to(DT)
    packed = nn.utils.rnn.pack_padded_sequence(torch.randn(3, 2, 3, dtype=DT), [3, 2])
    with pytest.raises(fxad.RuleError, match="batch sizes of the packed sequence are not known"):
        _packed_vjp("gru", packed.data, packed.batch_sizes, torch.zeros(1, 2, 4, dtype=DT),
                    [w.detach() for w in m._flat_weights], 1, False, via="placeholder")


def test_pack_padded_sequence_end_to_end():
    torch.manual_seed(0)
    m = nn.LSTM(3, 4, bidirectional=True).to(DT)
    x = torch.randn(5, 3, 3, dtype=DT)

    def f(x):
        p = nn.utils.rnn.pack_padded_sequence(x, [2, 5, 3], enforce_sorted=False)
        out, (h, c) = m(p)
        y, _ = nn.utils.rnn.pad_packed_sequence(out)
        return y.sin().sum() + h.sum() + c.sum()
    fxad.check(f, x)


@pytest.mark.parametrize("kind", ["lstm", "gru"])
@pytest.mark.parametrize("batch_first", [False, True])
def test_packed_sequence_with_lengths_as_an_input(kind, batch_first):
    torch.manual_seed(0)
    m = _module(kind, 3, 4, num_layers=2, bidirectional=True, batch_first=batch_first).to(DT)
    x = torch.randn((3, 5, 3) if batch_first else (5, 3, 3), dtype=DT)
    lengths = torch.tensor([2, 5, 3])

    def f(x, lengths):
        p = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=batch_first,
                                              enforce_sorted=False)
        out = m(p)[0]
        y, _ = nn.utils.rnn.pad_packed_sequence(out, batch_first=batch_first)
        return (y.sin() ** 2).sum()

    g = fxad.grad(f, x, lengths)
    assert "fxad_autograd_vjp" not in g.code
    value, (d_x, _) = g(x, lengths)
    xr = x.clone().requires_grad_()
    torch.testing.assert_close(value, f(x, lengths))
    torch.testing.assert_close(d_x, torch.autograd.grad(f(xr, lengths), xr)[0])
    # the code is specialized on the lengths' values (they decide the unrolled loop): guarded
    with pytest.raises(fxad.InputError, match="lengths"):
        g(x, torch.tensor([5, 2, 3]))


# --- dropout between layers ------------------------------------------------------------------

@pytest.mark.parametrize("level", [True, "all"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("kind", list(CLASSES))
def test_dropout_draws_like_eager(kind, dtype, level):
    """In training, dropout between layers draws eager PyTorch's masks for the same seed."""
    torch.manual_seed(0)
    m = _module(kind, 3, 4, num_layers=3, dropout=0.4, bidirectional=True).to(dtype).train()
    x = torch.randn(5, 2, 3, dtype=dtype)

    def f(x):
        return m(x)[0].pow(2).sum()
    with fxad.fused_kernels(level):
        g = fxad.grad(f, x)
    torch.manual_seed(123)
    value, (d_x,) = g(x)
    xr = x.clone().requires_grad_()
    torch.manual_seed(123)
    ref = f(xr)
    ref.backward()
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(value, ref.detach(), atol=tol, rtol=tol)
    torch.testing.assert_close(d_x, xr.grad, atol=tol, rtol=tol)


def test_packed_sequence_with_dropout():
    torch.manual_seed(0)
    m = nn.LSTM(3, 4, num_layers=2, dropout=0.5).to(DT)
    packed = nn.utils.rnn.pack_padded_sequence(torch.randn(4, 3, 3, dtype=DT), [4, 2, 1])
    h0 = torch.randn(2, 3, 4, dtype=DT)
    hx = (h0, torch.randn_like(h0))
    params = [w.detach() for w in m._flat_weights]
    gm = _packed_vjp("lstm", packed.data, packed.batch_sizes, hx, params, 2, False, "get_attr",
                     dropout=0.5, train=True)
    cots = [torch.randn(7, 4, dtype=DT), torch.randn(2, 3, 4, dtype=DT),
            torch.randn(2, 3, 4, dtype=DT)]
    torch.manual_seed(5)
    with torch.no_grad():
        out, d_in, _ = gm(packed.data, *hx, *cots)
    data = packed.data.clone().requires_grad_()
    torch.manual_seed(5)
    ref = torch.lstm(data, packed.batch_sizes, hx, params, True, 2, 0.5, True, False)
    torch.autograd.backward(ref, cots)
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b.detach(), atol=1e-10, rtol=0)
    torch.testing.assert_close(d_in[0], data.grad, atol=1e-10, rtol=0)


# --- forward mode and second order -----------------------------------------------------------

@pytest.mark.parametrize("kind", list(CLASSES))
def test_jvp_matches_torch_func(kind):
    torch.manual_seed(0)
    m = _module(kind, 3, 4, num_layers=2, bidirectional=True, batch_first=True).to(DT)
    x, h0 = torch.randn(2, 4, 3, dtype=DT), torch.randn(4, 2, 4, dtype=DT)
    c0 = torch.randn(4, 2, 4, dtype=DT)

    def f(x, h0, c0):
        out = m(x, (h0, c0)) if kind == "lstm" else m(x, h0)
        return _flat_out(out)
    primals = (x, h0, c0)
    tangents = tuple(torch.randn_like(p) for p in primals)
    j = fxad.jvp(f, *primals)
    assert FALLBACK not in j.code
    value, tangent = j(*primals, *tangents)
    ref_value, ref_tangent = torch.func.jvp(f, primals, tangents)
    for a, b in zip(value, ref_value):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=0)
    for a, b in zip(tangent, ref_tangent):
        if kind != "lstm" and b.abs().max() == 0:  # c0 is not used
            continue
        torch.testing.assert_close(a, b, atol=1e-10, rtol=0)


@pytest.mark.parametrize("kind", list(CELLS))
def test_cell_jvp_matches_torch_func(kind):
    torch.manual_seed(0)
    cls, extra = CELLS[kind]
    cell = cls(3, 4, **extra).to(DT)
    x, h, c = (torch.randn(2, n, dtype=DT) for n in (3, 4, 4))

    def f(x, h, c):
        return tuple(_leaves(cell(x, (h, c)) if kind == "lstm" else cell(x, h)))
    tangents = tuple(torch.randn_like(p) for p in (x, h, c))
    value, tangent = fxad.jvp(f, x, h, c)(x, h, c, *tangents)
    ref_value, ref_tangent = torch.func.jvp(f, (x, h, c), tangents)
    for a, b in zip(tangent, ref_tangent):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=0)


@pytest.mark.parametrize("kind", list(CLASSES))
def test_hvp(kind):
    """Second order: the generated gradient code (no fused kernels) differentiated again."""
    torch.manual_seed(0)
    m = _module(kind, 3, 4, num_layers=2, bidirectional=True).to(DT)
    x, v = torch.randn(4, 2, 3, dtype=DT), torch.randn(4, 2, 3, dtype=DT)

    def f(x):
        return m(x)[0].sin().sum()
    h = fxad.hvp(f, x)
    assert FALLBACK not in h.code
    out = h(x, v)
    got = out[-1] if isinstance(out, tuple) else out
    got = got[0] if isinstance(got, tuple) else got
    ref = torch.func.jvp(torch.func.grad(f), (x,), (v,))[1]
    torch.testing.assert_close(got, ref, atol=1e-10, rtol=0)


# --- oneDNN's LSTM kernels in code built to run --------------------------------------------

@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this build")
@pytest.mark.parametrize("config", [dict(), dict(num_layers=2, bidirectional=True,
                                                 batch_first=True), dict(bias=False)])
def test_onednn_lstm_at_level_all(config):
    """Code built to run (fused level "all": fxad.compile, fxad.joint_step) calls oneDNN's LSTM
    layer and its backward, as eager nn.LSTM does on the CPU in float32: autograd's values bit
    for bit; the default level writes the loop out."""
    torch.manual_seed(0)
    m = nn.LSTM(3, 4, **config)
    layers = config.get("num_layers", 1) * (2 if config.get("bidirectional") else 1)
    x = torch.randn((2, 5, 3) if config.get("batch_first") else (5, 2, 3))
    h0, c0 = torch.randn(layers, 2, 4), torch.randn(layers, 2, 4)

    def f(x, h0, c0):
        out, (h, c) = m(x, (h0, c0))
        return out.sin().sum() + h.pow(2).sum() + c.cos().sum()
    model = _Call(f, [m])
    with fxad.fused_kernels("all"):
        g = fxad.grad(model, x, h0, c0)
    assert "onednn_lstm_layer_backward" in g.code and "torch.addmm(" not in g.code
    value, grads, params = g(x, h0, c0)
    inputs = [t.clone().requires_grad_() for t in (x, h0, c0)]
    ref = f(*inputs)
    ref.backward()
    assert torch.equal(value, ref.detach())
    for a, b in zip(grads, inputs):
        assert torch.equal(a, b.grad)
    for name, p in model.named_parameters():
        assert torch.equal(params[name], p.grad), name
    assert "onednn" not in fxad.grad(model, x, h0, c0).code  # the default level: the loop


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this build")
@pytest.mark.parametrize("compile", [False, "aot_eager"])
def test_joint_step_with_onednn_lstm(compile):
    """fxad.joint_step builds at level "all" (oneDNN's kernels); under torch.compile the two
    oneDNN calls run eagerly (a graph break, as around eager nn.LSTM)."""
    torch.manual_seed(0)
    model = _Call(lambda x: nn.functional.mse_loss(m(x)[0], x.new_zeros(())), [])
    m = nn.LSTM(3, 4, num_layers=2, bidirectional=True)
    model.mods.append(m)
    x = torch.randn(5, 2, 3)
    step = fxad.joint_step(model, x, compile=compile)
    assert "fxad_onednn_lstm_layer_backward" in step.graph_module.code
    loss, _, grads = step(x)
    ref = model(x)
    ref.backward()
    torch.testing.assert_close(loss, ref.detach())
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, msg=name)


def test_onednn_not_used_where_eager_does_not():
    torch.manual_seed(0)
    x = torch.randn(5, 2, 3)
    for m in (nn.LSTM(3, 4, proj_size=2), nn.LSTM(3, 4).double(), nn.GRU(3, 4)):
        xx = x.to(next(m.parameters()).dtype)
        with fxad.fused_kernels("all"):
            code = fxad.grad(lambda x: m(x)[0].sum(), xx).code
        assert "onednn" not in code and FALLBACK not in code


# --- training with fxad.compile --------------------------------------------------------------

class _Tagger(nn.Module):
    def __init__(self, kind, dropout=0.0):
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.rnn = _module(kind, 6, 8, num_layers=2, bidirectional=True, batch_first=True,
                           dropout=dropout)
        self.head = nn.Linear(16, 5)

    def forward(self, tokens, labels):
        out, _ = self.rnn(self.emb(tokens))
        return nn.functional.cross_entropy(self.head(out).flatten(0, 1), labels.flatten())


@pytest.mark.parametrize("dropout", [0.0, 0.3], ids=["no_dropout", "dropout"])
@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn_tanh"])
def test_fxad_compile_training_matches_eager(kind, dropout):
    torch.manual_seed(0)
    model = _Tagger(kind, dropout)
    ref = copy.deepcopy(model)
    compiled = fxad.compile(model)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    opt_ref = torch.optim.Adam(ref.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(0)
    for step in range(4):
        tokens = torch.randint(0, 11, (4, 7), generator=gen)
        labels = torch.randint(0, 5, (4, 7), generator=gen)
        torch.manual_seed(100 + step)
        loss = compiled(tokens, labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        torch.manual_seed(100 + step)
        loss_ref = ref(tokens, labels)
        opt_ref.zero_grad()
        loss_ref.backward()
        opt_ref.step()
        torch.testing.assert_close(loss, loss_ref, atol=1e-5, rtol=1e-5)
    for (name, p), p_ref in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, p_ref, atol=1e-5, rtol=1e-5, msg=name)


def test_benchmark_script_runs(tmp_path):
    """benchmarks/bench_rnn.py end to end on a tiny configuration (no timing claims)."""
    bench = Path(__file__).resolve().parents[1] / "benchmarks"
    sys.path.insert(0, str(bench))
    try:
        import bench_rnn
    finally:
        sys.path.remove(str(bench))
    assert bench_rnn.main(["--models", "gru", "--layers", "1", "--directions", "uni",
                           "--seq", "3", "--batch", "2", "--input", "3", "--hidden", "4",
                           "--repeats", "2", "--warmup", "1", "--block", "1",
                           "--no-compile"]) == 0
