"""Rules for matrix and tensor products: ``@``/``matmul``, ``mm``, ``bmm``, ``addmm``,
``dot``/``vdot``, ``mv``, ``addmv``, ``addr``, ``outer``/``ger``, ``inner``, ``addbmm``,
``baddbmm``, ``tensordot``, ``kron``, ``einsum``, ``linalg.vecdot``, ``linalg.multi_dot``,
``trace``, ``cross``/``linalg.cross``.

For ``y = a @ b``: d_a = d @ b^T, d_b = a^T @ d (derivatives.yaml `mm`, `bmm`, and
``matmul_backward`` for the 1-D and batched cases); batch broadcasting is reduced by the
engine.  The other products' cotangents are written with the same products (matmul, einsum,
tensordot); entry of derivatives.yaml named in each rule.  ``F.linear`` is in
:mod:`fxad.rules.nn.linear`.
"""
from __future__ import annotations

import operator
import string
from typing import Any

import torch

from .._base import conj, randn, _add, _is_t
from ..registry import register_vjp


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
    if b.dim() == 2:  # (..., m, n) @ (n, p): the batch folds into rows, d_b is one product
        n, p = b.shape
        return d @ b.t(), torch.reshape(a, (-1, n)).t() @ torch.reshape(d, (-1, p))
    return d @ b.mT, a.mT @ d


@register_vjp(operator.matmul)
@register_vjp(torch.matmul)
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


@register_vjp(torch.mm)
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


@register_vjp(torch.bmm)
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


@register_vjp(torch.addmm)
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


def _mul(d: Any, s: Any) -> Any:
    return d if (not _is_t(s) and s == 1) else d * s


def _dot(op: Any) -> type:
    class Dot:
        """dot(a, b) = sum(a b) (vdot: conj(a) b, equal for real inputs): d_a = d b, d_b = d a
        (derivatives.yaml `dot`, `vdot`)."""

        def fwd(input, tensor):
            return op(input, tensor), (input, tensor)

        def bwd(aux, d):
            a, b = aux
            return d * b, d * a

        def samples(dtype):
            yield (randn(5, dtype=dtype), randn(5, dtype=dtype)), {}

    return Dot


register_vjp(torch.dot)(_dot(torch.dot))
register_vjp(torch.vdot)(_dot(torch.vdot))


@register_vjp(torch.mv)
class Mv:
    """mv(A, v): d_A = outer(d, v), d_v = A^T d (derivatives.yaml `mv`)."""

    def fwd(input, vec):
        return torch.mv(input, vec), (input, vec)

    def bwd(aux, d):
        a, v = aux
        return torch.outer(d, v), torch.mv(a.mT, d)

    def samples(dtype):
        yield (randn(3, 4, dtype=dtype), randn(4, dtype=dtype)), {}


@register_vjp(torch.addmv)
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


@register_vjp(torch.addr)
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


@register_vjp(torch.outer)
@register_vjp(torch.ger)
class Outer:
    """outer(u, v): d_u = d v, d_v = d^T u (derivatives.yaml via `mul`)."""

    def fwd(input, vec2):
        return torch.outer(input, vec2), (input, vec2)

    def bwd(aux, d):
        u, v = aux
        return torch.mv(d, v), torch.mv(d.mT, u)

    def samples(dtype):
        yield (randn(3, dtype=dtype), randn(4, dtype=dtype)), {}


@register_vjp(torch.addbmm)
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


@register_vjp(torch.baddbmm)
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


@register_vjp(torch.trace)
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


@register_vjp(torch.cross)
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


@register_vjp(torch.linalg.cross)
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


@register_vjp(torch.inner)
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


@register_vjp(torch.tensordot)
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


@register_vjp(torch.kron)
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


@register_vjp(torch.einsum)
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


@register_vjp(torch.linalg.vecdot)
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


@register_vjp(torch.linalg.multi_dot)
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
