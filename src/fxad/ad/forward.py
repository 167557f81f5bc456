"""Forward mode: turn a captured, normalized graph into its JVP graph.

The transform mirrors :mod:`fxad.ad.reverse`, in one sweep instead of two:

1. **Activity analysis** (shared with reverse mode): a node is *active* when it depends on a
   differentiated input and holds floating tensors; *useful* when an output depends on it.
2. **Tangent placeholders.**  After the primal inputs ``x, y, ...`` come one tangent
   placeholder per input, ``t_x, t_y, ...`` (inputs that are not differentiated — integer
   tensors, inputs outside ``argnums`` — still get a placeholder, which must receive ``None``).
3. **Forward sweep.**  Inactive or useless nodes are copied.  For an active node the rule's
   ``jvp(primals, tangents)`` runs on proxies and writes both the primal value and its tangent.
   Zero tangents are symbolic (``None``): an op whose inputs all have ``None`` tangents is not
   active, and ``jvp`` rules receive ``None`` for the tangents of constant arguments.
   A tangent with the *broadcast* shape of an operand is expanded to the value's shape and
   cast to its dtype by the engine (the forward analogue of ``sum_to_size`` in reverse mode).
4. **Rules without ``jvp``** (user rules, some :mod:`fxad.rules.nn` rules) fall back to
   *transposition*: ``bwd(aux, u)`` is linear in ``u``, so the tangent ``J t`` is the
   cotangent of ``u`` for the "output" cotangent ``t`` of ``u ↦ bwd(aux, u)``.  The engine
   writes ``bwd`` into a scratch graph, runs the reverse transform over it, and inlines the
   result (see :meth:`ForwardTransform._transposed_jvp`).  The JVP is then exact but usually
   less direct than a hand-written ``jvp``.

Calling convention of ``jvp`` (stated in :mod:`fxad.rules.registry`): ``primals`` are the
op's arguments bound to the rule's ``fwd`` signature, as one positional tuple in parameter
order, **defaults filled in**, ``*args`` spread in place, keyword-only parameters after the
positional ones, and a ``**kwargs`` parameter passed as one dict in the last slot.
``tangents`` is aligned with ``primals``: a tensor proxy or ``None`` per tensor argument, a
list for a list argument (``torch.cat``), ``None`` for constants.

Meta keys written on the JVP graph:

``fxad_jvp_of``
    on tangent nodes: name of the forward node whose rule wrote them (codegen prints
    ``# tangent of: <forward statement>`` above each block).
``fxad_jvp_src``
    on tangent nodes: ``SourceLoc`` of that forward node in the user's code.
``fxad_tan_of``
    on the node holding the tangent of a forward value: that value's name (used to name it
    ``t_<name>``).
``fxad_tangent``
    on tangent placeholders.
"""
from __future__ import annotations

import contextlib
import inspect
from typing import Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from ..capture.normalize import normalize
from ..errors import RuleError
from ..graph.factories import record_factories
from ..graph.proxy import Emitter
from ..graph.sizes import known_equal
from ..rules.fused import fused_kernels
from ..rules.registry import Rule, missing_rule
from .modules import ModuleRef, ModuleSlot
from .node_rules import rule_for
from .reverse import (ReverseTransform, _is_structural_getitem, activity, build_vjp_graph,
                      copy_node, has_float, is_float, node_desc, rule_errors)

_STRUCT = (tuple, list, dict)
TANGENT_PREFIX = "dot_"

_P = inspect.Parameter


def flat_params(sig: inspect.Signature, bound: inspect.BoundArguments) -> list[Any]:
    """``bound``'s arguments as the positional ``primals`` tuple of the ``jvp`` convention
    (see the module docstring).  ``bound`` must have its defaults applied."""
    out: list[Any] = []
    for name, p in sig.parameters.items():
        v = bound.arguments.get(name, p.default)
        if p.kind == _P.VAR_POSITIONAL:
            out.extend(v)
        elif p.kind == _P.VAR_KEYWORD:
            out.append(dict(v))
        else:
            out.append(v)
    return out


def _unbroadcast(ct: Any, like: torch.Tensor) -> Any:
    return ReverseTransform._unbroadcast(None, ct, like)  # type: ignore[arg-type]


def _fit(t: Any, like: Any, desc: str) -> Any:
    """Bring a tangent to its value's shape (expand a broadcast operand's tangent) and dtype."""
    if t is None:
        return None
    if isinstance(like, _STRUCT):
        if isinstance(t, fx.Proxy):  # a proxy of a tuple: index it lazily
            return t
        if isinstance(like, dict):
            return {k: _fit(t.get(k), like[k], desc) for k in like}
        if not isinstance(t, (tuple, list)) or len(t) != len(like):
            raise RuleError(f"jvp of the rule for {desc} must return one tangent per element of "
                            f"its {len(like)}-tuple value")
        return type(like)(_fit(a, b, desc) for a, b in zip(t, like)) \
            if type(like) in (tuple, list) else tuple(_fit(a, b, desc) for a, b in zip(t, like))
    if not is_float(like):
        return None
    if not isinstance(t, fx.Proxy):
        raise RuleError(f"jvp of the rule for {desc} returned a non-tensor tangent "
                        f"({type(t).__name__})")
    ts, ls = tuple(t.meta.shape), tuple(like.shape)
    if not known_equal(ts, ls):  # (no decision on sizes read from data: expand checks them)
        try:
            torch.broadcast_shapes(ts, ls)
        except RuntimeError as e:
            raise RuleError(f"jvp of the rule for {desc} returned a tangent of shape {ts} for a "
                            f"value of shape {ls}") from e
        if torch.broadcast_shapes(ts, ls) != torch.Size(ls):
            raise RuleError(f"jvp of the rule for {desc} returned a tangent of shape {ts} for a "
                            f"value of shape {ls}")
        t = t.expand(ls)
    if t.meta.dtype != like.dtype:
        t = t.to(like.dtype)
    return t


def _index(t: Any, key: Any) -> Any:
    """Tangent of ``value[key]`` for a structured value with tangent ``t``."""
    if t is None:
        return None
    if isinstance(t, fx.Proxy):
        return t[key]
    return t[key]


class ForwardTransform:
    """One JVP transform of one captured graph (use :func:`build_jvp_graph`)."""

    def __init__(self, gm: fx.GraphModule, root: torch.nn.Module,
                 argnums: tuple[int, ...] | None = None) -> None:
        self.gm = gm
        self.src = gm.graph
        self.graph = fx.Graph()
        self.root = root
        self.em = Emitter(self.graph, root)
        self.argnums = argnums
        self.env: dict[fx.Node, Any] = {}
        self.tan: dict[fx.Node, Any] = {}

    # -- helpers -------------------------------------------------------------------------------
    def _load(self, a: Any) -> Any:
        return fx.node.map_aggregate(a, lambda x: self.env[x] if isinstance(x, fx.Node) else x)

    def _tangents_of(self, a: Any) -> Any:
        if isinstance(a, fx.Node):
            return self.tan.get(a)
        if isinstance(a, (tuple, list)):
            return type(a)(self._tangents_of(x) for x in a) if type(a) in (tuple, list) \
                else [self._tangents_of(x) for x in a]
        if isinstance(a, dict):
            return {k: self._tangents_of(v) for k, v in a.items()}
        return None

    def _copy(self, node: fx.Node) -> Any:
        return copy_node(node, self.graph, self.em, self.env)

    # -- sweep ---------------------------------------------------------------------------------
    def run(self) -> tuple[list[fx.Node], fx.Node]:
        inputs = [n for n in self.src.nodes if n.op == "placeholder"]
        leaves = {n for i, n in enumerate(inputs) if has_float(n.meta.get("val"))
                  and (self.argnums is None or i in self.argnums)}
        self.leaves = leaves
        active, useful = activity(self.gm, leaves)
        self.active = active
        for n in inputs:
            new = self.graph.placeholder(n.name)
            new.meta = dict(n.meta)
            self.env[n] = self.em.value(new)
        self.tangent_placeholders: list[fx.Node] = []
        for n in inputs:
            ph = self.graph.placeholder(TANGENT_PREFIX + n.name)
            ph.target = ph.name  # FX prints placeholders by target: keep them unique
            ph.meta["fxad_tangent"] = True
            ph.meta["fxad_tan_of"] = n.name
            ph.meta["val"] = n.meta.get("val") if n in leaves else None
            if n in leaves:
                self.tan[n] = self.em.value(ph)
            self.tangent_placeholders.append(ph)
        out_node = None
        for node in self.src.nodes:
            if node.op == "placeholder":
                continue
            if node.op == "output":
                out_node = node
            elif node in active and node in useful:
                self._jvp_node(node)
            else:
                self.env[node] = self._copy(node)
        assert out_node is not None
        self.inputs = inputs
        return inputs, out_node

    def _jvp_node(self, node: fx.Node) -> None:
        gm = self.gm
        desc = node_desc(gm, node)
        if _is_structural_getitem(node):
            self.env[node] = self._copy(node)
            parent, key = node.args[0], node.args[1]
            meta = self._meta(node)
            with self.em.meta_defaults(**meta):
                t = _fit(_index(self.tan.get(parent), key), node.meta.get("val"), desc)
            self._set_tangent(node, t)
            return
        rule = rule_for(gm, node, self.em)
        if rule is not None and rule.jvp is None and rule.fused:
            # a rule without jvp is transposed with fused kernels off (they have no rules to
            # transpose with): the overload that applies then
            with fused_kernels(False):
                rule = rule_for(gm, node, self.em)
        if rule is None:
            raise missing_rule(desc, node.meta.get("fxad_loc"), module=node.op == "call_module")
        args = self._load(node.args)
        kwargs = self._load(node.kwargs)
        src_args = tuple(node.args)
        if node.op == "call_module":
            args = (ModuleRef(self.em, node.target, gm.get_submodule(node.target)),) + tuple(args)
            src_args = (ModuleSlot(node.target),) + src_args
        sig = rule.signature
        try:
            bound = sig.bind(*args, **kwargs)
            sbound = sig.bind(*src_args, **node.kwargs)
        except TypeError as e:
            raise RuleError(f"rule for {desc} cannot take the call's arguments: {e}",
                            op=desc, loc=node.meta.get("fxad_loc")) from e
        bound.apply_defaults()
        sbound.apply_defaults()
        primals = tuple(flat_params(sig, bound))
        tangents = tuple(self._tangents_of(a) for a in flat_params(sig, sbound))
        if all(t is None for t in pytree.tree_leaves(tangents)):
            # every tangent flowing in is symbolically zero (e.g. through torch.ones_like)
            self.env[node] = self._copy(node)
            return
        last = self.graph._root.prev  # nodes created from here on belong to this rule
        # the rule writes the node's own call again: it takes the value capture computed
        known = self.em.known_value(node.op, node.target, args, kwargs, node.meta["val"]) \
            if node.op in ("call_function", "call_method") and "val" in node.meta \
            else contextlib.nullcontext()
        with self.em.meta_defaults(**self._meta(node)), known:
            with rule_errors(self.gm, node, "forward-mode (JVP)"):
                if rule.jvp is not None:
                    result = rule.jvp(primals, tangents)
                else:
                    result = self._transposed_jvp(rule, node, args, kwargs, sbound)
            if not (isinstance(result, tuple) and len(result) == 2):
                raise RuleError(f"jvp of the rule for {desc} must return (value, tangent)",
                                op=desc, loc=node.meta.get("fxad_loc"))
            value, t = result
            t = _fit(t, node.meta.get("val"), desc)
        created = []
        n = last.next
        while n is not self.graph._root:
            created.append(n)
            n = n.next
        self._mark_primal(node, value, created)
        self.env[node] = value
        self._set_tangent(node, t)

    def _meta(self, node: fx.Node) -> dict[str, Any]:
        meta: dict[str, Any] = {"fxad_jvp_of": node.name}
        if "fxad_loc" in node.meta:
            meta["fxad_jvp_src"] = node.meta["fxad_loc"]
        return meta

    def _set_tangent(self, node: fx.Node, t: Any) -> None:
        if t is None:
            return
        if isinstance(t, fx.Proxy) and t.node.op != "placeholder":
            t.node.meta.setdefault("fxad_tan_of", node.name)
        self.tan[node] = t

    def _mark_primal(self, node: fx.Node, value: Any, created: list[fx.Node]) -> None:
        """The nodes computing ``value`` are forward code: drop their tangent provenance, move
        them before the rule's tangent code and give the value the forward node's name."""
        if not isinstance(value, fx.Proxy):
            return
        new = set(created)
        primal: set[fx.Node] = set()
        stack = [value.node]
        while stack:
            m = stack.pop()
            if m in primal or m not in new:
                continue
            primal.add(m)
            stack.extend(m.all_input_nodes)
        first_tangent = next((m for m in created if m not in primal), None)
        for m in created:
            if m not in primal:
                continue
            for k in ("fxad_jvp_of", "fxad_jvp_src"):
                m.meta.pop(k, None)
            for k in ("fxad_bwd_of", "fxad_bwd_src"):  # forward of a backward graph
                if k in node.meta:
                    m.meta.setdefault(k, node.meta[k])
            if first_tangent is not None and _before(first_tangent, m):
                first_tangent.prepend(m)
        vn = value.node
        if vn in new:
            for k in ("fxad_loc", "stack_trace", "fxad_cot_of", "fxad_inplace"):
                if k in node.meta:
                    vn.meta.setdefault(k, node.meta[k])
            if vn.name != node.name:
                vn._rename(node.name)  # if taken, fixed by _restore_names at the end

    # -- rules without jvp: transposition of the VJP -------------------------------------------
    def _transposed_jvp(self, rule: Rule, node: fx.Node, args: tuple, kwargs: dict,
                        sbound: inspect.BoundArguments) -> tuple[Any, Any]:
        """JVP of a rule that only has ``fwd``/``bwd``.

        ``bwd(aux, ·)`` is the linear map ``u ↦ Jᵀu``; its transpose ``t ↦ J t`` is obtained by
        reverse-differentiating ``u ↦ Σᵢ <(Jᵀu)ᵢ, tᵢ>`` with respect to ``u``, i.e. running the
        reverse transform over the code ``bwd`` writes, with the input tangents ``tᵢ`` as the
        cotangents of its outputs.  The result does not depend on ``u`` (linearity).
        """
        desc = node_desc(self.gm, node)
        with fused_kernels(False):  # fused backward kernels have no rules to transpose with
            value, aux = rule.fwd(*args, **kwargs)
        val = node.meta.get("val")
        # which parameters carry a tangent, and their source nodes
        pairs: list[tuple[str, Any, fx.Node]] = []  # (param, tangent proxy, source node)

        def collect(name: str, src: Any) -> None:
            if isinstance(src, fx.Node):
                t = self.tan.get(src)
                if t is not None and is_float(src.meta.get("val")):
                    pairs.append((name, t, src))
            elif isinstance(src, (tuple, list)):
                for s in src:
                    collect(name, s)

        for name, src in sbound.arguments.items():
            collect(name, src)
        if not pairs:
            return value, None
        # scratch graph: u ↦ bwd(aux, u)
        g2 = fx.Graph()
        em2 = Emitter(g2, self.root)
        lifted: dict[fx.Node, Any] = {}
        outside: list[Any] = []  # main-graph values of g2's placeholders, in order

        def new_ph(name: str, v: Any, main: Any) -> Any:
            ph = g2.placeholder(name)
            ph.meta["val"] = v
            outside.append(main)
            return em2.value(ph)

        if isinstance(val, torch.Tensor):
            u_slots: list[Any] = [None]
            u = new_ph("u", val, None)
        else:
            u_slots = [k for k, p in enumerate(val) if is_float(p)]
            u = tuple(new_ph(f"u{k}", p, None) if is_float(p) else None
                      for k, p in enumerate(val))
        n_u = len(u_slots)

        def lift(x: Any) -> Any:
            if isinstance(x, fx.Proxy):
                if x.node not in lifted:
                    lifted[x.node] = new_ph(f"r{len(lifted)}", x.node.meta.get("val"), x)
                return lifted[x.node]
            if isinstance(x, ModuleRef):
                return ModuleRef(em2, x.target, x.module)
            return x

        aux2 = pytree.tree_map(lift, aux)
        with record_factories(em2), fused_kernels(False):  # type: ignore[arg-type]
            cts = rule.bwd(aux2, u)
        names = list(rule.params)
        if isinstance(cts, dict):
            by_name = cts
        else:
            if not isinstance(cts, (tuple, list)):
                cts = (cts,)
            by_name = dict(zip(names, cts))
        outs: list[Any] = []
        seeds: list[Any] = []

        def match(src: Any, c: Any) -> None:
            if c is None:
                return
            if isinstance(src, fx.Node):
                t = self.tan.get(src)
                if t is None or not is_float(src.meta.get("val")):
                    return
                if not isinstance(c, fx.Proxy):
                    raise RuleError(f"bwd of the rule for {desc} returned a non-tensor "
                                    f"cotangent ({type(c).__name__})")
                outs.append(_unbroadcast(c, src.meta["val"]).node)
                seeds.append(t)
            elif isinstance(src, (tuple, list)) and isinstance(c, (tuple, list)):
                for s, ci in zip(src, c):
                    match(s, ci)

        for name, src in sbound.arguments.items():
            match(src, by_name.get(name))
        if not outs:
            return value, None
        g2.output(tuple(outs))
        gm2 = fx.GraphModule(self.root, g2)
        normalize(gm2)
        n_ph = len([p for p in g2.nodes if p.op == "placeholder"])
        vjp_graph, _ = build_vjp_graph(gm2, with_params=False, argnums=tuple(range(n_u)))
        # inline: g2 inputs → main values; cotangent placeholders → the input tangents
        env: dict[fx.Node, Any] = {}
        phs = [p for p in vjp_graph.nodes if p.op == "placeholder"]
        for i, p in enumerate(phs):
            if i < n_u:  # u: its value never matters (linearity); dead code after simplify
                k = u_slots[i]
                env[p] = torch.zeros_like(value if k is None else value[k]).node
            elif i < n_ph:
                env[p] = outside[i].node
            else:
                env[p] = seeds[i - n_ph].node
        result = None
        drop = ("fxad_bwd_of", "fxad_bwd_src", "fxad_cot_of", "fxad_fwd_of", "fxad_fwd_src",
                "fxad_loc", "stack_trace")
        for m in vjp_graph.nodes:
            if m.op == "placeholder":
                continue
            if m.op == "output":
                result = m.args[0]
                break
            new = self.graph.node_copy(m, lambda x: env[x])
            new.meta = {k: v for k, v in m.meta.items() if k not in drop}
            new.meta.update(self.em.node_meta_defaults)
            env[m] = new
        assert result is not None
        grads = result[1][:n_u]
        grads = [self.em.value(env[g]) if isinstance(g, fx.Node) else None for g in grads]
        if isinstance(val, torch.Tensor):
            return value, grads[0]
        it = iter(grads)
        return value, tuple(next(it) if is_float(p) else None for p in val)

    # -- result --------------------------------------------------------------------------------
    def output_tangent(self, node: Any) -> Any:
        """Tangent of an output leaf: zeros where nothing flowed, None for non-floats."""
        if not isinstance(node, fx.Node):
            return None
        val = node.meta.get("val")
        t = self.tan.get(node)
        if isinstance(val, _STRUCT):
            def fill(v: Any, tt: Any, path: tuple) -> Any:
                if isinstance(v, dict):
                    return {k: fill(v[k], _index(tt, k), path + (k,)) for k in v}
                if isinstance(v, (tuple, list)):
                    items = [fill(x, _index(tt, i), path + (i,)) for i, x in enumerate(v)]
                    return tuple(items) if isinstance(v, tuple) else items
                if not is_float(v):
                    return None
                if tt is not None:
                    return tt
                leaf = self.env[node]
                for k in path:
                    leaf = leaf[k]
                return torch.zeros_like(leaf)
            with self.em.meta_defaults(fxad_jvp_of="(constant output)"):
                return fill(val, t, ())
        if not is_float(val):
            return None
        if t is None:
            with self.em.meta_defaults(fxad_jvp_of="(constant output)"):
                return torch.zeros_like(self.env[node])
        return t


def _before(a: fx.Node, b: fx.Node) -> bool:
    """True when ``a`` comes before ``b`` in their graph."""
    n = a.next
    while n is not a.graph._root:
        if n is b:
            return True
        n = n.next
    return False


def _restore_names(graph: fx.Graph, env: dict[fx.Node, Any]) -> None:
    """Give primal values the names of their source nodes.  A tangent node created earlier
    may hold such a name (FX names nodes after their op): it is renamed out of the way."""
    by_name = {n.name: n for n in graph.nodes}
    ns = graph._graph_namespace
    for src, v in env.items():
        if not isinstance(v, fx.Proxy):
            continue
        vn = v.node
        if vn.op in ("placeholder", "get_attr") or vn.name == src.name \
                or vn.meta.get("fxad_jvp_of") is not None:
            continue
        other = by_name.get(src.name)
        if other is not None:
            if other.meta.get("fxad_jvp_of") is None:
                continue  # another primal node holds it
            other._rename(src.name + "_1")
            by_name[other.name] = other
        by_name.pop(vn.name, None)
        try:
            ns._used_names.discard(src.name)
        except AttributeError:  # pragma: no cover - other torch versions
            pass
        vn._rename(src.name)
        by_name[vn.name] = vn


def group_tangent_code(graph: fx.Graph) -> bool:
    """Move all tangent code (``meta['fxad_jvp_of']``) after all primal code, keeping the
    order within each.  Used when the source graph is itself a derivative (forward-over-reverse):
    the result reads as the gradient code followed by its tangent, instead of alternating
    between the two at every statement.  Returns False (and changes nothing) if some primal
    node depends on tangent code."""
    tangent: set[fx.Node] = set()
    for n in graph.nodes:
        if n.op in ("placeholder", "output"):
            continue
        if n.meta.get("fxad_jvp_of") is not None:
            tangent.add(n)
        elif any(a in tangent for a in n.all_input_nodes):
            return False
    out = next(n for n in reversed(graph.nodes) if n.op == "output")
    for n in [m for m in graph.nodes if m in tangent]:
        out.prepend(n)
    return True


def build_jvp_graph(gm: fx.GraphModule, *, root: torch.nn.Module | None = None,
                    argnums: tuple[int, ...] | None = None) -> tuple[fx.Graph, dict]:
    """Build the JVP graph of a captured, normalized GraphModule.

    The graph's placeholders are the original inputs followed by one tangent per input
    (``t_<input>``); it returns ``(outputs, output_tangents)`` with ``output_tangents``
    shaped like ``outputs`` (``None`` for non-floating leaves).

    Returns:
        (graph, info) with ``info["tangent_placeholders"]`` and ``info["differentiated"]``
        (per input: whether it has a tangent).
    """
    tr = ForwardTransform(gm, root if root is not None else gm, argnums=argnums)
    with record_factories(tr.em):  # type: ignore[arg-type]
        inputs, out_node = tr.run()
        outputs = tr._load(out_node.args[0])
        tangents = fx.node.map_aggregate(out_node.args[0], tr.output_tangent)
    tr.graph.output((_unwrap(outputs), _unwrap(tangents)))
    _restore_names(tr.graph, tr.env)
    # provenance names: forward node in the source graph -> its value in the new graph
    names = {n.name: v.node.name for n, v in tr.env.items() if isinstance(v, fx.Proxy)}
    for n in tr.graph.nodes:
        for key in ("fxad_jvp_of", "fxad_tan_of"):
            of = n.meta.get(key)
            if of in names:
                n.meta[key] = names[of]
    if any("fxad_bwd_of" in n.meta for n in gm.graph.nodes):
        group_tangent_code(tr.graph)
    return tr.graph, {"tangent_placeholders": tr.tangent_placeholders,
                      "differentiated": [n in tr.leaves for n in inputs]}


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
