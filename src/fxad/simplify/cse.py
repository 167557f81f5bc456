"""Common-subexpression elimination: two pure nodes with the same op, target and arguments
become one (the earlier).  Random ops and side effects are never merged."""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from ._util import aliases, is_impure, is_random


def _key(x: Any) -> Any:
    if isinstance(x, fx.Node):
        return ("node", id(x))
    if isinstance(x, (list, tuple)):
        return (type(x).__name__,) + tuple(_key(v) for v in x)
    if isinstance(x, dict):
        return ("dict",) + tuple(sorted((k, _key(v)) for k, v in x.items()))
    if isinstance(x, slice):
        return ("slice", _key(x.start), _key(x.stop), _key(x.step))
    if isinstance(x, float):
        return ("float", x, str(x))  # keeps 0.0 and -0.0 apart, nan keyed by repr
    if isinstance(x, (torch.dtype, torch.device, torch.memory_format, torch.layout)):
        return ("torch", str(x))
    if isinstance(x, torch.Tensor):
        return ("tensor", id(x))
    return (type(x).__name__, x)


def cse(graph: fx.Graph) -> int:
    """Merge duplicated pure computations; returns the number of nodes removed."""
    seen: dict[Any, fx.Node] = {}
    removed = 0
    for node in list(graph.nodes):
        if node.op not in ("call_function", "call_method", "get_attr") or is_impure(node) \
                or is_random(node):
            continue
        try:
            key = (node.op, node.target if node.op != "call_function" else id(node.target),
                   _key(node.args), _key(node.kwargs))
            hash(key)
        except TypeError:
            continue
        prev = seen.get(key)
        if prev is None:
            seen[key] = node
            continue
        for k in ("fxad_cot_of",):
            if k in node.meta and k not in prev.meta:
                prev.meta[k] = node.meta[k]
        aliases(graph)[node.name] = prev.name
        node.replace_all_uses_with(prev)
        graph.erase_node(node)
        removed += 1
    return removed
