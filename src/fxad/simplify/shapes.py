"""Redundant shape-op folding.

* no-ops: ``reshape``/``expand``/``sum_to_size`` to the same shape, ``.to`` the same dtype,
  ``contiguous`` of an input whose (fake) strides are already contiguous;
* inverse pairs: ``transpose(transpose(x))``, ``t(t(x))``, ``squeeze(unsqueeze(x, d), d)``,
  ``permute(permute(x, p), q)``, ``reshape(reshape(x, a), b)`` → ``reshape(x, b)``;
* an ``expand`` consumed by broadcasting arithmetic is dropped (``d.expand(s) * y`` →
  ``d * y`` when the product keeps its shape and dtype).
"""
from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from ..graph.proxy import compute_meta, take_name
from ._util import replace, same_type, val

_BROADCASTING = {operator.add, operator.sub, operator.mul, operator.truediv, torch.where}


def _is(node: Any, target: Any) -> bool:
    if not isinstance(node, fx.Node):
        return False
    if isinstance(target, str):
        return node.op == "call_method" and node.target == target
    return node.op == "call_function" and node.target is target


def _is_op(node: Any, fn: Any) -> bool:
    """``node`` calls ``fn`` as a function or as the same-named tensor method."""
    return _is(node, fn) or _is(node, fn.__name__)


def _sizes(args: tuple) -> tuple:
    rest = args[1:]
    if len(rest) == 1 and isinstance(rest[0], (tuple, list, torch.Size)):
        return tuple(rest[0])
    return tuple(rest)


def _noop(node: fx.Node) -> bool:
    x = node.args[0] if node.args else None
    if not isinstance(x, fx.Node) or not same_type(val(node), val(x)):
        return False
    if _is(node, "contiguous"):  # strides matter to view ops (view, view_as_complex)
        v = val(x)
        return not node.kwargs and isinstance(v, torch.Tensor) and v.is_contiguous()
    if _is(node, torch.reshape) or _is(node, "expand") or _is(node, "sum_to_size"):
        return not node.kwargs
    if _is(node, "to"):
        return len(node.args) == 2 and isinstance(node.args[1], torch.dtype) and not node.kwargs
    return False


def _inverse_pair(node: fx.Node) -> Any:
    x = node.args[0] if node.args else None
    if not isinstance(x, fx.Node) or len(x.users) < 1:
        return None
    if _is_op(node, torch.transpose) and _is_op(x, torch.transpose):
        a, b = sorted(d % x.args[0].meta["val"].dim() for d in node.args[1:3])
        c, d = sorted(k % x.args[0].meta["val"].dim() for k in x.args[1:3])
        if (a, b) == (c, d):
            return x.args[0]
    if _is_op(node, torch.t) and _is_op(x, torch.t):
        return x.args[0]
    if _is_op(node, torch.squeeze) and _is_op(x, torch.unsqueeze) and len(node.args) == 2 \
            and node.args[1] == x.args[1]:
        return x.args[0]
    return None


def _merge(node: fx.Node) -> tuple | None:
    """(target, args) of a single op equal to ``node`` ∘ its input, or None."""
    x = node.args[0] if node.args else None
    if _is(node, torch.reshape) and _is(x, torch.reshape):
        return torch.reshape, (x.args[0], node.args[1])
    if _is(node, torch.permute) and _is(x, torch.permute):
        p, q = tuple(x.args[1]), tuple(node.args[1])
        combined = tuple(p[i] for i in q)
        return torch.permute, (x.args[0], combined)
    return None


def fold_shapes(graph: fx.Graph) -> int:
    """One sweep of shape-op folding; returns the number of rewrites."""
    n = 0
    for node in list(graph.nodes):
        if node.op not in ("call_function", "call_method"):
            continue
        if _noop(node):
            replace(node, node.args[0])
            n += 1
            continue
        inv = _inverse_pair(node)
        if inv is not None and same_type(val(inv), val(node)):
            replace(node, inv)
            n += 1
            continue
        merged = _merge(node)
        if merged is not None:
            target, args = merged
            base = args[0]
            if target is torch.permute and tuple(args[1]) == tuple(range(len(args[1]))) \
                    and same_type(val(base), val(node)):
                replace(node, base)
                n += 1
                continue
            v = compute_meta(None, "call_function", target, args, {})
            if same_type(v, val(node)):
                with graph.inserting_before(node):
                    new = graph.call_function(target, args)
                new.meta = dict(node.meta)
                new.meta["val"] = v
                name = node.name
                replace(node, new)
                take_name(new, name)
                n += 1
                continue
        if _is(node, "expand"):
            n += _absorb_expand(node)
    return n


def _absorb_expand(node: fx.Node) -> int:
    src = node.args[0]
    if not isinstance(src, fx.Node):
        return 0
    n = 0
    for user in list(node.users):
        if user.op != "call_function" or user.target not in _BROADCASTING or user.kwargs:
            continue
        new_args = tuple(src if a is node else a for a in user.args)
        try:
            v = compute_meta(None, "call_function", user.target, new_args, {})
        except Exception:
            continue
        if same_type(v, val(user)):
            user.args = new_args
            n += 1
    return n
