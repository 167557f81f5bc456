"""Symbolic sizes as graph values.

When fxad builds on symbolic shapes (:mod:`fxad.symbolic`), a size the program or a rule
computes is a ``torch.SymInt`` (``SymFloat``, ``SymBool``) whose value is a sympy expression
of the input sizes (``s0*s1``, ``FloorDiv(s1, 4)``).  The generated code cannot hold such an
object: it must read the sizes from its inputs and compute the expression.  :func:`bind_sizes`
does that for one graph, after the engines and the simplifier ran:

* every free symbol is read from the first placeholder whose shape holds it as a plain
  dimension (``T = idx.size(1)``), named after where it comes from (the name the user gave the
  dimension, else ``idx_size_1``);
* every other expression is written with Python's arithmetic on those sizes
  (``B_T = B * T``, ``max(T, 4)``), once per distinct expression;
* the size lines sit right after the placeholders, so every use is dominated.

The translation walks the (simplified) sympy expression with
:func:`torch.utils._sympy.interp.sympy_interp`, the same interpreter PyTorch's own shape code
uses, through :class:`SizeCode`: one table says how each sympy function reads as Python, both
as graph nodes and as source text (the runtime guards of :mod:`fxad.symbolic` compile the
text form).

Sizes read from tensor data on every call (unbacked symbols ``u0``: ``.tolist()`` of drawn
counts, the size of a ``nonzero`` or ``x[mask]`` result, :func:`read_result_sizes`) are read
from the node that produced them instead, right before their first use.

Raises:
    CaptureError: a size expression with no source among the graph's inputs or the sizes
        read from data, or a sympy function with no Python form.
"""
from __future__ import annotations

import contextlib
import math
import operator
import re
import threading
from typing import Any, Callable, Iterator

import sympy
import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.utils._sympy.interp import sympy_interp

from ..errors import CaptureError

try:
    from torch.fx.experimental.symbolic_shapes import optimization_hint
except ImportError:  # torch < 2.12: the hint of an unbacked size is a fixed fallback
    from torch.fx.experimental.symbolic_shapes import size_hint as _size_hint

    def optimization_hint(a: Any, fallback: int | None = None) -> int:
        return _size_hint(a, fallback=8192 if fallback is None else fallback)

__all__ = ["SYM_TYPES", "is_symbolic", "expr_of", "bind_sizes", "has_symbolic_args",
           "SizeCode", "python_source", "size_names", "known_equal", "known_one",
           "has_symbolic_shape", "size_hint", "unbacked_sizes", "check_squeeze",
           "read_result_sizes"]

_STATE = threading.local()


@contextlib.contextmanager
def size_names(names: dict[Any, str]) -> Iterator[None]:
    """Inside: :func:`bind_sizes` names the size of symbol ``s`` ``names[s]`` by default."""
    old = getattr(_STATE, "names", None)
    _STATE.names = names
    try:
        yield
    finally:
        _STATE.names = old

SYM_TYPES = (torch.SymInt, torch.SymFloat, torch.SymBool)

# sympy handler name (torch.utils._sympy.interp) -> (Python callable, source template)
_OPS: dict[str, tuple[Callable, str]] = {
    "add": (operator.add, "({} + {})"),
    "sub": (operator.sub, "({} - {})"),
    "mul": (operator.mul, "({} * {})"),
    "neg": (operator.neg, "(-{})"),
    "floordiv": (operator.floordiv, "({} // {})"),
    "truediv": (operator.truediv, "({} / {})"),
    "int_truediv": (operator.truediv, "({} / {})"),
    "mod": (operator.mod, "({} % {})"),
    "python_mod": (operator.mod, "({} % {})"),
    "pow_by_natural": (operator.pow, "({} ** {})"),
    "pow": (operator.pow, "({} ** {})"),
    "minimum": (min, "min({}, {})"),
    "maximum": (max, "max({}, {})"),
    "abs": (abs, "abs({})"),
    "sqrt": (math.sqrt, "math.sqrt({})"),
    "to_float": (float, "float({})"),
    "floor_to_int": (math.floor, "math.floor({})"),
    "ceil_to_int": (math.ceil, "math.ceil({})"),
    "trunc_to_int": (math.trunc, "math.trunc({})"),
    "round_to_int": (round, "round({})"),
    "eq": (operator.eq, "({} == {})"),
    "ne": (operator.ne, "({} != {})"),
    "lt": (operator.lt, "({} < {})"),
    "le": (operator.le, "({} <= {})"),
    "gt": (operator.gt, "({} > {})"),
    "ge": (operator.ge, "({} >= {})"),
    "and_": (operator.and_, "({} and {})"),
    "or_": (operator.or_, "({} or {})"),
    "not_": (operator.not_, "(not {})"),
}


_SYM_MINMAX = {"minimum": torch.sym_min, "maximum": torch.sym_max}


class SizeCode:
    """A sympy-interpreter analysis writing each operation through ``emit(name, args)``
    (``name`` a key of the operation table); plain Python numbers are folded directly."""

    def __init__(self, emit: Callable[[str, tuple], Any]) -> None:
        self._emit = emit

    def _op(self, name: str, *args: Any) -> Any:
        if all(isinstance(a, (bool, int, float)) for a in args):
            return _OPS[name][0](*args)
        return self._emit(name, args)

    @staticmethod
    def constant(c: Any, dtype: torch.dtype) -> Any:
        if dtype is torch.bool:
            return bool(c)
        if dtype is torch.int64:
            return int(c)
        return float(c)

    def sym_sum(self, args: list) -> Any:
        acc = args[0]
        for a in args[1:]:
            acc = self.add(acc, a)
        return acc

    def add(self, a: Any, b: Any) -> Any:
        # ``x + (-1)*y`` reads as ``x - y``
        if isinstance(b, (int, float)) and b < 0:
            return self._op("sub", a, -b)
        return self._op("add", a, b)

    def mul(self, a: Any, b: Any) -> Any:
        if isinstance(a, (int, float)) and a == 1:
            return b
        if isinstance(a, (int, float)) and a == -1:
            return self._op("neg", b)
        return self._op("mul", a, b)

    def reciprocal(self, a: Any) -> Any:
        return self._op("truediv", 1.0, a)

    def square(self, a: Any) -> Any:
        return self._op("mul", a, a)

    def identity(self, a: Any) -> Any:
        return a

    def to_dtype(self, a: Any, dtype: torch.dtype) -> Any:
        return self._op("to_float", a)

    def floor_to_int(self, a: Any, dtype: torch.dtype) -> Any:
        return self._op("floor_to_int", a)

    def ceil_to_int(self, a: Any, dtype: torch.dtype) -> Any:
        return self._op("ceil_to_int", a)

    def trunc_to_int(self, a: Any, dtype: torch.dtype) -> Any:
        return self._op("trunc_to_int", a)

    def round_to_int(self, a: Any, dtype: torch.dtype) -> Any:
        return self._op("round_to_int", a)

    def __getattr__(self, name: str) -> Any:
        if name in _OPS:
            return lambda *args: self._op(name, *args)
        raise AttributeError(name)


def python_source(expr: Any, names: dict[Any, str]) -> str:
    """``expr`` (sympy) as a Python expression over the variables ``names[symbol]``."""
    def emit(name: str, args: tuple) -> str:
        return _OPS[name][1].format(*(a if isinstance(a, str) else repr(a) for a in args))

    out = sympy_interp(SizeCode(emit), {s: n for s, n in names.items()}, expr)
    if not isinstance(out, str):
        return repr(out)
    if out.startswith("(") and out.endswith(")"):  # one outer pair of parentheses
        depth = 0
        for k, ch in enumerate(out):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0 and k < len(out) - 1:
                break
        else:
            out = out[1:-1]
    return out


def is_symbolic(v: Any) -> bool:
    """A SymInt/SymFloat/SymBool that is not a known constant."""
    return isinstance(v, SYM_TYPES) and bool(expr_of(v).free_symbols)


def known_equal(a: Any, b: Any) -> bool:
    """``a == b`` for sizes or shapes, decided without recording a guard: True only where it
    holds for every value of the symbols (what an optimization may rely on)."""
    if isinstance(a, (tuple, list)) or isinstance(b, (tuple, list)):
        if not isinstance(a, (tuple, list)) or not isinstance(b, (tuple, list)):
            return False
        return len(a) == len(b) and all(known_equal(x, y) for x, y in zip(a, b))
    if not isinstance(a, SYM_TYPES) and not isinstance(b, SYM_TYPES):
        return a == b
    return statically_known_true(a == b)


def known_one(s: Any) -> bool:
    """A size that is 1 for every value of the symbols (a broadcast dimension)."""
    return known_equal(s, 1)


def size_hint(n: Any) -> int:
    """An int, or a symbolic size's value at the example inputs, without a guard (for
    estimates such as byte counts, never for decisions about the code)."""
    if isinstance(n, torch.SymInt):
        hint = n.node.hint
        if hint is None and _unbacked(n.node.expr):  # read from data on every call
            return int(optimization_hint(n))
        if hint is None:
            raise CaptureError(f"the size {n} has no value at the example inputs")
        return int(hint)
    return int(n)


def _unbacked(expr: Any) -> bool:
    """An expression of sizes read from tensor data (unbacked symbols ``u0``)."""
    return any(str(x).startswith("u") for x in expr.free_symbols)


def unbacked_sizes(graph: fx.Graph) -> list[str]:
    """Nodes of ``graph`` whose value has a size PyTorch could not express in the input sizes
    (an unbacked symbol ``u0``): ``name: shape``."""
    out = []
    for n in graph.nodes:
        for t in _leaves(n.meta.get("val")):
            shape = t[1].shape
            if any(isinstance(s, torch.SymInt) and any(
                    str(x).startswith("u") for x in s.node.expr.free_symbols) for s in shape):
                out.append(f"{n.name}: {tuple(shape)}")
                break
    return out


def read_result_sizes(graph: fx.Graph, only: set | None = None) -> int:
    """Read on every call the sizes of results that depend on data (``nonzero``, ``x[mask]``,
    ``masked_select``, ``unique`` captured on a ShapeEnv: a dimension that is an unbacked
    symbol ``u0`` of its own): a node ``nonzero_size_0 = nonzero.size(0)`` right after the
    first node whose value has that dimension, marked like the sizes read with ``.tolist()``
    (``meta['fxad_unbacked']``, a side effect: passes keep it, :func:`bind_sizes` writes
    every later use of the size as a read of it).  ``only``: these symbols alone (as the
    ShapeEnv holds them, before replacements).  Returns how many nodes it added."""
    read: set = set()
    for n in graph.nodes:
        if n.meta.get("fxad_unbacked"):
            v = n.meta["val"]
            read.update(expr_of(u) for u in (v if isinstance(v, list) else [v]))
    added = 0
    for n in list(graph.nodes):
        if n.op in ("placeholder", "output"):
            continue
        at = n
        for path, t in _leaves(n.meta.get("val")):  # (a tuple: torch.where(cond))
            for d, s in enumerate(t.shape):
                e = (expr_of(s) if only is None else s.node.expr) \
                    if isinstance(s, torch.SymInt) else None
                if not isinstance(e, sympy.Symbol) or not _unbacked(e) or e in read \
                        or only is not None and e not in only:
                    continue
                read.add(e)
                base, name, val = n, n.name, n.meta["val"]
                for k in path:
                    val = val[k]
                    with graph.inserting_after(at):
                        at = base = graph.create_node("call_function", operator.getitem,
                                                      (base, k), {}, name=f"{name}_{k}")
                    base.meta.update(val=val, fxad_side_effect=True, fxad_no_grad=True)
                    name = base.name
                with graph.inserting_after(at):
                    at = graph.create_node("call_method", "size", (base, d), {},
                                           name=f"{name}_size_{d}")
                at.meta.update(val=s, fxad_unbacked=True, fxad_side_effect=True,
                               fxad_no_grad=True)
                for key in ("fxad_loc", "stack_trace", "nn_module_stack"):
                    if key in n.meta:
                        at.meta[key] = n.meta[key]
                added += 1
    return added


def check_squeeze(name: str, args: tuple, kwargs: dict) -> None:
    """``squeeze`` removes the dimensions of size 1 among those it is given (all, without a
    ``dim``): a symbolic size there must not be 1 on a call, or the result has another rank
    (a guard; decisions inside PyTorch's operators are size-oblivious and do not record it)."""
    if name not in ("squeeze", "squeeze_") or not args or not isinstance(args[0], torch.Tensor):
        return
    x = args[0]
    dims = args[1] if len(args) > 1 else kwargs.get("dim")
    if dims is None:
        dims = range(x.dim())
    elif isinstance(dims, int):
        dims = [dims]
    for d in dims:
        s = x.shape[d]
        if is_symbolic(s) and not known_one(s):
            torch._check(s != 1)


def has_symbolic_shape(t: Any) -> bool:
    """A tensor with a symbolic dimension."""
    return isinstance(t, torch.Tensor) and any(isinstance(s, torch.SymInt) for s in t.shape) \
        and any(is_symbolic(s) for s in t.shape)


def expr_of(v: Any) -> Any:
    """The simplified sympy expression of a symbolic value (replacements applied)."""
    node = v.node
    return node.shape_env.simplify(node.expr)


def has_symbolic_args(node: fx.Node) -> bool:
    found = False

    def look(a: Any) -> Any:
        nonlocal found
        if isinstance(a, SYM_TYPES):
            found = True
        return a
    fx.node.map_aggregate((node.args, node.kwargs), look)
    return found


def _leaves(v: Any, path: tuple = ()) -> list[tuple[tuple, torch.Tensor]]:
    if isinstance(v, torch.Tensor):
        return [(path, v)]
    if isinstance(v, (tuple, list)):
        return [x for i, item in enumerate(v) for x in _leaves(item, path + (i,))]
    if isinstance(v, dict):
        return [x for k, item in v.items() for x in _leaves(item, path + (k,))]
    return []


def _ident(text: str) -> str:
    text = text.replace("//", " div ").replace("*", " ").replace("+", " plus ") \
        .replace("-", " minus ").replace("/", " over ")
    name = re.sub(r"\W+", "_", text).strip("_")
    return name if name and not name[0].isdigit() else f"size_{name}"


def bind_sizes(graph: fx.Graph, names: dict[Any, str] | None = None) -> int:
    """Replace every symbolic size in the arguments of ``graph``'s nodes by graph values read
    from the inputs (see the module docstring); returns how many arguments it replaced.

    Args:
        names: sympy symbol -> the name of its size line (``T``); missing ones are named
            ``<input>_size_<dim>``.
    """
    names = dict(names if names is not None else getattr(_STATE, "names", None) or {})
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    uses = [n for n in graph.nodes if n.op != "placeholder" and has_symbolic_args(n)]
    if not uses:
        return 0
    sources: dict[Any, tuple[fx.Node, tuple, int]] = {}
    for ph in placeholders:
        for path, t in _leaves(ph.meta.get("val")):
            for d, s in enumerate(t.shape):
                if isinstance(s, torch.SymInt) and is_symbolic(s):
                    e = expr_of(s)
                    if isinstance(e, sympy.Symbol) and e not in sources:
                        sources[e] = (ph, path, d)
    # sizes the program read from tensor data on every call (unbacked symbols): symbol ->
    # (the node reading them, index in its list or None)
    read: dict[Any, tuple[fx.Node, int | None]] = {}
    for n in graph.nodes:
        if n.meta.get("fxad_unbacked"):
            v = n.meta["val"]
            for k, u in enumerate(v) if isinstance(v, list) else [(None, v)]:
                read[expr_of(u)] = (n, k)
    anchor = placeholders[-1] if placeholders else None
    before: fx.Node | None = None  # a use: sizes of data-dependent values go right before it
    bound: dict[Any, Any] = {}
    symbol_nodes: dict[Any, fx.Node] = {}
    count = 0

    def insert(target: Any, args: tuple, name: str, val: Any, kind: str = "call_function"
               ) -> fx.Node:
        nonlocal anchor
        if before is not None:
            ctx = graph.inserting_before(before)
        elif anchor is None:
            ctx = graph.inserting_before(next(iter(graph.nodes)))
        else:
            ctx = graph.inserting_after(anchor)
        with ctx:
            node = graph.create_node(kind, target, args, {}, name=name)
        node.meta["val"] = val
        node.meta["fxad_size"] = True
        if before is None:
            anchor = node
        return node

    def read_node(sym: Any) -> fx.Node:
        src, k = read[sym]
        if k is None:
            node = src
        else:
            with graph.inserting_after(src):
                node = graph.create_node("call_function", operator.getitem, (src, k), {},
                                         name=f"{src.name}_{k}")
            node.meta["val"] = src.meta["val"][k]
            node.meta["fxad_size"] = True
        symbol_nodes[sym] = node
        return node

    def symbol_node(sym: Any) -> fx.Node:
        if sym in symbol_nodes:
            return symbol_nodes[sym]
        if sym in read:
            return read_node(sym)
        if sym not in sources:
            raise CaptureError(
                f"the size {sym} has no source among the inputs of the graph (a size computed "
                "from tensor data, e.g. by nonzero(), cannot be made symbolic)")
        ph, path, d = sources[sym]
        base: Any = ph
        val: Any = ph.meta.get("val")
        for k in path:
            val = val[k]
            base = insert(operator.getitem, (base, k), f"{ph.name}_{k}", val)
        name = names.get(sym) or f"{base.name}_size_{d}"
        node = insert("size", (base, d), name, val.shape[d], kind="call_method")
        symbol_nodes[sym] = node
        return node

    def emit(op: str, args: tuple) -> fx.Node:
        fn, template = _OPS[op]
        vals = tuple(a.meta["val"] if isinstance(a, fx.Node) else a for a in args)
        text = template.format(*(a.name if isinstance(a, fx.Node) else repr(a) for a in args))
        # (min/max of a size read from data: no guard on which is smaller)
        val = _SYM_MINMAX.get(op, fn)(*vals)
        return insert(fn, args, _ident(text), val)

    def value_of(v: Any) -> Any:
        nonlocal count
        e = expr_of(v)
        if e in bound:
            count += 1
            return bound[e]
        if not e.free_symbols:
            out: Any = int(e) if isinstance(v, torch.SymInt) else (
                bool(e) if isinstance(v, torch.SymBool) else float(e))
        else:
            env = {s: symbol_node(s) for s in e.free_symbols}
            out = sympy_interp(SizeCode(emit), env, e)
            if isinstance(v, torch.SymFloat) and isinstance(out, int):
                out = float(out)
        bound[e] = out
        count += 1
        return out

    def replace(a: Any) -> Any:
        nonlocal before
        if isinstance(a, SYM_TYPES) and read and expr_of(a).free_symbols & read.keys():
            before = use
            try:
                return value_of(a)
            finally:
                before = None
        if isinstance(a, SYM_TYPES):
            return value_of(a)
        if isinstance(a, torch.Size):
            return tuple(replace(x) for x in a)
        return a

    # the inputs' size lines first, in input and dimension order
    wanted: set = set()

    def collect(a: Any) -> Any:
        if isinstance(a, SYM_TYPES):
            wanted.update(expr_of(a).free_symbols)
        return a
    for n in uses:
        fx.node.map_aggregate((n.args, n.kwargs), collect)
    use: fx.Node | None = None
    for sym in sources:
        if sym in wanted:
            symbol_node(sym)
    for use in uses:
        use.args = fx.node.map_aggregate(use.args, replace)
        use.kwargs = fx.node.map_aggregate(use.kwargs, replace)
    return count
