"""Printable names of the callables fxad records (shared by capture, the rule registry and
the engines' error messages)."""
from __future__ import annotations

from typing import Any, Callable

import torch

try:
    from torch.fx.graph import _register_custom_builtin
except ImportError:  # pragma: no cover - a torch without fx's custom builtins
    _register_custom_builtin = None

__all__ = ["describe_target", "op_qualname", "op_kind"]


def op_qualname(target: Any) -> str | None:
    """``"namespace::name"`` of a dispatcher operator (``torch.ops.aten.add.Tensor``, an op
    another library registered with ``torch.library``), overload or packet; None for any
    other callable."""
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}::{target._opname}"
    return None


def describe_target(kind: str, target: Any) -> str:
    """Human-readable name of an FX target: ``torch.sin``, ``Tensor.view``, ``operator.add``."""
    if kind == "call_method":
        return f"Tensor.{target}"
    if kind == "call_module":
        return f"module {target}"
    if isinstance(target, str):
        return target
    qual = op_qualname(target)
    if qual is not None:
        # torch.library / ATen operators: as user code spells them (torch.ops.ns.name)
        ns, name = qual.split("::", 1)
        over = f".{target._overloadname}" if isinstance(target, torch._ops.OpOverload) else ""
        return f"torch.ops.{ns}.{name}{over}"
    mod = getattr(target, "__module__", None) or ""
    name = getattr(target, "__name__", None) or repr(target)
    if mod in ("_operator", "operator"):
        return f"operator.{name}"
    if mod.startswith("torch._C._nn"):
        return f"torch.nn.functional.{name}"
    if mod.startswith("torch._C._VariableFunctions") or mod == "torch":
        return f"torch.{name}"
    if mod.startswith("torch._C._linalg"):
        return f"torch.linalg.{name.removeprefix('linalg_')}"
    if mod.startswith("torch._C._special"):
        return f"torch.special.{name.removeprefix('special_')}"
    if mod.startswith("torch._C._fft"):
        return f"torch.fft.{name.removeprefix('fft_')}"
    if mod.startswith("torch._C"):
        # methods of torch._C.TensorBase show up as `TensorBase.add`
        return f"torch.{name.replace('TensorBase', 'Tensor')}"
    return f"{mod}.{name}" if mod else name


def op_kind(node: Any) -> str:
    """The op of a graph node as residual policies and reports name it (``Policy.by_op``
    keys): ``torch.relu`` → ``"relu"``, ``operator.mul`` → ``"mul"``, ``x.view(...)`` →
    ``"view"``, ``torch.ops.aten.foo.default`` → ``"foo"``; the node's ``op`` for other
    nodes.  What fxad knows about the op is in its record (:func:`fxad.rules.registry.kind_of`)."""
    t = node.target
    if node.op == "call_method":
        return str(t)
    if node.op == "call_function":
        if isinstance(t, torch._ops.OpOverload):
            return str(t).split(".")[-2]
        name = getattr(t, "__name__", None) or str(t)
        return name.rsplit(".", 1)[-1]
    return node.op


def code_builtin(name: str, fn: Callable[..., Any]) -> None:
    """Generated code calls ``fn`` by ``name`` and imports it from ``fn``'s module, so code
    saved with ``GraphModule.to_folder`` and ejected files run in a fresh interpreter (fx's
    custom builtins; nothing on a torch without them)."""
    if _register_custom_builtin is not None:
        _register_custom_builtin(name, f"from {fn.__module__} import {fn.__name__} as {name}",
                                 fn)
