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
out of anything but ``if`` blocks, yields, deletes, or declares ``global``/``nonlocal``; a
decision outside an ``if`` test (``while``, ``assert``, ``.item()``); a function the traced
program creates anew on each call (a ``def`` inside ``forward``).

Where the two branches end in different Python state, the ``if`` is captured **path by
path** instead (:mod:`fxad.capture.paths`; :class:`~fxad.capture.paths.ForkSite` restarts the
capture with the ``if``'s line marked, and :func:`if_stmt` then takes the outcome the run
forces and runs one branch as Python does):

* a branch that changes an object from outside it in place (``lst.append(h)``,
  ``d[k] = v``, ``self.x = v``; :func:`mutated`: capturing both branches would make the
  change twice); a change to a container the branch made itself, or in a branch that
  Python's own decision leaves unrun (``if output_hidden_states: hiddens.append(h)``), is no
  obstacle;
* a variable the branches leave different (bound in one only, other shapes, ``None`` in one
  and an object in the other) that the program reads afterwards: it is bound to an
  :class:`Undefined` whose first read starts the path-by-path capture.  Every read of a name
  a converted ``if`` assigns goes through :func:`use`, because Python answers ``v is None``,
  ``isinstance(v, T)``, and passes ``v`` to a function or into an object without asking
  ``v``.

Inside a ``torch.cond`` branch, a loop body or a checkpoint region (a nested capture) both
are refused with a :class:`~fxad.errors.DataDependentError` naming the line.
"""
from __future__ import annotations

import contextlib
import dis
import gc
import linecache
import sys
import types
from typing import Any, Callable, Iterator, NoReturn, Sequence

import torch

from ..errors import DataDependentError, SourceLoc
from ..graph.proxy import user_source_loc
from ..simplify._util import draws_random
from .control import BranchMismatch, capture_if
from .ifrewrite import META, REWRITTEN, CannotRewrite, rewrite
from .paths import ForkSite, current_forks
from .state import current

__all__ = ["RestartCapture", "random_decision", "patched", "attached_graphs", "if_stmt",
           "if_exp", "not_", "and_", "or_", "use", "mutated", "values_of", "unbound",
           "depends_on_random", "MAX_RESTARTS"]

MAX_RESTARTS = 8

# original code object -> rewritten code object (or the reason it cannot be rewritten)
_CACHE: dict[types.CodeType, types.CodeType | str] = {}
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

    def __init__(self, name: str, why: str, loc: SourceLoc | None,
                 fork: tuple[str, int] | None = None) -> None:
        object.__setattr__(self, "_info", (name, why, loc, fork))

    def _fail(self, *_: Any, **__: Any) -> NoReturn:
        name, why, loc, fork = object.__getattribute__(self, "_info")
        if fork is not None:  # capture the `if` path by path (capture.paths)
            raise ForkSite(fork, loc, f"`{name}`: {why}")
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
    before = values_of(scope, names)
    cap = _random(pred)
    if cap is None:
        return tuple((true_fn if pred else false_fn)(*before))
    loc = _loc(line)
    if pred.numel() != 1:
        raise DataDependentError(
            f"an `if` decides on a random tensor of shape {list(pred.shape)}, which has no "
            "single truth value", op="if", loc=loc,
            hint="reduce it to one element (.all(), .any()) or choose values with torch.where")
    pred = pred.reshape(()) if pred.dim() else pred
    site = (line[0], line[1])
    forks = current_forks()
    top = forks is not None and cap is forks.session and not _BRANCHES
    if top and site in forks.sites:  # captured path by path: Python takes one branch
        _keep_draws(pred)
        outcome = forks.take(cap, cap.node_of(pred), site, loc)
        return tuple((true_fn if outcome else false_fn)(*before))
    absent = object()
    _BRANCHES.append((site, loc) if top else None)
    try:
        outs = capture_if(cap, pred, [lambda: _bound(true_fn(*before), absent),
                                      lambda: _bound(false_fn(*before), absent)],
                          before, names, absent)
    finally:
        _BRANCHES.pop()
    return tuple(Undefined(n, o.why, loc, site if top else None)
                 if isinstance(o, BranchMismatch) else o for n, o in zip(names, outs))


def _bound(values: Sequence[Any], absent: Any) -> tuple:
    return tuple(absent if isinstance(v, _Unbound) else v for v in values)


def if_exp(pred: Any, a: Callable[[], Any], b: Callable[[], Any],
           line: tuple[str, int, str]) -> Any:
    """A rewritten ``a if pred else b`` (the values as thunks), as :func:`if_stmt`."""
    return if_stmt(pred, lambda _: (a(),), lambda _: (b(),), ("the conditional expression",),
                   {}, line)[0]


def values_of(scope: dict, names: tuple) -> tuple:
    """What a branch of a rewritten ``if`` returns: its variables ``names`` from ``scope``
    (the branch's ``locals()``), an unbound one as such (a nested ``if`` left it unbound)."""
    return tuple(scope[n] if n in scope else _Unbound(n) for n in names)


def unbound(v: Any) -> bool:
    """``v`` stands for a variable that has no value (it is deleted again)."""
    return isinstance(v, _Unbound)


# the captures of both branches of an `if` running now, outermost first: the `if`'s site and
# line where it is taken in the top-level capture (and could be captured path by path), else
# None
_BRANCHES: list[tuple[tuple[str, int], SourceLoc] | None] = []


def mutated(obj: Any, line: tuple[str, int, str], what: str) -> Any:
    """``obj``, about to be changed in place by a branch of a rewritten ``if`` (``what``:
    ``lst.append(...)``, ``d[k] = v``, ``self.x = v``).  While both branches are captured
    (:func:`if_stmt` on a random draw) the change would happen for both, on an object that
    exists outside them: refused naming the line; otherwise (a Python predicate, one branch
    runs as in Python) ``obj`` itself."""
    if _BRANCHES:
        loc = _loc(line)
        if _BRANCHES[0] is not None:  # capture the outermost `if` path by path instead
            site, where = _BRANCHES[0]
            raise ForkSite(site, where, f"a branch changes `{what}` at {loc.filename}:"
                                        f"{loc.lineno}")
        raise DataDependentError(
            f"a branch of an `if` on a random draw changes an object that exists outside it "
            f"(`{what}`): fxad captures both branches as torch.cond, so the change would "
            "happen for both, and a torch.cond cannot carry it", op="if", loc=loc,
            hint="build a new value in the branch and assign it (`hiddens = hiddens + [h]` "
                 "for a list: a variable the branches leave different can be used only "
                 "where it has one value), or make the change after the `if`")
    return obj


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
    if code in REWRITTEN:
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
            new = rewrite(funcs[0])
        except CannotRewrite as e:
            new = str(e)
        _CACHE[code] = new
    if isinstance(new, str):
        _refuse(loc, new)
    if not _converted_at(new, loc):
        _refuse(loc, _why_not_here(new, loc))
    raise RestartCapture([(f, new) for f in funcs])


# instructions that may sit between a truth test and its conditional jump, or after the jump
_PASS_THROUGH = ("CACHE", "EXTENDED_ARG", "NOP", "NOT_TAKEN")


def assertion_outcome(loc: SourceLoc | None) -> bool | None:
    """When the truth value being asked at ``loc`` (in the user's frame) is the test of an
    ``assert`` statement, the one with which the program goes on: one successor of the
    conditional jump that consumes it raises ``AssertionError`` (``LOAD_ASSERTION_ERROR``),
    so only the other outcome continues (``True`` for ``assert t``, ``False`` for ``assert
    not t``, each operand's for ``assert a and b``).  None for any other decision, ``assert
    a or b`` included (a False ``a`` goes on to test ``b``), and where the frame or the
    instruction cannot be found (a test made inside a library call of the line)."""
    frame = _user_frame(loc)
    if frame is None:
        return None
    ins = list(dis.get_instructions(frame.f_code))
    at = {x.offset: k for k, x in enumerate(ins)}
    k = at.get(frame.f_lasti)
    if k is None:
        return None

    def real(j: int | None) -> int | None:
        while j is not None and j < len(ins) and ins[j].opname in _PASS_THROUGH:
            j += 1
        return j if j is not None and j < len(ins) else None

    if ins[k].opname in ("TO_BOOL", "COMPARE_OP"):  # 3.13: the test, then the jump
        k = real(k + 1)
        if k is None:
            return None
    op = ins[k].opname
    if "JUMP" not in op or not ("IF_FALSE" in op or "IF_TRUE" in op):
        return None
    jumps_on = "IF_TRUE" in op  # the truth value that takes the jump
    for successor, outcome in ((real(at.get(ins[k].argval)), jumps_on),
                               (real(k + 1), not jumps_on)):
        if successor is not None and ins[successor].opname == "LOAD_ASSERTION_ERROR":
            return not outcome
    return None


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
    return loc is not None and loc.lineno in getattr(META.get(code), "lines", ())


def _why_not_here(code: types.CodeType, loc: SourceLoc | None) -> str:
    meta = META.get(code)
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
