"""Fallback rules: differentiate an op that has no hand-written rule through ``torch.autograd``.

So that users are not blocked by a missing rule, every public differentiable torch function
(``torch.*``, ``torch.nn.functional.*``, ``torch.linalg.*``, ``torch.special.*``,
``torch.fft.*``) without a hand-written rule gets a *fallback* rule.  Its forward is the op
itself; its backward is one call of :func:`autograd_vjp`, which re-runs the op on its saved
inputs and asks ``torch.autograd.grad`` for the vector-Jacobian product.  The generated code
stays standalone and readable::

    tan = torch.tan(x)
    # backward of: tan = torch.tan(x)
    fxad_autograd_vjp = fxad_autograd_vjp(torch.tan, (x,), {}, d_tan)
    d_x = fxad_autograd_vjp[0]

(forward mode: :func:`autograd_jvp`, through ``torch.func.jvp``).  The backward recomputes
the op, so fallback code is slower than a hand-written rule and not source-to-source below
the op; ``python -m fxad.tools.coverage`` reports fallback-covered ops separately.

A hand-written rule always wins: fallbacks are only registered for ops that have none when
this module is imported, and :func:`fxad.register_vjp` replaces a fallback without
``replace=True``.  Set ``FXAD_NO_FALLBACK=1`` in the environment before importing fxad to
get :class:`fxad.MissingRuleError` instead.

The fallback is never silent: every build whose generated code calls it (``fxad.vjp``,
``fxad.grad``, ``fxad.jvp`` and what is built on them) emits one :class:`FallbackWarning`
naming each op that used it and the user's line (:func:`warn_fallbacks`; once per build,
not per call of the generated module), and ``fxad.show`` / ``fxad.code_with_shapes`` /
``fxad show`` end those lines with ``# autograd fallback`` (:func:`is_fallback_node`).
"""
from __future__ import annotations

import importlib
import inspect
import operator  # noqa: F401  (generated code names operator.* ops; _resolve imports by name)
import os
import sys
import warnings
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F
from torch.utils import _pytree as pytree

from ..codegen import public_spelling
from ..errors import RuleError
from ..graph.proxy import _STATE as _PROXY_STATE  # the meta-computation depth
from ..graph.proxy import fake_mode, in_meta_computation
from ..graph.shapes import OUTPUT_META
from ..naming import code_builtin, op_qualname
from .registry import Rule, _install, _validate, lookup, missing_rule, op_name

FALLBACK_SOURCE = ("fallback: the VJP is computed by torch.autograd on the op (recomputes the "
                   "forward); no hand-written rule")

_FALLBACK_OPS: set[Any] = set()
_BY_NAME: dict[str, Any] = {}


class FallbackWarning(UserWarning):
    """A build used the autograd fallback (:mod:`fxad.rules.fallback`) for some ops: their
    derivative is computed by ``torch.autograd`` inside the generated code (the op is re-run
    there), not written out in torch code.  ``uses`` lists ``(op, location)`` pairs, the
    location being the user's ``file:line`` (or ``None`` where unknown)."""

    def __init__(self, message: str, uses: list[tuple[str, Any]] | None = None) -> None:
        super().__init__(message)
        self.uses = list(uses or [])


def is_fallback_node(node: torch.fx.Node) -> bool:
    """Whether ``node`` of generated code is a call of the autograd fallback
    (``fxad_autograd_vjp(...)`` / ``fxad_autograd_jvp(...)``)."""
    return node.op == "call_function" and node.target in (autograd_vjp, autograd_jvp)


def fallback_uses(graph: torch.fx.Graph) -> list[tuple[str, Any]]:
    """``(op name, user's source location)`` of each autograd-fallback call in ``graph``, in
    order, each pair once.  The location is the forward op's ``SourceLoc`` (or ``None``)."""
    seen: dict[tuple[str, str], tuple[str, Any]] = {}
    for n in graph.nodes:
        if not is_fallback_node(n):
            continue
        op = n.args[0] if n.args else "?"
        name = public_spelling(op if isinstance(op, str) else op_name(op))
        loc = _loc(n) or next((_loc(u) for u in n.users if _loc(u) is not None), None)
        seen.setdefault((name, loc.short() if loc is not None else ""), (name, loc))
    return list(seen.values())


def _loc(n: torch.fx.Node) -> Any:
    return n.meta.get("fxad_bwd_src") or n.meta.get("fxad_jvp_src") or n.meta.get("fxad_loc")


def warn_fallbacks(graph: torch.fx.Graph, api: str) -> list[tuple[str, Any]]:
    """Emit one :class:`FallbackWarning` for a build whose generated ``graph`` calls the
    autograd fallback, naming each op and the user's line; returns the uses (empty: no
    warning).  Called once per build by the entry points (``fxad.vjp``/``grad``/``jvp``),
    never by the generated code itself."""
    uses = fallback_uses(graph)
    if not uses:
        return uses
    where = ", ".join(f"{name} at {loc.short()}" if loc is not None else name
                      for name, loc in uses)
    n_ops = len({name for name, _ in uses})
    msg = (f"{api}: the derivative of {n_ops} op{'s' if n_ops != 1 else ''} comes from the "
           f"autograd fallback (torch.autograd runs inside the generated code; not "
           f"source-to-source below the op): {where}.  Register a rule with "
           f"fxad.register_vjp to replace it, or set FXAD_NO_FALLBACK=1 before importing "
           f"fxad to make this an error")
    # point at the user's call of fxad (the first frame outside the fxad package)
    level, f = 1, sys._getframe(0)
    while f is not None and f.f_globals.get("__name__", "").split(".")[0] == "fxad":
        f, level = f.f_back, level + 1
    warnings.warn(FallbackWarning(msg, uses), stacklevel=level)
    return uses


def is_fallback(op: Any) -> bool:
    """True when ``op``'s registered rule is a fallback rule, not a hand-written one."""
    rule = lookup(op)
    return rule is not None and rule.source == FALLBACK_SOURCE


def _is_diff(v: Any) -> bool:
    return isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex())


def _proxy_in(*trees: Any) -> torch.fx.Proxy | None:
    for leaf in pytree.tree_leaves(trees):
        if isinstance(leaf, torch.fx.Proxy):
            return leaf
    return None


def _resolve(op: Any) -> Any:
    if not isinstance(op, str):
        return op
    if op in _BY_NAME:
        return _BY_NAME[op]
    # generated code run in a fresh interpreter (``to_folder``) names an op whose fallback
    # was built on demand: ``operator.mul``, ``torch.nn.functional.linear``, ``expand``
    parts = op.split(".")
    if len(parts) == 1:
        return getattr(torch.Tensor, op)
    obj: Any = importlib.import_module(parts[0])
    for part in parts[1:]:
        obj = getattr(obj, part)
    return obj


def autograd_vjp(op: Any, args: tuple, kwargs: dict, d_out: Any) -> tuple:
    """VJP of ``op(*args, **kwargs)`` with cotangent ``d_out``, by ``torch.autograd.grad``.

    ``op`` is the op or its registered name (``"torch.tan"``; graph code spells it so).

    Returns one entry per floating tensor leaf of ``(args, kwargs)`` (pytree order): its
    cotangent (zeros where the output does not depend on it).
    """
    p = _proxy_in(args, kwargs, d_out)
    if p is not None:  # called by a rule while writing graph code
        return p.tracer.create_proxy("call_function", autograd_vjp, (op, args, kwargs, d_out), {})
    op = _resolve(op)
    leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
    slots = [i for i, v in enumerate(leaves) if _is_diff(v)]
    if in_meta_computation():  # shapes only: one cotangent shaped like each floating leaf
        return tuple(torch.zeros_like(leaves[i]) for i in slots)
    xs = [leaves[i].detach() for i in slots]
    cots = [d_out] if isinstance(d_out, torch.Tensor) else \
        pytree.tree_leaves(d_out, is_leaf=lambda x: x is None)

    def grads_wrt(which: list[int]) -> list[Any]:
        with torch.enable_grad():
            req = [x.requires_grad_(True) if k in which else x
                   for k, x in enumerate(x.detach() for x in xs)]
            vals = list(leaves)
            for i, x in zip(slots, req):
                vals[i] = x
            a, kw = pytree.tree_unflatten(vals, spec)
            outs = pytree.tree_leaves(op(*a, **kw))
            pairs = [(o, c) for o, c in zip(outs, cots)
                     if c is not None and isinstance(o, torch.Tensor) and o.requires_grad]
            wrt = [req[k] for k in which]
            g = torch.autograd.grad([o for o, _ in pairs], wrt, [c for _, c in pairs],
                                    allow_unused=True) if pairs and wrt else [None] * len(wrt)
        full: list[Any] = [None] * len(xs)
        for k, gk in zip(which, g):
            full[k] = gk
        return full

    try:
        grads = grads_wrt(list(range(len(xs))))
    except RuntimeError as e:
        if "is not differentiable with respect to argument" not in str(e):
            raise
        # some floating arguments are not differentiable (a running mean, a target):
        # differentiate only those that are
        ok = []
        for k in range(len(xs)):
            try:
                grads_wrt([k])
                ok.append(k)
            except RuntimeError:
                pass
        grads = grads_wrt(ok)
    return tuple(torch.zeros_like(x) if g is None else g for x, g in zip(xs, grads))


def autograd_jvp(op: Any, args: tuple, kwargs: dict, tangents: tuple) -> tuple:
    """``(value, tangent)`` of ``op(*args, **kwargs)`` along ``tangents`` (one per floating
    tensor leaf of ``(args, kwargs)``, ``None`` for zero), by ``torch.func.jvp``."""
    p = _proxy_in(args, kwargs, tangents)
    if p is not None:
        return p.tracer.create_proxy("call_function", autograd_jvp, (op, args, kwargs, tangents), {})
    op = _resolve(op)
    leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
    slots = [i for i, v in enumerate(leaves) if _is_diff(v)]
    prim = tuple(leaves[i] for i in slots)
    if in_meta_computation():  # shapes only (torch.func cannot load its tables in fake mode)
        a, kw = pytree.tree_unflatten(leaves, spec)
        out = OUTPUT_META[op](*a, **kw) if op in OUTPUT_META else op(*a, **kw)
        return out, pytree.tree_map(lambda o: o.clone() if _is_diff(o) else None, out)
    tans = tuple(torch.zeros_like(x) if t is None else t for x, t in zip(prim, tangents))

    def f(*xs: Any) -> Any:
        vals = list(leaves)
        for i, x in zip(slots, xs):
            vals[i] = x
        a, kw = pytree.tree_unflatten(vals, spec)
        return op(*a, **kw)

    try:
        return _jvp_by_double_vjp(f, prim, tans)
    except RuntimeError as e:
        # PyTorch's own forward AD is not used as a second resort: the OpInfo sweep found it
        # disagreeing with autograd's reverse mode on several ops (stft, triangular_solve,
        # chunked linear_cross_entropy), and a wrong tangent is worse than an error
        raise RuleError(
            f"forward mode for {getattr(op, '__name__', op)} (no hand-written rule) needs "
            f"its autograd double backward, which is unavailable: {str(e).splitlines()[0]}",
            op=str(getattr(op, "__name__", op)),
            hint="register a rule with a jvp: @fxad.register_vjp(op) class with fwd, bwd, "
                 "jvp") from e


def _jvp_by_double_vjp(f: Any, prim: tuple, tans: tuple) -> tuple:
    """J t by transposing autograd's VJP (linear in the cotangent u):
    J t = d/du <J^T u, t>.  Uses the same reverse-mode formulas as the VJP fallback, so the
    two modes agree by construction."""
    with torch.enable_grad():
        xs = [x.detach().requires_grad_(True) for x in prim]
        out = f(*xs)
        outs = [o for o in pytree.tree_leaves(out) if _is_diff(o) and o.requires_grad]
        us = [torch.zeros_like(o, requires_grad=True) for o in outs]
        gs = torch.autograd.grad(outs, xs, us, create_graph=True, allow_unused=True)
        if any(g is not None and not g.requires_grad for g in gs):
            # the op's backward is not itself differentiable (a once_differentiable kernel)
            raise RuntimeError("no double backward")
        pairs = [(g, t) for g, t in zip(gs, tans) if g is not None]
        if pairs:
            jt = torch.autograd.grad([g for g, _ in pairs], us, [t for _, t in pairs],
                                     allow_unused=True)
            if any(j is None for j in jt):
                # a VJP is linear in u: one that does not depend on u means the op's double
                # backward is not real (gradients precomputed in the forward)
                raise RuntimeError("double backward does not reach the cotangent")
        else:
            jt = [None] * len(us)
    it = iter(jt)
    t_out = pytree.tree_map(
        lambda o: ((lambda v: torch.zeros_like(o) if v is None else v)(next(it)))
        if _is_diff(o) and o.requires_grad else (torch.zeros_like(o) if _is_diff(o) else None),
        out)
    return pytree.tree_map(lambda o: o.detach() if isinstance(o, torch.Tensor) else o, out), t_out


def _make_rule(op: Any) -> None:
    fwd, bwd, jvp = _build(op)
    _install(op, fwd, bwd, jvp=jvp, source=FALLBACK_SOURCE, builtin=True)
    _FALLBACK_OPS.add(op)


_COMPLEX_RULES: dict[Any, Any] = {}

# operator namespaces of PyTorch itself: their ops reach fxad only through its own rules
_TORCH_NAMESPACES = {"aten", "prims", "prim", "quantized", "_quantized", "higher_order"}


def custom_op_rule(op: Any) -> Any:
    """The autograd-fallback rule for an operator another library registered with
    ``torch.library`` (``torch.ops.transformers.grouped_mm_fallback``), built and registered
    on first use; ``None`` for anything else, or when ``FXAD_NO_FALLBACK`` is set.  Such an
    op's derivative is whatever its library registered with autograd
    (``torch.library.register_autograd``); an op without one is refused at build time
    (:class:`fxad.MissingRuleError`), as for the torch functions.  The build that uses it
    warns (:class:`FallbackWarning`) like every fallback."""
    if os.environ.get("FXAD_NO_FALLBACK"):
        return None
    qual = op_qualname(op)
    if qual is None or qual.split("::", 1)[0] in _TORCH_NAMESPACES:
        return None
    if lookup(op) is None:
        _make_rule(op)
    return lookup(op)


def complex_rule(op: Any) -> Any:
    """The autograd-fallback :class:`~fxad.rules.registry.Rule` for ``op``, used in place of a
    hand-written rule not verified for complex tensors when a node carries complex values
    (see :mod:`fxad.rules.complex`).  Not registered: hand-written rules keep serving real
    tensors."""
    if op not in _COMPLEX_RULES:
        fwd, bwd, jvp = _build(op)
        _COMPLEX_RULES[op] = Rule(op=op, fwd=fwd, bwd=bwd, jvp=jvp, source=FALLBACK_SOURCE,
                                  params=_validate(op, fwd, bwd), builtin=True)
    return _COMPLEX_RULES[op]


def _build(op: Any) -> tuple[Any, Any, Any]:
    name = op_name(op)
    if isinstance(op, str):  # a Tensor method kept as a method call (``x.expand(...)``)
        op = getattr(torch.Tensor, op)
    _BY_NAME[name] = op
    _BY_NAME[public_spelling(name)] = op  # how generated code spells it
    method = getattr(torch.Tensor, getattr(op, "__name__", ""), None) is op
    def fwd(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
        _refuse_random(op, args, kwargs)
        _require_autograd_formula(op, name, method, args, kwargs)
        if method:  # a Tensor method: call it on the proxy
            return getattr(args[0], op.__name__)(*args[1:], **kwargs), (args, kwargs)
        return op(*args, **kwargs), (args, kwargs)

    def bwd(aux: Any, d_out: Any) -> dict:
        args, kwargs = aux
        grads = autograd_vjp(name, args, kwargs, d_out)
        leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
        out, k = [], 0
        for v in leaves:
            if _is_diff(v) or (isinstance(v, torch.fx.Proxy) and _is_diff(v.node.meta.get("val"))):
                out.append(grads[k])
                k += 1
            else:
                out.append(None)
        d_args, d_kwargs = pytree.tree_unflatten(out, spec)
        return {"args": tuple(d_args), "kwargs": d_kwargs}

    def jvp(primals: tuple, tangents: tuple) -> tuple[Any, Any]:
        args, kwargs = tuple(primals[:-1]), dict(primals[-1] or {})
        tans: list[Any] = []

        def walk(p: Any, t: Any) -> None:  # tangents of the floating leaves, pytree order
            if isinstance(p, (list, tuple)):
                for i, pi in enumerate(p):
                    walk(pi, t[i] if isinstance(t, (list, tuple)) and i < len(t) else None)
            elif isinstance(p, dict):
                for k, pi in p.items():
                    walk(pi, t.get(k) if isinstance(t, dict) else None)
            elif _is_float_leaf(p):
                tans.append(t if isinstance(t, torch.fx.Proxy) else None)

        walk((args, kwargs), (tuple(tangents[:-1]), tangents[-1]))
        res = autograd_jvp(name, args, kwargs, tuple(tans))
        return res[0], res[1]

    return fwd, bwd, jvp


def _require_autograd_formula(op: Any, name: str, method: bool, args: tuple,
                              kwargs: dict) -> None:
    """At transform time, on fake tensors: raise :class:`fxad.MissingRuleError` when autograd
    has no derivative for this call either (e.g. ``torch.special.airy_ai``), instead of
    generating code that fails when it runs."""
    def conv(v: Any) -> Any:
        if isinstance(v, torch.fx.Proxy):
            v = v.node.meta.get("val")
        if _is_diff(v):
            return v.detach().requires_grad_(True)
        return v

    if any(isinstance(v, torch.fx.Proxy) and not isinstance(v.node.meta.get("val"), torch.Tensor)
           for v in pytree.tree_leaves((args, kwargs))):
        return
    _PROXY_STATE.in_meta = getattr(_PROXY_STATE, "in_meta", 0) + 1  # factories: no recording
    try:
        with fake_mode():
            a, k = pytree.tree_map(conv, (tuple(args), dict(kwargs)))
            if any(isinstance(v, torch.fx.Proxy) for v in pytree.tree_leaves((a, k))):
                return
            with torch.enable_grad():
                out = getattr(a[0], op.__name__)(*a[1:], **k) if method else op(*a, **k)
    except Exception:  # cannot tell on fake tensors: let the generated code decide
        return
    finally:
        _PROXY_STATE.in_meta -= 1
    outs = [o for o in pytree.tree_leaves(out) if _is_diff(o)]
    has_input = any(_is_diff(v) for v in pytree.tree_leaves((a, k)))
    if has_input and outs and all(
            not o.requires_grad or (o.grad_fn is not None
                                    and "NotImplemented" in type(o.grad_fn).__name__)
            for o in outs) or (has_input and outs and _custom_op_without_autograd(op)):
        raise missing_rule(name, None)


def _custom_op_without_autograd(op: Any) -> bool:
    """A ``torch.library.custom_op`` with no ``register_autograd``: autograd accepts it (its
    generated backward node raises only when run), so fxad asks the op's definition."""
    qual = op_qualname(op)
    if qual is None:
        return False
    try:
        from torch._library.custom_ops import OPDEFS
    except ImportError:  # pragma: no cover - older torch
        return False
    opdef = OPDEFS.get(qual)
    return opdef is not None and getattr(opdef, "_backward_fn", True) is None


def _refuse_random(op: Any, args: tuple, kwargs: dict) -> None:
    """The fallback recomputes the op in the backward, so a random op (dropout in training
    mode) would get a different mask: refuse with a clear error instead of wrong numbers."""
    try:
        b = inspect.signature(op).bind(*args, **kwargs)
    except (TypeError, ValueError):
        return
    b.apply_defaults()
    a = b.arguments
    p = a.get("dropout_p", a.get("dropout", a.get("p")))
    if a.get("training", a.get("train")) is True and isinstance(p, (int, float)) and p > 0:
        raise RuleError(f"{op_name(op)} with dropout (training=True, p={p}) has no "
                        "hand-written rule, and the autograd fallback cannot reproduce its "
                        "random mask", op=op_name(op),
                        hint="register a rule with fxad.register_vjp, or set the dropout "
                             "probability to 0 / training=False")


def _is_float_leaf(v: Any) -> bool:
    return _is_diff(v) or (isinstance(v, torch.fx.Proxy) and _is_diff(v.node.meta.get("val")))


# namespaces whose public functions get a fallback; in-place (``x_``), random and
# constructor functions never reach differentiation with a floating input, so they are left out
_SKIP = {
    "bernoulli", "multinomial", "normal", "poisson", "rand", "rand_like", "randint",
    "randint_like", "randn", "randn_like", "randperm", "dropout", "alpha_dropout",
    "feature_alpha_dropout", "feature_dropout", "dropout1d", "dropout2d", "dropout3d", "rrelu",
    "fractional_max_pool2d", "fractional_max_pool3d", "gumbel_softmax", "empty", "empty_like",
    "empty_strided", "zeros", "ones", "full", "arange", "linspace", "logspace", "eye",
    "tensor", "as_tensor", "from_numpy", "set_grad_enabled", "no_grad", "enable_grad",
    "is_tensor", "is_floating_point", "is_complex", "numel", "result_type", "can_cast",
    "promote_types", "manual_seed", "seed", "get_default_dtype", "set_default_dtype", "compile",
    "while_loop", "scan", "associative_scan",
    "save", "load", "vmap", "autocast", "typename", "is_storage", "is_nonzero",
    "is_same_size", "equal", "allclose", "isclose", "sym_int", "sym_float", "sym_max",
    "sym_min", "sym_not", "sym_ite", "use_deterministic_algorithms", "binomial",
    "native_dropout", "fractional_max_pool2d_with_indices", "fractional_max_pool3d_with_indices",
    "random_", "standard_gamma", "poisson_nll_loss_random",
}


def _candidates() -> list[Any]:
    found: list[Any] = []
    for mod in (torch, F, torch.linalg, torch.special, torch.fft):
        for name in dir(mod):
            if name.startswith("_") or name.endswith("_") or name in _SKIP:
                continue
            fn = getattr(mod, name, None)
            if fn is None or isinstance(fn, type) or not callable(fn):
                continue
            if isinstance(fn, torch.nn.Module) or getattr(fn, "__module__", "") in ("typing",):
                continue
            if not (type(fn).__name__ in ("builtin_function_or_method", "function")):
                continue
            found.append(fn)
    # Tensor methods that stay methods in the canonical graph (no torch.* namesake)
    for name in ("unfold", "__rsub__", "__rpow__", "__rmod__", "__rmatmul__", "__rdiv__",
                 "__rtruediv__", "__mod__", "index_put", "masked_scatter", "sum_to_size"):
        fn = getattr(torch.Tensor, name, None)
        if fn is not None:
            found.append(fn)
    # private ops that OpInfo tests directly (aten-level; users rarely call them)
    aten = torch.ops.aten
    for packet, overload in (("_softmax_backward_data", None), ("_batch_norm_with_update", None),
                             ("_upsample_bilinear2d_aa", None), ("_safe_softmax", "default"),
                             ("max_pool2d_with_indices_backward", "default"),
                             ("native_dropout_backward", "default"), ("slice", "Tensor")):
        p = getattr(aten, packet, None)
        if p is not None:
            found.append(p if overload is None else getattr(p, overload))
    for name in ("_native_batch_norm_legit", "_unsafe_masked_index",
                 "_unsafe_masked_index_put_accumulate"):
        fn = getattr(torch, name, None)
        if fn is not None:
            found.append(fn)
    return found


def register_fallbacks() -> int:
    """Register a fallback rule for every candidate op without a rule; returns how many."""
    n = 0
    for fn in _candidates():
        try:
            hash(fn)
        except TypeError:
            continue
        if lookup(fn) is not None:
            continue
        _make_rule(fn)
        n += 1
    return n


code_builtin("fxad_autograd_vjp", autograd_vjp)
code_builtin("fxad_autograd_jvp", autograd_jvp)
if not os.environ.get("FXAD_NO_FALLBACK"):
    register_fallbacks()
