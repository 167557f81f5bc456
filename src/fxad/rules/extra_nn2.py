"""Rules for the ATen-level normalization / softmax / dropout entry points and a few losses:
``torch.native_layer_norm``, ``torch.native_batch_norm``, ``torch._native_batch_norm_legit``
(both overloads), ``aten._batch_norm_with_update``, ``torch.native_group_norm``,
``aten._softmax_backward_data``, ``aten._safe_softmax.default``,
``aten.native_dropout_backward.default``, ``F.multi_margin_loss``,
``F.multilabel_margin_loss`` and ``F.linear_cross_entropy``.

The forward of each rule calls the op the user called; backward and JVP are plain tensor
code.  Formulas follow PyTorch's ``tools/autograd/derivatives.yaml`` (entry named in each
rule's docstring) and reuse the helpers of :mod:`fxad.rules.nn` / :mod:`fxad.rules.extra_nn`
(``_normalize_vjp`` = the standardization backward, ``_softmax_vjp``, the cross-entropy
backward).  Statistics outputs follow autograd: the saved mean / inverse std of the layer
and batch norms are non-differentiable outputs (their cotangents are ignored, their tangents
are zero), while ``native_group_norm``'s mean and rstd are differentiable
(``infinitely_differentiable_native_group_norm_backward``).

``F.multi_head_attention_forward`` has no rule here: fxad's tracer records it as one call
(it is a ``torch.nn.functional`` function), so it stays on the autograd fallback.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ._base import builtin, randn, uniform
from .nn import CrossEntropy, _add, _mul, _normalize_vjp, _per_channel, _softmax_vjp

_aten = torch.ops.aten


# --- layer norm -----------------------------------------------------------------------------


def _ln_dims(x: Any, normalized_shape: Any) -> tuple[int, ...]:
    return tuple(range(x.dim() - len(tuple(normalized_shape)), x.dim()))


@builtin(torch.native_layer_norm)
class NativeLayerNorm:
    """native_layer_norm(x, shape, w, b, eps) -> (y, mean, rstd) with xhat = (x - mean) rstd
    over the trailing ``shape`` dims and y = xhat w + b.  With g = d_y w:
    d_x = rstd (g - mean(g) - xhat mean(g xhat)), d_w = d_y xhat, d_b = d_y (the engine sums
    the leading dims) (derivatives.yaml `native_layer_norm`: layer_norm_backward).  mean and
    rstd are non-differentiable outputs in autograd: their cotangents are ignored."""

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


@builtin(torch.native_batch_norm)
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


@builtin(torch._native_batch_norm_legit)
class NativeBatchNormLegit:
    """_native_batch_norm_legit(x, w, b, [rm, rv,] training, momentum, eps) -> (y, save_mean,
    save_invstd): the same formulas as :class:`NativeBatchNorm` (derivatives.yaml
    `_native_batch_norm_legit`: batchnorm_backward); the overload without running statistics
    always normalizes with the batch statistics."""

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


@builtin(_aten._batch_norm_with_update)
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


@builtin(torch.native_group_norm)
class NativeGroupNorm:
    """native_group_norm(x, w, b, N, C, HxW, G, eps) -> (y, mean, rstd): statistics per
    (sample, group) of M = C/G * HxW entries, y = xhat w + b per channel.  With g = d_y w
    grouped: d_x = rstd (g - mean(g) - xhat mean(g xhat)) + d_mean / M
    - d_rstd rstd^2 xhat / M (mean and rstd are differentiable outputs:
    d mean / dx = 1/M, d rstd / dx = -rstd^3 (x - mean) / M); d_w = sum(d_y xhat),
    d_b = sum(d_y) over all dims but the channels (derivatives.yaml `native_group_norm`:
    native_group_norm_backward / infinitely_differentiable_native_group_norm_backward).
    JVP: t_mean = mean(t), t_rstd = -rstd^2 mean(xhat t)."""

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


# --- softmax, dropout backward --------------------------------------------------------------


@builtin(_aten._softmax_backward_data)
class SoftmaxBackwardData:
    """_softmax_backward_data(g, y, dim, input_dtype) = y (g - S), S = sum(g y, dim): the
    softmax VJP, linear in g and bilinear in (g, y).  d_g = y (d - sum(d y)) (the softmax
    VJP again, it is self-adjoint); d_y = d (g - S) - g sum(d y).  JVP:
    t_out = y (t_g - sum(t_g y)) + t_y (g - S) - y sum(g t_y) (derived from the definition;
    derivatives.yaml `_softmax_backward_data`)."""

    def fwd(grad_output, output, dim, input_dtype):
        out = _aten._softmax_backward_data(grad_output, output, dim, input_dtype)
        return out, (grad_output, output, dim)

    def bwd(aux, d):
        g, y, dim = aux
        s = (g * y).sum(dim, keepdim=True)
        dy_sum = (d * y).sum(dim, keepdim=True)
        return y * (d - dy_sum), d * (g - s) - g * dy_sum, None, None

    def jvp(primals, tangents):
        g, y, dim, input_dtype = primals
        t_g, t_y = tangents[:2]
        out = _aten._softmax_backward_data(g, y, dim, input_dtype)
        t = None if t_g is None else _softmax_vjp(y, t_g, dim)
        if t_y is not None:
            s = (g * y).sum(dim, keepdim=True)
            t = _add(t, t_y * (g - s) - y * (g * t_y).sum(dim, keepdim=True))
        return out, t

    def samples(dtype):
        for shape, dim in (((5,), 0), ((3, 4), 1), ((2, 3, 4), 0), ((2, 3, 4), -1)):
            yield (randn(*shape, dtype=dtype), torch.softmax(randn(*shape, dtype=dtype), dim),
                   dim, dtype), {}


@builtin(_aten._safe_softmax.default)
class SafeSoftmax:
    """_safe_softmax(x, dim, dtype): softmax whose rows of all -inf give 0 instead of NaN.
    d_x = y (d - sum(d y, dim)) (derivatives.yaml `_safe_softmax`: _softmax_backward_data;
    a fully masked row has y = 0 and gets a zero cotangent).  JVP: y (t - sum(t y))."""

    def fwd(self, dim, dtype=None):
        out = _aten._safe_softmax.default(self, dim, dtype)
        return out, (out, dim)

    def bwd(aux, d):
        y, dim = aux
        return _softmax_vjp(y, d, dim), None, None

    def jvp(primals, tangents):
        x, dim, dtype = primals
        out = _aten._safe_softmax.default(x, dim, dtype)
        t = tangents[0]
        return out, (None if t is None else _softmax_vjp(out, t.to(out.dtype), dim))

    def samples(dtype):
        yield (randn(2, 3, 4, dtype=dtype), 1), {}
        yield (randn(5, dtype=dtype), 0), {}
        x = randn(3, 4, dtype=dtype)
        x[1] = float("-inf")
        x[2, 0] = float("-inf")
        yield (x, 1), {}


@builtin(_aten.native_dropout_backward.default)
class NativeDropoutBackward:
    """native_dropout_backward(g, mask, scale) = g mask scale: linear in g, so
    d_g = d mask scale and t_out = t mask scale (derivatives.yaml
    `native_dropout_backward`)."""

    def fwd(grad_output, mask, scale):
        out = _aten.native_dropout_backward.default(grad_output, mask, scale)
        return out, (mask, scale)

    def bwd(aux, d):
        mask, scale = aux
        return d * mask * scale, None, None

    def jvp(primals, tangents):
        g, mask, scale = primals
        out = _aten.native_dropout_backward.default(g, mask, scale)
        t = tangents[0]
        return out, (None if t is None else t * mask * scale)

    def samples(dtype):
        for shape in ((3, 4), (5,), ()):
            for scale in (0.0, 2.0):
                yield (randn(*shape, dtype=dtype), torch.rand(shape) > 0.4, scale), {}


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
    from .nn import _legacy_reduction

    return _legacy_reduction(op, size_average, reduce, reduction)


@builtin(F.multi_margin_loss)
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


@builtin(F.multilabel_margin_loss)
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


@builtin(F.linear_cross_entropy)
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
