"""Rules for sorting: ``sort``, ``msort``, ``topk``.

The values are a permutation (or a selection) of the input, so the cotangent is scattered
back to the returned indices and the tangent gathered there (derivatives.yaml ``sort``,
``topk``: ``value_selecting_reduction_backward``).  The value-selecting reductions
(``kthvalue``, ``median``, ``mode``) are in :mod:`fxad.rules.reductions`.
"""
from __future__ import annotations

import torch

from ._base import randn, _index_back, _value_d
from .registry import register_vjp


@register_vjp(torch.sort)
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


@register_vjp(torch.msort)
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


@register_vjp(torch.topk)
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
