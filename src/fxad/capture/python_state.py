"""Python state the traced program changes: announced, since it changes only at capture.

The program runs once, at build time; a change it makes to Python state outside its tensors
(a global counter, a list it appends to, an attribute set on an outer object or on one of its
modules) happens then and never again when the generated code runs.  :func:`snapshot` notes
that state before capture (the traced code's module globals and closure cells, the objects
and containers they hold one level down, and the non-tensor attributes of the modules being
traced); :func:`announce` compares after a successful capture and gives one ``UserWarning``
per change, naming the line that makes it, found in the bytecode (:mod:`dis`) of the traced
code: a ``STORE_GLOBAL``/``STORE_DEREF`` of the name, a mutating method called on it
(``append``, ``update``...), a subscript store into it, or a ``STORE_ATTR`` of the attribute.
Tensor attributes of modules are reported by :mod:`fxad.capture.module_state`.
"""
from __future__ import annotations

import contextlib
import dis
import functools
import inspect
import linecache
import os
import sys
import types
import warnings
from typing import Any, Iterator

import torch

_MUTATORS = {"append", "extend", "insert", "pop", "remove", "clear", "update", "add",
             "discard", "setdefault", "popitem", "sort", "reverse", "__setitem__",
             "__delitem__", "appendleft", "extendleft", "popleft", "__iadd__"}
_CONTAINERS = (list, dict, set, bytearray)
_MAX_ITEMS = 10_000
_SKIP_ATTRS = {"_parameters", "_buffers", "_modules", "_forward_hooks", "_forward_pre_hooks",
               "_backward_hooks", "_backward_pre_hooks", "_state_dict_hooks",
               "_load_state_dict_pre_hooks", "_forward_hooks_with_kwargs",
               "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called",
               "_state_dict_pre_hooks", "_load_state_dict_post_hooks",
               "_non_persistent_buffers_set", "_is_full_backward_hook", "__dict__"}


def _plain_value(v: Any) -> bool:
    """A value whose change is a Python effect worth naming (not code, types, modules or
    tensors)."""
    return not isinstance(v, (types.ModuleType, type, types.FunctionType, types.MethodType,
                              types.BuiltinFunctionType, torch.Tensor, torch.nn.Module,
                              property, staticmethod, classmethod))


def _content(v: Any) -> Any:
    """What a container holds, by identity (None: not a container, or too large)."""
    if not isinstance(v, _CONTAINERS):
        return None
    try:
        if len(v) > _MAX_ITEMS:
            return ("len", len(v))
        if isinstance(v, dict):
            return tuple((k, id(x)) for k, x in v.items())
        if isinstance(v, set):
            return frozenset(id(x) for x in v)
        return tuple(id(x) for x in v)
    except Exception:  # noqa: BLE001 - a container subclass that misbehaves: not compared
        return None


def _attrs(obj: Any) -> dict[str, int] | None:
    """An outer object's attributes, by identity (None: nothing to watch)."""
    d = getattr(obj, "__dict__", None)
    if not isinstance(d, dict) or not _plain_value(obj) or isinstance(obj, _CONTAINERS):
        return None
    return {k: id(v) for k, v in d.items() if _plain_value(v) and k not in _SKIP_ATTRS}


class _Watched:
    """One place state lives: a global name, a closure cell, or a module's attribute."""

    def __init__(self, kind: str, name: str, read: Any, code_scope: Any) -> None:
        self.kind, self.name, self.read, self.scope = kind, name, read, code_scope
        self.before = self._state()

    def _state(self) -> Any:
        try:
            v = self.read()
        except (KeyError, ValueError, AttributeError):
            return ("missing",)
        keep = v  # hold the object: its id stays valid
        return (id(v), _content(v), _attrs(v), keep)

    def change(self) -> str | None:
        """What changed (``"rebound"``, ``"mutated"``, ``"attribute <a>"``), or None."""
        after = self._state()
        b, a = self.before, after
        if b[0] != a[0]:
            if len(b) == 4 and len(a) == 4 and type(b[3]) is type(a[3]) \
                    and isinstance(a[3], (int, float, str, bool, tuple, type(None))):
                try:
                    if b[3] == a[3]:
                        return None
                except Exception:  # noqa: BLE001
                    pass
            return "rebound"
        if len(b) == 4 and b[1] != a[1]:
            return "mutated"
        if len(b) == 4 and b[2] is not None and a[2] is not None and b[2] != a[2]:
            changed = sorted(k for k in set(b[2]) | set(a[2]) if b[2].get(k) != a[2].get(k))
            return f"attribute {changed[0]}" if changed else None
        return None


def _functions(f: Any) -> list[Any]:
    fns = [f] if not isinstance(f, torch.nn.Module) else \
        list({id(type(m).forward): type(m).forward for m in f.modules()}.values())
    return [inspect.unwrap(fn) for fn in fns]


def snapshot(f: Any, user_globals: list[Any]) -> list[_Watched]:
    """The state :func:`announce` compares: ``f``'s (or every submodule's ``forward``'s)
    globals, closure cells and, for a module, its non-tensor attributes."""
    watched: list[_Watched] = []
    seen: set[tuple[int, str]] = set()
    for fn in _functions(f):
        code = getattr(fn, "__code__", None)
        glob = getattr(fn, "__globals__", None)
        if code is None or not isinstance(glob, dict) \
                or str(glob.get("__name__", "")).startswith(("torch", "fxad")):
            continue
        for name in _global_names(code):
            if (id(glob), name) in seen or name not in glob or not _plain_value(glob[name]) \
                    and not isinstance(glob[name], torch.nn.Module):
                continue
            seen.add((id(glob), name))
            watched.append(_Watched("global", name, lambda g=glob, n=name: g[n], glob))
        for name, cell in zip(code.co_freevars, getattr(fn, "__closure__", None) or ()):
            if (id(cell), name) in seen:
                continue
            seen.add((id(cell), name))
            try:
                if not _plain_value(cell.cell_contents):
                    continue
            except ValueError:
                pass
            watched.append(_Watched("closure", name, lambda c=cell: c.cell_contents, fn))
    if isinstance(f, torch.nn.Module):
        for path, mod in f.named_modules():
            for k, v in vars(mod).items():
                if k in _SKIP_ATTRS or not _plain_value(v) or k.startswith("__"):
                    continue
                where = f"{path}.{k}" if path else k
                watched.append(_Watched("attribute", where,
                                        lambda m=mod, a=k: m.__dict__[a], type(mod)))
    return watched


def _global_names(code: types.CodeType) -> set[str]:
    names: set[str] = set()
    for c in _codes(code):
        names.update(i.argval for i in dis.get_instructions(c)
                     if i.opname in ("LOAD_GLOBAL", "STORE_GLOBAL", "DELETE_GLOBAL")
                     and isinstance(i.argval, str))
    return names


def _codes(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            yield from _codes(c)


def _scope_codes(w: _Watched, fns: list[Any]) -> list[types.CodeType]:
    """Code objects where ``w``'s change can be made: the traced functions and the functions
    of the module (or class) they come from."""
    out: list[types.CodeType] = []
    for fn in fns:
        if getattr(fn, "__code__", None) is not None:
            out.extend(_codes(fn.__code__))
    if isinstance(w.scope, dict):
        for v in list(w.scope.values()):
            if isinstance(v, types.FunctionType) and v.__globals__ is w.scope:
                out.extend(_codes(v.__code__))
    elif isinstance(w.scope, type):
        for v in vars(w.scope).values():
            v = getattr(v, "__func__", v)
            if isinstance(v, types.FunctionType):
                out.extend(_codes(v.__code__))
    return list({id(c): c for c in out}.values())


def _locate(w: _Watched, change: str, codes: list[types.CodeType]
            ) -> tuple[str, int] | None:
    """``(file, line)`` of the instruction that makes ``change`` to ``w``."""
    loads = {"global": ("LOAD_GLOBAL", "LOAD_NAME"), "closure": ("LOAD_DEREF",),
             "attribute": ("LOAD_FAST",)}[w.kind]
    stores = {"global": "STORE_GLOBAL", "closure": "STORE_DEREF"}.get(w.kind)
    attr_name = w.name.rsplit(".", 1)[-1] if w.kind == "attribute" else None
    first: tuple[str, int] | None = None  # the first line found; one storing the new value wins
    for code in codes:
        ins = list(dis.get_instructions(code))
        for k, i in enumerate(ins):
            hit = False
            if w.kind == "attribute" and change.startswith("attribute "):
                # `self.config.problem_type = ...`: the attribute loaded, then stored into
                hit = i.opname in ("LOAD_ATTR", "LOAD_METHOD") and i.argval == attr_name \
                    and k + 1 < len(ins) and ins[k + 1].opname == "STORE_ATTR" \
                    and ins[k + 1].argval == change.split(" ", 1)[1]
            elif w.kind == "attribute":
                hit = i.opname == "STORE_ATTR" and i.argval == attr_name if change == "rebound" \
                    else i.opname in ("LOAD_ATTR", "LOAD_METHOD") and i.argval == attr_name \
                    and _mutates_next(ins, k)
            elif change == "rebound":
                hit = i.opname == stores and i.argval == w.name
            elif i.opname in loads and i.argval == w.name:
                if change == "mutated":
                    hit = _mutates_next(ins, k)
                else:  # an attribute of the object
                    attr = change.split(" ", 1)[1]
                    hit = any(j.opname == "STORE_ATTR" and j.argval == attr
                              for j in ins[k + 1:k + 8])
            if hit:
                line = next((j.positions.lineno for j in reversed(ins[:k + 1])
                             if j.positions is not None and j.positions.lineno), None) \
                    if hasattr(i, "positions") else i.starts_line
                line = line or code.co_firstlineno
                if first is None:
                    first = (code.co_filename, line)
                if not change.startswith("attribute ") or _stores_new_value(w, change, ins, k):
                    return code.co_filename, line
    return first


def _stores_new_value(w: _Watched, change: str, ins: list[Any], k: int) -> bool:
    """The attribute store found at ``ins[k]`` stores a constant equal to the attribute's
    value now (``problem_type = "single_label_classification"`` among three such lines)."""
    try:
        new = getattr(w.read(), change.split(" ", 1)[1])
    except Exception:  # noqa: BLE001 - an attribute that cannot be read: any store serves
        return True
    consts = [j for j in ins[max(0, k - 3):k] if j.opname == "LOAD_CONST"]
    try:
        return bool(consts) and type(consts[-1].argval) is type(new) \
            and consts[-1].argval == new
    except Exception:  # noqa: BLE001
        return False


def _mutates_next(ins: list[Any], k: int) -> bool:
    """The value loaded at ``ins[k]`` is mutated by the next few instructions: a mutating
    method called on it, or a subscript store/delete into it."""
    for j in ins[k + 1:k + 8]:
        if j.opname in ("LOAD_ATTR", "LOAD_METHOD") and j.argval in _MUTATORS:
            return True
        if j.opname in ("STORE_SUBSCR", "DELETE_SUBSCR"):
            return True
        if j.opname.startswith(("STORE_", "RETURN", "POP_TOP")):
            return False
    return False


def announce(f: Any, watched: list[_Watched]) -> None:
    """One ``UserWarning`` per piece of state in ``watched`` the capture changed: an object
    reached by several names (a config shared by every submodule) is named once, by its
    shortest path.  The warning points at the user's call of fxad; its text names the line
    that makes the change."""
    fns = _functions(f)
    groups: dict[Any, list[tuple[_Watched, str]]] = {}
    for w in watched:
        change = w.change()
        if change is None:
            continue
        # a rebinding is one place's own; a mutation is the object's, whatever holds it
        key = (w.kind, w.name) if change == "rebound" else (id(w.before[3]), change)
        groups.setdefault(key, []).append((w, change))
    level = _user_stacklevel()
    for members in groups.values():
        members.sort(key=lambda m: (m[0].name.count("."), len(m[0].name)))
        found = None
        for w, change in members:
            found = _locate(w, change, _scope_codes(w, fns))
            if found is not None:
                break
        w, change = members[0]
        what = {"global": f"the global `{w.name}`", "closure": f"the outer variable `{w.name}`",
                "attribute": f"the module attribute `{w.name}`"}[w.kind]
        verb = "is rebound" if change == "rebound" else "is changed in place" \
            if change == "mutated" else f"gets its `{change.split(' ', 1)[1]}` changed"
        where = ""
        if found is not None:
            text = linecache.getline(found[0], found[1]).strip()
            where = f" at {os.path.basename(found[0])}:{found[1]}: `{text}`"
        msg = (f"{what} {verb} by the traced program{where}; this ran once, at build time, "
               "and the generated code does not repeat it (keep such state outside the "
               "differentiated function)")
        warnings.warn(msg, UserWarning, stacklevel=level)


_OWN_FILES = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,
              os.path.dirname(os.path.abspath(torch.__file__)) + os.sep,
              os.path.abspath(contextlib.__file__), os.path.abspath(functools.__file__))


def _user_stacklevel() -> int:
    """The ``stacklevel`` (for a ``warnings.warn`` in :func:`announce`) of the first frame
    outside fxad, torch and the standard library's wrappers: the user's call of fxad."""
    frame, level = sys._getframe(1), 1  # announce's frame
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(
            _OWN_FILES):
        frame, level = frame.f_back, level + 1
    return level if frame is not None else 2
