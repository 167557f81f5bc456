"""More ``torch.nn.functional`` rules: pointwise activations (``elu``, ``selu``, ``celu``,
``leaky_relu``, ``hardtanh``, ``relu6``, ``hardsigmoid``, ``hardswish``, ``mish``,
``softplus``, ``threshold``, ``softshrink``, ``hardshrink``), ``glu``, ``softmin``,
``normalize``, ``cosine_similarity``, ``pairwise_distance``, losses (``l1_loss``,
``smooth_l1_loss``, ``huber_loss``, ``soft_margin_loss``, ``margin_ranking_loss``,
``binary_cross_entropy(_with_logits)``, ``kl_div``, ``nll_loss``), ``pad`` and
``pixel_shuffle``/``pixel_unshuffle``/``channel_shuffle``.

Formulas follow PyTorch's ``tools/autograd/derivatives.yaml`` (entry named in each rule).
Masks use the same strict/non-strict comparisons as the ATen backward kernels, so the
cotangent at a kink equals autograd's.  Broadcast cotangents are reduced by the engine.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from ._base import randn, uniform

from .registry import add_rule

_SELU_ALPHA = 1.6732632423543772848170429916717
_SELU_SCALE = 1.0507009873554804934193349852946


def _t(shape: tuple, dtype: torch.dtype, lo: float = -2.0, hi: float = 2.0) -> torch.Tensor:
    return uniform(shape, lo, hi, dtype)


def _is_t(x: Any) -> bool:
    return isinstance(x, torch.Tensor) or hasattr(x, "node")


def _reg(op: Any, cls: type) -> type:
    d = cls.__dict__
    f = lambda k: (lambda v: v.__func__ if isinstance(v, staticmethod) else v)(d.get(k))  # noqa
    add_rule(op, f("fwd"), f("bwd"), jvp=f("jvp"), samples=f("samples"),
             source=(cls.__doc__ or "").strip(), builtin=True)
    return cls


def builtin(*ops: Any):
    def deco(cls: type) -> type:
        for op in ops:
            _reg(op, cls)
        return cls
    return deco


# --- pointwise activations: y = f(x), d_x = d * f'(x) ------------------------------------------

def _pointwise(op: Any, fwd: Any, deriv: Any, doc: str, samples: Any = None) -> None:
    """``fwd(input, *params) -> value``; ``deriv(x, value, *params) -> f'``."""
    import inspect

    sig = inspect.signature(fwd)
    names = list(sig.parameters)

    def bwd(aux, d):
        x, out, params = aux
        return (d * deriv(x, out, *params),)

    def jvp(primals, tangents):
        x, params = primals[0], primals[1:]
        out = fwd(x, *params)
        t = tangents[0]
        return out, (None if t is None else t * deriv(x, out, *params))

    ns: dict[str, Any] = {"_f": fwd}
    src = (f"def fwd({', '.join(str(p) for p in sig.parameters.values())}):\n"
           f"    out = _f({', '.join(names)})\n"
           f"    return out, ({names[0]}, out, ({''.join(n + ', ' for n in names[1:])}))\n")
    exec(src, ns)  # a fwd with the op's exact parameter names and defaults

    def default_samples(dtype):
        yield (_t((3, 4), dtype, -4.0, 4.0),), {}
        yield (_t((), dtype, -4.0, 4.0),), {}

    add_rule(op, ns["fwd"], bwd, jvp=jvp, samples=samples or default_samples, source=doc,
             builtin=True)


def _where(c, a, b):
    return torch.where(c, a, b)


_pointwise(F.elu, lambda input, alpha=1.0, inplace=False: F.elu(input, alpha),
           lambda x, y, alpha, inplace: _where(x > 0, 1.0, alpha * torch.exp(x)),
           "elu: d_x = d * (1 if x > 0 else alpha exp(x)) (derivatives.yaml `elu`: "
           "elu_backward)")
_pointwise(F.celu, lambda input, alpha=1.0, inplace=False: F.celu(input, alpha),
           lambda x, y, alpha, inplace: _where(x > 0, 1.0, torch.exp(x / alpha)),
           "celu: d_x = d * (1 if x > 0 else exp(x / alpha)) (derivatives.yaml `celu`)")
_pointwise(F.selu, lambda input, inplace=False: F.selu(input),
           lambda x, y, inplace: _where(x > 0, _SELU_SCALE,
                                        (_SELU_SCALE * _SELU_ALPHA) * torch.exp(x)),
           "selu: d_x = d * scale * (1 if x > 0 else alpha exp(x)) (derivatives.yaml `selu`: "
           "elu_backward)")
_pointwise(F.leaky_relu,
           lambda input, negative_slope=0.01, inplace=False: F.leaky_relu(input, negative_slope),
           lambda x, y, s, inplace: _where(x > 0, 1.0, float(s)),
           "leaky_relu: d_x = d * (1 if x > 0 else slope) (derivatives.yaml `leaky_relu`)")
_pointwise(F.hardtanh,
           lambda input, min_val=-1.0, max_val=1.0, inplace=False: F.hardtanh(input, min_val,
                                                                              max_val),
           lambda x, y, lo, hi, inplace: ((x > lo) & (x < hi)).to(x.dtype),
           "hardtanh: d_x = d where min < x < max, else 0 (derivatives.yaml `hardtanh`: "
           "hardtanh_backward)")
_pointwise(F.relu6, lambda input, inplace=False: F.relu6(input),
           lambda x, y, inplace: ((x > 0) & (x < 6)).to(x.dtype),
           "relu6 = hardtanh(x, 0, 6): d_x = d where 0 < x < 6 (derivatives.yaml `hardtanh`)")
_pointwise(F.hardsigmoid, lambda input, inplace=False: F.hardsigmoid(input),
           lambda x, y, inplace: ((x > -3) & (x < 3)).to(x.dtype) / 6,
           "hardsigmoid: d_x = d / 6 where -3 < x < 3 (derivatives.yaml `hardsigmoid`)")
_pointwise(F.hardswish, lambda input, inplace=False: F.hardswish(input),
           lambda x, y, inplace: _where(x < -3, 0.0, _where(x <= 3, x / 3 + 0.5, 1.0)),
           "hardswish: d_x = d * (0 if x < -3, x/3 + 1/2 if x <= 3, else 1) "
           "(derivatives.yaml `hardswish`: hardswish_backward)")


def _mish_d(x, y, inplace):
    tsp = torch.tanh(F.softplus(x))
    return tsp + x * torch.sigmoid(x) * (1 - tsp * tsp)


_pointwise(F.mish, lambda input, inplace=False: F.mish(input), _mish_d,
           "mish = x tanh(softplus(x)): d_x = d * (tanh(sp) + x sigmoid(x) (1 - tanh(sp)^2)) "
           "(derivatives.yaml `mish`: mish_backward)")


def _softplus_d(x, y, beta, threshold):
    z = x * beta
    return _where(z > threshold, 1.0, torch.sigmoid(z))


_pointwise(F.softplus, lambda input, beta=1.0, threshold=20.0: F.softplus(input, beta, threshold),
           _softplus_d,
           "softplus: d_x = d * sigmoid(beta x), d where beta x > threshold "
           "(derivatives.yaml `softplus`: softplus_backward)")
_pointwise(F.threshold,
           lambda input, threshold, value, inplace=False: F.threshold(input, threshold, value),
           lambda x, y, th, v, inplace: (x > th).to(x.dtype),
           "threshold: d_x = d where x > threshold, else 0 (derivatives.yaml `threshold`)",
           samples=lambda dtype: iter([((_t((3, 4), dtype), 0.5, -1.0), {})]))
_pointwise(F.softshrink, lambda input, lambd=0.5: F.softshrink(input, lambd),
           lambda x, y, lambd: (torch.abs(x) > lambd).to(x.dtype),
           "softshrink: d_x = d where |x| > lambda, else 0 (derivatives.yaml `softshrink`)")
_pointwise(F.hardshrink, lambda input, lambd=0.5: F.hardshrink(input, lambd),
           lambda x, y, lambd: (torch.abs(x) > lambd).to(x.dtype),
           "hardshrink: d_x = d where |x| > lambda, else 0 (derivatives.yaml `hardshrink`)")


@builtin(F.glu)
class Glu:
    """glu(x, dim) = a sigmoid(b) with (a, b) = x.chunk(2, dim): d_a = d sigmoid(b),
    d_b = d a sigmoid(b) (1 - sigmoid(b)); d_x = cat(d_a, d_b) (derivatives.yaml `glu`)."""

    def fwd(input, dim=-1):
        return F.glu(input, dim), (input, dim)

    def bwd(aux, d):
        x, dim = aux
        a, b = torch.chunk(x, 2, dim)
        s = torch.sigmoid(b)
        return (torch.cat([d * s, d * a * s * (1 - s)], dim),)

    def samples(dtype):
        yield (_t((3, 4), dtype),), {}
        yield (_t((4, 3, 2), dtype), 0), {}


@builtin(F.softmin)
class Softmin:
    """softmin(x, dim) = softmax(-x, dim): d_x = -y (d - sum(d y, dim))
    (derivatives.yaml `_softmax`: _softmax_backward_data, negated)."""

    def fwd(input, dim=None, _stacklevel=3, dtype=None):
        out = F.softmin(input, dim, dtype=dtype) if dtype is not None else F.softmin(input, dim)
        return out, (out, dim)

    def bwd(aux, d):
        y, dim = aux
        if dim is None:
            dim = 0 if y.dim() in (0, 1, 3) else 1
        return (-(y * (d - torch.sum(d * y, dim, keepdim=True))),)

    def samples(dtype):
        yield (_t((3, 4), dtype), 1), {}
        yield (_t((2, 3, 4), dtype), 0), {}


# --- norms ----------------------------------------------------------------------------------

def pnorm_grad(x: Any, norm: Any, p: float, d: Any, dim: Any = None) -> Any:
    """Cotangent of ``vector_norm(x, p)`` given ``norm`` and ``d`` (both with the reduced dims
    kept as size 1): derivatives.yaml ``linalg_vector_norm`` (norm_backward)."""
    p = float(p)
    if p == 0.0:
        return torch.zeros_like(x) * d
    if p == 1.0:
        return torch.sgn(x) * d
    if p == 2.0:
        return x * torch.where(norm == 0, 0.0, d / norm)
    if math.isinf(p):
        mask = (torch.abs(x) == norm).to(x.dtype)
        cnt = torch.sum(mask) if dim is None else torch.sum(mask, dim, keepdim=True)
        return torch.sgn(x) * mask * (d / cnt)
    if p < 1.0:
        ax = torch.abs(x)
        scaled = torch.sgn(x) * torch.where(x == 0, 0.0, torch.pow(ax, p - 1))
        return scaled * d * torch.pow(norm, 1 - p)
    if p < 2.0:
        scaled = torch.sgn(x) * torch.pow(torch.abs(x), p - 1)
    else:
        scaled = x * torch.pow(torch.abs(x), p - 2)
    return scaled * torch.where(norm == 0, 0.0, d / torch.pow(norm, p - 1))


@builtin(F.normalize)
class Normalize:
    """normalize(x, p, dim, eps) = x / max(||x||_p, eps): d_x = d / n - x sum(d x, dim) / n^2
    * dn/dx where ||x||_p >= eps (dn/dx from derivatives.yaml `linalg_vector_norm`;
    `clamp_min`'s mask self >= min)."""

    def fwd(input, p=2.0, dim=1, eps=1e-12, out=None):
        res = F.normalize(input, p, dim, eps)
        norm = torch.linalg.vector_norm(input, p, dim, keepdim=True)
        return res, (input, norm, p, dim, eps)

    def bwd(aux, d):
        x, norm, p, dim, eps = aux
        den = torch.clamp_min(norm, eps)
        d_x = d / den
        g_den = -torch.sum(d * x, dim, keepdim=True) / (den * den)
        g_norm = torch.where(norm >= eps, g_den, 0.0)
        return (d_x + pnorm_grad(x, norm, p, g_norm, dim),)

    def samples(dtype):
        yield (_t((3, 4), dtype),), {}
        yield (_t((3, 4, 2), dtype), 1.5, -1), {}
        yield (_t((3, 4), dtype), 1.0, 0), {}


@builtin(F.cosine_similarity)
class CosineSimilarity:
    """cosine_similarity(a, b, dim, eps) = sum(a b, dim) / (max(|a|, eps) max(|b|, eps)) with
    a, b broadcast: d_a = d (b / (|a||b|) - cos a / |a|^2) (the norms' eps clamps are made
    without grad in ATen's cosine_similarity, so they scale only)."""

    def fwd(x1, x2, dim=1, eps=1e-8):
        out = F.cosine_similarity(x1, x2, dim, eps)
        return out, (x1, x2, out, dim, eps)

    def bwd(aux, d):
        a, b, out, dim, eps = aux
        shape = torch.broadcast_shapes(tuple(a.shape), tuple(b.shape))
        if tuple(a.shape) != tuple(shape):
            a = a.expand(shape)
        if tuple(b.shape) != tuple(shape):
            b = b.expand(shape)
        dim = dim % len(shape)
        na = torch.clamp_min(torch.linalg.vector_norm(a, 2, dim, keepdim=True), eps)
        nb = torch.clamp_min(torch.linalg.vector_norm(b, 2, dim, keepdim=True), eps)
        d = torch.unsqueeze(d, dim)
        c = torch.unsqueeze(out, dim)
        d_a = d * (b / (na * nb) - c * a / (na * na))
        d_b = d * (a / (na * nb) - c * b / (nb * nb))
        return d_a, d_b

    def samples(dtype):
        yield (_t((3, 4), dtype), _t((3, 4), dtype)), {}
        yield (_t((3, 4, 2), dtype), _t((4, 2), dtype), -1), {}


@builtin(F.pairwise_distance)
class PairwiseDistance:
    """pairwise_distance(a, b, p, eps, keepdim) = ||a - b + eps||_p over the last dim:
    d_a = dn/dz, d_b = -dn/dz (derivatives.yaml `linalg_vector_norm`)."""

    def fwd(x1, x2, p=2.0, eps=1e-6, keepdim=False):
        out = F.pairwise_distance(x1, x2, p, eps, keepdim)
        return out, (x1, x2, out, p, eps, keepdim)

    def bwd(aux, d):
        a, b, out, p, eps, keepdim = aux
        z = a - b + eps
        if z.dim() == 0:
            return pnorm_grad(z, out, p, d), -pnorm_grad(z, out, p, d)
        if not keepdim and out.dim() < z.dim():
            out, d = torch.unsqueeze(out, -1), torch.unsqueeze(d, -1)
        g = pnorm_grad(z, out, p, d, -1)
        return g, -g

    def samples(dtype):
        yield (_t((3, 4), dtype), _t((3, 4), dtype)), {}
        yield (_t((3, 4), dtype), _t((4,), dtype), 1.5), {"keepdim": True}


# --- losses ---------------------------------------------------------------------------------

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


@builtin(F.l1_loss)
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


@builtin(F.smooth_l1_loss)
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


@builtin(F.huber_loss)
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


@builtin(F.soft_margin_loss)
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


@builtin(F.margin_ranking_loss)
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


@builtin(F.binary_cross_entropy)
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


@builtin(F.binary_cross_entropy_with_logits)
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


@builtin(F.kl_div)
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


@builtin(F.nll_loss)
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


# --- padding and pixel shuffles --------------------------------------------------------------

@builtin(F.pad)
class Pad:
    """pad(x, pad, mode, value): constant mode: d_x = pad(d, -pad) (a crop, or zero padding
    for negative pads); reflect/replicate/circular: d_x = zeros.index_add of d at the source
    index of each output element, obtained by padding an arange of x's indices in the same
    mode (derivatives.yaml `constant_pad_nd`, `reflection_pad*d`, `replication_pad*d`,
    `_pad_circular`)."""

    def fwd(input, pad, mode="constant", value=None):
        kw = {} if value is None else {"value": value}
        out = F.pad(input, pad, mode, **kw) if mode != "constant" else F.pad(input, pad, **kw)
        return out, (input, tuple(pad), mode)

    def bwd(aux, d):
        x, pad, mode = aux
        if mode == "constant":
            return (F.pad(d, [-p for p in pad]),)
        shape = tuple(x.shape)
        n = math.prod(shape)
        idx = torch.arange(n, dtype=torch.float64, device=d.device).reshape(shape)
        src = F.pad(idx, pad, mode).to(torch.long)
        flat = torch.zeros(n, dtype=d.dtype, device=d.device).index_add(
            0, src.reshape(-1), d.reshape(-1))
        return (flat.reshape(shape),)

    def jvp(primals, tangents):
        x, pad, mode, value = primals
        t = tangents[0]
        kw = {} if value is None else {"value": value}
        out = F.pad(x, pad, mode, **kw) if mode != "constant" else F.pad(x, pad, **kw)
        if t is None:
            return out, None
        return out, (F.pad(t, pad, mode) if mode != "constant" else F.pad(t, pad))

    def samples(dtype):
        yield (_t((2, 3, 4), dtype), [1, 2]), {}
        yield (_t((2, 3, 4), dtype), [1, -1, 0, 2]), {"value": 0.5}
        yield (_t((2, 3, 4), dtype), [1, 2], "reflect"), {}
        yield (_t((1, 2, 3, 4), dtype), [1, 2, 2, 1], "replicate"), {}
        yield (_t((1, 2, 3, 4), dtype), [1, 2, 2, 1], "circular"), {}


@builtin(torch.constant_pad_nd)
class ConstantPadNd:
    """constant_pad_nd(x, pad, value): d_x = constant_pad_nd(d, -pad) (derivatives.yaml
    `constant_pad_nd`: constant_pad_nd_backward)."""

    def fwd(input, pad, value=0):
        return torch.constant_pad_nd(input, pad, value), tuple(pad)

    def bwd(aux, d):
        return (torch.constant_pad_nd(d, [-p for p in aux]),)

    def samples(dtype):
        yield (_t((2, 3, 4), dtype), [1, 2, -1, 1]), {}


@builtin(F.pixel_shuffle)
class PixelShuffle:
    """pixel_shuffle(x, r): a permutation; d_x = pixel_unshuffle(d, r)
    (derivatives.yaml `pixel_shuffle`)."""

    def fwd(input, upscale_factor):
        return F.pixel_shuffle(input, upscale_factor), upscale_factor

    def bwd(aux, d):
        return (F.pixel_unshuffle(d, aux),)

    def samples(dtype):
        yield (_t((2, 8, 3, 2), dtype), 2), {}


@builtin(F.pixel_unshuffle)
class PixelUnshuffle:
    """pixel_unshuffle(x, r): a permutation; d_x = pixel_shuffle(d, r)
    (derivatives.yaml `pixel_unshuffle`)."""

    def fwd(input, downscale_factor):
        return F.pixel_unshuffle(input, downscale_factor), downscale_factor

    def bwd(aux, d):
        return (F.pixel_shuffle(d, aux),)

    def samples(dtype):
        yield (_t((2, 2, 4, 6), dtype), 2), {}


@builtin(F.channel_shuffle)
class ChannelShuffle:
    """channel_shuffle(x, g): a channel permutation; d_x = channel_shuffle(d, C / g)
    (derivatives.yaml `channel_shuffle`)."""

    def fwd(input, groups):
        return F.channel_shuffle(input, groups), (input.shape[1], groups)

    def bwd(aux, d):
        c, g = aux
        return (F.channel_shuffle(d, c // g),)

    def samples(dtype):
        yield (_t((2, 6, 3), dtype), 2), {}


# --- convolutions (1-d, 3-d, transposed), fold/unfold ------------------------------------------

def _emit(fn: Any, *args: Any, **kwargs: Any) -> Any:
    from .nn import _emit as emit
    return emit(fn, *args, **kwargs)


def _ntuple(v: Any, n: int) -> tuple:
    return tuple(v) if isinstance(v, (tuple, list)) else (v,) * n


def _conv_rule(op: Any, nd: int) -> None:
    grad_in = getattr(torch.nn.grad, f"conv{nd}d_input")
    grad_w = getattr(torch.nn.grad, f"conv{nd}d_weight")
    name = f"conv{nd}d"

    def fwd(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
        out = op(input, weight, bias, stride, padding, dilation, groups)
        return out, (input, weight, bias is not None, stride, padding, dilation, groups)

    def bwd(aux, d):
        x, w, has_bias, stride, padding, dilation, groups = aux
        unbatched = x.dim() == nd + 1
        if unbatched:
            x, d = torch.unsqueeze(x, 0), torch.unsqueeze(d, 0)
        crop = None
        if isinstance(padding, str):
            if padding == "valid":
                pad = (0,) * nd
            else:  # 'same': pad explicitly (possibly asymmetric), conv with padding 0, crop
                dil = _ntuple(dilation, nd)
                tot = [dil[i] * (w.shape[2 + i] - 1) for i in range(nd)]
                lr = [(t // 2, t - t // 2) for t in tot]
                crop = [v for (lo, hi) in reversed(lr) for v in (lo, hi)]
                x = F.pad(x, crop)
                pad = (0,) * nd
        else:
            pad = _ntuple(padding, nd)
        d_x = _emit(grad_in, tuple(x.shape), w, d, stride, pad, dilation, groups)
        d_w = _emit(grad_w, x, tuple(w.shape), d, stride, pad, dilation, groups)
        if crop is not None:
            d_x = F.pad(d_x, [-v for v in crop])
        if unbatched:
            d_x = torch.squeeze(d_x, 0)
        d_b = torch.sum(d, [0] + list(range(2, nd + 2))) if has_bias else None
        return d_x, d_w, d_b

    def jvp(primals, tangents):
        x, w, b, stride, padding, dilation, groups = primals
        tx, tw, tb = tangents[:3]
        out = op(x, w, b, stride, padding, dilation, groups)
        t = None if tx is None else op(tx, w, None, stride, padding, dilation, groups)
        if tw is not None or tb is not None:
            tw = torch.zeros_like(w) if tw is None else tw
            t2 = op(x, tw, tb, stride, padding, dilation, groups)
            t = t2 if t is None else t + t2
        return out, t

    def samples(dtype):
        x = _t((2, 3) + (5,) * nd, dtype)
        w = _t((4, 3) + (3,) * nd, dtype)
        yield (x, w, _t((4,), dtype)), {}
        yield (x, w, None, 2, 1), {}
        yield (x, _t((4, 3) + (2,) * nd, dtype)), {"padding": "same"}
        yield (_t((4, 6) + (5,) * nd, dtype), _t((2, 3) + (3,) * nd, dtype)), \
            {"groups": 2, "dilation": 2}

    add_rule(op, fwd, bwd, jvp=jvp, samples=samples, builtin=True,
             source=f"{name}(x, w, b): d_x = conv{nd}d_input(x.shape, w, d) (the transposed "
                    f"convolution), d_w = conv{nd}d_weight(x, w.shape, d), d_b = sum(d) over "
                    "all but the channel dim; 'same' padding is applied explicitly and cropped "
                    "back (derivatives.yaml `convolution`: convolution_backward)")


_conv_rule(torch.conv1d, 1)
_conv_rule(torch.conv3d, 3)


def _conv_transpose_rule(op: Any, nd: int) -> None:
    conv = getattr(torch, f"conv{nd}d")
    grad_w = getattr(torch.nn.grad, f"conv{nd}d_weight")
    name = f"conv_transpose{nd}d"

    def fwd(input, weight, bias=None, stride=1, padding=0, output_padding=0, groups=1,
            dilation=1):
        out = op(input, weight, bias, stride, padding, output_padding, groups, dilation)
        return out, (input, weight, bias is not None, stride, padding, groups, dilation)

    def bwd(aux, d):
        x, w, has_bias, stride, padding, groups, dilation = aux
        unbatched = x.dim() == nd + 1
        if unbatched:
            x, d = torch.unsqueeze(x, 0), torch.unsqueeze(d, 0)
        d_x = conv(d, w, None, stride, padding, dilation, groups)
        extra = [d_x.shape[2 + i] - x.shape[2 + i] for i in range(nd)]
        xw = x
        if any(extra):  # output_padding >= stride (allowed below dilation): conv(d) is larger
            d_x = d_x[(slice(None), slice(None)) + tuple(slice(0, x.shape[2 + i])
                                                         for i in range(nd))]
            xw = F.pad(x, [v for e in reversed(extra) for v in (0, e)])
        d_w = _emit(grad_w, d, tuple(w.shape), xw, stride, padding, dilation, groups)
        if unbatched:
            d_x = torch.squeeze(d_x, 0)
        d_b = torch.sum(d, [0] + list(range(2, nd + 2))) if has_bias else None
        return d_x, d_w, d_b

    def jvp(primals, tangents):
        x, w, b, stride, padding, output_padding, groups, dilation = primals
        tx, tw, tb = tangents[:3]
        rest = (stride, padding, output_padding, groups, dilation)
        out = op(x, w, b, *rest)
        t = None if tx is None else op(tx, w, None, *rest)
        if tw is not None or tb is not None:
            tw = torch.zeros_like(w) if tw is None else tw
            t2 = op(x, tw, tb, *rest)
            t = t2 if t is None else t + t2
        return out, t

    def samples(dtype):
        x = _t((2, 4) + (4,) * nd, dtype)
        w = _t((4, 3) + (3,) * nd, dtype)
        yield (x, w, _t((3,), dtype)), {}
        yield (x, w, None, 2, 1, 1), {}
        yield (x, _t((4, 2) + (3,) * nd, dtype), None, 1, 0, 0, 2, 2), {}
        yield (x, w, None, 1, 0, 1, 1, 2), {}  # output_padding >= stride

    add_rule(op, fwd, bwd, jvp=jvp, samples=samples, builtin=True,
             source=f"{name}(x, w, b) is the adjoint of conv{nd}d in its input: "
                    f"d_x = conv{nd}d(d, w), d_w = conv{nd}d_weight(d, w.shape, x), "
                    "d_b = sum(d) over all but the channel dim (derivatives.yaml "
                    "`convolution` with transposed=True: convolution_backward)")


_conv_transpose_rule(torch.conv_transpose1d, 1)
_conv_transpose_rule(torch.conv_transpose2d, 2)
_conv_transpose_rule(torch.conv_transpose3d, 3)


@builtin(F.unfold)
class Im2Col:
    """unfold(x, kernel, dilation, padding, stride) (im2col): d_x = fold(d, x.shape[-2:],
    kernel, dilation, padding, stride) (col2im; derivatives.yaml `im2col`)."""

    def fwd(input, kernel_size, dilation=1, padding=0, stride=1):
        out = F.unfold(input, kernel_size, dilation, padding, stride)
        return out, (tuple(input.shape[-2:]), kernel_size, dilation, padding, stride)

    def bwd(aux, d):
        size, k, dil, pad, st = aux
        return (F.fold(d, size, k, dil, pad, st),)

    def samples(dtype):
        yield (_t((2, 3, 5, 4), dtype), 2), {}
        yield (_t((3, 6, 5), dtype), (2, 3), 1, 1, 2), {}


@builtin(F.fold)
class Col2Im:
    """fold(x, output_size, kernel, dilation, padding, stride) (col2im): d_x = unfold(d,
    kernel, dilation, padding, stride) (derivatives.yaml `col2im`)."""

    def fwd(input, output_size, kernel_size, dilation=1, padding=0, stride=1):
        out = F.fold(input, output_size, kernel_size, dilation, padding, stride)
        return out, (kernel_size, dilation, padding, stride)

    def bwd(aux, d):
        k, dil, pad, st = aux
        return (F.unfold(d, k, dil, pad, st),)

    def samples(dtype):
        yield (_t((2, 12, 12), dtype), (4, 5), 2), {}


@builtin(F.prelu)
class PReLU:
    """prelu(x, w) = x if x > 0 else w x, w broadcast along dim 1: d_x = d (1 or w),
    d_w = sum(d x where x <= 0) over all dims but 1 (derivatives.yaml `_prelu_kernel`)."""

    def fwd(input, weight):
        return F.prelu(input, weight), (input, weight)

    def bwd(aux, d):
        x, w = aux
        wb = w
        if x.dim() >= 2 and w.numel() > 1:
            wb = torch.reshape(w, (-1,) + (1,) * (x.dim() - 2))
        pos = x > 0
        d_x = torch.where(pos, d, wb * d)
        gw = torch.where(pos, 0.0, x * d)
        if w.numel() == 1 or x.dim() < 2:
            d_w = torch.reshape(torch.sum(gw), tuple(w.shape)) if w.numel() == 1 else gw
        else:
            d_w = torch.reshape(torch.sum(gw, [0] + list(range(2, x.dim()))), tuple(w.shape))
        return d_x, d_w

    def samples(dtype):
        yield (_t((2, 3, 4), dtype), _t((3,), dtype)), {}
        yield (_t((2, 3), dtype), _t((1,), dtype)), {}


@builtin(F.bilinear)
class Bilinear:
    """bilinear(a, b, W, bias) = a^T W_o b + bias_o: d_a = einsum(d, W, b), d_b = einsum(d, W,
    a), d_W = einsum(d, a, b), d_bias = sum(d) (derivatives.yaml via `_trilinear`)."""

    def fwd(input1, input2, weight, bias=None):
        return F.bilinear(input1, input2, weight, bias), (input1, input2, weight,
                                                          bias is not None)

    def bwd(aux, d):
        a, b, w, has_bias = aux
        d_a = torch.einsum("...o,oij,...j->...i", d, w, b)
        d_b = torch.einsum("...o,oij,...i->...j", d, w, a)
        d_w = torch.einsum("...o,...i,...j->oij", d, a, b)
        d_bias = torch.reshape(d, (-1, d.shape[-1])).sum(0) if has_bias else None
        return d_a, d_b, d_w, d_bias

    def samples(dtype):
        yield (_t((3, 2), dtype), _t((3, 4), dtype), _t((5, 2, 4), dtype), _t((5,), dtype)), {}


@builtin(F.poisson_nll_loss)
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


@builtin(F.hinge_embedding_loss)
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


@builtin(F.multilabel_soft_margin_loss)
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


# --- normalizations -------------------------------------------------------------------------

def _norm_core(d_xhat: Any, xhat: Any, rstd: Any, dims: Any) -> Any:
    """d_x of xhat = (x - mean) rstd over ``dims``: rstd (g - mean(g) - xhat mean(g xhat))."""
    return rstd * (d_xhat - torch.mean(d_xhat, dims, keepdim=True)
                   - xhat * torch.mean(d_xhat * xhat, dims, keepdim=True))


def _affine_grads(d: Any, xhat: Any, has_w: bool, has_b: bool, keep: int) -> tuple:
    """Weight/bias cotangents summed over every dim except ``keep`` (the channel)."""
    red = [i for i in range(d.dim()) if i != keep]
    d_w = torch.sum(d * xhat, red) if has_w else None
    d_b = torch.sum(d, red) if has_b else None
    return d_w, d_b


def _chan(v: Any, ndim: int) -> Any:
    return torch.reshape(v, (-1,) + (1,) * (ndim - 2))


@builtin(F.group_norm)
class GroupNorm:
    """group_norm(x, G, w, b): xhat = (x - mean) / sqrt(var + eps) per (sample, group);
    d_x = rstd (g - mean(g) - xhat mean(g xhat)) with g = d w, d_w = sum(d xhat),
    d_b = sum(d) over all dims but channels (derivatives.yaml `native_group_norm`:
    native_group_norm_backward)."""

    def fwd(input, num_groups, weight=None, bias=None, eps=1e-5):
        out = F.group_norm(input, num_groups, weight, bias, eps)
        return out, (input, num_groups, weight, bias is not None, eps)

    def bwd(aux, d):
        x, g, w, has_b, eps = aux
        shape = tuple(x.shape)
        xg = torch.reshape(x, (shape[0], g, -1))
        var, mean = torch.var_mean(xg, -1, correction=0, keepdim=True)
        rstd = torch.rsqrt(var + eps)
        xhat = (xg - mean) * rstd
        gx = d if w is None else d * _chan(w, len(shape))
        d_x = torch.reshape(_norm_core(torch.reshape(gx, (shape[0], g, -1)), xhat, rstd, -1),
                            shape)
        d_w, d_b = _affine_grads(d, torch.reshape(xhat, shape), w is not None, has_b, 1)
        return d_x, None, d_w, d_b

    def samples(dtype):
        yield (randn(2, 6, 3, dtype=dtype), 3, randn(6, dtype=dtype), randn(6, dtype=dtype)), {}
        yield (randn(2, 4, 2, 3, dtype=dtype), 2), {}


@builtin(F.rms_norm)
class RMSNorm:
    """rms_norm(x, shape, w, eps): xhat = x / sqrt(mean(x^2) + eps) over the last dims:
    d_x = rstd (g - xhat mean(g xhat)) with g = d w, d_w = sum(d xhat) over the leading dims
    (derivatives.yaml `_fused_rms_norm`)."""

    def fwd(input, normalized_shape, weight=None, eps=None):
        out = F.rms_norm(input, normalized_shape, weight, eps)
        return out, (input, len(normalized_shape), weight, eps)

    def bwd(aux, d):
        x, k, w, eps = aux
        if eps is None:
            eps = torch.finfo(x.dtype).eps
        dims = list(range(x.dim() - k, x.dim()))
        rstd = torch.rsqrt(torch.mean(x * x, dims, keepdim=True) + eps)
        xhat = x * rstd
        gx = d if w is None else d * w
        d_x = rstd * (gx - xhat * torch.mean(gx * xhat, dims, keepdim=True))
        d_w = None
        if w is not None:
            lead = list(range(x.dim() - k))
            d_w = torch.sum(d * xhat, lead) if lead else d * xhat
        return d_x, None, d_w

    def samples(dtype):
        yield (randn(2, 3, 4, dtype=dtype), (4,), randn(4, dtype=dtype)), {}
        yield (randn(2, 3, 4, dtype=dtype), (3, 4)), {"eps": 1e-3}


@builtin(F.instance_norm)
class InstanceNorm:
    """instance_norm(x, rm, rv, w, b, use_input_stats): with input stats, xhat is normalized
    per (sample, channel) and d_x = rstd (g - mean(g) - xhat mean(g xhat)); with running
    stats, y is affine: d_x = g / sqrt(rv + eps); d_w = sum(d xhat), d_b = sum(d)
    (derivatives.yaml `native_batch_norm` applied per instance)."""

    def fwd(input, running_mean=None, running_var=None, weight=None, bias=None,
            use_input_stats=True, momentum=0.1, eps=1e-5):
        out = F.instance_norm(input, running_mean, running_var, weight, bias, use_input_stats,
                              momentum, eps)
        return out, (input, running_mean, running_var, weight, bias is not None,
                     use_input_stats, eps)

    def bwd(aux, d):
        x, rm, rv, w, has_b, use_stats, eps = aux
        nd = x.dim()
        gx = d if w is None else d * _chan(w, nd)
        if use_stats or rm is None:
            dims = list(range(2, nd))
            var, mean = torch.var_mean(x, dims, correction=0, keepdim=True)
            rstd = torch.rsqrt(var + eps)
            xhat = (x - mean) * rstd
            d_x = _norm_core(gx, xhat, rstd, dims)
        else:
            rstd = _chan(torch.rsqrt(rv + eps), nd)
            xhat = (x - _chan(rm, nd)) * rstd
            d_x = gx * rstd
        d_w, d_b = _affine_grads(d, xhat, w is not None, has_b, 1)
        return {"input": d_x, "weight": d_w, "bias": d_b}

    def samples(dtype):
        yield (randn(2, 3, 5, dtype=dtype), None, None, randn(3, dtype=dtype),
               randn(3, dtype=dtype)), {}
        yield (randn(2, 3, 2, 3, dtype=dtype),), {}


@builtin(F.cosine_embedding_loss)
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


@builtin(F.triplet_margin_loss)
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
