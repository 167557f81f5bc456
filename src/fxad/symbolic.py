"""Builds on symbolic sizes: ``dynamic=True`` and ``dynamic_shapes=`` on :func:`fxad.vjp`,
:func:`fxad.grad`, :func:`fxad.jvp` (and, automatically, in :func:`fxad.compile`).

fxad normally builds on the example inputs' shapes and checks them on every call
(:mod:`fxad.guards`).  A dimension made *symbolic* is instead captured as a
:class:`torch.SymInt` of a :class:`~torch.fx.experimental.symbolic_shapes.ShapeEnv`, the
machinery behind ``make_fx(tracing_mode="symbolic")`` and :func:`torch.export.export`:

1. **Capture.**  The program runs on fake tensors whose chosen dimensions are symbols.  Its
   Python sees ``SymInt`` values: ``B, T = idx.shape`` are symbols, ``x.view(B * T, C)`` an
   expression.  Every decision it takes on a size (``if T > 8``, a broadcast that needs two
   sizes equal, a position table of 64 rows sliced to ``T``) is recorded by the ShapeEnv as a
   *guard*; sizes the program ties together (logits of ``idx`` against ``tgt`` in
   cross-entropy) become one symbol.  Size 0/1 are not assumed away: decisions inside PyTorch's
   operators are taken size-obliviously (``backed_size_oblivious``, as ``torch.export`` does),
   so the code is valid for a batch of one.  Where that makes a valid program fail to capture
   (a slice of size 1 broadcast against another size), the build is made again with
   PyTorch's default semantics: sizes 0 and 1 are then specialized (the guards require
   ``>= 2`` where the example had that).
2. **Rules and engines** compute sizes with the same ``SymInt`` values; any size that reaches
   the derivative graph is written as code reading the inputs
   (:func:`fxad.graph.sizes.bind_sizes`: ``T = idx.size(1)``, ``B_T = B * T``).
3. **Guards.**  Every guard the ShapeEnv recorded, every tie and every declared range is
   checked on each call, with the user's line that imposed it
   (:class:`fxad.guards.InputSpec`); an assumption about sizes read from tensor data
   (unbacked) is a guard line of the code, at its place (``fxad_expect_size``).  A dimension the program fixes (a Python loop over it,
   a match against a parameter's size) becomes static: silently for ``dynamic=True`` (like
   ``Dim.AUTO``), an :class:`~fxad.InputError` for a dimension declared with ``Dim``.

Vocabulary (PyTorch's):

* ``dynamic=True``: every dimension of every tensor input may vary; ties are inferred.
* ``dynamic_shapes=``: :func:`torch.export.export`'s format: per argument (a dict keyed by
  argument name, or a tuple in argument order), ``None`` (static), a dict ``{dim: spec}`` or a
  tuple with one spec per dimension, nested like the argument for tuples/lists/dicts.  A spec
  is a ``torch.export.Dim("T", min=..., max=...)`` (the same name on two inputs: one size),
  ``Dim.AUTO`` / ``Dim.DYNAMIC`` (fxad chooses), ``Dim.STATIC`` or ``None`` (static).
"""
from __future__ import annotations

import contextlib
import functools
import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import sympy
import torch
import torch.fx as fx
import torch.fx.experimental._config as _shape_config
from torch._dispatch.python import enable_python_dispatcher
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.export import Dim
from torch.fx.experimental.symbolic_shapes import (DimDynamic, GuardOnDataDependentSymNode,
                                                   ShapeEnv, StatelessSymbolicContext)
from torch.utils import _pytree as pytree
from torch.utils._sympy.numbers import int_oo

from .capture.decisions import UnbackedSizesNeeded, size_assumption
from .capture.state import capturing, symbolic_shapes
from .capture.state import current as current_capture
from .errors import CaptureError, DataDependentError, InputError, SourceLoc
from .graph.proxy import user_source_loc
from .graph.sizes import (bind_sizes, expr_of, is_symbolic, python_source, read_result_sizes,
                          size_names)
from .graph.symcache import memoized
from .guards import InputSpec, expect_size

__all__ = ["ShapePlan", "plan_shapes", "wants_symbolic", "symbolic_build", "build_with_sizes",
           "reads_sizes"]

_DimType = type(Dim("_probe"))
_Hint = type(Dim.AUTO)


@dataclass
class _DimSpec:
    """How one input dimension is built: ``name`` (None: fxad names it), ``declared`` (a
    ``Dim`` the user named: it must stay symbolic), ``low``/``high`` bounds."""
    name: str | None = None
    declared: bool = False
    low: int | None = None
    high: int | None = None
    symbol: Any = None


@functools.cache
def composites_fix_sizes() -> bool:
    """Whether this torch's C++ composite operators read symbolic sizes as integers:
    ``torch.matmul`` of a 3-D by a 2-D tensor does in PyTorch 2.11 (it folds the batch
    dimensions with ``sizes()``), which made every size of such a program static.  Asked
    once, by running that product on a symbolic fake tensor: True where it fails or its
    result's batch size is no longer symbolic."""
    env = ShapeEnv(duck_shape=False)
    mode = FakeTensorMode(shape_env=env, allow_non_fake_inputs=True)
    ctx = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC] * 3)
    try:
        a = mode.from_tensor(torch.empty(2, 5, 3), symbolic_context=ctx)
        b = mode.from_tensor(torch.empty(3, 4), static_shapes=True)
        with torch._C.DisableTorchFunction(), mode:
            out = torch.matmul(a, b)
        return not is_symbolic(out.shape[0])
    except Exception:  # noqa: BLE001 - "Cannot call numel() on tensor with symbolic sizes"
        return True


def wants_symbolic(dynamic: Any, dynamic_shapes: Any) -> bool:
    """True when the arguments ask for a symbolic build.

    Raises:
        InputError: ``dynamic`` is neither a bool nor None.
    """
    if dynamic not in (None, True, False):
        raise InputError(
            f"dynamic= takes True or False (got {dynamic!r}); to choose dimensions, pass "
            "dynamic_shapes= in torch.export's format, e.g. dynamic_shapes={'x': {0: "
            "torch.export.Dim('B')}}")
    return bool(dynamic) or dynamic_shapes is not None


class _GuardLog(list):
    """The ShapeEnv's guard list, remembering the user's line each guard was taken at (while
    the user's program runs; a guard taken by a derivative rule has no user line)."""

    def __init__(self) -> None:
        super().__init__()
        self.locs: dict[int, SourceLoc | str | None] = {}

    def append(self, guard: Any) -> None:  # noqa: D102 - list.append
        super().append(guard)
        self.locs[id(guard)] = user_source_loc() if capturing() else None


class _LocatedShapeEnv(ShapeEnv):
    """A ShapeEnv that remembers the user's line where each symbol was replaced (tied to
    another, or fixed to a number: ``range(x.shape[0])``)."""

    def _set_replacement(self, a: Any, tgt: Any, msg: str) -> None:  # noqa: D102
        if capturing() and a not in getattr(self, "fxad_replaced_at", {}):
            self.__dict__.setdefault("fxad_replaced_at", {})[a] = user_source_loc()
        super()._set_replacement(a, tgt, msg)

    def _make_data_dependent_error(self, expr: Any, unhinted_expr: Any, *,
                                   expr_sym_node_id: int | None = None) -> Any:  # noqa: D102
        err = super()._make_data_dependent_error(expr, unhinted_expr,
                                                 expr_sym_node_id=expr_sym_node_id)
        err.fxad_loc = user_source_loc() if capturing() else None
        names = {s: str(s) for s in expr.free_symbols}
        names.update(getattr(self, "fxad_symbol_names", {}))
        names.update(self.__dict__.get("fxad_unbacked_names", {}))
        try:
            err.fxad_expr = python_source(expr, names)
        except Exception:  # noqa: BLE001 - a sympy function without a Python form
            err.fxad_expr = str(expr)
        return err

    def guard_or_defer_runtime_assert(self, orig_expr: Any, msg: str,
                                      fx_node: Any = None) -> bool:
        """An assumption about unbacked sizes (read from tensor data,
        :func:`fxad.capture.decisions.drawn_sizes`) becomes a guard line at this place of
        the capture (:func:`fxad.capture.decisions.size_assumption`); one made after
        capture (by a derivative rule) is kept in ``fxad_late_asserts``."""
        before = [a for asserts in self.deferred_runtime_asserts.values() for a in asserts]
        out = super().guard_or_defer_runtime_assert(orig_expr, msg, fx_node)
        new = [a for asserts in self.deferred_runtime_asserts.values() for a in asserts
               if not any(a is b for b in before)]
        for a in new:
            cap = current_capture()
            if cap is not None:
                size_assumption(cap, a.expr, user_source_loc())
            else:
                self.__dict__.setdefault("fxad_late_asserts", []).append(a.expr)
        return out


@dataclass
class ShapePlan:
    """One symbolic build: the ShapeEnv, fake inputs, and what each dimension is.

    Attributes:
        names: argument names in call order.
        examples: the real example inputs.
        fakes: the example inputs as fake tensors with symbolic dimensions.
        specs: ``(argument, leaf, dim) -> _DimSpec`` for each symbolic dimension.
        symbol_names: sympy symbol -> the name its size line gets in generated code.
    """
    names: list[str]
    examples: tuple
    env: ShapeEnv
    mode: FakeTensorMode
    fakes: tuple = ()
    specs: dict[tuple[int, int, int], _DimSpec] = field(default_factory=dict)
    symbol_names: dict[Any, str] = field(default_factory=dict)
    oblivious: bool = True

    @contextlib.contextmanager
    def building(self) -> Iterator[None]:
        """The build runs in here: the fake mode with the ShapeEnv, size-oblivious decisions
        inside PyTorch's operators, size names for the generated code; where this torch's
        C++ composite operators would fix symbolic sizes (:func:`composites_fix_sizes`),
        PyTorch's Python dispatcher, which runs them as their Python decompositions."""
        with _shape_config.patch(backed_size_oblivious=self.oblivious), \
                memoized(self.env), symbolic_shapes(self.mode), \
                size_names(self.symbol_names), warnings.catch_warnings(), \
                (enable_python_dispatcher() if composites_fix_sizes()
                 else contextlib.nullcontext()):
            # sizes sit in node arguments until fxad.graph.sizes.bind_sizes writes them as
            # code, which torch.fx (rightly, in general) warns about
            warnings.filterwarnings("ignore", message="Raw Sym")
            yield

    # -- after the build ------------------------------------------------------------------
    def finish(self, gm: fx.GraphModule) -> None:
        """Turn the ShapeEnv's knowledge into ``gm``'s guards
        (``gm.meta['fxad_input_spec']``) and record ``gm.meta['fxad_shapes']``.

        Raises:
            InputError: a dimension declared with ``Dim`` was fixed by the program (names the
                line), or its range cannot hold.
        """
        spec: InputSpec = gm.meta["fxad_input_spec"]
        self._all_names = list(spec.names)  # the inputs, then a cotangent (fxad.vjp)
        self._check_declared()
        names = dict(self.symbol_names)  # symbol -> display name
        leaf_exprs = spec.sym_dims  # (argument, leaf, dim) -> sympy expression
        bound: dict[Any, tuple[int, int, int]] = {}
        symbols: dict[str, list[tuple[int, int, int]]] = {}
        predicates: list[tuple[Any, list, str]] = []
        for key, e in sorted(leaf_exprs.items()):
            e = self.env.simplify(e)
            if isinstance(e, sympy.Symbol) and e not in bound:
                bound[e] = key
            if isinstance(e, sympy.Symbol):
                symbols.setdefault(names[e], []).append(key)
        var = {s: f"_s{k}" for k, s in enumerate(bound)}
        for key, e in sorted(leaf_exprs.items()):
            e = self.env.simplify(e)
            if isinstance(e, sympy.Symbol):
                continue
            if not e.free_symbols:  # the program fixed this dimension
                spec.fix_dim(key, int(e))
                continue
            self._predicate(predicates, sympy.Eq(sympy.Symbol("_size"), e), bound, var, names,
                            extra=key, text=f"{self._dim_text(key)} == "
                                             f"{python_source(e, names)}", loc=None)
        # every relation the ShapeEnv recorded (declared ranges included), once each, with
        # the user's line where there is one
        why: dict[Any, Any] = {}
        for g in self.env.guards:
            e = self.env.simplify(g.expr)
            if not e.free_symbols:
                continue
            if not e.free_symbols <= set(bound):
                raise InputError(
                    f"the build assumed {e} of sizes that are not input dimensions; fxad cannot "
                    "check that on a call (a size computed from tensor data?)")
            loc = self.env.guards.locs.get(id(g)) if isinstance(self.env.guards, _GuardLog) \
                else None
            if e not in why or why[e] is None:
                why[e] = loc
        for sym, key in bound.items():  # ranges the ShapeEnv assumed without a guard
            vr = self.env.var_to_range.get(sym)
            if vr is None:
                continue
            if _finite(vr.lower) and int(vr.lower) > 0:
                e = sympy.Ge(sym, int(vr.lower))
                if e not in why:
                    why[e] = "sizes 0 and 1 are specialized in this build" \
                        if int(vr.lower) == 2 and not self.oblivious else None
            if _finite(vr.upper):
                e = sympy.Le(sym, int(vr.upper))
                why.setdefault(e, None)
        for e, loc in why.items():
            self._predicate(predicates, e, bound, var, names, text=python_source(e, names),
                            loc=loc)
        spec.symbols = symbols
        spec.symbol_dims = {names[s]: key for s, key in bound.items()}
        spec.predicates = predicates
        spec.values = {i: self.examples[i].detach().cpu().clone() for i in spec.values_at
                       if isinstance(self.examples[i], torch.Tensor)}
        gm.meta["fxad_shapes"] = self.describe(spec)
        gm.meta["fxad_shape_plan"] = self
        self._guards_checked = len(self.env.guards)

    def refresh(self, gm: fx.GraphModule) -> None:
        """Check again after later passes (a partition into forward and backward) took
        decisions on the sizes: their guards join ``gm``'s."""
        if len(self.env.guards) != getattr(self, "_guards_checked", -1):
            self.finish(gm)

    def _dim_text(self, key: tuple[int, int, int]) -> str:
        i, j, d = key
        names = getattr(self, "_all_names", self.names)
        return f"{names[i]}.size({d})" if j < 0 else f"{names[i]}[leaf {j}].size({d})"

    def _predicate(self, out: list, e: Any, bound: dict, var: dict, names: dict, *, text: str,
                   loc: SourceLoc | None, extra: tuple[int, int, int] | None = None) -> None:
        order = [s for s in bound if s in e.free_symbols]
        dims = [bound[s] for s in order]
        params = [var[s] for s in order]
        if extra is not None:
            dims.append(extra)
            params.append("_size")
        src = python_source(e, {**var, sympy.Symbol("_size"): "_size"})
        fn = eval(f"lambda {', '.join(params)}: bool({src})", {"math": math})  # noqa: S307
        where = f" (required by `{loc.code}` at {loc.filename}:{loc.lineno})" \
            if isinstance(loc, SourceLoc) else f" ({loc})" if isinstance(loc, str) else \
            " (required by the derivative code)"
        out.append((fn, dims, text + where))

    def _check_declared(self) -> None:
        for key, ds in self.specs.items():
            if not ds.declared:
                continue
            e = self.env.simplify(self._input_expr(key))
            if not e.free_symbols:
                loc = self._why_fixed(key)
                raise InputError(
                    f"dimension {key[2]} of `{self.names[key[0]]}` is declared dynamic "
                    f"({ds.name or 'Dim.DYNAMIC'}), but the program fixes it to {int(e)}"
                    + (f" at {loc.filename}:{loc.lineno} (`{loc.code}`)" if loc else ""),
                    hint="declare it static (Dim.STATIC or leave it out of dynamic_shapes), "
                         "or use Dim.AUTO to let fxad keep it static where the program "
                         "requires")

    def _input_expr(self, key: tuple[int, int, int]) -> Any:
        i, j, d = key
        leaves = _tensor_leaves(self.fakes[i])
        return expr_of(leaves[max(j, 0)][1].shape[d])

    def _why_fixed(self, key: tuple[int, int, int]) -> SourceLoc | None:
        sym = self.specs[key].symbol
        at = getattr(self.env, "fxad_replaced_at", {}).get(sym)
        if at is not None:
            return at
        for g in self.env.guards:
            if sym in g.expr.free_symbols and isinstance(self.env.guards, _GuardLog):
                loc = self.env.guards.locs.get(id(g))
                if loc is not None:
                    return loc
        return None

    def describe(self, spec: InputSpec) -> dict[str, Any]:
        """What stayed symbolic and the guards, for ``gm.meta['fxad_shapes']``."""
        return {"symbols": {name: [self._dim_text(k) for k in keys]
                            for name, keys in spec.symbols.items()},
                "guards": [text for _, _, text in spec.predicates]}


def _finite(bound: Any) -> bool:
    return bound not in (int_oo, -int_oo, sympy.oo, -sympy.oo)


def _tensor_leaves(x: Any) -> list[tuple[int, torch.Tensor]]:
    """(leaf index, tensor) of an argument: index -1 for a plain tensor argument, else its
    position among the pytree leaves (the numbering :func:`fxad.guards.spec_of` uses)."""
    if isinstance(x, torch.Tensor):
        return [(-1, x)]
    leaves = pytree.tree_leaves(x)
    return [(j, v) for j, v in enumerate(leaves) if isinstance(v, torch.Tensor)]


def _parse_entry(spec: Any, example: torch.Tensor, where: str) -> dict[int, _DimSpec]:
    """One tensor's entry of ``dynamic_shapes``: dim -> _DimSpec."""
    if spec is None:
        return {}
    if isinstance(spec, dict):
        items = list(spec.items())
    elif isinstance(spec, (tuple, list)):
        if len(spec) != example.dim():
            raise InputError(f"dynamic_shapes for {where} has {len(spec)} entries, but the "
                             f"tensor has {example.dim()} dimensions")
        items = list(enumerate(spec))
    else:
        raise InputError(f"dynamic_shapes for {where}: expected a dict {{dim: Dim}} or a tuple "
                         f"with one entry per dimension, got {spec!r}")
    out: dict[int, _DimSpec] = {}
    for d, s in items:
        if not isinstance(d, int) or not -example.dim() <= d < example.dim():
            raise InputError(f"dynamic_shapes for {where}: the tensor has no dimension {d!r} "
                             f"(shape {tuple(example.shape)})")
        d %= example.dim()
        if s is None or s == Dim.STATIC:
            continue
        if s == Dim.AUTO:
            out[d] = _DimSpec()
        elif s == Dim.DYNAMIC:
            out[d] = _DimSpec(declared=True)
        elif isinstance(s, _DimType) and type(s).__name__ == "Dim":
            low = getattr(s, "min", None)
            high = getattr(s, "max", None)
            high = None if high is None or high >= (1 << 62) or str(high) == "int_oo" else int(high)
            low = None if low is None or low <= 0 else int(low)
            out[d] = _DimSpec(name=s.__name__, declared=True, low=low, high=high)
        else:
            raise InputError(
                f"dynamic_shapes for {where}, dimension {d}: {s!r} is not supported (use "
                "torch.export.Dim('name', min=, max=), Dim.AUTO, Dim.DYNAMIC, Dim.STATIC or None;"
                " derived dimensions such as 2 * Dim('T') are not)")
    return out


def _parse(names: list[str], examples: Sequence[Any], dynamic: Any, dynamic_shapes: Any
           ) -> dict[tuple[int, int, int], _DimSpec]:
    out: dict[tuple[int, int, int], _DimSpec] = {}
    if dynamic_shapes is None:
        if dynamic:
            for i, x in enumerate(examples):
                for j, t in _tensor_leaves(x):
                    for d in range(t.dim()):
                        out[(i, j, d)] = _DimSpec()
        return out
    if isinstance(dynamic_shapes, dict):
        unknown = [k for k in dynamic_shapes if k not in names]
        if unknown:
            raise InputError(f"dynamic_shapes names no such argument: {unknown[0]!r} (the "
                             f"arguments are {', '.join(names)})")
        per_arg = [dynamic_shapes.get(n) for n in names]
    elif isinstance(dynamic_shapes, (tuple, list)):
        if len(dynamic_shapes) != len(examples):
            raise InputError(f"dynamic_shapes has {len(dynamic_shapes)} entries for "
                             f"{len(examples)} arguments")
        per_arg = list(dynamic_shapes)
    else:
        raise InputError("dynamic_shapes must be a dict keyed by argument name or a tuple "
                         f"in argument order, got {type(dynamic_shapes).__name__}")
    for i, (x, s) in enumerate(zip(examples, per_arg)):
        if s is None:
            continue
        if isinstance(x, torch.Tensor):
            for d, ds in _parse_entry(s, x, f"`{names[i]}`").items():
                out[(i, -1, d)] = ds
            continue
        if not isinstance(x, (tuple, list, dict)):
            raise InputError(f"dynamic_shapes gives dimensions for `{names[i]}`, which is not "
                             f"a tensor ({type(x).__name__})")
        try:
            pairs = pytree.tree_flatten(x)[0], pytree.tree_flatten(
                s, is_leaf=lambda v: v is None or isinstance(v, dict) and all(
                    isinstance(k, int) for k in v))[0]
        except Exception as e:  # pragma: no cover - structure mismatch
            raise InputError(f"dynamic_shapes for `{names[i]}` does not match its structure"
                             ) from e
        xs, ss = pairs
        if len(xs) != len(ss):
            raise InputError(f"dynamic_shapes for `{names[i]}` does not match its structure "
                             f"({len(xs)} leaves, {len(ss)} entries)")
        for j, (t, e) in enumerate(zip(xs, ss)):
            if isinstance(t, torch.Tensor):
                for d, ds in _parse_entry(e, t, f"`{names[i]}` leaf {j}").items():
                    out[(i, j, d)] = ds
    return out


def plan_shapes(names: list[str], examples: tuple, *, dynamic: Any = None,
                dynamic_shapes: Any = None, oblivious: bool = True) -> ShapePlan:
    """The symbolic inputs of a build (see the module docstring).

    Raises:
        InputError: a malformed ``dynamic_shapes``; the same ``Dim`` name on dimensions of
            different example sizes; an example size outside a ``Dim``'s range.
    """
    specs = _parse(names, examples, dynamic, dynamic_shapes)
    # (the ShapeEnv's replay log is for debugging torch.compile, and costs a third of a build)
    env = _LocatedShapeEnv(duck_shape=False, should_record_events=False)
    env.guards = _GuardLog()
    mode = FakeTensorMode(shape_env=env, allow_non_fake_inputs=True)
    plan = ShapePlan(list(names), tuple(examples), env, mode, specs=specs, oblivious=oblivious)
    env.fxad_symbol_names = plan.symbol_names  # for the text of size guards
    by_name: dict[str, tuple[tuple[int, int, int], Any]] = {}
    fakes = []
    with _shape_config.patch(backed_size_oblivious=oblivious), memoized(env):
        for i, x in enumerate(examples):
            def fake(j: int, t: torch.Tensor) -> torch.Tensor:
                dims = [specs.get((i, j, d)) for d in range(t.dim())]
                # Dim.AUTO keeps a size-0/1 example dimension static (it may broadcast)
                dims = [None if ds is not None and not ds.declared and t.shape[d] <= 1
                        else ds for d, ds in enumerate(dims)]
                for d, ds in enumerate(dims):
                    if ds is None:
                        specs.pop((i, j, d), None)
                if not any(dims):
                    return mode.from_tensor(t, static_shapes=True)
                ctx = StatelessSymbolicContext(dynamic_sizes=[
                    DimDynamic.STATIC if ds is None else DimDynamic.DYNAMIC for ds in dims])
                ft = mode.from_tensor(t, symbolic_context=ctx)
                for d, ds in enumerate(dims):
                    if ds is None:
                        continue
                    key = (i, j, d)
                    sym = ft.shape[d]
                    label = ds.name or (f"{names[i]}_size_{d}" if j < 0
                                        else f"{names[i]}_{j}_size_{d}")
                    ds.symbol = sym.node.expr
                    plan.symbol_names.setdefault(ds.symbol, label)
                    where = f"dimension {d} of `{names[i]}`"
                    if ds.low is not None and t.shape[d] < ds.low or \
                            ds.high is not None and t.shape[d] > ds.high:
                        raise InputError(f"{where} has size {t.shape[d]} in the example, outside "
                                         f"the range of {ds.name} ([{ds.low}, {ds.high}])")
                    if ds.name is not None and ds.name in by_name:
                        (k0, s0) = by_name[ds.name]
                        if int(s0.node.hint if hasattr(s0.node, 'hint') else 0) != t.shape[d] \
                                and s0.node.hint is not None:
                            raise InputError(
                                f"{where} and dimension {k0[2]} of `{names[k0[0]]}` are both "
                                f"{ds.name}, but their example sizes differ "
                                f"({t.shape[d]} and {s0.node.hint})")
                        with mode:
                            torch._check(sym == s0)
                    elif ds.name is not None:
                        by_name[ds.name] = (key, sym)
                    n_guards = len(env.guards)
                    with mode:
                        if ds.low is not None:
                            torch._check(sym >= ds.low)
                        if ds.high is not None:
                            torch._check(sym <= ds.high)
                    for g in env.guards[n_guards:]:
                        env.guards.locs[id(g)] = f"declared in dynamic_shapes as {ds.name}"
                return ft

            if isinstance(x, torch.Tensor):
                fakes.append(fake(-1, x))
            elif isinstance(x, (tuple, list, dict)) and any(
                    isinstance(v, torch.Tensor) for v in pytree.tree_leaves(x)):
                leaves, tree = pytree.tree_flatten(x)
                fakes.append(pytree.tree_unflatten(
                    [fake(j, v) if isinstance(v, torch.Tensor) else v
                     for j, v in enumerate(leaves)], tree))
            else:
                fakes.append(x)
    plan.fakes = tuple(fakes)
    return plan


def symbolic_build(build: Any, names: list[str], examples: tuple, *, dynamic: Any,
                   dynamic_shapes: Any) -> fx.GraphModule:
    """``build(fake_inputs)`` on symbolic sizes, its guards installed (``plan.finish``).

    The build runs with size-oblivious decisions first; if the capture fails that way, once
    more with PyTorch's default 0/1 specialization (see the module docstring).
    """
    plan = plan_shapes(names, examples, dynamic=dynamic, dynamic_shapes=dynamic_shapes)
    try:
        with plan.building(), _decisions_on_read_sizes():
            out = build(plan.fakes)
            _no_unbacked(out)
    except CaptureError:
        plan = plan_shapes(names, examples, dynamic=dynamic, dynamic_shapes=dynamic_shapes,
                           oblivious=False)
        with plan.building(), _decisions_on_read_sizes():
            out = build(plan.fakes)
            _no_unbacked(out)
    plan.finish(out)
    return out


@contextlib.contextmanager
def _decisions_on_read_sizes() -> Iterator[None]:
    """A Python decision on a size read from tensor data on every call (``if n > 2:`` of an
    unbacked size) raises :class:`~fxad.DataDependentError` naming the line, instead of
    PyTorch's ``GuardOnDataDependentSymNode``."""
    try:
        yield
    except GuardOnDataDependentSymNode as e:
        loc = getattr(e, "fxad_loc", None)
        raise DataDependentError(
            f"a Python decision on sizes read from tensor data on every call "
            f"(`{getattr(e, 'fxad_expr', '?')}`): their values change from call to call, so "
            "fxad cannot specialize the code on the decision",
            op="decision on a data-dependent size", loc=loc,
            hint="compute with the sizes without branching on them, or keep the value as a "
                 "tensor (torch.where)") from None


def reads_sizes(gm: fx.GraphModule) -> bool:
    """Whether ``gm`` reads sizes from tensor data on every call (nodes marked
    ``fxad_unbacked``)."""
    return any(n.meta.get("fxad_unbacked") for n in gm.graph.nodes)


def build_with_sizes(build: Any, names: list[str], examples: tuple) -> fx.GraphModule:
    """``build(examples)``, the static build; made again on a ShapeEnv (every input size
    static) when the program reads sizes from tensor data drawn anew on every call
    (:func:`fxad.capture.decisions.drawn_sizes`): those sizes are unbacked ``SymInt``\\ s
    through capture, rules and engines, read by the generated code on every call."""
    try:
        return build(examples)
    except UnbackedSizesNeeded:
        return symbolic_build(build, names, examples, dynamic=False, dynamic_shapes=None)


def _no_unbacked(gm: fx.GraphModule) -> None:
    """Refuse a build with a size PyTorch could not express in the input sizes (an unbacked
    symbol, from a decision it left open), other than the sizes the program read from
    tensor data (nodes marked ``fxad_unbacked``) and those of results computed from data
    (``nonzero``, ``x[mask]``), which the code reads on every call.  What the derivative
    code assumed of such sizes (``fxad_late_asserts``: the backward of ``x[mask]`` selects
    with the mask again, and assumes both counts equal) becomes guard lines
    (:func:`_late_guards`)."""
    env = next((u.node.shape_env for u in _unbacked_of(gm)), None)
    late = getattr(env, "fxad_late_asserts", []) if env is not None else []
    if late:
        _late_guards(gm, late)
        env.fxad_late_asserts = []
    read: set = set()
    for n in gm.graph.nodes:
        if n.meta.get("fxad_unbacked"):
            v = n.meta["val"]
            read.update(expr_of(u) for u in (v if isinstance(v, list) else [v]))
    bad = [desc for desc, syms in _bad_symbols(gm) if not syms <= read]
    if bad:
        raise CaptureError(
            f"a size of the derivative code could not be written in the input sizes "
            f"({bad[0]}); build this program with static shapes (without dynamic=)")


def _late_guards(gm: fx.GraphModule, late: list[Any]) -> None:
    """A guard line (:func:`fxad.guards.expect_size`) for each relation in ``late`` (sympy,
    of unbacked sizes) that the derivative code assumed after capture, right after the last
    node its sizes are read from, naming the user's line the backward is of; one about a
    size no node has any more is dropped with the code it was made for.

    Raises:
        CaptureError: a relation fxad cannot write as a check on a call.
    """
    graph = gm.graph
    # an assumption about a size no code computes any more (the tangent of a value the code
    # does not use, removed as dead code) has nothing to check
    present = set().union(*(_shape_symbols(n) for n in graph.nodes),
                          *(u.node.expr.free_symbols for u in _unbacked_of(gm)))
    late = [e for e in late if e.free_symbols <= present]
    if not late:
        return
    syms = set().union(*(e.free_symbols for e in late))
    read_result_sizes(graph, only=syms)
    source: dict[Any, fx.Node] = {}
    names: dict[Any, str] = {}
    for n in graph.nodes:
        v = n.meta.get("val")
        if n.meta.get("fxad_unbacked") and isinstance(v, torch.SymInt):
            source.setdefault(v.node.expr, n)
            names.setdefault(v.node.expr, n.name)
    order = {n: k for k, n in enumerate(graph.nodes)}
    rels = {"Equality": "==", "Unequality": "!=", "LessThan": "<=", "StrictLessThan": "<",
            "GreaterThan": ">=", "StrictGreaterThan": ">"}
    for e in late:
        rel = rels.get(type(e).__name__)
        logical = isinstance(e, (sympy.And, sympy.Or, sympy.Not))  # a broadcast: a == b or b == 1
        if rel is None and not logical or not e.free_symbols <= source.keys():
            raise CaptureError(f"the derivative code assumes {e} of sizes read from tensor "
                               "data, which fxad cannot check on a call; build this program "
                               "without those sizes")
        after = max((source[x] for x in e.free_symbols), key=order.__getitem__)
        env = next(iter(source.values())).meta["val"].node.shape_env
        # the size made last: by the derivative code, whose line the guard names
        newest = max(e.free_symbols, key=lambda x: int(str(x)[1:]) if str(x)[1:].isdigit()
                     else -1)
        src = ("fxad_bwd_src", "fxad_jvp_src")  # (reverse mode, forward mode)
        first = next((m for m in graph.nodes if newest in _shape_symbols(m)
                      and any(m.meta.get(k) is not None for k in src)), None)
        loc = next(first.meta[k] for k in src if first.meta.get(k) is not None) \
            if first is not None else None
        where = (f"{loc.short()} `{loc.code}` (its derivative code)"
                 if isinstance(loc, SourceLoc) else "the derivative code")

        def side(x: Any) -> Any:
            return int(x) if not x.free_symbols else env.create_symintnode(x, hint=None)

        sides = ("==", env.create_symboolnode(e), True) if logical else \
            (rel, side(e.lhs), side(e.rhs))
        with graph.inserting_after(after):
            node = graph.create_node("call_function", expect_size,
                                     sides + (python_source(e, names), where), {},
                                     name="size_guard")
        node.meta.update(val=None, fxad_side_effect=True, fxad_guard=where)
    bind_sizes(graph)
    gm.recompile()


def _shape_symbols(n: fx.Node) -> set:
    """The symbols (as the ShapeEnv holds them) in the sizes of ``n``'s tensor value."""
    v = n.meta.get("val")
    return {x for s in (v.shape if isinstance(v, torch.Tensor) else ())
            if isinstance(s, torch.SymInt) for x in s.node.expr.free_symbols}


def _unbacked_of(gm: fx.GraphModule) -> list[Any]:
    """The SymInts the program read from tensor data (nodes marked ``fxad_unbacked``)."""
    out: list[Any] = []
    for n in gm.graph.nodes:
        if n.meta.get("fxad_unbacked"):
            v = n.meta["val"]
            out.extend(v if isinstance(v, list) else [v])
    return [u for u in out if isinstance(u, torch.SymInt)]


def _bad_symbols(gm: fx.GraphModule) -> list[tuple[str, set]]:
    """``(name: shape, unbacked symbols)`` of each node whose value has a size with an
    unbacked symbol."""
    out = []
    for n in gm.graph.nodes:
        v = n.meta.get("val")
        ts = [t for t in pytree.tree_leaves(v) if isinstance(t, torch.Tensor)]
        syms = {x for t in ts for s in t.shape if isinstance(s, torch.SymInt)
                for x in s.node.expr.free_symbols if str(x).startswith("u")}
        if syms:
            out.append((f"{n.name}: {tuple(ts[0].shape)}", syms))
    return out
