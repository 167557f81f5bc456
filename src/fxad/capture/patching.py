"""Patch lists: ``(namespace, name, original, replacement)`` entries that capture (and
:func:`fxad.capture.control.eager_semantics`) set while they run and undo after, for names
bound in modules, in the traced code's own globals and in its closure cells."""
from __future__ import annotations

import inspect
from typing import Any, Iterable

import torch
import torch.fx as fx


def namespace_patches(spaces: Iterable[Any], replaced: dict[int, Any]
                      ) -> list[tuple[Any, str, Any, Any]]:
    """Patch-list entries for the names in module globals (dicts) and closure cells bound to
    an object in ``replaced`` (``id(original) -> replacement``)."""
    out: list[tuple[Any, str, Any, Any]] = []
    for space in {id(g): g for g in spaces}.values():
        if isinstance(space, dict):
            for name, val in list(space.items()):
                if id(val) in replaced and callable(val):
                    out.append((_DictSlot(space), name, val, replaced[id(val)]))
        else:  # a closure cell
            try:
                val = space.cell_contents
            except ValueError:
                continue
            if id(val) in replaced:
                out.append((_CellSlot(space), "cell_contents", val, replaced[id(val)]))
    return out


class _CellSlot:
    """``setattr(slot, "cell_contents", v)`` on a closure cell (for the patch list)."""

    def __init__(self, cell: Any) -> None:
        object.__setattr__(self, "_c", cell)

    def __setattr__(self, name: str, value: Any) -> None:
        self._c.cell_contents = value


class _DictSlot:
    """``setattr``/``getattr`` on a module's globals dict (for the patch list)."""

    def __init__(self, d: dict) -> None:
        object.__setattr__(self, "_d", d)

    def __setattr__(self, name: str, value: Any) -> None:
        self._d[name] = value

    def __getattr__(self, name: str) -> Any:
        return self._d[name]


def user_globals(f: Any) -> list[dict]:
    """The module globals of the traced code: the function's, or every submodule's
    ``forward``'s (where names imported from torch may need patching during capture), and
    for a function, those of the modules its closure holds and of the generated modules its
    globals hold (code fxad generated calls ``print`` from its own globals: the gradient of a
    gradient)."""
    out: list[Any] = []
    held: list[Any] = []
    if not isinstance(f, torch.nn.Module):
        fn = inspect.unwrap(f)
        held = [c.cell_contents for c in getattr(fn, "__closure__", None) or () if _filled(c)]
        held += [v for v in (getattr(fn, "__globals__", None) or {}).values()
                 if isinstance(v, fx.GraphModule)]
    fns = [f] if not isinstance(f, torch.nn.Module) else \
        [type(m).forward for m in f.modules()]
    fns += [type(m).forward for v in held if isinstance(v, torch.nn.Module)
            for m in v.modules()]
    for fn in fns:
        fn = inspect.unwrap(fn)
        glob = getattr(fn, "__globals__", None)
        if isinstance(glob, dict) and not str(glob.get("__name__", "")).startswith("torch"):
            out.append(glob)
            out.extend(getattr(fn, "__closure__", None) or ())
    return out


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True
