"""Rules for ops whose input is complex and output real: ``torch.imag`` and
``torch.view_as_real`` (``torch.real``, ``torch.view_as_complex``, ``torch.complex`` and
``torch.polar`` live with the other shape and FFT rules).

With PyTorch's convention (the cotangent of a complex ``z`` is ``d_re + 1j * d_im`` for the
real and imaginary parts' cotangents), ``imag(z)`` gives ``d_z = 1j * d`` (derivatives.yaml
`imag`: ``at::imag(grad)`` transposed) and ``view_as_real(z)`` gives
``d_z = view_as_complex(d)`` (derivatives.yaml `view_as_real`).  Both are R-linear, so their
JVP is the op applied to the tangent.  They have no real-valued sample inputs; their checks
are the OpInfo sweep's complex samples and ``tests/test_complex.py``.
"""
from __future__ import annotations

import torch

from ._base import builtin


@builtin(torch.imag)
class Imag:
    """imag(z): d_z = complex(0, d) (derivatives.yaml `imag`)."""

    def fwd(input):
        return torch.imag(input), None

    def bwd(aux, d):
        return (torch.complex(torch.zeros_like(d), d),)

    def jvp(primals, tangents):
        (z,), (t,) = primals, tangents
        return torch.imag(z), (None if t is None else torch.imag(t))


@builtin(torch.view_as_real)
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
