"""Reverse mode: turn a captured, normalized graph into its VJP graph.

The transform follows the DiffFX scheme, emitting code instead of running it:

1. **Activity analysis.**  A node is *active* when it depends on a differentiable leaf
   (a floating-point input or a trainable parameter) and its value holds floating tensors;
   it is *useful* when an output depends on it.  Only active-and-useful nodes go through a
   rule; all others are copied unchanged.
2. **Forward sweep.**  For each active node the rule's ``fwd`` runs on proxies: it writes the
   forward computation (and any residual computations) into the new graph and returns
   ``(value, aux)``.  ``(node, rule, aux, bound arguments)`` is pushed on a tape.
3. **Reverse sweep.**  Cotangent placeholders ``d_<output>`` seed the outputs.  Popping the
   tape, the rule's ``bwd(aux, d_value)`` writes the backward code; the engine reduces each
   returned cotangent to its input's shape (``sum_to_size``) and dtype, and accumulates
   fan-out with ``+``.  Zero cotangents are represented symbolically (``None``) and never
   materialized unless an input's whole gradient is zero.

Meta keys written on the VJP graph:

``fxad_fwd_of``, ``fxad_fwd_src``
    on the nodes a rule's ``fwd`` wrote: the forward node's name and its ``SourceLoc``
    (guard lines a rule writes name the user's line from it).
``fxad_bwd_of``
    on backward nodes: name of the forward node whose rule wrote them.
``fxad_bwd_src``
    on backward nodes: ``SourceLoc`` of that forward node in the user's code.
``fxad_residuals``
    on backward nodes: the ``residuals`` declaration of that rule, when it makes one.
``fxad_cot_of``
    on the node holding the total cotangent of a forward value: that value's name (used to
    name it ``d_<name>``).
"""
from __future__ import annotations

import contextlib
import inspect
import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from ..errors import FxadError, RuleError
from ..graph.factories import record_factories
from ..graph.proxy import Emitter, TensorProxy, describe_target, fetch_attr
from ..graph.sizes import known_equal, known_one
from ..rules.registry import _NEEDED, Rule, missing_rule
from .modules import ModuleRef, ModuleSlot
from .node_rules import rule_for

_STRUCT = (tuple, list, dict)


def is_float(v: Any) -> bool:
    return isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex())


def has_float(v: Any) -> bool:
    return any(is_float(x) for x in pytree.tree_leaves(v))


def node_desc(gm: fx.GraphModule, node: fx.Node) -> str:
    if node.op == "call_module":
        return f"module {type(gm.get_submodule(node.target)).__name__} (`{node.target}`)"
    return describe_target(node.op, node.target)


def copy_node(node: fx.Node, graph: fx.Graph, em: Emitter, env: dict) -> Any:
    """``node`` copied into ``graph`` with its arguments mapped through ``env`` (source node ->
    proxy, or a rule's Python tuple of proxies); an item of such a tuple (``out, idx =
    pool(...)``) is that proxy itself.  Used by both engines for the nodes they do not
    differentiate."""
    if node.op == "call_function" and node.target is operator.getitem \
            and isinstance(node.args[0], fx.Node) \
            and isinstance(env.get(node.args[0]), (tuple, list)):
        return env[node.args[0]][node.args[1]]
    new = graph.node_copy(node, lambda x: fx.node.map_aggregate(
        env[x], lambda v: v.node if isinstance(v, fx.Proxy) else v))
    new.meta = dict(node.meta)
    return em.value(new)


@contextlib.contextmanager
def rule_errors(gm: fx.GraphModule, node: fx.Node, phase: str) -> Any:
    """Run a rule's ``fwd``/``bwd``/``jvp`` so that no exception escapes bare: an fxad error
    gets the user's line of ``node`` if it has none, anything else becomes a
    :class:`~fxad.errors.RuleError` naming the op, the phase and the user's line."""
    desc = node_desc(gm, node)
    loc = node.meta.get("fxad_loc")
    try:
        yield
    except FxadError as e:
        if e.loc is not None:
            raise
        raise type(e)(e.bare_message, op=e.op or desc, loc=loc, hint=e.hint) from e
    except Exception as e:  # a bug in a rule, or inputs a rule does not handle
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise RuleError(
            f"the derivative rule for {desc} failed in its {phase}: {type(e).__name__}: {msg}",
            op=desc, loc=loc,
            hint=f"register a replacement rule with fxad.register_vjp({desc}, replace=True), "
                 "or rewrite this line with other ops") from e


@dataclass
class TapeEntry:
    node: fx.Node          # forward node of the source graph
    rule: Rule | None      # None: structural getitem handled by the engine
    aux: Any
    bound: inspect.BoundArguments | None
    arg_nodes: Any         # for structural getitem: (parent node, key)


@dataclass
class VJPResult:
    """Output of :func:`build_vjp_graph`: the graph and what its output tuple holds."""

    graph: fx.Graph
    input_names: list[str]
    param_names: list[str]
    cotangent_names: list[str]


def _is_structural_getitem(node: fx.Node) -> bool:
    return (node.op == "call_function" and node.target is operator.getitem
            and isinstance(node.args[0], fx.Node)
            and isinstance(node.args[0].meta.get("val"), _STRUCT))


def differentiable_params(gm: fx.GraphModule) -> dict[str, fx.Node]:
    """get_attr nodes that are trainable parameters, keyed by parameter name."""
    out: dict[str, fx.Node] = {}
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            obj = fetch_attr(gm, n.target)
            if isinstance(obj, torch.nn.Parameter) and obj.requires_grad and is_float(obj):
                out.setdefault(n.target, n)
    return out


def activity(gm: fx.GraphModule, leaves: set[fx.Node]) -> tuple[set[fx.Node], set[fx.Node]]:
    """(active, useful) node sets; see module docstring."""
    active: set[fx.Node] = set()
    once: set[fx.Node] = set()  # computed by a @once_differentiable backward from active values
    for n in gm.graph.nodes:
        if n in leaves:
            active.add(n)
        elif n.op in ("call_function", "call_method", "call_module") \
                and not n.meta.get("fxad_side_effect") \
                and has_float(n.meta.get("val")) \
                and any(a in active for a in n.all_input_nodes):
            if n.meta.get("fxad_once_differentiable"):
                once.add(n)
                active.add(n)
            elif not n.meta.get("fxad_no_grad"):
                active.add(n)
    useful: set[fx.Node] = set()
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    stack = [a for a in out.all_input_nodes if a in active]
    while stack:
        n = stack.pop()
        if n in useful:
            continue
        if n in once:
            cls = n.meta["fxad_once_differentiable"]
            raise RuleError(
                f"trying to differentiate twice through {cls}.backward, which is decorated "
                "with @once_differentiable", op=f"{cls}.backward", loc=n.meta.get("fxad_loc"),
                hint=f"remove @once_differentiable from {cls}.backward if it is written with "
                     "differentiable torch ops")
        useful.add(n)
        stack.extend(a for a in n.all_input_nodes if a in active)
    return active, useful


class ReverseTransform:
    """One VJP transform of one captured graph (use :func:`build_vjp_graph`)."""

    def __init__(self, gm: fx.GraphModule, *, with_params: bool,
                 argnums: tuple[int, ...] | None = None) -> None:
        self.argnums = argnums
        self.gm = gm
        self.src = gm.graph
        self.graph = fx.Graph()
        self.em = Emitter(self.graph, gm)
        self.env: dict[fx.Node, Any] = {}
        self.tape: list[TapeEntry] = []
        self.cots: dict[fx.Node, Any] = {}
        self.with_params = with_params
        self.leaf_param_cots: dict[str, Any] = {}

    # -- helpers -------------------------------------------------------------------------------
    def _load(self, a: Any) -> Any:
        return fx.node.map_aggregate(a, lambda x: self.env[x] if isinstance(x, fx.Node) else x)

    def _copy(self, node: fx.Node) -> Any:
        return copy_node(node, self.graph, self.em, self.env)

    # -- forward sweep -------------------------------------------------------------------------
    def forward(self) -> tuple[list[fx.Node], Any]:
        gm = self.gm
        params = differentiable_params(gm) if self.with_params else {}
        inputs = [n for n in self.src.nodes if n.op == "placeholder"]
        leaves = {n for i, n in enumerate(inputs) if has_float(n.meta.get("val"))
                  and (self.argnums is None or i in self.argnums)} | set(params.values())
        self.leaves = leaves
        active, useful = activity(gm, leaves)
        self.active = active
        out_node = None
        for node in self.src.nodes:
            if node.op == "placeholder":
                new = self.graph.placeholder(node.name)
                new.meta = dict(node.meta)
                self.env[node] = self.em.value(new)
            elif node.op == "output":
                out_node = node
            elif node in active and node in useful and node not in leaves:
                self._forward_rule(node)
            else:
                self.env[node] = self._copy(node)
        self.params = params
        self.inputs = inputs
        assert out_node is not None
        return inputs, out_node

    def _forward_rule(self, node: fx.Node) -> None:
        gm = self.gm
        if _is_structural_getitem(node):
            self.env[node] = self._copy(node)
            self.tape.append(TapeEntry(node, None, None, None, (node.args[0], node.args[1])))
            return
        rule = rule_for(gm, node, self.em)
        if rule is None:
            raise missing_rule(node_desc(gm, node), node.meta.get("fxad_loc"),
                               module=node.op == "call_module")
        args = self._load(node.args)
        kwargs = self._load(node.kwargs)
        if node.op == "call_module":
            args = (ModuleRef(self.em, node.target, gm.get_submodule(node.target)),) + tuple(args)
        try:
            bound = rule.signature.bind(*args, **kwargs)
        except TypeError as e:
            raise RuleError(f"rule for {node_desc(gm, node)} cannot take the call's arguments: {e}",
                            op=node_desc(gm, node), loc=node.meta.get("fxad_loc")) from e
        before = len(self.graph.nodes)
        # the rule writes the node's own call again: it takes the value capture computed
        known = self.em.known_value(node.op, node.target, args, kwargs, node.meta["val"]) \
            if node.op in ("call_function", "call_method") and "val" in node.meta \
            else contextlib.nullcontext()
        with rule_errors(gm, node, "forward"), self.em.meta_defaults(
                fxad_fwd_of=node.name, fxad_fwd_src=node.meta.get("fxad_loc")), known:
            result = rule.fwd(*args, **kwargs)
        if not (isinstance(result, tuple) and len(result) == 2):
            raise RuleError(f"fwd of the rule for {node_desc(gm, node)} must return (value, aux)",
                            op=node_desc(gm, node), loc=node.meta.get("fxad_loc"))
        value, aux = result
        if isinstance(value, fx.Proxy):
            created = len(self.graph.nodes) > before
            if created and value.node.op != "placeholder" and value.node.name != node.name \
                    and value.node.meta.get("fxad_fwd_of") == node.name:
                value.node._rename(node.name)
            for k in ("fxad_loc", "stack_trace", "fxad_inplace"):
                if k in node.meta:
                    value.node.meta.setdefault(k, node.meta[k])
        self.env[node] = value
        self.tape.append(TapeEntry(node, rule, aux, bound, None))

    # -- reverse sweep -------------------------------------------------------------------------
    def _accumulate(self, target: fx.Node, ct: Any) -> None:
        if ct is None or target not in self.active:
            return
        val = target.meta.get("val")
        if isinstance(val, _STRUCT):
            prev = self.cots.get(target)
            if prev is None:
                self.cots[target] = ct
            else:
                self.cots[target] = _merge_struct(prev, ct)
            return
        if not isinstance(ct, fx.Proxy):
            raise RuleError(f"a rule returned a non-tensor cotangent ({type(ct).__name__}) for "
                            f"`{target.name}`")
        ct = self._unbroadcast(ct, val)
        prev = self.cots.get(target)
        self.cots[target] = ct if prev is None else prev + ct

    def _unbroadcast(self, ct: TensorProxy, like: torch.Tensor) -> TensorProxy:
        """Bring a cotangent to its primal's shape and dtype.

        Broadcast dimensions are summed away (``sum_to_size``); a cotangent with size-1 or
        missing dimensions (from a reduction rule) is expanded (``expand``).
        """
        cs, ls = tuple(ct.meta.shape), tuple(like.shape)
        if not known_equal(cs, ls):
            k = len(ls)
            aligned = cs[len(cs) - k:] if len(cs) >= k else (1,) * (k - len(cs)) + cs
            reduced = tuple(1 if known_one(lsz) else csz for csz, lsz in zip(aligned, ls))
            if len(cs) > k or not known_equal(reduced, aligned):
                if len(cs) < k:
                    ct = torch.reshape(ct, aligned)
                if any(isinstance(s, torch.SymInt) for s in cs + ls):
                    # on symbolic sizes, name the summed dimensions: sum_to_size would
                    # decide at run time (and guard here) whether each size is 1
                    lead = len(cs) - k if len(cs) > k else 0
                    keep = tuple(lead + i for i, (r, a) in enumerate(zip(reduced, aligned))
                                 if known_one(r) and not known_one(a))
                    if keep:
                        ct = ct.sum(keep, keepdim=True)
                    if lead:
                        ct = ct.sum(tuple(range(lead)))
                else:
                    ct = ct.sum_to_size(reduced)
            # (also a 0-d cotangent of a 1-element tensor)
            if not known_equal(tuple(ct.meta.shape), ls):
                ct = ct.expand(ls)
        if ct.meta.dtype != like.dtype:
            ct = ct.to(like.dtype)
        return ct

    def backward(self, out_node: fx.Node) -> list[str]:
        # cotangent placeholders, one per floating output leaf, in output order
        leaves, _ = pytree.tree_flatten(out_node.args[0])
        phs = [n for n in self.graph.nodes if n.op == "placeholder"]
        cot_names: list[str] = []
        self.cot_placeholders: list[Any] = []
        # after the inputs; first in the graph for a function without inputs
        insert_at: fx.Node | None = phs[-1] if phs else None

        def inserting() -> Any:
            if insert_at is None:
                return self.graph.inserting_before(next(iter(self.graph.nodes)))
            return self.graph.inserting_after(insert_at)

        for leaf in leaves:
            val = leaf.meta.get("val") if isinstance(leaf, fx.Node) else None
            if isinstance(leaf, fx.Node) and is_float(val):
                with inserting():
                    ph = _placeholder(self.graph, f"d_{leaf.name}")
                ph.meta["val"] = val
                ph.meta["fxad_cotangent"] = True
                insert_at = ph
                cot_names.append(ph.name)
                p = self.em.value(ph)
                self.cot_placeholders.append(p)
                self._accumulate(leaf, p)
            elif isinstance(leaf, fx.Node) and isinstance(val, _STRUCT) and has_float(val):
                # a tuple-valued node returned as is (torch.split(x, 2)): one cotangent per
                # floating element
                parts, spec = pytree.tree_flatten(val)
                cts: list[Any] = []
                for i, part in enumerate(parts):
                    if not is_float(part):
                        cts.append(None)
                        continue
                    with inserting():
                        ph = _placeholder(self.graph, f"d_{leaf.name}_{i}")
                    ph.meta["val"] = part
                    ph.meta["fxad_cotangent"] = True
                    insert_at = ph
                    cot_names.append(ph.name)
                    p = self.em.value(ph)
                    self.cot_placeholders.append(p)
                    cts.append(p)
                ct_struct = pytree.tree_unflatten(cts, spec)
                if isinstance(ct_struct, tuple) and not type(ct_struct) is tuple:
                    ct_struct = tuple(ct_struct)
                self._accumulate(leaf, ct_struct)
            else:
                self.cot_placeholders.append(None)
        for entry in reversed(self.tape):
            node = entry.node
            ct = self.cots.pop(node, None)
            if ct is None or (isinstance(ct, _STRUCT) and all(
                    c is None for c in pytree.tree_leaves(ct, is_leaf=lambda x: x is None))):
                continue
            if isinstance(ct, fx.Proxy) and ct.node.op != "placeholder":
                # named after the value as the VJP graph names it (the items of a rule's
                # tuple may have taken the source graph's names)
                value = self.env.get(node)
                ct.node.meta.setdefault("fxad_cot_of", value.node.name if isinstance(
                    value, fx.Proxy) and value.node.op not in ("placeholder", "get_attr")
                    else node.name)
            meta = {"fxad_bwd_of": node.name}
            if entry.rule is not None and entry.rule.residuals is not None:
                meta["fxad_residuals"] = entry.rule.residuals  # the rule's declaration
            if "fxad_loc" in node.meta:
                meta["fxad_bwd_src"] = node.meta["fxad_loc"]
            with self.em.meta_defaults(**meta):
                if entry.rule is None:
                    parent, key = entry.arg_nodes
                    self._accumulate(parent, _struct_slot(parent.meta["val"], key, ct))
                    continue
                self._apply_bwd(entry, ct)
        return cot_names

    def _apply_bwd(self, entry: TapeEntry, ct: Any) -> None:
        node, rule, bound = entry.node, entry.rule, entry.bound
        assert rule is not None and bound is not None
        if isinstance(ct, list):
            ct = tuple(ct)
        src_args = self._source_arguments(entry)
        needed = {name: any(isinstance(a, fx.Node) and a in self.active
                            for a in pytree.tree_leaves(v))
                  for name, v in src_args.items()}
        token = _NEEDED.set(needed)
        try:
            with rule_errors(self.gm, node, "backward"):
                cts = rule.bwd(entry.aux, ct)
        finally:
            _NEEDED.reset(token)
        names = list(rule.params)
        if isinstance(cts, dict):
            by_name = cts
            unknown = set(by_name) - set(names)
            if unknown:
                raise RuleError(f"bwd of the rule for {node_desc(self.gm, node)} returned "
                                f"cotangents for unknown parameters {sorted(unknown)}")
        else:
            if not isinstance(cts, (tuple, list)):
                cts = (cts,)
            if len(cts) > len(names):
                raise RuleError(
                    f"bwd of the rule for {node_desc(self.gm, node)} returned {len(cts)} "
                    f"cotangents for {len(names)} parameters {names}")
            by_name = dict(zip(names, cts))
        # map bound proxies back to source-graph nodes
        for name, c in by_name.items():
            if c is None or name not in src_args:
                continue
            self._match(src_args[name], c, node, name)

    def _source_arguments(self, entry: TapeEntry) -> dict[str, Any]:
        node, rule = entry.node, entry.rule
        assert rule is not None
        args = tuple(node.args)
        if node.op == "call_module":
            args = (ModuleSlot(node.target),) + args
        b = rule.signature.bind(*args, **node.kwargs)
        return dict(b.arguments)

    def _match(self, src: Any, c: Any, node: fx.Node, pname: str) -> None:
        if c is None:
            return
        if isinstance(src, fx.Node):
            self._accumulate(src, c)
        elif isinstance(src, (tuple, list)):
            if not isinstance(c, (tuple, list)) or len(c) != len(src):
                raise RuleError(
                    f"bwd of the rule for {node_desc(self.gm, node)}: parameter `{pname}` is a "
                    f"sequence of {len(src)}, so its cotangent must be a sequence of that length")
            for s, ci in zip(src, c):
                self._match(s, ci, node, pname)
        elif isinstance(src, ModuleSlot):
            if not isinstance(c, dict):
                raise RuleError(f"bwd of the rule for {node_desc(self.gm, node)} must return a "
                                "dict {param_name: cotangent} for the module argument")
            mod = self.gm.get_submodule(src.target)
            for pname_, ct in c.items():
                if ct is None:
                    continue
                p = getattr(mod, pname_, None)
                if not (isinstance(p, torch.nn.Parameter) and p.requires_grad):
                    continue
                full = f"{src.target}.{pname_}"
                ct = self._unbroadcast(ct, p)
                prev = self.leaf_param_cots.get(full)
                self.leaf_param_cots[full] = ct if prev is None else prev + ct
        elif isinstance(src, dict) and isinstance(c, dict):
            for k, s in src.items():
                self._match(s, c.get(k), node, pname)
        # constants (Python numbers, None, dtypes): cotangent ignored

    # -- result ----------------------------------------------------------------------------------
    def gradient_of(self, node: fx.Node) -> Any:
        """Total cotangent of a leaf, zeros where nothing flowed, None for non-float leaves."""
        val = node.meta.get("val")
        ct = self.cots.get(node)
        if isinstance(val, _STRUCT):
            if node not in self.leaves:
                return pytree.tree_map(lambda _: None, val)
            return _fill_struct(val, ct, self, node)
        if not is_float(val) or node not in self.leaves:
            return None
        if ct is None:
            with self.em.meta_defaults(fxad_bwd_of="(unused input)"):
                return torch.zeros_like(self.env[node])
        return ct


def _struct_slot(val: Any, key: Any, ct: Any) -> Any:
    if isinstance(val, dict):
        return {k: (ct if k == key else None) for k in val}
    out = [None] * len(val)
    out[key] = ct
    return out


def _merge_struct(a: Any, b: Any) -> Any:
    if a is None:
        return b
    if b is None:
        return a
    if isinstance(a, dict):
        return {k: _merge_struct(a.get(k), b.get(k)) for k in a}
    if isinstance(a, (list, tuple)):
        return [_merge_struct(x, y) for x, y in zip(a, b)]
    return a + b


def _fill_struct(val: Any, ct: Any, tr: ReverseTransform, node: fx.Node) -> Any:
    base = tr.env[node]

    def fill(v: Any, c: Any, path: tuple) -> Any:
        if isinstance(v, dict):
            return {k: fill(v[k], (c or {}).get(k) if isinstance(c, dict) else None, path + (k,))
                    for k in v}
        if isinstance(v, (list, tuple)):
            items = [fill(x, c[i] if isinstance(c, (list, tuple)) else None, path + (i,))
                     for i, x in enumerate(v)]
            return tuple(items) if isinstance(v, tuple) else items
        if not is_float(v):
            return None
        if c is not None:
            return c
        leaf = base
        for k in path:
            leaf = leaf[k]
        return torch.zeros_like(leaf)

    return fill(val, ct, ())


def _placeholder(graph: fx.Graph, name: str) -> fx.Node:
    """A placeholder whose argument name is its (unique) node name: a value returned twice
    (``return y, y``) takes two cotangents, which must not share one argument name."""
    ph = graph.placeholder(name)
    ph.target = ph.name
    return ph


def build_vjp_graph(gm: fx.GraphModule, *, with_params: bool,
                    argnums: tuple[int, ...] | None = None) -> tuple[fx.Graph, dict]:
    """Build the VJP graph of a captured, normalized GraphModule.

    The graph's placeholders are the original inputs followed by one cotangent per floating
    output leaf; only inputs whose position is in ``argnums`` (all when None) are
    differentiated, the others get ``None``; it returns ``(outputs, input_grads)`` or, with ``with_params``,
    ``(outputs, input_grads, param_grads)``.

    Returns:
        (graph, info) with ``info`` holding ``cotangent_names``, ``param_names``.
    """
    tr = ReverseTransform(gm, with_params=with_params, argnums=argnums)
    with record_factories(tr.em):  # torch.zeros(...) inside rules writes graph code
        inputs, out_node = tr.forward()
        cot_names = tr.backward(out_node)
    outputs = tr._load(out_node.args[0])
    input_grads = tuple(tr.gradient_of(n) for n in inputs)
    result: tuple = (outputs, input_grads)
    if with_params:
        pg = {name: tr.gradient_of(n) for name, n in tr.params.items()}
        for n in gm.graph.nodes:  # parameters of leaf modules
            if n.op == "call_module" and n in tr.active:
                for pname, p in gm.get_submodule(n.target).named_parameters():
                    full = f"{n.target}.{pname}"
                    if full in pg or not p.requires_grad:
                        continue
                    ct = tr.leaf_param_cots.get(full)
                    if ct is None:
                        ct = torch.zeros_like(tr.em.create_proxy("get_attr", full, (), {}))
                    pg[full] = ct
        result = result + (pg,)
    tr.graph.output(_unwrap(result))
    return tr.graph, {"cotangent_names": cot_names, "param_names": list(tr.params),
                      "cot_placeholders": tr.cot_placeholders}


def _unwrap(x: Any) -> Any:
    if isinstance(x, fx.Proxy):
        return x.node
    if isinstance(x, dict):
        return {k: _unwrap(v) for k, v in x.items()}
    if isinstance(x, tuple) and hasattr(x, "_fields"):  # a namedtuple
        return type(x)(*(_unwrap(v) for v in x))
    if isinstance(x, (list, tuple)):
        return type(x)(_unwrap(v) for v in x)
    return x
