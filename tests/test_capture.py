"""Capture: shape-carrying proxies, specialization on example shapes, normalization, in-place
rewriting, and the errors for what cannot be captured."""
from __future__ import annotations

import operator

import pytest
import torch
import torch.nn as nn

import fxad
from fxad.capture.normalize import normalize
from fxad.capture.tracer import capture


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op in ("call_function", "call_method")]


def test_shapes_specialize_without_running_anything():
    def f(x):
        n, t = x.shape[0], x.size(1)
        if x.dim() == 2:
            x = x * 2
        z = torch.zeros(n, t, device=x.device) + torch.arange(t, device=x.device)
        return (x + z + len(x)).sum()

    gm = fxad.trace(f, torch.empty(3, 4, device="meta"))  # meta: no data at all
    assert torch.zeros in _targets(gm) and torch.arange in _targets(gm)
    for n in gm.graph.nodes:
        if n.op == "call_function":
            assert "val" in n.meta
    x = torch.randn(3, 4)
    torch.testing.assert_close(fxad.trace(f, x)(x), f(x))


def test_every_node_has_shape_and_dtype():
    gm = fxad.trace(lambda x, w: torch.tanh(x @ w).mean(0), torch.randn(5, 3), torch.randn(3, 2))
    vals = {n.name: n.meta["val"] for n in gm.graph.nodes if n.op != "output"}
    assert tuple(vals["matmul"].shape) == (5, 2) and vals["matmul"].dtype == torch.float32
    assert tuple(vals["mean"].shape) == (2,)


def test_methods_and_operators_are_normalized():
    def f(x, y):
        return x.add(y).mul(2).view(2, 6).permute(1, 0).sin() - torch.div(x, y).reshape(6, 2)

    gm = fxad.trace(f, torch.randn(3, 4), torch.randn(3, 4))
    targets = _targets(gm)
    assert operator.add in targets and operator.mul in targets and operator.truediv in targets
    assert torch.reshape in targets and torch.permute in targets and torch.sin in targets
    assert not any(isinstance(t, str) and t in ("add", "mul", "view", "sin") for t in targets)


def test_normalize_rewrites_alpha_and_casts():
    def f(x, y):
        return torch.add(x, y, alpha=3).float().sum(1)

    gm = normalize(capture(f, (torch.randn(2, 3, dtype=torch.float64), torch.randn(2, 3))))
    code = gm.code
    assert "alpha" not in code and "y * 3" in code and ".to(torch.float32)" in code


def test_return_types_fields_become_indices():
    gm = fxad.trace(lambda x: torch.max(x, 1).values.sum(), torch.randn(3, 4))
    assert "values" not in gm.code and "[0]" in gm.code


def test_inplace_ops_rewritten_out_of_place():
    def f(x):
        y = x * 1.5
        y += 1
        y[0] = 2.0
        y.relu_()
        z = y * 2
        return torch.nn.functional.relu(z, inplace=True)

    x = torch.randn(4)
    gm = fxad.trace(f, x)
    assert not any(isinstance(t, str) and t.endswith("_") for t in _targets(gm))
    torch.testing.assert_close(gm(x), f(x.clone()))
    fxad.check(f, x)


def test_inplace_on_input_is_written_back():
    # as PyTorch's functionalization: the function is functional inside, and the caller's
    # tensor is updated at the end, after the derivative code has read the original value
    def f(x):
        y = torch.relu_(x)
        return y * 2

    x = torch.randn(5, dtype=torch.float64)
    g = fxad.vjp(f, x)
    assert "x.copy_(" in g.code.strip().splitlines()[-2]
    xin, xe = x.clone(), x.clone()
    out, (d_x,) = g(xin, torch.ones(5, dtype=torch.float64))
    torch.testing.assert_close(out, f(xe))
    torch.testing.assert_close(xin, xe)
    torch.testing.assert_close(d_x, 2.0 * (x > 0).double())


def test_inplace_visible_through_view():
    def f(x):
        y = x * 1
        v = y[0]
        y.mul_(2)
        return v + y.sum()

    x = torch.randn(3, dtype=torch.float64)
    gm = fxad.trace(f, x)
    torch.testing.assert_close(gm(x), f(x))
    fxad.check(f, x)


def test_data_dependent_control_flow_error_names_line_and_fix():
    def f(x):
        if x.sum() > 0:
            return x
        return -x

    with pytest.raises(fxad.DataDependentError) as e:
        fxad.vjp(f, torch.randn(3), values="refuse")  # the default takes it and guards it
    msg = str(e.value)
    assert "test_capture.py" in msg and "if x.sum() > 0" in msg and "fix:" in msg


def test_item_error():
    with pytest.raises(fxad.DataDependentError, match="item"):
        fxad.vjp(lambda x: x * x.item(), torch.randn(1), values="refuse")


def test_data_dependent_shape_error():
    with pytest.raises(fxad.CaptureError, match="depends on tensor data"):
        fxad.trace(lambda x: x[x > 0].sum(), torch.randn(5))


def test_missing_rule_error_names_op_line_and_registration():
    def f(x):
        return torch.special.airy_ai(x).sum()

    with pytest.raises(fxad.MissingRuleError) as e:
        fxad.vjp(f, torch.randn(3))
    msg = str(e.value)
    assert "airy_ai" in msg and "test_capture.py" in msg and "register_vjp" in msg


def test_nondifferentiable_path_needs_no_rule():
    # integer ops and ops on non-differentiable inputs are copied, not differentiated
    def f(x, idx):
        k = torch.special.airy_ai(idx.float())
        return (x * k).sum()

    fxad.check(f, torch.randn(3), torch.tensor([1, 2, 3]))


def test_module_parameters_and_buffers():
    m = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 2))
    gm = fxad.trace(m, torch.randn(5, 3))
    attrs = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    assert {"0.weight", "1.running_mean", "3.bias"} <= attrs
    assert gm.meta["fxad_training"] is True


def test_leaf_module_without_rule_errors():
    class Inner(nn.Module):
        def forward(self, x):
            return x * 2

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = Inner()

        def forward(self, x):
            return self.inner(x).sum()

    with pytest.raises(fxad.MissingRuleError) as e:
        fxad.vjp(Outer(), torch.randn(3), leaf_modules=(Inner,))
    assert "Inner" in str(e.value) and "leaf" in str(e.value)


def test_out_argument_is_refused():
    def f(x):
        buf = torch.empty(3)
        torch.sin(x, out=buf)
        return buf

    with pytest.raises(fxad.InplaceError, match="out="):
        fxad.trace(f, torch.randn(3))


def test_metadata_queries_answered_at_capture():
    def f(x):
        return x * 2 if torch.is_floating_point(x) and not x.is_complex() else x

    gm = fxad.trace(f, torch.randn(3))
    assert "mul = x * 2" in gm.code and "is_floating_point" not in gm.code


# --- ops that need special handling during capture -----------------------------------------

def test_legacy_rdiv_traces_as_truediv():
    x = torch.rand(3, dtype=torch.float64) + 0.5
    gm = fxad.trace(lambda x: x.__rdiv__(2.0), x)
    assert "2.0 / x" in gm.code
    fxad.check(lambda x: x.__rdiv__(2.0), x)


def test_meshgrid_of_a_list_is_the_public_function():
    a, b = torch.randn(3, dtype=torch.float64), torch.randn(2, dtype=torch.float64)
    f = lambda a, b: torch.meshgrid([a, b], indexing="xy")  # noqa: E731
    assert "meshgrid([a, b]" in fxad.trace(f, a, b).code
    fxad.check(f, a, b)


def test_function_taking_a_callable_is_traced_through():
    import torch.nn.functional as F
    a, p, n = (torch.randn(4, 5, dtype=torch.float64) for _ in range(3))
    f = lambda a, p, n: F.triplet_margin_with_distance_loss(  # noqa: E731
        a, p, n, distance_function=torch.nn.PairwiseDistance())
    code = fxad.trace(f, a, p, n).code
    assert "pairwise_distance" in code and "triplet" not in code
    fxad.check(f, a, p, n)
    fxad.check(lambda a, p, n: F.triplet_margin_with_distance_loss(
        a, p, n, distance_function=lambda x, y: (x - y).abs().sum(-1)), a, p, n)


def test_module_calling_a_foreign_stateful_module_is_refused():
    lin = torch.nn.Linear(3, 3)

    class Outer(nn.Module):
        def forward(self, x):
            return lin(x)  # its parameters are not Outer's: their gradients have no key

    with pytest.raises(fxad.CaptureError, match="not a submodule"):
        fxad.trace(Outer(), torch.randn(2, 3))


@pytest.mark.parametrize("f,shape", [
    (lambda x: torch.cov(x), (3, 3)),
    (lambda x: torch.corrcoef(x), (3, 3)),
    (lambda x: torch.cov(x[0]), ()),
    (lambda x: torch.combinations(x[0], 2), (10, 2)),
    (lambda x: torch.combinations(x[0], 3, with_replacement=True), (35, 3)),
    (lambda x: torch.nn.functional.gaussian_nll_loss(x, x.sin(), x.exp(), reduction="none"),
     (3, 5)),
])
def test_data_checking_ops_get_their_shape_without_data(f, shape):
    x = torch.randn(3, 5, dtype=torch.float64)
    gm = fxad.trace(f, x)
    out = [n for n in gm.graph.nodes if n.op == "output"][0].args[0]
    assert tuple(out.meta["val"].shape) == shape == tuple(f(x).shape)
    fxad.check(f, x)


def test_function_closing_over_a_module_treats_its_parameters_as_constants():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).double()
    x = torch.randn(5, 3, dtype=torch.float64)
    f = lambda x: m(x).pow(2).sum()  # noqa: E731
    g = fxad.grad(f, x)
    assert "sequential_0_weight" in g.code
    value, (d_x,) = g(x)
    xr = x.clone().requires_grad_()
    want = torch.autograd.grad(f(xr), xr)[0]
    torch.testing.assert_close(d_x, want)
    H = fxad.hessian(f, x)(x)
    torch.testing.assert_close(H, torch.func.hessian(f)(x))
    assert not hasattr(m, "sequential")  # the user's module is left alone


def test_multihead_attention_module_is_traced_through_to_ops_with_rules():
    torch.manual_seed(0)
    m = nn.MultiheadAttention(8, 2, batch_first=True).double()
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    f = lambda x: m(x, x, x, need_weights=False)[0]  # noqa: E731
    code = fxad.vjp(f, x).code
    assert "multi_head_attention_forward" not in code and "autograd_vjp" not in code
    fxad.check(f, x)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(8, 2, batch_first=True)

        def forward(self, x):
            return self.attn(x, x, x)[0].sum()

    fxad.check(Block().double(), x)


def test_builtins_and_bound_methods_are_functions_of_their_arguments():
    x = torch.randn(3, dtype=torch.float64)
    assert "torch.cos(x)" in fxad.vjp(torch.sin, x).code
    fxad.check(torch.atan2, x, x + 2)
    lin = nn.Linear(3, 2).double()
    fxad.check(lin.forward, x)  # the module's parameters are constants here


def test_where_method_is_normalized_with_its_condition_first():
    gm = fxad.trace(lambda x: x.where(x > 0, x * 2), torch.randn(3))
    assert "torch.where(gt, x, mul)" in gm.code


def test_numpy_keyword_names_become_pytorchs():
    """PyTorch's C++-bound functions take NumPy's ``axis=``/``keepdims=``/``x=`` for
    ``dim=``/``keepdim=``/``input=``; the rules bind PyTorch's names (I-BERT's
    ``x.mean(axis=2, keepdim=True)``)."""
    def f(x):
        a = x.mean(axis=1, keepdims=True)
        b = torch.sum(x, axis=0)
        c = torch.amax(x, axis=-1, keepdims=True)
        return (a * c).sum() + (b * b).sum() + torch.exp(input=x).sum()

    gm = capture(f, (torch.randn(3, 4),))
    assert "axis" in gm.code and "keepdims" in gm.code  # as captured
    code = normalize(gm).code
    assert "axis" not in code and "keepdims" not in code
    x = torch.randn(3, 4, dtype=torch.float64)
    value, (d_x,) = fxad.grad(f, x)(x)
    xr = x.clone().requires_grad_()
    ref = f(xr)
    ref.backward()
    torch.testing.assert_close(value, ref.detach())
    torch.testing.assert_close(d_x, xr.grad)


def test_a_python_defined_torch_function_keeps_its_own_keyword_names():
    # torch.functional.tensordot is Python with parameters named `a` and `b`, not the C++
    # parser's NumPy alias `a` of `input`; torch.sum is C++-bound
    from fxad.capture.normalize import _canonical
    g = torch.fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    dot = g.call_function(torch.functional.tensordot, (), {"a": x, "b": w, "dims": 1})
    total = g.call_function(torch.sum, (dot,), {"axis": 0, "keepdims": True})
    assert _canonical(dot) is None
    assert _canonical(total) == ("call_function", torch.sum, (dot,),
                                 {"dim": 0, "keepdim": True})
