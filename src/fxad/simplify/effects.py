"""Ordering pass for the side effects a captured program keeps.

A program that mutates its input (``x.mul_(2)``) is captured functionally, with one
write-back ``x.copy_(new_x)`` at the end of its forward graph (``meta['fxad_input_mutation']``,
see :mod:`fxad.capture.tracer`).  Derivative code that is appended after the forward part may
still read the input's original value (``d_y = d * x``), so the write-back has to stay the
last statement of the whole generated function: :func:`input_mutations_last` moves it there.
"""
from __future__ import annotations

import torch.fx as fx

__all__ = ["input_mutations_last"]


def input_mutations_last(graph: fx.Graph) -> int:
    """Move every input write-back node just before the graph's output; returns how many
    were moved.

    >>> import torch, fxad
    >>> def f(x):
    ...     x.mul_(2)
    ...     return x.sum()
    >>> g = fxad.grad(f, torch.randn(3))
    >>> g.code.strip().splitlines()[-2].strip().startswith("copy_ = x.copy_(")
    True
    """
    out = next(n for n in reversed(graph.nodes) if n.op == "output")
    moved = 0
    for n in [n for n in graph.nodes if n.meta.get("fxad_input_mutation")]:
        if n.next is out:
            continue
        out.prepend(n)
        moved += 1
    return moved
