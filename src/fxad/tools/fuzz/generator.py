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

Layout: :mod:`~fxad.tools.fuzz.state` (the program being built and the operand helpers),
:mod:`~fxad.tools.fuzz.values`, :mod:`~fxad.tools.fuzz.shapes` and
:mod:`~fxad.tools.fuzz.mutation` (the op families' statement generators); this module
assembles a program from them.
"""
from __future__ import annotations

import re
import warnings

import torch

from . import oracle
from .mutation import _Mutations
from .program import Program, forget
from .shapes import _ShapeFamilies
from .state import MAX_ABS, MAX_NUMEL, _Reject  # noqa: F401  (MAX_*: the generator's limits)
from .values import _ValueFamilies

FAMILIES = ("unary", "binary", "scalar", "mask", "int", "reduction", "view", "slice", "index",
            "join", "split", "softmax", "matmul", "nn", "factory", "inplace", "setitem",
            "alias", "fanout")

_WEIGHTS = {  # relative frequency of each family per statement ("fanout" arises by itself)
    "unary": 10, "binary": 10, "scalar": 6, "mask": 6, "int": 5, "reduction": 8, "view": 9,
    "slice": 6, "index": 6, "join": 4, "split": 4, "softmax": 3, "matmul": 2, "nn": 3,
    "factory": 2, "inplace": 7, "setitem": 5, "alias": 3,
}

FOCUS_FACTOR = 6
MAX_DERIVATIVE = 1e6


class _Gen(_ValueFamilies, _ShapeFamilies, _Mutations):
    """A program being generated: the op families (``b_<family>`` methods) and the driver."""

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
