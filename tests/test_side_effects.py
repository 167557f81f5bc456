"""Side effects inside the traced program: replayed by the generated code (RNG seeding and
state, a torch.Generator argument, print, NumPy draws) or announced (Python state changed
only at build time), in float64 against eager PyTorch and autograd."""
from __future__ import annotations

import importlib.util
import logging
import random
import sys
import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxad
from fxad.eject import load
from fxad.errors import CaptureError

DT = torch.float64


def _x(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=DT)


def _eager_grad(f, *inputs):
    xs = [a.detach().clone().requires_grad_() if isinstance(a, torch.Tensor)
          and a.is_floating_point() else a for a in inputs]
    out = f(*xs)
    grads = torch.autograd.grad(out, [a for a in xs if isinstance(a, torch.Tensor)
                                      and a.requires_grad])
    return out.detach(), grads


# -- torch.manual_seed / fork_rng / Generator argument -----------------------------------------
def seeded(x):
    torch.manual_seed(123)
    y = F.dropout(x, 0.4, training=True) * torch.sin(x)
    return (y + torch.randn(x.shape, dtype=x.dtype) * x).sum()


def test_manual_seed_replayed_on_every_call():
    x = _x(5, 4)
    g = fxad.grad(seeded, x)
    code = g.code
    assert "torch.manual_seed(123)" in code
    # the seed comes before the first draw
    assert code.index("torch.manual_seed(123)") < code.index("bernoulli_")
    for k in range(3):
        torch.manual_seed(1000 + k)  # the state before the call does not matter
        v, (d,) = g(x)
        ev, (ed,) = _eager_grad(seeded, x)
        torch.testing.assert_close(v, ev)
        torch.testing.assert_close(d, ed)


def test_manual_seed_in_jvp_and_vjp():
    x, t = _x(3, 4), _x(3, 4, seed=1)
    j = fxad.jvp(seeded, x)
    out, tan = j(x, t)
    _, ejvp = torch.func.jvp(lambda a: seeded(a), (x,), (t,))
    torch.testing.assert_close(out, seeded(x))
    torch.testing.assert_close(tan, ejvp)
    v = fxad.vjp(seeded, x)
    res = v(x, torch.tensor(2.0, dtype=DT))
    _, (ed,) = _eager_grad(seeded, x)
    torch.testing.assert_close(res[1][0], 2 * ed)


def test_fork_rng_restores_the_state():
    def f(x):
        with torch.random.fork_rng():
            torch.manual_seed(7)
            a = torch.rand(x.shape, dtype=x.dtype)
        return (x * a * torch.rand(x.shape, dtype=x.dtype)).sum()

    x = _x(4, 3)
    g = fxad.grad(f, x)
    assert "torch.get_rng_state()" in g.code and "torch.set_rng_state(" in g.code
    for seed in (3, 4):
        torch.manual_seed(seed)
        v, (d,) = g(x)
        after = torch.rand(2)
        torch.manual_seed(seed)
        ev, (ed,) = _eager_grad(f, x)
        eafter = torch.rand(2)
        torch.testing.assert_close(v, ev)
        torch.testing.assert_close(d, ed)
        torch.testing.assert_close(after, eafter)  # the global state advanced alike


def test_generator_argument():
    def f(x, gen):
        noise = torch.randn(x.shape, generator=gen, dtype=x.dtype)
        keep = torch.bernoulli(torch.full(x.shape, 0.6, dtype=x.dtype), generator=gen)
        return (x * noise * keep + x.exp()).sum()

    x = _x(3, 5)
    g = fxad.grad(f, x, torch.Generator().manual_seed(0))
    assert "generator = gen" in g.code
    for seed in (1, 2, 3):
        v, (d, dg) = g(x, torch.Generator().manual_seed(seed))
        ev, (ed,) = _eager_grad(f, x, torch.Generator().manual_seed(seed))
        assert dg is None
        torch.testing.assert_close(v, ev)
        torch.testing.assert_close(d, ed)


def test_generator_reseeded_by_the_program_is_announced_and_kept():
    def f(x, gen):
        gen.manual_seed(0)
        return (x * torch.rand(x.shape, generator=gen, dtype=x.dtype)).sum()

    gen = torch.Generator().manual_seed(5)
    state = gen.get_state()
    with pytest.warns(UserWarning, match="changes the state of its torch.Generator"):
        fxad.grad(f, _x(3), gen)
    assert torch.equal(gen.get_state(), state)


def test_generator_made_inside_is_refused():
    def f(x):
        gen = torch.Generator().manual_seed(0)
        return (x * torch.rand(x.shape, generator=gen, dtype=x.dtype)).sum()

    with pytest.raises(CaptureError, match="torch.Generator") as e:
        fxad.grad(f, _x(2))
    assert "pass the generator in as an argument" in str(e.value)


class SeededDropout(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4, dtype=DT)

    def forward(self, x):
        torch.manual_seed(11)
        h = F.dropout(self.lin(x), 0.3, training=True)
        print("h", h.detach().sum())
        return (h * torch.rand(h.shape, dtype=h.dtype)).pow(2).sum()


def test_manual_seed_and_print_in_compile(capsys):
    torch.manual_seed(0)
    m = SeededDropout()
    x = _x(6, 4)
    cm = fxad.compile(m, x)
    capsys.readouterr()
    for _ in range(2):
        m.zero_grad()
        loss = cm(x)
        loss.backward()
        printed = capsys.readouterr().out
        got = [p.grad.clone() for p in m.parameters()]
        m.zero_grad()
        eloss = m(x)
        eloss.backward()
        assert printed == capsys.readouterr().out  # once per call, in the forward
        torch.testing.assert_close(loss, eloss)
        for a, b in zip(got, [p.grad for p in m.parameters()]):
            torch.testing.assert_close(a, b)


def test_manual_seed_and_print_in_joint_step(capsys):
    torch.manual_seed(0)
    m = SeededDropout()
    x = _x(6, 4)
    step = fxad.joint_step(m, x, compile=False)
    capsys.readouterr()
    for _ in range(2):
        loss, _, pgrads = step(x)
        printed = capsys.readouterr().out
        m.zero_grad()
        eloss = m(x)
        eloss.backward()
        assert printed == capsys.readouterr().out
        torch.testing.assert_close(loss, eloss.detach())
        for name, p in m.named_parameters():
            torch.testing.assert_close(pgrads[name], p.grad)


def test_build_leaves_the_random_states_alone():
    x = _x(5, 3)
    for build in (lambda: fxad.grad(seeded, x), lambda: fxad.grad(numpy_program, x)):
        torch.manual_seed(0)
        np.random.seed(0)
        want = torch.rand(3), np.random.rand(3)
        torch.manual_seed(0)
        np.random.seed(0)
        build()
        torch.testing.assert_close(torch.rand(3), want[0])
        np.testing.assert_array_equal(np.random.rand(3), want[1])


def python_layerdrop(x, w):
    for _ in range(4):
        scale = random.uniform(0.5, 1.5)
        if random.random() < 0.5:  # LayerDrop with Python's generator: a torch.cond
            x = torch.tanh(x @ w) * scale
    return (x * x).sum()


def test_python_float_draws_replayed_on_every_call():
    x, w = _x(2, 3), _x(3, 3, seed=1)
    state = random.getstate()
    g = fxad.grad(python_layerdrop, x, w)
    assert random.getstate() == state  # nothing drawn from Python's generator by the build
    assert "fxad_python_draw('uniform', 0.5, 1.5)" in g.code and "fxad_cond(" in g.code
    outs = set()
    for seed in range(8):
        random.seed(seed)
        v, (dx, dw) = g(x, w)
        after = random.getstate()
        random.seed(seed)
        ev, (edx, edw) = _eager_grad(python_layerdrop, x, w)
        assert random.getstate() == after  # Python's state advanced as eager's
        torch.testing.assert_close(v, ev)
        torch.testing.assert_close(dx, edx)
        torch.testing.assert_close(dw, edw)
        outs.add(round(float(v), 9))
    assert len(outs) > 2  # the layers run and are skipped as the draws say


def test_python_draws_in_compile():
    class Drop(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(_x(3, 3, seed=1))

        def forward(self, x):
            return python_layerdrop(x, self.w)

    m, x = Drop().train(), _x(2, 3)
    cm = fxad.compile(m, x)
    for seed in range(4):
        random.seed(seed)
        m.zero_grad()
        v = cm(x)
        v.backward()
        got = (v.detach(), m.w.grad.clone())
        random.seed(seed)
        m.zero_grad()
        ev = m(x)
        ev.backward()
        torch.testing.assert_close(got[0], ev.detach())
        torch.testing.assert_close(got[1], m.w.grad)


def test_python_integer_draw_is_refused_naming_the_line():
    def f(x):
        k = random.randint(1, 3)
        return (x * k).sum()

    state = random.getstate()
    with pytest.raises(fxad.errors.CaptureError, match=r"random.randint draws a Python value") as e:
        fxad.grad(f, _x(3))
    assert e.value.loc is not None and e.value.loc.lineno == f.__code__.co_firstlineno + 1
    assert "torch.rand(())" in str(e.value)
    assert random.getstate() == state


@pytest.mark.parametrize("effect", ["random", "numpy", "seed"])
def test_effects_inside_a_branch_are_refused_naming_the_line(effect):
    # capture runs both branches and the branch's derivative runs it again: the effect
    # cannot happen once per call (a Python draw there was a constant of the code before)
    def f(x):
        if torch.rand(()) < 0.5:
            if effect == "random":
                x = x * random.random()
            elif effect == "numpy":
                x = x * torch.tensor(np.random.rand(3))
            else:
                torch.manual_seed(0)
        return (x * x).sum()

    with pytest.raises(fxad.errors.CaptureError, match=r"inside a torch.cond / while_loop / "
                       r"scan body(.|\n)*test_side_effects.py:\d+ in \w+: (x = x \*|torch.manual)"):
        fxad.grad(f, _x(3))


# -- print -----------------------------------------------------------------------------------
def printing(x):
    y = torch.tanh(x) * 2
    print("y norm", torch.linalg.vector_norm(y), "shape", tuple(y.shape))
    z = y.sum() * 3
    print("z", z, sep=": ")
    return z


def test_print_replayed_with_real_values(capsys):
    x = _x(3, 2)
    g = fxad.grad(printing, x)
    build_out = capsys.readouterr().out
    assert build_out == ""  # nothing printed at build time
    lines = [ln.strip() for ln in g.code.splitlines()]
    assert any(ln.startswith("print('y norm', ") for ln in lines)
    assert any(ln.startswith("print('z', ") for ln in lines)
    for seed in (0, 1):
        xs = _x(3, 2, seed=seed)
        _, (d,) = g(xs)
        got = capsys.readouterr().out
        with torch.no_grad():
            printing(xs)
        want = capsys.readouterr().out
        assert got == want and "tensor(" in got
        # the print carries no derivative: the gradient is the plain one
        _, (ed,) = _eager_grad(printing, xs)
        capsys.readouterr()
        torch.testing.assert_close(d, ed)


def test_print_order_in_vjp_and_jvp(capsys):
    def f(x):
        print("first")
        y = x.sin()
        print("second", y.sum())
        return y.sum()

    x = _x(4)
    v = fxad.vjp(f, x)
    capsys.readouterr()
    v(x, torch.tensor(1.0, dtype=DT))
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "first" and out[1].startswith("second tensor(")
    j = fxad.jvp(f, x)
    capsys.readouterr()
    j(x, torch.ones_like(x))
    assert capsys.readouterr().out.splitlines()[0] == "first"


def test_print_of_formatted_tensors(capsys):
    def f(x):
        y = x.sin()
        n = torch.linalg.vector_norm(y)
        print(f"norm {n:.4f} of {{y}}:", f"{y}", "as str", str(n), "{:.2e}".format(n))
        return y.sum()

    g = fxad.grad(f, _x(3))
    assert "'norm {:.4f} of {{y}}:'.format(" in g.code
    assert capsys.readouterr().out == ""
    for seed in (1, 2):
        xs = _x(3, seed=seed)
        g(xs)
        got = capsys.readouterr().out
        with torch.no_grad():
            f(xs)
        assert got == capsys.readouterr().out and "<fxad-value" not in got


def test_print_inside_a_cond_body_is_announced():
    def f(x):
        def pos(x):
            print("positive branch")
            return x.sin()

        return torch.cond(x.sum() > 0, pos, lambda x: x.cos(), (x,)).sum()

    with pytest.warns(UserWarning, match="inside a torch.cond / while_loop / scan body"):
        fxad.grad(f, _x(3))


# -- Python effects at build time only ----------------------------------------------------------
CALLS: list = []
COUNTER = 0


class _Stats:
    seen = 0


STATS = _Stats()


def effectful(x):
    global COUNTER
    COUNTER += 1
    CALLS.append(tuple(x.shape))
    STATS.seen = STATS.seen + 1
    return x.sum()


def test_python_effects_warned_with_their_lines():
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        fxad.grad(effectful, _x(3))
    msgs = [str(m.message) for m in w]
    src = effectful.__code__.co_firstlineno
    assert any("`COUNTER`" in m and f"test_side_effects.py:{src + 2}" in m for m in msgs), msgs
    assert any("`CALLS`" in m and f"test_side_effects.py:{src + 3}" in m for m in msgs), msgs
    assert any("`STATS`" in m and "`seen`" in m and f"test_side_effects.py:{src + 4}" in m
               for m in msgs), msgs


def test_closure_and_module_attribute_effects_warned():
    log = []

    def f(x):
        log.append(1)
        return x.sum()

    with pytest.warns(UserWarning, match=r"outer variable `log` is changed in place"):
        fxad.grad(f, _x(2))

    class Counting(nn.Module):
        def __init__(self):
            super().__init__()
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            return x.sum()

    with pytest.warns(UserWarning, match=r"module attribute `calls` is rebound.*self.calls"):
        fxad.vjp(Counting(), _x(2))


def test_pure_program_gives_no_effect_warning():
    def f(x):
        scale = 2.0
        return (x * scale).sum()

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fxad.grad(f, _x(3))


# -- NumPy draws ----------------------------------------------------------------------------------
def numpy_program(x):
    perm = np.random.permutation(x.shape[0])
    noise = torch.from_numpy(np.random.rand(*x.shape))
    scale = torch.tensor(np.random.uniform(1.0, 2.0, size=(x.shape[1],)))
    return (x[torch.as_tensor(perm)] * noise * scale).sum()


def test_numpy_draws_replayed():
    x = _x(5, 3)
    g = fxad.grad(numpy_program, x)
    assert "numpy.random.permutation(5)" in g.code and "numpy.random.rand(5, 3)" in g.code
    for seed in (0, 1, 2):
        np.random.seed(seed)
        v, (d,) = g(x)
        np.random.seed(seed)
        ev, (ed,) = _eager_grad(numpy_program, x)
        torch.testing.assert_close(v, ev)
        torch.testing.assert_close(d, ed)


def test_numpy_draw_through_numpy_code_is_refused():
    def f(x):
        a = np.random.rand(3) * 2 + 1
        return (x * torch.tensor(a)).sum()

    line = f.__code__.co_firstlineno
    with pytest.raises(CaptureError) as e:
        fxad.grad(f, _x(3))
    msg = str(e.value)
    assert f"test_side_effects.py:{line + 1}" in msg and f"test_side_effects.py:{line + 2}" in msg


def test_numpy_draw_changed_in_place_is_refused():
    def f(x):
        perm = np.random.permutation(3)
        perm[0] = 0
        return x[torch.from_numpy(perm)].sum()

    with pytest.raises(CaptureError, match="computed or changed it"):
        fxad.grad(f, _x(3))


def numpy_layerdrop(x, w):
    for _ in range(3):
        p = np.random.rand()
        if not p < 0.5:  # LayerDrop as older code writes it with NumPy: a torch.cond
            x = torch.tanh(x @ w) * np.random.uniform(0.5, 1.5)
    return (x * x).sum()


def test_numpy_float_draw_replayed_as_a_decision():
    x, w = _x(2, 3), _x(3, 3, seed=1)
    with pytest.raises(CaptureError, match="inside a torch.cond"):  # drawn in the branch
        fxad.grad(numpy_layerdrop, x, w)

    def drawn_before(x, w):
        for _ in range(3):
            p, scale = np.random.rand(), np.random.uniform(0.5, 1.5)
            if not p < 0.5:
                x = torch.tanh(x @ w) * scale
        return (x * x).sum() + w.sum()

    g = fxad.grad(drawn_before, x, w)
    assert "fxad_numpy_draw('rand')" in g.code and "fxad_cond(" in g.code
    for seed in range(6):
        np.random.seed(seed)
        v, (dx, dw) = g(x, w)
        after = np.random.get_state()[1].copy()
        np.random.seed(seed)
        ev, (edx, edw) = _eager_grad(drawn_before, x, w)
        assert np.array_equal(np.random.get_state()[1], after)
        torch.testing.assert_close(v, ev)
        torch.testing.assert_close(dx, edx)
        torch.testing.assert_close(dw, edw)


def test_numpy_integer_scalar_draw_is_refused():
    def f(x):
        return x[: np.random.randint(1, 3)].sum()

    with pytest.raises(CaptureError, match="numpy.random.randint draws a number"):
        fxad.grad(f, _x(3))


def _saved(g, folder, name):
    """``g`` written with ``to_folder`` and loaded back as a fresh module."""
    g.to_folder(folder, name)
    spec = importlib.util.spec_from_file_location(f"{name}_fx", folder / "module.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[f"{name}_fx"] = mod
    try:
        spec.loader.exec_module(mod)
        return getattr(mod, name)()
    finally:
        sys.modules.pop(f"{name}_fx", None)


def test_saved_code_is_self_contained(tmp_path):
    x = _x(4, 3)
    g = fxad.vjp(lambda x: seeded(x) + numpy_program(x), x)
    saved = _saved(g, tmp_path / "saved", "Saved")
    one = torch.tensor(1.0, dtype=DT)
    np.random.seed(5)
    a = g(x, one)
    np.random.seed(5)
    b = saved(x, one)
    torch.testing.assert_close(a[0], b[0])
    torch.testing.assert_close(a[1][0], b[1][0])


# -- modules built inside forward -------------------------------------------------------------
class LossInForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3, dtype=DT)

    def forward(self, x, y):
        crit = nn.BCEWithLogitsLoss(pos_weight=torch.tensor(5.0, dtype=DT))
        return crit(self.lin(x), y) + nn.L1Loss()(x, y)


def test_module_without_parameters_built_in_forward():
    torch.manual_seed(0)
    m = LossInForward()
    x, y = _x(4, 3), torch.rand(4, 3, dtype=DT)
    out, grads, pgrads = fxad.vjp(m, x, y)(x, y, torch.tensor(1.0, dtype=DT))
    xr = x.clone().requires_grad_()
    yr = y.clone().requires_grad_()
    loss = m(xr, yr)
    loss.backward()
    torch.testing.assert_close(out, loss.detach())
    torch.testing.assert_close(grads[0], xr.grad)
    torch.testing.assert_close(grads[1], yr.grad)
    for name, p in m.named_parameters():
        torch.testing.assert_close(pgrads[name], p.grad)


def test_module_with_parameters_built_in_forward_is_refused():
    class Bad(nn.Module):
        def forward(self, x):
            return nn.Linear(3, 3, dtype=DT)(x).sum()

    with pytest.raises(CaptureError, match="nn.Parameter is created inside") as e:
        fxad.vjp(Bad(), _x(2, 3))
    assert "nn.Linear(3, 3, dtype=DT)(x)" in str(e.value)


# -- NumPy seeded inside the program: its draws are constants ----------------------------------
def _block_table(n: int, seed: int) -> np.ndarray:
    """Random blocks as BigBird-Pegasus picks them: a seed, permutations of index arrays,
    slices, a concatenation, Python decisions on the drawn numbers, rows set into zeros."""
    np.random.seed(seed)
    middle = np.arange(1, n - 1, dtype=np.int32)
    table = np.zeros((n - 2, 2), dtype=np.int32)
    for i in range(n - 2):
        perm = np.random.permutation(np.concatenate((middle[:i], middle[i + 1:])))
        picked = [v for v in perm if v not in (0, i + 1)][:2]
        table[i, :] = picked
    return table


def seeded_numpy_program(x, w):
    rows = [_block_table(x.shape[0], seed) for seed in (0, 1)]
    blocks = torch.tensor(np.stack(rows, axis=0), dtype=torch.long)  # (2, n-2, 2)
    picked = x[blocks]  # (2, n-2, 2, d)
    noise = torch.from_numpy(np.random.rand(x.shape[1]))
    return ((picked * w).tanh().sum(dim=(0, 2)) * noise).pow(2).sum()


def test_numpy_seeded_inside_draws_are_constants():
    x, w = _x(6, 3), _x(3, seed=1)
    g = fxad.grad(seeded_numpy_program, x, w)
    code = g.code
    # one line sets NumPy's state (the state eager has after the last draw); no draw replayed
    assert code.count("numpy.random.set_state(('MT19937', ") == 1, code
    assert "numpy.random.permutation" not in code and "numpy.random.rand" not in code
    assert not any(n.target is fxad.guards.expect for n in g.graph.nodes)
    for seed in range(3):
        xs, ws = _x(6, 3, seed=10 + seed), _x(3, seed=20 + seed)
        np.random.seed(100 + seed)
        v, (dx, dw) = g(xs, ws)
        after = np.random.get_state()
        np.random.seed(200 + seed)  # eager's state before the call does not matter either
        ev, (edx, edw) = _eager_grad(seeded_numpy_program, xs, ws)
        eafter = np.random.get_state()
        torch.testing.assert_close(v, ev)
        torch.testing.assert_close(dx, edx)
        torch.testing.assert_close(dw, edw)
        assert after[2:] == eafter[2:] and np.array_equal(after[1], eafter[1])


def test_numpy_seeded_inside_in_vjp_and_jvp():
    x, w = _x(5, 2), _x(2, seed=1)
    v = fxad.vjp(seeded_numpy_program, x, w)
    ct = torch.tensor(0.5, dtype=DT)
    out, (dx, dw) = v(x, w, ct)[:2]
    ev, (edx, edw) = _eager_grad(seeded_numpy_program, x, w)
    torch.testing.assert_close(out, ev)
    torch.testing.assert_close(dx, 0.5 * edx)
    torch.testing.assert_close(dw, 0.5 * edw)
    j = fxad.jvp(lambda x: seeded_numpy_program(x, w), x)
    tx = _x(5, 2, seed=3)
    out, tan = j(x, tx)
    _, etan = torch.func.jvp(lambda a: seeded_numpy_program(a, w), (x,), (tx,))
    torch.testing.assert_close(tan, etan)
    h = fxad.hvp(lambda x: seeded_numpy_program(x, w), x)
    _, ehv = torch.autograd.functional.hvp(lambda a: seeded_numpy_program(a, w), x, tx)
    torch.testing.assert_close(h(x, tx)[1][0], ehv)


def test_numpy_state_read_and_restored_inside_is_replayed():
    def f(x):
        saved = np.random.get_state()
        np.random.seed(3)
        perm = torch.from_numpy(np.random.permutation(np.arange(x.shape[0]))[::-1].copy())
        np.random.set_state(saved)
        noise = torch.from_numpy(np.random.rand(*x.shape))  # the caller's stream
        return (x[perm] * noise).sum()

    x = _x(4, 2)
    g = fxad.grad(f, x)
    code = g.code
    assert "numpy.random.get_state()" in code and "numpy.random.rand(4, 2)" in code
    for seed in (0, 1):
        np.random.seed(seed)
        v, (d,) = g(x)
        after = np.random.rand(3)
        np.random.seed(seed)
        ev, (ed,) = _eager_grad(f, x)
        torch.testing.assert_close(v, ev)
        torch.testing.assert_close(d, ed)
        np.testing.assert_array_equal(after, np.random.rand(3))


def test_numpy_seeded_from_entropy_keeps_replay_or_refusal():
    def replayed(x):
        np.random.seed()
        return (x * torch.from_numpy(np.random.rand(*x.shape))).sum()

    g = fxad.grad(replayed, _x(3))
    assert "numpy.random.seed()" in g.code and "numpy.random.rand(3)" in g.code

    def computed(x):
        np.random.seed(None)
        perm = np.random.permutation(np.arange(3))
        return x[torch.tensor(perm)].sum()

    line = computed.__code__.co_firstlineno
    with pytest.raises(CaptureError, match="called with a NumPy array") as e:
        fxad.grad(computed, _x(3))
    assert f"test_side_effects.py:{line + 2}" in str(e.value)

    def unseen(x):  # a Generator seeded from entropy: arrays of draws fxad does not see
        np.random.seed(0)
        rng = np.random.default_rng()
        return (x * torch.tensor(rng.random(3))).sum()

    with pytest.raises(CaptureError, match="default_rng"):
        fxad.grad(unseen, _x(3))


def test_numpy_seeded_code_saved_with_to_folder(tmp_path):
    x, w = _x(6, 3), _x(3, seed=1)
    g = fxad.vjp(seeded_numpy_program, x, w)
    saved = _saved(g, tmp_path / "seeded", "Seeded")
    one = torch.tensor(1.0, dtype=DT)
    np.random.seed(5)
    a = g(x, w, one)
    after = np.random.get_state()
    np.random.seed(6)
    b = saved(x, w, one)
    torch.testing.assert_close(a[0], b[0])
    torch.testing.assert_close(a[1][0], b[1][0])
    torch.testing.assert_close(a[1][1], b[1][1])
    assert np.array_equal(after[1], np.random.get_state()[1])


# -- numbers read only to be printed --------------------------------------------------------------
def printing_numbers(x, w):
    y = torch.tanh(x @ w)
    loss = (y * y).mean()
    print(f"loss {loss.item():.4f} max {y.max().item()!r}")
    print(float(loss), "{:.2e} of {}".format(y.sum().item(), x.shape[0]), sep=" | ")
    print("positive", int((y > 0).sum()))
    return loss


@pytest.mark.parametrize("values", ["guard", "refuse"])
def test_number_read_only_to_print_is_printed_without_a_guard(capsys, values):
    x, w = _x(4, 3), _x(3, 2, seed=1)
    g = fxad.grad(printing_numbers, x, w, values=values)
    assert capsys.readouterr().out == ""  # nothing printed at build time
    assert not any(n.target is fxad.guards.expect for n in g.graph.nodes)
    code = g.code
    assert "'loss {:.4f} max {!r}'.format(" in code and "print(printed_" in code and "fxad_printed(" in code
    for seed in range(3):
        xs, ws = _x(4, 3, seed=10 + seed), _x(3, 2, seed=20 + seed)
        v, (dx, dw) = g(xs, ws)  # other values: no InputError
        got = capsys.readouterr().out
        ev, (edx, edw) = _eager_grad(printing_numbers, xs, ws)
        want = capsys.readouterr().out
        assert got == want and "<fxad-value" not in got and got.count("\n") == 3
        torch.testing.assert_close(v, ev)
        torch.testing.assert_close(dx, edx)
        torch.testing.assert_close(dw, edw)


def test_printed_number_in_compile_and_jvp(capsys):
    class Printing(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(_x(3, 2, seed=1))

        def forward(self, x):
            return printing_numbers(x, self.w)

    m, x = Printing(), _x(4, 3)
    cm = fxad.compile(m, x)
    capsys.readouterr()
    for seed in range(2):
        xs = _x(4, 3, seed=5 + seed)
        m.zero_grad()
        cm(xs).backward()
        got, grad = capsys.readouterr().out, m.w.grad.clone()
        m.zero_grad()
        m(xs).backward()
        assert got == capsys.readouterr().out
        torch.testing.assert_close(grad, m.w.grad)
    w = _x(3, 2, seed=1)
    j = fxad.jvp(lambda x: printing_numbers(x, w), x)
    capsys.readouterr()
    xs, tx = _x(4, 3, seed=7), _x(4, 3, seed=8)
    _, tan = j(xs, tx)
    got = capsys.readouterr().out
    _, etan = torch.func.jvp(lambda a: printing_numbers(a, w), (xs,), (tx,))
    assert got == capsys.readouterr().out
    torch.testing.assert_close(tan, etan)


def test_number_used_besides_printing_is_still_guarded():
    def f(x):
        s = x.sum().item()  # kept in a variable: a value of the program, guarded
        print(f"s {s:.2f}")
        return x.sum() * 2

    g = fxad.grad(f, _x(3))
    assert any(n.target is fxad.guards.expect for n in g.graph.nodes)
    with pytest.raises(fxad.errors.InputError):
        g(_x(3, seed=4))


def test_printed_number_code_ejects(tmp_path, capsys):
    x, w = _x(4, 3), _x(3, 2, seed=1)
    fxad.eject(printing_numbers, x, w, path=tmp_path / "printing.py")
    ejected = load(tmp_path / "printing.py")
    capsys.readouterr()
    xs = _x(4, 3, seed=3)
    out = ejected.vjp(xs, w, torch.tensor(1.0, dtype=DT))
    got = capsys.readouterr().out
    ev, (edx, _) = _eager_grad(printing_numbers, xs, w)
    assert got == capsys.readouterr().out
    torch.testing.assert_close(out[1][0], edx)


def test_numpy_scalar_draw_after_a_constant_seed_is_a_constant():
    def f(x):
        np.random.seed(4)
        if np.random.rand() < 0.5:  # a decision on a known number: no guard, no refusal
            x = x * 2
        return (x * float(np.random.normal())).sum()

    g = fxad.grad(f, _x(3))
    assert "numpy.random.rand" not in g.code
    for seed in (0, 1):
        xs = _x(3, seed=seed)
        np.random.seed(seed)
        v, (d,) = g(xs)
        after = np.random.rand(2)
        ev, (ed,) = _eager_grad(f, xs)
        torch.testing.assert_close(v, ev)
        torch.testing.assert_close(d, ed)
        np.testing.assert_array_equal(after, np.random.rand(2))


# -- numbers and tensors read only to be logged ----------------------------------------------------
_LOG = logging.getLogger("fxad_test_program")


class _Recorder:
    """Has logging's method names but is no logger: what it is given is a value of the program."""

    def info(self, *args):
        self.last = args


def logging_numbers(x, w):
    y = torch.tanh(x @ w)
    loss = (y * y).mean()
    _LOG.info("loss %.4f", loss.item())
    _LOG.warning(f"max {y.max().item():.3f} of {x.shape[0]}")
    _LOG.debug("not logged at INFO %s", float(loss))
    logging.getLogger("fxad_test_program").log(logging.INFO, "sum %.4f", y.sum())  # a tensor
    _LOG.info("plain text")  # no traced value: logged when the program runs at build time
    return loss


def _messages(caplog):
    out = [(r.name, r.levelno, r.getMessage()) for r in caplog.records]
    caplog.clear()
    return out


@pytest.mark.parametrize("values", ["guard", "refuse"])
def test_number_read_only_to_log_is_logged_without_a_guard(caplog, values):
    caplog.set_level(logging.INFO, logger="fxad_test_program")
    x, w = _x(4, 3), _x(3, 2, seed=1)
    g = fxad.grad(logging_numbers, x, w, values=values)
    assert _messages(caplog) == [("fxad_test_program", logging.INFO, "plain text")]
    assert not any(n.target is fxad.guards.expect for n in g.graph.nodes)
    assert "fxad_log('fxad_test_program', 20, 'loss %.4f', printed" in g.code
    for seed in range(3):
        xs, ws = _x(4, 3, seed=10 + seed), _x(3, 2, seed=20 + seed)
        v, (dx, dw) = g(xs, ws)  # other values: no InputError
        got = _messages(caplog)
        ev, (edx, edw) = _eager_grad(logging_numbers, xs, ws)
        want = [m for m in _messages(caplog) if m[2] != "plain text"]
        assert got == want and len(got) == 3 and "<fxad-value" not in str(got)
        torch.testing.assert_close(v, ev)
        torch.testing.assert_close(dx, edx)
        torch.testing.assert_close(dw, edw)
    # the logger's level is read at call time
    caplog.set_level(logging.DEBUG, logger="fxad_test_program")
    g(x, w)
    assert not any("not logged" in m[2] for m in _messages(caplog))  # below the build's level


def test_logged_number_in_compile_and_eject(caplog, tmp_path):
    caplog.set_level(logging.INFO, logger="fxad_test_program")

    class Logging(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(_x(3, 2, seed=1))

        def forward(self, x):
            return logging_numbers(x, self.w)

    m, x = Logging(), _x(4, 3)
    cm = fxad.compile(m, x)
    for seed in range(2):
        xs = _x(4, 3, seed=5 + seed)
        caplog.clear()
        m.zero_grad()
        cm(xs).backward()
        got, grad = _messages(caplog), m.w.grad.clone()
        m.zero_grad()
        m(xs).backward()
        assert got == [r for r in _messages(caplog) if r[2] != "plain text"]
        torch.testing.assert_close(grad, m.w.grad)
    w = _x(3, 2, seed=1)
    fxad.eject(logging_numbers, x, w, path=tmp_path / "logging_numbers.py")
    ejected = load(tmp_path / "logging_numbers.py")
    caplog.clear()
    xs = _x(4, 3, seed=3)
    out = ejected.vjp(xs, w, torch.tensor(1.0, dtype=DT))
    got = _messages(caplog)
    _, (edx, _) = _eager_grad(logging_numbers, xs, w)
    assert got == [r for r in _messages(caplog) if r[2] != "plain text"]
    torch.testing.assert_close(out[1][0], edx)


def test_number_given_to_an_object_that_is_no_logger_is_guarded():
    rec = _Recorder()

    def f(x):
        rec.info("s", x.sum().item())  # not a logger: a value of the program, guarded
        return x.sum() * 2

    g = fxad.grad(f, _x(3))
    assert any(n.target is fxad.guards.expect for n in g.graph.nodes)
    with pytest.raises(fxad.errors.InputError):
        g(_x(3, seed=4))


def test_python_draw_code_ejects(tmp_path):
    def f(x):
        return (x * random.uniform(1.0, 2.0)).sum()

    x = _x(3)
    fxad.eject(f, x, path=tmp_path / "drawing.py")
    ejected = load(tmp_path / "drawing.py")
    random.seed(3)
    out = ejected.vjp(x, torch.tensor(1.0, dtype=DT))
    random.seed(3)
    ev, (edx,) = _eager_grad(f, x)
    torch.testing.assert_close(out[0], ev)
    torch.testing.assert_close(out[1][0], edx)


def test_logging_of_values_that_cannot_be_replayed_is_announced():
    def f(x):
        y = torch.sin(x).sum()
        _LOG.warning("y %s", y, extra={"tag": 1})
        return y

    with pytest.warns(UserWarning, match=r"logging call at .*test_side_effects.py:\d+ .*with "
                                         r"exc_info, extra"):
        g = fxad.grad(f, _x(3))
    assert "fxad_log" not in g.code

    def h(x):
        if torch.rand(()) < 0.5:
            x = x * 2
            _LOG.warning("x %s", x.sum())
        return x.sum()

    with pytest.warns(UserWarning, match=r"logging call at .* inside a torch.cond"):
        fxad.grad(h, _x(3))


def test_effects_survive_tracing_the_generated_code_again(capsys, caplog):
    # the gradient of a gradient traces fxad's own code: its draws stay draws (a constant
    # before), its printed and logged numbers stay unguarded
    caplog.set_level(logging.INFO, logger="fxad_test_program")

    def f(x):
        s = random.uniform(0.5, 1.5) * np.random.uniform(0.5, 1.5)
        y = (torch.sin(x) * s).sum()
        print(f"y {y.item():.4f}")
        _LOG.info("y %.4f", y.item())
        return y

    x = _x(3)
    g = fxad.grad(f, x)
    gg = fxad.grad(lambda x: g(x)[1][0].sum(), x)
    assert not any(n.target is fxad.guards.expect for n in gg.graph.nodes)
    assert "fxad_python_draw(" in gg.code and "fxad_log(" in gg.code
    capsys.readouterr()
    caplog.clear()
    for seed in range(3):
        xs = _x(3, seed=4 + seed)
        random.seed(seed)
        np.random.seed(seed)
        got = gg(xs)[1][0]
        printed, logged = capsys.readouterr().out, _messages(caplog)
        random.seed(seed)
        np.random.seed(seed)
        xe = xs.clone().requires_grad_()
        (d,) = torch.autograd.grad(f(xe), xe, create_graph=True)
        (want,) = torch.autograd.grad(d.sum(), xe)
        torch.testing.assert_close(got, want)
        assert printed == capsys.readouterr().out and logged == _messages(caplog)
