"""Rules for reductions: ``sum``, ``mean``, ``nansum``/``nanmean``, ``var``/``std``,
``var_mean``/``std_mean``, ``amax``/``amin``, ``max``/``min``, ``aminmax``, ``logsumexp``,
``prod``, the value-selecting reductions ``kthvalue``, ``mode``, ``median``/``nanmedian``,
``quantile``/``nanquantile``, the statistics ``cov``/``corrcoef``, and ``segment_reduce``.

The backward of a reduction returns the cotangent with the reduced dimensions restored as
size 1; the engine expands it to the input's shape (derivatives.yaml ``sum.dim_IntList``,
``mean.dim``, ``var.correction``, ``amax``, ``max.dim``, ``logsumexp``).  Value-selecting
reductions scatter the cotangent back to the selected indices (derivatives.yaml
``value_selecting_reduction_backward``); ``median()`` without ``dim`` spreads it evenly over
the ties (``evenly_distribute_backward``).  ``prod`` uses exclusive products, so inputs with
zeros get autograd's (exact) cotangents.

* ``quantile``/``nanquantile`` are composite in PyTorch (sort, gather at the two neighbouring
  ranks, ``lerp``): the cotangent goes to the two selected elements with weights ``1 - w`` and
  ``w``, and to ``q`` (when a tensor) through ``w``.
* ``segment_reduce`` (derivatives.yaml ``segment_reduce``: ``_segment_reduce_backward``):
  every element of a segment gets the segment's cotangent times a per-element weight: 1
  (sum), 1 / length (mean), ``out / x`` or the exclusive product (prod, exact at zeros,
  ``initial`` included), and for max / min the cotangent goes to every element equal to the
  result.  Ties follow PyTorch's CPU kernel exactly: the cotangent is split evenly over the
  ties only where it is positive (the kernel divides entries ``> 0``); forward mode splits
  evenly.
* ``cov`` / ``corrcoef`` share ``_cov_vjp`` / ``_cov_jvp``: ``C = Xc diag(w) Xc^T / N`` with
  ``Xc = X - mean_w`` and ``N`` the normalization of the torch.cov docs.  Since ``Xc w = 0``
  the mean's derivative drops out: ``dX = (G + G^T) Xc diag(w) / N``; for ``aweights``
  ``dC/dw_i = xc_i xc_i^T / N - C dN/dw_i / N``, ``N`` depending on the aweights too.
  OpInfo passes float32 ``aweights`` with a float64 input: autograd rounds that cotangent
  (terms that nearly cancel) in float32, which the sweep compares at float32 tolerance.
  ``corrcoef``: ``R = C / (s s^T)``, ``s = sqrt(diag C)``, clipped to [-1, 1] (the clip passes
  the cotangent only where ``-1 <= R <= 1``, as autograd's clamp does), then cov's rule.

Norms are in :mod:`fxad.rules.linalg.norms`, sorting in :mod:`fxad.rules.sorting`, cumulative
ops in :mod:`fxad.rules.scans`.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from ..errors import RuleError
from ._base import (dims_of, randn, restore_reduced, uniform, _excl_cumprod, _index_back,
                    _is_t, _tie_select, _tie_split, _value_d)
from .registry import register_vjp


def _count(shape: Any, dims: tuple[int, ...]) -> int:
    return math.prod(shape[k] for k in dims) if dims else 1


def _reduce(op: Any, x: Any, dim: Any, keepdim: bool, dtype: Any) -> Any:
    """Call ``op`` with only the non-default arguments (keeps generated code short)."""
    args = (x,) if dim is None else (x, dim, True) if keepdim else (x, dim)
    return op(*args) if dtype is None else op(*args, dtype=dtype)


@register_vjp(torch.sum)
class Sum:
    """sum(x, dim, keepdim): d_x = d broadcast back over the reduced dims
    (derivatives.yaml `sum.dim_IntList`: grad.expand_symint(self.sym_sizes()))."""

    def fwd(input, dim=None, keepdim=False, *, dtype=None):
        out = _reduce(torch.sum, input, dim, keepdim, dtype)
        return out, (input.dim(), dim, keepdim)

    def bwd(aux, d):
        ndim, dim, keepdim = aux
        if dim is None:
            return (d,)
        return (restore_reduced(d, dims_of(dim, ndim), keepdim),)

    def jvp(primals, tangents):
        x, dim, keepdim, dtype = primals
        return (_reduce(torch.sum, x, dim, keepdim, dtype),
                _reduce(torch.sum, tangents[0], dim, keepdim, dtype))

    def samples(dtype):
        yield (randn(3, 4, dtype=dtype),), {}
        yield (randn(3, 4, 5, dtype=dtype), 1), {}
        yield (randn(3, 4, 5, dtype=dtype), (0, 2)), {"keepdim": True}
        yield (randn(3, 4, dtype=dtype), -1, False), {}


@register_vjp(torch.mean)
class Mean:
    """mean(x, dim, keepdim): d_x = d / n broadcast back (derivatives.yaml `mean.dim`)."""

    def fwd(input, dim=None, keepdim=False, *, dtype=None):
        out = _reduce(torch.mean, input, dim, keepdim, dtype)
        return out, (tuple(input.shape), dim, keepdim)

    def bwd(aux, d):
        shape, dim, keepdim = aux
        dims = dims_of(dim, len(shape))
        n = _count(shape, dims)
        return (restore_reduced(d, dims if dim is not None else (), keepdim) / n,)

    def jvp(primals, tangents):
        x, dim, keepdim, dtype = primals
        return (_reduce(torch.mean, x, dim, keepdim, dtype),
                _reduce(torch.mean, tangents[0], dim, keepdim, dtype))

    def samples(dtype):
        yield (randn(3, 4, dtype=dtype),), {}
        yield (randn(3, 4, 5, dtype=dtype), 1), {}
        yield (randn(3, 4, 5, dtype=dtype), (0, 2), True), {}


def _safe_div(a: float, b: float) -> float:
    """a / b with b <= 0 giving inf (autograd's var/std backward yields inf/nan there too)."""
    return a / b if b > 0 else math.inf


def _nonzero(std: Any) -> Any:
    """``std`` with zeros replaced by inf: dividing by it gives 0 where the deviation is 0, as
    autograd's std_backward masks (``masked_fill_(result == 0, 0)``), in both modes."""
    return torch.where(std == 0, math.inf, std)


def _correction(unbiased: Any, correction: Any) -> float:
    if correction is not None:
        return float(correction)
    if unbiased is None:
        return 1.0
    return 1.0 if unbiased else 0.0


def _var_args(dim: Any, unbiased: Any, keepdim: Any, correction: Any) -> tuple[Any, bool, float]:
    # torch.var(x, True) means unbiased=True, not dim=True
    if isinstance(dim, bool):
        unbiased, dim = dim, None
    return dim, bool(keepdim), _correction(unbiased, correction)


@register_vjp(torch.var)
class Var:
    """var(x, dim, correction): d_x = d * 2 (x - mean) / (n - correction)
    (derivatives.yaml `var.correction`: var_backward)."""

    def fwd(input, dim=None, unbiased=None, keepdim=False, *, correction=None):
        dim_, keep, corr = _var_args(dim, unbiased, keepdim, correction)
        out = torch.var(input, dim_, correction=corr, keepdim=keep)
        return out, (input, dim_, keep, corr)

    def bwd(aux, d):
        x, dim, keepdim, corr = aux
        dims = dims_of(dim, x.dim())
        n = _count(tuple(x.shape), dims)
        centered = x - torch.mean(x, dims, keepdim=True)
        return (restore_reduced(d, dims if dim is not None else (), keepdim)
                * (centered * _safe_div(2.0, n - corr)),)

    def jvp(primals, tangents):
        x, dim, unbiased, keepdim, correction = primals
        dim_, keep, corr = _var_args(dim, unbiased, keepdim, correction)
        out = torch.var(x, dim_, correction=corr, keepdim=keep)
        dims = dims_of(dim_, x.dim())
        n = _count(tuple(x.shape), dims)
        centered = x - torch.mean(x, dims, keepdim=True)
        return out, torch.sum(centered * tangents[0], dims, keep) * _safe_div(2.0, n - corr)

    def samples(dtype):
        yield (randn(3, 4, dtype=dtype),), {}
        yield (randn(3, 4, 5, dtype=dtype), 1), {"keepdim": True}
        yield (randn(3, 4, dtype=dtype), (0, 1)), {"correction": 0}
        yield (randn(6, 4, dtype=dtype), 0, False), {}


@register_vjp(torch.std)
class Std:
    """std(x) = sqrt(var(x)): d_x = d * (x - mean) / ((n - correction) * std)
    (derivatives.yaml `std.correction`: std_backward)."""

    def fwd(input, dim=None, unbiased=None, keepdim=False, *, correction=None):
        dim_, keep, corr = _var_args(dim, unbiased, keepdim, correction)
        out = torch.std(input, dim_, correction=corr, keepdim=keep)
        return out, (input, dim_, keep, corr, out)

    def bwd(aux, d):
        x, dim, keepdim, corr, out = aux
        dims = dims_of(dim, x.dim())
        n = _count(tuple(x.shape), dims)
        red = dims if dim is not None else ()
        centered = x - torch.mean(x, dims, keepdim=True)
        scale = restore_reduced(d / _nonzero(out), red, keepdim) * _safe_div(1.0, n - corr)
        return (centered * scale,)

    def jvp(primals, tangents):
        x, dim, unbiased, keepdim, correction = primals
        dim_, keep, corr = _var_args(dim, unbiased, keepdim, correction)
        out = torch.std(x, dim_, correction=corr, keepdim=keep)
        dims = dims_of(dim_, x.dim())
        n = _count(tuple(x.shape), dims)
        centered = x - torch.mean(x, dims, keepdim=True)
        return out, (torch.sum(centered * tangents[0], dims, keep) * _safe_div(1.0, n - corr)
                     / _nonzero(out))

    def samples(dtype):
        yield (randn(3, 4, dtype=dtype),), {}
        yield (randn(3, 4, 5, dtype=dtype), 1), {"keepdim": True}


@register_vjp(torch.var_mean)
class VarMean:
    """var_mean(x, dim, correction) -> (var, mean): d_x = d_var * 2 (x - mean) / (n - correction)
    + d_mean / n (derivatives.yaml `var_mean.correction`: var_mean_backward).  Used by the
    normalization rules, so second derivatives through layer/batch norm need it."""

    outputs = ("var", "mean")

    def fwd(input, dim=None, unbiased=None, keepdim=False, *, correction=None):
        dim_, keep, corr = _var_args(dim, unbiased, keepdim, correction)
        out = torch.var_mean(input, dim_, correction=corr, keepdim=keep)
        return out, (input, dim_, keep, corr)

    def bwd(aux, d):
        x, dim, keepdim, corr = aux
        d_var, d_mean = d
        dims = dims_of(dim, x.dim())
        n = _count(tuple(x.shape), dims)
        red = dims if dim is not None else ()
        d_x = None
        if d_var is not None:
            centered = x - torch.mean(x, dims, keepdim=True)
            d_x = restore_reduced(d_var, red, keepdim) * (centered * _safe_div(2.0, n - corr))
        if d_mean is not None:
            d_m = restore_reduced(d_mean, red, keepdim) / n
            d_x = d_m if d_x is None else d_x + d_m
        return (d_x,)

    def jvp(primals, tangents):
        x, dim, unbiased, keepdim, correction = primals
        tx = tangents[0]
        dim_, keep, corr = _var_args(dim, unbiased, keepdim, correction)
        out = torch.var_mean(x, dim_, correction=corr, keepdim=keep)
        dims = dims_of(dim_, x.dim())
        n = _count(tuple(x.shape), dims)
        centered = x - torch.mean(x, dims, keepdim=True)
        t_var = torch.sum(centered * tx, dims, keep) * _safe_div(2.0, n - corr)
        return out, (t_var, torch.mean(tx, dims, keep))

    def samples(dtype):
        yield (randn(3, 4, dtype=dtype),), {}
        yield (randn(3, 4, 5, dtype=dtype), (1, 2)), {"correction": 0, "keepdim": True}


def _amax_like(op: Any) -> Any:
    class AmaxRule:

        def fwd(input, dim=(), keepdim=False):
            out = op(input, dim, keepdim)
            return out, (input, dim, keepdim, out)

        def bwd(aux, d):
            x, dim, keepdim, out = aux
            dims = dims_of(dim if dim != () else None, x.dim())
            red = dims if dim != () else tuple(range(x.dim()))
            hit = (x == restore_reduced(out, red, keepdim)).to(x.dtype)
            count = torch.sum(hit, red, keepdim=True)
            return (restore_reduced(d, red, keepdim) * (hit / count),)

        def jvp(primals, tangents):
            (x, dim, keepdim), tx = primals, tangents[0]
            out = op(x, dim, keepdim)
            red = dims_of(dim, x.dim()) if dim != () else tuple(range(x.dim()))
            hit = (x == restore_reduced(out, red, keepdim)).to(x.dtype)
            count = torch.sum(hit, red, keepdim=True)
            return out, torch.sum(tx * (hit / count), red, keepdim)

        def samples(dtype):
            yield (randn(3, 4, dtype=dtype), 1), {}
            yield (randn(3, 4, 5, dtype=dtype), (0, 2), True), {}
            yield (torch.tensor([[1.0, 3.0, 3.0], [2.0, 2.0, 0.0]], dtype=dtype), -1), {}

    AmaxRule.__doc__ = (f"{op.__name__}(x, dim, keepdim): the cotangent is shared evenly among "
                        "the entries equal to the extremum (derivatives.yaml `amax`: "
                        "scale_grad_by_count).")
    return AmaxRule


register_vjp(torch.amax)(_amax_like(torch.amax))
register_vjp(torch.amin)(_amax_like(torch.amin))


def _max_like(op: Any, elementwise: Any) -> tuple[type, ...]:
    """The rules of ``torch.max`` / ``torch.min``: three overloads, by the call's arguments."""

    class MaxDim:
        """{op}(x, dim, keepdim) -> (values, indices): the cotangent is scattered to the
        selected index (the default overload)."""

        def fwd(input, dim=None, keepdim=False):
            out = op(input, dim, keepdim)
            return out, (input, dim, keepdim, out[1])

        def bwd(aux, d):
            x, dim, keepdim, idx = aux
            d_values = d[0]
            if d_values is None:
                return (None,)
            if not keepdim:
                d_values = torch.unsqueeze(d_values, dim)
                idx = torch.unsqueeze(idx, dim)
            return (torch.zeros_like(x).scatter(dim, idx, d_values),)

        def jvp(primals, tangents):
            (x, dim, keepdim), tx = primals, tangents[0]
            out = op(x, dim, keepdim)
            idx = out[1] if keepdim else torch.unsqueeze(out[1], dim)
            t = torch.gather(tx, dim, idx)
            return out, (t if keepdim else torch.squeeze(t, dim), None)

        def samples(dtype):
            yield (randn(3, 4, dtype=dtype), 1), {}
            yield (randn(3, 4, 5, dtype=dtype), 0, True), {}

    class MaxAll:
        """{op}(x) -> value: the cotangent is shared evenly among ties (derivatives.yaml
        `max`: evenly_distribute_backward)."""

        def applies(input, dim=None, keepdim=False):
            return dim is None

        def fwd(input, dim=None, keepdim=False):
            out = op(input)
            return out, (input, out)

        def bwd(aux, d):
            x, out = aux
            hit = (x == out).to(x.dtype)
            return (hit * (d / torch.sum(hit)),)

        def jvp(primals, tangents):
            x, tx = primals[0], tangents[0]
            out = op(x)
            hit = (x == out).to(x.dtype)
            return out, torch.sum(hit * tx) / torch.sum(hit)

        def samples(dtype):
            yield (randn(3, 4, dtype=dtype),), {}

    class MaxBinary:
        """{op}(x, other) is torch.{elementwise}: the cotangent goes to the selected operand,
        split evenly on ties."""

        def applies(input, dim=None, keepdim=False):
            return isinstance(dim, torch.Tensor)  # a tensor in the dim slot: the binary form

        def fwd(input, dim=None, keepdim=False):
            out = elementwise(input, dim)
            return out, (input, dim, out)

        def bwd(aux, d):
            return _tie_split(*aux, d)

        def jvp(primals, tangents):
            (x, other, _), (tx, t_other, _) = primals, tangents
            out = elementwise(x, other)
            return out, _tie_select(x, other, out, tx, t_other)

        def samples(dtype):
            yield (randn(3, 4, dtype=dtype), randn(4, dtype=dtype)), {}

    for cls in (MaxDim, MaxAll, MaxBinary):
        cls.__doc__ = cls.__doc__.format(op=op.__name__, elementwise=elementwise.__name__)
    MaxDim.__doc__ = (
        f"{op.__name__}(x) -> value: cotangent shared evenly among ties (derivatives.yaml "
        f"`max`: evenly_distribute_backward); {op.__name__}(x, dim) -> (values, indices): "
        "cotangent scattered to the selected index (derivatives.yaml `max.dim`: "
        f"value_selecting_reduction_backward); {op.__name__}(x, other) is "
        f"torch.{elementwise.__name__}.")
    return MaxDim, MaxAll, MaxBinary


for _op, _elementwise in ((torch.max, torch.maximum), (torch.min, torch.minimum)):
    for _cls in _max_like(_op, _elementwise):
        register_vjp(_op)(_cls)


@register_vjp(torch.logsumexp)
class LogSumExp:
    """logsumexp(x, dim, keepdim): d_x = d * exp(x - out) (derivatives.yaml `logsumexp`:
    logsumexp_backward)."""

    def fwd(input, dim, keepdim=False):
        out = torch.logsumexp(input, dim, keepdim)
        return out, (input, dim, keepdim, out)

    def bwd(aux, d):
        x, dim, keepdim, out = aux
        dims = dims_of(dim, x.dim())
        return (restore_reduced(d, dims, keepdim) * torch.exp(x - restore_reduced(out, dims, keepdim)),)

    def jvp(primals, tangents):
        (x, dim, keepdim), tx = primals, tangents[0]
        out = torch.logsumexp(x, dim, keepdim)
        dims = dims_of(dim, x.dim())
        return out, torch.sum(tx * torch.exp(x - restore_reduced(out, dims, keepdim)), dims,
                              keepdim)

    def samples(dtype):
        yield (randn(3, 4, dtype=dtype), 1), {}
        yield (randn(3, 4, dtype=dtype), (0, 1), True), {}


def _prod_others(x: Any, dim: int) -> Any:
    """prod_{j != k} x_j along ``dim`` (exact with zeros): left and right exclusive products."""
    right = torch.flip(_excl_cumprod(torch.flip(x, [dim]), dim), [dim])
    return _excl_cumprod(x, dim) * right


@register_vjp(torch.prod)
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


def _selecting(op, name, extra_first=False):
    """The rule class of a (values, indices) reduction over ``dim`` with ``keepdim``."""

    class Selecting:
        source = (f"{name}(x, dim) -> (values, indices): d_x = zeros.scatter_add(dim, "
                  f"indices, d_values) (derivatives.yaml `{name}`: "
                  "value_selecting_reduction_backward)")

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

        def bwd(aux, d):
            x, dim, keepdim, idx = aux
            d = _value_d(d)
            if d is None:
                return (None,)
            return (_index_back(x, dim % max(x.dim(), 1), idx, d, keepdim),)

    return Selecting


register_vjp(torch.kthvalue)(_selecting(torch.kthvalue, "kthvalue", extra_first=True))
register_vjp(torch.mode)(_selecting(torch.mode, "mode"))


def _median_rule(op, name):
    class MedianRule:
        source = (f"{name}(x) spreads d evenly over the elements equal to the result "
                  f"(evenly_distribute_backward); {name}(x, dim) scatters d_values to the "
                  f"indices (value_selecting_reduction_backward) (derivatives.yaml `{name}`)")

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

    return MedianRule


register_vjp(torch.median)(_median_rule(torch.median, "median"))
register_vjp(torch.nanmedian)(_median_rule(torch.nanmedian, "nanmedian"))


@register_vjp(torch.aminmax)
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


@register_vjp(torch.nansum)
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


@register_vjp(torch.nanmean)
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


@register_vjp(torch.std_mean)
class StdMean:
    """std_mean(x, dim, correction) -> (std, mean): d_x = d_std (x - mean) / ((n - c) std)
    + d_mean / n (derivatives.yaml `std_mean.correction`: std_mean_backward)."""

    outputs = ("std", "mean")

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
            d_x = restore_reduced(d_std, red, keepdim) * centered * _safe_div(1.0, n - corr) \
                / _nonzero(s)
        if d_mean is not None:
            d_m = restore_reduced(d_mean, red, keepdim) / n
            d_x = d_m if d_x is None else d_x + d_m
        return (d_x,)

    def samples(dtype):
        yield (randn(3, 4, dtype=dtype),), {}
        yield (randn(3, 4, 5, dtype=dtype), (1, 2)), {"correction": 0, "keepdim": True}
        yield (randn(3, 4, dtype=dtype), 1, True), {}


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
    register_vjp(_op)(_quantile_rule(_op, _nan))


# --------------------------------------------------------------------------------------------
# segment_reduce
# --------------------------------------------------------------------------------------------

def _seg_layout(data: Any, lengths: Any, offsets: Any, axis: int) -> tuple[Any, Any, Any]:
    """Per element of ``data`` along ``axis``: the segment id (clamped into range, shaped to
    broadcast like ``data``'s leading dims + axis), whether it lies in a segment, and the
    segment lengths ``(..., S)``."""
    if lengths is not None:
        bounds = torch.cat([torch.zeros_like(lengths[..., :1]), torch.cumsum(lengths, -1)], -1)
        seg_len = lengths
    else:
        bounds = offsets
        seg_len = offsets[..., 1:] - offsets[..., :-1]
    n, s = data.shape[axis], seg_len.shape[-1]
    pos = torch.arange(n, device=data.device, dtype=bounds.dtype)
    pos = pos.expand(tuple(bounds.shape[:-1]) + (n,)).contiguous()
    seg = torch.searchsorted(bounds.contiguous(), pos, right=True) - 1
    inside = (seg >= 0) & (seg < s)
    seg = torch.clamp(seg, 0, s - 1)
    return seg, inside, seg_len


def _to_data(v: Any, data: Any, axis: int) -> Any:
    """A ``(..., N)`` per-position tensor reshaped to broadcast against ``data``."""
    return torch.reshape(v, tuple(v.shape) + (1,) * (data.dim() - axis - 1))


def _seg_gather(v: Any, seg: Any, data: Any, axis: int) -> Any:
    """``v`` (segment-shaped, like the output) read at each element's segment."""
    idx = _to_data(seg, data, axis).expand(tuple(data.shape[:axis]) + (data.shape[axis],)
                                           + tuple(v.shape[axis + 1:]))
    return torch.gather(v, axis, idx)


def _seg_sum(v: Any, lengths: Any, offsets: Any, axis: int, **kw: Any) -> Any:
    if lengths is not None:
        return torch.segment_reduce(v, "sum", lengths=lengths, axis=axis, unsafe=True, **kw)
    return torch.segment_reduce(v, "sum", offsets=offsets, axis=axis, unsafe=True, **kw)


def _seg_weights(data, out, reduce, lengths, offsets, axis, initial, linear):
    """Per-element weight w (shaped like data) with d_data = w * d_out[segment]; for max/min
    with ``linear=False`` returns the tie mask and count instead (the backward needs d)."""
    seg, inside, seg_len = _seg_layout(data, lengths, offsets, axis)
    inside = _to_data(inside, data, axis)
    if reduce == "sum":
        return seg, torch.where(inside, torch.ones_like(data), torch.zeros_like(data))
    if reduce == "mean":
        n = _to_data(torch.gather(seg_len, -1, seg), data, axis).to(data.dtype)
        return seg, torch.where(inside, 1 / n, torch.zeros_like(data))
    out_e = _seg_gather(out, seg, data, axis)
    if reduce in ("max", "min"):
        hit = inside & ((data == out_e) | torch.isnan(data))
        hitf = hit.to(data.dtype)
        cnt = _seg_gather(_seg_sum(hitf, lengths, offsets, axis), seg, data, axis)
        if linear:
            return seg, torch.where(hit, 1 / cnt, torch.zeros_like(data))
        return seg, (hit, cnt)
    if reduce == "prod":
        special = torch.isnan(data) | (data == 0)
        kw = {} if initial is None else {"initial": initial}
        others = torch.where(special, torch.ones_like(data), data)
        if lengths is not None:
            p = torch.segment_reduce(others, "prod", lengths=lengths, axis=axis, unsafe=True, **kw)
        else:
            p = torch.segment_reduce(others, "prod", offsets=offsets, axis=axis, unsafe=True, **kw)
        p_e = _seg_gather(p, seg, data, axis)
        n_special = _seg_gather(_seg_sum(special.to(data.dtype), lengths, offsets, axis),
                                seg, data, axis)
        n_nan = _seg_gather(_seg_sum(torch.isnan(data).to(data.dtype), lengths, offsets, axis),
                            seg, data, axis)
        other_nan = (n_nan - torch.isnan(data).to(data.dtype)) > 0
        rest = torch.where(other_nan, torch.full_like(data, math.nan), torch.zeros_like(data))
        excl = p_e * torch.where(n_special == 1, torch.ones_like(data), rest)
        return seg, (special, excl, out_e, inside)
    raise RuleError(f"segment_reduce: unknown reduction {reduce!r}")


@register_vjp(torch.segment_reduce)
class SegmentReduce:
    """segment_reduce(data, reduce, lengths= / offsets=, axis, unsafe, initial)
    (derivatives.yaml `segment_reduce`: _segment_reduce_backward): d_data = w * d[segment]
    with w = 1 (sum), 1/length (mean), [x == out] split over ties (max/min; PyTorch's kernel
    splits only positive cotangents), out/x or the exclusive product incl. ``initial`` (prod,
    exact at zeros)."""

    def fwd(data, reduce, *, lengths=None, indices=None, offsets=None, axis=0, unsafe=False,
            initial=None):
        kw = {k: v for k, v in (("lengths", lengths), ("indices", indices),
                                ("offsets", offsets)) if v is not None}
        if axis != 0:
            kw["axis"] = axis
        if unsafe:
            kw["unsafe"] = unsafe
        if initial is not None:
            kw["initial"] = initial
        out = torch.segment_reduce(data, reduce, **kw)
        return out, (data, out, reduce, lengths, offsets, axis % max(data.dim(), 1), initial)

    def bwd(aux, d):
        data, out, reduce, lengths, offsets, axis, initial = aux
        if out.shape[axis] == 0:
            return (torch.zeros_like(data),)
        seg, w = _seg_weights(data, out, reduce, lengths, offsets, axis, initial, linear=False)
        d_e = _seg_gather(d, seg, data, axis)
        zero = torch.zeros_like(data)
        if reduce == "sum":
            return (torch.where(w != 0, d_e, zero),)
        if reduce == "mean":
            seg_len = lengths if lengths is not None else offsets[..., 1:] - offsets[..., :-1]
            n = _to_data(torch.gather(seg_len, -1, seg), data, axis)
            return (torch.where(w != 0, d_e / n, zero),)
        if reduce in ("max", "min"):
            hit, cnt = w
            split = (cnt >= 2) & (d_e > 0)
            return (torch.where(hit, torch.where(split, d_e / cnt, d_e), zero),)
        special, excl, out_e, inside = w
        g = torch.where(special, d_e * excl, d_e * out_e / data)
        return (torch.where(inside, g, zero),)

    def jvp(primals, tangents):
        data, reduce, lengths, indices, offsets, axis, unsafe, initial = primals
        t = tangents[0]
        kw = {k: v for k, v in (("lengths", lengths), ("indices", indices),
                                ("offsets", offsets)) if v is not None}
        kw.update(axis=axis, unsafe=unsafe)
        if initial is not None:
            kw["initial"] = initial
        out = torch.segment_reduce(data, reduce, **kw)
        ax = axis % max(data.dim(), 1)
        if t is None or out.shape[ax] == 0:
            return out, None
        seg, w = _seg_weights(data, out, reduce, lengths, offsets, ax, initial, linear=True)
        if reduce == "prod":
            special, excl, out_e, inside = w
            w = torch.where(inside, torch.where(special, excl, out_e / data),
                            torch.zeros_like(data))
        return out, _seg_sum(w * t, lengths, offsets, ax)

    def samples(dtype):
        x = uniform((7,), 0.5, 2.0, dtype)
        for red in ("sum", "mean", "max", "min", "prod"):
            yield (x, red), {"lengths": torch.tensor([2, 3, 2])}
            yield (x, red), {"lengths": torch.tensor([2, 0, 3, 2]), "initial": 1.5}
            yield (x, red), {"offsets": torch.tensor([0, 2, 2, 5, 7]), "initial": 2.0}
        x2 = randn(5, 3, 2, dtype=dtype)
        for red in ("sum", "mean", "max", "min", "prod"):
            yield (x2, red), {"lengths": torch.tensor([[2, 1], [0, 3], [3, 0], [1, 2], [3, 0]]),
                              "axis": 1, "initial": 0.5}
            yield (x2, red), {"offsets": torch.tensor([0, 1, 1, 5]), "unsafe": True,
                              "initial": -0.5}
        z = uniform((6, 2), 0.5, 2.0, dtype)
        z[1, 0] = 0.0
        z[4, 1] = 0.0
        z[5, 1] = 0.0
        yield (z, "prod"), {"lengths": torch.tensor([3, 3]), "initial": 1.5}
        yield (z, "prod"), {"lengths": torch.tensor([2, 4])}


# --------------------------------------------------------------------------------------------
# cov, corrcoef
# --------------------------------------------------------------------------------------------

def _cov_parts(x: Any, correction: int, fweights: Any, aweights: Any) -> dict:
    """The pieces of torch.cov's computation (same dtypes and order as its docs' formula):
    observations matrix X (vars, obs), weights w (or None), their sum W, normalization N,
    centred Xc."""
    X = torch.reshape(x, (1, -1)) if x.dim() < 2 else x
    w = fweights
    if aweights is not None:
        w = aweights if w is None else w * aweights
    if w is None:
        W = X.shape[1]
        avg = torch.sum(X, 1) / W
        N = W - correction
        N = 0 if N <= 0 else N
    else:
        W = torch.sum(w)
        avg = torch.sum(X * w, 1) / W
        if aweights is not None and correction != 0:
            N = W - correction * torch.sum(w * aweights) / W
        else:
            N = W - correction
        N = torch.where(N <= 0, torch.zeros_like(N), N)
    Xc = X - torch.unsqueeze(avg, 1)
    return {"X": X, "w": w, "W": W, "N": N, "Xc": Xc}


def _cov_vjp(x, correction, fweights, aweights, out, G):
    """Cotangents (d_x, d_aweights) of cov for the (V, V) cotangent G."""
    p = _cov_parts(x, correction, fweights, aweights)
    Xc, w, W, N = p["Xc"], p["w"], p["W"], p["N"]
    v = Xc.shape[0]
    G = torch.reshape(G, (v, v))
    Xw = Xc if w is None else Xc * w
    d_x = torch.reshape((G + G.mT) @ Xw / N, tuple(x.shape))
    d_a = None
    if aweights is not None and aweights.is_floating_point():
        # Each term is rounded to the weights' dtype where autograd's graph of torch.cov
        # crosses into it, and they are combined in that dtype in the same grouping, so a
        # float32 aweights with a float64 input gets autograd's float32 cotangent.
        C = torch.reshape(out, (v, v))
        q = (torch.sum(Xc * (G @ Xc), 0) / N).to(w.dtype)   # through (Xc * w) in Xc diag(w) Xc^T
        g_n = (-torch.sum(G * C) / N).to(w.dtype)          # through C / N
        g_w = q + g_n                                      # N = W - ... : dN/dW = 1
        g_direct = None
        if correction != 0:
            t = torch.sum(w * aweights)
            g_w = g_w + g_n * (correction * t) / (W * W)   # - correction * t / W, through W
            g_t = (-g_n / W) * correction                  # ... through t = sum(w * aweights)
            g_w = g_w + g_t * aweights
            g_direct = g_t * w
        d_a = g_w if fweights is None else g_w * fweights
        if g_direct is not None:
            d_a = d_a + g_direct
    return d_x, d_a


def _cov_jvp(x, correction, fweights, aweights, out, tx, ta):
    """Tangent (V, V) of cov for tangents tx (of x) and ta (of aweights)."""
    p = _cov_parts(x, correction, fweights, aweights)
    Xc, w, W, N = p["Xc"], p["w"], p["W"], p["N"]
    v = Xc.shape[0]
    t = None
    if tx is not None:
        T = torch.reshape(tx, tuple(Xc.shape))
        M = T @ (Xc if w is None else Xc * w).mT
        t = (M + M.mT) / N
    if ta is not None and aweights is not None:
        C = torch.reshape(out, (v, v))
        dw = ta if fweights is None else ta * fweights
        if correction != 0:
            dNdw = 1 - correction * (aweights / W - torch.sum(w * aweights) / (W * W))
            dN = torch.sum(dNdw * dw) - correction * torch.sum(w * ta) / W
        else:
            dN = torch.sum(dw)
        ta_part = ((Xc * dw) @ Xc.mT - C * dN) / N
        t = ta_part if t is None else t + ta_part
    return t


@register_vjp(torch.cov)
class Cov:
    """cov(x, correction, fweights, aweights) = Xc diag(w) Xc^T / N with Xc the weighted-mean
    centred observations, w = fweights * aweights, N = sum(w) - correction * sum(w * aweights)
    / sum(w) (torch.cov docs): d_x = (G + G^T) Xc diag(w) / N; aweights get the derivative
    through w, the mean and N (derivatives.yaml: composite, via its ops); integer fweights
    get none."""

    def fwd(input, *, correction=1, fweights=None, aweights=None):
        out = torch.cov(input, correction=correction, fweights=fweights, aweights=aweights)
        return out, (input, correction, fweights, aweights, out)

    def bwd(aux, d):
        x, correction, fweights, aweights, out = aux
        d_x, d_a = _cov_vjp(x, correction, fweights, aweights, out, d)
        return d_x, None, None, d_a

    def jvp(primals, tangents):
        x, correction, fweights, aweights = primals
        tx, ta = tangents[0], tangents[3]
        out = torch.cov(x, correction=correction, fweights=fweights, aweights=aweights)
        t = _cov_jvp(x, correction, fweights, aweights, out, tx, ta)
        return out, (None if t is None else torch.reshape(t, tuple(out.shape)))

    def samples(dtype):
        x = randn(3, 6, dtype=dtype)
        yield (x,), {}
        yield (x,), {"correction": 0}
        yield (randn(6, dtype=dtype),), {}
        yield (x,), {"fweights": torch.tensor([1, 2, 1, 3, 1, 2])}
        yield (x,), {"aweights": torch.rand(6, dtype=dtype) + 0.5}
        yield (x,), {"fweights": torch.tensor([1, 2, 1, 3, 1, 2]),
                     "aweights": torch.rand(6, dtype=dtype) + 0.5, "correction": 2}


@register_vjp(torch.corrcoef)
class Corrcoef:
    """corrcoef(x) = clip(C / (s s^T), -1, 1), C = cov(x), s = sqrt(diag C): with G masked
    where the clip is active (autograd's clamp), d_C = G / (s s^T) + diag(d_s / (2 s)),
    d_s_k = -(sum_i G_ik R_ik + sum_j G_kj R_kj) / s_k; then cov's rule.  A single variable
    gives C / C (derivative 0 up to rounding, as autograd's)."""

    def fwd(input):
        out = torch.corrcoef(input)
        return out, input

    def bwd(x, d):
        C = torch.cov(x)
        if C.dim() == 0:
            dC = d / C - d * C / (C * C)
            return (_cov_vjp(x, 1, None, None, C, dC)[0],)
        s = torch.sqrt(torch.diagonal(C))
        col, row = torch.unsqueeze(s, 1), torch.unsqueeze(s, 0)
        R = C / col / row
        G = torch.where((R >= -1) & (R <= 1), d, torch.zeros_like(d))
        GR = G * R
        ds = -(torch.sum(GR, 0) + torch.sum(GR, 1)) / s
        dC = G / col / row + torch.diag(ds / (2 * s))
        return (_cov_vjp(x, 1, None, None, C, dC)[0],)

    def jvp(primals, tangents):
        (x,), (tx,) = primals, tangents
        out = torch.corrcoef(x)
        if tx is None:
            return out, None
        C = torch.cov(x)
        tC = torch.reshape(_cov_jvp(x, 1, None, None, C, tx, None), tuple(C.shape))
        if C.dim() == 0:
            return out, tC / C - C * tC / (C * C)
        s = torch.sqrt(torch.diagonal(C))
        col, row = torch.unsqueeze(s, 1), torch.unsqueeze(s, 0)
        R = C / col / row
        rel = torch.diagonal(tC) / (2 * s * s)             # ds / s
        tR = tC / col / row - R * (torch.unsqueeze(rel, 1) + torch.unsqueeze(rel, 0))
        return out, torch.where((R >= -1) & (R <= 1), tR, torch.zeros_like(tR))

    def samples(dtype):
        yield (randn(3, 5, dtype=dtype),), {}
        yield (randn(2, 4, dtype=dtype),), {}
        yield (randn(6, dtype=dtype),), {}
