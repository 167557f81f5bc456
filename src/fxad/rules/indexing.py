"""Rules for indexing, gather/scatter and masked ops: ``x[index]`` (``operator.getitem``),
the functional ``x[index] = v`` (:func:`fxad.ops.setitem`), ``gather``, ``scatter``/
``scatter_add``/``scatter_reduce``, ``index_select``/``index_add``/``index_copy``/
``index_fill``/``index_reduce``, ``index_put``, ``put``, ``take``/``take_along_dim``,
``masked_fill``, ``masked_scatter``, ``select_scatter``/``slice_scatter``/
``diagonal_scatter``, ``combinations``, and the ATen-level ``slice.Tensor``,
``_unsafe_masked_index`` and ``_unsafe_masked_index_put_accumulate``.

Formulas follow PyTorch's ``tools/autograd/derivatives.yaml`` (entry named in each rule; the
``*_backward`` helpers it names live in ``torch/csrc/autograd/FunctionsManual.cpp``):

* reading ops (indexing, ``gather``, ``take``, ``index_select``) are transposed by writing
  the cotangent back into zeros at the read positions, accumulating repeated indices
  (``index_add`` / ``scatter_add``); ``combinations`` is ``x[idx]`` for the integer table
  ``idx = torch.combinations(torch.arange(n), r, with_replacement)``, so it is the same;
* writing ops (``index_put``, ``put``, ``masked_scatter``, ``*_scatter``, ``setitem``): the
  overwritten positions of ``self`` get zero (unless accumulating) and the written values get
  the cotangent read back at their positions;
* scatter/index reductions: ``scatter_reduce_backward`` / ``index_reduce_backward`` -- sum and
  mean spread the cotangent (mean divides by the count, ``include_self`` counting), prod uses
  the "product of the others" with exact handling of a single zero, amax/amin share the
  cotangent evenly among all the entries equal to the result.  One deliberate difference:
  with ``include_self=False`` an excluded ``self`` entry that happens to equal the result is
  not counted among the ties (PyTorch counts it, giving ``src`` too small a share where the
  function is differentiable); on data without such a coincidence both agree.
"""
from __future__ import annotations

import operator
from typing import Any

import torch
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .. import ops
from ..errors import RuleError
from ._base import randn, _is_t
from .registry import needs_cotangent, register_vjp


@register_vjp(torch.masked_fill)
class MaskedFill:
    """masked_fill(x, mask, v): d_x = d with masked entries zeroed; a tensor ``v`` receives the
    sum of d over the mask (derivatives.yaml `masked_fill.Tensor`)."""

    def fwd(input, mask, value):
        return torch.masked_fill(input, mask, value), (mask, value)

    def bwd(aux, d):
        mask, value = aux
        d_value = torch.where(mask, d, 0.0).sum() if _is_t(value) else None
        return torch.masked_fill(d, mask, 0.0), None, d_value

    def jvp(primals, tangents):
        (x, mask, value), (tx, _, t_value) = primals, tangents
        out = torch.masked_fill(x, mask, value)
        if tx is None:
            return out, torch.where(mask, t_value, 0.0)
        return out, torch.masked_fill(tx, mask, 0.0 if t_value is None else t_value)

    def samples(dtype):
        x = randn(3, 4, dtype=dtype)
        yield (x, x > 0.3, -1.0), {}
        yield (x, randn(4) > 0, torch.tensor(2.0, dtype=dtype)), {}


def _has_tensor_index(index: Any) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) or hasattr(i, "node") or isinstance(i, list)
               for i in items)


@register_vjp(operator.getitem)
class GetItem:
    """x[index] with ints, slices, None, Ellipsis and integer/bool tensors.  Basic indexing:
    d_x = zeros with d written at ``index``; advanced indexing (repeated indices possible):
    d is accumulated at the selected flat positions with ``index_add`` (derivatives.yaml
    `index.Tensor`: index_put with accumulate=True)."""

    def fwd(input, index):
        return input[index], (input, index)

    def bwd(aux, d):
        x, index = aux
        if not _has_tensor_index(index):
            return ops.setitem(torch.zeros_like(x), index, d), None
        n = x.numel()
        positions = torch.reshape(torch.arange(n, device=x.device), tuple(x.shape))[index]
        flat = torch.zeros(n, dtype=x.dtype, device=x.device).index_add(
            0, torch.reshape(positions, (-1,)), torch.reshape(d, (-1,)))
        return torch.reshape(flat, tuple(x.shape)), None

    def jvp(primals, tangents):
        (x, index), tx = primals, tangents[0]
        return x[index], tx[index]

    def samples(dtype):
        x = randn(4, 5, dtype=dtype)
        yield (x, (slice(None), None, Ellipsis, slice(1, 3))), {}
        yield (x, 2), {}
        yield (x, (slice(None, None, 2), -1)), {}
        yield (x, torch.tensor([0, 2, 2, 3])), {}
        yield (x, (slice(None), torch.tensor([[1, 1], [0, 4]]))), {}


def _bool_mask(index: Any) -> Any:
    """The boolean tensor of ``x[mask]`` / ``x[(mask,)]``, else None."""
    if isinstance(index, tuple) and len(index) == 1:
        index = index[0]
    dtype = getattr(index, "dtype", None)
    return index if dtype == torch.bool and hasattr(index, "shape") else None


def _masked_value_cotangent(d: Any, index: Any, vshape: tuple) -> Any:
    """Cotangent of ``v`` in ``x[mask] = v`` without ``d[mask]`` (a data-dependent shape):
    ``v`` is broadcast over the selected entries, so it gets their sum, as a tensor the
    engine reduces to ``v``'s shape.  None when the index is not one boolean mask, or ``v``
    has one entry per selected element (then only ``d[mask]`` will do)."""
    mask = _bool_mask(index)
    if mask is None or mask.dim() == 0:
        return None
    k = mask.dim()
    rest = d.dim() - k
    if len(vshape) > rest + 1 or (len(vshape) == rest + 1
                                     and not statically_known_true(vshape[0] == 1)):
        return None
    keep = torch.reshape(mask, tuple(mask.shape) + (1,) * rest)
    total = torch.sum(torch.where(keep, d, 0.0), tuple(range(k)))
    if len(vshape) == rest + 1:
        total = torch.unsqueeze(total, 0)
    return total


@register_vjp(ops.setitem)
class SetItem:
    """Functional ``x[index] = v``: d_x = d with ``index`` zeroed, d_v = d[index]
    (derivatives.yaml `index_put`)."""

    def fwd(x, index, value):
        shape = tuple(value.shape) if _is_t(value) else ()
        return ops.setitem(x, index, value), (index, shape)

    def bwd(aux, d):
        index, vshape = aux
        d_value = None
        if needs_cotangent("value"):  # not for a constant value (`x[mask] = 0.5`)
            d_value = _masked_value_cotangent(d, index, vshape)
            if d_value is None:
                d_value = d[index]
        return ops.setitem(d, index, 0.0), None, d_value

    def jvp(primals, tangents):
        (x, index, value), (tx, _, t_value) = primals, tangents
        base = torch.zeros_like(x) if tx is None else tx
        return ops.setitem(x, index, value), ops.setitem(base, index,
                                                        0.0 if t_value is None else t_value)

    def samples(dtype):
        yield (randn(4, 5, dtype=dtype), (slice(1, 3),), randn(5, dtype=dtype)), {}
        yield (randn(4, 5, dtype=dtype), (0, slice(None)), 1.5), {}


@register_vjp(torch.gather)
class Gather:
    """gather(x, dim, idx): d_x = zeros.scatter_add(dim, idx, d) (derivatives.yaml `gather`)."""

    def fwd(input, dim, index, *, sparse_grad=False):
        return torch.gather(input, dim, index), (input, dim, index)

    def bwd(aux, d):
        x, dim, index = aux
        return torch.zeros_like(x).scatter_add(dim, index, d), None, None

    def jvp(primals, tangents):
        (x, dim, index, _), tx = primals, tangents[0]
        return torch.gather(x, dim, index), torch.gather(tx, dim, index)

    def samples(dtype):
        yield (randn(3, 4, dtype=dtype), 1, torch.tensor([[0, 0], [1, 3], [2, 2]])), {}


def _zeros_if_none(t: Any, like: Any) -> Any:
    return torch.zeros_like(like) if t is None else t


@register_vjp(torch.scatter_add)
class ScatterAdd:
    """scatter_add(x, dim, idx, src): d_x = d, d_src = gather(d, dim, idx) (derivatives.yaml
    `scatter_add`).  Linear in (x, src): the JVP is the same scatter_add of the tangents.
    Needed to differentiate the backward of ``gather`` / ``max_pool2d`` a second time."""

    def fwd(input, dim, index, src):
        return torch.scatter_add(input, dim, index, src), (dim, index)

    def bwd(aux, d):
        dim, index = aux
        return d, None, None, torch.gather(d, dim, index)

    def jvp(primals, tangents):
        (x, dim, index, src), (tx, _, _, t_src) = primals, tangents
        return (torch.scatter_add(x, dim, index, src),
                torch.scatter_add(_zeros_if_none(tx, x), dim, index, _zeros_if_none(t_src, src)))

    def samples(dtype):
        yield (randn(3, 4, dtype=dtype), 1, torch.tensor([[0, 0], [1, 3], [2, 2]]),
               randn(3, 2, dtype=dtype)), {}


@register_vjp(torch.scatter)
class Scatter:
    """scatter(x, dim, idx, src): d_x = d with the written positions zeroed, d_src =
    gather(d, dim, idx) (derivatives.yaml `scatter.src`, `scatter.value`); indices are assumed
    unique, as PyTorch's own derivative does."""

    def fwd(input, dim, index, src):
        return torch.scatter(input, dim, index, src), (dim, index, _is_t(src))

    def bwd(aux, d):
        dim, index, src_is_tensor = aux
        return (torch.scatter(d, dim, index, 0.0), None, None,
                torch.gather(d, dim, index) if src_is_tensor else None)

    def jvp(primals, tangents):
        (x, dim, index, src), (tx, _, _, t_src) = primals, tangents
        base = _zeros_if_none(tx, x)
        if not _is_t(src):
            return torch.scatter(x, dim, index, src), torch.scatter(base, dim, index, 0.0)
        return (torch.scatter(x, dim, index, src),
                torch.scatter(base, dim, index, _zeros_if_none(t_src, src)))

    def samples(dtype):
        yield (randn(3, 4, dtype=dtype), 1, torch.tensor([[0, 1], [3, 2], [2, 0]]),
               randn(3, 2, dtype=dtype)), {}
        yield (randn(3, 4, dtype=dtype), 1, torch.tensor([[0], [3], [2]]), 0.5), {}


@register_vjp(torch.index_add)
class IndexAdd:
    """index_add(x, dim, idx, src, alpha): d_x = d, d_src = alpha * index_select(d, dim, idx)
    (derivatives.yaml `index_add`).  Linear in (x, src).  Needed to differentiate the backward
    of indexing / ``index_select`` a second time."""

    def fwd(input, dim, index, source, *, alpha=1):
        out = torch.index_add(input, dim, index, source) if alpha == 1 else \
            torch.index_add(input, dim, index, source, alpha=alpha)
        return out, (dim, index, alpha)

    def bwd(aux, d):
        dim, index, alpha = aux
        d_src = torch.index_select(d, dim, index)
        return d, None, None, (d_src if alpha == 1 else d_src * alpha)

    def jvp(primals, tangents):
        (x, dim, index, src, alpha), (tx, _, _, t_src, _) = primals, tangents
        kw = {} if alpha == 1 else {"alpha": alpha}
        return (torch.index_add(x, dim, index, src, **kw),
                torch.index_add(_zeros_if_none(tx, x), dim, index, _zeros_if_none(t_src, src), **kw))

    def samples(dtype):
        yield (randn(3, 4, dtype=dtype), 1, torch.tensor([0, 3, 3]), randn(3, 3, dtype=dtype)), {}
        yield (randn(5, dtype=dtype), 0, torch.tensor([1, 1]), randn(2, dtype=dtype)), \
            {"alpha": 2.0}


@register_vjp(torch.index_select)
class IndexSelect:
    """index_select(x, dim, idx): d_x = zeros.index_add(dim, idx, d)
    (derivatives.yaml `index_select`)."""

    def fwd(input, dim, index):
        return torch.index_select(input, dim, index), (input, dim, index)

    def bwd(aux, d):
        x, dim, index = aux
        return torch.zeros_like(x).index_add(dim, index, d), None, None

    def jvp(primals, tangents):
        (x, dim, index), tx = primals, tangents[0]
        return torch.index_select(x, dim, index), torch.index_select(tx, dim, index)

    def samples(dtype):
        yield (randn(3, 4, dtype=dtype), 1, torch.tensor([0, 3, 3])), {}


@register_vjp(torch.select_scatter)
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


@register_vjp(torch.slice_scatter)
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


@register_vjp(torch.diagonal_scatter)
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


# --- gathers --------------------------------------------------------------------------------

@register_vjp(torch.take)
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


@register_vjp(torch.take_along_dim)
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


@register_vjp(torch.index_copy)
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


@register_vjp(torch.index_fill)
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


def _z(t: Any, like: Any) -> Any:
    """The tangent ``t``, or zeros shaped like ``like`` when it is None (zero)."""
    return torch.zeros_like(like) if t is None else t


# ---------------------------------------------------------------------------------------------
# indexing reads and writes
# ---------------------------------------------------------------------------------------------

def _is_bool_index(i: Any) -> bool:
    return i is not None and _is_t(i) and i.dtype == torch.bool


def _check_index_put(indices: Any) -> None:
    if len(indices) > 1 and any(_is_bool_index(i) for i in indices):

        raise RuleError("index_put: a boolean mask combined with other index tensors has no "
                        "hand-written rule (the number of selected entries is data-dependent)",
                        op="torch.index_put",
                        hint="index with integer tensors (mask.nonzero(as_tuple=True)) instead")


def _read_back(d: Any, indices: tuple, values: Any) -> Any:
    """d[indices], with shapes kept static: a single boolean mask selects a data-dependent
    number of rows, taken from values' shape (nonzero_static) or, where values broadcasts
    over them, summed at once."""
    if not any(_is_bool_index(i) for i in indices):
        return d[indices]
    (mask,) = indices
    k = mask.dim()
    rest = tuple(d.shape[k:])
    vs = tuple(values.shape)
    r = len(rest)
    if len(vs) > r and vs[len(vs) - r - 1] != 1:  # values has one row per selected entry
        nz = torch.nonzero_static(mask, size=vs[len(vs) - r - 1])
        return d[tuple(nz[:, j] for j in range(k))]
    m = torch.reshape(mask, tuple(mask.shape) + (1,) * r)
    g = torch.sum(torch.where(m, d, 0.0), tuple(range(k))) if k else torch.where(m, d, 0.0)
    if len(vs) > r:
        g = torch.reshape(g, (1,) + rest)
    return g


def _index_put_rule(method: bool) -> type:
    def call(x: Any, indices: Any, values: Any, accumulate: bool) -> Any:
        if method:
            return x.index_put(indices, values, accumulate)
        return torch.index_put(x, indices, values, accumulate)

    class IndexPut:
        """index_put(x, indices, values, accumulate): out = x with x[indices] replaced by (or,
        accumulating, increased by) values.  d_x = d with the written positions zeroed (d
        itself when accumulating), d_values = d[indices] (derivatives.yaml `index_put`:
        grad.index_put(indices, zeros_like(values), accumulate=False) / grad, and
        grad[indices]; the engine sums d_values down to values' shape).  Linear in (x, values):
        the JVP is the same index_put of the tangents."""

        def fwd(input, indices, values, accumulate=False):
            _check_index_put(indices)
            return call(input, indices, values, accumulate), (tuple(indices), values, accumulate)

        def bwd(aux, d):
            indices, values, accumulate = aux
            dx = d if accumulate else torch.index_put(d, indices, torch.zeros_like(values))
            return dx, None, _read_back(d, indices, values)

        def jvp(primals, tangents):
            x, indices, values, accumulate = primals
            tx, tv = tangents[0], tangents[2]
            out = call(x, indices, values, accumulate)
            if tx is None and tv is None:
                return out, None
            return out, torch.index_put(_z(tx, x), tuple(indices), _z(tv, values), accumulate)

        def samples(dtype):
            x = randn(5, 4, dtype=dtype)
            yield (x, [torch.tensor([4, 1])], randn(2, 4, dtype=dtype)), {}
            yield (x, [torch.tensor([4, 1, 4])], randn(4, dtype=dtype), True), {}
            yield (x, [torch.tensor([True, False, True, True, False])], randn(1, dtype=dtype)), {}
            yield (x, [torch.tensor([0, 2]), torch.tensor([3, 1])], randn(2, dtype=dtype)), \
                {"accumulate": True}
            yield (x, [torch.tensor([True, False, True, True, False])], randn(3, 4, dtype=dtype),
                   True), {}
            yield (x, [torch.tensor([True, False, True, True, False])], randn(1, 4, dtype=dtype)), {}
            yield (x, [randn(5, 4) > 0], randn(1, dtype=dtype), True), {}

    return IndexPut


for _m, _op in ((False, torch.index_put), (True, torch.Tensor.index_put)):
    register_vjp(_op)(_index_put_rule(_m))


def _put_rule(method: bool) -> type:
    def call(x: Any, index: Any, source: Any, accumulate: bool) -> Any:
        if method:
            return x.put(index, source, accumulate)
        return torch.put(x, index, source, accumulate)

    class Put:
        """put(x, index, source, accumulate): writes source into the flattened x at index.
        d_x = d with the written positions zeroed (d when accumulating), d_source =
        take(d, index) reshaped like source (derivatives.yaml `put`).  Linear: the JVP puts
        the tangents."""

        def fwd(input, index, source, accumulate=False):
            return call(input, index, source, accumulate), (index, source, accumulate)

        def bwd(aux, d):
            index, source, accumulate = aux
            dx = d if accumulate else torch.put(d, index, torch.zeros_like(source))
            return dx, None, torch.reshape(torch.take(d, index), tuple(source.shape))

        def jvp(primals, tangents):
            x, index, source, accumulate = primals
            tx, ts = tangents[0], tangents[2]
            out = call(x, index, source, accumulate)
            if tx is None and ts is None:
                return out, None
            return out, torch.put(_z(tx, x), index, _z(ts, source), accumulate)

        def samples(dtype):
            x = randn(3, 4, dtype=dtype)
            yield (x, torch.tensor([6, -1, 2]), randn(3, dtype=dtype)), {}
            yield (x, torch.tensor([[6, 6], [0, 11]]), randn(4, dtype=dtype), True), {}
            yield (randn(dtype=dtype), torch.tensor(0), randn(1, dtype=dtype)), {}

    return Put


for _m, _op in ((False, torch.put), (True, torch.Tensor.put)):
    register_vjp(_op)(_put_rule(_m))


def _masked_scatter_rule(method: bool) -> type:
    def call(x: Any, mask: Any, source: Any) -> Any:
        return x.masked_scatter(mask, source) if method else torch.masked_scatter(x, mask, source)

    class MaskedScatter:
        """masked_scatter(x, mask, source): the k-th True position of the (broadcast) mask, in
        row-major order, takes source.flatten()[k].  d_x = d with the masked positions zeroed;
        d_source: the k-th entry gets d at the k-th True position, entries past the number of
        True positions get zero (derivatives.yaml `masked_scatter`: masked_scatter_backward).
        The k-th position is found with a cumulative sum of the mask, so shapes stay static.
        Linear in (x, source): the JVP is the same masked_scatter of the tangents."""

        def fwd(input, mask, source):
            out = call(input, mask, source)
            return out, (mask, source, tuple(out.shape))

        def bwd(aux, d):
            mask, source, shape = aux
            m = torch.broadcast_to(mask, shape)
            dx = torch.where(m, 0.0, d)
            if source.numel() == 0:
                return dx, None, torch.zeros_like(source)
            mflat = torch.reshape(m, (-1,))
            pos = torch.cumsum(mflat.to(torch.int64), 0) - 1
            pos = torch.where(mflat, pos, 0)
            vals = torch.where(mflat, torch.reshape(d, (-1,)), 0.0)
            flat = torch.zeros_like(torch.reshape(source, (-1,))).index_add(0, pos, vals)
            return dx, None, torch.reshape(flat, tuple(source.shape))

        def jvp(primals, tangents):
            x, mask, source = primals
            tx, ts = tangents[0], tangents[2]
            out = call(x, mask, source)
            if tx is None and ts is None:
                return out, None
            return out, torch.masked_scatter(_z(tx, x), mask, _z(ts, source))

        def samples(dtype):
            yield (randn(4, 5, dtype=dtype), randn(4, 5) > 0, randn(4, 5, dtype=dtype)), {}
            yield (randn(5, dtype=dtype), randn(3, 5) > 0, randn(20, dtype=dtype)), {}
            yield (randn(3, 5, dtype=dtype), torch.tensor([True, False, True, True, False]),
                   randn(2, 5, dtype=dtype)), {}

    return MaskedScatter


for _m, _op in ((False, torch.masked_scatter), (True, torch.Tensor.masked_scatter)):
    register_vjp(_op)(_masked_scatter_rule(_m))


def _masked_select_rule(method: bool) -> type:
    def call(x: Any, mask: Any) -> Any:
        return x.masked_select(mask) if method else torch.masked_select(x, mask)

    class MaskedSelect:
        """masked_select(x, mask): the entries of x (broadcast with mask) at the True positions
        of mask, in row-major order; its size depends on the data.  d_x = zeros of the
        broadcast shape with d written back at those positions by ``masked_scatter`` (the
        engine sums it to x's shape) (derivatives.yaml `masked_select`:
        masked_select_backward).  Linear in x: the JVP is masked_select of the tangent."""

        def fwd(input, mask):
            shape = tuple(torch.broadcast_shapes(tuple(input.shape), tuple(mask.shape)))
            return call(input, mask), (mask, shape)

        def bwd(aux, d):
            mask, shape = aux
            zeros = torch.zeros(shape, dtype=d.dtype, device=d.device)
            return zeros.masked_scatter(torch.broadcast_to(mask, shape), d), None

        def jvp(primals, tangents):
            (x, mask), tx = primals, tangents[0]
            return call(x, mask), call(tx, mask)

    return MaskedSelect


for _m, _op in ((False, torch.masked_select), (True, torch.Tensor.masked_select)):
    register_vjp(_op)(_masked_select_rule(_m))


def _clamped(x: Any, indices: Any) -> tuple:
    """The index tensors of ``_unsafe_masked_index`` clamped into range (positions outside it
    are masked out, so any in-range index will do there)."""
    out = []
    for k, i in enumerate(indices):
        if i is None:
            out.append(None)
        else:
            n = x.shape[k]
            out.append(torch.clamp(i, -n, n - 1))
    return tuple(out)


@register_vjp(torch._unsafe_masked_index)
class UnsafeMaskedIndex:
    """_unsafe_masked_index(x, mask, indices, fill) = where(mask, x[indices], fill), indices
    clamped into range: d_x = zeros.index_put(indices, where(mask, d, 0), accumulate=True)
    (derivatives.yaml `_unsafe_masked_index`: _unsafe_masked_index_put_accumulate of grad).
    Linear in x: the JVP indexes the tangent."""

    def fwd(input, mask, indices, fill):
        out = torch._unsafe_masked_index(input, mask, indices, fill)
        return out, (input, mask, _clamped(input, indices))

    def bwd(aux, d):
        x, mask, idx = aux
        return torch.zeros_like(x).index_put(idx, torch.where(mask, d, 0.0), accumulate=True),

    def jvp(primals, tangents):
        x, mask, indices, fill = primals
        t = tangents[0]
        out = torch._unsafe_masked_index(x, mask, indices, fill)
        if t is None:
            return out, None
        return out, torch.where(mask, t[_clamped(x, indices)], 0.0)

    def samples(dtype):
        x = randn(4, 5, dtype=dtype)
        yield (x, randn(6, 6) > 0, [torch.randint(0, 7, (6, 1)), torch.randint(-3, 8, (1, 6))],
               -1.5), {}
        yield (x, torch.ones(3, 1, dtype=torch.bool), [torch.tensor([0, 3, 0])], 2.0), {}


@register_vjp(torch._unsafe_masked_index_put_accumulate)
class UnsafeMaskedIndexPutAccumulate:
    """_unsafe_masked_index_put_accumulate(x, mask, indices, values) = x.index_put(indices,
    where(mask, values, 0), accumulate=True), indices clamped into range: d_x = d,
    d_values = where(mask, d[indices], 0) (derivatives.yaml
    `_unsafe_masked_index_put_accumulate`).  Linear: the JVP is the same op on the tangents."""

    def fwd(input, mask, indices, values):
        out = torch._unsafe_masked_index_put_accumulate(input, mask, indices, values)
        return out, (mask, _clamped(input, indices))

    def bwd(aux, d):
        mask, idx = aux
        return d, None, None, torch.where(mask, d[idx], 0.0)

    def jvp(primals, tangents):
        x, mask, indices, values = primals
        tx, tv = tangents[0], tangents[3]
        out = torch._unsafe_masked_index_put_accumulate(x, mask, indices, values)
        if tx is None and tv is None:
            return out, None
        return out, _z(tx, x).index_put(_clamped(x, indices),
                                        torch.where(mask, _z(tv, values), 0.0), accumulate=True)

    def samples(dtype):
        x = randn(4, 5, dtype=dtype)
        yield (x, randn(6, 6) > 0, [torch.randint(0, 7, (6, 1)), torch.randint(-3, 8, (1, 6))],
               randn(6, 6, dtype=dtype)), {}
        yield (x, torch.tensor([[True], [False], [True]]), [torch.tensor([0, 9, 0])],
               randn(3, 5, dtype=dtype)), {}


_SLICE = torch.ops.aten.slice.Tensor


@register_vjp(_SLICE)
class AtenSlice:
    """aten.slice.Tensor(x, dim, start, end, step) = x[..., start:end:step, ...]:
    d_x = slice_scatter(zeros_like(x), d, dim, start, end, step) (derivatives.yaml
    `slice.Tensor`: slice_backward).  Linear: the JVP slices the tangent with basic
    indexing."""

    def fwd(input, dim=0, start=None, end=None, step=1):
        return _SLICE(input, dim, start, end, step), (input, dim, start, end, step)

    def bwd(aux, d):
        x, dim, start, end, step = aux
        return torch.slice_scatter(torch.zeros_like(x), d, dim, start, end, step),

    def jvp(primals, tangents):
        x, dim, start, end, step = primals
        t = tangents[0]
        out = _SLICE(x, dim, start, end, step)
        if t is None:
            return out, None
        key = (slice(None),) * (dim % x.dim()) + (slice(start, end, step),)
        return out, t[key]

    def samples(dtype):
        yield (randn(4, 6, 5, dtype=dtype), 1, 1, -2, 2), {}
        yield (randn(7, dtype=dtype),), {}
        yield (randn(7, 3, dtype=dtype), -2, -5, None, 3), {}


# ---------------------------------------------------------------------------------------------
# scatter_reduce / index_reduce
# ---------------------------------------------------------------------------------------------

class _Scatter:
    """How a reduction addresses positions: along ``dim`` with a full-shape index (scatter) or
    with a 1-D index (index_*); the two families share the reduction-backward formulas."""

    def __init__(self, dim: int, index: Any, scatter: bool) -> None:
        self.dim, self.index, self.scatter = dim, index, scatter

    def add(self, base: Any, src: Any) -> Any:
        if self.scatter:
            return torch.scatter_add(base, self.dim, self.index, src)
        return torch.index_add(base, self.dim, self.index, src)

    def read(self, t: Any) -> Any:
        if self.scatter:
            return torch.gather(t, self.dim, self.index)
        return torch.index_select(t, self.dim, self.index)

    def fill0(self, t: Any) -> Any:
        if self.scatter:
            return torch.scatter(t, self.dim, self.index, 0.0)
        return torch.index_fill(t, self.dim, self.index, 0.0)

    def reduce(self, base: Any, src: Any, mode: str, include_self: bool) -> Any:
        if self.scatter:
            return torch.scatter_reduce(base, self.dim, self.index, src, mode,
                                        include_self=include_self)
        return torch.index_reduce(base, self.dim, self.index, src, mode,
                                  include_self=include_self)


def _pad_to(g: Any, shape: tuple) -> Any:
    """Zero-pad ``g`` at the end of each dim up to ``shape`` (scatter reads only the leading
    index-shaped block of src)."""
    if tuple(g.shape) == tuple(shape):
        return g
    pads: list[int] = []
    for have, want in reversed(list(zip(g.shape, shape))):
        pads += [0, want - have]
    return F.pad(g, pads)


def _reduce_backward(sc: _Scatter, x: Any, src: Any, mode: str, include_self: bool,
                     result: Any, d: Any) -> tuple[Any, Any]:
    """(d_self, d_src) of scatter_reduce / index_reduce (FunctionsManual.cpp
    scatter_reduce_backward / index_reduce_backward)."""
    if mode == "sum":
        g_self, g_src = d, sc.read(d)
    elif mode == "mean":
        n = torch.ones_like(d) if include_self else torch.zeros_like(d)
        n = sc.add(n, torch.ones_like(src))
        n = torch.where(n == 0, 1.0, n)
        g_self = d / n
        g_src = sc.read(g_self)
    elif mode == "prod":
        # self: the product of everything else at its position (exact when self == 0)
        masked_self = torch.where(x == 0, 1.0, x)
        g_self = d * sc.reduce(masked_self, src, "prod", include_self) / masked_self
        # src: result / src, except for the single zero of a position, which gets the
        # product of the others
        src_zero = src == 0
        n_zero = sc.read(sc.add(torch.zeros_like(x), src_zero.to(x.dtype)))
        single = torch.logical_and(src_zero, n_zero == 1)
        others = sc.reduce(x, torch.where(single, 1.0, src), "prod", include_self)
        g_src = torch.where(single, sc.read(d * others),
                            sc.read(d * result) / torch.where(src_zero, 1.0, src))
    elif mode in ("amax", "amin"):
        # the cotangent is shared evenly among all entries equal to the result; with
        # include_self=False the overwritten self entries do not take part
        self_hit = x == result
        if not include_self:
            self_hit = torch.logical_and(self_hit, sc.fill0(torch.ones_like(x)) != 0)
        src_hit = src == sc.read(result)
        count = sc.add(self_hit.to(x.dtype), src_hit.to(x.dtype))
        share = d / count
        g_self = torch.where(self_hit, share, 0.0)
        g_src = torch.where(src_hit, sc.read(share), 0.0)
    else:  # pragma: no cover  (the forward rejects other modes)
        raise ValueError(f"unknown reduce mode {mode!r}")
    if not include_self:
        g_self = sc.fill0(g_self)
    return g_self, g_src


def _reduce_jvp(sc: _Scatter, x: Any, src: Any, mode: str, include_self: bool, result: Any,
                tx: Any, ts: Any) -> Any:
    """Tangent of scatter_reduce / index_reduce: the transpose of :func:`_reduce_backward`,
    written directly (each entry's weight times its tangent, added at its position)."""
    tx, ts = _z(tx, x), _z(ts, src)
    keep = torch.ones_like(x) if include_self else sc.fill0(torch.ones_like(x))
    if mode == "sum":
        return sc.add(tx * keep, ts)
    if mode == "mean":
        n = torch.ones_like(x) if include_self else torch.zeros_like(x)
        n = sc.add(n, torch.ones_like(src))
        n = torch.where(n == 0, 1.0, n)
        return sc.add(tx * keep, ts) / n
    if mode == "prod":
        masked_self = torch.where(x == 0, 1.0, x)
        w_self = sc.reduce(masked_self, src, "prod", include_self) / masked_self
        src_zero = src == 0
        n_zero = sc.read(sc.add(torch.zeros_like(x), src_zero.to(x.dtype)))
        single = torch.logical_and(src_zero, n_zero == 1)
        others = sc.read(sc.reduce(x, torch.where(single, 1.0, src), "prod", include_self))
        w_src = torch.where(single, others,
                            sc.read(result) / torch.where(src_zero, 1.0, src))
        return sc.add(tx * w_self * keep, ts * w_src)
    self_hit = torch.logical_and(x == result, keep != 0)
    src_hit = src == sc.read(result)
    count = sc.add(self_hit.to(x.dtype), src_hit.to(x.dtype))
    total = sc.add(torch.where(self_hit, tx, 0.0), torch.where(src_hit, ts, 0.0))
    return total / count


def _reduce_samples(scatter: bool, dtype: torch.dtype):
    for mode in ("sum", "mean", "amax", "amin", "prod") if scatter else \
            ("mean", "amax", "amin", "prod"):
        for include_self in (True, False):
            x = randn(5, 4, dtype=dtype)
            if scatter:
                idx = torch.tensor([[0, 1, 4, 0], [2, 1, 4, 0], [0, 3, 3, 0]])
                src = randn(3, 4, dtype=dtype)
                if mode == "prod":
                    src[0, 0] = 0.0
                    src[1, 3] = 0.0
                    src[2, 3] = 0.0
                    x[2, 1] = 0.0
                yield (x, 0, idx, src, mode), {"include_self": include_self}
                yield (x, 1, torch.tensor([[0, 0], [3, 1], [2, 2], [1, 1], [0, 3]]),
                       randn(5, 2, dtype=dtype), mode), {"include_self": include_self}
            else:
                idx = torch.tensor([0, 4, 0, 2, 4])
                src = randn(5, 4, dtype=dtype)
                if mode == "prod":
                    src[0, 0] = 0.0
                    src[1, 3] = 0.0
                    src[4, 3] = 0.0
                    x[2, 1] = 0.0
                yield (x, 0, idx, src, mode), {"include_self": include_self}
                yield (x, 1, torch.tensor([3, 3, 1]), randn(5, 3, dtype=dtype), mode), \
                    {"include_self": include_self}


@register_vjp(torch.scatter_reduce)
class ScatterReduce:
    """scatter_reduce(x, dim, index, src, reduce, include_self): derivatives.yaml
    `scatter_reduce.two` (scatter_reduce_backward): sum -> (d, gather(d)); mean -> d / count
    (count includes self when include_self); prod -> product of the other factors (a single
    zero handled exactly); amax/amin -> d shared evenly among the entries equal to the
    result.  With include_self=False the overwritten self positions get zero.  src entries
    outside the index's shape get zero."""

    def fwd(input, dim, index, src, reduce, *, include_self=True):
        out = torch.scatter_reduce(input, dim, index, src, reduce, include_self=include_self)
        return out, (input, dim, index, src, reduce, include_self, out)

    def bwd(aux, d):
        x, dim, index, src, mode, include_self, out = aux
        sc = _Scatter(dim, index, True)
        small = tuple(index.shape) != tuple(src.shape)
        s = src
        if small:  # only the leading index-shaped block of src takes part
            for k, n in enumerate(index.shape):
                s = torch.narrow(s, k, 0, n)
        g_self, g_src = _reduce_backward(sc, x, s, mode, include_self, out, d)
        return g_self, None, None, _pad_to(g_src, tuple(src.shape))

    def jvp(primals, tangents):
        x, dim, index, src, mode, include_self = primals
        tx, ts = tangents[0], tangents[3]
        out = torch.scatter_reduce(x, dim, index, src, mode, include_self=include_self)
        if tx is None and ts is None:
            return out, None
        s = src
        if ts is not None:
            ts = _z(ts, src)
        if tuple(index.shape) != tuple(src.shape):
            for k, n in enumerate(index.shape):
                s = torch.narrow(s, k, 0, n)
                ts = None if ts is None else torch.narrow(ts, k, 0, n)
        return out, _reduce_jvp(_Scatter(dim, index, True), x, s, mode, include_self, out,
                                tx, ts)

    def samples(dtype):
        yield from _reduce_samples(True, dtype)
        yield (randn(dtype=dtype), 0, torch.tensor(0), randn(dtype=dtype), "prod"), {}


@register_vjp(torch.index_reduce)
class IndexReduce:
    """index_reduce(x, dim, index, source, reduce, include_self): derivatives.yaml
    `index_reduce` (index_reduce_backward), the scatter_reduce formulas with index_add /
    index_select / index_fill for the 1-D index."""

    def fwd(input, dim, index, source, reduce, *, include_self=True):
        out = torch.index_reduce(input, dim, index, source, reduce, include_self=include_self)
        return out, (input, dim, index, source, reduce, include_self, out)

    def bwd(aux, d):
        x, dim, index, src, mode, include_self, out = aux
        g_self, g_src = _reduce_backward(_Scatter(dim, index, False), x, src, mode,
                                         include_self, out, d)
        return g_self, None, None, g_src

    def jvp(primals, tangents):
        x, dim, index, src, mode, include_self = primals
        tx, ts = tangents[0], tangents[3]
        out = torch.index_reduce(x, dim, index, src, mode, include_self=include_self)
        if tx is None and ts is None:
            return out, None
        return out, _reduce_jvp(_Scatter(dim, index, False), x, src, mode, include_self, out,
                                tx, ts)

    def samples(dtype):
        yield from _reduce_samples(False, dtype)


# --------------------------------------------------------------------------------------------
# combinations
# --------------------------------------------------------------------------------------------

@register_vjp(torch.combinations)
class Combinations:
    """combinations(x, r, with_replacement) = x[idx] with the integer table
    idx = combinations(arange(n), r, with_replacement): d_x = index_add of d at idx; the op is
    linear, so its tangent is the op applied to the tangent."""

    def fwd(input, r=2, with_replacement=False):
        out = torch.combinations(input, r, with_replacement)
        return out, (input, r, with_replacement)

    def bwd(aux, d):
        x, r, with_replacement = aux
        if r == 0 or d.numel() == 0:
            return (torch.zeros_like(x),)
        n = x.shape[0]
        idx = torch.combinations(torch.arange(n, device=x.device), r, with_replacement)
        return (torch.zeros_like(x).index_add(0, torch.reshape(idx, (-1,)),
                                              torch.reshape(d, (-1,))),)

    def jvp(primals, tangents):
        x, r, with_replacement = primals
        t = tangents[0]
        out = torch.combinations(x, r, with_replacement)
        return out, (None if t is None else torch.combinations(t, r, with_replacement))

    def samples(dtype):
        x = randn(4, dtype=dtype)
        yield (x,), {}
        yield (x, 3), {}
        yield (x, 2, True), {}
        yield (x,), {"r": 1, "with_replacement": True}
        yield (randn(1, dtype=dtype), 2, True), {}
