"""Rules for activation functions: ``relu``, ``gelu``, ``silu``, ``elu``, ``celu``, ``selu``,
``leaky_relu``, ``prelu``, ``hardtanh``, ``relu6``, ``hardsigmoid``, ``hardswish``, ``mish``,
``softplus``, ``threshold``, ``softshrink``, ``hardshrink``, ``tanhshrink``, ``softsign``,
``logsigmoid``, ``glu``, and the softmax family: ``softmax``/``log_softmax`` (``torch.*`` and
``F.*``), ``softmin``, ``aten._softmax_backward_data``, ``aten._safe_softmax``, and
``rrelu`` (``F.rrelu``, ``torch.rrelu``: random slopes in training, drawn as eager draws them).

Formulas follow PyTorch's ``tools/autograd/derivatives.yaml`` (entry named in each rule).
Masks use the same strict/non-strict comparisons as the ATen backward kernels, so the
cotangent at a kink equals autograd's.  ``relu``, ``gelu`` and ``silu`` may call a fused
backward kernel (:mod:`fxad.rules.fused`, ``docs/fused_kernels.md``).  ``sigmoid`` and
``tanh`` are in :mod:`fxad.rules.math`.
"""
from __future__ import annotations

import inspect
import math
from typing import Any

import torch
import torch.nn.functional as F

from .. import fused
from .._base import is_complex, randn, unary, _add, _error, _t
from ..registry import register_vjp
from ._common import _aten, _bound


@register_vjp(torch.relu)
@register_vjp(F.relu)
class Relu:
    """relu(x) = max(x, 0): d_x = d where out > 0 else 0 (derivatives.yaml `relu`:
    threshold_backward(grad, result, 0)).  Written ``d * sign(out)``: ``out >= 0``, so its
    sign is exactly the 0/1 mask (0 at x = 0, PyTorch's convention), and on the CPU this is
    ~5x faster than ``where(out > 0, d, 0)``, which materializes a boolean mask.  At fused
    level ``"all"`` (code built to run: :func:`fxad.compile`, :func:`fxad.joint_step`; see
    :mod:`fxad.rules.fused`) it is the single kernel
    ``torch.ops.aten.threshold_backward(d, out, 0)``: one pass instead of two and no
    temporary, 1.6x (float32) to 2.5x (bfloat16) faster on the CPU, ~2% of a bfloat16
    ResNet-18 training step.  ``d`` and ``out`` have the input's shape and real dtype."""

    residuals = "output"
    recompute = True

    def fwd(input, inplace=False):
        out = torch.relu(input)
        return out, out

    def bwd(out, d):
        if fused.enabled("all"):  # one kernel (docs/fused_kernels.md)
            return (torch.ops.aten.threshold_backward(d, out, 0),)
        return (d * torch.sign(out),)

    def jvp(primals, tangents):
        out = torch.relu(primals[0])
        return out, tangents[0] * torch.sign(out)

    def samples(dtype):
        yield (randn(3, 4, dtype=dtype),), {}


_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


@register_vjp(F.gelu)
class Gelu:
    """gelu(x) = x Φ(x): d_x = d (Φ(x) + x φ(x)); for ``approximate='tanh'``, with
    u = √(2/π)(x + 0.044715 x³), t = tanh(u): d_x = d (½(1 + t) + ½ x (1 - t²) u')
    (derivatives.yaml `gelu`: gelu_backward; Hendrycks & Gimpel 2016)."""

    residuals = "inputs"
    recompute = True

    def fwd(input, approximate="none"):
        return F.gelu(input, approximate=approximate), (input, approximate)

    def bwd(aux, d):
        x, approximate = aux
        if fused.enabled():  # one fused kernel instead of ~10 elementwise ops (docs/fused_kernels.md)
            return (torch.ops.aten.gelu_backward(d, x, approximate=approximate),)
        return (d * _gelu_derivative(x, approximate),)

    def jvp(primals, tangents):
        x, approximate = (primals + ("none",))[:2]
        return F.gelu(x, approximate=approximate), tangents[0] * _gelu_derivative(x, approximate)

    def samples(dtype):
        yield (randn(3, 4, dtype=dtype),), {}
        yield (randn(5, dtype=dtype),), {"approximate": "tanh"}


def _gelu_derivative(x: Any, approximate: str) -> Any:
    if approximate == "tanh":
        x2 = x * x
        t = torch.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * (x2 * x)))
        return 0.5 * (1 + t) + (0.5 * x) * ((1 - t * t) * (_SQRT_2_OVER_PI * (1 + 0.134145 * x2)))
    cdf = 0.5 * (1 + torch.erf(x * (1 / math.sqrt(2.0))))
    pdf = torch.exp(-0.5 * (x * x)) * _INV_SQRT_2PI
    return cdf + x * pdf


@register_vjp(F.silu)
class Silu:
    """silu(x) = x σ(x): d_x = d σ(x)(1 + x(1 - σ(x))) (derivatives.yaml `silu`:
    silu_backward)."""

    residuals = "inputs"
    recompute = True

    def fwd(input, inplace=False):
        return F.silu(input), input

    def bwd(x, d):
        if fused.enabled() and not is_complex(x):  # one kernel (docs/fused_kernels.md)
            return (torch.ops.aten.silu_backward(d, x),)
        s = torch.sigmoid(x)
        return (d * (s * (1 + x * (1 - s))),)

    def jvp(primals, tangents):
        x = primals[0]
        s = torch.sigmoid(x)
        return F.silu(x), tangents[0] * (s * (1 + x * (1 - s)))

    def samples(dtype):
        yield (randn(3, 4, dtype=dtype),), {}


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


@register_vjp(torch.softmax)
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


@register_vjp(torch.log_softmax)
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


@register_vjp(F.softmax)
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


@register_vjp(F.log_softmax)
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


unary(F.tanhshrink, save="input", derivative=lambda x: torch.tanh(x) ** 2,
      source="tanhshrink(x) = x - tanh(x): grad * tanh(x)^2")
unary(F.softsign, save="input", derivative=lambda x: 1 / (1 + torch.abs(x)) ** 2,
      source="softsign(x) = x / (1 + |x|): grad / (1 + |x|)^2")
unary(F.logsigmoid, save="input", derivative=lambda x: torch.sigmoid(-x),
      source="log_sigmoid: grad * sigmoid(-x) (derivatives.yaml `log_sigmoid_forward`)")


_SELU_ALPHA = 1.6732632423543772848170429916717
_SELU_SCALE = 1.0507009873554804934193349852946


# --- pointwise activations: y = f(x), d_x = d * f'(x) ------------------------------------------

def _pointwise(f: Any, deriv: Any, doc: str, samples: Any = None) -> type:
    """The rule class of ``y = f(input, *params)`` with ``d_x = d * deriv(x, y, *params)``
    (``fwd`` gets ``f``'s exact parameter names and defaults)."""
    sig = inspect.signature(f)
    names = list(sig.parameters)
    ns: dict[str, Any] = {"_f": f}
    src = (f"def fwd({', '.join(str(p) for p in sig.parameters.values())}):\n"
           f"    out = _f({', '.join(names)})\n"
           f"    return out, ({names[0]}, out, ({''.join(n + ', ' for n in names[1:])}))\n")
    exec(src, ns)  # a fwd with the op's exact parameter names and defaults

    def default_samples(dtype):
        yield (_t((3, 4), dtype, -4.0, 4.0),), {}
        yield (_t((), dtype, -4.0, 4.0),), {}

    class Pointwise:
        source = doc
        fwd = ns["fwd"]

        def bwd(aux, d):
            x, out, params = aux
            return (_scaled(d, deriv(x, out, *params)),)

        def jvp(primals, tangents):
            x, params = primals[0], primals[1:]
            out = f(x, *params)
            t = tangents[0]
            return out, (None if t is None else _scaled(t, deriv(x, out, *params)))

    Pointwise.samples = samples or default_samples
    return Pointwise


def _where(c, a, b):
    return torch.where(c, a, b)


class _Mask:
    """A derivative that is ``scale`` where ``mask`` holds and 0 elsewhere: applied as
    ``torch.where(mask, d * scale, 0)``, as PyTorch's backward kernels do, so that a NaN
    cotangent outside the mask gives 0 (a product would give NaN)."""

    def __init__(self, mask, scale=1.0):
        self.mask, self.scale = mask, scale


def _scaled(d, deriv):
    if isinstance(deriv, _Mask):
        return torch.where(deriv.mask, d if deriv.scale == 1.0 else d * deriv.scale, 0.0)
    return d * deriv


register_vjp(F.elu)(_pointwise(
    lambda input, alpha=1.0, inplace=False: F.elu(input, alpha),
    lambda x, y, alpha, inplace: _where(x > 0, 1.0, alpha * torch.exp(x)),
    "elu: d_x = d * (1 if x > 0 else alpha exp(x)) (derivatives.yaml `elu`: "
    "elu_backward)"))
register_vjp(F.celu)(_pointwise(
    lambda input, alpha=1.0, inplace=False: F.celu(input, alpha),
    lambda x, y, alpha, inplace: _where(x > 0, 1.0, torch.exp(x / alpha)),
    "celu: d_x = d * (1 if x > 0 else exp(x / alpha)) (derivatives.yaml `celu`)"))
register_vjp(F.selu)(_pointwise(
    lambda input, inplace=False: F.selu(input),
    lambda x, y, inplace: _where(x > 0, _SELU_SCALE,
                                 (_SELU_SCALE * _SELU_ALPHA) * torch.exp(x)),
    "selu: d_x = d * scale * (1 if x > 0 else alpha exp(x)) (derivatives.yaml `selu`: "
    "elu_backward)"))
register_vjp(F.leaky_relu)(_pointwise(
    lambda input, negative_slope=0.01, inplace=False: F.leaky_relu(input, negative_slope),
    # a tensor branch, so the slope keeps x's precision (two Python numbers would
    # make a float32 result)
    lambda x, y, s, inplace: _where(x > 0, torch.ones_like(x), float(s)),
    "leaky_relu: d_x = d * (1 if x > 0 else slope) (derivatives.yaml `leaky_relu`)"))
register_vjp(F.hardtanh)(_pointwise(
    lambda input, min_val=-1.0, max_val=1.0, inplace=False: F.hardtanh(input, min_val,
                                                                       max_val),
    lambda x, y, lo, hi, inplace: _Mask((x > lo) & (x < hi)),
    "hardtanh: d_x = d where min < x < max, else 0 (derivatives.yaml `hardtanh`: "
    "hardtanh_backward)"))
register_vjp(F.relu6)(_pointwise(
    lambda input, inplace=False: F.relu6(input),
    lambda x, y, inplace: _Mask((x > 0) & (x < 6)),
    "relu6 = hardtanh(x, 0, 6): d_x = d where 0 < x < 6 (derivatives.yaml `hardtanh`)"))
register_vjp(F.hardsigmoid)(_pointwise(
    lambda input, inplace=False: F.hardsigmoid(input),
    lambda x, y, inplace: _Mask((x > -3) & (x < 3), 1 / 6),
    "hardsigmoid: d_x = d / 6 where -3 < x < 3 (derivatives.yaml `hardsigmoid`)"))
register_vjp(F.hardswish)(_pointwise(
    lambda input, inplace=False: F.hardswish(input),
    lambda x, y, inplace: _where(x < -3, 0.0, _where(x <= 3, x / 3 + 0.5, 1.0)),
    "hardswish: d_x = d * (0 if x < -3, x/3 + 1/2 if x <= 3, else 1) "
    "(derivatives.yaml `hardswish`: hardswish_backward)"))


def _mish_d(x, y, inplace):
    tsp = torch.tanh(F.softplus(x))
    return tsp + x * torch.sigmoid(x) * (1 - tsp * tsp)


register_vjp(F.mish)(_pointwise(
    lambda input, inplace=False: F.mish(input), _mish_d,
    "mish = x tanh(softplus(x)): d_x = d * (tanh(sp) + x sigmoid(x) (1 - tanh(sp)^2)) "
    "(derivatives.yaml `mish`: mish_backward)"))


def _softplus_d(x, y, beta, threshold):
    z = x * beta
    return _where(z > threshold, 1.0, torch.sigmoid(z))


register_vjp(F.softplus)(_pointwise(
    lambda input, beta=1.0, threshold=20.0: F.softplus(input, beta, threshold),
    _softplus_d,
    "softplus: d_x = d * sigmoid(beta x), d where beta x > threshold "
    "(derivatives.yaml `softplus`: softplus_backward)"))
register_vjp(F.threshold)(_pointwise(
    lambda input, threshold, value, inplace=False: F.threshold(input, threshold, value),
    lambda x, y, th, v, inplace: (x > th).to(x.dtype),
    "threshold: d_x = d where x > threshold, else 0 (derivatives.yaml `threshold`)",
    samples=lambda dtype: iter([((_t((3, 4), dtype), 0.5, -1.0), {})])))
register_vjp(F.softshrink)(_pointwise(
    lambda input, lambd=0.5: F.softshrink(input, lambd),
    lambda x, y, lambd: (torch.abs(x) > lambd).to(x.dtype),
    "softshrink: d_x = d where |x| > lambda, else 0 (derivatives.yaml `softshrink`)"))
register_vjp(F.hardshrink)(_pointwise(
    lambda input, lambd=0.5: F.hardshrink(input, lambd),
    lambda x, y, lambd: (torch.abs(x) > lambd).to(x.dtype),
    "hardshrink: d_x = d where |x| > lambda, else 0 (derivatives.yaml `hardshrink`)"))


@register_vjp(F.glu)
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


@register_vjp(F.softmin)
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


@register_vjp(F.prelu)
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


# --- ATen-level softmax entry points --------------------------------------------------------


@register_vjp(_aten._softmax_backward_data)
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


@register_vjp(_aten._safe_softmax.default)
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


# --- rrelu (random slopes) -------------------------------------------------------------------


def _rrelu_fwd(input: Any, lower: float, upper: float, training: bool) -> tuple[Any, Any]:
    """(value, aux) of ``torch.rrelu``: aux is the saved noise (training) or
    ``(slope, input)`` (eval: leaky_relu with slope (lower + upper) / 2)."""
    if not training:
        slope = (lower + upper) / 2
        return F.leaky_relu(input, slope), (slope, input)
    # the kernel eager runs (rrelu_with_noise_cpu) on a fresh contiguous noise tensor, as
    # torch.rrelu allocates it: one uniform(lower, upper) draw per element <= 0, in order
    noise = torch.empty_like(input, memory_format=torch.contiguous_format)
    both = _aten.rrelu_with_noise_functional.default(input, noise, lower, upper, True)
    return both[0], both[1]


def _rrelu_times(aux: Any, t: Any) -> Any:
    """``t`` times the derivative: the saved noise, or leaky_relu's (1 if x > 0 else slope)."""
    if isinstance(aux, tuple):  # leaky_relu_backward: x > 0 ? t : t * slope
        slope, x = aux
        return torch.where(x > 0, t, t * slope)
    return t * aux


def _rrelu_jvp(primals: tuple, tangents: tuple) -> tuple[Any, Any]:
    out, aux = _rrelu_fwd(*primals[:4])
    t = tangents[0]
    return out, (None if t is None else _rrelu_times(aux, t))


def _rrelu_samples(dtype):
    x = randn(4, 5, dtype=dtype)
    yield (x,), {}  # eval mode (the default)
    yield (x, 0.1, 0.3, True), {}  # random: the rule tests seed eager and fxad alike
    yield (x.mT, 0.0, 1.0, True), {}  # a strided input
    yield (randn(2, 3, 4, dtype=dtype),), {"lower": 0.2, "upper": 0.2, "training": True}


_RRELU_DOC = """rrelu, training: noise[i] = uniform(lower, upper) drawn for each x[i] <= 0 (1 where
    x[i] > 0), y = x * noise; the generated forward calls the kernel eager runs,
    ``aten.rrelu_with_noise_functional(x, empty_like(x), lower, upper, True)`` (the functional
    form of ``rrelu_with_noise``), so under the same seed it draws the same slopes on the CPU
    (how many numbers it draws depends on the signs of x: only that kernel reproduces it).
    d_x = d * noise, t_y = t * noise (derivatives.yaml `rrelu_with_noise`:
    rrelu_with_noise_backward).  Eval: leaky_relu with slope (lower + upper) / 2,
    d_x = d * (1 if x > 0 else slope)."""


@register_vjp(F.rrelu)
class Rrelu:
    __doc__ = _RRELU_DOC
    residuals = "inputs+intermediates"
    recompute = False

    def fwd(input, lower=1.0 / 8, upper=1.0 / 3, training=False, inplace=False):
        return _rrelu_fwd(input, lower, upper, training)

    def bwd(aux, d):
        return (_rrelu_times(aux, d),)

    jvp = staticmethod(_rrelu_jvp)
    samples = staticmethod(_rrelu_samples)


@register_vjp(torch.rrelu)
class TorchRrelu:
    __doc__ = "``torch.rrelu(x, lower, upper, training)``: " + _RRELU_DOC
    residuals = "inputs+intermediates"
    recompute = False

    def fwd(input, lower=1.0 / 8, upper=1.0 / 3, training=False, generator=None):
        if generator is not None:
            raise _error("torch.rrelu", "a generator argument cannot be written into "
                         "generated code", "draw from the default generator (seed it with "
                         "torch.manual_seed)")
        return _rrelu_fwd(input, lower, upper, training)

    def bwd(aux, d):
        return (_rrelu_times(aux, d),)

    jvp = staticmethod(_rrelu_jvp)
    samples = staticmethod(_rrelu_samples)
