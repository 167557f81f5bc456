"""Rules for matrix decompositions: ``linalg.cholesky``/``cholesky_ex``/``cholesky``,
``linalg.eigh``/``eigvalsh``, ``linalg.eig``/``eigvals``, ``linalg.svd``/``svd``/``svdvals``,
``linalg.qr``/``qr``, ``linalg.lu``/``lu_factor``/``lu_factor_ex``/``lu``, ``lu_unpack``,
``linalg.householder_product`` (``orgqr``) and ``ormqr``.

Real inputs are assumed (OpInfo sweeps differentiate float tensors).  Formulas follow PyTorch's
``tools/autograd/derivatives.yaml`` (entry named in each rule) and the papers behind them:
M. Seeger et al., "Auto-differentiating linear algebra" (2017) for Cholesky/LU/QR,
M. Giles, "An extended collection of matrix derivative results for forward and reverse mode
AD" (2008) for eigen- and singular value decompositions.  Gauge conventions (eigenvector
signs, the extra columns of full SVD factors) follow PyTorch's backward formulas, so
cotangents match autograd's exactly.

Householder products apply the reflectors ``H_i = I - tau_i v_i v_i^T`` (``v_i`` = column
``i`` of the input below the diagonal, a unit on the diagonal, zeros above) to a matrix ``X``
one after another, each a rank-1 update ``X <- X - tau_i v_i (v_i^T X)``:

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

from .._base import randn, _add
from ..registry import register_vjp
from ._common import _first


def _cholesky_bwd(L: Any, gL: Any, upper: bool) -> Any:
    if upper:
        L, gL = L.mT, gL.mT
    n = L.shape[-1]
    eye = torch.eye(n, dtype=L.dtype, device=L.device)
    linv = torch.linalg.solve_triangular(L, eye, upper=False)
    phi = torch.tril(torch.matmul(L.mT, gL))
    phi = phi - 0.5 * torch.diag_embed(torch.diagonal(phi, 0, -2, -1))
    g = torch.matmul(torch.matmul(linv.mT, phi), linv)
    return 0.5 * (g + g.mT)


def _cholesky_jvp(L: Any, t: Any, upper: bool) -> Any:
    """dL = L Phi(L^{-1} dA L^{-T}) (upper: dU = dL^T) (derivatives.yaml `linalg_cholesky_ex`
    result: cholesky_jvp)."""
    if upper:
        L = L.mT
    t = 0.5 * (t + t.mT)  # the symmetric part (the VJP is symmetrized likewise)
    x = torch.linalg.solve_triangular(L, t, upper=False)
    x = torch.linalg.solve_triangular(L, x.mT, upper=False).mT
    phi = torch.tril(x) - 0.5 * torch.diag_embed(torch.diagonal(x, 0, -2, -1))
    dl = torch.matmul(L, phi)
    return dl.mT if upper else dl


@register_vjp(torch.linalg.cholesky)
class Cholesky:
    """linalg.cholesky(A) = L: d_A = sym(L^{-T} Phi(L^T d) L^{-1}), Phi = lower triangle with
    halved diagonal (derivatives.yaml `linalg_cholesky_ex`: cholesky_backward)."""

    def fwd(A, *, upper=False, out=None):
        L = torch.linalg.cholesky(A, upper=upper) if upper else torch.linalg.cholesky(A)
        return L, (L, upper)

    def bwd(aux, d):
        L, upper = aux
        return (_cholesky_bwd(L, d, upper),)

    def jvp(primals, tangents):
        a, upper, _ = primals
        L = torch.linalg.cholesky(a, upper=upper)
        t = tangents[0]
        return L, (None if t is None else _cholesky_jvp(L, t, upper))

    # no samples: cholesky reads only one triangle, so central differences cannot match the
    # symmetrized cotangent; the OpInfo sweep checks it against autograd


@register_vjp(torch.linalg.cholesky_ex)
class CholeskyEx:
    """linalg.cholesky_ex(A) -> (L, info): as linalg.cholesky (derivatives.yaml
    `linalg_cholesky_ex`)."""

    def fwd(A, *, upper=False, check_errors=False, out=None):
        res = torch.linalg.cholesky_ex(A, upper=upper, check_errors=check_errors)
        return res, (res[0], upper)

    def bwd(aux, d):
        d = d[0] if isinstance(d, (tuple, list)) else d
        if d is None:
            return (None,)
        L, upper = aux
        return (_cholesky_bwd(L, d, upper),)

    def jvp(primals, tangents):
        a, upper, check, _ = primals
        res = torch.linalg.cholesky_ex(a, upper=upper, check_errors=check)
        t = tangents[0]
        return res, (None if t is None else _cholesky_jvp(res[0], t, upper), None)


@register_vjp(torch.cholesky)
class CholeskyOld:
    """cholesky(A, upper): as linalg.cholesky (derivatives.yaml `cholesky`)."""

    def fwd(input, upper=False):
        L = torch.cholesky(input, upper)
        return L, (L, upper)

    def bwd(aux, d):
        L, upper = aux
        return (_cholesky_bwd(L, d, upper),)

    def jvp(primals, tangents):
        a, upper = primals
        L = torch.cholesky(a, upper)
        t = tangents[0]
        return L, (None if t is None else _cholesky_jvp(L, t, upper))


@register_vjp(torch.linalg.svdvals)
class SvdVals:
    """linalg.svdvals(A) = S: d_A = U diag(d) V^H (derivatives.yaml `_linalg_svd` with only
    gS: svd_backward)."""

    def fwd(A, *, driver=None, out=None):
        return torch.linalg.svdvals(A), A

    def bwd(aux, d):
        u, _, vh = torch.linalg.svd(aux, full_matrices=False)
        return (torch.matmul(u * torch.unsqueeze(d, -2), vh),)

    def samples(dtype):
        yield (randn(3, 4, dtype=dtype),), {}
        yield (randn(2, 4, 3, dtype=dtype),), {}


@register_vjp(torch.linalg.eigvalsh)
class EigvalsH:
    """linalg.eigvalsh(A, UPLO) = L: d_A = V diag(d) V^T with V the eigenvectors
    (derivatives.yaml `_linalg_eigh` with only gL: linalg_eig_backward)."""

    def fwd(A, UPLO="L", *, out=None):
        return torch.linalg.eigvalsh(A, UPLO), (A, UPLO)

    def bwd(aux, d):
        a, uplo = aux
        _, v = torch.linalg.eigh(a, uplo)
        return (torch.matmul(v * torch.unsqueeze(d, -2), v.mT),)

    def jvp(primals, tangents):
        a, uplo = primals[0], primals[1]
        t = tangents[0]
        w, v = torch.linalg.eigh(a, uplo)
        if t is None:
            return w, None
        return w, torch.sum(v * torch.matmul(t, v), -2)  # diag(V^T t V)

    # no samples: eigvalsh reads one triangle, so central differences cannot match the
    # symmetric cotangent; the OpInfo sweep checks it against autograd


def _eye(n: int, like: Any) -> Any:
    return torch.eye(n, dtype=like.dtype, device=like.device)


# --- symmetric eigendecomposition ------------------------------------------------------------

def _offdiag_inv(e: Any) -> Any:
    """1 / e off the diagonal, 0 on it (e: a batch of square matrices)."""
    eye = _eye(e.shape[-1], e)
    return (1 - eye) / (e + eye)


def _eigh_bwd(w: Any, v: Any, gw: Any, gv: Any) -> Any:
    """V (diag(gw) + skew(V^T gV) / E) V^T, E_ij = w_j - w_i, skew(K) = (K - K^T) / 2."""
    inner = None
    if gv is not None:
        k = torch.matmul(v.mT, gv)
        e = torch.unsqueeze(w, -2) - torch.unsqueeze(w, -1)
        inner = 0.5 * (k - k.mT) * _offdiag_inv(e)
    if gw is not None:
        inner = _add(inner, torch.diag_embed(gw))
    if inner is None:
        return None
    return torch.matmul(torch.matmul(v, inner), v.mT)


@register_vjp(torch.linalg.eigh)
class Eigh:
    """linalg.eigh(A, UPLO) -> (L, V): d_A = V (diag(d_L) + F o skew(V^T d_V)) V^T with
    F_ij = 1 / (L_j - L_i) off the diagonal and skew(K) = (K - K^T) / 2 (symmetric, as
    derivatives.yaml `_linalg_eigh`: linalg_eig_backward with is_hermitian).  JVP on the
    symmetric part T of the tangent: dL = diag(V^T T V), dV = V (F o V^T T V)."""

    def fwd(A, UPLO="L", *, out=None):
        res = torch.linalg.eigh(A, UPLO)
        return res, (res[0], res[1])

    def bwd(aux, d):
        w, v = aux
        return (_eigh_bwd(w, v, _first(d, 0), _first(d, 1)),)

    def jvp(primals, tangents):
        a, uplo = primals[0], primals[1]
        t = tangents[0]
        res = torch.linalg.eigh(a, uplo)
        if t is None:
            return res, (None, None)
        w, v = res[0], res[1]
        x = torch.matmul(torch.matmul(v.mT, 0.5 * (t + t.mT)), v)
        e = torch.unsqueeze(w, -2) - torch.unsqueeze(w, -1)
        return res, (torch.diagonal(x, 0, -2, -1), torch.matmul(v, x * _offdiag_inv(e)))

    # no samples: eigh reads one triangle, so central differences cannot match the
    # symmetric cotangent; the OpInfo sweep checks it against autograd


# --- singular value decomposition ------------------------------------------------------------

def _svd_bwd(u: Any, s: Any, vh: Any, gu: Any, gs: Any, gvh: Any) -> Any:
    """Cotangent of A = U diag(S) Vh (reduced factors, real): with E_ij = s_j^2 - s_i^2,
    inner = (skew(U^T gU) / E) S + S (skew(Vh gVh^T) / E) + diag(gS), skew(K) = K - K^T;
    gA = U inner Vh, plus (I - U U^T) gU S^{-1} Vh (m > n) or U S^{-1} gVh (I - V V^T)
    (m < n)."""
    m, n = u.shape[-2], vh.shape[-1]
    if gu is None and gvh is None:
        if gs is None:
            return None
        return torch.matmul(u * torch.unsqueeze(gs, -2), vh)
    s2 = s * s
    f = _offdiag_inv(torch.unsqueeze(s2, -2) - torch.unsqueeze(s2, -1))
    inner = None
    if gu is not None:
        k = torch.matmul(u.mT, gu)
        inner = (k - k.mT) * f * torch.unsqueeze(s, -2)
    if gvh is not None:
        k = torch.matmul(vh, gvh.mT)
        inner = _add(inner, torch.unsqueeze(s, -1) * ((k - k.mT) * f))
    if gs is not None:
        inner = inner + torch.diag_embed(gs)
    if m > n and gu is not None:
        g = torch.matmul(u, inner)
        gus = gu / torch.unsqueeze(s, -2)
        g = g + gus - torch.matmul(u, torch.matmul(u.mT, gus))
        return torch.matmul(g, vh)
    if m < n and gvh is not None:
        g = torch.matmul(inner, vh)
        sgv = gvh / torch.unsqueeze(s, -1)
        g = g + sgv - torch.matmul(torch.matmul(sgv, vh.mT), vh)
        return torch.matmul(u, g)
    return torch.matmul(torch.matmul(u, inner), vh)


def _svd_jvp(a: Any, u: Any, s: Any, vh: Any, t: Any) -> tuple[Any, Any, Any]:
    """Tangents (dU, dS, dVh) of the reduced SVD along t: dP = U^T t V, dS = diag(dP),
    dU = U ((dP S + S dP^T) / E) [+ (I - U U^T) t V S^{-1} when m > n],
    dV = V ((S dP + dP^T S) / E) [+ (I - V V^T) t^T U S^{-1} when m < n]."""
    m, n = a.shape[-2], a.shape[-1]
    v = vh.mT
    tv = torch.matmul(t, v)
    dp = torch.matmul(u.mT, tv)
    s2 = s * s
    f = _offdiag_inv(torch.unsqueeze(s2, -2) - torch.unsqueeze(s2, -1))
    sr, sc = torch.unsqueeze(s, -2), torch.unsqueeze(s, -1)
    du = torch.matmul(u, (dp * sr + sc * dp.mT) * f)
    dv = torch.matmul(v, (sc * dp + dp.mT * sr) * f)
    if m > n:
        du = du + (tv - torch.matmul(u, dp)) / sr
    if m < n:
        dv = dv + (torch.matmul(t.mT, u) - torch.matmul(v, dp.mT)) / sr
    return du, torch.diagonal(dp, 0, -2, -1), dv.mT


def _pad_cols(x: Any, full: Any) -> Any:
    """x (..., m, k) padded with zero columns to full's width."""
    k = x.shape[-1]
    if full.shape[-1] == k:
        return x
    return torch.cat([x, torch.zeros_like(full[..., :, k:])], -1)


@register_vjp(torch.linalg.svd)
class LinalgSvd:
    """linalg.svd(A, full_matrices) -> (U, S, Vh): svd_backward of derivatives.yaml
    `_linalg_svd` (M. Giles 2008; real inputs).  With full_matrices=True only the first
    min(m, n) columns of U (rows of Vh) enter, as in PyTorch (the others are not determined
    by A); their tangents are zero."""

    def fwd(A, full_matrices=True, *, driver=None, out=None):
        res = torch.linalg.svd(A, full_matrices, driver=driver)
        return res, (res[0], res[1], res[2])

    def bwd(aux, d):
        u, s, vh = aux
        k = s.shape[-1]
        gu, gs, gvh = _first(d, 0), _first(d, 1), _first(d, 2)
        u, vh = u[..., :, :k], vh[..., :k, :]
        if gu is not None:
            gu = gu[..., :, :k]
        if gvh is not None:
            gvh = gvh[..., :k, :]
        return (_svd_bwd(u, s, vh, gu, gs, gvh),)

    def jvp(primals, tangents):
        a, full, driver, _ = primals
        t = tangents[0]
        res = torch.linalg.svd(a, full, driver=driver)
        if t is None:
            return res, (None, None, None)
        u, s, vh = res[0], res[1], res[2]
        k = s.shape[-1]
        du, ds, dvh = _svd_jvp(a, u[..., :, :k], s, vh[..., :k, :], t)
        return res, (_pad_cols(du, u), ds, _pad_cols(dvh.mT, vh.mT).mT)

    def samples(dtype):
        yield (randn(4, 3, dtype=dtype), False), {}
        yield (randn(2, 3, 5, dtype=dtype),), {"full_matrices": False}
        yield (randn(3, 3, dtype=dtype),), {}


@register_vjp(torch.svd)
class Svd:
    """svd(A, some, compute_uv) -> (U, S, V) = linalg.svd(A, not some) with V = Vh^T: as
    linalg.svd (derivatives.yaml `_linalg_svd`; some=False: the first min(m, n) columns of
    U and V enter; compute_uv=False: U and V are zeros, only S is differentiable)."""

    def fwd(input, some=True, compute_uv=True, *, out=None):
        res = torch.svd(input, some, compute_uv)
        if not compute_uv:
            return res, (input, None, None, None)
        return res, (None, res[0], res[1], res[2])

    def bwd(aux, d):
        a, u, s, v = aux
        gs = _first(d, 1)
        if a is not None:  # compute_uv=False: only S carries a cotangent
            if gs is None:
                return (None,)
            u, s, vh = torch.linalg.svd(a, full_matrices=False)
            return (_svd_bwd(u, s, vh, None, gs, None),)
        k = s.shape[-1]
        gu, gv = _first(d, 0), _first(d, 2)
        u, vh = u[..., :, :k], v[..., :, :k].mT
        if gu is not None:
            gu = gu[..., :, :k]
        gvh = None if gv is None else gv[..., :, :k].mT
        return (_svd_bwd(u, s, vh, gu, gs, gvh),)

    def jvp(primals, tangents):
        a, some, uv, _ = primals
        t = tangents[0]
        res = torch.svd(a, some, uv)
        if t is None:
            return res, (None, None, None)
        if not uv:
            u, s, vh = torch.linalg.svd(a, full_matrices=False)
            ds = torch.sum(u * torch.matmul(t, vh.mT), -2)  # diag(U^T t V)
            return res, (None, ds, None)
        u, s, v = res[0], res[1], res[2]
        k = s.shape[-1]
        du, ds, dvh = _svd_jvp(a, u[..., :, :k], s, v[..., :, :k].mT, t)
        return res, (_pad_cols(du, u), ds, _pad_cols(dvh.mT, v))

    def samples(dtype):
        yield (randn(4, 3, dtype=dtype),), {}
        yield (randn(2, 3, 5, dtype=dtype), True), {}
        yield (randn(3, 4, dtype=dtype),), {"compute_uv": False}


# --- QR ---------------------------------------------------------------------------------------

def _qr_mode_check(mode: str, m: int, n: int) -> None:
    if mode == "r":
        raise RuntimeError("The derivative of linalg.qr depends on Q, which is not computed "
                           "when mode='r'; use mode='reduced' to differentiate through it")
    if mode == "complete" and m > n:
        raise RuntimeError("The QR decomposition is not differentiable when mode='complete' "
                           "and nrows > ncols")


def _qr_bwd_tall(q: Any, r: Any, gq: Any, gr: Any) -> Any:
    """A = QR with m >= n: gA = (gQ + Q N) R^{-T}, N = copy of the upper triangle of
    M = gR R^T - Q^T gQ into the lower one."""
    m = None
    if gr is not None:
        m = torch.matmul(gr, r.mT)
    if gq is not None:
        m = _add(m, -torch.matmul(q.mT, gq))
    if m is None:
        return None
    g = torch.matmul(q, torch.triu(m) + torch.triu(m, 1).mT)
    g = _add(g, gq)
    return torch.linalg.solve_triangular(r.mT, g, upper=False, left=False)


def _qr_bwd(a: Any, q: Any, r: Any, gq: Any, gr: Any) -> Any:
    m, n = a.shape[-2], a.shape[-1]
    if m >= n:
        return _qr_bwd_tall(q, r, gq, gr[..., :n, :] if gr is not None else None)
    # wide: A = Q [R1 | R2], R2 = Q^T Y with Y = A[..., m:]
    y = a[..., :, m:]
    gr1 = gy = None
    if gr is not None:
        gr1, gr2 = gr[..., :, :m], gr[..., :, m:]
        gq = _add(gq, torch.matmul(y, gr2.mT))
        gy = torch.matmul(q, gr2)
    gx = _qr_bwd_tall(q, r[..., :, :m], gq, gr1)
    if gx is None and gy is None:
        return None
    if gx is None:
        gx = torch.zeros_like(a[..., :, :m])
    if gy is None:
        gy = torch.zeros_like(y)
    return torch.cat([gx, gy], -1)


def _qr_jvp_tall(q: Any, r: Any, t: Any) -> tuple[Any, Any]:
    """C = Q^T t R^{-1}, B = triu(C) + tril(C, -1)^T: dR = B R, dQ = t R^{-1} - Q B."""
    tr = torch.linalg.solve_triangular(r, t, upper=True, left=False)
    c = torch.matmul(q.mT, tr)
    b = torch.triu(c) + torch.tril(c, -1).mT
    return tr - torch.matmul(q, b), torch.matmul(b, r)


def _qr_jvp(a: Any, q: Any, r: Any, t: Any) -> tuple[Any, Any]:
    m, n = a.shape[-2], a.shape[-1]
    if m >= n:
        return _qr_jvp_tall(q, r, t)
    dq, dr1 = _qr_jvp_tall(q, r[..., :, :m], t[..., :, :m])
    dr2 = torch.matmul(dq.mT, a[..., :, m:]) + torch.matmul(q.mT, t[..., :, m:])
    return dq, torch.cat([dr1, dr2], -1)


@register_vjp(torch.linalg.qr)
class LinalgQr:
    """linalg.qr(A, mode) -> (Q, R) (derivatives.yaml `linalg_qr`: linalg_qr_backward;
    Seeger et al. 2017).  m >= n: with M = gR R^T - Q^T gQ and N its upper triangle mirrored,
    gA = (gQ + Q N) R^{-T}.  m < n: A = [X | Y] with X = Q R1 square and R2 = Q^T Y, so
    gY = Q gR2 and X takes the square formula with gQ + Y gR2^T.  mode='r', and
    mode='complete' with m > n, are not differentiable (PyTorch raises likewise)."""

    def fwd(A, mode="reduced", *, out=None):
        res = torch.linalg.qr(A, mode)
        return res, (A, res[0], res[1], mode)

    def bwd(aux, d):
        a, q, r, mode = aux
        _qr_mode_check(mode, a.shape[-2], a.shape[-1])
        return (_qr_bwd(a, q, r, _first(d, 0), _first(d, 1)),)

    def jvp(primals, tangents):
        a, mode, _ = primals
        t = tangents[0]
        res = torch.linalg.qr(a, mode)
        if t is None:
            return res, (None, None)
        _qr_mode_check(mode, a.shape[-2], a.shape[-1])
        return res, _qr_jvp(a, res[0], res[1], t)

    def samples(dtype):
        yield (randn(4, 3, dtype=dtype),), {}
        yield (randn(2, 3, 5, dtype=dtype),), {}
        yield (randn(3, 3, dtype=dtype), "complete"), {}
        yield (randn(3, 4, dtype=dtype),), {"mode": "complete"}


@register_vjp(torch.qr)
class Qr:
    """qr(A, some) -> (Q, R) = linalg.qr(A, 'reduced' if some else 'complete'): as linalg.qr
    (derivatives.yaml `linalg_qr`)."""

    def fwd(input, some=True, *, out=None):
        res = torch.qr(input, some)
        return res, (input, res[0], res[1], "reduced" if some else "complete")

    def bwd(aux, d):
        a, q, r, mode = aux
        _qr_mode_check(mode, a.shape[-2], a.shape[-1])
        return (_qr_bwd(a, q, r, _first(d, 0), _first(d, 1)),)

    def jvp(primals, tangents):
        a, some, _ = primals
        t = tangents[0]
        res = torch.qr(a, some)
        if t is None:
            return res, (None, None)
        _qr_mode_check("reduced" if some else "complete", a.shape[-2], a.shape[-1])
        return res, _qr_jvp(a, res[0], res[1], t)

    def samples(dtype):
        yield (randn(4, 3, dtype=dtype),), {}
        yield (randn(3, 5, dtype=dtype), False), {}


# --- LU ---------------------------------------------------------------------------------------

def _linv_t(L: Any, x: Any) -> Any:
    """L^{-T} x for a unit lower triangular L."""
    return torch.linalg.solve_triangular(L.mT, x, upper=True, unitriangular=True)


def _x_uinv_t(x: Any, U: Any) -> Any:
    """x U^{-T} for an upper triangular U."""
    return torch.linalg.solve_triangular(U.mT, x, upper=False, left=False)


def _lu_bwd(P: Any, L: Any, U: Any, gL: Any, gU: Any, pivot: bool) -> Any:
    """Cotangent of A = P L U (L: m x k unit lower, U: k x n upper, k = min(m, n)).
    Square: gA = P L^{-T} [tril(L^T gL, -1) + triu(gU U^T)] U^{-T}.  Wide (m < n, U = [U1 | U2],
    U2 = L^{-1} P^T A2): gA = P L^{-T} [(tril(L^T gL - gU2 U2^T, -1) + triu(gU1 U1^T)) U1^{-T}
    | gU2].  Tall (m > n, L = [L1; L2], L2 = (P^T A)_2 U^{-1}):
    gA = P [L1^{-T} (tril(L1^T gL1, -1) + triu(gU U^T - L2^T gL2)) ; gL2] U^{-T}."""
    if gL is None and gU is None:
        return None
    m, n = L.shape[-2], U.shape[-1]
    if m <= n:
        U1 = U[..., :, :m]
        low = up = None
        if gL is not None:
            low = torch.matmul(L.mT, gL)
        if gU is not None:
            gU1 = gU[..., :, :m]
            up = torch.triu(torch.matmul(gU1, U1.mT))
            if m < n:
                low = _add(low, -torch.matmul(gU[..., :, m:], U[..., :, m:].mT))
        inner = _add(None if low is None else torch.tril(low, -1), up)
        g = _x_uinv_t(inner, U1)
        if m < n:
            g2 = gU[..., :, m:] if gU is not None else torch.zeros_like(U[..., :, m:])
            g = torch.cat([g, g2], -1)
        g = _linv_t(L, g)
    else:
        L1, L2 = L[..., :n, :], L[..., n:, :]
        low = up = None
        if gL is not None:
            low = torch.tril(torch.matmul(L1.mT, gL[..., :n, :]), -1)
            up = -torch.matmul(L2.mT, gL[..., n:, :])
        if gU is not None:
            up = _add(up, torch.matmul(gU, U.mT))
        inner = _add(low, None if up is None else torch.triu(up))
        g1 = _linv_t(L1, inner)
        g2 = gL[..., n:, :] if gL is not None else torch.zeros_like(L2)
        g = _x_uinv_t(torch.cat([g1, g2], -2), U)
    return torch.matmul(P, g) if pivot else g


def _lu_jvp(P: Any, L: Any, U: Any, t: Any, pivot: bool) -> tuple[Any, Any]:
    """(dL, dU) of A = P L U along t: with X = L1^{-1} (P^T t)_1 U1^{-1} on the leading square
    block, dL1 = L1 tril(X, -1), dU1 = triu(X) U1; wide: dU2 = L^{-1} ((P^T t)_2 - dL U2);
    tall: dL2 = ((P^T t)_2 - L2 dU) U^{-1}."""
    m, n = L.shape[-2], U.shape[-1]
    k = min(m, n)
    b = torch.matmul(P.mT, t) if pivot else t
    L1, U1 = L[..., :k, :], U[..., :, :k]
    x = torch.linalg.solve_triangular(L1, b[..., :k, :k], upper=False, unitriangular=True)
    x = torch.linalg.solve_triangular(U1, x, upper=True, left=False)
    dL = torch.matmul(L1, torch.tril(x, -1))
    dU = torch.matmul(torch.triu(x), U1)
    if m < n:
        r = b[..., :, k:] - torch.matmul(dL, U[..., :, k:])
        dU2 = torch.linalg.solve_triangular(L1, r, upper=False, unitriangular=True)
        dU = torch.cat([dU, dU2], -1)
    elif m > n:
        r = b[..., k:, :] - torch.matmul(L[..., k:, :], dU)
        dL2 = torch.linalg.solve_triangular(U1, r, upper=True, left=False)
        dL = torch.cat([dL, dL2], -2)
    return dL, dU


def _pad_to(x: Any, m: int, n: int) -> Any:
    dm, dn = m - x.shape[-2], n - x.shape[-1]
    return x if dm == 0 and dn == 0 else torch.nn.functional.pad(x, (0, dn, 0, dm))


def _lu_pack(dL: Any, dU: Any, m: int, n: int) -> Any:
    """Tangent of the packed LU matrix: strict lower part of dL plus upper part of dU."""
    return _pad_to(torch.tril(dL, -1), m, n) + _pad_to(torch.triu(dU), m, n)


def _lu_unpack_ct(gLU: Any) -> tuple[Any, Any]:
    """(gL, gU) from a cotangent of the packed LU matrix (m x n)."""
    m, n = gLU.shape[-2], gLU.shape[-1]
    k = min(m, n)
    return torch.tril(gLU, -1)[..., :, :k], torch.triu(gLU)[..., :k, :]


@register_vjp(torch.linalg.lu)
class LinalgLu:
    """linalg.lu(A, pivot) -> (P, L, U): linalg_lu_backward of derivatives.yaml `linalg_lu`
    (square, wide and tall cases; Seeger et al. 2017); P is piecewise constant."""

    def fwd(A, *, pivot=True, out=None):
        res = torch.linalg.lu(A, pivot=pivot)
        return res, (res[0], res[1], res[2], pivot)

    def bwd(aux, d):
        P, L, U, pivot = aux
        return (_lu_bwd(P, L, U, _first(d, 1), _first(d, 2), pivot),)

    def jvp(primals, tangents):
        a, pivot, _ = primals
        t = tangents[0]
        res = torch.linalg.lu(a, pivot=pivot)
        if t is None:
            return res, (None, None, None)
        dL, dU = _lu_jvp(res[0], res[1], res[2], t, pivot)
        return res, (None, dL, dU)

    def samples(dtype):
        yield (randn(3, 3, dtype=dtype),), {}
        yield (randn(2, 3, 5, dtype=dtype),), {}
        yield (randn(5, 3, dtype=dtype),), {}


def _lu_factor_bwd(aux: Any, gLU: Any) -> Any:
    LU, piv, pivot = aux
    if gLU is None:
        return None
    P, L, U = torch.lu_unpack(LU, piv)
    gL, gU = _lu_unpack_ct(gLU)
    return _lu_bwd(P, L, U, gL, gU, pivot)


def _lu_factor_tangent(LU: Any, piv: Any, t: Any, pivot: bool) -> Any:
    P, L, U = torch.lu_unpack(LU, piv)
    dL, dU = _lu_jvp(P, L, U, t, pivot)
    return _lu_pack(dL, dU, LU.shape[-2], LU.shape[-1])


@register_vjp(torch.linalg.lu_factor)
class LinalgLuFactor:
    """linalg.lu_factor(A, pivot) -> (LU, pivots): the packed factor's cotangent splits into
    gL = tril(gLU, -1), gU = triu(gLU), then linalg.lu's backward (derivatives.yaml
    `linalg_lu_factor_ex`: lu_factor_ex_backward)."""

    def fwd(A, *, pivot=True, out=None):
        res = torch.linalg.lu_factor(A, pivot=pivot)
        return res, (res[0], res[1], pivot)

    def bwd(aux, d):
        return (_lu_factor_bwd(aux, _first(d, 0)),)

    def jvp(primals, tangents):
        a, pivot, _ = primals
        t = tangents[0]
        res = torch.linalg.lu_factor(a, pivot=pivot)
        if t is None:
            return res, (None, None)
        return res, (_lu_factor_tangent(res[0], res[1], t, pivot), None)

    def samples(dtype):
        yield (randn(3, 3, dtype=dtype),), {}
        yield (randn(3, 5, dtype=dtype),), {}
        yield (randn(2, 5, 3, dtype=dtype),), {}


@register_vjp(torch.linalg.lu_factor_ex)
class LinalgLuFactorEx:
    """linalg.lu_factor_ex(A, pivot) -> (LU, pivots, info): as linalg.lu_factor
    (derivatives.yaml `linalg_lu_factor_ex`: lu_factor_ex_backward)."""

    def fwd(A, *, pivot=True, check_errors=False, out=None):
        res = torch.linalg.lu_factor_ex(A, pivot=pivot, check_errors=check_errors)
        return res, (res[0], res[1], pivot)

    def bwd(aux, d):
        return (_lu_factor_bwd(aux, _first(d, 0)),)

    def jvp(primals, tangents):
        a, pivot, check, _ = primals
        t = tangents[0]
        res = torch.linalg.lu_factor_ex(a, pivot=pivot, check_errors=check)
        if t is None:
            return res, (None, None, None)
        return res, (_lu_factor_tangent(res[0], res[1], t, pivot), None, None)

    def samples(dtype):
        yield (randn(4, 3, dtype=dtype),), {}


@register_vjp(torch.lu)
class Lu:
    """lu(A, pivot, get_infos) -> (LU, pivots[, infos]): as linalg.lu_factor
    (derivatives.yaml `linalg_lu_factor_ex`: lu_factor_ex_backward)."""

    def fwd(A, pivot=True, get_infos=False, out=None):
        res = torch.lu(A, pivot=pivot, get_infos=get_infos)
        return res, (res[0], res[1], pivot)

    def bwd(aux, d):
        return (_lu_factor_bwd(aux, _first(d, 0)),)

    def jvp(primals, tangents):
        a, pivot, infos, _ = primals
        t = tangents[0]
        res = torch.lu(a, pivot=pivot, get_infos=infos)
        rest = (None, None) if infos else (None,)
        if t is None:
            return res, (None,) + rest
        return res, (_lu_factor_tangent(res[0], res[1], t, pivot),) + rest

    def samples(dtype):
        yield (randn(3, 3, dtype=dtype),), {}
        yield (randn(2, 3, 4, dtype=dtype), True, True), {}


@register_vjp(torch.lu_unpack)
class LuUnpack:
    """lu_unpack(LU, pivots) -> (P, L, U): d_LU = tril(d_L, -1) + triu(d_U), each padded to
    LU's shape (derivatives.yaml `lu_unpack`: lu_unpack_backward); P is constant."""

    def fwd(LU_data, LU_pivots, unpack_data=True, unpack_pivots=True, *, out=None):
        res = torch.lu_unpack(LU_data, LU_pivots, unpack_data, unpack_pivots)
        return res, (tuple(LU_data.shape[-2:]), unpack_data)

    def bwd(aux, d):
        (m, n), data = aux
        gL, gU = _first(d, 1), _first(d, 2)
        if not data or (gL is None and gU is None):
            return None, None
        k = min(m, n)
        g = None
        if gL is not None:
            g = _pad_to(torch.tril(gL[..., :, :k], -1), m, n)
        if gU is not None:
            g = _add(g, _pad_to(torch.triu(gU[..., :k, :]), m, n))
        return g, None

    def jvp(primals, tangents):
        lu, piv, data, unpack_piv, _ = primals
        t = tangents[0]
        res = torch.lu_unpack(lu, piv, data, unpack_piv)
        if t is None or not data:
            return res, (None, None, None)
        dL, dU = _lu_unpack_ct(t)
        return res, (None, dL, dU)

    def samples(dtype):
        for shape in ((3, 3), (3, 5), (2, 5, 3)):
            lu, piv = torch.linalg.lu_factor(randn(*shape, dtype=dtype))
            yield (lu, piv), {}


# --- general eigendecomposition ---------------------------------------------------------------

def _real_if(g: Any, a: Any) -> Any:
    """The real part of a cotangent for a real input (complex-valued outputs of a real
    matrix), as PyTorch's handle_r_to_c."""
    return g if a.is_complex() else torch.real(g)


def _eig_bwd(a: Any, w: Any, v: Any, gw: Any, gv: Any) -> Any:
    """gA = V^{-H} (diag(gL) + P / conj(E)) V^H, E_ij = L_j - L_i (diagonal 1), where
    P = V^H gV - V^H V Re(diag(V^H gV)) projects out the normalization of V's columns
    (real part for a real A)."""
    vh = v.mH
    inner = None
    if gv is not None:
        k = torch.matmul(vh, gv)
        dk = torch.real(torch.diagonal(k, 0, -2, -1))
        k = k - torch.matmul(vh, v * torch.unsqueeze(dk, -2))
        eye = _eye(w.shape[-1], w)
        e = torch.conj(torch.unsqueeze(w, -2) - torch.unsqueeze(w, -1)) * (1 - eye) + eye
        inner = k / e
    if gw is not None:
        inner = _add(inner, torch.diag_embed(gw.to(w.dtype)))
    if inner is None:
        return None
    return _real_if(torch.linalg.solve(vh, torch.matmul(inner, vh)), a)


@register_vjp(torch.linalg.eigvals)
class LinalgEigvals:
    """linalg.eigvals(A) = L: d_A = V^{-H} diag(d) V^H (real part for a real A); JVP:
    dL = diag(V^{-1} t V) (derivatives.yaml `linalg_eig` with only gL: linalg_eig_backward)."""

    def fwd(A, *, out=None):
        return torch.linalg.eigvals(A), A

    def bwd(aux, d):
        w, v = torch.linalg.eig(aux)
        return (_eig_bwd(aux, w, v, d, None),)

    def jvp(primals, tangents):
        a, t = primals[0], tangents[0]
        w, v = torch.linalg.eig(a)
        if t is None:
            return w, None
        p = torch.linalg.solve(v, torch.matmul(t.to(v.dtype), v))
        return w, torch.diagonal(p, 0, -2, -1)

    # no samples: the output is complex, and fxad.check draws cotangents for real outputs
    # only; the OpInfo sweep checks it against autograd


@register_vjp(torch.linalg.eig)
class LinalgEig:
    """linalg.eig(A) -> (L, V) (columns of V of unit norm): derivatives.yaml `linalg_eig`:
    linalg_eig_backward, gA = V^{-H} (diag(gL) + P / conj(E)) V^H with E_ij = L_j - L_i and
    P = V^H gV - V^H V Re(diag(V^H gV)); real part for a real A.  Only losses invariant under
    V -> V e^{i phi} have a gradient (PyTorch checks this at run time; this rule does not).
    JVP: dP = V^{-1} t V, dL = diag(dP), dV = V (dP / E) (zero diagonal) minus
    V Re(diag(V^H dV)) to keep the columns' norms."""

    def fwd(A, *, out=None):
        res = torch.linalg.eig(A)
        return res, (A, res[0], res[1])

    def bwd(aux, d):
        a, w, v = aux
        return (_eig_bwd(a, w, v, _first(d, 0), _first(d, 1)),)

    def jvp(primals, tangents):
        a, t = primals[0], tangents[0]
        res = torch.linalg.eig(a)
        if t is None:
            return res, (None, None)
        w, v = res[0], res[1]
        p = torch.linalg.solve(v, torch.matmul(t.to(v.dtype), v))
        e = torch.unsqueeze(w, -2) - torch.unsqueeze(w, -1)
        dv = torch.matmul(v, p * _offdiag_inv(e))
        dv = dv - v * torch.unsqueeze(torch.real(torch.sum(torch.conj(v) * dv, -2)), -2)
        return res, (torch.diagonal(p, 0, -2, -1), dv)

    # no samples: a random cotangent of V is not invariant under V -> V e^{i phi}, so the
    # VJP is not defined for it (PyTorch raises); checked on invariant losses separately


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


@register_vjp(torch.linalg.householder_product)
@register_vjp(torch.orgqr)
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


@register_vjp(torch.ormqr)
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
