"""Activation checkpointing regions: the forward nodes whose values the backward recomputes
whatever the residual policy.

A region is a ``torch.utils.checkpoint`` call of the model (``node.meta['fxad_checkpoint']``,
set by the capture) or a submodule a :class:`Checkpoint` selects
(:func:`checkpoint_candidates`); :func:`checkpoint_regions` finds them in a VJP graph.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import torch.fx as fx

from ..errors import InputError

__all__ = ["Checkpoint", "as_checkpoint", "checkpoint_candidates", "checkpoint_regions"]


@dataclass
class Checkpoint:
    """Activation checkpointing chosen at the model level (``checkpoint=`` of
    :func:`fxad.residuals.partition`, :func:`fxad.compile`, :func:`fxad.joint_step`).

    The forward values computed inside a checkpointed submodule are recomputed in the
    backward instead of being saved; only what enters the submodule (and what leaves it,
    when the code after it needs that) is saved, as ``torch.utils.checkpoint`` around the
    submodule's call would do.

    Attributes:
        modules: which submodules are candidates: a module class or a tuple of classes
            (every instance, e.g. ``Block``), or module names as in ``named_modules()``
            (``["blocks.0", "blocks.3"]``).  Candidates are ordered as the forward first
            runs them.
        every: checkpoint every ``every``-th candidate (``1``: all of them; ``2``: the 1st,
            3rd, 5th, ...).
        budget: instead of ``every``: a memory budget in bytes.  The fewest leading
            candidates are checkpointed (the first ``j``, found by bisection) for which the
            simulated peak of the training step (:func:`fxad.memory.simulate` of
            :func:`fxad.residuals.joint_graph`: the tensors allocated during the step, not
            the parameters or inputs) is at most ``budget``; if even all of them do not
            reach it, all are checkpointed and a warning says so.  The leading blocks are
            chosen because their activations live longest and their recomputation runs at
            the end of the backward, where the least memory is in use.
        user_regions: also honour the model's own ``torch.utils.checkpoint`` regions
            (captured as ``node.meta['fxad_checkpoint']``).
    """

    modules: Any = None
    every: int = 1
    budget: int | None = None
    user_regions: bool = True

    def __post_init__(self) -> None:
        if self.every < 1:
            raise InputError(f"Checkpoint(every={self.every}): must be 1 or more")
        if self.budget is not None and self.budget < 0:
            raise InputError(f"Checkpoint(budget={self.budget}): must be a number of bytes >= 0")
        if self.modules is None and (self.budget is not None or self.every != 1):
            raise InputError("Checkpoint(every=/budget=) needs modules=: a module class (e.g. "
                             "your transformer block) or a list of module names")


def as_checkpoint(checkpoint: "Checkpoint | bool | None") -> "Checkpoint | None":
    """``None``/``True``: the user's ``torch.utils.checkpoint`` regions only; ``False``: no
    regions at all; a :class:`Checkpoint` as given."""
    if checkpoint is None or checkpoint is True:
        return Checkpoint()
    if checkpoint is False:
        return None
    if isinstance(checkpoint, Checkpoint):
        return checkpoint
    raise InputError(f"checkpoint={checkpoint!r}: use a fxad.residuals.Checkpoint, True/None "
                     "(honour torch.utils.checkpoint regions) or False (ignore them)")


def _origin_meta(vjp_gm: fx.GraphModule) -> Any:
    """``node -> meta`` of the captured node a forward node of the VJP graph comes from (the
    node a rule's ``fwd`` wrote it for, ``meta['fxad_fwd_of']``, in the captured graph
    ``vjp_gm.meta['fxad_forward']``), else the node's own meta."""
    fw = vjp_gm.meta.get("fxad_forward")
    by_name = {n.name: n for n in fw.graph.nodes} if isinstance(fw, fx.GraphModule) else {}

    def meta_of(n: fx.Node) -> dict:
        o = n.meta.get("fxad_fwd_of")
        if o is not None and o in by_name:
            return by_name[o].meta
        return n.meta
    return meta_of


def _module_path_entries(meta: dict) -> list[tuple[str, Any]]:
    """``(module path, module class)`` of each entry of ``meta['nn_module_stack']``."""
    out = []
    for k, v in (meta.get("nn_module_stack") or {}).items():
        if isinstance(v, tuple) and len(v) == 2:
            out.append((str(v[0]), v[1]))
        else:
            out.append((str(k), v))
    return out


def _class_matches(cls: Any, wanted: tuple) -> bool:
    if isinstance(cls, type):
        return issubclass(cls, wanted)
    name = str(cls)  # some captures record the class as a string
    return any(name in (t.__name__, t.__qualname__, f"{t.__module__}.{t.__qualname__}")
               for t in wanted)


def checkpoint_candidates(vjp_gm: fx.GraphModule, modules: Any) -> list[str]:
    """Module paths of the graph's forward nodes matching ``modules`` (a class, a tuple of
    classes or module names), in the order the forward first reaches them."""
    meta_of = _origin_meta(vjp_gm)
    if isinstance(modules, type) or (isinstance(modules, tuple) and modules
                                     and all(isinstance(t, type) for t in modules)):
        wanted = modules if isinstance(modules, tuple) else (modules,)

        def match(path: str, cls: Any) -> bool:
            return _class_matches(cls, wanted)
    else:
        names = [modules] if isinstance(modules, str) else list(modules)
        if not all(isinstance(x, str) for x in names):
            raise InputError("Checkpoint(modules=...): a module class, a tuple of classes, or "
                             "module names (strings) as in named_modules()")
        name_set = set(names)

        def match(path: str, cls: Any) -> bool:
            return path in name_set
    found: dict[str, None] = {}
    for n in vjp_gm.graph.nodes:
        if n.op == "output" or n.meta.get("fxad_bwd_of") is not None:
            continue
        for path, cls in _module_path_entries(meta_of(n)):
            if path not in found and match(path, cls):
                found[path] = None
    return list(found)


def checkpoint_regions(vjp_gm: fx.GraphModule, forward_nodes: list[fx.Node],
                       user_regions: bool = True, modules: Iterable[str] = ()
                       ) -> list[tuple[str, list[fx.Node]]]:
    """The activation-checkpointing regions of the forward nodes ``forward_nodes`` (in graph
    order): ``[(label, nodes), ...]`` in forward order.

    A node belongs to a region when its captured node carries ``meta['fxad_checkpoint']``
    (the id of the innermost ``torch.utils.checkpoint`` call it was recorded in; with
    ``user_regions``) or was recorded inside one of the submodules ``modules`` (paths, from
    ``meta['nn_module_stack']``).  Regions whose spans in the forward order overlap (a call
    nested in another, a checkpointed call inside a checkpointed module) are merged into the
    outermost one, which is what ``torch.utils.checkpoint`` recomputes; every forward node
    within a merged span belongs to it."""
    meta_of = _origin_meta(vjp_gm)
    mods = set(modules)
    pos = {n: i for i, n in enumerate(forward_nodes)}
    spans: dict[Any, list[int]] = {}
    names: dict[Any, str] = {}
    for n in forward_nodes:
        if n.op in ("placeholder", "get_attr", "output"):
            continue
        m = meta_of(n)
        labels = []
        rid = m.get("fxad_checkpoint", n.meta.get("fxad_checkpoint")) if user_regions else None
        if rid is not None:
            labels.append(("user", rid))
            names[("user", rid)] = f"torch.utils.checkpoint #{rid}"
        if mods:
            for path, _ in _module_path_entries(m):
                if path in mods:
                    labels.append(("module", path))
                    names[("module", path)] = path
                    break
        for lab in labels:
            sp = spans.setdefault(lab, [pos[n], pos[n]])
            sp[1] = pos[n]
    merged: list[tuple[int, int, list[Any]]] = []
    for lab, (a, b) in sorted(spans.items(), key=lambda kv: (kv[1][0], -kv[1][1])):
        if merged and a <= merged[-1][1]:
            lo, hi, labs = merged[-1]
            merged[-1] = (lo, max(hi, b), labs + [lab])
        else:
            merged.append((a, b, [lab]))
    out = []
    for a, b, labs in merged:
        label = " + ".join(names[x] for x in labs)
        out.append((label, [n for n in forward_nodes[a:b + 1]
                            if n.op not in ("placeholder", "get_attr", "output")]))
    return out
