"""Which registered rule differentiates a captured node.

The engines ask :func:`registered_rule` for every call node they differentiate; the answer
comes from the op record in :mod:`fxad.rules.registry` (the rule, the overload chosen for the
node's argument values and the current fused-kernel level where an op has overloads), the
complex-number policy (:mod:`fxad.rules.complex`) and, for operators other libraries
registered with ``torch.library``, their own autograd formula
(:func:`fxad.rules.fallback.custom_op_rule`).  Control flow and custom ``autograd.Function``
nodes are the engines' own business (:mod:`fxad.ad`).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from . import builtin  # noqa: F401  (the built-in rules, registered before any lookup)
from . import fused
from .complex import select as complex_select
from .fallback import custom_op_rule
from .registry import Rule, record


def rule_key(gm: fx.GraphModule, node: fx.Node) -> Any:
    """The registry key of ``node``: its target for ``call_function``, the ``torch.Tensor``
    method for ``call_method``, the module class for ``call_module``; None otherwise."""
    if node.op == "call_function":
        return node.target
    if node.op == "call_method":
        return getattr(torch.Tensor, node.target, node.target)
    if node.op == "call_module":
        return type(gm.get_submodule(node.target))
    return None


def call_values(gm: fx.GraphModule, node: fx.Node) -> tuple[tuple, dict]:
    """``node``'s positional and keyword arguments as a rule's selector (``applies``) sees
    them: a node computed by the graph or an input is its fake value (``meta['val']``; the
    node itself where capture recorded none), a module attribute (``get_attr``: parameters,
    buffers, tensor constants) the module's own tensor, constants as they are."""

    def value(a: Any) -> Any:
        if not isinstance(a, fx.Node):
            return a
        if a.op == "get_attr":
            obj: Any = gm
            try:
                for part in str(a.target).split("."):
                    obj = getattr(obj, part)
                return obj
            except AttributeError:
                pass
        return a.meta.get("val", a)

    return (tuple(fx.node.map_aggregate(tuple(node.args), value)),
            dict(fx.node.map_aggregate(dict(node.kwargs), value)))


def registered_rule(gm: fx.GraphModule, node: fx.Node) -> Rule | None:
    """The rule registered for ``node``'s op — for an op with overloads, the one that applies
    to the node's argument values at the current fused-kernel level (the complex variant for
    complex values) — the autograd formula of another library's ``torch.library`` op, or
    None."""
    key = rule_key(gm, node)
    rec = record(key)
    rule = None
    if rec is not None:
        rule = rec.select(*call_values(gm, node), fused.enabled) if rec.overloads \
            else rec.default
    if rule is None and node.op == "call_function":
        rule = custom_op_rule(key)
    return complex_select(key, rule, node)
