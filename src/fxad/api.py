"""Public entry points: :func:`trace`, :func:`vjp`, :func:`grad`, :func:`show`,
:func:`code_with_shapes`.

Argument handling and documentation only: the builds run in :mod:`fxad.pipeline` (on the
engine entry, :mod:`fxad.ad.transform`).  The checker lives in :mod:`fxad.check`; forward
mode and higher derivatives in :mod:`fxad.higher`.
"""
from __future__ import annotations

import re
import sys
from typing import Any, Callable, Iterable, TextIO

import torch
import torch.fx as fx

from . import codegen
from .ad.generated import VJPModule
from .ad.transform import captured
from .guards import ModeWarning
from .pipeline import build_vjp, example_keywords, keyword_call
from .rules.fallback import is_fallback_node

__all__ = ["trace", "vjp", "grad", "show", "code_with_shapes", "VJPModule", "ModeWarning"]


def trace(f: Callable | torch.nn.Module, *example_inputs: Any,
          leaf_modules: Iterable[type] = (), example_kwargs: dict[str, Any] | None = None,
          **kwargs: Any) -> fx.GraphModule:
    """Capture ``f`` on ``example_inputs`` as a normalized torch-level ``GraphModule``.

    Args:
        f: function of tensors, or an ``nn.Module`` (its parameters and buffers become
            ``get_attr`` nodes).
        example_inputs: positional inputs; only their shapes/dtypes/devices are used (no real
            computation runs during capture).
        leaf_modules: module classes kept as ``call_module`` nodes (they need a rule, see
            :func:`fxad.register_vjp`).
        kwargs, example_kwargs: keyword arguments of ``f``, as in :func:`vjp`: placeholders
            after the positional ones, named by their keyword.

    Returns:
        GraphModule; every node has ``meta['val']`` (a fake tensor with shape and dtype) and,
        where known, ``meta['fxad_loc']`` (the user's file and line).

    Raises:
        fxad.errors.CaptureError: untraceable Python (data-dependent control flow, ``.item()``,
            a shape error on the example inputs), with the source line and a fix.
        fxad.errors.InplaceError: an in-place op that cannot be rewritten safely.
    """
    callee, inputs, _ = keyword_call(f, example_inputs,
                                     example_keywords(example_kwargs, kwargs))
    return captured(callee, inputs, leaf_modules)


def vjp(f: Callable | torch.nn.Module, *example_inputs: Any, leaf_modules: Iterable[type] = (),
        argnums: int | Iterable[int] | None = None, simplify: bool = True,
        dynamic: bool | None = None, dynamic_shapes: Any = None, has_aux: bool = False,
        values: str = "guard", example_kwargs: dict[str, Any] | None = None,
        **kwargs: Any) -> fx.GraphModule:
    """Source-to-source vector-Jacobian product of ``f`` at shapes of ``example_inputs``.

    Returns:
        GraphModule ``g``.  For a function, ``g(*inputs, cotangent)`` returns
        ``(output, input_grads)``, where ``input_grads`` has one entry per positional input
        (``None`` for non-floating inputs) and ``cotangent`` has the output's shape/dtype
        (one cotangent per floating output tensor, in output order, for multi-output
        functions).  For an ``nn.Module``, ``g(*inputs, cotangent)`` returns ``(output,
        input_grads, param_grads)``, ``param_grads`` keyed like ``module.named_parameters()``
        (frozen parameters left out).  Parameters are read from the live module, so optimizer
        updates are seen by later calls.  With keyword example inputs, ``g(*inputs,
        cotangent, **kwargs)`` takes the same keywords; with ``has_aux=True``, ``aux`` comes
        last: ``(output, input_grads[, param_grads], aux)``.

    Args:
        argnums: positions of the positional inputs to differentiate (default: all floating
            positional inputs); the others get ``None`` and no code is generated for them
            (``argnums=()`` for a module: parameter gradients only, as in a training step).
        kwargs: keyword arguments of ``f`` (``fxad.vjp(f, x, mask=m, scale=2.0)``).  Tensors
            are inputs of the generated code (placeholders named by their keyword, after the
            positional ones, shapes and dtypes guarded) but are not differentiated, as in
            ``torch.func.grad``, whose ``argnums`` index positional arguments only: pass a
            tensor positionally to get its gradient.  Python values (numbers, bools, strings,
            ``None``) are specialized: the code is built for the example value and a call
            with another value raises :class:`~fxad.errors.InputError` naming the argument.
        example_kwargs: the same as a dict, for keywords that are also names of this
            function's options (``example_kwargs={"dynamic": True}``).
        has_aux: ``f`` returns ``(output, aux)`` (as in ``torch.func.vjp``): only ``output``
            is differentiated and takes a cotangent; ``aux`` (any pytree of tensors and Python
            values) is returned last, its tensors detached.
        dynamic: ``True``: build once on symbolic sizes, every dimension of every tensor
            input allowed to vary (dimensions the program fixes stay static, sizes it ties
            become one), like ``torch.export.Dim.AUTO``; the code reads its sizes from the
            inputs (``T = idx.size(1)``).  See :mod:`fxad.symbolic`.  Without it (the
            default), the module checks on every call that the inputs have the traced
            shapes, dtypes, devices and Python values (:mod:`fxad.guards`).
        dynamic_shapes: the dimensions that vary, in :func:`torch.export.export`'s format:
            ``{"idx": {0: Dim("B"), 1: Dim("T", max=64)}, "tgt": {0: Dim("B"), 1:
            Dim("T")}}`` (the same name: one size).  A named dimension the program fixes is
            an :class:`~fxad.errors.InputError` naming the line.
        values: how a Python decision on a tensor's value is captured: ``"guard"``
            (default), ``"guard+sizes"``, ``"guard+unbacked"`` or ``"refuse"``
            (:mod:`fxad.capture.decisions`).

    Raises:
        fxad.errors.MissingRuleError: an op on the differentiation path has no rule (the error
            names the op, the user's line and how to register one).
        fxad.errors.CaptureError: see :func:`trace`.
        fxad.errors.InputError: ``f`` takes no such keyword; ``has_aux=True`` and ``f`` does
            not return a pair; when called: inputs unlike the traced ones (shape, dtype,
            device, Python value), naming the argument, or a missing/unknown keyword.
    """
    return build_vjp(f, example_inputs, leaf_modules=leaf_modules, simplify=simplify,
                     seed_ones=False, argnums=argnums, dynamic=dynamic,
                     dynamic_shapes=dynamic_shapes, has_aux=has_aux, values=values,
                     kwargs=example_keywords(example_kwargs, kwargs))


def grad(f: Callable | torch.nn.Module, *example_inputs: Any, leaf_modules: Iterable[type] = (),
         argnums: int | Iterable[int] | None = None, simplify: bool = True,
         dynamic: bool | None = None, dynamic_shapes: Any = None, has_aux: bool = False,
         values: str = "guard", example_kwargs: dict[str, Any] | None = None,
         **kwargs: Any) -> fx.GraphModule:
    """Gradient of a scalar-valued ``f``: ``g(*inputs, **kwargs)`` returns ``(value,
    input_grads)`` or, for an ``nn.Module``, ``(value, input_grads, param_grads)``; with
    ``has_aux=True`` (``f`` returns ``(loss, aux)``, as in ``torch.func.grad``) ``aux`` comes
    last: ``(value, input_grads[, param_grads], aux)``.  Keyword arguments, ``argnums``,
    ``dynamic``, ``dynamic_shapes`` and ``values`` as in :func:`vjp` (keyword tensors are
    inputs, not differentiated).

    Raises:
        fxad.errors.InputError: the output is not a single floating-point scalar; when called,
            inputs unlike the traced ones.
    """
    return build_vjp(f, example_inputs, leaf_modules=leaf_modules, simplify=simplify,
                     seed_ones=True, argnums=argnums, dynamic=dynamic,
                     dynamic_shapes=dynamic_shapes, has_aux=has_aux, values=values,
                     kwargs=example_keywords(example_kwargs, kwargs))


_DELETION = re.compile(r";  (\w+ = )+None")


def _show_note(node: fx.Node) -> str:
    """A line's note in :func:`code_with_shapes`: its shape and dtype, and
    ``# autograd fallback`` on the calls of the autograd fallback."""
    note = codegen.shape_note(node)
    if is_fallback_node(node):
        return f"{note}  # autograd fallback" if note else "autograd fallback"
    return note


def code_with_shapes(gm: fx.GraphModule) -> str:
    """``gm.code`` with each statement annotated by its shape and dtype (``# f32[64,128]``)
    and without FX's ``x = None`` memory-release statements; a derivative computed by the
    autograd fallback (:mod:`fxad.rules.fallback`) ends with ``# autograd fallback``."""
    graph = gm.graph
    old = graph._codegen._body_transformer
    try:
        codegen.install(graph, annotate=_show_note)
        src = graph.python_code("self").src
    finally:
        graph._codegen._body_transformer = old
    return _DELETION.sub("", src).strip("\n") + "\n"


def show(gm: fx.GraphModule, *, file: TextIO | None = None, color: bool | None = None) -> str:
    """Print ``gm``'s code annotated with shapes and dtypes; returns the plain text.  Lines
    that call the autograd fallback end with ``# autograd fallback``.

    Uses ``rich`` syntax highlighting when writing to a terminal.
    """
    text = code_with_shapes(gm)
    stream = file or sys.stdout
    use_color = color if color is not None else (file is None and stream.isatty())
    if use_color:
        try:
            from rich.console import Console
            from rich.syntax import Syntax

            Console(file=stream).print(Syntax(text, "python", theme="ansi_dark"))
            return text
        except ImportError:  # pragma: no cover
            pass
    stream.write(text)
    return text
