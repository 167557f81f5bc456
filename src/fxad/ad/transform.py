"""The engine entry: from a function, or a captured graph, to its derivative module.

The steps, each a function here, in the order a build runs them:

1. :func:`captured`: capture and normalize (:mod:`fxad.capture`).
2. :func:`vjp_graph` / :func:`jvp_graph`: the VJP or JVP graph (:mod:`fxad.ad.reverse`,
   :mod:`fxad.ad.forward`), held with what the later steps need in a :class:`Derivative`.
3. :func:`finish_vjp` / :func:`finish_jvp`: simplification (:mod:`fxad.simplify`), readable
   names (``d_x``, ``dot_x``), the cotangent argument shaped like the output pytree
   (:func:`cotangent_argument`), input write-backs last, and fxad's code generation
   (:mod:`fxad.codegen`).
4. :func:`vjp_module` / :func:`jvp_module`: the :class:`~fxad.ad.generated.VJPModule` /
   :class:`~fxad.ad.generated.JVPModule` and its metadata; :func:`guard_vjp` records what a
   VJP module specialized on (:mod:`fxad.guards`, checked on every call).

:func:`body_vjp` and :func:`body_jvp` run these steps for the branch and body graphs of
captured control flow (:mod:`fxad.ad.control_flow`).  The build pipeline
(:mod:`fxad.pipeline`) runs them for what users ask for, adding its own steps between them:
gradients of parameters in ``named_parameters()`` order, seeding a gradient with ones, the
training-mode check and ``dynamic=`` shapes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from .. import codegen
from ..capture.normalize import normalize
from ..capture.tracer import capture
from ..graph.proxy import Emitter
from ..graph.sizes import bind_sizes
from ..guards import InputSpec, spec_of
from ..rules.fallback import warn_fallbacks
from ..rules.fused import enabled as fused_enabled, fuse_formulas, fused_kernels
from ..simplify import simplify as run_simplifier
from ..simplify._util import resolve
from ..simplify.effects import input_mutations_last
from .forward import TANGENT_PREFIX, build_jvp_graph
from .generated import JVPModule, VJPModule
from .reverse import build_vjp_graph, is_float

__all__ = ["Derivative", "captured", "vjp_graph", "jvp_graph", "finish_vjp", "finish_jvp",
           "vjp_module", "jvp_module", "guard_vjp", "body_vjp", "body_jvp"]


# -- 1. capture ----------------------------------------------------------------------------

def captured(f: Callable | torch.nn.Module, example_inputs: tuple,
             leaf_modules: Iterable[type] = ()) -> fx.GraphModule:
    """``f`` captured on ``example_inputs`` and normalized (what :func:`fxad.trace` returns);
    at fused level ``"all"`` (code built to run) with written-out formulas one kernel
    computes replaced by it (:func:`fxad.rules.fused.fuse_formulas`)."""
    f = without_fused_kernels(f)
    gm = capture(f, example_inputs, leaf_modules=leaf_modules)
    normalize(gm)
    if fused_enabled("all"):
        fuse_formulas(gm)
    return gm


def without_fused_kernels(f: Any) -> Any:
    """An fxad-generated module about to be differentiated again: fused backward kernels have
    no rules, so rebuild it with the plain-torch formulas (same values, differentiable)."""
    if not (isinstance(f, fx.GraphModule) and "fxad_rebuild" in f.meta):
        return f
    if not any(n.op == "call_function" and isinstance(
            n.target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket))
            for n in f.graph.nodes):
        return f
    with fused_kernels(False):
        return f.meta["fxad_rebuild"]()


def source_module(f: Any) -> torch.nn.Module | None:
    """The user's module behind ``f`` (``f`` itself, or the module an fxad graph was captured
    from); None for a function."""
    if isinstance(f, fx.GraphModule):
        return f.meta.get("fxad_source_module")
    return f if isinstance(f, torch.nn.Module) else None


# -- 2. the derivative graph ---------------------------------------------------------------

@dataclass
class Derivative:
    """A derivative graph between the engine and its module: what the build steps read and
    edit.

    Attributes:
        f: what is differentiated (a function, an ``nn.Module`` or a GraphModule).
        forward: ``f`` captured and normalized.
        graph: the derivative graph.
        info: what the engine reports about it (``cotangent_names``, ``differentiated``, ...).
        source: the user's module behind ``f`` (its parameters are differentiated in reverse
            mode), or None.
        root: the module the generated code reads its attributes from.
        em: an emitter writing into ``graph``.
        out_node: ``graph``'s output node.
        input_names: the names of the inputs (not the cotangents), set by :func:`finish_vjp`.
    """

    f: Any
    forward: fx.GraphModule
    graph: fx.Graph
    info: dict
    source: torch.nn.Module | None
    root: torch.nn.Module
    em: Emitter
    out_node: fx.Node
    input_names: list[str] = field(default_factory=list)

    @property
    def outputs(self) -> Any:
        """What the derivative returns as the function's outputs."""
        return self.out_node.args[0][0]


def _output_node(graph: fx.Graph) -> fx.Node:
    return next(n for n in reversed(graph.nodes) if n.op == "output")


def vjp_graph(f: Any, gm: fx.GraphModule, *, argnums: tuple[int, ...] | None) -> Derivative:
    """The VJP graph of ``gm`` (``f`` captured): it returns ``(outputs, input_grads)``, and
    ``param_grads`` third when ``f`` is a module (see :func:`fxad.ad.reverse.build_vjp_graph`)."""
    src = source_module(f)
    graph, info = build_vjp_graph(gm, with_params=src is not None, argnums=argnums)
    root: torch.nn.Module = src if src is not None else gm
    return Derivative(f, gm, graph, info, src, root, Emitter(graph, root), _output_node(graph))


def jvp_graph(f: Any, gm: fx.GraphModule, *, argnums: tuple[int, ...] | None) -> Derivative:
    """The JVP graph of ``gm`` (``f`` captured): it takes the inputs then one tangent per
    input and returns ``(outputs, output_tangents)`` (see
    :func:`fxad.ad.forward.build_jvp_graph`)."""
    src = source_module(f)
    root: torch.nn.Module = src if src is not None else gm
    graph, info = build_jvp_graph(gm, root=root, argnums=argnums)
    return Derivative(f, gm, graph, info, src, root, Emitter(graph, root), _output_node(graph))


# -- 3. finishing the graph ----------------------------------------------------------------

def finish_vjp(d: Derivative, *, simplify: bool, cotangent_pytree: bool) -> None:
    """Simplify, name the gradients, take the cotangent as one argument shaped like the
    output (``cotangent_pytree``; for several or structured outputs), keep input write-backs
    last and install fxad's code generation."""
    if simplify:
        run_simplifier(d.graph)
    inputs = [n for n in d.graph.nodes
              if n.op == "placeholder" and not n.meta.get("fxad_cotangent")]
    d.input_names = [n.name for n in inputs]
    name_gradients(d, inputs)
    outputs = d.outputs
    single = isinstance(outputs, fx.Node) and isinstance(outputs.meta.get("val"), torch.Tensor)
    if not single and cotangent_pytree:
        cotangent_argument(d.graph, outputs, len(inputs))
    input_mutations_last(d.graph)
    bind_sizes(d.graph)
    codegen.install(d.graph)


def name_gradients(d: Derivative, inputs: list[fx.Node]) -> None:
    """``d_<input>`` for the returned input gradients, ``d_<parameter>`` (dots as
    underscores) for the parameter gradients, ``d_<value>`` for the other cotangents."""
    result = list(d.out_node.args[0])
    names: dict[fx.Node, str] = {}
    for ph, g in zip(inputs, result[1]):
        if isinstance(g, fx.Node):
            names.setdefault(g, f"d_{ph.name}")
    if d.source is not None:
        for pname, g in result[2].items():
            if isinstance(g, fx.Node):
                names.setdefault(g, "d_" + pname.replace(".", "_"))
    codegen.name_cotangents(d.graph, names)


class _Slot:
    """A leaf marker used to build the input TreeSpec."""


def cotangent_argument(graph: fx.Graph, outputs: Any, n_inputs: int) -> None:
    """Make the graph take one ``cotangent`` argument shaped like the output pytree.

    Floating tensor leaves of the output take a cotangent tensor; other leaves take ``None``.
    """
    def slot(leaf: Any) -> Any:
        v = leaf.meta.get("val") if isinstance(leaf, fx.Node) else None
        if isinstance(v, (tuple, list)):
            return type(v)(_Slot() if is_float(x) else None for x in v) \
                if type(v) in (tuple, list) else tuple(_Slot() if is_float(x) else None for x in v)
        return _Slot() if is_float(v) else None

    def plain(x: Any) -> Any:  # FX stores immutable_dict / immutable_list in node args
        if isinstance(x, dict):
            return {k: plain(v) for k, v in x.items()}
        if isinstance(x, list):
            return [plain(v) for v in x]
        if isinstance(x, tuple) and type(x) is tuple:
            return tuple(plain(v) for v in x)
        return x

    cot_tree = pytree.tree_map(slot, plain(outputs), is_leaf=lambda x: isinstance(x, fx.Node))
    # every leaf of the cotangent is an argument; non-floating outputs take an ignored one
    # (pass None), so that the argument pytree mirrors the output pytree exactly
    flat, tree_spec = pytree.tree_flatten(cot_tree, is_leaf=lambda x: x is None)
    cots = [n for n in graph.nodes if n.op == "placeholder" and n.meta.get("fxad_cotangent")]
    last = [n for n in graph.nodes if n.op == "placeholder"][-1]
    it = iter(cots)
    prev = last if not cots else None
    for k, leaf in enumerate(flat):
        if leaf is None:
            anchor = prev if prev is not None else cots[0].prev
            with graph.inserting_after(anchor):
                ph = graph.placeholder(f"no_cotangent_{k}")
            ph.meta["val"] = None
            prev = ph
        else:
            prev = next(it)
    cot_tree = pytree.tree_unflatten([_Slot() for _ in flat], tree_spec)
    spec = pytree.tree_structure(tuple(_Slot() for _ in range(n_inputs)) + (cot_tree,))
    names = [n.name for n in graph.nodes if n.op == "placeholder"][:n_inputs] + ["cotangent"]
    graph.set_codegen(_pytree_codegen(names, spec))


def _pytree_codegen(names: list[str], in_spec: pytree.TreeSpec) -> fx.graph.CodeGen:
    """FX's code generation for a function whose arguments ``names`` are pytrees (flattened
    by ``in_spec`` into the graph's placeholders).  torch.fx has no public class for it: this
    is the one use of its private ``_PyTreeCodeGen`` (the one ``torch.fx.symbolic_trace``
    uses for pytree inputs), which writes the signature ``forward(self, x, cotangent)``."""
    from torch.fx.graph import _PyTreeCodeGen, _PyTreeInfo

    return _PyTreeCodeGen(_PyTreeInfo(orig_args=names, in_spec=in_spec, out_spec=None))


def finish_jvp(d: Derivative, *, simplify: bool) -> None:
    """Simplify, name the tangents (:func:`name_tangents`), keep input write-backs last and
    install fxad's code generation."""
    if simplify:
        run_simplifier(d.graph)
    name_tangents(d.graph)
    input_mutations_last(d.graph)
    bind_sizes(d.graph)
    codegen.install(d.graph)


def name_tangents(graph: fx.Graph) -> None:
    """Rename tangent nodes ``dot_<value>`` (``meta['fxad_tan_of']``); placeholders keep their
    names; clashes get FX's numeric suffix."""
    for node in graph.nodes:
        if node.op not in ("call_function", "call_method"):
            continue
        of = node.meta.get("fxad_tan_of")
        if of:
            name = TANGENT_PREFIX + resolve(graph, of)
            if node.name != name:
                node._rename(name)


# -- 4. the module -------------------------------------------------------------------------

def vjp_module(d: Derivative) -> VJPModule:
    """The :class:`~fxad.ad.generated.VJPModule` of a finished VJP graph."""
    name = type(d.source).__name__ if d.source is not None else getattr(d.f, "__name__", "f")
    out = VJPModule(d.root, d.graph, class_name=f"{name}VJP")
    out.meta.update(d.forward.meta)
    out.meta["fxad_forward"] = d.forward
    out.meta["fxad_cotangent_names"] = d.info["cotangent_names"]
    return out


def guard_vjp(out: fx.GraphModule, d: Derivative, example_inputs: tuple, *,
              seeded: bool) -> None:
    """Record what the VJP module specialized on (checked on every call): the inputs as
    traced, then (unless the gradient is ``seeded`` with ones, as in :func:`fxad.grad`) the
    cotangent shaped like the output (``None`` for non-floating outputs)."""
    out.meta["fxad_input_spec"] = vjp_input_spec(
        d.input_names, example_inputs, None if seeded else d.outputs,
        "fxad.grad" if seeded else "fxad.vjp", d.forward.meta)


def vjp_input_spec(names: list[str], example_inputs: tuple, outputs: Any, api: str,
                   meta: dict | None = None) -> InputSpec:
    """The guard of a generated VJP: the inputs as traced, then the cotangent (shaped like the
    output; ``None`` for non-floating outputs)."""
    examples = list(example_inputs)
    names = list(names)
    if outputs is not None:
        def cot(x: Any) -> Any:
            v = x.meta.get("val") if isinstance(x, fx.Node) else None
            if isinstance(v, (tuple, list)):
                return tuple(t if is_float(t) else None for t in v)
            return v if is_float(v) else None
        plain = pytree.tree_map(lambda x: x, outputs, is_leaf=lambda x: isinstance(x, fx.Node))
        examples.append(pytree.tree_map(cot, plain, is_leaf=lambda x: isinstance(x, fx.Node)))
        names.append("cotangent")
    meta = meta or {}
    return spec_of(names, examples, rebuild=f"rebuild it with {api}(f, *inputs) on inputs "
                                            "like these",
                   values=meta.get("fxad_value_inputs", ()),
                   constants=meta.get("fxad_value_constants", ()))


def jvp_module(d: Derivative, example_inputs: tuple, *, suffix: str = "JVP",
               name: str | None = None) -> JVPModule:
    """The :class:`~fxad.ad.generated.JVPModule` of a finished JVP graph, with what it
    specialized on (checked on every call)."""
    f = d.f
    if name is None:
        name = type(d.source).__name__ if d.source is not None else \
            type(f).__name__ if isinstance(f, fx.GraphModule) else getattr(f, "__name__", "f")
    out = JVPModule(d.root, d.graph, class_name=f"{name}{suffix}")
    gm = d.forward
    out.meta.update(gm.meta)
    out.meta["fxad_forward"] = gm
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    out.meta["fxad_jvp_inputs"] = [(n.name, n.meta.get("val"), diff)
                                   for n, diff in zip(phs, d.info["differentiated"])]
    out.meta["fxad_input_spec"] = spec_of(
        [n.name for n in phs], example_inputs,
        rebuild="rebuild it with fxad.jvp(f, *inputs) on inputs like these",
        values=gm.meta.get("fxad_value_inputs", ()),
        constants=gm.meta.get("fxad_value_constants", ()))
    return out


# -- control-flow bodies -------------------------------------------------------------------

def body_vjp(gm: fx.GraphModule, example_inputs: tuple) -> VJPModule:
    """The VJP module of a captured branch or loop body ``gm`` (its own readable module,
    called as ``vjp(*inputs, cotangent)``), built as :func:`fxad.vjp` builds one."""
    d = vjp_graph(gm, captured(gm, example_inputs), argnums=None)
    finish_vjp(d, simplify=True, cotangent_pytree=True)
    out = vjp_module(d)
    out.meta["fxad_rebuild"] = lambda: body_vjp(gm, example_inputs)
    guard_vjp(out, d, example_inputs, seeded=False)
    warn_fallbacks(out.graph, "fxad.vjp")
    return out


def body_jvp(gm: fx.GraphModule, example_inputs: tuple) -> JVPModule:
    """The JVP module of a captured branch or loop body ``gm`` (``jvp(*inputs,
    *tangents)``), built as :func:`fxad.jvp` builds one."""
    d = jvp_graph(gm, captured(gm, example_inputs), argnums=None)
    finish_jvp(d, simplify=True)
    out = jvp_module(d, example_inputs)
    warn_fallbacks(d.graph, "fxad.jvp")
    return out
