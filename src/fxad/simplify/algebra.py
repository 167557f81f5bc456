"""Zero/one propagation: ``t + 0``, ``0 + t``, ``t - 0``, ``0 - t``, ``t * 1``, ``1 * t``,
``t / 1``, ``t ** 1``, ``-(-t)``, ``a + (-b)`` → ``a - b``.

A zero/one operand is a Python ``0``/``1`` or a ``torch.zeros_like``/``torch.ones_like`` (or
``zeros``/``ones``) node.  A rewrite is made only when the replacement has exactly the
node's shape and dtype, so broadcasting and type promotion are never changed.
"""
from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from ..graph.proxy import compute_meta, take_name
from ._util import replace, same_type, val

_ZERO_FACTORIES = (torch.zeros_like, torch.zeros)
_ONE_FACTORIES = (torch.ones_like, torch.ones)


def _is_const(x: Any, c: float) -> bool:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        if isinstance(x, fx.Node) and x.op == "call_function":
            if c == 0 and x.target in _ZERO_FACTORIES:
                return True
            if c == 1 and x.target in _ONE_FACTORIES:
                return True
            if x.target is torch.full_like and len(x.args) > 1 and _is_const(x.args[1], c):
                return True
        return False
    return x == c


def _is_neg(x: Any) -> bool:
    return isinstance(x, fx.Node) and x.op == "call_function" and x.target is operator.neg


def _try(node: fx.Node, new: Any) -> bool:
    if isinstance(new, fx.Node) and same_type(val(node), val(new)):
        replace(node, new)
        return True
    return False


def _rewrite(node: fx.Node, target: Any, args: tuple) -> bool:
    try:
        v = compute_meta(None, "call_function", target, args, {})
    except Exception:
        return False
    if not same_type(v, val(node)):
        return False
    with node.graph.inserting_before(node):
        new = node.graph.call_function(target, args)
    new.meta = dict(node.meta)
    new.meta["val"] = v
    name = node.name
    replace(node, new)
    take_name(new, name)
    return True


def fold_algebra(graph: fx.Graph) -> int:
    """One sweep of zero/one rewrites; returns how many nodes were replaced."""
    n = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.kwargs:
            continue
        t, args = node.target, node.args
        if t is operator.add and len(args) == 2:
            a, b = args
            if (_is_const(b, 0) and _try(node, a)) or (_is_const(a, 0) and _try(node, b)):
                n += 1
            elif _is_neg(b) and _rewrite(node, operator.sub, (a, b.args[0])):
                n += 1
            elif _is_neg(a) and _rewrite(node, operator.sub, (b, a.args[0])):
                n += 1
        elif t is operator.sub and len(args) == 2:
            a, b = args
            if _is_const(b, 0) and _try(node, a):
                n += 1
            elif _is_const(a, 0) and isinstance(b, fx.Node) and _rewrite(node, operator.neg, (b,)):
                n += 1
            elif _is_neg(b) and _rewrite(node, operator.add, (a, b.args[0])):
                n += 1
        elif t is operator.mul and len(args) == 2:
            a, b = args
            if (_is_const(b, 1) and _try(node, a)) or (_is_const(a, 1) and _try(node, b)):
                n += 1
            elif _is_neg(a) and _is_neg(b) and _rewrite(node, operator.mul,
                                                        (a.args[0], b.args[0])):
                n += 1
        elif t is operator.truediv and len(args) == 2:
            if _is_const(args[1], 1) and _try(node, args[0]):
                n += 1
        elif t in (operator.pow, torch.pow) and len(args) == 2:
            if _is_const(args[1], 1) and _try(node, args[0]):
                n += 1
        elif t is operator.neg and len(args) == 1:
            if _is_neg(args[0]) and _try(node, args[0].args[0]):
                n += 1
    return n
