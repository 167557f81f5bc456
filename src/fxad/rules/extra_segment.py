"""Segment and bag reductions, combinations, correlation and the Gaussian NLL loss:
``torch.segment_reduce`` (``torch._segment_reduce``; lengths or offsets, sum / mean / max / min
/ prod), ``F.embedding_bag`` (sum / mean / max), ``torch.combinations``, ``torch.corrcoef`` and
``F.gaussian_nll_loss`` and ``torch.cov``.

Sources of the formulas:

* segment_reduce: derivatives.yaml ``segment_reduce`` (``_segment_reduce_backward``).  Every
  element of a segment gets the segment's cotangent times a per-element weight: 1 (sum),
  1 / length (mean), ``out / x`` or the exclusive product (prod, exact at zeros, ``initial``
  included), and for max / min the cotangent goes to every element equal to the result.
  Ties follow PyTorch's CPU kernel exactly: the cotangent is split evenly over the ties only
  where it is positive (the kernel divides entries ``> 0``); forward mode splits evenly.
* embedding_bag: derivatives.yaml ``_embedding_bag`` (``_embedding_bag_backward``,
  ``_embedding_bag_per_sample_weights_backward``): the weight cotangent is an ``index_add``
  of the bag cotangents (times the per-sample weight, over the bag size for ``mean``, to the
  first maximal row per column for ``max``); ``per_sample_weights`` gets the dot product of
  the bag cotangent with the selected weight row; padding entries get nothing.
* combinations: the output is ``x[idx]`` for the integer table
  ``idx = torch.combinations(torch.arange(n), r, with_replacement)``, so the cotangent is
  ``index_add``-ed back; the op is linear, so its JVP is the op applied to the tangent.
* cov / corrcoef share ``_cov_vjp`` / ``_cov_jvp``: ``C = Xc diag(w) Xc^T / N`` with
  ``Xc = X - mean_w`` and ``N`` the normalization of the torch.cov docs.  Since ``Xc w = 0``
  the mean's derivative drops out: ``dX = (G + G^T) Xc diag(w) / N``; for ``aweights``
  ``dC/dw_i = xc_i xc_i^T / N - C dN/dw_i / N``, ``N`` depending on the aweights too.
  OpInfo passes float32 ``aweights`` with a float64 input: autograd rounds that cotangent
  (terms that nearly cancel) in float32, which the sweep compares at float32 tolerance.
* corrcoef: ``R = C / (s s^T)``, ``s = sqrt(diag C)``, clipped to [-1, 1] (the clip passes
  the cotangent only where ``-1 <= R <= 1``, as autograd's clamp does), then cov's rule.
* gaussian_nll_loss: ``l = (log v + (x - y)^2 / v) / 2`` with ``v = max(var, eps)``; as in
  ``torch.nn.functional`` the clamp happens under ``no_grad`` on a copy, so ``var`` gets the
  derivative at the clamped value (not zero where clamped), exactly as autograd gives.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from ..errors import RuleError
from ._base import builtin, randn, uniform


# --------------------------------------------------------------------------------------------
# segment_reduce
# --------------------------------------------------------------------------------------------

def _seg_layout(data: Any, lengths: Any, offsets: Any, axis: int) -> tuple[Any, Any, Any]:
    """Per element of ``data`` along ``axis``: the segment id (clamped into range, shaped to
    broadcast like ``data``'s leading dims + axis), whether it lies in a segment, and the
    segment lengths ``(..., S)``."""
    if lengths is not None:
        bounds = torch.cat([torch.zeros_like(lengths[..., :1]), torch.cumsum(lengths, -1)], -1)
        seg_len = lengths
    else:
        bounds = offsets
        seg_len = offsets[..., 1:] - offsets[..., :-1]
    n, s = data.shape[axis], seg_len.shape[-1]
    pos = torch.arange(n, device=data.device, dtype=bounds.dtype)
    pos = pos.expand(tuple(bounds.shape[:-1]) + (n,)).contiguous()
    seg = torch.searchsorted(bounds.contiguous(), pos, right=True) - 1
    inside = (seg >= 0) & (seg < s)
    seg = torch.clamp(seg, 0, s - 1)
    return seg, inside, seg_len


def _to_data(v: Any, data: Any, axis: int) -> Any:
    """A ``(..., N)`` per-position tensor reshaped to broadcast against ``data``."""
    return torch.reshape(v, tuple(v.shape) + (1,) * (data.dim() - axis - 1))


def _seg_gather(v: Any, seg: Any, data: Any, axis: int) -> Any:
    """``v`` (segment-shaped, like the output) read at each element's segment."""
    idx = _to_data(seg, data, axis).expand(tuple(data.shape[:axis]) + (data.shape[axis],)
                                           + tuple(v.shape[axis + 1:]))
    return torch.gather(v, axis, idx)


def _seg_sum(v: Any, lengths: Any, offsets: Any, axis: int, **kw: Any) -> Any:
    if lengths is not None:
        return torch.segment_reduce(v, "sum", lengths=lengths, axis=axis, unsafe=True, **kw)
    return torch.segment_reduce(v, "sum", offsets=offsets, axis=axis, unsafe=True, **kw)


def _seg_weights(data, out, reduce, lengths, offsets, axis, initial, linear):
    """Per-element weight w (shaped like data) with d_data = w * d_out[segment]; for max/min
    with ``linear=False`` returns the tie mask and count instead (the backward needs d)."""
    seg, inside, seg_len = _seg_layout(data, lengths, offsets, axis)
    inside = _to_data(inside, data, axis)
    if reduce == "sum":
        return seg, torch.where(inside, torch.ones_like(data), torch.zeros_like(data))
    if reduce == "mean":
        n = _to_data(torch.gather(seg_len, -1, seg), data, axis).to(data.dtype)
        return seg, torch.where(inside, 1 / n, torch.zeros_like(data))
    out_e = _seg_gather(out, seg, data, axis)
    if reduce in ("max", "min"):
        hit = inside & ((data == out_e) | torch.isnan(data))
        hitf = hit.to(data.dtype)
        cnt = _seg_gather(_seg_sum(hitf, lengths, offsets, axis), seg, data, axis)
        if linear:
            return seg, torch.where(hit, 1 / cnt, torch.zeros_like(data))
        return seg, (hit, cnt)
    if reduce == "prod":
        special = torch.isnan(data) | (data == 0)
        kw = {} if initial is None else {"initial": initial}
        others = torch.where(special, torch.ones_like(data), data)
        if lengths is not None:
            p = torch.segment_reduce(others, "prod", lengths=lengths, axis=axis, unsafe=True, **kw)
        else:
            p = torch.segment_reduce(others, "prod", offsets=offsets, axis=axis, unsafe=True, **kw)
        p_e = _seg_gather(p, seg, data, axis)
        n_special = _seg_gather(_seg_sum(special.to(data.dtype), lengths, offsets, axis),
                                seg, data, axis)
        n_nan = _seg_gather(_seg_sum(torch.isnan(data).to(data.dtype), lengths, offsets, axis),
                            seg, data, axis)
        other_nan = (n_nan - torch.isnan(data).to(data.dtype)) > 0
        rest = torch.where(other_nan, torch.full_like(data, math.nan), torch.zeros_like(data))
        excl = p_e * torch.where(n_special == 1, torch.ones_like(data), rest)
        return seg, (special, excl, out_e, inside)
    raise RuleError(f"segment_reduce: unknown reduction {reduce!r}")


@builtin(torch.segment_reduce)
class SegmentReduce:
    """segment_reduce(data, reduce, lengths= / offsets=, axis, unsafe, initial)
    (derivatives.yaml `segment_reduce`: _segment_reduce_backward): d_data = w * d[segment]
    with w = 1 (sum), 1/length (mean), [x == out] split over ties (max/min; PyTorch's kernel
    splits only positive cotangents), out/x or the exclusive product incl. ``initial`` (prod,
    exact at zeros)."""

    def fwd(data, reduce, *, lengths=None, indices=None, offsets=None, axis=0, unsafe=False,
            initial=None):
        kw = {k: v for k, v in (("lengths", lengths), ("indices", indices),
                                ("offsets", offsets)) if v is not None}
        if axis != 0:
            kw["axis"] = axis
        if unsafe:
            kw["unsafe"] = unsafe
        if initial is not None:
            kw["initial"] = initial
        out = torch.segment_reduce(data, reduce, **kw)
        return out, (data, out, reduce, lengths, offsets, axis % max(data.dim(), 1), initial)

    def bwd(aux, d):
        data, out, reduce, lengths, offsets, axis, initial = aux
        if out.shape[axis] == 0:
            return (torch.zeros_like(data),)
        seg, w = _seg_weights(data, out, reduce, lengths, offsets, axis, initial, linear=False)
        d_e = _seg_gather(d, seg, data, axis)
        zero = torch.zeros_like(data)
        if reduce == "sum":
            return (torch.where(w != 0, d_e, zero),)
        if reduce == "mean":
            seg_len = lengths if lengths is not None else offsets[..., 1:] - offsets[..., :-1]
            n = _to_data(torch.gather(seg_len, -1, seg), data, axis)
            return (torch.where(w != 0, d_e / n, zero),)
        if reduce in ("max", "min"):
            hit, cnt = w
            split = (cnt >= 2) & (d_e > 0)
            return (torch.where(hit, torch.where(split, d_e / cnt, d_e), zero),)
        special, excl, out_e, inside = w
        g = torch.where(special, d_e * excl, d_e * out_e / data)
        return (torch.where(inside, g, zero),)

    def jvp(primals, tangents):
        data, reduce, lengths, indices, offsets, axis, unsafe, initial = primals
        t = tangents[0]
        kw = {k: v for k, v in (("lengths", lengths), ("indices", indices),
                                ("offsets", offsets)) if v is not None}
        kw.update(axis=axis, unsafe=unsafe)
        if initial is not None:
            kw["initial"] = initial
        out = torch.segment_reduce(data, reduce, **kw)
        ax = axis % max(data.dim(), 1)
        if t is None or out.shape[ax] == 0:
            return out, None
        seg, w = _seg_weights(data, out, reduce, lengths, offsets, ax, initial, linear=True)
        if reduce == "prod":
            special, excl, out_e, inside = w
            w = torch.where(inside, torch.where(special, excl, out_e / data),
                            torch.zeros_like(data))
        return out, _seg_sum(w * t, lengths, offsets, ax)

    def samples(dtype):
        x = uniform((7,), 0.5, 2.0, dtype)
        for red in ("sum", "mean", "max", "min", "prod"):
            yield (x, red), {"lengths": torch.tensor([2, 3, 2])}
            yield (x, red), {"lengths": torch.tensor([2, 0, 3, 2]), "initial": 1.5}
            yield (x, red), {"offsets": torch.tensor([0, 2, 2, 5, 7]), "initial": 2.0}
        x2 = randn(5, 3, 2, dtype=dtype)
        for red in ("sum", "mean", "max", "min", "prod"):
            yield (x2, red), {"lengths": torch.tensor([[2, 1], [0, 3], [3, 0], [1, 2], [3, 0]]),
                              "axis": 1, "initial": 0.5}
            yield (x2, red), {"offsets": torch.tensor([0, 1, 1, 5]), "unsafe": True,
                              "initial": -0.5}
        z = uniform((6, 2), 0.5, 2.0, dtype)
        z[1, 0] = 0.0
        z[4, 1] = 0.0
        z[5, 1] = 0.0
        yield (z, "prod"), {"lengths": torch.tensor([3, 3]), "initial": 1.5}
        yield (z, "prod"), {"lengths": torch.tensor([2, 4])}


# --------------------------------------------------------------------------------------------
# combinations
# --------------------------------------------------------------------------------------------

@builtin(torch.combinations)
class Combinations:
    """combinations(x, r, with_replacement) = x[idx] with the integer table
    idx = combinations(arange(n), r, with_replacement): d_x = index_add of d at idx; the op is
    linear, so its tangent is the op applied to the tangent."""

    def fwd(input, r=2, with_replacement=False):
        out = torch.combinations(input, r, with_replacement)
        return out, (input, r, with_replacement)

    def bwd(aux, d):
        x, r, with_replacement = aux
        if r == 0 or d.numel() == 0:
            return (torch.zeros_like(x),)
        n = x.shape[0]
        idx = torch.combinations(torch.arange(n, device=x.device), r, with_replacement)
        return (torch.zeros_like(x).index_add(0, torch.reshape(idx, (-1,)),
                                              torch.reshape(d, (-1,))),)

    def jvp(primals, tangents):
        x, r, with_replacement = primals
        t = tangents[0]
        out = torch.combinations(x, r, with_replacement)
        return out, (None if t is None else torch.combinations(t, r, with_replacement))

    def samples(dtype):
        x = randn(4, dtype=dtype)
        yield (x,), {}
        yield (x, 3), {}
        yield (x, 2, True), {}
        yield (x,), {"r": 1, "with_replacement": True}
        yield (randn(1, dtype=dtype), 2, True), {}


# --------------------------------------------------------------------------------------------
# gaussian_nll_loss
# --------------------------------------------------------------------------------------------

def _gnll_var(input: Any, var: Any) -> tuple[Any, bool]:
    """var shaped as in F.gaussian_nll_loss (one fewer dim -> unsqueezed last dim)."""
    if tuple(var.shape) != tuple(input.shape) and tuple(input.shape[:-1]) == tuple(var.shape):
        return torch.unsqueeze(var, -1), True
    return var, False


@builtin(F.gaussian_nll_loss)
class GaussianNLLLoss:
    """gaussian_nll_loss: l = (log v + (x - y)^2 / v) / 2, v = max(var, eps);
    d_x = (x - y) / v, d_y = -d_x, d_var = (1/v - (x - y)^2 / v^2) / 2 times the (reduced)
    cotangent.  F.gaussian_nll_loss clamps a copy of var in place under no_grad, so autograd
    passes the var cotangent straight through the clamp (not zero where clamped); so do we."""

    def fwd(input, target, var, full=False, eps=1e-6, reduction="mean"):
        out = F.gaussian_nll_loss(input, target, var, full=full, eps=eps, reduction=reduction)
        return out, (input, target, var, eps, reduction)

    def bwd(aux, d):
        x, y, var, eps, reduction = aux
        is_tensor = isinstance(var, torch.Tensor) or hasattr(var, "shape")
        v, unsq = _gnll_var(x, var) if is_tensor else (None, False)
        diff = x - y
        shape = torch.broadcast_shapes(tuple(x.shape), tuple(y.shape),
                                       tuple(v.shape) if v is not None else ())
        if reduction == "mean":
            d = d / math.prod(shape)
        vc = torch.clamp(v, min=eps) if v is not None else torch.clamp(
            torch.full_like(x, var), min=eps)
        d_x = d * diff / vc
        d_var = None
        if v is not None:
            d_var = d * (0.5 / vc - 0.5 * diff * diff / (vc * vc))
            if unsq:
                d_var = torch.sum(torch.broadcast_to(d_var, shape), -1)
        return d_x, -d_x, d_var

    def jvp(primals, tangents):
        x, y, var, full, eps, reduction = primals
        tx, ty, tv = tangents[:3]
        out = F.gaussian_nll_loss(x, y, var, full=full, eps=eps, reduction=reduction)
        is_tensor = isinstance(var, torch.Tensor) or hasattr(var, "shape")
        v, unsq = _gnll_var(x, var) if is_tensor else (None, False)
        vc = torch.clamp(v, min=eps) if v is not None else torch.clamp(
            torch.full_like(x, var), min=eps)
        diff = x - y
        shape = torch.broadcast_shapes(tuple(x.shape), tuple(y.shape), tuple(vc.shape))
        t = None
        if tx is not None or ty is not None:
            td = tx if ty is None else (-ty if tx is None else tx - ty)
            t = diff * td / vc
        if v is not None and tv is not None:
            if unsq:
                tv = torch.unsqueeze(tv, -1)
            tvar = tv * (0.5 / vc - 0.5 * diff * diff / (vc * vc))
            t = tvar if t is None else t + tvar
        if t is None:
            return out, None
        t = torch.broadcast_to(t, shape)
        if reduction == "mean":
            t = torch.mean(t)
        elif reduction == "sum":
            t = torch.sum(t)
        return out, t

    def samples(dtype):
        x, y = randn(4, 3, dtype=dtype), randn(4, 3, dtype=dtype)
        yield (x, y, uniform((4, 3), 0.5, 2.0, dtype)), {}
        yield (x, y, uniform((4,), 0.5, 2.0, dtype)), {"full": True, "reduction": "sum"}
        yield (x, y, uniform((4, 1), 0.5, 2.0, dtype)), {"reduction": "none"}
        yield (x, randn(3, dtype=dtype), uniform((4, 1), 0.5, 2.0, dtype)), {"eps": 1e-3}
        yield (randn(3, dtype=dtype), y, uniform((3,), 0.5, 2.0, dtype)), {"reduction": "sum"}
        # (var clamped at eps: autograd's straight-through value is checked separately; finite
        # differences see the clamp, so such a sample is not listed here)


# --------------------------------------------------------------------------------------------
# cov, corrcoef
# --------------------------------------------------------------------------------------------

def _cov_parts(x: Any, correction: int, fweights: Any, aweights: Any) -> dict:
    """The pieces of torch.cov's computation (same dtypes and order as its docs' formula):
    observations matrix X (vars, obs), weights w (or None), their sum W, normalization N,
    centred Xc."""
    X = torch.reshape(x, (1, -1)) if x.dim() < 2 else x
    w = fweights
    if aweights is not None:
        w = aweights if w is None else w * aweights
    if w is None:
        W = X.shape[1]
        avg = torch.sum(X, 1) / W
        N = W - correction
        N = 0 if N <= 0 else N
    else:
        W = torch.sum(w)
        avg = torch.sum(X * w, 1) / W
        if aweights is not None and correction != 0:
            N = W - correction * torch.sum(w * aweights) / W
        else:
            N = W - correction
        N = torch.where(N <= 0, torch.zeros_like(N), N)
    Xc = X - torch.unsqueeze(avg, 1)
    return {"X": X, "w": w, "W": W, "N": N, "Xc": Xc}


def _cov_vjp(x, correction, fweights, aweights, out, G):
    """Cotangents (d_x, d_aweights) of cov for the (V, V) cotangent G."""
    p = _cov_parts(x, correction, fweights, aweights)
    Xc, w, W, N = p["Xc"], p["w"], p["W"], p["N"]
    v = Xc.shape[0]
    G = torch.reshape(G, (v, v))
    Xw = Xc if w is None else Xc * w
    d_x = torch.reshape((G + G.mT) @ Xw / N, tuple(x.shape))
    d_a = None
    if aweights is not None and aweights.is_floating_point():
        # Each term is rounded to the weights' dtype where autograd's graph of torch.cov
        # crosses into it, and they are combined in that dtype in the same grouping, so a
        # float32 aweights with a float64 input gets autograd's float32 cotangent.
        C = torch.reshape(out, (v, v))
        q = (torch.sum(Xc * (G @ Xc), 0) / N).to(w.dtype)   # through (Xc * w) in Xc diag(w) Xc^T
        g_n = (-torch.sum(G * C) / N).to(w.dtype)          # through C / N
        g_w = q + g_n                                      # N = W - ... : dN/dW = 1
        g_direct = None
        if correction != 0:
            t = torch.sum(w * aweights)
            g_w = g_w + g_n * (correction * t) / (W * W)   # - correction * t / W, through W
            g_t = (-g_n / W) * correction                  # ... through t = sum(w * aweights)
            g_w = g_w + g_t * aweights
            g_direct = g_t * w
        d_a = g_w if fweights is None else g_w * fweights
        if g_direct is not None:
            d_a = d_a + g_direct
    return d_x, d_a


def _cov_jvp(x, correction, fweights, aweights, out, tx, ta):
    """Tangent (V, V) of cov for tangents tx (of x) and ta (of aweights)."""
    p = _cov_parts(x, correction, fweights, aweights)
    Xc, w, W, N = p["Xc"], p["w"], p["W"], p["N"]
    v = Xc.shape[0]
    t = None
    if tx is not None:
        T = torch.reshape(tx, tuple(Xc.shape))
        M = T @ (Xc if w is None else Xc * w).mT
        t = (M + M.mT) / N
    if ta is not None and aweights is not None:
        C = torch.reshape(out, (v, v))
        dw = ta if fweights is None else ta * fweights
        if correction != 0:
            dNdw = 1 - correction * (aweights / W - torch.sum(w * aweights) / (W * W))
            dN = torch.sum(dNdw * dw) - correction * torch.sum(w * ta) / W
        else:
            dN = torch.sum(dw)
        ta_part = ((Xc * dw) @ Xc.mT - C * dN) / N
        t = ta_part if t is None else t + ta_part
    return t


@builtin(torch.cov)
class Cov:
    """cov(x, correction, fweights, aweights) = Xc diag(w) Xc^T / N with Xc the weighted-mean
    centred observations, w = fweights * aweights, N = sum(w) - correction * sum(w * aweights)
    / sum(w) (torch.cov docs): d_x = (G + G^T) Xc diag(w) / N; aweights get the derivative
    through w, the mean and N (derivatives.yaml: composite, via its ops); integer fweights
    get none."""

    def fwd(input, *, correction=1, fweights=None, aweights=None):
        out = torch.cov(input, correction=correction, fweights=fweights, aweights=aweights)
        return out, (input, correction, fweights, aweights, out)

    def bwd(aux, d):
        x, correction, fweights, aweights, out = aux
        d_x, d_a = _cov_vjp(x, correction, fweights, aweights, out, d)
        return d_x, None, None, d_a

    def jvp(primals, tangents):
        x, correction, fweights, aweights = primals
        tx, ta = tangents[0], tangents[3]
        out = torch.cov(x, correction=correction, fweights=fweights, aweights=aweights)
        t = _cov_jvp(x, correction, fweights, aweights, out, tx, ta)
        return out, (None if t is None else torch.reshape(t, tuple(out.shape)))

    def samples(dtype):
        x = randn(3, 6, dtype=dtype)
        yield (x,), {}
        yield (x,), {"correction": 0}
        yield (randn(6, dtype=dtype),), {}
        yield (x,), {"fweights": torch.tensor([1, 2, 1, 3, 1, 2])}
        yield (x,), {"aweights": torch.rand(6, dtype=dtype) + 0.5}
        yield (x,), {"fweights": torch.tensor([1, 2, 1, 3, 1, 2]),
                     "aweights": torch.rand(6, dtype=dtype) + 0.5, "correction": 2}


@builtin(torch.corrcoef)
class Corrcoef:
    """corrcoef(x) = clip(C / (s s^T), -1, 1), C = cov(x), s = sqrt(diag C): with G masked
    where the clip is active (autograd's clamp), d_C = G / (s s^T) + diag(d_s / (2 s)),
    d_s_k = -(sum_i G_ik R_ik + sum_j G_kj R_kj) / s_k; then cov's rule.  A single variable
    gives C / C (derivative 0 up to rounding, as autograd's)."""

    def fwd(input):
        out = torch.corrcoef(input)
        return out, input

    def bwd(x, d):
        C = torch.cov(x)
        if C.dim() == 0:
            dC = d / C - d * C / (C * C)
            return (_cov_vjp(x, 1, None, None, C, dC)[0],)
        s = torch.sqrt(torch.diagonal(C))
        col, row = torch.unsqueeze(s, 1), torch.unsqueeze(s, 0)
        R = C / col / row
        G = torch.where((R >= -1) & (R <= 1), d, torch.zeros_like(d))
        GR = G * R
        ds = -(torch.sum(GR, 0) + torch.sum(GR, 1)) / s
        dC = G / col / row + torch.diag(ds / (2 * s))
        return (_cov_vjp(x, 1, None, None, C, dC)[0],)

    def jvp(primals, tangents):
        (x,), (tx,) = primals, tangents
        out = torch.corrcoef(x)
        if tx is None:
            return out, None
        C = torch.cov(x)
        tC = torch.reshape(_cov_jvp(x, 1, None, None, C, tx, None), tuple(C.shape))
        if C.dim() == 0:
            return out, tC / C - C * tC / (C * C)
        s = torch.sqrt(torch.diagonal(C))
        col, row = torch.unsqueeze(s, 1), torch.unsqueeze(s, 0)
        R = C / col / row
        rel = torch.diagonal(tC) / (2 * s * s)             # ds / s
        tR = tC / col / row - R * (torch.unsqueeze(rel, 1) + torch.unsqueeze(rel, 0))
        return out, torch.where((R >= -1) & (R <= 1), tR, torch.zeros_like(tR))

    def samples(dtype):
        yield (randn(3, 5, dtype=dtype),), {}
        yield (randn(2, 4, dtype=dtype),), {}
        yield (randn(6, dtype=dtype),), {}


# --------------------------------------------------------------------------------------------
# embedding_bag
# --------------------------------------------------------------------------------------------

def _bag_layout(input, offsets, include_last_offset, padding_idx, num_weights):
    """Flat indices, the bag of each index (clamped into range), whether it counts (inside a
    bag and not padding), and the number of bags."""
    idx = torch.reshape(input, (-1,))
    m = idx.shape[0]
    pos = torch.arange(m, device=idx.device)
    if input.dim() == 2:
        n_bags = input.shape[0]
        bag = torch.div(pos, max(input.shape[1], 1), rounding_mode="floor")
        valid = torch.ones_like(idx, dtype=torch.bool)
    else:
        n_bags = offsets.shape[0] - (1 if include_last_offset else 0)
        bag = torch.searchsorted(offsets.to(pos.dtype), pos, right=True) - 1
        # entries past offsets[-1] (include_last_offset=True) belong to the last bag, as in
        # PyTorch's CPU kernels (forward and backward)
        valid = bag >= 0
        bag = torch.clamp(bag, 0, max(n_bags - 1, 0))
    if padding_idx is not None:
        pad = padding_idx + num_weights if padding_idx < 0 else padding_idx
        valid = valid & (idx != pad)
    return idx, bag, valid, n_bags


def _freq_divisor(idx, num_weights, dtype):
    """Per index, the divisor PyTorch's embedding_bag backward uses for scale_grad_by_freq.
    The CPU kernel walks the sorted indices group by group and divides the k-th group (k-th
    smallest distinct index) by the count of ``sorted_indices[k]`` rather than of the group's
    own index; we reproduce that on CPU so gradients equal autograd's.  Elsewhere it is the
    index's own count in the batch."""
    counts = torch.zeros(num_weights, dtype=dtype, device=idx.device).index_add(
        0, idx, torch.ones_like(idx, dtype=dtype))
    if idx.device.type != "cpu":
        return counts[idx]
    rank = torch.cumsum((counts > 0).to(torch.int64), 0) - 1       # rank among distinct
    sorted_idx = torch.sort(idx).values
    return counts[sorted_idx[rank[idx]]]


def _bag_max_first(weight, out, idx, bag, valid, n_bags):
    """(M, D) mask: for each bag and column, the first index whose row attains the max."""
    m = idx.shape[0]
    vals = weight[idx]
    cand = torch.unsqueeze(valid, 1) & (vals == out[bag])
    pos = torch.unsqueeze(torch.arange(m, device=idx.device), 1).expand(tuple(vals.shape))
    pos = torch.where(cand, pos, torch.full_like(pos, m))
    first = torch.full((n_bags, vals.shape[1]), m, dtype=pos.dtype, device=idx.device)
    first = first.scatter_reduce(0, torch.unsqueeze(bag, 1).expand(tuple(vals.shape)), pos,
                                 "amin")
    return cand & (pos == first[bag])


@builtin(F.embedding_bag)
class EmbeddingBag:
    """embedding_bag (derivatives.yaml `_embedding_bag`: _embedding_bag_backward and
    _embedding_bag_per_sample_weights_backward): d_weight = index_add over the bag entries of
    the bag's cotangent times the per-sample weight (sum), over the bag size (mean), or to the
    first row attaining the max per column (max); per_sample_weights get <d_bag, weight_row>;
    padding entries get nothing; scale_grad_by_freq divides by the index count (as PyTorch's
    CPU kernel does, see _freq_divisor).  With max_norm the forward renormalises weight rows
    in place (no gradient through the renorm), and the backward reads the renormalised rows,
    as autograd does.  With sparse=True autograd returns the same values as a sparse tensor;
    this rule writes the dense gradient."""

    def fwd(input, weight, offsets=None, max_norm=None, norm_type=2, scale_grad_by_freq=False,
            mode="mean", sparse=False, per_sample_weights=None, include_last_offset=False,
            padding_idx=None):
        out = F.embedding_bag(input, weight, offsets, max_norm=max_norm, norm_type=norm_type,
                              scale_grad_by_freq=scale_grad_by_freq, mode=mode, sparse=sparse,
                              per_sample_weights=per_sample_weights,
                              include_last_offset=include_last_offset, padding_idx=padding_idx)
        return out, (input, weight, offsets, scale_grad_by_freq, mode, per_sample_weights,
                     include_last_offset, padding_idx, out)

    def bwd(aux, d):
        (input, weight, offsets, scale_freq, mode, psw, include_last_offset, padding_idx,
         out) = aux
        idx, bag, valid, n_bags = _bag_layout(input, offsets, include_last_offset, padding_idx,
                                              weight.shape[0])
        if n_bags == 0 or idx.shape[0] == 0:
            return {"weight": torch.zeros_like(weight)}
        d_bag = d[bag]                                          # (M, D)
        keep = torch.unsqueeze(valid, 1)
        zero = torch.zeros_like(d_bag)
        if mode == "max":
            first = _bag_max_first(weight, out, idx, bag, valid, n_bags)
            rows = torch.where(first, d_bag, zero)
            return {"weight": torch.zeros_like(weight).index_add(0, idx, rows)}
        rows = d_bag
        if psw is not None:
            rows = rows * torch.unsqueeze(torch.reshape(psw, (-1,)), 1)
        if mode == "mean":
            size = torch.zeros(n_bags, dtype=d.dtype, device=d.device).index_add(
                0, bag, valid.to(d.dtype))
            rows = rows / torch.unsqueeze(size[bag], 1)
        if scale_freq:
            rows = rows / torch.unsqueeze(_freq_divisor(idx, weight.shape[0], d.dtype), 1)
        d_w = torch.zeros_like(weight).index_add(0, idx, torch.where(keep, rows, zero))
        d_psw = None
        if psw is not None:
            dots = torch.sum(d_bag * weight[idx], 1)
            d_psw = torch.reshape(torch.where(valid, dots, torch.zeros_like(dots)),
                                  tuple(psw.shape))
        return {"weight": d_w, "per_sample_weights": d_psw}

    def jvp(primals, tangents):
        (input, weight, offsets, max_norm, norm_type, scale_freq, mode, sparse, psw,
         include_last_offset, padding_idx) = primals
        tw, tp = tangents[1], tangents[8]
        if scale_freq and (tw is not None or tp is not None):
            # the flag rescales only autograd's backward (so its VJP is not the transpose of
            # any derivative of the forward); no forward-mode counterpart matches both
            raise RuleError("forward mode for embedding_bag(scale_grad_by_freq=True) is not "
                            "defined: the flag changes only the backward's gradient scaling")
        out = F.embedding_bag(input, weight, offsets, max_norm=max_norm, norm_type=norm_type,
                              scale_grad_by_freq=scale_freq, mode=mode, sparse=sparse,
                              per_sample_weights=psw, include_last_offset=include_last_offset,
                              padding_idx=padding_idx)
        kw = {"mode": mode, "include_last_offset": include_last_offset,
              "padding_idx": padding_idx}
        t = None
        if tw is not None:
            if mode == "max":
                idx, bag, valid, n_bags = _bag_layout(input, offsets, include_last_offset,
                                                      padding_idx, weight.shape[0])
                first = _bag_max_first(weight, out, idx, bag, valid, n_bags)
                rows = torch.where(first, tw[idx], torch.zeros_like(tw[idx]))
                t = torch.zeros_like(out).index_add(0, bag, rows)
            else:
                t = F.embedding_bag(input, tw, offsets, per_sample_weights=psw, **kw)
        if tp is not None:
            tpsw = F.embedding_bag(input, weight, offsets, per_sample_weights=tp, **kw)
            t = tpsw if t is None else t + tpsw
        return out, t

    def samples(dtype):
        w = randn(10, 4, dtype=dtype)
        idx = torch.tensor([1, 5, 4, 5, 9, 0, 2])
        off = torch.tensor([0, 3, 3])
        idx2 = torch.tensor([[2, 1, 1], [0, 2, 4], [2, 0, 7]])
        for mode in ("sum", "mean", "max"):
            yield (idx, w, off), {"mode": mode}
            yield (idx2, w), {"mode": mode, "padding_idx": 2}
            yield (idx, w, torch.tensor([0, 2, 2, 6])), {"mode": mode,
                                                         "include_last_offset": True}
            yield (idx, w, off), {"mode": mode, "padding_idx": -5}
        yield (idx, w, off, None, 2, False, "sum", False, randn(7, dtype=dtype)), {}
        yield (idx2, w), {"mode": "sum", "per_sample_weights": randn(3, 3, dtype=dtype),
                          "padding_idx": 1}
