"""Rules for neural-network ops: softmax / log-softmax, layer and batch normalization,
embedding, dropout, losses (cross-entropy, MSE), scaled dot-product attention, 2-D
convolution and pooling.

The forward of each rule calls the fused PyTorch function for the value; the backward is
written in plain tensor code (recomputing cheap statistics such as ``var_mean`` rather than
saving them).  The only fused backward kernels called are the public
``torch.nn.grad.conv2d_input`` / ``conv2d_weight`` (convolution) and ``conv_transpose2d`` (the
adjoint of average pooling).  Formulas follow PyTorch's ``tools/autograd/derivatives.yaml``
(entry named in each rule's docstring) and ``torch/csrc/autograd/FunctionsManual.cpp``.

Configurations a rule cannot differentiate exactly raise :class:`~fxad.errors.RuleError`
naming the op and what to change.
"""
from __future__ import annotations

import inspect
import math
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.utils import _pytree as pytree

from ..errors import RuleError
from . import fused
from .registry import needs_cotangent
from ._base import builtin, randn, uniform, value_of

# --- helpers --------------------------------------------------------------------------------


def _emit(fn: Callable, *args: Any, **kwargs: Any) -> Any:
    """Call ``fn`` as *one* graph node when an argument is a proxy (so a public composite such
    as ``torch.nn.grad.conv2d_input`` appears in the generated code as written, instead of
    being traced into its internals); call it directly on real tensors."""
    fn = getattr(fn, "__wrapped__", fn)  # capture's recording wrapper -> the function itself
    for a in pytree.tree_leaves((args, kwargs)):
        if isinstance(a, fx.Proxy):
            return a.tracer.create_proxy("call_function", fn, args, kwargs)
    return fn(*args, **kwargs)


def _bound(fwd: Callable, primals: tuple, tangents: tuple) -> tuple[dict, dict]:
    """JVP helper: positional ``primals`` / ``tangents`` (in ``fwd``'s parameter order) as dicts
    by parameter name, defaults filled in, missing tangents ``None``."""
    b = inspect.signature(fwd).bind(*primals)
    names = list(b.arguments)
    b.apply_defaults()
    t = {n: None for n in b.arguments}
    t.update({n: v for n, v in zip(names, tangents)})
    return dict(b.arguments), t


def _add(a: Any, b: Any) -> Any:
    if a is None:
        return b
    if b is None:
        return a
    return a + b


def _mul(a: Any, b: Any) -> Any:
    """``a * b`` where ``b`` may be ``None`` (meaning 1)."""
    return a if b is None else a * b


def _pair(v: Any, what: str = "argument") -> tuple[int, int]:
    if isinstance(v, int):
        return (v, v)
    v = tuple(v)
    if len(v) == 1:
        return (v[0], v[0])
    if len(v) != 2:
        raise RuleError(f"expected an int or a pair for {what}, got {v!r}")
    return (v[0], v[1])


def _error(op: str, message: str, hint: str) -> RuleError:
    return RuleError(f"{op}: {message}", op=op, hint=hint)


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


def _channel_shape(x: Any) -> tuple[int, ...]:
    """Shape that broadcasts a per-channel ``(C,)`` vector against ``x`` (channels at dim 1)."""
    return (x.shape[1],) + (1,) * (x.dim() - 2)


def _per_channel(v: Any, x: Any) -> Any:
    shape = _channel_shape(x)
    return v if len(shape) == 1 else v.reshape(shape)


# --- softmax --------------------------------------------------------------------------------


def _softmax_dim(ndim: int) -> int:
    """Implicit ``dim`` of the legacy ``F.softmax(x)`` call (``F._get_softmax_dim``)."""
    return 0 if ndim in (0, 1, 3) else 1


def _softmax(x: Any, dim: int, dtype: Any) -> Any:
    return torch.softmax(x, dim) if dtype is None else torch.softmax(x, dim, dtype=dtype)


def _log_softmax(x: Any, dim: int, dtype: Any) -> Any:
    return torch.log_softmax(x, dim) if dtype is None else torch.log_softmax(x, dim, dtype=dtype)


def _softmax_vjp(out: Any, d: Any, dim: int) -> Any:
    return out * (d - (d * out).sum(dim, keepdim=True))


def _log_softmax_vjp(out: Any, d: Any, dim: int) -> Any:
    return d - torch.exp(out) * d.sum(dim, keepdim=True)


def _softmax_samples(dtype: torch.dtype):
    yield (randn(3, 5, dtype=dtype), 1), {}
    yield (randn(2, 3, 4, dtype=dtype), 0), {}
    yield (randn(2, 3, 4, dtype=dtype), -1), {}
    yield (randn(6, dtype=dtype), 0), {}


@builtin(torch.softmax)
class Softmax:
    """y = softmax(x, dim): d_x = y * (d - sum(d * y, dim))
    (derivatives.yaml `_softmax`: _softmax_backward_data).  JVP: t_y = y * (t - sum(t * y))."""

    residuals = "output"
    recompute = False

    def fwd(input, dim, dtype=None):
        out = _softmax(input, dim, dtype)
        return out, (out, dim)

    def bwd(aux, d):
        out, dim = aux
        return (_softmax_vjp(out, d, dim),)

    def jvp(primals, tangents):
        p, t = _bound(Softmax.fwd, primals, tangents)
        out = _softmax(p["input"], p["dim"], p["dtype"])
        return out, _softmax_vjp(out, t["input"], p["dim"])

    samples = staticmethod(_softmax_samples)


@builtin(torch.log_softmax)
class LogSoftmax:
    """y = log_softmax(x, dim): d_x = d - exp(y) * sum(d, dim)
    (derivatives.yaml `_log_softmax`: _log_softmax_backward_data).
    JVP: t_y = t - sum(exp(y) * t, dim)."""

    residuals = "output"
    recompute = False

    def fwd(input, dim, dtype=None):
        out = _log_softmax(input, dim, dtype)
        return out, (out, dim)

    def bwd(aux, d):
        out, dim = aux
        return (_log_softmax_vjp(out, d, dim),)

    def jvp(primals, tangents):
        p, t = _bound(LogSoftmax.fwd, primals, tangents)
        out = _log_softmax(p["input"], p["dim"], p["dtype"])
        return out, t["input"] - (torch.exp(out) * t["input"]).sum(p["dim"], keepdim=True)

    samples = staticmethod(_softmax_samples)


@builtin(F.softmax)
class FunctionalSoftmax:
    """``F.softmax(x)`` kept by normalization (legacy implicit ``dim``: 0 for 0-, 1- and 3-D
    inputs, else 1, as ``F._get_softmax_dim``); same formula as ``torch.softmax``
    (derivatives.yaml `_softmax`)."""

    residuals = "output"
    recompute = False

    def fwd(input, dim=None, _stacklevel=3, dtype=None):
        dim = _softmax_dim(input.dim()) if dim is None else dim
        out = _softmax(input, dim, dtype)
        return out, (out, dim)

    def bwd(aux, d):
        out, dim = aux
        return (_softmax_vjp(out, d, dim),)

    def jvp(primals, tangents):
        p, t = _bound(FunctionalSoftmax.fwd, primals, tangents)
        out, (_, dim) = FunctionalSoftmax.fwd(p["input"], p["dim"], dtype=p["dtype"])
        return out, _softmax_vjp(out, t["input"], dim)


@builtin(F.log_softmax)
class FunctionalLogSoftmax:
    """``F.log_softmax(x)`` kept by normalization (legacy implicit ``dim``); same formula as
    ``torch.log_softmax`` (derivatives.yaml `_log_softmax`)."""

    residuals = "output"
    recompute = False

    def fwd(input, dim=None, _stacklevel=3, dtype=None):
        dim = _softmax_dim(input.dim()) if dim is None else dim
        out = _log_softmax(input, dim, dtype)
        return out, (out, dim)

    def bwd(aux, d):
        out, dim = aux
        return (_log_softmax_vjp(out, d, dim),)

    def jvp(primals, tangents):
        p, t = _bound(FunctionalLogSoftmax.fwd, primals, tangents)
        out, (_, dim) = FunctionalLogSoftmax.fwd(p["input"], p["dim"], dtype=p["dtype"])
        return out, t["input"] - (torch.exp(out) * t["input"]).sum(dim, keepdim=True)


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


@builtin(F.layer_norm)
class LayerNorm:
    """y = xhat * w + b with xhat = (x - mean) / sqrt(var + eps) over the trailing
    ``normalized_shape`` dims (biased var).  With g = d * w:
    d_x = rstd * (g - mean(g) - xhat * mean(g * xhat)); d_w = d * xhat; d_b = d (the engine
    sums the leading dims) (derivatives.yaml `native_layer_norm`: layer_norm_backward)."""

    residuals = "inputs+intermediates"
    recompute = False

    def fwd(input, normalized_shape, weight=None, bias=None, eps=1e-5):
        dims = tuple(range(input.dim() - len(tuple(normalized_shape)), input.dim()))
        if fused.enabled():
            # save mean and rstd from the forward kernel for the fused backward kernel
            out, mean, rstd = torch.native_layer_norm(input, list(normalized_shape), weight,
                                                      bias, eps)
            return out, ("fused", input, list(normalized_shape), mean, rstd, weight, bias)
        out = F.layer_norm(input, normalized_shape, weight, bias, eps)
        return out, (input, weight, bias is not None, dims, eps)

    def bwd(aux, d):
        if isinstance(aux[0], str):  # "fused": docs/fused_kernels.md
            _, x, shape, mean, rstd, w, b = aux
            d_x, d_w, d_b = torch.ops.aten.native_layer_norm_backward(
                d, x, shape, mean, rstd, w, b, [True, w is not None, b is not None])
            return d_x, None, d_w, d_b
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


def _is_buffer(t: Any) -> bool:
    """None or a module buffer read (``get_attr``): never differentiated."""
    return t is None or (isinstance(t, fx.Proxy) and t.node.op == "get_attr")


@builtin(F.batch_norm)
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
        if fused.enabled() and all(_is_buffer(s) for s in (running_mean, running_var)):
            # saves the batch mean / inverse std for the fused backward kernel
            # (docs/fused_kernels.md); updates running statistics in place like F.batch_norm
            out, save_mean, save_invstd = torch.native_batch_norm(
                input, weight, bias, running_mean, running_var, training, momentum, eps)
            # in training the backward kernel reads only the batch statistics (save_mean,
            # save_invstd), not the running ones, which the forward has just updated
            rm, rv = (None, None) if training is True else (running_mean, running_var)
            return out, ("fused", input, weight, bias is not None, rm, rv,
                         save_mean, save_invstd, training, eps)
        out = F.batch_norm(input, running_mean, running_var, weight=weight, bias=bias,
                           training=training, momentum=momentum, eps=eps)
        stats = None if training else (running_mean, running_var)
        return out, (input, stats, weight, bias is not None, eps)

    def bwd(aux, d):
        if isinstance(aux[0], str):  # "fused": docs/fused_kernels.md
            _, x, w, has_bias, rm, rv, save_mean, save_invstd, training, eps = aux
            d_x, d_w, d_b = torch.ops.aten.native_batch_norm_backward(
                d, x, w, rm, rv, save_mean, save_invstd, training, eps,
                [True, w is not None, has_bias])
            return d_x, None, None, d_w, d_b
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


# --- embedding, dropout ---------------------------------------------------------------------


@builtin(F.embedding)
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


def _dropout_fwd(input: Any, p: float, training: bool) -> tuple[Any, Any]:
    # (p outside [0, 1] already fails during capture, as in eager PyTorch)
    if not training or p == 0.0:
        return input, "identity"
    if p == 1.0:
        return torch.zeros_like(input), "zero"
    mask = (torch.rand_like(input) >= p).to(input.dtype) / (1.0 - p)
    return input * mask, mask


def _dropout_bwd(mask: Any, d: Any) -> Any:
    if isinstance(mask, str):
        return d if mask == "identity" else None
    return d * mask


@builtin(F.dropout)
class Dropout:
    """Training with 0 < p < 1: y = x * mask with mask = (rand_like(x) >= p) / (1 - p) drawn in
    the generated forward and saved; d_x = d * mask (derivatives.yaml `native_dropout`:
    native_dropout_backward).  p == 0 or eval mode: identity; p == 1: zeros.  The mask is
    drawn with ``torch.rand_like``, so it differs from eager ``F.dropout``'s for the same seed
    (same distribution)."""

    residuals = "intermediates"
    recompute = False

    def fwd(input, p=0.5, training=True, inplace=False):
        return _dropout_fwd(input, p, training)

    def bwd(mask, d):
        return (_dropout_bwd(mask, d),)

    def jvp(primals, tangents):
        x, p, training = primals[:3]
        out, mask = _dropout_fwd(x, p, training)
        return out, _dropout_bwd(mask, tangents[0])

    def samples(dtype):
        # deterministic configurations only (training dropout is tested in test_nn_rules.py)
        yield (randn(3, 4, dtype=dtype), 0.0), {}
        yield (randn(3, 4, dtype=dtype),), {"p": 0.4, "training": False}


@builtin(torch.dropout)
class TorchDropout:
    """``torch.dropout(x, p, train)``: same as ``F.dropout`` (derivatives.yaml
    `native_dropout`)."""

    def fwd(input, p, train):
        return _dropout_fwd(input, p, train)

    def bwd(mask, d):
        return (_dropout_bwd(mask, d),)

    def jvp(primals, tangents):
        out, mask = _dropout_fwd(*primals[:3])
        return out, _dropout_bwd(mask, tangents[0])

    def samples(dtype):
        yield (randn(3, 4, dtype=dtype), 0.3, False), {}


# --- losses ---------------------------------------------------------------------------------


_REDUCTION_ENUM = {"none": 0, "mean": 1, "sum": 2}  # at::Reduction


def _fused_cross_entropy(input: Any, target: Any, weight: Any, label_smoothing: float) -> bool:
    """Whether :class:`CrossEntropy` takes its fused path (level ``"all"``; see there)."""
    x, t = value_of(input), value_of(target)
    return (fused.enabled("all") and weight is None and not label_smoothing
            and isinstance(x, torch.Tensor) and isinstance(t, torch.Tensor)
            and x.is_floating_point() and x.dim() in (1, 2) and t.dtype == torch.int64
            and t.dim() == x.dim() - 1)


@builtin(F.cross_entropy)
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
        if _fused_cross_entropy(input, target, weight, label_smoothing):
            lsm = torch.log_softmax(input, input.dim() - 1)
            red = _REDUCTION_ENUM[reduction]
            nll = torch.ops.aten.nll_loss_forward(lsm, target, None, red, ignore_index)
            return nll[0], ("fused", lsm, target, red, ignore_index, nll[1])
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
        if isinstance(aux[0], str):  # "fused": docs/fused_kernels.md
            _, lsm, target, red, ignore_index, total_weight = aux
            d_lsm = torch.ops.aten.nll_loss_backward(d, lsm, target, None, red, ignore_index,
                                                     total_weight)
            d_x = torch.ops.aten._log_softmax_backward_data(d_lsm, lsm, lsm.dim() - 1,
                                                            value_of(lsm).dtype)
            return d_x, None, None
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


@builtin(F.mse_loss)
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


# --- attention ------------------------------------------------------------------------------


def _sdpa_scores(q: Any, k: Any, attn_mask: Any, is_causal: bool, scale: float) -> Any:
    """softmax(q k^T * scale + mask): the attention probabilities, recomputed."""
    s = (q @ k.mT) * scale
    if is_causal:
        L, S = q.shape[-2], k.shape[-2]
        above = q.new_ones((L, S), dtype=torch.bool).triu(1)
        s = s.masked_fill(above, float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            s = s.masked_fill(attn_mask.logical_not(), float("-inf"))
        else:
            s = s + attn_mask
    return torch.softmax(s, -1)


def _sdpa_check(q: Any, k: Any, enable_gqa: bool) -> int:
    """Number of query heads per key head (1 without grouped-query attention)."""
    if enable_gqa and q.dim() >= 3 and k.shape[-3] != q.shape[-3]:
        return q.shape[-3] // k.shape[-3]
    return 1


def _sdpa_dropout_fwd(q: Any, k: Any, v: Any, mask: Any, dropout_p: float, is_causal: bool,
                      scale: Any, group: int) -> tuple[Any, Any, Any]:
    """Attention with dropout on the probabilities, written out: ``(P * M) v`` with the
    dropout mask ``M = (rand_like(P) >= p) / (1 - p)`` drawn in the generated forward.
    Returns ``(out, P, M)``."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if group > 1:
        k, v = k.repeat_interleave(group, -3), v.repeat_interleave(group, -3)
    p = _sdpa_scores(q, k, mask, is_causal, scale)
    keep = (torch.rand_like(p) >= dropout_p).to(p.dtype) / (1.0 - dropout_p)
    return (p * keep) @ v, p, keep


def _cpu_flash_ok(q: Any, k: Any, v: Any, mask: Any, enable_gqa: bool) -> bool:
    """The CPU flash-attention kernels apply: 4-D CPU float inputs of equal heads, no mask."""
    return (mask is None and not enable_gqa and q.dim() == 4 and k.dim() == 4 and v.dim() == 4
            and all(t.device.type == "cpu" for t in (q, k, v))
            and q.dtype in (torch.float32, torch.float64, torch.bfloat16)
            and q.dtype == k.dtype == v.dtype and k.shape[-3] == q.shape[-3]
            and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward"))


@builtin(F.scaled_dot_product_attention)
class ScaledDotProductAttention:
    """y = P v with P = softmax(q k^T * scale + mask) (causal: upper triangle masked to -inf;
    bool mask: False masked to -inf; float mask added).  Backward recomputes P:
    d_v = P^T d; dP = d v^T; dS = P * (dP - sum(dP * P, -1)); d_q = dS k * scale;
    d_k = dS^T q * scale; a float mask gets dS (derivatives.yaml
    `_scaled_dot_product_flash_attention` / math reference `_scaled_dot_product_attention_math`).
    ``enable_gqa``: k and v heads are repeated (repeat_interleave) and their cotangents summed
    over each group.

    ``dropout_p > 0``: the probabilities are computed in the generated forward and multiplied
    by a dropout mask ``M = (rand_like(P) >= p) / (1 - p)`` saved for the backward, y = (P*M) v
    (as PyTorch's math reference does; the mask differs from the fused kernel's for the same
    seed, with the same distribution): d_v = (P*M)^T d, dP = (d v^T) * M, then as above."""

    residuals = "inputs+output+intermediates"
    recompute = False

    def fwd(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
            enable_gqa=False):
        group = _sdpa_check(query, key, enable_gqa)
        if dropout_p > 0.0:
            out, p, keep = _sdpa_dropout_fwd(query, key, value, attn_mask, dropout_p, is_causal,
                                             scale, group)
            return out, ("dropout", query, key, value, attn_mask, p, keep, scale, group)
        kw: dict[str, Any] = {}
        if attn_mask is not None:
            kw["attn_mask"] = attn_mask
        if is_causal:
            kw["is_causal"] = True
        if scale is not None:
            kw["scale"] = scale
        if enable_gqa:
            kw["enable_gqa"] = True
        if fused.enabled() and _cpu_flash_ok(query, key, value, attn_mask, enable_gqa):
            # CPU flash attention: save its logsumexp for the fused backward kernel
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                query, key, value, 0.0, bool(is_causal), scale=scale)
            return out, ("fused", query, key, value, out, lse, bool(is_causal), scale)
        out = F.scaled_dot_product_attention(query, key, value, **kw)
        return out, (query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)

    def bwd(aux, d):
        if isinstance(aux[0], str) and aux[0] == "fused":  # docs/fused_kernels.md
            _, q, k, v, out, lse, is_causal, scale = aux
            d_q, d_k, d_v = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                d, q, k, v, out, lse, 0.0, is_causal, scale=scale)
            return d_q, d_k, d_v, None
        if isinstance(aux[0], str):  # "dropout"
            _, q, k, v, mask, p, keep, scale, group = aux
            scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
            if group > 1:
                k = k.repeat_interleave(group, -3)
                v = v.repeat_interleave(group, -3)
            d_v = (p * keep).mT @ d
            dp = (d @ v.mT) * keep
        else:
            q, k, v, mask, dropout_p, is_causal, scale, enable_gqa = aux
            group = _sdpa_check(q, k, enable_gqa)
            scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
            if group > 1:
                k = k.repeat_interleave(group, -3)
                v = v.repeat_interleave(group, -3)
            p = _sdpa_scores(q, k, mask, is_causal, scale)
            d_v = p.mT @ d
            dp = d @ v.mT
        ds = p * (dp - (dp * p).sum(-1, keepdim=True))
        d_q = (ds @ k) * scale
        d_k = (ds.mT @ q) * scale
        if group > 1:
            d_k = d_k.unflatten(-3, (d_k.shape[-3] // group, group)).sum(-3)
            d_v = d_v.unflatten(-3, (d_v.shape[-3] // group, group)).sum(-3)
        d_mask = ds if mask is not None and mask.dtype != torch.bool else None
        return d_q, d_k, d_v, d_mask

    def jvp(primals, tangents):
        pr, t = _bound(ScaledDotProductAttention.fwd, primals, tangents)
        q, k, v, mask = pr["query"], pr["key"], pr["value"], pr["attn_mask"]
        group = _sdpa_check(q, k, pr["enable_gqa"])
        keep = None
        if pr["dropout_p"] > 0.0:
            out, _, keep = _sdpa_dropout_fwd(q, k, v, mask, pr["dropout_p"], pr["is_causal"],
                                             pr["scale"], group)
        else:
            out = F.scaled_dot_product_attention(q, k, v, mask, 0.0, pr["is_causal"],
                                                 scale=pr["scale"], enable_gqa=pr["enable_gqa"])
        scale = 1.0 / math.sqrt(q.shape[-1]) if pr["scale"] is None else pr["scale"]
        tk, tv = t["key"], t["value"]
        if group > 1:
            k, v = k.repeat_interleave(group, -3), v.repeat_interleave(group, -3)
            tk = None if tk is None else tk.repeat_interleave(group, -3)
            tv = None if tv is None else tv.repeat_interleave(group, -3)
        p = _sdpa_scores(q, k, mask, pr["is_causal"], scale)
        ts = None
        if t["query"] is not None:
            ts = (t["query"] @ k.mT) * scale
        if tk is not None:
            ts = _add(ts, (q @ tk.mT) * scale)
        if t["attn_mask"] is not None:
            ts = _add(ts, t["attn_mask"])
        pk = p if keep is None else p * keep
        t_out = None
        if ts is not None:
            tp = p * (ts - (ts * p).sum(-1, keepdim=True))
            t_out = (tp if keep is None else tp * keep) @ v
        if tv is not None:
            t_out = _add(t_out, pk @ tv)
        return out, t_out

    def samples(dtype):
        q, k = randn(2, 3, 4, dtype=dtype), randn(2, 5, 4, dtype=dtype)
        v = randn(2, 5, 3, dtype=dtype)
        yield (q, k, v), {}
        yield (randn(2, 2, 4, 3, dtype=dtype), randn(2, 2, 4, 3, dtype=dtype),
               randn(2, 2, 4, 3, dtype=dtype)), {"is_causal": True}
        yield (q, k, v, randn(3, 5, dtype=dtype)), {"scale": 0.3}
        yield (q, k, v, torch.tensor([[True, False, True, True, False]] * 3)), {}
        yield (randn(1, 4, 3, 2, dtype=dtype), randn(1, 2, 5, 2, dtype=dtype),
               randn(1, 2, 5, 3, dtype=dtype)), {"enable_gqa": True}


# --- convolution, pooling -------------------------------------------------------------------


def _conv_padding(padding: Any, weight_shape: Any, dilation: Any) -> tuple[int, int]:
    """Integer padding of ``torch.conv2d``; ``'same'`` must be symmetric."""
    if padding == "valid":
        return (0, 0)
    if padding == "same":
        pads = []
        for k, dl in zip(weight_shape[-2:], _pair(dilation, "dilation")):
            total = dl * (k - 1)
            if total % 2:
                raise _error("torch.conv2d",
                             f"padding='same' with kernel {tuple(weight_shape[-2:])} and dilation "
                             f"{dilation} pads asymmetrically, which is not supported",
                             "use an odd kernel size (or even dilation), or pad explicitly "
                             "with F.pad and use padding=0")
            pads.append(total // 2)
        return (pads[0], pads[1])
    return _pair(padding, "padding")


@builtin(torch.conv2d)
class Conv2d:
    """y = conv2d(x, w) + b: d_x = conv2d_input(x.shape, w, d, ...) (the transposed
    convolution), d_w = conv2d_weight(x, w.shape, d, ...), d_b = sum(d) over (N, H, W)
    (derivatives.yaml `convolution`: convolution_backward).  ``torch.nn.grad.conv2d_input`` /
    ``conv2d_weight`` are the public fused kernels fxad allows for convolutions.  String
    padding ('valid', symmetric 'same') is converted to integers; unbatched (C, H, W) inputs
    are supported."""

    residuals = "inputs"
    recompute = False

    def fwd(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
        pad = _conv_padding(padding, weight.shape, dilation)
        out = torch.conv2d(input, weight, bias, stride, padding, dilation, groups)
        return out, (input, weight, bias is not None, stride, pad, dilation, groups)

    def bwd(aux, d):
        x, w, has_bias, stride, pad, dilation, groups = aux
        unbatched = x.dim() == 3
        if unbatched:
            x, d = x.unsqueeze(0), d.unsqueeze(0)
        if fused.enabled() and not unbatched:
            # one fused kernel for all needed cotangents (docs/fused_kernels.md)
            mask = [needs_cotangent("input"), needs_cotangent("weight"),
                    has_bias and needs_cotangent("bias")]
            d_x, d_w, d_b = torch.ops.aten.convolution_backward(
                d, x, w, [w.shape[0]] if has_bias else None, list(_pair(stride)), list(pad),
                list(_pair(dilation)), False, [0, 0], groups, mask)
            return (d_x if mask[0] else None), (d_w if mask[1] else None), \
                (d_b if mask[2] else None)
        d_x = _emit(torch.nn.grad.conv2d_input, tuple(x.shape), w, d, stride, pad, dilation,
                    groups)
        d_w = _emit(torch.nn.grad.conv2d_weight, x, tuple(w.shape), d, stride, pad, dilation,
                    groups)
        if unbatched:
            d_x = d_x.squeeze(0)
        d_b = d.sum((0, 2, 3)) if has_bias else None
        return d_x, d_w, d_b

    def jvp(primals, tangents):
        p, t = _bound(Conv2d.fwd, primals, tangents)
        x, w = p["input"], p["weight"]
        rest = (p["stride"], p["padding"], p["dilation"], p["groups"])
        out = torch.conv2d(x, w, p["bias"], *rest)
        t_out = None
        if t["input"] is not None:
            t_out = torch.conv2d(t["input"], w, None, *rest)
        if t["weight"] is not None or t["bias"] is not None:
            tw = torch.zeros_like(w) if t["weight"] is None else t["weight"]
            t_out = _add(t_out, torch.conv2d(x, tw, t["bias"], *rest))
        return out, t_out

    def samples(dtype):
        x, w = randn(2, 3, 6, 5, dtype=dtype), randn(4, 3, 3, 3, dtype=dtype)
        b = randn(4, dtype=dtype)
        yield (x, w, b), {}
        yield (x, w, b, 2, 1), {}
        yield (x, randn(4, 3, 2, 3, dtype=dtype)), {"stride": (2, 1), "padding": (1, 0),
                                                    "dilation": (1, 2)}
        yield (randn(2, 4, 5, 5, dtype=dtype), randn(6, 2, 3, 3, dtype=dtype), None, 1, 1, 1, 2), {}
        yield (x, w, b), {"padding": "same"}
        yield (x, w), {"padding": "valid"}
        yield (randn(3, 6, 5, dtype=dtype), w, b), {"padding": 1}


def _max_pool2d_fwd(input, kernel_size, stride, padding, dilation, ceil_mode, return_indices):
    both = F.max_pool2d_with_indices(input, kernel_size, stride, padding, dilation,
                                     ceil_mode=ceil_mode, return_indices=True)
    out, idx = both
    if fused.enabled() and input.dim() == 4:
        k = _pair(kernel_size, "kernel_size")
        st = k if stride is None or (isinstance(stride, (tuple, list)) and len(stride) == 0) \
            else _pair(stride, "stride")
        return (both if return_indices else out), (
            "fused", input, idx, list(k), list(st), list(_pair(padding, "padding")),
            list(_pair(dilation, "dilation")), bool(ceil_mode))
    return (both if return_indices else out), (input.shape, idx)


def _max_pool2d_bwd(aux, d):
    if isinstance(d, tuple):
        d = d[0]
        if d is None:
            return (None,)
    if isinstance(aux[0], str):  # "fused": docs/fused_kernels.md
        _, x, idx, k, st, pad, dil, ceil = aux
        return (torch.ops.aten.max_pool2d_with_indices_backward(d, x, k, st, pad, dil, ceil, idx),)
    shape, idx = aux
    flat = d.new_zeros(tuple(shape[:-2]) + (shape[-2] * shape[-1],))
    return (flat.scatter_add(-1, idx.flatten(-2), d.flatten(-2)).reshape(shape),)


def _max_pool2d_jvp(fwd, primals, tangents, both=False):
    """t_y = t gathered at the argmax indices; a tuple value gets the tangent (t_y, None)."""
    p, t = _bound(fwd, primals, tangents)
    res = F.max_pool2d_with_indices(p["input"], p["kernel_size"], p["stride"],
                                    p["padding"], p["dilation"], p["ceil_mode"], True)
    out, idx = res[0], res[1]
    t_out = t["input"].flatten(-2).gather(-1, idx.flatten(-2)).reshape(out.shape)
    if both or p["return_indices"]:  # the op's own tuple result (a node, not a Python tuple)
        return res, (t_out, None)
    return out, t_out


def _max_pool2d_samples(dtype):
    x = randn(2, 3, 6, 7, dtype=dtype)
    yield (x, 2), {}
    yield (x, 3, 1), {}  # overlapping windows
    yield (x, (3, 2)), {"stride": (2, 1), "padding": 1, "dilation": (1, 2)}
    yield (x, 3), {"stride": 2, "ceil_mode": True}
    yield (randn(3, 5, 5, dtype=dtype), 2), {}
    yield (x, 2), {"return_indices": True}


@builtin(F.max_pool2d)
class MaxPool2d:
    """y = max over each window: d_x = scatter_add of d at the argmax indices (from
    ``max_pool2d_with_indices``) into zeros of shape (N, C, H*W), exact for overlapping windows
    (derivatives.yaml `max_pool2d_with_indices`: max_pool2d_with_indices_backward)."""

    residuals = "inputs+intermediates"
    recompute = False

    def fwd(input, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False,
            return_indices=False):
        return _max_pool2d_fwd(input, kernel_size, stride, padding, dilation, ceil_mode,
                               return_indices)

    bwd = staticmethod(_max_pool2d_bwd)

    def jvp(primals, tangents):
        return _max_pool2d_jvp(MaxPool2d.fwd, primals, tangents)

    samples = staticmethod(_max_pool2d_samples)


@builtin(F.max_pool2d_with_indices)
class MaxPool2dWithIndices:
    """``F.max_pool2d(..., return_indices=True)`` (same formula as ``F.max_pool2d``;
    derivatives.yaml `max_pool2d_with_indices`)."""

    def fwd(input, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False,
            return_indices=False):
        return _max_pool2d_fwd(input, kernel_size, stride, padding, dilation, ceil_mode, True)

    bwd = staticmethod(_max_pool2d_bwd)

    def jvp(primals, tangents):
        return _max_pool2d_jvp(MaxPool2dWithIndices.fwd, primals, tangents, both=True)


def _sum_pool_adjoint(d: Any, shape: Any, kernel: tuple[int, int], stride: tuple[int, int],
                      padding: tuple[int, int]) -> Any:
    """Adjoint of the window *sum* of a 2-D pooling: depthwise ``conv_transpose2d`` of ``d``
    with a ones kernel, cropped or ``output_padding``-extended back to ``shape``."""
    oh, ow = d.shape[-2], d.shape[-1]
    H, W = shape[-2], shape[-1]
    full = [(o - 1) * s - 2 * p + k for o, s, p, k in zip((oh, ow), stride, padding, kernel)]
    out_pad = tuple(max(n - f, 0) for n, f in zip((H, W), full))
    ones = d.new_ones((1, 1) + kernel)
    d_x = F.conv_transpose2d(d.reshape(-1, 1, oh, ow), ones, stride=stride, padding=padding,
                             output_padding=out_pad)
    if full[0] > H or full[1] > W:  # ceil_mode windows hanging past the input
        d_x = d_x[..., :H, :W]
    return d_x.reshape(shape)


def _avg_pool_options(stride: Any, padding: Any, ceil_mode: bool, count_include_pad: bool,
                      divisor_override: Any) -> dict[str, Any]:
    """Keyword arguments of ``F.avg_pool2d`` that differ from the defaults."""
    kw: dict[str, Any] = {}
    if stride is not None and not (isinstance(stride, (tuple, list)) and len(stride) == 0):
        kw["stride"] = stride
    if padding not in (0, (0, 0), [0, 0], (0,), [0]):
        kw["padding"] = padding
    if ceil_mode:
        kw["ceil_mode"] = True
    if not count_include_pad:
        kw["count_include_pad"] = False
    if divisor_override is not None:
        kw["divisor_override"] = divisor_override
    return kw


@builtin(F.avg_pool2d)
class AvgPool2d:
    """y = window sum / divisor: d_x = the adjoint of the window sum applied to d / divisor,
    i.e. a depthwise ``conv_transpose2d`` of d with a ones kernel (stride, padding and
    output_padding chosen to restore H, W) (derivatives.yaml `avg_pool2d`:
    avg_pool2d_backward).  The divisor is kh*kw, ``divisor_override``, or with
    ``count_include_pad=False`` the number of in-bounds elements of each window (computed as
    ``avg_pool2d(ones, ..., divisor_override=1)``).  Raises for ``ceil_mode`` windows that hang
    past the padded input with ``count_include_pad=True`` (their divisor shrinks)."""

    def fwd(input, kernel_size, stride=None, padding=0, ceil_mode=False,
            count_include_pad=True, divisor_override=None):
        out = F.avg_pool2d(input, kernel_size, **_avg_pool_options(
            stride, padding, ceil_mode, count_include_pad, divisor_override))
        return out, (input.shape, tuple(out.shape[-2:]), kernel_size, stride, padding, ceil_mode,
                     count_include_pad, divisor_override)

    def bwd(aux, d):
        shape, out_hw, kernel_size, stride, padding, ceil_mode, include_pad, override = aux
        kernel = _pair(kernel_size, "kernel_size")
        stride = kernel if stride is None or (not isinstance(stride, int) and len(stride) == 0) \
            else _pair(stride, "stride")
        padding = _pair(padding, "padding")
        H, W = shape[-2], shape[-1]
        # furthest extent of the last window along each dim, in unpadded input coordinates
        ends = [(o - 1) * s - p + k for o, s, p, k in zip(out_hw, stride, padding, kernel)]
        if override is not None:
            d = d / override
        elif include_pad:
            if ends[0] > H + padding[0] or ends[1] > W + padding[1]:
                raise _error(
                    "torch.nn.functional.avg_pool2d",
                    "ceil_mode=True with windows that hang past the padded input is not "
                    "supported with count_include_pad=True (those windows have a smaller divisor)",
                    "use ceil_mode=False, choose sizes where ceil_mode adds no partial window, "
                    "or pass count_include_pad=False")
            d = d / (kernel[0] * kernel[1])
        elif padding == (0, 0) and ends[0] <= H and ends[1] <= W:
            d = d / (kernel[0] * kernel[1])
        else:  # divisor: in-bounds elements per window
            ones = d.new_ones((1,) * (len(shape) - 2) + (H, W))
            counts = F.avg_pool2d(ones, kernel, **_avg_pool_options(
                stride, padding, ceil_mode, True, 1))
            d = d / counts
        return (_sum_pool_adjoint(d, shape, kernel, stride, padding),)

    def jvp(primals, tangents):
        p, t = _bound(AvgPool2d.fwd, primals, tangents)
        args = (p["kernel_size"], p["stride"], p["padding"], p["ceil_mode"],
                p["count_include_pad"], p["divisor_override"])
        return F.avg_pool2d(p["input"], *args), F.avg_pool2d(t["input"], *args)

    def samples(dtype):
        x = randn(2, 3, 6, 7, dtype=dtype)
        yield (x, 2), {}
        yield (x, 3, 1), {}
        yield (x, (3, 2), (2, 1), 1), {}
        yield (x, 3, 2, 1), {"count_include_pad": False}
        yield (x, 2), {"ceil_mode": True, "count_include_pad": False}
        yield (randn(2, 3, 7, 7, dtype=dtype), 3, 2), {"ceil_mode": True}  # no partial window
        yield (x, 3, 2, 1), {"divisor_override": 5}
        yield (randn(3, 5, 6, dtype=dtype), 2), {}


@builtin(F.adaptive_avg_pool2d)
class AdaptiveAvgPool2d:
    """Output cell (i, j) averages rows [floor(iH/oh), ceil((i+1)H/oh)) and the matching
    columns.  When oh | H and ow | W this is avg_pool2d with kernel = stride = (H/oh, W/ow),
    whose adjoint repeats d / (kh*kw) over each window (output 1x1: d / (H*W), expanded by the
    engine).  Otherwise d_x = A_h^T d A_w with the row-averaging matrices A (derivatives.yaml
    `_adaptive_avg_pool2d`: _adaptive_avg_pool2d_backward)."""

    def fwd(input, output_size):
        out = F.adaptive_avg_pool2d(input, output_size)
        return out, (input.shape, input.dtype)

    def bwd(aux, d):
        shape, dtype = aux
        H, W = shape[-2], shape[-1]
        oh, ow = d.shape[-2], d.shape[-1]
        if H % oh == 0 and W % ow == 0:
            kh, kw = H // oh, W // ow
            d_x = d / (kh * kw)
            if oh > 1 and kh > 1:  # dims of size 1 are expanded by the engine
                d_x = d_x.repeat_interleave(kh, -2)
            if ow > 1 and kw > 1:
                d_x = d_x.repeat_interleave(kw, -1)
            return (d_x,)
        return (_averaging_matrix(oh, H, d).mT @ d @ _averaging_matrix(ow, W, d),)

    def jvp(primals, tangents):
        (x, output_size), t = primals, tangents[0]
        return F.adaptive_avg_pool2d(x, output_size), F.adaptive_avg_pool2d(t, output_size)

    def samples(dtype):
        x = randn(2, 3, 6, 4, dtype=dtype)
        yield (x, 1), {}
        yield (x, (3, 2)), {}
        yield (x, (6, 1)), {}
        yield (x, (4, 3)), {}  # windows of unequal size
        yield (x, (None, 3)), {}
        yield (randn(3, 5, 7, dtype=dtype), 2), {}


def _averaging_matrix(o: int, n: int, like: Any) -> Any:
    """(o, n) matrix averaging adaptive-pooling window i: [floor(i n / o), ceil((i+1) n / o))."""
    i = torch.arange(o, device=like.device).unsqueeze(1)
    start = (i * n) // o
    end = ((i + 1) * n + o - 1) // o
    pos = torch.arange(n, device=like.device)
    inside = (pos >= start) & (pos < end)
    return inside.to(like.dtype) / (end - start).to(like.dtype)
