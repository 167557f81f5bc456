"""Guards: what a generated module specialized on, checked on every call.

fxad traces a program once, on example inputs, and the generated code is specialized on
what the trace saw: every tensor input's shape, dtype and device, every Python value passed
as an argument (a flag, a size, a string), and, through them, the branch a Python ``if``
took and the length of a Python loop over ``x.shape[0]``.  Called with inputs that differ,
the code would compute something else without a word, so every module fxad returns records
an :class:`InputSpec` and checks it before running (:meth:`InputSpec.check`, a few attribute
comparisons per argument), raising :class:`fxad.InputError` that names the argument, the
traced and the given value, and how to rebuild.

Dimensions built on symbolic sizes (``dynamic=True`` / ``dynamic_shapes=``,
:mod:`fxad.symbolic`) are left out of the shape check; the guard then checks what stayed
static, that dimensions sharing a size symbol still agree (``idx.size(0) == tgt.size(0)``),
and every relation the program or the derivative code assumed of the sizes (``T <= 64``),
naming the user's line that imposed it.

Decisions on tensor *values* (``if x.sum() > 0``, ``assert (t > 0).all()``, ``t.item()``,
``torch.equal(a, b)``, ``t.tolist()``; :mod:`fxad.capture.decisions`) are taken at build time
on the real example value, and the generated code re-checks each of them where the program
took it, with a guard line ``fxad_expect(question, operands, taken, where)`` (:func:`expect`)
that raises :class:`fxad.ValueGuardError` (an :class:`fxad.InputError`) when the value comes
out differently.  Each such line reads the tensor's value: one device synchronization per
guard when the program runs on a GPU.
Decisions on a tensor's memory layout (``x.is_contiguous()``, ``x.stride()``) are guarded
on the layout of each input the tensor is computed from (question ``"layout"``,
:func:`layout_of`: metadata only, no synchronization).

A module captured from an ``nn.Module`` also bakes in each submodule's training flag
(dropout, batch-norm statistics): :func:`install_mode_check` warns with a
:class:`ModeWarning` when it is called after the flags changed.
"""
from __future__ import annotations

import operator
import os
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch._prims_common import make_contiguous_strides_for
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils import _pytree as pytree

from .errors import InputError, ValueGuardError
from .graph.sizes import expr_of, is_symbolic
from .naming import code_builtin

__all__ = ["expect_size", "InputSpec", "spec_of", "ModeWarning", "install_mode_check", "expect",
           "layout_of", "describe_layout"]


@dataclass(frozen=True)
class _TensorSlot:
    shape: tuple          # sizes; None where the dimension is dynamic
    dtype: torch.dtype
    device: torch.device


@dataclass
class InputSpec:
    """The arguments a generated module was built for.

    Attributes:
        names: argument names, in call order.
        trees: per argument, its pytree structure.
        leaves: per argument, per leaf: a :class:`_TensorSlot` for a tensor, ``("value", v)``
            for a Python value the trace specialized on, or ``None`` for an argument that is
            not checked (cotangents of non-floating outputs take ``None``).
        symbols: symbolic sizes: name -> list of ``(argument, leaf, dim)`` sharing it (leaf
            -1 for a plain tensor argument).
        rebuild: how to rebuild, for the error message (``fxad.grad(f, *inputs)``).
        predicates: relations of the symbolic sizes checked on every call:
            ``(fn(*sizes) -> bool, [(argument, leaf, dim)], text)``.
        sym_dims: ``(argument, leaf, dim) -> sympy expression`` of each symbolic dimension of
            the examples (filled by :func:`spec_of`, read by :mod:`fxad.symbolic`).
    """

    names: list[str]
    trees: list[Any]
    leaves: list[list[Any]]
    symbols: dict[str, list[tuple[int, int, int]]] = field(default_factory=dict)
    rebuild: str = "rebuild it with the new inputs"
    predicates: list[tuple[Any, list[tuple[int, int, int]], str]] = field(default_factory=list)
    sym_dims: dict[tuple[int, int, int], Any] = field(default_factory=dict)
    symbol_dims: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    values_at: list[int] = field(default_factory=list)
    # integer tensor inputs whose *values* the trace read (the lengths of a packed sequence):
    # argument position -> value; and constant tensors it read: (the tensor, its value then)
    values: dict[int, torch.Tensor] = field(default_factory=dict)
    # arguments before this position are the program's inputs: ``None`` for a tensor is an
    # error there (it would take another branch), not a zero cotangent
    strict_inputs: int = 0
    constants: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)

    def check(self, args: Sequence[Any]) -> None:
        """Raise :class:`fxad.InputError` unless ``args`` match what was traced."""
        if len(args) != len(self.names):
            raise InputError(f"this module takes {len(self.names)} argument(s) "
                             f"({', '.join(self.names)}), got {len(args)}")
        for i, (a, tree, slots) in enumerate(zip(args, self.trees, self.leaves)):
            if len(slots) == 1 and tree is None:  # a plain argument: no pytree work
                self._check_leaf(i, -1, a, slots[0])
                continue
            leaves, spec = pytree.tree_flatten(_plain(a))
            if spec != tree:
                raise InputError(
                    f"argument `{self.names[i]}` does not have the structure it was traced "
                    f"with ({tree} expected, got {spec}); {self.rebuild}")
            for j, (v, slot) in enumerate(zip(leaves, slots)):
                self._check_leaf(i, j, v, slot)
        if self.symbols or self.predicates:
            self._check_symbols(args)
        for i, want in self.values.items():
            got = args[i]
            if not isinstance(got, torch.Tensor) or got.shape != want.shape \
                    or not torch.equal(got.cpu(), want):
                raise InputError(
                    f"argument `{self.names[i]}` has values {_short(got)}, but this module was "
                    f"traced with {_short(want)}: the program used them as sizes or in Python "
                    f"control flow, which fxad specializes on; {self.rebuild}")
        for obj, want in self.constants:
            if obj.shape != want.shape or not torch.equal(obj.cpu(), want):
                raise InputError(
                    f"a constant tensor the program read while traced changed (it was "
                    f"{_short(want)}, now {_short(obj)}); the code was specialized on its "
                    f"values; {self.rebuild}")
    def admits(self, args: Sequence[Any]) -> str | None:
        """Why the leading arguments ``args`` (the model's inputs, without the cotangent) do
        not match this spec, or None when they do."""
        n = len(args)
        try:
            for i, (a, tree, slots) in enumerate(zip(args, self.trees[:n], self.leaves[:n])):
                if len(slots) == 1 and tree is None:
                    self._check_leaf(i, -1, a, slots[0])
                    continue
                leaves, spec = pytree.tree_flatten(_plain(a))
                if spec != tree:
                    return f"argument `{self.names[i]}` has another structure"
                for j, (v, slot) in enumerate(zip(leaves, slots)):
                    self._check_leaf(i, j, v, slot)
            if self.symbols or self.predicates:
                self._check_symbols(args, limit=n)
        except InputError as e:
            return str(e)
        return None

    def _where(self, i: int, j: int) -> str:
        name = f"`{self.names[i]}`"
        return name if j < 0 else f"{name} (leaf {j})"

    def _check_leaf(self, i: int, j: int, v: Any, slot: Any) -> None:
        if slot is None:
            return
        if isinstance(slot, _TensorSlot):
            if not isinstance(v, torch.Tensor):
                if v is None and i >= self.strict_inputs:
                    return  # a zero cotangent / tangent, where the module allows it
                raise InputError(f"argument {self._where(i, j)} must be a tensor (it was "
                                 f"traced with one), got {type(v).__name__}")
            shape = v.shape
            if len(shape) != len(slot.shape) or any(
                    s is not None and s != g for s, g in zip(slot.shape, shape)):
                want = "(" + ", ".join("*" if s is None else str(s) for s in slot.shape) + \
                    ("," if len(slot.shape) == 1 else "") + ")"
                raise InputError(
                    f"argument {self._where(i, j)} has shape {tuple(shape)}, but this module "
                    f"was traced for shape {want} (fxad specializes on input shapes); "
                    f"{self.rebuild}, or build with dynamic=True (or dynamic_shapes=) so "
                    "that sizes may vary")
            if v.dtype != slot.dtype:
                raise InputError(f"argument {self._where(i, j)} has dtype {v.dtype}, but this "
                                 f"module was traced for {slot.dtype}; {self.rebuild}")
            if v.device != slot.device:
                raise InputError(f"argument {self._where(i, j)} is on {v.device}, but this "
                                 f"module was traced for {slot.device}; {self.rebuild}")
            return
        _, want = slot
        if isinstance(want, torch.Generator) and isinstance(v, torch.Generator) \
                and v.device == want.device:
            return  # a generator the code draws from (fxad.capture.effects): any one
        if isinstance(v, torch.Tensor) or type(v) is not type(want) or v != want:
            raise InputError(
                f"argument {self._where(i, j)} is {v!r}, but this module was traced with "
                f"{want!r}: fxad specializes on Python values (the branches and loops "
                f"that depend on them are fixed in the code); {self.rebuild}")

    def _dim(self, key: tuple[int, int, int]) -> str:
        i, j, d = key
        return f"`{self.names[i]}`.size({d})" if j < 0 else \
            f"`{self.names[i]}` (leaf {j}).size({d})"

    def _check_symbols(self, args: Sequence[Any], limit: int | None = None) -> None:
        flat = [pytree.tree_leaves(_plain(a)) if self.trees[i] is not None else [a]
                for i, a in enumerate(args)]
        if limit is not None:  # only the first ``limit`` arguments are given
            symbols = {s: [m for m in ms if m[0] < limit] for s, ms in self.symbols.items()}
            symbols = {s: ms for s, ms in symbols.items() if ms}
            predicates = [p for p in self.predicates if all(k[0] < limit for k in p[1])]
        else:
            symbols, predicates = self.symbols, self.predicates

        def size(key: tuple[int, int, int]) -> int:
            i, j, d = key
            return flat[i][max(j, 0)].shape[d]

        for sym, members in symbols.items():
            first = size(members[0])
            for m in members[1:]:
                s = size(m)
                if s != first:
                    raise InputError(
                        f"{self._dim(m)} is {s}, but {self._dim(members[0])} is {first}: the "
                        f"program ties them together (both are the size {sym}) and they must "
                        f"agree")
        for fn, dims, text in predicates:
            sizes = [size(k) for k in dims]
            if not fn(*sizes):
                given = ", ".join(f"{self._dim(k)} = {s}" for k, s in zip(dims, sizes))
                raise InputError(
                    f"the input sizes break an assumption of the generated code: {text} does "
                    f"not hold for {given}; {self.rebuild}")

    def fix_dim(self, key: tuple[int, int, int], size: int) -> None:
        """Make dimension ``key`` static with ``size`` (the program fixed it)."""
        i, j, d = key
        slots = self.leaves[i]
        slot = slots[max(j, 0)]
        shape = list(slot.shape)
        shape[d] = size
        slots[max(j, 0)] = _TensorSlot(tuple(shape), slot.dtype, slot.device)


def _short(t: Any) -> str:
    if not isinstance(t, torch.Tensor):
        return repr(t)
    vals = t.flatten().tolist()
    return str(vals[:8])[:-1] + (", ...]" if len(vals) > 8 else "]")


def _plain(x: Any) -> Any:
    """Named tuples and ``torch.return_types`` as plain tuples: a cotangent for
    ``torch.sort``'s ``(values, indices)`` may be either."""
    if isinstance(x, tuple):
        return tuple(_plain(v) for v in x)
    if isinstance(x, list):
        return [_plain(v) for v in x]
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    return x


def spec_of(names: Sequence[str], examples: Sequence[Any], *, rebuild: str,
            unchecked: Sequence[int] = (), values: Sequence[int] = (),
            constants: Sequence[tuple[torch.Tensor, torch.Tensor]] = ()) -> InputSpec:
    """The :class:`InputSpec` of ``examples`` (one per argument in ``names``).

    Args:
        unchecked: positions whose leaves are not value-checked (Python values fxad does not
            specialize on, such as ``None`` slots of a cotangent).

    A dimension whose example size is a ``SymInt`` (a symbolic build) is left out of the
    shape check and recorded in ``sym_dims``; :mod:`fxad.symbolic` turns those into symbol
    and relation checks.
    """
    trees, leaves = [], []
    sym_dims: dict[tuple[int, int, int], Any] = {}
    for i, ex in enumerate(examples):
        plain = not isinstance(ex, (tuple, list, dict))
        ex = ex if plain else _plain(ex)
        flat = [ex] if plain else pytree.tree_flatten(ex)[0]
        trees.append(None if plain else pytree.tree_flatten(ex)[1])
        slots = []
        for j, v in enumerate(flat):
            jj = -1 if plain else j
            if isinstance(v, torch.Tensor):
                shape = []
                for d, s in enumerate(v.shape):
                    if is_symbolic(s):
                        sym_dims[(i, jj, d)] = expr_of(s)
                        shape.append(None)
                    else:
                        shape.append(int(s))
                slots.append(_TensorSlot(tuple(shape), v.dtype, v.device))
            elif i in unchecked or v is None:
                slots.append(None)
            else:
                slots.append(("value", v))
        leaves.append(slots)
    spec = InputSpec(list(names), trees, leaves, rebuild=rebuild, sym_dims=sym_dims)
    spec.values_at = list(values)
    spec.values = {i: examples[i].detach().cpu().clone() for i in values
                   if isinstance(examples[i], torch.Tensor)
                   and not isinstance(examples[i], FakeTensor)}
    spec.constants = list(constants)
    return spec


class ModeWarning(UserWarning):
    """A graph captured in training (eval) mode was called while the module is in eval
    (training) mode: flags such as dropout and batch-norm statistics were baked in."""


_LIBRARY_DIRS = (os.path.dirname(torch.__file__) + os.sep,
                 os.path.dirname(os.path.abspath(__file__)) + os.sep)


def caller_stacklevel() -> int:
    """The ``stacklevel`` that makes a warning raised by the calling function point at the
    user's line: past the frames of torch (a forward pre-hook's caller) and of fxad."""
    frame, level = sys._getframe(2), 2
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(
            _LIBRARY_DIRS):
        frame, level = frame.f_back, level + 1
    return level


def install_mode_check(gm: Any, mod: torch.nn.Module) -> None:
    """Record ``mod``'s training flags in ``gm.meta['fxad_training_flags']`` (``gm``: a
    generated GraphModule) and warn (a :class:`ModeWarning`) on every call of ``gm`` made
    after they changed."""
    captured = {n: m.training for n, m in mod.named_modules()}
    gm.meta["fxad_training_flags"] = captured

    pairs = [(m, m.training) for _, m in mod.named_modules()]

    def hook(_gm: Any, _args: Any) -> None:
        if all(m.training is flag for m, flag in pairs):  # cheap per-call check
            return
        now = {n: m.training for n, m in mod.named_modules()}
        if now != captured:
            diff = next(n for n in captured if now.get(n) != captured[n])
            mode = "training" if captured[diff] else "eval"
            warnings.warn(
                f"this fxad graph was captured with {type(mod).__name__}"
                f"{'.' + diff if diff else ''} in {mode} mode, but the module is now in "
                f"{'eval' if mode == 'training' else 'training'} mode; dropout and "
                "batch-norm behaviour are baked in at capture: capture again after "
                "switching modes", ModeWarning, stacklevel=caller_stacklevel())

    gm.register_forward_pre_hook(hook)


# -- guards on decisions taken on tensor values --------------------------------------------
# question -> how the generated code asks it again (the operands are the tensors, then any
# Python arguments of the question)
QUESTIONS: dict[str, Any] = {
    "bool": torch.Tensor.__bool__, "item": torch.Tensor.item, "int": torch.Tensor.__int__,
    "float": torch.Tensor.__float__, "complex": torch.Tensor.__complex__,
    "index": torch.Tensor.__index__, "tolist": torch.Tensor.tolist,
    "contains": torch.Tensor.__contains__, "is_nonzero": torch.is_nonzero,
    "torch.equal": torch.equal, "torch.allclose": torch.allclose,
    "count_nonzero": lambda t: int(torch.count_nonzero(t)),
    "sum_int": lambda t: int(t.sum()),
    "layout": lambda t: layout_of(t),
    "assert": torch.Tensor.__bool__,
}


def describe_layout(shape: Sequence[int], stride: Sequence[int], offset: int) -> Any:
    """The memory layout a guard compares: ``"contiguous"`` for row-major strides
    (``torch._prims_common.make_contiguous_strides_for(shape)``, size-1 dimensions included)
    and storage offset 0, else ``(stride, storage_offset)`` as plain tuples of ints."""
    stride = tuple(int(v) for v in stride)
    if int(offset) == 0 and stride == tuple(
            int(v) for v in make_contiguous_strides_for(tuple(int(d) for d in shape))):
        return "contiguous"
    return stride, int(offset)


def layout_of(t: torch.Tensor) -> Any:
    """:func:`describe_layout` of ``t`` (a strided tensor of any shape and dtype): the
    answer the guard question ``"layout"`` compares with the build-time one.  Equal layouts
    (with the shape and dtype the input spec checks) give a program the same answers to every
    question about layout (``is_contiguous()``, ``stride()``, ``storage_offset()``), for the
    input and for every tensor computed from it."""
    return describe_layout(t.shape, t.stride(), t.storage_offset())


def _same(a: Any, b: Any) -> bool:
    """Exact equality, NaN equal to NaN, element by element in lists and tuples."""
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return True
    if isinstance(a, complex) and isinstance(b, complex):
        return _same(a.real, b.real) and _same(a.imag, b.imag)
    return type(a) is type(b) and a == b or (isinstance(a, (int, float)) and not
                                              isinstance(a, bool) and not isinstance(b, bool)
                                              and isinstance(b, (int, float)) and a == b)


def _abstract(operands: Sequence[Any]) -> bool:
    """Operands without data (fake or meta tensors: a pass computing shapes runs the node),
    or graph proxies: nothing to check."""
    return any(isinstance(o, (FakeTensor, torch.fx.Proxy)) or
               isinstance(o, torch.Tensor) and o.device.type == "meta" for o in operands)


def _brief(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 80 else text[:77] + "..."


def expect(question: str, operands: tuple, taken: Any, where: str,
           options: dict | None = None) -> None:
    """Guard line of generated code: ask ``question`` of ``operands`` again and raise
    :class:`fxad.ValueGuardError` unless the answer equals ``taken``, the value the program
    decided on at build time (floats compared exactly).

    Args:
        question: a key of :data:`QUESTIONS` (``"bool"`` for ``if t:``, ``"item"``,
            ``"torch.equal"``, ``"count_nonzero"`` for a data-dependent output size...).
        operands: the tensors asked about (and Python arguments of the question).
        taken: the build-time answer (bool, int, float, complex, nested list, tuple).
        where: the user's line and statement (``"model.py:12 if x.sum() > 0:"``).
        options: keyword arguments of the question (``rtol=`` of ``torch.allclose``).

    Raises:
        ValueGuardError: the answer differs; the message names ``where``, the question and
            both values.
        AssertionError: question ``"assert"`` (an ``assert`` statement on a value computed
            from a random draw) and the assertion fails for this call, as the program
            would raise; no other build could serve it.
    """
    if _abstract(operands):
        return
    now = QUESTIONS[question](*operands, **(options or {}))
    if _same(now, taken):
        return
    if question == "assert":  # an assert on a random draw: what the program raises
        raise AssertionError(f"{where}: the assertion does not hold for this call (fxad "
                             "checks an assertion on a value drawn anew on every call each "
                             "time the code runs)")
    if question == "layout":
        raise ValueGuardError(
            f"{where}: the program reads the memory layout of a tensor computed from this "
            f"input, and the code was built for an input laid out {_layout_text(taken)}, but "
            f"for these inputs it is laid out {_layout_text(now)} (fxad takes Python decisions "
            "on memory layouts at build time and checks them on every call)", where=where,
            taken=taken, now=now,
            hint="rebuild for these inputs (fxad.compile does so by itself), or pass inputs "
                 "laid out like the example inputs (.contiguous())")
    asked = f"{question}(...)"
    raise ValueGuardError(
        f"{where}: the code was built for {asked} = {_brief(taken)}, but for these inputs it "
        f"is {_brief(now)} (fxad takes Python decisions on tensor values at build time and "
        "checks them on every call)", where=where, taken=taken, now=now,
        hint="rebuild for these inputs (fxad.compile does so by itself); to serve both "
             "values with one build, write the choice as tensor code (torch.where(pred, a, "
             "b), or torch.cond for two code paths), or pass the value as an argument")


def _layout_text(layout: Any) -> str:
    if layout == "contiguous":
        return "contiguously (row-major strides, storage offset 0)"
    return f"with strides {layout[0]} and storage offset {layout[1]}"


_RELATIONS = {"==": operator.eq, "!=": operator.ne, "<=": operator.le, "<": operator.lt,
              ">=": operator.ge, ">": operator.gt}


def expect_size(relation: str, lhs: int, rhs: int, text: str, where: str) -> None:
    """Guard line of generated code for an assumption about sizes read from tensor data on
    every call (a split's sizes drawn anew each call summing to the split dimension):
    ``lhs relation rhs`` must hold.

    Args:
        relation: ``"=="``, ``"!="``, ``"<="``, ``"<"``, ``">="`` or ``">"``.
        lhs, rhs: the two sides, computed by the generated code on this call.
        text: the assumption in the program's names (``expert_size[0] + ... == 32``).
        where: the user's line that made it (``"model.py:12 `x.split(sizes)`"``).

    Raises:
        InputError: the assumption fails on this call; the message names ``where``.
    """
    if _RELATIONS[relation](lhs, rhs):
        return
    raise InputError(
        f"{where}: the code assumes {text}, which fails on this call ({lhs} {relation} "
        f"{rhs} is false)", hint="these sizes are read from tensor data on every call; the "
                                 "program's eager run fails on them too")


code_builtin("fxad_expect", expect)
code_builtin("fxad_expect_size", expect_size)
