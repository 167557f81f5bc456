"""Matrix products with a dimension that is not a multiple of 8, padded, in the code built
to run (:func:`fxad.compile`, :func:`fxad.joint_step`; :func:`fxad.vjp` keeps the products
as written).

On CUDA a half-precision (float16, bfloat16) matrix product whose sizes or leading
dimensions are not multiples of 8 elements (16 bytes) cannot use the tensor-core kernels
cuBLAS picks for aligned ones: cuBLAS falls back to kernels that read one element at a
time.  GPT-2's language-model head is such a product (vocabulary 50257): on an H200 under
bfloat16 autocast its forward and two backward products took 15.6 ms of eager PyTorch's
55.8 ms step (``benchmarks/bench_gpu.py --profile``, 2026-11-26).  Inductor pads such
products for the same reason (its ``pad_mm`` pass).

:func:`pad_unaligned_matmuls` rewrites ``F.linear(x, w[, b])``, ``torch.mm(a, b)`` and
``torch.addmm(c, a, b)`` on CUDA half-precision tensors of static shape whose product has
at least :data:`MIN_MACS` multiply-adds and whose M, N or K is not a multiple of 8: the
operands are zero-padded up to the next multiple (``F.pad``), the product runs on the
padded operands, and its result is narrowed back (``narrow``, a view).  Zero rows and
columns add nothing to the sums, so the values are those of the unpadded product (the
kernels may accumulate in another order: float rounding).  A padded operand is made once
and shared: the weight of a linear layer is padded once for its forward and backward
products; a transposed operand (``x.t()``) is padded through the transpose, so that the
backward's ``d.t() @ h`` and ``d @ w`` read one padded copy of ``d``.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..graph.proxy import compute_meta

__all__ = ["pad_unaligned_matmuls", "MIN_MACS", "PAD_DEVICE_TYPES"]

#: products smaller than this many multiply-adds are left alone (the copies would cost more)
MIN_MACS = 1 << 30
#: device types whose products are padded (a test pads CPU products to check the rewrite)
PAD_DEVICE_TYPES: tuple[str, ...] = ("cuda",)
_ALIGN = 8
_HALF = (torch.float16, torch.bfloat16)
_TRANSPOSES = ("t", "transpose")


def _val(n: Any) -> Any:
    return n.meta.get("val") if isinstance(n, fx.Node) else None


def _eligible(*tensors: Any) -> bool:
    vals = [_val(t) for t in tensors]
    return all(isinstance(v, torch.Tensor) and v.dtype in _HALF and v.layout == torch.strided
               and v.device.type in PAD_DEVICE_TYPES
               and all(type(s) is int for s in v.shape) for v in vals)


def _up(n: int) -> int:
    return (-n) % _ALIGN


class _Padder:
    """Padded copies of graph values, made once each (memoized by value and padding)."""

    def __init__(self, gm: fx.GraphModule) -> None:
        self.gm = gm
        self.memo: dict[tuple[fx.Node, tuple[int, ...]], fx.Node] = {}

    def _node(self, before: fx.Node, target: Any, args: tuple, meta_from: fx.Node,
              kind: str = "call_function") -> fx.Node:
        v = compute_meta(self.gm, kind, target, args, {})
        if before.op == "placeholder":  # after the inputs, not among them
            before = [n for n in self.gm.graph.nodes if n.op == "placeholder"][-1]
        with self.gm.graph.inserting_after(before):
            n = self.gm.graph.create_node(kind, target, args, {})
        n.meta = {k: w for k, w in meta_from.meta.items() if k == "fxad_loc"}
        n.meta["val"] = v
        return n

    def pad(self, x: fx.Node, rows: int, cols: int) -> fx.Node:
        """``x`` (2-D) with ``rows`` zero rows and ``cols`` zero columns appended."""
        if not rows and not cols:
            return x
        key = (x, (rows, cols))
        if key in self.memo:
            return self.memo[key]
        if x.op in ("call_method", "call_function") and _is_transpose(x):
            src = x.args[0]
            inner = self.pad(src, cols, rows)
            out = self._node(inner, "t", (inner,), x, kind="call_method")
        else:
            out = self._node(x, F.pad, (x, (0, cols, 0, rows)), x)
        self.memo[key] = out
        return out

    def pad_last(self, x: fx.Node, cols: int) -> fx.Node:
        """``x`` (any rank) with ``cols`` zero columns appended to its last dimension."""
        if not cols:
            return x
        if _val(x).dim() == 2:
            return self.pad(x, 0, cols)
        key = (x, (-1, cols))
        if key not in self.memo:
            self.memo[key] = self._node(x, F.pad, (x, (0, cols)), x)
        return self.memo[key]


def _is_transpose(n: fx.Node) -> bool:
    """``x.t()`` / ``torch.t(x)`` / ``x.transpose(0, 1)`` of a 2-D ``x``."""
    if not n.args or not isinstance(n.args[0], fx.Node):
        return False
    v = _val(n.args[0])
    if not (isinstance(v, torch.Tensor) and v.dim() == 2):
        return False
    if n.op == "call_method":
        return n.target == "t" and len(n.args) == 1 or (
            n.target == "transpose" and sorted(d % 2 for d in n.args[1:]) == [0, 1])
    return n.target is torch.t and len(n.args) == 1


def _needs_layout(user: fx.Node) -> bool:
    """``user`` depends on the layout of what it reads, not only on its values: the graph's
    output (the caller's tensors, contiguous as eager returns them), a layout guard of the
    rules (:func:`fxad.rules._base.expect_layout`), ``view`` / ``as_strided``."""
    if user.op == "output":
        return True
    if user.op == "call_method":
        return user.target in ("view", "as_strided")
    return user.op == "call_function" and (
        user.target is torch.as_strided
        or getattr(user.target, "__name__", "") == "expect_layout")


def _narrow(p: _Padder, n: fx.Node, out_dims: list[tuple[int, int]]) -> None:
    """Replace the uses of the product ``n`` (now computed padded) by its narrowed view (a
    contiguous copy of it for the users of :func:`_needs_layout`)."""
    users = list(n.users)
    last = n
    for dim, size in out_dims:
        last = p._node(last, "narrow", (last, dim, 0, size), n, kind="call_method")
    dense = None
    for u in users:
        if _needs_layout(u) and not _val(last).is_contiguous():
            if dense is None:
                dense = p._node(last, "contiguous", (last,), n, kind="call_method")
            u.replace_input_with(n, dense)
        else:
            u.replace_input_with(n, last)


def pad_unaligned_matmuls(gm: fx.GraphModule) -> int:
    """Pad the unaligned half-precision products of ``gm`` (see the module docstring) and
    return how many were rewritten (recompiling ``gm`` when there are any).  Needs
    ``meta['val']`` on the operands."""
    g = gm.graph
    p = _Padder(gm)
    done = 0
    for n in list(g.nodes):
        if n.op != "call_function" or n.kwargs:
            continue
        if n.target is F.linear and 2 <= len(n.args) <= 3:
            x, w = n.args[0], n.args[1]
            b = n.args[2] if len(n.args) == 3 else None
            if not (isinstance(x, fx.Node) and isinstance(w, fx.Node) and _eligible(x, w)
                    and (b is None or isinstance(b, fx.Node) and _eligible(b))
                    and _val(w).dim() == 2 and _val(x).dim() >= 1):
                continue
            N, K = _val(w).shape
            M = math.prod(_val(x).shape[:-1])
            pn, pk = _up(N), _up(K)
            if not (pn or pk) or M * N * K < MIN_MACS:
                continue
            args = [p.pad_last(x, pk), p.pad(w, pn, pk)]
            if b is not None:
                args.append(p.pad_last(b, pn))
            out_dims = [(_val(n).dim() - 1, N)] if pn else []
        elif n.target in (torch.mm, torch.addmm):
            c, a, bb = (None, *n.args) if n.target is torch.mm else n.args
            if not (isinstance(a, fx.Node) and isinstance(bb, fx.Node) and _eligible(a, bb)
                    and _val(a).dim() == 2 and _val(bb).dim() == 2
                    and (c is None or isinstance(c, fx.Node) and _eligible(c)
                         and _val(c).dim() == 1)):
                continue
            (M, K), N = _val(a).shape, _val(bb).shape[1]
            pm, pn, pk = _up(M), _up(N), _up(K)
            if not (pm or pn or pk) or M * N * K < MIN_MACS:
                continue
            args = [p.pad(a, pm, pk), p.pad(bb, pk, pn)]
            if c is not None:
                args.insert(0, p.pad_last(c, pn))
            out_dims = [(d, s) for d, s, pad in ((0, M, pm), (1, N, pn)) if pad]
        else:
            continue
        n.args = tuple(args)
        n.meta["val"] = compute_meta(gm, "call_function", n.target, n.args, {})
        if out_dims:
            _narrow(p, n, out_dims)
        done += 1
    if done:
        g.lint()
        gm.recompile()
    return done
