"""The split of a VJP graph into a forward and a backward graph (:func:`partition`).

The split runs in named steps (:func:`_partition`):

1. :func:`_sort_nodes`: the forward nodes (what the outputs and the side effects need) and
   the backward nodes (tagged ``meta['fxad_bwd_of']`` or depending on a cotangent);
2. :func:`_regions_inside`: the activation-checkpointing regions and the values used only
   inside one;
3. :func:`_backward_reads`: the forward values the backward reads;
4. :func:`_choices` and :func:`~fxad.residuals.mincut.min_cut`: what each value may be
   (saved, recomputed, either), then which are saved and which recomputed;
5. :func:`_forward_graph`: the forward graph returning the outputs and the saved values;
6. :class:`_BackwardBuilder`: the backward graph, reading the saved values and cotangents,
   with the recomputed forward nodes emitted before their first use;
7. :func:`_block_headers` and :func:`_checkpoint_summary`: what each backward block saves,
   and what each region recomputes and saves, for the code's comments and the report.
"""
from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from .. import codegen
from ..errors import InputError
from ..memory import nbytes, simulate
from ..naming import op_kind
from ..simplify._util import is_impure, is_random, resolve
from .joint import joint_graph
from .mincut import min_cut
from .policy import Policy, as_policy, saved_cost
from .regions import Checkpoint, as_checkpoint, checkpoint_candidates, checkpoint_regions
from .report import CommentCodeGen, Partition, fmt_bytes, residual_kind, statements

__all__ = ["partition"]


def partition(vjp_gm: fx.GraphModule, policy: str | Policy | None = "min_memory", *,
              lift_params: bool = False,
              checkpoint: "Checkpoint | bool | None" = None) -> Partition:
    """Split the graph of ``fxad.vjp(model_or_fn, *inputs)`` into forward and backward graphs
    with the residual policy ``policy`` (see :mod:`fxad.residuals`).

    With ``lift_params``, the parameters that receive gradients are explicit inputs:
    ``fwd_gm(*inputs, *params)`` (``params`` in the order of ``param_names``), and the
    backward reads them as saved values (which cost no memory: the model holds them);
    otherwise both graphs read them from the module (``self.fc.weight``).

    Activation checkpointing (``checkpoint``; default: the model's own
    ``torch.utils.checkpoint(fn, ..., use_reentrant=False)`` regions, captured as
    ``node.meta['fxad_checkpoint']``): the forward values computed inside a region and used
    only inside it are recomputed in the backward instead of being saved, whatever the
    policy (random ops and ops with side effects excepted: they are saved); the region's
    inputs are saved, and so are its outputs where code after the region needs them, as
    ``torch.utils.checkpoint`` keeps them.  A :class:`Checkpoint` adds regions by submodule
    (every k-th block, or as many as a memory budget needs); ``False`` ignores all regions.
    ``part.checkpointed`` and ``part.report()`` list the regions, what each recomputes and
    the inputs it saves.
    """
    ck = as_checkpoint(checkpoint)
    if ck is None:
        return _partition(vjp_gm, policy, lift_params, False, [])
    if ck.modules is None:
        return _partition(vjp_gm, policy, lift_params, ck.user_regions, [])
    cands = checkpoint_candidates(vjp_gm, ck.modules)
    if not cands:
        raise InputError(f"Checkpoint(modules={ck.modules!r}): no forward node was recorded "
                         "inside a matching submodule")
    if ck.budget is None:
        part = _partition(vjp_gm, policy, lift_params, ck.user_regions, cands[::ck.every])
        return part

    peaks: dict[int, int] = {}

    def peak(j: int) -> int:
        if j not in peaks:
            p = _partition(vjp_gm, policy, False, ck.user_regions, cands[:j])
            peaks[j] = simulate(joint_graph(p).graph).peak_bytes
        return peaks[j]

    lo, hi = 0, len(cands)
    if peak(hi) > ck.budget:
        warnings.warn(f"fxad: Checkpoint(budget={ck.budget}): even with all {len(cands)} "
                      f"candidate modules checkpointed the simulated peak is {peak(hi)} bytes; "
                      "checkpointing all of them", stacklevel=2)
        lo = hi
    while lo < hi:  # the smallest j with peak(j) <= budget
        mid = (lo + hi) // 2
        if peak(mid) <= ck.budget:
            hi = mid
        else:
            lo = mid + 1
    part = _partition(vjp_gm, policy, lift_params, ck.user_regions, cands[:lo])
    part.checkpoint_note = (f"budget {fmt_bytes(ck.budget)}: {lo} of {len(cands)} candidate "
                            f"modules checkpointed, simulated step peak {fmt_bytes(peak(lo))} "
                            f"(none checkpointed: {fmt_bytes(peak(0))})")
    return part


def _partition(vjp_gm: fx.GraphModule, policy: str | Policy | None, lift_params: bool,
               user_regions: bool, ckpt_modules: list[str]) -> Partition:
    """The split with the checkpointing regions of the user (``user_regions``) and of the
    submodules ``ckpt_modules``, in the steps of the module docstring."""
    pol = as_policy(policy)
    result = vjp_gm.graph.output_node().args[0]
    if lift_params and len(result) > 2:
        vjp_gm = _lift_params(vjp_gm, list(dict(result[2])))
    g = _sort_nodes(vjp_gm)
    regions = checkpoint_regions(vjp_gm, g.fwd, user_regions, ckpt_modules) \
        if (user_regions or ckpt_modules) else []
    region_of, internal = _regions_inside(regions, g)
    needed = _backward_reads(g)
    choice = _choices(g.avail, pol, region_of, internal)
    saved, recompute = min_cut(g.avail, choice, needed, saved_cost)
    stmts = statements(vjp_gm)
    root = vjp_gm.meta.get("fxad_source_module") or vjp_gm
    fwd_gm = _forward_graph(g, saved, root)
    bwd = _BackwardBuilder(g, saved, recompute)
    bwd.build()
    blocks = _block_headers(g, bwd, stmts)
    bwd_gm = _backward_module(bwd.bg, g, saved, recompute, root)
    bwd_gm.saved_names = fwd_gm.saved_names  # type: ignore[assignment]
    return Partition(fwd_gm=fwd_gm, bwd_gm=bwd_gm, saved_names=[s.name for s in saved],
                     saved_bytes=sum(saved_cost(s) for s in saved),
                     recomputed=[n.name for n in g.avail if n in recompute],
                     n_outputs=len(g.out_leaves), out_spec=g.out_spec,
                     float_outputs=g.float_outputs, input_grads=bwd.input_grads,
                     param_names=bwd.param_names, param_has_grad=bwd.has_grad, blocks=blocks,
                     lifted_params=lift_params and bool(bwd.param_names), root=root,
                     checkpointed=_checkpoint_summary(regions, saved, recompute))


@dataclass
class _Nodes:
    """The nodes of a VJP graph, sorted (:func:`_sort_nodes`)."""

    graph: fx.Graph
    nodes: list[fx.Node]  # all of them, in graph order, the output last
    out_leaves: list[fx.Node]  # the outputs, flattened
    out_spec: Any
    in_grads: Any  # per input, its gradient node (or not a node: no gradient)
    param_grads: dict[str, Any]  # parameter name -> its gradient node (or not a node)
    inputs: list[fx.Node]  # the input placeholders
    cots: list[fx.Node]  # the cotangent placeholders
    extra_phs: list[fx.Node]  # other placeholders (``no_cotangent_k``: constant None)
    float_outputs: list[bool]  # per output leaf, whether it takes a cotangent
    depends_cot: set[fx.Node]  # the nodes that depend on a cotangent
    bwd: list[fx.Node]  # backward nodes, in graph order
    fwd: list[fx.Node]  # forward nodes (the other computing nodes), in graph order
    avail: list[fx.Node]  # what the backward can get by saving or recomputing: inputs + fwd


def _sort_nodes(vjp_gm: fx.GraphModule) -> _Nodes:
    """Step 1: backward = tagged ``meta['fxad_bwd_of']`` or depending on a cotangent, and
    not needed by the outputs or a side effect of the forward; forward = the rest."""
    nodes = list(vjp_gm.graph.nodes)
    out_node = nodes[-1]
    assert out_node.op == "output"
    result = out_node.args[0]
    outputs, in_grads = result[0], result[1]
    param_grads: dict[str, Any] = dict(result[2]) if len(result) > 2 else {}
    out_leaves, out_spec = pytree.tree_flatten(outputs)
    if not all(isinstance(x, fx.Node) and isinstance(x.meta.get("val"), torch.Tensor)
               for x in out_leaves):
        raise InputError("fxad.compile supports functions whose output is a tensor or a "
                         "tuple/list/dict of tensors")
    inputs = [n for n in nodes if n.op == "placeholder" and not n.meta.get("fxad_cotangent")
              and n.meta.get("val") is not None]
    cots = [n for n in nodes if n.op == "placeholder" and n.meta.get("fxad_cotangent")]
    extra_phs = [n for n in nodes if n.op == "placeholder" and n not in inputs and n not in cots]
    float_outputs = [x.meta["val"].is_floating_point() or x.meta["val"].is_complex()
                     for x in out_leaves]
    if sum(float_outputs) != len(cots):
        raise InputError("internal: cotangents do not match the floating outputs")
    depends_cot: set[fx.Node] = set(cots) | set(extra_phs)
    for n in nodes:
        if n.op != "placeholder" and any(a in depends_cot for a in n.all_input_nodes):
            depends_cot.add(n)
    need_fwd: set[fx.Node] = set()
    stack = list(out_leaves) + [n for n in nodes
                                if n.op not in ("placeholder", "output", "get_attr")
                                and is_impure(n) and not n.meta.get("fxad_bwd_of")
                                and n not in depends_cot]
    while stack:
        n = stack.pop()
        if n in need_fwd or n.op in ("placeholder", "get_attr"):
            continue
        need_fwd.add(n)
        stack.extend(n.all_input_nodes)
    if need_fwd & depends_cot:
        raise InputError("internal: a forward output depends on a cotangent")
    computing = ("call_function", "call_method", "call_module")
    bwd = [n for n in nodes if n.op in computing and n not in need_fwd
           and (n in depends_cot or n.meta.get("fxad_bwd_of") is not None)]
    bwd_set = set(bwd)
    fwd = [n for n in nodes if n.op in computing and n not in bwd_set]
    return _Nodes(graph=vjp_gm.graph, nodes=nodes, out_leaves=out_leaves, out_spec=out_spec,
                  in_grads=in_grads, param_grads=param_grads, inputs=inputs, cots=cots,
                  extra_phs=extra_phs, float_outputs=float_outputs, depends_cot=depends_cot,
                  bwd=bwd, fwd=fwd, avail=inputs + fwd)


def _regions_inside(regions: list[tuple[str, list[fx.Node]]], g: _Nodes
                    ) -> tuple[dict[fx.Node, int], set[fx.Node]]:
    """Step 2: ``(region_of, internal)``: the index of the activation-checkpointing region
    of each node in one, and the nodes used only inside their region (not outputs), which
    the backward recomputes."""
    region_of: dict[fx.Node, int] = {}
    for ri, (_, rn) in enumerate(regions):
        for n in rn:
            region_of[n] = ri
    fwd_set = set(g.fwd)
    out_set = set(g.out_leaves)
    internal: set[fx.Node] = set()
    for n, ri in region_of.items():
        if n not in out_set and all(region_of.get(u) == ri for u in n.users if u in fwd_set):
            internal.add(n)
    return region_of, internal


def _backward_reads(g: _Nodes) -> set[fx.Node]:
    """Step 3: the forward values (inputs and forward nodes) that the backward nodes read,
    and those returned as gradients."""
    avail = set(g.avail)
    grad_nodes = [x for x in list(g.in_grads) + list(g.param_grads.values())
                  if isinstance(x, fx.Node)]
    needed: set[fx.Node] = set()
    for n in g.bwd:
        needed.update(a for a in n.all_input_nodes if a in avail)
    needed.update(x for x in grad_nodes if x in avail)
    return needed


def _choices(avail: list[fx.Node], pol: Policy, region_of: dict[fx.Node, int],
             internal: set[fx.Node]) -> dict[fx.Node, str]:
    """Step 4: per value, ``"save"``, ``"recompute"`` or ``"cheap"`` (recomputable where
    that saves bytes): inputs, side effects and random ops are saved; the inside of a
    checkpointing region is recomputed and its outputs saved; the rest is the policy's."""
    choice: dict[fx.Node, str] = {}
    for v in avail:
        if v.op == "placeholder" or is_impure(v) or is_random(v):
            c = "save"
            if v.name in pol.by_node and pol.by_node[v.name] == "recompute":
                raise InputError(f"cannot recompute `{v.name}`: it is an input, has a side "
                                 "effect or is random")
        elif v in internal and pol.by_node.get(v.name) != "save":
            c = "recompute"  # inside an activation-checkpointing region
        elif v in region_of and v.name not in pol.by_node:
            # a region's output is kept as computed (as torch.utils.checkpoint's outputs
            # are): recomputing it would recompute the region's insides early in the
            # backward and keep them alive until the region's own backward
            c = "save"
        else:
            c = pol.choice(v)
        choice[v] = c
    return choice


def _forward_graph(g: _Nodes, saved: list[fx.Node], root: Any) -> fx.GraphModule:
    """Step 5: ``fwd_gm(*inputs) -> (*outputs, *saved)``: the nodes the outputs, the saved
    values and the side effects need."""
    keep: set[fx.Node] = set()
    stack = list(g.out_leaves) + saved + [n for n in g.fwd if is_impure(n)]
    while stack:
        n = stack.pop()
        if n in keep:
            continue
        keep.add(n)
        stack.extend(n.all_input_nodes)
    fg = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in g.nodes:
        if n in g.inputs or (n in keep and n.op != "placeholder"):
            env[n] = fg.node_copy(n, lambda a: env[a])
    # an input the program mutates is written back at the end of the forward (copy_): a
    # backward that reads its value before the mutation gets a copy taken just before that
    writes = {n.args[0]: env[n] for n in g.nodes
              if n.meta.get("fxad_input_mutation") and n in env}
    saved_out = []
    for s_ in saved:
        if s_ in writes:
            with fg.inserting_before(writes[s_]):
                c = fg.call_method("clone", (env[s_],))
            c.meta = dict(s_.meta)
            saved_out.append(c)
        else:
            saved_out.append(env[s_])
    fg.output(tuple(env[x] for x in g.out_leaves) + tuple(saved_out))
    saved_total = sum(saved_cost(s) for s in saved)
    fg._codegen = CommentCodeGen(
        tail=f"# saved for backward ({len(saved)} values, {fmt_bytes(saved_total)}): "
             + ", ".join(s.name for s in saved))
    codegen.install(fg)
    fwd_gm = fx.GraphModule(root, fg, class_name="ForwardGraph")
    fwd_gm.saved_names = [s.name for s in saved]  # type: ignore[assignment]
    return fwd_gm


def _block_label(n: fx.Node) -> str:
    of = n.meta.get("fxad_bwd_of")
    if of is None:
        return "(recomputed)"
    return of


class _BackwardBuilder:
    """Step 6: the backward graph: saved placeholders, cotangents, then the backward nodes
    with the recomputed forward nodes emitted lazily before their first use (under the
    header of the block that first needs them).  Records per block the saved values it
    reads and whether it recomputes."""

    def __init__(self, g: _Nodes, saved: list[fx.Node], recompute: set[fx.Node]) -> None:
        self.g = g
        self.saved = saved
        self.saved_set = set(saved)
        self.recompute = recompute
        self.bg = fx.Graph()
        self.env: dict[fx.Node, fx.Node] = {}
        self.block_reads: dict[str, list[fx.Node]] = {}
        self.block_recomputes: set[str] = set()  # blocks that recompute forward values
        self.input_grads: list[bool] = []
        self.param_names: list[str] = []
        self.has_grad: list[bool] = []

    def reads_saved(self, n: fx.Node, label: str) -> None:
        for a in n.all_input_nodes:
            if a in self.saved_set:
                lst = self.block_reads.setdefault(label, [])
                if a not in lst:
                    lst.append(a)

    def materialize(self, a: fx.Node, label: str) -> None:
        benv, bg = self.env, self.bg
        if a in benv:
            return
        if a.op == "get_attr":
            benv[a] = bg.node_copy(a)
            benv[a].meta = dict(a.meta)
            benv[a].meta["fxad_bwd_of"] = label
            return
        if a not in self.recompute:
            raise InputError(f"internal: `{a.name}` is neither saved nor recomputed")
        for x in a.all_input_nodes:
            self.materialize(x, label)
        self.reads_saved(a, label)
        self.block_recomputes.add(label)
        new = bg.node_copy(a, lambda x: benv[x])
        new.meta = dict(a.meta)
        new.meta["fxad_bwd_of"] = label
        new.meta["fxad_recomputed"] = True
        benv[a] = new

    def build(self) -> None:
        g, bg, benv = self.g, self.bg, self.env
        for s in self.saved:
            benv[s] = bg.placeholder(s.name)
            benv[s].meta.update(s.meta)
        for c in g.cots:
            benv[c] = bg.node_copy(c, lambda a: benv[a])
        for ph in g.extra_phs:  # `no_cotangent_k` placeholders of pytree outputs: constant None
            benv[ph] = None  # type: ignore[assignment]
        order = {n: i for i, n in enumerate(g.nodes)}
        for n in g.bwd:
            label = _block_label(n)
            for a in sorted(n.all_input_nodes, key=order.__getitem__):
                self.materialize(a, label)
            self.reads_saved(n, label)
            benv[n] = bg.node_copy(n, lambda x: benv[x])
        outs: list[Any] = []
        for gr in g.in_grads:
            if isinstance(gr, fx.Node):
                self.materialize(gr, "(gradient)")
                outs.append(benv[gr])
                self.input_grads.append(True)
            else:
                outs.append(None)
                self.input_grads.append(False)
        self.param_names = list(g.param_grads)
        for name in self.param_names:
            gr = g.param_grads[name]
            live = isinstance(gr, fx.Node) and gr in g.depends_cot
            self.has_grad.append(live)
            if live:
                outs.append(benv[gr])
            else:
                outs.append(None)
        bg.output(tuple(outs))


def _block_headers(g: _Nodes, bwd: _BackwardBuilder, stmts: dict[str, str]
                   ) -> list[tuple[str, list[str], int, str, str]]:
    """Step 7: each backward block's header becomes ``<forward statement>  [saved N B: a,
    b]``; returns the blocks of :attr:`Partition.blocks`."""
    graph = g.graph
    blocks: list[tuple[str, list[str], int, str, str]] = []
    fwd_by_name = {n.name: n for n in g.nodes}
    declared: dict[str, str] = {}
    for n in g.bwd:
        if "fxad_residuals" in n.meta:
            declared.setdefault(_block_label(n), n.meta["fxad_residuals"])
    emitted: dict[str, list[fx.Node]] = {}  # forward node name -> nodes its rule's fwd wrote
    for n in g.nodes:
        if "fxad_fwd_of" in n.meta:
            emitted.setdefault(n.meta["fxad_fwd_of"], []).append(n)
    def forward_of(label: str) -> tuple[fx.Node | None, str]:
        fname = resolve(graph, label)
        value = _forward_node(label, fname, fwd_by_name, emitted)
        return value, value.name if value is not None else fname

    relabel: dict[str, str] = {}
    for label, reads in bwd.block_reads.items():
        value, fname = forward_of(label)
        stmt = stmts.get(fname, fname)
        b = sum(saved_cost(r) for r in reads)
        kind = residual_kind(value, emitted.get(label, ()), reads)
        if label in bwd.block_recomputes:
            kind += " (recomputing)"
        names = [r.name for r in reads]
        blocks.append((stmt, names, b, kind, declared.get(label, "")))
        relabel[label] = f"{stmt}  [saved {fmt_bytes(b)}: {', '.join(names)}]"
    for n in bwd.bg.nodes:
        of = n.meta.get("fxad_bwd_of")
        if of is not None:
            n.meta = dict(n.meta)
            if of not in relabel:
                relabel[of] = stmts.get(forward_of(of)[1], of)
            n.meta["fxad_bwd_of"] = relabel[of]
    return blocks


def _forward_node(label: str, fname: str, fwd_by_name: dict[str, fx.Node],
                  emitted: dict[str, list[fx.Node]]) -> fx.Node | None:
    """The forward node of the graph whose statement a backward block of ``label`` (a
    node name of the captured graph) is headed by.  Where the rules kept the captured
    names, the node called ``fname`` (``label`` after the simplifier's renames); else, of
    the nodes ``label``'s rule wrote (``emitted``), the one calling the op ``label`` is
    named after (``linear`` for ``linear_6``, not the reshapes around it), else the last:
    the graph built for execution renames nodes, so that ``linear_6`` of the captured
    graph may be another linear there."""
    n = fwd_by_name.get(fname)
    if n is not None and n.meta.get("fxad_fwd_of", label) == label:
        return n
    calls = [c for c in emitted.get(label, ()) if c.op in ("call_function", "call_method")]
    if not calls:
        return n
    base = re.sub(r"_\d+$", "", label)
    return next((c for c in calls if op_kind(c) == base), calls[-1])


def _backward_module(bg: fx.Graph, g: _Nodes, saved: list[fx.Node], recompute: set[fx.Node],
                     root: Any) -> fx.GraphModule:
    """``bwd_gm`` (without its ``saved_names``): the backward graph, its code listing the
    saved values (with shapes and bytes) and the recomputed ones under its ``def`` line."""
    saved_total = sum(saved_cost(s) for s in saved)
    desc = [f"{s.name} {codegen.shape_note(s)} "
            + ("(parameter)" if s.meta.get("fxad_param") else f"({fmt_bytes(nbytes(s))})")
            for s in saved]
    head = [f"# saved tensors ({len(saved)} values, {fmt_bytes(saved_total)}):"]
    head += [f"#   {d}" for d in desc]
    if recompute:
        head.append("# recomputed here: " + ", ".join(n.name for n in g.avail if n in recompute))
    bg._codegen = CommentCodeGen(head="\n".join(head), boxed=True)
    codegen.install(bg)
    return fx.GraphModule(root, bg, class_name="BackwardGraph")


def _checkpoint_summary(regions: list[tuple[str, list[fx.Node]]], saved: list[fx.Node],
                        recompute: set[fx.Node]
                        ) -> list[tuple[str, list[str], list[str], int, list[str]]]:
    """Step 7: :attr:`Partition.checkpointed`: per region, what it recomputes, the saved
    values entering it (lifted parameters aside: they cost nothing) and its saved outputs."""
    checkpointed = []
    for label, rn in regions:
        rset = set(rn)
        rec = [n.name for n in rn if n in recompute]
        ins = [s for s in saved if s not in rset and any(u in rset for u in s.users)
               and not s.meta.get("fxad_param")]  # (lifted parameters cost nothing)
        outs_saved = [s for s in saved if s in rset]
        checkpointed.append((label, rec, [s.name for s in ins], sum(saved_cost(s) for s in ins),
                             [s.name for s in outs_saved]))
    return checkpointed


def _lift_params(vjp_gm: fx.GraphModule, names: list[str]) -> fx.GraphModule:
    """A copy of ``vjp_gm`` whose reads of the parameters ``names`` (``get_attr`` nodes, under
    any alias of a tied parameter) are placeholders, one per parameter, after the inputs."""
    root = vjp_gm.meta.get("fxad_source_module") or vjp_gm
    by_id: dict[int, str] = {}
    for n in names:
        try:
            by_id[id(root.get_parameter(n))] = n
        except AttributeError:
            continue
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    nodes = list(vjp_gm.graph.nodes)
    last_input = max((i for i, n in enumerate(nodes) if n.op == "placeholder"
                      and not n.meta.get("fxad_cotangent")), default=-1)
    lifted: dict[str, fx.Node] = {}
    param_of: dict[fx.Node, str] = {}  # get_attr node -> name of the parameter it reads
    readers: dict[str, fx.Node] = {}  # the first read of each parameter names its placeholder
    for n in nodes:
        if n.op == "get_attr":
            try:
                key = by_id.get(id(root.get_parameter(n.target)))
            except AttributeError:
                key = None
            if key is not None:
                param_of[n] = key
                readers.setdefault(key, n)

    def add_placeholders() -> None:
        for name in names:
            r = readers.get(name)
            ph = g.placeholder(r.name if r is not None else name.replace(".", "_"))
            ph.meta = dict(r.meta) if r is not None else {}
            if "val" not in ph.meta:
                ph.meta["val"] = root.get_parameter(name).detach().to("meta")
            ph.meta["fxad_param"] = name
            lifted[name] = ph

    if last_input < 0:  # a model without tensor inputs
        add_placeholders()
    for i, n in enumerate(nodes):
        if n in param_of:
            env[n] = lifted[param_of[n]]
            continue
        env[n] = g.node_copy(n, lambda a: env[a])
        if i == last_input:
            add_placeholders()
    out = fx.GraphModule(root, g, class_name=type(vjp_gm).__name__)
    out.meta.update(vjp_gm.meta)
    return out


