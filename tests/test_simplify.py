"""Before/after tests of each simplifier pass on small hand-built graphs."""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

import fxad
from fxad.graph.proxy import Emitter
from fxad.simplify import cse, dce, fold_algebra, fold_shapes, simplify


def _graph(build, *shapes):
    g = fx.Graph()
    em = Emitter(g)
    phs = []
    for i, s in enumerate(shapes):
        n = g.placeholder(f"x{i}")
        n.meta["val"] = torch.empty(s, device="meta")
        phs.append(em.value(n))
    out = build(*phs)
    g.output(out.node if hasattr(out, "node") else tuple(o.node for o in out))
    return g


def _code(g):
    return "\n".join(line.strip() for line in g.python_code("self").src.splitlines()
                     if line.strip() and not line.startswith("def"))


def _ops(g):
    return [n.target for n in g.nodes if n.op in ("call_function", "call_method")]


def test_dce_removes_unused_chain_but_keeps_side_effects():
    def build(x):
        dead = torch.cos(torch.sin(x))  # noqa: F841
        keep = x.add_(0) if False else x * 2
        return keep

    g = _graph(build, (3,))
    assert torch.sin in _ops(g) and torch.cos in _ops(g)
    assert dce(g) == 2
    assert _ops(g) == [operator.mul]
    # a node marked as a side effect survives
    g2 = _graph(lambda x: x * 2, (3,))
    n = g2.call_method("add_", (next(iter(g2.nodes)), 1))
    n.meta["fxad_side_effect"] = True
    assert dce(g2) == 0


def test_cse_merges_duplicates_not_random_ops():
    g = _graph(lambda x: torch.sin(x) * torch.sin(x) + torch.rand_like(x) + torch.rand_like(x),
               (3,))
    assert _ops(g).count(torch.sin) == 2
    assert cse(g) == 1
    assert _ops(g).count(torch.sin) == 1 and _ops(g).count(torch.rand_like) == 2
    assert "mul = sin * sin" in _code(g)


def test_algebra_zero_and_one():
    def build(x):
        z = torch.zeros_like(x)
        a = z + x          # -> x
        b = a * 1          # -> x
        c = b / 1          # -> x
        d = c - z          # -> x
        return -(-(d ** 1))  # -> x

    g = _graph(build, (3,))
    before = _code(g)
    assert "zeros_like" in before and "* 1" in before
    fold_algebra(g)
    dce(g)
    assert _code(g) == "return x0"


def test_algebra_keeps_broadcasting_add():
    # (3,) + zeros(2, 3) has shape (2, 3): folding it to x would change the shape
    g = _graph(lambda x, y: x + torch.zeros_like(y), (3,), (2, 3))
    assert fold_algebra(g) == 0
    g = _graph(lambda x, y: x + torch.zeros_like(y), (2, 3), (2, 3))
    assert fold_algebra(g) == 1


def test_algebra_add_neg_becomes_sub():
    g = _graph(lambda x, y: x + (-y), (3,), (3,))
    fold_algebra(g)
    dce(g)
    assert "sub = x0 - x1" in _code(g) or "add = x0 - x1" in _code(g)


def test_shape_folding():
    def build(x):
        a = torch.reshape(torch.reshape(x, (6,)), (3, 2))    # -> reshape(x, (3, 2))
        b = torch.transpose(torch.transpose(x, 0, 1), 1, 0)  # -> x
        c = torch.squeeze(torch.unsqueeze(x, 0), 0)          # -> x
        d = x.to(torch.float32).expand((2, 3))               # -> x
        return a, b + c + d

    g = _graph(build, (2, 3))
    simplify(g)
    code = _code(g)
    assert code.count("torch.reshape") == 1 and "transpose" not in code and "unsqueeze" not in code
    assert ".to(" not in code and "expand" not in code


def test_expand_absorbed_by_broadcasting():
    g = _graph(lambda d, y: d.expand((4, 3)) * y, (1, 3), (4, 3))
    fold_shapes(g)
    dce(g)
    assert "expand" not in _code(g) and "mul = x0 * x1" in _code(g)


def test_expand_kept_when_needed():
    g = _graph(lambda d, y: d.expand((4, 3)) * y, (1, 3), (3,))
    fold_shapes(g)
    dce(g)
    assert "expand" in _code(g)


def test_permute_pairs_compose():
    g = _graph(lambda x: torch.permute(torch.permute(x, (2, 0, 1)), (1, 2, 0)), (2, 3, 4))
    simplify(g)
    assert _code(g) == "return x0"


def test_contiguous_dropped_only_when_strides_already_are():
    g = _graph(lambda x: (x * 2).contiguous(), (2, 3))               # fresh result: drop
    fold_shapes(g)
    dce(g)
    assert "contiguous" not in _code(g)
    g = _graph(lambda x: torch.transpose(x, 0, 1).contiguous(), (2, 3))  # a view: keep
    fold_shapes(g)
    dce(g)
    assert "contiguous" in _code(g)


# --- in-place accumulation (not part of simplify(): for code that is run, not transformed) ---

def _gm(g):
    return fx.GraphModule(torch.nn.Module(), g)


def test_accumulate_in_place_before_after():
    from fxad.simplify.inplace import accumulate_in_place

    # a and b are fresh and read only by the sum: the first is reused
    gm = _gm(_graph(lambda x, w: x @ w + x * 2, (4, 3), (3, 3)))
    assert "add = matmul + mul" in _code(gm.graph)
    assert accumulate_in_place(gm) == 1
    assert "add = matmul.add_(mul)" in _code(gm.graph)
    x, w = torch.randn(4, 3), torch.randn(3, 3)
    torch.testing.assert_close(gm(x, w), x @ w + x * 2)

    # only the second operand is fresh (the first is an input): accumulate into the second
    gm = _gm(_graph(lambda x, w: x + x @ w, (4, 3), (3, 3)))
    assert accumulate_in_place(gm) == 1
    assert "add = matmul.add_(x0)" in _code(gm.graph)
    torch.testing.assert_close(gm(x, w), x + x @ w)


def test_accumulate_in_place_leaves_unsafe_sums_alone():
    from fxad.simplify.inplace import accumulate_in_place, is_fresh

    cases = {
        "inputs only": (lambda x, y: x + y, [(3,), (3,)]),
        "a view": (lambda x, y: x.t() + y, [(2, 3), (3, 2)]),
        "read again later": (lambda x, y: (lambda m: (m + y) * m)(x * 2), [(3,), (3,)]),
        "broadcast into it": (lambda x, y: x * 2 + y, [(3,), (2, 3)]),
        "promoted dtype": (lambda x, y: x * 2 + y.double(), [(3,), (3,)]),
        "output": (lambda x, y: (lambda m: (m + y, m))(x * 2), [(3,), (3,)]),
    }
    for name, (build, shapes) in cases.items():
        g = _graph(build, *shapes)
        before = _code(g)
        assert accumulate_in_place(_gm(g)) == 0, name
        assert _code(g) == before, name
    # results of ATen ops: fresh unless the schema says they alias an input
    g = fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.empty(3, 4)
    vm = g.call_function(torch.ops.aten.var_mean.correction, (x, [0]))
    vm.meta["val"] = (torch.empty(4), torch.empty(4))
    mean = g.call_function(operator.getitem, (vm, 1))
    view = g.call_function(torch.ops.aten.view.default, (x, [12]))
    t = g.call_method("t", (x,))
    assert is_fresh(mean) and not is_fresh(view) and not is_fresh(t) and not is_fresh(x)


class _ConvNet(torch.nn.Module):
    """A shared-weight pair of convolutions (with and without bias) and a linear head."""

    def __init__(self):
        super().__init__()
        self.c1 = torch.nn.Conv2d(3, 4, 3, padding=1, bias=False)
        self.c2 = torch.nn.Conv2d(4, 4, 3, padding=1)
        self.fc = torch.nn.Linear(4, 2)

    def forward(self, x):
        h = torch.relu(self.c2(torch.relu(self.c1(x))))
        h = self.c2(h) + h  # c2's weight used twice: one gradient, summed
        return self.fc(h.mean((2, 3))).sum()


def _run_vjp(gm, *inputs):
    """Run a VJP graph of a scalar function (cotangent 1) with autocast off, as fxad does."""
    from fxad.training import _autocast_devices, _AutocastOff
    seed = [n for n in gm.graph.nodes if n.op == "placeholder"][-1].meta["val"]
    with _AutocastOff(_autocast_devices()):
        return gm(*inputs, torch.ones((), dtype=seed.dtype))


def test_channels_last_convolutions_before_after():
    from fxad.simplify.layout import channels_last_convolutions
    from fxad.training import _vjp_graph

    torch.manual_seed(0)
    model, x = _ConvNet(), torch.randn(2, 3, 5, 5)
    for autocast in (None, torch.bfloat16):
        with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=bool(autocast)):
            gm = _vjp_graph(model, (x,), (), ())
        before = gm.code
        assert "channels_last" not in before
        ref = _run_vjp(gm, x)
        assert channels_last_convolutions(gm) == 2  # c1.weight, c2.weight; not fc's 2-D one
        code = gm.code
        if autocast is None:  # one channels-last copy per weight, gradients copied back
            assert "c2_weight_nhwc = c2_weight.contiguous(memory_format = " \
                   "torch.channels_last)" in code
            assert code.count(" c2_weight.contiguous(") == 1
            assert "d_c1_weight_nchw = d_c1_weight.contiguous(memory_format = " \
                   "torch.contiguous_format)" in code
        else:  # after the casts; gradients permuted back before their cast to float32
            assert "to_1 = c1_weight.to(torch.bfloat16)" in code
            assert "to_1_nhwc = to_1.contiguous(memory_format = torch.channels_last)" in code
            assert "d_to_1_nchw = d_to_1.contiguous(memory_format = " \
                   "torch.contiguous_format)" in code
            assert "d_c1_weight = d_to_1_nchw.to(torch.float32)" in code
            assert "torch.ops.aten.convolution_backward(d_conv2d, to, to_1_nhwc," in code
        out = _run_vjp(gm, x)
        torch.testing.assert_close(out[0], ref[0])
        for name, g in ref[2].items():
            assert out[2][name].is_contiguous(), name  # the parameter's layout
            tol = {"atol": 2e-2, "rtol": 2e-2} if autocast else {}
            torch.testing.assert_close(out[2][name], g, **tol, msg=name)
        assert channels_last_convolutions(gm) == 0  # already channels-last: idempotent


def test_channels_last_convolutions_leaves_other_weights_alone():
    from fxad.simplify.layout import channels_last_convolutions
    from fxad.training import _vjp_graph

    def weight_is_an_input(x, w):  # not a parameter: its layout is the caller's
        return torch.conv2d(x, w).sum()

    x, w = torch.randn(1, 2, 4, 4), torch.randn(3, 2, 3, 3)
    gm = _vjp_graph(weight_is_an_input, (x, w), (0, 1), ())
    assert channels_last_convolutions(gm) == 0

    conv1d = torch.nn.Sequential(torch.nn.Conv1d(2, 3, 3))  # 3-D weight
    gm = _vjp_graph(lambda x: conv1d(x).sum(), (torch.randn(1, 2, 6),), (), ())
    assert channels_last_convolutions(gm) == 0

    class ReadTwice(torch.nn.Module):  # the weight also feeds a view: its gradient is a sum
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(2, 2, 3, bias=False)

        def forward(self, x):
            return self.conv(x).sum() + (self.conv.weight.view(-1) ** 2).sum()

    model, x = ReadTwice(), torch.randn(1, 2, 4, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        gm = _vjp_graph(model, (x,), (), ())
    ref = _run_vjp(gm, x)
    assert channels_last_convolutions(gm) == 1
    code = gm.code  # the cast feeds only the convolutions; the view reads the parameter
    assert "to_1_nhwc = to_1.contiguous(memory_format = torch.channels_last)" in code
    assert "torch.reshape(conv_weight, (-1,))" in code
    assert "d_conv_weight_nchw = d_conv_weight.contiguous(memory_format = " \
           "torch.contiguous_format)" in code
    out = _run_vjp(gm, x)
    assert out[2]["conv.weight"].is_contiguous()
    torch.testing.assert_close(out[2]["conv.weight"], ref[2]["conv.weight"])

    # casts_only (fxad.compile's default): float32 weights stay, autocast's casts move
    torch.manual_seed(0)
    model, x = _ConvNet(), torch.randn(2, 3, 5, 5)
    assert channels_last_convolutions(_vjp_graph(model, (x,), (), ()), casts_only=True) == 0
    with torch.autocast("cpu", dtype=torch.bfloat16):
        gm = _vjp_graph(model, (x,), (), ())
    assert channels_last_convolutions(gm, casts_only=True) == 2

    # a 1x1 kernel's contiguous weight is already channels-last: nothing to move
    gm = _vjp_graph(torch.nn.Conv2d(2, 2, 1), (torch.randn(1, 2, 3, 3),), (), ())
    assert channels_last_convolutions(gm) == 0


def test_cast_methods_before_after():
    from fxad.simplify.calls import cast_methods

    def f(x, w):
        return (x.to(torch.bfloat16) @ w.to(torch.bfloat16)).to(torch.float32), \
            x.to(torch.float64), x.to(torch.float16), x.to(torch.int32), x.to(x.device), \
            x.to(torch.float32, copy=True)

    x, w = torch.randn(4, 3), torch.randn(3, 2)
    gm = fxad.trace(f, x, w)
    before = _code(gm.graph)
    assert before.count(".to(torch.") == 7
    ref = gm(x, w)
    assert cast_methods(gm) == 5
    after = _code(gm.graph)
    for s in ("x.bfloat16()", "w.bfloat16()", "matmul.float()", "x.double()", "x.half()"):
        assert s in after
    # an integer dtype and keyword arguments keep ``to``; ``x.to(x.device)`` is ``x`` itself
    # (PyTorch returns the same tensor object, and capture records it as such)
    assert "x.to(torch.int32)" in after and "copy = True" in after and after.count(".to(") == 2
    assert "to_5, x, to_6" in after
    for a, b in zip(gm(x, w), ref):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert cast_methods(gm) == 0
