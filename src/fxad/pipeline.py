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
from typing import Any, Callable, Iterable

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from .ad.generated import JVPModule, VJPModule
from .ad.reverse import is_float
from .ad.transform import (Derivative, captured, finish_jvp, finish_vjp, guard_vjp, jvp_graph,
                           jvp_module, vjp_graph, vjp_module)
from .capture.tracer import argument_names
from .errors import InputError
from .guards import install_mode_check
from .rules.fallback import warn_fallbacks
from .rules.fused import fused_kernels
from .symbolic import symbolic_build, wants_symbolic

__all__ = ["argnum_positions", "build_vjp", "static_vjp", "build_jvp", "static_jvp",
           "build_hvp", "build_jacrev", "build_jacfwd", "build_hessian", "BatchedDerivative"]


def argnum_positions(argnums: int | Iterable[int] | None, n: int) -> tuple[int, ...] | None:
    """``argnums`` as non-negative positions among ``n`` inputs (None: all)."""
    if argnums is None:
        return None
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    bad = [a for a in nums if not -n <= a < n]
    if bad:
        raise InputError(f"argnums {bad} out of range for {n} inputs")
    return tuple(a % n for a in nums)


# -- reverse mode ----------------------------------------------------------------------------

def build_vjp(f: Any, example_inputs: tuple, *, leaf_modules: Iterable[type], simplify: bool,
              seed_ones: bool, argnums: Any = None, dynamic: Any = None,
              dynamic_shapes: Any = None) -> fx.GraphModule:
    """:func:`fxad.vjp` (``seed_ones=False``) or :func:`fxad.grad` (``seed_ones=True``); on
    symbolic sizes with ``dynamic=True`` / ``dynamic_shapes=`` (:mod:`fxad.symbolic`)."""
    api = "fxad.grad" if seed_ones else "fxad.vjp"
    if not wants_symbolic(dynamic, dynamic_shapes):
        out = static_vjp(f, example_inputs, leaf_modules=leaf_modules, simplify=simplify,
                         seed_ones=seed_ones, argnums=argnums)
        warn_fallbacks(out.graph, api)
        return out
    out = symbolic_build(
        lambda fakes: static_vjp(f, fakes, leaf_modules=leaf_modules, simplify=simplify,
                                 seed_ones=seed_ones, argnums=argnums),
        argument_names(f, len(example_inputs)), example_inputs, dynamic=dynamic,
        dynamic_shapes=dynamic_shapes)
    warn_fallbacks(out.graph, api)
    out.meta["fxad_rebuild"] = lambda: build_vjp(
        f, example_inputs, leaf_modules=leaf_modules, simplify=simplify, seed_ones=seed_ones,
        argnums=argnums, dynamic=dynamic, dynamic_shapes=dynamic_shapes)
    return out


def static_vjp(f: Any, example_inputs: tuple, *, leaf_modules: Iterable[type],
               simplify: bool, seed_ones: bool, argnums: Any = None) -> VJPModule:
    """One reverse-mode build at the shapes of ``example_inputs`` (the steps in the module
    docstring)."""
    gm = captured(f, example_inputs, leaf_modules)
    d = vjp_graph(f, gm, argnums=argnum_positions(argnums, len(example_inputs)))
    if d.source is not None:
        order_parameter_gradients(d)
    if seed_ones:
        seed_with_ones(d)
    finish_vjp(d, simplify=simplify, cotangent_pytree=not seed_ones)
    out = vjp_module(d)
    if d.source is not None:
        install_mode_check(out, d.source)
    out.meta["fxad_rebuild"] = lambda: build_vjp(
        f, example_inputs, leaf_modules=leaf_modules, simplify=simplify, seed_ones=seed_ones,
        argnums=argnums)
    guard_vjp(out, d, example_inputs, seeded=seed_ones)
    return out


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
              argnums: Any, dynamic: Any = None, dynamic_shapes: Any = None) -> JVPModule:
    """:func:`fxad.jvp`; on symbolic sizes as :func:`build_vjp`."""
    if not wants_symbolic(dynamic, dynamic_shapes):
        return static_jvp(f, example_inputs, leaf_modules=leaf_modules, simplify=simplify,
                          argnums=argnums)
    return symbolic_build(
        lambda fakes: static_jvp(f, fakes, leaf_modules=leaf_modules, simplify=simplify,
                                 argnums=argnums),
        argument_names(f, len(example_inputs)), example_inputs, dynamic=dynamic,
        dynamic_shapes=dynamic_shapes)


def static_jvp(f: Any, example_inputs: tuple, *, leaf_modules: Iterable[type], simplify: bool,
               argnums: Any, select: Callable[[Any], Any] | None = None,
               suffix: str = "JVP", name: str | None = None) -> JVPModule:
    """One forward-mode build at the shapes of ``example_inputs``; ``select`` keeps part of
    the outputs (:func:`build_hvp`: the gradients)."""
    gm = captured(f, example_inputs, leaf_modules)
    if select is not None:
        keep_outputs(gm, select)
    d = jvp_graph(f, gm, argnums=argnum_positions(argnums, len(example_inputs)))
    finish_jvp(d, simplify=simplify)
    out = jvp_module(d, example_inputs, suffix=suffix, name=name)
    if d.source is not None:
        install_mode_check(out, d.source)
    warn_fallbacks(d.graph, "fxad.jvp")  # once per build (fxad.FallbackWarning)
    return out


def keep_outputs(gm: fx.GraphModule, select: Callable[[Any], Any]) -> None:
    """Make ``gm`` return ``select(outputs)`` only."""
    out_node = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    out_node.args = (select(out_node.args[0]),)
    gm.recompile()


def build_hvp(f: Callable, example_inputs: tuple, *, argnums: Any,
              leaf_modules: Iterable[type], simplify: bool, dynamic: Any = None,
              dynamic_shapes: Any = None) -> JVPModule:
    """:func:`fxad.hvp`: the JVP of the generated gradient code (forward-over-reverse); on
    symbolic sizes, both builds are (the gradient code reads its sizes from its inputs, and
    its JVP is captured on symbolic sizes again)."""
    with fused_kernels(False):  # the gradient code is differentiated again: no fused kernels
        g = build_vjp(f, example_inputs, argnums=argnums, leaf_modules=leaf_modules,
                      simplify=simplify, seed_ones=True, dynamic=dynamic,
                      dynamic_shapes=dynamic_shapes)

    def jvp_of_grad(inputs: tuple) -> JVPModule:
        return static_jvp(g, inputs, leaf_modules=leaf_modules, simplify=simplify,
                          argnums=argnums, select=lambda out: out[1], suffix="HVP",
                          name=getattr(f, "__name__", "f"))

    if wants_symbolic(dynamic, dynamic_shapes):
        out = symbolic_build(jvp_of_grad, argument_names(f, len(example_inputs)),
                             example_inputs, dynamic=dynamic, dynamic_shapes=dynamic_shapes)
    else:
        out = jvp_of_grad(example_inputs)
    out.meta["fxad_grad_module"] = g
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

    def __call__(self, *inputs: Any) -> Any:
        return self._fn(*inputs)

    def __repr__(self) -> str:
        return f"BatchedDerivative({self.kind}, module={type(self.module).__name__})"


def _float_leaves(x: Any) -> list[torch.Tensor]:
    return [v for v in pytree.tree_leaves(x)
            if isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex())]


def build_jacrev(f: Callable, example_inputs: tuple, nums: tuple[int, ...], single: bool, *,
                 leaf_modules: Iterable[type], simplify: bool) -> BatchedDerivative:
    """:func:`fxad.jacrev`: the generated VJP vmapped over the basis of the output space."""
    g = build_vjp(f, example_inputs, argnums=nums, leaf_modules=leaf_modules,
                  simplify=simplify, seed_ones=False)
    fwd_gm = g.meta["fxad_forward"]
    out_node = next(n for n in reversed(fwd_gm.graph.nodes) if n.op == "output")
    out = out_node.args[0]
    out_val = out.meta.get("val") if isinstance(out, fx.Node) else None
    if not (isinstance(out_val, torch.Tensor) and out_val.is_floating_point()):
        raise InputError("fxad.jacrev needs a function returning one floating-point tensor; "
                         "use fxad.jacfwd for other outputs")
    out_shape = tuple(out_val.shape)

    def run(*xs: Any) -> Any:
        m = math.prod(out_shape)
        device = next((v.device for v in _float_leaves(xs)), None)
        basis = torch.eye(m, dtype=out_val.dtype, device=device).reshape((m,) + out_shape)

        def row(ct: torch.Tensor) -> Any:
            grads = g(*xs, ct)[1]
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
                 leaf_modules: Iterable[type], simplify: bool) -> BatchedDerivative:
    """:func:`fxad.jacfwd`: the generated JVP vmapped over the basis of the inputs."""
    j = build_jvp(f, example_inputs, argnums=nums, leaf_modules=leaf_modules,
                  simplify=simplify)

    def run(*xs: Any) -> Any:
        return forward_jacobian(lambda ts: j(*xs, *ts)[1], xs, nums, single)

    return BatchedDerivative("jacfwd", j, run)


def build_hessian(f: Callable, example_inputs: tuple, nums: tuple[int, ...], single: bool, *,
                  leaf_modules: Iterable[type], simplify: bool) -> BatchedDerivative:
    """:func:`fxad.hessian`: the generated HVP vmapped over the basis of the inputs."""
    h = build_hvp(f, example_inputs, argnums=nums, leaf_modules=leaf_modules,
                  simplify=simplify)

    def run(*xs: Any) -> Any:
        res = forward_jacobian(lambda ts: tuple(h(*xs, *ts)[1][i] for i in nums), xs, nums,
                               single)
        return res[0] if single else res

    return BatchedDerivative("hessian", h, run)
