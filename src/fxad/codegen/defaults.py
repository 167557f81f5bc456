"""Arguments equal to the op's default are left out of the generated code.

``torch.nn.functional.embedding`` receives every argument of its Python signature when it is
captured (``padding_idx=None, max_norm=None, norm_type=2.0, ...``); the code prints the call
as a person writes it, ``torch.nn.functional.embedding(idx, weight)``.  Only the printing
changes: the graph keeps the arguments, and the printed call means the same call.

Where the defaults come from:

* a Python function (``torch.nn.functional.cross_entropy``, ``torch.split``): its one
  signature (:func:`inspect.signature`, not following ``__wrapped__``);
* a torch builtin, a tensor method or an ATen operator packet: the operator's schemas
  (``torch._C._jit_get_schemas_for_operator``).  An op with overloads is trimmed only where
  exactly one of its schemas can take the call before and after the argument is dropped (the
  test over-approximates which schemas can take a call, so "one" is certain): an argument
  whose default differs between overloads, or whose absence could select another overload,
  is kept;
* an ``OpOverload``: its schema.

An argument is dropped only when its value is a plain constant (None, bool, int, float, str,
a dtype, device, layout or memory format, or a sequence of those) equal to the default and of
the same type (``2`` is not dropped for a default of ``2.0``; ``-0.0`` not for ``0.0``).
Keyword arguments are dropped; positional ones from the end; a positional default followed by
other arguments is dropped and the arguments after it passed by keyword, where their names
are certain (a Python function, an operator overload or packet).
"""
from __future__ import annotations

import functools
import inspect
import math
import types
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

_NO = object()  # no default


@dataclass(frozen=True)
class _Param:
    name: str
    positional: bool   # may be passed by position
    keyword: bool      # may be passed by keyword
    default: Any       # _NO: required


@dataclass(frozen=True)
class _Signature:
    params: tuple[_Param, ...]
    varargs: bool = False  # positional arguments after ``*args`` cannot be mapped


def _from_python(fn: Any) -> _Signature | None:
    try:
        sig = inspect.signature(fn, follow_wrapped=False)
    except (TypeError, ValueError):
        return None
    params: list[_Param] = []
    varargs = False
    for p in sig.parameters.values():
        if p.kind is p.VAR_POSITIONAL:
            varargs = True
            continue
        if p.kind is p.VAR_KEYWORD:
            continue
        default = _NO if p.default is p.empty else p.default
        params.append(_Param(p.name, positional=p.kind in (p.POSITIONAL_ONLY,
                                                           p.POSITIONAL_OR_KEYWORD) and not varargs,
                             keyword=p.kind is not p.POSITIONAL_ONLY, default=default))
    return _Signature(tuple(params), varargs)


def _from_schema(schema: Any) -> _Signature:
    params = []
    for a in schema.arguments:
        default = a.default_value if a.has_default_value() else _NO
        params.append(_Param(a.name, positional=not a.kwarg_only, keyword=True,
                             default=default))
    return _Signature(tuple(params))


@functools.lru_cache(maxsize=None)
def _schemas_named(qualname: str) -> tuple[_Signature, ...]:
    try:
        schemas = torch._C._jit_get_schemas_for_operator(qualname)
    except RuntimeError:
        return ()
    return tuple(_from_schema(s) for s in schemas)


@dataclass(frozen=True)
class _Candidates:
    """The signatures an op's call may bind to, whether keyword names are certain (so that
    positional arguments may be passed by keyword: not for torch builtins, whose first
    argument is ``input`` where the schema says ``self``), and whether they are schemas
    (list-typed arguments, whose default a tuple equals)."""

    sigs: tuple[_Signature, ...] = ()
    keywords_ok: bool = False
    schema: bool = True


def _python(fn: Any) -> _Candidates:
    sig = _from_python(fn)
    return _Candidates((sig,) if sig is not None else (), True, False)


def candidates(node: fx.Node) -> _Candidates:
    """The candidate signatures of ``node``'s op (none: nothing is left out)."""
    t = node.target
    if node.op == "call_method":
        meth = getattr(torch.Tensor, t, None) if isinstance(t, str) else None
        if isinstance(meth, types.FunctionType):  # a Python method of torch.Tensor
            return _python(meth)
        # schemas list ``self`` first, as the node passes it
        return _Candidates(_schemas_named(f"aten::{t}"))
    if node.op != "call_function":
        return _Candidates()
    if isinstance(t, torch._ops.OpOverload):
        return _Candidates((_from_schema(t._schema),), True)
    if isinstance(t, torch._ops.OpOverloadPacket):
        return _Candidates(tuple(_from_schema(getattr(t, o)._schema) for o in t.overloads()),
                           True)
    if isinstance(t, types.FunctionType):
        return _python(t)
    if isinstance(t, types.BuiltinFunctionType) \
            and str(getattr(t, "__module__", None) or "").startswith("torch"):
        return _Candidates(_schemas_named(f"aten::{t.__name__}"))
    return _Candidates()


def _fits(sig: _Signature, n_pos: int, kw: tuple[str, ...]) -> bool:
    """Whether ``sig`` may take ``n_pos`` positional arguments and keywords ``kw`` (by count
    and name only: an over-approximation of what the op accepts)."""
    pos = [p for p in sig.params if p.positional]
    if n_pos > len(pos) and not sig.varargs:
        return False
    by_name = {p.name: p for p in sig.params}
    bound = {p.name for p in pos[:n_pos]}
    for k in kw:
        p = by_name.get(k)
        if p is None or not p.keyword or k in bound:
            return False
    given = bound | set(kw)
    return all(p.name in given for p in sig.params if p.default is _NO)


_SIMPLE = (type(None), bool, int, float, str, torch.dtype, torch.device, torch.layout,
           torch.memory_format)


def _same(value: Any, default: Any, *, sequences: bool) -> bool:
    """``value`` is a plain constant equal to ``default`` (same type; a list equals a tuple of
    the same items where ``sequences``, for the list-typed arguments of a schema)."""
    if isinstance(value, (list, tuple)) and isinstance(default, (list, tuple)):
        if not sequences and type(value) is not type(default):
            return False
        return len(value) == len(default) and all(
            _same(a, b, sequences=sequences) for a, b in zip(value, default))
    if type(value) is not type(default) or not isinstance(value, _SIMPLE):
        return False
    if isinstance(value, float):
        return value == default and math.copysign(1.0, value) == math.copysign(1.0, default)
    return bool(value == default)


def _trimmed(sig: _Signature, args: tuple, kwargs: dict, *, keywords_ok: bool,
             sequences: bool) -> tuple[tuple, dict]:
    """``(args, kwargs)`` without the arguments equal to ``sig``'s defaults."""
    pos = [p for p in sig.params if p.positional]
    by_name = {p.name: p for p in sig.params}

    def is_default(p: _Param, v: Any) -> bool:
        return p.default is not _NO and _same(v, p.default, sequences=sequences)

    kw = {k: v for k, v in kwargs.items()
          if not (k in by_name and is_default(by_name[k], v))}
    args = list(args)
    if sig.varargs:
        return tuple(args), kw
    # the first positional default followed by other arguments: the rest by keyword
    first = next((i for i, v in enumerate(args) if i < len(pos) and is_default(pos[i], v)),
                 None)
    if first is not None and keywords_ok \
            and all(p.keyword and p.name not in kw for p in pos[first:len(args)]):
        moved = {pos[i].name: args[i] for i in range(first, len(args))
                 if not is_default(pos[i], args[i])}
        return tuple(args[:first]), {**moved, **kw}
    while args and len(args) <= len(pos) and is_default(pos[len(args) - 1], args[-1]):
        args.pop()
    return tuple(args), kw


def printed_arguments(node: fx.Node) -> tuple[tuple, dict] | None:
    """``(args, kwargs)`` of ``node`` without the arguments equal to its op's defaults, or
    None when nothing can be left out."""
    if node.op not in ("call_function", "call_method") or not (node.args or node.kwargs):
        return None
    cands = candidates(node)
    sigs = cands.sigs
    if not sigs:
        return None
    args, kwargs = tuple(node.args), dict(node.kwargs)
    fitting = [s for s in sigs if _fits(s, len(args), tuple(kwargs))]
    if len(fitting) != 1:
        return None
    sig = fitting[0]
    new_args, new_kwargs = _trimmed(sig, args, kwargs, keywords_ok=cands.keywords_ok,
                                    sequences=cands.schema)
    if len(new_args) == len(args) and len(new_kwargs) == len(kwargs):
        return None
    # the shorter call must still select the same (only) signature
    if [s for s in sigs if _fits(s, len(new_args), tuple(new_kwargs))] != [sig]:
        return None
    return new_args, new_kwargs
