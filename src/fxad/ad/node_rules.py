"""Which rule differentiates a node: the engines' one lookup (:func:`rule_for`).

Most nodes are ops with a registered rule (:func:`fxad.rules.dispatch.registered_rule`).
Some node kinds carry their own derivative instead, built for that one node: a custom
``torch.autograd.Function`` (:mod:`fxad.ad.custom_function`: its own ``backward``/``jvp``)
and captured control flow (:mod:`fxad.ad.control_flow`: the derivatives of its branch and
body graphs).  Those modules register a matcher and a rule factory here with
:func:`register_node_rule` when they are imported (``fxad.ad`` imports both), so that the
sweeps (:mod:`fxad.ad.reverse`, :mod:`fxad.ad.forward`) consult them without importing
them: the control-flow rules build body derivatives through :mod:`fxad.ad.transform`, which
runs the sweeps.
"""
from __future__ import annotations

from typing import Callable

import torch.fx as fx

from ..graph.proxy import Emitter
from ..rules.dispatch import registered_rule
from ..rules.registry import Rule

Matcher = Callable[[fx.Node], bool]
Factory = Callable[[fx.GraphModule, fx.Node, Emitter], Rule]

_NODE_RULES: list[tuple[Matcher, Factory]] = []


def register_node_rule(matches: Matcher, make: Factory) -> None:
    """Nodes for which ``matches(node)`` holds are differentiated by ``make(gm, node, em)``
    (``em``: the engine's emitter), before the registered rules are consulted."""
    _NODE_RULES.append((matches, make))


def rule_for(gm: fx.GraphModule, node: fx.Node, em: Emitter) -> Rule | None:
    """The rule that differentiates ``node``: a node kind's own rule (see the module
    docstring), else the registered rule, else None."""
    for matches, make in _NODE_RULES:
        if matches(node):
            return make(gm, node, em)
    return registered_rule(gm, node)
