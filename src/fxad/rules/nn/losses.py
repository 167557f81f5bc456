"""Rules for loss functions: ``cross_entropy``, ``nll_loss``, ``mse_loss``, ``l1_loss``,
``smooth_l1_loss``, ``huber_loss``, ``binary_cross_entropy`` (``_with_logits``), ``kl_div``,
``poisson_nll_loss``, ``gaussian_nll_loss``, ``soft_margin_loss``, ``margin_ranking_loss``,
``hinge_embedding_loss``, ``multilabel_soft_margin_loss``, ``multi_margin_loss``,
``multilabel_margin_loss``, ``cosine_embedding_loss``, ``triplet_margin_loss``,
``ctc_loss`` and ``linear_cross_entropy``.

Formulas follow PyTorch's ``tools/autograd/derivatives.yaml`` (entry named in each rule);
legacy ``size_average`` / ``reduce`` arguments are mapped onto ``reduction`` as
``torch.nn._reduction`` does.  ``cross_entropy`` may call the fused ``nll_loss_backward``
(:mod:`fxad.rules.fused`); ``linear_cross_entropy`` reuses its backward.

* ``gaussian_nll_loss``: ``l = (log v + (x - y)^2 / v) / 2`` with ``v = max(var, eps)``; as in
  ``torch.nn.functional`` the clamp happens under ``no_grad`` on a copy, so ``var`` gets the
  derivative at the clamped value (not zero where clamped), exactly as autograd gives.
* ``ctc_loss``: by the CTC alpha-beta recursion (see the rule's docstring).
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from .._base import pnorm_grad, randn, uniform, value_of, _add, _error, _is_t, _t
from ..registry import register_vjp
from ._common import _bound, _mul


def _legacy_reduction(op: str, size_average: Any, reduce: Any, reduction: str) -> str:
    """Map the deprecated ``size_average`` / ``reduce`` flags onto ``reduction`` exactly as
    ``torch.nn._reduction.legacy_get_string`` does."""
    if size_average is None and reduce is None:
        if reduction not in ("none", "mean", "sum"):
            raise _error(op, f"unknown reduction {reduction!r}",
                         "use reduction='none', 'mean' or 'sum'")
        return reduction
    size_average = True if size_average is None else size_average
    reduce = True if reduce is None else reduce
    if not reduce:
        return "none"
    return "mean" if size_average else "sum"


# --- losses ---------------------------------------------------------------------------------


_REDUCTION_ENUM = {"none": 0, "mean": 1, "sum": 2}  # at::Reduction


def _fused_cross_entropy(input: Any, target: Any, weight: Any, label_smoothing: float) -> bool:
    """Whether :class:`CrossEntropyFused` applies (at level ``"all"``; see
    :class:`CrossEntropy`)."""
    x, t = value_of(input), value_of(target)
    return (weight is None and not label_smoothing
            and isinstance(x, torch.Tensor) and isinstance(t, torch.Tensor)
            and x.is_floating_point() and x.dim() in (1, 2) and t.dtype == torch.int64
            and t.dim() == x.dim() - 1)


@register_vjp(F.cross_entropy)
class CrossEntropy:
    """Cross-entropy of logits x (classes at dim 1, or dim 0 for an unbatched ``(C,)`` input),
    with P = softmax(x) and G the cotangent of log_softmax(x): d_x = G - P * sum_c G.

    * class-index targets t, per-sample coefficient a = d (none), d (sum) or d / W (mean,
      W = total weight of the non-ignored samples), masked by t != ignore_index:
      G = -a ((1 - eps) w[t] onehot(t) + (eps / C) w); without class weights this is the
      closed form d_x = a (P - (1 - eps) onehot(t) - eps / C), computed as
      ``(a (P - eps / C)).scatter_add(1, t, -(1 - eps) a)`` (no (N, C) one-hot).
    * probability targets (float, shape of x): q = t (1 - eps) + eps / C, G = -a q w with
      a = d / (numel / C) for mean; d_t = -(1 - eps) a w log_softmax(x).

    Class weights w get their gradient as well (d_w = sum over samples of G's weight factor;
    for class-index targets with mean reduction including the -L dW/dw term; autograd refuses
    it for class-index targets).  Sources: derivatives.yaml `_log_softmax`, `nll_loss_forward`
    (nll_loss_backward) and ATen's ``cross_entropy_loss_label_smoothing`` /
    ``cross_entropy_loss_prob_target`` (LossNLL.cpp).  The deprecated ``size_average`` /
    ``reduce`` flags are mapped onto ``reduction``.

    At fused level ``"all"`` (code built to run: :func:`fxad.compile`, :func:`fxad.joint_step`;
    :mod:`fxad.rules.fused`), for an ``(N, C)`` or ``(C,)`` input with int64 class indices, no
    class weights and no label smoothing, the forward is what ``F.cross_entropy`` runs inside,
    ``lsm = torch.log_softmax(x, -1)`` and ``torch.ops.aten.nll_loss_forward(lsm, t, None,
    reduction, ignore_index)`` (which also returns W, the total weight), and the backward is
    autograd's, ``torch.ops.aten.nll_loss_backward`` then
    ``torch.ops.aten._log_softmax_backward_data`` (derivatives.yaml `nll_loss_forward`,
    `_log_softmax`): two kernels instead of ~11 ops, saving ``lsm`` (the input's shape and
    dtype) and W instead of the input."""

    residuals = "inputs+intermediates"
    recompute = False

    def fwd(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
            reduction="mean", label_smoothing=0.0):
        reduction = _legacy_reduction("torch.nn.functional.cross_entropy", size_average,
                                      reduce, reduction)
        kw: dict[str, Any] = {}
        if weight is not None:
            kw["weight"] = weight
        if ignore_index != -100:
            kw["ignore_index"] = ignore_index
        if reduction != "mean":
            kw["reduction"] = reduction
        if label_smoothing:
            kw["label_smoothing"] = label_smoothing
        out = F.cross_entropy(input, target, **kw)
        return out, (input, target, weight, ignore_index, reduction, label_smoothing, out)

    def bwd(aux, d):
        x, target, w, ignore_index, reduction, eps, out = aux
        cdim = 0 if x.dim() == 1 else 1
        C = x.shape[cdim]
        other = tuple(k for k in range(x.dim()) if k != cdim)  # sample dims
        wb = None if w is None else (w if cdim == x.dim() - 1 else
                                     w.reshape((C,) + (1,) * (x.dim() - cdim - 1)))
        p = torch.softmax(x, cdim)

        def over_samples(v: Any) -> Any:  # sum over the sample dims -> (C,)
            return v.sum(other) if other else v

        if target.is_floating_point():  # class probabilities
            if reduction == "none":
                a = d.unsqueeze(cdim)
            elif reduction == "sum":
                a = d
            else:
                a = d / (x.numel() // C)
            q = target if not eps else target * (1 - eps) + eps / C
            g = -(a * _mul(q, wb))
            d_x = g - p * g.sum(cdim, keepdim=True)
            logp = torch.log_softmax(x, cdim)
            d_t = _mul(-(a * logp), wb)
            if eps:
                d_t = d_t * (1 - eps)
            d_w = over_samples(-(a * logp * q)) if w is not None else None
            return d_x, d_t, d_w

        valid = target != ignore_index
        t = torch.where(valid, target, 0)  # ignored samples point at class 0, masked below
        if w is None:
            # d_x = a (P - eps / C) - a (1 - eps) onehot(t): the one-hot term is scattered
            # into the sample's target class instead of materializing a (N, C) one-hot
            if reduction == "mean":
                a = (d / valid.sum()) * valid
            else:
                a = d * valid
            a = a.unsqueeze(cdim)
            base = p * a if not eps else (p - eps / C) * a
            return base.scatter_add(cdim, t.unsqueeze(cdim), a * -(1 - eps)), None, None
        onehot = F.one_hot(t, C)
        if cdim != x.dim() - 1:
            onehot = onehot.movedim(-1, cdim)
        onehot = onehot.to(x.dtype)
        wt = None if w is None else torch.take(w, t)  # weight of each sample's class
        if reduction == "mean":
            total = valid.sum() if w is None else (wt * valid).sum()
            a = (d / total) * valid
        else:
            a = d * valid
        a = a.unsqueeze(cdim)
        wmass = wt.unsqueeze(cdim) * onehot
        if eps:
            wmass = (1 - eps) * wmass + (eps / C) * wb
        g = -(a * wmass)
        d_x = g - p * g.sum(cdim, keepdim=True)
        mass = onehot if not eps else (1 - eps) * onehot + eps / C
        gw = -(torch.log_softmax(x, cdim) * mass)
        if reduction == "mean":
            gw = gw - out * onehot
        return d_x, None, over_samples(a * gw)

    def samples(dtype):
        x = randn(4, 5, dtype=dtype)
        t = torch.tensor([1, 0, 4, 2])
        yield (x, t), {}
        yield (x, torch.tensor([1, -100, 4, 1])), {"reduction": "sum"}
        yield (x, torch.tensor([1, 3, 3, 2])), {"reduction": "none", "ignore_index": 3}
        yield (x, t), {"label_smoothing": 0.2}
        yield (x, torch.tensor([1, -100, 4, 1])), {"label_smoothing": 0.1, "reduction": "none"}
        yield (randn(2, 3, 4, 2, dtype=dtype), torch.tensor([[[0, 1], [2, 2], [1, 0], [0, -100]],
                                                             [[2, 2], [1, 0], [0, 1], [1, 1]]])), {}
        yield (randn(5, dtype=dtype), torch.tensor(3)), {}
        probs = torch.softmax(randn(4, 5, dtype=dtype), 1)
        yield (x, probs), {}
        yield (x, probs), {"reduction": "none", "label_smoothing": 0.1}
        yield (x, probs, uniform((5,), 0.5, 2.0, dtype)), {"reduction": "sum"}
        yield (randn(2, 3, 4, dtype=dtype), torch.softmax(randn(2, 3, 4, dtype=dtype), 1),
               uniform((3,), 0.5, 2.0, dtype)), {"label_smoothing": 0.3}


@register_vjp(F.cross_entropy)
class CrossEntropyFused:
    """At fused level ``"all"``, (N, C) or (C,) logits with int64 class indices, no class
    weights and no label smoothing: ``lsm = torch.log_softmax(x, -1)`` and
    ``torch.ops.aten.nll_loss_forward`` (which also returns W, the total weight); backward
    ``torch.ops.aten.nll_loss_backward`` then ``torch.ops.aten._log_softmax_backward_data``
    (see :class:`CrossEntropy`)."""

    residuals = "inputs+intermediates"
    recompute = False
    fused = "all"

    def applies(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
                reduction="mean", label_smoothing=0.0):
        return _fused_cross_entropy(input, target, weight, label_smoothing)

    def fwd(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
            reduction="mean", label_smoothing=0.0):
        reduction = _legacy_reduction("torch.nn.functional.cross_entropy", size_average,
                                      reduce, reduction)
        lsm = torch.log_softmax(input, input.dim() - 1)
        red = _REDUCTION_ENUM[reduction]
        nll = torch.ops.aten.nll_loss_forward(lsm, target, None, red, ignore_index)
        return nll[0], (lsm, target, red, ignore_index, nll[1])

    def bwd(aux, d):
        lsm, target, red, ignore_index, total_weight = aux
        d_lsm = torch.ops.aten.nll_loss_backward(d, lsm, target, None, red, ignore_index,
                                                 total_weight)
        d_x = torch.ops.aten._log_softmax_backward_data(d_lsm, lsm, lsm.dim() - 1,
                                                        value_of(lsm).dtype)
        return d_x, None, None


@register_vjp(F.mse_loss)
class MseLoss:
    """l = w (x - t)^2 reduced: d_x = 2 a w (x - t), d_t = -d_x with a = d (none, sum) or
    d / n (mean; n = numel, or sum(w) when weighted); d_w = a ((x - t)^2 - L) for mean, else
    a (x - t)^2 (derivatives.yaml `mse_loss`: mse_loss_backward; weighted form as in
    ``F.mse_loss``).  Broadcasting between x and t is reduced by the engine."""

    def fwd(input, target, size_average=None, reduce=None, reduction="mean", weight=None):
        reduction = _legacy_reduction("torch.nn.functional.mse_loss", size_average, reduce,
                                      reduction)
        kw: dict[str, Any] = {}
        if reduction != "mean":
            kw["reduction"] = reduction
        if weight is not None:
            kw["weight"] = weight
        out = F.mse_loss(input, target, **kw)
        return out, (input, target, reduction, weight, out)

    def bwd(aux, d):
        x, t, reduction, w, out = aux
        diff = x - t
        if reduction == "mean":
            a = d / (diff.numel() if w is None else w.sum())
        else:
            a = d
        d_x = diff * _mul(2 * a, w)
        d_w = None
        if w is not None:
            sq = diff * diff
            d_w = a * (sq - out) if reduction == "mean" else a * sq
        return d_x, -d_x, None, None, None, d_w

    def jvp(primals, tangents):
        p, t = _bound(MseLoss.fwd, primals, tangents)
        x, tg, w, red = p["input"], p["target"], p["weight"], p["reduction"]
        out = F.mse_loss(x, tg, reduction=red, weight=w)
        diff = x - tg
        t_diff = _add(t["input"], None if t["target"] is None else -t["target"])
        t_el = None if t_diff is None else _mul(2 * diff * t_diff, w)
        if t["weight"] is not None:
            t_el = _add(t_el, diff * diff * t["weight"])
        if red == "none":
            return out, t_el
        if red == "sum":
            return out, t_el.sum()
        n = diff.numel() if w is None else w.sum()
        t_out = t_el.sum() / n
        if t["weight"] is not None:
            t_out = t_out - out * t["weight"].sum() / n
        return out, t_out

    def samples(dtype):
        yield (randn(3, 4, dtype=dtype), randn(3, 4, dtype=dtype)), {}
        yield (randn(3, 4, dtype=dtype), randn(3, 4, dtype=dtype)), {"reduction": "sum"}
        yield (randn(3, 4, dtype=dtype), randn(3, 4, dtype=dtype)), {"reduction": "none"}
        w = uniform((3, 4), 0.5, 2.0, dtype)
        yield (randn(3, 4, dtype=dtype), randn(3, 4, dtype=dtype), None, None, "mean", w), {}
        yield (randn(3, 4, dtype=dtype), randn(3, 4, dtype=dtype), None, None, "sum", w), {}
        yield (randn(3, 4, dtype=dtype), randn(3, 4, dtype=dtype), None, None, "none", w), {}


def _reduction(size_average, reduce, reduction):
    if size_average is not None or reduce is not None:
        from torch.nn import _reduction as R
        return R.legacy_get_string(size_average, reduce, emit_warning=False)
    return reduction


def _scale(d, reduction, n):
    return d / n if reduction == "mean" else d


def _numel(x) -> int:
    return math.prod(tuple(x.shape))


def _pair_samples(dtype, lo=-2.0, hi=2.0, tlo=-2.0, thi=2.0):
    yield (_t((3, 4), dtype, lo, hi), _t((3, 4), dtype, tlo, thi)), {}
    yield (_t((3, 4), dtype, lo, hi), _t((3, 4), dtype, tlo, thi)), {"reduction": "sum"}
    yield (_t((3, 4), dtype, lo, hi), _t((3, 4), dtype, tlo, thi)), {"reduction": "none"}


def _weighted(g, loss_el, w, r):
    """(d_input-like term, d_weight) for a loss with an optional elementwise weight."""
    if w is None:
        return g, None
    return g * w, r * loss_el


@register_vjp(F.l1_loss)
class L1Loss:
    """l1_loss = reduce(w |x - t|): d_x = r w sgn(x - t), d_t = -d_x, d_w = r |x - t|
    (derivatives.yaml `abs` through the composite l1_loss)."""

    def fwd(input, target, size_average=None, reduce=None, reduction="mean", weight=None):
        red = _reduction(size_average, reduce, reduction)
        kw = {} if weight is None else {"weight": weight}
        out = F.l1_loss(input, target, reduction=red, **kw)
        return out, (input, target, weight, red)

    def bwd(aux, d):
        x, t, w, red = aux
        z = x - t
        r = _scale(d, red, _numel(z))
        g, d_w = _weighted(r * torch.sgn(z), torch.abs(z) if w is not None else None, w, r)
        return g, -g, None, None, None, d_w

    def samples(dtype):
        yield from _pair_samples(dtype)


@register_vjp(F.smooth_l1_loss)
class SmoothL1Loss:
    """smooth_l1_loss(beta): d_x = r * (z / beta if |z| <= beta else sgn(z)), z = x - t;
    d_t = -d_x (derivatives.yaml `smooth_l1_loss`: smooth_l1_loss_backward)."""

    def fwd(input, target, size_average=None, reduce=None, reduction="mean", beta=1.0):
        red = _reduction(size_average, reduce, reduction)
        out = F.smooth_l1_loss(input, target, reduction=red, beta=beta)
        return out, (input, target, red, beta)

    def bwd(aux, d):
        x, t, red, beta = aux
        z = x - t
        r = _scale(d, red, _numel(z))
        if beta == 0:
            g = r * torch.sgn(z)
        else:
            g = r * torch.clamp(z / beta, -1.0, 1.0)
        return g, -g

    def samples(dtype):
        yield from _pair_samples(dtype)
        yield (_t((3, 4), dtype), _t((3, 4), dtype)), {"beta": 0.5}


@register_vjp(F.huber_loss)
class HuberLoss:
    """huber_loss(delta): d_x = r w clamp(z, -delta, delta), z = x - t; d_t = -d_x
    (derivatives.yaml `huber_loss`: huber_loss_backward)."""

    def fwd(input, target, reduction="mean", delta=1.0, weight=None):
        kw = {} if weight is None else {"weight": weight}
        out = F.huber_loss(input, target, reduction=reduction, delta=delta, **kw)
        return out, (input, target, reduction, delta, weight)

    def bwd(aux, d):
        x, t, red, delta, w = aux
        z = x - t
        r = _scale(d, red, _numel(z))
        el = None
        if w is not None:
            az = torch.abs(z)
            el = torch.where(az < delta, 0.5 * z * z, delta * (az - 0.5 * delta))
        g, d_w = _weighted(r * torch.clamp(z, -delta, delta), el, w, r)
        return g, -g, None, None, d_w

    def samples(dtype):
        yield from _pair_samples(dtype)
        yield (_t((3, 4), dtype), _t((3, 4), dtype)), {"delta": 0.5}


@register_vjp(F.soft_margin_loss)
class SoftMarginLoss:
    """soft_margin_loss = reduce(log(1 + exp(-t x))): d_x = -r t sigmoid(-t x),
    d_t = -r x sigmoid(-t x) (derivatives.yaml `soft_margin_loss`)."""

    def fwd(input, target, size_average=None, reduce=None, reduction="mean"):
        red = _reduction(size_average, reduce, reduction)
        return F.soft_margin_loss(input, target, reduction=red), (input, target, red)

    def bwd(aux, d):
        x, t, red = aux
        r = _scale(d, red, _numel(x))
        s = torch.sigmoid(-t * x) * r
        return -t * s, -x * s

    def samples(dtype):
        for red in ("mean", "sum", "none"):
            yield (_t((3, 4), dtype),), {"target": torch.sign(_t((3, 4), dtype)),
                                         "reduction": red}


@register_vjp(F.margin_ranking_loss)
class MarginRankingLoss:
    """margin_ranking_loss = reduce(clamp_min(-y (a - b) + margin, 0)): with m = (z >= 0),
    d_a = -r y m, d_b = r y m, d_y = -r (a - b) m (composite; `clamp_min`'s mask)."""

    def fwd(input1, input2, target, margin=0, size_average=None, reduce=None, reduction="mean"):
        red = _reduction(size_average, reduce, reduction)
        out = F.margin_ranking_loss(input1, input2, target, margin, reduction=red)
        return out, (input1, input2, target, margin, red)

    def bwd(aux, d):
        a, b, y, margin, red = aux
        diff = a - b
        z = -y * diff + margin
        n = _numel(z)
        m = torch.where(z >= 0, _scale(d, red, n), 0.0)
        return -y * m, y * m, -diff * m

    def samples(dtype):
        yield (_t((3, 4), dtype), _t((3, 4), dtype), _t((3, 4), dtype)), {}
        yield (_t((3, 4), dtype), _t((3, 4), dtype), _t((3, 4), dtype), 0.5), \
            {"reduction": "sum"}


@register_vjp(F.binary_cross_entropy)
class BinaryCrossEntropy:
    """bce = reduce(-w (t log x + (1 - t) log(1 - x))), logs clamped at -100:
    d_x = r w (x - t) / max(x (1 - x), 1e-12), d_t = r w (log(1 - x) - log x) (clamped)
    (derivatives.yaml `binary_cross_entropy`: binary_cross_entropy_backward /
    binary_cross_entropy_target_backward)."""

    def fwd(input, target, weight=None, size_average=None, reduce=None, reduction="mean"):
        red = _reduction(size_average, reduce, reduction)
        out = F.binary_cross_entropy(input, target, weight, reduction=red)
        return out, (input, target, weight, red)

    def bwd(aux, d):
        x, t, w, red = aux
        r = _scale(d, red, _numel(x))
        if w is not None:
            r = r * w
        d_x = r * (x - t) / torch.clamp_min(x * (1 - x), 1e-12)
        d_t = r * (torch.clamp_min(torch.log1p(-x), -100.0) - torch.clamp_min(torch.log(x),
                                                                              -100.0))
        return d_x, d_t

    def samples(dtype):
        yield (_t((3, 4), dtype, 0.1, 0.9), _t((3, 4), dtype, 0.0, 1.0)), {}
        yield (_t((3, 4), dtype, 0.1, 0.9), _t((3, 4), dtype, 0.0, 1.0)), {"reduction": "none"}


@register_vjp(F.binary_cross_entropy_with_logits)
class BCEWithLogits:
    """bce_with_logits = reduce(-w (pw t logsigmoid(x) + (1 - t) logsigmoid(-x))):
    d_x = r w ((pw t + 1 - t) sigmoid(x) - pw t), d_t = r w (logsigmoid(-x) - pw logsigmoid(x))
    (derivatives.yaml `binary_cross_entropy_with_logits`)."""

    def fwd(input, target, weight=None, size_average=None, reduce=None, reduction="mean",
            pos_weight=None):
        red = _reduction(size_average, reduce, reduction)
        out = F.binary_cross_entropy_with_logits(input, target, weight, reduction=red,
                                                 pos_weight=pos_weight)
        return out, (input, target, weight, red, pos_weight)

    def bwd(aux, d):
        x, t, w, red, pw = aux
        n = _numel(x) if tuple(x.shape) == tuple(t.shape) else \
            math.prod(torch.broadcast_shapes(tuple(x.shape), tuple(t.shape)))
        r0 = _scale(d, red, n)
        r = r0 if w is None else r0 * w
        s = torch.sigmoid(x)
        res: dict[str, Any] = {}
        if pw is None:
            res["input"], res["target"] = r * (s - t), r * -x
            el = F.binary_cross_entropy_with_logits(x, t, reduction="none") \
                if w is not None else None
        else:
            pt = pw * t
            res["input"] = r * ((pt + 1 - t) * s - pt)
            res["target"] = r * (F.logsigmoid(-x) - pw * F.logsigmoid(x))
            res["pos_weight"] = -r * t * F.logsigmoid(x)
            el = F.binary_cross_entropy_with_logits(x, t, reduction="none", pos_weight=pw) \
                if w is not None else None
        if w is not None:
            res["weight"] = r0 * el
        return res

    def samples(dtype):
        yield (_t((3, 4), dtype), _t((3, 4), dtype, 0.0, 1.0)), {}
        yield (_t((3, 4), dtype), _t((3, 4), dtype, 0.0, 1.0)), \
            {"reduction": "sum", "pos_weight": _t((4,), dtype, 0.5, 2.0)}
        yield (_t((3, 4), dtype), _t((3, 4), dtype, 0.0, 1.0)), {"weight": _t((4,), dtype)}


@register_vjp(F.kl_div)
class KLDiv:
    """kl_div(x, t) = reduce(t (log t - x)) (or exp(t) (t - x) with log_target):
    d_x = -r t (-r exp(t)), d_t = r (log t + 1 - x) (r exp(t) (t + 1 - x)); 'batchmean'
    divides by x.size(0) (derivatives.yaml `kl_div`)."""

    def fwd(input, target, size_average=None, reduce=None, reduction="mean", log_target=False):
        red = _reduction(size_average, reduce, reduction)
        out = F.kl_div(input, target, reduction=red, log_target=log_target)
        return out, (input, target, red, log_target)

    def bwd(aux, d):
        x, t, red, log_target = aux
        shape = torch.broadcast_shapes(tuple(x.shape), tuple(t.shape))
        if red == "batchmean":
            r = d / shape[0] if len(shape) > 0 else d
        else:
            r = _scale(d, red, math.prod(shape))
        if log_target:
            et = torch.exp(t)
            return -r * et, r * et * (t + 1 - x)
        return -r * t, r * (torch.log(t) + 1 - x)

    def samples(dtype):
        yield (_t((3, 4), dtype), _t((3, 4), dtype, 0.1, 1.0)), {}
        yield (_t((3, 4), dtype), _t((3, 4), dtype)), {"reduction": "batchmean",
                                                       "log_target": True}


@register_vjp(F.nll_loss)
class NLLLoss:
    """nll_loss(x, t, w) = reduce(-w[t] x[t]) over non-ignored targets, class dim 1 (0 for a
    1-d input): d_x = zeros with -r w[t] scattered at t; 'mean' divides by sum(w[t])
    (derivatives.yaml `nll_loss`: nll_loss_backward)."""

    def fwd(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
            reduction="mean"):
        red = _reduction(size_average, reduce, reduction)
        out = F.nll_loss(input, target, weight, ignore_index=ignore_index, reduction=red)
        return out, (input, target, weight, ignore_index, red)

    def bwd(aux, d):
        x, t, w, ignore, red = aux
        cdim = 0 if x.dim() == 1 else 1
        keep = t != ignore
        ts = torch.where(keep, t, 0)
        wt = keep.to(x.dtype) if w is None else w[ts] * keep
        g = -wt * d
        if red == "mean":
            g = g / torch.sum(wt)
        d_x = torch.zeros_like(x).scatter(cdim, torch.unsqueeze(ts, cdim),
                                          torch.unsqueeze(g, cdim))
        return (d_x,)

    def samples(dtype):
        yield (_t((3, 4), dtype), torch.tensor([0, 3, 1])), {}
        yield (_t((3, 4), dtype), torch.tensor([0, 3, 1])), \
            {"weight": _t((4,), dtype, 0.5, 1.5), "reduction": "sum", "ignore_index": 3}
        yield (_t((2, 4, 3), dtype), torch.tensor([[0, 3, 1], [2, 2, 0]])), {"reduction": "none"}


@register_vjp(F.poisson_nll_loss)
class PoissonNLLLoss:
    """poisson_nll_loss: log_input: l = exp(x) - t x, d_x = exp(x) - t, d_t = -x; else
    l = x - t log(x + eps), d_x = 1 - t / (x + eps), d_t = -log(x + eps); full adds the
    Stirling term t log t - t + log(2 pi t)/2 for t > 1, d_t += log t + 1/(2t) (composite)."""

    def fwd(input, target, log_input=True, full=False, size_average=None, eps=1e-8,
            reduce=None, reduction="mean"):
        red = _reduction(size_average, reduce, reduction)
        out = F.poisson_nll_loss(input, target, log_input, full, eps=eps, reduction=red)
        return out, (input, target, log_input, full, eps, red)

    def bwd(aux, d):
        x, t, log_input, full, eps, red = aux
        r = _scale(d, red, math.prod(torch.broadcast_shapes(tuple(x.shape), tuple(t.shape))))
        if log_input:
            d_x, d_t = r * (torch.exp(x) - t), -r * x
        else:
            d_x, d_t = r * (1 - t / (x + eps)), -r * torch.log(x + eps)
        if full:
            d_t = d_t + r * torch.where(t > 1, torch.log(t) + 0.5 / t, 0.0)
        return d_x, d_t

    def samples(dtype):
        yield (_t((3, 4), dtype), _t((3, 4), dtype, 0.0, 3.0)), {}
        yield (_t((3, 4), dtype, 0.1, 2.0), _t((3, 4), dtype, 0.5, 3.0), False, True), \
            {"reduction": "sum"}


@register_vjp(F.hinge_embedding_loss)
class HingeEmbeddingLoss:
    """hinge_embedding_loss = reduce(where(t != 1, clamp_min(margin - x, 0), 0)
    + where(t != -1, x, 0)): d_x = r ((t != -1) - (t != 1)(margin - x >= 0)); the target
    only selects (composite; `clamp_min`'s mask)."""

    def fwd(input, target, margin=1.0, size_average=None, reduce=None, reduction="mean"):
        red = _reduction(size_average, reduce, reduction)
        out = F.hinge_embedding_loss(input, target, margin, reduction=red)
        return out, (input, target, margin, red)

    def bwd(aux, d):
        x, t, margin, red = aux
        r = _scale(d, red, math.prod(torch.broadcast_shapes(tuple(x.shape), tuple(t.shape))))
        g = (t != -1).to(x.dtype) - ((t != 1) & (margin - x >= 0)).to(x.dtype)
        return r * g, None

    def samples(dtype):
        yield (_t((3, 4), dtype),), {"target": torch.sign(_t((3, 4), dtype))}


@register_vjp(F.multilabel_soft_margin_loss)
class MultilabelSoftMarginLoss:
    """multilabel_soft_margin_loss = reduce(mean over classes of -w (t logsigmoid(x)
    + (1 - t) logsigmoid(-x))): d_x = r w (sigmoid(x) - t) / C, d_t = -r w x / C
    (composite)."""

    def fwd(input, target, weight=None, size_average=None, reduce=None, reduction="mean"):
        red = _reduction(size_average, reduce, reduction)
        out = F.multilabel_soft_margin_loss(input, target, weight, reduction=red)
        return out, (input, target, weight, red)

    def bwd(aux, d):
        x, t, w, red = aux
        c = x.shape[-1]
        n = math.prod(tuple(x.shape[:-1]))
        r = _scale(d, red, n)
        if red == "none" and x.dim() > 1:
            r = torch.unsqueeze(r, -1)
        r = r / c
        el = None
        if w is not None:
            el = -(t * F.logsigmoid(x) + (1 - t) * F.logsigmoid(-x))
            rw = r * w
        else:
            rw = r
        d_w = r * el if w is not None else None
        return rw * (torch.sigmoid(x) - t), -rw * x, d_w

    def samples(dtype):
        yield (_t((3, 4), dtype), _t((3, 4), dtype, 0.0, 1.0)), {}
        yield (_t((3, 4), dtype), _t((3, 4), dtype, 0.0, 1.0)), {"reduction": "none"}


@register_vjp(F.cosine_embedding_loss)
class CosineEmbeddingLoss:
    """cosine_embedding_loss: cos = sum(a b) / sqrt((|a|^2 + e)(|b|^2 + e)), e = 1e-12;
    l = 1 - cos (y = 1), clamp_min(cos - margin, 0) (y = -1): dl/dcos = -1 or
    (cos - margin >= 0); d_a = r dl/dcos (b / den - cos a / (|a|^2 + e)) (ATen composite
    cosine_embedding_loss)."""

    def fwd(input1, input2, target, margin=0, size_average=None, reduce=None,
            reduction="mean"):
        red = _reduction(size_average, reduce, reduction)
        out = F.cosine_embedding_loss(input1, input2, target, margin, reduction=red)
        return out, (input1, input2, target, margin, red)

    def bwd(aux, d):
        a, b, y, margin, red = aux
        dim = a.dim() - 1
        m1 = torch.sum(a * a, dim) + 1e-12
        m2 = torch.sum(b * b, dim) + 1e-12
        den = torch.sqrt(m1 * m2)
        cos = torch.sum(a * b, dim) / den
        r = _scale(d, red, math.prod(tuple(cos.shape)))
        dc = torch.where(y == 1, -1.0, 0.0) + torch.where(y == -1, (cos - margin >= 0)
                                                          .to(cos.dtype), 0.0)
        g = torch.unsqueeze(r * dc, dim)
        c, den, m1, m2 = (torch.unsqueeze(v, dim) for v in (cos, den, m1, m2))
        return g * (b / den - c * a / m1), g * (a / den - c * b / m2), None

    def samples(dtype):
        yield (_t((3, 4), dtype), _t((3, 4), dtype)), {"target": torch.tensor([1, -1, -1])}
        yield (_t((4,), dtype), _t((4,), dtype)), {"target": torch.tensor(-1),
                                                   "margin": -0.5, "reduction": "sum"}


@register_vjp(F.triplet_margin_loss)
class TripletMarginLoss:
    """triplet_margin_loss = reduce(clamp_min(margin + d(a, p) - d_neg, 0)), d = pairwise
    p-norm distance, d_neg = d(a, n) or min(d(a, n), d(p, n)) with swap (ties split): each
    distance's cotangent r (z >= 0) (+-1) goes through its p-norm (derivatives.yaml
    `linalg_vector_norm`, `clamp_min`, `minimum`)."""

    def fwd(anchor, positive, negative, margin=1.0, p=2, eps=1e-6, swap=False,
            size_average=None, reduce=None, reduction="mean"):
        red = _reduction(size_average, reduce, reduction)
        out = F.triplet_margin_loss(anchor, positive, negative, margin, p, eps, swap,
                                    reduction=red)
        return out, (anchor, positive, negative, margin, p, eps, swap, red)

    def bwd(aux, d):
        a, pos, neg, margin, p, eps, swap, red = aux

        def dist(u, v):
            z = u - v + eps
            return z, torch.linalg.vector_norm(z, p, -1, keepdim=True)

        z_ap, d_ap = dist(a, pos)
        z_an, d_an = dist(a, neg)
        d_neg = d_an
        if swap:
            z_pn, d_pn = dist(pos, neg)
            d_neg = torch.minimum(d_an, d_pn)
        z = margin + d_ap - d_neg
        r = _scale(d, red, math.prod(tuple(z.shape)))
        if z.dim() > r.dim():
            r = torch.unsqueeze(r, -1)
        m = torch.where(z >= 0, r, 0.0)
        g_ap = pnorm_grad(z_ap, d_ap, p, m, -1)
        if swap:
            w_an = torch.where(d_an < d_pn, 1.0, torch.where(d_an == d_pn, 0.5, 0.0))
            g_an = pnorm_grad(z_an, d_an, p, -m * w_an, -1)
            g_pn = pnorm_grad(z_pn, d_pn, p, -m * (1 - w_an), -1)
            return g_ap + g_an, -g_ap + g_pn, -g_an - g_pn
        g_an = pnorm_grad(z_an, d_an, p, -m, -1)
        return g_ap + g_an, -g_ap, -g_an

    def samples(dtype):
        yield (_t((3, 4), dtype), _t((3, 4), dtype), _t((3, 4), dtype)), {}
        yield (_t((3, 4), dtype), _t((3, 4), dtype), _t((3, 4), dtype), 2.0, 1.5), \
            {"swap": True, "reduction": "none"}


# --- margin losses --------------------------------------------------------------------------


def _rows(x: Any) -> tuple[Any, int, int]:
    """Scores as (N, C) rows (a 0-d input is one row of one class)."""
    c = x.shape[-1] if x.dim() > 0 else 1
    n = x.numel() // c if c else 0
    return torch.reshape(x, (n, c)), n, c


def _per_sample(d: Any, reduction: str, n: int) -> Any:
    """Cotangent of each sample's loss as an (N, 1) column (or a scalar)."""
    if reduction == "none":
        return torch.reshape(d, (-1, 1))
    return d / n if reduction == "mean" else d


def _reduce_tangent(t: Any, reduction: str, out: Any) -> Any:
    """Per-sample loss tangents (N,) reduced like the loss."""
    if reduction == "none":
        return torch.reshape(t, tuple(out.shape))
    return t.mean() if reduction == "mean" else t.sum()


def _multi_margin_parts(x: Any, target: Any, p: int, margin: float, weight: Any) -> tuple:
    """(G, h, onehot, n): G (N, C) gradient of each sample's loss with respect to its scores,
    h (N,) the sum of the active hinge terms (before the class weight), for
    loss_n = w[y_n] / C sum_{i != y_n} max(0, margin - x[y_n] + x[i])^p."""
    x2, n, c = _rows(x)
    y = torch.reshape(target, (-1,))
    onehot = F.one_hot(y, c).to(x.dtype)
    z = margin - (x2 * onehot).sum(1, keepdim=True) + x2
    act = (z > 0) & (onehot == 0)
    h = torch.where(act, z if p == 1 else z * z, 0.0).sum(1)
    gz = (act.to(x.dtype) if p == 1 else torch.where(act, 2.0 * z, 0.0)) / c
    if weight is not None:
        gz = gz * torch.unsqueeze(torch.take(weight, y), 1)
    return gz - onehot * gz.sum(1, keepdim=True), h, onehot, n, c


def _nn_reduction(op: str, size_average: Any, reduce: Any, reduction: str) -> str:

    return _legacy_reduction(op, size_average, reduce, reduction)


@register_vjp(F.multi_margin_loss)
class MultiMarginLoss:
    """multi_margin_loss(x, y, p, margin, w): per sample
    loss_n = w[y] / C sum_{i != y} max(0, margin - x[y] + x[i])^p.  With z_i the hinge
    argument and active = z_i > 0 (strict, as the ATen kernel): d x[i] = w[y] / C (1 or
    2 z_i) for active i != y, d x[y] = -sum of those (derivatives.yaml `multi_margin_loss`:
    multi_margin_loss_backward); scaled by the reduction (mean: 1/N).  The class weight gets
    d_w[y_n] += d_n h_n / C with h_n the sum of active hinge terms (autograd refuses it; the
    loss is linear in w).  p must be 1 or 2 (as in PyTorch)."""

    def fwd(input, target, p=1, margin=1.0, weight=None, size_average=None, reduce=None,
            reduction="mean"):
        red = _nn_reduction("torch.nn.functional.multi_margin_loss", size_average, reduce,
                            reduction)
        out = F.multi_margin_loss(input, target, p, margin, weight, reduction=red)
        return out, (input, target, p, margin, weight, red)

    def bwd(aux, d):
        x, target, p, margin, w, red = aux
        g, h, onehot, n, c = _multi_margin_parts(x, target, p, margin, w)
        a = _per_sample(d, red, n)
        d_x = torch.reshape(a * g, tuple(x.shape))
        d_w = None
        if w is not None:
            d_w = (onehot * (a * torch.unsqueeze(h, 1) / c)).sum(0)
        return d_x, None, None, None, d_w

    def jvp(primals, tangents):
        x, target, p, margin, w, size_average, reduce, reduction = primals
        t_x, t_w = tangents[0], tangents[4]
        red = _nn_reduction("torch.nn.functional.multi_margin_loss", size_average, reduce,
                            reduction)
        out = F.multi_margin_loss(x, target, p, margin, w, reduction=red)
        g, h, onehot, n, c = _multi_margin_parts(x, target, p, margin, w)
        t = None
        if t_x is not None:
            t = (g * _rows(t_x)[0]).sum(1)
        if t_w is not None:
            t = _add(t, torch.take(t_w, torch.reshape(target, (-1,))) * h / c)
        return out, (None if t is None else _reduce_tangent(t, red, out))

    def samples(dtype):
        x = randn(4, 5, dtype=dtype)
        y = torch.tensor([1, 0, 4, 2])
        w = uniform((5,), 0.5, 2.0, dtype)
        yield (x, y), {}
        yield (x, y, 2), {"margin": 0.5, "reduction": "sum"}
        yield (x, y), {"p": 1, "margin": 1.5, "weight": w, "reduction": "none"}
        yield (x, y, 2, 1.0), {"weight": w}
        yield (randn(5, dtype=dtype), torch.tensor(3)), {"reduction": "none"}
        yield (randn(dtype=dtype), torch.tensor(0)), {}


def _multilabel_parts(x: Any, target: Any) -> tuple[Any, int]:
    """(G, n): G (N, C) gradient of each sample's loss with respect to its scores, for
    loss_n = 1/C sum_{j valid} sum_{i not a target} max(0, 1 - x[y_j] + x[i]); the valid
    targets are those before the first negative entry."""
    x2, n, c = _rows(x)
    t2 = torch.reshape(target, (n, c))
    valid = torch.cumprod((t2 >= 0).to(torch.int64), 1) > 0
    tc = torch.clamp_min(t2, 0)
    oh = F.one_hot(tc, c) * torch.unsqueeze(valid, -1)           # (N, J, C)
    is_target = oh.sum(1) > 0                                      # (N, C)
    z = 1.0 - torch.unsqueeze(torch.gather(x2, 1, tc), -1) + torch.unsqueeze(x2, 1)
    act = ((z > 0) & torch.unsqueeze(valid, -1) & ~torch.unsqueeze(is_target, 1)).to(x.dtype)
    pulled = (oh.to(x.dtype) * torch.unsqueeze(act.sum(2), -1)).sum(1)
    return (act.sum(1) - pulled) / c, n


@register_vjp(F.multilabel_margin_loss)
class MultilabelMarginLoss:
    """multilabel_margin_loss(x, y): per sample
    loss = 1/C sum_{j} sum_{i not in targets} max(0, 1 - (x[y_j] - x[i])), j running over the
    target entries before the first negative one.  Each active pair (z > 0, strict as the
    ATen kernel) adds 1/C to d x[i] and -1/C to d x[y_j] (derivatives.yaml
    `multilabel_margin_loss`: multilabel_margin_loss_backward); scaled by the reduction."""

    def fwd(input, target, size_average=None, reduce=None, reduction="mean"):
        red = _nn_reduction("torch.nn.functional.multilabel_margin_loss", size_average, reduce,
                            reduction)
        out = F.multilabel_margin_loss(input, target, reduction=red)
        return out, (input, target, red)

    def bwd(aux, d):
        x, target, red = aux
        g, n = _multilabel_parts(x, target)
        return torch.reshape(_per_sample(d, red, n) * g, tuple(x.shape)), None

    def jvp(primals, tangents):
        x, target, size_average, reduce, reduction = primals
        red = _nn_reduction("torch.nn.functional.multilabel_margin_loss", size_average, reduce,
                            reduction)
        out = F.multilabel_margin_loss(x, target, reduction=red)
        t_x = tangents[0]
        if t_x is None:
            return out, None
        g, n = _multilabel_parts(x, target)
        return out, _reduce_tangent((g * _rows(t_x)[0]).sum(1), red, out)

    def samples(dtype):
        x = randn(3, 5, dtype=dtype)
        y = torch.tensor([[3, 0, -1, 1, 2], [4, 4, 1, -1, 0], [0, 1, 2, 3, 4]])
        yield (x, y), {}
        yield (x, y), {"reduction": "none"}
        yield (x, y), {"reduction": "sum"}
        yield (randn(4, dtype=dtype), torch.tensor([2, -1, 0, 1])), {"reduction": "none"}
        yield (randn(dtype=dtype), torch.tensor(0)), {}


# --- linear cross-entropy -------------------------------------------------------------------


def _lce_logits(x: Any, w: Any, b: Any) -> tuple[Any, Any, Any]:
    """(logits in the loss's layout, flat weight (C * prod(d), D), flat bias)."""
    c, extra, d_in = w.shape[0], tuple(w.shape[1:-1]), w.shape[-1]
    rows = c
    for s in extra:
        rows *= s
    w2 = torch.reshape(w, (rows, d_in))
    b2 = None if b is None else torch.reshape(b, (rows,))
    logits = F.linear(x, w2, b2)
    return torch.reshape(logits, tuple(x.shape[:-1]) + (c,) + extra), w2, b2


def _lce_ce_aux(logits: Any, target: Any, weight: Any, ignore_index: Any, reduction: str,
                label_smoothing: float, out: Any) -> tuple:
    ii = -100 if ignore_index is None else ignore_index
    return (logits, target, weight, ii, reduction, label_smoothing, out)


def _lce_chunked(w: Any, target: Any, reduction: str, label_smoothing: float,
                 options: Any) -> bool:
    """True when ``F.linear_cross_entropy`` takes its chunked path (the conditions it checks;
    otherwise it warns and runs the reference composite)."""
    return (options is not None and reduction in ("mean", "sum", "none")
            and label_smoothing == 0.0 and target.dtype == torch.int64 and w.dim() == 2)


class LinearCrossEntropy:
    """linear_cross_entropy(x, W, target, linear_bias=b, ...) = cross_entropy(linear(x, W, b)
    reshaped to (N, C, d...), target, ...).  The cotangent G of the logits is the
    cross-entropy backward of :class:`fxad.rules.nn.CrossEntropy` (derivatives.yaml
    `_log_softmax` / `nll_loss_forward`), then d_x = G W, d_W = G^T x, d_b = sum(G) over
    samples (derivatives.yaml `linear` / `addmm`).  The forward calls the op itself, so its
    chunked path (``options``) is kept; the backward recomputes the logits.  JVP: the logits'
    tangent t_z = linear(t_x, W) + linear(x, t_W) + t_b, paired with the per-sample
    cross-entropy gradient (rows are independent, so reduction='none' sums over the class dim
    only); class weights enter linearly per sample.  Class weights: autograd refuses their
    gradient on the reference path (``options=None``; fxad gives the exact one, as its
    ``cross_entropy`` rule) and the chunked op returns none, so with ``options`` fxad returns
    none either (matching autograd) when that path is taken."""

    def fwd(input, linear_weight, target, *, linear_bias=None, weight=None, reduction="mean",
            ignore_index=None, label_smoothing=0.0, options=None):
        out = F.linear_cross_entropy(input, linear_weight, target, linear_bias=linear_bias,
                                     weight=weight, reduction=reduction,
                                     ignore_index=ignore_index,
                                     label_smoothing=label_smoothing, options=options)
        return out, (input, linear_weight, target, linear_bias, weight, reduction,
                     ignore_index, label_smoothing, out,
                     _lce_chunked(linear_weight, target, reduction, label_smoothing, options))

    def bwd(aux, d):
        x, w, target, b, cw, red, ii, eps, out, chunked = aux
        logits, w2, _ = _lce_logits(x, w, b)
        d_z, d_t, d_cw = CrossEntropy.bwd(_lce_ce_aux(logits, target, cw, ii, red, eps, out), d)
        g = torch.reshape(d_z, tuple(x.shape[:-1]) + (w2.shape[0],))
        d_x = torch.matmul(g, w2)
        if x.dim() == 1:
            d_w2 = torch.outer(g, x)
        else:
            d_w2 = torch.matmul(torch.transpose(g, 0, 1), x)
        d_b = None
        if b is not None:
            d_b = torch.reshape(g if x.dim() == 1 else g.sum(0), tuple(b.shape))
        return {"input": d_x, "linear_weight": torch.reshape(d_w2, tuple(w.shape)),
                "target": d_t, "linear_bias": d_b, "weight": None if chunked else d_cw}

    def jvp(primals, tangents):
        x, w, target, b, cw, red, ii, eps, options = primals
        t_x, t_w, t_t, t_b, t_cw = tangents[:5]
        out = F.linear_cross_entropy(x, w, target, linear_bias=b, weight=cw, reduction=red,
                                     ignore_index=ii, label_smoothing=eps, options=options)
        logits, w2, _ = _lce_logits(x, w, b)
        zshape = tuple(logits.shape)
        t_z = None
        if t_x is not None:
            t_z = torch.reshape(F.linear(t_x, w2), zshape)
        if t_w is not None:
            t_z = _add(t_z, torch.reshape(F.linear(x, torch.reshape(t_w, tuple(w2.shape))),
                                          zshape))
        if t_b is not None:
            t_z = _add(t_z, torch.reshape(t_b, zshape[x.dim() - 1:]))
        ones = torch.ones_like(out)
        g_z, g_t, g_cw = CrossEntropy.bwd(_lce_ce_aux(logits, target, cw, ii, red, eps, out),
                                          ones)
        cdim = 0 if logits.dim() == 1 else 1
        t = None
        for g, tt in ((g_z, t_z), (g_t, t_t)):
            if tt is None or g is None:
                continue
            prod = g * tt
            t = _add(t, prod.sum(cdim) if red == "none" else prod.sum())
        if t_cw is not None and not _lce_chunked(w, target, red, eps, options):
            if red == "none":  # each sample's loss is linear in the class weights
                t = _add(t, F.cross_entropy(logits, target, weight=t_cw, reduction="none",
                                            ignore_index=-100 if ii is None else ii,
                                            label_smoothing=eps))
            elif g_cw is not None:
                t = _add(t, (g_cw * t_cw).sum())
        return out, t

    def samples(dtype):
        x, w = randn(6, 3, dtype=dtype), randn(4, 3, dtype=dtype)
        t = torch.tensor([1, 0, 3, 2, 2, 1])
        yield (x, w, t), {}
        yield (x, w, t), {"linear_bias": randn(4, dtype=dtype), "reduction": "sum"}
        yield (x, w, torch.tensor([1, -100, 3, 2, 2, 1])), {"reduction": "none"}
        yield (x, w, t), {"label_smoothing": 0.1, "weight": uniform((4,), 0.5, 2.0, dtype)}
        yield (randn(3, dtype=dtype), w, torch.tensor(2)), {}
        yield (randn(4, 3, dtype=dtype), randn(2, 3, 3, dtype=dtype),
               torch.tensor([[0, 1, 1], [1, 0, 0], [1, 1, 1], [0, 0, 1]])), {}
        yield (x, w, torch.softmax(randn(6, 4, dtype=dtype), 1)), {"reduction": "none"}


if hasattr(F, "linear_cross_entropy"):  # PyTorch 2.12 and later
    register_vjp(F.linear_cross_entropy)(LinearCrossEntropy)


# --------------------------------------------------------------------------------------------
# gaussian_nll_loss
# --------------------------------------------------------------------------------------------

def _gnll_var(input: Any, var: Any) -> tuple[Any, bool]:
    """var shaped as in F.gaussian_nll_loss (one fewer dim -> unsqueezed last dim)."""
    if tuple(var.shape) != tuple(input.shape) and tuple(input.shape[:-1]) == tuple(var.shape):
        return torch.unsqueeze(var, -1), True
    return var, False


@register_vjp(F.gaussian_nll_loss)
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


# --- CTC loss -------------------------------------------------------------------------------

def _ctc_lengths(x: Any, n: int, like: Any) -> Any:
    """Per-sequence lengths as an int64 ``(n,)`` tensor (from a tensor, a list or an int)."""
    if _is_t(x):
        return torch.reshape(x, (n,)).to(torch.int64)
    vals = [int(v) for v in x] if isinstance(x, (list, tuple)) else [int(x)]
    # (built from recorded factories: one ``full`` when all lengths agree)
    if len(set(vals)) <= 1:
        return torch.full((n,), vals[0] if vals else 0, dtype=torch.int64, device=like.device)
    return torch.stack([torch.full((), v, dtype=torch.int64, device=like.device)
                        for v in vals])


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


@register_vjp(torch.nn.functional.ctc_loss)
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
