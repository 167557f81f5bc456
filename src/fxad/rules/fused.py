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
  At this level a formula written out in the program that one PyTorch kernel computes is
  also replaced by that kernel before differentiation (:func:`fuse_formulas`).

>>> import fxad
>>> with fxad.fused_kernels(False):
...     pass  # graphs built here use only public torch expressions
"""
from __future__ import annotations

import contextlib
import math
import operator
from typing import Any, Iterator

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..graph.proxy import is_dtype_cast, substitute, widens

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


# --- written-out formulas one kernel computes (level "all") ------------------------------------

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def _close(c: Any, want: float) -> bool:
    return isinstance(c, (int, float)) and not isinstance(c, bool) \
        and abs(c - want) <= 1e-6 * abs(want)


def _by_const(node: Any, op: Any, want: float) -> fx.Node | None:
    """``a`` where ``node`` is ``op(a, c)`` or ``op(c, a)`` (``op`` commutative) with the
    constant ``c`` equal to ``want`` (to 1e-6 relative); else None."""
    if not (isinstance(node, fx.Node) and node.op == "call_function" and node.target is op
            and len(node.args) == 2 and not node.kwargs):
        return None
    a, b = node.args
    if isinstance(a, fx.Node) and _close(b, want):
        return a
    if isinstance(b, fx.Node) and _close(a, want) and op is not operator.pow:
        return b
    return None


def _other(node: fx.Node, op: Any, one: fx.Node) -> fx.Node | None:
    """``b`` where ``node`` is ``op(one, b)`` or ``op(b, one)``."""
    if not (node.op == "call_function" and node.target is op and len(node.args) == 2
            and not node.kwargs):
        return None
    a, b = node.args
    if a is one and isinstance(b, fx.Node):
        return b
    if b is one and isinstance(a, fx.Node):
        return a
    return None


def _gelu_tanh(t: fx.Node) -> tuple[fx.Node, fx.Node, list[fx.Node]] | None:
    """For ``t = torch.tanh(u)``: ``(x, out, nodes)`` where ``out`` is
    ``(0.5 * x) * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x ** 3)))`` (operands of each
    commutative op in either order; the cube may be of ``x`` cast up, :func:`_upcast`, and
    ``x`` is then that cast) and ``nodes`` the formula's nodes; else None."""
    inner = _by_const(t.args[0] if t.args else None, operator.mul, _SQRT_2_OVER_PI)
    if inner is None or inner.op != "call_function" or inner.target is not operator.add:
        return None
    for x, cube_term in (inner.args, inner.args[::-1]):
        cube = _by_const(cube_term, operator.mul, 0.044715)
        base = _by_const(cube, operator.pow, 3.0)
        if isinstance(x, fx.Node) and base is not None and (base is x or _upcast(base, x)):
            break
    else:
        return None
    val = x.meta.get("val")
    if not (isinstance(val, torch.Tensor) and val.is_floating_point()):
        return None
    for one_plus in t.users:
        if _by_const(one_plus, operator.add, 1.0) is not t:
            continue
        for out in one_plus.users:
            half = _other(out, operator.mul, one_plus)
            if half is None or _by_const(half, operator.mul, 0.5) is not x:
                continue
            nodes = [out, one_plus, t, t.args[0], inner, cube_term, cube, half]
            want = out.meta.get("val")
            if base is x:
                return x, out, nodes
            if isinstance(want, torch.Tensor) and want.dtype == base.meta["val"].dtype:
                return base, out, nodes  # the formula's dtype: that of the upcast x
    return None


def _upcast(node: fx.Node, x: fx.Node) -> bool:
    """``node`` is ``x.to(dtype)`` casting a floating ``x`` to a wider floating dtype (the
    capture writes ``x.float()`` and ``x.double()`` so too): where CUDA autocast runs ``pow``
    in float32 on a half-precision ``x`` (casts made explicit by ``materialize_autocast``),
    the whole formula computes in float32 by type promotion."""
    return is_dtype_cast(node) and node.args[0] is x and widens(node)


def fuse_formulas(gm: fx.GraphModule) -> int:
    """Replace, in a captured graph, formulas written out op by op that one PyTorch kernel
    computes, by that kernel (code built to run: fused level ``"all"``); returns the number
    of rewrites.  The values agree to rounding (the kernel evaluates the same expression
    in one pass); the derivative is then the kernel's rule.

    * The tanh approximation of GELU as transformers' ``NewGELUActivation`` writes it
      (GPT-2's ``gelu_new``), ``0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3)))``,
      becomes ``F.gelu(x, approximate="tanh")``: one pass forward instead of eight and
      ``gelu_backward`` instead of about ten passes (on GPT-2's MLP activations,
      4 x 128 x 1024 float32, 4.4 ms instead of 10.7 ms forward + backward on one thread).
      Where the cube is taken of ``x`` cast up (CUDA autocast runs ``pow`` in float32 on a
      bfloat16 ``x``, and type promotion carries the rest of the formula to float32), the
      kernel runs on that cast ``x``, in the formula's dtype.
      Intermediate values the program reads elsewhere stay computed.
    """
    g = gm.graph
    done = 0
    for t in list(g.nodes):
        if t.op != "call_function" or t.target is not torch.tanh or getattr(t, "_erased", 0):
            continue
        found = _gelu_tanh(t)
        if found is None:
            continue
        x, out, nodes = found
        # the formula's nodes nothing else reads, outputs first
        if substitute(gm, out, F.gelu, (x,), {"approximate": "tanh"}, nodes):
            done += 1
    if done:
        g.lint()
        gm.recompile()
    return done
