"""Shape-generic generated code: ``dynamic=`` on :func:`fxad.vjp`, :func:`fxad.grad`,
:func:`fxad.jvp`.

fxad traces on example inputs and specializes on their shapes (:mod:`fxad.guards` checks
them on every call).  A dimension marked dynamic (``dynamic=True``: dimension 0 of every
tensor input; or ``dynamic={"x": (0, 1), "y": 0}`` / ``{0: (0, 1)}`` by argument name or
position) is made generic instead: the generated code reads its size from the input
(``x_size_0 = x.size(0)``) and computes every size-dependent constant from it, so one build
serves every size.

How (and why this is trustworthy):

1. **Control flow on sizes.**  The program runs once more on fake tensors whose dynamic
   dimensions are *symbolic* (:class:`torch.fx.experimental.symbolic_shapes.ShapeEnv`, as
   ``torch.compile`` does).  Every Python decision that reads such a size (``if x.shape[0] >
   8``, ``range(T)``, a broadcast check) leaves a guard there.  Dimensions the program ties
   together (``torch.cat`` along another dimension: ``Eq(s0, s1)``) become one size symbol;
   a dimension the program specializes (``Eq(s0, 4)``: a Python loop over it) stays static,
   with a :class:`DynamicWarning`; the other guards (``s0 > 8``) are checked on every call.
2. **The generated code.**  fxad builds the derivative code again with every symbol moved
   to a second size (all combinations: 2**m builds for m symbols, m <= 3).  The builds must
   have the same structure; each integer or float constant that differs between them is
   fitted exactly by a multilinear polynomial of the sizes (``B * T``, ``4 * T``, ``1 / T``
   through its reciprocal) and written as code computing it from the input sizes.
3. **Verification.**  A further build at a third size of every symbol must match the
   structure and every fitted constant, and the generic module run on inputs of that size
   must return what that build returns (same inputs, cotangents, tangents).  Anything that
   fails falls back to a static dimension, with a :class:`DynamicWarning` saying why.

Sizes must be at least the smallest size verified (the example's, or a probe below it where
the program's decisions required it), and never 1 (a size-1 dimension broadcasts, which
changes the code); the guard rejects smaller ones.
"""
from __future__ import annotations

import itertools
import math
import operator
import warnings
from fractions import Fraction
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from . import codegen
from .capture import tracer
from .errors import InputError
from .guards import _TensorSlot

__all__ = ["DynamicWarning", "generalize", "parse_dynamic"]

MAX_SYMBOLS = 3


class DynamicWarning(UserWarning):
    """A dimension marked ``dynamic=`` stayed static (the reason is in the message)."""


# -- which dimensions ------------------------------------------------------------------------

def parse_dynamic(dynamic: Any, names: Sequence[str], examples: Sequence[Any]
                  ) -> list[tuple[int, int]]:
    """``(argument, dim)`` pairs marked dynamic (dims non-negative).

    Raises:
        InputError: an unknown argument, a non-tensor argument, a dimension out of range, or a
            dimension of size < 2 in the example.
    """
    if dynamic is None or dynamic is False:
        return []
    pairs: list[tuple[int, int]] = []
    if dynamic is True:
        pairs = [(i, 0) for i, x in enumerate(examples)
                 if isinstance(x, torch.Tensor) and x.dim() > 0]
    elif isinstance(dynamic, dict):
        for key, dims in dynamic.items():
            if isinstance(key, int):
                i = key % len(examples) if -len(examples) <= key < len(examples) else -1
            else:
                i = list(names).index(key) if key in names else -1
            if i < 0:
                raise InputError(f"dynamic={{{key!r}: ...}}: no such argument (arguments: "
                                 f"{', '.join(names)})")
            x = examples[i]
            if not isinstance(x, torch.Tensor):
                raise InputError(f"dynamic: argument `{names[i]}` is not a tensor (only "
                                 "dimensions of tensor arguments can be dynamic)")
            for d in ((dims,) if isinstance(dims, int) else tuple(dims)):
                if not -x.dim() <= d < x.dim():
                    raise InputError(f"dynamic: argument `{names[i]}` has {x.dim()} "
                                     f"dimensions, no dimension {d}")
                pairs.append((i, d % x.dim()))
    else:
        raise InputError("dynamic= takes True (dimension 0 of every tensor input) or a dict "
                         "{argument name or position: dims}")
    for i, d in pairs:
        if examples[i].shape[d] < 2:
            raise InputError(f"dynamic: dimension {d} of `{names[i]}` has size "
                             f"{examples[i].shape[d]} in the example; use an example with at "
                             "least 2 there (a size-1 dimension broadcasts)")
    return sorted(set(pairs))


# -- step 1: guards from a symbolic run ------------------------------------------------------

def _symbolic_run(f: Any, examples: Sequence[Any], pairs: list[tuple[int, int]]
                  ) -> tuple[dict[tuple[int, int], Any], list[Any], dict]:
    """Run ``f`` on fakes whose ``pairs`` dimensions are symbolic; returns
    (dim -> sympy symbol, guard expressions, symbol -> example value)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import (DimDynamic, ShapeEnv,
                                                       StatelessSymbolicContext)

    env = ShapeEnv()
    mode = FakeTensorMode(shape_env=env, allow_non_fake_inputs=True)
    dyn = {}
    for i, d in pairs:
        dyn.setdefault(i, set()).add(d)
    fakes = []
    syms: dict[tuple[int, int], Any] = {}
    for i, x in enumerate(examples):
        if isinstance(x, torch.Tensor) and i in dyn:
            ctx = StatelessSymbolicContext(dynamic_sizes=[
                DimDynamic.DYNAMIC if d in dyn[i] else DimDynamic.STATIC for d in range(x.dim())])
            fx_ = mode.from_tensor(x, symbolic_context=ctx)
            for d in dyn[i]:
                syms[(i, d)] = fx_.shape[d].node.expr
            fakes.append(fx_)
        else:
            fakes.append(x)
    with tracer.symbolic_shapes(mode), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tracer.capture(f, fakes)
    hints = dict(getattr(env, "backed_var_to_val", None) or env.var_to_val)
    return syms, [g.expr for g in env.guards], hints


# -- step 2: structure and constants of a build ---------------------------------------------

def _constants(gm: fx.GraphModule) -> tuple[list[Any], list[Any]] | None:
    """(structure, constants): the graph with every int/float argument replaced by a slot
    marker, and the constants in slot order."""
    nodes = list(gm.graph.nodes)
    index = {n: k for k, n in enumerate(nodes)}
    consts: list[Any] = []

    def walk(a: Any) -> Any:
        if isinstance(a, fx.Node):
            return ("node", index[a])
        if isinstance(a, bool) or a is None or isinstance(a, (str, torch.dtype, torch.device,
                                                                torch.memory_format,
                                                                torch.layout)):
            return ("const", a)
        if isinstance(a, (int, float)):
            consts.append(a)
            return ("slot", type(a).__name__)
        if isinstance(a, slice):
            return ("slice", walk(a.start), walk(a.stop), walk(a.step))
        if isinstance(a, (tuple, list)):
            return (type(a).__name__ if type(a) in (tuple, list) else "seq",
                    tuple(walk(v) for v in a))
        if isinstance(a, dict):
            return ("dict", tuple((k, walk(v)) for k, v in a.items()))
        return ("object", id(a) if not isinstance(a, type) else a)

    structure = []
    for n in nodes:
        target = n.target
        if n.op == "get_attr":
            obj = _fetch(gm, n.target)
            target = (n.target, tuple(obj.shape) if isinstance(obj, torch.Tensor) else None)
        elif n.op == "placeholder":
            target = None
        structure.append((n.op, target, walk(n.args), walk(dict(n.kwargs))))
    return structure, consts


def _fetch(gm: fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for atom in target.split("."):
        obj = getattr(obj, atom, None)
    return obj


def _resize(x: torch.Tensor, dims: dict[int, int]) -> torch.Tensor:
    """``x`` with the given dimensions resized, its data repeated (values keep their domain:
    token ids, masks)."""
    for d, n in dims.items():
        reps = -(-n // x.shape[d])
        x = torch.cat([x] * reps, d).narrow(d, 0, n) if reps > 1 else x.narrow(d, 0, n)
    return x.contiguous() if not x.is_contiguous() else x.clone()


# -- fitting ----------------------------------------------------------------------------------

def _solve(rows: list[list[Any]], rhs: list[Any]) -> list[Any] | None:
    """Exact Gaussian elimination (Fractions in, Fractions out); None if singular."""
    n = len(rows)
    a = [list(r) + [b] for r, b in zip(rows, rhs)]
    for c in range(n):
        p = next((r for r in range(c, n) if a[r][c] != 0), None)
        if p is None:
            return None
        a[c], a[p] = a[p], a[c]
        for r in range(n):
            if r != c and a[r][c] != 0:
                k = a[r][c] / a[c][c]
                a[r] = [x - k * y for x, y in zip(a[r], a[c])]
    return [a[r][n] / a[r][r] for r in range(n)]


def _monomials(m: int) -> list[tuple[int, ...]]:
    return [s for k in range(m + 1) for s in itertools.combinations(range(m), k)]


def _fit(values: list[Any], corners: list[tuple[int, ...]], as_float: bool
         ) -> tuple[str, list[Any]] | None:
    """Coefficients of the multilinear polynomial through ``values`` at ``corners`` (sizes
    per symbol): ``("poly", coef)`` or, for floats, ``("recip", coef)`` (1 / polynomial)."""
    mons = _monomials(len(corners[0]))
    rows = [[Fraction(math.prod(c[i] for i in mon)) for mon in mons] for c in corners]
    if not as_float:
        coef = _solve(rows, [Fraction(v) for v in values])
        return ("poly", coef) if coef is not None else None
    try:
        coef = _solve(rows, [Fraction(v) for v in values])
        if coef is not None:
            return ("poly", coef)
    except (OverflowError, ValueError):
        pass
    if all(v != 0 for v in values):
        coef = _solve(rows, [1 / Fraction(v) for v in values])
        if coef is not None:
            return ("recip", coef)
    return None


def _evaluate(model: tuple[str, list[Any]], sizes: tuple[int, ...]) -> Any:
    kind, coef = model
    p = sum(c * math.prod(sizes[i] for i in mon) for c, mon in zip(coef, _monomials(len(sizes))))
    return 1 / p if kind == "recip" else p


def _close(a: Any, b: Any) -> bool:
    if isinstance(b, int) and not isinstance(b, bool):
        return isinstance(a, Fraction) and a.denominator == 1 and int(a) == b
    return math.isclose(float(a), float(b), rel_tol=1e-12, abs_tol=1e-300)


# -- the generalization -----------------------------------------------------------------------

def generalize(build: Callable[[tuple], fx.GraphModule], f: Any, names: Sequence[str],
               examples: tuple, dynamic: Any, base: fx.GraphModule, *,
               run: Callable[[fx.GraphModule, tuple, fx.GraphModule], Any],
               stacklevel: int = 3) -> fx.GraphModule:
    """Make the dimensions marked ``dynamic`` generic in ``base`` (built by ``build(examples)``);
    see the module docstring.  ``run(gm, inputs, seed)`` calls a module on inputs with
    seeded cotangents/tangents shaped like those of a third module's (a static build at the
    verification size) and returns its results (for the numeric verification).

    Returns ``base`` itself, rewritten (or unchanged where nothing could be made generic, with
    a :class:`DynamicWarning`, issued at ``stacklevel`` counted from this function).
    """
    pairs = parse_dynamic(dynamic, names, examples)
    if not pairs:
        return base
    where = {p: f"`{names[p[0]]}`.shape[{p[1]}]" for p in pairs}
    try:
        syms, guards, hints = _symbolic_run(f, examples, pairs)
    except Exception as e:  # noqa: BLE001 - the program does not run on symbolic sizes
        warnings.warn(f"dynamic=: every marked dimension stays static: the program could not "
                      f"be analysed on symbolic sizes ({type(e).__name__}: "
                      f"{str(e).splitlines()[0] if str(e) else ''})", DynamicWarning,
                      stacklevel=stacklevel)
        return base
    groups, pinned, predicates = _classes(pairs, syms, guards)
    for p, why in pinned.items():
        warnings.warn(f"dynamic=: {where[p]} stays static: the program {why}", DynamicWarning,
                      stacklevel=stacklevel)
    groups = [g for g in groups if not any(p in pinned for p in g)]
    if len(groups) > MAX_SYMBOLS:
        raise InputError(f"dynamic=: {len(groups)} independent sizes; fxad makes at most "
                         f"{MAX_SYMBOLS} generic in one build")
    while groups:
        result = _try(build, base, names, examples, groups, predicates, syms, run)
        if isinstance(result, fx.GraphModule):
            return result
        bad, why = result
        warnings.warn(f"dynamic=: {', '.join(where[p] for p in groups[bad])} stays static: "
                      f"{why}", DynamicWarning, stacklevel=stacklevel)
        groups = groups[:bad] + groups[bad + 1:]
    return base


def _classes(pairs: list[tuple[int, int]], syms: dict, guards: list[Any]
             ) -> tuple[list[list[tuple[int, int]]], dict, list[Any]]:
    """Size classes (dims the program ties together), dims pinned to a value, and the other
    guards (checked at run time)."""
    import sympy

    parent = {p: p for p in pairs}
    by_sym = {}
    for p, s in syms.items():
        by_sym.setdefault(s, []).append(p)

    def find(p: Any) -> Any:
        while parent[p] != p:
            p = parent[p]
        return p

    for ps in by_sym.values():
        for q in ps[1:]:
            parent[find(q)] = find(ps[0])
    pinned: dict[tuple[int, int], str] = {}
    predicates = []
    known = set(by_sym)
    for g in guards:
        free = g.free_symbols & known
        if not free:
            continue
        if isinstance(g, sympy.Eq) and len(free) == 2 and g.lhs in known and g.rhs in known:
            a, b = by_sym[g.lhs][0], by_sym[g.rhs][0]
            parent[find(a)] = find(b)
            continue
        if isinstance(g, sympy.Eq) and len(free) == 1 and (g.lhs.is_number or g.rhs.is_number):
            for s in free:
                for p in by_sym[s]:
                    pinned[p] = f"specializes on its size ({g}: a Python loop or branch " \
                                "that needs this exact size)"
            continue
        predicates.append(g)
    classes: dict[Any, list[tuple[int, int]]] = {}
    for p in pairs:
        classes.setdefault(find(p), []).append(p)
    return list(classes.values()), pinned, predicates


def _try(build: Callable, base: fx.GraphModule, names: Sequence[str], examples: tuple,
         groups: list[list[tuple[int, int]]], predicates: list[Any], syms: dict,
         run: Callable) -> Any:
    m = len(groups)
    n0 = [examples[g[0][0]].shape[g[0][1]] for g in groups]
    taken = {s for x in examples if isinstance(x, torch.Tensor) for s in x.shape}

    holds = _predicate(groups, predicates, syms)
    n1, n2 = list(n0), list(n0)
    for k in range(m):
        # two more sizes per symbol, distinct from every size in the inputs, inside the region
        # where the program's decisions on sizes come out as they did for the example
        cands = [n for n in list(range(n0[k] + 1, n0[k] + 200)) + list(range(n0[k] - 1, 1, -1))
                 if n not in taken and holds(n0[:k] + [n] + n0[k + 1:])]
        if len(cands) < 2:
            return k, "no other size keeps the program's decisions on this size"
        n1[k], n2[k] = cands[0], cands[1]
    if not holds(n2) or any(not holds([n1[k] if (mask >> k) & 1 else n0[k]
                                       for k in range(m)]) for mask in range(2 ** m)):
        return 0, "the program's decisions on sizes do not hold at the sizes fxad probes"

    def inputs_at(sizes: Sequence[int]) -> tuple:
        out = list(examples)
        for k, g in enumerate(groups):
            for i, d in g:
                out[i] = _resize(out[i], {d: sizes[k]})
        return tuple(out)

    base_struct, base_consts = _constants(base)
    corners, values = [], []
    for mask in itertools.product((0, 1), repeat=m):
        sizes = tuple(n1[k] if bit else n0[k] for k, bit in enumerate(mask))
        if not any(mask):
            consts = base_consts
        else:
            try:
                struct, consts = _constants(build(inputs_at(sizes)))
            except Exception as e:  # noqa: BLE001
                k = mask.index(1)
                return k, f"the program fails at size {sizes[k]}: {type(e).__name__}"
            if struct != base_struct:
                k = max(range(m), key=lambda j: mask[j])
                return k, ("the generated code's structure depends on the size (a Python "
                           "loop or branch over it, or broadcasting that changes)")
        corners.append(sizes)
        values.append(consts)
    slots = [j for j in range(len(base_consts))
             if any(v[j] != base_consts[j] for v in values)]
    models = {}
    for j in slots:
        vals = [v[j] for v in values]
        model = _fit(vals, corners, isinstance(base_consts[j], float))
        if model is None or (isinstance(base_consts[j], int)
                             and model[0] == "poly" and any(c.denominator != 1 for c in model[1])):
            dep = [k for k in range(m) if any(values[c][j] != base_consts[j]
                                               for c, mask in enumerate(
                                                   itertools.product((0, 1), repeat=m))
                                               if mask[k])]
            return (dep[0] if dep else 0), (f"a constant of the generated code ({base_consts[j]})"
                                            " is not a polynomial of the sizes")
        models[j] = model
    # verification: at a third size above the example (required), then at the smallest
    # sizes below it, which set the smallest size the guard accepts
    def verify(sizes: Sequence[int]) -> str | None:
        try:
            check_inputs = inputs_at(sizes)
            check_gm = build(check_inputs)
            struct, consts = _constants(check_gm)
        except Exception as e:  # noqa: BLE001
            return f"the program fails at size {list(sizes)}: {type(e).__name__}"
        if struct != base_struct:
            return "the generated code's structure changes at a third size"
        for j, model in models.items():
            if not _close(_evaluate(model, tuple(sizes)), consts[j]):
                return (f"a size-dependent constant ({base_consts[j]}) does not follow one "
                        "formula at a third size")
        for j in range(len(base_consts)):
            if j not in models and consts[j] != base_consts[j]:
                return "a constant changes only at a third size"
        try:
            got = run(gm, check_inputs, check_gm)
            want = run(check_gm, check_inputs, check_gm)
        except Exception as e:  # noqa: BLE001
            return f"the generic code fails at size {list(sizes)} ({type(e).__name__})"
        if not _same(got, want):
            return "the generic code's result differs from a build at the verification size"
        return None

    gm = _rewrite(_copy_module(base), names, examples, groups, models)
    low = [min(a, b, c) for a, b, c in zip(n0, n1, n2)]
    _guard(gm, groups, predicates, syms, names, [2] * m)  # widest while verifying
    why = verify(n2)
    if why is not None:
        return 0, why
    for small in range(2, min(n0)):
        sizes = [small if small not in taken or small == n else n for n in n0]
        if sizes == list(n0) or not holds(sizes) or verify(sizes) is not None:
            continue
        low = [min(a, b) for a, b in zip(low, sizes)]
        break
    _guard(gm, groups, predicates, syms, names, low)
    return gm


def _copy_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A module like ``gm`` (same class, submodules and parameters by reference, a copy of
    its meta and of its input spec) over a copy of its graph, to rewrite."""
    import copy

    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))  # graph_copy leaves the output node out
    graph._codegen = copy.copy(gm.graph._codegen)
    codegen.install(graph)
    # the per-instance class torch.fx makes (renamed to the class name): its base
    cls = next(c for c in type(gm).__mro__
               if c.__qualname__.split(".")[-1] != "GraphModuleImpl")
    new = cls(gm, graph, class_name=gm.__class__.__name__)
    new.meta.update(gm.meta)
    spec = gm.meta.get("fxad_input_spec")
    if spec is not None:
        new.meta["fxad_input_spec"] = copy.deepcopy(spec)
    for hook in getattr(gm, "_forward_pre_hooks", {}).values():
        new.register_forward_pre_hook(hook)
    return new


def _predicate(groups: list[list[tuple[int, int]]], predicates: list[Any], syms: dict
               ) -> Callable[[Sequence[int]], bool]:
    """``holds(sizes)``: the program's guards on sizes, with one size per group."""
    if not predicates:
        return lambda sizes: True
    import sympy
    expr = sympy.And(*predicates)
    subs_of = []
    for k, g in enumerate(groups):
        for p in g:
            if p in syms:
                subs_of.append((syms[p], k))

    def holds(sizes: Sequence[int]) -> bool:
        return bool(expr.subs({s: sizes[k] for s, k in subs_of}))
    return holds


def _same(a: Any, b: Any) -> bool:
    la, lb = pytree.tree_leaves(a), pytree.tree_leaves(b)
    if len(la) != len(lb):
        return False
    for x, y in zip(la, lb):
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return False
        if isinstance(x, torch.Tensor):
            if x.shape != y.shape or x.dtype != y.dtype:
                return False
            if not torch.allclose(x, y, rtol=1e-5, atol=1e-6, equal_nan=True):
                return False
        elif x != y:
            return False
    return True


def _rewrite(gm: fx.GraphModule, names: Sequence[str], examples: tuple,
             groups: list[list[tuple[int, int]]], models: dict) -> fx.GraphModule:
    """Replace the fitted constants of ``gm`` by code computing them from the input sizes."""
    graph = gm.graph
    phs = [n for n in graph.nodes if n.op == "placeholder"]
    anchor = phs[len(examples) - 1] if phs else None
    size_nodes: list[fx.Node] = []
    cursor = [anchor]

    def emit(op: str, target: Any, args: tuple, val: Any, name: str | None = None) -> fx.Node:
        with graph.inserting_after(cursor[0]):
            node = graph.create_node(op, target, args, {}, name=name)
        node.meta["val"] = val
        node.meta["fxad_dynamic_size"] = True
        cursor[0] = node
        return node

    for g in groups:
        i, d = g[0]
        size_nodes.append(emit("call_method", "size", (phs[i], d), int(examples[i].shape[d]),
                               name=f"{names[i]}_size_{d}"))
    cache: dict[Any, fx.Node] = {}

    def number(c: Fraction, as_float: bool) -> Any:
        return float(c) if as_float or c.denominator != 1 else int(c)

    def expression(model: tuple[str, list], as_float: bool, base_val: Any) -> Any:
        key = (model[0], tuple(model[1]), as_float)
        if key in cache:
            return cache[key]
        kind, coef = model
        terms = []
        for c, mon in zip(coef, _monomials(len(groups))):
            if c == 0:
                continue
            if not mon:
                terms.append(number(c, as_float))
                continue
            t: Any = size_nodes[mon[0]]
            for k in mon[1:]:
                t = emit("call_function", operator.mul, (t, size_nodes[k]), None)
            if c != 1:
                t = emit("call_function", operator.mul, (t, number(c, as_float)), None)
            terms.append(t)
        expr: Any = terms[0] if terms else 0
        for t in terms[1:]:
            expr = emit("call_function", operator.add, (expr, t), None)
        if kind == "recip":
            expr = emit("call_function", operator.truediv, (1.0, expr), None)
        elif as_float and isinstance(expr, fx.Node):
            expr = emit("call_function", float, (expr,), None)
        if isinstance(expr, fx.Node):
            expr.meta["val"] = base_val
        cache[key] = expr
        return expr

    j = [0]
    consts_models = models

    def walk(a: Any) -> Any:
        if isinstance(a, fx.Node) or isinstance(a, bool) or a is None:
            return a
        if isinstance(a, (int, float)):
            k = j[0]
            j[0] += 1
            if k in consts_models:
                return expression(consts_models[k], isinstance(a, float), a)
            return a
        if isinstance(a, slice):
            return slice(walk(a.start), walk(a.stop), walk(a.step))
        if isinstance(a, (tuple, list)):
            items = [walk(v) for v in a]
            return type(a)(items) if type(a) in (tuple, list) else tuple(items)
        if isinstance(a, dict):
            return {k: walk(v) for k, v in a.items()}
        return a

    # every node in order, as _constants numbered the slots (size nodes are emitted right
    # after the inputs, so they precede every node that uses them)
    for n in [n for n in graph.nodes if not n.meta.get("fxad_dynamic_size")]:
        args, kwargs = walk(n.args), walk(dict(n.kwargs))
        if n.op not in ("placeholder", "get_attr"):
            n.args, n.kwargs = args, kwargs
    graph.lint()
    gm.recompile()
    return gm


def _guard(gm: fx.GraphModule, groups: list[list[tuple[int, int]]], predicates: list[Any],
           syms: dict, names: Sequence[str], low: Sequence[int]) -> None:
    """Let the module's guard accept the generic dimensions, check that dimensions of one size
    agree, and evaluate the program's other decisions on sizes (``s0 > 8``) at run time."""
    import sympy

    spec = gm.meta.get("fxad_input_spec")
    if spec is None:
        return
    spec.symbols.clear()
    spec.predicates.clear()
    for k, g in enumerate(groups):
        sym = f"{names[g[0][0]]}.shape[{g[0][1]}]"
        spec.symbols[sym] = []
        spec.min_size[sym] = max(2, low[k])  # the smallest size the probes verified
        for i, d in g:
            j = -1 if spec.trees[i] is None else 0
            slot = spec.leaves[i][max(j, 0)]
            shape = list(slot.shape)
            shape[d] = None
            spec.leaves[i][max(j, 0)] = _TensorSlot(tuple(shape), slot.dtype, slot.device)
            spec.symbols[sym].append((i, j, d))
    if predicates:
        order = []
        for p, s in syms.items():
            if s not in [o[1] for o in order]:
                order.append((p, s))
        fn = sympy.lambdify([s for _, s in order], sympy.And(*predicates), "math")
        spec.predicates.append((fn, [p for p, _ in order],
                                " and ".join(str(p) for p in predicates)))

