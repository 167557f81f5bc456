"""The op record (:mod:`fxad.rules.registry`): one record per op with its kind, complex status
and rules; overloads chosen per call by :func:`fxad.rules.dispatch.registered_rule`."""
from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

import fxad
from fxad.errors import RuleError
from fxad.rules import registry as R
from fxad.rules.dispatch import registered_rule


def _node(target, *args, op="call_function", **kwargs):
    g = fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.empty(2, 3, 4, 5)
    return g.create_node(op, target, tuple(x if a is None else a for a in args) or (x,), kwargs)


@pytest.mark.parametrize("target,op,kind", [
    (torch.sin, "call_function", "elementwise"),
    (operator.add, "call_function", "elementwise"),
    (torch.ops.aten.add.Tensor, "call_function", "elementwise"),
    ("add", "call_method", "elementwise"),
    ("view", "call_method", "view"),
    (operator.getitem, "call_function", "view"),
    (torch.transpose, "call_function", "view"),
    (torch.rand, "call_function", "random"),
    ("bernoulli_", "call_method", "random"),
    (torch.empty_like, "call_function", "uninitialized"),
    (torch.matmul, "call_function", "other"),
    (F.layer_norm, "call_function", "other"),
])
def test_kind_of(target, op, kind):
    assert R.kind_of(_node(target, op=op)) == kind


def test_random_calls_follow_the_arguments():
    assert R.is_random_call(_node(F.dropout, None, 0.5, True))
    assert not R.is_random_call(_node(F.dropout, None, 0.5, False))
    assert not R.is_random_call(_node(F.dropout, None, 0.0, True))
    assert R.is_random_call(_node(torch.empty_like))
    assert not R.is_random_call(_node(torch.sin))


def test_recompute_follows_the_declaration_then_the_kind():
    assert R.record(torch.Tensor.view).recompute is True
    assert R.record(torch.matmul).recompute is False
    assert R.record(F.layer_norm).recompute is False  # declared


def test_overloads_are_chosen_per_call():
    rec = R.record(torch.max)
    assert [r.name for r in rec.rules] == ["MaxAll", "MaxBinary", "MaxDim"]
    x = torch.empty(3, 4)
    assert rec.select((x,), {}).name == "MaxAll"
    assert rec.select((x, x), {}).name == "MaxBinary"
    assert rec.select((x, 1), {}).name == "MaxDim"
    assert rec.select((x,), {"dim": 0}).name == "MaxDim"
    # every overload's samples reach the rule tests through the default rule
    assert len(list(R.lookup(torch.max).samples(torch.float64))) == 4


def test_fused_overload_needs_its_level():
    rec = R.record(F.cross_entropy)
    assert rec.fused is not None and rec.fused.fused == "all"
    x, t = torch.empty(4, 5), torch.zeros(4, dtype=torch.int64)
    assert rec.select((x, t), {}, lambda level: True).name == "CrossEntropyFused"
    assert rec.select((x, t), {}, lambda level: level is True).name == "CrossEntropy"
    assert rec.select((x, t), {"label_smoothing": 0.1}, lambda level: True).name == "CrossEntropy"


def test_registered_rule_reads_the_node_and_the_fused_level():
    gm = fxad.trace(lambda q, k, v: F.scaled_dot_product_attention(q, k, v),
                    *(torch.randn(1, 2, 3, 4) for _ in range(3)))
    node = next(n for n in gm.graph.nodes if n.target is F.scaled_dot_product_attention)
    assert registered_rule(gm, node).name == "ScaledDotProductAttentionFused"
    with fxad.fused_kernels(False):
        assert registered_rule(gm, node).name == "ScaledDotProductAttention"


def test_one_record_per_op_and_overriding_its_rules():
    rec = R.record(F.layer_norm)
    old = R.lookup(F.layer_norm)
    assert old is rec.default and len(rec.rules) > 1
    with R.overridden(F.layer_norm, rules=(R.Rule(op=F.layer_norm, fwd=old.fwd, bwd=old.bwd),)):
        assert R.record(F.layer_norm).overloads == ()  # one rule serves every call
    assert R.record(F.layer_norm) == rec  # the overloads are back


def test_overridden_facts_are_restored():
    assert R.record(torch.abs).complex == "unverified"
    with R.overridden(torch.abs, complex="verified"):
        assert R.record(torch.abs).complex == "verified"
    assert R.record(torch.abs).complex == "unverified"


def test_declarations_are_checked():
    with pytest.raises(RuleError, match="kind"):
        R.declare(torch.sin, kind="pointwise")

    def f(x):
        return x

    with pytest.raises(RuleError, match="fused must be"):
        @fxad.register_vjp(f)
        class Bad:
            fused = "yes"

            def fwd(x):
                return x, None

            def bwd(aux, d):
                return (d,)
    assert R.lookup(f) is None
