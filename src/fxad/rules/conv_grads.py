"""Rules for the convolution gradient functions ``torch.nn.grad.conv{1,2,3}d_input`` and
``conv{1,2,3}d_weight``, so that the gradient code of a convolution (with fused kernels off,
as :func:`fxad.hvp` and grad-of-grad build it) can be differentiated again.

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
import torch.nn.grad as nn_grad

from ._base import builtin, randn
from .nn import _add, _emit


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

    @builtin(grad_in)
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

    @builtin(grad_w)
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
