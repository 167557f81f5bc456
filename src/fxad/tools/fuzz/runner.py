"""Run fuzz programs through fxad, classify, shrink failures and write reproducers.

Classes of a program (per mode, and overall: the worst of its modes):

``pass``
    fxad's values and derivatives equal eager PyTorch's (float64, rtol 1e-7, atol 1e-9).
``refusal``
    fxad refused with one of its own errors (:class:`fxad.FxadError`) that names the op and
    the program's line: a documented limitation, not a wrong answer.
``wrong``
    any value, derivative, shape or dtype that differs from PyTorch's, a derivative missing
    where PyTorch has a nonzero one, or generated code that modifies its inputs.
``crash``
    any other exception from fxad (a bare ``IndexError`` from inside fxad, or one that fxad
    wrapped in a :class:`fxad.RuleError` because a built-in rule raised it), an fxad error
    raised while running generated code, or an fxad error that does not name the op and line.
"""
from __future__ import annotations

import inspect
import os
import re
import time
import traceback
import warnings
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable

import fxad

from ...errors import FxadError, RuleError
from . import oracle
from .generator import eager_ok, generate
from .program import Program, Stmt, forget

CLASSES = ("pass", "refusal", "wrong", "crash")
#: reverse: fxad.vjp; forward: fxad.jvp; dynamic: fxad.vjp on symbolic sizes, checked at the
#: example and at oracle.DYNAMIC_SIZES other sizes its guards admit
MODES = ("reverse", "forward", "dynamic")


@dataclass
class Outcome:
    """Result of one mode on one program."""

    mode: str
    cls: str
    detail: str = ""
    signature: str = ""  # what "the same failure" means while shrinking
    traceback: str = ""

    @property
    def bad(self) -> bool:
        return self.cls in ("wrong", "crash")


@dataclass
class Result:
    program: Program
    outcomes: dict[str, Outcome]

    @property
    def cls(self) -> str:
        return max((o.cls for o in self.outcomes.values()), key=_worst)

    def worst(self) -> Outcome:
        return max(self.outcomes.values(), key=lambda o: _worst(o.cls))


def _worst(cls: str) -> int:
    return {"pass": 0, "refusal": 1, "invalid": 2, "crash": 2, "wrong": 3}[cls]


_FXAD_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _where(tb: Any) -> str:
    """Innermost fxad frame of a traceback, as ``module.py:function``."""
    frames = traceback.extract_tb(tb)
    for fr in reversed(frames):
        if fr.filename.startswith(_FXAD_DIR) and os.sep + "fuzz" + os.sep not in fr.filename:
            return f"{os.path.relpath(fr.filename, _FXAD_DIR)}:{fr.name}"
    fr = frames[-1] if frames else None
    return f"{os.path.basename(fr.filename)}:{fr.name}" if fr else "?"


_OP_RE = re.compile(r"(torch\.[\w.]+|Tensor\.\w+|operator\.\w+|F\.\w+|aten\.\w+|`\w+`)")


def is_clear_refusal(e: FxadError, f: Callable) -> bool:
    """An fxad error naming the op and a line of the program."""
    loc = getattr(e, "loc", None)
    fname = getattr(f, "__fuzz_filename__", None)
    if loc is None or (fname is not None and loc.filename != fname) or loc.lineno < 1:
        return False
    return bool(getattr(e, "op", None)) or bool(_OP_RE.search(getattr(e, "bare_message", str(e))))


def _first_line(s: str) -> str:
    return s.strip().splitlines()[0] if s.strip() else ""


def run_mode(prog: Program, mode: str, f: Callable | None = None) -> Outcome:
    """Run one mode of ``prog`` through the oracle."""
    own = f is None
    f = f or prog.compile()
    names = [i.name for i in prog.inputs]
    try:
        inputs = prog.make_inputs()
        try:
            if mode in ("reverse", "dynamic"):
                expected = oracle.eager_reverse(f, inputs, prog.input_seed)
            else:
                expected = oracle.eager_forward(f, inputs, prog.input_seed)
        except Exception as e:  # the program itself is invalid
            return Outcome(mode, "invalid", f"eager: {type(e).__name__}: {e}", "invalid")
        phase = "build"
        try:
            with warnings.catch_warnings(), _Quiet():
                warnings.simplefilter("ignore")
                built = fxad.vjp(f, *inputs) if mode == "reverse" else \
                    fxad.vjp(f, *inputs, dynamic=True) if mode == "dynamic" else \
                    fxad.jvp(f, *inputs)
                phase = "run"
                if mode == "dynamic":
                    got = oracle.run_vjp(built, inputs, expected)
                    phase = "compare"
                    oracle.compare_reverse(expected, got, names)
                    phase = "run at other sizes"
                    oracle.check_other_sizes(f, built, inputs, prog.input_seed, names)
                elif mode == "reverse":
                    got = oracle.run_vjp(built, inputs, expected)
                    phase = "compare"
                    oracle.compare_reverse(expected, got, names)
                else:
                    got = oracle.run_jvp(built, inputs, expected)
                    phase = "compare"
                    oracle.compare_forward(expected, got)
        except oracle.Mismatch as e:
            return Outcome(mode, "wrong", str(e), f"{mode}:wrong", traceback.format_exc())
        except FxadError as e:
            tb = traceback.format_exc()
            # a built-in rule that raised (fxad reports it as a RuleError naming the op and
            # line, caused by the bare exception) is a bug, not a refusal
            cause = e.__cause__
            internal = isinstance(e, RuleError) and cause is not None \
                and not isinstance(cause, FxadError)
            if phase == "build" and not internal and is_clear_refusal(e, f):
                return Outcome(mode, "refusal", f"{type(e).__name__}: {e}",
                               f"{mode}:refusal:{type(e).__name__}", tb)
            why = ("a rule raised " + type(cause).__name__ if internal else
                   "unclear refusal" if phase == "build" else f"fxad error while {phase}")
            where = _where(cause.__traceback__) if internal else _where(e.__traceback__)
            return Outcome(mode, "crash", f"{why}: {type(e).__name__}: {e}",
                           f"{mode}:crash:{type(e).__name__}:{where}", tb)
        except Exception as e:
            tb = traceback.format_exc()
            return Outcome(mode, "crash", f"{phase}: {type(e).__name__}: {e}",
                           f"{mode}:crash:{type(e).__name__}:{_where(e.__traceback__)}", tb)
        return Outcome(mode, "pass")
    finally:
        if own:
            forget(f)


class _Quiet:
    """Silence torch's fake-tensor logger (it logs every failed meta function at ERROR level,
    which fxad turns into its own errors anyway) and warnings while fxad runs."""

    _LOGGERS = ("torch._subclasses.fake_tensor",)

    def __enter__(self) -> None:
        import contextlib
        import io
        import logging
        self._saved = [(logging.getLogger(n), logging.getLogger(n).level) for n in self._LOGGERS]
        for lg, _ in self._saved:
            lg.setLevel(logging.CRITICAL)
        # torch.fx prints the generated code around an exception raised inside it to stderr
        self._stderr = contextlib.redirect_stderr(io.StringIO())
        self._stderr.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self._stderr.__exit__(*exc)
        for lg, level in self._saved:
            lg.setLevel(level)


def run_program(prog: Program, modes: Iterable[str] = MODES) -> Result:
    f = prog.compile()
    try:
        return Result(prog, {m: run_mode(prog, m, f) for m in modes})
    finally:
        forget(f)


# ------------------------------------------------------------------------------- shrinking
def _later_uses(prog: Program, i: int, name: str) -> bool:
    return any(name in s.uses() or (not s.defs and name in s.text and
                                     re.search(rf"\b{name}\b", s.text))
               for s in prog.stmts[i + 1:]) or name in prog.outputs


def _rename_after(prog: Program, i: int, old: str, new: str) -> Program:
    stmts = list(prog.stmts[:i]) + [s.renamed(old, new) for s in prog.stmts[i + 1:]]
    outs = tuple(new if o == old else o for o in prog.outputs)
    return replace(prog, stmts=tuple(stmts), outputs=outs)


def _candidates(prog: Program) -> Iterable[Program]:
    # fewer outputs
    if len(prog.outputs) > 1:
        for k in range(len(prog.outputs)):
            yield replace(prog, outputs=prog.outputs[:k] + prog.outputs[k + 1:])
    floats = [i.name for i in prog.inputs if i.is_float]
    # delete a statement (latest first), routing its uses to one of its operands or an input
    for i in reversed(range(len(prog.stmts))):
        s = prog.stmts[i]
        live = [d for d in s.defs if _later_uses(prog, i, d)]
        if not live:
            yield replace(prog, stmts=prog.stmts[:i] + prog.stmts[i + 1:])
            continue
        for r in list(dict.fromkeys(s.uses() + floats)):
            p = replace(prog, stmts=prog.stmts[:i] + (Stmt("pass"),) + prog.stmts[i + 1:])
            for d in live:
                p = _rename_after(p, i, d, r)
            yield replace(p, stmts=p.stmts[:i] + p.stmts[i + 1:])
    # an operand replaced by an input
    for i, s in enumerate(prog.stmts):
        for u in s.uses():
            if u.startswith("v"):
                for x in floats:
                    stmts = list(prog.stmts)
                    stmts[i] = s.renamed(u, x) if s.defs else _rename_operand(s, u, x)
                    yield replace(prog, stmts=tuple(stmts))
    # unused inputs dropped
    used = {u for s in prog.stmts for u in s.uses()} | set(prog.outputs)
    for k, inp in enumerate(prog.inputs):
        if inp.name not in used:
            yield replace(prog, inputs=prog.inputs[:k] + prog.inputs[k + 1:])
    # smaller input shapes
    for k, inp in enumerate(prog.inputs):
        m = re.search(r"(?:randn\(|randint\(0, \d+, )(\((\d+(?:, \d+)*),?\))", inp.ctor)
        if not m:
            continue
        dims = [int(x) for x in m.group(2).split(",")]
        for j, n in enumerate(dims):
            for smaller in sorted({1, 2} & set(range(1, n))):
                new = dims[:j] + [smaller] + dims[j + 1:]
                shape = "(" + ", ".join(map(str, new)) + ("," if len(new) == 1 else "") + ")"
                ctor = inp.ctor[:m.start(1)] + shape + inp.ctor[m.end(1):]
                inputs = list(prog.inputs)
                inputs[k] = replace(inp, ctor=ctor)
                yield replace(prog, inputs=tuple(inputs))


def _rename_operand(s: Stmt, old: str, new: str) -> Stmt:
    """Rename ``old`` in an in-place statement except as its target (the first name)."""
    m = re.match(r"\s*(\w+)", s.text)
    if m and m.group(1) == old:
        head, rest = s.text[:m.end()], s.text[m.end():]
        return replace(s, text=head + re.sub(rf"\b{old}\b", new, rest))
    return s.renamed(old, new)


def shrink(prog: Program, outcome: Outcome, *, budget: int = 400,
           deadline_s: float = 60.0) -> Program:
    """Smallest program (greedy) that still fails with ``outcome.signature`` in its mode."""
    best = prog
    evals = 0
    t0 = time.monotonic()
    progress = True
    while progress and evals < budget and time.monotonic() - t0 < deadline_s:
        progress = False
        for cand in _candidates(best):
            if evals >= budget or time.monotonic() - t0 > deadline_s:
                break
            if cand.source() == best.source() and cand.inputs == best.inputs:
                continue
            evals += 1
            if not eager_ok(cand):
                continue
            o = run_mode(cand, outcome.mode)
            if o.signature == outcome.signature:
                best = cand
                progress = True
                break
    return best


# ------------------------------------------------------------------------------ reproducers
def reproducer_source(prog: Program, outcome: Outcome) -> str:
    """A standalone script: the program, its inputs, the oracle, and the failing check."""
    import torch

    detail = "\n".join("#   " + line for line in outcome.detail.strip().splitlines()[:12])
    names = [i.name for i in prog.inputs]
    if outcome.mode == "dynamic":
        main = ("    expected = eager_reverse(f, inputs, SEED)\n"
                "    g = fxad.vjp(f, *inputs, dynamic=True)\n"
                f"    compare_reverse(expected, run_vjp(g, inputs, expected), {names!r})\n"
                f"    check_other_sizes(f, g, inputs, SEED, {names!r})\n")
    elif outcome.mode == "reverse":
        main = ("    expected = eager_reverse(f, inputs, SEED)\n"
                "    got = fxad_reverse(f, inputs, expected)\n"
                f"    compare_reverse(expected, got, {names!r})\n")
    else:
        main = ("    expected = eager_forward(f, inputs, SEED)\n"
                "    got = fxad_forward(f, inputs, expected)\n"
                "    compare_forward(expected, got)\n")
    oracle_src = inspect.getsource(oracle)
    oracle_src = oracle_src.split('"""', 2)[2].lstrip("\n")  # drop the module docstring
    return (
        f"# fxad fuzz reproducer ({prog.tag}): {outcome.cls} in {outcome.mode} mode\n"
        f"# fxad {fxad.__version__}, torch {torch.__version__}\n"
        f"# {_first_line(outcome.detail)[:200]}\n"
        f"# run: python {{this file}}  (raises while the bug is there)\n"
        f"#\n{detail}\n"
        "import torch\n"
        "import torch.nn.functional as F\n\n\n"
        f"{prog.source()}\n\n"
        f"{prog.input_source()}"
        f"SEED = {prog.input_seed}\n\n"
        "# ---- the oracle of fxad.tools.fuzz (eager PyTorch float64 vs fxad) ----\n"
        f"{oracle_src}\n\n"
        "if __name__ == \"__main__\":\n"
        f"{main}"
        "    print(\"fxad agrees with PyTorch\")\n"
    )


def write_reproducer(prog: Program, outcome: Outcome, out_dir: str, name: str) -> str:
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name)
    with open(path, "w") as fh:
        fh.write(reproducer_source(prog, outcome))
    return path


# ------------------------------------------------------------------------------------ batch
@dataclass
class Summary:
    n: int = 0
    counts: dict[str, int] = field(default_factory=lambda: {c: 0 for c in CLASSES})
    mode_counts: dict[str, dict[str, int]] = field(default_factory=dict)
    refusals: dict[str, int] = field(default_factory=dict)
    refusal_examples: dict[str, str] = field(default_factory=dict)  # kind -> program tag
    failures: list[tuple[Result, Outcome, str | None]] = field(default_factory=list)
    families: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0

    def line(self) -> str:
        c = self.counts
        return (f"{self.n} programs: {c['pass']} pass / {c['refusal']} clear refusal / "
                f"{c['wrong']} wrong / {c['crash']} crash")

    def report(self) -> str:
        lines = [self.line() + f"  ({self.seconds:.1f} s)"]
        for m, c in self.mode_counts.items():
            lines.append(f"  {m:8s}: " + " / ".join(f"{c.get(k, 0)} {k}" for k in CLASSES))
        if self.refusals:
            lines.append("  refusals (per mode; kind x count, first program): " + ", ".join(
                f"{k} x{v} ({self.refusal_examples.get(k, '?')})"
                for k, v in sorted(self.refusals.items(), key=lambda kv: -kv[1])))
        for res, o, path in self.failures:
            lines.append(f"  {o.cls.upper()} {res.program.tag} [{o.mode}] "
                         f"{_first_line(o.detail)[:150]}" + (f" -> {path}" if path else ""))
        return "\n".join(lines)


def _refusal_key(o: Outcome) -> str:
    m = re.match(r"(\w+): (.*)", o.detail)
    head = m.group(2) if m else o.detail
    op = _OP_RE.search(head)
    return f"{m.group(1) if m else '?'}({op.group(1) if op else _first_line(head)[:40]})"


def run_batch(n: int, seed: int, *, modes: Iterable[str] = MODES, out_dir: str | None = None,
              do_shrink: bool = True, start: int = 0, max_shrink_per_signature: int = 3,
              focus: tuple[str, ...] = (),
              log: Callable[[str], None] | None = None) -> Summary:
    """Generate and check programs ``start .. start+n-1`` of batch ``seed`` (see
    :func:`fxad.tools.fuzz.generate` for ``focus``)."""
    modes = tuple(modes)
    summary = Summary(mode_counts={m: {c: 0 for c in CLASSES} for m in modes})
    shrunk_per_sig: dict[str, int] = {}
    t0 = time.monotonic()
    for index in range(start, start + n):
        prog = generate(seed, index, focus=focus)
        for fam in prog.families:
            summary.families[fam] = summary.families.get(fam, 0) + 1
        res = run_program(prog, modes)
        for m, o in res.outcomes.items():
            cls = "crash" if o.cls == "invalid" else o.cls
            summary.mode_counts[m][cls] += 1
            if o.cls == "refusal":
                k = _refusal_key(o)
                summary.refusals[k] = summary.refusals.get(k, 0) + 1
                summary.refusal_examples.setdefault(k, prog.tag)
        cls = res.cls if res.cls != "invalid" else "crash"
        summary.counts[cls] += 1
        summary.n += 1
        if res.worst().bad or res.cls == "invalid":
            o = res.worst()
            path = None
            if out_dir is not None:
                small = prog
                k = shrunk_per_sig.get(o.signature, 0)
                if do_shrink and k < max_shrink_per_signature:
                    small = shrink(prog, o)
                    shrunk_per_sig[o.signature] = k + 1
                o2 = run_mode(small, o.mode)
                path = write_reproducer(small, o2 if o2.signature == o.signature else o,
                                        out_dir, f"{prog.tag}_{o.mode}_{o.cls}.py")
            summary.failures.append((res, o, path))
            if log:
                log(f"{o.cls.upper()} {prog.tag} [{o.mode}] {_first_line(o.detail)[:200]}"
                    + (f" -> {path}" if path else ""))
    summary.seconds = time.monotonic() - t0
    return summary
