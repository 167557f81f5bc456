"""Matrix decompositions and the functions built on them: ``cholesky_solve``,
``cholesky_inverse``, ``triangular_solve``, ``linalg.eigh``, ``linalg.eig``,
``linalg.eigvals``, ``linalg.svd``/``svd``, ``linalg.qr``/``qr``, ``matrix_exp``,
``linalg.lu``, ``linalg.lu_factor``/``lu_factor_ex``/``lu``, ``lu_unpack``,
``linalg.lu_solve``/``lu_solve``, ``linalg.pinv``/``pinverse``, ``linalg.cond``,
``linalg.tensorinv``, ``linalg.tensorsolve``.

Real inputs are assumed (OpInfo sweeps differentiate float tensors).  Formulas follow PyTorch's
``tools/autograd/derivatives.yaml`` (entry named in each rule) and the papers behind them:
M. Seeger et al., "Auto-differentiating linear algebra" (2017) for Cholesky/LU/QR,
M. Giles, "An extended collection of matrix derivative results for forward and reverse mode
AD" (2008) for eigen- and singular value decompositions, Golub & Pereyra (1973) for the
pseudo-inverse, and Najfeld & Havel (1995) / Al-Mohy & Higham (2009) for the block-matrix
formula of the Fréchet derivative of ``matrix_exp``.  Gauge conventions (eigenvector signs,
the extra columns of full SVD factors) follow PyTorch's backward formulas, so cotangents
match autograd's exactly.
"""
from __future__ import annotations

from typing import Any

import torch

from ._base import builtin, randn
from .extra_reductions import _matrix_norm_bwd


def _first(d: Any, i: int) -> Any:
    """Entry ``i`` of a tuple cotangent (``None`` when absent)."""
    if isinstance(d, (tuple, list)):
        return d[i] if i < len(d) else None
    return d if i == 0 else None


def _add(a: Any, b: Any) -> Any:
    if a is None:
        return b
    if b is None:
        return a
    return a + b


def _eye(n: int, like: Any) -> Any:
    return torch.eye(n, dtype=like.dtype, device=like.device)


def _spd(n: int, dtype: torch.dtype, *batch: int) -> torch.Tensor:
    a = randn(*batch, n, n, dtype=dtype)
    return a @ a.mT + n * torch.eye(n, dtype=dtype)


def _tri(n: int, dtype: torch.dtype, upper: bool, *batch: int) -> torch.Tensor:
    a = randn(*batch, n, n, dtype=dtype) + 3 * torch.eye(n, dtype=dtype)
    return torch.triu(a) if upper else torch.tril(a)


# --- Cholesky-based solves --------------------------------------------------------------------

def _chol_dA(L: Any, dL: Any, upper: bool) -> Any:
    """dA of A = L L^T (upper: U^T U)."""
    if upper:
        p = torch.matmul(dL.mT, L)
    else:
        p = torch.matmul(dL, L.mT)
    return p + p.mT


def _chol_gL(L: Any, m: Any, upper: bool) -> Any:
    """Cotangent of the factor given M with <M, dA>: -(M + M^T) L (upper: -U (M + M^T))."""
    s = m + m.mT
    return -torch.matmul(L, s) if upper else -torch.matmul(s, L)


@builtin(torch.cholesky_solve)
class CholeskySolve:
    """cholesky_solve(B, L, upper) = X = (L L^T)^{-1} B (upper: (U^T U)^{-1} B):
    d_B = cholesky_solve(d, L), d_L = -(M + M^T) L with M = d_B X^T (upper: -U (M + M^T));
    the factor's full matrix gets a cotangent, as in derivatives.yaml `cholesky_solve`
    (cholesky_solve_backward)."""

    def fwd(input, input2, upper=False, *, out=None):
        x = torch.cholesky_solve(input, input2, upper)
        return x, (input2, x, upper)

    def bwd(aux, d):
        L, x, upper = aux
        d_b = torch.cholesky_solve(d, L, upper)
        return d_b, _chol_gL(L, torch.matmul(d_b, x.mT), upper)

    def jvp(primals, tangents):
        b, L, upper, _ = primals
        tb, tL = tangents[0], tangents[1]
        x = torch.cholesky_solve(b, L, upper)
        rhs = tb
        if tL is not None:
            rhs = _add(rhs, -torch.matmul(_chol_dA(L, tL, upper), x))
        return x, (None if rhs is None else torch.cholesky_solve(rhs, L, upper))

    # no samples: the op reads one triangle of the factor while the cotangent (as PyTorch's)
    # covers the full matrix, so central differences cannot match; the OpInfo sweep checks it


@builtin(torch.cholesky_inverse)
class CholeskyInverse:
    """cholesky_inverse(L, upper) = Y = (L L^T)^{-1} (upper: (U^T U)^{-1}):
    d_L = -(M + M^T) L with M = Y d Y (upper: -U (M + M^T)) (derivatives.yaml
    `cholesky_inverse`: cholesky_inverse_backward)."""

    def fwd(input, upper=False, *, out=None):
        y = torch.cholesky_inverse(input, upper)
        return y, (input, y, upper)

    def bwd(aux, d):
        L, y, upper = aux
        return (_chol_gL(L, torch.matmul(torch.matmul(y, d), y), upper),)

    def jvp(primals, tangents):
        L, upper, _ = primals
        t = tangents[0]
        y = torch.cholesky_inverse(L, upper)
        if t is None:
            return y, None
        return y, -torch.matmul(torch.matmul(y, _chol_dA(L, t, upper)), y)

    # no samples: the op reads one triangle of the factor while the cotangent (as PyTorch's)
    # covers the full matrix, so central differences cannot match; the OpInfo sweep checks it


def _tri_mask(x: Any, upper: bool, unit: bool) -> Any:
    k = 1 if unit else 0
    return torch.triu(x, k) if upper else torch.tril(x, -k)


@builtin(torch.triangular_solve)
class TriangularSolve:
    """triangular_solve(b, A, upper, transpose, unitriangular) -> (X, A.clone()) with
    op(A) X = b: d_b = op(A)^{-T} d_X, d_A = -d_b X^T (transpose: -X d_b^T) restricted to
    A's triangle (strict when unitriangular), plus the clone's cotangent (derivatives.yaml
    `triangular_solve`: triangular_solve_backward)."""

    def fwd(input, A, upper=True, transpose=False, unitriangular=False, *, out=None):
        res = torch.triangular_solve(input, A, upper, transpose, unitriangular)
        return res, (A, res[0], upper, transpose, unitriangular)

    def bwd(aux, d):
        A, x, upper, trans, unit = aux
        gx, gm = _first(d, 0), _first(d, 1)
        g_b = g_a = None
        if gx is not None:
            g_b = torch.triangular_solve(gx, A, upper, not trans, unit)[0]
            g_a = -torch.matmul(x, g_b.mT) if trans else -torch.matmul(g_b, x.mT)
            g_a = _tri_mask(g_a, upper, unit)
        return g_b, _add(g_a, gm)

    def jvp(primals, tangents):
        b, A, upper, trans, unit, _ = primals
        tb, tA = tangents[0], tangents[1]
        res = torch.triangular_solve(b, A, upper, trans, unit)
        x = res[0]
        rhs = tb
        if tA is not None:
            ta = _tri_mask(tA, upper, unit)
            rhs = _add(rhs, -torch.matmul(ta.mT if trans else ta, x))
        tx = None if rhs is None else torch.triangular_solve(rhs, A, upper, trans, unit)[0]
        return res, (tx, tA)

    def samples(dtype):
        yield (randn(3, 2, dtype=dtype), _tri(3, dtype, True)), {}
        yield (randn(3, 2, dtype=dtype), _tri(3, dtype, False), False, True), {}
        yield (randn(2, 3, 1, dtype=dtype), _tri(3, dtype, True, 2)), \
            {"transpose": False, "unitriangular": True}


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


@builtin(torch.linalg.eigh)
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


@builtin(torch.linalg.svd)
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


@builtin(torch.svd)
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


@builtin(torch.linalg.qr)
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


@builtin(torch.qr)
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


# --- matrix exponential ---------------------------------------------------------------------

def _block_expm(a: Any, t: Any) -> Any:
    """Upper-right block of matrix_exp([[a, t], [0, a]]) = the Fréchet derivative L(a, t)."""
    n = a.shape[-1]
    top = torch.cat([a, t], -1)
    bottom = torch.cat([torch.zeros_like(a), a], -1)
    e = torch.matrix_exp(torch.cat([top, bottom], -2))
    return e[..., :n, n:]


@builtin(torch.matrix_exp)
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


@builtin(torch.linalg.matrix_exp)
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


@builtin(torch.linalg.lu)
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


@builtin(torch.linalg.lu_factor)
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


@builtin(torch.linalg.lu_factor_ex)
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


@builtin(torch.lu)
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


@builtin(torch.lu_unpack)
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


def _lu_solve_ga(x: Any, gb: Any, left: bool, adjoint: bool) -> Any:
    """Cotangent of A in op(A) X = B (left) or X op(A) = B (right), op = transpose when
    adjoint, given gB = op(A)^{-T} gX (left) or gX op(A)^{-T} (right)."""
    if left:
        return -torch.matmul(x, gb.mT) if adjoint else -torch.matmul(gb, x.mT)
    return -torch.matmul(gb.mT, x) if adjoint else -torch.matmul(x.mT, gb)


def _lu_solve_dx(LU: Any, piv: Any, x: Any, tLU: Any, tB: Any, left: bool,
                 adjoint: bool) -> Any:
    rhs = tB
    if tLU is not None:
        P, L, U = torch.lu_unpack(LU, piv)
        da = torch.matmul(P, torch.matmul(torch.tril(tLU, -1), U) +
                          torch.matmul(L, torch.triu(tLU)))
        if adjoint:
            da = da.mT
        rhs = _add(rhs, -(torch.matmul(da, x) if left else torch.matmul(x, da)))
    if rhs is None:
        return None
    return torch.linalg.lu_solve(LU, piv, rhs, left=left, adjoint=adjoint)


def _lu_solve_bwd(LU: Any, piv: Any, x: Any, d: Any, left: bool, adjoint: bool) -> tuple:
    """(gLU, gB): gB = lu_solve(LU, d, adjoint=not adjoint); gA as for linalg.solve, mapped to
    the packed factor through A = P L U: gLU = tril(P^T gA U^T, -1) + triu(L^T P^T gA)."""
    gb = torch.linalg.lu_solve(LU, piv, d, left=left, adjoint=not adjoint)
    ga = _lu_solve_ga(x, gb, left, adjoint)
    P, L, U = torch.lu_unpack(LU, piv)
    pga = torch.matmul(P.mT, ga)
    g_lu = torch.tril(torch.matmul(pga, U.mT), -1) + torch.triu(torch.matmul(L.mT, pga))
    return g_lu, gb


@builtin(torch.linalg.lu_solve)
class LinalgLuSolve:
    """linalg.lu_solve(LU, pivots, B, left, adjoint) = X: d_B = lu_solve(LU, d, adjoint=not
    adjoint); d_A as for linalg.solve, pulled back to the packed factor through
    A = P L U (derivatives.yaml `linalg_lu_solve`: linalg_lu_solve_LU)."""

    def fwd(LU, pivots, B, *, left=True, adjoint=False, out=None):
        x = torch.linalg.lu_solve(LU, pivots, B, left=left, adjoint=adjoint)
        return x, (LU, pivots, x, left, adjoint)

    def bwd(aux, d):
        LU, piv, x, left, adjoint = aux
        g_lu, gb = _lu_solve_bwd(LU, piv, x, d, left, adjoint)
        return g_lu, None, gb

    def jvp(primals, tangents):
        LU, piv, B, left, adjoint, _ = primals
        x = torch.linalg.lu_solve(LU, piv, B, left=left, adjoint=adjoint)
        return x, _lu_solve_dx(LU, piv, x, tangents[0], tangents[2], left, adjoint)

    def samples(dtype):
        lu, piv = torch.linalg.lu_factor(randn(3, 3, dtype=dtype))
        yield (lu, piv, randn(3, 2, dtype=dtype)), {}
        yield (lu, piv, randn(2, 3, dtype=dtype)), {"left": False}
        yield (lu, piv, randn(3, 2, dtype=dtype)), {"adjoint": True}
        yield (lu, piv, randn(2, 2, 3, dtype=dtype)), {"left": False, "adjoint": True}


@builtin(torch.lu_solve)
class LuSolve:
    """lu_solve(b, LU, pivots) = linalg.lu_solve(LU, pivots, b) (derivatives.yaml
    `linalg_lu_solve`)."""

    def fwd(input, LU_data, LU_pivots, *, out=None):
        x = torch.lu_solve(input, LU_data, LU_pivots)
        return x, (LU_data, LU_pivots, x)

    def bwd(aux, d):
        LU, piv, x = aux
        g_lu, gb = _lu_solve_bwd(LU, piv, x, d, True, False)
        return gb, g_lu, None

    def jvp(primals, tangents):
        b, LU, piv, _ = primals
        x = torch.lu_solve(b, LU, piv)
        return x, _lu_solve_dx(LU, piv, x, tangents[1], tangents[0], True, False)

    def samples(dtype):
        lu, piv = torch.linalg.lu_factor(randn(3, 3, dtype=dtype))
        yield (randn(3, 2, dtype=dtype), lu, piv), {}
        lu, piv = torch.linalg.lu_factor(randn(2, 3, 3, dtype=dtype))
        yield (randn(2, 3, 1, dtype=dtype), lu, piv), {}


# --- pseudo-inverse ---------------------------------------------------------------------------

def _pinv_bwd(a: Any, x: Any, g: Any) -> Any:
    """X = A^+: gA = -X^T G X^T + (I - A X) G^T X X^T + X^T X G^T (I - X A)
    (Golub & Pereyra 1973; derivatives.yaml `linalg_pinv`: pinv_backward)."""
    gt = g.mT
    xxt = torch.matmul(x, x.mT)
    xtx = torch.matmul(x.mT, x)
    t1 = -torch.matmul(torch.matmul(x.mT, g), x.mT)
    t2 = torch.matmul(gt, xxt)
    t2 = t2 - torch.matmul(a, torch.matmul(x, t2))
    t3 = torch.matmul(xtx, gt)
    t3 = t3 - torch.matmul(torch.matmul(t3, x), a)
    return t1 + t2 + t3


def _pinv_jvp(a: Any, x: Any, t: Any) -> Any:
    """dX = -X T X + X X^T T^T (I - A X) + (I - X A) T^T X^T X."""
    tt = t.mT
    t1 = -torch.matmul(torch.matmul(x, t), x)
    t2 = torch.matmul(torch.matmul(x, x.mT), tt)
    t2 = t2 - torch.matmul(torch.matmul(t2, a), x)
    t3 = torch.matmul(tt, torch.matmul(x.mT, x))
    t3 = t3 - torch.matmul(x, torch.matmul(a, t3))
    return t1 + t2 + t3


@builtin(torch.linalg.pinv)
class LinalgPinv:
    """linalg.pinv(A, atol, rtol, hermitian) = X: gA = -X^T d X^T + (I - A X) d^T X X^T +
    X^T X d^T (I - X A) at the rank the tolerances select (Golub & Pereyra 1973;
    derivatives.yaml `linalg_pinv`: pinv_backward); the tolerances are not differentiated."""

    def fwd(A, *args, **kwargs):
        x = torch.linalg.pinv(A, *args, **kwargs)
        return x, (A, x)

    def bwd(aux, d):
        a, x = aux
        return (_pinv_bwd(a, x, d),)

    def jvp(primals, tangents):
        a, args, kwargs = primals[0], primals[1:-1], primals[-1]
        t = tangents[0]
        x = torch.linalg.pinv(a, *args, **kwargs)
        return x, (None if t is None else _pinv_jvp(a, x, t))

    def samples(dtype):
        yield (randn(3, 3, dtype=dtype),), {}
        yield (randn(2, 4, 3, dtype=dtype),), {}
        yield (randn(3, 5, dtype=dtype),), {"rtol": 1e-10}


@builtin(torch.pinverse)
class Pinverse:
    """pinverse(A, rcond) = linalg.pinv(A, rtol=rcond): as linalg.pinv (derivatives.yaml
    `linalg_pinv`: pinv_backward)."""

    def fwd(input, rcond=1e-15):
        x = torch.pinverse(input, rcond)
        return x, (input, x)

    bwd = LinalgPinv.bwd

    def jvp(primals, tangents):
        a, rcond = primals
        t = tangents[0]
        x = torch.pinverse(a, rcond)
        return x, (None if t is None else _pinv_jvp(a, x, t))

    def samples(dtype):
        yield (randn(3, 4, dtype=dtype),), {}
        yield (randn(2, 3, 3, dtype=dtype), 1e-10), {}


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


@builtin(torch.linalg.cond)
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


# --- tensor inverse and solve -----------------------------------------------------------------

@builtin(torch.linalg.tensorinv)
class LinalgTensorinv:
    """linalg.tensorinv(A, ind) = inv(A as a p x p matrix) reshaped: the matrix inverse's
    backward -B^T d B^T on the reshaped cotangent (derivatives.yaml: composite of `reshape`
    and `linalg_inv_ex`)."""

    def fwd(A, ind=2, *, out=None):
        out_ = torch.linalg.tensorinv(A, ind)
        p = 1
        for s in A.shape[:ind]:
            p *= s
        b = torch.reshape(out_, (-1, p))
        return out_, (b, tuple(A.shape))

    def bwd(aux, d):
        b, shape = aux
        g = torch.reshape(d, tuple(b.shape))
        return (torch.reshape(-torch.matmul(torch.matmul(b.mT, g), b.mT), shape),)

    def jvp(primals, tangents):
        a, ind, _ = primals
        t = tangents[0]
        out_ = torch.linalg.tensorinv(a, ind)
        if t is None:
            return out_, None
        p = 1
        for s in a.shape[:ind]:
            p *= s
        b = torch.reshape(out_, (-1, p))
        dm = torch.reshape(t, (p, -1))
        return out_, torch.reshape(-torch.matmul(torch.matmul(b, dm), b), tuple(out_.shape))

    def samples(dtype):
        yield (randn(2, 3, 6, dtype=dtype) + 0,), {"ind": 2}
        yield (randn(4, 2, 2, dtype=dtype), 1), {}


def _tensorsolve_setup(a: Any, b: Any, dims: Any) -> tuple[Any, Any]:
    """(A with dims moved to the end, the destination positions)."""
    if dims is None:
        return a, None
    dims = [dims] if isinstance(dims, int) else list(dims)
    dest = list(range(a.dim() - len(dims), a.dim()))
    return torch.movedim(a, dims, dest), (dims, dest)


@builtin(torch.linalg.tensorsolve)
class LinalgTensorsolve:
    """linalg.tensorsolve(A, B, dims) = X with tensordot(A, X, X.ndim) = B: with A2 the
    (B.numel() x X.numel()) matrix of A (dims moved to the end), d_B = A2^{-T} vec(d),
    d_A2 = -d_B vec(X)^T (derivatives.yaml: composite of `movedim`, `reshape` and
    `linalg_solve`: linalg_solve_backward)."""

    def fwd(A, B, dims=None, *, out=None):
        x = torch.linalg.tensorsolve(A, B, dims)
        return x, (A, B, x, dims)

    def bwd(aux, d):
        a, b, x, dims = aux
        am, move = _tensorsolve_setup(a, b, dims)
        a2 = torch.reshape(am, (b.numel(), -1))
        gb = torch.linalg.solve(a2.mT, torch.reshape(d, (-1,)))
        ga = torch.reshape(-torch.outer(gb, torch.reshape(x, (-1,))), tuple(am.shape))
        if move is not None:
            ga = torch.movedim(ga, move[1], move[0])
        return ga, torch.reshape(gb, tuple(b.shape))

    def jvp(primals, tangents):
        a, b, dims, _ = primals
        ta, tb = tangents[0], tangents[1]
        x = torch.linalg.tensorsolve(a, b, dims)
        am, _ = _tensorsolve_setup(a, b, dims)
        a2 = torch.reshape(am, (b.numel(), -1))
        xf = torch.reshape(x, (-1,))
        rhs = None if tb is None else torch.reshape(tb, (-1,))
        if ta is not None:
            tam, _ = _tensorsolve_setup(ta, b, dims)
            rhs = _add(rhs, -torch.mv(torch.reshape(tam, (b.numel(), -1)), xf))
        if rhs is None:
            return x, None
        return x, torch.reshape(torch.linalg.solve(a2, rhs), tuple(x.shape))

    def samples(dtype):
        yield (randn(2, 3, 6, dtype=dtype), randn(2, 3, dtype=dtype)), {}
        yield (randn(2, 3, 6, dtype=dtype), randn(2, 3, dtype=dtype)), {"dims": (0, 2)}
        yield (randn(3, 4, 4, 3, dtype=dtype), randn(3, 4, dtype=dtype), (0, 2)), {}


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


@builtin(torch.linalg.eigvals)
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


@builtin(torch.linalg.eig)
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
