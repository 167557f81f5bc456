"""Rules for norms: ``linalg.vector_norm``, ``linalg.matrix_norm``, ``linalg.norm``, ``norm``,
``dist``, ``linalg.cond`` and ``renorm``.

Vector p-norms share :func:`fxad.rules._base.pnorm_grad` (derivatives.yaml
``linalg_vector_norm``: norm_backward); matrix norms go through the singular values or the
entries (``fro``, ``nuc``, ``+-1``, ``+-2``, ``+-inf``; derivatives.yaml
``linalg_matrix_norm``), and ``cond`` through the matrix norms of ``A`` and ``A^-1``.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from .._base import dims_of, pnorm_grad, randn, restore_reduced
from ..registry import register_vjp


# --- norms ----------------------------------------------------------------------------------

def _vnorm_bwd(x: Any, out: Any, p: Any, dim: Any, keepdim: bool, d: Any) -> Any:
    if dim is None:
        return pnorm_grad(x, out, p, d)
    dims = dims_of(dim, x.dim())
    if not dims:
        return pnorm_grad(x, out, p, d)
    red = restore_reduced(out, dims, keepdim)
    return pnorm_grad(x, red, p, restore_reduced(d, dims, keepdim), dims)


@register_vjp(torch.linalg.vector_norm)
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


@register_vjp(torch.norm)
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


@register_vjp(torch.dist)
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


@register_vjp(torch.linalg.matrix_norm)
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


@register_vjp(torch.linalg.norm)
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


# --- condition number -------------------------------------------------------------------------

def _cond_grad(a: Any, p: Any, d: Any) -> Any:
    """Cotangent of linalg.cond(A, p) for cotangent d.  p in (None, 2, -2): cond = S[0] / S[-1]
    (inverted for -2) through svdvals' backward U diag(gS) V^T.  Other p: cond = n(A) n(B),
    B = A^{-1}: gA = d n(B) grad n(A) - B^T (d n(A) grad n(B)) B^T (linalg.matrix_norm's
    backward)."""
    if p is None or p in (2, -2):
        u, s, vh = torch.linalg.svd(a, full_matrices=False)
        s1, sn = s[..., 0], s[..., -1]
        if p == -2:
            c1, cn = -d * sn / (s1 * s1), d / s1
        else:
            c1, cn = d / sn, -d * s1 / (sn * sn)
        o1 = torch.unsqueeze(u[..., :, 0], -1) * torch.unsqueeze(vh[..., 0, :], -2)
        on = torch.unsqueeze(u[..., :, -1], -1) * torch.unsqueeze(vh[..., -1, :], -2)
        return torch.unsqueeze(torch.unsqueeze(c1, -1), -1) * o1 + \
            torch.unsqueeze(torch.unsqueeze(cn, -1), -1) * on
    dims = (a.dim() - 2, a.dim() - 1)
    b = torch.linalg.inv(a)
    na = torch.linalg.matrix_norm(a, p)
    nb = torch.linalg.matrix_norm(b, p)
    ga = _matrix_norm_bwd(a, p, dims, False, d * nb)
    gb = _matrix_norm_bwd(b, p, dims, False, d * na)
    return ga - torch.matmul(torch.matmul(b.mT, gb), b.mT)


@register_vjp(torch.linalg.cond)
class LinalgCond:
    """linalg.cond(A, p): the composite of derivatives.yaml (`linalg_svdvals` for p in None/2/-2:
    cond = S[0] / S[-1]; `linalg_matrix_norm` and `linalg_inv_ex` otherwise); JVP:
    <grad cond(A), t>, the gradient of the (piecewise) smooth scalar."""

    def fwd(A, p=None, *, out=None):
        c = torch.linalg.cond(A, p)
        return c, (A, p)

    def bwd(aux, d):
        a, p = aux
        return (_cond_grad(a, p, d),)

    def jvp(primals, tangents):
        a, p, _ = primals
        t = tangents[0]
        c = torch.linalg.cond(a, p)
        if t is None:
            return c, None
        return c, torch.sum(_cond_grad(a, p, torch.ones_like(c)) * t, (-2, -1))

    def samples(dtype):
        yield (randn(3, 3, dtype=dtype),), {}
        yield (randn(2, 3, 4, dtype=dtype), -2), {}
        # (p = 'fro', 'nuc', +-inf, +-1: PyTorch's own autograd fails on linalg.cond, an
        # in-place write to the inverse, so fxad.check has no reference; checked against
        # finite differences separately)


# ---------------------------------------------------------------------------------------------
# renorm, quantile
# ---------------------------------------------------------------------------------------------

def _renorm_parts(x: Any, p: float, dim: int, maxnorm: float) -> tuple:
    dims = tuple(k for k in range(x.dim()) if k != dim % x.dim())
    norm = torch.linalg.vector_norm(x, p, dims, keepdim=True)
    over = norm > maxnorm
    inv = 1.0 / (norm + 1e-7)
    return dims, norm, over, inv


@register_vjp(torch.renorm)
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
