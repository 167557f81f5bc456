"""Pooling, unpooling, resampling and local response normalization in 1, 2 and 3 spatial
dimensions (the 2-d max / average / adaptive-average pools live in :mod:`fxad.rules.nn`).

* Max pools ``F.max_pool1d/3d`` (and ``*_with_indices``) and adaptive max pools
  ``F.adaptive_max_pool1d/2d/3d`` (and ``*_with_indices``): the forward also returns the argmax
  indices into the flattened spatial dims; the backward scatter-adds the cotangent there and the
  JVP gathers the tangent there (derivatives.yaml `max_pool3d_with_indices`,
  `adaptive_max_pool2d`: max_pool_double_backward / the ``*_backward`` kernels).
* Average pools ``torch.avg_pool1d``, ``F.avg_pool3d``: the adjoint of a window sum is a
  depthwise transposed convolution with a ones kernel, applied to ``d / divisor`` where the
  divisor of each window is computed from the window bounds (derivatives.yaml `avg_pool3d`).
* Adaptive average pools ``torch.adaptive_avg_pool1d``, ``F.adaptive_avg_pool3d``: separable
  averaging matrices A, d_x = d contracted with A along each spatial dim
  (derivatives.yaml `_adaptive_avg_pool3d`).
* ``F.max_unpool1d/2d/3d``: y = zeros scattered with x at the indices, so d_x = d gathered
  at the indices (derivatives.yaml `max_unpool2d`: max_pool_double_backward).
* ``torch.ops.aten.max_pool2d_with_indices_backward`` (written by the fused 2-d max-pool rule):
  linear in ``grad_output`` (a scatter-add at the indices), so its own cotangent is the gather
  of ``d`` at the indices; it does not depend on the values of ``self``
  (derivatives.yaml `max_pool2d_with_indices_backward`).
* ``F.interpolate`` (all modes, antialias included), ``torch.ops.aten._upsample_bilinear2d_aa``:
  every mode is a separable linear map y = A_1 ⊗ ... ⊗ A_n x.  The backward is its adjoint,
  d_x = d contracted with A_k along spatial dim k; the 1-d matrix A_k is obtained exactly by
  resampling an identity matrix with the same call restricted to dim k (other dims of size 1,
  scale 1, which every mode maps identically).  (derivatives.yaml `upsample_*`: the
  ``upsample_*_backward`` kernels are the same adjoints.)
* ``F.local_response_norm``: y = x * b^(-beta), b = k + alpha * W(x^2), W the average over a
  window of ``size`` channels; d_x = d b^(-beta) - 2 alpha beta x W^T(d x b^(-beta-1)),
  where W^T is the window average with the padding mirrored.

All backward and JVP code is plain torch (no fused backward kernels).
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from ._base import builtin, randn
from .nn import _averaging_matrix, _bound, _error

# --- helpers ---------------------------------------------------------------------------------


def _ntuple(v: Any, n: int, what: str = "argument") -> tuple:
    """``v`` as an ``n``-tuple (an int or a 1-sequence is repeated)."""
    if isinstance(v, (int, float)):
        return (v,) * n
    v = tuple(v)
    if len(v) == 1:
        return v * n
    if len(v) != n:
        raise _error("pooling", f"expected {n} values for {what}, got {v!r}",
                     f"pass an int or a sequence of {n} ints")
    return v


def _no_stride(stride: Any) -> bool:
    return stride is None or (isinstance(stride, (tuple, list)) and len(stride) == 0)


def _first(d: Any) -> Any:
    """The value's cotangent of an op that may return ``(value, indices)``."""
    return d[0] if isinstance(d, tuple) else d


def _scatter_spatial(d: Any, idx: Any, shape: Any, nd: int) -> Any:
    """Adjoint of gathering at ``idx`` (indices into the flattened last ``nd`` dims of a tensor
    of ``shape``): zeros of ``shape`` with ``d`` scatter-added at ``idx``."""
    flat = d.new_zeros(tuple(shape[:-nd]) + (math.prod(shape[-nd:]),))
    return flat.scatter_add(-1, idx.flatten(-nd), d.flatten(-nd)).reshape(shape)


def _gather_spatial(t: Any, idx: Any, nd: int) -> Any:
    """``t`` (flattened over its last ``nd`` dims) gathered at ``idx``, shaped like ``idx``."""
    return t.flatten(-nd).gather(-1, idx.flatten(-nd)).reshape(idx.shape)


# --- max pools ---------------------------------------------------------------------------------


def _max_pool_fwd(with_indices: Any, input, kernel_size, stride, padding, dilation, ceil_mode,
                  return_indices):
    out, idx = with_indices(input, kernel_size, stride, padding, dilation, ceil_mode, True)
    return ((out, idx) if return_indices else out), (input.shape, idx)


def _max_pool_bwd(nd: int, aux: Any, d: Any) -> tuple:
    shape, idx = aux
    d = _first(d)
    if d is None:
        return (None,)
    return (_scatter_spatial(d, idx, shape, nd),)


def _max_pool_jvp(nd: int, with_indices: Any, fwd: Any, primals: tuple, tangents: tuple,
                  always_tuple: bool = False) -> tuple:
    """t_y = the input tangent gathered at the argmax indices."""
    p, t = _bound(fwd, primals, tangents)
    both = with_indices(p["input"], p["kernel_size"], p["stride"], p["padding"],
                        p["dilation"], p["ceil_mode"], True)
    t_out = _gather_spatial(t["input"], both[1], nd)
    if always_tuple or p["return_indices"]:
        return both, (t_out, None)  # the value is the op's own (values, indices) result
    return both[0], t_out


def _max_pool1d_samples(dtype):
    x = randn(2, 3, 9, dtype=dtype)
    yield (x, 2), {}
    yield (x, 3, 1), {}  # overlapping windows
    yield (x, 3), {"stride": 2, "padding": 1, "dilation": 2}
    yield (x, 4), {"stride": 2, "ceil_mode": True}
    yield (randn(3, 7, dtype=dtype), 2), {}  # unbatched
    yield (x, 3), {"stride": 2, "return_indices": True}


def _max_pool3d_samples(dtype):
    x = randn(2, 2, 5, 6, 4, dtype=dtype)
    yield (x, 2), {}
    yield (x, 3, 1), {}
    yield (x, (3, 2, 2)), {"stride": (2, 1, 2), "padding": 1, "dilation": (1, 2, 1)}
    yield (x, 2), {"stride": 2, "ceil_mode": True}
    yield (randn(2, 4, 5, 3, dtype=dtype), 2), {}  # unbatched
    yield (x, 2), {"return_indices": True}


@builtin(F.max_pool1d)
class MaxPool1d:
    """y = max over each window: d_x = d scatter-added at the argmax indices (from
    ``max_pool1d_with_indices``); t_y = t gathered there (derivatives.yaml
    `max_pool2d_with_indices`, the 1-d op being the 2-d one on a unit dim)."""

    def fwd(input, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False,
            return_indices=False):
        return _max_pool_fwd(F.max_pool1d_with_indices, input, kernel_size, stride, padding,
                             dilation, ceil_mode, return_indices)

    def bwd(aux, d):
        return _max_pool_bwd(1, aux, d)

    def jvp(primals, tangents):
        return _max_pool_jvp(1, F.max_pool1d_with_indices, MaxPool1d.fwd, primals, tangents)

    samples = staticmethod(_max_pool1d_samples)


@builtin(F.max_pool1d_with_indices)
class MaxPool1dWithIndices:
    """``F.max_pool1d(..., return_indices=True)``: same formula as ``F.max_pool1d``."""

    def fwd(input, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False,
            return_indices=False):
        return _max_pool_fwd(F.max_pool1d_with_indices, input, kernel_size, stride, padding,
                             dilation, ceil_mode, True)

    def bwd(aux, d):
        return _max_pool_bwd(1, aux, d)

    def jvp(primals, tangents):
        return _max_pool_jvp(1, F.max_pool1d_with_indices, MaxPool1dWithIndices.fwd, primals,
                             tangents, always_tuple=True)


@builtin(F.max_pool3d)
class MaxPool3d:
    """y = max over each window: d_x = d scatter-added at the argmax indices (from
    ``max_pool3d_with_indices``, indices into the flattened D*H*W dims); t_y = t gathered
    there (derivatives.yaml `max_pool3d_with_indices`: max_pool3d_with_indices_backward)."""

    def fwd(input, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False,
            return_indices=False):
        return _max_pool_fwd(F.max_pool3d_with_indices, input, kernel_size, stride, padding,
                             dilation, ceil_mode, return_indices)

    def bwd(aux, d):
        return _max_pool_bwd(3, aux, d)

    def jvp(primals, tangents):
        return _max_pool_jvp(3, F.max_pool3d_with_indices, MaxPool3d.fwd, primals, tangents)

    samples = staticmethod(_max_pool3d_samples)


@builtin(F.max_pool3d_with_indices)
class MaxPool3dWithIndices:
    """``F.max_pool3d(..., return_indices=True)``: same formula as ``F.max_pool3d``."""

    def fwd(input, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False,
            return_indices=False):
        return _max_pool_fwd(F.max_pool3d_with_indices, input, kernel_size, stride, padding,
                             dilation, ceil_mode, True)

    def bwd(aux, d):
        return _max_pool_bwd(3, aux, d)

    def jvp(primals, tangents):
        return _max_pool_jvp(3, F.max_pool3d_with_indices, MaxPool3dWithIndices.fwd, primals,
                             tangents, always_tuple=True)


# --- adaptive max pools --------------------------------------------------------------------


def _adaptive_max_fwd(with_indices: Any, input, output_size, return_indices):
    out, idx = with_indices(input, output_size, True)
    return ((out, idx) if return_indices else out), (input.shape, idx)


def _adaptive_max_jvp(nd: int, with_indices: Any, primals: tuple, tangents: tuple,
                      always_tuple: bool = False) -> tuple:
    """t_y = the input tangent gathered at the argmax indices."""
    (x, output_size, return_indices), t = primals, tangents[0]
    both = with_indices(x, output_size, True)
    t_out = _gather_spatial(t, both[1], nd)
    if always_tuple or return_indices:
        return both, (t_out, None)  # the value is the op's own (values, indices) result
    return both[0], t_out


def _adaptive_max_samples(nd: int):
    def samples(dtype):
        sizes = {1: (9,), 2: (6, 5), 3: (5, 4, 6)}[nd]
        x = randn(2, 3, *sizes, dtype=dtype)
        yield (x, 1), {}
        yield (x, tuple(s // 2 for s in sizes)), {}
        yield (x, tuple(s - 2 for s in sizes)), {}  # overlapping windows of unequal size
        yield (randn(3, *sizes, dtype=dtype), 2), {}  # unbatched
        yield (x, 3), {"return_indices": True}
        if nd > 1:
            yield (x, (None,) + (2,) * (nd - 1)), {}
    return samples


def _adaptive_max_rule(nd: int, op: Any, with_indices: Any) -> type:
    """Rule class for ``op`` (``adaptive_max_pool{nd}d`` or its ``_with_indices`` form)."""
    always = op is with_indices

    class AdaptiveMaxPool:
        def fwd(input, output_size, return_indices=False):
            return _adaptive_max_fwd(with_indices, input, output_size, return_indices or always)

        def bwd(aux, d):
            return _max_pool_bwd(nd, aux, d)

        def jvp(primals, tangents):
            return _adaptive_max_jvp(nd, with_indices, primals, tangents, always_tuple=always)

        samples = staticmethod(_adaptive_max_samples(nd))

    AdaptiveMaxPool.__name__ = AdaptiveMaxPool.__qualname__ = (
        f"AdaptiveMaxPool{nd}d" + ("WithIndices" if always else ""))
    AdaptiveMaxPool.__doc__ = (
        f"y = max over each adaptive window: d_x = d scatter-added at the argmax indices into the "
        f"flattened spatial dims (from ``adaptive_max_pool{nd}d(..., return_indices=True)``); "
        f"t_y = t gathered there (derivatives.yaml `adaptive_max_pool{max(nd, 2)}d`: "
        f"adaptive_max_pool{max(nd, 2)}d_backward).")
    return builtin(op)(AdaptiveMaxPool)


AdaptiveMaxPool1d = _adaptive_max_rule(1, F.adaptive_max_pool1d,
                                       F.adaptive_max_pool1d_with_indices)
AdaptiveMaxPool1dWithIndices = _adaptive_max_rule(1, F.adaptive_max_pool1d_with_indices,
                                                  F.adaptive_max_pool1d_with_indices)
AdaptiveMaxPool2d = _adaptive_max_rule(2, F.adaptive_max_pool2d,
                                       F.adaptive_max_pool2d_with_indices)
AdaptiveMaxPool2dWithIndices = _adaptive_max_rule(2, F.adaptive_max_pool2d_with_indices,
                                                  F.adaptive_max_pool2d_with_indices)
AdaptiveMaxPool3d = _adaptive_max_rule(3, F.adaptive_max_pool3d,
                                       F.adaptive_max_pool3d_with_indices)
AdaptiveMaxPool3dWithIndices = _adaptive_max_rule(3, F.adaptive_max_pool3d_with_indices,
                                                  F.adaptive_max_pool3d_with_indices)


# --- max_pool2d_with_indices_backward ---------------------------------------------------------

_MAX_POOL2D_BACKWARD = torch.ops.aten.max_pool2d_with_indices_backward


@builtin(_MAX_POOL2D_BACKWARD, _MAX_POOL2D_BACKWARD.default)
class MaxPool2dWithIndicesBackward:
    """z = zeros like ``self`` with ``grad_output`` scatter-added at ``indices`` (the backward of
    ``max_pool2d``): linear in ``grad_output`` and independent of the values of ``self``, so
    d_grad_output = d gathered at ``indices`` and t_z = t_grad_output scatter-added at
    ``indices`` (derivatives.yaml `max_pool2d_with_indices_backward`:
    max_pool_double_backward)."""

    def fwd(grad_output, input, kernel_size, stride, padding, dilation, ceil_mode, indices):
        out = _MAX_POOL2D_BACKWARD(grad_output, input, kernel_size, stride, padding, dilation,
                                   ceil_mode, indices)
        return out, indices

    def bwd(aux, d):
        return _gather_spatial(d, aux, 2), None

    def jvp(primals, tangents):
        grad_output, x, *_, indices = primals
        out = _MAX_POOL2D_BACKWARD(*primals)
        t = tangents[0]
        return out, (None if t is None else _scatter_spatial(t, indices, x.shape, 2))

    def samples(dtype):
        for x, k, st, pad, dil, ceil in [
                (randn(2, 3, 6, 7, dtype=dtype), [2, 2], [2, 2], [0, 0], [1, 1], False),
                (randn(2, 3, 6, 7, dtype=dtype), [3, 3], [1, 1], [1, 1], [1, 1], False),
                (randn(3, 5, 6, dtype=dtype), [3, 2], [2, 1], [1, 0], [1, 2], True)]:
            out, idx = F.max_pool2d_with_indices(x, k, st, pad, dil, ceil, True)
            yield (randn(*out.shape, dtype=dtype), x, k, st, pad, dil, ceil, idx), {}


# --- average pools ------------------------------------------------------------------------------


def _window_divisor(out_sizes: Any, in_sizes: Any, kernel: tuple, stride: tuple,
                    padding: tuple, count_include_pad: bool, like: Any) -> Any:
    """Divisor of each average-pooling window, shaped to broadcast over the last dims: the
    product over dims of the window length, clipped to the padded input (count_include_pad)
    or to the input itself."""
    nd = len(out_sizes)
    div = None
    for j, (o, n, k, s, p) in enumerate(zip(out_sizes, in_sizes, kernel, stride, padding)):
        start = torch.arange(o, device=like.device) * s - p
        end = torch.clamp(start + k, max=n + p)
        if not count_include_pad:
            start, end = torch.clamp(start, min=0), torch.clamp(end, max=n)
        length = (end - start).to(like.dtype).reshape((o,) + (1,) * (nd - 1 - j))
        div = length if div is None else div * length
    return div


_CONV_TRANSPOSE = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


def _window_sum_adjoint(d: Any, shape: Any, kernel: tuple, stride: tuple,
                        padding: tuple) -> Any:
    """Adjoint of the window *sum* of an n-d pooling: depthwise transposed convolution of ``d``
    with a ones kernel, cropped or ``output_padding``-extended back to ``shape``."""
    nd = len(kernel)
    outs, ins = tuple(d.shape[-nd:]), tuple(shape[-nd:])
    full = [(o - 1) * s - 2 * p + k for o, s, p, k in zip(outs, stride, padding, kernel)]
    out_pad = tuple(max(n - f, 0) for n, f in zip(ins, full))
    ones = d.new_ones((1, 1) + tuple(kernel))
    planes = d.reshape((math.prod(d.shape[:-nd]), 1) + outs)
    d_x = _CONV_TRANSPOSE[nd](planes, ones, stride=stride, padding=padding,
                              output_padding=out_pad)
    if any(f > n for f, n in zip(full, ins)):  # ceil_mode windows hanging past the input
        d_x = d_x[(...,) + tuple(slice(0, n) for n in ins)]
    return d_x.reshape(shape)


def _avg_pool_bwd(nd: int, aux: Any, d: Any) -> tuple:
    shape, kernel_size, stride, padding, include_pad, override = aux
    kernel = _ntuple(kernel_size, nd, "kernel_size")
    stride = kernel if _no_stride(stride) else _ntuple(stride, nd, "stride")
    padding = _ntuple(padding, nd, "padding")
    outs, ins = tuple(d.shape[-nd:]), tuple(shape[-nd:])
    # furthest extent of the last window along each dim, in unpadded input coordinates
    ends = [(o - 1) * s - p + k for o, s, p, k in zip(outs, stride, padding, kernel)]
    full_windows = all(e <= n + p for e, n, p in zip(ends, ins, padding)) if include_pad \
        else all(p == 0 and e <= n for e, n, p in zip(ends, ins, padding))
    if override is not None:
        d = d / override
    elif full_windows:  # every window counts kernel-size elements
        d = d / math.prod(kernel)
    else:
        d = d / _window_divisor(tuple(d.shape[-nd:]), tuple(shape[-nd:]), kernel, stride,
                                padding, include_pad, d)
    return (_window_sum_adjoint(d, shape, kernel, stride, padding),)


def _avg_pool_samples(nd: int):
    def samples(dtype):
        sizes = {1: (9,), 3: (5, 6, 4)}[nd]
        x = randn(2, 3, *sizes, dtype=dtype)
        yield (x, 2), {}
        yield (x, 3, 1), {}  # overlapping windows
        yield (x, 3, 2, 1), {}
        yield (x, 3, 2, 1), {"count_include_pad": False}
        yield (x, 2), {"ceil_mode": True}
        yield (x, 3, 2, 1), {"ceil_mode": True}
        yield (x, 3, 2, 1), {"ceil_mode": True, "count_include_pad": False}
        yield (randn(3, *sizes, dtype=dtype), 2), {}  # unbatched
        if nd == 3:
            yield (x, (3, 2, 2), (2, 1, 2), (1, 0, 1)), {}
            yield (x, 3, 2, 1), {"divisor_override": 5}
            yield (x, 2, 1, 1), {"ceil_mode": True, "divisor_override": 3}
    return samples


@builtin(torch.avg_pool1d)
class AvgPool1d:
    """y = window sum / divisor: d_x = the adjoint of the window sum (a depthwise
    ``conv_transpose1d`` with a ones kernel) applied to d / divisor, where the divisor of
    window i is its length clipped to the padded input, or with ``count_include_pad=False`` to
    the input (derivatives.yaml `avg_pool2d`, the 1-d op being the 2-d one on a unit dim)."""

    def fwd(input, kernel_size, stride=None, padding=0, ceil_mode=False,
            count_include_pad=True):
        kw = {}
        if not _no_stride(stride):
            kw["stride"] = stride
        if padding not in (0, (0,), [0]):
            kw["padding"] = padding
        if ceil_mode:
            kw["ceil_mode"] = True
        if not count_include_pad:
            kw["count_include_pad"] = False
        out = torch.avg_pool1d(input, kernel_size, **kw)
        return out, (input.shape, kernel_size, stride, padding, count_include_pad, None)

    def bwd(aux, d):
        return _avg_pool_bwd(1, aux, d)

    def jvp(primals, tangents):
        (x, kernel_size, stride, padding, ceil_mode, include_pad), t = primals, tangents[0]
        stride = kernel_size if _no_stride(stride) else stride
        args = (kernel_size, stride, padding, ceil_mode, include_pad)
        return torch.avg_pool1d(x, *args), torch.avg_pool1d(t, *args)

    samples = staticmethod(_avg_pool_samples(1))


@builtin(F.avg_pool3d)
class AvgPool3d:
    """y = window sum / divisor: d_x = the adjoint of the window sum (a depthwise
    ``conv_transpose3d`` with a ones kernel) applied to d / divisor, where the divisor is
    ``divisor_override`` or the product of the window's lengths clipped to the padded input,
    or with ``count_include_pad=False`` to the input (derivatives.yaml `avg_pool3d`:
    avg_pool3d_backward)."""

    def fwd(input, kernel_size, stride=None, padding=0, ceil_mode=False,
            count_include_pad=True, divisor_override=None):
        out = F.avg_pool3d(input, kernel_size, stride, padding, ceil_mode, count_include_pad,
                           divisor_override)
        return out, (input.shape, kernel_size, stride, padding, count_include_pad,
                     divisor_override)

    def bwd(aux, d):
        return _avg_pool_bwd(3, aux, d)

    def jvp(primals, tangents):
        (x, *args), t = primals, tangents[0]
        return F.avg_pool3d(x, *args), F.avg_pool3d(t, *args)

    samples = staticmethod(_avg_pool_samples(3))


# --- adaptive average pools ---------------------------------------------------------------------

_SPATIAL = "xyz"


def _contract_spatial(d: Any, mats: list) -> Any:
    """Contract the last ``len(mats)`` dims of ``d`` with the matrices: dim k of size m_k
    becomes size n_k through ``mats[k]`` of shape (m_k, n_k)."""
    nd = len(mats)
    src, dst = _SPATIAL[:nd], _SPATIAL[:nd].upper()
    spec = f"...{src}," + ",".join(f"{a}{b}" for a, b in zip(src, dst)) + f"->...{dst}"
    return torch.einsum(spec, d, *mats)


def _adaptive_avg_bwd(nd: int, shape: Any, d: Any) -> Any:
    """d_x = d contracted with the averaging matrix A_k (o_k, n_k) along each spatial dim."""
    outs, ins = d.shape[-nd:], shape[-nd:]
    return _contract_spatial(d, [_averaging_matrix(o, n, d) for o, n in zip(outs, ins)])


@builtin(torch.adaptive_avg_pool1d)
class AdaptiveAvgPool1d:
    """Output i averages [floor(i L / o), ceil((i+1) L / o)): y = x A^T with the averaging
    matrix A (o, L), so d_x = d A (derivatives.yaml `_adaptive_avg_pool2d`, the 1-d op being
    the 2-d one on a unit dim)."""

    def fwd(input, output_size):
        return torch.adaptive_avg_pool1d(input, output_size), input.shape

    def bwd(aux, d):
        return (d @ _averaging_matrix(d.shape[-1], aux[-1], d),)

    def jvp(primals, tangents):
        (x, output_size), t = primals, tangents[0]
        return torch.adaptive_avg_pool1d(x, output_size), torch.adaptive_avg_pool1d(t, output_size)

    def samples(dtype):
        x = randn(2, 3, 9, dtype=dtype)
        yield (x, 1), {}
        yield (x, 3), {}
        yield (x, (4,)), {}  # windows of unequal size
        yield (x, 12), {}  # more outputs than inputs
        yield (randn(3, 7, dtype=dtype), 5), {}  # unbatched


@builtin(F.adaptive_avg_pool3d)
class AdaptiveAvgPool3d:
    """Output cell (i, j, l) averages the separable window [floor(i D / o), ceil((i+1) D / o))
    x ... : y = x contracted with averaging matrices A_k along each spatial dim, so d_x is d
    contracted with their transposes (derivatives.yaml `_adaptive_avg_pool3d`:
    _adaptive_avg_pool3d_backward)."""

    def fwd(input, output_size):
        return F.adaptive_avg_pool3d(input, output_size), input.shape

    def bwd(aux, d):
        return (_adaptive_avg_bwd(3, aux, d),)

    def jvp(primals, tangents):
        (x, output_size), t = primals, tangents[0]
        return F.adaptive_avg_pool3d(x, output_size), F.adaptive_avg_pool3d(t, output_size)

    def samples(dtype):
        x = randn(2, 3, 6, 4, 5, dtype=dtype)
        yield (x, 1), {}
        yield (x, (3, 2, 5)), {}
        yield (x, (4, 3, 2)), {}  # windows of unequal size
        yield (x, (None, 3, None)), {}
        yield (randn(3, 5, 4, 7, dtype=dtype), 2), {}  # unbatched


# --- max unpooling ------------------------------------------------------------------------------


def _unpool_samples(nd: int):
    pool = {1: F.max_pool1d_with_indices, 2: F.max_pool2d_with_indices,
            3: F.max_pool3d_with_indices}[nd]
    sizes = {1: (8,), 2: (6, 4), 3: (4, 6, 4)}[nd]

    def samples(dtype):
        # indices of non-overlapping max pools: distinct, so the unpooling is well defined
        x = randn(2, 3, *sizes, dtype=dtype)
        _, idx = pool(x, 2, return_indices=True)
        yield (randn(*idx.shape, dtype=dtype), idx, 2), {}
        yield (randn(*idx.shape, dtype=dtype), idx, 2), {"output_size": tuple(x.shape)}
        _, idx = pool(x, 3, 3, 1, return_indices=True)
        yield (randn(*idx.shape, dtype=dtype), idx, 3, 3, 1), {"output_size": sizes}
        _, idx = pool(x[0], 2, return_indices=True)  # unbatched
        yield (randn(*idx.shape, dtype=dtype), idx, 2), {}
    return samples


def _unpool_rule(nd: int, op: Any) -> type:
    class MaxUnpool:
        def fwd(input, indices, kernel_size, stride=None, padding=0, output_size=None):
            return op(input, indices, kernel_size, stride, padding, output_size), indices

        def bwd(aux, d):
            return _gather_spatial(d, aux, nd), None

        def jvp(primals, tangents):
            x, indices, *rest = primals
            t = tangents[0]
            out = op(x, indices, *rest)
            return out, (None if t is None else _scatter_spatial(t, indices, out.shape, nd))

        samples = staticmethod(_unpool_samples(nd))

    MaxUnpool.__name__ = MaxUnpool.__qualname__ = f"MaxUnpool{nd}d"
    MaxUnpool.__doc__ = (
        f"y = zeros of the unpooled shape with x placed at ``indices`` (flattened spatial "
        f"dims): linear in x, so d_x = d gathered at ``indices`` (derivatives.yaml "
        f"`max_unpool{max(nd, 2)}d`: max_pool_double_backward) and t_y = t scatter-added at "
        f"``indices``, its transpose.  With distinct indices t_y equals ``max_unpool{nd}d`` "
        f"of t; with repeated indices (where the value keeps an unspecified one of the "
        f"colliding entries) it stays the transpose of PyTorch's gather backward.")
    return builtin(op)(MaxUnpool)


MaxUnpool1d = _unpool_rule(1, F.max_unpool1d)
MaxUnpool2d = _unpool_rule(2, F.max_unpool2d)
MaxUnpool3d = _unpool_rule(3, F.max_unpool3d)


# --- interpolation ----------------------------------------------------------------------------


def _interp_matrices(resample: Any, in_sizes: tuple, out_sizes: tuple, scales: Any,
                     like: Any) -> list:
    """The 1-d matrices of a separable resampling, transposed (n_k, o_k), read off by
    resampling an identity.

    ``resample(z, size=..., scale_factor=...)`` is the user's call with only size/scales
    replaced.  For dim k the identity I (n_k, n_k) is laid out as a batch of n_k one-channel
    images, one-hot along dim k and constant along the other dims (of size 2: every mode maps
    size 2 to size 2 with scale 1 identically, while antialiased kernels treat size-1 dims
    specially).  They are resampled with dim k's output size (or, when the user's scale factors
    set the sampling grid, its scale factor), so row i of the result (read at index 0 of the
    other dims) is column i of the 1-d resampling matrix A_k (o_k, n_k)."""
    nd = len(in_sizes)
    mats = []
    for k, (n, o) in enumerate(zip(in_sizes, out_sizes)):
        one_hot = [n if j == k else 1 for j in range(nd)]
        planes = [n if j == k else 2 for j in range(nd)]
        eye = torch.eye(n, dtype=like.dtype, device=like.device)
        eye = eye.reshape([n, 1] + one_hot).expand([n, 1] + planes)
        if scales is None:
            z = resample(eye, size=tuple(o if j == k else 2 for j in range(nd)),
                         scale_factor=None)
        else:
            z = resample(eye, size=None,
                         scale_factor=tuple(scales[k] if j == k else 1.0 for j in range(nd)))
        m = z[(slice(None), 0) + tuple(slice(None) if j == k else 0 for j in range(nd))]
        # a scale-set grid does not depend on the output length: keep its first o_k samples
        mats.append(m if m.shape[1] == o else m[:, :o])
    return mats


def _interp_adjoint(resample: Any, d: Any, shape: Any, scales: Any) -> Any:
    """d_x = A_k^T applied to d along every spatial dim k (the adjoint of the resampling)."""
    mats = _interp_matrices(resample, tuple(shape[2:]), tuple(d.shape[2:]), scales, d)
    return _contract_spatial(d, [m.mT for m in mats])


def _interp_scales(input: Any, size: Any, scale_factor: Any,
                   recompute_scale_factor: Any) -> Any:
    """Per-dim scale factors that set the sampling grid, or None when the grid is set by the
    input and output sizes (``size`` given, or ``recompute_scale_factor=True``)."""
    if size is not None or scale_factor is None or recompute_scale_factor:
        return None
    nd = input.dim() - 2
    return tuple(float(s) for s in _ntuple(scale_factor, nd, "scale_factor"))


def _interp_kwargs(size, scale_factor, mode, align_corners, recompute_scale_factor,
                   antialias) -> dict:
    """Keyword arguments of ``F.interpolate`` that differ from the defaults."""
    kw: dict[str, Any] = {}
    if size is not None:
        kw["size"] = size
    if scale_factor is not None:
        kw["scale_factor"] = scale_factor
    if mode != "nearest":
        kw["mode"] = mode
    if align_corners is not None:
        kw["align_corners"] = align_corners
    if recompute_scale_factor is not None:
        kw["recompute_scale_factor"] = recompute_scale_factor
    if antialias:
        kw["antialias"] = True
    return kw


@builtin(F.interpolate)
class Interpolate:
    """Every mode of ``F.interpolate`` ('nearest', 'nearest-exact', 'linear', 'bilinear',
    'bicubic', 'trilinear', 'area', antialiased or not) resamples each spatial dim
    independently with fixed weights: y = x contracted with 1-d matrices A_k (o_k, n_k) along
    each spatial dim.  The backward is the adjoint, d_x = d contracted with A_k^T, and the JVP
    resamples the tangent (derivatives.yaml `upsample_nearest2d.vec`, `upsample_bilinear2d.vec`,
    `upsample_bicubic2d.vec`, `_upsample_bilinear2d_aa.vec`, ...: the ``*_backward`` kernels
    compute this adjoint).  A_k is read off exactly by interpolating an identity matrix with the
    same mode, align_corners, antialias and scale factor (see ``_interp_matrices``).  For
    'area' (adaptive average pooling) and the 'nearest' modes this is a dense (o_k, n_k)
    matrix product per dim rather than a window sum; still exact."""

    def fwd(input, size=None, scale_factor=None, mode="nearest", align_corners=None,
            recompute_scale_factor=None, antialias=False):
        kw = _interp_kwargs(size, scale_factor, mode, align_corners, recompute_scale_factor,
                            antialias)
        out = F.interpolate(input, **kw)
        return out, (input.shape, kw, _interp_scales(input, size, scale_factor,
                                                     recompute_scale_factor))

    def bwd(aux, d):
        shape, kw, scales = aux
        fixed = {k: v for k, v in kw.items() if k not in ("size", "scale_factor",
                                                          "recompute_scale_factor")}

        def resample(z, size, scale_factor):
            return F.interpolate(z, size=size, scale_factor=scale_factor, **fixed)

        return (_interp_adjoint(resample, d, shape, scales),)

    def jvp(primals, tangents):
        (x, *args), t = primals, tangents[0]
        kw = _interp_kwargs(*args)
        return F.interpolate(x, **kw), F.interpolate(t, **kw)

    def samples(dtype):
        x1, x2, x3 = (randn(2, 3, 7, dtype=dtype), randn(2, 3, 5, 6, dtype=dtype),
                      randn(1, 2, 4, 5, 3, dtype=dtype))
        yield (x1, 12), {}
        yield (x1,), {"scale_factor": 1.7, "mode": "nearest-exact"}
        yield (x1, 4), {"mode": "linear"}
        yield (x1,), {"scale_factor": 0.6, "mode": "linear", "align_corners": True}
        yield (x1,), {"scale_factor": 1.7, "mode": "area"}
        yield (x2, (9, 4)), {"mode": "bilinear"}
        yield (x2,), {"scale_factor": (1.7, 0.8), "mode": "bilinear", "align_corners": False}
        yield (x2,), {"scale_factor": 1.7, "mode": "bilinear", "recompute_scale_factor": True}
        yield (x2, (3, 9)), {"mode": "bicubic", "align_corners": True}
        yield (x2,), {"scale_factor": (1.3, 2.0), "mode": "bicubic"}
        yield (x2, (3, 4)), {"mode": "bilinear", "antialias": True}
        yield (x2, (4, 9)), {"mode": "bicubic", "antialias": True, "align_corners": True}
        yield (x2, (4, 3)), {"mode": "area"}
        yield (x2, (8, 11)), {"mode": "nearest"}
        yield (x3, (6, 3, 7)), {"mode": "trilinear"}
        yield (x3,), {"scale_factor": 1.5, "mode": "nearest"}
        yield (x3, (2, 3, 2)), {"mode": "area"}


_UPSAMPLE_BILINEAR2D_AA = torch.ops.aten._upsample_bilinear2d_aa


def _aa_resample(align_corners: bool) -> Any:
    def resample(z, size, scale_factor):
        return F.interpolate(z, size=size, scale_factor=scale_factor, mode="bilinear",
                             align_corners=align_corners, antialias=True)
    return resample


@builtin(_UPSAMPLE_BILINEAR2D_AA)
class UpsampleBilinear2dAA:
    """``aten._upsample_bilinear2d_aa``, the kernel of ``F.interpolate(..., mode='bilinear',
    antialias=True)``, in both overloads: ``(input, output_size, align_corners,
    scale_factors)`` and ``(input, output_size, align_corners, scales_h, scales_w)``.  The same
    separable linear map as ``F.interpolate``: d_x = d contracted with A_k^T, t_y = t
    contracted with A_k (derivatives.yaml `_upsample_bilinear2d_aa.vec`:
    _upsample_bilinear2d_aa_backward).  Explicit scales set the sampling grid (unless
    align_corners=True, which ignores them), whatever the output size: A_k is then the first
    o_k rows of the resampling of the identity by that scale; raises if the scale's own grid
    is shorter than o_k."""

    def fwd(input, output_size, align_corners, scale_factors=None, scales_w=None, *,
            scales_h=None):
        legacy = scales_w is not None or scales_h is not None or \
            isinstance(scale_factors, (int, float))
        if legacy:  # (input, output_size, align_corners, scales_h, scales_w)
            sh = scales_h if scales_h is not None else scale_factors
            out = _UPSAMPLE_BILINEAR2D_AA(input, output_size, align_corners, sh, scales_w)
            scales = None if align_corners or (sh is None and scales_w is None) else (sh, scales_w)
        else:
            out = _UPSAMPLE_BILINEAR2D_AA(input, output_size, align_corners, scale_factors)
            scales = None if align_corners or output_size is not None or scale_factors is None \
                else tuple(float(s) for s in scale_factors)
        if scales is not None:
            ins, outs = tuple(input.shape[-2:]), tuple(out.shape[-2:])
            if any(s is None or math.floor(n * s) < o for n, o, s in zip(ins, outs, scales)):
                raise _error("aten._upsample_bilinear2d_aa",
                             f"scales {scales} with output size {outs} for input size {ins} "
                             "are not supported",
                             "call F.interpolate(x, size=..., mode='bilinear', antialias=True)")
        return out, (input.shape, align_corners, scales)

    def bwd(aux, d):
        shape, align_corners, scales = aux
        return (_interp_adjoint(_aa_resample(align_corners), d, shape, scales),)

    def jvp(primals, tangents):
        x, output_size, align_corners, scale_factors, scales_w, scales_h = primals
        out, (shape, _, scales) = UpsampleBilinear2dAA.fwd(
            x, output_size, align_corners, scale_factors, scales_w, scales_h=scales_h)
        t = tangents[0]
        if t is None:
            return out, None
        mats = _interp_matrices(_aa_resample(align_corners), tuple(shape[2:]),
                                tuple(out.shape[2:]), scales, t)
        return out, _contract_spatial(t, mats)

    def samples(dtype):
        x = randn(2, 3, 6, 9, dtype=dtype)
        yield (x, [3, 4], False, None), {}
        yield (x, [8, 13], True, None), {}
        yield (x, None, False, [1.7, 0.6]), {}
        yield (x, None, True, [0.8, 1.0]), {}
        yield (x, [3, 3], False), {"scales_h": 1.7, "scales_w": 0.9}
        yield (x, [3, 4], True), {"scales_h": 1.7, "scales_w": 0.9}
        yield (x, [5, 4], False, 0.9, 0.5), {}


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


@builtin(F.local_response_norm)
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
