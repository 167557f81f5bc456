"""Dtype-cast methods that keep their method spelling in the canonical graph
(``x.double(memory_format=...)``, ``x.cfloat()``).

A cast is the identity on values: the cotangent is passed through and the engine casts it
back to the input dtype (derivatives.yaml ``_to_copy``: ``_to_copy_backward``); for a cast to a
complex dtype the real part is taken.
"""
from __future__ import annotations

import torch

from ._base import builtin, uniform


def _make_cast(method: str, complex_out: bool) -> None:
    class Cast:
        __doc__ = (f"``x.{method}()``: a dtype cast; d_x = d"
                   + (".real (for a real x)" if complex_out else "")
                   + " cast back to x's dtype (derivatives.yaml ``_to_copy``).")

        def fwd(self, memory_format=torch.preserve_format):
            out = getattr(self, method)(memory_format=memory_format) \
                if memory_format is not torch.preserve_format else getattr(self, method)()
            return out, self.dtype.is_complex

        def bwd(input_is_complex, d):
            # a complex cotangent of a real input: its real part (a complex input keeps it)
            return (torch.real(d) if complex_out and not input_is_complex else d),

        def samples(dtype):
            if method in ("float", "half", "bfloat16", "chalf", "cfloat"):
                return  # single/low precision (finite differences fail): the OpInfo sweep
            yield (uniform((3, 4), -2.0, 2.0, dtype),), {}

    builtin(getattr(torch.Tensor, method))(Cast)


for _m in ("float", "double", "half", "bfloat16"):
    _make_cast(_m, False)
for _m in ("cfloat", "cdouble", "chalf"):
    _make_cast(_m, True)
