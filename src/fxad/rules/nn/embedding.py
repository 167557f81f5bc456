"""Rules for embeddings: ``F.embedding`` (``padding_idx``, ``scale_grad_by_freq``; ``max_norm``
is refused, it renormalizes the table in place) and ``F.embedding_bag`` (sum / mean / max,
``per_sample_weights``).

The weight cotangent is an ``index_add`` of the output cotangent rows at the looked-up
indices (derivatives.yaml ``embedding``: embedding_backward; ``_embedding_bag``:
``_embedding_bag_backward``, ``_embedding_bag_per_sample_weights_backward``): for bags, times
the per-sample weight, over the bag size for ``mean``, to the first maximal row per column for
``max``; ``per_sample_weights`` gets the dot product of the bag cotangent with the selected
weight row; padding entries get nothing.  ``embedding`` calls the fused
``embedding_dense_backward`` where :mod:`fxad.rules.fused` allows it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...errors import RuleError
from .. import fused
from .._base import randn, _error
from ..registry import register_vjp
from ._common import _bound


# --- embedding ------------------------------------------------------------------------------


@register_vjp(F.embedding)
class Embedding:
    """y = weight[idx]: d_weight = zeros_like(weight).index_add(0, idx.flatten(), d rows)
    (with fused kernels on: ``torch.ops.aten.embedding_dense_backward``, one kernel);
    rows of ``padding_idx`` get no gradient; ``scale_grad_by_freq`` divides each row by how
    often its index occurs (derivatives.yaml `embedding`: embedding_dense_backward).  The
    gradient is dense even with ``sparse=True``.  ``max_norm`` (an in-place renormalization of
    the table during the forward) raises."""

    residuals = "inputs"
    recompute = False

    def fwd(input, weight, padding_idx=None, max_norm=None, norm_type=2.0,
            scale_grad_by_freq=False, sparse=False):
        if max_norm is not None:
            raise _error("torch.nn.functional.embedding",
                         "max_norm is not supported (it renormalizes the weight in place)",
                         "renormalize the table explicitly outside the differentiated "
                         "function, or drop max_norm")
        n = weight.shape[0]
        if padding_idx is not None and padding_idx < 0:
            padding_idx += n
        # (the printed call keeps the user's flags; they do not change the value)
        out = F.embedding(input, weight, padding_idx, None, norm_type, scale_grad_by_freq, sparse)
        return out, (input, n, padding_idx, scale_grad_by_freq)

    def bwd(aux, d):
        idx, n, padding_idx, by_freq = aux
        if fused.enabled() and d.dtype.is_floating_point:
            # one kernel that accumulates into a fresh table (the plain form below copies
            # the zero table once more: index_add is out of place); docs/fused_kernels.md
            return None, torch.ops.aten.embedding_dense_backward(
                d, idx, n, -1 if padding_idx is None else padding_idx, by_freq)
        idx = idx.reshape(-1)
        rows = d.reshape(-1, d.shape[-1])
        if padding_idx is not None:
            rows = rows.masked_fill((idx == padding_idx).unsqueeze(1), 0.0)
        if by_freq:
            counts = d.new_zeros(n).index_add(0, idx, d.new_ones(idx.shape[0]))
            rows = rows / counts[idx].unsqueeze(1)
        d_w = d.new_zeros((n, d.shape[-1])).index_add(0, idx, rows)
        return None, d_w

    def jvp(primals, tangents):
        p, t = _bound(Embedding.fwd, primals, tangents)
        pad = p["padding_idx"]
        out = F.embedding(p["input"], p["weight"], pad)
        return out, None if t["weight"] is None else F.embedding(p["input"], t["weight"], pad)

    def samples(dtype):
        idx = torch.tensor([[0, 2, 4], [2, 3, 2]])
        yield (idx, randn(5, 3, dtype=dtype)), {}
        # padding rows get no gradient and scale_grad_by_freq rescales rows by definition,
        # which finite differences disagree with: these samples avoid the padding index and
        # scale_grad_by_freq (tests/test_nn_rules.py compares those with autograd)
        yield (idx, randn(5, 3, dtype=dtype), 1), {}
        yield (torch.tensor([1, 3, 3, 0]), randn(5, 2, dtype=dtype)), {"padding_idx": -1}
        yield (torch.tensor(3), randn(5, 3, dtype=dtype)), {}


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


@register_vjp(F.embedding_bag)
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
