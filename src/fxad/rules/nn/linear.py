"""Rules for ``torch.nn.functional``'s linear functions: ``linear`` and ``bilinear``.

``linear(x, W, b) = x W^T + b`` is written with matmuls (derivatives.yaml ``linear`` via
``addmm`` / ``matmul``); matrix products in general are in :mod:`fxad.rules.linalg.products`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .._base import conj, randn, _t
from ..registry import register_vjp


@register_vjp(F.linear)
class Linear:
    """linear(x, W, b) = x W^T + b: d_x = d @ W, d_W = d^T x (leading dims flattened),
    d_b = d summed over leading dims (derivatives.yaml `linear` via addmm / matmul)."""

    residuals = "inputs"
    recompute = False

    def fwd(input, weight, bias=None):
        return F.linear(input, weight, bias), (input, weight)

    def bwd(aux, d):
        x, w = conj(aux[0]), conj(aux[1])  # (complex: adjoints use conjugates)
        d_x = d @ w
        if x.dim() == 1:
            d_w = torch.unsqueeze(d, -1) * x
        elif x.dim() == 2:
            d_w = d.t() @ x
        else:
            d_w = torch.reshape(d, (-1, d.shape[-1])).t() @ torch.reshape(x, (-1, x.shape[-1]))
        d_b = d if d.dim() == 1 else d.sum(0) if d.dim() == 2 else d.sum(tuple(range(d.dim() - 1)))
        return d_x, d_w, d_b

    def jvp(primals, tangents):
        x, w = primals[:2]
        b = primals[2] if len(primals) > 2 else None
        tx, tw = tangents[:2]
        tb = tangents[2] if len(tangents) > 2 else None
        t = None
        if tx is not None:
            t = F.linear(tx, w)
        if tw is not None:
            t = F.linear(x, tw) if t is None else t + F.linear(x, tw)
        if tb is not None:
            t = tb if t is None else t + tb
        return F.linear(x, w, b), t

    def samples(dtype):
        yield (randn(3, 4, dtype=dtype), randn(5, 4, dtype=dtype), randn(5, dtype=dtype)), {}
        yield (randn(2, 3, 4, dtype=dtype), randn(5, 4, dtype=dtype)), {}
        yield (randn(4, dtype=dtype), randn(5, 4, dtype=dtype), randn(5, dtype=dtype)), {}


@register_vjp(F.linear)
class LinearFlat:
    """Real ``x`` of 3 or more dimensions at fused level ``"all"`` (code built to run:
    :func:`fxad.compile`, :func:`fxad.joint_step`): the leading dimensions are flattened
    once, as eager's ``linear`` does (``addmm`` on the folded input, whose 2-D copy, if
    ``x`` is not contiguous, is what it saves): ``x2 = x.reshape(-1, in)``, y = linear(x2,
    W, b) reshaped; d2 = d.reshape(-1, out); d_x = (d2 @ W).reshape(x.shape),
    d_W = d2^T x2, d_b = d2.sum(0) (derivatives.yaml `addmm`).  The default rule reshapes
    ``d`` twice (a copy each when it is not contiguous) and ``x`` again in the backward."""

    residuals = "inputs"
    recompute = False
    fused = "all"

    def applies(input, weight, bias=None):
        return input.dim() > 2 and not input.is_complex() and not weight.is_complex()

    def fwd(input, weight, bias=None):
        x2 = torch.reshape(input, (-1, input.shape[-1]))
        out = torch.reshape(F.linear(x2, weight, bias), (*input.shape[:-1], weight.shape[0]))
        return out, (x2, weight, tuple(input.shape))

    def bwd(aux, d):
        x2, w, shape = aux
        d2 = torch.reshape(d, (-1, d.shape[-1]))
        d_x = torch.reshape(torch.mm(d2, w), shape)
        return d_x, torch.mm(d2.t(), x2), d2.sum(0)

    jvp = Linear.jvp

    def samples(dtype):
        yield (randn(2, 3, 4, dtype=dtype), randn(5, 4, dtype=dtype), randn(5, dtype=dtype)), {}
        yield (randn(3, 2, 4, dtype=dtype).transpose(0, 1), randn(5, 4, dtype=dtype)), {}


@register_vjp(F.bilinear)
class Bilinear:
    """bilinear(a, b, W, bias) = a^T W_o b + bias_o: d_a = einsum(d, W, b), d_b = einsum(d, W,
    a), d_W = einsum(d, a, b), d_bias = sum(d) (derivatives.yaml via `_trilinear`)."""

    def fwd(input1, input2, weight, bias=None):
        return F.bilinear(input1, input2, weight, bias), (input1, input2, weight,
                                                          bias is not None)

    def bwd(aux, d):
        a, b, w, has_bias = aux
        d_a = torch.einsum("...o,oij,...j->...i", d, w, b)
        d_b = torch.einsum("...o,oij,...i->...j", d, w, a)
        d_w = torch.einsum("...o,...i,...j->oij", d, a, b)
        d_bias = torch.reshape(d, (-1, d.shape[-1])).sum(0) if has_bias else None
        return d_a, d_b, d_w, d_bias

    def samples(dtype):
        yield (_t((3, 2), dtype), _t((3, 4), dtype), _t((5, 2, 4), dtype), _t((5,), dtype)), {}
