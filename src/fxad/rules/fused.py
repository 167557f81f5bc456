"""Switch for the few fused PyTorch backward kernels fxad's rules may call.

Where a fused PyTorch backward kernel is the only fast path, a rule calls it (listed with the
reasons in ``docs/fused_kernels.md``): ``native_layer_norm_backward``, ``gelu_backward`` and
the CPU flash-attention backward.  These kernels have no derivative rules themselves, so code
that will be differentiated again (``fxad.vjp(fxad.grad(f, x), x)``, Hessians) must be built
with them switched off; the rules then write the same formulas as plain torch expressions.

>>> import fxad
>>> with fxad.fused_kernels(False):
...     pass  # graphs built here use only public torch expressions
"""
from __future__ import annotations

import contextlib
from typing import Iterator

_STATE = {"enabled": True}


def enabled() -> bool:
    """True when rules may call fused backward kernels (the default)."""
    return _STATE["enabled"]


@contextlib.contextmanager
def fused_kernels(enable: bool) -> Iterator[None]:
    """Context manager: allow (True) or forbid (False) fused backward kernels in rules."""
    old = _STATE["enabled"]
    _STATE["enabled"] = bool(enable)
    try:
        yield
    finally:
        _STATE["enabled"] = old
