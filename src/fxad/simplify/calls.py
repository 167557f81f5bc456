"""Cheaper spellings of the same calls, for generated code that is run rather than read.

``x.to(torch.float32)`` becomes ``x.float()`` (and ``torch.bfloat16`` / ``torch.float16`` /
``torch.float64`` become ``.bfloat16()`` / ``.half()`` / ``.double()``): the same operation
(each of those methods is ``to(dtype)`` with the default ``memory_format``), but Python's
argument parser for ``Tensor.to`` tries its overloads (a device, a dtype, another tensor) in
turn, which costs about 2 us more per call on the 2-core CPU, and a training step under
autocast casts every weight down and every weight gradient back up: 40 casts per step of the
8-layer MLP benchmark.

Not in :data:`fxad.simplify.PASSES`: the other passes recognize casts by ``to``.
:func:`fxad.compile` applies it to the two graphs it runs.
"""
from __future__ import annotations

import torch
import torch.fx as fx

__all__ = ["cast_methods"]

_DTYPE_METHODS = {torch.float32: "float", torch.float64: "double", torch.float16: "half",
                  torch.bfloat16: "bfloat16"}


def cast_methods(gm: fx.GraphModule) -> int:
    """Rewrite ``x.to(dtype)`` (one positional floating dtype, no keywords) to the dtype's
    own method in ``gm`` and recompile it; returns the number of calls rewritten."""
    changed = 0
    for n in gm.graph.nodes:
        if n.op == "call_method" and n.target == "to" and len(n.args) == 2 and not n.kwargs \
                and isinstance(n.args[1], torch.dtype) and n.args[1] in _DTYPE_METHODS:
            n.target = _DTYPE_METHODS[n.args[1]]
            n.args = (n.args[0],)
            changed += 1
    if changed:
        gm.recompile()
    return changed
