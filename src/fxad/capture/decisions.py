"""Decisions on tensor values: taken on the real example value, guarded in the generated code.

Capture runs the program on fake tensors, which have no data.  When the program asks for a
tensor's value to take a Python decision (``if x.sum() > 0:``, ``assert (t > 0).all()``,
``t.item()``, ``int(t)``, ``t.tolist()``, ``torch.equal(a, b)``), capture computes that value
for real from the user's example inputs and the module's real parameters and buffers: it runs
the recorded graph's ancestors of the tensor (and only those) on real tensors, outside the
capture and fake modes, remembering each node's real value for later questions.  The program
goes on with the real answer (a bool, int, float, list), capture keeps computing on fake
tensors, and a guard line is added to the graph where the decision was taken::

    guard = fxad_expect('bool', (gt,), True, 'model.py:12 `if x.sum() > 0:`')

(:func:`fxad.guards.expect`): on every call the generated code asks the same question again
and raises :class:`fxad.ValueGuardError` naming the line, the question and both values when
the answer differs.  Guard nodes are side effects (``meta['fxad_side_effect']``), so the
derivative engines, the training partition, CSE and DCE keep them; on a GPU each costs one
device synchronization (reading the value), as the eager program's own ``if`` does.

Data-dependent output *sizes* (``nonzero``, ``argwhere``, ``torch.where(cond)``, ``x[mask]``,
``masked_select``, ``repeat_interleave`` with a tensor of counts) are specialized the same
way, only when the user opts in: the op is recorded in a form of static size
(``torch.nonzero_static(mask, size=k)``, ``output_size=``) after a guard on the count
(``'count_nonzero'``, ``'sum_int'``), and a size given as a one-element integer tensor
(``torch.arange(n)``) becomes its guarded value.  A selection by a mask computed from a
random draw, or any selection (``unique`` too) under ``"guard+unbacked"``, has a size of
its own instead: the build is made again on a ShapeEnv, where PyTorch gives the result an
unbacked size, which the code reads from the result on every call
(:func:`fxad.graph.sizes.read_result_sizes`).  The switch is the ``values=`` keyword of the
public entry points, entered here with :func:`value_policy`:

* ``"guard"`` (default): decisions specialized and guarded, data-dependent sizes refused;
* ``"guard+sizes"``: data-dependent sizes specialized and guarded too;
* ``"guard+unbacked"``: decisions specialized and guarded; every integer read with
  ``.tolist()`` or ``.item()`` and every selection's size read on every call, as those
  computed from a random draw always are (:func:`drawn_sizes`; ``int(t)`` is refused there,
  as Python's ``int`` must return a plain int): a routing whose counts follow the parameters
  serves every training step with one build;
* ``"refuse"``: every question about tensor data raises
  :class:`~fxad.errors.DataDependentError` naming the line.

A value computed from a random draw (dropout, ``torch.rand``) changes from call to call by
design and is never specialized: the question goes to
:func:`fxad.capture.autograph.random_decision` (a ``torch.cond`` rewrite, or a refusal).
The test of an ``assert`` statement is the exception: the program goes on only where the
assertion holds, so capture takes that path and the code checks the assertion on every call
(``fxad_expect('assert', ...)``, raising ``AssertionError`` as the program would).
Integers read from such a value (``.tolist()``, ``.item()`` of an integer tensor: the experts'
token counts of a mixture of experts after dropout) are sizes drawn anew on every call:
:func:`drawn_sizes` gives the program unbacked ``SymInt`` values read by the code on every call,
each assumption the ShapeEnv makes about them a guard line (:func:`size_assumption`); a static
build meeting them is made again on a ShapeEnv (:func:`fxad.symbolic.build_with_sizes`).
A tensor's memory *layout* read as Python values (``x.is_contiguous()``, ``x.stride()``,
``x.storage_offset()``) follows the layout of the inputs it is computed from:
:func:`fxad.capture.layouts.read_layout` answers as eager PyTorch on the example and guards
each such input's layout once (``fxad_expect('layout', (x,), 'contiguous', where)``).
Values asked inside a ``torch.cond`` / ``while_loop`` body or a custom ``autograd.Function``
are refused naming the line.

Functions of the capture session (:class:`fxad.capture.session.Session`), passed as ``cap``.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import re
import weakref
from typing import Any, Callable, Iterator

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import _disable_current_modes

from ..errors import DataDependentError, InputError, SourceLoc
from ..graph.proxy import fake_mode, user_source_loc
from ..graph.sizes import python_source
from ..guards import expect, expect_size
from ..simplify._util import draws_random

from .autograph import assertion_outcome, random_decision

__all__ = ["POLICIES", "value_policy", "current_policy", "check_policy", "note_example",
           "question_of", "has_examples", "decide", "data_dependent_size", "python_sizes",
           "UnbackedSizesNeeded", "drawn_sizes", "size_assumption"]

POLICIES = ("guard", "guard+sizes", "guard+unbacked", "refuse")
_POLICY: contextvars.ContextVar[str] = contextvars.ContextVar("fxad_values", default="guard")

# the Tensor methods / torch functions that read data, and the question a guard asks again
_QUESTION = {"__bool__": "bool", "is_nonzero": "is_nonzero", "item": "item",
             "__int__": "int", "__float__": "float", "__complex__": "complex",
             "__index__": "index", "tolist": "tolist", "__contains__": "contains",
             "equal": "torch.equal", "allclose": "torch.allclose"}
_FUNCTION_QUESTION = {torch.equal: "torch.equal", torch.allclose: "torch.allclose",
                      torch.is_nonzero: "is_nonzero"}

_COND_HINT = ("write the choice as tensor code: torch.where(pred, a, b) for a choice between "
              "values, torch.cond(pred, true_fn, false_fn, operands) for one between code paths")


def check_policy(values: Any) -> str:
    """``values`` if it is one of :data:`POLICIES`.

    Raises:
        InputError: any other value.
    """
    if values not in POLICIES:
        raise InputError(f"values={values!r}: use 'guard' (decisions on tensor values taken "
                         "on the example and checked on every call; the default), "
                         "'guard+sizes' (data-dependent sizes too), 'guard+unbacked' "
                         "(integers read from tensors are sizes read on every call) or "
                         "'refuse'")
    return values


@contextlib.contextmanager
def value_policy(values: str = "guard") -> Iterator[None]:
    """Capture inside this block treats questions about tensor data as ``values`` says
    (:data:`POLICIES`; see the module docstring).

    Raises:
        InputError: ``values`` is not one of :data:`POLICIES`.
    """
    token = _POLICY.set(check_policy(values))
    try:
        yield
    finally:
        _POLICY.reset(token)


def current_policy() -> str:
    """The policy of the capture running now (``"guard"`` outside :func:`value_policy`)."""
    return _POLICY.get()


class _Real:
    """Per capture session: the real example of each input node and the real values
    computed so far (node -> value)."""

    def __init__(self) -> None:
        self.examples: dict[fx.Node, Any] = {}
        self.memo: dict[fx.Node, Any] = {}


_STATES: "weakref.WeakKeyDictionary[Any, _Real]" = weakref.WeakKeyDictionary()


def note_example(cap: Any, node: fx.Node, example: Any) -> None:
    """Remember ``example``, the real value the program's input ``node`` stands for (a
    tensor, or a container of them).  A fake example (a build on symbolic sizes) stands for
    the real tensor it was made from, where its fake mode remembers one; otherwise the input
    has no value to decide on."""
    st = _STATES.setdefault(cap, _Real())
    leaves, spec = pytree.tree_flatten(example)
    reals = [_real_of(v) if isinstance(v, FakeTensor) else v for v in leaves]
    if not any(isinstance(v, FakeTensor) and r is None for v, r in zip(leaves, reals)):
        st.examples[node] = pytree.tree_unflatten(reals, spec)


def _real_of(fake: FakeTensor) -> torch.Tensor | None:
    """The real tensor ``fake`` was made from (``FakeTensorMode.from_tensor``), if any."""
    conv = getattr(fake.fake_mode, "fake_tensor_converter", None)
    try:  # the converter: tensor id -> fake, and real tensor -> tensor id
        ids = [k for k, f in list(conv.tensor_memo.items()) if f is fake]
        lookup = conv.meta_converter.describer.lookup_tensor
    except AttributeError:  # another torch version: no value to decide on
        return None
    for real, k in list(lookup.items()) if ids else ():
        if k == ids[0] and not isinstance(real, FakeTensor):
            return real
    return None


def has_examples(cap: Any) -> bool:
    """Whether ``cap`` runs on the user's example inputs (not a nested region's session)."""
    return cap in _STATES


def question_of(func: Any, method: str | None) -> str | None:
    """The guard question for a call that reads tensor data, or None where the value cannot
    be specialized (``numpy()``, ``data_ptr()``: refused)."""
    if method is not None:
        return _QUESTION.get(method)
    try:
        return _FUNCTION_QUESTION.get(func)
    except TypeError:  # an unhashable callable
        return None


def _where(loc: SourceLoc | None) -> str:
    if loc is None:
        return "the traced program"
    return f"{loc.short()} `{loc.code}`" if loc.code else loc.short()


class _NoValue(Exception):
    """A value that cannot be computed for real (see the message)."""


def _concrete(a: Any) -> Any:
    """Sizes of a symbolic build as the example's integers."""
    if isinstance(a, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        hint = a.node.hint
        if hint is None:
            raise _NoValue("it depends on a size with no example value")
        return hint
    if isinstance(a, (tuple, list)) and not isinstance(a, torch.Size):
        items = [_concrete(v) for v in a]
        if type(a) in (tuple, list):
            return type(a)(items)
        try:
            return type(a)(*items)
        except TypeError:
            return type(a)(items)
    if isinstance(a, torch.Size):
        return torch.Size([_concrete(v) for v in a])
    if isinstance(a, dict):
        return {k: _concrete(v) for k, v in a.items()}
    if isinstance(a, slice):
        return slice(_concrete(a.start), _concrete(a.stop), _concrete(a.step))
    return a


def _fetch(root: torch.nn.Module, path: str) -> Any:
    return functools.reduce(getattr, path.split("."), root)


def _run(cap: Any, st: _Real, n: fx.Node) -> Any:
    if n.op == "placeholder":
        if n not in st.examples:
            raise _NoValue(f"input `{n.name}` has no example value here")
        return st.examples[n]
    if n.op == "get_attr":
        obj = _fetch(cap.root, n.target)
        # buffers may be updated in place by the ops evaluated (batch norm's statistics)
        return obj.clone() if isinstance(obj, torch.Tensor) \
            and not isinstance(obj, torch.nn.Parameter) else obj
    args = _concrete(fx.node.map_arg(n.args, st.memo.__getitem__))
    kwargs = _concrete(fx.node.map_arg(n.kwargs, st.memo.__getitem__))
    if n.op == "call_method":
        self_ = args[0]
        if isinstance(self_, torch.Tensor) and n.target.endswith("_") \
                and not n.target.startswith("_"):
            self_ = self_.clone()  # an in-place update (of a buffer): on a copy
        return getattr(self_, n.target)(*args[1:], **kwargs)
    if n.op == "call_module":
        return cap.root.get_submodule(n.target)(*args, **kwargs)
    if n.op == "call_function":
        return n.target(*args, **kwargs)
    raise _NoValue(f"node `{n.name}` ({n.op}) has no value")


def _real_values(cap: Any, nodes: list[fx.Node], loc: SourceLoc | None,
                 tensor: torch.Tensor | None, sizes: bool = False) -> list[Any]:
    """The real values of ``nodes``: their ancestors in the recorded graph run on the real
    examples, parameters and buffers (values memoized per session).  A random ancestor
    hands the decision to :func:`fxad.capture.autograph.random_decision`."""
    st = _STATES.get(cap)
    if st is None:
        raise DataDependentError(
            "a Python decision on a tensor value inside a torch.cond / while_loop body, a "
            "custom autograd.Function or another nested region: fxad has no example values "
            "there to take it on", op="value of a tensor", loc=loc,
            hint="take the decision outside that region, or " + _COND_HINT)
    need: set[fx.Node] = set()
    stack = [n for n in nodes if n not in st.memo]
    while stack:
        n = stack.pop()
        if n in need or n in st.memo:
            continue
        if draws_random(n):
            _random(cap, n, loc, None if sizes else tensor)
        need.add(n)
        stack.extend(n.all_input_nodes)
    if need:
        cap.suspended += 1  # module calls and patched entry points pass straight through
        try:
            with _disable_current_modes(), torch._C.DisableTorchFunction(), torch.no_grad():
                for n in cap.graph.nodes:
                    if n in need:
                        st.memo[n] = _run(cap, st, n)
        except _NoValue as e:
            raise DataDependentError(
                f"the program asks for a tensor's value, which fxad cannot compute for real "
                f"here: {e}", op="value of a tensor", loc=loc, hint=_COND_HINT) from None
        except Exception as e:  # noqa: BLE001 - reported at the user's line
            raise DataDependentError(
                f"the program asks for a tensor's value, and computing it for real from the "
                f"example inputs failed: {type(e).__name__}: {str(e).strip()[:300]}",
                op="value of a tensor", loc=loc, hint=_COND_HINT) from e
        finally:
            cap.suspended -= 1
    return [st.memo[n] for n in nodes]


def _random(cap: Any, node: fx.Node, loc: SourceLoc | None, tensor: Any) -> None:
    """A question about a value computed from a random draw: the decision goes to
    :func:`fxad.capture.autograph.random_decision` (``tensor``: the tensor asked about), a
    size (``tensor`` None) is refused."""
    if tensor is not None:
        random_decision(cap, tensor, loc)
    op = node.target if isinstance(node.target, str) else \
        getattr(node.target, "__name__", str(node.target))
    raise DataDependentError(
        f"a data-dependent size computed from a random draw (`{node.name}`, {op}): it "
        "changes from call to call, so fxad cannot specialize the code on it",
        op="size of a random selection", loc=loc,
        hint="keep the size fixed: mask instead of selecting (torch.where(mask, x, 0) "
             "instead of x[mask])")


def _emit_guard(cap: Any, question: str, operands: tuple, taken: Any, where: str,
                options: dict | None = None) -> fx.Node:
    args = (question, operands, taken, where) + ((options,) if options else ())
    node = cap.graph.create_node("call_function", expect, args, {}, name="guard")
    node.meta["val"] = None
    node.meta["fxad_side_effect"] = True
    node.meta["fxad_guard"] = where
    cap.stamp(node)
    return node


def _real_args(cap: Any, args: Any, loc: SourceLoc | None,
               sizes: bool = False) -> tuple[Any, Any]:
    """``args`` with every tensor replaced by its real value (and the first tensor)."""
    leaves = [v for v in pytree.tree_leaves(args) if isinstance(v, torch.Tensor)]
    fakes = [v for v in leaves if isinstance(v, FakeTensor) or id(v) in cap.env]
    nodes = [cap.node_of(v) for v in fakes]
    reals = _real_values(cap, nodes, loc, leaves[0] if leaves else None, sizes)
    by_id = {id(v): r for v, r in zip(fakes, reals)}
    return pytree.tree_map(lambda v: by_id.get(id(v), v) if isinstance(v, torch.Tensor)
                           else v, args), (leaves[0] if leaves else None)


def decide(cap: Any, func: Callable, question: str, args: tuple, kwargs: dict) -> Any:
    """Answer a question about tensor data (``bool(t)``, ``t.item()``, ``torch.equal(a, b)``)
    with the real value, and record a guard that asks it again on every call.

    Returns:
        The answer eager PyTorch gives on the example inputs.

    Raises:
        DataDependentError: the value cannot be computed for real (inside a nested region,
            from a random draw, or the real computation failed), naming the user's line.
    """
    loc = user_source_loc()
    holds = _asserted_draw(cap, question, args, loc)
    if holds is not None:
        _emit_guard(cap, "assert", cap.arg(tuple(args), "Tensor.bool"), holds, _where(loc))
        return holds
    if question in _SIZE_QUESTIONS and _drawn_count(
            cap, args, kwargs, any_integer=current_policy() == "guard+unbacked"):
        return drawn_sizes(cap, question, args[0], loc)
    (rargs, rkwargs), _ = _real_args(cap, (args, kwargs), loc)
    with _disable_current_modes(), torch._C.DisableTorchFunction():
        answer = func(*rargs, **rkwargs)
    if isinstance(answer, (list, tuple)):  # (tolist) nested lists, as the guard compares
        answer = _plain(answer)
    operands = cap.arg(tuple(args), f"Tensor.{question}")
    options = cap.arg(dict(kwargs), f"Tensor.{question}") if kwargs else None
    _emit_guard(cap, question, operands, answer, _where(loc), options)
    return answer


def _asserted_draw(cap: Any, question: str, args: tuple, loc: SourceLoc | None) -> bool | None:
    """When ``bool(args[0])`` tests an ``assert`` statement on a value computed from a random
    draw (``assert not h.isnan().any()`` after dropout), the truth value with which the
    program goes on (:func:`~fxad.capture.autograph.assertion_outcome`); else None.  The
    value changes from call to call, so it cannot be taken for real at build time, but the
    program goes on only where the assertion holds: the code takes that path and checks the
    assertion on every call (guard question ``"assert"``: ``AssertionError`` naming the line
    when it fails, as the program would raise)."""
    t = args[0] if question == "bool" and len(args) == 1 else None
    if not (isinstance(t, torch.Tensor) and id(t) in cap.env and has_examples(cap)
            and _from_random(cap, t)):
        return None
    return assertion_outcome(loc)


# questions whose answer a program may use as a size (``.tolist()`` split sizes, ``.item()``)
_SIZE_QUESTIONS = ("tolist", "item", "int", "index")


class UnbackedSizesNeeded(DataDependentError):
    """A size drawn anew on every call was asked for in a build without a ShapeEnv: the
    pipeline builds again on one (:func:`fxad.symbolic.build_with_sizes`)."""


def _drawn_count(cap: Any, args: tuple, kwargs: dict, any_integer: bool = False) -> bool:
    """Whether ``args[0]`` is an integer tensor of at most one dimension (and static size)
    computed from a random draw, the kind of value a program uses as sizes (the experts'
    token counts of a mixture of experts after dropout); ``any_integer``: random or not."""
    t = args[0] if args else None
    if kwargs or len(args) != 1 or not isinstance(t, torch.Tensor) or t.dim() > 1 \
            or t.is_floating_point() or t.is_complex() or t.dtype == torch.bool \
            or not isinstance(t.numel(), int) or id(t) not in cap.env:
        return False
    if any_integer:  # (a value computed from Python numbers alone stays a number)
        return not (id(t) in cap.known and cap.known_src.get(id(t)) == frozenset())
    return _from_random(cap, t)


def _target_name(loc: SourceLoc | None, default: str) -> str:
    """The variable the user's line assigns (``expert_size = counts.tolist()``)."""
    m = re.match(r"\s*([A-Za-z_]\w*)\s*(?::[^=]*)?=(?!=)", loc.code or "") if loc else None
    return m.group(1) if m else default


def drawn_sizes(cap: Any, question: str, t: torch.Tensor, loc: SourceLoc | None) -> Any:
    """``t.tolist()`` (``t.item()``) of an integer tensor computed from a random draw: a graph
    node that reads the values on every call (named after the user's variable), and for the
    program one *unbacked* ``SymInt`` per element (``ShapeEnv.create_unbacked_symint``, as
    ``torch.export`` does), assumed ``>= 0``; every assumption the ShapeEnv records about
    them becomes a guard line (:func:`size_assumption`).

    Raises:
        DataDependentError: ``int(t)`` / ``operator.index(t)``, whose protocol must return a
            plain int.
        UnbackedSizesNeeded: a static build (no ShapeEnv), to be made again on one.
    """
    env = getattr(fake_mode(), "shape_env", None)
    if question in ("int", "index"):  # their protocol must return a plain int
        raise DataDependentError(
            f"`{question}(t)` of an integer read from tensor data on every call (it changes from"
            f" call to call): Python's {question}() must return a plain int", op=question,
            loc=loc, hint="write t.item() (or t.tolist()), which fxad reads on every call")
    if env is None:
        raise UnbackedSizesNeeded(
            "integers read from tensor data as sizes that change from call to call (computed "
            "from a random draw, or values='guard+unbacked'): fxad reads them on every call "
            "in builds of fxad.grad, vjp, jvp and compile, not in this one",
            op="size read from tensor data", loc=loc, hint="keep the sizes fixed (mask "
            "instead of selecting), or build with fxad.grad / vjp / jvp / compile")
    n = int(t.numel())
    name = _target_name(loc, "sizes")
    method = "tolist" if question == "tolist" else "item"
    node = cap.graph.create_node("call_method", method, (cap.node_of(t),), {}, name=name)
    syms = [env.create_unbacked_symint() for _ in range(n)]
    names = env.__dict__.setdefault("fxad_unbacked_names", {})
    many = method == "tolist" and t.dim() == 1
    for k, u in enumerate(syms):
        names[u.node.expr] = f"{node.name}[{k}]" if many else node.name
    node.meta.update(val=list(syms) if many else syms[0], fxad_side_effect=True,
                     fxad_unbacked=True, fxad_no_grad=True)
    cap.stamp(node)
    for u in syms:
        torch._check(u >= 0)
    return list(syms) if many else syms[0]


def size_assumption(cap: Any, expr: Any, loc: SourceLoc | None) -> None:
    """A guard line for ``expr`` (a sympy relation the ShapeEnv assumed of unbacked sizes,
    ``Eq(u0 + u1, 32)`` where a split uses them), at this place of the capture graph:
    ``fxad_expect_size('==', lhs, rhs, text, where)`` (:func:`fxad.guards.expect_size`),
    raising :class:`~fxad.InputError` naming the user's line when a call breaks it."""
    env = fake_mode().shape_env
    rel = {"Equality": "==", "Unequality": "!=", "LessThan": "<=", "StrictLessThan": "<",
           "GreaterThan": ">=", "StrictGreaterThan": ">"}.get(type(expr).__name__)
    if rel is None:
        raise DataDependentError(f"fxad cannot check the size assumption {expr} on a call",
                                 op="size assumption", loc=loc)

    def side(e: Any) -> Any:
        return int(e) if not e.free_symbols else env.create_symintnode(e, hint=None)

    names = {s: str(s) for s in expr.free_symbols}
    names.update(getattr(env, "fxad_symbol_names", {}))
    names.update(env.__dict__.get("fxad_unbacked_names", {}))
    text = python_source(expr, names)
    where = _where(loc)
    node = cap.graph.create_node("call_function", expect_size,
                                 (rel, side(expr.lhs), side(expr.rhs), text, where), {},
                                 name="size_guard")
    node.meta.update(val=None, fxad_side_effect=True, fxad_guard=where)
    cap.stamp(node)


def _plain(v: Any) -> Any:
    return [_plain(x) for x in v] if isinstance(v, (list, tuple)) else v


def data_dependent_size(cap: Any, func: Callable, method: str | None, args: tuple,
                        kwargs: dict, what: str, error: Exception) -> Any:
    """The result of an op whose output size depends on tensor data (``nonzero``,
    ``x[mask]``), recorded in a form of static size (``torch.nonzero_static`` with the
    example's count, ``repeat_interleave(..., output_size=)``) after a guard on that count,
    when the policy is ``"guard+sizes"``.

    Raises:
        DataDependentError: under another policy (naming the opt-in), for an op without a
            static-size form, or when the value cannot be computed for real.
    """
    loc = user_source_loc()
    mask_hint = "use masking (torch.where(mask, x, 0)) instead of selecting (x[mask])"
    name = method or getattr(func, "__name__", "")
    masks = _selection_masks(name, args, kwargs)
    if masks and (current_policy() == "guard+unbacked"
                  or any(_from_random(cap, m) for m in masks)):
        raise UnbackedSizesNeeded(  # the build is made again on a ShapeEnv: a size of its own
            f"{what}: an output size read on every call (computed from a random draw, or "
            "values='guard+unbacked'), in builds of fxad.grad, vjp, jvp and compile only",
            op=what, loc=loc, hint=f"{mask_hint}, or build with fxad.grad / vjp / jvp / "
                                   "compile") from error
    if current_policy() != "guard+sizes":
        _refuse_size(what, loc, error)
    if name in ("nonzero", "argwhere") or name == "where" and len(args) == 1 and not kwargs:
        idx = _static_nonzero(cap, args[0], loc, what)
        if name == "where" or kwargs.get("as_tuple", False):
            return tuple(cap.handle(torch.Tensor.unbind, (idx, 1), {}))
        return idx
    if name == "__getitem__" and len(args) == 2:
        items = args[1] if isinstance(args[1], tuple) else (args[1],)
        if any(_is_mask(v) for v in items):
            new: list[Any] = []
            for v in items:
                if _is_mask(v):
                    idx = _static_nonzero(cap, v, loc, what)
                    new.extend(cap.handle(torch.Tensor.unbind, (idx, 1), {}))
                else:
                    new.append(v)
            return cap.handle(torch.Tensor.__getitem__, (args[0], tuple(new)), {})
    if name == "masked_select" and len(args) + len(kwargs) == 2:
        x, mask = args[0], args[1] if len(args) > 1 else kwargs["mask"]
        # each broadcast on its own: the mask's count must not depend on x's values
        shape = torch.broadcast_shapes(x.shape, mask.shape)
        xb = x if x.shape == shape else cap.handle(torch.Tensor.expand, (x, shape), {})
        mb = mask if mask.shape == shape else cap.handle(torch.Tensor.expand, (mask, shape), {})
        return cap.handle(torch.Tensor.__getitem__, (xb, mb), {})
    if name == "repeat_interleave" and "output_size" not in kwargs:
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
        if isinstance(repeats, torch.Tensor):
            (real,), _ = _real_args(cap, (repeats,), loc, sizes=True)
            total = _outside(lambda: int(real.sum()))
            _emit_guard(cap, "sum_int", cap.arg((repeats,), what), total, _where(loc))
            if real.numel() == 1:  # one count for every element
                dim = args[2] if len(args) > 2 else kwargs.get("dim")
                x = args[0]
                total *= x.numel() if dim is None else x.shape[dim]
            return cap.handle(func, args, {**kwargs, "output_size": total})
    # a size given as a one-element integer tensor (torch.arange(n_tensor)): its value
    def scalar(v: Any) -> bool:
        return isinstance(v, torch.Tensor) and v.numel() == 1 and not (
            v.is_floating_point() or v.is_complex() or v.dtype == torch.bool)

    first = 1 if method is not None else 0  # a method's own tensor is its data
    if any(scalar(v) for v in pytree.tree_leaves((args[first:], kwargs))):
        def number(v: Any) -> Any:
            return decide(cap, torch.Tensor.item, "item", (v,), {}) if scalar(v) else v

        return cap.handle(func, tuple(args[:first]) + pytree.tree_map(number, args[first:]),
                          pytree.tree_map(number, kwargs))
    raise DataDependentError(
        f"{what} cannot be traced on the example shapes: its output size depends on tensor "
        "data, and values='guard+sizes' specializes only nonzero, argwhere, "
        "torch.where(cond), boolean-mask indexing, masked_select, repeat_interleave and "
        "sizes given as one-element integer tensors",
        op=what, loc=loc, hint=f"{mask_hint}, or compute this outside the traced function "
                               "and pass it in as an input") from error


def _refuse_size(what: str, loc: SourceLoc | None, error: Exception | None) -> None:
    raise DataDependentError(
        f"{what} cannot be traced on the example shapes: its output size depends on tensor "
        "data", op=what, loc=loc,
        hint="use masking (torch.where(mask, x, 0)) instead of selecting (x[mask]); or build "
             "with values='guard+sizes' to specialize the code on the example's size, checked "
             "on every call, or values='guard+unbacked' to read it on every call") from error


def _selection_masks(name: str, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors whose values decide the output size of a selection (``nonzero``,
    ``argwhere``, ``torch.where(cond)``, ``x[mask]``, ``masked_select``, ``unique``), or []."""
    if name in ("nonzero", "argwhere", "unique", "unique_consecutive") \
            or name == "where" and len(args) == 1 and not kwargs:
        return [args[0]] if args and isinstance(args[0], torch.Tensor) else []
    if name == "__getitem__" and len(args) == 2:
        return [v for v in (args[1] if isinstance(args[1], tuple) else (args[1],))
                if _is_mask(v)]
    mask = (args[1] if len(args) > 1 else kwargs.get("mask")) if name == "masked_select" else 0
    return [mask] if isinstance(mask, torch.Tensor) else []


def _from_random(cap: Any, t: torch.Tensor) -> bool:
    """Whether the recorded graph computes ``t`` from a random draw."""
    seen: set[fx.Node] = set()
    stack = [cap.node_of(t)] if id(t) in cap.env else []
    while stack:
        n = stack.pop()
        if n not in seen and draws_random(n):
            return True
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return False


def _outside(fn: Callable[[], Any]) -> Any:
    """``fn()`` on real tensors, outside capture's modes."""
    with _disable_current_modes(), torch._C.DisableTorchFunction():
        return fn()


def _is_mask(v: Any) -> bool:
    return isinstance(v, torch.Tensor) and v.dtype in (torch.bool, torch.uint8) \
        and v.dim() > 0


def _static_nonzero(cap: Any, mask: torch.Tensor, loc: SourceLoc | None, what: str) -> Any:
    """``torch.nonzero_static(mask, size=k)`` for the example's count ``k`` of nonzero
    elements, after a guard on that count."""
    (real,), _ = _real_args(cap, (mask,), loc, sizes=True)
    count = _outside(lambda: int(torch.count_nonzero(real)))
    _emit_guard(cap, "count_nonzero", cap.arg((mask,), what), count, _where(loc))
    return cap.handle(torch.nonzero_static, (mask,), {"size": count})


# ops whose top-level arguments after the first are sizes (``x.view(n, -1)``, ``torch.arange(n)``)
_SIZE_ARGS = {"view", "reshape", "expand", "repeat", "tile", "new_zeros", "new_ones",
              "new_empty", "zeros", "ones", "empty", "arange", "narrow", "rand", "randn"}


def python_sizes(cap: Any, func: Any, method: str | None, args: tuple,
                 kwargs: dict) -> tuple[tuple, dict]:
    """``args`` and ``kwargs`` with each 0-d integer tensor used as a size (inside a tuple or
    list argument, or a size argument of :data:`_SIZE_ARGS`) replaced by its value, where
    that value comes from Python numbers alone (``torch.div(seq_len, w, rounding_mode=
    "trunc")`` of transformers' Longformer): the same on every call, so the node records
    the number, as derivative rules of sizes need.

    Raises:
        DataDependentError: on a ShapeEnv (where PyTorch gives a selection a size of its
            own), a selection the policy does not open (as :func:`data_dependent_size`).
    """
    if current_policy() in ("guard", "refuse") \
            and getattr(fake_mode(), "shape_env", None) is not None:
        name = method or getattr(func, "__name__", "")
        masks = _selection_masks(name, args, kwargs)
        if masks and not any(_from_random(cap, m) for m in masks) \
                and not all(id(m) in cap.known for m in masks):  # (known: constants)
            _refuse_size(f"Tensor.{name}" if method else f"torch.{name}", user_source_loc(),
                         None)
    if not cap.known:
        return args, kwargs

    def number(v: Any) -> Any:
        if isinstance(v, torch.Tensor) and v.dim() == 0 and not (
                v.is_floating_point() or v.is_complex() or v.dtype == torch.bool) \
                and id(v) in cap.known and cap.known_src.get(id(v)) == frozenset():
            return _outside(lambda: int(cap.known[id(v)]))
        return v

    def walk(a: Any) -> Any:
        if type(a) in (tuple, list):
            return type(a)(number(v) if isinstance(v, torch.Tensor) else walk(v) for v in a)
        return a

    name = method or getattr(func, "__name__", "")
    start = 1 if method is not None else 0
    new = tuple(number(a) if k >= start and name in _SIZE_ARGS else walk(a)
                for k, a in enumerate(args))
    return new, {k: walk(v) for k, v in kwargs.items()}
