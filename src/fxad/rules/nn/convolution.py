"""Rules for convolutions: ``conv1d``/``conv2d``/``conv3d``, ``conv_transpose1d``/``2d``/``3d``,
``F.unfold`` (im2col) / ``F.fold`` (col2im), and the convolution gradient functions
``torch.nn.grad.conv{1,2,3}d_input`` / ``conv{1,2,3}d_weight``.

The backward of a convolution calls the public ``torch.nn.grad.conv*d_input`` /
``conv*d_weight`` (emitted as one call each; ``conv2d`` calls the fused
``convolution_backward`` instead where :mod:`fxad.rules.fused` allows it).  With fused kernels
off, those calls are what :func:`fxad.hvp` and grad-of-grad differentiate again, so they have
rules too.
With ``C(x, w)`` the convolution (bilinear in input ``x`` and weight ``w``), the two functions
are its partial adjoints: ``conv_input(x.shape, w, g) = B(w, g)`` with
``<C(x, w), g> = <x, B(w, g)>`` and ``conv_weight(x, w.shape, g) = W(x, g)`` with
``<C(x, w), g> = <w, W(x, g)>``.  Both are bilinear, and the same identity gives their VJPs
(derivatives.yaml `convolution_backward`, whose double backward PyTorch writes the same way):

* ``B(w, g)``: ``d_w = W(d, g)``, ``d_g = C(d, w)``;
* ``W(x, g)``: ``d_x = B(d, g)``, ``d_g = C(x, d)``;

and their JVPs ``B(t_w, g) + B(w, t_g)``, ``W(t_x, g) + W(x, t_g)``.  Stride, padding
(integers), dilation and groups are passed through unchanged.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
import torch.nn.grad as nn_grad

from .. import fused
from .._base import randn, _add, _emit, _error, _t
from ..registry import needs_cotangent, register_vjp
from ._common import _bound, _pair


# --- 2-d convolution ------------------------------------------------------------------------


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


@register_vjp(torch.conv2d)
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


def _ntuple(v: Any, n: int) -> tuple:
    return tuple(v) if isinstance(v, (tuple, list)) else (v,) * n


def _conv_rule(op: Any, nd: int) -> type:
    grad_in = getattr(torch.nn.grad, f"conv{nd}d_input")
    grad_w = getattr(torch.nn.grad, f"conv{nd}d_weight")
    name = f"conv{nd}d"

    class Conv:
        source = (f"{name}(x, w, b): d_x = conv{nd}d_input(x.shape, w, d) (the transposed "
                  f"convolution), d_w = conv{nd}d_weight(x, w.shape, d), d_b = sum(d) over "
                  "all but the channel dim; 'same' padding is applied explicitly and cropped "
                  "back (derivatives.yaml `convolution`: convolution_backward)")

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

    return Conv


register_vjp(torch.conv1d)(_conv_rule(torch.conv1d, 1))
register_vjp(torch.conv3d)(_conv_rule(torch.conv3d, 3))


def _conv_transpose_rule(op: Any, nd: int) -> type:
    conv = getattr(torch, f"conv{nd}d")
    grad_w = getattr(torch.nn.grad, f"conv{nd}d_weight")
    name = f"conv_transpose{nd}d"

    class ConvTranspose:
        source = (f"{name}(x, w, b) is the adjoint of conv{nd}d in its input: "
                  f"d_x = conv{nd}d(d, w), d_w = conv{nd}d_weight(d, w.shape, x), "
                  "d_b = sum(d) over all but the channel dim (derivatives.yaml "
                  "`convolution` with transposed=True: convolution_backward)")

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

    return ConvTranspose


register_vjp(torch.conv_transpose1d)(_conv_transpose_rule(torch.conv_transpose1d, 1))
register_vjp(torch.conv_transpose2d)(_conv_transpose_rule(torch.conv_transpose2d, 2))
register_vjp(torch.conv_transpose3d)(_conv_transpose_rule(torch.conv_transpose3d, 3))


@register_vjp(F.unfold)
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


@register_vjp(F.fold)
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


def _make(nd: int) -> None:
    conv = getattr(torch, f"conv{nd}d")
    grad_in = getattr(nn_grad, f"conv{nd}d_input")
    grad_w = getattr(nn_grad, f"conv{nd}d_weight")

    def samples_in(dtype: torch.dtype):
        for x_shape, w_shape, kw in _cases(nd):
            w = randn(*w_shape, dtype=dtype)
            g_shape = conv(torch.zeros(x_shape, dtype=dtype), w, None, **kw).shape
            yield (tuple(x_shape), w, randn(*g_shape, dtype=dtype)), kw

    def samples_w(dtype: torch.dtype):
        for x_shape, w_shape, kw in _cases(nd):
            x = randn(*x_shape, dtype=dtype)
            g_shape = conv(x, torch.zeros(w_shape, dtype=dtype), None, **kw).shape
            yield (x, tuple(w_shape), randn(*g_shape, dtype=dtype)), kw

    @register_vjp(grad_in)
    class ConvInput:
        __doc__ = (f"conv{nd}d_input(x_shape, w, g) = B(w, g), the adjoint of conv{nd}d in its "
                   "input: d_w = conv_weight(d, w.shape, g), d_g = conv(d, w) (module "
                   "docstring; derivatives.yaml `convolution_backward`).")

        def fwd(input_size, weight, grad_output, stride=1, padding=0, dilation=1, groups=1):
            out = _emit(grad_in, input_size, weight, grad_output, stride, padding, dilation,
                        groups)
            return out, (weight, grad_output, stride, padding, dilation, groups)

        def bwd(aux, d):
            w, g, stride, padding, dilation, groups = aux
            d_w = _emit(grad_w, d, tuple(w.shape), g, stride, padding, dilation, groups)
            d_g = conv(d, w, None, stride, padding, dilation, groups)
            return None, d_w, d_g

        def jvp(primals, tangents):
            size, w, g, stride, padding, dilation, groups = primals
            _, tw, tg = tangents[:3]
            rest = (stride, padding, dilation, groups)
            out = _emit(grad_in, size, w, g, *rest)
            t = None if tw is None else _emit(grad_in, size, tw, g, *rest)
            if tg is not None:
                t = _add(t, _emit(grad_in, size, w, tg, *rest))
            return out, t

        samples = samples_in

    @register_vjp(grad_w)
    class ConvWeight:
        __doc__ = (f"conv{nd}d_weight(x, w_shape, g) = W(x, g), the adjoint of conv{nd}d in its "
                   "weight: d_x = conv_input(x.shape, d, g), d_g = conv(x, d) (module "
                   "docstring; derivatives.yaml `convolution_backward`).")

        def fwd(input, weight_size, grad_output, stride=1, padding=0, dilation=1, groups=1):
            out = _emit(grad_w, input, weight_size, grad_output, stride, padding, dilation,
                        groups)
            return out, (input, grad_output, stride, padding, dilation, groups)

        def bwd(aux, d):
            x, g, stride, padding, dilation, groups = aux
            d_x = _emit(grad_in, tuple(x.shape), d, g, stride, padding, dilation, groups)
            d_g = conv(x, d, None, stride, padding, dilation, groups)
            return d_x, None, d_g

        def jvp(primals, tangents):
            x, size, g, stride, padding, dilation, groups = primals
            tx, _, tg = tangents[:3]
            rest = (stride, padding, dilation, groups)
            out = _emit(grad_w, x, size, g, *rest)
            t = None if tx is None else _emit(grad_w, tx, size, g, *rest)
            if tg is not None:
                t = _add(t, _emit(grad_w, x, size, tg, *rest))
            return out, t

        samples = samples_w


def _cases(nd: int):
    sp = (5,) * nd
    k = (3,) * nd
    yield (2, 3) + sp, (4, 3) + k, {}
    yield (2, 3) + sp, (4, 3) + k, {"stride": 2, "padding": 1}
    yield (1, 4) + sp, (6, 2) + (2,) * nd, {"padding": 1, "dilation": 2, "groups": 2}


for _nd in (1, 2, 3):
    _make(_nd)
