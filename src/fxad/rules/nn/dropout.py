"""Rules for the dropout family: ``F.dropout``, ``F.dropout1d/2d/3d``, ``F.alpha_dropout``,
``F.feature_alpha_dropout``, their ``torch.*`` entry points (``torch.dropout``,
``torch.feature_dropout``, ``torch.alpha_dropout``, ``torch.feature_alpha_dropout``),
``torch.native_dropout`` (called as it is: it is eager's own kernel) and
``aten.native_dropout_backward``.

The same random numbers as eager PyTorch (CPU)
----------------------------------------------
The generated forward draws the noise exactly as ATen's CPU kernels do
(``aten/src/ATen/native/Dropout.cpp``, ``_dropout_impl``; ``native_dropout_cpu``): the same
in-place kernel on a fresh tensor of the same shape, strides and dtype, in the same order::

    noise = torch.empty_like(x).bernoulli_(0.7)      # dropout, alpha_dropout
    noise = torch.empty((N, C, 1, 1), dtype=x.dtype).bernoulli_(0.7)  # feature dropout
                                                     # (dropout1d/2d/3d, feature_alpha_dropout)

then the same arithmetic (``noise / (1 - p)``, or alpha dropout's ``a`` and ``b`` constants
computed in double precision as ATen does), so under the same ``torch.manual_seed`` the
masks, values and cotangents equal eager autograd's bit for bit on the CPU (float32 and
float64, contiguous and strided inputs; ``tests/test_random_ops.py``).  The mask is drawn
once, in the forward, and saved; the backward multiplies the cotangent by it
(derivatives.yaml ``native_dropout``: native_dropout_backward; for the composite CPU
dropouts, the ``mul`` by the noise tensor), and the JVP multiplies the tangent by it.  The
backward never draws.

On CUDA (and XPU, lazy and PrivateUse1 devices) eager ``F.dropout`` calls the fused
``native_dropout`` kernel instead (ATen's ``is_fused_kernel_acceptable``), and so does the
generated code for a tensor traced on such a device (``torch.native_dropout(x, p, True)``,
d_x = d * mask * scale): the same kernel, but unlike the CPU path this is not covered by
fxad's tests (no GPU in CI).  ``torch.compile``/inductor generates its own random numbers
(unless ``torch._inductor.config.fallback_random``): the distribution is the same there, the
numbers are not.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from .._base import randn
from ..registry import register_vjp
from ._common import _aten

# SELU's negative saturation value (alpha * scale), as in Dropout.cpp
_ALPHA = 1.7580993408473766


def _noise(input: Any, p: float, feature: bool, unbatched: bool) -> Any:
    """The Bernoulli(1 - p) draw of ``_dropout_impl``: ``empty_like(input).bernoulli_(1 - p)``
    or, for feature dropout, a contiguous ``(N, C, 1, ...)`` tensor (``make_feature_noise``;
    an unbatched input is seen with a leading batch dimension of 1, as
    ``F.dropout1d``/``F.dropout3d`` unsqueeze it; its noise has the same elements in the
    same order without that dimension)."""
    if not feature:
        return torch.empty_like(input).bernoulli_(1 - p)
    shape = tuple(input.shape)
    if unbatched:
        shape = (1,) + shape
    noise_shape = shape[:2] + (1,) * (len(shape) - 2)
    if unbatched:
        noise_shape = noise_shape[1:]
    # (torch.empty, not x.new_empty: the simplifier never merges two torch.empty calls)
    return torch.empty(noise_shape, dtype=input.dtype, device=input.device).bernoulli_(1 - p)


def _dropout_fwd(input: Any, p: float, training: bool, *, feature: bool = False,
                 alpha: bool = False, unbatched: bool = False) -> tuple[Any, Any]:
    """(value, mask) of ``_dropout_impl``; the mask is a tensor, ``"identity"`` or
    ``"zero"``."""
    # (p outside [0, 1] already fails during capture, as in eager PyTorch)
    if not training or p == 0.0 or input.numel() == 0:
        return input, "identity"
    if p == 1.0:  # input.mul(zeros({})): zeros, with NaN where the input is NaN
        return input * 0.0, "zero"
    if not (feature or alpha) and _fused_device(input):
        # ATen's `dropout` on CUDA/XPU/lazy/PrivateUse1 (is_fused_kernel_acceptable): the
        # fused native_dropout kernel, so the generated code calls it too
        both = torch.native_dropout(input, p, True)
        return both[0], (both[1], 1.0 / (1 - p))
    noise = _noise(input, p, feature, unbatched)
    if alpha:
        a = 1.0 / math.sqrt((_ALPHA * _ALPHA * p + 1) * (1 - p))
        b = (noise - 1) * (_ALPHA * a) + _ALPHA * a * p
        mask = noise * a
        return input * mask + b, mask
    mask = noise / (1 - p)
    return input * mask, mask


def _fused_device(input: Any) -> bool:
    """Whether eager ``F.dropout`` runs the fused ``native_dropout`` kernel on ``input``'s
    device (ATen's ``is_fused_kernel_acceptable``; the CPU runs ``_dropout_impl``)."""
    return input.device.type in _FUSED_DEVICES


_FUSED_DEVICES = ("cuda", "xpu", "lazy", "privateuseone")


def _dropout_bwd(mask: Any, d: Any) -> Any:
    if isinstance(mask, str):
        return d if mask == "identity" else None
    if isinstance(mask, tuple):  # (boolean mask, scale) of native_dropout
        return d * mask[0] * mask[1]
    return d * mask


def _samples(*shapes: tuple[int, ...], functional: bool = True):
    """Samples of a dropout rule: eval mode, p = 0, training with p = 0.3 and 0.6, p = 1,
    on each shape (training samples are random: the rule tests seed eager and fxad alike)."""
    def samples(dtype):
        for k, shape in enumerate(shapes):
            x = randn(*shape, dtype=dtype)
            if k == 0:
                yield ((x,), {"p": 0.4, "training": False}) if functional else ((x, 0.4, False), {})
                yield (x, 0.0, True), {}
                yield (x, 1.0, True), {}
            yield (x, 0.3, True), {}
            yield (x.mT if x.dim() >= 2 else x, 0.6, True), {}  # a strided input
    return samples


def _register(op: Any, *, feature: bool, alpha: bool, unbatched_dims: int | None,
              training_name: str, training_default: Any, doc: str, samples: Any) -> None:
    """One rule class for ``op(input, p, training)`` (``training_name``: the flag's parameter
    name, ``training``/``train``; ``unbatched_dims``: the input rank that F.dropout1d/3d treat
    as unbatched)."""
    functional = training_name == "training"

    def is_unbatched(x: Any) -> bool:
        return unbatched_dims is not None and x.dim() == unbatched_dims

    def forward(x: Any, p: float, training: bool) -> tuple[Any, Any]:
        return _dropout_fwd(x, p, training, feature=feature, alpha=alpha,
                            unbatched=is_unbatched(x))

    if functional:  # F.*(input, p=0.5, training=..., inplace=False)
        def fwd(input, p=0.5, training=training_default, inplace=False):
            return forward(input, p, training)
    else:
        def fwd(input, p, train):
            return forward(input, p, train)

    def bwd(mask, d):
        return (_dropout_bwd(mask, d),)

    def jvp(primals, tangents):
        out, mask = forward(*primals[:3])
        t = tangents[0]
        return out, (None if t is None else _dropout_bwd(mask, t))

    cls = type(op.__name__.title().replace("_", ""), (), {
        "__doc__": doc, "fwd": staticmethod(fwd), "bwd": staticmethod(bwd),
        "jvp": staticmethod(jvp), "samples": staticmethod(samples),
        "residuals": "intermediates", "recompute": False})
    register_vjp(op)(cls)


_DROPOUT_DOC = (
    "Training with 0 < p < 1: noise = empty_like(x).bernoulli_(1 - p), mask = noise / (1 - p), "
    "y = x * mask, drawn in the generated forward exactly as ATen's CPU `_dropout_impl` draws "
    "it (the same masks as eager under the same seed) and saved; d_x = d * mask, t_y = t * "
    "mask (derivatives.yaml `native_dropout`: native_dropout_backward).  p == 0, eval mode or "
    "an empty input: identity; p == 1: x * 0.")
_FEATURE_DOC = (
    "Channel dropout: noise of shape (N, C, 1, ...) = torch.empty(...).bernoulli_(1 - p) "
    "(ATen's `make_feature_noise`; an unbatched input of {unbatched} dimensions is seen with "
    "N = 1), mask = noise / (1 - p), y = x * mask; d_x = d * mask, t_y = t * mask "
    "(derivatives.yaml: the `mul` by the noise tensor of the composite CPU kernel).  Same "
    "draws as eager on the CPU under the same seed.")
_ALPHA_DOC = (
    "Alpha dropout: noise = {noise}.bernoulli_(1 - p), a = 1 / sqrt((alpha^2 p + 1)(1 - p)), "
    "b = (noise - 1) alpha a + alpha a p, mask = noise a, y = x * mask + b (alpha = "
    "1.7580993408473766, ATen's `_dropout_impl`, the same draws as eager on the CPU under "
    "the same seed); d_x = d * mask, t_y = t * mask.  p == 0 or eval mode: identity; "
    "p == 1: x * 0.")

_register(F.dropout, feature=False, alpha=False, unbatched_dims=None, training_name="training",
          training_default=True, doc=_DROPOUT_DOC, samples=_samples((3, 4), (2, 3, 5)))
_register(torch.dropout, feature=False, alpha=False, unbatched_dims=None, training_name="train",
          training_default=None, doc="``torch.dropout(x, p, train)``: " + _DROPOUT_DOC,
          samples=_samples((3, 4), functional=False))
_register(F.dropout1d, feature=True, alpha=False, unbatched_dims=2, training_name="training",
          training_default=True, doc=_FEATURE_DOC.format(unbatched=2),
          samples=_samples((2, 5, 4), (5, 4)))
_register(F.dropout2d, feature=True, alpha=False, unbatched_dims=None, training_name="training",
          training_default=True, doc=_FEATURE_DOC.format(unbatched="(none: a 3-d input is "
                                                                    "(N, C, L))"),
          samples=_samples((2, 5, 3, 4)))
_register(F.dropout3d, feature=True, alpha=False, unbatched_dims=4, training_name="training",
          training_default=True, doc=_FEATURE_DOC.format(unbatched=4),
          samples=_samples((2, 4, 2, 3, 2), (4, 2, 3, 2)))
_register(torch.feature_dropout, feature=True, alpha=False, unbatched_dims=None,
          training_name="train", training_default=None,
          doc="``torch.feature_dropout(x, p, train)``: " + _FEATURE_DOC.format(
              unbatched="(none)"), samples=_samples((2, 5, 3), functional=False))
_register(F.alpha_dropout, feature=False, alpha=True, unbatched_dims=None,
          training_name="training", training_default=False,
          doc=_ALPHA_DOC.format(noise="empty_like(x)"), samples=_samples((3, 4), (2, 3, 5)))
_register(torch.alpha_dropout, feature=False, alpha=True, unbatched_dims=None,
          training_name="train", training_default=None,
          doc="``torch.alpha_dropout(x, p, train)``: " + _ALPHA_DOC.format(
              noise="empty_like(x)"), samples=_samples((3, 4), functional=False))
_register(F.feature_alpha_dropout, feature=True, alpha=True, unbatched_dims=None,
          training_name="training", training_default=False,
          doc=_ALPHA_DOC.format(noise="torch.empty((N, C, 1, ...))"),
          samples=_samples((2, 5, 3, 4), (3, 4)))
_register(torch.feature_alpha_dropout, feature=True, alpha=True, unbatched_dims=None,
          training_name="train", training_default=None,
          doc="``torch.feature_alpha_dropout(x, p, train)``: " + _ALPHA_DOC.format(
              noise="torch.empty((N, C, 1, ...))"), samples=_samples((2, 5, 3), functional=False))


def _native_dropout_fwd(input: Any, p: float, train: Any) -> tuple[Any, Any]:
    both = torch.native_dropout(input, p, train)  # the op itself: eager's kernel and draws
    if train is False:
        return both, None
    return both, (both[1], 0.0 if p == 1 else 1.0 / (1 - p))


@register_vjp(torch.native_dropout)
class NativeDropout:
    """``torch.native_dropout(x, p, train) -> (y, mask)``: the generated forward calls the op
    itself (the same kernel and draws as eager under the same seed: on the CPU
    ``empty_like(x).bernoulli_(1 - p)``, on CUDA a fused kernel) and saves the boolean mask;
    d_x = d * mask * scale, t_y = t * mask * scale with scale = 1 / (1 - p), 0 for p == 1
    (derivatives.yaml `native_dropout`: native_dropout_backward).  train=False: identity."""

    outputs = ("out", "mask")

    residuals = "output"
    recompute = False

    def fwd(input, p, train):
        return _native_dropout_fwd(input, p, train)

    def bwd(aux, d):
        d = d[0] if isinstance(d, tuple) else d
        if d is None or aux is None:
            return (d,)
        mask, scale = aux
        return (d * mask * scale,)

    def jvp(primals, tangents):
        value, aux = _native_dropout_fwd(*primals[:3])
        t = tangents[0]
        if t is None:
            return value, None
        if aux is None:
            return value, (t, None)
        mask, scale = aux
        return value, (t * mask * scale, None)

    def samples(dtype):
        x = randn(3, 4, dtype=dtype)
        yield (x, 0.3, False), {}
        yield (x, 0.3, True), {}
        yield (x.mT, 0.6, True), {}


@register_vjp(_aten.native_dropout_backward.default)
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
