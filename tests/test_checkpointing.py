"""Activation checkpointing: torch.utils.checkpoint regions (``node.meta['fxad_checkpoint']``,
set by hand here as the capture will set it) and model-level selective checkpointing
(``fxad.residuals.Checkpoint``) in the residual policy, the bridge and the joint step."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxad
from fxad.demo.models import Block, TinyGPT
from fxad.memory import simulate
from fxad.residuals import Checkpoint, checkpoint_candidates, joint_graph, partition
from fxad.training import joint_step


def _gpt(n_layer=3, T=32, B=4, C=32):
    torch.manual_seed(0)
    m = TinyGPT(50, block_size=T, n_layer=n_layer, n_head=2, n_embd=C)
    g = torch.Generator().manual_seed(1)
    return m, (torch.randint(0, 50, (B, T), generator=g), torch.randint(0, 50, (B, T), generator=g))


def _mark(gm, regions):
    """Set ``meta['fxad_checkpoint']`` as the capture does for ``torch.utils.checkpoint``:
    ``regions`` maps a module path to a region id; nested paths get the innermost id."""
    for n in gm.graph.nodes:
        paths = [v[0] if isinstance(v, tuple) else k
                 for k, v in (n.meta.get("nn_module_stack") or {}).items()]
        ids = [regions[p] for p in paths if p in regions]
        if ids and n.op in ("call_function", "call_method"):
            n.meta["fxad_checkpoint"] = ids[-1]
    return gm


def _traced(model, inputs, regions):
    return _mark(fxad.trace(model, *inputs), regions)


def _assert_same_training(ref, fm, inputs, steps=2, atol=1e-6):
    o_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    o_fx = torch.optim.SGD(fm.parameters(), lr=0.1)
    for _ in range(steps):
        for m, o in ((ref, o_ref), (fm, o_fx)):
            o.zero_grad()
            m(*inputs).backward()
        for (name, a), b in zip(ref.named_parameters(), fm.parameters()):
            torch.testing.assert_close(b.grad, a.grad, atol=atol, rtol=1e-5, msg=name)
        o_ref.step()
        o_fx.step()


# --------------------------------------------------------------------------- user regions

@pytest.mark.parametrize("policy", ["save", "min_memory"])
def test_user_region_recomputes_its_inside_and_saves_its_inputs(policy):
    m, x = _gpt()
    gm = _traced(m, x, {"blocks.1": 0})
    v = fxad.vjp(gm, *x, argnums=())
    plain = partition(v, policy, checkpoint=False)
    part = partition(v, policy)  # default: the model's own regions are honoured
    assert part.saved_bytes < plain.saved_bytes
    (label, rec, ins, nbytes, outs), = part.checkpointed
    assert label == "torch.utils.checkpoint #0"
    assert rec and set(rec) <= set(part.recomputed)
    # nothing computed inside the block is saved, except its output (the next block's input)
    inside = {n.name for n in v.graph.nodes if n.meta.get("fxad_checkpoint") == 0}
    inside |= {n.name for n in v.graph.nodes
               if n.meta.get("fxad_fwd_of") in {q.name for q in gm.graph.nodes
                                                 if q.meta.get("fxad_checkpoint") == 0}}
    assert set(part.saved_names) & inside == set(outs)
    assert len(ins) == 1 and nbytes == 4 * 32 * 32 * 4  # the block's input x: [4, 32, 32] f32
    rep = part.report()
    assert "activation checkpointing: 1 region(s)" in rep
    assert f"region torch.utils.checkpoint #0: recomputes {len(rec)} node(s)" in rep
    assert "# recomputed here:" in part.bwd_gm.code


def test_user_regions_train_like_autograd_through_the_bridge_and_joint_step():
    m, x = _gpt()
    gm = _traced(copy.deepcopy(m), x, {"blocks.0": 0, "blocks.2": 1})
    fm = fxad.compile(gm)
    _assert_same_training(copy.deepcopy(m), fm, x)
    assert len(fm.partition(*x).checkpointed) == 2
    step = joint_step(_traced(copy.deepcopy(m), x, {"blocks.0": 0}), *x, compile=False)
    assert step.partition.checkpointed
    loss, _, grads = step(*x)
    ref = copy.deepcopy(m)
    ref(*x).backward()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, atol=1e-6, rtol=1e-5, msg=name)


def _eager_checkpointed(model, every=1):
    for i, b in enumerate(model.blocks):
        if i % every == 0:
            b.forward = lambda h, _f=b.forward: torch.utils.checkpoint.checkpoint(
                _f, h, use_reentrant=False)
    return model


def test_the_models_own_checkpoint_calls_are_honoured():
    """End to end: the capture records ``torch.utils.checkpoint`` regions."""
    m, x = _gpt()
    fm = fxad.compile(_eager_checkpointed(copy.deepcopy(m), every=2))
    part = fm.partition(*x)
    assert len(part.checkpointed) == 2
    assert all(c[0].startswith("torch.utils.checkpoint #") for c in part.checkpointed)
    by_option = fxad.compile(copy.deepcopy(m), checkpoint=Checkpoint(modules=Block, every=2))
    assert part.saved_bytes == by_option.partition(*x).saved_bytes
    _assert_same_training(_eager_checkpointed(copy.deepcopy(m), every=2), fm, x)
    assert fxad.compile(_eager_checkpointed(copy.deepcopy(m)), checkpoint=False) \
        .partition(*x).saved_bytes == fxad.compile(copy.deepcopy(m)).partition(*x).saved_bytes


def test_nested_regions_are_recomputed_as_the_outermost():
    m, x = _gpt()
    # the inner call (the MLP, id 1) inside the outer one (block 1, id 0): torch recomputes
    # the outer region, saving neither region's inside
    v = fxad.vjp(_traced(m, x, {"blocks.1": 0, "blocks.1.mlp": 1}), *x, argnums=())
    part = partition(v, "save")
    (label, *_), = part.checkpointed
    assert label == "torch.utils.checkpoint #0 + torch.utils.checkpoint #1"
    only_outer = partition(fxad.vjp(_traced(m, x, {"blocks.1": 0}), *x, argnums=()), "save")
    assert part.saved_names == only_outer.saved_names


def test_adjacent_regions_save_the_value_between_them():
    m, x = _gpt()
    v = fxad.vjp(_traced(m, x, {"blocks.0": 0, "blocks.1": 1}), *x, argnums=())
    part = partition(v, "min_memory")
    (l0, _, in0, _, out0), (l1, _, in1, _, out1) = part.checkpointed
    assert out0 == in1  # block 0's output, saved once, is block 1's input


def test_checkpoint_false_ignores_user_regions():
    m, x = _gpt()
    v = fxad.vjp(_traced(m, x, {"blocks.1": 0}), *x, argnums=())
    assert partition(v, "save", checkpoint=False).checkpointed == []
    assert partition(v, "save", checkpoint=False).saved_names == \
        partition(fxad.vjp(m, *x, argnums=()), "save").saved_names
    ck = Checkpoint(modules=Block, user_regions=False)
    assert [c[0] for c in partition(v, "save", checkpoint=ck).checkpointed] == \
        ["blocks.0", "blocks.1", "blocks.2"]


def test_random_and_side_effect_ops_in_a_region_are_saved_not_recomputed():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3, padding=1)
            self.bn = nn.BatchNorm2d(4)
            self.fc = nn.Linear(4, 3)

        def forward(self, x, y):
            h = F.relu(self.bn(self.conv(x)))  # batch norm updates its statistics
            return F.cross_entropy(self.fc(h.mean((2, 3))), y)

    torch.manual_seed(0)
    m = Net().train()
    x = (torch.randn(2, 3, 5, 5), torch.randint(0, 3, (2,)))
    gm = fxad.trace(m, *x)
    for n in gm.graph.nodes:
        if n.op in ("call_function", "call_method") and n.name != "cross_entropy":
            n.meta["fxad_checkpoint"] = 0
    fm = fxad.compile(gm)
    ref = copy.deepcopy(m)
    _assert_same_training(ref, fm, x, steps=2, atol=1e-5)
    # the running statistics moved once per step, as in eager (not again by a recomputation)
    torch.testing.assert_close(gm.bn.running_mean, ref.bn.running_mean)


# --------------------------------------------------------------------------- model-level option

def test_checkpoint_every_kth_block():
    m, x = _gpt(n_layer=4)
    v = fxad.vjp(m, *x, argnums=())
    assert checkpoint_candidates(v, Block) == [f"blocks.{i}" for i in range(4)]
    assert checkpoint_candidates(v, ["blocks.2", "ln_f"]) == ["blocks.2", "ln_f"]
    sizes = {}
    for every in (1, 2, 4):
        part = partition(v, "save", checkpoint=Checkpoint(modules=Block, every=every))
        assert [c[0] for c in part.checkpointed] == [f"blocks.{i}" for i in range(0, 4, every)]
        sizes[every] = part.saved_bytes
    assert sizes[1] < sizes[2] < sizes[4] < partition(v, "save").saved_bytes
    by_name = partition(v, "save", checkpoint=Checkpoint(modules=["blocks.0", "blocks.2"]))
    assert by_name.saved_names == \
        partition(v, "save", checkpoint=Checkpoint(modules=Block, every=2)).saved_names


def test_checkpoint_budget_picks_the_fewest_leading_blocks():
    m, x = _gpt(n_layer=4, B=8)
    v = fxad.vjp(m, *x, argnums=())

    def peak(ck):
        return simulate(joint_graph(partition(v, "save", checkpoint=ck)).graph).peak_bytes
    peaks = [peak(Checkpoint(modules=[f"blocks.{i}" for i in range(j)] or ["none"]))
             if j else peak(None) for j in range(5)]
    # each leading block checkpointed lowers the peak, until the peak is elsewhere
    assert peaks[0] > peaks[1] > peaks[2] and all(a >= b for a, b in zip(peaks, peaks[1:])), peaks
    budget = (peaks[1] + peaks[2]) // 2  # needs two blocks
    part = partition(v, "save", checkpoint=Checkpoint(modules=Block, budget=budget))
    assert [c[0] for c in part.checkpointed] == ["blocks.0", "blocks.1"]
    assert "2 of 4 candidate modules checkpointed" in part.report()
    assert peak(Checkpoint(modules=["blocks.0", "blocks.1"])) <= budget
    with pytest.warns(UserWarning, match="even with all 4"):
        part = partition(v, "save", checkpoint=Checkpoint(modules=Block, budget=1))
    assert len(part.checkpointed) == 4
    assert partition(v, "save", checkpoint=Checkpoint(modules=Block, budget=10**12)) \
        .checkpointed == []


@pytest.mark.parametrize("policy", ["save", "min_memory"])
def test_selective_checkpointing_trains_like_autograd(policy):
    m, x = _gpt()
    fm = fxad.compile(copy.deepcopy(m), policy=policy,
                      checkpoint=Checkpoint(modules=Block, every=2))
    _assert_same_training(copy.deepcopy(m), fm, x)
    assert [c[0] for c in fm.partition(*x).checkpointed] == ["blocks.0", "blocks.2"]
    step = joint_step(copy.deepcopy(m), *x, compile=False, policy=policy,
                      checkpoint=Checkpoint(modules=Block))
    assert "recomputed in the backward" in step.graph_module.code
    loss, _, grads = step(*x)
    ref = copy.deepcopy(m)
    ref(*x).backward()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, atol=1e-6, rtol=1e-5, msg=name)


def _measured_peak(step):
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"
              and e.device_type() == torch.autograd.DeviceType.CPU]
    cur = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        cur += e.nbytes()
        peak = max(peak, cur)
    return peak


def test_checkpointing_lowers_the_measured_peak_like_eager_checkpointing():
    m, x = _gpt(n_layer=4, T=64, B=8, C=64)

    def run(model):
        def step():
            for p in model.parameters():
                p.grad = None
            model(*x).backward()
        step()  # capture / warm up
        for p in model.parameters():
            p.grad = None
        return _measured_peak(step)
    eager = run(copy.deepcopy(m))
    eager_ck = run(_eager_checkpointed(copy.deepcopy(m)))
    fx_plain = run(fxad.compile(copy.deepcopy(m)))
    fx_ck = run(fxad.compile(copy.deepcopy(m), checkpoint=Checkpoint(modules=Block)))
    assert eager_ck < 0.8 * eager and fx_ck < 0.8 * fx_plain
    assert fx_ck <= 1.05 * eager_ck, (fx_ck, eager_ck)


def test_checkpoint_option_errors():
    m, x = _gpt(n_layer=1)
    v = fxad.vjp(m, *x, argnums=())
    with pytest.raises(fxad.InputError, match="every"):
        Checkpoint(modules=Block, every=0)
    with pytest.raises(fxad.InputError, match="needs modules"):
        Checkpoint(budget=10)
    with pytest.raises(fxad.InputError, match="no forward node"):
        partition(v, "save", checkpoint=Checkpoint(modules=nn.Conv2d))
    with pytest.raises(fxad.InputError, match="checkpoint="):
        partition(v, "save", checkpoint="blocks")
    with pytest.raises(fxad.InputError, match="module class"):
        partition(v, "save", checkpoint=Checkpoint(modules=[Block]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        partition(v, "save", checkpoint=Checkpoint(modules=Block))
