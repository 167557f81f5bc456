"""Rules for reductions: ``sum``, ``mean``, ``var``, ``std``, ``amax``/``amin``, ``max``/``min``,
``logsumexp``, ``prod``-free set.

The backward of a reduction returns the cotangent with the reduced dimensions restored as
size 1; the engine expands it to the input's shape.  Formulas: derivatives.yaml entries
``sum.dim_IntList``, ``mean.dim``, ``var.correction``, ``amax``, ``max.dim``, ``max``,
``logsumexp``.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from ._base import builtin, dims_of, randn, restore_reduced


def _count(shape: Any, dims: tuple[int, ...]) -> int:
    return math.prod(shape[k] for k in dims) if dims else 1


def _reduce(op: Any, x: Any, dim: Any, keepdim: bool, dtype: Any) -> Any:
    """Call ``op`` with only the non-default arguments (keeps generated code short)."""
    args = (x,) if dim is None else (x, dim, True) if keepdim else (x, dim)
    return op(*args) if dtype is None else op(*args, dtype=dtype)


@builtin(torch.sum)
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


@builtin(torch.mean)
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


@builtin(torch.var)
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


@builtin(torch.std)
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
        scale = restore_reduced(d / out, red, keepdim) * _safe_div(1.0, n - corr)
        return (centered * scale,)

    def jvp(primals, tangents):
        x, dim, unbiased, keepdim, correction = primals
        dim_, keep, corr = _var_args(dim, unbiased, keepdim, correction)
        out = torch.std(x, dim_, correction=corr, keepdim=keep)
        dims = dims_of(dim_, x.dim())
        n = _count(tuple(x.shape), dims)
        centered = x - torch.mean(x, dims, keepdim=True)
        return out, torch.sum(centered * tangents[0], dims, keep) * _safe_div(1.0, n - corr) / out

    def samples(dtype):
        yield (randn(3, 4, dtype=dtype),), {}
        yield (randn(3, 4, 5, dtype=dtype), 1), {"keepdim": True}


@builtin(torch.var_mean)
class VarMean:
    """var_mean(x, dim, correction) -> (var, mean): d_x = d_var * 2 (x - mean) / (n - correction)
    + d_mean / n (derivatives.yaml `var_mean.correction`: var_mean_backward).  Used by the
    normalization rules, so second derivatives through layer/batch norm need it."""

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


builtin(torch.amax)(_amax_like(torch.amax))
builtin(torch.amin)(_amax_like(torch.amin))


def _max_like(op: Any, elementwise: Any) -> Any:
    class MaxRule:

        def fwd(input, dim=None, keepdim=False):
            if dim is None:
                out = op(input)
                return out, ("all", input, out)
            if hasattr(dim, "node") or isinstance(dim, torch.Tensor):  # binary form
                out = elementwise(input, dim)
                return out, ("binary", input, dim, out)
            out = op(input, dim, keepdim)
            return out, ("dim", input, dim, keepdim, out[1])

        def bwd(aux, d):
            kind = aux[0]
            if kind == "all":
                _, x, out = aux
                hit = (x == out).to(x.dtype)
                return (hit * (d / torch.sum(hit)),)
            if kind == "binary":
                _, a, b, out = aux
                tie = a == b
                half = d * 0.5
                return (torch.where(tie, half, torch.where(a == out, d, 0.0)),
                        torch.where(tie, half, torch.where(b == out, d, 0.0)))
            _, x, dim, keepdim, idx = aux
            d_values = d[0]
            if d_values is None:
                return (None,)
            if not keepdim:
                d_values = torch.unsqueeze(d_values, dim)
                idx = torch.unsqueeze(idx, dim)
            return (torch.zeros_like(x).scatter(dim, idx, d_values),)

        def jvp(primals, tangents):
            (x, dim, keepdim), (tx, t_other, _) = primals, tangents
            if dim is None:
                out = op(x)
                hit = (x == out).to(x.dtype)
                return out, torch.sum(hit * tx) / torch.sum(hit)
            if hasattr(dim, "node") or isinstance(dim, torch.Tensor):  # binary form
                from .elementwise import _tie_select
                out = elementwise(x, dim)
                return out, _tie_select(x, dim, out, tx, t_other)
            out = op(x, dim, keepdim)
            idx = out[1] if keepdim else torch.unsqueeze(out[1], dim)
            t = torch.gather(tx, dim, idx)
            return out, (t if keepdim else torch.squeeze(t, dim), None)

        def samples(dtype):
            yield (randn(3, 4, dtype=dtype),), {}
            yield (randn(3, 4, dtype=dtype), 1), {}
            yield (randn(3, 4, 5, dtype=dtype), 0, True), {}
            yield (randn(3, 4, dtype=dtype), randn(4, dtype=dtype)), {}

    MaxRule.__doc__ = (
        f"{op.__name__}(x) -> value: cotangent shared evenly among ties (derivatives.yaml "
        f"`max`: evenly_distribute_backward); {op.__name__}(x, dim) -> (values, indices): "
        "cotangent scattered to the selected index (derivatives.yaml `max.dim`: "
        f"value_selecting_reduction_backward); {op.__name__}(x, other) is "
        f"torch.{elementwise.__name__}.")
    return MaxRule


builtin(torch.max)(_max_like(torch.max, torch.maximum))
builtin(torch.min)(_max_like(torch.min, torch.minimum))


@builtin(torch.logsumexp)
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
