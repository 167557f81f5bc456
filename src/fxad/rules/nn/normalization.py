"""Rules for normalization: ``layer_norm``, ``batch_norm``, ``group_norm``, ``instance_norm``,
``rms_norm``, ``local_response_norm``, ``normalize`` (Lp normalization), and the ATen-level
entry points ``native_layer_norm``, ``native_batch_norm``, ``_native_batch_norm_legit`` (both
overloads), ``aten._batch_norm_with_update``, ``native_group_norm``.

The forward of each rule calls the PyTorch function for the value; the backward is written
in plain tensor code, recomputing cheap statistics such as ``var_mean`` rather than saving
them (``_normalize_vjp`` is the standardization backward), except that ``layer_norm`` and
``batch_norm`` call their fused backward kernels where :mod:`fxad.rules.fused` allows it
(``docs/fused_kernels.md``).  Formulas follow PyTorch's
``tools/autograd/derivatives.yaml`` (entry named in each rule's docstring) and
``torch/csrc/autograd/FunctionsManual.cpp``.  Statistics outputs follow autograd: the saved
mean / inverse std of the layer and batch norms are non-differentiable outputs (their
cotangents are ignored, their tangents are zero), while ``native_group_norm``'s mean and rstd
are differentiable (``infinitely_differentiable_native_group_norm_backward``).

``local_response_norm``: y = x * b^(-beta), b = k + alpha * W(x^2), W the average over a
window of ``size`` channels; d_x = d b^(-beta) - 2 alpha beta x W^T(d x b^(-beta-1)), where
W^T is the window average with the padding mirrored.  Configurations a rule cannot
differentiate exactly raise :class:`~fxad.errors.RuleError` naming the op and what to change.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor

from .._base import pnorm_grad, randn, uniform, _add, _t
from ..registry import register_vjp
from ...ops import canonical_layout
from ._common import _aten, _bound, _mul


def _channel_shape(x: Any) -> tuple[int, ...]:
    """Shape that broadcasts a per-channel ``(C,)`` vector against ``x`` (channels at dim 1)."""
    return (x.shape[1],) + (1,) * (x.dim() - 2)


def _per_channel(v: Any, x: Any) -> Any:
    shape = _channel_shape(x)
    return v if len(shape) == 1 else v.reshape(shape)


# --- normalization --------------------------------------------------------------------------


def _normalize_vjp(g: Any, xhat: Any, rstd: Any, dims: tuple[int, ...]) -> Any:
    """Cotangent of x for xhat = (x - mean(x)) * rsqrt(var(x) + eps) over ``dims``, given the
    cotangent ``g`` of xhat: rstd * (g - mean(g) - xhat * mean(g * xhat))."""
    return rstd * (g - g.mean(dims, keepdim=True) - xhat * (g * xhat).mean(dims, keepdim=True))


def _standardize(x: Any, dims: tuple[int, ...], eps: float) -> tuple[Any, Any]:
    """(xhat, rstd) with biased batch statistics over ``dims`` (recomputed in the backward)."""
    var, mean = torch.var_mean(x, dims, correction=0, keepdim=True)
    rstd = torch.rsqrt(var + eps)
    return (x - mean) * rstd, rstd


@register_vjp(F.layer_norm)
class LayerNorm:
    """y = xhat * w + b with xhat = (x - mean) / sqrt(var + eps) over the trailing
    ``normalized_shape`` dims (biased var).  With g = d * w:
    d_x = rstd * (g - mean(g) - xhat * mean(g * xhat)); d_w = d * xhat; d_b = d (the engine
    sums the leading dims) (derivatives.yaml `native_layer_norm`: layer_norm_backward)."""

    residuals = "inputs+intermediates"
    recompute = False

    def fwd(input, normalized_shape, weight=None, bias=None, eps=1e-5):
        dims = tuple(range(input.dim() - len(tuple(normalized_shape)), input.dim()))
        out = F.layer_norm(input, normalized_shape, weight, bias, eps)
        return out, (input, weight, bias is not None, dims, eps)

    def bwd(aux, d):
        x, w, has_bias, dims, eps = aux
        xhat, rstd = _standardize(x, dims, eps)
        d_x = _normalize_vjp(_mul(d, w), xhat, rstd, dims)
        d_w = d * xhat if w is not None else None
        return d_x, None, d_w, (d if has_bias else None)

    def jvp(primals, tangents):
        p, t = _bound(LayerNorm.fwd, primals, tangents)
        x, w = p["input"], p["weight"]
        dims = tuple(range(x.dim() - len(tuple(p["normalized_shape"])), x.dim()))
        out = F.layer_norm(x, p["normalized_shape"], w, p["bias"], p["eps"])
        xhat, rstd = _standardize(x, dims, p["eps"])
        t_out = None
        if t["input"] is not None:
            t_out = _mul(_normalize_vjp(t["input"], xhat, rstd, dims), w)
        if t["weight"] is not None:
            t_out = _add(t_out, xhat * t["weight"])
        return out, _add(t_out, t["bias"])

    def samples(dtype):
        yield (randn(3, 4, dtype=dtype), (4,), randn(4, dtype=dtype), randn(4, dtype=dtype)), {}
        yield (randn(2, 3, 4, dtype=dtype), (3, 4)), {}
        yield (randn(2, 3, 5, dtype=dtype), (5,)), {"weight": randn(5, dtype=dtype),
                                                     "eps": 1e-3}
        yield (randn(6, dtype=dtype), [6], None, randn(6, dtype=dtype)), {}


@register_vjp(F.layer_norm)
class LayerNormFused:
    """The forward kernel ``torch.native_layer_norm`` saves mean and rstd for the fused
    backward kernel ``native_layer_norm_backward`` (``docs/fused_kernels.md``)."""

    residuals = "inputs+intermediates"
    recompute = False
    fused = True

    def fwd(input, normalized_shape, weight=None, bias=None, eps=1e-5):
        out, mean, rstd = torch.native_layer_norm(input, list(normalized_shape), weight, bias,
                                                  eps)
        return out, (input, list(normalized_shape), mean, rstd, weight, bias)

    def bwd(aux, d):
        x, shape, mean, rstd, w, b = aux
        d_x, d_w, d_b = torch.ops.aten.native_layer_norm_backward(
            d, x, shape, mean, rstd, w, b, [True, w is not None, b is not None])
        return d_x, None, d_w, d_b

    jvp = LayerNorm.jvp


def _is_buffer(t: Any) -> bool:
    """None or a module buffer read (``get_attr``): never differentiated.  ``t`` is a proxy
    in a rule's ``fwd``; in a selector (``applies``) a module buffer is the module's own
    tensor (constants are passed as they are), any other tensor a fake one."""
    if isinstance(t, fx.Proxy):
        return t.node.op == "get_attr"
    return t is None or (isinstance(t, torch.Tensor) and not isinstance(t, FakeTensor))


@register_vjp(F.batch_norm)
class BatchNorm:
    """y = xhat * w + b per channel (dim 1).  Training: xhat uses the biased batch statistics
    over all dims but 1, and with g = d * w,
    d_x = rstd * (g - mean(g) - xhat * mean(g * xhat)) (means over dims != 1).
    Eval: xhat = (x - running_mean) * rsqrt(running_var + eps), d_x = g * rstd, and the
    running statistics get d_rm = -sum(g * rstd), d_rv = -1/2 sum(g * xhat) rstd^2 (autograd
    refuses those; fxad differentiates them as plain inputs).  Both modes:
    d_w = sum(d * xhat), d_b = sum(d) over dims != 1 (derivatives.yaml `native_batch_norm`:
    batchnorm_backward).  The forward calls ``F.batch_norm`` itself, so running statistics are
    updated in place exactly as in eager PyTorch; they are never differentiated in training
    mode (they do not affect the output)."""

    residuals = "inputs+intermediates"
    recompute = False

    def fwd(input, running_mean, running_var, weight=None, bias=None, training=False,
            momentum=0.1, eps=1e-5):
        out = F.batch_norm(input, running_mean, running_var, weight=weight, bias=bias,
                           training=training, momentum=momentum, eps=eps)
        stats = None if training else (running_mean, running_var)
        return out, (input, stats, weight, bias is not None, eps)

    def bwd(aux, d):
        x, stats, w, has_bias, eps = aux
        dims = (0,) + tuple(range(2, x.dim()))
        wc = None if w is None else _per_channel(w, x)
        g = _mul(d, wc)
        d_rm = d_rv = None
        if stats is None:
            xhat, rstd = _standardize(x, dims, eps)
            d_x = _normalize_vjp(g, xhat, rstd, dims)
        else:
            rm, rv = stats
            rstd = torch.rsqrt(_per_channel(rv, x) + eps)
            xhat = (x - _per_channel(rm, x)) * rstd
            d_x = g * rstd
            d_rm = -(d_x.sum(dims))
            d_rv = (g * xhat).sum(dims) * (-0.5 / (rv + eps))
        d_w = (d * xhat).sum(dims) if w is not None else None
        d_b = d.sum(dims) if has_bias else None
        return d_x, d_rm, d_rv, d_w, d_b

    def jvp(primals, tangents):
        p, t = _bound(BatchNorm.fwd, primals, tangents)
        x, w, eps = p["input"], p["weight"], p["eps"]
        out = F.batch_norm(x, p["running_mean"], p["running_var"], w, p["bias"],
                           p["training"], p["momentum"], eps)
        dims = (0,) + tuple(range(2, x.dim()))
        wc = None if w is None else _per_channel(w, x)
        if p["training"]:
            xhat, rstd = _standardize(x, dims, eps)
            t_xhat = None if t["input"] is None else _normalize_vjp(t["input"], xhat, rstd, dims)
        else:
            rm, rv = p["running_mean"], p["running_var"]
            rstd = torch.rsqrt(_per_channel(rv, x) + eps)
            xhat = (x - _per_channel(rm, x)) * rstd
            t_xhat = None if t["input"] is None else t["input"] * rstd
            if t["running_mean"] is not None:
                t_xhat = _add(t_xhat, -_per_channel(t["running_mean"], x) * rstd)
            if t["running_var"] is not None:
                t_xhat = _add(t_xhat, -0.5 * xhat * rstd ** 2 * _per_channel(t["running_var"], x))
        t_out = None if t_xhat is None else _mul(t_xhat, wc)
        if t["weight"] is not None:
            t_out = _add(t_out, xhat * _per_channel(t["weight"], x))
        if t["bias"] is not None:
            t_out = _add(t_out, _per_channel(t["bias"], x))
        return out, t_out

    def samples(dtype):
        # training mode with batch statistics only: autograd refuses gradients for running
        # statistics, so eval mode is covered by tests/test_nn_rules.py instead
        c = 3
        w, b = randn(c, dtype=dtype), randn(c, dtype=dtype)
        yield (randn(4, c, dtype=dtype), None, None, w, b, True), {}
        yield (randn(2, c, 5, dtype=dtype), None, None), {"weight": w, "bias": b,
                                                          "training": True}
        yield (randn(2, c, 3, 4, dtype=dtype), None, None, w, b, True, 0.1, 1e-3), {}
        yield (randn(2, c, 3, 3, dtype=dtype), None, None), {"training": True}


@register_vjp(F.batch_norm)
class BatchNormFused:
    """Running statistics that are module buffers (or None): ``torch.native_batch_norm``
    saves the batch mean / inverse std for the fused backward kernel
    ``native_batch_norm_backward`` (``docs/fused_kernels.md``) and updates the running
    statistics in place like ``F.batch_norm``."""

    residuals = "inputs+intermediates"
    recompute = False
    fused = True

    def applies(input, running_mean, running_var, weight=None, bias=None, training=False,
                momentum=0.1, eps=1e-5):
        return _is_buffer(running_mean) and _is_buffer(running_var)

    def fwd(input, running_mean, running_var, weight=None, bias=None, training=False,
            momentum=0.1, eps=1e-5):
        out, save_mean, save_invstd = torch.native_batch_norm(
            input, weight, bias, running_mean, running_var, training, momentum, eps)
        # in training the backward kernel reads only the batch statistics (save_mean,
        # save_invstd), not the running ones, which the forward has just updated
        rm, rv = (None, None) if training is True else (running_mean, running_var)
        return out, (input, weight, bias is not None, rm, rv, save_mean, save_invstd,
                     training, eps)

    def bwd(aux, d):
        x, w, has_bias, rm, rv, save_mean, save_invstd, training, eps = aux
        d_x, d_w, d_b = torch.ops.aten.native_batch_norm_backward(
            _kernel_layout(d), _kernel_layout(x), w, rm, rv, save_mean, save_invstd,
            training, eps, [True, w is not None, has_bias])
        return d_x, None, None, d_w, d_b

    jvp = BatchNorm.jvp


def _kernel_layout(t: Any) -> Any:
    """``t`` as PyTorch's CPU ``native_batch_norm_backward`` computes it right: a value laid
    out channels-last at build time goes through :func:`fxad.ops.canonical_layout` (a stride
    on a size-1 dimension other than the canonical one gives wrong values: timm's
    EfficientFormer at batch 1, whose layer norm after ``flatten(2).transpose(1, 2)`` hands
    its batch norm a cotangent of strides ``(448, 1, 3136, 448)`` for shape
    ``(1, 448, 7, 7)``); a row-major one is passed as it is."""
    if t.dim() not in (4, 5):
        return t
    fmt = torch.channels_last if t.dim() == 4 else torch.channels_last_3d
    try:
        laid_out = not t.is_contiguous() and t.is_contiguous(memory_format=fmt)
    except Exception:  # noqa: BLE001 - symbolic sizes it cannot decide: check on every call
        laid_out = True
    return canonical_layout(t) if laid_out else t


@register_vjp(F.normalize)
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


def _wn_dims(v: Any, dim: int) -> list[int]:
    """Dims ``norm_except_dim(v, 2, dim)`` reduces: every dim but ``dim``; all of them for
    ``dim == -1`` (ATen's convention: -1 means the norm of the whole tensor, not the last
    dim)."""
    return list(range(v.dim())) if dim == -1 else [i for i in range(v.dim()) if i != dim]


@register_vjp(torch._weight_norm)
class WeightNorm:
    """_weight_norm(v, g, dim) = v * g / n with n = ||v||_2 over every dim but ``dim`` (the
    whole tensor for dim = -1), kept as size 1 (the weight of
    ``nn.utils.parametrizations.weight_norm``).  With s = sum(d * v) over those dims:
    d_v = (g / n) d - v g s / n^3, d_g = s / n (derivatives.yaml `_weight_norm_interface`:
    _weight_norm_interface_backward; Salimans & Kingma 2016, eq. 3).  A zero norm gives
    inf/nan as in eager."""

    def fwd(v, g, dim=0):
        out = torch._weight_norm(v, g, dim)
        return out, (v, g, dim)

    def bwd(aux, d):
        v, g, dim = aux
        dims = _wn_dims(v, dim)
        n = torch.linalg.vector_norm(v, 2, dims, keepdim=True)
        s = torch.sum(d * v, dims, keepdim=True)
        d_v = d * (g / n) - v * (g * s / (n * n * n))
        return d_v, s / n, None

    def jvp(primals, tangents):
        p, t = _bound(WeightNorm.fwd, primals, tangents)
        v, g, dim = p["v"], p["g"], p["dim"]
        out = torch._weight_norm(v, g, dim)
        dims = _wn_dims(v, dim)
        n = torch.linalg.vector_norm(v, 2, dims, keepdim=True)
        t_out = None
        if t["v"] is not None:
            vt = torch.sum(v * t["v"], dims, keepdim=True)
            t_out = t["v"] * (g / n) - v * (g * vt / (n * n * n))
        if t["g"] is not None:
            t_out = _add(t_out, v * (t["g"] / n))
        return out, t_out

    def samples(dtype):
        yield (randn(4, 3, 2, dtype=dtype), randn(4, 1, 1, dtype=dtype)), {}
        yield (randn(4, 3, 2, dtype=dtype), randn(1, 1, 2, dtype=dtype), 2), {}
        yield (randn(4, 3, 2, dtype=dtype), randn(1, 3, 1, dtype=dtype), 1), {}
        yield (randn(5, 3, dtype=dtype), randn(dtype=dtype), -1), {}
        yield (randn(4, 3, dtype=dtype), randn(4, 1, dtype=dtype)), {"dim": 0}


# --- group, RMS and instance normalization --------------------------------------------------

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


@register_vjp(F.group_norm)
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


@register_vjp(F.rms_norm)
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


@register_vjp(F.instance_norm)
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


# --- local response normalization -------------------------------------------------------------


def _channel_window_mean(z: Any, size: int, transpose: bool = False) -> Any:
    """Mean over a window of ``size`` channels (dim 1) around each channel, zero-padded: W z,
    with window [c - size//2, c + (size-1)//2]; or ``transpose=True``: W^T z, whose window
    [c - (size-1)//2, c + size//2] mirrors it."""
    lo, hi = (size // 2, (size - 1) // 2) if not transpose else ((size - 1) // 2, size // 2)
    zc = torch.movedim(z, 1, -1)
    rows = zc.reshape(-1, 1, zc.shape[-1])
    mean = F.avg_pool1d(F.pad(rows, (lo, hi)), size, stride=1)
    return torch.movedim(mean.reshape(zc.shape), -1, 1)


@register_vjp(F.local_response_norm)
class LocalResponseNorm:
    """y = x * b^(-beta), b = k + alpha * W(x^2), W the zero-padded mean over a window of
    ``size`` channels: d_x = d * b^(-beta) - 2 alpha beta x * W^T(d x b^(-beta-1)),
    t_y = t * b^(-beta) - 2 alpha beta x b^(-beta-1) W(x t) (chain rule; PyTorch composes
    the op from pad, avg_pool and pow, so derivatives.yaml has no entry of its own)."""

    def fwd(input, size, alpha=1e-4, beta=0.75, k=1.0):
        out = F.local_response_norm(input, size, alpha=alpha, beta=beta, k=k)
        return out, (input, size, alpha, beta, k)

    def bwd(aux, d):
        x, size, alpha, beta, k = aux
        b = k + alpha * _channel_window_mean(x * x, size)
        scale = torch.pow(b, -beta)
        back = _channel_window_mean(d * x * scale / b, size, transpose=True)
        return (d * scale - (2 * alpha * beta) * x * back,)

    def jvp(primals, tangents):
        (x, size, alpha, beta, k), t = primals, tangents[0]
        out = F.local_response_norm(x, size, alpha=alpha, beta=beta, k=k)
        b = k + alpha * _channel_window_mean(x * x, size)
        scale = torch.pow(b, -beta)
        t_b = _channel_window_mean(x * t, size)
        return out, t * scale - (2 * alpha * beta) * x * scale / b * t_b

    def samples(dtype):
        yield (randn(2, 6, 5, dtype=dtype), 3), {}
        yield (randn(2, 6, 4, 3, dtype=dtype), 2), {"alpha": 0.3, "beta": 0.5, "k": 1.5}
        yield (randn(1, 5, 3, 2, 2, dtype=dtype), 4), {"alpha": 0.2, "k": 2.0}
        yield (randn(2, 3, 4, dtype=dtype), 5), {"alpha": 0.5, "beta": 1.2}  # window > channels


# --- layer norm -----------------------------------------------------------------------------


def _ln_dims(x: Any, normalized_shape: Any) -> tuple[int, ...]:
    return tuple(range(x.dim() - len(tuple(normalized_shape)), x.dim()))


@register_vjp(torch.native_layer_norm)
class NativeLayerNorm:
    """native_layer_norm(x, shape, w, b, eps) -> (y, mean, rstd) with xhat = (x - mean) rstd
    over the trailing ``shape`` dims and y = xhat w + b.  With g = d_y w:
    d_x = rstd (g - mean(g) - xhat mean(g xhat)), d_w = d_y xhat, d_b = d_y (the engine sums
    the leading dims) (derivatives.yaml `native_layer_norm`: layer_norm_backward).  mean and
    rstd are non-differentiable outputs in autograd: their cotangents are ignored."""

    outputs = ("out", "mean", "rstd")

    def fwd(input, normalized_shape, weight, bias, eps):
        res = torch.native_layer_norm(input, normalized_shape, weight, bias, eps)
        return res, (input, weight, bias is not None, _ln_dims(input, normalized_shape),
                     res[1], res[2])

    def bwd(aux, d):
        x, w, has_b, dims, mean, rstd = aux
        d_y = d[0]
        if d_y is None:
            return None, None, None, None, None
        xhat = (x - mean) * rstd
        d_x = _normalize_vjp(_mul(d_y, w), xhat, rstd, dims)
        return d_x, None, (d_y * xhat if w is not None else None), (d_y if has_b else None), None

    def jvp(primals, tangents):
        x, shape, w, b, eps = primals
        t_x, _, t_w, t_b, _ = tangents
        res = torch.native_layer_norm(x, shape, w, b, eps)
        mean, rstd = res[1], res[2]
        dims = _ln_dims(x, shape)
        xhat = (x - mean) * rstd
        t_y = None if t_x is None else _mul(_normalize_vjp(t_x, xhat, rstd, dims), w)
        if t_w is not None:
            t_y = _add(t_y, xhat * t_w)
        t_y = _add(t_y, t_b)
        return res, (t_y, None, None)

    def samples(dtype):
        yield (randn(3, 4, dtype=dtype), (4,), randn(4, dtype=dtype), randn(4, dtype=dtype),
               1e-5), {}
        yield (randn(2, 3, 4, dtype=dtype), [3, 4], None, None, 1e-5), {}
        yield (randn(2, 3, 5, dtype=dtype), (5,), randn(5, dtype=dtype), None, 1e-3), {}
        yield (randn(6, dtype=dtype), [6], None, randn(6, dtype=dtype), 1e-5), {}


# --- batch norm -----------------------------------------------------------------------------


def _bn_dims(x: Any) -> tuple[int, ...]:
    return (0,) + tuple(range(2, x.dim()))


def _bn_xhat(x: Any, training: bool, save_mean: Any, save_invstd: Any, rm: Any, rv: Any,
             eps: float) -> tuple[Any, Any]:
    """(xhat, rstd) per channel: batch statistics saved by the forward kernel in training
    mode, the running statistics in eval mode."""
    if training:
        rstd = _per_channel(save_invstd, x)
        return (x - _per_channel(save_mean, x)) * rstd, rstd
    rstd = torch.rsqrt(_per_channel(rv, x) + eps)
    return (x - _per_channel(rm, x)) * rstd, rstd


def _bn_bwd(x: Any, w: Any, has_b: bool, training: bool, save_mean: Any, save_invstd: Any,
            rm: Any, rv: Any, eps: float, d: Any) -> tuple:
    """(d_x, d_w, d_b, d_running_mean, d_running_var) of batch normalization (see
    :class:`NativeBatchNorm`)."""
    if d is None:
        return None, None, None, None, None
    dims = _bn_dims(x)
    xhat, rstd = _bn_xhat(x, training, save_mean, save_invstd, rm, rv, eps)
    g = _mul(d, None if w is None else _per_channel(w, x))
    d_rm = d_rv = None
    if training:
        d_x = _normalize_vjp(g, xhat, rstd, dims)
    else:
        d_x = g * rstd
        d_rm = -d_x.sum(dims)
        d_rv = (g * xhat).sum(dims) * (-0.5 / (rv + eps))
    d_w = (d * xhat).sum(dims) if w is not None else None
    d_b = d.sum(dims) if has_b else None
    return d_x, d_w, d_b, d_rm, d_rv


def _bn_tangent(x: Any, w: Any, training: bool, save_mean: Any, save_invstd: Any, rm: Any,
                rv: Any, eps: float, t_x: Any, t_w: Any, t_b: Any, t_rm: Any,
                t_rv: Any) -> Any:
    """Tangent of the normalized output along the given input tangents."""
    dims = _bn_dims(x)
    xhat, rstd = _bn_xhat(x, training, save_mean, save_invstd, rm, rv, eps)
    if training:
        t_xhat = None if t_x is None else _normalize_vjp(t_x, xhat, rstd, dims)
    else:
        t_xhat = None if t_x is None else t_x * rstd
        if t_rm is not None:
            t_xhat = _add(t_xhat, -_per_channel(t_rm, x) * rstd)
        if t_rv is not None:
            t_xhat = _add(t_xhat, -0.5 * xhat * rstd * rstd * _per_channel(t_rv, x))
    t_y = None if t_xhat is None else _mul(t_xhat, None if w is None else _per_channel(w, x))
    if t_w is not None:
        t_y = _add(t_y, xhat * _per_channel(t_w, x))
    if t_b is not None:
        t_y = _add(t_y, _per_channel(t_b, x))
    return t_y


def _bn_samples(dtype: torch.dtype, with_training: bool = True):
    """(input, weight, bias, running_mean, running_var, [training]) cases, running statistics
    given as None (autograd does not differentiate them)."""
    c = 3
    w, b = randn(c, dtype=dtype), randn(c, dtype=dtype)
    tr = (True,) if with_training else ()
    yield (randn(4, c, dtype=dtype), w, b, None, None) + tr
    yield (randn(2, c, 5, dtype=dtype), w, None, None, None) + tr
    yield (randn(2, c, 3, 4, dtype=dtype), None, b, None, None) + tr
    yield (randn(3, 1, dtype=dtype), None, None, None, None) + tr


@register_vjp(torch.native_batch_norm)
class NativeBatchNorm:
    """native_batch_norm(x, w, b, rm, rv, training, momentum, eps) -> (y, save_mean,
    save_invstd), y = xhat w + b per channel (dim 1).  Training: xhat uses the batch statistics
    (saved by the kernel) and with g = d_y w, d_x = rstd (g - mean(g) - xhat mean(g xhat))
    (means over all dims but 1).  Eval: xhat = (x - rm) rsqrt(rv + eps), d_x = g rstd, and
    the running statistics get d_rm = -sum(g rstd), d_rv = -1/2 sum(g xhat) / (rv + eps)
    (autograd refuses those; fxad differentiates them as plain inputs, like its
    ``F.batch_norm`` rule).  d_w = sum(d_y xhat), d_b = sum(d_y) (derivatives.yaml
    `native_batch_norm`: batchnorm_backward).  save_mean / save_invstd are non-differentiable
    outputs.  The forward calls the op itself, so running statistics are updated in place as
    in eager PyTorch."""

    outputs = ("out", "save_mean", "save_invstd")

    def fwd(input, weight, bias, running_mean, running_var, training, momentum, eps):
        res = torch.native_batch_norm(input, weight, bias, running_mean, running_var, training,
                                      momentum, eps)
        return res, (input, weight, bias is not None, training, res[1], res[2],
                     running_mean, running_var, eps)

    def bwd(aux, d):
        x, w, has_b, training, sm, si, rm, rv, eps = aux
        d_x, d_w, d_b, d_rm, d_rv = _bn_bwd(x, w, has_b, training, sm, si, rm, rv, eps, d[0])
        return d_x, d_w, d_b, d_rm, d_rv

    def jvp(primals, tangents):
        x, w, b, rm, rv, training, momentum, eps = primals
        t_x, t_w, t_b, t_rm, t_rv = tangents[:5]
        res = torch.native_batch_norm(x, w, b, rm, rv, training, momentum, eps)
        t_y = _bn_tangent(x, w, training, res[1], res[2], rm, rv, eps, t_x, t_w, t_b, t_rm,
                          t_rv)
        return res, (t_y, None, None)

    def samples(dtype):
        for args in _bn_samples(dtype):
            yield args + (0.1, 1e-5), {}
        yield (randn(2, 3, 4, dtype=dtype), randn(3, dtype=dtype), None, None, None, True,
               0.0, 0.5), {}
        # eval mode; running statistics as keywords (not differentiated by the test)
        stats = {"running_mean": randn(3, dtype=dtype),
                 "running_var": uniform((3,), 0.5, 2.0, dtype)}
        yield (randn(2, 3, 4, dtype=dtype), randn(3, dtype=dtype), randn(3, dtype=dtype)), \
            dict(stats, training=False, momentum=0.1, eps=1e-5)


def _legit_args(args: tuple, kwargs: dict) -> dict:
    """Bind the trailing arguments of either ``_native_batch_norm_legit`` overload."""
    n = len(args) + len(kwargs)
    names = (("running_mean", "running_var") if n == 5 else ()) + ("training", "momentum", "eps")
    out = dict(zip(names, args))
    out.update(kwargs)
    out.setdefault("running_mean", None)
    out.setdefault("running_var", None)
    return out


@register_vjp(torch._native_batch_norm_legit)
class NativeBatchNormLegit:
    """_native_batch_norm_legit(x, w, b, [rm, rv,] training, momentum, eps) -> (y, save_mean,
    save_invstd): the same formulas as :class:`NativeBatchNorm` (derivatives.yaml
    `_native_batch_norm_legit`: batchnorm_backward); the overload without running statistics
    always normalizes with the batch statistics."""

    outputs = ("out", "save_mean", "save_invstd")

    def fwd(input, weight, bias, *args, **kwargs):
        res = torch._native_batch_norm_legit(input, weight, bias, *args, **kwargs)
        a = _legit_args(args, kwargs)
        return res, (input, weight, bias is not None, a, len(args), list(kwargs), res[1],
                     res[2])

    def bwd(aux, d):
        x, w, has_b, a, nargs, kwnames, sm, si = aux
        d_x, d_w, d_b, d_rm, d_rv = _bn_bwd(x, w, has_b, a["training"], sm, si,
                                            a["running_mean"], a["running_var"], a["eps"], d[0])
        cots = {"running_mean": d_rm, "running_var": d_rv}
        names = (("running_mean", "running_var") if nargs + len(kwnames) == 5 else ()) \
            + ("training", "momentum", "eps")
        return {"input": d_x, "weight": d_w, "bias": d_b,
                "args": tuple(cots.get(n) for n in names[:nargs]),
                "kwargs": {k: cots.get(k) for k in kwnames}}

    def jvp(primals, tangents):
        x, w, b = primals[:3]
        args, kwargs = tuple(primals[3:-1]), dict(primals[-1] or {})
        t_x, t_w, t_b = tangents[:3]
        t_args, t_kw = tuple(tangents[3:-1]), tangents[-1] or {}
        res = torch._native_batch_norm_legit(x, w, b, *args, **kwargs)
        a = _legit_args(args, kwargs)
        t = _legit_args(t_args, dict(t_kw) if isinstance(t_kw, dict) else {})
        t_y = _bn_tangent(x, w, a["training"], res[1], res[2], a["running_mean"],
                          a["running_var"], a["eps"], t_x, t_w, t_b, t["running_mean"],
                          t["running_var"])
        return res, (t_y, None, None)

    def samples(dtype):
        for args in _bn_samples(dtype, with_training=False):
            yield args[:3] + (True, 0.1, 1e-5), {}
        stats = {"running_mean": randn(3, dtype=dtype),
                 "running_var": uniform((3,), 0.5, 2.0, dtype)}
        yield (randn(2, 3, 4, dtype=dtype), randn(3, dtype=dtype), None), \
            dict(stats, training=True, momentum=0.1, eps=1e-5)
        yield (randn(2, 3, 4, dtype=dtype), randn(3, dtype=dtype), randn(3, dtype=dtype)), \
            dict(stats, training=False, momentum=0.1, eps=1e-5)


@register_vjp(_aten._batch_norm_with_update)
class BatchNormWithUpdate:
    """aten._batch_norm_with_update(x, w, b, rm, rv, momentum, eps) -> (y, save_mean,
    save_rstd, reserve): training-mode batch normalization that updates the running
    statistics in place; the same formulas as :class:`NativeBatchNorm` in training mode
    (derivatives.yaml `_batch_norm_with_update`: batchnorm_backward).  Only the output y is
    differentiable."""

    def fwd(input, weight, bias, running_mean, running_var, momentum, eps):
        res = _aten._batch_norm_with_update(input, weight, bias, running_mean, running_var,
                                            momentum, eps)
        return res, (input, weight, bias is not None, res[1], res[2], eps)

    def bwd(aux, d):
        x, w, has_b, sm, si, eps = aux
        d_x, d_w, d_b, _, _ = _bn_bwd(x, w, has_b, True, sm, si, None, None, eps, d[0])
        return d_x, d_w, d_b

    def jvp(primals, tangents):
        x, w, b, rm, rv, momentum, eps = primals
        t_x, t_w, t_b = tangents[:3]
        res = _aten._batch_norm_with_update(x, w, b, rm, rv, momentum, eps)
        t_y = _bn_tangent(x, w, True, res[1], res[2], None, None, eps, t_x, t_w, t_b, None,
                          None)
        return res, (t_y, None, None, None)

    def samples(dtype):
        # weight and bias given: with None, PyTorch's fake-tensor kernel of this op fails
        for args in _bn_samples(dtype, with_training=False):
            c = args[0].shape[1]
            yield (args[0], randn(c, dtype=dtype), randn(c, dtype=dtype)), \
                {"running_mean": torch.zeros(c, dtype=dtype),
                 "running_var": torch.ones(c, dtype=dtype), "momentum": 0.1, "eps": 1e-5}


# --- group norm -----------------------------------------------------------------------------


def _gn_parts(x: Any, n: int, group: int, m: int, mean: Any, rstd: Any) -> tuple[Any, Any, Any]:
    """x grouped as (N, G, M) with its saved statistics as (N, G, 1) and xhat."""
    xg = torch.reshape(x, (n, group, m))
    mean3, rstd3 = torch.unsqueeze(mean, -1), torch.unsqueeze(rstd, -1)
    return xg, (xg - mean3) * rstd3, rstd3


@register_vjp(torch.native_group_norm)
class NativeGroupNorm:
    """native_group_norm(x, w, b, N, C, HxW, G, eps) -> (y, mean, rstd): statistics per
    (sample, group) of M = C/G * HxW entries, y = xhat w + b per channel.  With g = d_y w
    grouped: d_x = rstd (g - mean(g) - xhat mean(g xhat)) + d_mean / M
    - d_rstd rstd^2 xhat / M (mean and rstd are differentiable outputs:
    d mean / dx = 1/M, d rstd / dx = -rstd^3 (x - mean) / M); d_w = sum(d_y xhat),
    d_b = sum(d_y) over all dims but the channels (derivatives.yaml `native_group_norm`:
    native_group_norm_backward / infinitely_differentiable_native_group_norm_backward).
    JVP: t_mean = mean(t), t_rstd = -rstd^2 mean(xhat t)."""

    outputs = ("out", "mean", "rstd")

    def fwd(input, weight, bias, N, C, HxW, group, eps):
        res = torch.native_group_norm(input, weight, bias, N, C, HxW, group, eps)
        return res, (input, weight, bias is not None, N, group, C // group * HxW, res[1],
                     res[2])

    def bwd(aux, d):
        x, w, has_b, n, group, m, mean, rstd = aux
        d_y, d_mean, d_rstd = d
        shape = tuple(x.shape)
        xg, xhat, rstd3 = _gn_parts(x, n, group, m, mean, rstd)
        d_xg = d_w = d_b = None
        if d_y is not None:
            g = d_y if w is None else d_y * _per_channel(w, x)
            d_xg = _normalize_vjp(torch.reshape(g, (n, group, m)), xhat, rstd3, (-1,))
            red = [k for k in range(x.dim()) if k != 1]
            xhat_full = torch.reshape(xhat, shape)
            d_w = torch.sum(d_y * xhat_full, red) if w is not None else None
            d_b = torch.sum(d_y, red) if has_b else None
        if d_mean is not None:
            d_xg = _add(d_xg, torch.unsqueeze(d_mean, -1) / m)
        if d_rstd is not None:
            d_xg = _add(d_xg, -(torch.unsqueeze(d_rstd, -1) * rstd3 * rstd3 * xhat) / m)
        d_x = None if d_xg is None else torch.reshape(d_xg, shape)
        return d_x, d_w, d_b

    def jvp(primals, tangents):
        x, w, b, n, c, hxw, group, eps = primals
        t_x, t_w, t_b = tangents[:3]
        res = torch.native_group_norm(x, w, b, n, c, hxw, group, eps)
        shape = tuple(x.shape)
        m = c // group * hxw
        xg, xhat, rstd3 = _gn_parts(x, n, group, m, res[1], res[2])
        t_y = t_mean = t_rstd = None
        if t_x is not None:
            tg = torch.reshape(t_x, (n, group, m))
            t_xhat = torch.reshape(_normalize_vjp(tg, xhat, rstd3, (-1,)), shape)
            t_y = _mul(t_xhat, None if w is None else _per_channel(w, x))
            t_mean = torch.mean(tg, -1)
            t_rstd = -(res[2] * res[2]) * torch.mean(xhat * tg, -1)
        if t_w is not None:
            t_y = _add(t_y, torch.reshape(xhat, shape) * _per_channel(t_w, x))
        if t_b is not None:
            t_y = _add(t_y, _per_channel(t_b, x))
        return res, (t_y, t_mean, t_rstd)

    def samples(dtype):
        yield (randn(2, 6, 3, dtype=dtype), randn(6, dtype=dtype), randn(6, dtype=dtype),
               2, 6, 3, 3, 1e-5), {}
        yield (randn(2, 4, 2, 3, dtype=dtype), None, None, 2, 4, 6, 2, 1e-5), {}
        yield (randn(1, 4, 5, dtype=dtype), randn(4, dtype=dtype), None, 1, 4, 5, 1, 0.5), {}
        yield (randn(3, 2, dtype=dtype), randn(2, dtype=dtype), randn(2, dtype=dtype), 3, 2, 1,
               2, 1e-5), {}
