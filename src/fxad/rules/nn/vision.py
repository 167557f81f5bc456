"""Rules for ``torch.nn.functional``'s vision functions: ``pad`` and ``constant_pad_nd``,
``pixel_shuffle``/``pixel_unshuffle``, ``channel_shuffle``, ``interpolate`` (all modes,
antialias included) and ``aten._upsample_bilinear2d_aa``, ``grid_sample`` and
``grid_sampler``/``grid_sampler_2d``/``grid_sampler_3d``.

Padding and shuffles are linear index maps; their cotangents are the inverse maps
(derivatives.yaml entries named in each rule).

``interpolate``: every mode is a separable linear map y = A_1 ⊗ ... ⊗ A_n x.  The backward is
its adjoint, d_x = d contracted with A_k along spatial dim k; the 1-d matrix A_k is obtained
exactly by resampling an identity matrix with the same call restricted to dim k (other dims
of size 1, scale 1, which every mode maps identically).  (derivatives.yaml `upsample_*`: the
``upsample_*_backward`` kernels are the same adjoints.)

Grid sampling (all interpolation modes: bilinear, nearest, bicubic; all padding modes: zeros,
border, reflection; ``align_corners`` on and off) is re-expressed with explicit torch ops (the
``grid_sampler_2d_backward`` / ``grid_sampler_3d_backward`` entries of derivatives.yaml name a
fused kernel; the formulas below are its mathematical content, derived here):

* Each grid component ``g`` (``grid[..., 0]`` indexes the last spatial dim W, ``[..., 1]`` H,
  ``[..., 2]`` D) is mapped to a source coordinate ``c`` by *unnormalizing*:
  ``c = (g + 1) (size - 1) / 2`` (align_corners) or ``c = ((g + 1) size - 1) / 2``, slope
  ``dc/dg = (size - 1) / 2`` or ``size / 2``.
* Padding acts on ``c`` (bilinear and nearest): *border* clamps to ``[0, size - 1]`` with slope 1
  strictly inside and 0 on and beyond the borders (PyTorch's convention: the borders count as
  out of bounds for the gradient); *reflection* folds ``c`` about ``lo`` and ``hi``
  (``0, size - 1`` with align_corners, else ``-1/2, size - 1/2``) -- slope +-1 by the parity of
  the number of folds and the side of ``lo`` -- and then clamps as for border.
* Bilinear: per dim the two taps ``i0 = floor(c)`` and ``i0 + 1`` with weights ``1 - f`` and
  ``f`` (``f = c - i0``, slopes -1 and +1); the 4 (2-d) or 8 (3-d) corners are products of the
  per-dim taps.  Nearest: one tap ``round(c)`` (half to even, like ``nearbyint``), weight 1,
  no grid gradient.  Bicubic (2-d only): 4 taps per dim at ``floor(c) - 1 + i`` with the cubic
  convolution weights of Keys (1981), "Cubic convolution interpolation for digital image
  processing", with ``A = -0.75``; padding is applied to each (integer) tap position instead
  of to ``c`` (no gradient through it).
* Taps outside the input read zero.  With ``w_k`` the weight of tap ``k``, ``v_k`` the input
  value there and ``d`` the cotangent of the output:
  ``d_input = sum_k scatter_add(w_k d)`` at the tap positions, and
  ``d_grid_j = dc_j/dg_j * sum_k sum_channels d v_k dw_k/dc_j``.
  The JVP is ``sum_k w_k t_input[k] + sum_j sum_k v_k dw_k/dc_j dc_j/dg_j t_grid_j``.

All backward and JVP code is plain torch (gather / scatter_add over the flattened spatial
dims).
"""
from __future__ import annotations

import itertools
import math
from typing import Any

import torch
import torch.nn.functional as F

from .._base import randn, uniform, _error, _t
from ..registry import register_vjp
from ._common import _contract_spatial, _ntuple


# --- padding and pixel shuffles --------------------------------------------------------------

@register_vjp(F.pad)
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


@register_vjp(torch.constant_pad_nd)
class ConstantPadNd:
    """constant_pad_nd(x, pad, value): d_x = constant_pad_nd(d, -pad) (derivatives.yaml
    `constant_pad_nd`: constant_pad_nd_backward)."""

    def fwd(input, pad, value=0):
        return torch.constant_pad_nd(input, pad, value), tuple(pad)

    def bwd(aux, d):
        return (torch.constant_pad_nd(d, [-p for p in aux]),)

    def samples(dtype):
        yield (_t((2, 3, 4), dtype), [1, 2, -1, 1]), {}


@register_vjp(F.pixel_shuffle)
class PixelShuffle:
    """pixel_shuffle(x, r): a permutation; d_x = pixel_unshuffle(d, r)
    (derivatives.yaml `pixel_shuffle`)."""

    def fwd(input, upscale_factor):
        return F.pixel_shuffle(input, upscale_factor), upscale_factor

    def bwd(aux, d):
        return (F.pixel_unshuffle(d, aux),)

    def samples(dtype):
        yield (_t((2, 8, 3, 2), dtype), 2), {}


@register_vjp(F.pixel_unshuffle)
class PixelUnshuffle:
    """pixel_unshuffle(x, r): a permutation; d_x = pixel_shuffle(d, r)
    (derivatives.yaml `pixel_unshuffle`)."""

    def fwd(input, downscale_factor):
        return F.pixel_unshuffle(input, downscale_factor), downscale_factor

    def bwd(aux, d):
        return (F.pixel_shuffle(d, aux),)

    def samples(dtype):
        yield (_t((2, 2, 4, 6), dtype), 2), {}


@register_vjp(F.channel_shuffle)
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


@register_vjp(F.interpolate)
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


@register_vjp(_UPSAMPLE_BILINEAR2D_AA)
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


_MODES = {"bilinear": 0, "nearest": 1, "bicubic": 2}
_PADDINGS = {"zeros": 0, "border": 1, "reflection": 2}
_A = -0.75  # cubic convolution parameter used by PyTorch's bicubic modes


# --- coordinates -----------------------------------------------------------------------------


def _mul(a: Any, b: Any) -> Any:
    """``a * b`` where ``None`` stands for 1 (keeps the generated code free of ``* 1``)."""
    if a is None:
        return b
    if b is None or (isinstance(b, float) and b == 1.0):
        return a
    if isinstance(b, float) and b == -1.0:
        return -a
    return a * b


def _unnormalize(g: Any, size: int, align_corners: bool) -> tuple[Any, float]:
    """Grid value in [-1, 1] -> pixel coordinate, and the slope dc/dg."""
    if align_corners:
        s = (size - 1) / 2
        return (g + 1) * s, s
    s = size / 2
    return ((g + 1) * size - 1) / 2, s


def _clip(c: Any, size: int) -> tuple[Any, Any]:
    """Clamp to [0, size - 1]; also the mask where the slope is 1 (strictly inside)."""
    inside = torch.logical_and(c > 0, c < size - 1)
    return torch.clamp(c, 0, size - 1), inside


def _reflect(c: Any, twice_lo: int, twice_hi: int) -> tuple[Any, Any]:
    """Fold ``c`` into [lo, hi] by reflections about lo and hi; also the slope (+-1)."""
    if twice_lo == twice_hi:
        zero = torch.zeros_like(c)
        return zero, zero
    lo = twice_lo / 2
    span = (twice_hi - twice_lo) / 2
    rel = c - lo
    dist = torch.abs(rel)
    extra = torch.fmod(dist, span)
    odd = torch.remainder(torch.floor(dist / span), 2) == 1
    folded = torch.where(odd, span - extra, extra) + lo
    flip = torch.logical_xor(odd, rel < 0)
    slope = torch.where(flip, torch.full_like(c, -1.0), torch.ones_like(c))
    return folded, slope


def _pad(c: Any, size: int, padding: int, align_corners: bool) -> tuple[Any, Any]:
    """Apply the padding mode to coordinate ``c``: (new coordinate, slope or None for 1)."""
    if padding == 0:
        return c, None
    slope = None
    if padding == 2:
        if align_corners:
            c, slope = _reflect(c, 0, 2 * (size - 1))
        else:
            c, slope = _reflect(c, -1, 2 * size - 1)
    c, inside = _clip(c, size)
    if slope is None:
        slope = inside.to(c.dtype)
    else:
        slope = torch.where(inside, slope, torch.zeros_like(slope))
    return c, slope


def _cubic_weights(f: Any) -> tuple[list, list]:
    """Weights of the 4 taps at offsets -1, 0, 1, 2 from floor(c) for fraction ``f``, and their
    derivatives in ``f`` (Keys' kernel: |x| <= 1: (A+2)|x|^3 - (A+3)|x|^2 + 1,
    1 < |x| < 2: A|x|^3 - 5A|x|^2 + 8A|x| - 4A)."""
    A = _A
    u = f + 1      # distance to tap -1, in (1, 2]
    r = 1 - f      # distance to tap 1, in (0, 1]
    v = 2 - f      # distance to tap 2, in (1, 2]
    w = [((A * u - 5 * A) * u + 8 * A) * u - 4 * A,
         ((A + 2) * f - (A + 3)) * f * f + 1,
         ((A + 2) * r - (A + 3)) * r * r + 1,
         ((A * v - 5 * A) * v + 8 * A) * v - 4 * A]
    dw = [(3 * A * u - 10 * A) * u + 8 * A,
          (3 * (A + 2) * f - 2 * (A + 3)) * f,
          -((3 * (A + 2) * r - 2 * (A + 3)) * r),
          -((3 * A * v - 10 * A) * v + 8 * A)]
    return w, dw


def _dim_taps(g: Any, size: int, mode: int, padding: int, align_corners: bool) -> tuple:
    """Taps along one spatial dim for grid component ``g`` (shape (N, Q)).

    Returns ``(taps, slope)``: ``taps`` a list of ``(index, weight, dweight)`` with ``index``
    an int64 tensor (may be out of range), ``weight``/``dweight`` tensors or None (weight 1 /
    no derivative), ``dweight`` the derivative of the weight in the coordinate; ``slope`` the
    derivative of the coordinate in ``g`` (a float, a tensor, or None when not needed)."""
    c, slope = _unnormalize(g, size, align_corners)
    if mode == 2:  # bicubic: padding applies to the integer tap positions
        base = torch.floor(c)
        w, dw = _cubic_weights(c - base)
        taps = []
        for i in range(4):
            pos, _ = _pad(base + (i - 1), size, padding, align_corners)
            taps.append((pos.to(torch.int64), w[i], dw[i]))
        return taps, slope
    c, pad_slope = _pad(c, size, padding, align_corners)
    if mode == 1:
        return [(torch.round(c).to(torch.int64), None, None)], None
    base = torch.floor(c)
    f = c - base
    i0 = base.to(torch.int64)
    slope = slope if pad_slope is None else pad_slope * slope
    return [(i0, 1 - f, -1.0), (i0 + 1, f, 1.0)], slope


class _Sampling:
    """The sampling of one call as explicit tensors over ``K`` taps and ``Q`` output points:
    ``index`` (N, K, Q) into the flattened spatial dims (0 where out of bounds), ``weight``
    (N, K, Q) (0 where out of bounds), per grid component ``dweight[j]`` (N, K, Q),
    d(weight)/d(coordinate j) (0 out of bounds), and ``slope[j]`` (dc_j/dg_j)."""

    def __init__(self, input: Any, grid: Any, mode: int, padding: int, align_corners: bool):
        shape = tuple(input.shape)
        n, c = shape[0], shape[1]
        spatial = shape[2:]
        k = len(spatial)
        out_pts = tuple(grid.shape[1:-1])
        q = math.prod(out_pts)
        self.n, self.c, self.k, self.q = n, c, k, q
        self.in_shape, self.out_shape = shape, (n, c) + out_pts
        self.grid_shape = tuple(grid.shape)
        self.differentiable = mode != 1
        flat_grid = grid.reshape(n, q, k)
        # per grid component j: spatial dim k - 1 - j
        sizes = [spatial[k - 1 - j] for j in range(k)]
        strides = [math.prod(spatial[k - j:]) for j in range(k)]
        per_dim, self.slope = [], []
        for j in range(k):
            taps, slope = _dim_taps(flat_grid[:, :, j], sizes[j], mode, padding, align_corners)
            per_dim.append(taps)
            self.slope.append(slope)
        index, weight, dweight = [], [], [[] for _ in range(k)]
        for combo in itertools.product(*per_dim):
            inb, lin, w = None, None, None
            for j, (idx, wj, _) in enumerate(combo):
                ok = torch.logical_and(idx >= 0, idx < sizes[j])
                inb = ok if inb is None else torch.logical_and(inb, ok)
                term = idx if strides[j] == 1 else idx * strides[j]
                lin = term if lin is None else lin + term
                w = _mul(w, wj)
            index.append(torch.where(inb, lin, torch.zeros_like(lin)))
            mask = inb.to(grid.dtype)
            weight.append(_mul(w, mask))
            if self.differentiable:
                for j in range(k):
                    dw = mask
                    for i, (_, wi, dwi) in enumerate(combo):
                        dw = _mul(dw, dwi if i == j else wi)
                    dweight[j].append(dw)
        self.index = torch.stack(index, 1)
        self.weight = torch.stack(weight, 1)
        self.dweight = [torch.stack(d, 1) for d in dweight] if self.differentiable else None
        self.taps = len(index)

    def gather(self, x: Any) -> Any:
        """Values of ``x`` (shaped like the input) at the taps: (N, C, K, Q)."""
        idx = self.index.reshape(self.n, 1, self.taps * self.q)
        idx = idx.expand(self.n, self.c, self.taps * self.q)
        vals = torch.flatten(x, 2).gather(2, idx)
        return vals.reshape(self.n, self.c, self.taps, self.q)

    def scatter(self, src: Any, like: Any) -> Any:
        """Adjoint of :meth:`gather`: zeros like the input with ``src`` (N, C, K, Q) added."""
        idx = self.index.reshape(self.n, 1, self.taps * self.q)
        idx = idx.expand(self.n, self.c, self.taps * self.q)
        flat = torch.zeros_like(torch.flatten(like, 2))
        flat = flat.scatter_add(2, idx, src.reshape(self.n, self.c, self.taps * self.q))
        return flat.reshape(self.in_shape)

    def grid_terms(self, values: Any, d: Any) -> Any:
        """sum over channels and taps of d * v * dweight_j * slope_j, stacked over j, shaped
        like the grid (``d`` is (N, C, Q))."""
        dv = torch.sum(values * torch.unsqueeze(d, 2), 1)   # (N, K, Q)
        parts = []
        for j in range(self.k):
            gj = torch.sum(dv * self.dweight[j], 1)          # (N, Q)
            parts.append(gj * self.slope[j])
        return torch.stack(parts, -1).reshape(self.grid_shape)


def _backward(aux: Any, d: Any) -> tuple[Any, Any]:
    input, grid, mode, padding, align_corners = aux
    s = _Sampling(input, grid, mode, padding, align_corners)
    dq = d.reshape(s.n, s.c, s.q)
    d_input = s.scatter(torch.unsqueeze(dq, 2) * torch.unsqueeze(s.weight, 1), input)
    if not s.differentiable:
        return d_input, None
    return d_input, s.grid_terms(s.gather(input), dq)


def _tangent(input: Any, grid: Any, t_input: Any, t_grid: Any, mode: int, padding: int,
             align_corners: bool) -> Any:
    if t_input is None and (t_grid is None or mode == 1):
        return None
    s = _Sampling(input, grid, mode, padding, align_corners)
    out = None
    if t_input is not None:
        out = torch.sum(s.gather(t_input) * torch.unsqueeze(s.weight, 1), 2)
    if t_grid is not None and s.differentiable:
        tg = t_grid.reshape(s.n, s.q, s.k)
        rate = None  # d(weight)/d(grid) . t_grid, (N, K, Q)
        for j in range(s.k):
            term = s.dweight[j] * torch.unsqueeze(tg[:, :, j] * s.slope[j], 1)
            rate = term if rate is None else rate + term
        part = torch.sum(s.gather(input) * torch.unsqueeze(rate, 1), 2)
        out = part if out is None else out + part
    return out.reshape(s.out_shape)


def _mode_args(mode: str, padding_mode: str, align_corners: Any) -> tuple[int, int, bool]:
    return _MODES[mode], _PADDINGS[padding_mode], bool(align_corners)


# --- rules -----------------------------------------------------------------------------------


def _grid(shape: tuple, dtype: torch.dtype, lo: float = -1.3, hi: float = 1.3) -> torch.Tensor:
    return uniform(shape, lo, hi, dtype)


def _input(shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    return uniform(shape, -2.0, 2.0, dtype)


@register_vjp(F.grid_sample)
class GridSample:
    """F.grid_sample(input, grid, mode, padding_mode, align_corners): the sampling is a sum over
    taps of weight * input value; d_input scatter-adds weight * d at the taps, d_grid sums
    d * value * d(weight)/d(coordinate) * d(coordinate)/d(grid) (see the module docstring;
    derivatives.yaml `grid_sampler_2d` / `grid_sampler_3d`: the grid_sampler_*_backward kernels
    compute the same sums; bicubic weights: Keys (1981) with A = -0.75)."""

    def fwd(input, grid, mode="bilinear", padding_mode="zeros", align_corners=None):
        out = F.grid_sample(input, grid, mode=mode, padding_mode=padding_mode,
                            align_corners=align_corners)
        return out, (input, grid) + _mode_args(mode, padding_mode, align_corners)

    def bwd(aux, d):
        return _backward(aux, d)

    def jvp(primals, tangents):
        x, grid, mode, padding_mode, align_corners = primals
        out = F.grid_sample(x, grid, mode=mode, padding_mode=padding_mode,
                            align_corners=align_corners)
        return out, _tangent(x, grid, tangents[0], tangents[1],
                             *_mode_args(mode, padding_mode, align_corners))

    def samples(dtype):
        for mode in ("bilinear", "nearest", "bicubic"):
            for pad in ("zeros", "border", "reflection"):
                for ac in (False, True):
                    yield ((_input((2, 3, 4, 5), dtype), _grid((2, 3, 2, 2), dtype)),
                           {"mode": mode, "padding_mode": pad, "align_corners": ac})
        for mode in ("bilinear", "nearest"):
            for pad in ("zeros", "border", "reflection"):
                yield ((_input((2, 2, 3, 4, 5), dtype), _grid((2, 2, 3, 2, 3), dtype)),
                       {"mode": mode, "padding_mode": pad, "align_corners": pad == "border"})
        # defaults; far out-of-range grid (several reflections); size-1 spatial dims
        yield (_input((1, 2, 3, 3), dtype), _grid((1, 2, 2, 2), dtype)), {}
        yield ((_input((1, 2, 3, 4), dtype), _grid((1, 3, 3, 2), dtype, -4.0, 4.0)),
               {"padding_mode": "reflection", "align_corners": False})
        yield ((_input((1, 2, 3, 4), dtype), _grid((1, 3, 3, 2), dtype, -4.0, 4.0)),
               {"padding_mode": "reflection", "align_corners": True})
        yield ((_input((1, 2, 3, 4), dtype), _grid((1, 3, 3, 2), dtype, -4.0, 4.0)),
               {"mode": "bicubic", "padding_mode": "reflection", "align_corners": False})
        for pad in ("zeros", "border", "reflection"):
            yield ((_input((1, 2, 1, 4), dtype), _grid((1, 2, 3, 2), dtype)),
                   {"padding_mode": pad, "align_corners": True})


def _sampler_rule(op: Any, sampler_samples: Any) -> type:
    class GridSampler:
        source = _SAMPLER_DOC

        def fwd(input, grid, interpolation_mode, padding_mode, align_corners):
            out = op(input, grid, interpolation_mode, padding_mode, align_corners)
            return out, (input, grid, interpolation_mode, padding_mode, bool(align_corners))

        def bwd(aux, d):
            return _backward(aux, d)

        def jvp(primals, tangents):
            x, grid, mode, padding, align_corners = primals
            out = op(x, grid, mode, padding, align_corners)
            return out, _tangent(x, grid, tangents[0], tangents[1], mode, padding,
                                 bool(align_corners))

        samples = sampler_samples

    return GridSampler


def _samples_2d(dtype):
    for mode in (0, 1, 2):
        for pad in (0, 1, 2):
            for ac in (False, True):
                yield (_input((2, 3, 4, 5), dtype), _grid((2, 3, 2, 2), dtype), mode, pad, ac), {}


def _samples_3d(dtype):
    for mode in (0, 1):
        for pad in (0, 1, 2):
            for ac in (False, True):
                yield ((_input((2, 2, 3, 4, 5), dtype), _grid((2, 2, 3, 2, 3), dtype), mode,
                        pad, ac), {})


def _samples_any(dtype):
    yield from itertools.islice(_samples_2d(dtype), 0, None, 5)
    yield from itertools.islice(_samples_3d(dtype), 0, None, 5)


_SAMPLER_DOC = (
    "grid_sampler / grid_sampler_2d / grid_sampler_3d(input, grid, interpolation_mode "
    "(0 bilinear, 1 nearest, 2 bicubic), padding_mode (0 zeros, 1 border, 2 reflection), "
    "align_corners): same formulas as F.grid_sample (see the module docstring; derivatives.yaml "
    "`grid_sampler_2d` / `grid_sampler_3d`: grid_sampler_*_backward; bicubic weights: Keys "
    "(1981), A = -0.75).")

for _op, _samples in ((torch.grid_sampler_2d, _samples_2d), (torch.grid_sampler_3d, _samples_3d),
                      (torch.grid_sampler, _samples_any)):
    register_vjp(_op)(_sampler_rule(_op, _samples))
