"""Rewrites of the derivative graph that :func:`fxad.compile` and :func:`fxad.joint_step`
run (the code built to run; :func:`fxad.vjp` keeps the engine's form).

:func:`stack_selected_cotangents`: where a program reads every row of a tensor
(``q, k, v = proj[0], proj[1], proj[2]``, as ``F.multi_head_attention_forward`` unpacks its
packed input projection), the engine gives each read its cotangent as a zero tensor of the
whole shape with one row written (``fxad_setitem(zeros_like(proj), i, d_i)``) and sums
them.  That is one zero tensor, one copy of it per row and ``n - 1`` whole-tensor additions;
autograd's ``SelectBackward`` does the same (a zero tensor per row).  The sum is
``torch.stack([d_0, ..., d_{n-1}])``: one write of the result.
"""
from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from .. import ops
from ..graph.proxy import substitute

__all__ = ["stack_selected_cotangents"]

_ADDS = (operator.add, torch.add)


def _val(n: Any) -> Any:
    return n.meta.get("val") if isinstance(n, fx.Node) else None


def _row_write(n: Any) -> tuple[fx.Node, int, fx.Node] | None:
    """``(zeros, i, d)`` where ``n`` is ``fxad_setitem(zeros, i, d)`` with ``zeros =
    zeros_like(x)``, an integer ``i`` and ``d`` of one row's shape and dtype; else None."""
    if not (isinstance(n, fx.Node) and n.op == "call_function" and n.target is ops.setitem
            and len(n.args) == 3 and not n.kwargs and len(n.users) == 1):
        return None
    z, i, d = n.args
    if not (isinstance(z, fx.Node) and z.op == "call_function" and z.target is torch.zeros_like
            and len(z.args) == 1 and not z.kwargs and type(i) is int
            and isinstance(d, fx.Node)):
        return None
    zv, dv = _val(z), _val(d)
    if not (isinstance(zv, torch.Tensor) and isinstance(dv, torch.Tensor) and zv.dim() >= 1
            and tuple(dv.shape) == tuple(zv.shape[1:]) and dv.dtype == zv.dtype
            and dv.device == zv.device and 0 <= i < zv.shape[0]):
        return None
    return z, i, d


def _leaves(n: fx.Node, root: fx.Node, inner: list[fx.Node]) -> list[fx.Node] | None:
    """The operands of the sum tree at ``n`` (adds read only inside the tree)."""
    if n.op == "call_function" and n.target in _ADDS and len(n.args) == 2 and not n.kwargs \
            and (n is root or len(n.users) == 1):
        inner.append(n)
        out = []
        for a in n.args:
            if not isinstance(a, fx.Node):
                return None
            sub = _leaves(a, root, inner)
            if sub is None:
                return None
            out.extend(sub)
        return out
    return [n]


def stack_selected_cotangents(gm: fx.GraphModule) -> int:
    """Rewrite each sum of row writes into one zero tensor covering all its rows once (see
    the module docstring) to ``torch.stack`` of the rows; returns the number of rewrites
    (and recompiles ``gm`` when there are any).  Needs ``meta['val']`` on the nodes."""
    g = gm.graph
    done = 0
    for root in reversed(list(g.nodes)):
        if getattr(root, "_erased", False) or root.op != "call_function" \
                or root.target not in _ADDS:
            continue
        inner: list[fx.Node] = []
        leaves = _leaves(root, root, inner)
        if not leaves or len(leaves) < 2:
            continue
        writes = [_row_write(n) for n in leaves]
        if any(w is None for w in writes):
            continue
        zeros = {w[0] for w in writes}  # type: ignore[index]
        rows = {w[1]: w[2] for w in writes}  # type: ignore[index]
        if len(zeros) != 1 or len(rows) != len(writes):
            continue
        z = next(iter(zeros))
        if set(rows) != set(range(_val(z).shape[0])) or _val(root).shape != _val(z).shape \
                or _val(root).dtype != _val(z).dtype:
            continue
        items = [rows[i] for i in range(len(rows))]
        if substitute(gm, root, torch.stack, (items,), {}, [*inner, *leaves, z]):
            done += 1
    if done:
        g.lint()
        gm.recompile()
    return done
