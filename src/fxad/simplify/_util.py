"""Helpers shared by the simplifier passes."""
from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.fx as fx

# ops whose result differs between two identical calls
RANDOM_OPS = {torch.rand, torch.randn, torch.randint, torch.randperm, torch.rand_like,
              torch.randn_like, torch.randint_like, torch.bernoulli, torch.multinomial,
              torch.normal, torch.empty, torch.empty_like}


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
    if node.op == "call_function" and node.target in RANDOM_OPS:
        return True
    if node.op == "call_function" and node.target in (torch.nn.functional.dropout,
                                                       torch.dropout):
        # random only when it drops something: training and 0 < p
        p = _kw(node, "p", 1, 0.5)
        training = _kw(node, "training" if node.target is torch.nn.functional.dropout
                       else "train", 2, True)
        return bool(training) and p != 0
    return node.op == "call_method" and node.target in ("bernoulli", "uniform_", "normal_")


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
        and tuple(a.shape) == tuple(b.shape) and a.dtype == b.dtype


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
