"""Regional compilation of a joint training step: compile each repeated block once.

A transformer's joint graph (:func:`fxad.residuals.joint_graph`) holds the same layer N
times in its forward and N times in its backward.  Handing the whole graph to inductor
compiles every copy: on the small GPT-2 benchmark (4 layers) inductor's code generation and
C++ compilation are ~95% of :func:`fxad.training.joint_step`'s set-up.  Here the graph is
cut into *regions*, and regions that compute the same thing on inputs of the same shapes,
strides and dtypes share one compiled function:

1. :func:`tag_blocks` labels each node of the VJP graph (before the residual partition)
   with the repeated block it was captured in: the outermost module of its
   ``nn_module_stack`` whose path ends in a list index (``transformer.h.3``,
   ``encoder.layer.0``, ``layers.2``); a backward node takes the block of the forward node
   it differentiates (``meta['fxad_bwd_of']``).  Nodes outside every indexed module (the
   embeddings, the head, the loss) are labelled ``""``; nodes with no module information
   (guards and helpers inserted by passes) are left unlabelled.
2. :func:`plan_regions` walks the joint graph in order and cuts it into runs: maximal
   sequences of call nodes with the same ``(block, phase)`` key, where the phase is forward
   or backward by position (the backward's recomputations of forward values belong to the
   backward).  Labels are corrected first (:func:`_labels`: nodes without module
   information, values shared by many blocks such as an attention mask, recomputations);
   parameter reads (``get_attr``) become inputs of the region and do not cut a run, and
   glue found inside a block's run that neither reads the run nor has side effects runs
   before the region, which goes on after it.
3. Each run becomes a graph module of its own (inputs in first-use order, the values read
   after the run as outputs).  Runs are grouped by a structural signature: the ops, their
   constant arguments, how each argument is wired (which input, which earlier node), which
   nodes are outputs, and the shape, stride, dtype and device of every input.  One module
   per group is compiled; every run of the group calls it.
4. The driver (:func:`regional_graph`, a :class:`torch.fx.GraphModule`) runs the glue
   between regions (the nodes labelled ``""``) as plain PyTorch and calls the compiled
   regions.

Correctness does not depend on the labels: every run is an exact slice of the joint graph
in its own order (the only nodes moved are pure glue that reads nothing of the run), and two
runs share a compiled function only when their graphs are the same up to the names of their
nodes.  Labels only decide how much is shared.

What is given up: inductor cannot fuse across a region's border (the forward's last
elementwise op with the backward's first, a layer's last with the next one's first); the
glue (an embedding, the output layer's product, the loss) runs uncompiled; and each region
call checks dynamo's guards (tens of microseconds).
"""
from __future__ import annotations

import operator
import re
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from ..residuals.regions import _module_path_entries, _origin_meta
from ..simplify._util import is_impure, is_random

__all__ = ["tag_blocks", "plan_regions", "regional_graph", "RegionPlan"]

_INDEXED = re.compile(r"\.\d+$")
_CALLS = ("call_function", "call_method", "call_module")
_BLOCK = "fxad_block"


def _block_of(meta: dict) -> str | None:
    """The outermost indexed module path of ``meta['nn_module_stack']``; ``""`` outside any
    indexed module; ``None`` without module information."""
    entries = _module_path_entries(meta)
    if not entries:
        return None
    for path, _ in entries:
        if _INDEXED.search(path):
            return path
    return ""


def tag_blocks(vjp_gm: fx.GraphModule) -> int:
    """Label each node of ``vjp_gm`` (a VJP graph, before the residual partition) with its
    repeated block in ``node.meta['fxad_block']`` (see the module docstring): a forward
    node by the captured node it computes (``meta['fxad_fwd_of']``), a backward node by the
    captured node it differentiates (``meta['fxad_bwd_of']``, a name in the captured graph
    ``vjp_gm.meta['fxad_forward']``).

    Returns:
        The number of distinct blocks found.
    """
    meta_of = _origin_meta(vjp_gm)
    fw = vjp_gm.meta.get("fxad_forward")
    captured = {n.name: n for n in fw.graph.nodes} if isinstance(fw, fx.GraphModule) else {}
    found: set[str] = set()
    for n in vjp_gm.graph.nodes:
        of = n.meta.get("fxad_bwd_of")
        if of is None:
            b = _block_of(meta_of(n))
        else:
            b = _block_of(captured[of].meta) if isinstance(of, str) and of in captured \
                else None
        if b is not None:
            n.meta[_BLOCK] = b
            found.add(b)
    return len(found - {""})


def _first_backward(nodes: list[fx.Node]) -> int:
    for i, n in enumerate(nodes):
        if n.op in _CALLS and n.meta.get("fxad_bwd_of") is not None:
            return i
    return len(nodes)


def _labels(nodes: list[fx.Node]) -> dict[fx.Node, str | None]:
    """Each call node's block (``meta['fxad_block']``), with three corrections:

    * a node without module information takes the block of its first labelled user (the
      transpose at a block's start, written by a rule without the module stack), else
      ``None`` (a guard, read by nothing: it stays with its neighbours);
    * a value read in three or more blocks (an attention mask computed in the first layer
      and read by all), and a value read only by such values (and by its recomputation in
      the backward), is glue, ``""``, so that the first layer's region equals the others;
    * a forward value the backward recomputes takes the block of its first labelled user
      (the backward region that needs it), not the block of its forward twin; read by
      three or more blocks' backward regions, it is glue (so that the first backward
      region does not compute it for the others and differ from them).
    """
    def in_many_blocks(blocks: Any) -> bool:
        return len(set(blocks) - {None, ""}) >= 3

    out: dict[fx.Node, str | None] = {}
    shared: set[fx.Node] = set()
    for n in reversed(nodes):
        if n.op not in _CALLS:
            continue
        b = n.meta.get(_BLOCK)
        recomputed = n.meta.get("fxad_recomputed")
        if recomputed and in_many_blocks(out.get(u) for u in n.users):
            shared.add(n)  # a recomputed shared value (the mask's float form): glue too
            b = ""
        elif b is None or recomputed:
            b = next((out[u] for u in n.users if out.get(u) is not None), None)
        elif in_many_blocks(u.meta.get(_BLOCK) for u in n.users) \
                or (any(u in shared for u in n.users)
                    and all(u in shared or u.meta.get("fxad_recomputed") for u in n.users)):
            shared.add(n)  # and what only shared values (or their recomputations) read
            b = ""
        out[n] = b
    return out


def _runs(nodes: list[fx.Node]) -> list[tuple[Any, list[fx.Node]]]:
    """Maximal runs of call nodes by ``(block, phase)``; glue runs have key ``None``."""
    boundary = _first_backward(nodes)
    labels = _labels(nodes)
    runs: list[tuple[Any, list[fx.Node]]] = []
    for i, n in enumerate(nodes):
        if n.op not in _CALLS:
            continue
        b = labels[n]
        if b is None:  # no module information: stays with its neighbours
            key = runs[-1][0] if runs else None
        else:
            key = (b, "backward" if i >= boundary else "forward") if b else None
        if runs and runs[-1][0] == key:
            runs[-1][1].append(n)
        elif len(runs) >= 2 and key is not None and runs[-1][0] is None \
                and runs[-2][0] == key and _can_run_before(runs[-1][1], runs[-2][1]):
            glue = runs.pop()  # glue inside a block's run that does not read the run:
            runs[-1][1].append(n)  # it runs before the region, which goes on
            runs.insert(len(runs) - 1, glue)
        else:
            runs.append((key, [n]))
    return runs


def _can_run_before(glue: list[fx.Node], run: list[fx.Node]) -> bool:
    """Whether ``glue`` (nodes after ``run`` in the graph) may run before it: no node of
    ``glue`` reads one of ``run``, draws random numbers or has a side effect, and no node of
    ``run`` has one (an in-place update ``glue`` might read)."""
    members = set(run)
    return not any(is_impure(n) or is_random(n) for n in glue) \
        and not any(is_impure(n) for n in run) \
        and not any(a in members for n in glue for a in n.all_input_nodes)


def _leaf_signature(x: Any) -> Any:
    if isinstance(x, torch.Tensor):  # a constant tensor argument: by identity
        return ("tensor", id(x))
    if isinstance(x, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return str(x)
    if isinstance(x, slice):
        return ("slice", x.start, x.stop, x.step)
    try:
        hash(x)
    except TypeError:
        return ("unhashable", repr(x))
    return (type(x).__name__, x)


def _value_signature(v: Any) -> Any:
    if isinstance(v, torch.Tensor):  # sizes as text: symbolic ones (SymInt) do not hash
        return (str(tuple(v.shape)),
                str(tuple(v.stride())) if v.layout == torch.strided else None,
                str(v.dtype), str(v.device))
    return ("value", type(v).__name__, repr(v))


class _Region:
    """One run: its inputs (external nodes in first-use order), outputs (its nodes read
    outside it) and structural signature."""

    def __init__(self, label: str, run: list[fx.Node]) -> None:
        self.label = label
        self.nodes = run
        members = set(run)
        index: dict[fx.Node, Any] = {}
        self.inputs: list[fx.Node] = []

        def ref(a: fx.Node) -> Any:
            if a in members:
                return ("node", index[a])
            if a not in index:
                index[a] = ("input", len(self.inputs))
                self.inputs.append(a)
            return index[a]

        body = []
        for k, n in enumerate(run):
            args = pytree.tree_map(lambda a: ref(a) if isinstance(a, fx.Node) else
                                   _leaf_signature(a), (n.args, n.kwargs))
            target = n.target if n.op != "call_module" else ("module", n.target)
            body.append((n.op, target, repr(pytree.tree_structure(args)),
                         tuple(pytree.tree_leaves(args))))
            index[n] = k
        self.outputs = [n for n in run if any(u not in members for u in n.users)]
        ins = tuple(_value_signature(a.meta.get("val")) for a in self.inputs)
        outs = tuple(index[n] for n in self.outputs)
        self.signature = (tuple(body), ins, outs)

    def module(self, root: torch.nn.Module) -> fx.GraphModule:
        g = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        for i, a in enumerate(self.inputs):
            env[a] = g.placeholder(f"input_{i}")
            env[a].meta = dict(a.meta)
        for n in self.nodes:
            env[n] = g.node_copy(n, lambda a: env[a])
        g.output(tuple(env[n] for n in self.outputs))
        return fx.GraphModule(root, g, class_name="Region")


@dataclass
class RegionPlan:
    """How a joint graph cuts into regions (:func:`plan_regions`).

    Attributes:
        regions: the runs of the repeated blocks, in graph order.
        group_of: for each region, the index of the group of equal regions it belongs to
            (one compiled function per group).
        glue_nodes: the number of call nodes outside every region (run uncompiled).
    """
    regions: list[_Region] = field(default_factory=list)
    group_of: list[int] = field(default_factory=list)
    glue_nodes: int = 0

    @property
    def groups(self) -> int:
        """How many distinct region functions there are to compile."""
        return len(set(self.group_of))

    @property
    def region_nodes(self) -> int:
        return sum(len(r.nodes) for r in self.regions)

    def compiled_nodes(self) -> int:
        """Call nodes compiled: one region of each group."""
        first: dict[int, _Region] = {}
        for r, k in zip(self.regions, self.group_of):
            first.setdefault(k, r)
        return sum(len(r.nodes) for r in first.values())

    def summary(self) -> str:
        return (f"{len(self.regions)} regions in {self.groups} groups "
                f"({self.compiled_nodes()} of {self.region_nodes} region nodes compiled, "
                f"{self.glue_nodes} glue nodes run uncompiled)")


def plan_regions(gm: fx.GraphModule) -> RegionPlan:
    """Cut ``gm`` (a joint graph whose VJP graph went through :func:`tag_blocks`) into the
    runs of its repeated blocks and group equal runs (see the module docstring)."""
    nodes = list(gm.graph.nodes)
    plan = RegionPlan()
    groups: dict[Any, int] = {}
    for key, run in _runs(nodes):
        if key is None:
            plan.glue_nodes += len(run)
            continue
        r = _Region(f"{key[0]} {key[1]}", run)
        plan.regions.append(r)
        plan.group_of.append(groups.setdefault(r.signature, len(groups)))
    return plan


def regional_graph(gm: fx.GraphModule, plan: RegionPlan,
                   compile_region: Callable[[fx.GraphModule], Callable]) -> fx.GraphModule:
    """``gm`` as a driver graph that runs the glue of ``plan`` (:func:`plan_regions` of
    ``gm``) and calls one compiled function per group of equal regions.

    Args:
        gm: the joint graph; it is not changed.
        plan: its regions.
        compile_region: compiles one region's graph module (e.g. ``torch.compile``); called
            once per group, on the group's first region.

    Returns:
        The driver: ``driver(*inputs)`` returns what ``gm`` returns; its submodule
        ``region_<k>`` is group ``k``'s compiled function, each region's call is followed by
        its outputs under their names in ``gm``.
    """
    root = torch.nn.Module()
    for name, mod in gm.named_children():
        root.add_module(name, mod)
    by_end: dict[fx.Node, tuple[_Region, int]] = {}
    for r, k in zip(plan.regions, plan.group_of):
        if not hasattr(root, f"region_{k}"):
            root.add_module(f"region_{k}", _Compiled(compile_region(r.module(gm)), r.label))
        by_end[r.nodes[-1]] = (r, k)  # every input of a region is computed by its end
    inside = {n for r in plan.regions for n in r.nodes}
    driver = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in gm.graph.nodes:
        if n in by_end:
            r, k = by_end[n]
            call = driver.call_module(f"region_{k}", tuple(env[a] for a in r.inputs))
            for j, o in enumerate(r.outputs):
                env[o] = driver.call_function(operator.getitem, (call, j))
                env[o].meta = dict(o.meta)
                env[o]._rename(o.name)
        elif n not in inside:
            env[n] = driver.node_copy(n, lambda a: env[a])
    driver.lint()
    return fx.GraphModule(root, driver, class_name="RegionalStep")


class _Compiled(torch.nn.Module):
    """A compiled region as a submodule of the driver (``label``: its first run)."""

    def __init__(self, fn: Callable, label: str) -> None:
        super().__init__()
        self.fn = fn
        self.label = label

    def forward(self, *args: Any) -> Any:
        return self.fn(*args)

    def extra_repr(self) -> str:
        return self.label
