"""Strided views and finite differences: ``as_strided``, ``as_strided_copy``,
``as_strided_scatter`` and ``gradient``.

``as_strided(x, size, stride, storage_offset)`` reads the storage positions
``p(i) = storage_offset + sum_k i_k * stride_k``.  For an input that owns its whole storage
contiguously (checked while tracing; anything else is refused with a :class:`RuleError`),
storage position ``p`` is element ``p`` of ``x.reshape(-1)``, so

* VJP: ``d_x = zeros(numel).index_add(0, p, d)`` reshaped like ``x`` -- repeated positions
  (overlapping strides) accumulate (derivatives.yaml ``as_strided``: as_strided_backward);
* JVP: ``t_out = torch.take(t_x, p)`` (the same gather, independent of the tangent's layout).

``as_strided_scatter(x, src, size, stride, storage_offset)`` is ``x`` with the positions ``p``
overwritten by ``src``: ``d_x`` is ``d`` with the positions ``p`` zeroed and
``d_src = take(d, p)`` (derivatives.yaml ``as_strided_scatter``, ``src`` entry; with overlapping
positions every ``src`` element receives the cotangent of its position, autograd's convention).
That rule is written below but *not registered*: autograd's ``d_x`` in PyTorch 2.13 is the
complement (``d`` kept at ``p``, zero elsewhere; finite differences side with the rule), so the
op stays on the autograd fallback to keep agreeing with torch.autograd.

``gradient(x, spacing, dim, edge_order)`` (torch.gradient) is, along each requested dim, a
three-point finite-difference stencil: a central difference inside and one-sided differences
of order 1 or 2 at the two ends; with coordinate tensors as spacing the stencil weights are
the nonuniform-grid weights of Fornberg / numpy.gradient,
``a = -h2/(h1 (h1+h2))``, ``b = (h2-h1)/(h1 h2)``, ``c = h1/(h2 (h1+h2))``
(``h1, h2`` the neighbouring steps).  Written with ``r = 1/h`` and ``w = 1/(h1+h2)`` every weight
is a signed sum of ``r`` and ``w`` entries (``a = w - r1``, ``b = r1 - r2``, ``c = r2 - w``,
the edge weights likewise), which gives the derivatives with respect to the coordinates:
``dr = -r^2 dh``, ``dw = -w^2 (dh1 + dh2)``, ``h = diff(coordinates)``.  The VJP with respect to
the input is the transposed stencil (each ``weight * x[s:s+L]`` term becomes
``pad(weight * d, (s, n-s-L))``); the JVP applies the stencil to the tangent and the weight
tangents to the input.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ..errors import RuleError
from ._base import builtin, randn
from .registry import add_rule


def _error(op: str, message: str, hint: str) -> RuleError:
    return RuleError(f"{op}: {message}", op=op, hint=hint)


def _meta(x: Any) -> Any:
    """The (fake or real) tensor behind ``x`` for reading its layout."""
    m = getattr(x, "meta", None)
    return m if isinstance(m, torch.Tensor) else x


def _check_owns_storage(op: str, x: Any, *, offset_matters: bool = True) -> None:
    """Refuse an input whose elements are not storage positions 0..numel-1 in order."""
    v = _meta(x)
    ok = v.is_contiguous()
    if ok and offset_matters:
        try:
            nbytes = v.untyped_storage().nbytes()
        except Exception:  # noqa: BLE001  storage not inspectable: be conservative
            nbytes = -1
        ok = v.storage_offset() == 0 and nbytes == v.numel() * v.element_size()
    if not ok:
        raise _error(op, "the input is not a contiguous tensor owning its whole storage "
                     f"(shape {tuple(v.shape)}, stride {tuple(v.stride())}, storage offset "
                     f"{v.storage_offset()}), so its storage positions are not its elements",
                     "call .contiguous() (or .clone()) on the input first, so the strided "
                     "positions refer to the input's own elements")


def _check_in_bounds(op: str, x: Any, size: Any, stride: Any, offset: int) -> None:
    """Refuse positions past the input's elements (eager as_strided raises there too)."""
    n = _meta(x).numel()
    if all(int(k) > 0 for k in size):
        last = int(offset) + sum((int(k) - 1) * int(s) for k, s in zip(size, stride))
        if int(offset) < 0 or last >= n:
            raise _error(op, f"size {tuple(size)}, stride {tuple(stride)} and storage offset "
                         f"{offset} read storage position {last}, past the input's {n} "
                         "elements", "keep the strided positions inside the input")


def _positions(size: Any, stride: Any, offset: int, device: Any) -> Any:
    """int64 tensor of shape ``size``: the storage position each output element reads."""
    size, stride = tuple(int(s) for s in size), tuple(int(s) for s in stride)
    p = None
    for k, (n, s) in enumerate(zip(size, stride)):
        if n > 1 and s != 0:
            shape = [1] * len(size)
            shape[k] = n
            term = torch.reshape(torch.arange(0, n * s, s, device=device), tuple(shape))
            p = term if p is None else p + term
    if p is None:
        return torch.full(size, int(offset), dtype=torch.int64, device=device)
    if offset:
        p = p + int(offset)
    return p if tuple(p.shape) == size else p.expand(size)


def _offset(x: Any, storage_offset: Any) -> int:
    return _meta(x).storage_offset() if storage_offset is None else int(storage_offset)


class _AsStrided:
    """as_strided(x, size, stride, storage_offset): d_x = zeros.index_add(0, p, d) with p the
    storage positions read (derivatives.yaml `as_strided`: as_strided_backward, for an input
    owning its storage contiguously); JVP: take(t, p)."""

    @classmethod
    def make(cls, op: Any, name: str) -> None:
        def fwd(input, size, stride, storage_offset=None):
            _check_in_bounds(name, input, size, stride, _offset(input, storage_offset))
            _check_owns_storage(name, input)
            out = op(input, size, stride, storage_offset)
            return out, (tuple(input.shape), input.numel(), tuple(size), tuple(stride),
                         _offset(input, storage_offset))

        def bwd(aux, d):
            shape, numel, size, stride, offset = aux
            p = _positions(size, stride, offset, d.device)
            flat = torch.zeros(numel, dtype=d.dtype, device=d.device)
            d_x = flat.index_add(0, torch.reshape(p, (-1,)), torch.reshape(d, (-1,)))
            return torch.reshape(d_x, shape), None, None, None

        def jvp(primals, tangents):
            x, size, stride, storage_offset = primals
            _check_in_bounds(name, x, size, stride, _offset(x, storage_offset))
            _check_owns_storage(name, x)
            out = op(x, size, stride, storage_offset)
            t = tangents[0]
            if t is None:
                return out, None
            p = _positions(size, stride, _offset(x, storage_offset), x.device)
            return out, torch.take(t, p)

        add_rule(op, fwd, bwd, jvp=jvp, samples=_as_strided_samples,
                 source=(cls.__doc__ or "").replace("as_strided(", f"{name}(", 1),
                 builtin=True)


def _as_strided_samples(dtype: torch.dtype):
    yield (randn(3, 3, dtype=dtype), (2, 2), (1, 2)), {}
    yield (randn(3, 3, dtype=dtype), (2, 2), (1, 2), 1), {}
    yield (randn(3, 3, dtype=dtype), (2, 2), (1, 2)), {"storage_offset": 1}
    yield (randn(16, dtype=dtype), (2, 1, 1, 2), (1, 7, 7, 1)), {}
    # overlapping windows: positions repeat, cotangents accumulate
    yield (randn(10, dtype=dtype), (4, 4), (2, 1)), {"storage_offset": 0}
    yield (randn(4, dtype=dtype), (3, 2), (0, 1), 2), {}       # zero stride
    yield (randn(2, 3, dtype=dtype), (), (), 4), {}             # 0-d output
    yield (randn(dtype=dtype), (1,), (1,)), {}                   # 0-d input


_AsStrided.make(torch.as_strided, "torch.as_strided")
_AsStrided.make(torch.as_strided_copy, "torch.as_strided_copy")


# PyTorch 2.13's own backward for ``input`` (as_strided_scatter_backward) returns ``d`` *at*
# the strided positions and zeros elsewhere, the complement of the true derivative, so the
# autograd fallback would be wrong here; this rule is checked against finite differences
# instead (fxad.coverage._AUTOGRAD_WRONG, tests/test_rules.py).
@builtin(torch.as_strided_scatter)
class AsStridedScatter:
    """as_strided_scatter(x, src, size, stride, storage_offset): d_x = d with the strided
    positions p zeroed, d_src = take(d, p) (derivatives.yaml `as_strided_scatter`:
    as_strided_scatter_backward; for overlapping positions autograd's convention: every src
    element gets its position's cotangent); JVP: as_strided_scatter of the tangents."""

    def fwd(input, src, size, stride, storage_offset=None):
        # the op writes into a fresh clone of input, so only contiguity matters
        _check_owns_storage("torch.as_strided_scatter", input, offset_matters=False)
        out = torch.as_strided_scatter(input, src, size, stride, storage_offset)
        off = 0 if storage_offset is None else int(storage_offset)
        return out, (tuple(input.shape), tuple(src.shape), tuple(size), tuple(stride), off)

    def bwd(aux, d):
        shape, src_shape, size, stride, off = aux
        p = _positions(size, stride, off, d.device)
        flat_p = torch.reshape(p, (-1,))
        d_flat = torch.reshape(d, (-1,))
        d_input = torch.reshape(torch.index_fill(d_flat, 0, flat_p, 0.0), shape)
        d_src = torch.reshape(torch.take(d, p), src_shape)
        return d_input, d_src, None, None, None

    def jvp(primals, tangents):
        x, src, size, stride, storage_offset = primals
        _check_owns_storage("torch.as_strided_scatter", x, offset_matters=False)
        out = torch.as_strided_scatter(x, src, size, stride, storage_offset)
        t_x, t_src = tangents[0], tangents[1]
        if t_x is None and t_src is None:
            return out, None
        t_x = torch.zeros_like(x) if t_x is None else t_x.contiguous()
        if t_src is None:
            t_src = torch.zeros_like(src)
        return out, torch.as_strided_scatter(t_x, t_src, size, stride, storage_offset)

    def samples(dtype):
        yield (randn(3, 3, dtype=dtype), randn(2, 2, dtype=dtype), (2, 2), (1, 2)), {}
        yield (randn(3, 3, dtype=dtype), randn(2, 2, dtype=dtype), (2, 2), (1, 2), 1), {}
        yield (randn(3, 3, dtype=dtype), randn(2, 2, dtype=dtype), (2, 2), (2, 1)), \
            {"storage_offset": 0}
        yield (randn(16, dtype=dtype), randn(2, 1, 1, 2, dtype=dtype), (2, 1, 1, 2),
               (1, 2, 4, 8)), {}
        yield (randn(1, dtype=dtype), randn(dtype=dtype), (), ()), {}


# --------------------------------------------------------------------------------------------
# torch.gradient


def _gradient_dims(x: Any, dim: Any) -> list[int]:
    nd = x.dim()
    if dim is None:
        return list(range(nd))
    if isinstance(dim, int):
        return [dim % nd]
    return [d % nd for d in dim]


def _gradient_spacings(spacing: Any, k: int) -> list[Any]:
    """One entry per differentiated dim: a Python number, a 0-d tensor, or a 1-D coordinate
    tensor."""
    if spacing is None:
        return [1.0] * k
    if isinstance(spacing, (list, tuple)):
        if len(spacing) != k:  # torch.gradient has already refused this in the forward
            raise _error("torch.gradient", f"expected {k} spacings, got {len(spacing)}",
                         "give one spacing per differentiated dim")
        return list(spacing)
    return [spacing] * k


def _coord_tensor(h: Any) -> bool:
    v = _meta(h)
    return isinstance(v, torch.Tensor) and v.dim() == 1


def _weights_uniform(h: Any, n: int, edge_order: int) -> list[list[tuple[int, Any]]]:
    """Stencil of one dim with uniform step ``h``: segments (prepend, center, append), each a
    list of (start, weight) terms meaning sum weight * x[start:start+len]."""
    half = 0.5 / h
    center = [(0, -half), (2, half)]
    if edge_order == 1:
        pre = [(0, -1.0 / h), (1, 1.0 / h)]
        app = [(n - 2, -1.0 / h), (n - 1, 1.0 / h)]
    else:
        pre = [(0, -1.5 / h), (1, 2.0 / h), (2, -0.5 / h)]
        app = [(n - 3, 0.5 / h), (n - 2, -2.0 / h), (n - 1, 1.5 / h)]
    return [pre, center, app]


def _weights_coords(r: Any, w: Any, n: int, edge_order: int) -> list[list[tuple[int, Any]]]:
    """Stencil weights on a nonuniform grid as signed sums of r = 1/h (length n-1) and
    w = 1/(h[:-1] + h[1:]) (length n-2).  Linear in (r, w): called with their tangents it
    gives the weight tangents."""
    center = [(0, w - r[:-1]), (1, r[:-1] - r[1:]), (2, r[1:] - w)]
    if edge_order == 1:
        pre = [(0, -r[0]), (1, r[0])]
        app = [(n - 2, -r[-1]), (n - 1, r[-1])]
    else:
        pre = [(0, -(r[0] + w[0])), (1, r[0] + r[1]), (2, w[0] - r[1])]
        app = [(n - 3, r[-2] - w[-1]), (n - 2, -(r[-2] + r[-1])), (n - 1, r[-1] + w[-1])]
    return [pre, center, app]


def _seg_lengths(n: int) -> list[int]:
    return [1, n - 2, 1]


def _apply(xm: Any, segs: list, n: int) -> Any:
    """Apply a stencil along the last dim of ``xm``."""
    parts = []
    for terms, length in zip(segs, _seg_lengths(n)):
        acc = None
        for start, wt in terms:
            term = wt * xm[..., start:start + length]
            acc = term if acc is None else acc + term
        parts.append(acc)
    return torch.cat(parts, -1)


def _apply_t(gm: Any, segs: list, n: int) -> Any:
    """Transpose of :func:`_apply`: scatter each term back with a zero pad."""
    acc = None
    pos = 0
    for terms, length in zip(segs, _seg_lengths(n)):
        g = gm[..., pos:pos + length]
        pos += length
        for start, wt in terms:
            term = F.pad(wt * g, (start, n - start - length))
            acc = term if acc is None else acc + term
    return acc


def _reduce_lead(v: Any) -> Any:
    """Sum over all dims but the last."""
    return v if v.dim() == 1 else torch.sum(v, tuple(range(v.dim() - 1)))


def _coord_cotangent(xm: Any, gm: Any, r: Any, w: Any, n: int, edge_order: int) -> Any:
    """Cotangent of the coordinate vector: weight cotangents -> (r, w) -> h -> coordinates."""
    lengths = _seg_lengths(n)
    offs = [0, 1, n - 1]

    def dwt(seg: int, start: int) -> Any:
        g = gm[..., offs[seg]:offs[seg] + lengths[seg]]
        v = _reduce_lead(g * xm[..., start:start + lengths[seg]])
        return v if seg == 1 else torch.sum(v)

    m = n - 1  # len(r)

    def at(v: Any, i: int, size: int) -> Any:  # a scalar placed at index i of a zero vector
        return F.pad(torch.reshape(v, (1,)), (i % size, size - 1 - i % size))

    # center: a = w - r[:-1], b = r[:-1] - r[1:], c = r[1:] - w
    da, db, dc = dwt(1, 0), dwt(1, 1), dwt(1, 2)
    d_r = F.pad(db - da, (0, 1)) + F.pad(dc - db, (1, 0))
    d_w = da - dc
    if edge_order == 1:
        d_r = d_r + at(dwt(0, 1) - dwt(0, 0), 0, m) + at(dwt(2, n - 1) - dwt(2, n - 2), -1, m)
    else:
        p0, p1, p2 = dwt(0, 0), dwt(0, 1), dwt(0, 2)
        q0, q1, q2 = dwt(2, n - 3), dwt(2, n - 2), dwt(2, n - 1)
        d_r = d_r + at(p1 - p0, 0, m) + at(p1 - p2, 1, m) + at(q0 - q1, -2, m) \
            + at(q2 - q1, -1, m)
        d_w = d_w + at(p2 - p0, 0, n - 2) + at(q2 - q0, -1, n - 2)
    d_sw = -(w * w) * d_w                       # cotangent of h[:-1] + h[1:]
    d_h = -(r * r) * d_r + F.pad(d_sw, (0, 1)) + F.pad(d_sw, (1, 0))
    return F.pad(d_h, (1, 0)) - F.pad(d_h, (0, 1))   # transpose of diff


def _steps(c: Any) -> tuple[Any, Any]:
    h = c[1:] - c[:-1]
    return 1.0 / h, 1.0 / (h[:-1] + h[1:])


@builtin(torch.gradient)
class Gradient:
    """gradient(x, spacing, dim, edge_order) (torch.gradient): per dim a three-point stencil
    (central inside, one-sided of order 1 or 2 at the ends; nonuniform-grid weights of
    numpy.gradient / Fornberg for coordinate spacings).  Linear in x: d_x is the transposed
    stencil (slices become zero pads); coordinate tensors get the derivative of the weights
    through r = 1/h, w = 1/(h1+h2), h = diff(coordinates) (module docstring)."""

    def fwd(input, *, spacing=None, dim=None, edge_order=1):
        kw: dict = {"edge_order": edge_order}
        if spacing is not None:
            kw["spacing"] = spacing
        if dim is not None:
            kw["dim"] = dim
        out = torch.gradient(input, **kw)
        dims = _gradient_dims(input, dim)
        hs = _gradient_spacings(spacing, len(dims))
        return out, (input, dims, hs, edge_order)

    def bwd(aux, d):
        x, dims, hs, edge_order = aux
        d_x = None
        d_coords: list = [None] * len(hs)
        for i, (k, h) in enumerate(zip(dims, hs)):
            g = d[i]
            if g is None:
                continue
            n = x.shape[k]
            gm = torch.movedim(g, k, -1)
            if _coord_tensor(h):
                r, w = _steps(h)
                segs = _weights_coords(r, w, n, edge_order)
                d_coords[i] = _coord_cotangent(torch.movedim(x, k, -1), gm, r, w, n,
                                               edge_order)
            else:
                segs = _weights_uniform(h, n, edge_order)
            term = torch.movedim(_apply_t(gm, segs, n), -1, k)
            d_x = term if d_x is None else d_x + term
        out: dict = {"input": d_x}
        if any(_coord_tensor(h) for h in hs) and isinstance(hs, list):
            out["spacing"] = d_coords
        return out

    def jvp(primals, tangents):
        x, spacing, dim, edge_order = primals
        out, (_, dims, hs, _) = Gradient.fwd(x, spacing=spacing, dim=dim,
                                             edge_order=edge_order)
        t_x, t_sp = tangents[0], tangents[1]
        t_hs = list(t_sp) if isinstance(t_sp, (list, tuple)) else [None] * len(hs)
        res = []
        for i, (k, h) in enumerate(zip(dims, hs)):
            n = x.shape[k]
            xm = torch.movedim(x, k, -1)
            t = None
            if _coord_tensor(h):
                r, w = _steps(h)
                segs = _weights_coords(r, w, n, edge_order)
                t_c = t_hs[i] if i < len(t_hs) else None
                if t_c is not None:
                    t_h = t_c[1:] - t_c[:-1]
                    t_r = -(r * r) * t_h
                    t_w = -(w * w) * (t_h[:-1] + t_h[1:])
                    t = _apply(xm, _weights_coords(t_r, t_w, n, edge_order), n)
            else:
                segs = _weights_uniform(h, n, edge_order)
            if t_x is not None:
                tx = _apply(torch.movedim(t_x, k, -1), segs, n)
                t = tx if t is None else t + tx
            res.append(None if t is None else torch.movedim(t, -1, k))
        return out, tuple(res)

    def samples(dtype):
        yield (randn(5, dtype=dtype),), {}
        yield (randn(5, dtype=dtype),), {"spacing": 2.0}
        yield (randn(5, 5, dtype=dtype),), {"edge_order": 2}
        yield (randn(5, 5, dtype=dtype),), {"spacing": [2.0, 2.1]}
        yield (randn(4, 4, 4, dtype=dtype),), {"spacing": [2.0, 1.0], "dim": (0, 1),
                                               "edge_order": 2}
        yield (randn(3, 4, dtype=dtype),), {"dim": 1, "spacing": 0.5}
        yield (randn(2, 3, dtype=dtype),), {"dim": -2}            # size 2: center empty
        c1 = torch.tensor([1.1, 2.0, 3.5], dtype=dtype)
        c2 = torch.tensor([4.0, 2.0, 6.0, 6.5], dtype=dtype)
        yield (randn(3, 3, 4, dtype=dtype),), {"spacing": [c1, c2], "dim": (0, -1)}
        yield (randn(3, 3, 4, dtype=dtype),), {"spacing": [c1, c2], "dim": (1, 2),
                                               "edge_order": 2}
        yield (randn(3, 4, dtype=dtype),), {"spacing": (c1, c2), "edge_order": 2}   # tuple
        c3 = torch.tensor([0.5, 1.7, 2.0, 3.1, 4.6], dtype=dtype)
        yield (randn(5, dtype=dtype),), {"spacing": [c3], "edge_order": 2}
        yield (randn(2, 3, dtype=dtype),), {"spacing": [torch.tensor([0.0, 1.5], dtype=dtype)],
                                            "dim": 0}
