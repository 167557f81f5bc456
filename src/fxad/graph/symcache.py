"""Memoized size arithmetic for a symbolic build.

A fake-tensor operation on symbolic sizes computes with
:class:`torch.fx.experimental.sym_node.SymNode` values: PyTorch's C++ core asks for a result's
number of elements, its storage size and its contiguity, and PyTorch's meta functions compare
and multiply sizes.  Each such step builds a new sympy expression (``s0*s1*64``,
``Eq(s1, 1)``), though one build asks the same few questions thousands of times: a 2-block GPT
does about 20,000 of them, of which fewer than 2,000 differ.

Inside :func:`memoized`, the binary operations of the ``SymNode`` values of one ``ShapeEnv``
(and the wrapping of Python ints as ``SymNode``) are memoized per ``ShapeEnv``: the key is the
operation, both operands' expressions, types and example values, and the ShapeEnv's
replacement version (a size tied to another after the first call computes again), so a
repeated question returns the ``SymNode`` the first one built.  Nothing else changes: guards,
replacements and value ranges are the ShapeEnv's as before, and ``SymNode`` values of other
ShapeEnvs (``torch.compile`` in another thread), or computed while a proxy mode records size
arithmetic (``make_fx``), take PyTorch's own path.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator

import sympy
from torch.fx.experimental.proxy_tensor import get_proxy_mode
from torch.fx.experimental.sym_node import SymNode

__all__ = ["memoized"]

# SymNode's binary operations whose result depends only on the operands' expressions (``mod``
# also reads value ranges, which guards refine during a build: left out)
_BINARY = ("add", "sub", "mul", "and_", "or_", "int_floordiv", "int_truediv",
           "float_truediv", "pow_by_natural", "float_pow", "eq", "ne", "gt", "lt", "le", "ge",
           "sym_min", "sym_max")
_ATTR = "_fxad_memo"
_LOCK = threading.Lock()
_ORIGINAL: dict[str, Callable] = {}
_USERS = 0


def _memo_of(node: SymNode) -> dict | None:
    env = node.shape_env
    return None if env is None else env.__dict__.get(_ATTR)


def _binary(name: str, original: Callable) -> Callable:
    def op(self: SymNode, other: Any) -> Any:
        env = self.shape_env
        memo = None if env is None else env.__dict__.get(_ATTR)
        if memo is None or type(other) is not SymNode or get_proxy_mode() is not None:
            return original(self, other)
        key = (name, self._expr, other._expr, self.pytype, other.pytype, self._hint,
               other._hint, getattr(self, "_optimized_summation", None),
               getattr(other, "_optimized_summation", None),
               env._replacements_version_counter)
        out = memo.get(key)
        if out is None:
            out = memo[key] = original(self, other)
        return out
    op.__name__ = original.__name__
    op.__doc__ = original.__doc__
    return op


def _wrap_int(original: Callable) -> Callable:
    def wrap_int(self: SymNode, num: int) -> SymNode:
        memo = _memo_of(self)
        if memo is None or type(num) is not int:
            return original(self, num)
        key = ("wrap_int", num)
        out = memo.get(key)
        if out is None:
            out = memo[key] = original(self, num)
        return out
    return wrap_int


def _maybe_as_int(original: Callable) -> Callable:
    def maybe_as_int(self: SymNode) -> int | None:
        e = self._expr
        if isinstance(e, sympy.Integer):
            return int(e)
        env = self.shape_env
        if env is None or _ATTR not in env.__dict__:
            return original(self)
        # remembered on the node, for the ShapeEnv's replacement version it was computed at
        version = env._replacements_version_counter
        seen = self.__dict__.get("_fxad_as_int")
        if seen is not None and seen[0] == version:
            return seen[1]
        out = original(self)
        self.__dict__["_fxad_as_int"] = (version, out)
        return out
    return maybe_as_int


def _supported(env: Any) -> bool:
    """Whether this torch has the ``SymNode``/``ShapeEnv`` members the memo relies on (they
    are PyTorch internals; where one is missing, builds take PyTorch's own path)."""
    return hasattr(env, "_replacements_version_counter") \
        and all(hasattr(SymNode, f"_{n}") for n in _BINARY) \
        and all(hasattr(SymNode, a) for a in ("wrap_int", "maybe_as_int"))


def _install() -> None:
    for name in _BINARY:
        attr = f"_{name}"
        _ORIGINAL[attr] = getattr(SymNode, attr)
        setattr(SymNode, attr, _binary(name, _ORIGINAL[attr]))
    for attr, make in (("wrap_int", _wrap_int), ("maybe_as_int", _maybe_as_int)):
        _ORIGINAL[attr] = getattr(SymNode, attr)
        setattr(SymNode, attr, make(_ORIGINAL[attr]))


def _uninstall() -> None:
    for attr, fn in _ORIGINAL.items():
        setattr(SymNode, attr, fn)
    _ORIGINAL.clear()


@contextlib.contextmanager
def memoized(env: Any) -> Iterator[None]:
    """Inside: the size arithmetic of ``env`` (a ShapeEnv) is memoized (see the module
    docstring).  Re-entrant and usable from several threads; the memo lives as long as
    ``env``."""
    global _USERS
    if not _supported(env):
        yield
        return
    env.__dict__.setdefault(_ATTR, {})
    with _LOCK:
        if _USERS == 0:
            _install()
        _USERS += 1
    try:
        yield
    finally:
        with _LOCK:
            _USERS -= 1
            if _USERS == 0:
                _uninstall()
