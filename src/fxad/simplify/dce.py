"""Dead-code elimination: erase nodes nobody uses, except side effects (buffer updates,
in-place calls, training-mode ``batch_norm``)."""
from __future__ import annotations

import torch.fx as fx

from ._util import is_impure


def dce(graph: fx.Graph) -> int:
    """Erase unused pure nodes (in reverse order, so chains disappear in one call)."""
    removed = 0
    for node in reversed(list(graph.nodes)):
        if not node.users and not is_impure(node):
            graph.erase_node(node)
            removed += 1
    return removed
