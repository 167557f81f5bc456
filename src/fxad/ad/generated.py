"""The classes of the modules fxad generates: :class:`VJPModule` (reverse mode: :func:`fxad.vjp`,
:func:`fxad.grad`, the VJPs of control-flow bodies) and :class:`JVPModule` (forward mode:
:func:`fxad.jvp`, :func:`fxad.hvp`, the JVPs of control-flow bodies).

Both are ``fx.GraphModule``\\ s whose calls check their arguments against what the trace
specialized on (``meta['fxad_input_spec']``, :mod:`fxad.guards`) and run under
``torch.no_grad()``: the generated code already computes the derivatives.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from ..capture.outputs import OUTPUT_SPEC, restore_output
from ..capture.tracer import capturing
from ..errors import InputError
from .forward import TANGENT_PREFIX

__all__ = ["VJPModule", "JVPModule", "keyword_arguments", "keyword_values"]


class VJPModule(fx.GraphModule):
    """GraphModule returned by :func:`fxad.vjp` and :func:`fxad.grad`.

    Calls run under ``torch.no_grad()`` by default: the generated code already computes the
    derivatives, so recording an autograd graph (parameters have ``requires_grad=True``)
    would only cost time and memory.  Set ``gm.record_autograd = True`` to differentiate
    the generated code with ``torch.autograd``.
    """

    record_autograd: bool = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        spec = self.meta.get("fxad_input_spec")
        args = keyword_arguments(self, args, kwargs, spec.names if spec is not None else None)
        if spec is not None:
            spec.check(args)  # what the trace specialized on (fxad.guards)
        if capturing():  # captured by fxad again: keep grad mode
            return super().__call__(*args)
        if self.record_autograd:
            return self._containers(super().__call__(*args))
        with torch.no_grad():
            return self._containers(super().__call__(*args))

    def _containers(self, result: Any) -> Any:
        """``(output, grads, ...[, aux])`` with the output (and ``aux``) in the program's own
        containers (a ``ModelOutput``, a namedtuple: :mod:`fxad.capture.outputs`)."""
        spec = self.meta.get(OUTPUT_SPEC)
        if spec is None or not isinstance(result, tuple) or not result:
            return result
        out = list(result)
        if self.meta.get("fxad_has_aux"):
            if spec.num_children != 2 or len(out) < 3:
                return result
            out[0] = restore_output(out[0], spec.child(0))
            out[-1] = restore_output(out[-1], spec.child(1))
        else:
            out[0] = restore_output(out[0], spec)
        return tuple(out)


def keyword_arguments(gm: fx.GraphModule, args: tuple, kwargs: dict,
                      names: list[str] | None, tail: int = 0, full: int | None = None) -> tuple:
    """The arguments of a call of a generated module in the order of its placeholders.

    A module built with keyword example inputs (``meta['fxad_keywords']``: ``(n_positional,
    keywords)``) takes them as keywords after its positional arguments: ``g(x, cotangent,
    mask=m)`` runs the code ``forward(x, mask, cotangent)``; ``tail`` more ``None``
    arguments follow the others (a JVP's tangents of the keyword inputs).  Called with all
    its arguments positionally, in the code's order (``full`` of them; default
    ``len(names)``), it takes them as they are.  Other modules bind keywords by name.

    Raises:
        InputError: a keyword missing, unknown or given twice.
    """
    spec = gm.meta.get("fxad_keywords")
    if spec is None:
        if not kwargs:
            return args
        if names is None:
            names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        bound = list(args) + [_MISSING] * (len(names) - len(args))
        for k, v in kwargs.items():
            if k not in names:
                raise InputError(f"this module takes no argument `{k}` (its arguments: "
                                 f"{', '.join(names)})")
            i = names.index(k)
            if bound[i] is not _MISSING:
                raise InputError(f"argument `{k}` given twice")
            bound[i] = v
        missing = [names[i] for i, v in enumerate(bound) if v is _MISSING]
        if missing:
            raise InputError(f"missing argument(s) {', '.join(missing)}")
        return tuple(bound)
    n_pos, keywords = spec
    if full is None:
        full = len(names) if names is not None else -1
    if not kwargs and len(args) == full:
        return args  # the code's own order
    return args[:n_pos] + keyword_values(kwargs, keywords) + args[n_pos:] + (None,) * tail


def keyword_values(kwargs: dict, keywords: tuple[str, ...], what: str = "this module"
                   ) -> tuple:
    """The values of ``kwargs`` in the order of ``keywords`` (those a build took).

    Raises:
        InputError: a keyword missing or unknown.
    """
    if tuple(kwargs) == keywords:
        return tuple(kwargs.values())
    unknown = sorted(set(kwargs) - set(keywords))
    missing = [k for k in keywords if k not in kwargs]
    if unknown or missing:
        raise InputError(
            f"{what} was built with the keyword argument(s) "
            f"{', '.join(keywords) or '(none)'}"
            + (f"; missing: {', '.join(missing)}" if missing else "")
            + (f"; unknown: {', '.join(unknown)}" if unknown else ""),
            hint="call it with the keyword arguments it was built with, as f is called "
                 "(a different set of keywords needs a new build)")
    return tuple(kwargs[k] for k in keywords)


_MISSING = object()


class JVPModule(fx.GraphModule):
    """GraphModule returned by :func:`fxad.jvp` and :func:`fxad.hvp`: ``gm(*primals, *tangents)``.

    Before running, a call checks its arguments (raising :class:`fxad.InputError`, before any
    computation): ``n`` primals then ``n`` tangents; each tangent a pytree like its primal
    with the primal's shapes and dtypes; ``None`` for inputs that are not differentiated
    (integer tensors, inputs outside ``argnums``).  ``None`` for a differentiated input, or
    for a floating leaf of one, means a zero tangent.

    Calls run under ``torch.no_grad()`` unless ``gm.record_autograd = True`` (as
    :class:`fxad.VJPModule`).
    """

    record_autograd: bool = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        kw = self.meta.get("fxad_keywords")
        if kwargs and kw is None:
            raise InputError("fxad JVP modules take positional arguments only: "
                             "gm(*primals, *tangents)")
        if kw is not None:  # built with keyword inputs: gm(*primals, *tangents, **kwargs)
            names = [s[0] for s in self.meta.get("fxad_jvp_inputs", [])]
            args = keyword_arguments(self, args, kwargs, names, tail=len(kw[1]),
                                     full=2 * len(names))
        args = self._check_arguments(args)
        spec = self.meta.get("fxad_input_spec")
        if spec is not None:  # what the trace specialized on (fxad.guards)
            spec.check(args[:len(spec.names)])
        if capturing():  # captured by fxad again: the code's own containers
            return super().__call__(*args)
        if self.record_autograd:
            return self._containers(super().__call__(*args))
        with torch.no_grad():
            return self._containers(super().__call__(*args))

    def _containers(self, result: Any) -> Any:
        """``(output, output_tangent)`` with both in the program's own containers (a
        ``ModelOutput``, a namedtuple: :mod:`fxad.capture.outputs`)."""
        spec = self.meta.get(OUTPUT_SPEC)
        if spec is None or not isinstance(result, tuple) or len(result) != 2:
            return result
        return restore_output(result[0], spec), restore_output(result[1], spec)

    def _check_arguments(self, args: tuple) -> tuple:
        specs = self.meta.get("fxad_jvp_inputs")
        if specs is None:  # pragma: no cover - not built by fxad
            return args
        n = len(specs)
        if len(args) != 2 * n:
            names = ", ".join(s[0] for s in specs)
            raise InputError(
                f"this JVP module takes {n} primal(s) ({names}) followed by {n} tangent(s) "
                f"({', '.join(TANGENT_PREFIX + s[0] for s in specs)}); got {len(args)} "
                "arguments")
        primals, tangents = list(args[:n]), list(args[n:])
        for i, (name, captured, differentiated) in enumerate(specs):
            tangents[i] = _check_tangent(name, primals[i], tangents[i], captured, differentiated)
        return tuple(primals) + tuple(tangents)


def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"shape {tuple(x.shape)} and dtype {x.dtype}"
    return type(x).__name__


def _check_tangent(name: str, primal: Any, tangent: Any, captured: Any,
                   differentiated: bool) -> Any:
    tname = TANGENT_PREFIX + name
    if not differentiated:
        if tangent is not None and any(isinstance(v, torch.Tensor)
                                       for v in pytree.tree_leaves(tangent)):
            why = "it is not a floating-point input" if not _has_float(captured) else \
                "it is not in argnums"
            raise InputError(f"tangent `{tname}` must be None: input `{name}` is not "
                             f"differentiated ({why})")
        return None
    p_leaves, p_spec = pytree.tree_flatten(primal)
    c_leaves, c_spec = pytree.tree_flatten(captured)
    if p_spec != c_spec:
        raise InputError(f"input `{name}` does not have the structure it was captured with "
                         f"({c_spec} expected)")
    if tangent is None:
        t_leaves: list[Any] = [None] * len(p_leaves)
    else:
        t_leaves, t_spec = pytree.tree_flatten(tangent, is_leaf=lambda x: x is None)
        if t_spec != p_spec:
            raise InputError(f"tangent `{tname}` must have the structure of input `{name}` "
                             f"({p_spec}); got {t_spec}")
    out = []
    for k, (p, c, t) in enumerate(zip(p_leaves, c_leaves, t_leaves)):
        where = f"`{tname}`" + (f" (leaf {k})" if len(p_leaves) > 1 else "")
        if isinstance(c, torch.Tensor):
            # (the exact shape is the guard's to check: a dimension may be dynamic)
            if not isinstance(p, torch.Tensor) or p.dim() != c.dim() or p.dtype != c.dtype:
                raise InputError(
                    f"input `{name}`" + (f" (leaf {k})" if len(p_leaves) > 1 else "")
                    + f" has {_describe(p)}, but the JVP was generated for {_describe(c)}; "
                    "generate it again for these shapes")
        if not (isinstance(c, torch.Tensor) and (c.is_floating_point() or c.is_complex())):
            if t is not None:
                raise InputError(f"tangent {where} must be None: that leaf of `{name}` is not "
                                 "a floating-point tensor")
            out.append(None)
            continue
        if t is None:
            out.append(torch.zeros_like(p))
            continue
        if not isinstance(t, torch.Tensor):
            raise InputError(f"tangent {where} must be a tensor or None, got {type(t).__name__}")
        if tuple(t.shape) != tuple(p.shape) or t.dtype != p.dtype:
            raise InputError(f"tangent {where} has {_describe(t)}, but input `{name}` has "
                             f"{_describe(p)}; a tangent must match its primal's shape and "
                             "dtype")
        out.append(t)
    return pytree.tree_unflatten(out, p_spec)


def _has_float(v: Any) -> bool:
    return any(isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex())
               for x in pytree.tree_leaves(v))
