"""Rules for ops that build, take apart or conjugate complex tensors: ``real``, ``imag``,
``view_as_real``, ``view_as_complex``, ``complex``, ``polar``, ``angle``, ``conj``,
``conj_physical``, ``resolve_conj``, ``resolve_neg``.

With PyTorch's convention (the cotangent of a complex ``z`` is ``d_re + 1j * d_im`` for the
real and imaginary parts' cotangents):

* ``imag(z)`` gives ``d_z = 1j * d`` (derivatives.yaml `imag`: ``at::imag(grad)``
  transposed) and ``view_as_real(z)`` gives ``d_z = view_as_complex(d)`` (derivatives.yaml
  `view_as_real`).  Both are R-linear, so their JVP is the op applied to the tangent.  They
  have no real-valued sample inputs; their checks are the OpInfo sweep's complex samples and
  ``tests/test_complex.py``.
* ``complex(re, im)``: d_re = Re(d), d_im = Im(d) (derivatives.yaml ``complex``).
  ``view_as_complex(x)``: d_x = stack(Re(d), Im(d), -1) (derivatives.yaml
  ``view_as_complex``: ``at::view_as_real``).  ``polar(r, t) = r e^{i t}``: with
  ``d = a + i b``, d_r = a cos t + b sin t and d_t = r (b cos t - a sin t) (derivatives.yaml
  ``polar``: polar_backward, written out with cos/sin).

Which rules are verified for complex inputs in general is recorded in
:mod:`fxad.rules.complex`.
"""
from __future__ import annotations

from typing import Any

import torch

from ._base import randn
from .registry import register_vjp


@register_vjp(torch.angle)
class Angle:
    """angle(x) for real x is 0 or pi: zero derivative (derivatives.yaml `angle`:
    angle_backward)."""

    def fwd(input):
        return torch.angle(input), input

    def bwd(aux, d):
        return (torch.zeros_like(aux) * d,)

    def samples(dtype):
        yield (randn(3, 4, dtype=dtype),), {}


# --- conjugation ----------------------------------------------------------------------------

def _conj_like(op: Any, back: Any, name: str, formula: str) -> type:
    class ConjLike:
        source = f"{name}: d_x = {formula} (derivatives.yaml `{name}`)"

        def fwd(input):
            return op(input), None

        def bwd(aux, d):
            return (back(d),)

        def samples(dtype):
            yield (randn(3, 4, dtype=dtype),), {}

    return ConjLike


register_vjp(torch.conj)(_conj_like(torch.conj, torch.conj, "conj", "conj(d)"))
register_vjp(torch.conj_physical)(_conj_like(torch.conj_physical, torch.conj_physical,
                                             "conj_physical", "conj_physical(d)"))
register_vjp(torch.resolve_conj)(_conj_like(torch.resolve_conj, lambda d: d, "resolve_conj", "d"))
register_vjp(torch.resolve_neg)(_conj_like(torch.resolve_neg, lambda d: d, "resolve_neg", "d"))
register_vjp(torch.real)(_conj_like(torch.real, lambda d: d, "real",
                                    "d (real part; the engine casts to x's dtype)"))


# ---------------------------------------------------------------------------------------------
# building complex tensors
# ---------------------------------------------------------------------------------------------

def _pairs(dtype: torch.dtype):
    yield (randn(5, dtype=dtype), randn(5, dtype=dtype)), {}
    yield (randn(dtype=dtype), randn(dtype=dtype)), {}
    yield (randn(5, 1, dtype=dtype), randn(5, dtype=dtype)), {}
    yield (randn(2, 3, 4, dtype=dtype), randn(dtype=dtype)), {}


@register_vjp(torch.complex)
class Complex:
    """complex(re, im) = re + i im: d_re = Re(d), d_im = Im(d) (derivatives.yaml `complex`)."""

    def fwd(real, imag):
        return torch.complex(real, imag), None

    def bwd(aux, d):
        return torch.real(d), torch.imag(d)

    def jvp(primals, tangents):
        re, im = primals
        t_re, t_im = tangents
        out = torch.complex(re, im)
        if t_re is None and t_im is None:
            return out, None
        if t_re is None:
            t_re = torch.zeros_like(t_im)
        if t_im is None:
            t_im = torch.zeros_like(t_re)
        return out, torch.complex(t_re, t_im)

    def samples(dtype):
        yield from _pairs(dtype)


@register_vjp(torch.view_as_complex)
class ViewAsComplex:
    """view_as_complex(x) (x[..., 0] + i x[..., 1]): d_x = stack([Re(d), Im(d)], -1)
    (derivatives.yaml `view_as_complex`: view_as_real of the cotangent, spelled with
    real/imag so that it also takes conjugated views)."""

    def fwd(input):
        return torch.view_as_complex(input), None

    def bwd(aux, d):
        return (torch.stack([torch.real(d), torch.imag(d)], -1),)

    def jvp(primals, tangents):
        (x,), (t,) = primals, tangents
        out = torch.view_as_complex(x)
        if t is None:
            return out, None
        return out, torch.complex(torch.select(t, -1, 0), torch.select(t, -1, 1))

    def samples(dtype):
        yield (randn(5, 2, dtype=dtype),), {}
        yield (randn(2, 3, 2, dtype=dtype),), {}
        yield (randn(2, dtype=dtype),), {}


@register_vjp(torch.polar)
class Polar:
    """polar(r, t) = r (cos t + i sin t).  With d = a + i b: d_t = r (b cos t - a sin t)
    = Re(conj(d) i out), and d_r = Re(conj(d) sgn(out)) = sign(r) (a cos t + b sin t)
    (derivatives.yaml `polar`: polar_backward).  On polar's domain r > 0 this is the
    derivative; at r <= 0 (outside it, like std::polar) the sign(r) factor reproduces
    PyTorch's convention (0 at r = 0), and the JVP is its transpose."""

    def fwd(abs, angle):
        return torch.polar(abs, angle), (abs, angle)

    def bwd(aux, d):
        r, t = aux
        a, b = torch.real(d), torch.imag(d)
        c, s = torch.cos(t), torch.sin(t)
        return torch.sign(r) * (a * c + b * s), r * (b * c - a * s)

    def jvp(primals, tangents):
        r, t = primals
        t_r, t_t = tangents
        out = torch.polar(r, t)
        if t_r is None and t_t is None:
            return out, None
        c, s = torch.cos(t), torch.sin(t)
        # d out = sign(r) t_r e^{it} + i r t_t e^{it}
        re, im = 0, 0
        if t_r is not None:
            sr = torch.sign(r) * t_r
            re, im = sr * c, sr * s
        if t_t is not None:
            rt = r * t_t
            re, im = re - rt * s, im + rt * c
        return out, torch.complex(re, im)

    def samples(dtype):
        r = lambda *sh: torch.rand(sh, dtype=dtype) + 0.1
        yield (r(5), randn(5, dtype=dtype)), {}
        yield (r(), randn(dtype=dtype)), {}
        yield (r(5, 1), randn(5, dtype=dtype)), {}
        yield (r(2, 3, 4), randn(dtype=dtype)), {}
        yield (r(4), randn(3, 1, dtype=dtype)), {}


@register_vjp(torch.imag)
class Imag:
    """imag(z): d_z = complex(0, d) (derivatives.yaml `imag`)."""

    def fwd(input):
        return torch.imag(input), None

    def bwd(aux, d):
        return (torch.complex(torch.zeros_like(d), d),)

    def jvp(primals, tangents):
        (z,), (t,) = primals, tangents
        return torch.imag(z), (None if t is None else torch.imag(t))


@register_vjp(torch.view_as_real)
class ViewAsReal:
    """view_as_real(z) (..., 2): d_z = view_as_complex(d) (derivatives.yaml
    `view_as_real`)."""

    def fwd(input):
        return torch.view_as_real(input), None

    def bwd(aux, d):
        return (torch.view_as_complex(d.contiguous()),)

    def jvp(primals, tangents):
        (z,), (t,) = primals, tangents
        return torch.view_as_real(z), (None if t is None else torch.view_as_real(t))
