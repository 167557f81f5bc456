"""fxad.memory.simulate and the scheduling pass fxad.simplify.schedule (before/after)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxad
from fxad.memory import simulate
from fxad.simplify.schedule import defer_widening_output_casts, is_widening_output_cast

N = 1024  # elements of the small tensors: bf16 2 KiB, fp32 4 KiB
M = 8192  # elements of the large temporaries


def _order(gm):
    return [n.name for n in gm.graph.nodes if n.op not in ("placeholder", "output")]


def test_simulate_counts_allocations_views_and_outputs():
    def f(a, b, z):
        c = a * 2          # 4N bytes, freed after e
        d = c.view(-1)     # a view: no bytes, keeps c alive
        e = d + b          # 4N bytes, an output
        big = z * 3        # 4M bytes, freed after s
        s = big.sum()      # 4 bytes, an output
        return e, s

    gm = fxad.trace(f, torch.randn(N), torch.randn(N), torch.randn(M))
    est = simulate(gm.graph)
    by_name = dict(zip([n.name for n in gm.graph.nodes if n.op != "output"], est.bytes_per_node))
    assert by_name["mul"] == 4 * N
    assert by_name["view"] == 4 * N          # the view allocates nothing
    assert by_name["add"] == 8 * N           # c (through its view) is read here, freed after
    assert by_name["mul_1"] == 4 * N + 4 * M  # e (an output) and big
    assert est.peak_bytes == 4 * N + 4 * M + 4 and est.peak_node == "sum_1"
    assert est.live_at_peak == ["mul_1", "add", "sum_1"]
    # inputs are the caller's: a graph that only reads them allocates nothing
    assert simulate(fxad.trace(lambda a: a.view(-1), torch.randn(N)).graph).peak_bytes == 0


def test_simulate_grouped_runs_keep_their_inputs_alive():
    def f(a, b):
        return (a * 3).to(torch.float32), (b * 3).to(torch.float32)

    gm = fxad.trace(f, torch.randn(N, dtype=torch.bfloat16), torch.randn(N, dtype=torch.bfloat16))
    # mul, to, mul_1, to_1: one cast at a time, 2N + 4N + 2N + 4N at most
    assert simulate(gm.graph).peak_bytes == 10 * N
    names = {n.name: n for n in gm.graph.nodes}
    deferred = [names[k] for k in ("a", "b", "mul", "mul_1", "to", "to_1")]
    # both casts at the end: 12N as one kernel (both inputs alive), 10N one after the other
    assert simulate(gm.graph, is_widening_output_cast, deferred).peak_bytes == 12 * N
    assert simulate(gm.graph, None, deferred).peak_bytes == 10 * N


def _casts_then_big_temporaries(a, b):
    g = (a * 3).to(torch.float32)  # a gradient cast up early: 4N held to the end
    big = b * 5
    s = (big + 1).sum()            # the peak: two large bf16 temporaries
    return g, s


def test_defer_widening_output_casts_where_the_peak_is_later():
    a, b = torch.randn(N, dtype=torch.bfloat16), torch.randn(M, dtype=torch.bfloat16)
    gm = fxad.trace(_casts_then_big_temporaries, a, b)
    before = _order(gm)
    assert before == ["mul", "to", "mul_1", "add", "sum_1"]
    peak = simulate(gm.graph, is_widening_output_cast).peak_bytes
    ref = gm(a, b)
    assert defer_widening_output_casts(gm.graph) == 1
    gm.recompile()
    assert _order(gm) == ["mul", "mul_1", "add", "sum_1", "to"]  # after
    assert simulate(gm.graph, is_widening_output_cast).peak_bytes == peak - 2 * N
    out = gm(a, b)
    assert all(torch.equal(x, y) for x, y in zip(out, ref))
    assert defer_widening_output_casts(gm.graph) == 0  # a second run changes nothing


def test_defer_widening_output_casts_not_where_they_would_be_grouped():
    def f(a, b):  # the peak is at the end: deferring groups both casts into one kernel
        return (a * 3).to(torch.float32), (b * 3).to(torch.float32)

    x = torch.randn(N, dtype=torch.bfloat16)
    gm = fxad.trace(f, x, x.clone())
    before = _order(gm)
    assert defer_widening_output_casts(gm.graph) == 0
    assert _order(gm) == before
    assert defer_widening_output_casts(gm.graph, grouped=False) == 0  # no gain either way


def test_only_widening_casts_read_by_the_output_move():
    def f(a):
        h = a.to(torch.float32)            # read by the sum too: stays
        lo = (a * 2).to(torch.bfloat16)    # not widening: stays
        return h, h.sum(), lo

    gm = fxad.trace(f, torch.randn(N, dtype=torch.bfloat16))
    assert not any(is_widening_output_cast(n) for n in gm.graph.nodes)
    assert defer_widening_output_casts(gm.graph) == 0


class _Convs(nn.Module):
    """Early, wide activations and a deep, wide 3x3 convolution: under bf16 autocast the
    deep weight's float32 gradient would be held through the early layers' backward."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.c2 = nn.Conv2d(8, 8, 3, padding=1)
        self.c3 = nn.Conv2d(8, 96, 3, stride=4, padding=1)
        self.c4 = nn.Conv2d(96, 96, 3, padding=1)
        self.fc = nn.Linear(96, 10)

    def forward(self, x, y):
        h = F.relu(self.c2(F.relu(self.c1(x))))
        h = F.relu(self.c4(F.relu(self.c3(h))))
        return F.cross_entropy(self.fc(h.mean((2, 3))), y)


def test_joint_step_defers_gradient_casts_where_that_lowers_the_peak():
    torch.manual_seed(0)
    model = _Convs()
    inputs = (torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,)))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        step = fxad.joint_step(copy.deepcopy(model), *inputs, compile=False)
    g = step.graph_module.graph
    nodes = [n for n in g.nodes if n.op != "output"]
    casts = [n for n in nodes if is_widening_output_cast(n)]
    assert casts and nodes[-len(casts):] == casts  # all at the end
    # the same step with the casts where the backward writes them has a higher peak
    eager = [n for n in nodes if n not in set(casts)]
    for c in casts:
        eager.insert(eager.index(c.args[0]) + 1, c)
    assert simulate(g, None, eager).peak_bytes > simulate(g).peak_bytes
    loss, _, grads = step(*inputs)
    ref = copy.deepcopy(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_loss = ref(*inputs)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach(), atol=1e-2, rtol=1e-2)
    for name, p in ref.named_parameters():
        assert grads[name].dtype == torch.float32
        scale = p.grad.abs().max()
        assert (grads[name] - p.grad).abs().max() <= 0.05 * scale + 1e-6, name


@pytest.mark.parametrize("grouped", [True, False])
def test_defer_keeps_the_values(grouped):
    a, b = torch.randn(N, dtype=torch.bfloat16), torch.randn(M, dtype=torch.bfloat16)
    gm = fxad.trace(_casts_then_big_temporaries, a, b)
    ref = gm(a, b)
    defer_widening_output_casts(gm.graph, grouped=grouped)
    gm.graph.lint()
    gm.recompile()
    assert all(torch.equal(x, y) for x, y in zip(gm(a, b), ref))
