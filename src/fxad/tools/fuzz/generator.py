"""Seeded generator of random straight-line PyTorch programs.

Programs are built one statement at a time while being run eagerly on their example inputs
(float64), so every choice can look at real shapes and values: a ``log`` gets a positive
operand, a division a denominator away from zero, an index tensor values in range.  A
statement that fails eagerly or makes a non-finite or huge value is dropped.  The finished
program must also pass the eager reference of both modes (:mod:`fxad.tools.fuzz.oracle`) with finite
derivatives; otherwise it is generated again (same seed, next attempt), so a seed always gives
the same program.

The op families (:data:`FAMILIES`) are the ones of the issue: elementwise unary ops,
binary ops with broadcasting, Python scalars, comparisons/``where``/masks, integer tensors,
reductions, views, slicing, integer-tensor indexing, ``cat``/``stack``, ``split``/``chunk``/
``unbind``, softmax, matmul, a few ``torch.nn.functional`` ops (``linear``, ``cross_entropy``
with integer targets, ``embedding``, ``pad``, ``normalize``...), tensor factories, in-place
ops on intermediates (integer ones too), ``x[idx] = v``, in-place ops on tensors that have
views and through views (aliasing), and fan-out (a value used several times, an output
returned twice or an input returned).
"""
from __future__ import annotations

import math
import random
import re
import warnings
from typing import Any, Callable

import torch

from . import oracle
from .program import Input, Program, Stmt, namespace

FAMILIES = ("unary", "binary", "scalar", "mask", "int", "reduction", "view", "slice", "index",
            "join", "split", "softmax", "matmul", "nn", "factory", "inplace", "setitem",
            "alias", "fanout")

_WEIGHTS = {  # relative frequency of each family per statement ("fanout" arises by itself)
    "unary": 10, "binary": 10, "scalar": 6, "mask": 6, "int": 5, "reduction": 8, "view": 9,
    "slice": 6, "index": 6, "join": 4, "split": 4, "softmax": 3, "matmul": 2, "nn": 3,
    "factory": 2, "inplace": 7, "setitem": 5, "alias": 3,
}

FOCUS_FACTOR = 6
MAX_NUMEL = 256
MAX_ABS = 1e4
MAX_DERIVATIVE = 1e6


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


class _Gen:
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

    # ---- families ---------------------------------------------------------------------------
    def b_unary(self) -> Any:
        a = self.pick("f")
        if a is None:
            return None
        c = self.r.random()
        if c < 0.55:
            expr = self.choice([
                f"torch.sin({a})", f"{a}.cos()", f"torch.tanh({a})", f"{a}.sigmoid()",
                f"torch.relu({a})", f"F.relu({a})", f"{a}.abs()", f"torch.abs({a})", f"-{a}",
                f"{a}.neg()", f"torch.atan({a})", f"torch.erf({a})", f"F.softplus({a})",
                f"F.gelu({a})", f"F.silu({a})", f"F.elu({a})", f"F.leaky_relu({a}, 0.1)",
                f"{a}.clamp(-0.5, 0.8)", f"torch.clamp({a}, min=0.1)", f"{a}.square()",
                f"{a} ** 2", f"torch.floor({a})", f"{a}.sign()", f"F.hardtanh({a})",
                f"F.logsigmoid({a})", f"{a}.clamp(max=0.3)", f"torch.sinh({self.bounded(a)})",
                f"{self.bounded(a)}.pow(3)", f"{a}.detach()",
            ])
        elif c < 0.7:
            b = self.bounded(a)
            expr = self.choice([f"torch.exp({b})", f"{b}.exp()", f"torch.expm1({b})",
                                f"2 ** {b}", f"torch.exp2({b})"])
        else:
            p = self.positive(a)
            expr = self.choice([f"torch.log({p})", f"{p}.log()", f"torch.sqrt({p})",
                                f"{p}.sqrt()", f"torch.rsqrt({p})", f"{p}.reciprocal()",
                                f"torch.log1p({p})", f"{p} ** 0.5", f"{p} ** -1.5",
                                f"{p}.pow(1.3)", f"torch.log2({p})"])
        return self.one("unary", expr)

    def b_binary(self) -> Any:
        a = self.pick("f")
        if a is None:
            return None
        if self.r.random() < 0.15:
            b = a
        else:
            b = self.pick("f", lambda n: self.broadcastable(a, n))
            if b is None:
                return None
        d = self.denominator(b)
        expr = self.choice([
            f"{a} + {b}", f"{a} - {b}", f"{a} * {b}", f"{a} / {d}", f"torch.add({a}, {b})",
            f"torch.sub({a}, {b}, alpha=2)", f"{a}.mul({b})", f"torch.div({a}, {d})",
            f"torch.maximum({a}, {b})", f"torch.minimum({a}, {b})", f"torch.atan2({a}, {d})",
            f"{self.positive(a)} ** {self.bounded(b, 2)}", f"torch.lerp({a}, {b}, 0.3)",
            f"torch.where({a} > {b}, {a}, {b})", f"{a}.add({b}, alpha=0.5)",
            f"torch.addcmul({a}, {a}, {b}, value=0.5)", f"{a}.pow({self.choice(['2', '3'])}) - {b}",
        ])
        return self.one("binary", expr)

    def b_scalar(self) -> Any:
        a = self.pick("f")
        if a is None:
            return None
        s, s2 = self.scalar(), self.scalar()
        expr = self.choice([
            f"{a} + {s}", f"{s} + {a}", f"{s} - {a}", f"{a} * {s}", f"{s} * {a}",
            f"{a} / {s}", f"{s} / {self.denominator(a)}", f"{a} ** 3", f"torch.mul({a}, {s})",
            f"{a}.div({s})", f"torch.add({a}, {s})", f"{a}.sub({s}, alpha=2)",
            f"torch.rsub({a}, {s})", f"{a}.clamp(max={s})", f"torch.where({a} > 0, {a}, {s})",
            f"{a}.masked_fill({a} < {s}, {s2})", f"{a} * torch.tensor({s}, dtype=torch.float64)",
            f"{a} - {s}", f"{a} * 1", f"{a} + 0", f"{a} * 0", f"{s} ** {self.bounded(a)}",
            f"{a} - {a}", f"{a} / 1", f"{a} ** 1", f"{a} ** 0", f"-(-{a})", f"0 * {a} + {a}",
            f"{a} * 1.0 - 0.0", f"({a} * 0).sum()", f"{a} + {a}",
            f"{a} / {a}.detach().abs().clamp(min=1)",
        ])
        return self.one("scalar", expr)

    def b_mask(self) -> Any:
        r = self.r
        masks = [n for n in self.order if self.kind(n) == "b"]
        if masks and r.random() < 0.5:
            m = self.choice(masks)
        else:
            a = self.pick("f")
            if a is None:
                return None
            b = self.pick("f", lambda n: self.broadcastable(a, n))
            cmp = self.choice([f"{a} > {b}" if b else f"{a} > 0", f"{a} < 0.3", f"{a} >= 0",
                               f"torch.gt({a}, -0.2)", f"{a}.le(0.5)"])
            if r.random() < 0.4:
                return self.one("mask", cmp)
            m = f"({cmp})"
        if m in self.ns and r.random() < 0.3:
            m2 = self.choice(masks)
            if self.broadcastable(m, m2, onto=True):
                m = self.choice([f"({m} & {m2})", f"({m} | {m2})", f"(~{m2})"])
        mvar = m if m in self.ns else None
        a = self.pick("f", lambda n: mvar is None or self.broadcastable(n, mvar))
        if a is None:
            return None
        b = self.pick("f", lambda n: self.broadcastable(a, n))
        s = self.scalar()
        onto = mvar is None or self.broadcastable(a, mvar, onto=True)
        forms = [f"torch.where({m}, {a}, {s})", f"torch.where({m}, {s}, {a})",
                 f"{a} * {m}", f"{a} * {m}.double()", f"{m}.to(torch.float64) * {a}"]
        if b is not None:
            forms += [f"torch.where({m}, {a}, {b})", f"{a}.clamp(min={b})" if
                      self.broadcastable(a, b, onto=True) else f"{b} + {a}"]
        if onto:
            forms += [f"{a}.masked_fill({m}, {s})", f"{a}.where({m}, 0.0)"]
        return self.one("mask", self.choice(forms))

    def b_int(self) -> Any:
        r = self.r
        ints = [n for n in self.order if self.kind(n) == "i"]
        c = r.random()
        if c < 0.35 or not ints:
            a = self.pick("f")
            if a is None:
                return None
            t = self.t(a)
            nd = t.dim()
            forms = [f"{a}.long()", f"({a} * 3).long()", f"({a} > 0).sum({self.dim(nd)})"
                     if nd else f"({a} > 0).long()", f"{a}.to(torch.int64)"]
            if nd:
                d = self.dim(nd)
                forms += [f"{a}.argmax({d})", f"{a}.argmin({d}, keepdim=True)",
                          f"{a}.argsort({d})", f"{a}.sort({d}).indices",
                          f"torch.arange({t.shape[d]})", f"torch.arange({t.shape[d]}).flip(0)"]
            return self.one("int", self.choice(forms))
        k = self.choice(ints)
        own = [i for i in ints if not self.is_input_alias(i) and not self.aliases(i)]
        if own and r.random() < 0.35:  # an integer intermediate mutated in place
            i = self.choice(own)
            nd = self.t(i).dim()
            return [(self.choice([f"{i}.add_(1)", f"{i}.clamp_(0, 3)", f"{i} //= 2",
                                  f"{i}[0] = 1" if nd else f"{i}.mul_(2)",
                                  f"{i}.masked_fill_({i} > 2, 0)"]), (), "int")]
        if c < 0.55:
            return self.one("int", self.choice([
                f"{k} + 1", f"{k} * 2", f"{k} % 3", f"{k} // 2", f"{k}.clamp(0, 3)",
                f"{k} - 2", f"torch.remainder({k}, 4)", f"{k}.flip(0)" if self.t(k).dim() else
                f"{k} + 2"]))
        a = self.pick("f", lambda n: self.broadcastable(n, k))
        if a is None:
            return None
        b = self.pick("f", lambda n: self.broadcastable(a, n) and self.broadcastable(n, k))
        forms = [f"{a} * {k}", f"{k} + {a}", f"{a} / ({k} + 1)", f"{a} * {k}.double()",
                 f"{a} + {k}.float()", f"{a} - {k}.to(torch.float64)", f"{a} ** ({k} % 3)",
                 f"{k} * 0.5 + {a}"]
        if b is not None:
            forms.append(f"torch.where({k} > 1, {a}, {b})")
        return self.one("int", self.choice(forms))

    def b_reduction(self) -> Any:
        a = self.pick("f")
        if a is None:
            return None
        t = self.t(a)
        nd = t.dim()
        bounded = t.numel() and t.abs().max() <= 3
        if nd == 0 or self.r.random() < 0.15:
            forms = [f"{a}.sum()", f"torch.sum({a})", f"{a}.mean()", f"{a}.amax()",
                     f"{a}.max()", f"torch.min({a})", f"{a}.norm()"]
            if bounded and t.numel() <= 8:
                forms.append(f"{a}.prod()")
            return self.one("reduction", self.choice(forms))
        d = self.dim(nd)
        n = t.shape[d]
        kd = self.choice(["True", "False"])
        forms = [
            f"{a}.sum({d})", f"torch.sum({a}, {d}, keepdim={kd})", f"{a}.mean({d}, keepdim={kd})",
            f"torch.amax({a}, {d}, keepdim={kd})", f"{a}.amin({d})", f"{a}.max({d}).values",
            f"torch.max({a}, {d}, keepdim=True)[0]", f"{a}.min({d})[0]",
            f"torch.logsumexp({a}, {d})", f"{a}.logsumexp({d}, keepdim=True)",
            f"torch.linalg.vector_norm({a}, dim={d})", f"{a}.norm(dim={d}, keepdim={kd})",
            f"{a}.cumsum({d})", f"torch.cummax({a}, {d}).values",
        ]
        if nd >= 2:
            d2 = self.choice([x for x in range(nd) if x != d % nd])
            forms += [f"{a}.sum(({d}, {d2}))", f"torch.mean({a}, ({d}, {d2}), keepdim={kd})",
                      f"torch.amax({a}, ({d}, {d2}))"]
        if n >= 2:
            forms += [f"{a}.var({d})", f"torch.var({a}, {d}, correction=0, keepdim={kd})",
                      f"{a}.std({d})"]
        if bounded and n <= 5:
            forms += [f"{a}.prod({d})", f"torch.prod({a}, {d}, keepdim={kd})",
                      f"torch.cumprod({a}, {d})"]
        return self.one("reduction", self.choice(forms))

    def _reshape_target(self, shape: tuple[int, ...]) -> tuple[int, ...] | None:
        r = self.r
        nd = len(shape)
        opts: list[tuple[int, ...]] = [(-1,), (math.prod(shape),)]
        if nd >= 2:
            i = r.randrange(nd - 1)
            opts.append(shape[:i] + (shape[i] * shape[i + 1],) + shape[i + 2:])
            opts.append(shape[:i] + (-1,) + shape[i + 2:])
        for i, s in enumerate(shape):
            if s == 4:
                opts.append(shape[:i] + (2, 2) + shape[i + 1:])
            if s == 1:
                opts.append(shape[:i] + shape[i + 1:])
        i = r.randrange(nd + 1)
        opts.append(shape[:i] + (1,) + shape[i:])
        return self.choice(opts)

    def b_view(self) -> Any:
        r = self.r
        a = self.pick("fi" if r.random() < 0.15 else "f")
        if a is None:
            return None
        s = self.shp(a)
        nd = len(s)
        forms = [f"{a}.unsqueeze({r.randint(-nd - 1, nd)})", f"{a}[None]", f"{a}.clone()",
                 f"{a}.contiguous()", f"{a}.reshape({self._reshape_target(s)})",
                 f"torch.reshape({a}, {self._reshape_target(s)})"]
        if nd == 0:
            forms += [f"{a}.expand({r.randint(2, 3)})", f"{a}.view(1, 1)"]
            return self.one("view", self.choice(forms))
        d = self.dim(nd)
        tgt = self._reshape_target(s)
        forms += [f"{a}.view({tgt})" if self.t(a).is_contiguous() else f"{a}.reshape({tgt})",
                  f"{a}.flatten()", f"{a}.flip({d})", f"torch.roll({a}, 1, {d})",
                  f"{a}[:, None]" if nd >= 1 else f"{a}[None]",
                  f"{a}.narrow({d}, {r.randrange(s[d])}, 1)",
                  f"{a}.select({d}, {r.randrange(-s[d], s[d])})",
                  f"{a}.repeat({', '.join(str(r.choice([1, 2])) for _ in range(nd))})",
                  f"{a}.view(-1)" if self.t(a).is_contiguous() else f"{a}.reshape(-1)"]
        if s[d] > 1:
            forms.append(f"{a}.narrow({d}, 1, {s[d] - 1})")
        if 1 in s:
            i = s.index(1)
            forms += [f"{a}.squeeze({i})", f"{a}.squeeze()",
                      f"{a}.expand("
                      f"{', '.join(str(r.choice([2, 3])) if x == 1 else '-1' for x in s)})"]
        forms += [f"{a}.expand({r.choice([2, 3])}, {', '.join(str(x) for x in s)})",
                  f"torch.broadcast_to({a}, {(2,) + s})"]
        if nd >= 2:
            perm = list(range(nd))
            r.shuffle(perm)
            d1, d2 = r.sample(range(nd), 2)
            forms += [f"{a}.permute({', '.join(map(str, perm))})",
                      f"torch.permute({a}, {tuple(perm)})",
                      f"{a}.transpose({d1}, {d2 - nd if r.random() < 0.3 else d2})",
                      f"torch.transpose({a}, {d1}, {d2})", f"{a}.mT",
                      f"torch.movedim({a}, {d1}, {d2})", f"{a}.diagonal()",
                      f"torch.tril({a})", f"{a}.triu(1)", f"{a}.flatten({r.randrange(nd - 1)})"]
            if nd == 2:
                forms += [f"{a}.t()", f"{a}.T"]
        if 4 in s:
            forms.append(f"{a}.unflatten({s.index(4)}, (2, -1))")
        ex = [n for n in self.order if n != a and self.broadcastable(n, a, onto=True)
              and self.shp(n) != s]
        if ex:
            forms.append(f"{a}.expand_as({self.choice(ex)})")
        return self.one("view", self.choice(forms))

    def b_slice(self) -> Any:
        a = self.pick("fi" if self.r.random() < 0.1 else "f", lambda n: self.t(n).dim() >= 1)
        if a is None:
            return None
        return self.one("slice", f"{a}[{self.slice_expr(self.shp(a))}]")

    def b_index(self) -> Any:
        r = self.r
        a = self.pick("f", lambda n: self.t(n).dim() >= 1)
        if a is None:
            return None
        s = self.shp(a)
        nd = len(s)
        d = r.randrange(nd)
        n = s[d]
        c = r.random()
        if c < 0.3:
            idx = self.index_tensor(n, negative=True)
            if d == 0:
                forms = [f"{a}[{idx}]"]
                if nd >= 2:
                    idx2 = self.index_tensor(s[1], length=len(eval(idx, self.ns)), negative=True)
                    forms += [f"{a}[{idx}, {idx2}]", f"{a}[{idx}, 1:]"]
            elif d == nd - 1:
                forms = [f"{a}[..., {idx}]"]
            else:
                forms = [f"{a}[:, {idx}]"]
            return self.one("index", self.choice(forms))
        if c < 0.5:
            idx = self.index_tensor(n)
            return self.one("index", self.choice([f"{a}.index_select({d}, {idx})",
                                                  f"torch.index_select({a}, {d}, {idx})"]))
        if c < 0.7:
            # gather along d with a literal index no larger than a elsewhere
            ishape = [x if k == d else r.randint(1, x) for k, x in enumerate(s)]
            ishape[d] = r.randint(1, 4)
            vals = torch.randint(0, n, ishape, generator=torch.Generator().manual_seed(
                r.randrange(2 ** 31))).tolist()
            return self.one("index", self.choice([f"torch.gather({a}, {d}, {_lit(vals)})",
                                                  f"{a}.gather({d}, {_lit(vals)})"]))
        b = self.pick("f", lambda k: self.shp(k) == s) or a
        forms = [f"torch.take_along_dim({a}, {b}.argsort({d}), {d})",
                 f"{a}.gather({d}, {b}.argsort({d}, descending=True))",
                 f"{a}.sort({d}).values", f"torch.topk({a}, 1, {d}).values",
                 f"{a}.take({self.index_tensor(math.prod(s))})",
                 f"{a}.scatter({d}, {b}.argsort({d}), {b})",
                 f"{a}.index_add({d}, {self.index_tensor(n, length=n)}, {b})"]
        if n >= 2:
            forms.append(f"torch.topk({a}, 2, {d}, largest=False).values")
        return self.one("index", self.choice(forms))

    def b_join(self) -> Any:
        r = self.r
        a = self.pick("f", lambda n: self.t(n).dim() >= 1)
        if a is None:
            return None
        s = self.shp(a)
        nd = len(s)
        d = r.randrange(nd)
        if r.random() < 0.6:
            parts = [n for n in self.order if self.kind(n) == "f" and self.t(n).dim() == nd
                     and all(x == y for k, (x, y) in enumerate(zip(self.shp(n), s)) if k != d)]
            others = [self.choice(parts) for _ in range(r.choice([1, 1, 2]))]
            seq = [a] + others
            r.shuffle(seq)
            dd = d - nd if r.random() < 0.3 else d
            return self.one("join", self.choice([f"torch.cat([{', '.join(seq)}], {dd})",
                                                 f"torch.cat(({', '.join(seq)}), dim={dd})",
                                                 f"torch.concat([{', '.join(seq)}], {dd})"]))
        parts = [n for n in self.order if self.kind(n) == "f" and self.shp(n) == s]
        seq = [a, self.choice(parts)]
        dd = r.randint(-nd - 1, nd)
        forms = [f"torch.stack([{', '.join(seq)}], {dd})", f"torch.stack(({seq[1]},))"]
        if nd <= 2:
            forms += [f"torch.hstack([{', '.join(seq)}])", f"torch.vstack([{', '.join(seq)}])"]
        return self.one("join", self.choice(forms))

    def b_split(self) -> Any:
        r = self.r
        a = self.pick("f", lambda n: any(x >= 2 for x in self.shp(n)))
        if a is None:
            return None
        s = self.shp(a)
        d = self.choice([k for k, x in enumerate(s) if x >= 2])
        n = s[d]
        c = r.random()
        if c < 0.35:
            k = r.randint(1, n - 1)
            v, w = self.new(), self.new()
            text = self.choice([f"{v}, {w} = {a}.split([{k}, {n - k}], {d})",
                                f"{v}, {w} = torch.split({a}, [{k}, {n - k}], dim={d})",
                                f"{v}, {w} = {a}.chunk(2, {d})",
                                f"{v}, {w} = torch.chunk({a}, 2, {d})"])
            return [(text, (v, w), "split")]
        if c < 0.55 and n <= 4:
            vs = [self.new() for _ in range(n)]
            return [(f"{', '.join(vs)} = {a}.unbind({d})", tuple(vs), "split")]
        return self.one("split", self.choice([
            f"{a}.split({r.randint(1, n - 1)}, {d})[{r.choice([0, -1])}]",
            f"torch.unbind({a}, {d})[{r.randrange(n)}]", f"{a}.chunk(3, {d})[-1]",
            f"{a}.tensor_split(2, {d})[0]", f"{a}.split(1, {d})[{r.randrange(-n, n)}]"]))

    def b_softmax(self) -> Any:
        a = self.pick("f", lambda n: self.t(n).dim() >= 1)
        if a is None:
            return None
        d = self.dim(self.t(a).dim())
        return self.one("softmax", self.choice([
            f"torch.softmax({a}, {d})", f"{a}.softmax({d})", f"F.softmax({a}, dim={d})",
            f"torch.log_softmax({a}, {d})", f"{a}.log_softmax({d})", f"F.log_softmax({a}, {d})",
            f"{a}.softmax({d}, dtype=torch.float64)"]))

    def b_matmul(self) -> Any:
        a = self.pick("f", lambda n: self.t(n).dim() >= 1)
        if a is None:
            return None
        k = self.shp(a)[-1]

        def ok(n: str) -> bool:
            s = self.shp(n)
            if len(s) == 1:
                return s[0] == k
            if len(s) < 2 or s[-2] != k:
                return False
            return _broadcast(self.shp(a)[:-2], s[:-2]) is not None

        b = self.pick("f", ok)
        if b is None:
            if self.t(a).dim() == 1:
                return self.one("matmul", f"torch.outer({a}, {a})")
            return self.one("matmul", f"{a} @ {a}.mT" if self.t(a).dim() >= 2 else f"{a} @ {a}")
        forms = [f"{a} @ {b}", f"torch.matmul({a}, {b})"]
        if self.t(a).dim() == 2 and self.t(b).dim() == 2:
            forms.append(f"torch.mm({a}, {b})")
        return self.one("matmul", self.choice(forms))

    def b_nn(self) -> Any:
        r = self.r
        a = self.pick("f", lambda n: self.t(n).dim() >= 1)
        if a is None:
            return None
        s = self.shp(a)
        nd, k = len(s), s[-1]
        c = r.random()
        if c < 0.2:
            w = self.pick("f", lambda n: self.t(n).dim() == 2 and self.shp(n)[1] == k)
            if w is None:
                return None
            bias = self.pick("f", lambda n: self.shp(n) in ((self.shp(w)[0],), ()))
            args = f"{a}, {w}" + (f", {bias}" if bias and r.random() < 0.6 else "")
            return self.one("nn", f"F.linear({args})")
        if c < 0.4 and nd <= 2:
            n_cls = k
            rows = 1 if nd == 1 else s[0]
            ints = [i for i in self.order if self.kind(i) == "i" and
                    self.shp(i) == ((rows,) if nd == 2 else ())]
            tgt = f"({self.choice(ints)} % {n_cls})" if ints and r.random() < 0.5 else \
                _lit([r.randrange(n_cls) for _ in range(rows)] if nd == 2 else r.randrange(n_cls))
            red = self.choice(["", ", reduction='sum'", ", reduction='none'"])
            return self.one("nn", self.choice([
                f"F.cross_entropy({a}, {tgt}{red})",
                f"F.nll_loss(F.log_softmax({a}, -1), {tgt}{red})" if nd == 2 else
                f"F.cross_entropy({a}, {tgt})"]))
        if c < 0.5:
            idx = self.pick("i", lambda n: self.t(n).numel() <= 16)
            w = self.pick("f", lambda n: self.t(n).dim() == 2)
            if idx is None or w is None:
                return None
            return self.one("nn", self.choice([
                f"F.embedding({idx} % {self.shp(w)[0]}, {w})",
                f"F.one_hot({idx} % {k}, {k}).double() * {a}" if self.broadcastable(
                    a, idx) else f"F.embedding({idx} % {self.shp(w)[0]}, {w})"]))
        b = self.pick("f", lambda n: self.shp(n) == s)
        d = self.dim(nd)
        forms = [f"F.pad({a}, ({r.randint(0, 2)}, {r.randint(0, 2)}))",
                 f"F.normalize({a}, dim={d})", f"F.layer_norm({a}, ({k},))",
                 f"torch.flatten({a})", f"F.softplus({a}, beta=2)"]
        if s[d] >= 2:
            forms.append(f"torch.diff({a}, dim={d})")
        if b is not None:
            forms += [f"F.mse_loss({a}, {b})", f"F.l1_loss({a}, {b}, reduction='sum')",
                      f"F.smooth_l1_loss({a}, {b})", f"torch.dist({a}, {b})"]
        if nd == 2:
            forms.append(f"torch.einsum('ij->ji', {a})")
            if b is not None:
                forms += [f"torch.einsum('ij,ij->i', {a}, {b})",
                          f"torch.einsum('ij,kj->ik', {a}, {b})"]
        return self.one("nn", self.choice(forms))

    def b_factory(self) -> Any:
        a = self.pick("f")
        if a is None:
            return None
        s = self.shp(a)
        forms = [f"torch.zeros_like({a})", f"torch.ones({s}, dtype=torch.float64)",
                 f"{a}.new_zeros({s})", f"torch.full({s}, 0.5, dtype=torch.float64)",
                 f"torch.zeros({s}, dtype=torch.float64)", f"torch.ones_like({a}) * 2",
                 f"torch.empty_like({a}).copy_({a})"]
        if len(s) == 1:
            forms += [f"torch.arange({s[0]}, dtype=torch.float64)",
                      f"torch.linspace(0, 1, {s[0]}, dtype=torch.float64)"]
        return self.one("factory", self.choice(forms))

    def overlapping(self, name: str) -> bool:
        """Whether ``name`` or a tensor sharing its memory has elements sharing one memory
        location (``expand``): writing there has no well-defined autograd semantics."""
        return any(any(st == 0 and n > 1 for st, n in zip(self.t(k).stride(), self.t(k).shape))
                   for k in [name] + self.aliases(name))

    def _mutation(self, t: str, family: str) -> Any:
        """An in-place statement on ``t`` (an intermediate)."""
        r = self.r
        if self.overlapping(t):
            return None
        s = self.shp(t)
        nd = len(s)
        # operands never share memory with the target: PyTorch reads them while it writes
        # (x[idx] = diagonal(x)), with a result that depends on the kernel's order
        mem = {_storage(self.t(k)) for k in [t] + self.aliases(t)}

        def apart(n: str) -> bool:
            return _storage(self.t(n)) not in mem

        b = self.pick("f", lambda n: apart(n) and self.broadcastable(t, n, onto=True))
        sc = self.scalar()
        if family == "setitem" or (family == "alias" and r.random() < 0.4):
            if nd == 0:
                idx = "..."
            else:
                c = r.random()
                if c < 0.55:
                    idx = self.slice_expr(s, allow_none=False)
                elif c < 0.75:
                    d = r.randrange(nd)
                    ti = self.index_tensor(s[d], unique=True)
                    idx = ti if d == 0 else ", ".join([":"] * d + [ti])
                else:
                    m = self.pick("b", lambda n: self.broadcastable(t, n, onto=True))
                    idx = m if m is not None else f"{t} > 0.5"
            try:
                sub = eval(f"{t}[{idx}]", self.ns)
            except Exception:
                return None
            vals = [n for n in self.order if apart(n) and self.kind(n) == "f"
                    and _broadcast(self.shp(n), tuple(sub.shape)) == tuple(sub.shape)]
            is_mask = (idx in self.ns and self.kind(idx) == "b") or idx.endswith("> 0.5")
            val = sc if (not vals or is_mask or r.random() < 0.3) else self.choice(vals)
            if r.random() < 0.2 and val != sc:
                val = f"{val}.sin()" if r.random() < 0.5 else f"{val} * 2"
            return [(f"{t}[{idx}] = {val}", (), family)]
        forms = [f"{t}.mul_({sc})", f"{t}.clamp_(min=-0.5)", f"{t}.clamp_(-1, 1)",
                 f"{t}.relu_()", f"{t}.sigmoid_()", f"{t}.tanh_()", f"{t}.sin_()",
                 f"{t}.neg_()", f"{t}.abs_()", f"{t}.zero_()", f"{t}.fill_({sc})",
                 f"{t} *= {sc}", f"{t}.div_({sc})", f"{t}.add_({sc})", f"{t}.pow_(2)",
                 f"{t}.masked_fill_({t} > 0.5, {sc})"]
        if self.t(t).abs().max() < 3:
            forms.append(f"{t}.exp_()")
        if b is not None:
            forms += [f"{t}.add_({b})", f"{t}.sub_({b}, alpha=0.5)", f"{t} += {b}",
                      f"{t} -= {b}", f"{t}.copy_({b})", f"{t}.mul_({b})",
                      f"{t}.addcmul_({b}, {b}, value=0.5)", f"{t}.lerp_({b}, 0.3)",
                      f"{t}.div_({self.denominator(b)})", f"{t} *= {b}"]
        m = self.pick("b", lambda n: self.broadcastable(t, n, onto=True))
        if m is not None:
            forms.append(f"{t}.masked_fill_({m}, {sc})")
        if nd >= 1:
            d = r.randrange(nd)
            perm = self.index_tensor(s[d], length=s[d], unique=True)
            src = self.pick("f", lambda n: apart(n) and self.shp(n) == s)
            if src is not None:
                forms += [f"{t}.index_add_({d}, {perm}, {src})",
                          f"{t}.index_copy_({d}, {perm}, {src})",
                          f"{t}.scatter_({d}, {src}.argsort({d}), {src})",
                          f"{t}.scatter_add_({d}, {src}.argsort({d}), {src})"]
            forms.append(f"{t}.index_fill_({d}, {self.index_tensor(s[d], unique=True)}, {sc})")
        return [(self.choice(forms), (), family)]

    def _own(self, n: str) -> bool:
        return self.kind(n) == "f" and not self.is_input_alias(n) \
            and self.t(n).dtype == torch.float64

    def b_inplace(self) -> Any:
        t = self.pick("f", lambda n: self._own(n) and not self.aliases(n))
        return None if t is None else self._mutation(t, "inplace")

    def b_setitem(self) -> Any:
        t = self.pick("f", lambda n: self._own(n) and not self.aliases(n))
        return None if t is None else self._mutation(t, "setitem")

    def b_alias(self) -> Any:
        r = self.r
        t = self.pick("f", lambda n: self._own(n) and bool(self.aliases(n)))
        if t is not None:
            return self._mutation(t, "alias")
        base = self.pick("f", lambda n: self._own(n) and self.t(n).dim() >= 1)
        if base is None:
            return None
        s = self.shp(base)
        nd = len(s)
        w = self.new()
        view = self.choice([f"{base}[{r.randrange(s[0])}]", f"{base}.unsqueeze(0)",
                            f"{base}.view(-1)" if self.t(base).is_contiguous() else f"{base}[:]",
                            f"{base}[..., 1:]" if s[-1] > 1 else f"{base}[..., :1]",
                            f"{base}.transpose(0, 1)" if nd >= 2 else f"{base}[None]",
                            f"{base}.narrow(0, 0, 1)", f"{base}.diagonal()" if nd >= 2
                            else f"{base}[::2]"])
        if not self.add([(f"{w} = {view}", (w,), "alias")]):
            return None
        target = self.choice([w, base])
        return self._mutation(target, "alias")

    # ------------------------------------------------------------------------------ driver
    def body(self, n_stmts: int) -> None:
        fams = list(_WEIGHTS)
        weights = [_WEIGHTS[f] * (FOCUS_FACTOR if f in self.focus else 1) for f in fams]
        tries = 0
        while len(self.stmts) < n_stmts and tries < 6 * n_stmts:
            tries += 1
            fam = self.r.choices(fams, weights)[0]
            try:
                stmts = getattr(self, "b_" + fam)()
            except _Reject:
                stmts = None
            if stmts:
                self.add(stmts)

    def outputs(self) -> tuple[str, ...]:
        r = self.r
        used = {u for s in self.stmts for u in s.uses()}
        inter = [n for n in self.order if not n.startswith(("x", "n"))]
        floats = [n for n in inter if self.kind(n) == "f"]
        if not floats:
            raise _Reject
        sinks = [n for n in floats if n not in used] or floats
        outs = [sinks[-1]]
        k = r.choice([1, 1, 2, 2, 3])
        pool = [n for n in inter if n not in outs]
        while len(outs) < k and pool:
            n = self.choice([p for p in pool if p not in used] or pool)
            pool.remove(n)
            outs.append(n)
        if r.random() < 0.05:
            outs.append(outs[0])
        if r.random() < 0.08:  # an input, or a value sharing an input's memory
            outs.append(self.choice([n for n in self.order if self.is_input_alias(n)]))
        r.shuffle(outs)
        return tuple(outs)


def _families(prog: Program) -> frozenset[str]:
    fams = prog.used_families()
    counts: dict[str, int] = {}
    for s in prog.stmts:
        for u in s.uses():
            counts[u] = counts.get(u, 0) + 1
        if any(len(re.findall(rf"\b{u}\b", s.text)) >= 2 for u in s.uses()):
            fams.add("fanout")
    for o in prog.outputs:
        counts[o] = counts.get(o, 0) + 1
    if any(c >= 2 for c in counts.values()):
        fams.add("fanout")
    if any(i.name.startswith("n") for i in prog.inputs):
        fams.add("int")
    return frozenset(fams)


def eager_ok(prog: Program) -> bool:
    """The program runs eagerly in both modes with finite, moderate derivatives."""
    f = prog.compile()
    try:
        inputs = prog.make_inputs()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (each statement was checked for warnings)
            rev = oracle.eager_reverse(f, inputs, prog.input_seed)
            fwd = oracle.eager_forward(f, inputs, prog.input_seed)
        if not any(g is not None for g in rev["grads"]) and \
                not any(t is not None for t in fwd["tangents"]):
            return False
        vals = rev["outputs"] + [g for g in rev["grads"] if g is not None] + \
            fwd["outputs"] + [t for t in fwd["tangents"] if t is not None]
        for v in vals:
            if isinstance(v, torch.Tensor) and v.is_floating_point() and v.numel() and \
                    not (v.isfinite().all() and v.abs().max() <= MAX_DERIVATIVE):
                return False
        for a, b in zip(rev["outputs"], fwd["outputs"]):
            if not torch.equal(a, b):  # nondeterministic program
                return False
        return True
    except Exception:
        return False
    finally:
        from .program import forget
        forget(f)


def generate(seed: int, index: int, *, focus: tuple[str, ...] = (),
             max_attempts: int = 50) -> Program:
    """The ``index``-th program of the batch ``seed`` (deterministic); ``focus``: families
    drawn :data:`FOCUS_FACTOR` times as often (another batch of programs)."""
    bad = [f for f in focus if f not in _WEIGHTS]
    if bad:
        raise ValueError(f"unknown families {bad}; choose from {list(_WEIGHTS)}")
    for attempt in range(max_attempts):
        g = _Gen(seed, index, attempt, tuple(focus))
        g.make_inputs()
        g.load_inputs()
        g.body(g.r.randint(3, 12))
        try:
            outs = g.outputs()
        except _Reject:
            continue
        prog = Program(tuple(g.inputs), tuple(g.stmts), outs, g.input_seed, g.tag)
        if eager_ok(prog):
            return Program(prog.inputs, prog.stmts, prog.outputs, prog.input_seed, prog.tag,
                           _families(prog))
    raise RuntimeError(f"could not generate a valid program for seed {seed} index {index}")
