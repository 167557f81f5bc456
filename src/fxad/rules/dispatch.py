"""Which registered rule differentiates a captured node.

The engines ask :func:`registered_rule` for every call node they differentiate; the answer
comes from the op record in :mod:`fxad.rules.registry` (the rule, chosen for the node's
argument values where an op has overloads), the complex-number policy
(:mod:`fxad.rules.complex`) and, for operators other libraries registered with
``torch.library``, their own autograd formula (:func:`fxad.rules.fallback.custom_op_rule`).
Control flow and custom ``autograd.Function`` nodes are the engines' own business
(:mod:`fxad.ad`).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from .complex import select as complex_select
from .fallback import custom_op_rule
from .registry import Rule, lookup


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


def registered_rule(gm: fx.GraphModule, node: fx.Node) -> Rule | None:
    """The rule registered for ``node``'s op (the complex variant for complex values), the
    autograd formula of another library's ``torch.library`` op, or None."""
    key = rule_key(gm, node)
    rule = lookup(key)
    if rule is None and node.op == "call_function":
        rule = custom_op_rule(key)
    return complex_select(key, rule, node)
