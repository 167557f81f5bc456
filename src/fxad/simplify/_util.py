"""Helpers shared by the simplifier passes."""
from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.fx as fx

from ..graph.sizes import known_equal
from ..rules.registry import is_random_call, kind_of


def is_impure(node: fx.Node) -> bool:
    """Nodes that must stay even when unused, and must not be merged with an equal one."""
    if node.op in ("placeholder", "output"):
        return True
    if node.meta.get("fxad_side_effect"):
        return True
    if node.op == "call_method" and isinstance(node.target, str) and node.target.endswith("_") \
            and not node.target.startswith("_"):
        return True
    if node.op == "call_function" and node.target is torch.nn.functional.batch_norm \
            and _kw(node, "training", 5, False):
        return True  # updates running statistics in place
    if node.op == "call_function" and node.target is torch.native_batch_norm \
            and _kw(node, "training", 5, False) and _kw(node, "running_mean", 3, None) is not None:
        return True
    return node.op == "call_module"


def is_random(node: fx.Node) -> bool:
    """``node`` draws random numbers (its op's kind is ``"random"`` and this call draws:
    dropout only in training, ...) or reads uninitialized memory (``torch.empty``): it must
    not be merged with an equal node nor recomputed (see
    :func:`fxad.rules.registry.is_random_call`)."""
    return is_random_call(node)


def draws_random(node: fx.Node) -> bool:
    """``node`` draws random numbers (:func:`is_random` without uninitialized memory:
    ``torch.empty_like(x)`` is kept apart from equal nodes like a draw, but what a program
    writes into it is not random, e.g. the inverse permutation of ``pack_padded_sequence``)."""
    return is_random(node) and kind_of(node) != "uninitialized"


def _kw(node: fx.Node, name: str, pos: int, default: Any) -> Any:
    if name in node.kwargs:
        return node.kwargs[name]
    if len(node.args) > pos:
        return node.args[pos]
    return default


def val(x: Any) -> Any:
    return x.meta.get("val") if isinstance(x, fx.Node) else x


def same_type(a: Any, b: Any) -> bool:
    """True when fake values ``a`` and ``b`` are tensors of equal shape and dtype."""
    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) \
        and known_equal(tuple(a.shape), tuple(b.shape)) and a.dtype == b.dtype


_ALIASES: "weakref.WeakKeyDictionary[fx.Graph, dict[str, str]]" = weakref.WeakKeyDictionary()


def aliases(graph: fx.Graph) -> dict[str, str]:
    """Names of erased nodes → name of the node that replaced them (for cotangent naming)."""
    return _ALIASES.setdefault(graph, {})


def resolve(graph: fx.Graph, name: str) -> str:
    table = _ALIASES.get(graph, {})
    seen = set()
    while name in table and name not in seen:
        seen.add(name)
        name = table[name]
    return name


def replace(node: fx.Node, new: Any) -> None:
    """Replace all uses of ``node`` by ``new`` (a node or constant) and erase it."""
    if isinstance(new, fx.Node):
        aliases(node.graph)[node.name] = new.name
        for k in ("fxad_cot_of",):
            if k in node.meta and k not in new.meta and new.op != "placeholder":
                new.meta[k] = node.meta[k]
    node.replace_all_uses_with(new)
    node.graph.erase_node(node)
