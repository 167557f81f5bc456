"""Sizes drawn anew on every call: a data-dependent size computed from a random draw (the
experts' token counts of a mixture of experts after dropout, read with ``.tolist()``) is an
unbacked symbolic size through capture, the engines and the generated code, which reads it
on every call and checks every assumption made about it (float64, against autograd)."""
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxad

D = torch.float64


class TinyMoE(nn.Module):
    """Top-1 routing after dropout: the token count of each expert changes from call to
    call; tokens are grouped by expert with ``split(expert_size)``, each group goes through
    its expert, and the outputs are scattered back with ``index_add``."""

    def __init__(self, d: int = 4, h: int = 6, experts: int = 3) -> None:
        super().__init__()
        self.router = nn.Linear(d, experts, bias=False)
        self.w = nn.Parameter(torch.randn(experts, h, d))
        self.experts = experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.dropout(x, 0.3, training=True)
        logits = self.router(x)
        top = logits.argmax(1)
        counts = F.one_hot(top, self.experts).sum(0)
        expert_size = counts.tolist()
        _, order = top.sort(0)
        parts = x[order].split(expert_size, dim=0)
        outs = [F.linear(parts[i], self.w[i]) for i in range(self.experts)]
        y = torch.cat(outs, 0)
        gate = logits.softmax(1).max(1).values[order]
        y = y * gate[:, None]
        return torch.zeros(x.shape[0], y.shape[1], dtype=y.dtype).index_add(0, order, y)


def _model() -> TinyMoE:
    torch.manual_seed(0)
    return TinyMoE().to(D)


def _close(a, b, equal_nan=False):
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, equal_nan=equal_nan)


def _grad_matches(g, f, x: torch.Tensor, seed: int, equal_nan: bool = False) -> None:
    """fxad's gradient ``g`` of ``f`` at ``x`` equals autograd's under the same seed."""
    torch.manual_seed(seed)
    value, (dx,) = g(x)
    xr = x.clone().requires_grad_()
    torch.manual_seed(seed)
    ref = f(xr)
    _close(value, ref.detach(), equal_nan)
    _close(dx, torch.autograd.grad(ref, xr)[0], equal_nan)


def _jvp_matches(jvp, f, x: torch.Tensor, t: torch.Tensor, seed: int) -> None:
    """fxad's JVP of ``f`` at ``x`` along ``t`` equals ``torch.func.jvp`` under the same seed."""
    torch.manual_seed(seed)
    out, tangent = jvp(x, t)
    torch.manual_seed(seed)
    ref, ref_tangent = torch.func.jvp(f, (x,), (t,))
    _close(out, ref)
    _close(tangent, ref_tangent)


def _eager_vjp(m: TinyMoE, x: torch.Tensor, ct: torch.Tensor, seed: int):
    m.zero_grad(set_to_none=True)
    xr = x.detach().clone().requires_grad_()
    torch.manual_seed(seed)
    out = m(xr)
    out.backward(ct)
    return out.detach(), xr.grad, {n: p.grad for n, p in m.named_parameters()}


def test_one_build_matches_autograd_on_every_draw():
    m = _model()
    x = torch.randn(8, 4, dtype=D)
    vjp = fxad.vjp(m, x)
    assert "fxad_expect_size" in vjp.code
    line = next(s for s in vjp.code.splitlines() if "fxad_expect_size('=='" in s)
    assert "== 8" in line and "split(expert_size, dim=0)" in line, line
    sizes = set()
    for seed in range(6):
        ct = torch.randn(8, 6, dtype=D)
        torch.manual_seed(seed)
        out, (dx,), dparams = vjp(x, ct)
        ref, ref_dx, ref_dp = _eager_vjp(m, x, ct, seed)
        torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(dx, ref_dx, rtol=1e-12, atol=1e-12)
        for name, g in ref_dp.items():
            torch.testing.assert_close(dparams[name], g, rtol=1e-12, atol=1e-12)
        torch.manual_seed(seed)
        with torch.no_grad():
            drop = F.dropout(x, 0.3, training=True)
        sizes.add(tuple(F.one_hot(m.router(drop).argmax(1), 3).sum(0).tolist()))
    assert len(sizes) > 1  # the sizes did change from call to call


def test_grad_of_a_loss_matches_autograd():
    m = _model()
    x = torch.randn(8, 4, dtype=D)
    loss = lambda x: m(x).pow(2).sum()  # noqa: E731
    g = fxad.grad(loss, x)
    for seed in (3, 4):
        _grad_matches(g, loss, x, seed)


def test_programs_without_such_sizes_keep_their_code():
    def f(x):
        return F.dropout(x, 0.5, training=True).sin().sum()

    code = fxad.grad(f, torch.randn(4, dtype=D)).code
    assert "fxad_expect_size" not in code and ".item()" not in code


def bad_split(x: torch.Tensor) -> torch.Tensor:
    counts = (torch.rand(3) * 4).long()
    sizes = counts.tolist()
    parts = x.split(sizes, dim=0)
    return sum((p * (k + 1)).sum() for k, p in enumerate(parts))


def test_a_broken_size_assumption_raises_naming_the_line():
    x = torch.randn(6, 2, dtype=D)
    g = fxad.grad(bad_split, x)
    hit = 0
    for seed in range(20):
        torch.manual_seed(seed)
        drawn = (torch.rand(3) * 4).long()
        torch.manual_seed(seed)
        if int(drawn.sum()) == 6:
            value, (dx,) = g(x)
            xr = x.clone().requires_grad_()
            torch.manual_seed(seed)
            ref = bad_split(xr)
            torch.testing.assert_close(value, ref.detach())
            torch.testing.assert_close(dx, torch.autograd.grad(ref, xr)[0])
            continue
        with pytest.raises(fxad.InputError) as e:
            g(x)
        msg = str(e.value)
        where = r"test_unbacked_sizes\.py:\d+ `parts = x\.split\(sizes, dim=0\)`"
        assert re.search(where, msg), msg
        assert "== 6" in msg
        hit += 1
    assert hit > 0


def test_compile_trains_like_eager():
    m = _model()
    ref = _model()
    x = torch.randn(8, 4, dtype=D)
    compiled = fxad.compile(m)
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(4):
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)
        torch.manual_seed(step)
        loss = compiled(x).pow(2).sum()
        loss.backward()
        torch.manual_seed(step)
        ref_loss = ref(x).pow(2).sum()
        ref_loss.backward()
        torch.testing.assert_close(loss.detach(), ref_loss.detach(), rtol=1e-12, atol=1e-12)
        opt.step()
        ref_opt.step()
    for (name, p), q in zip(m.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12, msg=name)
    assert len(compiled.builds) == 1


def drawn_prefix(x: torch.Tensor) -> torch.Tensor:
    n = (torch.rand(()) * 4).long().item()
    return (x[:n] * x[1:n + 1]).sum() + x.new_ones(n).sum() * x.sum()


def test_a_drawn_size_in_slices_and_factories_matches_autograd():
    x = torch.randn(5, dtype=D)
    g = fxad.grad(drawn_prefix, x)
    for seed in range(4):
        _grad_matches(g, drawn_prefix, x, seed)


def decides_on_a_drawn_size(x: torch.Tensor) -> torch.Tensor:
    n = (torch.rand(()) * 4).long().item()
    if n > 2:
        return x.sum()
    return x.prod()


def test_a_decision_on_a_drawn_size_is_refused_naming_the_line():
    with pytest.raises(fxad.DataDependentError) as e:
        fxad.grad(decides_on_a_drawn_size, torch.randn(3, dtype=D))
    msg = str(e.value)
    assert "if n > 2:" in msg and "`n > 2`" in msg, msg


def test_jvp_matches_torch_func_on_every_draw():
    m = _model()
    x = torch.randn(8, 4, dtype=D)
    t = torch.randn(8, 4, dtype=D)
    jvp = fxad.jvp(m, x)
    for seed in (0, 1, 2):
        _jvp_matches(jvp, m, x, t, seed)


def test_with_symbolic_input_sizes_too():
    m = _model()
    g = fxad.grad(lambda x: m(x).pow(2).sum(), torch.randn(8, 4, dtype=D), dynamic=True)
    line = next(s for s in g.code.splitlines() if "fxad_expect_size('=='" in s)
    assert "== x_size_0" in line, line
    for n in (8, 11):
        _grad_matches(g, lambda x: m(x).pow(2).sum(), torch.randn(n, 4, dtype=D), seed=n)


class Routed(nn.Module):
    """Top-1 routing without dropout: the counts follow the router's weights, which change
    on every training step."""

    def __init__(self) -> None:
        super().__init__()
        self.moe = TinyMoE()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self.moe
        logits = m.router(x)
        top = logits.argmax(1)
        expert_size = F.one_hot(top, m.experts).sum(0).tolist()
        _, order = top.sort(0)
        parts = x[order].split(expert_size, dim=0)
        y = torch.cat([F.linear(parts[i], m.w[i]) for i in range(m.experts)], 0)
        y = y * logits.softmax(1).max(1).values[order][:, None]
        out = torch.zeros(x.shape[0], y.shape[1], dtype=y.dtype).index_add(0, order, y)
        return out.pow(2).sum()


def _train_beside_eager(cls, rows: int, lr: float, steps: int, values: str = "guard",
                       count=None):
    """``fxad.compile`` of a ``cls`` and an eager copy trained side by side with SGD on one
    batch of ``rows`` x 4 (each step under the same seed): equal losses at every step and
    equal parameters at the end.  Returns the compiled model and the values of
    ``count(ref, x)`` seen before each step."""
    torch.manual_seed(0)
    model = cls().to(D)
    ref = cls().to(D)
    ref.load_state_dict(model.state_dict())
    x = torch.randn(rows, 4, dtype=D)
    compiled = fxad.compile(model, values=values)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=lr)
    counts = set()
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)
        if count is not None:
            with torch.no_grad():
                counts.add(count(ref, x))
        torch.manual_seed(step)
        loss = compiled(x)
        loss.backward()
        torch.manual_seed(step)
        ref_loss = ref(x)
        ref_loss.backward()
        torch.testing.assert_close(loss.detach(), ref_loss.detach(), rtol=1e-12, atol=1e-12)
        opt.step()
        ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12)
    return compiled, counts


def _train(values: str):
    return _train_beside_eager(
        Routed, 16, 0.5, 6, values,
        count=lambda ref, x: tuple(F.one_hot(ref.moe.router(x).argmax(1), 3).sum(0).tolist()))


def test_opting_in_reads_every_integer_size_on_every_call():
    compiled, counts = _train("guard+unbacked")
    assert len(counts) > 1  # the routing changed while training
    assert len(compiled.builds) == 1
    guarded, _ = _train("guard")  # specialized on the counts: a build per routing
    assert len(guarded.builds) > 1


def _check_hvp(f, x, seeds=range(4)):
    """fxad.hvp of ``f`` (one build) against torch.func's forward-over-reverse, under each
    seed."""
    v = torch.randn_like(x)
    h = fxad.hvp(f, x)
    for seed in seeds:
        torch.manual_seed(seed)
        (grad,), (hv,) = h(x, v)

        def g(x):
            torch.manual_seed(seed)
            return torch.func.grad(f)(x)

        ref_grad, ref_hv = torch.func.jvp(g, (x,), (v,))
        torch.testing.assert_close(grad, ref_grad, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(hv, ref_hv, rtol=1e-12, atol=1e-12)
    return h


def test_hvp_of_code_that_reads_sizes_matches_torch_func():
    m = _model()
    h = _check_hvp(lambda x: m(x).pow(2).sum(), torch.randn(8, 4, dtype=D))
    assert "fxad_expect_size('=='" in h.code


# -- output sizes that depend on data: nonzero, x[mask], masked_select, unique ---------------

def select_rows(x: torch.Tensor) -> torch.Tensor:
    keep = F.dropout(torch.ones(x.shape[0], dtype=x.dtype), 0.5, training=True) > 0
    return (x[keep] ** 2).sum()


def select_entries(x: torch.Tensor) -> torch.Tensor:
    return x.masked_select(torch.rand(x.shape) > 0.5).sin().sum()


def nonzero_rows(x: torch.Tensor) -> torch.Tensor:
    idx = torch.nonzero(torch.rand(x.shape[0]) > 0.5)[:, 0]
    return (x[idx] ** 3).sum() + x[idx].mean()


def write_selected(x: torch.Tensor) -> torch.Tensor:
    m = torch.bernoulli(torch.full(x.shape, 0.5)).bool()
    y = x.clone()
    y[m] = x[m] * 2
    return (y ** 2).sum()


def unique_rows(x: torch.Tensor) -> torch.Tensor:
    k = torch.unique((torch.rand(6) * x.shape[0]).long())
    return (x[k] ** 2).sum()


def _count(f, x, seed):
    """The number of entries selected by ``f``'s draw under ``seed``."""
    torch.manual_seed(seed)
    if f is select_rows:
        return int((F.dropout(torch.ones(x.shape[0], dtype=x.dtype), 0.5, training=True) > 0).sum())
    if f is select_entries:
        return int((torch.rand(x.shape) > 0.5).sum())
    if f is nonzero_rows:
        return int((torch.rand(x.shape[0]) > 0.5).sum())
    if f is write_selected:
        return int(torch.bernoulli(torch.full(x.shape, 0.5)).sum())
    return len(torch.unique((torch.rand(6) * x.shape[0]).long()))


@pytest.mark.parametrize("f", [select_rows, select_entries, nonzero_rows, write_selected,
                               unique_rows])
def test_a_random_selection_matches_autograd_on_every_draw(f):
    x = torch.randn(6, 3, dtype=D)
    g = fxad.grad(f, x)  # one build
    assert re.search(r"= \w+\.size\(0\)", g.code), g.code  # the count, read on every call
    counts = set()
    for seed in range(6):
        _grad_matches(g, f, x, seed, equal_nan=True)  # (an empty selection's mean is nan)
        counts.add(_count(f, x, seed))
    assert len(counts) > 1, counts  # the selection's size did change from call to call


@pytest.mark.parametrize("f", [select_rows, select_entries, write_selected])
def test_jvp_of_a_random_selection_matches_torch_func(f):
    x = torch.randn(6, 3, dtype=D)
    t = torch.randn(6, 3, dtype=D)
    jvp = fxad.jvp(f, x)
    for seed in range(4):
        _jvp_matches(jvp, f, x, t, seed)


def test_the_backward_checks_its_own_count_naming_the_line():
    # x[mask]'s backward selects with the mask again: its count is checked equal to the
    # forward's, in a guard line naming the user's line
    g = fxad.grad(select_rows, torch.randn(6, 3, dtype=D))
    line = next(s for s in g.code.splitlines() if "fxad_expect_size('=='" in s)
    assert "return (x[keep] ** 2).sum()` (its derivative code)" in line, line


def positive_part(x: torch.Tensor) -> torch.Tensor:
    y = x[x > 0]
    return (y * y.sin()).sum() + torch.nonzero(x).shape[0]


def test_opting_in_reads_a_selection_of_the_inputs_on_every_call():
    g = fxad.grad(positive_part, torch.randn(6, dtype=D), values="guard+unbacked")
    assert "count_nonzero" not in g.code and "nonzero_static" not in g.code
    counts = set()
    for seed in range(5):
        x = torch.randn(6, dtype=D, generator=torch.Generator().manual_seed(seed))
        _grad_matches(g, positive_part, x, seed)
        counts.add(int((x > 0).sum()))
    assert len(counts) > 1


def two_selections(x: torch.Tensor) -> torch.Tensor:
    a = x[torch.rand(x.shape[0]) > 0.5]
    b = x[torch.rand(x.shape[0]) > 0.5]
    return (a * b).sum()


def test_two_selections_assumed_equal_raise_naming_the_line():
    x = torch.randn(6, dtype=D)
    g = fxad.grad(two_selections, x)
    hit = passed = 0
    for seed in range(12):
        torch.manual_seed(seed)
        same = int((torch.rand(6) > 0.5).sum()) == int((torch.rand(6) > 0.5).sum())
        torch.manual_seed(seed)
        if same:
            value, (dx,) = g(x)
            xr = x.clone().requires_grad_()
            torch.manual_seed(seed)
            ref = two_selections(xr)
            torch.testing.assert_close(value, ref.detach(), rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(dx, torch.autograd.grad(ref, xr)[0])
            passed += 1
            continue
        with pytest.raises(fxad.InputError) as e:
            g(x)
        assert "`return (a * b).sum()`" in str(e.value), str(e.value)
        hit += 1
    assert hit and passed


def decides_on_a_selection(x: torch.Tensor) -> torch.Tensor:
    y = x[torch.rand(x.shape) > 0.5]
    if y.shape[0] > 2:
        return y.sum()
    return x.sum()


def test_a_decision_on_a_selections_size_is_refused_naming_the_line():
    with pytest.raises(fxad.DataDependentError) as e:
        fxad.grad(decides_on_a_selection, torch.randn(5, dtype=D))
    assert "if y.shape[0] > 2:" in str(e.value), str(e.value)


@pytest.mark.parametrize("f", [select_rows, select_entries, write_selected])
def test_hvp_of_a_random_selection_matches_torch_func(f):
    h = _check_hvp(lambda x: f(x) * f(x).detach() + f(x) ** 2, torch.randn(6, 3, dtype=D))
    assert re.search(r"= \w+\.size\(0\)", h.code), h.code


def test_a_selection_with_symbolic_input_sizes():
    g = fxad.grad(select_entries, torch.randn(4, 3, dtype=D), dynamic=True)
    for n in (4, 7):
        _grad_matches(g, select_entries, torch.randn(n, 3, dtype=D), seed=n)


class Selected(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        keep = torch.rand(h.shape) > 0.3
        return h.masked_select(keep).tanh().sum() + h[keep[:, 0]].pow(2).mean()


def test_compile_trains_a_random_selection_like_eager():
    compiled, _ = _train_beside_eager(Selected, 8, 0.1, 4)
    assert len(compiled.builds) == 1


class PositivePart(nn.Module):
    """A selection by a mask of the parameters' output: its count changes as they train."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return h[h > 0].pow(2).sum() + torch.nonzero(h < 0).shape[0] * h.mean()


def test_opting_in_trains_a_selection_with_one_build():
    compiled, counts = _train_beside_eager(PositivePart, 8, 0.3, 5, "guard+unbacked",
                                           count=lambda ref, x: int((ref.lin(x) > 0).sum()))
    assert len(counts) > 1, counts  # the selection's size changed while training
    assert len(compiled.builds) == 1


def where_pairs(x: torch.Tensor) -> torch.Tensor:
    r, c = (torch.rand(x.shape) > 0.5).nonzero(as_tuple=True)
    i = torch.argwhere(torch.rand(x.shape) > 0.5)
    return x[r, c].exp().sum() + (x[i[:, 0], i[:, 1]] * 3).pow(2).sum()


def mixed_indexing(x: torch.Tensor) -> torch.Tensor:
    m = torch.rand(x.shape[0]) > 0.5
    y = x.clone()
    y[m, 0] = x[m, 1] * 2
    return (y ** 2).sum() + x[:, torch.rand(x.shape[1]) > 0.5].sin().sum()


@pytest.mark.parametrize("f", [where_pairs, mixed_indexing])
def test_other_index_forms_of_a_random_selection_match_autograd(f):
    x = torch.randn(5, 4, dtype=D)
    g = fxad.grad(f, x)
    for seed in range(5):
        _grad_matches(g, f, x, seed)


def test_int_of_a_drawn_count_is_refused_naming_the_line():
    # Python's int() must return a plain int: a size that changes from call to call cannot
    # come out of it (the .item() spelling is read on every call)
    def f(x):
        y = torch.nn.functional.dropout(x, 0.5)
        n = int((y != 0).sum())
        return y[:n].sum()

    with pytest.raises(fxad.errors.DataDependentError,
                       match=r"`int\(t\)` of an integer read from tensor data(.|\n)*"
                             r"test_unbacked_sizes.py:\d+ in f: n = int(.|\n)*t.item\(\)"):
        fxad.grad(f, torch.randn(6, dtype=torch.float64))
