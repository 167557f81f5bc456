"""Simulated tensor memory of a graph run in node order, from the shapes in ``meta['val']``.

:func:`simulate` walks an FX graph once, as its generated code runs it, and tracks which
storages are alive: a node that computes a tensor allocates ``numel * itemsize`` bytes
(``meta['val']``, :func:`nbytes`), a view (:func:`is_view`: its op record's kind is
``"view"``, and ``getitem`` of a multi-output node) shares its base's
storage, and a storage is freed after the last node that reads it or any of its views (graph
outputs live to the end).  Placeholders and ``get_attr`` reads (inputs, parameters, buffers)
are owned by the caller and count 0 bytes.

It is an estimate, not a measurement: a compiler that fuses elementwise ops never allocates
their intermediates, and an allocator rounds sizes.  It serves to compare two orders of the
same graph (:func:`fxad.simplify.schedule.defer_widening_output_casts`), where what differs
is when the same values are alive.  Grouped kernels are modelled where asked: inductor's C++
backend emits a run of adjacent elementwise nodes as one kernel, which allocates all of its
outputs before any of its inputs is freed; ``group_runs`` (a predicate on nodes) marks the
nodes such a run is made of, and the inputs of a run stay alive until its last node.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Callable

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from .graph.sizes import size_hint
from .rules.registry import kind_of

__all__ = ["MemoryEstimate", "simulate", "nbytes", "is_view"]


@dataclass
class MemoryEstimate:
    """Result of :func:`simulate`.

    Attributes:
        peak_bytes: the largest number of bytes alive at once (bytes, from ``meta['val']``).
        peak_node: the name of the node at which that peak is reached.
        live_at_peak: names of the nodes whose storages are alive at the peak, largest first.
        bytes_per_node: bytes alive right after each node runs, in graph order.
    """

    peak_bytes: int
    peak_node: str
    live_at_peak: list[str]
    bytes_per_node: list[int]


def nbytes(node: fx.Node) -> int:
    """Bytes of a node's value from ``meta['val']`` (0 for non-tensor values; symbolic sizes
    at the example inputs' values)."""
    return sum(size_hint(v.numel()) * v.element_size()
               for v in pytree.tree_leaves(node.meta.get("val"))
               if isinstance(v, torch.Tensor))


def is_view(node: fx.Node) -> bool:
    """Whether ``node``'s value shares its first input's storage: a view op
    (kind ``"view"`` in the op record, :func:`fxad.rules.registry.kind_of`) or ``getitem`` of a multi-output node."""
    if node.op == "call_function" and node.target is operator.getitem:
        return True
    return node.op in ("call_function", "call_method") and kind_of(node) == "view"


def simulate(graph: fx.Graph,
             group_runs: Callable[[fx.Node], bool] | None = None,
             order: list[fx.Node] | None = None) -> MemoryEstimate:
    """Simulate the tensor memory of running ``graph`` in its node order, or in ``order``
    (all its nodes but the output, in a topological order), without changing the graph (see
    the module docstring).  ``group_runs(node)``: nodes that a compiler emits as one kernel
    when they are adjacent; the storages a run reads stay alive until its last node.

    Returns:
        :class:`MemoryEstimate`.  Nodes without ``meta['val']`` count 0 bytes.
    """
    nodes = list(order) if order is not None else [n for n in graph.nodes if n.op != "output"]
    pos = {n: i for i, n in enumerate(nodes)}
    root: dict[fx.Node, fx.Node] = {}  # node -> the node that allocated its storage
    size: dict[fx.Node, int] = {}
    for n in nodes:
        if n.op in ("placeholder", "get_attr"):
            root[n], size[n] = n, 0
        elif is_view(n) and n.all_input_nodes:
            root[n] = root[n.all_input_nodes[0]]
        else:
            root[n], size[n] = n, nbytes(n)
    end = len(nodes)
    run_end: dict[fx.Node, int] = {}  # a grouped node -> index of the last node of its run
    if group_runs is not None:
        i = 0
        while i < end:
            j = i
            while j < end and group_runs(nodes[j]):
                j += 1
            for k in range(i, j):
                run_end[nodes[k]] = j - 1
            i = max(j, i + 1)
    last: dict[fx.Node, int] = {}
    for n in nodes:
        r = root[n]
        last[r] = max(last.get(r, pos[n]), pos[n])
        for a in n.all_input_nodes:
            ra = root[a]
            last[ra] = max(last.get(ra, 0), run_end.get(n, pos[n]))
    for a in graph.output_node().all_input_nodes:
        last[root[a]] = end
    free_at: dict[int, list[fx.Node]] = {}
    for r, i in last.items():
        free_at.setdefault(i, []).append(r)
    alive = 0
    per_node: list[int] = []
    for i, n in enumerate(nodes):
        if root[n] is n:
            alive += size[n]
        per_node.append(alive)  # before the frees after node i
        for r in free_at.get(i, ()):
            alive -= size[r]
    if not nodes:
        return MemoryEstimate(peak_bytes=0, peak_node="", live_at_peak=[], bytes_per_node=[])
    peak_i = max(range(end), key=per_node.__getitem__)  # the first node at the peak
    live = sorted((r for r in last if size[r] and pos[r] <= peak_i <= last[r]),
                  key=lambda r: (-size[r], pos[r]))
    return MemoryEstimate(peak_bytes=per_node[peak_i], peak_node=nodes[peak_i].name,
                          live_at_peak=[r.name for r in live], bytes_per_node=per_node)
