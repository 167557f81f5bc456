"""More shape and indexing ops, and a few elementwise functions: ``narrow``, ``select``,
``diag``/``diagonal``/``diag_embed``/``diagflat``, ``*_scatter``, ``roll``, ``rot90``,
``fliplr``/``flipud``, ``unflatten``/``ravel``, ``tile``, ``broadcast_to``/
``broadcast_tensors``, ``hstack``/``vstack``/``dstack``/``column_stack``, the split
variants, ``take``/``take_along_dim``, ``index_copy``/``index_fill``, ``Tensor.unfold``,
``block_diag``, ``diff``, the ``*_copy`` view variants, and ``rsub``, ``nan_to_num``,
``logit``, ``angle``, ``fill``, ``polygamma``, ``mvlgamma``, ``special.i1``/``i1e``/``entr``.

A view's backward writes the cotangent back into zeros of the input's shape with the
matching ``*_scatter`` op, or applies the inverse permutation (derivatives.yaml entries named
in each rule).  Broadcast cotangents are reduced by the engine.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from ._base import builtin, randn, uniform
from .registry import add_rule


def _t(shape: tuple, dtype: torch.dtype, lo: float = -2.0, hi: float = 2.0) -> torch.Tensor:
    return uniform(shape, lo, hi, dtype)


def _pieces(out: Any, d: Any) -> list:
    """Cotangents of a tuple output with zeros for the unused pieces."""
    return [c if c is not None else torch.zeros_like(out[i]) for i, c in enumerate(d)]


@builtin(torch.narrow)
class Narrow:
    """narrow(x, dim, start, length): d_x = slice_scatter(zeros, d, dim, start, start + length)
    (derivatives.yaml `narrow` via `slice`: slice_backward).  A 0-d tensor ``start`` (read at
    run time): d_x = index_add(zeros, dim, (arange(length) + start) mod size, d)."""

    def fwd(input, dim, start, length):
        return torch.narrow(input, dim, start, length), (input, dim, start, length)

    def bwd(aux, d):
        x, dim, start, length = aux
        if not isinstance(start, int):  # a tensor (a proxy while the backward is built)
            size = x.shape[dim]
            idx = torch.remainder(torch.arange(length, device=x.device) + start, size)
            return (torch.index_add(torch.zeros_like(x), dim, idx, d), None)
        start = start % x.shape[dim] if start < 0 else start
        return (torch.slice_scatter(torch.zeros_like(x), d, dim, start, start + length),)

    def jvp(primals, tangents):
        x, dim, start, length = primals
        t = tangents[0]
        return (torch.narrow(x, dim, start, length),
                None if t is None else torch.narrow(t, dim, start, length))

    def samples(dtype):
        yield (randn(4, 5, dtype=dtype), 1, 1, 3), {}
        yield (randn(4, 5, dtype=dtype), 0, -2, 2), {}
        yield (randn(4, 5, dtype=dtype), 1, torch.tensor(2), 3), {}
        yield (randn(4, 5, dtype=dtype), -1, torch.tensor(-3), 2), {}


@builtin(torch.narrow_copy)
class NarrowCopy:
    """narrow_copy(x, dim, start, length): d_x = slice_scatter(zeros, d, dim, start,
    start + length) (derivatives.yaml `narrow_copy`)."""

    def fwd(input, dim, start, length):
        return torch.narrow_copy(input, dim, start, length), (input, dim, start, length)

    def bwd(aux, d):
        return Narrow.bwd(aux, d)

    def samples(dtype):
        yield (randn(4, 5, dtype=dtype), 1, 1, 3), {}


@builtin(torch.select)
class Select:
    """select(x, dim, i): d_x = select_scatter(zeros, d, dim, i) (derivatives.yaml
    `select.int`: select_backward)."""

    def fwd(input, dim, index):
        return torch.select(input, dim, index), (input, dim, index)

    def bwd(aux, d):
        x, dim, index = aux
        return (torch.select_scatter(torch.zeros_like(x), d, dim, index),)

    def jvp(primals, tangents):
        x, dim, index = primals
        t = tangents[0]
        return torch.select(x, dim, index), (None if t is None else torch.select(t, dim, index))

    def samples(dtype):
        yield (randn(4, 5, dtype=dtype), 1, 2), {}
        yield (randn(4, 5, dtype=dtype), 0, -1), {}


@builtin(torch.select_scatter)
class SelectScatter:
    """select_scatter(x, src, dim, i): d_x = select_scatter(d, 0, dim, i),
    d_src = select(d, dim, i) (derivatives.yaml `select_scatter`)."""

    def fwd(input, src, dim, index):
        return torch.select_scatter(input, src, dim, index), (src, dim, index)

    def bwd(aux, d):
        src, dim, index = aux
        return (torch.select_scatter(d, torch.zeros_like(src), dim, index),
                torch.select(d, dim, index))

    def samples(dtype):
        yield (randn(4, 5, dtype=dtype), randn(5, dtype=dtype), 0, 1), {}


def _slice_index(ndim: int, dim: int, start: Any, end: Any, step: int) -> tuple:
    return (slice(None),) * (dim % ndim) + (slice(start, end, step),)


@builtin(torch.slice_scatter)
class SliceScatter:
    """slice_scatter(x, src, dim, start, end, step): d_x = slice_scatter(d, 0, ...),
    d_src = d[..., start:end:step] (derivatives.yaml `slice_scatter`)."""

    def fwd(input, src, dim=0, start=None, end=None, step=1):
        out = torch.slice_scatter(input, src, dim, start, end, step)
        return out, (src, dim, start, end, step)

    def bwd(aux, d):
        src, dim, start, end, step = aux
        return (torch.slice_scatter(d, torch.zeros_like(src), dim, start, end, step),
                d[_slice_index(d.dim(), dim, start, end, step)])

    def samples(dtype):
        yield (randn(4, 6, dtype=dtype), randn(4, 2, dtype=dtype), 1, 1, 5, 2), {}


@builtin(torch.diagonal_scatter)
class DiagonalScatter:
    """diagonal_scatter(x, src, offset, dim1, dim2): d_x = diagonal_scatter(d, 0, ...),
    d_src = diagonal(d, ...) (derivatives.yaml `diagonal_scatter`)."""

    def fwd(input, src, offset=0, dim1=0, dim2=1):
        out = torch.diagonal_scatter(input, src, offset, dim1, dim2)
        return out, (src, offset, dim1, dim2)

    def bwd(aux, d):
        src, offset, dim1, dim2 = aux
        return (torch.diagonal_scatter(d, torch.zeros_like(src), offset, dim1, dim2),
                torch.diagonal(d, offset, dim1, dim2))

    def samples(dtype):
        yield (randn(4, 5, dtype=dtype), randn(4, dtype=dtype), 1), {}


def _diagonal_rule(op: Any, kw_only: bool, defaults: tuple, name: str) -> None:
    o0, a0, b0 = defaults

    def bwd(aux, d):
        x, offset, dim1, dim2 = aux
        return (torch.diagonal_scatter(torch.zeros_like(x), d, offset, dim1, dim2),)

    if kw_only:
        def fwd(A, *, offset=o0, dim1=a0, dim2=b0):
            return op(A, offset=offset, dim1=dim1, dim2=dim2), (A, offset, dim1, dim2)
    else:
        def fwd(input, offset=o0, dim1=a0, dim2=b0):
            return op(input, offset, dim1, dim2), (input, offset, dim1, dim2)

    def jvp(primals, tangents):
        x, offset, dim1, dim2 = primals
        t = tangents[0]
        return (torch.diagonal(x, offset, dim1, dim2),
                None if t is None else torch.diagonal(t, offset, dim1, dim2))

    def samples(dtype):
        yield (randn(4, 5, dtype=dtype),), {}
        yield (randn(2, 4, 5, dtype=dtype),), {"offset": -1, "dim1": 1, "dim2": 2}

    add_rule(op, fwd, bwd, jvp=jvp, samples=samples, builtin=True,
             source=f"{name}(x, offset, dim1, dim2): d_x = diagonal_scatter(zeros, d, offset, "
                    "dim1, dim2) (derivatives.yaml `diagonal`: diagonal_backward)")


_diagonal_rule(torch.diagonal, False, (0, 0, 1), "diagonal")
_diagonal_rule(torch.diagonal_copy, False, (0, 0, 1), "diagonal_copy")
_diagonal_rule(torch.linalg.diagonal, True, (0, -2, -1), "linalg.diagonal")


@builtin(torch.diag_embed)
class DiagEmbed:
    """diag_embed(x, offset, dim1, dim2): d_x = diagonal(d, offset, dim1, dim2)
    (derivatives.yaml `diag_embed`)."""

    def fwd(input, offset=0, dim1=-2, dim2=-1):
        return torch.diag_embed(input, offset, dim1, dim2), (offset, dim1, dim2)

    def bwd(aux, d):
        return (torch.diagonal(d, *aux),)

    def samples(dtype):
        yield (randn(2, 3, dtype=dtype),), {}
        yield (randn(2, 3, dtype=dtype), 1, 0, 2), {}


@builtin(torch.diag)
class Diag:
    """diag(x, k): a 1-d x is embedded (d_x = diagonal(d, k)); a 2-d x has its diagonal read
    (d_x = diagonal_scatter(zeros, d, k)) (derivatives.yaml `diag` via `diag_embed`/
    `diagonal`)."""

    def fwd(input, diagonal=0):
        return torch.diag(input, diagonal), (input, diagonal)

    def bwd(aux, d):
        x, k = aux
        if x.dim() == 1:
            return (torch.diagonal(d, k),)
        return (torch.diagonal_scatter(torch.zeros_like(x), d, k),)

    def samples(dtype):
        yield (randn(4, dtype=dtype),), {}
        yield (randn(4, 5, dtype=dtype), 1), {}
        yield (randn(4, 3, dtype=dtype), -1), {}


@builtin(torch.diagflat)
class Diagflat:
    """diagflat(x, k) = diag(x.flatten(), k): d_x = diagonal(d, k) reshaped to x
    (derivatives.yaml via `diag_embed`)."""

    def fwd(input, offset=0):
        return torch.diagflat(input, offset), (tuple(input.shape), offset)

    def bwd(aux, d):
        shape, k = aux
        return (torch.reshape(torch.diagonal(d, k), shape),)

    def samples(dtype):
        yield (randn(2, 3, dtype=dtype), 1), {}


@builtin(torch.roll)
class Roll:
    """roll(x, shifts, dims): d_x = roll(d, -shifts, dims) (derivatives.yaml `roll`)."""

    def fwd(input, shifts, dims=()):
        return torch.roll(input, shifts, dims), (shifts, dims)

    def bwd(aux, d):
        shifts, dims = aux
        neg = -shifts if isinstance(shifts, int) else [-s for s in shifts]
        return (torch.roll(d, neg, dims),)

    def samples(dtype):
        yield (randn(3, 4, dtype=dtype), 1), {}
        yield (randn(3, 4, dtype=dtype), (1, -3), (0, 1)), {}


@builtin(torch.rot90)
class Rot90:
    """rot90(x, k, dims): d_x = rot90(d, -k, dims) (derivatives.yaml `rot90`)."""

    def fwd(input, k=1, dims=(0, 1)):
        return torch.rot90(input, k, dims), (k, dims)

    def bwd(aux, d):
        k, dims = aux
        return (torch.rot90(d, -k, dims),)

    def samples(dtype):
        yield (randn(3, 4, dtype=dtype),), {}
        yield (randn(2, 3, 4, dtype=dtype), 3, (2, 0)), {}


def _flip_rule(op: Any, dim: int, name: str) -> None:
    def fwd(input):
        return op(input), None

    def bwd(aux, d):
        return (op(d),)

    def samples(dtype):
        yield (randn(3, 4, dtype=dtype),), {}

    add_rule(op, fwd, bwd, samples=samples, builtin=True,
             source=f"{name}(x) = flip(x, [{dim}]), its own inverse: d_x = {name}(d) "
                    "(derivatives.yaml `flip`)")


_flip_rule(torch.fliplr, 1, "fliplr")
_flip_rule(torch.flipud, 0, "flipud")


def _reshape_back(op: Any, fwd: Any, name: str, samples: Any) -> None:
    """An op that only rearranges elements in row-major order: d_x = d.reshape(x.shape)."""

    def bwd(aux, d):
        return (torch.reshape(d, aux),)

    add_rule(op, fwd, bwd, samples=samples, builtin=True,
             source=f"{name}: a reshape; d_x = reshape(d, x.shape) (derivatives.yaml "
                    "`view`/`_reshape_alias`)")


_reshape_back(torch.unflatten,
              lambda input, dim, sizes: (torch.unflatten(input, dim, sizes), tuple(input.shape)),
              "unflatten", lambda dt: iter([((randn(3, 4, dtype=dt), 1, (2, 2)), {})]))
_reshape_back(torch.ravel, lambda input: (torch.ravel(input), tuple(input.shape)),
              "ravel", lambda dt: iter([((randn(3, 4, dtype=dt),), {})]))
_reshape_back(torch.view_copy,
              lambda input, size: (torch.view_copy(input, size), tuple(input.shape)),
              "view_copy", lambda dt: iter([((randn(3, 4, dtype=dt), (2, 6)), {})]))
_reshape_back(torch.squeeze_copy,
              lambda input, dim=None: (torch.squeeze_copy(input) if dim is None else
                                       torch.squeeze_copy(input, dim), tuple(input.shape)),
              "squeeze_copy", lambda dt: iter([((randn(3, 1, 4, dtype=dt),), {})]))
_reshape_back(torch.unsqueeze_copy,
              lambda input, dim: (torch.unsqueeze_copy(input, dim), tuple(input.shape)),
              "unsqueeze_copy", lambda dt: iter([((randn(3, 4, dtype=dt), 1), {})]))
_reshape_back(torch.alias_copy, lambda input: (torch.alias_copy(input), tuple(input.shape)),
              "alias_copy", lambda dt: iter([((randn(3, 4, dtype=dt),), {})]))


@builtin(torch.permute_copy)
class PermuteCopy:
    """permute_copy(x, dims): d_x = permute(d, inverse(dims)) (derivatives.yaml `permute`)."""

    def fwd(input, dims):
        n = input.dim()
        return torch.permute_copy(input, dims), [d % n for d in dims]

    def bwd(aux, d):
        inv = [0] * len(aux)
        for i, p in enumerate(aux):
            inv[p] = i
        return (torch.permute(d, inv),)

    def samples(dtype):
        yield (randn(2, 3, 4, dtype=dtype), (2, 0, 1)), {}


@builtin(torch.transpose_copy)
class TransposeCopy:
    """transpose_copy(x, a, b): d_x = transpose(d, a, b) (derivatives.yaml `transpose`)."""

    def fwd(input, dim0, dim1):
        return torch.transpose_copy(input, dim0, dim1), (dim0, dim1)

    def bwd(aux, d):
        return (torch.transpose(d, *aux),)

    def samples(dtype):
        yield (randn(2, 3, 4, dtype=dtype), 0, 2), {}


@builtin(torch.t_copy)
class TCopy:
    """t_copy(x): d_x = t(d) (derivatives.yaml `t`)."""

    def fwd(input):
        return torch.t_copy(input), None

    def bwd(aux, d):
        return (torch.t(d),)

    def samples(dtype):
        yield (randn(3, 4, dtype=dtype),), {}


@builtin(torch.expand_copy)
class ExpandCopy:
    """expand_copy(x, size): d_x = d (summed to x's shape by the engine) (derivatives.yaml
    `expand`)."""

    def fwd(input, size, *, implicit=False):
        return torch.expand_copy(input, size), None

    def bwd(aux, d):
        return (d,)

    def samples(dtype):
        yield (randn(3, 1, dtype=dtype), (2, 3, 4)), {}


@builtin(torch.broadcast_to)
class BroadcastTo:
    """broadcast_to(x, size): d_x = d (summed to x's shape by the engine) (derivatives.yaml
    `expand`)."""

    def fwd(input, size):
        return torch.broadcast_to(input, size), None

    def bwd(aux, d):
        return (d,)

    def jvp(primals, tangents):
        x, size = primals
        t = tangents[0]
        return torch.broadcast_to(x, size), (None if t is None else torch.broadcast_to(t, size))

    def samples(dtype):
        yield (randn(3, 1, dtype=dtype), (2, 3, 4)), {}


@builtin(torch.broadcast_tensors)
class BroadcastTensors:
    """broadcast_tensors(*xs): d_x_i = d_i (summed to x_i's shape by the engine)
    (derivatives.yaml `expand`)."""

    def fwd(*tensors):
        return torch.broadcast_tensors(*tensors), len(tensors)

    def bwd(aux, d):
        return {"tensors": tuple(d)}

    def samples(dtype):
        yield (randn(3, 1, dtype=dtype), randn(4, dtype=dtype)), {}


@builtin(torch.tile)
class Tile:
    """tile(x, reps): with x padded to len(reps) dims and d viewed as (r0, s0, r1, s1, ...),
    d_x = sum of d over the r axes (derivatives.yaml `repeat`: repeat_backward)."""

    def fwd(input, dims):
        return torch.tile(input, dims), (tuple(input.shape), tuple(dims))

    def bwd(aux, d):
        shape, reps = aux
        n = max(len(shape), len(reps))
        s = (1,) * (n - len(shape)) + shape
        r = (1,) * (n - len(reps)) + reps
        dr = torch.reshape(d, [v for pair in zip(r, s) for v in pair])
        return (torch.reshape(torch.sum(dr, list(range(0, 2 * n, 2))), shape),)

    def samples(dtype):
        yield (randn(3, 4, dtype=dtype), (2,)), {}
        yield (randn(3, dtype=dtype), (2, 1, 3)), {}


# --- stacks and splits ----------------------------------------------------------------------

def _stack_rule(op: Any, name: str, arrange: Any, cat_dim: Any) -> None:
    """``op(tensors) = cat([arrange(x) for x in tensors], cat_dim(tensors))``."""

    def fwd(tensors, *, out=None):
        shapes = [tuple(x.shape) for x in tensors]
        return op(tensors), shapes

    def bwd(aux, d):
        shapes = aux
        arranged = [arrange(s) for s in shapes]
        dim = cat_dim(arranged)
        pieces = torch.split(d, [a[dim] for a in arranged], dim)
        return ([torch.reshape(p, s) for p, s in zip(pieces, shapes)],)

    def samples(dtype):
        yield ([randn(3, 2, dtype=dtype), randn(3, 2, dtype=dtype)],), {}
        yield ([randn(3, dtype=dtype), randn(3, dtype=dtype)],), {}

    add_rule(op, fwd, bwd, samples=samples, builtin=True,
             source=f"{name}: a cat of reshaped inputs; d_x_i = the matching split of d, "
                    "reshaped to x_i (derivatives.yaml `cat`)")


def _at1(s):
    return s if len(s) >= 1 else (1,)


def _at2(s):
    return s if len(s) >= 2 else (1, 1) if len(s) == 0 else (1,) + s


def _at3(s):
    if len(s) >= 3:
        return s
    return {0: (1, 1, 1), 1: (1,) + s + (1,), 2: s + (1,)}[len(s)]


def _col(s):
    return s if len(s) >= 2 else ((s[0] if s else 1), 1)


_stack_rule(torch.hstack, "hstack", _at1, lambda a: 0 if len(a[0]) == 1 else 1)
_stack_rule(torch.vstack, "vstack", _at2, lambda a: 0)
_stack_rule(torch.row_stack, "row_stack", _at2, lambda a: 0)
_stack_rule(torch.dstack, "dstack", _at3, lambda a: 2)
_stack_rule(torch.column_stack, "column_stack", _col, lambda a: 1)


def _split_rule(op: Any, name: str, dim_of: Any, fwd: Any, samples: Any) -> None:
    def bwd(aux, d):
        out, dim = aux
        return (torch.cat(_pieces(out, d), dim),)

    add_rule(op, fwd, bwd, samples=samples, builtin=True,
             source=f"{name}: d_x = cat of the pieces' cotangents (zeros for unused pieces) "
                    "(derivatives.yaml `split`: split_backward)")


def _split_fwd_factory(op, dim_of):
    def fwd(input, indices_or_sections):
        out = op(input, indices_or_sections)
        return out, (out, dim_of(input))
    return fwd


def _sec_samples(dt):
    yield (randn(4, 6, 2, dtype=dt), 2), {}
    yield (randn(4, 6, 2, dtype=dt), [1, 3]), {}


_split_rule(torch.hsplit, "hsplit", None,
            _split_fwd_factory(torch.hsplit, lambda x: 1 if x.dim() > 1 else 0), _sec_samples)
_split_rule(torch.vsplit, "vsplit", None, _split_fwd_factory(torch.vsplit, lambda x: 0),
            _sec_samples)
_split_rule(torch.dsplit, "dsplit", None, _split_fwd_factory(torch.dsplit, lambda x: 2),
            _sec_samples)


def _sws_fwd(input, split_sizes, dim=0):
    out = torch.split_with_sizes(input, split_sizes, dim)
    return out, (out, dim)


def _us_fwd(input, split_size, dim=0):
    out = torch.unsafe_split(input, split_size, dim)
    return out, (out, dim)


def _uc_fwd(input, chunks, dim=0):
    out = torch.unsafe_chunk(input, chunks, dim)
    return out, (out, dim)


_split_rule(torch.split_with_sizes, "split_with_sizes", None, _sws_fwd,
            lambda dt: iter([((randn(5, 3, dtype=dt), [2, 3]), {})]))
_split_rule(torch.unsafe_split, "unsafe_split", None, _us_fwd,
            lambda dt: iter([((randn(5, 3, dtype=dt), 2), {})]))
_split_rule(torch.unsafe_chunk, "unsafe_chunk", None, _uc_fwd,
            lambda dt: iter([((randn(5, 3, dtype=dt), 2, 1), {})]))


@builtin(torch.unbind_copy)
class UnbindCopy:
    """unbind_copy(x, dim): d_x = stack of the pieces' cotangents (zeros for unused ones)
    (derivatives.yaml `unbind`: unbind_backward)."""

    def fwd(input, dim=0):
        out = torch.unbind_copy(input, dim)
        return out, (out, dim)

    def bwd(aux, d):
        out, dim = aux
        return (torch.stack(_pieces(out, d), dim),)

    def samples(dtype):
        yield (randn(3, 4, dtype=dtype), 1), {}


@builtin(torch.block_diag)
class BlockDiag:
    """block_diag(*xs): d_x_i = the i-th diagonal block of d (0-d/1-d inputs are 1x1 / 1xn
    blocks) (derivatives.yaml `block_diag`: block_diag_backward)."""

    def fwd(*tensors):
        return torch.block_diag(*tensors), [tuple(t.shape) for t in tensors]

    def bwd(aux, d):
        r = c = 0
        cts = []
        for s in aux:
            h, w = (1, 1) if len(s) == 0 else (1, s[0]) if len(s) == 1 else s
            cts.append(torch.reshape(d[r:r + h, c:c + w], s))
            r, c = r + h, c + w
        return {"tensors": tuple(cts)}

    def samples(dtype):
        yield (randn(2, 3, dtype=dtype), randn(4, dtype=dtype), randn(dtype=dtype)), {}


# --- gathers --------------------------------------------------------------------------------

@builtin(torch.take)
class Take:
    """take(x, idx) = x.flatten()[idx]: d_x = zeros.index_add(0, idx.flatten(), d.flatten())
    reshaped (derivatives.yaml `take`)."""

    def fwd(input, index):
        return torch.take(input, index), (input, index)

    def bwd(aux, d):
        x, idx = aux
        n = x.numel()
        flat = torch.reshape(torch.zeros_like(x), (-1,))
        idx = torch.where(idx < 0, idx + n, idx)
        flat = flat.index_add(0, torch.reshape(idx, (-1,)), torch.reshape(d, (-1,)))
        return torch.reshape(flat, tuple(x.shape)), None

    def jvp(primals, tangents):
        x, idx = primals
        t = tangents[0]
        return torch.take(x, idx), (None if t is None else torch.take(t, idx))

    def samples(dtype):
        yield (randn(3, 4, dtype=dtype), torch.tensor([[0, 5], [11, 5]])), {}


@builtin(torch.take_along_dim)
class TakeAlongDim:
    """take_along_dim(x, idx, dim): d_x = zeros (broadcast shape) scatter_add of d at idx
    along dim; dim=None works on x.flatten() (derivatives.yaml `take_along_dim` via
    `gather`)."""

    def fwd(input, indices, dim=None, *, out=None):
        res = torch.take_along_dim(input, indices, dim) if dim is not None else \
            torch.take_along_dim(input, indices)
        return res, (input, indices, dim, tuple(res.shape))

    def bwd(aux, d):
        x, idx, dim, oshape = aux
        if dim is None:
            flat = torch.reshape(torch.zeros_like(x), (-1,))
            flat = flat.scatter_add(0, torch.reshape(idx, (-1,)), torch.reshape(d, (-1,)))
            return torch.reshape(flat, tuple(x.shape)), None
        n = len(oshape)
        dim = dim % n
        xs = (1,) * (n - x.dim()) + tuple(x.shape)
        shape = list(oshape)
        shape[dim] = xs[dim]
        base = torch.zeros_like(x) if tuple(shape) == tuple(x.shape) else \
            torch.zeros(shape, dtype=d.dtype, device=d.device)  # broadcast x: summed by the engine
        return base.scatter_add(dim, idx.expand(oshape), d), None

    def jvp(primals, tangents):
        x, idx, dim, _ = primals
        t = tangents[0]
        f = (lambda v: torch.take_along_dim(v, idx, dim)) if dim is not None else \
            (lambda v: torch.take_along_dim(v, idx))
        return f(x), (None if t is None else f(t))

    def samples(dtype):
        yield (randn(3, 4, dtype=dtype), torch.tensor([[0, 3], [1, 1], [2, 0]]), 1), {}
        yield (randn(3, 4, dtype=dtype), torch.tensor([0, 5, 5])), {}
        yield (randn(1, 4, dtype=dtype), torch.tensor([[0, 1], [3, 3], [2, 0]]), 1), {}


@builtin(torch.index_copy)
class IndexCopy:
    """index_copy(x, dim, idx, src): d_x = index_fill(d, dim, idx, 0),
    d_src = index_select(d, dim, idx) (derivatives.yaml `index_copy`)."""

    def fwd(input, dim, index, source):
        return torch.index_copy(input, dim, index, source), (dim, index)

    def bwd(aux, d):
        dim, index = aux
        return torch.index_fill(d, dim, index, 0), None, None, torch.index_select(d, dim, index)

    def samples(dtype):
        yield (randn(4, 3, dtype=dtype), 0, torch.tensor([2, 0]), randn(2, 3, dtype=dtype)), {}


@builtin(torch.index_fill)
class IndexFill:
    """index_fill(x, dim, idx, value): d_x = index_fill(d, dim, idx, 0); a tensor value gets
    sum(d over the filled slots, each once) (derivatives.yaml `index_fill.int_Tensor`:
    index_select(d, dim, unique(idx)).sum())."""

    def fwd(input, dim, index, value):
        return torch.index_fill(input, dim, index, value), (dim, index, value)

    def bwd(aux, d):
        dim, index, value = aux
        d_v = None
        if hasattr(value, "node") or isinstance(value, torch.Tensor):
            mask = torch.index_fill(torch.zeros_like(d), dim, index, 1.0)  # each slot once
            d_v = torch.sum(d * mask)
        return torch.index_fill(d, dim, index, 0), None, None, d_v

    def samples(dtype):
        yield (randn(4, 3, dtype=dtype), 1, torch.tensor([2, 0]), 1.5), {}
        yield (randn(4, 3, dtype=dtype), 0, torch.tensor([2, 0, 2]), randn(dtype=dtype)), {}


@builtin(torch.Tensor.unfold)
class Unfold:
    """x.unfold(dim, size, step): windows along dim as a new last axis; d_x = index_add of the
    windows' cotangents at their source positions (derivatives.yaml `unfold`:
    unfold_backward)."""

    def fwd(self, dimension, size, step):
        return self.unfold(dimension, size, step), (self, dimension, size, step)

    def bwd(aux, d):
        x, dim, size, step = aux
        if x.dim() == 0:
            return (torch.reshape(d, ()),)
        dim = dim % x.dim()
        n = x.shape[dim]
        idx = torch.arange(n, device=d.device).unfold(0, size, step).reshape(-1)
        dd = torch.flatten(torch.movedim(d, -1, dim + 1), dim, dim + 1)
        return (torch.zeros_like(x).index_add(dim, idx, dd),)

    def jvp(primals, tangents):
        x, dim, size, step = primals
        t = tangents[0]
        return x.unfold(dim, size, step), (None if t is None else t.unfold(dim, size, step))

    def samples(dtype):
        yield (randn(3, 7, dtype=dtype), 1, 3, 2), {}
        yield (randn(5, 2, dtype=dtype), 0, 2, 1), {}


@builtin(torch.unfold_copy)
class UnfoldCopy:
    """unfold_copy(x, dim, size, step): as Tensor.unfold (derivatives.yaml `unfold_copy`:
    unfold_backward)."""

    def fwd(input, dimension, size, step):
        return torch.unfold_copy(input, dimension, size, step), (input, dimension, size, step)

    def bwd(aux, d):
        return Unfold.bwd(aux, d)

    def jvp(primals, tangents):
        x, dim, size, step = primals
        t = tangents[0]
        return (torch.unfold_copy(x, dim, size, step),
                None if t is None else torch.unfold_copy(t, dim, size, step))

    def samples(dtype):
        yield (randn(3, 7, dtype=dtype), 1, 3, 2), {}


@builtin(torch.diff)
class Diff:
    """diff(x, n, dim, prepend, append): n forward differences of cat(prepend, x, append);
    each step's transpose is d_y = cat(0, g) - cat(g, 0) along dim; the result is split
    back into prepend / x / append (derivatives.yaml: composite of `sub`/`narrow`/`cat`)."""

    def fwd(input, n=1, dim=-1, prepend=None, append=None):
        out = torch.diff(input, n, dim, prepend, append)
        return out, (input, n, dim, prepend, append)

    def bwd(aux, d):
        x, n, dim, pre, app = aux
        dim = dim % x.dim()
        g = d
        for _ in range(n):
            z = torch.zeros_like(torch.narrow(x, dim, 0, 1)).expand(
                tuple(g.shape[:dim]) + (1,) + tuple(g.shape[dim + 1:]))
            g = torch.cat([z, g], dim) - torch.cat([g, z], dim)
        sizes = [pre.shape[dim] if pre is not None and pre.dim() > 0 else (1 if pre is not None
                                                                           else 0),
                 x.shape[dim],
                 app.shape[dim] if app is not None and app.dim() > 0 else (1 if app is not None
                                                                           else 0)]
        p, gx, a = torch.split(g, sizes, dim)
        d_pre = None if pre is None else (p if pre.dim() > 0 else torch.sum(p))
        d_app = None if app is None else (a if app.dim() > 0 else torch.sum(a))
        return gx, None, None, d_pre, d_app

    def samples(dtype):
        yield (randn(3, 5, dtype=dtype),), {}
        yield (randn(3, 5, dtype=dtype), 2, 0), {}
        yield (randn(3, 5, dtype=dtype), 1, 1, randn(3, 2, dtype=dtype),
               randn(3, 1, dtype=dtype)), {}


# --- elementwise odds and ends ----------------------------------------------------------------

@builtin(torch.rsub)
class Rsub:
    """rsub(x, y, alpha) = y - alpha x: d_x = -alpha d, d_y = d (derivatives.yaml `rsub`)."""

    def fwd(input, other, alpha=1):
        return torch.rsub(input, other, alpha=alpha), (input, other, alpha)

    def bwd(aux, d):
        x, y, alpha = aux
        is_t = lambda v: isinstance(v, torch.Tensor) or hasattr(v, "node")  # noqa: E731
        return (-d * alpha if is_t(x) else None), (d if is_t(y) else None)

    def samples(dtype):
        yield (randn(3, 4, dtype=dtype), randn(4, dtype=dtype)), {}
        yield (randn(3, 4, dtype=dtype), 2.0, 0.5), {}


@builtin(torch.nan_to_num)
class NanToNum:
    """nan_to_num(x): d_x = d where x is finite, else 0 (derivatives.yaml `nan_to_num`)."""

    def fwd(input, nan=0.0, posinf=None, neginf=None, *, out=None):
        return torch.nan_to_num(input, nan, posinf, neginf), input

    def bwd(aux, d):
        return (torch.where(torch.isfinite(aux), d, 0.0),)

    def samples(dtype):
        yield (randn(3, 4, dtype=dtype),), {}  # (non-finite inputs: no finite differences)


@builtin(torch.logit)
class Logit:
    """logit(x, eps): d_x = d / (x (1 - x)), 0 outside [eps, 1 - eps] when eps is given
    (derivatives.yaml `logit`: logit_backward)."""

    def fwd(input, eps=None):
        return torch.logit(input, eps), (input, eps)

    def bwd(aux, d):
        x, eps = aux
        g = d / (x * (1 - x))
        if eps is None:
            return g, None
        return torch.where((x < eps) | (x > 1 - eps), 0.0, g), None

    def samples(dtype):
        yield (_t((3, 4), dtype, 0.05, 0.95),), {}
        yield (_t((3, 4), dtype, 0.3, 0.7), 0.1), {}


@builtin(torch.angle)
class Angle:
    """angle(x) for real x is 0 or pi: zero derivative (derivatives.yaml `angle`:
    angle_backward)."""

    def fwd(input):
        return torch.angle(input), input

    def bwd(aux, d):
        return (torch.zeros_like(aux) * d,)

    def samples(dtype):
        yield (randn(3, 4, dtype=dtype),), {}


@builtin(torch.fill)
class Fill:
    """fill(x, v): d_x = 0, d_v = sum(d) for a tensor v (derivatives.yaml `fill.Tensor`)."""

    def fwd(input, value):
        return torch.fill(input, value), value

    def bwd(aux, d):
        is_t = isinstance(aux, torch.Tensor) or hasattr(aux, "node")
        return None, (torch.sum(d) if is_t else None)

    def samples(dtype):
        yield (randn(3, 4, dtype=dtype), randn(dtype=dtype)), {}


def _polygamma_rule(op, name, first):
    def fwd(n, input):
        return op(n, input), (n, input)

    def bwd(aux, d):
        n, x = aux
        return None, d * torch.polygamma(n + 1, x)

    def samples(dtype):
        yield (1, _t((3, 4), dtype, 0.5, 3.0)), {}
        yield (0, _t((3, 4), dtype, 0.5, 3.0)), {}

    add_rule(op, fwd, bwd, samples=samples, builtin=True,
             source=f"{name}(n, x): d_x = d polygamma(n + 1, x) (derivatives.yaml `polygamma`)")


_polygamma_rule(torch.polygamma, "polygamma", True)
_polygamma_rule(torch.special.polygamma, "special.polygamma", True)


@builtin(torch.mvlgamma)
class Mvlgamma:
    """mvlgamma(x, p) = const + sum_{i<p} lgamma(x - i/2): d_x = d sum_{i<p} digamma(x - i/2)
    (derivatives.yaml `mvlgamma`: mvlgamma_backward)."""

    def fwd(input, p):
        return torch.mvlgamma(input, p), (input, p)

    def bwd(aux, d):
        x, p = aux
        s = torch.digamma(x)
        for i in range(1, p):
            s = s + torch.digamma(x - i / 2)
        return d * s, None

    def samples(dtype):
        yield (_t((3, 4), dtype, 2.0, 4.0), 3), {}


@builtin(torch.special.i1)
class I1:
    """special.i1: d_x = d (i0(x) - i1(x) / x), 1/2 at x = 0 (derivatives.yaml `special_i1`:
    i1_backward)."""

    def fwd(input):
        out = torch.special.i1(input)
        return out, (input, out)

    def bwd(aux, d):
        x, y = aux
        return (d * torch.where(x == 0, 0.5, torch.special.i0(x) - y / x),)

    def samples(dtype):
        yield (_t((3, 4), dtype),), {}


@builtin(torch.special.i1e)
class I1e:
    """special.i1e: d_x = d (i0e(x) - i1e(x) (sgn(x) + 1/x)), 1/2 at x = 0 (derivatives.yaml
    `special_i1e`: i1e_backward)."""

    def fwd(input):
        out = torch.special.i1e(input)
        return out, (input, out)

    def bwd(aux, d):
        x, y = aux
        g = torch.special.i0e(x) - y * (torch.sgn(x) + 1 / x)
        return (d * torch.where(x == 0, 0.5, g),)

    def samples(dtype):
        yield (_t((3, 4), dtype),), {}


@builtin(torch.special.entr)
class Entr:
    """special.entr(x) = -x log x: d_x = -d (1 + log x) (derivatives.yaml `special_entr`)."""

    def fwd(input):
        return torch.special.entr(input), input

    def bwd(aux, d):
        return (-d * (1 + torch.log(aux)),)

    def samples(dtype):
        yield (_t((3, 4), dtype, 0.1, 2.0),), {}


# --- conjugation views, atleast_*d, more splits ---------------------------------------------

def _conj_like(op: Any, back: Any, name: str, formula: str) -> None:
    def fwd(input):
        return op(input), None

    def bwd(aux, d):
        return (back(d),)

    def samples(dtype):
        yield (randn(3, 4, dtype=dtype),), {}

    add_rule(op, fwd, bwd, samples=samples, builtin=True,
             source=f"{name}: d_x = {formula} (derivatives.yaml `{name}`)")


_conj_like(torch.conj, torch.conj, "conj", "conj(d)")
_conj_like(torch.conj_physical, torch.conj_physical, "conj_physical", "conj_physical(d)")
_conj_like(torch.resolve_conj, lambda d: d, "resolve_conj", "d")
_conj_like(torch.resolve_neg, lambda d: d, "resolve_neg", "d")
_conj_like(torch.real, lambda d: d, "real", "d (real part; the engine casts to x's dtype)")


def _atleast_rule(op: Any, name: str) -> None:
    def fwd(*tensors):
        return op(*tensors), [tuple(t.shape) for t in (
            tensors[0] if len(tensors) == 1 and isinstance(tensors[0], (list, tuple))
            else tensors)] + [len(tensors) == 1 and isinstance(tensors[0], (list, tuple))]

    def bwd(aux, d):
        shapes, listed = aux[:-1], aux[-1]
        ds = list(d) if isinstance(d, (tuple, list)) else [d]
        cts = [None if c is None else torch.reshape(c, s) for c, s in zip(ds, shapes)]
        return {"tensors": ([cts] if listed else tuple(cts))}

    def samples(dtype):
        yield (randn(3, dtype=dtype),), {}
        yield (randn(dtype=dtype), randn(2, 3, dtype=dtype)), {}

    add_rule(op, fwd, bwd, samples=samples, builtin=True,
             source=f"{name}: reshapes; d_x_i = reshape(d_i, x_i.shape) (derivatives.yaml "
                    "`view`)")


_atleast_rule(torch.atleast_1d, "atleast_1d")
_atleast_rule(torch.atleast_2d, "atleast_2d")
_atleast_rule(torch.atleast_3d, "atleast_3d")


def _swsc_fwd(input, split_sizes, dim=0):
    out = torch.split_with_sizes_copy(input, split_sizes, dim)
    return out, (out, dim)


_split_rule(torch.split_with_sizes_copy, "split_with_sizes_copy", None, _swsc_fwd,
            lambda dt: iter([((randn(5, 3, dtype=dt), [2, 3]), {})]))


@builtin(torch.cartesian_prod)
class CartesianProd:
    """cartesian_prod(*xs) -> (N, k): column i repeats x_i over a meshgrid; d_x_i = the sum of
    d[:, i] viewed as the grid over the other axes (a single input is returned as is)
    (derivatives.yaml via `meshgrid`/`stack`)."""

    def fwd(*tensors):
        return torch.cartesian_prod(*tensors), [t.shape[0] for t in tensors]

    def bwd(aux, d):
        sizes = aux
        if len(sizes) == 1:
            return {"tensors": (d,)}
        cts = []
        for i in range(len(sizes)):
            g = torch.reshape(d[:, i], sizes)
            other = [j for j in range(len(sizes)) if j != i]
            cts.append(torch.sum(g, other))
        return {"tensors": tuple(cts)}

    def samples(dtype):
        yield (randn(3, dtype=dtype), randn(2, dtype=dtype)), {}


@builtin(torch.repeat_interleave)
class RepeatInterleave:
    """repeat_interleave(x, repeats, dim): an int repeat views d as (..., n, r, ...) and sums
    the r axis; tensor repeats index_add d back at repeat_interleave(arange(n), repeats);
    dim=None works on x.flatten() (derivatives.yaml `repeat_interleave` via `index_select`)."""

    def fwd(input, repeats=None, dim=None, *, output_size=None):
        kw = {} if output_size is None else {"output_size": output_size}
        out = torch.repeat_interleave(input, repeats, dim, **kw)
        return out, (input, repeats, dim)

    def bwd(aux, d):
        x, reps, dim = aux
        shape = tuple(x.shape)
        xs = shape if dim is not None else (x.numel(),)
        dim = 0 if dim is None else dim % max(len(shape), 1)
        if len(xs) == 0:
            return torch.reshape(torch.sum(d), shape), None
        if isinstance(reps, int) or (not hasattr(reps, "node") and not
                                     isinstance(reps, torch.Tensor)):
            r = int(reps)
            g = torch.reshape(d, xs[:dim] + (xs[dim], r) + xs[dim + 1:])
            return torch.reshape(torch.sum(g, dim + 1), shape), None
        if reps.dim() == 0 or reps.numel() == 1:
            r_t = reps
            idx = torch.repeat_interleave(torch.arange(xs[dim], device=d.device), r_t)
        else:
            idx = torch.repeat_interleave(torch.arange(xs[dim], device=d.device), reps)
        base = torch.reshape(torch.zeros_like(x), xs)
        return torch.reshape(base.index_add(dim, idx, d), shape), None

    def jvp(primals, tangents):
        x, reps, dim, output_size = primals
        t = tangents[0]
        kw = {} if output_size is None else {"output_size": output_size}
        return (torch.repeat_interleave(x, reps, dim, **kw),
                None if t is None else torch.repeat_interleave(t, reps, dim, **kw))

    def samples(dtype):
        yield (randn(3, 4, dtype=dtype), 2, 1), {}
        yield (randn(3, 4, dtype=dtype), 3), {}


@builtin(torch.meshgrid)
class Meshgrid:
    """meshgrid(*xs, indexing): grid i repeats x_i along one axis (axis i for 'ij'; axes 0
    and 1 swapped for 'xy'); d_x_i = sum of d_i over the other axes (derivatives.yaml via
    `expand`)."""

    def fwd(*tensors, indexing=None):
        listed = len(tensors) == 1 and isinstance(tensors[0], (list, tuple))
        xs = list(tensors[0]) if listed else list(tensors)
        kw = {} if indexing is None else {"indexing": indexing}
        out = torch.meshgrid(*xs, **kw)
        return out, ([tuple(x.shape) for x in xs], indexing == "xy", listed)

    def bwd(aux, d):
        shapes, xy, listed = aux
        k = len(shapes)
        cts = []
        for i, (c, s) in enumerate(zip(d, shapes)):
            if c is None:
                cts.append(None)
                continue
            ax = i
            if xy and k >= 2 and i < 2:
                ax = 1 - i
            other = [j for j in range(k) if j != ax]
            g = torch.sum(c, other) if other else c
            cts.append(torch.reshape(g, s))
        return {"tensors": ([cts] if listed else tuple(cts))}

    def samples(dtype):
        yield (randn(3, dtype=dtype), randn(2, dtype=dtype)), {"indexing": "ij"}
        yield (randn(3, dtype=dtype), randn(2, dtype=dtype), randn(4, dtype=dtype)), \
            {"indexing": "xy"}
