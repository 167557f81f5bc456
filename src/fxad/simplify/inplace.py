"""In-place accumulation of cotangent sums, for generated code that is run rather than
transformed further.

Where a value feeds several ops, its cotangent is the sum of their contributions, written
``d_x = d_a + d_b``.  When one operand is a fresh tensor (produced by an op that allocates
its result, e.g. a product or a fused backward kernel) that nothing reads afterwards,
:func:`accumulate_in_place` rewrites the sum to ``d_x = d_b_fresh.add_(d_a)``: the same
values (floating-point addition is commutative), one allocation and one activation-sized
buffer fewer at that point.  This is what autograd's engine does when it accumulates the
gradients of a tensor with several uses.

This pass is *not* part of :data:`fxad.simplify.PASSES`: the rewritten graph mutates
tensors, so it must not be differentiated again or given to passes that assume pure ops.
:func:`fxad.compile` applies it to the backward graph it runs.
"""
from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from ._util import same_type, val

__all__ = ["accumulate_in_place", "is_fresh"]

# torch-level callables whose result is always a new tensor (never an alias of an input)
_FRESH_FUNCTIONS = frozenset({
    operator.add, operator.sub, operator.mul, operator.truediv, operator.neg,
    operator.matmul, torch.add, torch.sub, torch.mul, torch.div, torch.neg, torch.matmul,
    torch.mm, torch.bmm, torch.where, torch.sum, torch.mean,
})
_FRESH_METHODS = frozenset({"add", "sub", "mul", "div", "neg", "matmul", "mm", "bmm",
                            "sum", "mean"})


def _aten_returns_fresh(target: Any) -> bool:
    """An ATen op whose schema marks none of its results as an alias of an input."""
    if isinstance(target, torch._ops.OpOverloadPacket):
        target = getattr(target, "default", None)
    if not isinstance(target, torch._ops.OpOverload):
        return False
    schema = target._schema
    if schema.is_mutable:
        return False
    return all(r.alias_info is None for r in schema.returns)


def is_fresh(node: fx.Node) -> bool:
    """True when ``node``'s tensor value is newly allocated by its op: no other node's value
    shares its storage (views, ``.to`` that may return its input, ``reshape`` ... are not
    fresh)."""
    if node.op == "call_function":
        if node.target is operator.getitem:  # one result of a multi-output ATen op
            src = node.args[0]
            return (isinstance(src, fx.Node) and src.op == "call_function"
                    and isinstance(src.meta.get("val"), (tuple, list))
                    and _aten_returns_fresh(src.target))
        return node.target in _FRESH_FUNCTIONS or _aten_returns_fresh(node.target)
    if node.op == "call_method":
        return node.target in _FRESH_METHODS
    return False


def accumulate_in_place(gm: fx.GraphModule) -> int:
    """Rewrite ``c = a + b`` to ``c = a.add_(b)`` (or ``b.add_(a)``) where that operand is
    fresh (:func:`is_fresh`), read by nothing else, and already has ``c``'s shape, dtype and
    device (no broadcasting or type promotion into it).  Needs ``meta['val']`` on the nodes;
    returns the number of rewrites (and recompiles ``gm`` when there are any)."""
    n_rewrites = 0
    for n in list(gm.graph.nodes):
        if not (n.op == "call_function" and n.target in (operator.add, torch.add)
                and len(n.args) == 2 and not n.kwargs):
            continue
        out = val(n)
        for acc, other in ((n.args[0], n.args[1]), (n.args[1], n.args[0])):
            if not isinstance(acc, fx.Node) or acc is other or len(acc.users) != 1 \
                    or not is_fresh(acc):
                continue
            if not same_type(val(acc), out) or val(acc).device != out.device:
                continue
            n.op, n.target, n.args = "call_method", "add_", (acc, other)
            n_rewrites += 1
            break
    if n_rewrites:
        gm.graph.lint()
        gm.recompile()
    return n_rewrites
