"""Simplifier: small graph passes run to a fixed point.

Each pass takes an ``fx.Graph`` whose nodes carry ``meta['val']`` and returns the number of
rewrites it made.  :func:`simplify` runs them in order until none changes anything.

* :mod:`.dce` — dead-code elimination (keeps side effects such as buffer updates)
* :mod:`.cse` — common-subexpression elimination (never merges random ops)
* :mod:`.algebra` — zero/one propagation: ``0 + t``, ``t * 1``, ``-(-t)``, ``t / 1`` ...
* :mod:`.shapes` — redundant reshape / expand / transpose / cast folding

Not in :data:`PASSES`: :mod:`.inplace` (cotangent sums accumulated in place), which makes a
graph mutate tensors, and :mod:`.layout` (channels-last convolution weights on the CPU),
which changes strides that other passes read from stale ``meta['val']``; both are applied
only to code that is run, not transformed again.
"""
from __future__ import annotations

import torch.fx as fx

from .algebra import fold_algebra
from .cse import cse
from .dce import dce
from .shapes import fold_shapes

PASSES = (dce, cse, fold_algebra, fold_shapes)


def simplify(graph: fx.Graph, *, max_rounds: int = 20) -> int:
    """Run all passes until a fixed point; returns the total number of rewrites."""
    total = 0
    for _ in range(max_rounds):
        changed = sum(p(graph) for p in PASSES)
        total += changed
        if not changed:
            break
    graph.lint()
    return total


__all__ = ["simplify", "dce", "cse", "fold_algebra", "fold_shapes", "PASSES"]
