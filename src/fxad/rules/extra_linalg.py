"""More linear algebra: products (``dot``, ``vdot``, ``mv``, ``addmv``, ``addr``, ``outer``,
``inner``, ``addbmm``, ``baddbmm``, ``kron``, ``tensordot``, ``einsum``, ``linalg.vecdot``,
``linalg.multi_dot``), ``trace``, ``cross``, and matrix functions (``linalg.det``,
``slogdet``, ``logdet``, ``inv``, ``solve``, ``solve_triangular``, ``cholesky``,
``matrix_power``).

Real inputs are assumed (OpInfo sweeps differentiate float tensors); formulas follow
PyTorch's ``tools/autograd/derivatives.yaml``, entry named in each rule.  Products'
cotangents are written with the same products (matmul, einsum, tensordot), matrix functions'
with ``linalg.solve``/``inv``.
"""
from __future__ import annotations

import string
from typing import Any

import torch

from ._base import conj, builtin, randn
from .registry import add_rule


def _is_t(x: Any) -> bool:
    return isinstance(x, torch.Tensor) or hasattr(x, "node")


def _mul(d: Any, s: Any) -> Any:
    return d if (not _is_t(s) and s == 1) else d * s


def _spd(n: int, dtype: torch.dtype, *batch: int) -> torch.Tensor:
    a = randn(*batch, n, n, dtype=dtype)
    return a @ a.mT + n * torch.eye(n, dtype=dtype)


class Dot:
    """dot(a, b) = sum(a b) (vdot: conj(a) b, equal for real inputs): d_a = d b, d_b = d a
    (derivatives.yaml `dot`, `vdot`)."""

    def bwd(aux, d):
        a, b = aux
        return d * b, d * a


for _op in (torch.dot, torch.vdot):
    def _dot_fwd(input, tensor, _op=_op):
        return _op(input, tensor), (input, tensor)

    def _dot_samples(dtype):
        yield (randn(5, dtype=dtype), randn(5, dtype=dtype)), {}

    add_rule(_op, _dot_fwd, Dot.bwd, samples=_dot_samples, source=Dot.__doc__, builtin=True)


@builtin(torch.mv)
class Mv:
    """mv(A, v): d_A = outer(d, v), d_v = A^T d (derivatives.yaml `mv`)."""

    def fwd(input, vec):
        return torch.mv(input, vec), (input, vec)

    def bwd(aux, d):
        a, v = aux
        return torch.outer(d, v), torch.mv(a.mT, d)

    def samples(dtype):
        yield (randn(3, 4, dtype=dtype), randn(4, dtype=dtype)), {}


@builtin(torch.addmv)
class Addmv:
    """addmv(x, A, v, beta, alpha) = beta x + alpha A v: d_x = beta d, d_A = alpha outer(d, v),
    d_v = alpha A^T d (derivatives.yaml `addmv`)."""

    def fwd(input, mat, vec, *, beta=1, alpha=1):
        return torch.addmv(input, mat, vec, beta=beta, alpha=alpha), (mat, vec, beta, alpha)

    def bwd(aux, d):
        a, v, beta, alpha = aux
        da = _mul(d, alpha)
        return _mul(d, beta), torch.outer(da, v), torch.mv(a.mT, da)

    def samples(dtype):
        yield (randn(3, dtype=dtype), randn(3, 4, dtype=dtype), randn(4, dtype=dtype)), {}
        yield (randn(1, dtype=dtype), randn(3, 4, dtype=dtype), randn(4, dtype=dtype)), \
            {"beta": 0.5, "alpha": 2.0}


@builtin(torch.addr)
class Addr:
    """addr(x, u, v, beta, alpha) = beta x + alpha outer(u, v): d_x = beta d,
    d_u = alpha d v, d_v = alpha d^T u (derivatives.yaml `addr`)."""

    def fwd(input, vec1, vec2, *, beta=1, alpha=1):
        return torch.addr(input, vec1, vec2, beta=beta, alpha=alpha), (vec1, vec2, beta, alpha)

    def bwd(aux, d):
        u, v, beta, alpha = aux
        da = _mul(d, alpha)
        return _mul(d, beta), torch.mv(da, v), torch.mv(da.mT, u)

    def samples(dtype):
        yield (randn(3, 4, dtype=dtype), randn(3, dtype=dtype), randn(4, dtype=dtype)), {}
        yield (randn(4, dtype=dtype), randn(3, dtype=dtype), randn(4, dtype=dtype)), \
            {"beta": 0.5, "alpha": 2.0}


@builtin(torch.outer, torch.ger)
class Outer:
    """outer(u, v): d_u = d v, d_v = d^T u (derivatives.yaml via `mul`)."""

    def fwd(input, vec2):
        return torch.outer(input, vec2), (input, vec2)

    def bwd(aux, d):
        u, v = aux
        return torch.mv(d, v), torch.mv(d.mT, u)

    def samples(dtype):
        yield (randn(3, dtype=dtype), randn(4, dtype=dtype)), {}


@builtin(torch.addbmm)
class Addbmm:
    """addbmm(x, B1, B2) = beta x + alpha sum_b B1_b B2_b: d_x = beta d,
    d_B1 = alpha d B2^T, d_B2 = alpha B1^T d (derivatives.yaml `addbmm`)."""

    def fwd(input, batch1, batch2, *, beta=1, alpha=1):
        out = torch.addbmm(input, batch1, batch2, beta=beta, alpha=alpha)
        return out, (batch1, batch2, beta, alpha)

    def bwd(aux, d):
        b1, b2, beta, alpha = aux
        da = torch.unsqueeze(_mul(d, alpha), 0)
        return _mul(d, beta), torch.matmul(da, b2.mT), torch.matmul(b1.mT, da)

    def samples(dtype):
        yield (randn(3, 5, dtype=dtype), randn(2, 3, 4, dtype=dtype),
               randn(2, 4, 5, dtype=dtype)), {}
        yield (randn(5, dtype=dtype), randn(2, 3, 4, dtype=dtype),
               randn(2, 4, 5, dtype=dtype)), {"beta": 0.5, "alpha": 2.0}


@builtin(torch.baddbmm)
class Baddbmm:
    """baddbmm(x, B1, B2) = beta x + alpha B1 @ B2: d_x = beta d, d_B1 = alpha d B2^T,
    d_B2 = alpha B1^T d (derivatives.yaml `baddbmm`)."""

    def fwd(input, batch1, batch2, *, beta=1, alpha=1):
        out = torch.baddbmm(input, batch1, batch2, beta=beta, alpha=alpha)
        return out, (batch1, batch2, beta, alpha)

    def bwd(aux, d):
        b1, b2, beta, alpha = aux
        da = _mul(d, alpha)
        return _mul(d, beta), torch.bmm(da, b2.mT), torch.bmm(b1.mT, da)

    def samples(dtype):
        yield (randn(2, 3, 5, dtype=dtype), randn(2, 3, 4, dtype=dtype),
               randn(2, 4, 5, dtype=dtype)), {}
        yield (randn(5, dtype=dtype), randn(2, 3, 4, dtype=dtype),
               randn(2, 4, 5, dtype=dtype)), {"beta": 0.5, "alpha": 2.0}


@builtin(torch.trace)
class Trace:
    """trace(A): d_A = d * I (rectangular eye) (derivatives.yaml `trace`: trace_backward)."""

    def fwd(input):
        return torch.trace(input), tuple(input.shape)

    def bwd(aux, d):
        n, m = aux
        return (d * torch.eye(n, m, dtype=d.dtype, device=d.device),)

    def jvp(primals, tangents):
        (a,), (t,) = primals, tangents
        return torch.trace(a), (None if t is None else torch.trace(t))

    def samples(dtype):
        yield (randn(3, 4, dtype=dtype),), {}


def _cross_dim(shape: tuple, dim: Any) -> int:
    if dim is not None:
        return dim
    return next(i for i, s in enumerate(shape) if s == 3)


@builtin(torch.cross)
class Cross:
    """cross(a, b, dim): d_a = cross(b, d), d_b = cross(d, a) (derivatives.yaml
    `linalg_cross`)."""

    def fwd(input, other, dim=None):
        out = torch.cross(input, other) if dim is None else torch.cross(input, other, dim)
        return out, (input, other, _cross_dim(tuple(out.shape), dim))

    def bwd(aux, d):
        a, b, dim = aux
        return torch.linalg.cross(b, d, dim=dim), torch.linalg.cross(d, a, dim=dim)

    def samples(dtype):
        yield (randn(4, 3, dtype=dtype), randn(4, 3, dtype=dtype), 1), {}
        yield (randn(3, 2, dtype=dtype), randn(3, 2, dtype=dtype)), {}


@builtin(torch.linalg.cross)
class LinalgCross:
    """linalg.cross(a, b, dim): d_a = cross(b, d), d_b = cross(d, a) (derivatives.yaml
    `linalg_cross`)."""

    def fwd(input, other, *, dim=-1):
        return torch.linalg.cross(input, other, dim=dim), (input, other, dim)

    def bwd(aux, d):
        a, b, dim = aux
        return torch.linalg.cross(b, d, dim=dim), torch.linalg.cross(d, a, dim=dim)

    def samples(dtype):
        yield (randn(4, 3, dtype=dtype), randn(4, 3, dtype=dtype)), {}


@builtin(torch.inner)
class Inner:
    """inner(a, b) = contraction of the last dims: d_a = tensordot(d, b) over b's leading
    dims, d_b = tensordot(d, a) over a's leading dims (0-d operands: a product)
    (derivatives.yaml via `tensordot`/`mul`)."""

    def fwd(input, other):
        return torch.inner(input, other), (input, other)

    def bwd(aux, d):
        a, b = aux
        if a.dim() == 0 or b.dim() == 0:
            return d * b, d * a
        na, nb = a.dim() - 1, b.dim() - 1
        d_a = torch.tensordot(d, b, dims=(list(range(na, na + nb)), list(range(nb))))
        d_b = torch.tensordot(d, a, dims=(list(range(na)), list(range(na))))
        return d_a, d_b

    def samples(dtype):
        yield (randn(2, 4, dtype=dtype), randn(3, 4, dtype=dtype)), {}
        yield (randn(4, dtype=dtype), randn(2, 3, 4, dtype=dtype)), {}
        yield (randn(dtype=dtype), randn(2, 3, dtype=dtype)), {}


def _inv_perm(perm: list[int]) -> list[int]:
    inv = [0] * len(perm)
    for i, p in enumerate(perm):
        inv[p] = i
    return inv


@builtin(torch.tensordot)
class Tensordot:
    """tensordot(a, b, dims): d_a = tensordot(d, b) over b's free dims, permuted to a's order;
    d_b = tensordot(a, d) over a's free dims, permuted to b's order (derivatives.yaml via
    `mm`)."""

    def fwd(a, b, dims=2, out=None):
        res = torch.tensordot(a, b, dims)
        return res, (a, b, dims)

    def bwd(aux, d):
        a, b, dims = aux
        if isinstance(dims, int):
            ca, cb = list(range(a.dim() - dims, a.dim())), list(range(dims))
        else:
            ca, cb = dims
            ca = [ca] if isinstance(ca, int) else list(ca)
            cb = [cb] if isinstance(cb, int) else list(cb)
        ca, cb = [c % a.dim() for c in ca], [c % b.dim() for c in cb]
        fa = [i for i in range(a.dim()) if i not in ca]
        fb = [i for i in range(b.dim()) if i not in cb]
        nfa, nfb = len(fa), len(fb)
        ga = torch.tensordot(d, b, dims=(list(range(nfa, nfa + nfb)), fb))
        ga = torch.permute(ga, _inv_perm(fa + [ca[cb.index(j)] for j in sorted(cb)]))
        gb = torch.tensordot(a, d, dims=(fa, list(range(nfa))))
        gb = torch.permute(gb, _inv_perm([cb[ca.index(i)] for i in sorted(ca)] + fb))
        return ga, gb

    def samples(dtype):
        yield (randn(2, 3, 4, dtype=dtype), randn(3, 4, 5, dtype=dtype)), {}
        yield (randn(2, 3, 4, dtype=dtype), randn(4, 5, 2, dtype=dtype), ([0, 2], [2, 0])), {}
        yield (randn(2, 3, dtype=dtype), randn(4, 5, dtype=dtype), 0), {}


@builtin(torch.kron)
class Kron:
    """kron(a, b): out[(i, j)] = a[i] b[j] per dim; with d viewed as interleaved
    (a0, b0, a1, b1, ...) blocks, d_a = sum over the b axes of d b, d_b = sum over the a axes of
    d a (derivatives.yaml `kron`)."""

    def fwd(input, other):
        return torch.kron(input, other), (input, other)

    def bwd(aux, d):
        a, b = aux
        n = max(a.dim(), b.dim())
        sa = (1,) * (n - a.dim()) + tuple(a.shape)
        sb = (1,) * (n - b.dim()) + tuple(b.shape)
        inter = [s for pair in zip(sa, sb) for s in pair]
        dr = torch.reshape(d, inter)
        ae = torch.reshape(a, [s for x in sa for s in (x, 1)])
        be = torch.reshape(b, [s for x in sb for s in (1, x)])
        d_a = torch.reshape(torch.sum(dr * be, list(range(1, 2 * n, 2))), tuple(a.shape))
        d_b = torch.reshape(torch.sum(dr * ae, list(range(0, 2 * n, 2))), tuple(b.shape))
        return d_a, d_b

    def samples(dtype):
        yield (randn(2, 3, dtype=dtype), randn(4, 2, dtype=dtype)), {}
        yield (randn(3, dtype=dtype), randn(2, 2, dtype=dtype)), {}


# --- einsum ---------------------------------------------------------------------------------

def _parse_einsum(eq: str, ndims: list[int]) -> tuple[list[str], str]:
    """Operand and output subscripts with '...' expanded to explicit letters."""
    eq = eq.replace(" ", "")
    lhs, arrow, rhs = eq.partition("->")
    subs = lhs.split(",")
    used = set(c for c in eq if c.isalpha())
    free = [c for c in string.ascii_letters if c not in used]
    nell = max([nd - (len(s) - 3) for s, nd in zip(subs, ndims) if "..." in s], default=0)
    ell = "".join(free[:nell])
    out_subs = []
    for s, nd in zip(subs, ndims):
        if "..." in s:
            k = nd - (len(s) - 3)
            s = s.replace("...", ell[nell - k:])
        out_subs.append(s)
    if arrow:
        out = rhs.replace("...", ell)
    else:
        counts: dict[str, int] = {}
        for s in out_subs:
            for c in s:
                counts[c] = counts.get(c, 0) + 1
        out = ell + "".join(sorted(c for c, k in counts.items() if k == 1 and c not in ell))
    return out_subs, out


@builtin(torch.einsum)
class Einsum:
    """einsum(eq, *ops): the cotangent of operand i is einsum of d with the other operands
    onto operand i's subscripts; letters summed only within operand i come back as size-1 dims
    (expanded by the engine); a repeated letter (a diagonal) gets an identity factor
    (derivatives.yaml `einsum`, via the linearity of each operand)."""

    def fwd(equation, *operands):
        return torch.einsum(equation, *operands), (equation, operands)

    def bwd(aux, d):
        eq, operands = aux
        listed = len(operands) == 1 and isinstance(operands[0], (list, tuple))
        ops = list(operands[0]) if listed else list(operands)
        subs, out = _parse_einsum(eq, [o.dim() for o in ops])
        used = set("".join(subs) + out)
        spare = [c for c in string.ascii_letters if c not in used]
        cts = []
        for i, (x, s) in enumerate(zip(ops, subs)):
            if not _is_t(x) or not x.is_floating_point():
                cts.append(None)
                continue
            others = [(o, so) for j, (o, so) in enumerate(zip(ops, subs)) if j != i]
            avail = set(out).union(*[set(so) for _, so in others])
            terms, args = [out], [d]
            for o, so in others:
                terms.append(so)
                args.append(o)
            target, seen = [], set()
            for k, c in enumerate(s):
                if c in seen:  # a diagonal: new letter tied to c by an identity matrix
                    nc = spare.pop(0)
                    n = x.shape[k]
                    terms.append(c + nc)
                    args.append(torch.eye(n, dtype=d.dtype, device=d.device))
                    target.append(nc)
                else:
                    seen.add(c)
                    target.append(c)
            keep = "".join(c for c in target if c in avail or
                           any(c in t for t in terms[len(others) + 1:]))
            g = torch.einsum(",".join(terms) + "->" + keep, *args)
            for k, c in enumerate(target):
                if c not in keep:
                    g = torch.unsqueeze(g, k)
            cts.append(g)
        return {"operands": ([cts] if listed else tuple(cts))}

    def jvp(primals, tangents):
        eq, operands = primals[0], list(primals[1:])
        tans = list(tangents[1:])
        listed = len(operands) == 1 and isinstance(operands[0], (list, tuple))
        if listed:
            operands, tans = list(operands[0]), list(tans[0] or [None] * len(operands[0]))
        out = torch.einsum(eq, *operands)
        t_out = None
        for i, t in enumerate(tans):  # multilinear: one term per operand with a tangent
            if t is None:
                continue
            args = operands[:i] + [t] + operands[i + 1:]
            term = torch.einsum(eq, *args)
            t_out = term if t_out is None else t_out + term
        return out, t_out

    def samples(dtype):
        yield ("ij,jk->ik", randn(3, 4, dtype=dtype), randn(4, 5, dtype=dtype)), {}
        yield ("bij,bkj->bik", randn(2, 3, 4, dtype=dtype), randn(2, 5, 4, dtype=dtype)), {}
        yield ("ii->i", randn(3, 3, dtype=dtype)), {}
        yield ("...ij,j", randn(2, 3, 4, dtype=dtype), randn(4, dtype=dtype)), {}
        yield ("ij->", randn(3, 4, dtype=dtype)), {}
        yield ("i,j->ij", randn(3, dtype=dtype), randn(4, dtype=dtype)), {}


@builtin(torch.linalg.vecdot)
class VecDot:
    """linalg.vecdot(x, y, dim) = sum(x y, dim) (real): d_x = d y, d_y = d x with d unsqueezed
    at dim (derivatives.yaml `linalg_vecdot`)."""

    def fwd(x, y, *, dim=-1):
        return torch.linalg.vecdot(x, y, dim=dim), (x, y, dim)

    def bwd(aux, d):
        x, y, dim = aux
        du = torch.unsqueeze(d, dim)
        return du * y, du * x

    def samples(dtype):
        yield (randn(3, 4, dtype=dtype), randn(4, dtype=dtype)), {}
        yield (randn(3, 4, dtype=dtype), randn(3, 4, dtype=dtype)), {"dim": 0}


@builtin(torch.linalg.multi_dot)
class MultiDot:
    """multi_dot([M_0, ..., M_k]) (1-d ends as row/column vectors): d_M_i =
    (M_0 ... M_{i-1})^T d (M_{i+1} ... M_k)^T (derivatives.yaml via `mm`)."""

    def fwd(tensors, *, out=None):
        return torch.linalg.multi_dot(tensors), list(tensors)

    def bwd(aux, d):
        ms = [conj(m) for m in aux]  # (complex: the adjoint uses conjugates)
        shapes = [tuple(m.shape) for m in ms]
        if ms[0].dim() == 1:
            ms[0] = torch.unsqueeze(ms[0], 0)
        if ms[-1].dim() == 1:
            ms[-1] = torch.unsqueeze(ms[-1], 1)
        d2 = torch.reshape(d, (ms[0].shape[0], ms[-1].shape[1]))
        k = len(ms)
        left = [None] * k
        acc = None
        for i in range(k):
            left[i] = acc
            acc = ms[i] if acc is None else torch.mm(acc, ms[i])
        right = [None] * k
        acc = None
        for i in range(k - 1, -1, -1):
            right[i] = acc
            acc = ms[i] if acc is None else torch.mm(ms[i], acc)
        cts = []
        for i in range(k):
            g = d2
            if left[i] is not None:
                g = torch.mm(left[i].mT, g)
            if right[i] is not None:
                g = torch.mm(g, right[i].mT)
            cts.append(torch.reshape(g, shapes[i]))
        return (cts,)

    def samples(dtype):
        yield ([randn(2, 3, dtype=dtype), randn(3, 4, dtype=dtype), randn(4, 2, dtype=dtype)],), {}
        yield ([randn(3, dtype=dtype), randn(3, 4, dtype=dtype), randn(4, dtype=dtype)],), {}


# --- matrix functions -----------------------------------------------------------------------

def _sq(x: Any) -> Any:
    return torch.unsqueeze(torch.unsqueeze(x, -1), -1)


@builtin(torch.linalg.det)
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


@builtin(torch.linalg.slogdet)
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


@builtin(torch.det)
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


@builtin(torch.logdet)
class LogDet:
    """logdet(A) = log det(A): d_A = d A^{-T} (derivatives.yaml `logdet`)."""

    def fwd(input):
        return torch.logdet(input), input

    def bwd(aux, d):
        return (_sq(d) * torch.linalg.inv(aux).mT,)

    def samples(dtype):
        yield (_spd(3, dtype),), {}


@builtin(torch.linalg.inv)
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


@builtin(torch.linalg.inv_ex)
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


@builtin(torch.linalg.solve)
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


@builtin(torch.linalg.solve_ex)
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


@builtin(torch.linalg.solve_triangular)
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


@builtin(torch.linalg.cholesky)
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


@builtin(torch.linalg.cholesky_ex)
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


@builtin(torch.cholesky)
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


class MatrixPower:
    """matrix_power(A, n): d_A = sum_k (A^T)^k d (A^T)^(n-1-k); n < 0 through B = A^{-1}:
    d_A = -B^T d_B B^T (derivatives.yaml `linalg_matrix_power`)."""

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


for _op in (torch.linalg.matrix_power, torch.matrix_power):
    def _mp_fwd(input, n, _op=_op):
        return _op(input, n), (input, n)

    def _mp_samples(dtype):
        yield (randn(3, 3, dtype=dtype), 3), {}
        yield (randn(2, 3, 3, dtype=dtype), 1), {}
        yield (randn(3, 3, dtype=dtype) + 3 * torch.eye(3, dtype=dtype), -2), {}

    add_rule(_op, _mp_fwd, MatrixPower.bwd, samples=_mp_samples, source=MatrixPower.__doc__,
             builtin=True)


@builtin(torch.linalg.svdvals)
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


@builtin(torch.linalg.eigvalsh)
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


@builtin(torch.linalg.vander)
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
