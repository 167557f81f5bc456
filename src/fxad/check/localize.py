"""Where a check fails: bisection over prefixes of the captured graph for the first op whose
VJP disagrees (:func:`_localize`), and the :class:`~fxad.errors.CheckError` naming it
(:func:`_raise`)."""
from __future__ import annotations

import copy
import inspect
import linecache
from typing import Any, Iterable

import torch
import torch.fx as fx

from ..ad.reverse import (_is_structural_getitem, activity, differentiable_params, has_float,
                          node_desc)
from ..api import vjp
from ..errors import CheckError, SourceLoc
from ..rules.dispatch import rule_key
from ..rules.registry import op_name
from .compare import _Failure, _formula_side, _rounding_side, _Setup
from .oracle import _Problem


def _candidates(fw: fx.GraphModule, with_params: bool) -> list[fx.Node]:
    leaves = {n for n in fw.graph.nodes if n.op == "placeholder" and has_float(n.meta.get("val"))}
    if with_params:
        leaves |= set(differentiable_params(fw).values())
    active, useful = activity(fw, leaves)
    return [n for n in fw.graph.nodes if n in active and n in useful and n not in leaves
            and n.op in ("call_function", "call_method", "call_module")]


def _prefix(fw: fx.GraphModule, upto: fx.Node, outs: list[fx.Node], root: torch.nn.Module,
            with_params: bool) -> fx.GraphModule:
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    reached = False
    for n in fw.graph.nodes:
        if n.op == "output":
            break
        if n.op == "placeholder" or not reached:
            env[n] = graph.node_copy(n, lambda a: env[a])
            env[n].meta = dict(n.meta)
        if n is upto:
            reached = True
    graph.output(tuple(env[o] for o in outs))
    gm = fx.GraphModule(root, graph, class_name="CheckPrefix")
    gm.meta.update({k: v for k, v in fw.meta.items() if k != "fxad_rebuild"})
    gm.meta["fxad_source_module"] = gm if with_params else None
    return gm


def _is_tensor_float(n: fx.Node) -> bool:
    v = n.meta.get("val")
    return isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex())


def _localize(kind: str, fw: fx.GraphModule, xs: tuple, with_params: bool, st: _Setup,
              leaf_modules: Iterable[type], eps: float = 0.0, dtype: Any = None,
              xs64: tuple | None = None, elementwise: bool = True) -> fx.Node | None:
    """First op (in program order) whose VJP disagrees, by bisection over graph prefixes."""
    cands = _candidates(fw, with_params)
    root64 = None
    if kind == "rounding" and xs64 is not None:
        root64 = copy.deepcopy(fw).to(torch.float64)

    def ok(k: int) -> bool:
        upto = cands[k]
        outs = [n for n in cands[:k + 1] if _is_tensor_float(n)]
        if not outs:
            return True
        gm = _prefix(fw, upto, outs, fw, with_params)
        prob = _Problem(gm, xs, with_params)
        gen = torch.Generator().manual_seed(st.seed + 1)
        g = vjp(gm, *xs, leaf_modules=leaf_modules)
        if kind == "rounding":
            if root64 is not None:
                ref = _Problem(_prefix(fw, upto, outs, root64, with_params), xs64, with_params)
            else:
                ref = prob
            fail, _ = _rounding_side(prob, g, ref, eps, dtype, gen)
        else:
            fail, _ = _formula_side(prob, g, st, gen, with_fd=kind == "fd",
                                    elementwise=elementwise)
        return fail is None

    try:
        if not cands or ok(len(cands) - 1):
            return None
        lo, hi = -1, len(cands) - 1
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if ok(mid):
                lo = mid
            else:
                hi = mid
    except Exception:  # a prefix that cannot be differentiated on its own: give up quietly
        return None
    node = cands[hi]
    while _is_structural_getitem(node):
        node = node.args[0]
    return node


def _definition_loc(f: Any) -> SourceLoc | None:
    """``file:line`` of the definition of the checked function or module's ``forward``."""
    target = type(f).forward if isinstance(f, torch.nn.Module) else f
    target = inspect.unwrap(getattr(target, "__func__", target))
    code = getattr(target, "__code__", None)
    if code is None:
        return None
    text = linecache.getline(code.co_filename, code.co_firstlineno).strip()
    return SourceLoc(code.co_filename, code.co_firstlineno, code.co_name, text)


def _raise(fail: _Failure, f: Any, node: fx.Node | None, fw: fx.GraphModule | None,
           checked_dtype: Any) -> None:
    affected = ", ".join(fail.names) if fail.names else "the output"
    if fail.kind == "structure":
        raise CheckError(fail.message, loc=_definition_loc(f),
                         hint="fxad.show(fxad.vjp(f, *inputs)) prints the generated code")
    if node is None or fw is None:
        raise CheckError(
            fail.message + f" (no single op's derivative disagrees on its own; affected: "
            f"{affected})", loc=_definition_loc(f),
            hint="the difference comes from how the ops combine; fxad.show(fxad.vjp(f, "
                 "*inputs)) prints the generated code to compare with the function")
    desc = node_desc(fw, node)
    key = rule_key(fw, node)
    try:
        spelled = op_name(key)
    except Exception:
        spelled = desc
    loc = node.meta.get("fxad_loc")
    what = f"differs beyond {checked_dtype} rounding" if fail.kind == "rounding" \
        else "disagrees"
    msg = (f"{fail.message}\n  the first op whose derivative {what}: {desc} (`{node.name}`); "
           f"affected: {affected}")
    hint = (f"correct the rule for {spelled}: fxad.lookup({spelled}) returns the registered rule "
            f"(its source says where the formula comes from); register a corrected one with "
            f"fxad.register_vjp({spelled}, ..., replace=True); fxad.show(fxad.vjp(f, *inputs)) "
            "prints the generated code")
    raise CheckError(msg, op=desc, loc=loc if isinstance(loc, SourceLoc) else None, hint=hint)

