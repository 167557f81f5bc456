"""Derivatives of captured control flow (:mod:`fxad.capture.control`).

``cond``
    Reverse mode: fxad generates the VJP of each branch graph (its own readable module, kept
    beside the branch) and the backward selects one with the same predicate:
    ``fxad_cond(pred, true_branch_vjp, false_branch_vjp, (*operands, d_out))[1]``; the
    branch's forward is recomputed inside its VJP (no branch activations are saved).
    Forward mode does the same with each branch's generated JVP.
``while_loop``
    Reverse mode recomputes: :func:`fxad.ops.while_loop_vjp` runs the loop forward again from
    the saved initial state, keeping every iteration's carried tensors (memory: one copy of
    the carried tensors per iteration, held only while the backward runs), then runs the
    body's generated VJP over them in reverse.  Forward mode carries the tangents through
    the loop with the body's generated JVP (:func:`fxad.ops.while_loop_jvp`).

Each generated branch/body derivative is an ordinary fxad module: ``print(m.code)`` shows it,
and it can be differentiated again (second order through ``cond``).
"""
from __future__ import annotations

import operator
from typing import Any, Sequence

import torch
import torch.fx as fx

from .. import ops
from ..capture.control import draws_in, updates_buffer
from ..graph.proxy import attach, fetch_attr, to_fake
from ..rules.registry import Rule
from .node_rules import register_node_rule
from .transform import body_jvp, body_vjp

_CACHE_KEY = "_fxad_control_derivatives"


class _Cache(dict):
    """What is derived from a branch graph module and kept on it (in its ``__dict__``: a
    module's ``meta`` is copied into the modules built from it): its VJP and JVP per example
    shapes, its recompute form, which may be the module itself.  Rebuilt on demand, so a
    pickled or deep-copied module (``GraphModule.to_folder`` saves its submodules with
    ``torch.save``) gets an empty one: a ``GraphModule`` pickles its ``__dict__``, in which a
    reference to itself would recurse without end."""

    def __reduce__(self) -> tuple:
        return (_Cache, ())

    def __deepcopy__(self, memo: dict) -> "_Cache":
        return _Cache()


def _cache(gm: fx.GraphModule) -> _Cache:
    cache = gm.__dict__.get(_CACHE_KEY)
    if not isinstance(cache, _Cache):
        cache = gm.__dict__[_CACHE_KEY] = _Cache()
    return cache


def is_control_flow(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in (ops.cond, ops.while_loop, ops.scan)


def _module(p: Any) -> fx.GraphModule:
    node = p.node if isinstance(p, fx.Proxy) else p
    em = p.tracer if isinstance(p, fx.Proxy) else None
    return fetch_attr(em.root, node.target)


def _examples(values: tuple) -> tuple:
    return tuple(v.node.meta.get("val") if isinstance(v, fx.Proxy) else to_fake(v)
                 for v in values)


def _attach(em: Any, gm: fx.GraphModule, stem: str) -> Any:
    """Keep a generated derivative module on the graph's root (and on the user's module the
    root stands for, which the generated module is built on: a plain attribute, not a
    registered submodule) and read it with a ``get_attr`` node."""
    meta = getattr(em.root, "meta", None)
    src = meta.get("fxad_source_module") if isinstance(meta, dict) else None
    others = (src,) if src is not None and src is not em.root else ()
    return em.create_proxy("get_attr", attach(em.root, stem, gm, others), (), {})


def _derivative(kind: str, gm: fx.GraphModule, examples: tuple, cache_on: Any) -> fx.GraphModule:
    """The VJP (``kind="vjp"``) or JVP of a captured subgraph, built once per subgraph by
    the engine entry (:func:`fxad.ad.transform.body_vjp` / :func:`~fxad.ad.transform.body_jvp`)."""
    cache = _cache(gm)
    key = (kind,) + tuple((tuple(str(n) for n in v.shape), v.dtype)  # sizes may be SymInts
                          if isinstance(v, torch.Tensor) else repr(v) for v in examples)
    if key not in cache:
        cache[key] = (body_vjp if kind == "vjp" else body_jvp)(gm, examples)
    return cache[key]


def recompute_form(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` (a branch graph) as its VJP recomputes it: without the buffer updates the
    forward made already (an in-place ``num_batches_tracked.add_(1)`` dropped, a training
    ``batch_norm`` given no running statistics: the same output, computed from the batch),
    in nested branches too, so that a backward leaves the buffers as eager PyTorch does
    (updated once, by the forward).  ``gm`` itself when it updates nothing."""
    cache = _cache(gm)
    if "recompute" in cache:
        return cache["recompute"]
    graph = fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    attrs: dict[str, Any] = {}
    changed = False
    for n in list(graph.nodes):
        if n.op in ("get_attr", "call_module"):
            obj = fetch_attr(gm, n.target)
            if isinstance(obj, fx.GraphModule) and any(
                    u.op == "call_function" and u.target is ops.cond for u in n.users):
                new = recompute_form(obj)
                if new is not obj:
                    changed = True
                    n.target = n.target + "_recompute"
                    obj = new
            attrs[n.target] = obj
        elif n.meta.get("fxad_buffer_write"):
            n.replace_all_uses_with(n.args[0])
            graph.erase_node(n)
            changed = True
        elif updates_buffer(n):  # a training batch_norm: the same output without statistics
            kwargs = dict(n.kwargs)
            args = list(n.args)
            for i, k in ((1, "running_mean"), (2, "running_var")):
                if len(args) > i:
                    args[i] = None
                kwargs.pop(k, None)
            n.args, n.kwargs = tuple(args), kwargs
            changed = True
    if not changed:
        cache["recompute"] = gm
        return gm
    graph.eliminate_dead_code()
    new_gm = fx.GraphModule(attrs, graph, class_name=type(gm).__name__)
    new_gm.meta.update(gm.meta)
    cache["recompute"] = new_gm
    return new_gm


def _floating(v: Any) -> bool:
    return isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex())


def _zeros_for(ts: Any, vals: Sequence[Any]) -> tuple:
    """Tangents or cotangents ``ts`` (``None`` for zero) aligned with values ``vals``: zeros
    written into the code for the floating ones (the generated loop bodies take tensors)."""
    ts = list(ts) if ts is not None else [None] * len(vals)
    return tuple(t if t is not None or not _floating(v) else
                 torch.zeros(tuple(v.shape), dtype=v.dtype, device=v.device)
                 for t, v in zip(ts, vals))


def cond_rule(node: fx.Node) -> Rule:
    def fwd(pred: Any, true_fn: Any, false_fn: Any, operands: tuple, rng: Any = None
            ) -> tuple[Any, Any]:
        em = true_fn.tracer
        # a replayed cond (a backward differentiated again) runs with its saved states
        args = (pred, true_fn, false_fn, operands) + (() if rng is None else (rng,))
        if rng is None and (draws_in(_module(true_fn)) or draws_in(_module(false_fn))):
            # the backward recomputes the branch: it must draw the forward's numbers again,
            # so the generators' states are saved just before the branch draws
            rng = em.create_proxy("call_function", ops.rng_state, (pred,), {})
            rng.node.meta["fxad_side_effect"] = True
        value = em.create_proxy("call_function", ops.cond, args, {})
        if rng is not None:
            value.node.meta["fxad_draws_random"] = True
        return value, (pred, true_fn, false_fn, operands, rng)

    def bwd(aux: Any, d_out: Any) -> tuple:
        pred, true_fn, false_fn, operands, rng = aux
        em = true_fn.tracer
        ex = _examples(operands)
        t_vjp = _derivative("vjp", recompute_form(_module(true_fn)), ex, em)
        f_vjp = _derivative("vjp", recompute_form(_module(false_fn)), ex, em)
        out_val = node.meta["val"]
        if isinstance(out_val, torch.Tensor):
            cot = d_out
        else:
            cot = tuple(d if d is not None or not _floating(v) else
                        torch.zeros(tuple(v.shape), dtype=v.dtype, device=v.device)
                        for d, v in zip(d_out, out_val))
        tv = _attach(em, t_vjp, "true_branch_vjp")
        fv = _attach(em, f_vjp, "false_branch_vjp")
        res = em.create_proxy("call_function", ops.cond,
                              (pred, tv, fv, tuple(operands) + (cot,))
                              + (() if rng is None else (rng,)), {})
        if rng is not None:
            res.node.meta["fxad_draws_random"] = True
        grads = em.create_proxy("call_function", operator.getitem, (res, 1), {})
        out = []
        for k, (o, v) in enumerate(zip(operands, ex)):
            out.append(em.create_proxy("call_function", operator.getitem, (grads, k), {})
                       if isinstance(o, fx.Proxy) and _floating(v) else None)
        return (None, None, None, out, None)

    def jvp(primals: tuple, tangents: tuple) -> tuple[Any, Any]:
        pred, true_fn, false_fn, operands = primals[:4]
        em = true_fn.tracer
        ex = _examples(operands)
        t_jvp = _derivative("jvp", _module(true_fn), ex, em)
        f_jvp = _derivative("jvp", _module(false_fn), ex, em)
        tans = _zeros_for(tangents[3], ex)
        tj = _attach(em, t_jvp, "true_branch_jvp")
        fj = _attach(em, f_jvp, "false_branch_jvp")
        rng = primals[4] if len(primals) > 4 else None
        res = em.create_proxy("call_function", ops.cond,
                              (pred, tj, fj, tuple(operands) + tuple(tans))
                              + (() if rng is None else (rng,)), {})
        if rng is not None or draws_in(_module(true_fn)) or draws_in(_module(false_fn)):
            res.node.meta["fxad_draws_random"] = True
        value = em.create_proxy("call_function", operator.getitem, (res, 0), {})
        tangent = em.create_proxy("call_function", operator.getitem, (res, 1), {})
        return value, tangent

    return Rule(op=ops.cond, fwd=fwd, bwd=bwd, jvp=jvp,
                source="torch.cond: the derivative of the branch the predicate selects "
                       "(each branch differentiated by fxad)",
                params=("pred", "true_fn", "false_fn", "operands", "rng"), residuals="inputs")


def while_loop_rule(node: fx.Node) -> Rule:
    def fwd(cond_fn: Any, body_fn: Any, carried: tuple, additional: tuple = ()
            ) -> tuple[Any, Any]:
        em = body_fn.tracer
        value = em.create_proxy("call_function", ops.while_loop,
                                (cond_fn, body_fn, carried, additional), {})
        return value, (cond_fn, body_fn, carried, additional)

    def bwd(aux: Any, d_out: Any) -> tuple:
        cond_fn, body_fn, carried, additional = aux
        em = body_fn.tracer
        ex = _examples(tuple(carried) + tuple(additional))
        b_vjp = _derivative("vjp", _module(body_fn), ex, em)
        bv = _attach(em, b_vjp, "loop_body_vjp")
        cots = _zeros_for(d_out, ex[:len(carried)])
        res = em.create_proxy("call_function", ops.while_loop_vjp,
                              (cond_fn, body_fn, bv, tuple(carried), tuple(additional), cots), {})
        grads = [em.create_proxy("call_function", operator.getitem, (res, k), {})
                 if isinstance(x, fx.Proxy) and _floating(v) else None
                 for k, (x, v) in enumerate(zip(tuple(carried) + tuple(additional), ex))]
        n = len(carried)
        return (None, None, grads[:n], grads[n:])

    def jvp(primals: tuple, tangents: tuple) -> tuple[Any, Any]:
        cond_fn, body_fn, carried, additional = primals
        em = body_fn.tracer
        ex = _examples(tuple(carried) + tuple(additional))
        b_jvp = _derivative("jvp", _module(body_fn), ex, em)
        bj = _attach(em, b_jvp, "loop_body_jvp")

        n = len(carried)
        res = em.create_proxy("call_function", ops.while_loop_jvp,
                              (cond_fn, bj, tuple(carried), _zeros_for(tangents[2], ex[:n]),
                               tuple(additional), _zeros_for(tangents[3], ex[n:])), {})
        value = em.create_proxy("call_function", operator.getitem, (res, 0), {})
        tangent = em.create_proxy("call_function", operator.getitem, (res, 1), {})
        return value, tangent

    return Rule(op=ops.while_loop, fwd=fwd, bwd=bwd, jvp=jvp,
                source="torch.while_loop: reverse mode recomputes the loop and runs the "
                       "body's VJP over the states in reverse; forward mode carries tangents",
                params=("cond_fn", "body_fn", "carried", "additional"), residuals="inputs")


def scan_rule(node: fx.Node) -> Rule:
    def fwd(body: Any, init: tuple, xs: tuple, additional: tuple = (), dim: int = 0,
            reverse: bool = False) -> tuple[Any, Any]:
        em = body.tracer
        value = em.create_proxy("call_function", ops.scan,
                                (body, init, xs, additional, dim, reverse), {})
        return value, (body, init, xs, additional, dim, reverse)

    def bwd(aux: Any, d_out: Any) -> tuple:
        body, init, xs, additional, dim, reverse = aux
        em = body.tracer
        nc, nx = len(init), len(xs)
        ex = _examples(tuple(init) + tuple(xs) + tuple(additional))
        slice_ex = tuple(v.select(dim, 0) for v in ex[nc:nc + nx])
        body_ex = ex[:nc] + slice_ex + ex[nc + nx:]
        b_vjp = _derivative("vjp", _module(body), body_ex, em)
        bv = _attach(em, b_vjp, "scan_body_vjp")
        out_val = node.meta["val"]
        d_carry, d_ys = (d_out if d_out is not None else (None, None))
        d_carry = _zeros_for(d_carry, out_val[0])
        d_ys = tuple(d_ys) if d_ys is not None else (None,) * len(out_val[1])
        res = em.create_proxy("call_function", ops.scan_vjp,
                              (body, bv, tuple(init), tuple(xs), tuple(additional), dim,
                               reverse, d_carry, d_ys), {})
        grads = [em.create_proxy("call_function", operator.getitem, (res, k), {})
                 if isinstance(x, fx.Proxy) and _floating(v) else None
                 for k, (x, v) in enumerate(zip(tuple(init) + tuple(xs) + tuple(additional),
                                                ex))]
        return (None, grads[:nc], grads[nc:nc + nx], grads[nc + nx:], None, None)

    def jvp(primals: tuple, tangents: tuple) -> tuple[Any, Any]:
        body, init, xs, additional, dim, reverse = primals
        em = body.tracer
        nc, nx = len(init), len(xs)
        ex = _examples(tuple(init) + tuple(xs) + tuple(additional))
        slice_ex = tuple(v.select(dim, 0) for v in ex[nc:nc + nx])
        b_jvp = _derivative("jvp", _module(body), ex[:nc] + slice_ex + ex[nc + nx:], em)
        bj = _attach(em, b_jvp, "scan_body_jvp")
        res = em.create_proxy("call_function", ops.scan_jvp,
                              (bj, tuple(init), tuple(xs), tuple(additional), dim, reverse,
                               _zeros_for(tangents[1], ex[:nc]),
                               _zeros_for(tangents[2], ex[nc:nc + nx]),
                               _zeros_for(tangents[3], ex[nc + nx:])), {})
        value = em.create_proxy("call_function", operator.getitem, (res, 0), {})
        tangent = em.create_proxy("call_function", operator.getitem, (res, 1), {})
        return value, tangent

    return Rule(op=ops.scan, fwd=fwd, bwd=bwd, jvp=jvp,
                source="torch scan/map: reverse mode recomputes the carries and runs the "
                       "body's VJP over the steps in reverse; forward mode carries tangents",
                params=("body", "init", "xs", "additional", "dim", "reverse"),
                residuals="inputs")


def control_flow_rule(node: fx.Node) -> Rule:
    if node.target is ops.cond:
        return cond_rule(node)
    if node.target is ops.scan:
        return scan_rule(node)
    return while_loop_rule(node)


# the sweeps find these rules through fxad.ad.node_rules (fxad.ad imports this module)
register_node_rule(is_control_flow, lambda gm, node, em: control_flow_rule(node))
