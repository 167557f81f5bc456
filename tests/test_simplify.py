"""Before/after tests of each simplifier pass on small hand-built graphs."""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from fxad.capture.proxy import Emitter
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
