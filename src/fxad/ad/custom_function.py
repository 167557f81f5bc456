"""Derivatives of custom ``torch.autograd.Function``\\ s: their own ``backward`` and ``jvp``.

Capture (:mod:`fxad.capture.custom`) records a Function call as its forward ops (without
derivatives) and a marker node ``fxad.ops.autograd_function(name, inputs, outputs, saved)``
carrying :class:`~fxad.capture.custom.CustomFunction` in ``meta['fxad_custom_function']``:
the Function's ``backward`` (and ``jvp``) captured as graphs.  :func:`custom_function_rule`
turns that record into a :class:`~fxad.rules.registry.Rule` for this one node, so the
engines treat it like any op: the backward graph is written into the VJP code with the
cotangents and the saved tensors as its inputs (the generated code shows the user's backward
formula under ``# backward of: ... fxad_autograd_function('ClassName', ...)``), and forward
mode uses the captured ``jvp``, or transposes the backward when the class defines none.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from ..ops import autograd_function
from ..rules.registry import Rule
from .node_rules import register_node_rule


def is_custom_function(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is autograd_function \
        and "fxad_custom_function" in node.meta


def inline(gm: fx.GraphModule, values: list[Any], em: Any) -> Any:
    """Write ``gm``'s graph into the emitter's graph, its placeholders bound to ``values``
    (proxies or None); returns its output structure with proxies."""
    env: dict[fx.Node, Any] = {}
    it = iter(values)

    def load(a: Any) -> Any:
        return fx.node.map_aggregate(a, lambda x: env[x] if isinstance(x, fx.Node) else x)

    for n in gm.graph.nodes:
        if n.op == "placeholder":
            env[n] = next(it)
        elif n.op == "output":
            return load(n.args[0])
        else:
            p = em.create_proxy(n.op, n.target, load(n.args), load(n.kwargs))
            for k in ("fxad_loc", "stack_trace", "fxad_no_grad", "fxad_once_differentiable"):
                if k in n.meta:
                    p.node.meta[k] = n.meta[k]
            env[n] = p
    raise AssertionError("graph without output")


def _emitter(*values: Any) -> Any:
    """The emitter (proxy tracer) writing the graph the given proxies belong to."""
    for v in pytree.tree_leaves(values):
        if isinstance(v, fx.Proxy):
            return v.tracer
    raise AssertionError("no proxy among the values")


def custom_function_rule(node: fx.Node, em: Any) -> Rule:
    """The rule of one custom-Function marker node (see the module docstring).  ``em`` is
    the engine's emitter; code goes to the graph of the proxies the rule receives (the
    engines also run rules on scratch graphs)."""
    rec = node.meta["fxad_custom_function"]

    def fwd(name: str, inputs: tuple, outputs: Any, saved: tuple = ()) -> tuple[Any, Any]:
        value = _emitter(inputs, outputs, saved).create_proxy("call_function", autograd_function,
                                (name, inputs, outputs, saved), {})
        return value, (inputs, outputs, saved)

    def _outputs(outputs: Any) -> list[Any]:
        return list(outputs) if rec.tuple_output else [outputs]

    def bwd(aux: Any, d_out: Any) -> tuple:
        inputs, outputs, saved = aux
        outs = _outputs(outputs)
        ds = list(d_out) if rec.tuple_output else [d_out]
        cots = []
        for i in rec.tensor_outputs:
            d = ds[i] if i < len(ds) else None
            if d is None or i in rec.non_differentiable:
                d = torch.zeros_like(outs[i])  # autograd materializes unused cotangents
            cots.append(d)
        grads = inline(rec.backward, cots + list(saved), _emitter(cots, saved))
        grads = list(grads) if isinstance(grads, (tuple, list)) else [grads]
        grads = [g if isinstance(inputs[k], fx.Proxy) else None for k, g in enumerate(grads)]
        return (None, grads, None, None)

    jvp = None
    if rec.jvp is not None:
        def jvp(primals: tuple, tangents: tuple) -> tuple[Any, Any]:
            name, inputs, outputs, saved = primals
            value, _ = fwd(name, inputs, outputs, saved)
            t_in = tangents[1] or [None] * len(inputs)
            lead = []
            for x, t in zip(inputs, t_in):
                if not isinstance(x, fx.Proxy):
                    lead.append(None)
                else:
                    lead.append(t if t is not None else torch.zeros_like(x))
            tout = inline(rec.jvp, lead + list(saved), _emitter(lead, saved))
            if rec.tuple_output:
                touts = list(tout) if isinstance(tout, (tuple, list)) else [tout]
                touts = [None if k in rec.non_differentiable else t
                         for k, t in enumerate(touts)]
                return value, tuple(touts)
            return value, None if 0 in rec.non_differentiable else tout

    return Rule(op=autograd_function, fwd=fwd, bwd=bwd, jvp=jvp,
                source=f"the custom torch.autograd.Function {rec.cls.__qualname__}: its own "
                       "backward" + (" and jvp" if rec.jvp is not None else ""),
                params=("name", "inputs", "outputs", "saved"), residuals="inputs+output")


# the sweeps find this rule through fxad.ad.node_rules (fxad.ad imports this module)
register_node_rule(is_custom_function, lambda gm, node, em: custom_function_rule(node, em))
