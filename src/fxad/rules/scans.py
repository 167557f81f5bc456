"""Rules for cumulative ops, integration and finite differences: ``cumsum``, ``cumprod``,
``logcumsumexp``, ``cummax``/``cummin``, ``trapezoid``/``trapz``/``cumulative_trapezoid``,
``diff`` and ``gradient``.

A scan's cotangent is the reverse scan of the output cotangent (``cumsum``: a flipped
cumulative sum); ``cumprod`` uses exclusive products, so inputs with zeros get autograd's
(exact) cotangents; ``cummax``/``cummin`` scatter the cotangent back to the running argmax
(derivatives.yaml entries named in each rule).

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

import math
from typing import Any

import torch
import torch.nn.functional as F

from ._base import randn, _error, _excl_cumprod, _index_back, _meta, _value_d
from .registry import register_vjp


def _flipsum(d: Any, dim: int) -> Any:
    """Reverse cumulative sum along ``dim``."""
    return torch.flip(torch.cumsum(torch.flip(d, [dim]), dim), [dim])


@register_vjp(torch.cumsum)
class Cumsum:
    """cumsum(x, dim): d_x = reverse cumsum of d along dim (derivatives.yaml `cumsum`:
    cumsum_backward)."""

    def fwd(input, dim, *, dtype=None):
        out = torch.cumsum(input, dim) if dtype is None else torch.cumsum(input, dim, dtype=dtype)
        return out, (input.dim(), dim)

    def bwd(aux, d):
        ndim, dim = aux
        if ndim == 0:
            return d, None
        return _flipsum(d, dim), None

    def jvp(primals, tangents):
        x, dim, dtype = primals
        kw = {} if dtype is None else {"dtype": dtype}
        t = tangents[0]
        return torch.cumsum(x, dim, **kw), (None if t is None else torch.cumsum(t, dim, **kw))

    def samples(dtype):
        yield (randn(3, 4, dtype=dtype), 1), {}
        yield (randn(3, 4, 2, dtype=dtype), 0), {}
        yield (randn(dtype=dtype), 0), {}


@register_vjp(torch.cumprod)
class Cumprod:
    """cumprod(x, dim): d_x_k = sum_{i >= k} d_i prod_{j <= i, j != k} x_j, formed as
    (exclusive prefix product)_k * sum_i d_i prod_{k < j <= i} x_j with an (n, n) masked cumprod
    (exact with zeros; derivatives.yaml `cumprod`: cumprod_backward)."""

    def fwd(input, dim, *, dtype=None):
        out = torch.cumprod(input, dim) if dtype is None else torch.cumprod(input, dim,
                                                                            dtype=dtype)
        return out, (input, dim)

    def bwd(aux, d):
        x, dim = aux
        if x.dim() == 0:
            return d, None
        xm, dm = torch.movedim(x, dim, -1), torch.movedim(d, dim, -1)
        n = xm.shape[-1]
        after = torch.ones(n, n, dtype=torch.bool, device=x.device).triu(1)   # [k, j]: j > k
        upper = torch.ones(n, n, dtype=torch.bool, device=x.device).triu()    # [k, i]: i >= k
        p = torch.cumprod(torch.where(after, torch.unsqueeze(xm, -2), 1.0), -1)
        s = torch.sum(torch.where(upper, p * torch.unsqueeze(dm, -2), 0.0), -1)
        return torch.movedim(_excl_cumprod(xm, -1 % xm.dim()) * s, -1, dim), None

    def jvp(primals, tangents):
        x, dim, dtype = primals
        t = tangents[0]
        kw = {} if dtype is None else {"dtype": dtype}
        out = torch.cumprod(x, dim, **kw)
        if t is None or x.dim() == 0:
            return out, t
        # t_out_i = sum_{k <= i} t_k prod_{j <= i, j != k} x_j
        xm, tm = torch.movedim(x, dim, -1), torch.movedim(t, dim, -1)
        n = xm.shape[-1]
        after = torch.ones(n, n, dtype=torch.bool, device=x.device).triu(1)
        upper = torch.ones(n, n, dtype=torch.bool, device=x.device).triu()
        p = torch.cumprod(torch.where(after, torch.unsqueeze(xm, -2), 1.0), -1)
        w = torch.unsqueeze(_excl_cumprod(xm, xm.dim() - 1) * tm, -1)
        return out, torch.movedim(torch.sum(torch.where(upper, p * w, 0.0), -2), -1, dim)

    def samples(dtype):
        x = randn(3, 4, dtype=dtype)
        yield (x, 1), {}
        z = x.clone()
        z[1, 2] = 0
        z[0, 0] = 0
        z[2, 1] = 0
        z[2, 3] = 0
        yield (z, 1), {}
        yield (z, 0), {}


@register_vjp(torch.logcumsumexp)
class LogCumSumExp:
    """logcumsumexp(x, dim): d_x_k = sum_{i >= k} d_i exp(x_k - out_i), formed with an (n, n)
    mask (exponents <= 0, so stable; derivatives.yaml `logcumsumexp`:
    logcumsumexp_backward)."""

    def fwd(input, dim):
        out = torch.logcumsumexp(input, dim)
        return out, (input, out, dim)

    def bwd(aux, d):
        x, out, dim = aux
        if x.dim() == 0:
            return d, None
        xm, om, dm = (torch.movedim(v, dim, -1) for v in (x, out, d))
        n = xm.shape[-1]
        upper = torch.ones(n, n, dtype=torch.bool, device=x.device).triu()    # [k, i]: i >= k
        e = torch.where(upper, torch.unsqueeze(xm, -1) - torch.unsqueeze(om, -2), -math.inf)
        g = torch.sum(torch.exp(e) * torch.unsqueeze(dm, -2), -1)
        return torch.movedim(g, -1, dim), None

    def jvp(primals, tangents):
        x, dim = primals
        t = tangents[0]
        out = torch.logcumsumexp(x, dim)
        if t is None or x.dim() == 0:
            return out, t
        # t_out_i = sum_{k <= i} t_k exp(x_k - out_i)
        xm, om, tm = (torch.movedim(v, dim, -1) for v in (x, out, t))
        n = xm.shape[-1]
        upper = torch.ones(n, n, dtype=torch.bool, device=x.device).triu()
        e = torch.where(upper, torch.unsqueeze(xm, -1) - torch.unsqueeze(om, -2), -math.inf)
        g = torch.sum(torch.exp(e) * torch.unsqueeze(tm, -1), -2)
        return out, torch.movedim(g, -1, dim)

    def samples(dtype):
        yield (randn(3, 4, dtype=dtype), 1), {}
        yield (randn(3, 4, dtype=dtype), 0), {}


def _cum_max_min(op: Any) -> type:
    class CumMaxMin:
        """cummax/cummin(x, dim) -> (values, indices): d_x = zeros.scatter_add(dim, indices,
        d_values) (derivatives.yaml `cummax`/`cummin`: cummaxmin_backward)."""

        def fwd(input, dim):
            out = op(input, dim)
            return out, (input, dim, out[1])

        def bwd(aux, d):
            x, dim, idx = aux
            d = _value_d(d)
            if d is None:
                return None, None
            return _index_back(x, dim, idx, d), None

        def samples(dtype):
            yield (randn(3, 4, dtype=dtype), 1), {}
            yield (randn(3, 4, dtype=dtype), 0), {}

    return CumMaxMin


register_vjp(torch.cummax)(_cum_max_min(torch.cummax))
register_vjp(torch.cummin)(_cum_max_min(torch.cummin))


def _trap_grads(y: Any, x: Any, dx: Any, dim: int, u: Any) -> tuple[Any, Any]:
    """Cotangents of sum_i u_i s_i (y_i + y_{i+1}) / 2 (s: spacing dx, or diff(x))."""
    nd = y.dim()
    dim = dim % nd
    n = y.shape[dim]
    lo, hi = torch.narrow(y, dim, 0, n - 1), torch.narrow(y, dim, 1, n - 1)
    shape = list(torch.broadcast_shapes(tuple(u.shape), tuple(lo.shape)))
    u = u.expand(shape)
    if x is None:
        q = u * (1 if dx is None else dx)
    elif x.dim() == 1:
        s = torch.reshape(torch.diff(x), [1] * dim + [n - 1] + [1] * (nd - dim - 1))
        q = u * s
    else:
        q = u * torch.diff(x, dim=dim)
    z = torch.zeros_like(torch.narrow(q, dim, 0, 1))
    d_y = 0.5 * (torch.cat([q, z], dim) + torch.cat([z, q], dim))
    d_x = None
    if x is not None:
        r = u * 0.5 * (lo + hi)
        zr = torch.zeros_like(torch.narrow(r, dim, 0, 1))
        g = torch.cat([zr, r], dim) - torch.cat([r, zr], dim)
        if x.dim() == 1 and nd > 1:
            g = torch.sum(g, [k for k in range(nd) if k != dim])
        d_x = g
    return d_y, d_x


def _trap_rule(op: Any, name: str, cumulative: bool) -> type:
    class Trapezoid:
        source = (f"{name}(y, x or dx, dim): linear in y with weights s_i/2 on y_i and "
                  "y_{i+1} (s = dx or diff(x)); d_x from the transpose of diff "
                  f"(derivatives.yaml: composite of `diff`, `mul`, `sum`"
                  f"{', `cumsum`' if cumulative else ''})")

        def fwd(y, x=None, *, dx=None, dim=-1):
            if x is not None:
                out = op(y, x, dim=dim)
            elif dx is not None:
                out = op(y, dx=dx, dim=dim)
            else:
                out = op(y, dim=dim)
            return out, (y, x, dx, dim)

        def bwd(aux, d):
            y, x, dx, dim = aux
            dim = dim % y.dim()
            u = torch.flip(torch.cumsum(torch.flip(d, [dim]), dim), [dim]) if cumulative \
                else torch.unsqueeze(d, dim)
            return _trap_grads(y, x, dx, dim, u)

        def samples(dtype):
            yield (randn(3, 5, dtype=dtype),), {}
            yield (randn(3, 5, dtype=dtype), randn(5, dtype=dtype)), {}
            yield (randn(3, 5, dtype=dtype), randn(3, 5, dtype=dtype)), {"dim": 0}
            yield (randn(3, 5, dtype=dtype),), {"dx": 0.5}

    return Trapezoid


register_vjp(torch.trapezoid)(_trap_rule(torch.trapezoid, "trapezoid", False))
register_vjp(torch.trapz)(_trap_rule(torch.trapz, "trapz", False))
register_vjp(torch.cumulative_trapezoid)(_trap_rule(torch.cumulative_trapezoid,
                                                    "cumulative_trapezoid", True))


@register_vjp(torch.diff)
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


@register_vjp(torch.gradient)
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
