"""PyTorch's own functions, whatever a library has since put in the ``torch`` namespace.

Some libraries replace torch functions with Python functions of their own when imported
(PyTorch Geometric sets ``torch.index_select`` and ``torch.select`` to wrappers that accept
its ``HashTensor``).  fxad resolves op names (``x.index_select`` → ``torch.index_select``)
and keys its derivative rules by PyTorch's functions, so it reads them from this table,
taken when fxad is imported, and from ``torch._C._VariableFunctions`` (where every native
``torch.*`` function lives) for a name a library replaced before that.  A replacement
itself is ordinary Python: capture traces through it like user code, down to the real op
it calls.
"""
from __future__ import annotations

import types
from typing import Any

import torch

_NATIVE = torch._C._VariableFunctions


def _is_foreign(val: Any) -> bool:
    """A Python function defined outside torch (a library's replacement)."""
    module = getattr(val, "__module__", None) or ""
    return isinstance(val, types.FunctionType) \
        and module != "torch" and not module.startswith("torch.")


def _snapshot() -> dict[str, Any]:
    table: dict[str, Any] = {}
    for name, val in list(vars(torch).items()):
        if _is_foreign(val):
            native = getattr(_NATIVE, name, None)
            if native is not None:
                table[name] = native
        elif callable(val):
            table[name] = val
    return table


_TORCH: dict[str, Any] = _snapshot()


def torch_function(name: str) -> Any:
    """PyTorch's own ``torch.<name>`` (None when torch has no such callable)."""
    fn = _TORCH.get(name)
    if fn is not None:
        return fn
    cur = getattr(torch, name, None)
    if _is_foreign(cur):
        return getattr(_NATIVE, name, None)
    return cur if callable(cur) else None


def original(fn: Any) -> Any:
    """``fn``, or PyTorch's own function where ``fn`` is a library's replacement now found
    in the ``torch`` namespace under that name (``torch_geometric``'s ``_new_index_select``
    → the native ``torch.index_select``)."""
    if not _is_foreign(fn):
        return fn
    hit = _SEEN.get(id(fn))
    if hit is not None and hit[0] is fn:
        return hit[1]
    real = fn
    for name, val in list(vars(torch).items()):
        if val is fn:
            native = torch_function(name)
            if native is not None:
                real = native
                break
    _SEEN[id(fn)] = (fn, real)
    return real


_SEEN: dict[int, tuple[Any, Any]] = {}  # id(function) -> (function, original)


def is_replaced(fn: Any) -> bool:
    """``fn`` is a library's replacement of a torch function (see :func:`original`)."""
    return original(fn) is not fn
