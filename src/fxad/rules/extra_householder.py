"""Products of Householder reflectors: ``linalg.householder_product`` (``orgqr``) and
``ormqr``; and ``nn.functional.ctc_loss`` (by the CTC alpha-beta recursion, see its rule).

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


# --- CTC loss -------------------------------------------------------------------------------

def _ctc_lengths(x: Any, n: int, like: Any) -> Any:
    """Per-sequence lengths as an int64 ``(n,)`` tensor (from a tensor, a list or an int)."""
    if _is_tensor(x):
        return torch.reshape(x, (n,)).to(torch.int64)
    vals = [int(v) for v in x] if isinstance(x, (list, tuple)) else [int(x)]
    # (built from recorded factories: one ``full`` when all lengths agree)
    if len(set(vals)) <= 1:
        return torch.full((n,), vals[0] if vals else 0, dtype=torch.int64, device=like.device)
    return torch.stack([torch.full((), v, dtype=torch.int64, device=like.device)
                        for v in vals])


def _is_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor) or hasattr(x, "node")


def _ctc_labels(targets: Any, tl: Any, n: int, batched: bool) -> Any:
    """Targets as an ``(n, W)`` padded matrix (1-D concatenated targets are cut per sequence
    at the cumulative target lengths; entries past a sequence's length are never read)."""
    if targets.dim() == 2:
        return targets
    if not batched:
        return torch.unsqueeze(targets, 0)
    w = targets.shape[0]
    if w == 0:
        return torch.reshape(targets, (n, 0))
    offsets = torch.cumsum(tl, 0) - tl
    pos = torch.unsqueeze(offsets, 1) + torch.arange(w, device=targets.device)
    return targets[torch.clamp(pos, 0, w - 1)]


def _ctc_grad(log_probs: Any, targets: Any, input_lengths: Any, target_lengths: Any,
              blank: int, zero_infinity: bool) -> tuple[Any, Any, Any, bool]:
    """The per-sequence gradient ``G[t, n, c]`` of PyTorch's CTC negative log-likelihood (its
    convention: ``exp(lp) - exp(log sum_{s: l'_s = c} alpha_t(s) beta_t(s) + nll - lp)`` for
    ``t < T_n``, zero afterwards and, with ``zero_infinity``, for infinite losses), computed by
    the forward (alpha) and backward (beta) recursions in log space over the extended label
    sequence ``l'`` (blanks interleaved).  Returns ``(G, target lengths, batch size, batched)``
    with ``G`` shaped ``(T, N, C)``."""
    batched = log_probs.dim() == 3
    lp = log_probs if batched else torch.unsqueeze(log_probs, 1)
    T, N, C = lp.shape
    il = _ctc_lengths(input_lengths, N, lp)
    tl = _ctc_lengths(target_lengths, N, lp)
    labels = torch.clamp(_ctc_labels(targets, tl, N, batched).to(torch.int64), 0, C - 1)
    W = labels.shape[1]
    S = 2 * W + 1
    blanks = torch.full_like(labels, blank)
    ext = torch.cat([torch.reshape(torch.stack([blanks, labels], -1), (N, 2 * W)),
                     torch.full((N, 1), blank, dtype=torch.int64, device=lp.device)], 1)
    s = torch.arange(S, device=lp.device)
    two_l = torch.unsqueeze(2 * tl, 1)
    has_label = torch.unsqueeze(tl > 0, 1)
    valid = s <= two_l
    prev2 = torch.cat([torch.full_like(ext[:, :2], -1), ext[:, :-2]], 1)
    skip = (s % 2 == 1) & (s >= 2) & (ext != prev2)  # s-2 -> s allowed (alpha)
    skip_b = torch.cat([skip[:, 2:], torch.zeros_like(skip[:, :2])], 1)  # s+2 -> s
    lpe = torch.gather(lp, 2, torch.unsqueeze(ext, 0).expand(T, N, S))
    neg = torch.full_like(lpe[0], float("-inf"))

    # alpha_t(s): log-probability of the prefixes of l' ending in s at time t
    a = torch.where((s == 0) | ((s == 1) & has_label), lpe[0], neg)
    alphas = [a]
    for t in range(1, T):
        a1 = torch.cat([neg[:, :1], a[:, :-1]], 1)
        a2 = torch.where(skip, torch.cat([neg[:, :2], a[:, :-2]], 1), neg)
        a = lpe[t] + torch.logsumexp(torch.stack([a, a1, a2]), 0)
        alphas.append(a)
    alpha = torch.stack(alphas)
    last = torch.clamp(il - 1, min=0)
    a_last = torch.gather(alpha, 0, torch.reshape(last, (1, N, 1)).expand(1, N, S))[0]
    end1 = torch.gather(a_last, 1, two_l)
    end2 = torch.where(has_label, torch.gather(a_last, 1, torch.clamp(two_l - 1, min=0)),
                       neg[:, :1])
    nll = -torch.logsumexp(torch.cat([end1, end2], 1), 1)

    # beta_t(s): log-probability of the suffixes of l' starting in s at time t (with lp_t)
    at_end = (s == two_l) | ((s == two_l - 1) & has_label)
    last_col = torch.unsqueeze(il - 1, 1)
    betas: list[Any] = [None] * T
    b = None
    for t in reversed(range(T)):
        start = torch.where(at_end, lpe[t], neg)
        if b is None:
            b = torch.where(last_col == t, start, neg)
        else:
            b1 = torch.cat([b[:, 1:], neg[:, :1]], 1)
            b2 = torch.where(skip_b, torch.cat([b[:, 2:], neg[:, :2]], 1), neg)
            rec = lpe[t] + torch.logsumexp(torch.stack([b, b1, b2]), 0)
            b = torch.where(last_col == t, start, torch.where(last_col > t, rec, neg))
        b = torch.where(valid, b, neg)
        betas[t] = b
    beta = torch.stack(betas)

    # log sum over the positions s carrying class c of alpha_t(s) beta_t(s)
    onehot = torch.unsqueeze(ext, 2) == torch.arange(C, device=lp.device)
    ab = alpha + beta
    # (PyTorch's kernel, at t = T_n - 1, assigns the last label's term instead of adding it:
    # when the last label is the blank itself, the term of the final blank s = 2 L is dropped)
    last_is_blank = has_label & (torch.gather(ext, 1, torch.clamp(two_l - 1, min=0)) == blank)
    at_last = torch.unsqueeze(torch.unsqueeze(torch.arange(T, device=lp.device), 1) == il - 1, 2)
    ab = torch.where(at_last & (s == two_l) & last_is_blank, float("-inf"), ab)
    ab = torch.where(onehot, torch.unsqueeze(ab, 3), float("-inf"))
    lab = torch.logsumexp(ab, 2)
    g = torch.exp(lp) - torch.exp(lab + torch.reshape(nll, (1, N, 1)) - lp)
    inside = torch.unsqueeze(torch.unsqueeze(torch.arange(T, device=lp.device), 1) < il, 2)
    g = torch.where(inside, g, 0.0)
    if zero_infinity:
        g = torch.where(torch.reshape(nll == float("inf"), (1, N, 1)), 0.0, g)
    return g, tl, N, batched


def _ctc_weights(d: Any, tl: Any, n: int, reduction: str, dtype: Any) -> Any:
    """Cotangent of each sequence's loss given the cotangent ``d`` of the reduced loss."""
    if reduction == "none":
        return torch.reshape(d, (n,))
    if reduction == "sum":
        return d
    return d / (torch.clamp(tl, min=1).to(dtype) * n)


@builtin(torch.nn.functional.ctc_loss)
class CtcLoss:
    """ctc_loss(log_probs, targets, input_lengths, target_lengths, blank, reduction,
    zero_infinity): the gradient of each sequence's loss by the CTC forward-backward (alpha-beta)
    recursion (Graves et al. 2006, "Connectionist Temporal Classification", eq. 16), in
    PyTorch's convention of derivatives.yaml `_ctc_loss` (ctc_loss_backward): for t < T_n,
    d lp[t, n, c] = g_n (exp(lp) - exp(log sum_{s: l'_s = c} alpha_t(s) beta_t(s) + nll_n - lp))
    — the exp(lp) term, zero after the softmax that produces log_probs, is part of PyTorch's
    gradient — zero for t >= T_n and, with zero_infinity, for infinite losses; g_n is the
    cotangent of sequence n's loss through the reduction ('mean' divides by the clamped target
    lengths and the batch size).  The JVP contracts the same gradient with the tangent."""

    def fwd(log_probs, targets, input_lengths, target_lengths, blank=0, reduction="mean",
            zero_infinity=False):
        out = torch.nn.functional.ctc_loss(log_probs, targets, input_lengths, target_lengths,
                                           blank=blank, reduction=reduction,
                                           zero_infinity=zero_infinity)
        return out, (log_probs, targets, input_lengths, target_lengths, blank, reduction,
                     zero_infinity)

    def bwd(aux, d):
        lp, targets, il, tl_arg, blank, reduction, zero_inf = aux
        g, tl, n, batched = _ctc_grad(lp, targets, il, tl_arg, blank, zero_inf)
        w = _ctc_weights(d, tl, n, reduction, lp.dtype)
        d_lp = g * torch.reshape(w, (1, -1, 1)) if reduction != "sum" else g * d
        return (d_lp if batched else d_lp[:, 0]),

    def jvp(primals, tangents):
        lp, targets, il, tl_arg, blank, reduction, zero_inf = primals
        out = torch.nn.functional.ctc_loss(lp, targets, il, tl_arg, blank=blank,
                                           reduction=reduction, zero_infinity=zero_inf)
        t_lp = tangents[0]
        if t_lp is None:
            return out, None
        g, tl, n, batched = _ctc_grad(lp, targets, il, tl_arg, blank, zero_inf)
        t_seq = torch.sum(g * (t_lp if batched else torch.unsqueeze(t_lp, 1)), (0, 2))
        if reduction == "none":
            return out, (t_seq if batched else torch.reshape(t_seq, ()))
        if reduction == "sum":
            return out, torch.sum(t_seq)
        return out, torch.mean(t_seq / torch.clamp(tl, min=1).to(lp.dtype))

    # no samples: PyTorch's gradient carries the exp(log_probs) term above, which finite
    # differences of the op alone do not see; the OpInfo sweep checks it against autograd
