"""Products of Householder reflectors: ``linalg.householder_product`` (``orgqr``) and
``ormqr``.

Both ops apply the reflectors ``H_i = I - tau_i v_i v_i^T`` (``v_i`` = column ``i`` of the
input below the diagonal, a unit on the diagonal, zeros above) to a matrix ``X`` one after
another, each a rank-1 update ``X <- X - tau_i v_i (v_i^T X)``:

* ``householder_product(A, tau) = H_1 H_2 ... H_k E`` with ``E`` the first ``n`` columns of
  the ``m x m`` identity (applied right to left: ``H_k`` first);
* ``ormqr(A, tau, C, left, transpose) = op(Q) C`` or ``C op(Q)`` with
  ``Q = H_1 ... H_k``: ``Q C`` applies ``H_k`` first, ``Q^T C`` applies ``H_1`` first, and
  the right-hand forms are the left-hand ones on ``C^T`` (``C Q = (Q^T C^T)^T``).

The rules differentiate that explicit sequence: the backward recomputes the intermediate
matrices ``X`` and walks the reflectors in reverse, with, for one step ``Y = X - t v w``,
``w = v^T X`` and cotangent ``G`` of ``Y``::

    d_X = G - t v (v^T G)        d_t = -<v^T G, w>        d_v = -t (G w^T + X G^T v)

and only the strictly-lower part of ``d_v`` reaches the input (the unit diagonal and the
zeros above are constants).  The JVP differentiates the same steps forward.  This is the
method of PyTorch's ``householder_product_backward`` / ``householder_product_jvp`` and
``ormqr`` entries in ``tools/autograd/derivatives.yaml`` (written here independently).  Real
dtypes only (complex values go through the engine's complex fallback).
"""
from __future__ import annotations

from typing import Any

import torch

from ._base import builtin, randn


def _reflectors(A: Any, k: int) -> Any:
    """The ``m x k`` matrix whose column ``i`` is the Householder vector ``v_i``."""
    m = A.shape[-2]
    eye = torch.eye(m, k, dtype=A.dtype, device=A.device)
    return torch.tril(A[..., :k], -1) + eye


def _col(M: Any, i: int) -> Any:
    """Column ``i`` of ``M`` as an ``(..., m, 1)`` matrix."""
    return M[..., i:i + 1]


def _scalar(tau: Any, i: int) -> Any:
    """``tau[..., i]`` shaped ``(..., 1, 1)`` to scale matrices."""
    return torch.unsqueeze(tau[..., i:i + 1], -1)


def _apply(V: Any, tau: Any, X: Any, order: list[int]) -> list[Any]:
    """Apply the reflectors in ``order`` to ``X``; returns the matrices before each step and the
    result (``len(order) + 1`` entries)."""
    xs = [X]
    for i in order:
        v, t = _col(V, i), _scalar(tau, i)
        X = X - t * torch.matmul(v, torch.matmul(v.mT, X))
        xs.append(X)
    return xs


def _apply_bwd(V: Any, tau: Any, X: Any, order: list[int], G: Any) -> tuple[Any, Any, Any]:
    """Cotangents ``(d_V, d_tau, d_X)`` of ``_apply(V, tau, X, order)[-1]`` given its cotangent
    ``G`` (``d_V``: the raw cotangent of the reflector matrix, all entries)."""
    k = V.shape[-1]
    xs = _apply(V, tau, X, order)
    d_v: list[Any] = [None] * k
    d_t: list[Any] = [None] * k
    for step in reversed(range(len(order))):
        i = order[step]
        X = xs[step]
        v, t = _col(V, i), _scalar(tau, i)
        vG = torch.matmul(v.mT, G)  # (..., 1, n)
        w = torch.matmul(v.mT, X)  # (..., 1, n)
        d_t[i] = -torch.sum(vG * w, (-2, -1))
        d_v[i] = -t * (torch.matmul(G, w.mT) + torch.matmul(X, vG.mT))
        G = G - t * torch.matmul(v, vG)
    return torch.cat(d_v, -1), torch.stack(d_t, -1), G


def _apply_jvp(V: Any, tau: Any, X: Any, order: list[int], dV: Any, dtau: Any,
               dX: Any) -> Any:
    """Tangent of ``_apply(V, tau, X, order)[-1]`` (``None`` tangents are zero)."""
    for i in order:
        v, t = _col(V, i), _scalar(tau, i)
        w = torch.matmul(v.mT, X)
        vw = torch.matmul(v, w)
        terms = []
        if dX is not None:
            terms.append(dX)
            dw = torch.matmul(v.mT, dX)
        else:
            dw = None
        if dV is not None:
            dv = _col(dV, i)
            dvx = torch.matmul(dv.mT, X)
            dw = dvx if dw is None else dw + dvx
            terms.append(-t * torch.matmul(dv, w))
        if dw is not None:
            terms.append(-t * torch.matmul(v, dw))
        if dtau is not None:
            terms.append(-_scalar(dtau, i) * vw)
        X = X - t * vw
        if terms:
            dX = terms[0]
            for term in terms[1:]:
                dX = dX + term
    return dX


def _cotangent_of_A(A: Any, d_V: Any) -> Any:
    """Only the strictly-lower part of the first ``k`` columns of ``A`` is read."""
    k, ncols = d_V.shape[-1], A.shape[-1]
    return torch.nn.functional.pad(torch.tril(d_V, -1), (0, ncols - k))


def _tangent_of_V(dA: Any, k: int) -> Any:
    return None if dA is None else torch.tril(dA[..., :k], -1)


@builtin(torch.linalg.householder_product, torch.orgqr)
class HouseholderProduct:
    """householder_product(A, tau) = H_1 ... H_k E (first n columns of the product of the
    reflectors H_i = I - tau_i v_i v_i^T): backward and JVP differentiate the k rank-1 updates
    one by one (the backward in reverse, recomputing the intermediate products); d_A is the
    strictly-lower part of the cotangents of the v_i (derivatives.yaml
    `linalg_householder_product`: householder_product_backward / householder_product_jvp)."""

    def fwd(input, tau, *, out=None):
        return torch.linalg.householder_product(input, tau), (input, tau)

    def bwd(aux, d):
        A, tau = aux
        m, n = A.shape[-2], A.shape[-1]
        k = tau.shape[-1]
        if k == 0:
            return torch.zeros_like(A), torch.zeros_like(tau)
        V = _reflectors(A, k)
        E = torch.eye(m, n, dtype=A.dtype, device=A.device)
        d_V, d_tau, _ = _apply_bwd(V, tau, E, list(reversed(range(k))), d)
        return _cotangent_of_A(A, d_V), d_tau

    def jvp(primals, tangents):
        A, tau = primals[0], primals[1]
        dA, dtau = tangents[0], tangents[1]
        out = torch.linalg.householder_product(A, tau)
        m, n = A.shape[-2], A.shape[-1]
        k = tau.shape[-1]
        if k == 0:
            return out, None
        V = _reflectors(A, k)
        E = torch.eye(m, n, dtype=A.dtype, device=A.device)
        t = _apply_jvp(V, tau, E, list(reversed(range(k))), _tangent_of_V(dA, k), dtau, None)
        return out, t

    def samples(dtype):
        yield (randn(5, 5, dtype=dtype), randn(5, dtype=dtype)), {}
        yield (randn(6, 4, dtype=dtype), randn(3, dtype=dtype)), {}
        yield (randn(2, 3, 5, 4, dtype=dtype), randn(2, 3, 4, dtype=dtype)), {}
        yield (randn(4, 2, dtype=dtype), randn(0, dtype=dtype)), {}


def _ormqr_order(k: int, left: bool, transpose: bool) -> list[int]:
    """Order in which ``ormqr`` applies the reflectors to ``C`` (``C^T`` when right-hand):
    ``Q C`` and ``C Q^T`` apply ``H_k`` first, ``Q^T C`` and ``C Q`` apply ``H_1`` first."""
    last_first = (left and not transpose) or (not left and transpose)
    return list(reversed(range(k))) if last_first else list(range(k))


@builtin(torch.ormqr)
class Ormqr:
    """ormqr(A, tau, C, left, transpose) = op(Q) C or C op(Q), Q = H_1 ... H_k (m x m):
    as a sequence of rank-1 reflector updates applied to C (or C^T for right-hand products);
    d_C is the adjoint application op(Q)^T d (or d op(Q)^T), and d_A, d_tau come from
    differentiating the updates in reverse (derivatives.yaml `ormqr`: ormqr_backward)."""

    def fwd(input, input2, input3, left=True, transpose=False, *, out=None):
        res = torch.ormqr(input, input2, input3, left=left, transpose=transpose)
        return res, (input, input2, input3, left, transpose)

    def bwd(aux, d):
        A, tau, C, left, transpose = aux
        k = tau.shape[-1]
        if k == 0:
            return torch.zeros_like(A), torch.zeros_like(tau), d
        V = _reflectors(A, k)
        order = _ormqr_order(k, left, transpose)
        X, G = (C, d) if left else (C.mT, d.mT)
        d_V, d_tau, d_X = _apply_bwd(V, tau, X, order, G)
        return _cotangent_of_A(A, d_V), d_tau, (d_X if left else d_X.mT)

    def jvp(primals, tangents):
        A, tau, C, left, transpose = primals[:5]
        dA, dtau, dC = tangents[:3]
        out = torch.ormqr(A, tau, C, left=left, transpose=transpose)
        k = tau.shape[-1]
        if k == 0:
            return out, dC
        V = _reflectors(A, k)
        order = _ormqr_order(k, left, transpose)
        X = C if left else C.mT
        dX = dC if (left or dC is None) else dC.mT
        t = _apply_jvp(V, tau, X, order, _tangent_of_V(dA, k), dtau, dX)
        if t is None or left:
            return out, t
        return out, t.mT

    def samples(dtype):
        for left in (True, False):
            for transpose in (False, True):
                kw = {"left": left, "transpose": transpose}
                yield (randn(5, 3, dtype=dtype), randn(3, dtype=dtype),
                       randn(5, 2, dtype=dtype) if left else randn(2, 5, dtype=dtype)), kw
                yield (randn(2, 4, 4, dtype=dtype), randn(2, 4, dtype=dtype),
                       randn(2, 4, 3, dtype=dtype) if left else randn(2, 3, 4, dtype=dtype)), kw
        yield (randn(3, 5, dtype=dtype), randn(3, dtype=dtype), randn(3, 2, dtype=dtype)), {}
        yield (randn(4, 2, dtype=dtype), randn(2, dtype=dtype), randn(3, 4, dtype=dtype),
               False, True), {}
