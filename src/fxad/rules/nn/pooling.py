"""Rules for pooling and unpooling in 1, 2 and 3 spatial dimensions.

* Max pools ``F.max_pool1d/2d/3d`` (and ``*_with_indices``) and adaptive max pools
  ``F.adaptive_max_pool1d/2d/3d`` (and ``*_with_indices``): the forward also returns the argmax
  indices into the flattened spatial dims; the backward scatter-adds the cotangent there and the
  JVP gathers the tangent there (derivatives.yaml `max_pool3d_with_indices`,
  `adaptive_max_pool2d`: max_pool_double_backward / the ``*_backward`` kernels).  The 2-d max
  pool may call the fused ``max_pool2d_with_indices_backward`` (:mod:`fxad.rules.fused`).
* Average pools ``torch.avg_pool1d``, ``F.avg_pool2d``, ``F.avg_pool3d``: the adjoint of a
  window sum is a depthwise transposed convolution with a ones kernel, applied to
  ``d / divisor`` where the divisor of each window is computed from the window bounds
  (derivatives.yaml `avg_pool2d`, `avg_pool3d`).
* Adaptive average pools ``torch.adaptive_avg_pool1d``, ``F.adaptive_avg_pool2d/3d``:
  separable averaging matrices A, d_x = d contracted with A along each spatial dim
  (derivatives.yaml `_adaptive_avg_pool2d`, `_adaptive_avg_pool3d`).
* ``F.max_unpool1d/2d/3d``: y = zeros scattered with x at the indices, so d_x = d gathered
  at the indices (derivatives.yaml `max_unpool2d`: max_pool_double_backward).
* Fractional max pools ``F.fractional_max_pool2d/3d`` (and ``*_with_indices``): the windows
  come from ``torch.rand(N, C, 2 or 3)``, drawn in the generated forward as
  ``torch/nn/functional.py`` draws it (the same windows as eager under the same seed); the
  backward and JVP are the max pool's, at the argmax indices (derivatives.yaml
  `fractional_max_pool2d`, `fractional_max_pool3d`).
* ``torch.ops.aten.max_pool2d_with_indices_backward`` (written by the fused 2-d max-pool rule):
  linear in ``grad_output`` (a scatter-add at the indices), so its own cotangent is the gather
  of ``d`` at the indices; it does not depend on the values of ``self``
  (derivatives.yaml `max_pool2d_with_indices_backward`).
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from .._base import randn, _error
from ..registry import register_vjp
from ._common import _bound, _contract_spatial, _ntuple, _pair


def _max_pool2d_fwd(input, kernel_size, stride, padding, dilation, ceil_mode, return_indices):
    both = F.max_pool2d_with_indices(input, kernel_size, stride, padding, dilation,
                                     ceil_mode=ceil_mode, return_indices=True)
    out, idx = both
    return (both if return_indices else out), (input.shape, idx)


def _max_pool2d_bwd(aux, d):
    if isinstance(d, tuple):
        d = d[0]
        if d is None:
            return (None,)
    shape, idx = aux
    flat = d.new_zeros(tuple(shape[:-2]) + (shape[-2] * shape[-1],))
    return (flat.scatter_add(-1, idx.flatten(-2), d.flatten(-2)).reshape(shape),)


def _max_pool2d_fused_applies(input, *args: Any, **kwargs: Any) -> bool:
    return input.dim() == 4  # batched input: the fused backward kernel's layout


def _max_pool2d_fused_fwd(input, kernel_size, stride, padding, dilation, ceil_mode,
                          return_indices):
    """The forward of the fused overloads: the indices and the window parameters are saved
    for ``max_pool2d_with_indices_backward`` (docs/fused_kernels.md)."""
    both = F.max_pool2d_with_indices(input, kernel_size, stride, padding, dilation,
                                     ceil_mode=ceil_mode, return_indices=True)
    out, idx = both
    k = _pair(kernel_size, "kernel_size")
    st = k if stride is None or (isinstance(stride, (tuple, list)) and len(stride) == 0) \
        else _pair(stride, "stride")
    return (both if return_indices else out), (
        input, idx, list(k), list(st), list(_pair(padding, "padding")),
        list(_pair(dilation, "dilation")), bool(ceil_mode))


def _max_pool2d_fused_bwd(aux, d):
    if isinstance(d, tuple):
        d = d[0]
        if d is None:
            return (None,)
    x, idx, k, st, pad, dil, ceil = aux
    return (torch.ops.aten.max_pool2d_with_indices_backward(d, x, k, st, pad, dil, ceil, idx),)


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


@register_vjp(F.max_pool2d)
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


@register_vjp(F.max_pool2d_with_indices)
class MaxPool2dWithIndices:
    """``F.max_pool2d(..., return_indices=True)`` (same formula as ``F.max_pool2d``;
    derivatives.yaml `max_pool2d_with_indices`)."""

    outputs = ("out", "indices")

    def fwd(input, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False,
            return_indices=False):
        return _max_pool2d_fwd(input, kernel_size, stride, padding, dilation, ceil_mode, True)

    bwd = staticmethod(_max_pool2d_bwd)

    def jvp(primals, tangents):
        return _max_pool2d_jvp(MaxPool2dWithIndices.fwd, primals, tangents, both=True)


@register_vjp(F.max_pool2d)
class MaxPool2dFused:
    """A batched (N, C, H, W) input: the fused backward kernel
    ``max_pool2d_with_indices_backward`` (docs/fused_kernels.md)."""

    residuals = "inputs+intermediates"
    recompute = False
    fused = True
    applies = staticmethod(_max_pool2d_fused_applies)

    def fwd(input, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False,
            return_indices=False):
        return _max_pool2d_fused_fwd(input, kernel_size, stride, padding, dilation, ceil_mode,
                                     return_indices)

    bwd = staticmethod(_max_pool2d_fused_bwd)
    jvp = MaxPool2d.jvp


@register_vjp(F.max_pool2d_with_indices)
class MaxPool2dWithIndicesFused:
    """A batched (N, C, H, W) input: the fused backward kernel
    ``max_pool2d_with_indices_backward`` (docs/fused_kernels.md)."""

    fused = True
    applies = staticmethod(_max_pool2d_fused_applies)

    def fwd(input, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False,
            return_indices=False):
        return _max_pool2d_fused_fwd(input, kernel_size, stride, padding, dilation, ceil_mode,
                                     True)

    bwd = staticmethod(_max_pool2d_fused_bwd)
    jvp = MaxPool2dWithIndices.jvp


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


@register_vjp(F.avg_pool2d)
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


@register_vjp(F.adaptive_avg_pool2d)
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


@register_vjp(F.max_pool1d)
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


@register_vjp(F.max_pool1d_with_indices)
class MaxPool1dWithIndices:
    """``F.max_pool1d(..., return_indices=True)``: same formula as ``F.max_pool1d``."""

    outputs = ("out", "indices")

    def fwd(input, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False,
            return_indices=False):
        return _max_pool_fwd(F.max_pool1d_with_indices, input, kernel_size, stride, padding,
                             dilation, ceil_mode, True)

    def bwd(aux, d):
        return _max_pool_bwd(1, aux, d)

    def jvp(primals, tangents):
        return _max_pool_jvp(1, F.max_pool1d_with_indices, MaxPool1dWithIndices.fwd, primals,
                             tangents, always_tuple=True)


@register_vjp(F.max_pool3d)
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


@register_vjp(F.max_pool3d_with_indices)
class MaxPool3dWithIndices:
    """``F.max_pool3d(..., return_indices=True)``: same formula as ``F.max_pool3d``."""

    outputs = ("out", "indices")

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
    return register_vjp(op)(AdaptiveMaxPool)


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


@register_vjp(_MAX_POOL2D_BACKWARD)
@register_vjp(_MAX_POOL2D_BACKWARD.default)
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


@register_vjp(torch.avg_pool1d)
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


@register_vjp(F.avg_pool3d)
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


def _adaptive_avg_bwd(nd: int, shape: Any, d: Any) -> Any:
    """d_x = d contracted with the averaging matrix A_k (o_k, n_k) along each spatial dim."""
    outs, ins = d.shape[-nd:], shape[-nd:]
    return _contract_spatial(d, [_averaging_matrix(o, n, d) for o, n in zip(outs, ins)])


@register_vjp(torch.adaptive_avg_pool1d)
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


@register_vjp(F.adaptive_avg_pool3d)
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
    return register_vjp(op)(MaxUnpool)


MaxUnpool1d = _unpool_rule(1, F.max_unpool1d)
MaxUnpool2d = _unpool_rule(2, F.max_unpool2d)
MaxUnpool3d = _unpool_rule(3, F.max_unpool3d)


# --- fractional max pools (random windows) ----------------------------------------------------


def _fractional_fwd(nd: int, with_indices: Any, input: Any, kernel_size: Any,
                    output_size: Any, output_ratio: Any, return_indices: bool,
                    _random_samples: Any) -> tuple[Any, Any]:
    samples = _random_samples
    if samples is None:
        # the draw of torch/nn/functional.py, in the generated forward: the same
        # torch.rand(N, C, nd) as eager, so the same windows under the same seed
        n_batch = 1 if input.dim() == nd + 1 else input.shape[0]
        samples = torch.rand(n_batch, input.shape[-(nd + 1)], nd, dtype=input.dtype,
                             device=input.device)
    both = with_indices(input, kernel_size, output_size, output_ratio, True,
                        _random_samples=samples)
    return (both if return_indices else both[0]), (tuple(input.shape), both[1])


def _fractional_jvp(nd: int, with_indices: Any, always: bool, primals: tuple,
                    tangents: tuple) -> tuple[Any, Any]:
    x, kernel_size, output_size, output_ratio, return_indices, samples = primals[:6]
    both = always or return_indices
    value, (_, idx) = _fractional_fwd(nd, with_indices, x, kernel_size, output_size,
                                      output_ratio, both, samples)
    t = tangents[0]
    t_out = None if t is None else _gather_spatial(t, idx, nd)
    if both:
        return value, (t_out, None)
    return value, t_out


def _fractional_samples(nd: int):
    def samples(dtype):
        sizes = {2: (7, 6), 3: (5, 6, 5)}[nd]
        x = randn(2, 3, *sizes, dtype=dtype)
        yield (x, 2), {"output_size": 3}
        yield (x, 3), {"output_size": tuple(s - 3 for s in sizes)}
        yield (x, 2), {"output_ratio": (0.5,) * nd, "return_indices": True}
        yield (randn(3, *sizes, dtype=dtype), 2), {"output_size": 2}  # unbatched
        # fixed windows (no draw)
        yield (x, 2), {"output_size": 3, "_random_samples": torch.rand(2, 3, nd, dtype=dtype)}
    return samples


def _fractional_rule(nd: int, op: Any, with_indices: Any) -> type:
    always = op is with_indices

    class FractionalMaxPool:
        residuals = "output+intermediates"  # the indices: an item of the value, or not
        recompute = False

        def fwd(input, kernel_size, output_size=None, output_ratio=None, return_indices=False,
                _random_samples=None):
            return _fractional_fwd(nd, with_indices, input, kernel_size, output_size,
                                   output_ratio, return_indices or always, _random_samples)

        def bwd(aux, d):
            shape, idx = aux
            return _max_pool_bwd(nd, (shape, idx), d)

        def jvp(primals, tangents):
            return _fractional_jvp(nd, with_indices, always, primals, tangents)

        samples = staticmethod(_fractional_samples(nd))

    FractionalMaxPool.__name__ = FractionalMaxPool.__qualname__ = (
        f"FractionalMaxPool{nd}d" + ("WithIndices" if always else ""))
    FractionalMaxPool.__doc__ = (
        f"y = max over pseudo-random windows: without ``_random_samples`` the generated "
        f"forward draws ``torch.rand(N, C, {nd}, dtype=x.dtype)`` as torch/nn/functional.py "
        f"does (the same windows as eager under the same seed), then calls "
        f"``fractional_max_pool{nd}d_with_indices`` "
        f"with them; d_x = d scatter-added at the argmax indices, t_y = t gathered there "
        f"(derivatives.yaml `fractional_max_pool{nd}d`: fractional_max_pool{nd}d_backward).")
    return register_vjp(op)(FractionalMaxPool)


FractionalMaxPool2d = _fractional_rule(2, F.fractional_max_pool2d,
                                       F.fractional_max_pool2d_with_indices)
FractionalMaxPool2dWithIndices = _fractional_rule(2, F.fractional_max_pool2d_with_indices,
                                                  F.fractional_max_pool2d_with_indices)
FractionalMaxPool3d = _fractional_rule(3, F.fractional_max_pool3d,
                                       F.fractional_max_pool3d_with_indices)
FractionalMaxPool3dWithIndices = _fractional_rule(3, F.fractional_max_pool3d_with_indices,
                                                  F.fractional_max_pool3d_with_indices)
