"""Random decisions: a Python ``if`` on a random draw turned into ``torch.cond``.

Some programs decide on a value that changes from call to call by design: LayerDrop
(``if torch.rand([]) < self.layerdrop: skip the layer``) draws a number and runs a layer or
not.  Capture cannot specialize on the example's draw (the next call draws again), so when
the program asks for the truth value of a tensor computed from a random op
(:func:`random_decision`, called by the value-decision code of capture), the function that
asks is rewritten, as TensorFlow's AutoGraph rewrites Python ``if`` on tensors:

* its source is parsed (:mod:`ast`) and every ``if`` statement that can become a
  conditional is replaced by a call of :func:`if_stmt` with its two branches as nested
  functions of the variables the branches assign (their values before the ``if`` in, their
  new values out); ``not``, ``and``, ``or`` in tests become :func:`not_`, :func:`and_`,
  :func:`or_`, and ``a if c else b`` becomes :func:`if_exp`; ``if c: ...; continue`` at the
  top of a loop body becomes ``if c: ... else: <the rest of the body>``, and a ``continue``
  deeper in ``if`` blocks sets a flag under which the rest of the body runs;
* at run time these helpers do exactly what Python does unless the predicate is a tensor
  computed from a random draw while capturing: then both branches are captured and recorded
  as one ``fxad.ops.cond`` node (:func:`fxad.capture.control.capture_if`), whose predicate
  the generated code evaluates on every call (a new draw each call);
* the capture starts again with the rewritten code object swapped into the function
  (:class:`RestartCapture`, :func:`patched`): the function object keeps its globals,
  defaults, closure cells (``__class__`` for ``super()``) and decorators; the swap lasts
  for the capture only.  Rewrites are cached per code object, so a loop of N layers costs
  one restart per function.

What cannot be rewritten is refused with a :class:`~fxad.errors.DataDependentError` naming
the line and showing the ``torch.cond`` rewrite: a branch that returns, breaks, continues
out of anything but ``if`` blocks, yields, deletes, declares ``global``/``nonlocal``, or
mutates an object (``lst.append``, ``self.x = ...``: both branches run while capturing); a
decision outside an ``if`` test (``while``, ``assert``, ``.item()``); a function the traced
program creates anew on each call (a ``def`` inside ``forward``).  A variable that the
branches leave different (bound in one only, other shapes, ``None`` in one and an object in
the other) is bound to a value (:class:`Undefined`) that raises that error where it is read:
every read of a name a converted ``if`` assigns goes through :func:`use`, because Python
answers ``v is None``, ``isinstance(v, T)``, and passes ``v`` to a function or into an object
without asking ``v``.
"""
from __future__ import annotations

import ast
import contextlib
import gc
import inspect
import linecache
import sys
import textwrap
import types
from typing import Any, Callable, Iterator, NoReturn, Sequence

import torch

from ..errors import DataDependentError, SourceLoc
from ..graph.proxy import user_source_loc
from ..simplify._util import draws_random
from .control import BranchMismatch, capture_if
from .state import current

__all__ = ["RestartCapture", "random_decision", "patched", "attached_graphs", "if_stmt", "if_exp", "not_",
           "and_", "or_", "use", "depends_on_random", "MAX_RESTARTS"]

MAX_RESTARTS = 8
_HELPERS = "_fxad_autograph"
# methods that change a list, dict or set in place (not names of tensor methods: `x.add(y)`
# and `x.sort()` compute new tensors)
_MUTATORS = {"append", "extend", "insert", "pop", "remove", "clear", "update", "setdefault",
             "discard", "popitem", "__setitem__"}

# original code object -> rewritten code object (or the reason it cannot be rewritten)
_CACHE: dict[types.CodeType, types.CodeType | str] = {}
# every code object made by a rewrite (the functions and their branch functions)
_REWRITTEN: set[types.CodeType] = set()
# original code objects whose rewrite is swapped in now (how many swaps)
_ACTIVE: dict[types.CodeType, int] = {}


class RestartCapture(Exception):
    """Capture must run again with ``patches`` applied: ``(function, new code)`` pairs."""

    def __init__(self, patches: list[tuple[types.FunctionType, types.CodeType]]) -> None:
        super().__init__("capture restarts with rewritten functions")
        self.patches = patches


# -- run-time helpers called by rewritten code ----------------------------------------------

class _Unbound:
    """A variable with no value yet (plain Python semantics: deleted again after the
    ``if``; reading it inside a branch raises Python's own error)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def _fail(self, *_: Any, **__: Any) -> NoReturn:
        raise UnboundLocalError(
            f"cannot access local variable '{self.name}' where it is not associated with a "
            "value")

    __bool__ = __getattr__ = __getitem__ = __iter__ = __call__ = __len__ = _fail
    __add__ = __radd__ = __sub__ = __mul__ = __rmul__ = __index__ = __float__ = _fail


class Undefined:
    """The value of a variable after a captured ``if`` whose branches disagree on it: any
    use raises a :class:`~fxad.errors.DataDependentError` naming the ``if`` and why."""

    def __init__(self, name: str, why: str, loc: SourceLoc | None) -> None:
        object.__setattr__(self, "_info", (name, why, loc))

    def _fail(self, *_: Any, **__: Any) -> NoReturn:
        name, why, loc = object.__getattribute__(self, "_info")
        where = f" ({loc.filename}:{loc.lineno}: `{loc.code}`)" if loc is not None else ""
        raise DataDependentError(
            f"`{name}` is used after an `if` on a random draw{where} that fxad captured as "
            f"torch.cond, but it has no single value there: {why}", op="if",
            loc=user_source_loc() or loc,
            hint=f"give `{name}` a value of the same kind (tensor shape, dtype, Python value)"
                 " in both branches, or before the `if`")

    __bool__ = __getattr__ = __getitem__ = __iter__ = __call__ = __len__ = _fail
    __add__ = __radd__ = __sub__ = __mul__ = __rmul__ = __index__ = __float__ = _fail
    __setattr__ = __eq__ = __ne__ = __lt__ = __gt__ = __hash__ = _fail  # type: ignore


def depends_on_random(cap: Any, t: Any) -> bool:
    """The tensor ``t`` of capture ``cap`` is computed from a random draw (an ancestor node
    draws: :func:`fxad.simplify._util.draws_random`)."""
    if cap is None or not isinstance(t, torch.Tensor):
        return False
    node = cap.env.get(id(t))
    return node is not None and bool(_draws_behind(node))


def _draws_behind(node: Any) -> list:
    """The nodes among ``node`` and its ancestors that draw random numbers."""
    found, seen, todo = [], set(), [node]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if draws_random(n):
            found.append(n)
        todo.extend(n.all_input_nodes)
    return found


def _random(v: Any) -> Any:
    """The capture, if ``v`` is a tensor decided by a random draw while capturing."""
    cap = current()
    if cap is None or getattr(cap, "suspended", 0) or not isinstance(v, torch.Tensor):
        return None
    return cap if depends_on_random(cap, v) else None


def _truth(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v if v.dtype == torch.bool else v != 0
    return bool(v)


def not_(v: Any) -> Any:
    """``not v``; a random tensor's negation stays a tensor."""
    if _random(v) is not None:
        return torch.logical_not(_truth(v))
    return not v


def _logical(thunks: Sequence[Callable[[], Any]], stop: bool) -> Any:
    acc = None
    for k, thunk in enumerate(thunks):
        v = thunk()
        if acc is not None:  # a random tensor decides: the rest joins it as tensors
            if isinstance(v, torch.Tensor):
                acc = (torch.logical_or if stop else torch.logical_and)(acc, _truth(v))
            elif bool(v) is stop:
                _keep_draws(acc)  # the draw decides nothing now, but eager draws it
                return stop  # `t or True` is true, `t and False` false, whatever t is
            continue
        if k == len(thunks) - 1:
            return v
        if _random(v) is not None:
            acc = _truth(v)
        elif bool(v) is stop:
            return v
    return acc


def _keep_draws(t: torch.Tensor) -> None:
    """Keep the random draws ``t`` is computed from in the graph even if nothing reads
    them, so that the generated code draws as many numbers as eager PyTorch."""
    cap = current()
    node = cap.env.get(id(t)) if cap is not None else None
    for n in _draws_behind(node) if node is not None else ():
        n.meta["fxad_side_effect"] = True


def and_(*thunks: Callable[[], Any]) -> Any:
    """``a and b and ...`` (each operand a thunk, evaluated as Python would); from the
    first operand that is a random tensor on, a ``torch.logical_and`` of the operands."""
    return _logical(thunks, False)


def or_(*thunks: Callable[[], Any]) -> Any:
    """``a or b or ...``, as :func:`and_` with ``torch.logical_or``."""
    return _logical(thunks, True)


def _loc(line: tuple[str, int, str]) -> SourceLoc:
    return SourceLoc(line[0], line[1], line[2], linecache.getline(line[0], line[1]).strip())


def if_stmt(pred: Any, true_fn: Callable, false_fn: Callable, names: tuple,
            scope: dict, line: tuple[str, int, str]) -> tuple:
    """A rewritten ``if pred: ... else: ...``: ``true_fn``/``false_fn`` take the current
    values of the variables ``names`` (read from ``scope``, the caller's ``locals()``) and
    return their new values.  A Python predicate runs one branch, as Python does; a tensor
    decided by a random draw while capturing records both as one ``torch.cond``."""
    before = tuple(scope[n] if n in scope else _Unbound(n) for n in names)
    cap = _random(pred)
    if cap is None:
        return tuple((true_fn if pred else false_fn)(*before))
    loc = _loc(line)
    if pred.numel() != 1:
        raise DataDependentError(
            f"an `if` decides on a random tensor of shape {list(pred.shape)}, which has no "
            "single truth value", op="if", loc=loc,
            hint="reduce it to one element (.all(), .any()) or choose values with torch.where")
    absent = object()
    outs = capture_if(cap, pred.reshape(()) if pred.dim() else pred,
                      [lambda: _bound(true_fn(*before), absent),
                       lambda: _bound(false_fn(*before), absent)],
                      before, names, absent)
    return tuple(Undefined(n, o.why, loc) if isinstance(o, BranchMismatch) else o
                 for n, o in zip(names, outs))


def _bound(values: Sequence[Any], absent: Any) -> tuple:
    return tuple(absent if isinstance(v, _Unbound) else v for v in values)


def if_exp(pred: Any, a: Callable[[], Any], b: Callable[[], Any],
           line: tuple[str, int, str]) -> Any:
    """A rewritten ``a if pred else b`` (the values as thunks), as :func:`if_stmt`."""
    return if_stmt(pred, lambda _: (a(),), lambda _: (b(),), ("the conditional expression",),
                   {}, line)[0]


def unbound(v: Any) -> bool:
    """``v`` stands for a variable that has no value (it is deleted again)."""
    return isinstance(v, _Unbound)


def use(v: Any) -> Any:
    """``v``, read by the rewritten program: an :class:`Undefined` raises its error here,
    whatever the read is (``v is None``, ``isinstance(v, T)``, passing or storing ``v``,
    which Python would answer without asking ``v``)."""
    if isinstance(v, Undefined):
        v._fail()
    return v


# -- the decision: rewrite and restart, or refuse -----------------------------------------

_REWRITE_HINT = (
    "write the choice with torch.cond, so that both paths are in the graph and the "
    "predicate is evaluated on every call:\n"
    "        def run(h):\n"
    "            return layer(h)          # the `if` branch, returning the values it assigns\n"
    "        def skip(h):\n"
    "            return h.clone()         # the other branch: the same shapes and dtypes\n"
    "        h = torch.cond(torch.rand([]) < p, run, skip, (h,))\n"
    "    (the branches must not return early, break, continue, or change Python objects)")


def random_decision(cap: Any, tensor: Any, loc: SourceLoc | None) -> NoReturn:
    """The program asks for the truth value of ``tensor``, computed from a random draw,
    at ``loc``.  Raises :class:`RestartCapture` with the function rewritten so that its
    ``if`` becomes a ``torch.cond``, or a :class:`~fxad.errors.DataDependentError` naming
    the line and how to write the ``torch.cond`` by hand."""
    frame = _user_frame(loc)
    if frame is None:
        _refuse(loc, "fxad could not find the function that makes this decision")
    code = frame.f_code
    if code in _REWRITTEN:
        _refuse(loc, _why_not_here(code, loc))
    if code.co_name.startswith("<"):
        _refuse(loc, f"the decision is made in a {code.co_name[1:-1]}, which fxad cannot "
                     "rewrite; move it into an `if` statement of a function")
    if code in _ACTIVE:  # rewritten already, yet the original code runs: a new function
        _refuse(loc, f"`{code.co_name}` is defined inside the traced program (a new function "
                     "object on every call), so fxad cannot swap in a rewritten version; "
                     "define it outside, e.g. as a method or a module-level function")
    funcs = [f for f in gc.get_referrers(code)
             if isinstance(f, types.FunctionType) and f.__code__ is code]
    if not funcs:
        _refuse(loc, f"fxad could not find the function object of `{code.co_name}`")
    new = _CACHE.get(code)
    if new is None:
        try:
            new = _rewrite(funcs[0])
        except _CannotRewrite as e:
            new = str(e)
        _CACHE[code] = new
    if isinstance(new, str):
        _refuse(loc, new)
    if not _converted_at(new, loc):
        _refuse(loc, _why_not_here(new, loc))
    raise RestartCapture([(f, new) for f in funcs])


def _refuse(loc: SourceLoc | None, why: str) -> NoReturn:
    raise DataDependentError(
        "Python control flow depends on a random draw, whose value changes from call to "
        f"call (it cannot be specialized on the example's value); {why}", op="bool(Tensor)",
        loc=loc, hint=_REWRITE_HINT)


def _user_frame(loc: SourceLoc | None) -> Any:
    if loc is None:
        return None
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename == loc.filename and frame.f_lineno == loc.lineno:
            return frame
        frame = frame.f_back
    return None


def _converted_at(code: types.CodeType, loc: SourceLoc | None) -> bool:
    return loc is not None and loc.lineno in getattr(_META.get(code), "lines", ())


def _why_not_here(code: types.CodeType, loc: SourceLoc | None) -> str:
    meta = _META.get(code)
    if meta is not None and loc is not None:
        for (lo, hi), why in meta.refused.items():
            if lo <= loc.lineno <= hi:
                return why
    return ("the decision is not the test of an `if` statement or conditional expression "
            "that fxad can turn into torch.cond (a `while`, an `assert`, a Python number "
            "taken with .item() or float())")


@contextlib.contextmanager
def patched(patches: Sequence[tuple[types.FunctionType, types.CodeType]]) -> Iterator[None]:
    """The rewritten code objects swapped into their functions while the block runs."""
    done: list[tuple[types.FunctionType, types.CodeType]] = []
    try:
        for f, new in patches:
            if f.__code__ is not new:
                done.append((f, f.__code__))
                _ACTIVE[f.__code__] = _ACTIVE.get(f.__code__, 0) + 1
                f.__code__ = new
        yield
    finally:
        for f, old in reversed(done):
            f.__code__ = old
            _ACTIVE[old] -= 1
            if not _ACTIVE[old]:
                del _ACTIVE[old]


def attached_graphs(program: Any) -> Callable[[], None]:
    """A function that removes the attributes capture attached (``_fxad_...`` graphs of
    control flow) to the module ``program`` (or the module a wrapper holds in ``.f``) since
    this call: what an abandoned capture left on the user's module."""
    module = program if isinstance(program, torch.nn.Module) else getattr(program, "f", None)
    if not isinstance(module, torch.nn.Module):
        return lambda: None
    before = set(vars(module))

    def forget() -> None:
        for name in set(vars(module)) - before:
            if name.startswith("_fxad_"):
                del vars(module)[name]
    return forget


# -- the rewrite ------------------------------------------------------------------------------

class _CannotRewrite(Exception):
    pass


class _Meta:
    def __init__(self) -> None:
        self.lines: set[int] = set()       # test lines of the converted ifs
        self.refused: dict[tuple[int, int], str] = {}


_META: dict[types.CodeType, _Meta] = {}


def _rewrite(func: types.FunctionType) -> types.CodeType:
    code = func.__code__
    if code.co_flags & (inspect.CO_GENERATOR | inspect.CO_COROUTINE
                        | inspect.CO_ASYNC_GENERATOR):
        raise _CannotRewrite(f"`{code.co_name}` is a generator or coroutine")
    try:
        lines, start = inspect.getsourcelines(code)
    except (OSError, TypeError) as e:
        raise _CannotRewrite(f"the source of `{code.co_name}` is not available ({e})") from e
    tree = ast.parse(textwrap.dedent("".join(lines)))
    fdef = tree.body[0] if tree.body else None
    if not isinstance(fdef, ast.FunctionDef) or fdef.name != code.co_name:
        raise _CannotRewrite(f"the source of `{code.co_name}` could not be parsed as its def")
    ast.increment_lineno(tree, start - 1)
    meta = _Meta()
    _Converter(code.co_filename, code.co_name, fdef, meta).run()
    if not meta.lines:
        why = next(iter(meta.refused.values()), "no `if` in it can be converted")
        raise _CannotRewrite(why)
    new = _compile(fdef, code)
    _META[new] = meta
    _mark(new)
    return new


def _mark(code: types.CodeType) -> None:
    _REWRITTEN.add(code)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            _mark(c)


def _compile(fdef: ast.FunctionDef, code: types.CodeType) -> types.CodeType:
    """Compile ``fdef`` so that its code object has ``code``'s free variables (a factory
    function binds them; a class of the method's own class name gives ``super()`` its
    ``__class__`` cell and private names their mangling)."""
    fdef.decorator_list = []
    fdef.returns = None
    for a in fdef.args.posonlyargs + fdef.args.args + fdef.args.kwonlyargs \
            + [fdef.args.vararg, fdef.args.kwarg]:
        if a is not None:
            a.annotation = None
    imp = ast.ImportFrom(module="fxad.capture", names=[ast.alias("autograph", _HELPERS)],
                         level=0)
    fdef.body.insert(0, _here(imp, fdef.lineno))
    parts = code.co_qualname.split(".")
    owner = parts[-2] if len(parts) >= 2 and parts[-2].isidentifier() else None
    inner: ast.stmt = fdef
    if owner is not None:
        inner = ast.ClassDef(name=owner, bases=[], keywords=[], body=[fdef], decorator_list=[])
        ret: ast.expr = ast.Subscript(ast.Attribute(ast.Name(owner, ast.Load()), "__dict__",
                                                    ast.Load()),
                                      ast.Constant(_mangled(fdef.name, owner)), ast.Load())
    else:
        ret = ast.Name(fdef.name, ast.Load())
    free = [n for n in code.co_freevars if n != "__class__"]
    factory = ast.FunctionDef(
        name="_fxad_factory",
        args=ast.arguments(posonlyargs=[], args=[ast.arg(n) for n in free], vararg=None,
                           kwonlyargs=[], kw_defaults=[], kwarg=None, defaults=[]),
        body=[inner, ast.Return(ret)], decorator_list=[], returns=None)
    module = ast.Module(body=[_here(factory, fdef.lineno)], type_ignores=[])
    scope: dict[str, Any] = {}
    exec(compile(module, code.co_filename, "exec", dont_inherit=True), scope)  # noqa: S102
    fn = scope["_fxad_factory"](*[None] * len(free))
    new = fn.__code__
    if new.co_freevars != code.co_freevars:
        raise _CannotRewrite(f"the rewritten `{code.co_name}` reads other variables of its "
                             "enclosing scope than the original")
    return new.replace(co_qualname=code.co_qualname)


def _mangled(name: str, owner: str) -> str:
    if name.startswith("__") and not name.endswith("__") and owner.strip("_"):
        return f"_{owner.lstrip('_')}{name}"
    return name


def _assigned(stmts: Sequence[ast.stmt]) -> list[str]:
    """Names the statements bind (in order of first binding), not those of nested scopes."""
    out: list[str] = []

    def add(name: str) -> None:
        if name not in out:
            out.append(name)

    def visit(node: ast.AST) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            add(node.name)
            for d in node.decorator_list:
                visit(d)
            return
        if isinstance(node, (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp,
                             ast.GeneratorExp)):
            return
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            add(node.id)
        elif isinstance(node, ast.NamedExpr):
            add(node.target.id)
        elif isinstance(node, ast.alias):
            add((node.asname or node.name).split(".")[0])
        elif isinstance(node, ast.ExceptHandler) and node.name:
            add(node.name)
        for child in ast.iter_child_nodes(node):
            visit(child)

    for s in stmts:
        visit(s)
    return out


def _obstacle(stmts: Sequence[ast.stmt], declared: set[str]) -> str | None:
    """Why these branch statements cannot become a function body, or None."""
    def visit(node: ast.AST, loop: int) -> str | None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            return None
        if isinstance(node, ast.Return):
            return "a branch returns from the function"
        if isinstance(node, (ast.Break, ast.Continue)) and not loop:
            return f"a branch uses `{type(node).__name__.lower()}` out of its loop"
        if isinstance(node, (ast.Yield, ast.YieldFrom, ast.Await)):
            return "a branch yields or awaits"
        if isinstance(node, (ast.Global, ast.Nonlocal)):
            return "a branch declares global or nonlocal names"
        if isinstance(node, ast.Delete):
            return "a branch deletes a name or an item"
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                for sub in ast.walk(t):
                    if isinstance(sub, (ast.Attribute, ast.Subscript)) \
                            and isinstance(getattr(sub, "ctx", None), ast.Store):
                        return (f"a branch changes an object (`{ast.unparse(sub)} = ...`), "
                                "which would happen for both branches while capturing")
                    if isinstance(sub, ast.Name) and sub.id in declared:
                        return f"a branch assigns the global or nonlocal name `{sub.id}`"
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in _MUTATORS:
            return (f"a branch changes an object (`{ast.unparse(node.func)}(...)`), which would "
                    "happen for both branches while capturing")
        inner = loop + isinstance(node, (ast.For, ast.While, ast.AsyncFor))
        # a loop's `else:` block is outside the loop (an `a if c else b` has an expression)
        after = node.orelse if isinstance(getattr(node, "orelse", None), list) else ()
        for child in ast.iter_child_nodes(node):
            why = visit(child, inner if child not in after else loop)
            if why:
                return why
        return None

    for s in stmts:
        why = visit(s, 0)
        if why:
            return why
    return None


def _here(node: Any, line: int) -> Any:
    """Give ``node`` and its sub-nodes without a location the one-line location ``line``
    (a location over several lines would put attribute loads and calls on its last line,
    where tracebacks and fxad's messages would then point)."""
    for n in ast.walk(node):
        if "lineno" in n._attributes and getattr(n, "lineno", None) is None:
            n.lineno = n.end_lineno = line
            n.col_offset = n.end_col_offset = 0
    return node


def _thunk(e: ast.expr) -> ast.Lambda:
    lam = ast.Lambda(args=ast.arguments(posonlyargs=[], args=[], vararg=None, kwonlyargs=[],
                                        kw_defaults=[], kwarg=None, defaults=[]), body=e)
    return _here(lam, e.lineno)


def _helper(name: str, args: list[ast.expr], like: ast.AST) -> ast.Call:
    call = ast.Call(func=ast.Attribute(ast.Name(_HELPERS, ast.Load()), name, ast.Load()),
                    args=args, keywords=[])
    return _here(call, like.lineno)


class _Converter:
    """Rewrites the body of one function (not its nested functions)."""

    def __init__(self, filename: str, funcname: str, fdef: ast.FunctionDef,
                 meta: _Meta) -> None:
        self.filename, self.funcname, self.fdef, self.meta = filename, funcname, fdef, meta
        self.declared = {n for s in ast.walk(fdef) if isinstance(s, (ast.Global, ast.Nonlocal))
                         for n in s.names}
        tested = {n.id for s in ast.walk(fdef) if isinstance(s, (ast.If, ast.IfExp))
                  for n in ast.walk(s.test) if isinstance(n, ast.Name)}
        self.tested = tested
        self.count = 0
        self.tracked: set[str] = set()  # the names a converted `if` assigns

    def run(self) -> None:
        self.fdef.body = self.block(self.fdef.body)
        if self.tracked:
            _ReadsChecked(self.tracked).visit(self.fdef)
        first = (self.fdef.args.posonlyargs + self.fdef.args.args)[:1]
        if first:  # zero-argument super() inside a branch function: explicit arguments
            for n in ast.walk(self.fdef):
                if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) \
                        and n.func.id == "super" and not n.args and not n.keywords:
                    n.args = [_here(ast.Name("__class__", ast.Load()), n.lineno),
                              _here(ast.Name(first[0].arg, ast.Load()), n.lineno)]

    def line(self, node: ast.AST) -> ast.Tuple:
        return ast.Tuple([ast.Constant(self.filename), ast.Constant(node.lineno),
                          ast.Constant(self.funcname)], ast.Load())

    # expressions
    def expr(self, e: ast.expr, boolean: bool) -> ast.expr:
        """``e`` with conditional expressions rewritten, and (``boolean``: a value used
        as a truth value) ``not``/``and``/``or`` too."""
        if isinstance(e, (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp,
                          ast.GeneratorExp, ast.NamedExpr)):
            return e
        if isinstance(e, ast.IfExp):
            self.meta.lines.add(e.test.lineno)
            return _helper("if_exp", [self.expr(e.test, True), _thunk(self.expr(e.body, False)),
                                      _thunk(self.expr(e.orelse, False)), self.line(e.test)], e)
        if boolean and isinstance(e, ast.UnaryOp) and isinstance(e.op, ast.Not):
            return _helper("not_", [self.expr(e.operand, True)], e)
        if boolean and isinstance(e, ast.BoolOp):
            name = "and_" if isinstance(e.op, ast.And) else "or_"
            return _helper(name, [_thunk(self.expr(v, True)) for v in e.values], e)
        for field, value in ast.iter_fields(e):
            if isinstance(value, ast.expr):
                setattr(e, field, self.expr(value, False))
            elif isinstance(value, list):
                setattr(e, field, [self.expr(v, False) if isinstance(v, ast.expr) else v
                                   for v in value])
        return e

    # statements
    def block(self, stmts: list[ast.stmt], loop_body: bool = False) -> list[ast.stmt]:
        if loop_body:  # `continue` skips the rest of this list only at a loop body's top
            stmts = _fold_continue(stmts)
            if _continues(stmts):
                self.count += 1
                flag = f"_fxad_continue{self.count}"
                stmts = [_here(_assign(flag, False), stmts[0].lineno)] + _flag_continue(
                    stmts, flag)
        out: list[ast.stmt] = []
        for s in stmts:
            out.extend(self.stmt(s))
        return out

    def stmt(self, s: ast.stmt) -> list[ast.stmt]:
        if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            return [s]
        if isinstance(s, ast.If):
            return self.convert_if(s)
        if isinstance(s, (ast.For, ast.While, ast.AsyncFor)):
            s.body = self.block(s.body, loop_body=True)
            s.orelse = self.block(s.orelse)
            if isinstance(s, ast.While):
                s.test = self.expr(s.test, False)
            else:
                s.iter = self.expr(s.iter, False)
            return [s]
        for field in ("body", "orelse", "finalbody"):
            if isinstance(getattr(s, field, None), list):
                setattr(s, field, self.block(getattr(s, field)))
        if isinstance(s, ast.Try):
            for h in s.handlers:
                h.body = self.block(h.body)
        if isinstance(s, ast.Assign):
            boolean = any(isinstance(t, ast.Name) and t.id in self.tested for t in s.targets)
            s.value = self.expr(s.value, boolean)
        elif isinstance(s, (ast.Expr, ast.Return, ast.AugAssign, ast.AnnAssign)) \
                and s.value is not None:
            s.value = self.expr(s.value, False)
        return [s]

    def convert_if(self, s: ast.If) -> list[ast.stmt]:
        why = _obstacle(s.body + s.orelse, self.declared)
        if why is None and any(isinstance(n, ast.NamedExpr) for n in ast.walk(s.test)):
            why = "its test assigns a name (`:=`)"
        if why is not None:
            self.meta.refused[(s.lineno, s.test.end_lineno or s.lineno)] = \
                f"this `if` cannot become torch.cond: {why}"
            s.body = self.block(s.body)
            s.orelse = self.block(s.orelse)
            return [s]
        self.count += 1
        k = self.count
        names = _assigned(s.body + s.orelse)
        self.tracked.update(names)
        body = self.block(s.body)
        orelse = self.block(s.orelse)
        for ln in range(s.test.lineno, (s.test.end_lineno or s.test.lineno) + 1):
            self.meta.lines.add(ln)
        test = self.expr(s.test, True)

        def branch(name: str, stmts: list[ast.stmt]) -> ast.FunctionDef:
            ret = ast.Return(ast.Tuple([_raw(ast.Name(n, ast.Load())) for n in names],
                                       ast.Load()))
            fn = ast.FunctionDef(
                name=name, args=ast.arguments(posonlyargs=[], args=[ast.arg(n) for n in names],
                                              vararg=None, kwonlyargs=[], kw_defaults=[],
                                              kwarg=None, defaults=[]),
                body=(stmts or [ast.Pass()]) + [ret], decorator_list=[], returns=None)
            return _here(fn, s.lineno)

        t_name, f_name = f"_fxad_if{k}_true", f"_fxad_if{k}_false"
        call = _helper("if_stmt", [test, ast.Name(t_name, ast.Load()), ast.Name(f_name, ast.Load()),
                                   ast.Tuple([ast.Constant(n) for n in names], ast.Load()),
                                   ast.Call(ast.Name("locals", ast.Load()), [], []),
                                   self.line(s.test)], s)
        target = ast.Tuple([ast.Name(n, ast.Store()) for n in names], ast.Store())
        out: list[ast.stmt] = [branch(t_name, body), branch(f_name, orelse),
                               _here(ast.Assign([target], call), s.lineno)]
        for n in names:  # a variable the taken branch left unbound is unbound again
            test_unbound = _helper("unbound", [_raw(ast.Name(n, ast.Load()))], s)
            out.append(_here(ast.If(test_unbound, [ast.Delete(
                [ast.Name(n, ast.Del())])], []), s.lineno))
        return out


def _raw(name: ast.Name) -> ast.Name:
    """A read the rewrite itself makes (a branch returning its variables, the test for an
    unbound one): it passes an :class:`Undefined` on instead of raising."""
    name.fxad_raw = True  # type: ignore[attr-defined]
    return name


class _ReadsChecked(ast.NodeTransformer):
    """Every read of a name some converted ``if`` assigns becomes ``use(name)``, so that a
    variable the branches leave different (:class:`Undefined`) raises at any read: Python
    answers ``v is None``, ``type(v)``, ``isinstance(v, T)`` and passes ``v`` on without
    asking the object, and each of those would otherwise decide on the one value capture
    saw."""

    def __init__(self, names: set[str]) -> None:
        self.names = names

    def visit_Name(self, node: ast.Name) -> ast.AST:
        if isinstance(node.ctx, ast.Load) and node.id in self.names \
                and not getattr(node, "fxad_raw", False):
            return _helper("use", [node], node)
        return node


def _fold_continue(stmts: list[ast.stmt]) -> list[ast.stmt]:
    """``if c: A; continue`` followed by ``B`` in a loop body -> ``if c: A else: B``."""
    for i, s in enumerate(stmts):
        if isinstance(s, ast.If) and not s.orelse and s.body \
                and isinstance(s.body[-1], ast.Continue) \
                and _obstacle(s.body[:-1], set()) is None:
            rest = _fold_continue(stmts[i + 1:])
            folded = ast.If(test=s.test, body=s.body[:-1] or [ast.Pass()], orelse=rest)
            return stmts[:i] + [ast.copy_location(folded, s)]
    return stmts


def _continues(stmts: Sequence[ast.AST]) -> bool:
    """A ``continue`` of the enclosing loop among ``stmts`` (not in nested loops or defs)."""
    for s in stmts:
        if isinstance(s, ast.Continue):
            return True
        if isinstance(s, (ast.If, ast.With)):
            if _continues(s.body) or _continues(getattr(s, "orelse", [])):
                return True
    return False


def _assign(name: str, value: bool) -> ast.Assign:
    return ast.Assign([ast.Name(name, ast.Store())], ast.Constant(value))


def _flag_continue(stmts: list[ast.stmt], flag: str) -> list[ast.stmt]:
    """``continue`` (inside ``if``/``with`` blocks of a loop body) written as ``flag = True``
    with the statements after it run under ``if not flag:``, as AutoGraph does: the ``if``
    around a ``continue`` can then become a conditional."""
    out: list[ast.stmt] = []
    for i, s in enumerate(stmts):
        if isinstance(s, ast.Continue):
            out.append(_here(_assign(flag, True), s.lineno))
            return out  # the rest of this block never runs
        if isinstance(s, (ast.If, ast.With)) and _continues([s]):
            s.body = _flag_continue(s.body, flag)
            if isinstance(s, ast.If):
                s.orelse = _flag_continue(s.orelse, flag)
            out.append(s)
            rest = _flag_continue(stmts[i + 1:], flag)
            if rest:
                test = ast.UnaryOp(ast.Not(), ast.Name(flag, ast.Load()))
                out.append(_here(ast.If(test, rest, []), rest[0].lineno))
            return out
        out.append(s)
    return out
