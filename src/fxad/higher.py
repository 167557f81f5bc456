"""Forward mode and higher-order derivatives: :func:`jvp`, :func:`hvp`, :func:`jacrev`,
:func:`jacfwd`, :func:`hessian`.

Design
------
* **One rule table.**  Each rule keeps its VJP (``fwd``/``bwd``) and its JVP (``jvp``) side
  by side in one class (see :mod:`fxad.rules.registry`).  A rule registered without ``jvp``
  still works in forward mode: the engine transposes its ``bwd`` (which is linear in the
  cotangent) with the reverse transform (:mod:`fxad.ad.forward`).  Adding an op is therefore a
  one-place change: register ``fwd``/``bwd``; add ``jvp`` beside them for shorter tangent code.
* **Generated code all the way down.**  :func:`jvp` writes torch-level code like :func:`vjp`;
  compositions (``fxad.jvp(fxad.grad(f, x), x)``, ``fxad.vjp(fxad.grad(f, x), x)``) re-capture
  the generated module and differentiate it again, so second derivatives are plain code too.
  :func:`hvp` is forward-over-reverse: the JVP of the generated gradient code (built with
  ``fxad.fused_kernels(False)``, since fused backward kernels have no rules; when composing
  by hand, fxad rebuilds a generated module that contains fused kernels the same way).
* **Jacobians and Hessians** are computed by ``torch.func.vmap`` over the generated code,
  batched over basis vectors (one VJP per output element for :func:`jacrev`, one JVP per input
  element for :func:`jacfwd`, one HVP per input element for :func:`hessian`).  The returned
  :class:`BatchedDerivative` exposes the generated per-vector module (``.module``, ``.code``).

Names in generated forward-mode code: the tangent of input ``x`` is the placeholder
``dot_x``; the tangent of an intermediate value ``v`` is ``dot_v`` (so in an HVP, ``dot_d_x``
is the tangent of the gradient ``d_x``: the Hessian-vector product).  ``dot_`` rather than
``t_`` because FX already names transposes ``t``, ``t_1``.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Iterable

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from . import codegen
from .ad.forward import TANGENT_PREFIX, build_jvp_graph
from .api import _argnums, _install_mode_check, _source_module, grad, trace, vjp
from .errors import InputError
from .simplify import simplify as run_simplifier
from .simplify._util import resolve

__all__ = ["JVPModule", "BatchedDerivative", "jvp", "hvp", "jacrev", "jacfwd", "hessian"]


class JVPModule(fx.GraphModule):
    """GraphModule returned by :func:`jvp` and :func:`hvp`: ``gm(*primals, *tangents)``.

    Before running, a call checks its arguments (raising :class:`fxad.InputError`, before any
    computation): ``n`` primals then ``n`` tangents; each tangent a pytree like its primal
    with the primal's shapes and dtypes; ``None`` for inputs that are not differentiated
    (integer tensors, inputs outside ``argnums``).  ``None`` for a differentiated input, or
    for a floating leaf of one, means a zero tangent.

    Calls run under ``torch.no_grad()`` unless ``gm.record_autograd = True`` (as
    :class:`fxad.VJPModule`).
    """

    record_autograd: bool = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs:
            raise InputError("fxad JVP modules take positional arguments only: "
                             "gm(*primals, *tangents)")
        args = self._check_arguments(args)
        spec = self.meta.get("fxad_input_spec")
        if spec is not None:  # what the trace specialized on (fxad.guards)
            spec.check(args[:len(spec.names)])
        if self.record_autograd:
            return super().__call__(*args)
        with torch.no_grad():
            return super().__call__(*args)

    def _check_arguments(self, args: tuple) -> tuple:
        specs = self.meta.get("fxad_jvp_inputs")
        if specs is None:  # pragma: no cover - not built by fxad
            return args
        n = len(specs)
        if len(args) != 2 * n:
            names = ", ".join(s[0] for s in specs)
            raise InputError(
                f"this JVP module takes {n} primal(s) ({names}) followed by {n} tangent(s) "
                f"({', '.join(TANGENT_PREFIX + s[0] for s in specs)}); got {len(args)} "
                "arguments")
        primals, tangents = list(args[:n]), list(args[n:])
        for i, (name, captured, differentiated) in enumerate(specs):
            tangents[i] = _check_tangent(name, primals[i], tangents[i], captured, differentiated)
        return tuple(primals) + tuple(tangents)


def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"shape {tuple(x.shape)} and dtype {x.dtype}"
    return type(x).__name__


def _check_tangent(name: str, primal: Any, tangent: Any, captured: Any,
                   differentiated: bool) -> Any:
    tname = TANGENT_PREFIX + name
    if not differentiated:
        if tangent is not None and any(isinstance(v, torch.Tensor)
                                       for v in pytree.tree_leaves(tangent)):
            why = "it is not a floating-point input" if not _has_float(captured) else \
                "it is not in argnums"
            raise InputError(f"tangent `{tname}` must be None: input `{name}` is not "
                             f"differentiated ({why})")
        return None
    p_leaves, p_spec = pytree.tree_flatten(primal)
    c_leaves, c_spec = pytree.tree_flatten(captured)
    if p_spec != c_spec:
        raise InputError(f"input `{name}` does not have the structure it was captured with "
                         f"({c_spec} expected)")
    if tangent is None:
        t_leaves: list[Any] = [None] * len(p_leaves)
    else:
        t_leaves, t_spec = pytree.tree_flatten(tangent, is_leaf=lambda x: x is None)
        if t_spec != p_spec:
            raise InputError(f"tangent `{tname}` must have the structure of input `{name}` "
                             f"({p_spec}); got {t_spec}")
    out = []
    for k, (p, c, t) in enumerate(zip(p_leaves, c_leaves, t_leaves)):
        where = f"`{tname}`" + (f" (leaf {k})" if len(p_leaves) > 1 else "")
        if isinstance(c, torch.Tensor):
            # (the exact shape is the guard's to check: a dimension may be dynamic)
            if not isinstance(p, torch.Tensor) or p.dim() != c.dim() or p.dtype != c.dtype:
                raise InputError(
                    f"input `{name}`" + (f" (leaf {k})" if len(p_leaves) > 1 else "")
                    + f" has {_describe(p)}, but the JVP was generated for {_describe(c)}; "
                    "generate it again for these shapes")
        if not (isinstance(c, torch.Tensor) and (c.is_floating_point() or c.is_complex())):
            if t is not None:
                raise InputError(f"tangent {where} must be None: that leaf of `{name}` is not "
                                 "a floating-point tensor")
            out.append(None)
            continue
        if t is None:
            out.append(torch.zeros_like(p))
            continue
        if not isinstance(t, torch.Tensor):
            raise InputError(f"tangent {where} must be a tensor or None, got {type(t).__name__}")
        if tuple(t.shape) != tuple(p.shape) or t.dtype != p.dtype:
            raise InputError(f"tangent {where} has {_describe(t)}, but input `{name}` has "
                             f"{_describe(p)}; a tangent must match its primal's shape and "
                             "dtype")
        out.append(t)
    return pytree.tree_unflatten(out, p_spec)


def _has_float(v: Any) -> bool:
    return any(isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex())
               for x in pytree.tree_leaves(v))


def name_tangents(graph: fx.Graph) -> None:
    """Rename tangent nodes ``t_<value>`` (``meta['fxad_tan_of']``); placeholders keep their
    names; clashes get FX's numeric suffix."""
    for node in graph.nodes:
        if node.op not in ("call_function", "call_method"):
            continue
        of = node.meta.get("fxad_tan_of")
        if of:
            name = TANGENT_PREFIX + resolve(graph, of)
            if node.name != name:
                node._rename(name)


def _build_jvp(f: Any, example_inputs: tuple, *, leaf_modules: Iterable[type], simplify: bool,
               argnums: Any, select: Callable[[Any], Any] | None = None,
               suffix: str = "JVP", name: str | None = None) -> JVPModule:
    gm = trace(f, *example_inputs, leaf_modules=leaf_modules)
    if select is not None:  # keep part of the outputs (hvp: the gradients)
        out_node = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
        out_node.args = (select(out_node.args[0]),)
        gm.recompile()
    src_mod = _source_module(f)
    root: torch.nn.Module = src_mod if src_mod is not None else gm
    graph, info = build_jvp_graph(gm, root=root,
                                  argnums=_argnums(argnums, len(example_inputs)))
    if simplify:
        run_simplifier(graph)
    name_tangents(graph)
    from .simplify.effects import input_mutations_last
    input_mutations_last(graph)
    codegen.install(graph)
    if name is None:
        name = type(src_mod).__name__ if src_mod is not None else \
            type(f).__name__ if isinstance(f, fx.GraphModule) else getattr(f, "__name__", "f")
    out = JVPModule(root, graph, class_name=f"{name}{suffix}")
    out.meta.update(gm.meta)
    out.meta["fxad_forward"] = gm
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    out.meta["fxad_jvp_inputs"] = [(n.name, n.meta.get("val"), d)
                                   for n, d in zip(phs, info["differentiated"])]
    from .guards import spec_of
    out.meta["fxad_input_spec"] = spec_of(
        [n.name for n in phs], example_inputs,
        rebuild="rebuild it with fxad.jvp(f, *inputs) on inputs like these",
        values=gm.meta.get("fxad_value_inputs", ()),
        constants=gm.meta.get("fxad_value_constants", ()))
    if src_mod is not None:
        _install_mode_check(out, src_mod)
    from .rules.fallback import warn_fallbacks
    warn_fallbacks(graph, "fxad.jvp")  # once per build (fxad.FallbackWarning)
    return out


def jvp(f: Callable | torch.nn.Module, *example_inputs: Any, leaf_modules: Iterable[type] = (),
        argnums: int | Iterable[int] | None = None, simplify: bool = True,
        dynamic: Any = None) -> JVPModule:
    """Source-to-source Jacobian-vector product (forward mode) of ``f``.

    Returns:
        :class:`JVPModule` ``g``: ``g(*primals, *tangents)`` returns ``(output,
        output_tangent)``, ``output_tangent`` shaped like ``output`` (``None`` for
        non-floating leaves).  One tangent per input, a pytree like it (the generated
        placeholders are named ``t_<input>``); pass ``None`` for inputs that are not
        differentiated (integer tensors, inputs outside ``argnums``).  For an ``nn.Module``
        the parameters are constants (tangents of the inputs only).

    Args:
        argnums: positions of the inputs to differentiate (default: all floating inputs).
        dynamic: dimensions made generic, as in :func:`fxad.vjp` (:mod:`fxad.dynamic`).

    Raises:
        fxad.errors.MissingRuleError: an op on the differentiation path has no rule.
        fxad.errors.InputError (when called): wrong number of arguments, a primal unlike the
            traced one (shape, dtype, device, Python value), or a tangent whose structure,
            shape or dtype does not match its primal.
    """
    out = _build_jvp(f, example_inputs, leaf_modules=leaf_modules, simplify=simplify,
                     argnums=argnums)
    if dynamic is None or dynamic is False:
        return out
    from .dynamic import generalize
    names = out.meta["fxad_input_spec"].names

    def build(inputs: tuple) -> fx.GraphModule:
        return _build_jvp(f, inputs, leaf_modules=leaf_modules, simplify=simplify,
                          argnums=argnums)

    def run(gm: fx.GraphModule, inputs: tuple, template: fx.GraphModule) -> Any:
        gen = torch.Generator().manual_seed(0)
        tangents = []
        for (name, captured, differentiated), x in zip(template.meta["fxad_jvp_inputs"],
                                                        inputs):
            tangents.append(pytree.tree_map(
                lambda v: torch.randn(v.shape, dtype=v.dtype, generator=gen)
                if isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex())
                else None, x) if differentiated else None)
        return gm(*inputs, *tangents)

    return generalize(build, f, names, example_inputs, dynamic, out, run=run)


def _function_only(f: Any, what: str) -> Any:
    """``f`` itself, or for an ``nn.Module`` a function of its inputs that calls it: its
    parameters and buffers are constants of the derivative (as ``torch.func.jacrev(model)``
    treats them).  For derivatives with respect to parameters, write a function of them."""
    if isinstance(f, torch.nn.Module) and not isinstance(f, fx.GraphModule):
        import inspect

        mod = f

        def of_inputs(*xs: Any) -> Any:
            return mod(*xs)

        of_inputs.__signature__ = inspect.signature(mod.forward)  # type: ignore[attr-defined]
        of_inputs.__name__ = type(mod).__name__
        return of_inputs
    return f


def hvp(f: Callable, *example_inputs: Any, argnums: int | Iterable[int] | None = None,
        leaf_modules: Iterable[type] = (), simplify: bool = True) -> JVPModule:
    """Hessian-vector product of a scalar-valued ``f``, forward-over-reverse: the generated
    JVP of the generated gradient code (:func:`fxad.grad`).

    ``f`` may be an ``nn.Module``: derivatives are then with respect to its inputs, its
    parameters being constants (as ``torch.func.jacrev(model)`` treats them).

    Returns:
        :class:`JVPModule` ``h``: ``h(*inputs, *tangents)`` returns ``(grads, hvps)``, both
        tuples with one entry per input (``None`` for inputs that are not differentiated);
        ``hvps[i] = Σ_j ∂²f/∂x_i∂x_j · tangents[j]``.
    """
    f = _function_only(f, "hvp")
    from .rules.fused import fused_kernels
    with fused_kernels(False):  # the gradient code is differentiated again: no fused kernels
        g = grad(f, *example_inputs, argnums=argnums, leaf_modules=leaf_modules,
                 simplify=simplify)
    out = _build_jvp(g, example_inputs, leaf_modules=leaf_modules, simplify=simplify,
                     argnums=argnums, select=lambda out: out[1], suffix="HVP",
                     name=getattr(f, "__name__", "f"))
    out.meta["fxad_grad_module"] = g
    return out


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


def _nums(argnums: int | Iterable[int], n: int) -> tuple[tuple[int, ...], bool]:
    single = isinstance(argnums, int)
    nums = _argnums(argnums, n)
    assert nums is not None
    if not nums:
        raise InputError("argnums must name at least one input")
    return nums, single


def _float_leaves(x: Any) -> list[torch.Tensor]:
    return [v for v in pytree.tree_leaves(x)
            if isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex())]


def jacrev(f: Callable, *example_inputs: Any, argnums: int | Iterable[int] = 0,
           leaf_modules: Iterable[type] = (), simplify: bool = True) -> BatchedDerivative:
    """Jacobian of a tensor-valued ``f`` by reverse mode: the generated VJP (:func:`fxad.vjp`)
    vmapped over the basis of the output space.

    ``f`` may be an ``nn.Module``: derivatives are then with respect to its inputs, its
    parameters being constants (as ``torch.func.jacrev(model)`` treats them).

    Returns:
        :class:`BatchedDerivative` ``J``; ``J(*inputs)`` has shape ``out.shape + x.shape`` for
        ``argnums`` an int (a pytree like ``x`` for a pytree input), a tuple over ``argnums``
        otherwise (as ``torch.func.jacrev``).

    Raises:
        InputError: ``f`` does not return a single floating-point tensor (use :func:`jacfwd`).
    """
    f = _function_only(f, "jacrev")
    nums, single = _nums(argnums, len(example_inputs))
    g = vjp(f, *example_inputs, argnums=nums, leaf_modules=leaf_modules, simplify=simplify)
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


def _forward_jacobian(call: Callable[[list[Any]], Any], xs: tuple, nums: tuple[int, ...],
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


def jacfwd(f: Callable, *example_inputs: Any, argnums: int | Iterable[int] = 0,
           leaf_modules: Iterable[type] = (), simplify: bool = True) -> BatchedDerivative:
    """Jacobian of ``f`` by forward mode: the generated JVP (:func:`jvp`) vmapped over the
    basis of the inputs in ``argnums``.

    ``f`` may be an ``nn.Module``: derivatives are then with respect to its inputs, its
    parameters being constants (as ``torch.func.jacrev(model)`` treats them).

    Returns:
        :class:`BatchedDerivative` ``J``; ``J(*inputs)`` is shaped like ``f``'s output pytree
        with, at each floating leaf ``o``, a tensor of shape ``o.shape + x.shape`` (``argnums``
        an int) or a tuple of them over ``argnums`` (as ``torch.func.jacfwd``).
    """
    f = _function_only(f, "jacfwd")
    nums, single = _nums(argnums, len(example_inputs))
    j = jvp(f, *example_inputs, argnums=nums, leaf_modules=leaf_modules, simplify=simplify)

    def run(*xs: Any) -> Any:
        return _forward_jacobian(lambda ts: j(*xs, *ts)[1], xs, nums, single)

    return BatchedDerivative("jacfwd", j, run)


def hessian(f: Callable, *example_inputs: Any, argnums: int | Iterable[int] = 0,
            leaf_modules: Iterable[type] = (), simplify: bool = True) -> BatchedDerivative:
    """Hessian of a scalar-valued ``f``: the generated HVP (:func:`hvp`, forward-over-reverse)
    vmapped over the basis of the inputs in ``argnums``.

    ``f`` may be an ``nn.Module``: derivatives are then with respect to its inputs, its
    parameters being constants (as ``torch.func.jacrev(model)`` treats them).

    Returns:
        :class:`BatchedDerivative` ``H``; ``H(*inputs)`` has shape ``x.shape + x.shape`` for
        ``argnums`` an int, ``H[a][b]`` of shape ``x_a.shape + x_b.shape`` for a tuple (as
        ``torch.func.hessian``).
    """
    f = _function_only(f, "hessian")
    nums, single = _nums(argnums, len(example_inputs))
    h = hvp(f, *example_inputs, argnums=nums, leaf_modules=leaf_modules, simplify=simplify)

    def run(*xs: Any) -> Any:
        res = _forward_jacobian(lambda ts: tuple(h(*xs, *ts)[1][i] for i in nums), xs, nums,
                                single)
        return res[0] if single else res

    return BatchedDerivative("hessian", h, run)
