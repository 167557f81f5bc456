"""The state of a program being generated (:class:`_State`): its inputs and statements so
far, the values they computed (run eagerly as each statement is added), and the helpers the
op families draw operands with (:mod:`fxad.tools.fuzz.generator`)."""
from __future__ import annotations

import math
import random
import warnings
from typing import Any, Callable

import torch

from .program import Input, Program, Stmt, namespace

MAX_NUMEL = 256
MAX_ABS = 1e4


class _Reject(Exception):
    pass


def _broadcast(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...] | None:
    """``torch.broadcast_shapes(a, b)``, or None where they do not broadcast."""
    out = []
    for k in range(1, max(len(a), len(b)) + 1):
        x = a[-k] if k <= len(a) else 1
        y = b[-k] if k <= len(b) else 1
        if x != y and x != 1 and y != 1:
            return None
        out.append(y if x == 1 else x)
    return tuple(reversed(out))


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _lit(values: Any) -> str:
    return f"torch.tensor({values!r})"


class _State:
    """A program being generated: the random stream, the inputs and statements so far, and
    the namespace holding the values they computed."""

    def __init__(self, seed: int, index: int, attempt: int,
                 focus: tuple[str, ...] = ()) -> None:
        key = f"fxad-fuzz:{seed}:{index}:{attempt}" + (f":{','.join(focus)}" if focus else "")
        self.r = random.Random(key)
        self.focus = focus
        self.tag = f"seed{seed}-{index}"
        self.input_seed = (seed * 1_000_003 + index * 7919 + attempt) % (2 ** 31)
        self.inputs: list[Input] = []
        self.stmts: list[Stmt] = []
        self.order: list[str] = []
        self.ns: dict[str, Any] = namespace()
        self.n_vars = 0
        self.used: set[str] = set()

    # ----------------------------------------------------------------------------- helpers
    def t(self, name: str) -> torch.Tensor:
        return self.ns[name]

    def shp(self, name: str) -> tuple[int, ...]:
        return tuple(self.ns[name].shape)

    def kind(self, name: str) -> str:
        t = self.ns[name]
        if t.dtype == torch.bool:
            return "b"
        return "f" if t.is_floating_point() else "i"

    def new(self) -> str:
        name = f"v{self.n_vars}"
        self.n_vars += 1
        return name

    def choice(self, seq: list | tuple) -> Any:
        return seq[self.r.randrange(len(seq))]

    def pick(self, kinds: str = "f", pred: Callable[[str], bool] | None = None) -> str | None:
        """A variable of one of ``kinds`` satisfying ``pred``; recent ones preferred."""
        cands = [n for n in self.order if self.kind(n) in kinds and (pred is None or pred(n))]
        if not cands:
            return None
        c = self.r.random()
        if c < 0.45:  # an unused value (keeps the program connected)
            fresh = [n for n in cands if n not in self.used]
            if fresh:
                return self.choice(fresh)
        if c < 0.75:
            return self.choice(cands[-3:])
        return self.choice(cands)

    def dim(self, nd: int, *, neg: bool = True) -> int:
        d = self.r.randrange(nd)
        return d - nd if neg and self.r.random() < 0.3 else d

    def is_input_alias(self, name: str) -> bool:
        if name.startswith(("x", "n")):
            return True
        key = _storage(self.t(name))
        return any(_storage(self.t(i.name)) == key for i in self.inputs)

    def aliases(self, name: str) -> list[str]:
        key = _storage(self.t(name))
        return [n for n in self.order if n != name and _storage(self.t(n)) == key]

    def broadcastable(self, a: str, b: str, *, onto: bool = False) -> bool:
        s = _broadcast(self.shp(a), self.shp(b))
        if s is None:
            return False
        if onto:  # b broadcasts onto a without changing a's shape
            return tuple(s) == self.shp(a)
        return math.prod(s) <= MAX_NUMEL

    def scalar(self) -> str:
        return self.choice(["2", "3", "0.5", "-1.5", "2.5", "0.25", "-2", "1"])

    # numerically tame operands --------------------------------------------------------------
    def positive(self, a: str) -> str:
        """An expression of ``a`` with values >= ~0.1."""
        t = self.t(a)
        if t.numel() and t.min() > 0.2 and self.r.random() < 0.6:
            return a
        forms = [f"({a}.abs() + 0.5)", f"({a} * {a} + 0.1)", f"torch.sigmoid({a})",
                 f"(1.5 + {a}.tanh())", f"F.softplus({a})"]
        if t.numel() and t.abs().max() < 3:
            forms.append(f"{a}.exp()")
        return self.choice(forms)

    def denominator(self, b: str) -> str:
        t = self.t(b)
        if t.numel() and t.abs().min() > 0.3 and self.r.random() < 0.7:
            return b
        return self.choice([f"({b}.abs() + 1)", f"({b} * {b} + 0.5)", f"(2 + {b}.sin())",
                            f"torch.exp({b}.tanh())"])

    def bounded(self, a: str, bound: float = 3.0) -> str:
        t = self.t(a)
        if t.numel() and t.abs().max() < bound and self.r.random() < 0.7:
            return a
        return self.choice([f"{a}.tanh()", f"torch.sin({a})", f"torch.sigmoid({a})"])

    def index_tensor(self, n: int, *, length: int | None = None, unique: bool = False,
                     negative: bool = False) -> str:
        """A 1-D integer tensor expression with values in ``[0, n)`` (or ``[-n, n)``)."""
        m = length or self.r.randint(1, min(n, 4) if unique else 4)
        forms = ["lit"]
        if m == n:
            forms += ["arange"]
        ints = [k for k in self.order if self.kind(k) == "i" and self.t(k).dim() == 1
                and self.t(k).numel() == m]
        if ints and not unique:
            forms += ["mod"]
        form = self.choice(forms)
        if form == "arange":
            return self.choice([f"torch.arange({n})", f"torch.arange({n}).flip(0)",
                                f"torch.arange({n} - 1, -1, -1)"])
        if form == "mod":
            return f"({self.choice(ints)} % {n})"
        if unique:
            vals = self.r.sample(range(n), m)
        else:
            vals = [self.r.randrange(n) for _ in range(m)]
        if negative:
            vals = [v - n if self.r.random() < 0.3 else v for v in vals]
        return _lit(vals)

    def slice_expr(self, shape: tuple[int, ...], *, allow_none: bool = True) -> str:
        nd = len(shape)
        k = self.r.randint(1, nd)
        parts = []
        for d in range(k):
            n = shape[d]
            c = self.r.random()
            if c < 0.3:
                parts.append(":")
            elif c < 0.55:
                parts.append(str(self.r.randrange(-n, n)))
            else:
                start = self.choice([None, 0, 1, -1, -2, n // 2]) if n > 1 else None
                stop = self.choice([None, None, n - 1, -1, n]) if n > 1 else None
                step = self.choice([None, None, 2, 3])
                s = ("" if start is None else str(start)) + ":" + \
                    ("" if stop is None else str(stop))
                if step is not None:
                    s += f":{step}"
                parts.append(s)
        if self.r.random() < 0.25 and k < nd:
            parts = ["..."] + parts[:max(1, k - 1)]
        if allow_none and self.r.random() < 0.15:
            parts.insert(self.r.randrange(len(parts) + 1), "None")
        return ", ".join(parts)

    # ----------------------------------------------------------------------------- inputs
    def make_inputs(self) -> None:
        r = self.r
        nd = self.choice([0, 1, 2, 2, 2, 3, 3, 3, 4])
        base = [self.choice([1, 2, 2, 3, 3, 4, 4, 5]) for _ in range(nd)]
        n_float = self.choice([1, 1, 2, 2, 2, 3])
        for k in range(n_float):
            shape = list(base)
            if k > 0 or r.random() < 0.15:
                if r.random() < 0.4 and shape:
                    shape = shape[r.randrange(len(shape)):]
                shape = [1 if r.random() < 0.25 else s for s in shape]
                if r.random() < 0.08:
                    shape = []
            self.add_input(f"x{k}", "torch.randn(" + repr(tuple(shape)) +
                           ", dtype=torch.float64, generator=gen)")
        if r.random() < 0.35:
            shape = base[r.randrange(len(base)):] if base else []
            self.add_input("n0", f"torch.randint(0, 6, {tuple(shape)!r}, generator=gen)")

    def add_input(self, name: str, ctor: str) -> None:
        self.inputs.append(Input(name, ctor))
        self.order.append(name)

    def load_inputs(self) -> None:
        ns = {"torch": torch}
        src = Program(tuple(self.inputs), (), ("x0",), self.input_seed).input_source()
        exec(src, ns)
        for i in self.inputs:
            self.ns[i.name] = ns[i.name]

    def rebuild(self) -> None:
        """Re-run the program so far (after a rejected statement that may have mutated)."""
        self.ns = namespace()
        self.load_inputs()
        self.order = [i.name for i in self.inputs]
        for s in self.stmts:
            exec(s.text, self.ns)
            self.order += list(s.defs)

    # -------------------------------------------------------------------------- statements
    def add(self, stmts: list[tuple[str, tuple[str, ...], str]]) -> bool:
        for text, defs, family in stmts:
            before = set(self.ns)
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("error")  # deprecated forms (in-place on expanded)
                    exec(text, self.ns)
                for d in defs:
                    v = self.ns[d]
                    if not isinstance(v, torch.Tensor) or v.numel() == 0 \
                            or v.numel() > MAX_NUMEL or v.dim() > 5:
                        raise _Reject
                    if v.is_complex():
                        raise _Reject
                for n in self.order + list(defs):
                    v = self.ns[n]
                    if v.is_floating_point() and v.numel() and \
                            not (v.isfinite().all() and v.abs().max() <= MAX_ABS):
                        raise _Reject
            except Exception:
                for k in set(self.ns) - before:
                    del self.ns[k]
                self.rebuild()
                return False
            stmt = Stmt(text, defs, family)
            self.stmts.append(stmt)
            self.used.update(stmt.uses())
            self.order += list(defs)
        return True

    def one(self, family: str, expr: str) -> list[tuple[str, tuple[str, ...], str]]:
        v = self.new()
        return [(f"{v} = {expr}", (v,), family)]
