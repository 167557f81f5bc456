"""More reductions and scans: ``cumsum``, ``cumprod``, ``logcumsumexp``, ``cummax``/``cummin``,
``prod``, ``nansum``/``nanmean``, value-selecting reductions (``sort``, ``msort``, ``topk``,
``kthvalue``, ``median``, ``nanmedian``, ``mode``, ``aminmax``), ``std_mean`` and the p-norms
(``linalg.vector_norm``, ``norm``, ``dist``).

A reduction's backward returns the cotangent with reduced dims restored as size 1 (the engine
expands it).  Value-selecting reductions scatter the cotangent back to the selected indices
(derivatives.yaml ``value_selecting_reduction_backward``); ``median()`` without ``dim``
spreads it evenly over the ties (``evenly_distribute_backward``).  ``prod`` and ``cumprod``
use exclusive products, so inputs with zeros get autograd's (exact) cotangents.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from ._base import builtin, dims_of, randn, restore_reduced, uniform
from .extra_nn import pnorm_grad
from .reductions import _count, _safe_div, _var_args


def _t(shape: tuple, dtype: torch.dtype, lo: float = -2.0, hi: float = 2.0) -> torch.Tensor:
    return uniform(shape, lo, hi, dtype)


def _flipsum(d: Any, dim: int) -> Any:
    """Reverse cumulative sum along ``dim``."""
    return torch.flip(torch.cumsum(torch.flip(d, [dim]), dim), [dim])


@builtin(torch.cumsum)
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


def _excl_cumprod(x: Any, dim: int) -> Any:
    """prod_{j < k} x_j along ``dim`` (1 at k = 0), without division."""
    n = x.shape[dim]
    ones = torch.ones_like(torch.narrow(x, dim, 0, 1))
    return torch.cat([ones, torch.cumprod(torch.narrow(x, dim, 0, n - 1), dim)], dim)


def _prod_others(x: Any, dim: int) -> Any:
    """prod_{j != k} x_j along ``dim`` (exact with zeros): left and right exclusive products."""
    right = torch.flip(_excl_cumprod(torch.flip(x, [dim]), dim), [dim])
    return _excl_cumprod(x, dim) * right


@builtin(torch.prod)
class Prod:
    """prod(x, dim): d_x_k = d * prod_{j != k} x_j, computed as left * right exclusive
    cumulative products (exact with zeros; derivatives.yaml `prod.dim_int`: prod_backward)."""

    def fwd(input, dim=None, keepdim=False, *, dtype=None):
        kw = {} if dtype is None else {"dtype": dtype}
        out = torch.prod(input, **kw) if dim is None else torch.prod(input, dim, keepdim, **kw)
        return out, (input, dim, keepdim)

    def bwd(aux, d):
        x, dim, keepdim = aux
        if x.dim() == 0:
            return (d,)
        if dim is None:
            flat = torch.reshape(x, (-1,))
            return (torch.reshape(_prod_others(flat, 0), tuple(x.shape)) * d,)
        dim = dim % x.dim()
        return (_prod_others(x, dim) * restore_reduced(d, (dim,), keepdim),)

    def samples(dtype):
        x = randn(3, 4, dtype=dtype)
        yield (x,), {}
        yield (x, 1), {}
        z = x.clone()
        z[1, 2] = 0
        z[0, 0] = 0
        z[0, 3] = 0
        yield (z, 1, True), {}
        yield (z,), {}


@builtin(torch.cumprod)
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


@builtin(torch.logcumsumexp)
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


def _index_back(x: Any, dim: int, idx: Any, d: Any, keepdim: bool = True) -> Any:
    """zeros like x with d scatter-added at idx along dim (idx/d reduced if not keepdim)."""
    if x.dim() == 0:
        return d
    if not keepdim:
        idx, d = torch.unsqueeze(idx, dim), torch.unsqueeze(d, dim)
    return torch.zeros_like(x).scatter_add(dim, idx, d)


def _value_d(d: Any) -> Any:
    return d[0] if isinstance(d, (tuple, list)) else d


class CumMaxMin:
    """cummax/cummin(x, dim) -> (values, indices): d_x = zeros.scatter_add(dim, indices,
    d_values) (derivatives.yaml `cummax`/`cummin`: cummaxmin_backward)."""

    def bwd(aux, d):
        x, dim, idx = aux
        d = _value_d(d)
        if d is None:
            return None, None
        return _index_back(x, dim, idx, d), None


def _cum_fwd(op):
    def fwd(input, dim):
        out = op(input, dim)
        return out, (input, dim, out[1])
    return fwd


def _cum_samples(dtype):
    yield (randn(3, 4, dtype=dtype), 1), {}
    yield (randn(3, 4, dtype=dtype), 0), {}


from .registry import add_rule  # noqa: E402

for _op in (torch.cummax, torch.cummin):
    add_rule(_op, _cum_fwd(_op), CumMaxMin.bwd, samples=_cum_samples,
             source=CumMaxMin.__doc__, builtin=True)


@builtin(torch.sort)
class Sort:
    """sort(x, dim) -> (values, indices): d_x = zeros.scatter_add(dim, indices, d_values)
    (derivatives.yaml `sort.stable`: value_selecting_reduction_backward)."""

    def fwd(input, dim=-1, descending=False, stable=None):
        kw = {} if stable is None else {"stable": stable}
        out = torch.sort(input, dim=dim, descending=descending, **kw)
        return out, (input, dim, out[1])

    def bwd(aux, d):
        x, dim, idx = aux
        d = _value_d(d)
        return (None if d is None else _index_back(x, dim, idx, d)),

    def samples(dtype):
        yield (randn(3, 4, dtype=dtype),), {}
        yield (randn(3, 4, dtype=dtype), 0, True), {}


@builtin(torch.msort)
class Msort:
    """msort(x) = sort(x, 0).values: d_x = zeros.scatter_add(0, indices, d)
    (derivatives.yaml `sort`)."""

    def fwd(input):
        out = torch.msort(input)
        return out, (input, torch.sort(input, 0)[1])

    def bwd(aux, d):
        x, idx = aux
        return (_index_back(x, 0, idx, d),)

    def samples(dtype):
        yield (randn(3, 4, dtype=dtype),), {}


@builtin(torch.topk)
class Topk:
    """topk(x, k, dim) -> (values, indices): d_x = zeros.scatter_add(dim, indices, d_values)
    (derivatives.yaml `topk`: value_selecting_reduction_backward)."""

    def fwd(input, k, dim=-1, largest=True, sorted=True):
        out = torch.topk(input, k, dim, largest, sorted)
        return out, (input, dim, out[1])

    def bwd(aux, d):
        x, dim, idx = aux
        d = _value_d(d)
        return (None if d is None else _index_back(x, dim, idx, d)),

    def samples(dtype):
        yield (randn(3, 5, dtype=dtype), 2), {}
        yield (randn(3, 5, dtype=dtype), 2, 0, False), {}


def _selecting(op, name, extra_first=False):
    """Register a (values, indices) reduction over ``dim`` with ``keepdim``."""

    def bwd(aux, d):
        x, dim, keepdim, idx = aux
        d = _value_d(d)
        if d is None:
            return (None,)
        return (_index_back(x, dim % max(x.dim(), 1), idx, d, keepdim),)

    if extra_first:
        def fwd(input, k, dim=-1, keepdim=False):
            out = op(input, k, dim, keepdim)
            return out, (input, dim, keepdim, out[1])

        def samples(dtype):
            yield (randn(3, 5, dtype=dtype), 2), {}
            yield (randn(3, 5, dtype=dtype), 3, 0, True), {}
    else:
        def fwd(input, dim=-1, keepdim=False):
            out = op(input, dim, keepdim)
            return out, (input, dim, keepdim, out[1])

        def samples(dtype):
            yield (randn(3, 5, dtype=dtype),), {}
            yield (randn(3, 5, dtype=dtype), 0, True), {}

    add_rule(op, fwd, bwd, samples=samples, builtin=True,
             source=f"{name}(x, dim) -> (values, indices): d_x = zeros.scatter_add(dim, "
                    f"indices, d_values) (derivatives.yaml `{name}`: "
                    "value_selecting_reduction_backward)")


_selecting(torch.kthvalue, "kthvalue", extra_first=True)
_selecting(torch.mode, "mode")


def _median_rule(op, name):
    def fwd(input, dim=None, keepdim=False):
        if dim is None:
            out = op(input)
            return out, (input, None, keepdim, out)
        out = op(input, dim, keepdim)
        return out, (input, dim, keepdim, out[1])

    def bwd(aux, d):
        x, dim, keepdim, res = aux
        if dim is None:
            mask = (x == res) | (torch.isnan(x) & torch.isnan(res))
            return (mask * (d / torch.sum(mask)),)
        d = _value_d(d)
        if d is None:
            return (None,)
        return (_index_back(x, dim % max(x.dim(), 1), res, d, keepdim),)

    def samples(dtype):
        yield (randn(3, 5, dtype=dtype),), {}
        yield (randn(3, 5, dtype=dtype), 1), {}

    add_rule(op, fwd, bwd, samples=samples, builtin=True,
             source=f"{name}(x) spreads d evenly over the elements equal to the result "
                    f"(evenly_distribute_backward); {name}(x, dim) scatters d_values to the "
                    f"indices (value_selecting_reduction_backward) (derivatives.yaml `{name}`)")


_median_rule(torch.median, "median")
_median_rule(torch.nanmedian, "nanmedian")


@builtin(torch.aminmax)
class AminMax:
    """aminmax(x, dim) -> (min, max): each cotangent spread evenly over the elements equal to
    its result along the reduced dims (derivatives.yaml `aminmax`: like `amin`/`amax`,
    scale_grad_by_count)."""

    def fwd(input, *, dim=None, keepdim=False):
        out = torch.aminmax(input) if dim is None else torch.aminmax(input, dim=dim,
                                                                     keepdim=keepdim)
        return out, (input, dim, keepdim, out)

    def bwd(aux, d):
        x, dim, keepdim, out = aux
        dims = dims_of(dim, x.dim())
        red = dims if dim is not None else ()
        d_x = None
        for dv, v in zip(d, out):
            if dv is None:
                continue
            v = restore_reduced(v, red, keepdim)
            mask = (x == v).to(x.dtype)
            cnt = torch.sum(mask, dims, keepdim=True) if dims else mask
            g = restore_reduced(dv, red, keepdim) * mask / cnt
            d_x = g if d_x is None else d_x + g
        return (d_x,)

    def samples(dtype):
        yield (randn(3, 5, dtype=dtype),), {}
        yield (randn(3, 5, dtype=dtype),), {"dim": 1}
        yield (torch.tensor([[1.0, 2.0, 2.0], [2.0, 0.5, 0.5]], dtype=dtype),), \
            {"dim": 0, "keepdim": True}


@builtin(torch.nansum)
class NanSum:
    """nansum(x, dim): d_x = d broadcast back, 0 at NaN inputs (derivatives.yaml `nansum`)."""

    def fwd(input, dim=None, keepdim=False, *, dtype=None):
        kw = {} if dtype is None else {"dtype": dtype}
        out = torch.nansum(input, **kw) if dim is None else torch.nansum(input, dim, keepdim,
                                                                         **kw)
        return out, (input, dim, keepdim)

    def bwd(aux, d):
        x, dim, keepdim = aux
        red = dims_of(dim, x.dim()) if dim is not None else ()
        return (torch.where(torch.isnan(x), 0.0, restore_reduced(d, red, keepdim)),)

    def samples(dtype):
        x = randn(3, 4, dtype=dtype)
        x[1, 1] = float("nan")
        yield (x,), {}
        yield (x, 1), {}


@builtin(torch.nanmean)
class NanMean:
    """nanmean(x, dim) = nansum(x, dim) / count of non-NaN: d_x = d / count broadcast back,
    0 at NaN inputs (derivatives.yaml composite: nansum / sum(~isnan))."""

    def fwd(input, dim=None, keepdim=False, *, dtype=None):
        kw = {} if dtype is None else {"dtype": dtype}
        out = torch.nanmean(input, **kw) if dim is None else torch.nanmean(input, dim, keepdim,
                                                                           **kw)
        return out, (input, dim, keepdim)

    def bwd(aux, d):
        x, dim, keepdim = aux
        dims = dims_of(dim, x.dim())
        red = dims if dim is not None else ()
        ok = ~torch.isnan(x)
        cnt = torch.sum(ok, dims, keepdim=True) if dims else ok
        return (torch.where(ok, restore_reduced(d, red, keepdim) / cnt, 0.0),)

    def samples(dtype):
        x = randn(3, 4, dtype=dtype)
        x[1, 1] = float("nan")
        yield (x,), {}
        yield (x, 1), {}


@builtin(torch.std_mean)
class StdMean:
    """std_mean(x, dim, correction) -> (std, mean): d_x = d_std (x - mean) / ((n - c) std)
    + d_mean / n (derivatives.yaml `std_mean.correction`: std_mean_backward)."""

    def fwd(input, dim=None, unbiased=None, keepdim=False, *, correction=None):
        dim_, keep, corr = _var_args(dim, unbiased, keepdim, correction)
        out = torch.std_mean(input, dim_, correction=corr, keepdim=keep)
        return out, (input, dim_, keep, corr, out[0])

    def bwd(aux, d):
        x, dim, keepdim, corr, std = aux
        d_std, d_mean = d
        dims = dims_of(dim, x.dim())
        n = _count(tuple(x.shape), dims)
        red = dims if dim is not None else ()
        d_x = None
        if d_std is not None:
            centered = x - torch.mean(x, dims, keepdim=True) if dims else x - x
            s = restore_reduced(std, red, keepdim)
            d_x = restore_reduced(d_std, red, keepdim) * centered * _safe_div(1.0, n - corr) / s
        if d_mean is not None:
            d_m = restore_reduced(d_mean, red, keepdim) / n
            d_x = d_m if d_x is None else d_x + d_m
        return (d_x,)

    def samples(dtype):
        yield (randn(3, 4, dtype=dtype),), {}
        yield (randn(3, 4, 5, dtype=dtype), (1, 2)), {"correction": 0, "keepdim": True}
        yield (randn(3, 4, dtype=dtype), 1, True), {}


# --- norms ----------------------------------------------------------------------------------

def _vnorm_bwd(x: Any, out: Any, p: Any, dim: Any, keepdim: bool, d: Any) -> Any:
    if dim is None:
        return pnorm_grad(x, out, p, d)
    dims = dims_of(dim, x.dim())
    if not dims:
        return pnorm_grad(x, out, p, d)
    red = restore_reduced(out, dims, keepdim)
    return pnorm_grad(x, red, p, restore_reduced(d, dims, keepdim), dims)


@builtin(torch.linalg.vector_norm)
class VectorNorm:
    """linalg.vector_norm(x, ord, dim): d_x = norm_backward: sgn(x) d (ord 1), x d / n (ord 2),
    sgn(x) |x|^(p-1) d / n^(p-1) (other p), spread evenly over the maxima (ord inf), 0
    (ord 0) (derivatives.yaml `linalg_vector_norm`)."""

    def fwd(x, ord=2, dim=None, keepdim=False, *, dtype=None):
        kw = {} if dtype is None else {"dtype": dtype}
        out = torch.linalg.vector_norm(x, ord, dim, keepdim, **kw)
        return out, (x, out, ord, dim, keepdim)

    def bwd(aux, d):
        x, out, p, dim, keepdim = aux
        return (_vnorm_bwd(x, out, p, dim, keepdim, d),)

    def samples(dtype):
        yield (randn(3, 4, dtype=dtype),), {}
        yield (randn(3, 4, dtype=dtype), 1), {"dim": 1}
        yield (randn(3, 4, dtype=dtype), math.inf, (0, 1), True), {}
        yield (randn(3, 4, dtype=dtype), 3.0, 0), {}
        yield (randn(3, 4, dtype=dtype), 0.5), {}


def _nuc_bwd(x: Any, dims: tuple, keepdim: bool, d: Any) -> Any:
    """nuclear norm: d_x = d U V^H over the two matrix dims (derivatives.yaml `linalg_svd`
    specialised to sum(S))."""
    xm = torch.movedim(x, dims, (-2, -1))
    u, _, vh = torch.linalg.svd(xm, full_matrices=False)
    g = torch.matmul(u, vh)
    dr = torch.movedim(restore_reduced(d, dims, keepdim), dims, (-2, -1))
    return torch.movedim(g * dr, (-2, -1), dims)


@builtin(torch.norm)
class Norm:
    """torch.norm(x, p, dim): 'fro' and numeric p are vector norms over dim (see
    linalg.vector_norm); 'nuc' is the nuclear norm, d_x = d U V^H (derivatives.yaml
    `linalg_vector_norm`, `linalg_svd`)."""

    def fwd(input, p="fro", dim=None, keepdim=False, out=None, dtype=None):
        kw = {} if dtype is None else {"dtype": dtype}
        res = torch.norm(input, p, dim, keepdim, **kw)
        return res, (input, res, p, dim, keepdim)

    def bwd(aux, d):
        x, res, p, dim, keepdim = aux
        if isinstance(dim, int):
            dim = (dim,)
        if p == "nuc":
            dims = tuple(d_ % x.dim() for d_ in dim) if dim is not None else tuple(
                range(x.dim()))
            return (_nuc_bwd(x, dims, keepdim, d),)
        p = 2.0 if p in ("fro", None) else p
        return (_vnorm_bwd(x, res, p, dim, keepdim, d),)

    def samples(dtype):
        yield (randn(3, 4, dtype=dtype),), {}
        yield (randn(3, 4, dtype=dtype), 1, 1), {}
        yield (randn(3, 4, dtype=dtype), "nuc"), {}
        yield (randn(2, 3, 4, dtype=dtype), "fro", (1, 2), True), {}


@builtin(torch.dist)
class Dist:
    """dist(a, b, p) = ||a - b||_p: d_a = dn/dz, d_b = -dn/dz with z = a - b
    (derivatives.yaml `dist`: norm_backward)."""

    def fwd(input, other, p=2):
        out = torch.dist(input, other, p)
        return out, (input, other, out, p)

    def bwd(aux, d):
        a, b, out, p = aux
        g = pnorm_grad(a - b, out, p, d)
        return g, -g

    def samples(dtype):
        yield (randn(3, 4, dtype=dtype), randn(3, 4, dtype=dtype)), {}
        yield (randn(3, 4, dtype=dtype), randn(4, dtype=dtype), 1.5), {}
        yield (randn(3, 4, dtype=dtype), randn(4, dtype=dtype), math.inf), {}


def _matrix_norm_bwd(x: Any, ord: Any, dims: tuple, keepdim: bool, d: Any) -> Any:
    """Cotangent of linalg.matrix_norm(x, ord, dims) (dims: two non-negative ints)."""
    dr = restore_reduced(d, tuple(sorted(dims)), keepdim)
    if ord == "fro":
        out = torch.linalg.vector_norm(x, 2, dims, keepdim=True)
        return pnorm_grad(x, out, 2.0, dr, dims)
    if ord == "nuc":
        return _nuc_bwd(x, dims, keepdim, d)
    if ord in (2, -2, 2.0, -2.0):
        xm = torch.movedim(x, dims, (-2, -1))
        u, _, vh = torch.linalg.svd(xm, full_matrices=False)
        k = 0 if ord > 0 else -1
        g = torch.unsqueeze(u[..., :, k], -1) * torch.unsqueeze(vh[..., k, :], -2)
        return torch.movedim(g, (-2, -1), dims) * dr
    # +-inf: max/min over dims[0] of row sums over dims[1]; +-1: the transpose
    sum_dim, sel_dim = (dims[1], dims[0]) if abs(ord) == math.inf else (dims[0], dims[1])
    s = torch.sum(torch.abs(x), sum_dim, keepdim=True)
    m = torch.amax(s, sel_dim, keepdim=True) if ord > 0 else torch.amin(s, sel_dim, keepdim=True)
    mask = (s == m).to(x.dtype)
    return torch.sgn(x) * (mask / torch.sum(mask, sel_dim, keepdim=True)) * dr


@builtin(torch.linalg.matrix_norm)
class MatrixNorm:
    """linalg.matrix_norm(A, ord, dim): 'fro' as a vector 2-norm; 'nuc': d U V^H; 2/-2:
    d u_k v_k^H for the largest/smallest singular value; inf/1 (and negatives): sgn(A) times
    the cotangent spread evenly over the maximizing (minimizing) rows/columns of the
    absolute sums (derivatives.yaml `linalg_matrix_norm` composite: `amax`, `linalg_svd`)."""

    def fwd(A, ord="fro", dim=(-2, -1), keepdim=False, *, dtype=None):
        kw = {} if dtype is None else {"dtype": dtype}
        out = torch.linalg.matrix_norm(A, ord, dim, keepdim, **kw)
        return out, (A, ord, dim, keepdim)

    def bwd(aux, d):
        x, ord, dim, keepdim = aux
        dims = tuple(v % x.dim() for v in dim)
        return (_matrix_norm_bwd(x, ord, dims, keepdim, d),)

    def samples(dtype):
        yield (randn(3, 4, dtype=dtype),), {}
        yield (randn(2, 3, 4, dtype=dtype), "nuc"), {}
        yield (randn(3, 4, dtype=dtype), math.inf), {}
        yield (randn(3, 4, dtype=dtype), -1, (1, 0), True), {}
        yield (randn(3, 4, dtype=dtype), 2), {}


@builtin(torch.linalg.norm)
class LinalgNorm:
    """linalg.norm(A, ord, dim): a vector norm (dim an int, or ord None with dim None, or a
    1-d A) or a matrix norm (two dims, or a 2-d A with ord given); see linalg.vector_norm and
    linalg.matrix_norm (derivatives.yaml `linalg_vector_norm`, `linalg_matrix_norm`)."""

    def fwd(A, ord=None, dim=None, keepdim=False, *, dtype=None):
        kw = {} if dtype is None else {"dtype": dtype}
        out = torch.linalg.norm(A, ord, dim, keepdim, **kw)
        return out, (A, out, ord, dim, keepdim)

    def bwd(aux, d):
        x, out, ord, dim, keepdim = aux
        if isinstance(dim, int):
            dim = (dim,)
        if dim is None and (ord is None or x.dim() == 1):
            return (pnorm_grad(x, out, 2.0 if ord is None else ord, d)
                    if not keepdim else _vnorm_bwd(x, out, 2.0 if ord is None else ord,
                                                   tuple(range(x.dim())), keepdim, d),)
        if dim is not None and len(dim) == 1:
            return (_vnorm_bwd(x, out, 2.0 if ord is None else ord, dim, keepdim, d),)
        dims = (0, 1) if dim is None else tuple(v % x.dim() for v in dim)
        return (_matrix_norm_bwd(x, "fro" if ord is None else ord, dims, keepdim, d),)

    def samples(dtype):
        yield (randn(3, 4, dtype=dtype),), {}
        yield (randn(3, 4, dtype=dtype), 3.0, 1), {}
        yield (randn(3, 4, dtype=dtype), "nuc"), {}
        yield (randn(2, 3, 4, dtype=dtype), -math.inf, (2, 1), True), {}
        yield (randn(4, dtype=dtype), 1), {}


@builtin(torch.cdist)
class Cdist:
    """cdist(x1, x2, p)[..., i, j] = ||x1_i - x2_j||_p: with g_ij the p-norm cotangent of
    x1_i - x2_j, d_x1 = sum_j g_ij, d_x2 = -sum_i g_ij (derivatives.yaml `_cdist_forward`:
    _cdist_backward)."""

    def fwd(x1, x2, p=2.0, compute_mode="use_mm_for_euclid_dist_if_necessary"):
        out = torch.cdist(x1, x2, p, compute_mode)
        return out, (x1, x2, out, p)

    def bwd(aux, d):
        a, b, out, p = aux
        diff = torch.unsqueeze(a, -2) - torch.unsqueeze(b, -3)
        g = pnorm_grad(diff, torch.unsqueeze(out, -1), p, torch.unsqueeze(d, -1), -1)
        return torch.sum(g, -2), -torch.sum(g, -3)

    def samples(dtype):
        yield (randn(3, 4, dtype=dtype), randn(5, 4, dtype=dtype)), {}
        yield (randn(2, 3, 4, dtype=dtype), randn(2, 5, 4, dtype=dtype), 1.5), {}
        yield (randn(3, 4, dtype=dtype), randn(5, 4, dtype=dtype), math.inf), {}


@builtin(torch.nn.functional.pdist)
class Pdist:
    """pdist(x, p)[k] = ||x_i - x_j||_p over the pairs i < j (row-major): with g_k the p-norm
    cotangent of x_i - x_j, d_x = index_add of g_k at i minus at j (derivatives.yaml
    `_pdist_forward`: _pdist_backward)."""

    def fwd(input, p=2):
        out = torch.nn.functional.pdist(input, p)
        return out, (input, out, p)

    def bwd(aux, d):
        x, out, p = aux
        n = x.shape[0]
        ij = torch.triu_indices(n, n, 1, device=x.device)
        i, j = ij[0], ij[1]
        z = x[i] - x[j]
        g = pnorm_grad(z, torch.unsqueeze(out, -1), p, torch.unsqueeze(d, -1), -1)
        return (torch.zeros_like(x).index_add(0, i, g).index_add(0, j, -g),)

    def jvp(primals, tangents):
        x, p = primals
        t = tangents[0]
        out = torch.nn.functional.pdist(x, p)
        if t is None:
            return out, None
        n = x.shape[0]
        ij = torch.triu_indices(n, n, 1, device=x.device)
        z = x[ij[0]] - x[ij[1]]
        tz = t[ij[0]] - t[ij[1]]
        g = pnorm_grad(z, torch.unsqueeze(out, -1), p, torch.ones_like(torch.unsqueeze(out, -1)),
                       -1)
        return out, torch.sum(g * tz, -1)

    def samples(dtype):
        yield (randn(4, 3, dtype=dtype),), {}
        yield (randn(4, 3, dtype=dtype), 1.5), {}


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


def _trap_rule(op: Any, name: str, cumulative: bool) -> None:
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

    add_rule(op, fwd, bwd, samples=samples, builtin=True,
             source=f"{name}(y, x or dx, dim): linear in y with weights s_i/2 on y_i and "
                    "y_{i+1} (s = dx or diff(x)); d_x from the transpose of diff "
                    f"(derivatives.yaml: composite of `diff`, `mul`, `sum`"
                    f"{', `cumsum`' if cumulative else ''})")


_trap_rule(torch.trapezoid, "trapezoid", False)
_trap_rule(torch.trapz, "trapz", False)
_trap_rule(torch.cumulative_trapezoid, "cumulative_trapezoid", True)
