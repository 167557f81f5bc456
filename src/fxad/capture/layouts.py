"""Memory layouts read as Python values, answered on the example and guarded on the inputs.

``x.is_contiguous()``, ``x.stride()``, ``x.storage_offset()`` of a tensor computed from the
program's inputs: :func:`read_layout` answers as eager PyTorch on the example and guards the
layout of each input the tensor is computed from, once per input and build
(``fxad_expect('layout', (x,), 'contiguous', where)``; see :mod:`fxad.capture.decisions` for
the decisions on tensor values this belongs with).

Functions of the capture session (:class:`fxad.capture.session.Session`), passed as ``cap``.
"""
from __future__ import annotations

import operator
import re
import weakref
from typing import Any, Callable

import torch
import torch.fx as fx
from torch._prims_common import make_contiguous_strides_for
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..errors import DataDependentError, SourceLoc
from ..graph.proxy import user_source_loc
from ..guards import describe_layout
from .decisions import (_concrete, _emit_guard, _outside, _real_args, _real_values, _where,
                        current_policy, has_examples)

__all__ = ["read_layout"]


class _Layouts:
    """Per capture session: the program inputs each node is computed from, and the inputs
    whose layout is guarded already."""

    def __init__(self) -> None:
        self.inputs: dict[fx.Node, frozenset[fx.Node]] = {}
        self.guarded: set[fx.Node] = set()


_LAYOUTS: "weakref.WeakKeyDictionary[Any, _Layouts]" = weakref.WeakKeyDictionary()


def _container_input(n: fx.Node) -> bool:
    """``n`` is a program input holding tensors (a placeholder, or an item of one)."""
    while n.op == "call_function" and n.target is operator.getitem \
            and isinstance(n.args[0], fx.Node) \
            and not isinstance(n.meta.get("val"), torch.Tensor):
        n = n.args[0]
    return n.op == "placeholder"


def _is_input_tensor(n: fx.Node) -> bool:
    """A tensor the caller passes: a placeholder, or an item of a container placeholder."""
    if not isinstance(n.meta.get("val"), torch.Tensor):
        return False
    return n.op == "placeholder" or (n.op == "call_function" and n.target is operator.getitem
                                     and isinstance(n.args[0], fx.Node)
                                     and _container_input(n.args[0]))


def _inputs_of(cap: Any, node: fx.Node) -> frozenset[fx.Node]:
    """The input tensors (:func:`_is_input_tensor`) ``node`` is computed from (memoized per
    session; the graph's node order is topological)."""
    memo = _LAYOUTS.setdefault(cap, _Layouts()).inputs
    if node in memo:
        return memo[node]
    todo: set[fx.Node] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if n in todo or n in memo:
            continue
        todo.add(n)
        if not _is_input_tensor(n):
            stack.extend(n.all_input_nodes)
    for n in cap.graph.nodes:
        if n in todo:
            memo[n] = frozenset({n}) if _is_input_tensor(n) else frozenset().union(
                *(memo[m] for m in n.all_input_nodes))
    return memo[node]


def _fake_layout(t: torch.Tensor) -> Any:
    """:func:`fxad.guards.describe_layout` of a fake input: ``"contiguous"`` when its
    (possibly symbolic) strides are row-major for every size, else the example's numbers."""
    from_shape = make_contiguous_strides_for(t.shape) if t.dim() else ()
    if all(statically_known_true(a == b) for a, b in zip(t.stride(), from_shape)) \
            and statically_known_true(t.storage_offset() == 0):
        return "contiguous"
    return describe_layout(_concrete(tuple(t.shape)), _concrete(tuple(t.stride())),
                           _concrete(t.storage_offset()))


def _outer_tensor(cap: Any, node: fx.Node) -> Any:
    """The tensor of the enclosing capture a control-flow body's input ``node`` stands for
    (operand ``arg{i}`` or lifted ``lifted{k}``), or None."""
    outer = getattr(cap, "outer", None)
    m = re.fullmatch(r"(arg|lifted)(\d+)", node.name) if node.op == "placeholder" else None
    if outer is None or m is None:
        return None
    pool = outer[1] if m.group(1) == "arg" else (cap.lift or [])
    k = int(m.group(2))
    v = pool[k] if k < len(pool) else None
    return v if isinstance(v, torch.Tensor) else None


def _guard_layouts(cap: Any, t: torch.Tensor, loc: SourceLoc | None, name: str) -> bool:
    """Guard lines on the layout of each input ``t`` is computed from (once per input), in
    this capture or, from a control-flow body, in the enclosing one; whether the fake inputs
    are laid out as their examples (else the answer is computed from the real values).

    Raises:
        DataDependentError: ``values="refuse"``, or no example inputs to guard on (a custom
            ``autograd.Function``'s backward), naming the user's line.
    """
    inputs = sorted(_inputs_of(cap, cap.node_of(t)), key=lambda n: n.name)
    if not inputs:
        return True
    if not has_examples(cap):
        outer = [_outer_tensor(cap, n) for n in inputs]
        if getattr(cap, "outer", None) is not None and all(v is not None for v in outer):
            # the body's inputs are laid out as the enclosing capture's tensors (fresh fakes
            # of the same strides): guarded there, on the inputs those are computed from
            same = [_guard_layouts(cap.outer[0], v, loc, name) for v in outer]
            if all(same):
                return True
            why = "its example inputs are not dense here, which a body cannot answer"
        else:
            why = ("inside a custom autograd.Function or another nested region fxad has no "
                   "example inputs")
    elif current_policy() == "refuse":
        why = ("the build asked for values='refuse'; the default, values='guard', takes the "
               "decision on the example's layout and checks it on every call")
    else:
        why = None
    if why is not None:
        raise DataDependentError(
            f"Python code reads the memory layout of a tensor computed from the inputs "
            f"(Tensor.{name}) ({why})", op=f"Tensor.{name}", loc=loc,
            hint="drop the layout test (most code gives the same values on any layout; "
                 "call .contiguous() where a layout is needed), or pass the layout-dependent "
                 "choice as an argument")
    try:
        reals = _real_values(cap, inputs, loc, None, sizes=True)
        taken = [describe_layout(r.shape, r.stride(), r.storage_offset()) for r in reals]
    except DataDependentError:  # inputs without example values: their fake layouts
        taken = [_fake_layout(n.meta["val"]) for n in inputs]
    guarded = _LAYOUTS.setdefault(cap, _Layouts()).guarded
    for n, w in zip(inputs, taken):
        if n not in guarded:
            guarded.add(n)
            _emit_guard(cap, "layout", (n,), w, _where(loc))
    return all(_fake_layout(n.meta["val"]) == w for n, w in zip(inputs, taken))


def read_layout(cap: Any, func: Callable, args: tuple, kwargs: dict) -> Any:
    """A question about ``args[0]``'s memory layout read as a Python value
    (``x.is_contiguous()``, ``x.stride()``, ``x.storage_offset()``): the answer eager PyTorch
    gives on the example, and a guard line on the layout of each input tensor the tensor is
    computed from (once per input and build; :func:`fxad.guards.layout_of`: row-major, or
    the exact strides and storage offset).  With equal input layouts (and the shapes and
    dtypes the input spec checks) every layout answer of the program is the same, so the
    decision is.  A tensor computed from no input (a parameter, a constant, a fresh
    ``torch.zeros``) has the same layout on every call: no guard.  Inside a control-flow
    body the guards go to the enclosing capture, on the inputs the body's operands are
    computed from.  The answer is the fake tensor's where each input's fake has its
    example's layout, else (an input that is not dense, or has a storage offset) the real
    tensor's, computed from the examples.

    Raises:
        DataDependentError: ``values="refuse"``, or inside a region without example inputs
            (a custom ``autograd.Function``), for a tensor computed from the inputs; naming
            the user's line.
    """
    t = args[0]
    if id(t) not in cap.env:  # a parameter or constant the program holds: its own layout
        return _outside(lambda: func(*args, **kwargs)) if not isinstance(t, FakeTensor) \
            else func(*args, **kwargs)
    loc = user_source_loc()
    if _guard_layouts(cap, t, loc, getattr(func, "__name__", "layout")):
        return func(*cap.to_fake_arg(args), **cap.to_fake_arg(kwargs))
    # the fake inputs are laid out otherwise than the examples: answer for real
    (rargs, rkwargs), _ = _real_args(cap, (args, kwargs), loc)
    return _outside(lambda: func(*rargs, **rkwargs))
