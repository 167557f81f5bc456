"""The random-program fuzzer (``fxad.tools.fuzz``): a fixed-seed batch of programs through fxad's
reverse and forward mode against eager PyTorch, the generator itself, the fuzzer's ability to
see a wrong rule, and regression programs for the bugs it found."""
from __future__ import annotations

import contextlib
import dataclasses
import subprocess
import sys

import pytest
import torch

import fxad
from fxad.tools.fuzz import FAMILIES, Program, generate, run_batch, run_program
from fxad.tools.fuzz.generator import eager_ok
from fxad.tools.fuzz.runner import reproducer_source, shrink, write_reproducer
from fxad.rules import registry

CI_SEED = 0
CI_PROGRAMS = 500


def test_fixed_seed_batch():
    """The CI batch: every program passes or is refused with an fxad error naming the op and
    the line; none is wrong and none crashes."""
    summary = run_batch(CI_PROGRAMS, CI_SEED)
    print(summary.report())
    bad = [(res, o) for res, o, _ in summary.failures]
    msg = [summary.line()]
    for res, o in bad:
        msg += [f"--- {res.program.tag} {o.cls} in {o.mode} mode: {o.detail[:2000]}",
                res.program.source(), res.program.input_source()]
    assert not bad, "\n".join(msg)
    assert summary.counts["pass"] >= 0.8 * CI_PROGRAMS, summary.line()


# --------------------------------------------------------------------------------- generator
def test_generator_is_deterministic():
    for i in range(20):
        a, b = generate(7, i), generate(7, i)
        assert a.source() == b.source() and a.input_source() == b.input_source()
    assert generate(7, 0).source() != generate(8, 0).source()


def test_generator_covers_every_family():
    seen: dict[str, int] = {}
    for i in range(150):
        for fam in generate(CI_SEED, i).families:
            seen[fam] = seen.get(fam, 0) + 1
    missing = [f for f in FAMILIES if f not in seen]
    assert not missing, (missing, seen)


def test_generated_programs_are_valid_pytorch():
    for i in range(30):
        p = generate(3, i)
        assert eager_ok(p), p.source()
        compile(p.source(), "<test>", "exec")
        outs = p.compile()(*p.make_inputs())
        outs = outs if isinstance(outs, tuple) else (outs,)
        assert any(o.is_floating_point() for o in outs)


def test_program_from_source_roundtrip():
    p = generate(CI_SEED, 5)
    q = Program.from_source(p.source(), {i.name: i.ctor for i in p.inputs},
                            seed=p.input_seed)
    assert q.source() == p.source() and [s.defs for s in q.stmts] == [s.defs for s in p.stmts]


# ------------------------------------------------------------------- the fuzzer sees bugs
_PROGRAM = Program.from_source("""
def f(x0, x1):
    v0 = torch.sin(x0) * x1
    v1 = v0.sum(1)
    v2 = v1.exp()
    return v2
""", {"x0": "torch.randn((3, 4), dtype=torch.float64, generator=gen)",
      "x1": "torch.randn((4,), dtype=torch.float64, generator=gen)"}, seed=11)


def test_correct_program_passes():
    res = run_program(_PROGRAM)
    assert res.cls == "pass", {m: o.detail for m, o in res.outcomes.items()}


def test_detects_a_wrong_rule(tmp_path):
    orig = fxad.lookup(torch.sin)

    def bwd(aux, d):  # cos(x) * d is right; this drops a factor of 2 in
        return tuple(2 * g if g is not None else None for g in orig.bwd(aux, d))

    def jvp(primals, tangents):
        out, t = orig.jvp(primals, tangents)
        return out, 2 * t

    wrong = contextlib.ExitStack()
    wrong.enter_context(registry.overridden(
        torch.sin, rules=(dataclasses.replace(orig, bwd=bwd, jvp=jvp),)))
    res = run_program(_PROGRAM)
    assert res.outcomes["reverse"].cls == "wrong"
    assert "d_x0" in res.outcomes["reverse"].detail
    assert res.outcomes["forward"].cls == "wrong"
    # the shrunk reproducer still fails, is smaller, and runs on its own
    small = shrink(_PROGRAM, res.outcomes["reverse"])
    assert len(small.stmts) <= len(_PROGRAM.stmts) and "sin" in small.source()
    path = write_reproducer(small, res.outcomes["reverse"], str(tmp_path), "repro.py")
    text = open(path).read()
    assert "def f(" in text and "eager_reverse" in text
    wrong.close()
    # with the right rule the reproducer passes: run it in a fresh interpreter
    done = subprocess.run([sys.executable, path], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "fxad agrees with PyTorch" in done.stdout


def test_detects_a_crashing_rule():
    orig = fxad.lookup(torch.exp)

    def bwd(aux, d):
        raise IndexError("tuple index out of range")

    with registry.overridden(torch.exp, rules=(dataclasses.replace(orig, bwd=bwd),)):
        out = run_program(_PROGRAM, modes=("reverse",)).outcomes["reverse"]
    assert out.cls == "crash" and "IndexError" in out.detail


def test_clear_refusal_is_not_a_crash():
    p = Program.from_source("""
def f(x0):
    v0 = x0 * 2
    v1 = v0[0]
    v1.mul_(3)
    return v0, v1
""", {"x0": "torch.randn((3, 4), dtype=torch.float64, generator=gen)"})
    res = run_program(p)
    for o in res.outcomes.values():
        # mutation through a view: implemented (pass) or refused naming the op and line
        assert o.cls in ("pass", "refusal"), o.detail
        if o.cls == "refusal":
            assert "Tensor.mul_" in o.detail and ":7 in f: v1.mul_(3)" in o.detail


def test_reproducer_names_the_failure():
    p = generate(CI_SEED, 1)
    res = run_program(p)
    text = reproducer_source(p, res.outcomes["reverse"])
    assert text.startswith("# fxad fuzz reproducer") and p.source() in text


# ------------------------------------------------------- regression programs (found by fuzzing)
_F = "torch.randn({}, dtype=torch.float64, generator=gen)"
REGRESSIONS = {
    # the same value returned twice takes two cotangents: their placeholders shared one
    # argument name, so the generated code read the second cotangent twice
    "output_returned_twice": ("""
def f(x0):
    return x0, x0
""", {"x0": _F.format((4, 3))}),
    "intermediate_returned_twice": ("""
def f(x0):
    v0 = torch.sin(x0)
    return v0, v0, x0
""", {"x0": _F.format((3,))}),
    # a zero norm: forward mode transposed `where(norm == 0, 0, d / norm)` into a 0/0
    "norm_of_zero_row_forward": ("""
def f(x0):
    v0 = (x0 > 0).double() * x0
    v1 = v0.norm(dim=1, keepdim=True)
    v2 = torch.linalg.vector_norm(v0, 3, dim=1)
    return v1, v2
""", {"x0": "torch.tensor([[1.0, -2.0], [-1.0, -3.0]], dtype=torch.float64)"}),
    # a zero standard deviation: 0/0 in std's tangent and cotangent (autograd gives 0)
    "std_of_constant_row": ("""
def f(x0):
    v0 = x0.clone()
    v0[1] = 0.5
    v1 = v0.std(1)
    v2 = torch.std_mean(v0, 1)[0]
    return v1, v2
""", {"x0": _F.format((3, 4))}),
    # `x[mask] = v`: the backward read d[mask] (a data-dependent shape) even for a constant v
    "masked_setitem": ("""
def f(x0, x1):
    v0 = torch.mul(x0, 2.5)
    v0[x0 > 0.5] = 3
    v1 = x0 * 1
    v1[x0[:, 0] > 0.1] = x1
    v2 = x0 * 1
    v2[x0 < 0] = x1.sum()
    return v0, v1, v2
""", {"x0": _F.format((3, 4)), "x1": _F.format((1, 4))}),
    # a 0-d cotangent of a one-element tensor was not expanded to its shape (the gradient of
    # sum(x) for x of shape (1,) came back 0-d; a rule then received a 0-d cotangent)
    "one_element_reductions": ("""
def f(x0, x1):
    v0 = torch.sum(x0)
    v1 = torch.reshape(x1, (-1,))
    v2 = v1.narrow(0, 15, 1)
    v3 = v2.sum()
    v4 = torch.roll(x1[1:2, 0], 1, 0).sum()
    return v0, v3, v4
""", {"x0": _F.format((1,)), "x1": _F.format((4, 4))}),
    # a ** b with a tensor exponent b == 0 at a == 0: b * a ** (b - 1) = 0 * inf = nan (autograd
    # gives 0)
    "pow_zero_exponent_at_zero": ("""
def f(x0, n0):
    v0 = -x0
    v0 += x0
    v1 = v0 ** (n0 % 3)
    v2 = v0 ** (n0 % 3).double()
    return v1, v2
""", {"x0": _F.format((3, 1)), "n0": "torch.tensor([[0, 1], [2, 0], [1, 0]])"}),
    # clamp with one tensor bound equal to x: PyTorch's forward mode takes the bound's tangent
    # (its reverse mode gives x the cotangent); with a number bound, x's tangent
    "clamp_at_its_bound": ("""
def f(x0, x1):
    v0 = x0.detach()
    v1 = v0.clamp(min=x0)
    v2 = v0.clamp(max=x0)
    v3 = torch.relu(x0).clamp(min=0)
    v4 = torch.clamp(x0, x0.detach(), x0.detach())
    v5 = torch.clamp(x0.detach(), x0, x1)
    return v1, v2, v3, v4, v5
""", {"x0": _F.format((5,)), "x1": _F.format((5,))}),
    # the method form `x.where(cond, y)` had no rule
    "tensor_where_method": ("""
def f(x0, x1):
    v0 = x0.where(x0 > 0, x1)
    v1 = x1.where(x1 < 0.3, 0.0)
    return v0, v1
""", {"x0": _F.format((3, 4)), "x1": _F.format((4,))}),
}


@pytest.mark.parametrize("name", sorted(REGRESSIONS))
def test_regression_program(name):
    src, inputs = REGRESSIONS[name]
    p = Program.from_source(src, inputs, seed=5, tag=name)
    assert eager_ok(p), "the regression program itself is invalid"
    res = run_program(p)
    assert res.cls == "pass", {m: o.detail for m, o in res.outcomes.items()}
