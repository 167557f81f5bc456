"""Segment and bag reductions, combinations, covariance and the Gaussian NLL loss:
``torch.segment_reduce`` (``torch._segment_reduce``; lengths or offsets, sum / mean / max / min
/ prod), ``F.embedding_bag`` (sum / mean / max), ``torch.combinations``, ``torch.cov``,
``torch.corrcoef`` and ``F.gaussian_nll_loss``.

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
* cov: ``C = Xc diag(w) Xc^T / N`` with ``Xc = X - mean_w`` and ``N`` the normalization of
  the torch.cov docs.  Since ``Xc w = 0`` the mean's derivative drops out:
  ``dX = (G + G^T) Xc diag(w) / N``; for ``aweights`` (through ``w = fweights * aweights``)
  ``dC/dw_i = xc_i xc_i^T / N - C dN/dw_i / N`` with ``N`` depending on ``a`` too.
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
