"""Switch for the few fused PyTorch backward kernels fxad's rules may call.

Where a fused PyTorch backward kernel is the only fast path, a rule calls it (listed with the
reasons in ``docs/fused_kernels.md``): ``native_layer_norm_backward``, ``gelu_backward``, the
CPU flash-attention backward and others.  These kernels have no derivative rules themselves,
so code that will be differentiated again (``fxad.vjp(fxad.grad(f, x), x)``, Hessians) must be
built with them switched off; the rules then write the same formulas as plain torch
expressions.

Three levels:

* ``False`` — plain torch expressions only;
* ``True`` (the default) — fused kernels that replace several ops (a whole normalization or
  activation backward);
* ``"all"`` — also those that replace a short readable expression by one kernel: relu's
  ``d * torch.sign(out)`` becomes ``torch.ops.aten.threshold_backward(d, out, 0)``, and
  cross-entropy's closed form (~11 ops) becomes autograd's ``nll_loss_backward`` and
  ``_log_softmax_backward_data``.  Code
  built for execution rather than reading (the training bridge of :func:`fxad.compile` and
  :func:`fxad.joint_step`) is captured at this level unless the caller chose ``False``.

>>> import fxad
>>> with fxad.fused_kernels(False):
...     pass  # graphs built here use only public torch expressions
"""
from __future__ import annotations

import contextlib
from typing import Iterator

_LEVELS = {False: 0, True: 1, "all": 2}
_STATE = {"level": 1}


def enabled(level: bool | str = True) -> bool:
    """True when rules may call the fused backward kernels of ``level``: ``True`` (the default
    set) or ``"all"`` (also the one-for-two-ops kernels; see the module docstring)."""
    return _STATE["level"] >= _LEVELS[level]


def current() -> bool | str:
    """The current level: ``False``, ``True`` or ``"all"``."""
    return {v: k for k, v in _LEVELS.items()}[_STATE["level"]]


@contextlib.contextmanager
def fused_kernels(enable: bool | str) -> Iterator[None]:
    """Context manager: forbid (``False``), allow the default set of (``True``) or allow all
    (``"all"``) fused backward kernels in rules.

    Raises:
        ValueError: ``enable`` is not ``False``, ``True`` or ``"all"``.
    """
    if not (isinstance(enable, bool) or enable == "all"):
        raise ValueError(f"fused_kernels({enable!r}): use False, True or 'all'")
    old = _STATE["level"]
    _STATE["level"] = _LEVELS[enable]
    try:
        yield
    finally:
        _STATE["level"] = old


@contextlib.contextmanager
def for_execution() -> Iterator[None]:
    """Level ``"all"`` unless fused kernels were switched off (``False``) by the caller: used
    where the generated code is built to run fast rather than to be read."""
    with fused_kernels("all" if enabled() else False):
        yield
