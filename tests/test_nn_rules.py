"""Checks of the rules in :mod:`fxad.rules.nn` that the generic sample test
(tests/test_rules.py) cannot cover: modes whose gradient is not the finite-difference one
(embedding padding / scale_grad_by_freq), inputs autograd refuses to differentiate (running
statistics, class weights of index targets), random ops (dropout), in-place running-stat
updates, legacy arguments, error messages, and the forward-mode (JVP) rules."""
from __future__ import annotations

import copy
import inspect
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxad
from fxad.tools.coverage import check_seeded, draws_random
from fxad.errors import RuleError
from fxad.rules.nn._common import _bound

DT = torch.float64


def _rand(*shape):
    return torch.randn(shape, dtype=DT)


def _vjp(f, *inputs, cot=None):
    """fxad's (outputs, input cotangents) of f at inputs for the cotangent ``cot``."""
    g = fxad.vjp(f, *inputs)
    with torch.no_grad():
        out = f(*inputs)
    if cot is None:
        cot = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(1))
    res = g(*inputs, cot)
    return res[0], res[1], cot


def _autograd(f, inputs, cot):
    xs = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
    out = f(*xs)
    wrt = [x for x in xs if x.requires_grad]
    grads = iter(torch.autograd.grad(out, wrt, cot))
    return [next(grads) if x.requires_grad else None for x in xs]


def _assert_grads(mine, ref):
    assert len(mine) == len(ref)
    for a, b in zip(mine, ref):
        if b is None:
            continue
        assert a is not None
        torch.testing.assert_close(a, b, rtol=1e-7, atol=1e-9)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# --- softmax --------------------------------------------------------------------------------

@pytest.mark.parametrize("fn", [F.softmax, F.log_softmax])
def test_softmax_implicit_dim(fn):
    def f(x):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return fn(x)
    for shape in [(5,), (3, 4), (2, 3, 4)]:
        fxad.check(f, _rand(*shape))


def test_softmax_dtype_argument():
    x = torch.randn(3, 4)
    f = lambda x: torch.softmax(x, 1, dtype=torch.float64)  # noqa: E731
    out, (d_x,), cot = _vjp(f, x)
    (ref,) = _autograd(f, [x], cot)
    assert out.dtype == torch.float64 and d_x.dtype == torch.float32
    torch.testing.assert_close(d_x, ref)


# --- normalization --------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(6, 3), (4, 3, 5), (2, 3, 4, 4)])
@pytest.mark.parametrize("train", [True, False])
def test_batch_norm_modules(shape, train):
    bn = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d}[len(shape)](3)
    with torch.no_grad():
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 2)
        bn.weight.uniform_(0.5, 2)
        bn.bias.uniform_(-1, 1)
    bn.train(train)
    report = fxad.check(bn, _rand(*shape))
    assert report.n_params == 2


def test_batch_norm_updates_running_stats_like_eager():
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3, momentum=0.3)).double()
    mine = nn.Sequential(nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3, momentum=0.3)).double()
    mine.load_state_dict(ref.state_dict())
    x = _rand(4, 2, 6, 6)
    g = fxad.vjp(mine, x)
    for step in range(3):
        xs = x + step
        out_ref = ref(xs)
        res = g(xs, torch.ones_like(out_ref))
        torch.testing.assert_close(res[0], out_ref)
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(mine.state_dict()[k], v, msg=k)
    assert int(mine[1].num_batches_tracked) == 3


def test_batch_norm_eval_running_stats_as_inputs():
    # autograd refuses gradients w.r.t. running statistics; compare with the composite formula
    x, rm, rv, w, b = _rand(4, 3, 5), _rand(3), torch.rand(3, dtype=DT) + 0.5, _rand(3), _rand(3)

    def f(x, rm, rv, w, b):
        return F.batch_norm(x, rm, rv, w, b, False, 0.1, 1e-3)

    def composite(x, rm, rv, w, b):
        c = lambda v: v.reshape(3, 1)  # noqa: E731
        return (x - c(rm)) / torch.sqrt(c(rv) + 1e-3) * c(w) + c(b)

    out, grads, cot = _vjp(f, x, rm, rv, w, b)
    torch.testing.assert_close(out, composite(x, rm, rv, w, b))
    _assert_grads(grads, _autograd(composite, [x, rm, rv, w, b], cot))


def test_batch_norm_training_does_not_differentiate_running_stats():
    x, rm, rv = _rand(4, 3), torch.zeros(3, dtype=DT), torch.ones(3, dtype=DT)
    _, (d_x, d_rm, d_rv), cot = _vjp(lambda x, rm, rv: F.batch_norm(x, rm, rv, training=True),
                                     x, rm, rv)
    assert torch.count_nonzero(d_rm) == 0 and torch.count_nonzero(d_rv) == 0
    (ref,) = _autograd(lambda x: F.batch_norm(x, None, None, training=True), [x], cot)
    torch.testing.assert_close(d_x, ref)


def test_batch_norm_fused_backward_reads_running_stats_only_in_eval():
    # training: the backward kernel uses the batch statistics the forward saved; the running
    # ones were just updated in place and are not read (nor kept alive) by the backward
    for train in (True, False):
        bn = nn.Sequential(nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3)).double().train(train)
        x = _rand(4, 2, 6, 6)
        ref = copy.deepcopy(bn)
        gm = fxad.vjp(bn, x)
        (node,) = [n for n in gm.graph.nodes
                   if n.target is torch.ops.aten.native_batch_norm_backward]
        stats = node.args[3:5]
        assert all(s is None for s in stats) if train else all(s is not None for s in stats)
        cot = _rand(4, 3, 4, 4)
        (d_x,) = gm(x, cot)[1]
        (d_ref,) = _autograd(ref, [x], cot)
        torch.testing.assert_close(d_x, d_ref)


def test_layer_norm_module():
    ln = nn.LayerNorm((3, 4))
    with torch.no_grad():
        ln.weight.uniform_(0.5, 2)
        ln.bias.uniform_(-1, 1)
    fxad.check(ln, _rand(2, 3, 4))


# --- embedding ------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs", [{"padding_idx": 2}, {"padding_idx": -1},
                                    {"scale_grad_by_freq": True},
                                    {"scale_grad_by_freq": True, "padding_idx": 0},
                                    {"sparse": True}])
def test_embedding_matches_autograd(kwargs):
    idx = torch.tensor([[0, 2, 4, 2], [2, 3, 2, 4]])
    w = _rand(5, 3)
    f = lambda w: F.embedding(idx, w, **kwargs)  # noqa: E731
    out, (d_w,), cot = _vjp(f, w)
    torch.testing.assert_close(out, f(w))
    (ref,) = _autograd(f, [w], cot)
    torch.testing.assert_close(d_w, ref.to_dense())


def test_embedding_max_norm_raises():
    # max_norm renormalizes the weight in place (eager's embedding_renorm_): refused clearly,
    # by the rule or by capture, which sees the op write into its argument
    with pytest.raises((RuleError, fxad.InplaceError), match="max_norm|in place"):
        fxad.vjp(lambda w: F.embedding(torch.tensor([0, 1]), w, max_norm=1.0), _rand(3, 2))


# --- dropout --------------------------------------------------------------------------------

@pytest.mark.parametrize("call", [lambda x: F.dropout(x, 0.3),
                                  lambda x: torch.dropout(x, 0.3, True),
                                  nn.Sequential(nn.Dropout(0.3))])
def test_dropout_training(call):
    x = torch.rand(50, 40, dtype=DT) + 0.5  # nonzero, so the mask is out / x
    g = fxad.vjp(call, x)
    cot = _rand(50, 40)
    out, (d_x,) = g(x, cot)[:2]
    mask = out / x
    kept = mask != 0
    torch.testing.assert_close(mask[kept], torch.full_like(mask[kept], 1 / 0.7))
    assert 0.6 < kept.double().mean() < 0.8
    torch.testing.assert_close(d_x, cot * mask)
    out2 = g(x, cot)[0]
    assert not torch.equal(out, out2)  # a fresh mask per call


@pytest.mark.parametrize("call,expect", [
    (lambda x: F.dropout(x, 0.0), "identity"),
    (lambda x: F.dropout(x, 0.4, training=False), "identity"),
    (lambda x: torch.dropout(x, 0.4, False), "identity"),
    (lambda x: F.dropout(x, 1.0), "zero"),
])
def test_dropout_degenerate(call, expect):
    x, cot = _rand(4, 5), _rand(4, 5)
    out, (d_x,) = fxad.vjp(call, x)(x, cot)
    if expect == "identity":
        assert torch.equal(out, x) and torch.equal(d_x, cot)
    else:
        assert torch.count_nonzero(out) == 0 and torch.count_nonzero(d_x) == 0


# --- losses ---------------------------------------------------------------------------------

def _ce_composite(x, t, w, ignore_index, reduction, eps):
    """Cross-entropy from log_softmax and gather (differentiable in the class weights)."""
    cdim = 0 if x.dim() == 1 else 1
    C = x.shape[cdim]
    logp = torch.log_softmax(x, cdim)
    valid = t != ignore_index
    ts = torch.where(valid, t, 0)
    wb = w.reshape((C,) + (1,) * (x.dim() - cdim - 1))
    nll = -logp.gather(cdim, ts.unsqueeze(cdim)).squeeze(cdim) * torch.take(w, ts) * valid
    smooth = -(logp * wb).sum(cdim) * valid
    loss = (1 - eps) * nll + (eps / C) * smooth
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / (torch.take(w, ts) * valid).sum()


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("eps", [0.0, 0.2])
@pytest.mark.parametrize("shape", [(5, 4), (2, 4, 3), (4,)])
def test_cross_entropy_class_weights(reduction, eps, shape):
    x = _rand(*shape)
    C = shape[1] if len(shape) > 1 else shape[0]
    t = torch.randint(0, C, shape[:1] + shape[2:] if len(shape) > 1 else ())
    if t.dim():
        t.view(-1)[0] = 1
        t.view(-1)[-1] = -100  # ignored
    w = torch.rand(C, dtype=DT) + 0.5

    def f(x, w):
        return F.cross_entropy(x, t, weight=w, reduction=reduction, label_smoothing=eps)

    out, grads, cot = _vjp(f, x, w)
    ref_f = lambda x, w: _ce_composite(x, t, w, -100, reduction, eps)  # noqa: E731
    torch.testing.assert_close(out, ref_f(x, w))
    _assert_grads(grads, _autograd(ref_f, [x, w], cot))
    # and the input gradient against autograd of F.cross_entropy + finite differences
    fxad.check(lambda x: f(x, w), x)


@pytest.mark.parametrize("size_average,reduce", [(False, None), (None, False), (True, True),
                                                 (False, True)])
def test_cross_entropy_and_mse_legacy_flags(size_average, reduce):
    x, t, y = _rand(4, 3), torch.tensor([0, 2, 1, 1]), _rand(4, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fxad.check(lambda x: F.cross_entropy(x, t, size_average=size_average, reduce=reduce), x)
        fxad.check(lambda x, y: F.mse_loss(x, y, size_average=size_average, reduce=reduce), x, y)


def test_mse_loss_broadcast_target():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fxad.check(lambda x, y: F.mse_loss(x, y), _rand(3, 4), _rand(4))


def test_cross_entropy_module_all_ignored_gives_nan_like_eager():
    x, t = _rand(3, 4), torch.full((3,), -100)
    out, (d_x,), _ = _vjp(lambda x: F.cross_entropy(x, t), x, cot=torch.tensor(1.0, dtype=DT))
    assert torch.isnan(out)


# --- attention ------------------------------------------------------------------------------

def test_sdpa_unbatched_and_broadcast_mask():
    q, k, v = _rand(3, 4), _rand(5, 4), _rand(5, 2)
    fxad.check(lambda q, k, v: F.scaled_dot_product_attention(q, k, v), q, k, v)
    q, k, v = _rand(2, 2, 3, 4), _rand(2, 2, 5, 4), _rand(2, 2, 5, 2)
    fxad.check(lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m),
               q, k, v, _rand(2, 1, 1, 5))


@pytest.mark.parametrize("kw", [{}, {"is_causal": True}, {"scale": 0.4}])
def test_sdpa_dropout_matches_autograd_with_the_same_mask(kw):
    q, k, v = _rand(2, 2, 3, 4), _rand(2, 2, 5, 4), _rand(2, 2, 5, 3)
    if kw.get("is_causal"):
        k, v = k[..., :3, :], v[..., :3, :]
    f = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, dropout_p=0.3, **kw)  # noqa: E731
    g = fxad.vjp(f, q, k, v)
    assert "bernoulli_" in g.code  # the mask is drawn as eager CPU attention draws it
    cot = _rand(2, 2, 3, 3)
    torch.manual_seed(7)
    out, grads = g(q, k, v, cot)[:2]
    # eager autograd under the same seed: the same mask, so the same numbers
    xs = [t.clone().requires_grad_() for t in (q, k, v)]
    torch.manual_seed(7)
    want = f(*xs)
    torch.testing.assert_close(out, want.detach())
    for a, b in zip(grads, torch.autograd.grad(want, xs, cot)):
        torch.testing.assert_close(a, b)
    out2 = g(q, k, v, cot)[0]
    assert not torch.equal(out, out2)  # a fresh mask per call


# --- convolution and pooling ----------------------------------------------------------------

def test_conv2d_same_padding_asymmetric_raises():
    with pytest.raises(RuleError, match="asymmetric"):
        fxad.vjp(lambda x, w: torch.conv2d(x, w, padding="same"), _rand(1, 2, 5, 5),
                 _rand(3, 2, 2, 2))


def test_small_cnn():
    net = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                        nn.MaxPool2d(2), nn.Conv2d(4, 4, 3, stride=2, padding=1, groups=2),
                        nn.AvgPool2d(2, ceil_mode=True, count_include_pad=False),
                        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3))
    x = _rand(2, 3, 10, 10)
    fxad.check(net, x)
    net.eval()
    fxad.check(net, x)


def test_avg_pool2d_partial_ceil_window_with_padding_count_raises():
    with pytest.raises(RuleError, match="ceil_mode"):
        fxad.vjp(lambda x: F.avg_pool2d(x, 2, ceil_mode=True), _rand(1, 1, 5, 5))


def test_avg_pool2d_ceil_mode_count_exclude_pad_with_padding():
    fxad.check(lambda x: F.avg_pool2d(x, 3, 2, 1, ceil_mode=True, count_include_pad=False),
               _rand(2, 2, 6, 6))


def test_max_pool2d_ties_route_to_one_input():
    x = torch.ones(1, 1, 4, 4, dtype=DT)
    out, (d_x,), cot = _vjp(lambda x: F.max_pool2d(x, 2, 1), x)
    (ref,) = _autograd(lambda x: F.max_pool2d(x, 2, 1), [x], cot)
    torch.testing.assert_close(d_x, ref)


# --- plain formulas (fused backward kernels switched off) ------------------------------------

def _calls_fused_kernels(rule) -> bool:
    try:
        return "fused.enabled()" in inspect.getsource(rule.bwd)
    except (OSError, TypeError):
        return False


# the core nn rules these checks were written for (softmax, normalization, embedding, dropout,
# cross-entropy / MSE, attention, 2-d convolution and pooling); the other rules under
# fxad.rules.nn are checked by tests/test_rules.py
_CORE_NN = {torch.softmax, torch.log_softmax, F.softmax, F.log_softmax, F.layer_norm,
            F.batch_norm, F.embedding, F.dropout, torch.dropout, F.cross_entropy, F.mse_loss,
            F.scaled_dot_product_attention, torch.conv2d, F.max_pool2d,
            F.max_pool2d_with_indices, F.avg_pool2d, F.adaptive_avg_pool2d}


def _is_nn_rule(rule):
    return rule.op in _CORE_NN


def _nn_sample_cases():
    """Samples of the nn rules and of every other rule whose backward has a fused branch
    (relu, gelu, silu, ...)."""
    from fxad.rules.registry import op_name
    for op, rule in sorted(fxad.all_rules().items(), key=lambda kv: op_name(kv[0])):
        if rule.samples is None or not (_is_nn_rule(rule) or _calls_fused_kernels(rule)):
            continue
        torch.manual_seed(0)
        for i, (args, kwargs) in enumerate(rule.samples(DT)):
            yield pytest.param(op, args, kwargs, id=f"{op_name(op)}-{i}")


@pytest.mark.parametrize("level", [False, "all"])
@pytest.mark.parametrize("op,args,kwargs", list(_nn_sample_cases()))
def test_formulas_at_other_fused_levels(op, args, kwargs, level):
    """tests/test_rules.py checks the samples at the default level; this checks the
    plain-torch formulas the rules write with fused kernels off, and the extra kernels of
    level "all" (relu's threshold_backward)."""
    slots = [i for i, v in enumerate(args) if isinstance(v, torch.Tensor) and v.is_floating_point()]

    def fn(*xs):
        a = list(args)
        for i, x in zip(slots, xs):
            a[i] = x
        return op(*a, **kwargs)

    xs = [args[i] for i in slots]
    with fxad.fused_kernels(level):
        if draws_random(fn, xs):  # dropout in training: eager and fxad under one seed
            problems = check_seeded(fn, xs, seed=12345)
            assert not problems, problems
        else:
            fxad.check(fn, *xs)


def test_fused_kernel_levels():
    from fxad.rules import fused
    assert fused.current() is True and fused.enabled() and not fused.enabled("all")
    with fxad.fused_kernels("all"):
        assert fused.current() == "all" and fused.enabled() and fused.enabled("all")
        with fused.for_execution():
            assert fused.current() == "all"
        with fxad.fused_kernels(False):
            assert not fused.enabled() and not fused.enabled("all")
            with fused.for_execution():  # an explicit False is kept
                assert fused.current() is False
    assert fused.current() is True
    for bad in ("fast", 2, None):
        with pytest.raises(ValueError, match="use False, True or 'all'"):
            with fxad.fused_kernels(bad):
                pass
    x = torch.randn(3, 4, dtype=DT)
    with fxad.fused_kernels("all"):
        assert "threshold_backward" in fxad.vjp(torch.relu, x).code
    assert "threshold_backward" not in fxad.vjp(torch.relu, x).code


@pytest.mark.parametrize("shape,target,kwargs,fused_path", [
    ((6, 5), [1, -100, 4, 2, 0, 3], {}, True),
    ((6, 5), [1, -100, 4, 2, 0, 3], {"reduction": "sum"}, True),
    ((6, 5), [1, 3, 4, 2, 0, 3], {"reduction": "none", "ignore_index": 3}, True),
    ((5,), 3, {}, True),
    ((6, 5), [1, 0, 4, 2, 0, 3], {"label_smoothing": 0.1}, False),
    ((6, 5), [1, 0, 4, 2, 0, 3], {"weight": "w"}, False),
    ((2, 5, 3), [[1, 0, 4], [2, 0, 3]], {}, False),
])
def test_cross_entropy_fused_path(shape, target, kwargs, fused_path):
    """At level "all", cross-entropy of (N, C) / (C,) logits with class indices and neither
    class weights nor label smoothing runs autograd's two backward kernels
    (nll_loss_backward, _log_softmax_backward_data) and gives autograd's values bit for bit;
    other cases keep the closed-form backward."""
    torch.manual_seed(0)
    x = torch.randn(shape, dtype=DT)
    t = torch.tensor(target)
    kw = dict(kwargs)
    if kw.get("weight") == "w":
        kw["weight"] = torch.rand(shape[1], dtype=DT) + 0.5

    def f(x):
        return F.cross_entropy(x, t, **kw)

    with fxad.fused_kernels("all"):
        g = fxad.vjp(f, x)
    assert ("nll_loss_backward" in g.code) == fused_path
    assert ("_log_softmax_backward_data" in g.code) == fused_path
    xr = x.clone().requires_grad_()
    out = f(xr)
    cot = torch.randn_like(out)
    (ref,) = torch.autograd.grad(out, xr, cot)
    value, (d_x,) = g(x, cot)
    if fused_path:
        assert torch.equal(value, out.detach()) and torch.equal(d_x, ref)
    else:
        torch.testing.assert_close(value, out.detach())
        torch.testing.assert_close(d_x, ref)
    assert "nll_loss_backward" not in fxad.vjp(f, x).code  # the default level: closed form


# --- forward mode ---------------------------------------------------------------------------

def _jvp_cases():
    for op, rule in sorted(fxad.all_rules().items(), key=lambda kv: repr(kv[0])):
        if rule.jvp is None or rule.samples is None or not _is_nn_rule(rule):
            continue
        torch.manual_seed(0)
        for i, (args, kwargs) in enumerate(rule.samples(DT)):
            yield pytest.param(op, rule, args, kwargs, id=f"{getattr(op, '__name__', op)}-{i}")


def _sdpa_math(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
               enable_gqa=False):
    """Reference attention (forward AD is not implemented for the fused CPU kernels)."""
    if enable_gqa:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], -3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], -3)
    s = q @ k.mT * (q.shape[-1] ** -0.5 if scale is None else scale)
    if is_causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    if attn_mask is not None:
        s = s.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool \
            else s + attn_mask
    return torch.softmax(s, -1) @ v


@pytest.mark.parametrize("op,rule,args,kwargs", list(_jvp_cases()))
def test_jvp_matches_torch_func(op, rule, args, kwargs):
    if op is F.scaled_dot_product_attention:
        torch.testing.assert_close(_sdpa_math(*args, **kwargs), op(*args, **kwargs))
        op = _sdpa_math
    b = inspect.signature(rule.fwd).bind(*args, **kwargs)
    b.apply_defaults()
    primals = tuple(b.arguments.values())
    slots = [i for i, v in enumerate(primals)
             if isinstance(v, torch.Tensor) and v.is_floating_point()]
    tangents = tuple(torch.randn_like(primals[i]) if i in slots else None
                     for i in range(len(primals)))

    def f(*xs):  # the op called as in the sample, float tensors replaced by xs
        new = {id(primals[i]): x for i, x in zip(slots, xs)}
        sub = lambda v: new.get(id(v), v) if isinstance(v, torch.Tensor) else v  # noqa: E731
        return op(*[sub(a) for a in args], **{k: sub(v) for k, v in kwargs.items()})

    xs, ts = tuple(primals[i] for i in slots), tuple(tangents[i] for i in slots)
    if draws_random(f, list(xs)):
        # a random op (dropout in training): eager forward-mode AD under the same seed is the
        # reference (torch.func.jvp draws other masks for strided inputs)
        import torch.autograd.forward_ad as fwAD
        with fwAD.dual_level():
            torch.manual_seed(12345)
            ref_out, ref_t = fwAD.unpack_dual(f(*map(fwAD.make_dual, xs, ts)))
        torch.manual_seed(12345)
        out, t = rule.jvp(primals, tangents)
        assert torch.equal(out, ref_out)  # the same draws
        torch.testing.assert_close(torch.zeros_like(ref_t) if t is None else t, ref_t)
        return
    ref_out, ref_t = torch.func.jvp(f, xs, ts)
    out, t = rule.jvp(primals, tangents)
    if isinstance(ref_out, tuple):  # max_pool2d(return_indices=True): tangent of the values
        assert t[1] is None
        ref_out, ref_t, out, t = ref_out[0], ref_t[0], out[0], t[0]
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(t, ref_t)


def test_bound_fills_defaults():
    p, t = _bound(lambda input, p=0.5, training=True: None, (1,), (2,))
    assert p == {"input": 1, "p": 0.5, "training": True}
    assert t == {"input": 2, "p": None, "training": None}


class _NormThenTokens(nn.Module):
    """A batch norm whose cotangent comes back through ``flatten(2).transpose(1, 2)`` and a
    layer norm (timm's EfficientFormer): at batch 1 the cotangent's strides on the size-1
    batch dimension are not the canonical channels-last ones."""

    def __init__(self, c=16):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 1)
        self.bn = nn.BatchNorm2d(c)
        self.gamma = nn.Parameter(torch.randn(c))
        self.ln = nn.LayerNorm(c)

    def forward(self, x):
        x = x + self.bn(self.conv(x)) * self.gamma.view(1, -1, 1, 1)
        tokens = self.ln(x.flatten(2).transpose(1, 2))
        return (tokens * torch.linspace(-1, 2, tokens.shape[-1], dtype=x.dtype)).pow(2).sum()


@pytest.mark.parametrize("shape", [(1, 16, 7, 7), (2, 16, 5, 5)])
def test_batch_norm_kernel_gets_canonical_strides(shape):
    """PyTorch's CPU native_batch_norm_backward is wrong for a channels-last cotangent with
    a non-canonical stride on a size-1 dimension beside a row-major input (eager autograd
    included, torch 2.13): fxad's derivative must match finite differences there."""
    torch.manual_seed(0)
    m = _NormThenTokens(shape[1]).double().train()
    x = torch.randn(shape, dtype=DT)
    state = copy.deepcopy(m.state_dict())
    trained = copy.deepcopy(m)
    _, (d_x,), _ = fxad.grad(m, x)(x)
    u = torch.randn(shape, dtype=DT)
    eps = 1e-6
    m.load_state_dict(state)
    up = m(x + eps * u).item()
    m.load_state_dict(state)
    down = m(x - eps * u).item()
    fd = (up - down) / (2 * eps)
    assert abs((d_x * u).sum().item() - fd) <= 1e-6 * abs(fd)
    xr = x.clone().requires_grad_()  # the training path's kernel too
    fxad.compile(trained)(xr).backward()
    assert abs((xr.grad * u).sum().item() - fd) <= 1e-6 * abs(fd)


def test_canonical_layout_copies_only_odd_channels_last_strides():
    from fxad.ops import canonical_layout
    base = torch.randn(49 * 8, dtype=DT)
    odd = base.as_strided((1, 8, 7, 7), (8, 1, 56, 8))  # batch stride 8, not 392
    fixed = canonical_layout(odd)
    assert fixed.stride() == (392, 1, 56, 8) and torch.equal(fixed, odd)
    canon = torch.randn(1, 7, 7, 8, dtype=DT).permute(0, 3, 1, 2)
    assert canonical_layout(canon) is canon
    rowmajor = torch.randn(1, 8, 7, 7, dtype=DT)
    assert canonical_layout(rowmajor) is rowmajor
    flat = torch.randn(3, 4, dtype=DT)
    assert canonical_layout(flat) is flat
