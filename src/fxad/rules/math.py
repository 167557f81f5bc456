"""Rules for unary and special functions: ``exp``/``exp2``/``expm1``, ``log``/``log2``/
``log10``/``log1p``, ``sqrt``/``rsqrt``, ``abs``, ``sign``/``sgn``, ``square``, ``reciprocal``,
trigonometric and hyperbolic functions and their inverses, ``sigmoid``, ``erf``/``erfc``/
``erfinv``, ``lgamma``/``digamma``/``polygamma``/``mvlgamma``, ``i0``/``i1`` (and ``*e``),
``torch.special`` (``ndtr``, ``ndtri``, ``log_ndtr``, ``erfcx``, ``entr``, ``xlog1py``),
``sinc``, ``logit``, ``frac``, ``deg2rad``/``rad2deg``, and the binary functions ``atan2``,
``hypot``, ``logaddexp``/``logaddexp2``, ``xlogy``.

Most unary rules are one :func:`fxad.rules._base.unary` line: ``dx = dy * f'(x)`` with ``f'``
written in the input or in the output, whichever derivatives.yaml uses (entry named in each
rule).  Broadcast cotangents of the binary functions are reduced by the engine.
"""
from __future__ import annotations

import math

import torch

from ._base import unary, _add, _binary_samples, _is_t, _LN10, _LN2, _t
from .registry import register_vjp


# --- unary functions ------------------------------------------------------------------------

unary(torch.exp, save="output", derivative=lambda y: y,
      source="d/dx exp(x) = exp(x) (derivatives.yaml `exp`: grad * result)")
unary(torch.log, save="input", derivative=lambda x: 1 / x, domain=(0.5, 3.0),
      source="d/dx log(x) = 1/x (derivatives.yaml `log`: grad.div(self))")
unary(torch.sin, save="input", derivative=torch.cos,
      source="d/dx sin(x) = cos(x) (derivatives.yaml `sin`)")
unary(torch.cos, save="input", derivative=lambda x: -torch.sin(x),
      source="d/dx cos(x) = -sin(x) (derivatives.yaml `cos`)")
unary(torch.tanh, save="output", derivative=lambda y: 1 - y * y,
      source="d/dx tanh(x) = 1 - tanh(x)^2 (derivatives.yaml `tanh`: tanh_backward)")
unary(torch.sigmoid, save="output", derivative=lambda y: y * (1 - y),
      source="d/dx s(x) = s(x)(1 - s(x)) (derivatives.yaml `sigmoid`: sigmoid_backward)")


def _output_kernel(op, kernel, doc: str) -> type:
    """The fused-level-``"all"`` rule of a real unary ``op`` whose backward is autograd's one
    kernel ``kernel(d, y)`` of the saved output (code built to run: :func:`fxad.compile`,
    :func:`fxad.joint_step`); the default level writes the formula (``unary`` above)."""

    class OutputKernel:
        source = doc
        residuals = "output"
        recompute = True
        fused = "all"

        def applies(input):
            return not input.is_complex()

        def fwd(input):
            out = op(input)
            return out, out

        def bwd(out, d):
            return (kernel(d, out),)

        def samples(dtype):
            yield (_t((3, 4), dtype),), {}

    return OutputKernel


TanhFused = register_vjp(torch.tanh)(_output_kernel(
    torch.tanh, torch.ops.aten.tanh_backward,
    "tanh at fused level 'all': torch.ops.aten.tanh_backward(d, y) = d * (1 - y^2) "
    "(derivatives.yaml `tanh`), one pass instead of three"))
SigmoidFused = register_vjp(torch.sigmoid)(_output_kernel(
    torch.sigmoid, torch.ops.aten.sigmoid_backward,
    "sigmoid at fused level 'all': torch.ops.aten.sigmoid_backward(d, y) = d * y * (1 - y) "
    "(derivatives.yaml `sigmoid`), one pass instead of three"))


unary(torch.sqrt, save="output", derivative=lambda y: 0.5 / y, domain=(0.5, 3.0),
      source="d/dx sqrt(x) = 1/(2 sqrt(x)) (derivatives.yaml `sqrt`: grad / (2 * result))")
unary(torch.rsqrt, save="output", derivative=lambda y: -0.5 * y ** 3, domain=(0.5, 3.0),
      source="d/dx x^-1/2 = -x^-3/2 / 2 (derivatives.yaml `rsqrt`: -0.5 * grad * result.pow(3))")
unary(torch.abs, save="input", derivative=torch.sign,
      source="d/dx |x| = sign(x) (derivatives.yaml `abs`: grad * self.sgn())")
unary(torch.square, save="input", derivative=lambda x: 2 * x,
      source="d/dx x^2 = 2x (derivatives.yaml `square` via pow)")
unary(torch.reciprocal, save="output", derivative=lambda y: -(y * y), domain=(0.5, 2.0),
      source="d/dx 1/x = -1/x^2 (derivatives.yaml `reciprocal`: -grad * (result * result).conj())")
unary(torch.log1p, save="input", derivative=lambda x: 1 / (1 + x), domain=(-0.5, 2.0),
      source="d/dx log(1+x) = 1/(1+x) (derivatives.yaml `log1p`)")
unary(torch.expm1, save="output", derivative=lambda y: y + 1,
      source="d/dx (e^x - 1) = e^x (derivatives.yaml `expm1`: grad * (result + 1))")
unary(torch.erf, save="input",
      derivative=lambda x: (2 / math.sqrt(math.pi)) * torch.exp(-(x * x)),
      source="d/dx erf(x) = 2/sqrt(pi) exp(-x^2) (derivatives.yaml `erf`)")
unary(torch.sign, save="input", derivative=lambda x: torch.zeros_like(x),
      source="sign is piecewise constant (derivatives.yaml `sign`: zeros_like(grad))")


_SQRT_PI = math.sqrt(math.pi)
_SQRT_2PI = math.sqrt(2 * math.pi)


# --- trigonometric and hyperbolic functions, other bases, special functions -----------------

unary(torch.tan, save="output", derivative=lambda y: 1 + y * y, domain=(-1.2, 1.2),
      source="tan: grad * (1 + result^2) (derivatives.yaml `tan`)")
unary(torch.sinh, save="input", derivative=torch.cosh,
      source="sinh: grad * cosh(x) (derivatives.yaml `sinh`)")
unary(torch.cosh, save="input", derivative=torch.sinh,
      source="cosh: grad * sinh(x) (derivatives.yaml `cosh`)")
unary(torch.asin, save="input", derivative=lambda x: torch.rsqrt(1 - x * x), domain=(-0.9, 0.9),
      source="asin: grad / sqrt(1 - x^2) (derivatives.yaml `asin`)")
unary(torch.acos, save="input", derivative=lambda x: -torch.rsqrt(1 - x * x), domain=(-0.9, 0.9),
      source="acos: -grad / sqrt(1 - x^2) (derivatives.yaml `acos`)")
unary(torch.atan, save="input", derivative=lambda x: 1 / (1 + x * x),
      source="atan: grad / (1 + x^2) (derivatives.yaml `atan`)")
unary(torch.asinh, save="input", derivative=lambda x: torch.rsqrt(x * x + 1),
      source="asinh: grad / sqrt(x^2 + 1) (derivatives.yaml `asinh`)")
unary(torch.acosh, save="input", derivative=lambda x: torch.rsqrt(x * x - 1), domain=(1.1, 3.0),
      source="acosh: grad / sqrt(x^2 - 1) (derivatives.yaml `acosh`)")
unary(torch.atanh, save="input", derivative=lambda x: 1 / (1 - x * x), domain=(-0.9, 0.9),
      source="atanh: grad / (1 - x^2) (derivatives.yaml `atanh`)")
unary(torch.log2, save="input", derivative=lambda x: 1 / (x * _LN2), domain=(0.2, 3.0),
      source="log2: grad / (x ln 2) (derivatives.yaml `log2`)")
unary(torch.log10, save="input", derivative=lambda x: 1 / (x * _LN10), domain=(0.2, 3.0),
      source="log10: grad / (x ln 10) (derivatives.yaml `log10`)")
unary(torch.exp2, save="output", derivative=lambda y: y * _LN2,
      source="exp2: grad * result * ln 2 (derivatives.yaml `exp2`)")
unary(torch.erfc, save="input", derivative=lambda x: (-2 / _SQRT_PI) * torch.exp(-x * x),
      source="erfc: -2/sqrt(pi) exp(-x^2) grad (derivatives.yaml `erfc`)")
unary(torch.erfinv, save="output", derivative=lambda y: (_SQRT_PI / 2) * torch.exp(y * y),
      domain=(-0.9, 0.9),
      source="erfinv: sqrt(pi)/2 exp(erfinv(x)^2) grad (derivatives.yaml `erfinv`)")
unary(torch.lgamma, save="input", derivative=torch.digamma, domain=(0.2, 3.0),
      source="lgamma: grad * digamma(x) (derivatives.yaml `lgamma`)")
unary(torch.digamma, save="input", derivative=lambda x: torch.polygamma(1, x), domain=(0.2, 3.0),
      source="digamma: grad * polygamma(1, x) (derivatives.yaml `digamma`)")
unary(torch.deg2rad, save="input", derivative=lambda x: torch.full_like(x, math.pi / 180),
      source="deg2rad: grad * pi/180 (derivatives.yaml `deg2rad`)")
unary(torch.rad2deg, save="input", derivative=lambda x: torch.full_like(x, 180 / math.pi),
      source="rad2deg: grad * 180/pi (derivatives.yaml `rad2deg`)")
unary(torch.frac, save="input", residuals="nothing", derivative=torch.ones_like,
      source="frac: grad (derivatives.yaml `frac`)")
unary(torch.positive, save="input", residuals="nothing", derivative=torch.ones_like,
      source="positive: identity")
unary(torch.sgn, save="input", derivative=torch.zeros_like,
      source="sgn (real input): zero derivative (derivatives.yaml `sgn`)")
unary(torch.i0, save="input", derivative=torch.special.i1,
      source="i0: grad * i1(x) (derivatives.yaml `i0`)")
unary(torch.special.i0e, save="input", residuals="inputs+output",
      derivative=lambda x: torch.special.i1e(x) - torch.sign(x) * torch.special.i0e(x),
      source="special_i0e: grad * (i1e(x) - sgn(x) i0e(x)) (derivatives.yaml `special_i0e`)")
unary(torch.special.ndtr, save="input",
      derivative=lambda x: torch.exp(-0.5 * x * x) / _SQRT_2PI,
      source="special_ndtr: grad * exp(-x^2/2)/sqrt(2 pi) (derivatives.yaml `special_ndtr`)")
unary(torch.special.ndtri, save="output",
      derivative=lambda y: _SQRT_2PI * torch.exp(0.5 * y * y), domain=(0.05, 0.95),
      source="special_ndtri: grad * sqrt(2 pi) exp(ndtri(x)^2/2) (derivatives.yaml "
             "`special_ndtri`)")
unary(torch.special.log_ndtr, save="input", residuals="inputs+output",
      derivative=lambda x: torch.exp(-0.5 * x * x - torch.special.log_ndtr(x)) / _SQRT_2PI,
      source="special_log_ndtr: grad * exp(-x^2/2 - log_ndtr(x))/sqrt(2 pi) (derivatives.yaml "
             "`special_log_ndtr`)")
unary(torch.special.erfcx, save="input", residuals="inputs+output",
      derivative=lambda x: 2 * x * torch.special.erfcx(x) - 2 / _SQRT_PI,
      source="special_erfcx: grad * (2 x erfcx(x) - 2/sqrt(pi)) (derivatives.yaml "
             "`special_erfcx`)")
unary(torch.sinc, save="input", residuals="inputs+output",
      derivative=lambda x: torch.where(x == 0, 0.0, (torch.cos(math.pi * x) - torch.sinc(x)) / x),
      source="sinc: grad * (cos(pi x) - sinc(x)) / x, 0 at x = 0 (derivatives.yaml `sinc`)")


@register_vjp(torch.atan2)
class Atan2:
    """atan2(a, b): d_a = d * b / (a^2 + b^2), d_b = -d * a / (a^2 + b^2)
    (derivatives.yaml ``atan2``)."""

    def fwd(input, other):
        return torch.atan2(input, other), (input, other)

    def bwd(aux, d):
        a, b = aux
        r = d / (a * a + b * b)
        return r * b, -r * a

    def samples(dtype):
        yield from _binary_samples(dtype)


@register_vjp(torch.hypot)
class Hypot:
    """hypot(a, b) = sqrt(a^2 + b^2): d_a = d * a / out, d_b = d * b / out
    (derivatives.yaml ``hypot``)."""

    def fwd(input, other):
        out = torch.hypot(input, other)
        return out, (input, other, out)

    def bwd(aux, d):
        a, b, out = aux
        r = d / out
        return r * a, r * b

    def jvp(primals, tangents):
        (a, b), (ta, tb) = primals, tangents
        out = torch.hypot(a, b)
        return out, _add(None if ta is None else ta * a / out, None if tb is None else tb * b / out)

    def samples(dtype):
        yield from _binary_samples(dtype)


@register_vjp(torch.logaddexp)
class LogAddExp:
    """logaddexp(a, b): d_a = d * sigmoid(a - b), d_b = d * sigmoid(b - a)
    (derivatives.yaml ``logaddexp``)."""

    def fwd(input, other):
        return torch.logaddexp(input, other), (input, other)

    def bwd(aux, d):
        a, b = aux
        s = torch.sigmoid(a - b)
        return d * s, d * (1 - s)

    def samples(dtype):
        yield from _binary_samples(dtype)


@register_vjp(torch.logaddexp2)
class LogAddExp2:
    """logaddexp2(a, b) = log2(2^a + 2^b): d_a = d * sigmoid((a - b) ln 2)
    (derivatives.yaml ``logaddexp2``)."""

    def fwd(input, other):
        return torch.logaddexp2(input, other), (input, other)

    def bwd(aux, d):
        a, b = aux
        s = torch.sigmoid((a - b) * _LN2)
        return d * s, d * (1 - s)

    def samples(dtype):
        yield from _binary_samples(dtype)


@register_vjp(torch.xlogy)
class XLogY:
    """xlogy(x, y) = x log y (0 where x == 0): d_x = d * log y (0 where x == 0 and y is not
    NaN), d_y = d * x / y (derivatives.yaml ``xlogy.Tensor``)."""

    def fwd(self, other):
        return torch.xlogy(self, other), (self, other)

    def bwd(aux, d):
        x, y = aux
        d_x = None
        if _is_t(x) and _is_t(y):
            d_x = d * torch.where((x == 0) & ~torch.isnan(y), 0.0, torch.log(y))
        elif _is_t(x):
            d_x = d * torch.where(x == 0, 0.0, math.log(y))
        d_y = d * x / y if _is_t(y) else None
        return d_x, d_y

    def samples(dtype):
        yield from _binary_samples(dtype, 0.2, 2.0)


@register_vjp(torch.special.xlog1py)
class XLog1pY:
    """xlog1py(x, y) = x log1p(y): d_x = d * log1p(y) (0 where x == 0), d_y = d * x / (1 + y)
    (derivatives.yaml ``special_xlog1py``)."""

    def fwd(self, other):
        return torch.special.xlog1py(self, other), (self, other)

    def bwd(aux, d):
        x, y = aux
        d_x = None
        if _is_t(x):
            ly = torch.log1p(y) if _is_t(y) else math.log1p(y)
            d_x = d * torch.where((x == 0) & ~torch.isnan(y), 0.0, ly) if _is_t(y) \
                else d * torch.where(x == 0, 0.0, ly)
        d_y = d * x / (1 + y) if _is_t(y) else None
        return d_x, d_y

    def samples(dtype):
        yield from _binary_samples(dtype, 0.2, 2.0)


@register_vjp(torch.logit)
class Logit:
    """logit(x, eps): d_x = d / (x (1 - x)), 0 outside [eps, 1 - eps] when eps is given
    (derivatives.yaml `logit`: logit_backward)."""

    def fwd(input, eps=None):
        return torch.logit(input, eps), (input, eps)

    def bwd(aux, d):
        x, eps = aux
        g = d / (x * (1 - x))
        if eps is None:
            return g, None
        return torch.where((x < eps) | (x > 1 - eps), 0.0, g), None

    def samples(dtype):
        yield (_t((3, 4), dtype, 0.05, 0.95),), {}
        yield (_t((3, 4), dtype, 0.3, 0.7), 0.1), {}


def _polygamma_rule(op, name):
    class Polygamma:
        source = f"{name}(n, x): d_x = d polygamma(n + 1, x) (derivatives.yaml `polygamma`)"

        def fwd(n, input):
            return op(n, input), (n, input)

        def bwd(aux, d):
            n, x = aux
            return None, d * torch.polygamma(n + 1, x)

        def samples(dtype):
            yield (1, _t((3, 4), dtype, 0.5, 3.0)), {}
            yield (0, _t((3, 4), dtype, 0.5, 3.0)), {}

    return Polygamma


register_vjp(torch.polygamma)(_polygamma_rule(torch.polygamma, "polygamma"))
register_vjp(torch.special.polygamma)(_polygamma_rule(torch.special.polygamma,
                                                      "special.polygamma"))


@register_vjp(torch.mvlgamma)
class Mvlgamma:
    """mvlgamma(x, p) = const + sum_{i<p} lgamma(x - i/2): d_x = d sum_{i<p} digamma(x - i/2)
    (derivatives.yaml `mvlgamma`: mvlgamma_backward)."""

    def fwd(input, p):
        return torch.mvlgamma(input, p), (input, p)

    def bwd(aux, d):
        x, p = aux
        s = torch.digamma(x)
        for i in range(1, p):
            s = s + torch.digamma(x - i / 2)
        return d * s, None

    def samples(dtype):
        yield (_t((3, 4), dtype, 2.0, 4.0), 3), {}


@register_vjp(torch.special.i1)
class I1:
    """special.i1: d_x = d (i0(x) - i1(x) / x), 1/2 at x = 0 (derivatives.yaml `special_i1`:
    i1_backward)."""

    def fwd(input):
        out = torch.special.i1(input)
        return out, (input, out)

    def bwd(aux, d):
        x, y = aux
        return (d * torch.where(x == 0, 0.5, torch.special.i0(x) - y / x),)

    def samples(dtype):
        yield (_t((3, 4), dtype),), {}


@register_vjp(torch.special.i1e)
class I1e:
    """special.i1e: d_x = d (i0e(x) - i1e(x) (sgn(x) + 1/x)), 1/2 at x = 0 (derivatives.yaml
    `special_i1e`: i1e_backward)."""

    def fwd(input):
        out = torch.special.i1e(input)
        return out, (input, out)

    def bwd(aux, d):
        x, y = aux
        g = torch.special.i0e(x) - y * (torch.sgn(x) + 1 / x)
        return (d * torch.where(x == 0, 0.5, g),)

    def samples(dtype):
        yield (_t((3, 4), dtype),), {}


@register_vjp(torch.special.entr)
class Entr:
    """special.entr(x) = -x log x: d_x = -d (1 + log x) (derivatives.yaml `special_entr`)."""

    def fwd(input):
        return torch.special.entr(input), input

    def bwd(aux, d):
        return (-d * (1 + torch.log(aux)),)

    def samples(dtype):
        yield (_t((3, 4), dtype, 0.1, 2.0),), {}
