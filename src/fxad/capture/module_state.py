"""The traced module's own attributes, kept as they were.

The program runs on the user's module, and may assign to its attributes
(``self.cache = self.cache.to(x.dtype)``); the module must never keep a traced (fake)
value.  :func:`module_state` notes every tensor the modules hold before capture,
:func:`restore_module_state` puts them back after, and :func:`warn_rebound` says where the
generated code therefore differs from eager PyTorch.
"""
from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor


def module_state(root: torch.nn.Module) -> dict:
    """Every tensor the modules of ``root`` hold (parameters, buffers, plain tensor
    attributes), by module path: what :func:`restore_module_state` puts back."""
    state: dict = {}
    for path, mod in root.named_modules(remove_duplicate=False):
        entries = {}
        for kind, d in (("_parameters", mod._parameters), ("_buffers", mod._buffers),
                        ("__dict__", mod.__dict__)):
            for name, v in d.items():
                if kind != "__dict__" or isinstance(v, torch.Tensor):
                    entries[(kind, name)] = v
        state[path] = (mod, entries)
    return state


def restore_module_state(state: dict) -> list[tuple[str, Any, Any]]:
    """Undo what the traced program assigned to the attributes of the modules it was given
    (``self.cache = self.cache.to(x.dtype)``): the user's module must never keep a traced
    (fake) value.  Modules attached during capture (a function's closure modules) are not
    touched.  Returns ``(path, old, new)`` for each tensor attribute the program rebound
    (``old`` None: added by the program)."""
    rebound: list[tuple[str, Any, Any]] = []
    for path, (mod, entries) in state.items():
        seen: set = set()
        for kind in ("_parameters", "_buffers", "__dict__"):
            d = getattr(mod, kind)
            for name, v in list(d.items()):
                where = f"{path}.{name}".lstrip(".")
                if (kind, name) not in entries:
                    if not isinstance(v, FakeTensor):  # only traced values are undone
                        continue
                    del d[name]  # a traced tensor the program stored on the module
                    if name not in seen:
                        rebound.append((where, None, v))
                elif v is not entries[(kind, name)]:
                    d[name] = entries[(kind, name)]
                    if name not in seen:
                        rebound.append((where, entries[(kind, name)], v))
                seen.add(name)
        for (kind, name), old in entries.items():  # deleted (or moved) by the program
            d = getattr(mod, kind)
            if name not in d:
                d[name] = old
    return rebound


def warn_rebound(cap: Any, rebound: list[tuple[str, Any, Any]]) -> None:
    """Say where the generated code differs from eager: eager PyTorch keeps a tensor the
    program assigned to a module attribute, fxad's code does not store it (it recomputes the
    value from the module's own attribute on every call).  Silent only where the new value
    is the old one converted to the dtype/device/layout it already had (transformers' CTRL:
    ``self.pos_encoding = self.pos_encoding.to(device=..., dtype=...)``), which leaves the
    attribute's value as it was."""
    changed = [path for path, old, new in rebound if not _same_value(cap, old, new)]
    if changed:
        warnings.warn(
            "the traced program assigns to module attributes (" + ", ".join(
                f"`{p}`" for p in changed) + "): eager PyTorch keeps the new value on the "
            "module, fxad's generated code does not (each call computes the value from the "
            "module's attribute as it was when traced, and the module is left unchanged); "
            "update such state outside the differentiated function", UserWarning,
            stacklevel=3)


_VALUE_PRESERVING = {"to", "type", "contiguous", "float", "double", "half", "bfloat16", "detach",
                     "clone", "cpu", "cuda", torch.Tensor.to, torch.clone, torch.detach}


def _same_value(cap: Any, old: Any, new: Any) -> bool:
    """Whether ``new`` is ``old`` passed through conversions that leave it as it was (same
    dtype, device, shape and strides at every step)."""
    if not isinstance(old, torch.Tensor) or not isinstance(new, torch.Tensor):
        return old is new
    if new is old:
        return True
    node = cap.env.get(id(new))
    while isinstance(node, fx.Node) and node.op in ("call_method", "call_function") \
            and node.target in _VALUE_PRESERVING and node.args \
            and isinstance(node.args[0], fx.Node):
        src, val = node.args[0], node.meta.get("val")
        sv = src.meta.get("val")
        if not (isinstance(val, torch.Tensor) and isinstance(sv, torch.Tensor)) or \
                (val.dtype, val.device, tuple(val.shape), val.stride()) != \
                (sv.dtype, sv.device, tuple(sv.shape), sv.stride()):
            return False
        node = src
    return isinstance(node, fx.Node) and node.op == "get_attr" \
        and node.target == cap.attr_paths.get(id(old))
