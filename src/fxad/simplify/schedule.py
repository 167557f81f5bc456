"""Scheduling pass: when to cast gradients up to their parameters' dtype.

Under mixed precision the step computes each weight gradient in the low-precision dtype and
casts it up (``d_w = d_to_3.to(torch.float32)``), and nothing but the graph's output reads
the result.  Run where it first can (right after its product, as the backward is written),
each such *widening output cast* holds a buffer twice the size of its input from there to
the end of the step; run last, it holds its input instead, until then.  Which is better
depends on where the step's peak is: in a deep convolutional network the peak is inside the
backward, while early activations are still saved, and the deepest layers' weight
gradients (the largest) are cast before it; in a deep MLP with small activations the peak
is at the end, where all gradients are alive anyway.  And a compiler may emit adjacent
casts as one kernel (inductor's C++ backend does), which allocates all of their outputs
before any input is freed.

:func:`defer_widening_output_casts` compares the two orders with :func:`fxad.memory.simulate`
(modelling that grouping when asked) and moves the casts to the end only where the simulated
peak is lower.
"""
from __future__ import annotations

import torch.fx as fx

from ..graph.proxy import widens
from ..memory import simulate

__all__ = ["defer_widening_output_casts", "is_widening_output_cast"]


def is_widening_output_cast(node: fx.Node) -> bool:
    """``x.to(dtype)`` into a wider floating dtype whose only reader is the graph output."""
    if node.op != "call_method" or node.target != "to" or not node.args:
        return False
    users = list(node.users)
    return len(users) == 1 and users[0].op == "output" and widens(node)


def defer_widening_output_casts(graph: fx.Graph, *, grouped: bool = True) -> int:
    """Move the widening output casts (:func:`is_widening_output_cast`) to just before the
    output, keeping their order, if :func:`fxad.memory.simulate` gives that order a lower
    peak than the current one; ``grouped``: adjacent casts run as one kernel (inductor's C++
    backend).  Returns the number of casts moved (0: the order is unchanged)."""
    casts = [n for n in graph.nodes if is_widening_output_cast(n)]
    if not casts:
        return 0
    group = is_widening_output_cast if grouped else None
    nodes = [n for n in graph.nodes if n.op != "output"]
    moved = set(casts)
    deferred = [n for n in nodes if n not in moved] + casts
    before = simulate(graph, group, nodes).peak_bytes
    after = simulate(graph, group, deferred).peak_bytes
    if after >= before:
        return 0
    out = graph.output_node()
    for n in casts:
        out.prepend(n)
    return len(casts)
