"""Rules for functions of a matrix: ``linalg.det``/``det``, ``linalg.slogdet``, ``logdet``,
``matrix_exp``/``linalg.matrix_exp``, ``linalg.matrix_power``/``matrix_power``, and the
Vandermonde matrix ``linalg.vander``.

Real inputs are assumed.  Determinants' cotangents are written with ``linalg.solve``/``inv``
(derivatives.yaml ``linalg_det``, ``slogdet``); ``matrix_exp`` uses the block-matrix formula
of the Fréchet derivative (Najfeld & Havel (1995) / Al-Mohy & Higham (2009);
derivatives.yaml ``linalg_matrix_exp``).
"""
from __future__ import annotations

from typing import Any

import torch

from .._base import conj, randn, _spd
from ..registry import register_vjp


# --- matrix functions -----------------------------------------------------------------------

def _sq(x: Any) -> Any:
    return torch.unsqueeze(torch.unsqueeze(x, -1), -1)


@register_vjp(torch.linalg.det)
class Det:
    """linalg.det(A): d_A = d det(A) A^{-T} (derivatives.yaml `linalg_det`; invertible A)."""

    def fwd(A, *, out=None):
        out_ = torch.linalg.det(A)
        return out_, (A, out_)

    def bwd(aux, d):
        a, det = conj(aux[0]), conj(aux[1])  # (complex: d_A = d conj(det A^{-T}))
        return (_sq(d * det) * torch.linalg.inv(a).mT,)

    def samples(dtype):
        yield (randn(3, 3, dtype=dtype),), {}
        yield (randn(2, 4, 4, dtype=dtype),), {}


@register_vjp(torch.linalg.slogdet)
class SlogDet:
    """linalg.slogdet(A) -> (sign, logabsdet): d_A = d_logabsdet A^{-T} (sign is piecewise
    constant) (derivatives.yaml `_linalg_slogdet`)."""

    def fwd(A, *, out=None):
        res = torch.linalg.slogdet(A)
        return res, A

    def bwd(aux, d):
        d_l = d[1] if isinstance(d, (tuple, list)) else d
        if d_l is None:
            return (None,)
        return (_sq(d_l) * torch.linalg.inv(aux).mT,)

    def samples(dtype):
        yield (randn(3, 3, dtype=dtype),), {}


@register_vjp(torch.det)
class DetOld:
    """det(A): d_A = d det(A) A^{-T} (derivatives.yaml `linalg_det`; invertible A)."""

    def fwd(input):
        out_ = torch.det(input)
        return out_, (input, out_)

    def bwd(aux, d):
        a, det = conj(aux[0]), conj(aux[1])  # (complex: d_A = d conj(det A^{-T}))
        return (_sq(d * det) * torch.linalg.inv(a).mT,)

    def samples(dtype):
        yield (randn(3, 3, dtype=dtype),), {}


@register_vjp(torch.logdet)
class LogDet:
    """logdet(A) = log det(A): d_A = d A^{-T} (derivatives.yaml `logdet`)."""

    def fwd(input):
        return torch.logdet(input), input

    def bwd(aux, d):
        return (_sq(d) * torch.linalg.inv(aux).mT,)

    def samples(dtype):
        yield (_spd(3, dtype),), {}


def _mpow_pos_bwd(a: Any, n: int, d: Any) -> Any:
    """sum_{k<n} (A^T)^k d (A^T)^{n-1-k}."""
    at = a.mT
    pows = [None] * n  # pows[k] = (A^T)^k, None for k = 0
    for k in range(1, n):
        pows[k] = at if k == 1 else torch.matmul(pows[k - 1], at)
    g = None
    for k in range(n):
        t = d if pows[k] is None else torch.matmul(pows[k], d)
        r = pows[n - 1 - k]
        t = t if r is None else torch.matmul(t, r)
        g = t if g is None else g + t
    return g


def _matrix_power(op: Any) -> type:
    class MatrixPower:
        """matrix_power(A, n): d_A = sum_k (A^T)^k d (A^T)^(n-1-k); n < 0 through B = A^{-1}:
        d_A = -B^T d_B B^T (derivatives.yaml `linalg_matrix_power`)."""

        def fwd(input, n):
            return op(input, n), (input, n)

        def bwd(aux, d):
            a, n = conj(aux[0]), aux[1]  # (complex: the adjoint uses conj(A))
            if n == 0:
                return None, None
            if n > 0:
                return _mpow_pos_bwd(a, n, d), None
            b = torch.linalg.inv(a)
            db = _mpow_pos_bwd(b, -n, d)
            bt = b.mT
            return -torch.matmul(torch.matmul(bt, db), bt), None

        def samples(dtype):
            yield (randn(3, 3, dtype=dtype), 3), {}
            yield (randn(2, 3, 3, dtype=dtype), 1), {}
            yield (randn(3, 3, dtype=dtype) + 3 * torch.eye(3, dtype=dtype), -2), {}

    return MatrixPower


register_vjp(torch.linalg.matrix_power)(_matrix_power(torch.linalg.matrix_power))
register_vjp(torch.matrix_power)(_matrix_power(torch.matrix_power))


@register_vjp(torch.linalg.vander)
class Vander:
    """linalg.vander(x, N)[..., j] = x^j: d_x = sum_{j >= 1} d_j j x^(j - 1)
    (derivatives.yaml: composite of `pow`/`cumprod`)."""

    def fwd(x, *, N=None):
        out = torch.linalg.vander(x, N=N)
        return out, (out,)

    def bwd(aux, d):
        (out,) = aux
        n = out.shape[-1]
        if n < 2:
            return (torch.sum(d * 0, -1),)
        j = torch.arange(1, n, dtype=d.dtype, device=d.device)
        return (torch.sum(d[..., 1:] * j * out[..., :-1], -1),)

    def jvp(primals, tangents):
        x, n_ = primals
        t = tangents[0]
        out = torch.linalg.vander(x, N=n_)
        if t is None:
            return out, None
        n = out.shape[-1]
        j = torch.arange(1, n, dtype=out.dtype, device=out.device)
        dv = torch.cat([torch.zeros_like(out[..., :1]), j * out[..., :-1]], -1)
        return out, torch.unsqueeze(t, -1) * dv

    def samples(dtype):
        yield (randn(4, dtype=dtype),), {}
        yield (randn(2, 3, dtype=dtype),), {"N": 5}


# --- matrix exponential ---------------------------------------------------------------------

def _block_expm(a: Any, t: Any) -> Any:
    """Upper-right block of matrix_exp([[a, t], [0, a]]) = the Fréchet derivative L(a, t)."""
    n = a.shape[-1]
    top = torch.cat([a, t], -1)
    bottom = torch.cat([torch.zeros_like(a), a], -1)
    e = torch.matrix_exp(torch.cat([top, bottom], -2))
    return e[..., :n, n:]


@register_vjp(torch.matrix_exp)
class MatrixExp:
    """matrix_exp(A): d_A = L(A^T, d), the Fréchet derivative at A^T, read off the upper
    right block of matrix_exp([[A^T, d], [0, A^T]]); JVP: L(A, t) likewise (derivatives.yaml
    `matrix_exp`: linalg_matrix_exp_differential; Najfeld & Havel 1995)."""

    def fwd(input):
        return torch.matrix_exp(input), input

    def bwd(aux, d):
        return (_block_expm(aux.mT, d),)

    def jvp(primals, tangents):
        (a,), (t,) = primals, tangents
        out = torch.matrix_exp(a)
        return out, (None if t is None else _block_expm(a, t))

    def samples(dtype):
        yield (randn(3, 3, dtype=dtype),), {}
        yield (randn(2, 3, 3, dtype=dtype),), {}
        yield (randn(1, 1, dtype=dtype),), {}


@register_vjp(torch.linalg.matrix_exp)
class LinalgMatrixExp:
    """linalg.matrix_exp(A): as matrix_exp (derivatives.yaml `matrix_exp`)."""

    def fwd(A):
        return torch.linalg.matrix_exp(A), A

    bwd = MatrixExp.bwd

    def jvp(primals, tangents):
        (a,), (t,) = primals, tangents
        out = torch.linalg.matrix_exp(a)
        return out, (None if t is None else _block_expm(a, t))

    def samples(dtype):
        yield (randn(3, 3, dtype=dtype),), {}
