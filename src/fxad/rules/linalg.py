"""Rules for matrix products: ``@``/``matmul``, ``mm``, ``bmm``, ``linear``, ``addmm``,
``baddbmm``-free set, ``einsum`` is not covered (register a rule or rewrite with matmul).

For ``y = a @ b``: d_a = d @ b^T, d_b = a^T @ d (derivatives.yaml `mm`, `bmm`, and
``matmul_backward`` for the 1-D and batched cases); batch broadcasting is reduced by the
engine.
"""
from __future__ import annotations

import operator

import torch
import torch.nn.functional as F

from ._base import conj, builtin, randn


def _add(a, b):
    if a is None:
        return b
    if b is None:
        return a
    return a + b


def _matmul_bwd(a, b, d):
    if a.dim() == 1 and b.dim() == 1:  # dot product
        return d * b, a * d
    if a.dim() == 1:  # (n) @ (..., n, p) -> (..., p)
        d2 = torch.unsqueeze(d, -2)
        return torch.squeeze(d2 @ b.mT, -2), torch.unsqueeze(a, -1) * d2
    if b.dim() == 1:  # (..., m, n) @ (n) -> (..., m)
        d2 = torch.unsqueeze(d, -1)
        return d2 * b, torch.squeeze(a.mT @ d2, -1)
    if a.dim() == 2 and b.dim() == 2:
        return d @ b.t(), a.t() @ d
    return d @ b.mT, a.mT @ d


@builtin(operator.matmul, torch.matmul)
class Matmul:
    """a @ b with numpy semantics (1-D operands, batch broadcasting): d_a = d @ b^T,
    d_b = a^T @ d (derivatives.yaml `matmul` → matmul_backward)."""

    residuals = "inputs"
    recompute = False

    def fwd(input, other):
        return input @ other, (input, other)

    def bwd(aux, d):
        a, b = aux
        return _matmul_bwd(conj(a), conj(b), d)  # complex: d_a = d @ b^H, d_b = a^H @ d

    def jvp(primals, tangents):
        (a, b), (ta, tb) = primals, tangents
        t = None if ta is None else ta @ b
        if tb is not None:
            t = a @ tb if t is None else t + a @ tb
        return a @ b, t

    def samples(dtype):
        yield (randn(3, 4, dtype=dtype), randn(4, 5, dtype=dtype)), {}
        yield (randn(2, 3, 4, dtype=dtype), randn(4, 5, dtype=dtype)), {}
        yield (randn(4, dtype=dtype), randn(2, 4, 5, dtype=dtype)), {}
        yield (randn(2, 3, 4, dtype=dtype), randn(4, dtype=dtype)), {}
        yield (randn(4, dtype=dtype), randn(4, dtype=dtype)), {}


@builtin(torch.mm)
class Mm:
    """mm(a, b): d_a = d @ b^T, d_b = a^T @ d (derivatives.yaml `mm`)."""

    residuals = "inputs"
    recompute = False

    def fwd(input, mat2):
        return torch.mm(input, mat2), (input, mat2)

    def bwd(aux, d):
        a, b = conj(aux[0]), conj(aux[1])  # (complex: adjoints use conjugates)
        return torch.mm(d, b.t()), torch.mm(a.t(), d)

    def jvp(primals, tangents):
        (a, b), (ta, tb) = primals, tangents
        return torch.mm(a, b), _add(None if ta is None else torch.mm(ta, b),
                                    None if tb is None else torch.mm(a, tb))

    def samples(dtype):
        yield (randn(3, 4, dtype=dtype), randn(4, 5, dtype=dtype)), {}


@builtin(torch.bmm)
class Bmm:
    """bmm(a, b): d_a = d @ b^T, d_b = a^T @ d per batch (derivatives.yaml `bmm`)."""

    residuals = "inputs"
    recompute = False

    def fwd(input, mat2):
        return torch.bmm(input, mat2), (input, mat2)

    def bwd(aux, d):
        a, b = conj(aux[0]), conj(aux[1])  # (complex: adjoints use conjugates)
        return torch.bmm(d, b.mT), torch.bmm(a.mT, d)

    def jvp(primals, tangents):
        (a, b), (ta, tb) = primals, tangents
        return torch.bmm(a, b), _add(None if ta is None else torch.bmm(ta, b),
                                     None if tb is None else torch.bmm(a, tb))

    def samples(dtype):
        yield (randn(2, 3, 4, dtype=dtype), randn(2, 4, 5, dtype=dtype)), {}


@builtin(F.linear)
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


@builtin(torch.addmm)
class Addmm:
    """addmm(c, a, b, beta, alpha) = beta c + alpha a @ b: d_c = beta d,
    d_a = alpha d @ b^T, d_b = alpha a^T @ d (derivatives.yaml `addmm`)."""

    residuals = "inputs"
    recompute = False

    def fwd(input, mat1, mat2, *, beta=1, alpha=1):
        return torch.addmm(input, mat1, mat2, beta=beta, alpha=alpha), (mat1, mat2, beta, alpha)

    def bwd(aux, d):
        a, b, beta, alpha = conj(aux[0]), conj(aux[1]), conj(aux[2]), conj(aux[3])
        d_ab = d if alpha == 1 else d * alpha
        return (d if beta == 1 else d * beta), torch.mm(d_ab, b.t()), torch.mm(a.t(), d_ab)

    def jvp(primals, tangents):
        (c, a, b, beta, alpha), (tc, ta, tb, _, _) = primals, tangents
        t_ab = _add(None if ta is None else torch.mm(ta, b), None if tb is None else torch.mm(a, tb))
        if t_ab is not None and alpha != 1:
            t_ab = t_ab * alpha
        if tc is not None and beta != 1:
            tc = tc * beta
        return torch.addmm(c, a, b, beta=beta, alpha=alpha), _add(tc, t_ab)

    def samples(dtype):
        yield (randn(5, dtype=dtype), randn(3, 4, dtype=dtype), randn(4, 5, dtype=dtype)), {}
        yield (randn(3, 5, dtype=dtype), randn(3, 4, dtype=dtype), randn(4, 5, dtype=dtype)), \
            {"beta": 0.5, "alpha": 2.0}
