"""fxad.compile (autograd bridge), residual policies, joint-step torch.compile, autocast."""
from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxad
from fxad.demo.models import MLP, SmallCNN, TinyGPT
from fxad.residuals import Policy, partition
from fxad.training import inductor_available, joint_step


def _mlp():
    torch.manual_seed(0)
    return MLP(d_in=16, hidden=32, d_out=4), (torch.randn(8, 16), torch.randn(8, 4))


def _cnn():
    torch.manual_seed(0)
    return SmallCNN(width=4).train(), (torch.randn(4, 3, 8, 8), torch.randint(0, 10, (4,)))


def _gpt():
    torch.manual_seed(0)
    m = TinyGPT(40, block_size=16, n_layer=2, n_head=2, n_embd=32)
    return m, (torch.randint(0, 40, (2, 16)), torch.randint(0, 40, (2, 16)))


def _resblock():
    class Res(nn.Module):  # bias-free convolutions, batch norm, residual add
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 3, 3, padding=1, bias=False)
            self.bn = nn.BatchNorm2d(3)
            self.fc = nn.Linear(3, 5)

        def forward(self, x, y):
            h = F.relu(x + self.bn(self.conv(x)))
            return F.cross_entropy(self.fc(h.mean((2, 3))), y)

    torch.manual_seed(0)
    return Res().train(), (torch.randn(2, 3, 6, 6), torch.randint(0, 5, (2,)))


CASES = {"mlp": _mlp, "cnn": _cnn, "gpt": _gpt, "res": _resblock}


def _train_both(model, inputs, *, policy="min_memory", steps=3, autocast=None, atol=1e-5,
                device_type="cpu", buffer_tol=(1e-5, 1e-4), ref_layout=None, **compile_kw):
    """Train ``fxad.compile(model)`` and autograd on a copy (in ``ref_layout``, a memory
    format, if given) side by side with SGD; compare losses, gradients and buffers."""
    ref, mine = copy.deepcopy(model), copy.deepcopy(model)
    if ref_layout is not None:
        ref = ref.to(memory_format=ref_layout)
    fm = fxad.compile(mine, policy=policy, **compile_kw)
    o_ref = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    o_fx = torch.optim.SGD(fm.parameters(), lr=0.05, momentum=0.9)
    for _ in range(steps):
        losses = []
        for m in (ref, fm):
            if autocast is not None:
                with torch.autocast(device_type, dtype=autocast):
                    loss = m(*inputs)
            else:
                loss = m(*inputs)
            loss.backward()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[1], losses[0], atol=atol, rtol=1e-4)
        for (name, p_ref), p in zip(ref.named_parameters(), mine.parameters()):
            if p_ref.grad is None:
                assert p.grad is None, name
                continue
            assert p.grad is not None, name
            assert p.grad.dtype == p_ref.grad.dtype and p.grad.shape == p_ref.grad.shape
            torch.testing.assert_close(p.grad, p_ref.grad, atol=atol, rtol=1e-4, msg=name)
        o_ref.step()
        o_fx.step()
        o_ref.zero_grad()
        o_fx.zero_grad()
    for b_ref, b in zip(ref.buffers(), mine.buffers()):  # batch-norm running statistics
        torch.testing.assert_close(b.float(), b_ref.float(), atol=buffer_tol[0],
                                   rtol=buffer_tol[1])
    return fm


@pytest.mark.parametrize("policy", ["save", "min_memory"])
@pytest.mark.parametrize("case", list(CASES))
def test_bridge_matches_autograd_over_steps(case, policy):
    model, inputs = CASES[case]()
    _train_both(model, inputs, policy=policy)


@pytest.mark.parametrize("autocast", [None, torch.bfloat16])
@pytest.mark.parametrize("case", ["cnn", "res"])
def test_bridge_channels_last_convolutions(case, autocast):
    model, inputs = CASES[case]()
    # NHWC bfloat16 kernels round differently from NCHW ones (by up to a few percent of a
    # gradient over three steps, depending on the CPU): under autocast the reference is
    # autograd on a channels-last copy of the model, which runs the same kernels
    fm = _train_both(model, inputs, autocast=autocast, channels_last=True,
                     ref_layout=torch.channels_last if autocast else None)
    assert "memory_format = torch.channels_last" in fm.fwd_gm.code
    assert "memory_format = torch.contiguous_format" in fm.bwd_gm.code
    assert all(p.grad is None or p.grad.is_contiguous() for p in fm.parameters())
    # by default: only weights that autocast casts (copied anyway), never float32 weights
    assert "channels_last" not in fxad.compile(model, *inputs).fwd_gm.code
    with torch.autocast("cpu", dtype=torch.bfloat16):
        off = fxad.compile(copy.deepcopy(model), *inputs, channels_last=False)
    assert "channels_last" not in off.fwd_gm.code


def test_bridge_backward_is_fxad_code():
    model, inputs = _mlp()
    fm = fxad.compile(model, *inputs)
    assert fm.bwd_gm is fm.partition(*inputs).bwd_gm
    loss = fm(*inputs)
    assert type(loss.grad_fn).__name__ == "_BridgeBackward"
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_bridge_accumulates_and_input_grads():
    model, (x, y) = _mlp()
    ref = copy.deepcopy(model)
    fm = fxad.compile(model)
    xa = x.clone().requires_grad_()
    xb = x.clone().requires_grad_()
    for _ in range(2):  # .grad accumulates over two backward calls, as with autograd
        fm(xa, y).backward()
        ref(xb, y).backward()
    torch.testing.assert_close(xa.grad, xb.grad)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def test_unused_and_frozen_parameters():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.unused = nn.Linear(4, 4)
            self.frozen = nn.Linear(4, 4)
            self.frozen.requires_grad_(False)

        def forward(self, x):
            return self.frozen(self.a(x)).pow(2).mean()

    torch.manual_seed(0)
    m = M()
    fm = fxad.compile(m)
    fm(torch.randn(3, 4)).backward()
    assert m.a.weight.grad is not None
    assert m.unused.weight.grad is None and m.frozen.weight.grad is None


def test_parameters_are_graph_inputs_saved_with_version_checks():
    model, inputs = _mlp()
    m = fxad.compile(model)
    part = m.partition(*inputs)
    assert part.lifted_params and "getattr(self" not in part.fwd_gm.code
    assert "self." not in part.bwd_gm.code.split("# saved tensors")[1]
    for name in part.param_names:  # the forward takes each parameter by its code name
        assert name.replace(".", "_") in part.fwd_gm.code.split(":")[0]
    # parameters cost no saved bytes (the model holds them), but are saved for backward
    code_names = {n.replace(".", "_") for n in part.param_names}
    assert "fc2_weight" in part.saved_names
    saved_nodes = part.fwd_gm.graph.output_node().args[0][part.n_outputs:]
    assert part.saved_bytes == sum(fxad.residuals.nbytes(n) for n in saved_nodes
                                   if n.name not in code_names) > 0
    loss = m(*inputs)
    with torch.no_grad():
        model.fc2.weight.add_(1.0)  # in place between forward and backward
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_replaced_submodule_is_seen():
    model, inputs = _mlp()
    m = fxad.compile(model)
    m(*inputs).backward()
    model.fc1 = nn.Linear(model.fc1.in_features, model.fc1.out_features)
    m(*inputs).backward()
    assert model.fc1.weight.grad is not None
    ref = copy.deepcopy(model)
    for p in ref.parameters():
        p.grad = None
    ref(*inputs).backward()
    torch.testing.assert_close(model.fc1.weight.grad, ref.fc1.weight.grad)


def test_no_grad_runs_the_model():
    model, inputs = _mlp()
    fm = fxad.compile(model)
    with torch.no_grad():
        out = fm(*inputs)
    assert out.grad_fn is None and not fm._plans


def test_tuple_output_and_cotangents():
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(5, 3)

        def forward(self, x):
            h = self.l(x)
            return h.sin(), h.argmax(-1)

    torch.manual_seed(0)
    m = Two()
    x = torch.randn(4, 5)
    fm = fxad.compile(copy.deepcopy(m))
    a, idx = fm(x)
    assert idx.dtype == torch.int64 and not idx.requires_grad
    w = torch.randn(4, 3)
    (a * w).sum().backward()
    a2, _ = m(x)
    (a2 * w).sum().backward()
    torch.testing.assert_close(fm.module.l.weight.grad, m.l.weight.grad)


# --------------------------------------------------------------------------- residuals

@pytest.mark.parametrize("case", list(CASES))
def test_policies_give_identical_gradients(case):
    model, inputs = CASES[case]()
    g = fxad.vjp(model, *inputs, argnums=())
    state = copy.deepcopy(model.state_dict())
    results = []
    policies = ["save", "min_memory", Policy(by_op={"linear": "recompute", "gelu": "save"}),
                Policy(recompute_cheap=False, by_op={"relu": "recompute"})]
    for pol in policies:
        model.load_state_dict(state)  # batch-norm statistics: same start for each policy
        part = partition(g, pol)
        with torch.no_grad():
            res = part.fwd_gm(*inputs)
            grads = part.bwd_gm([*res[part.n_outputs:], torch.ones(())])
        results.append((res[0], grads))
    for loss, grads in results[1:]:
        assert torch.equal(loss, results[0][0])
        for a, b in zip(grads, results[0][1]):
            assert (a is None and b is None) or torch.equal(a, b)


def test_min_memory_saves_no_more_and_recomputes_only_cheap_ops():
    model, inputs = _gpt()
    g = fxad.vjp(model, *inputs, argnums=())
    save = partition(g, "save")
    mm = partition(g, "min_memory")
    assert save.recomputed == []
    assert mm.saved_bytes < save.saved_bytes
    by_name = {n.name: n for n in g.graph.nodes}
    pol = Policy()
    assert mm.recomputed and all(pol.choice(by_name[r]) == "cheap" for r in mm.recomputed)
    # the saved list is named and printed
    assert mm.fwd_gm.saved_names == mm.saved_names
    assert "# saved for backward" in mm.fwd_gm.code
    assert all(name in mm.fwd_gm.code for name in mm.saved_names)
    assert "# recomputed here:" in mm.bwd_gm.code
    shown = fxad.show(mm.bwd_gm, file=open("/dev/null", "w"))
    assert "[saved " in shown  # saved bytes per backward block
    assert "saves" in mm.report()


def _declared_cases():
    from fxad.rules.registry import all_rules, op_name
    out = []
    for op, rule in all_rules().items():
        if rule.builtin and rule.residuals is not None and rule.samples is not None:
            out.append(pytest.param(rule, id=op_name(op)))
    return out


def _cube(x):
    return x * x * x


torch.fx.wrap("_cube")  # an FX leaf function, differentiated by a user rule below

# training-mode dropout draws a mask: not among the rule's deterministic samples
_EXTRA_SAMPLES = {F.dropout: [((torch.randn(3, 4, dtype=torch.float64), 0.5, True), {})]}


@pytest.mark.parametrize("rule", _declared_cases())
def test_rule_residual_declarations_match_the_split(rule):
    """What a rule declares it saves (``residuals``) covers what its backward block reads
    under the "save" policy, on every float64 sample; a rule declaring residuals reads some."""
    from fxad.rules.registry import RESIDUAL_KINDS
    declared = set() if rule.residuals == "nothing" else set(rule.residuals.split("+"))
    read = 0
    samples = list(rule.samples(torch.float64)) + _EXTRA_SAMPLES.get(rule.op, [])
    for args, kwargs in samples:
        slots = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]

        def f(*xs, _args=args, _kw=kwargs, _slots=slots):
            a = list(_args)
            for i, x in zip(_slots, xs):
                a[i] = x
            out = rule.op(*a, **_kw)
            return out[0] if _kw.get("return_indices") else out

        xs = [args[i] for i in slots]
        argnums = tuple(k for k, x in enumerate(xs) if x.is_floating_point())
        part = partition(fxad.vjp(f, *xs, argnums=argnums), "save")
        for stmt, names, _, kind, decl in part.blocks:
            if decl:  # the block of the rule under test (helpers carry no declaration)
                assert decl == rule.residuals
                actual = set() if kind == "nothing" else set(kind.split("+"))
                assert actual <= declared, (stmt, kind, rule.residuals)
                assert actual <= set(RESIDUAL_KINDS)
                read += bool(actual)
    assert bool(read) == bool(declared), "the rule's backward never read what it declares"


def test_residual_declaration_is_validated_and_reported():
    with pytest.raises(fxad.RuleError, match="residuals"):
        fxad.register_vjp(_cube, fwd=lambda x: (_cube(x), x),
                          bwd=lambda x, d: (3 * x * x * d,), residuals="everything")
    fxad.register_vjp(_cube, fwd=lambda x: (_cube(x), x), bwd=lambda x, d: (3 * x * x * d,),
                      residuals="output")  # wrong on purpose: it saves its input
    try:
        part = partition(fxad.vjp(lambda x: _cube(x).sum(), torch.randn(3)), "save")
        assert "saves inputs (rule declares output)" in part.report()
    finally:
        fxad.unregister(_cube)


def test_per_node_recompute_and_bad_policy():
    model, inputs = _mlp()
    g = fxad.vjp(model, *inputs, argnums=())
    lin = next(n.name for n in g.graph.nodes if fxad.residuals.op_kind(n) == "linear")
    part = partition(g, Policy(by_node={lin: "recompute"}))
    assert lin in part.recomputed and lin not in part.saved_names
    with pytest.raises(fxad.InputError):
        partition(g, Policy(by_node={"x": "recompute"}))
    with pytest.raises(fxad.InputError):
        partition(g, "everything")


def test_global_op_policy():
    model, inputs = _gpt()
    g = fxad.vjp(model, *inputs, argnums=())
    fxad.set_residual_policy(F.gelu, "save")
    try:
        part = partition(g, "min_memory")
        assert not any(r.startswith("gelu") for r in part.recomputed)
    finally:
        fxad.set_residual_policy(F.gelu, None)


# --------------------------------------------------------------------------- autocast

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", list(CASES))
def test_autocast_matches_eager_autocast(case, dtype):
    model, inputs = CASES[case]()
    # by default the cast convolution weights go channels-last where oneDNN runs the CPU
    # convolutions, and NHWC bfloat16 kernels round differently from NCHW ones: the
    # reference then is autograd on a channels-last copy, which runs the same kernels
    nhwc = case in ("cnn", "res") and torch.backends.mkldnn.is_available()
    fm = _train_both(model, inputs, steps=2, autocast=dtype, atol=2e-2,
                     ref_layout=torch.channels_last if nhwc else None)
    code = fm.fwd_gm.code
    method = {torch.bfloat16: "bfloat16", torch.float16: "half"}[dtype]
    assert f".{method}()" in code and ".float()" in fm.bwd_gm.code  # the casts are explicit
    if nhwc:
        assert "memory_format = torch.channels_last" in code


# --------------------------------------------------------------------------- joint step

def _autograd_grads(model, inputs, autocast=None):
    ref = copy.deepcopy(model)
    with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
        loss = ref(*inputs)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in ref.named_parameters()}, ref


def _check_joint(step, model, inputs, *, autocast=None, atol=1e-5, rtol=1e-4, loss_tol=None):
    """``step``'s loss (``assert_close``'s default tolerances unless ``loss_tol``) and
    parameter gradients against autograd on a copy of ``model`` (as it was before ``step``
    ran); returns that reference model."""
    loss, _, grads = step(*inputs)
    ref_loss, ref_grads, ref = _autograd_grads(model, inputs, autocast)
    torch.testing.assert_close(loss, ref_loss, **(loss_tol or {}))
    for n, g in ref_grads.items():
        assert grads[n].dtype == g.dtype
        torch.testing.assert_close(grads[n], g, atol=atol, rtol=rtol)
    return ref


def test_joint_step_uncompiled_matches_autograd():
    model, inputs = _cnn()
    _check_joint(joint_step(copy.deepcopy(model), *inputs, compile=False), model, inputs)


def test_joint_step_torch_compile_matches():
    if not inductor_available():
        pytest.skip("torch.compile (inductor) unavailable here")
    model, inputs = _mlp()
    _check_joint(joint_step(copy.deepcopy(model), *inputs), model, inputs)


def test_joint_graph_recomputes_after_the_forward():
    model, inputs = _gpt()
    step = joint_step(model, *inputs, compile=False)
    gm, part = step.graph_module, step.partition
    nodes = list(gm.graph.nodes)
    seed = next(i for i, n in enumerate(nodes) if n.target is torch.ones_like)
    recomputed = [i for i, n in enumerate(nodes) if n.meta.get("fxad_recomputed")]
    assert part.recomputed and len(recomputed) == len(part.recomputed)
    assert min(recomputed) > seed  # duplicated in the backward, not shared with the forward
    # the forward reads no recomputed node; the header names the saved and recomputed values
    assert all(i > seed for i, n in enumerate(nodes) for a in n.all_input_nodes
               if a.meta.get("fxad_recomputed"))
    code = gm.code
    assert "# saved from forward to backward (%d values" % len(part.saved_names) in code
    assert "gelu_recomputed" in code and "# recomputed in the backward" in code
    assert "_weight_1 " not in code  # one get_attr per parameter
    _check_joint(step, model, inputs)


@pytest.mark.parametrize("case", ["res", "gpt", "cnn"])
def test_joint_step_policies_give_identical_gradients(case):
    model, inputs = CASES[case]()
    outs = {}
    for policy in ("save", "min_memory", Policy(by_op={"relu": "recompute"})):
        m = copy.deepcopy(model)
        step = joint_step(m, *inputs, compile=False, policy=policy)
        outs[str(policy)] = (step(*inputs), m)
    (ref, ref_m), *rest = outs.values()
    for (loss, _, grads), m in rest:
        torch.testing.assert_close(loss, ref[0], rtol=0, atol=0)
        for n in grads:
            torch.testing.assert_close(grads[n], ref[2][n], rtol=0, atol=0)
        for b, rb in zip(m.buffers(), ref_m.buffers()):  # batch-norm statistics updated
            torch.testing.assert_close(b, rb, rtol=0, atol=0)
    if case == "res":
        _, _, ref_model = _autograd_grads(model, inputs)
        torch.testing.assert_close(ref_m.bn.running_mean, ref_model.bn.running_mean)
        assert not torch.equal(ref_m.bn.running_mean, model.bn.running_mean)


def test_joint_step_autocast_matches_eager_autocast():
    model, inputs = _cnn()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        step = joint_step(copy.deepcopy(model), *inputs, compile=False)
    assert ".to(torch.bfloat16)" in step.graph_module.code
    # runs with autocast disabled (the casts are in the graph); float32 gradients
    _check_joint(step, model, inputs, autocast=torch.bfloat16, atol=2e-2, rtol=5e-2,
                 loss_tol=dict(atol=2e-2, rtol=2e-2))


def test_joint_step_unused_parameter_and_input_grads():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 1)
            self.unused = nn.Linear(4, 4)

        def forward(self, x):
            return self.a(x).sum()

    m = M()
    x = torch.randn(3, 4)
    loss, in_grads, grads = joint_step(m, x, compile=False, argnums=(0,))(x)
    assert torch.equal(grads["unused.weight"], torch.zeros(4, 4))
    torch.testing.assert_close(in_grads[0], m.a.weight.detach().expand(3, 4))
    assert list(grads) == [n for n, _ in m.named_parameters()]


def test_joint_graph_folds_the_seed():
    def f(x, w):
        return (torch.tanh(x @ w) ** 2).sum()

    x, w = torch.randn(3, 4, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)
    step = joint_step(f, x, w, compile=False, argnums=(0, 1))
    code = step.graph_module.code
    assert "ones_like" not in code and "d_x = d_matmul @ t" in code
    loss, (d_x, d_w) = step(x, w)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    f(xr, wr).backward()
    torch.testing.assert_close(d_x, xr.grad)
    torch.testing.assert_close(d_w, wr.grad)


def test_joint_step_rejects_a_non_scalar_output():
    with pytest.raises(fxad.InputError, match="one floating-point scalar"):
        joint_step(nn.Linear(3, 2), torch.randn(4, 3), compile=False)


def test_joint_step_inductor_options(monkeypatch):
    seen = []

    def fake_compile(fn, **kw):
        seen.append(kw)
        return fn

    monkeypatch.setattr(torch, "compile", fake_compile)
    model, inputs = _mlp()
    joint_step(model, *inputs)
    joint_step(model, *inputs, options={"max_autotune": True})
    joint_step(model, *inputs, mode="reduce-overhead")
    joint_step(model, *inputs, compile="aot_eager")
    assert seen[0] == {"backend": "inductor", "options": {"layout_optimization": False,
                                                          "reorder_for_locality": False,
                                                          "reorder_for_peak_memory": False}}
    assert seen[1]["options"] == {"max_autotune": True}
    assert "options" not in seen[2] and "options" not in seen[3]


def test_joint_step_channels_last_convolutions():
    model, inputs = _resblock()
    # float32 weights stay NCHW by default (the copies cost more than NHWC saves)
    plain = joint_step(copy.deepcopy(model), *inputs, compile=False)
    assert "channels_last" not in plain.graph_module.code
    step = joint_step(copy.deepcopy(model), *inputs, compile=False, channels_last=True)
    code = step.graph_module.code
    assert "conv_weight_nhwc = conv_weight.contiguous(memory_format = torch.channels_last)" \
        in code
    _, _, grads = step(*inputs)
    assert grads["conv.weight"].is_contiguous()
    if torch.backends.mkldnn.is_available():  # under autocast the cast weights go NHWC
        with torch.autocast("cpu", dtype=torch.bfloat16):
            cast = joint_step(copy.deepcopy(model), *inputs, compile=False)
        assert "memory_format = torch.channels_last" in cast.graph_module.code
    _check_joint(joint_step(copy.deepcopy(model), *inputs, compile=False), model, inputs)
    off = joint_step(copy.deepcopy(model), *inputs, compile=False, channels_last=False)
    assert "channels_last" not in off.graph_module.code
    _, _, grads_off = off(*inputs)
    for n, g in grads_off.items():
        torch.testing.assert_close(grads[n], g)


def test_channels_last_activations_reach_views_and_grouped_convolutions():
    # (a depthwise weight, (C, 1, k, k), is contiguous and channels-last at once: not moved)
    class Net(nn.Module):  # x.view(B, -1) of an NHWC activation needs a copy (reshape)
        def __init__(self):
            super().__init__()
            self.c1 = nn.Conv2d(3, 8, 3, padding=1)
            self.c2 = nn.Conv2d(8, 8, 3, padding=1, groups=2)  # grouped
            self.fc = nn.Linear(8 * 6 * 6, 5)

        def forward(self, x, y):
            h = F.relu(self.c2(F.relu(self.c1(x))))
            return F.cross_entropy(self.fc(h.view(h.size(0), -1)), y)

    torch.manual_seed(0)
    model, inputs = Net(), (torch.randn(2, 3, 6, 6), torch.randint(0, 5, (2,)))
    step = joint_step(copy.deepcopy(model), *inputs, compile=False, channels_last=True)
    code = step.graph_module.code
    assert "c1_weight_nhwc = " in code and "c2_weight_nhwc = " in code
    _check_joint(step, model, inputs)
    _train_both(model, inputs, steps=2, channels_last=True)


def test_joint_step_compiled_conv_batch_norm_matches():
    if not inductor_available():
        pytest.skip("torch.compile (inductor) unavailable here")
    model, inputs = _resblock()
    m = copy.deepcopy(model)
    ref_m = _check_joint(joint_step(m, *inputs), model, inputs)
    torch.testing.assert_close(m.bn.running_var, ref_m.bn.running_var)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bridge_cuda_autocast():
    model, inputs = _gpt()
    model = model.cuda()
    inputs = tuple(t.cuda() for t in inputs)
    _train_both(model, inputs, steps=2)
    _train_both(model, inputs, steps=2, autocast=torch.bfloat16, atol=2e-2, device_type="cuda")


def test_model_without_tensor_inputs():
    class Const(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(3, dtype=torch.float64))

        def forward(self):
            return (self.w.sin() ** 2).sum()

    torch.manual_seed(0)
    model = Const()
    m = fxad.compile(model)
    m().backward()
    torch.testing.assert_close(model.w.grad, 2 * model.w.sin() * model.w.cos())


def test_bridge_runs_fused_relu_backward_and_names_the_user_line():
    """The bridge builds code to run: relu's backward is the one-kernel threshold_backward
    (fused level "all"), its gradients match autograd's, the provenance comments name this
    file (not fxad's training.py), and fxad.vjp keeps the readable d * sign(out)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    x = torch.randn(5, 4)
    fm = fxad.compile(copy.deepcopy(model))
    fm(x).sum().backward()
    code = fm.bwd_gm.code
    assert "torch.ops.aten.threshold_backward(d_relu, relu, 0)" in code
    assert "sign" not in code
    blocks = [ln for ln in code.splitlines() if "# backward of:" in ln]
    assert blocks and all("[test_training.py:" in ln for ln in blocks), blocks
    model(x).sum().backward()
    for p_ref, p in zip(model.parameters(), fm.parameters()):
        torch.testing.assert_close(p.grad, p_ref.grad)
    readable = fxad.vjp(model, x).code
    assert "torch.sign(relu)" in readable and "torch.ops.aten" not in readable
    with fxad.fused_kernels(False):  # the caller's choice wins over the bridge's level
        fm2 = fxad.compile(copy.deepcopy(model))
        fm2(x).sum().backward()
    assert "torch.ops.aten" not in fm2.bwd_gm.code


def test_autocast_off_restores_the_flags():
    from fxad.training import _autocast_devices, _AutocastOff
    devices = _autocast_devices()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with _AutocastOff(devices):
            assert not torch.is_autocast_enabled("cpu")
            assert torch.mm(torch.randn(2, 2), torch.randn(2, 2)).dtype == torch.float32
        assert torch.is_autocast_enabled("cpu")
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16
        with pytest.raises(ValueError), _AutocastOff(devices):
            raise ValueError
        assert torch.is_autocast_enabled("cpu")
    with _AutocastOff(devices):  # autocast already off: nothing to flip or restore
        assert not torch.is_autocast_enabled("cpu")
    assert not torch.is_autocast_enabled("cpu")


def test_build_passes_run_with_autocast_off(monkeypatch):
    """The passes after differentiation compute the dtypes of the nodes they write as the
    code runs, with autocast off (under CUDA autocast, ``torch.sum`` of bfloat16 values
    has a float32 fake value, and a bias gradient's cast back to float32 was then dropped
    as redundant from ``joint_step``'s graph)."""
    import fxad.training.capture as cap
    import fxad.training.module as mod
    import fxad.training.step as stp
    seen = []

    def spy(fn):
        def run(*a, **k):
            seen.append((fn.__name__, torch.is_autocast_enabled("cpu")))
            return fn(*a, **k)
        return run

    monkeypatch.setattr(cap, "sum_to_size_as_sum", spy(cap.sum_to_size_as_sum))
    monkeypatch.setattr(mod, "partition", spy(mod.partition))
    monkeypatch.setattr(stp, "partition", spy(stp.partition))
    model, inputs = _gpt()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fxad.compile(copy.deepcopy(model))(*inputs).backward()
        joint_step(copy.deepcopy(model), *inputs, compile=False)
    assert {name for name, _ in seen} == {"sum_to_size_as_sum", "partition"}
    assert not any(on for _, on in seen), seen


def test_backward_headers_name_the_forward_line_they_differentiate():
    """The graph built for execution renames nodes (a linear becomes reshape, linear,
    reshape), so a captured node's name (``linear_6``: the head) can be another node there
    (a block's linear): each backward block's header must still show its own forward line,
    which the parameter gradients computed under it read."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
            self.head = nn.Linear(8, 5)

        def forward(self, x, y):
            for b in self.blocks:
                x = x + torch.tanh(b(x))
            return F.cross_entropy(self.head(x).flatten(0, 1), y.flatten())

    torch.manual_seed(0)
    model = Net()
    inputs = (torch.randn(2, 3, 8), torch.randint(0, 5, (2, 3)))
    code = joint_step(model, *inputs, compile=False).graph_module.code
    header, checked = None, 0
    for line in code.splitlines():
        s = line.strip()
        if s.startswith("# backward of:"):
            header = s.split("[")[0]
        m = re.match(r"d_(\w+_(weight|bias)) = ", s)
        if m and header is not None:
            assert m.group(1) in header, (s, header)
            checked += 1
    assert checked == 8  # weight and bias of the three blocks and the head
