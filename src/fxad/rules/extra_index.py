"""Indexing, scatter/index reductions and assorted ops: ``scatter_reduce``, ``index_reduce``,
``index_put``, ``put``, ``masked_scatter``, ``_unsafe_masked_index``,
``_unsafe_masked_index_put_accumulate``, ``aten.slice.Tensor``, ``quantile``/``nanquantile``,
``frexp``, ``renorm``, ``nextafter`` and ``div`` with a ``rounding_mode``.

Formulas follow PyTorch's ``tools/autograd/derivatives.yaml`` (entry named in each rule; the
``*_backward`` helpers it names live in ``torch/csrc/autograd/FunctionsManual.cpp``):

* scatter/index reductions: ``scatter_reduce_backward`` / ``index_reduce_backward`` — sum and
  mean spread the cotangent (mean divides by the count, ``include_self`` counting), prod uses
  the "product of the others" with exact handling of a single zero, amax/amin share the
  cotangent evenly among all the entries equal to the result.  One deliberate difference:
  with ``include_self=False`` an excluded ``self`` entry that happens to equal the result is
  not counted among the ties (PyTorch counts it, giving ``src`` too small a share where the
  function is differentiable); on data without such a coincidence both agree.
* ``quantile``/``nanquantile`` are composite in PyTorch (sort, gather at the two neighbouring
  ranks, ``lerp``): the cotangent goes to the two selected elements with weights
  ``1 - w`` and ``w``, and to ``q`` (when a tensor) through ``w``.
* indexing writes (``index_put``, ``put``, ``masked_scatter``): the overwritten positions of
  ``self`` get zero (unless accumulating) and the written values get the cotangent read back
  at their positions.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from ._base import builtin, randn, uniform
from .extra_nn import pnorm_grad
from .registry import add_rule


def _is_t(x: Any) -> bool:
    return isinstance(x, torch.Tensor) or hasattr(x, "node")


def _z(t: Any, like: Any) -> Any:
    """The tangent ``t``, or zeros shaped like ``like`` when it is None (zero)."""
    return torch.zeros_like(like) if t is None else t


def _first(d: Any) -> Any:
    return d[0] if isinstance(d, (tuple, list)) else d


# ---------------------------------------------------------------------------------------------
# div with rounding_mode, nextafter, frexp
# ---------------------------------------------------------------------------------------------

def _div_call(method: bool):
    def call(x: Any, y: Any, mode: Any) -> Any:
        if method:
            return x.div(y, rounding_mode=mode)
        return torch.div(x, y, rounding_mode=mode)
    return call


def _div_rule(method: bool) -> type:
    call = _div_call(method)

    class Div:
        """div(x, y, rounding_mode): with rounding_mode 'floor' or 'trunc' the result is
        piecewise constant, so both cotangents are zero (derivatives.yaml `div.Tensor_mode`:
        zeros for self and other); with rounding_mode=None it is true division,
        d_x = d / y, d_y = -d x / y^2 (derivatives.yaml `div.Tensor`)."""

        def fwd(input, other, *, rounding_mode=None):
            return call(input, other, rounding_mode), (input, other, rounding_mode)

        def bwd(aux, d):
            x, y, mode = aux
            if mode is not None:
                return None, None
            dx = d / y
            dy = -d * x / (y * y) if _is_t(y) else None
            return dx, dy

        def jvp(primals, tangents):
            x, y, mode = primals
            tx, ty = tangents[0], tangents[1]
            out = call(x, y, mode)
            if mode is not None or (tx is None and ty is None):
                return out, None
            t = None if tx is None else tx / y
            if ty is not None:
                ty_term = -ty * x / (y * y)
                t = ty_term if t is None else t + ty_term
            return out, t

        def samples(dtype):
            for mode in ("floor", "trunc"):
                yield (randn(3, 4, dtype=dtype), uniform((4,), 0.5, 2.0, dtype)), \
                    {"rounding_mode": mode}
                yield (randn(3, 4, dtype=dtype), 1.5), {"rounding_mode": mode}
            yield (randn(3, 4, dtype=dtype), uniform((3, 4), 0.5, 2.0, dtype)), \
                {"rounding_mode": None}

    return Div


for _m, _op in ((False, torch.div), (True, torch.Tensor.div)):
    _cls = _div_rule(_m)
    add_rule(_op, _cls.fwd, _cls.bwd, jvp=_cls.jvp, samples=_cls.samples,
             source=_cls.__doc__, builtin=True)


@builtin(torch.nextafter)
class Nextafter:
    """nextafter(x, y) moves x by one ulp toward y: PyTorch treats it as the identity in x and
    constant in y (derivatives.yaml `nextafter`: self grad, other zeros), so d_x = d."""

    def fwd(input, other):
        return torch.nextafter(input, other), None

    def bwd(aux, d):
        return d, None

    def jvp(primals, tangents):
        x, y = primals
        return torch.nextafter(x, y), tangents[0]

    def samples(dtype):
        yield (randn(3, 4, dtype=dtype), randn(4, dtype=dtype)), {}
        yield (randn(dtype=dtype), randn(2, dtype=dtype)), {}


@builtin(torch.frexp)
class Frexp:
    """frexp(x) -> (mantissa, exponent) with x = mantissa * 2**exponent: the exponent is
    piecewise constant, so d_x = d_mantissa / 2**exponent (derivatives.yaml `frexp.Tensor`:
    grad / exponent.exp2())."""

    def fwd(input):
        out = torch.frexp(input)
        return out, out[1]

    def bwd(aux, d):
        dm = _first(d)
        if dm is None:
            return (None,)
        return (dm / torch.exp2(aux.to(dm.dtype)),)

    def jvp(primals, tangents):
        (x,), (t,) = primals, tangents
        out = torch.frexp(x)
        if t is None:
            return out, (None, None)
        return out, (t / torch.exp2(out[1].to(t.dtype)), None)

    def samples(dtype):
        yield (randn(3, 4, dtype=dtype) * 10,), {}
        yield (randn(dtype=dtype),), {}


# ---------------------------------------------------------------------------------------------
# indexing reads and writes
# ---------------------------------------------------------------------------------------------

def _is_bool_index(i: Any) -> bool:
    return i is not None and _is_t(i) and i.dtype == torch.bool


def _check_index_put(indices: Any) -> None:
    if len(indices) > 1 and any(_is_bool_index(i) for i in indices):
        from ..errors import RuleError

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
    _cls = _index_put_rule(_m)
    add_rule(_op, _cls.fwd, _cls.bwd, jvp=_cls.jvp, samples=_cls.samples,
             source=_cls.__doc__, builtin=True)


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
    _cls = _put_rule(_m)
    add_rule(_op, _cls.fwd, _cls.bwd, jvp=_cls.jvp, samples=_cls.samples,
             source=_cls.__doc__, builtin=True)


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
    _cls = _masked_scatter_rule(_m)
    add_rule(_op, _cls.fwd, _cls.bwd, jvp=_cls.jvp, samples=_cls.samples,
             source=_cls.__doc__, builtin=True)


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


@builtin(torch._unsafe_masked_index)
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


@builtin(torch._unsafe_masked_index_put_accumulate)
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


@builtin(_SLICE)
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


@builtin(torch.scatter_reduce)
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


@builtin(torch.index_reduce)
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


# ---------------------------------------------------------------------------------------------
# renorm, quantile
# ---------------------------------------------------------------------------------------------

def _renorm_parts(x: Any, p: float, dim: int, maxnorm: float) -> tuple:
    dims = tuple(k for k in range(x.dim()) if k != dim % x.dim())
    norm = torch.linalg.vector_norm(x, p, dims, keepdim=True)
    over = norm > maxnorm
    inv = 1.0 / (norm + 1e-7)
    return dims, norm, over, inv


@builtin(torch.renorm)
class Renorm:
    """renorm(x, p, dim, maxnorm): each slice along dim with p-norm N > maxnorm is scaled by
    s = maxnorm / (N + 1e-7).  There d_x = s d - maxnorm / (N + 1e-7)^2 * sum(x d) * dN/dx,
    elsewhere d_x = d (derivatives.yaml `renorm`: renorm_backward; dN/dx is
    `linalg_vector_norm`'s norm_backward)."""

    def fwd(input, p, dim, maxnorm):
        return torch.renorm(input, p, dim, maxnorm), (input, p, dim, maxnorm)

    def bwd(aux, d):
        x, p, dim, maxnorm = aux
        dims, norm, over, inv = _renorm_parts(x, p, dim, maxnorm)
        xd = torch.sum(x * d, dims, keepdim=True)
        g = d * (maxnorm * inv) - pnorm_grad(x, norm, p, xd * (maxnorm * inv * inv), dims)
        return torch.where(over, g, d), None, None, None

    def jvp(primals, tangents):
        x, p, dim, maxnorm = primals
        t = tangents[0]
        out = torch.renorm(x, p, dim, maxnorm)
        if t is None:
            return out, None
        dims, norm, over, inv = _renorm_parts(x, p, dim, maxnorm)
        dn = torch.sum(pnorm_grad(x, norm, p, torch.ones_like(norm), dims) * t, dims,
                       keepdim=True)
        g = t * (maxnorm * inv) - x * (dn * (maxnorm * inv * inv))
        return out, torch.where(over, g, t)

    def samples(dtype):
        x = randn(4, 3, 5, dtype=dtype)
        yield (x, 2, 1, 1.5), {}
        yield (x, 1, -1, 2.0), {}
        yield (x, 3, 0, 2.5), {}
        yield (x, 1.5, 2, 1.0), {}
        yield (x, math.inf, 0, 1.0), {}
        yield (randn(6, 2, dtype=dtype), 2, 0, 0.5), {}


def _quantile_parts(x: Any, q: Any, dim: Any, interpolation: str, ignore_nan: bool) -> dict:
    """Sort along the reduced axis (moved last) and find, per quantile, the ranks of the two
    neighbours and the interpolation weight, as PyTorch's composite quantile does."""
    if dim is None or x.dim() == 0:
        xm = torch.reshape(x, (-1,))
    else:
        xm = torch.movedim(x, dim, -1)
    rest, n = tuple(xm.shape[:-1]), xm.shape[-1]
    vals, order = torch.sort(xm, -1)
    q_is_t = _is_t(q)
    lead = (q.shape[0],) if q_is_t and q.dim() == 1 else ()
    if q_is_t:
        qb = torch.reshape(q, lead + (1,) * (len(rest) + 1))
    else:
        qb = q
    nan = torch.isnan(vals)
    if ignore_nan:
        cnt = torch.sum(torch.logical_not(nan), -1, keepdim=True).to(x.dtype)
        raw = qb * (cnt - 1)
        slope, frozen = cnt - 1, raw < 0
        ranks = torch.where(frozen, 0.0, raw)
    else:
        anynan = torch.any(nan, -1, keepdim=True)
        if not q_is_t:  # a Python q: ranks in x's dtype (torch.where of two floats is float32)
            qb = torch.full_like(anynan, q, dtype=x.dtype)
        ranks = torch.where(anynan, float(n - 1), qb * (n - 1))
        slope, frozen = float(n - 1), anynan
    ranks = torch.broadcast_to(ranks, lead + rest + (1,))
    if interpolation == "lower":
        ranks = torch.floor(ranks)
    elif interpolation == "higher":
        ranks = torch.ceil(ranks)
    elif interpolation == "nearest":
        ranks = torch.round(ranks)
    below = ranks.to(torch.int64)
    parts = {"xm": xm, "rest": rest, "lead": lead, "order": order,
             "vals": torch.broadcast_to(vals, lead + rest + (n,)), "below": below,
             "above": None, "w": None, "slope": slope, "frozen": frozen}
    if interpolation in ("linear", "midpoint"):
        parts["above"] = torch.ceil(ranks).to(torch.int64)
        parts["w"] = ranks - below if interpolation == "linear" else None
    return parts


def _quantile_rule(op: Any, ignore_nan: bool) -> type:
    class Quantile:
        """quantile / nanquantile(x, q, dim, keepdim, interpolation): composite in PyTorch
        (sort, gather at ranks below/above, lerp with weight w = rank - floor(rank)), so the
        cotangent goes to the element of rank below with weight 1 - w and to the one above
        with weight w (0.5 each for 'midpoint', all to one for lower/higher/nearest), then
        back through the sort permutation (derivatives.yaml `sort`, `gather`, `lerp`).  A
        tensor q gets d (above - below) (n - 1) through w for 'linear' (n: the count of
        non-NaN values for nanquantile)."""

        def fwd(input, q, dim=None, keepdim=False, *, interpolation="linear"):
            out = op(input, q, dim, keepdim, interpolation=interpolation)
            return out, (input, q, dim, interpolation)

        def bwd(aux, d):
            x, q, dim, interpolation = aux
            pt = _quantile_parts(x, q, dim, interpolation, ignore_nan)
            lead, rest, n = pt["lead"], pt["rest"], pt["xm"].shape[-1]
            dl = torch.reshape(d, lead + rest + (1,))
            g = torch.zeros(lead + rest + (n,), dtype=d.dtype, device=d.device)
            dq = None
            if pt["above"] is None:
                g = torch.scatter_add(g, -1, pt["below"], dl)
            else:
                w = 0.5 if pt["w"] is None else pt["w"]
                g = torch.scatter_add(g, -1, pt["below"], dl * (1 - w))
                g = torch.scatter_add(g, -1, pt["above"], dl * w)
                if pt["w"] is not None and _is_t(q):
                    diff = (torch.gather(pt["vals"], -1, pt["above"])
                            - torch.gather(pt["vals"], -1, pt["below"]))
                    e = torch.where(pt["frozen"], 0.0, dl * diff * pt["slope"])
                    dq = torch.reshape(torch.sum(e, tuple(range(len(lead), e.dim()))),
                                       tuple(q.shape))
            if lead:
                g = torch.sum(g, 0)
            gx = torch.scatter_add(torch.zeros_like(pt["xm"]), -1, pt["order"], g)
            if dim is None or x.dim() == 0:
                gx = torch.reshape(gx, tuple(x.shape))
            else:
                gx = torch.movedim(gx, -1, dim)
            return gx, dq

        def jvp(primals, tangents):
            x, q, dim, keepdim, interpolation = primals
            tx, tq = tangents[0], tangents[1]
            out = op(x, q, dim, keepdim, interpolation=interpolation)
            if tx is None and tq is None:
                return out, None
            pt = _quantile_parts(x, q, dim, interpolation, ignore_nan)
            lead, rest, n = pt["lead"], pt["rest"], pt["xm"].shape[-1]
            t = torch.zeros(lead + rest + (1,), dtype=x.dtype, device=x.device)
            if tx is not None:
                tm = torch.reshape(tx, (-1,)) if dim is None or x.dim() == 0 \
                    else torch.movedim(tx, dim, -1)
                ts = torch.broadcast_to(torch.gather(tm, -1, pt["order"]), lead + rest + (n,))
                tb = torch.gather(ts, -1, pt["below"])
                if pt["above"] is None:
                    t = tb
                else:
                    w = 0.5 if pt["w"] is None else pt["w"]
                    t = tb * (1 - w) + torch.gather(ts, -1, pt["above"]) * w
            if tq is not None and pt["w"] is not None:
                diff = (torch.gather(pt["vals"], -1, pt["above"])
                        - torch.gather(pt["vals"], -1, pt["below"]))
                tqb = torch.reshape(tq, lead + (1,) * (len(rest) + 1))
                t = t + torch.where(pt["frozen"], 0.0, diff * pt["slope"] * tqb)
            return out, torch.reshape(t, tuple(out.shape))

        def samples(dtype):
            x = randn(4, 5, dtype=dtype)
            for interp in ("linear", "lower", "higher", "midpoint", "nearest"):
                yield (x, 0.33), {"interpolation": interp}
                yield (x, torch.tensor([0.3, 0.6, 0.85], dtype=dtype), 1, True), \
                    {"interpolation": interp}
            yield (x, torch.tensor(0.7, dtype=dtype), 0), {}
            yield (randn(3, 2, 4, dtype=dtype), 0.4, -2, False), {}
            yield (randn(dtype=dtype), 0.5, 0), {}
            if ignore_nan:
                xn = x.clone()
                xn[1, 2] = math.nan
                yield (xn, torch.tensor([0.2, 0.9], dtype=dtype), 1), {}

    return Quantile


for _op, _nan in ((torch.quantile, False), (torch.nanquantile, True)):
    _cls = _quantile_rule(_op, _nan)
    add_rule(_op, _cls.fwd, _cls.bwd, jvp=_cls.jvp, samples=_cls.samples,
             source=_cls.__doc__, builtin=True)
