"""Multi-output calls printed as tuple unpacking, and fused forward kernels whose extra
outputs nothing reads printed as the op the user called.

FX prints a multi-output call as the tuple and one line per item::

    native_layer_norm = torch.native_layer_norm(x, [8], w, b, 1e-05)
    layer_norm = native_layer_norm[0]
    mean = native_layer_norm[1]
    rstd = native_layer_norm[2];  native_layer_norm = None

:func:`plans` finds the calls whose result is only picked apart by constant indices, and
the body transformer (:class:`fxad.codegen.BodyTransformer`) prints each as one statement,
``layer_norm, mean, rstd = torch.native_layer_norm(x, [8], w, b, 1e-05)``; an item nothing
reads is ``_`` (``*_`` for two or more at the end), an item that is itself picked apart is a
nested tuple (``output, (h, c) = ...``).

A fused forward kernel whose extra outputs are not read (the backward that needed them was
removed) is printed as the function the user called, by :func:`plain_call`:
``layer_norm = torch.nn.functional.layer_norm(x, [8], w, b)`` for
``torch.native_layer_norm(...)[0]``, ``torch.nn.functional.scaled_dot_product_attention``
for the CPU flash-attention kernel without dropout.  Both compute the same value (the
function calls the kernel and returns its first output).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn.functional as F

from .names import items


def _bind(schema: Any, args: tuple, kwargs: dict) -> dict[str, Any] | None:
    """The call's arguments by the schema's names, defaults filled in; None if they do not
    bind."""
    pos = [a for a in schema.arguments if not a.kwarg_only]
    if len(args) > len(pos):
        return None
    out = {a.name: v for a, v in zip(pos, args)}
    names = {a.name for a in schema.arguments}
    for k, v in kwargs.items():
        if k not in names or k in out:
            return None
        out[k] = v
    for a in schema.arguments:
        if a.name not in out:
            if not a.has_default_value():
                return None
            out[a.name] = a.default_value
    return out


def _layer_norm(args: tuple, kwargs: dict) -> tuple[Any, tuple, dict] | None:
    a = _bind(torch.ops.aten.native_layer_norm.default._schema, args, kwargs)
    if a is None:
        return None
    return (F.layer_norm, (a["input"], a["normalized_shape"], a["weight"], a["bias"],
                           a["eps"]), {})


def _sdpa(args: tuple, kwargs: dict) -> tuple[Any, tuple, dict] | None:
    a = _bind(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default._schema,
              args, kwargs)
    if a is None or a["dropout_p"] != 0.0:
        return None  # (with dropout the two draw differently)
    return (F.scaled_dot_product_attention, (a["query"], a["key"], a["value"]),
            {"attn_mask": a["attn_mask"], "is_causal": a["is_causal"], "scale": a["scale"]})


_aten = torch.ops.aten
_PLAIN: dict[Any, Callable[[tuple, dict], tuple[Any, tuple, dict] | None]] = {
    torch.native_layer_norm: _layer_norm,
    _aten.native_layer_norm: _layer_norm,
    _aten.native_layer_norm.default: _layer_norm,
    _aten._scaled_dot_product_flash_attention_for_cpu: _sdpa,
    _aten._scaled_dot_product_flash_attention_for_cpu.default: _sdpa,
}


def plain_call(node: fx.Node) -> tuple[Any, tuple, dict] | None:
    """``(function, args, kwargs)`` printing ``node[0]``, where ``node`` is a fused forward
    kernel (:data:`_PLAIN`) of which only the first output is read; else None."""
    if node.op != "call_function":
        return None
    try:
        form = _PLAIN.get(node.target)
    except TypeError:  # an unhashable target
        return None
    got = items(node) if form is not None else None
    if not got or set(got) != {0}:
        return None
    return form(tuple(node.args), dict(node.kwargs))


@dataclass
class Plan:
    """How one multi-output call prints.

    Attributes:
        root: the call.
        pattern: one entry per item of its result: the item's node, a nested list for an
            item that is itself unpacked, or None for an item nothing reads.
        single: the one item ``root`` prints as when it prints as the plain function
            (:func:`plain_call`); None otherwise.
        members: the item nodes whose lines the statement replaces.
        unbound: the nested items, which get no name of their own.
    """

    root: fx.Node
    pattern: list[Any]
    single: fx.Node | None = None
    members: list[fx.Node] = field(default_factory=list)
    unbound: set[fx.Node] = field(default_factory=set)


def _pattern(node: fx.Node, plan: Plan) -> list[Any] | None:
    got = items(node)
    if not got:
        return None
    out: list[Any] = [None] * len(node.meta["val"])
    for i, g in got.items():
        plan.members.append(g)
        sub = _pattern(g, plan)
        if sub is not None:
            plan.unbound.add(g)
            out[i] = sub
        else:
            out[i] = g
    return out


def plans(graph: fx.Graph, plain: set[fx.Node] = frozenset()) -> dict[fx.Node, Plan]:
    """The multi-output calls of ``graph`` that print as one statement (see the module
    docstring), by call node; ``plain``: the calls printed as their plain function
    (:func:`plain_call`), whose one statement assigns their one item."""
    out: dict[fx.Node, Plan] = {}
    absorbed: set[fx.Node] = set()
    for node in graph.nodes:
        if node in absorbed or node.op not in ("call_function", "call_method", "call_module"):
            continue
        plan = Plan(node, [])
        pattern = _pattern(node, plan)
        if pattern is None:
            continue
        plan.pattern = pattern
        if node in plain:
            plan.single = pattern[0]
        out[node] = plan
        absorbed.update(plan.members)
    return out


def render(pattern: list[Any], printed: dict[fx.Node, str], top: bool = True) -> str:
    """The assignment target of ``pattern`` with the items' printed names."""
    elems = [render(e, printed, False) if isinstance(e, list) else
             "_" if e is None else printed[e] for e in pattern]
    k = 0
    while k < len(pattern) and pattern[len(pattern) - 1 - k] is None:
        k += 1
    if k >= 2:
        elems = elems[:len(elems) - k] + ["*_"]
    s = ", ".join(elems) + ("," if len(elems) == 1 else "")
    return s if top else f"({s})"
