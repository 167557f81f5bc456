"""The backward graph of a partition cut into stages that release parameter gradients as they
are completed (:func:`split_backward`), for :func:`fxad.compile`'s bridge under DDP and FSDP
(``grad_release=``)."""
from __future__ import annotations

import textwrap
from dataclasses import dataclass

import torch.fx as fx

from .. import codegen
from ..memory import nbytes
from .report import CommentCodeGen, Partition

__all__ = ["StagedBackward", "split_backward"]


@dataclass
class StagedBackward:
    """The backward graph of a :class:`Partition` cut into stages (:func:`split_backward`).

    Attributes:
        stages: ``stages[s]([...]) -> (*carry, *grads)``: stage 0 takes the list
            ``[*saved, *cotangents]`` as ``bwd_gm`` does, each later stage the ``carry`` list
            of the one before (the values still needed, emptied on entry); the last stage
            returns ``(*input_grads, *grads)``.
        n_carry: number of carried values each stage returns before its gradients.
        params: per stage, the indices (into ``part.param_names``) of the parameter
            gradients it returns, in order.
        reads: per stage, the indices of the (lifted) parameters whose values it reads.
    """

    stages: list[fx.GraphModule]
    n_carry: list[int]
    params: list[list[int]]
    reads: list[list[int]]


def split_backward(part: Partition, units: list[list[int]] | None = None,
                   min_bytes: int = 0) -> StagedBackward | None:
    """Cut ``part.bwd_gm`` so that parameter gradients can be released while the rest of
    the backward still runs (DDP's bucketed all-reduce, FSDP's reduce-scatter).

    ``units``: groups of parameter indices whose gradients are released together (default:
    each parameter alone); only parameters with a gradient count.  A unit is complete at
    the backward node that computes its last gradient; going through the units in that
    order, a stage ends after a unit once the stage holds at least ``min_bytes`` bytes of
    gradients (``0``: a stage per completion point).  The last stage also returns the input
    gradients.  Returns ``None`` when there would be a single stage.  The stages run the
    nodes of ``bwd_gm`` in its order: the values computed are the same, and each stage
    passes on only the values still needed (the rest is freed at its end).
    """
    bg = part.bwd_gm.graph
    nodes = list(bg.nodes)
    phs = [n for n in nodes if n.op == "placeholder"]
    comp = [n for n in nodes if n.op not in ("placeholder", "output")]
    out_args = list(bg.output_node().args[0])
    n_in = len(part.input_grads)
    pos = {n: i for i, n in enumerate(comp)}
    grad_of: dict[int, fx.Node] = {}
    for i, g in enumerate(out_args[n_in:]):
        if isinstance(g, fx.Node):
            grad_of[i] = g
    if units is None:
        units = [[i] for i in grad_of]
    units = [[i for i in u if i in grad_of] for u in units]
    units = [u for u in units if u]
    if len(units) < 2:
        return None
    done: dict[int, list[int]] = {}  # completion position -> param indices
    for u in units:
        c = max(pos.get(grad_of[i], -1) for i in u)
        done.setdefault(c, []).extend(u)
    order = sorted(done)
    cuts: list[int] = []  # a stage ends after comp[c] for c in cuts
    stage_params: list[list[int]] = [[]]
    acc = 0
    for k, c in enumerate(order):
        stage_params[-1].extend(done[c])
        acc += sum(nbytes(grad_of[i]) for i in done[c])
        if k < len(order) - 1 and acc >= min_bytes and (not cuts or c > cuts[-1]) and c >= 0:
            cuts.append(c)
            stage_params.append([])
            acc = 0
    if not cuts:
        return None
    if not stage_params[-1]:  # nothing left for the last stage
        stage_params.pop()
        cuts.pop()
        if not cuts:
            return None
    n_st = len(cuts) + 1
    bounds = [0] + [c + 1 for c in cuts] + [len(comp)]
    seg = {n: s for s in range(n_st) for n in comp[bounds[s]:bounds[s + 1]]}
    for p in phs:
        seg[p] = -1
    last_use: dict[fx.Node, int] = {}
    for n in comp:
        for a in n.all_input_nodes:
            last_use[a] = max(last_use.get(a, -1), seg[n])
    for g in out_args[:n_in]:
        if isinstance(g, fx.Node):
            last_use[g] = n_st - 1
    for s, ps in enumerate(stage_params):
        for i in ps:
            last_use[grad_of[i]] = max(last_use.get(grad_of[i], -1), s)
    order_all = phs + comp
    param_ph = {p: p.meta.get("fxad_param") for p in phs if p.meta.get("fxad_param")}
    index_of = {name: i for i, name in enumerate(part.param_names)}
    stages: list[fx.GraphModule] = []
    n_carry: list[int] = []
    reads: list[list[int]] = []
    for s in range(n_st):
        g = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        ins = phs if s == 0 else [v for v in order_all
                                  if seg[v] < s and last_use.get(v, -1) >= s]
        for v in ins:
            env[v] = g.placeholder(v.name)
            env[v].meta = dict(v.meta)
        r: set[int] = set()
        for n in comp[bounds[s]:bounds[s + 1]]:
            env[n] = g.node_copy(n, lambda x: env[x])
            for a in n.all_input_nodes:
                if a in param_ph and param_ph[a] in index_of:
                    r.add(index_of[param_ph[a]])
        reads.append(sorted(r))
        if s < n_st - 1:
            carry = [v for v in order_all if seg[v] <= s and last_use.get(v, -1) >= s + 1]
            outs = [env[v] for v in carry] + [env[grad_of[i]] for i in stage_params[s]]
            n_carry.append(len(carry))
            what = f"gradients of {', '.join(part.param_names[i] for i in stage_params[s])}"
        else:
            outs = [env[x] if isinstance(x, fx.Node) else x for x in out_args[:n_in]]
            outs += [env[grad_of[i]] for i in stage_params[s]]
            n_carry.append(0)
            what = ("input gradients and " if any(part.input_grads) else "") + \
                f"gradients of {', '.join(part.param_names[i] for i in stage_params[s])}"
        g.output(tuple(outs))
        head = "\n".join("# " + ln for ln in textwrap.wrap(
            f"backward stage {s + 1} of {n_st}: returns the {what}", 88))
        g._codegen = CommentCodeGen(head=head, boxed=True)
        codegen.install(g)
        stages.append(fx.GraphModule(part.root, g, class_name=f"BackwardStage{s}"))
    return StagedBackward(stages=stages, n_carry=n_carry, params=stage_params, reads=reads)
