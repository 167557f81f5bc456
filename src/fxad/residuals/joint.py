"""The forward and backward graphs of a partition put back into one graph: the whole training
step (:func:`joint_graph`), for ``torch.compile``."""
from __future__ import annotations

import textwrap
from typing import Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from .. import codegen
from ..errors import InputError
from ..simplify import dce, fold_algebra, fold_shapes
from .report import CommentCodeGen, Partition, fmt_bytes

__all__ = ["joint_graph"]


def joint_graph(part: Partition, *, with_params: bool = True) -> fx.GraphModule:
    """The forward and backward graphs of ``part`` as one graph: ``gm(*inputs) -> (value,
    input_grads)``, plus ``param_grads`` (a dict by parameter name, zeros for unused
    parameters) when ``with_params``; the same outputs as :func:`fxad.grad`.

    The forward nodes come first, then ``ones_like`` seeds for the floating outputs (the
    step differentiates ``value``; for a scalar loss, its gradient), then the backward
    nodes with the recomputed forward nodes emitted just before their first use, as in
    ``bwd_gm``; then the seeds are folded (``ones_like(loss) * x`` becomes ``x``: the
    algebra, shape and dead-code passes of :mod:`fxad.simplify`, not CSE, which would merge
    each recomputed node back into its forward twin).  The code lists the values that cross
    from forward to backward and the recomputed ones under its ``def`` line.  Parameters and
    buffers are read from the model (the graph module shares their tensors; batch-norm
    running statistics are updated in place as by the model).

    Raises:
        fxad.InputError: ``part`` was made with ``lift_params=True`` (its forward graph
            takes the parameters as inputs).
    """
    if part.lifted_params:
        raise InputError("joint_graph needs a partition made with lift_params=False")
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    attr_nodes: dict[str, fx.Node] = {}  # one get_attr per parameter/buffer
    fwd_out: list[fx.Node] = []
    for n in part.fwd_gm.graph.nodes:
        if n.op == "output":
            fwd_out = [env[a] for a in n.args[0]]
            continue
        env[n] = g.node_copy(n, lambda a: env[a])
        if n.op == "get_attr":
            attr_nodes.setdefault(n.target, env[n])
    outs, saved = fwd_out[:part.n_outputs], fwd_out[part.n_outputs:]
    seeds = []
    for o, is_float in zip(outs, part.float_outputs):
        if is_float:
            seed = g.call_function(torch.ones_like, (o,))
            seed.meta = {"val": o.meta.get("val"), "fxad_bwd_of": o.name}
            seeds.append(seed)
    bph = [n for n in part.bwd_gm.graph.nodes if n.op == "placeholder"]
    benv: dict[fx.Node, Any] = dict(zip(bph, saved + seeds))
    grads: list[Any] = []
    for n in part.bwd_gm.graph.nodes:
        if n.op == "placeholder":
            continue
        if n.op == "output":
            grads = [benv[a] if isinstance(a, fx.Node) else a for a in n.args[0]]
            continue
        if n.op == "get_attr" and n.target in attr_nodes:
            benv[n] = attr_nodes[n.target]
            continue
        benv[n] = g.node_copy(n, lambda a: benv[a])
        if n.meta.get("fxad_recomputed"):  # the forward has a node of that name
            benv[n]._rename(f"{n.name}_recomputed")
    n_in = len(part.input_grads)
    result: list[Any] = [pytree.tree_unflatten(outs, part.out_spec), tuple(grads[:n_in])]
    if with_params:
        pgrads: dict[str, Any] = {}
        for name, gr in zip(part.param_names, grads[n_in:]):
            if gr is None:  # unused parameter: zeros, as fxad.grad returns
                p = attr_nodes[name] if name in attr_nodes else g.get_attr(name)
                gr = g.call_function(torch.zeros_like, (p,))
                gr.meta = {"fxad_bwd_of": "(unused parameter)"}
            pgrads[name] = gr
        result.append(pgrads)
    g.output(tuple(result))
    # fold the seed (``ones_like(loss) * x`` -> ``x``) and what it enables; no CSE, which
    # would merge each recomputed node back into its forward twin
    for _ in range(20):
        if not fold_algebra(g) + fold_shapes(g) + dce(g):
            break
    recomputed = [n.name for n in g.nodes if n.meta.get("fxad_recomputed")]
    head = [f"# saved from forward to backward ({len(saved)} values, "
            f"{fmt_bytes(part.saved_bytes)}):"]
    head += ["#   " + ln for ln in textwrap.wrap(", ".join(s.name for s in saved), 88)]
    if recomputed:
        head.append(f"# recomputed in the backward ({len(recomputed)}):")
        head += ["#   " + ln for ln in textwrap.wrap(", ".join(recomputed), 88)]
    g._codegen = CommentCodeGen(head="\n".join(head))
    codegen.install(g)
    return fx.GraphModule(part.root, g, class_name="JointGraph")
