"""Rules for linear solvers and inverses: ``linalg.solve``/``solve_ex``,
``linalg.solve_triangular``, ``triangular_solve``, ``cholesky_solve``, ``cholesky_inverse``,
``linalg.lu_solve``/``lu_solve``, ``linalg.inv``/``inv_ex``, ``linalg.pinv``/``pinverse``,
``linalg.tensorinv``, ``linalg.tensorsolve``.

Real inputs are assumed (OpInfo sweeps differentiate float tensors).  For ``X = A^-1 B``:
d_B = A^-T G, d_A = -d_B X^T (derivatives.yaml ``linalg_solve``), written with the same
solver; the Cholesky and LU forms follow M. Seeger et al., "Auto-differentiating linear
algebra" (2017), and the pseudo-inverse Golub & Pereyra (1973).  Entry of derivatives.yaml
named in each rule.
"""
from __future__ import annotations

from typing import Any

import torch

from .._base import randn, _add
from ..registry import register_vjp
from ._common import _first


@register_vjp(torch.linalg.inv)
class Inv:
    """linalg.inv(A) = B: d_A = -B^T d B^T (derivatives.yaml `linalg_inv_ex`)."""

    def fwd(A, *, out=None):
        b = torch.linalg.inv(A)
        return b, b

    def bwd(aux, d):
        bt = aux.mT
        return (-torch.matmul(torch.matmul(bt, d), bt),)

    def jvp(primals, tangents):
        a, _ = primals
        b = torch.linalg.inv(a)
        t = tangents[0]
        return b, (None if t is None else -torch.matmul(torch.matmul(b, t), b))

    def samples(dtype):
        yield (randn(3, 3, dtype=dtype),), {}
        yield (randn(2, 3, 3, dtype=dtype),), {}


@register_vjp(torch.linalg.inv_ex)
class InvEx:
    """linalg.inv_ex(A) -> (B, info): d_A = -B^T d_B B^T (derivatives.yaml `linalg_inv_ex`)."""

    def fwd(A, *, check_errors=False, out=None):
        res = torch.linalg.inv_ex(A, check_errors=check_errors)
        return res, res[0]

    def bwd(aux, d):
        d = d[0] if isinstance(d, (tuple, list)) else d
        if d is None:
            return (None,)
        bt = aux.mT
        return (-torch.matmul(torch.matmul(bt, d), bt),)

    def samples(dtype):
        yield (randn(3, 3, dtype=dtype),), {}


def _solve_bwd(a: Any, b: Any, x: Any, left: bool, d: Any) -> tuple[Any, Any]:
    vec = b.dim() == 1 or (b.dim() == a.dim() - 1 and tuple(b.shape) == tuple(a.shape[:-1]))
    if vec:
        d_b = torch.linalg.solve(a.mT, d)
        d_a = -torch.unsqueeze(d_b, -1) * torch.unsqueeze(x, -2)
        return d_a, d_b
    if left:
        d_b = torch.linalg.solve(a.mT, d)
        return -torch.matmul(d_b, x.mT), d_b
    d_b = torch.linalg.solve(a.mT, d, left=False)
    return -torch.matmul(x.mT, d_b), d_b


@register_vjp(torch.linalg.solve)
class Solve:
    """linalg.solve(A, B) = X (A X = B; left=False: X A = B): d_B = A^{-T} d (d A^{-T}),
    d_A = -d_B X^T (-X^T d_B) (derivatives.yaml `_linalg_solve_ex`:
    linalg_solve_backward)."""

    def fwd(A, B, *, left=True, out=None):
        x = torch.linalg.solve(A, B) if left else torch.linalg.solve(A, B, left=False)
        return x, (A, B, x, left)

    def bwd(aux, d):
        return _solve_bwd(*aux[:3], aux[3], d)

    def samples(dtype):
        yield (randn(3, 3, dtype=dtype), randn(3, 2, dtype=dtype)), {}
        yield (randn(3, 3, dtype=dtype), randn(3, dtype=dtype)), {}
        yield (randn(2, 3, 3, dtype=dtype), randn(2, 4, 3, dtype=dtype)), {"left": False}


@register_vjp(torch.linalg.solve_ex)
class SolveEx:
    """linalg.solve_ex(A, B) -> (X, info): as linalg.solve (derivatives.yaml
    `_linalg_solve_ex`)."""

    def fwd(A, B, *, left=True, check_errors=False, out=None):
        res = torch.linalg.solve_ex(A, B, left=left, check_errors=check_errors)
        return res, (A, B, res[0], left)

    def bwd(aux, d):
        d = d[0] if isinstance(d, (tuple, list)) else d
        if d is None:
            return None, None
        return _solve_bwd(*aux[:3], aux[3], d)

    def samples(dtype):
        yield (randn(3, 3, dtype=dtype), randn(3, 2, dtype=dtype)), {}


@register_vjp(torch.linalg.solve_triangular)
class SolveTriangular:
    """linalg.solve_triangular(A, B, upper, left, unitriangular) = X: d_B = solve_triangular(
    A^T, d, !upper), d_A = -d_B X^T (left) or -X^T d_B (right), restricted to A's triangle
    (strict when unitriangular) (derivatives.yaml `linalg_solve_triangular`)."""

    def fwd(A, B, *, upper, left=True, unitriangular=False, out=None):
        x = torch.linalg.solve_triangular(A, B, upper=upper, left=left,
                                          unitriangular=unitriangular)
        return x, (A, x, upper, left, unitriangular)

    def bwd(aux, d):
        a, x, upper, left, unit = aux
        d_b = torch.linalg.solve_triangular(a.mT, d, upper=not upper, left=left,
                                            unitriangular=unit)
        g = -torch.matmul(d_b, x.mT) if left else -torch.matmul(x.mT, d_b)
        k = 1 if unit else 0
        g = torch.triu(g, k) if upper else torch.tril(g, -k)
        return g, d_b

    def samples(dtype):
        a = randn(3, 3, dtype=dtype) + 3 * torch.eye(3, dtype=dtype)
        yield (a, randn(3, 2, dtype=dtype)), {"upper": True}
        yield (a, randn(2, 3, dtype=dtype)), {"upper": False, "left": False}
        yield (a, randn(3, 2, dtype=dtype)), {"upper": False, "unitriangular": True}


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


@register_vjp(torch.cholesky_solve)
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


@register_vjp(torch.cholesky_inverse)
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


@register_vjp(torch.triangular_solve)
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


@register_vjp(torch.linalg.lu_solve)
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


@register_vjp(torch.lu_solve)
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


@register_vjp(torch.linalg.pinv)
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


@register_vjp(torch.pinverse)
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


# --- tensor inverse and solve -----------------------------------------------------------------

@register_vjp(torch.linalg.tensorinv)
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


@register_vjp(torch.linalg.tensorsolve)
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
