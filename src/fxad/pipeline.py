"""The build pipeline: what :func:`fxad.vjp`, :func:`fxad.grad`, :func:`fxad.jvp`,
:func:`fxad.hvp` and the Jacobians run, from the user's function to a generated module.

A reverse-mode build (:func:`static_vjp`), step by step::

    captured            capture and normalize                  (fxad.ad.transform)
    vjp_graph           the VJP graph                          (fxad.ad.reverse)
    order_parameter_gradients   parameter gradients in named_parameters() order, zeros for
                        the unused ones (modules only)
    seed_with_ones      fxad.grad: the cotangent of the scalar output is 1
    finish_vjp          simplify, name the gradients, the cotangent as one pytree argument,
                        input write-backs last, code generation
    vjp_module          the VJPModule
    install_mode_check  warn when the module's training flags change (fxad.guards)
    guard_vjp           what the module specialized on, checked on every call (fxad.guards)

Keyword arguments (``fxad.grad(f, x, mask=m)``) are captured as trailing inputs named by
their keyword (:func:`keyword_call`, :class:`~fxad.capture.tracer.KeywordCall`); their
gradients are dropped (:func:`drop_keyword_gradients`, as ``torch.func.grad`` differentiates
positional arguments only) and the module maps them back from keywords when called
(:func:`mark_keywords`).  ``has_aux=True`` detaches the auxiliary outputs in the captured
graph (:func:`split_aux`) and moves them last in the result (:func:`move_aux`).  Every
build runs under the ``values=`` policy (:func:`value_policy`).

With ``dynamic=True`` or ``dynamic_shapes=``, the same steps run once on symbolic sizes
(:mod:`fxad.symbolic`): the inputs are fake tensors whose dimensions are ``SymInt`` values, the
generated code reads its sizes from the inputs, and the guards check the ShapeEnv's
relations (:func:`build_vjp`).  A forward-mode build (:func:`static_jvp`)
runs ``captured``, ``jvp_graph``, ``finish_jvp`` and ``jvp_module`` the same way; :func:`build_hvp`
is the JVP of the generated gradient code, and the Jacobians (:func:`build_jacrev`,
:func:`build_jacfwd`, :func:`build_hessian`) vmap a generated module over basis vectors
(:class:`BatchedDerivative`).

The steps shared with the derivatives of control-flow bodies live in the engine entry
(:mod:`fxad.ad.transform`); the ones here serve only what users ask for.
"""
from __future__ import annotations

import math
import operator
from typing import Any, Callable, Iterable

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from .ad.generated import JVPModule, VJPModule
from .ad.reverse import has_float, is_float
from .ad.transform import (Derivative, captured, finish_jvp, finish_vjp, guard_vjp, jvp_graph,
                           jvp_module, vjp_graph, vjp_module)
from .capture import decisions
from .capture.tracer import KeywordCall, argument_names
from .errors import InputError
from .graph.sizes import read_result_sizes
from .capture.module_state import install_settings_check
from .guards import install_mode_check
from .rules.fallback import warn_fallbacks
from .rules.fused import fused_kernels
from .symbolic import build_with_sizes, reads_sizes, symbolic_build, wants_symbolic

__all__ = ["argnum_positions", "keyword_call", "keyword_argnums", "example_keywords",
           "value_policy", "build_vjp", "static_vjp", "build_jvp", "static_jvp", "build_hvp",
           "build_jacrev", "build_jacfwd", "build_hessian", "BatchedDerivative"]


def argnum_positions(argnums: int | Iterable[int] | None, n: int) -> tuple[int, ...] | None:
    """``argnums`` as non-negative positions among ``n`` inputs (None: all)."""
    if argnums is None:
        return None
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    bad = [a for a in nums if not -n <= a < n]
    if bad:
        raise InputError(f"argnums {bad} out of range for {n} inputs")
    return tuple(a % n for a in nums)


# -- keyword arguments, has_aux, the value policy ---------------------------------------------

def keyword_call(f: Any, example_inputs: tuple, kwargs: dict | None
                 ) -> tuple[Any, tuple, int]:
    """``(callee, inputs, n_positional)``: with keyword example inputs, ``callee`` is a
    :class:`~fxad.capture.tracer.KeywordCall` and ``inputs`` the positional inputs followed by
    the keyword values (the order of the placeholders); otherwise ``f`` and the inputs."""
    if isinstance(f, KeywordCall):  # already flat (a rebuild)
        return f, tuple(example_inputs), len(example_inputs) - len(f.keywords)
    if not kwargs:
        return f, tuple(example_inputs), len(example_inputs)
    return KeywordCall(f, tuple(kwargs)), tuple(example_inputs) + tuple(kwargs.values()), \
        len(example_inputs)


def example_keywords(example_kwargs: dict[str, Any] | None, kwargs: dict[str, Any]
                     ) -> dict[str, Any]:
    """The keyword example inputs of a public call: ``example_kwargs`` (for keywords that
    are also names of fxad's options) and the other keywords together."""
    both = dict(example_kwargs or {})
    dup = sorted(set(both) & set(kwargs))
    if dup:
        raise InputError(f"keyword argument(s) {dup} given twice (in example_kwargs and "
                         "directly)")
    both.update(kwargs)
    return both


def keyword_argnums(argnums: Any, n_pos: int, n: int, callee: Any = None
                    ) -> tuple[int, ...] | None:
    """``argnums`` as positions among the ``n_pos`` positional inputs; with keyword inputs
    (``n > n_pos``) the default is every positional input: as in ``torch.func.grad``, keyword
    arguments are not differentiated.  A ``callee`` whose keywords are differentiable
    (:class:`~fxad.capture.tracer.KeywordCall`, ``fxad.compile``) takes positions among all
    ``n`` inputs, the keyword ones last."""
    if isinstance(callee, KeywordCall) and callee.differentiable:
        n_pos = n
    nums = argnum_positions(argnums, n_pos)
    if nums is None and n > n_pos:
        return tuple(range(n_pos))
    return nums


def _padded_shapes(dynamic_shapes: Any, n_pos: int, n: int) -> Any:
    """``dynamic_shapes`` given as a tuple for the positional inputs, with ``None`` for the
    keyword inputs (a dict names them itself)."""
    if isinstance(dynamic_shapes, (tuple, list)) and len(dynamic_shapes) == n_pos < n:
        return tuple(dynamic_shapes) + (None,) * (n - n_pos)
    return dynamic_shapes


def mark_keywords(out: Any, callee: Any, n_pos: int) -> None:
    """Record on a generated module the keyword arguments it takes (``meta['fxad_keywords']``:
    ``(n_positional, keywords)``), which its call maps to their placeholders."""
    if isinstance(callee, KeywordCall):
        out.meta["fxad_keywords"] = (n_pos, callee.keywords)


def value_policy(values: str) -> Any:
    """The context every build runs in for the ``values=`` option (how capture treats a
    Python decision on a tensor's value: ``"guard"``, ``"guard+sizes"`` or ``"refuse"``,
    :mod:`fxad.capture.decisions`); raises :class:`InputError` for another value."""
    return decisions.value_policy(values)


def split_aux(gm: fx.GraphModule, api: str) -> int:
    """``has_aux=True``: ``gm`` returns ``(output, aux)``; the floating tensors of ``aux`` are
    detached (as ``torch.func`` does: they take no cotangent).  Returns the number of
    cotangents ``output`` takes (its floating tensor leaves)."""
    out_node = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    res = out_node.args[0]
    if not (isinstance(res, (tuple, list)) and len(res) == 2):
        raise InputError(f"{api}(..., has_aux=True) needs a function returning a pair "
                         "(output, aux); it returned "
                         + (f"a {len(res)}-tuple" if isinstance(res, (tuple, list)) else
                            "a single value"),
                         hint="return (loss, aux), or leave out has_aux=True")

    def detach(x: Any, name: str) -> Any:
        """``x`` (a node, or a container of them) with its floating tensors detached, each
        named after its place in ``aux`` (``aux_logits`` for ``{"logits": ...}``)."""
        if isinstance(x, dict):
            return {k: detach(v, f"{name}_{k}") for k, v in x.items()}
        if isinstance(x, (tuple, list)):
            return type(x)(detach(v, f"{name}_{i}") for i, v in enumerate(x)) \
                if type(x) in (tuple, list) else tuple(detach(v, f"{name}_{i}")
                                                       for i, v in enumerate(x))
        v = x.meta.get("val") if isinstance(x, fx.Node) else None
        if isinstance(v, (tuple, list)) and has_float(v):  # a tuple-valued node: per item
            items = []
            for i, item in enumerate(v):
                with gm.graph.inserting_before(out_node):
                    g = gm.graph.call_function(operator.getitem, (x, i))
                g.meta["val"] = item
                items.append(detach(g, f"{name}_{i}"))
            return tuple(items)
        if not is_float(v):
            return x
        with gm.graph.inserting_before(out_node):
            ident = "".join(c if c.isalnum() else "_" for c in name)
            d = gm.graph.create_node("call_method", "detach", (x,), {}, name=ident)
        d.meta.update({k: val for k, val in x.meta.items() if k in ("val", "fxad_loc")})
        d.meta["fxad_no_grad"] = True
        return d

    aux = detach(res[1], "aux")
    out_node.args = ((res[0], aux),)
    gm.recompile()
    n_cots = []  # one per floating tensor, as the reverse engine makes its placeholders

    def count(x: Any) -> Any:
        v = x.meta.get("val") if isinstance(x, fx.Node) else None
        n_cots.append(sum(map(is_float, pytree.tree_leaves(v) if isinstance(v, (tuple, list))
                              else [v])))
        return x

    fx.node.map_aggregate(res[0], count)
    return sum(n_cots)


def move_aux(d: Derivative, n_out: int) -> None:
    """The derivative of ``split_aux``'s graph: its result becomes ``(output, grads, ...,
    aux)``, and the cotangents of ``aux`` (unused: it is detached) are dropped."""
    result = list(d.out_node.args[0])
    output, aux = result[0]
    cots = [n for n in d.graph.nodes if n.op == "placeholder" and n.meta.get("fxad_cotangent")]
    for node in cots[n_out:]:
        if node.users:  # pragma: no cover - a detached value takes no cotangent
            raise InputError("internal: the cotangent of an aux value is used")
        if node.name in d.info["cotangent_names"]:
            d.info["cotangent_names"].remove(node.name)
        d.graph.erase_node(node)
    d.out_node.args = ((output, *result[1:], aux),)


def drop_keyword_gradients(d: Derivative, n_pos: int) -> None:
    """Input gradients of the positional inputs only (keyword inputs are not differentiated,
    as in ``torch.func.grad``)."""
    result = list(d.out_node.args[0])
    result[1] = tuple(result[1][:n_pos])
    d.out_node.args = (tuple(result),)


# -- reverse mode ----------------------------------------------------------------------------

def build_vjp(f: Any, example_inputs: tuple, *, leaf_modules: Iterable[type], simplify: bool,
              seed_ones: bool, argnums: Any = None, dynamic: Any = None,
              dynamic_shapes: Any = None, kwargs: dict | None = None, has_aux: bool = False,
              values: str = "guard") -> fx.GraphModule:
    """:func:`fxad.vjp` (``seed_ones=False``) or :func:`fxad.grad` (``seed_ones=True``); on
    symbolic sizes with ``dynamic=True`` / ``dynamic_shapes=`` (:mod:`fxad.symbolic`);
    ``kwargs``: keyword example inputs (:func:`keyword_call`)."""
    api = "fxad.grad" if seed_ones else "fxad.vjp"
    callee, inputs, n_pos = keyword_call(f, example_inputs, kwargs)
    nums = keyword_argnums(argnums, n_pos, len(inputs), callee)

    def one(xs: tuple) -> VJPModule:
        return static_vjp(callee, xs, leaf_modules=leaf_modules, simplify=simplify,
                          seed_ones=seed_ones, argnums=nums, has_aux=has_aux, values=values)

    with value_policy(values):
        if not wants_symbolic(dynamic, dynamic_shapes):
            out = build_with_sizes(one, argument_names(callee, len(inputs)), inputs)
        else:
            out = symbolic_build(one, argument_names(callee, len(inputs)), inputs,
                                 dynamic=dynamic,
                                 dynamic_shapes=_padded_shapes(dynamic_shapes, n_pos,
                                                               len(inputs)))
            out.meta["fxad_rebuild"] = lambda: build_vjp(
                callee, inputs, leaf_modules=leaf_modules, simplify=simplify,
                seed_ones=seed_ones, argnums=nums, dynamic=dynamic,
                dynamic_shapes=dynamic_shapes, has_aux=has_aux, values=values)
    warn_fallbacks(out.graph, api)
    mark_keywords(out, callee, n_pos)
    return out


def static_vjp(f: Any, example_inputs: tuple, *, leaf_modules: Iterable[type],
               simplify: bool, seed_ones: bool, argnums: Any = None, has_aux: bool = False,
               values: str = "guard") -> VJPModule:
    """One reverse-mode build at the shapes of ``example_inputs`` (the steps in the module
    docstring); ``f`` may be a :class:`~fxad.capture.tracer.KeywordCall`, whose keyword
    inputs come last and get no gradient."""
    api = "fxad.grad" if seed_ones else "fxad.vjp"
    gm = captured(f, example_inputs, leaf_modules)
    read_result_sizes(gm.graph)  # sizes of results that depend on data: read on every call
    n_out = split_aux(gm, api) if has_aux else 0
    user_f = f.f if isinstance(f, KeywordCall) else f
    n_pos = len(example_inputs) - (len(f.keywords) if isinstance(f, KeywordCall) else 0)
    d = vjp_graph(user_f, gm, argnums=argnum_positions(argnums, len(example_inputs)))
    if has_aux:
        move_aux(d, n_out)
    if n_pos < len(example_inputs) and not f.differentiable:
        drop_keyword_gradients(d, n_pos)
    if d.source is not None:
        order_parameter_gradients(d)
    if seed_ones:
        seed_with_ones(d)
    finish_vjp(d, simplify=simplify, cotangent_pytree=not seed_ones)
    if not seed_ones:
        unused_cotangent(d)
    out = vjp_module(d)
    watch_modules(out, d, gm)
    out.meta["fxad_rebuild"] = lambda: build_vjp(
        f, example_inputs, leaf_modules=leaf_modules, simplify=simplify, seed_ones=seed_ones,
        argnums=argnums, has_aux=has_aux, values=values)
    out.meta["fxad_has_aux"] = has_aux
    guard_vjp(out, d, example_inputs, seeded=seed_ones)
    spec = out.meta["fxad_input_spec"]
    if not seed_ones and spec.names[-1:] != ["cotangent"]:  # (an output of None)
        spec.names.append("cotangent")
        spec.trees.append(None)
        spec.leaves.append([None])
    guard_none_inputs(spec, example_inputs)
    return out


def watch_modules(out: fx.GraphModule, d: Derivative, gm: fx.GraphModule) -> None:
    """Warn on calls of ``out`` made after the modules it was captured from changed their
    training flags (:func:`fxad.guards.install_mode_check`) or Python attributes
    (:func:`fxad.capture.module_state.install_settings_check`): the traced module, or the
    modules a traced function calls from its closure (``gm.meta['fxad_closure_modules']``)."""
    roots = [d.source] if d.source is not None else gm.meta.get("fxad_closure_modules", [])
    for root in roots:
        install_mode_check(out, root)
    install_settings_check(out, roots)


def unused_cotangent(d: Derivative) -> None:
    """A VJP whose output has no floating tensor (``x.argmax()``, ``None``) takes no
    cotangent; it is still called ``g(*inputs, cotangent)`` (``None``), as every VJP."""
    phs = [n for n in d.graph.nodes if n.op == "placeholder"]
    if any(n.meta.get("fxad_cotangent") for n in phs) or len(phs) > len(d.input_names):
        return
    anchor = phs[-1] if phs else next(iter(d.graph.nodes))
    with (d.graph.inserting_after(anchor) if phs else d.graph.inserting_before(anchor)):
        ph = d.graph.placeholder("cotangent")
    ph.meta["val"] = None


def guard_none_inputs(spec: Any, example_inputs: tuple) -> None:
    """An input traced as ``None`` (``mask=None``) is guarded to stay ``None``, and one traced
    as a tensor to stay a tensor: the code took the branch for it."""
    spec.strict_inputs = len(example_inputs)
    for i, x in enumerate(example_inputs):
        if x is None and i < len(spec.leaves) and spec.leaves[i] == [None]:
            spec.leaves[i] = [("value", None)]


def _trainable(mod: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n, p) for n, p in mod.named_parameters() if p.requires_grad and is_float(p)]


def order_parameter_gradients(d: Derivative) -> None:
    """The parameter gradients (third output) keyed and ordered like the module's trainable
    ``named_parameters()``, zeros for the parameters nothing flowed to."""
    assert d.source is not None
    graph, out_node, em = d.graph, d.out_node, d.em
    result = list(out_node.args[0])
    given = result[2]
    ordered: dict[str, Any] = {}
    # (constructed and not entered, as the build always did: this leaves the graph's
    # insertion point before the output for every later step that adds nodes)
    graph.inserting_before(out_node)
    with graph.inserting_before(out_node), em.meta_defaults(fxad_bwd_of="(unused parameter)"):
        for name, _ in _trainable(d.source):
            if name in given:
                ordered[name] = given[name]
            else:
                ordered[name] = torch.zeros_like(
                    em.create_proxy("get_attr", name, (), {})).node
    result[2] = ordered
    out_node.args = (tuple(result),)


def seed_with_ones(d: Derivative) -> None:
    """:func:`fxad.grad`: the one cotangent placeholder (of a single scalar output) replaced
    by ``ones_like(output)``."""
    graph, em = d.graph, d.em
    outputs = d.outputs
    cots = [n for n in graph.nodes if n.op == "placeholder" and n.meta.get("fxad_cotangent")]
    if len(cots) != 1 or not isinstance(outputs, fx.Node) \
            or outputs.meta["val"].numel() != 1:
        raise InputError("fxad.grad needs a function with one scalar floating-point output; "
                         "use fxad.vjp for other outputs")
    ph = cots[0]
    with graph.inserting_after(outputs), em.meta_defaults(fxad_bwd_of=outputs.name):
        ones = torch.ones_like(em.value(outputs)).node
    ph.replace_all_uses_with(ones)
    graph.erase_node(ph)
    # the output set again, as the build always did after seeding: it becomes the last user
    # of the values it returns again (after ``ones_like(output)``), which the passes see
    d.out_node.args = (tuple(d.out_node.args[0]),)


# -- forward mode ----------------------------------------------------------------------------

def build_jvp(f: Any, example_inputs: tuple, *, leaf_modules: Iterable[type], simplify: bool,
              argnums: Any, dynamic: Any = None, dynamic_shapes: Any = None,
              kwargs: dict | None = None, values: str = "guard") -> JVPModule:
    """:func:`fxad.jvp`; on symbolic sizes as :func:`build_vjp`; keyword example inputs as
    there (inputs without tangents)."""
    callee, inputs, n_pos = keyword_call(f, example_inputs, kwargs)
    nums = keyword_argnums(argnums, n_pos, len(inputs), callee)

    def one(xs: tuple) -> JVPModule:
        return static_jvp(callee, xs, leaf_modules=leaf_modules, simplify=simplify,
                          argnums=nums)

    with value_policy(values):
        if not wants_symbolic(dynamic, dynamic_shapes):
            out = build_with_sizes(one, argument_names(callee, len(inputs)), inputs)
        else:
            out = symbolic_build(one, argument_names(callee, len(inputs)), inputs,
                                 dynamic=dynamic, dynamic_shapes=_padded_shapes(
                                     dynamic_shapes, n_pos, len(inputs)))
    mark_keywords(out, callee, n_pos)
    return out


def static_jvp(f: Any, example_inputs: tuple, *, leaf_modules: Iterable[type], simplify: bool,
               argnums: Any, select: Callable[[Any], Any] | None = None,
               suffix: str = "JVP", name: str | None = None) -> JVPModule:
    """One forward-mode build at the shapes of ``example_inputs``; ``select`` keeps part of
    the outputs (:func:`build_hvp`: the gradients)."""
    gm = captured(f, example_inputs, leaf_modules)
    read_result_sizes(gm.graph)  # sizes of results that depend on data: read on every call
    if select is not None:
        keep_outputs(gm, select)
    user_f = f.f if isinstance(f, KeywordCall) else f
    d = jvp_graph(user_f, gm, argnums=argnum_positions(argnums, len(example_inputs)))
    finish_jvp(d, simplify=simplify)
    out = jvp_module(d, example_inputs, suffix=suffix, name=name)
    watch_modules(out, d, gm)
    guard_none_inputs(out.meta["fxad_input_spec"], example_inputs)
    warn_fallbacks(d.graph, "fxad.jvp")  # once per build (fxad.FallbackWarning)
    return out


def keep_outputs(gm: fx.GraphModule, select: Callable[[Any], Any]) -> None:
    """Make ``gm`` return ``select(outputs)`` only."""
    out_node = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    out_node.args = (select(out_node.args[0]),)
    gm.recompile()


def build_hvp(f: Callable, example_inputs: tuple, *, argnums: Any,
              leaf_modules: Iterable[type], simplify: bool, dynamic: Any = None,
              dynamic_shapes: Any = None, kwargs: dict | None = None,
              values: str = "guard") -> JVPModule:
    """:func:`fxad.hvp`: the JVP of the generated gradient code (forward-over-reverse); on
    symbolic sizes, both builds are (the gradient code reads its sizes from its inputs, and
    its JVP is captured on symbolic sizes again).  Keyword example inputs as in
    :func:`build_vjp` (the gradient code takes them as its trailing inputs)."""
    callee, inputs, n_pos = keyword_call(f, example_inputs, kwargs)
    nums = keyword_argnums(argnums, n_pos, len(inputs), callee)
    with fused_kernels(False):  # the gradient code is differentiated again: no fused kernels
        g = build_vjp(callee, inputs, argnums=nums, leaf_modules=leaf_modules,
                      simplify=simplify, seed_ones=True, dynamic=dynamic,
                      dynamic_shapes=_padded_shapes(dynamic_shapes, n_pos, len(inputs)),
                      values=values)
    reads = reads_sizes(g)

    def jvp_of_grad(xs: tuple) -> JVPModule:
        return static_jvp(g, xs, leaf_modules=leaf_modules, simplify=simplify,
                          argnums=nums, select=lambda out: out[1], suffix="HVP",
                          name=getattr(f, "__name__", "f"))

    with value_policy(values):
        if wants_symbolic(dynamic, dynamic_shapes):
            out = symbolic_build(jvp_of_grad, argument_names(callee, len(inputs)), inputs,
                                 dynamic=dynamic, dynamic_shapes=_padded_shapes(
                                     dynamic_shapes, n_pos, len(inputs)))
        elif reads:  # the gradient code reads sizes from data: its JVP is built on a ShapeEnv
            out = symbolic_build(jvp_of_grad, argument_names(callee, len(inputs)), inputs,
                                 dynamic=False, dynamic_shapes=None)
        else:
            out = jvp_of_grad(inputs)
    out.meta["fxad_grad_module"] = g
    mark_keywords(out, callee, n_pos)
    return out


# -- Jacobians and Hessians ------------------------------------------------------------------

class BatchedDerivative:
    """A Jacobian or Hessian of ``f``: ``J(*inputs)`` evaluates it by ``torch.func.vmap`` of the
    generated code over basis vectors.

    Attributes:
        module: the generated per-vector module (a VJP, JVP or HVP module).
        kind: ``"jacrev"``, ``"jacfwd"`` or ``"hessian"``.
    """

    def __init__(self, kind: str, module: fx.GraphModule, fn: Callable[..., Any]) -> None:
        self.kind = kind
        self.module = module
        self._fn = fn

    @property
    def code(self) -> str:
        """The generated code that is vmapped."""
        return self.module.code

    def __call__(self, *inputs: Any, **kwargs: Any) -> Any:
        return self._fn(*inputs, **kwargs)

    def __repr__(self) -> str:
        return f"BatchedDerivative({self.kind}, module={type(self.module).__name__})"


def _float_leaves(x: Any) -> list[torch.Tensor]:
    return [v for v in pytree.tree_leaves(x)
            if isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex())]


def build_jacrev(f: Callable, example_inputs: tuple, nums: tuple[int, ...], single: bool, *,
                 leaf_modules: Iterable[type], simplify: bool, kwargs: dict | None = None,
                 values: str = "guard") -> BatchedDerivative:
    """:func:`fxad.jacrev`: the generated VJP vmapped over the basis of the output space."""
    g = build_vjp(f, example_inputs, argnums=nums, leaf_modules=leaf_modules,
                  simplify=simplify, seed_ones=False, kwargs=kwargs, values=values)
    fwd_gm = g.meta["fxad_forward"]
    out_node = next(n for n in reversed(fwd_gm.graph.nodes) if n.op == "output")
    out = out_node.args[0]
    out_val = out.meta.get("val") if isinstance(out, fx.Node) else None
    if not (isinstance(out_val, torch.Tensor) and out_val.is_floating_point()):
        raise InputError("fxad.jacrev needs a function returning one floating-point tensor; "
                         "use fxad.jacfwd for other outputs")
    out_shape = tuple(out_val.shape)

    def run(*xs: Any, **kw: Any) -> Any:
        m = math.prod(out_shape)
        device = next((v.device for v in _float_leaves(xs)), None)
        basis = torch.eye(m, dtype=out_val.dtype, device=device).reshape((m,) + out_shape)

        def row(ct: torch.Tensor) -> Any:
            grads = g(*xs, ct, **kw)[1]
            return tuple(grads[i] for i in nums)

        rows = torch.func.vmap(row)(basis)
        jac = tuple(pytree.tree_map(lambda r, x: r.reshape(out_shape + tuple(x.shape)), r, xs[i])
                    for r, i in zip(rows, nums))
        return jac[0] if single else jac

    return BatchedDerivative("jacrev", g, run)


def forward_jacobian(call: Callable[[list[Any]], Any], xs: tuple, nums: tuple[int, ...],
                     single: bool) -> Any:
    """vmap ``call(tangents) -> output tangent pytree`` over the basis of the inputs in
    ``nums``; returns, for every output leaf, the Jacobian w.r.t. each input in ``nums``."""
    slots = []  # (argnum, leaf position, leaf) of every floating leaf of the differentiated inputs
    for i in nums:
        leaves, _ = pytree.tree_flatten(xs[i])
        for k, v in enumerate(leaves):
            if isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex()):
                slots.append((i, k, v))
    sizes = [v.numel() for _, _, v in slots]
    total = sum(sizes)
    device = slots[0][2].device
    eye = torch.eye(total, device=device)
    basis, off = [], 0
    for (_, _, v), s in zip(slots, sizes):
        basis.append(eye[:, off:off + s].to(v.dtype).reshape((total,) + tuple(v.shape)))
        off += s
    out_spec: list[Any] = []

    def col(*ts: torch.Tensor) -> list[torch.Tensor]:
        tangents: list[Any] = [None] * len(xs)
        for i in nums:
            leaves, spec = pytree.tree_flatten(xs[i])
            tl = [None] * len(leaves)
            for (j, k, _), t in zip(slots, ts):
                if j == i:
                    tl[k] = t
            tangents[i] = pytree.tree_unflatten(tl, spec)
        out = call(tangents)
        leaves, spec = pytree.tree_flatten(out, is_leaf=lambda x: x is None)
        out_spec[:] = [spec, [v is None for v in leaves]]
        return [v for v in leaves if v is not None]

    cols = torch.func.vmap(col)(*basis)
    spec, none_mask = out_spec
    it = iter(cols)
    results = []
    for is_none in none_mask:
        if is_none:
            results.append(None)
            continue
        c = next(it)  # (total, *out_shape)
        out_shape = tuple(c.shape[1:])
        per_input: dict[int, list[Any]] = {i: [] for i in nums}
        off = 0
        for (i, k, v), s in zip(slots, sizes):
            block = c[off:off + s].movedim(0, -1).reshape(out_shape + tuple(v.shape))
            per_input[i].append((k, block))
            off += s
        jac = []
        for i in nums:
            leaves, sp = pytree.tree_flatten(xs[i])
            filled: list[Any] = [None] * len(leaves)
            for k, block in per_input[i]:
                filled[k] = block
            jac.append(pytree.tree_unflatten(filled, sp))
        results.append(jac[0] if single else tuple(jac))
    return pytree.tree_unflatten(results, spec)


def build_jacfwd(f: Callable, example_inputs: tuple, nums: tuple[int, ...], single: bool, *,
                 leaf_modules: Iterable[type], simplify: bool, kwargs: dict | None = None,
                 values: str = "guard") -> BatchedDerivative:
    """:func:`fxad.jacfwd`: the generated JVP vmapped over the basis of the inputs."""
    j = build_jvp(f, example_inputs, argnums=nums, leaf_modules=leaf_modules,
                  simplify=simplify, kwargs=kwargs, values=values)

    def run(*xs: Any, **kw: Any) -> Any:
        return forward_jacobian(lambda ts: j(*xs, *ts, **kw)[1], xs, nums, single)

    return BatchedDerivative("jacfwd", j, run)


def build_hessian(f: Callable, example_inputs: tuple, nums: tuple[int, ...], single: bool, *,
                  leaf_modules: Iterable[type], simplify: bool, kwargs: dict | None = None,
                  values: str = "guard") -> BatchedDerivative:
    """:func:`fxad.hessian`: the generated HVP vmapped over the basis of the inputs."""
    h = build_hvp(f, example_inputs, argnums=nums, leaf_modules=leaf_modules,
                  simplify=simplify, kwargs=kwargs, values=values)

    def run(*xs: Any, **kw: Any) -> Any:
        res = forward_jacobian(lambda ts: tuple(h(*xs, *ts, **kw)[1][i] for i in nums), xs,
                               nums, single)
        return res[0] if single else res

    return BatchedDerivative("hessian", h, run)
