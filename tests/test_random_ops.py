"""Random ops: fxad's generated code draws the same random numbers as eager PyTorch (CPU).

Under one ``torch.manual_seed``, the values, cotangents (``fxad.vjp``) and tangents
(``fxad.jvp``) of every random op equal eager autograd's *bit for bit*, in float32 and
float64, for contiguous and strided inputs and several seeds; a training run through
``fxad.compile`` follows eager's parameters; the backward never draws.  (The rule tests,
``tests/test_rules.py`` and ``tests/test_forward.py``, check the same ops' samples under
equal seeds against autograd and finite differences.)
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn as nn
import torch.nn.functional as F
from torch.utils import _pytree as pytree

import fxad
from fxad.tools.coverage import check_seeded

SEEDS = (0, 1, 7)

# (name, function, input shape): every random op of the issue, each through its public
# spelling(s); functions returning (value, indices) are compared on the value
OPS = [
    ("dropout", lambda x: F.dropout(x, 0.3), (4, 5, 6)),
    ("dropout_p0.9", lambda x: F.dropout(x, 0.9), (33, 40)),  # > 800 elements: parallel draw
    ("nn.Dropout", nn.Dropout(0.5), (4, 5)),
    ("torch.dropout", lambda x: torch.dropout(x, 0.4, True), (4, 5)),
    ("dropout1d", lambda x: F.dropout1d(x, 0.3), (4, 5, 6)),
    ("dropout1d_unbatched", lambda x: F.dropout1d(x, 0.3), (5, 6)),
    ("dropout2d", lambda x: F.dropout2d(x, 0.3), (4, 5, 6, 3)),
    ("dropout3d", lambda x: F.dropout3d(x, 0.3), (2, 5, 4, 3, 2)),
    ("dropout3d_unbatched", lambda x: F.dropout3d(x, 0.3), (5, 4, 3, 2)),
    ("torch.feature_dropout", lambda x: torch.feature_dropout(x, 0.4, True), (4, 5, 6)),
    ("alpha_dropout", lambda x: F.alpha_dropout(x, 0.3, True), (4, 5, 6)),
    ("nn.AlphaDropout", nn.AlphaDropout(0.2), (4, 5)),
    ("feature_alpha_dropout", lambda x: F.feature_alpha_dropout(x, 0.3, True), (4, 5, 6, 3)),
    ("native_dropout", lambda x: torch.native_dropout(x, 0.4, True), (4, 5, 6)),
    ("rrelu", lambda x: F.rrelu(x, training=True), (4, 5, 6)),
    ("nn.RReLU", nn.RReLU(0.1, 0.4), (4, 5)),
    ("torch.rrelu", lambda x: torch.rrelu(x, 0.1, 0.9, True), (30, 40)),
    ("rrelu_eval", lambda x: F.rrelu(x), (4, 5, 6)),
    ("bernoulli", lambda x: torch.bernoulli(torch.sigmoid(x)) * x, (4, 5, 6)),
    ("bernoulli_method", lambda x: torch.sigmoid(x).bernoulli() * x, (4, 5)),
    ("bernoulli_inplace", lambda x: x * torch.empty_like(x).bernoulli_(0.3), (4, 5)),
    ("normal", lambda x: torch.normal(x, x.exp()), (4, 5, 6)),
    ("normal_float_std", lambda x: torch.normal(x, 2.0), (4, 5, 6)),
    ("normal_float_mean", lambda x: torch.normal(1.0, x.exp()), (4, 5, 6)),
    ("normal_broadcast", lambda x: torch.normal(x, x[0].exp()), (4, 5)),
    ("normal_inplace", lambda x: x + torch.empty_like(x).normal_(0.5, 2.0), (20, 30)),
    ("uniform_inplace", lambda x: x * torch.empty_like(x).uniform_(-1, 1), (4, 5)),
    ("fractional_max_pool2d", lambda x: F.fractional_max_pool2d(x, 2, output_size=(3, 3)),
     (2, 3, 7, 8)),
    ("fractional_max_pool2d_ratio", lambda x: F.fractional_max_pool2d(
        x, 2, output_ratio=(0.5, 0.5), return_indices=True), (2, 3, 9, 8)),
    ("fractional_max_pool2d_unbatched", lambda x: F.fractional_max_pool2d(x, 2, output_size=3),
     (3, 7, 8)),
    ("nn.FractionalMaxPool2d", nn.FractionalMaxPool2d(3, output_size=4), (2, 3, 9, 9)),
    ("fractional_max_pool3d", lambda x: F.fractional_max_pool3d(x, 2, output_size=(2, 3, 2)),
     (2, 3, 5, 6, 5)),
    ("several", lambda x: F.dropout(x, 0.2) + F.rrelu(x * 2, training=True)
     * F.dropout2d(x.unsqueeze(-1), 0.5).squeeze(-1) + torch.bernoulli(x.sigmoid()), (4, 5, 6)),
]


def _value(out):
    return out[0] if isinstance(out, tuple) else out


def _inputs(shape, dtype, strided):
    gen = torch.Generator().manual_seed(3)
    if not strided:
        return torch.randn(shape, dtype=dtype, generator=gen)
    # the same shape with the dimensions' memory order reversed
    return torch.randn(tuple(reversed(shape)), dtype=dtype, generator=gen).permute(
        *reversed(range(len(shape))))


def _eager(f, x, cot, tan, seed):
    xr = x.detach().clone().requires_grad_()
    torch.manual_seed(seed)
    out = _value(f(xr))
    grad = torch.autograd.grad(out, xr, cot, allow_unused=True)[0] \
        if out.requires_grad else None
    rng_after = torch.get_rng_state()
    with fwAD.dual_level():
        torch.manual_seed(seed)
        t = fwAD.unpack_dual(_value(f(fwAD.make_dual(x, tan)))).tangent
    return out.detach(), (torch.zeros_like(x) if grad is None else grad), \
        (torch.zeros_like(out) if t is None else t), rng_after


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("name,f,shape", OPS, ids=[o[0] for o in OPS])
def test_same_draws_as_eager_bit_for_bit(name, f, shape, dtype, strided):
    x = _inputs(shape, dtype, strided)
    g = fxad.vjp(lambda x: _value(f(x)), x)
    j = fxad.jvp(lambda x: _value(f(x)), x)
    gen = torch.Generator().manual_seed(11)
    cot = torch.randn(_value(f(x)).shape, dtype=dtype, generator=gen)
    tan = torch.randn(shape, dtype=dtype, generator=gen)
    for seed in SEEDS:
        out, grad, tangent, rng_after = _eager(f, x, cot, tan, seed)
        torch.manual_seed(seed)
        got, (d_x,) = g(x, cot)
        # the same draws, consumed in the same amount: the backward draws nothing
        assert torch.equal(torch.get_rng_state(), rng_after), "another number of draws"
        assert torch.equal(got, out), f"{name}: values differ from eager (seed {seed})"
        assert torch.equal(torch.zeros_like(x) if d_x is None else d_x, grad), \
            f"{name}: cotangent differs from autograd (seed {seed})"
        torch.manual_seed(seed)
        got_j, t = j(x, tan)
        assert torch.equal(got_j, out)
        assert torch.equal(torch.zeros_like(out) if t is None else t, tangent), \
            f"{name}: tangent differs from forward-mode autograd (seed {seed})"


def test_seeds_give_different_draws():
    """The generated code draws from the global generator, afresh on every call."""
    x = torch.randn(50, 40)
    g = fxad.vjp(lambda x: F.dropout(x, 0.5), x)
    torch.manual_seed(0)
    a = g(x, torch.ones(50, 40))[0]
    b = g(x, torch.ones(50, 40))[0]
    torch.manual_seed(1)
    c = g(x, torch.ones(50, 40))[0]
    assert not torch.equal(a, b) and not torch.equal(a, c)


def test_draw_code_is_eagers():
    """What the generated forward draws, as the reader sees it."""
    x = torch.randn(4, 5, 6)
    code = fxad.vjp(lambda x: F.dropout(x, 0.3), x).code
    assert "torch.empty_like(x)" in code and ".bernoulli_(0.7)" in code
    assert "rand_like" not in code
    assert "backward of: dropout = x * truediv" in code
    code = fxad.vjp(lambda x: F.dropout2d(x, 0.3), x.unsqueeze(0)).code
    assert "torch.empty((1, 4, 1, 1), dtype = torch.float32" in code
    code = fxad.vjp(lambda x: F.rrelu(x, training=True), x).code
    # the default bounds (0.125, 1/3) are left out of the printed call
    assert "noise_out = torch.ops.aten.rrelu_with_noise_functional.default(x, empty_like, " \
        "training = True)" in code
    code = fxad.vjp(lambda x: F.fractional_max_pool2d(x, 2, output_size=2), x).code
    assert "torch.rand(1, 4, 2, dtype = torch.float32" in code
    code = fxad.vjp(lambda x: torch.normal(x, 2.0) * x, x).code
    assert "torch.normal(x, 2.0)" in code


@pytest.mark.parametrize("name,f,shape", [o for o in OPS if o[0] in (
    "dropout", "dropout3d", "feature_alpha_dropout", "rrelu", "fractional_max_pool2d_ratio",
    "bernoulli", "normal", "several")], ids=lambda v: v if isinstance(v, str) else "")
def test_check_seeded_against_autograd_and_finite_differences(name, f, shape):
    x = _inputs(shape, torch.float64, False)
    fd = name not in ("normal", "several")  # normal: autograd's zero, not the pathwise one
    problems = check_seeded(lambda x: _value(f(x)), [x], seed=5, fd=fd)
    assert not problems, problems


def test_degenerate_dropouts_follow_eager():
    x = torch.randn(2, 3, 4, 5)
    x[0, 0, 0, 0] = float("nan")
    for f in (lambda x: F.dropout(x, 0.0), lambda x: F.dropout(x, 0.4, training=False),
              lambda x: F.alpha_dropout(x, 0.4), lambda x: F.dropout2d(x, 0.4, False),
              lambda x: F.feature_alpha_dropout(x, 0.0, True)):
        out, (d_x,) = fxad.vjp(f, x)(x, torch.ones_like(x))
        assert torch.equal(out, f(x), ) or torch.allclose(out, f(x), equal_nan=True)
        assert torch.equal(d_x, torch.ones_like(x))
    for f in (lambda x: F.dropout(x, 1.0), lambda x: F.dropout3d(x.unsqueeze(0), 1.0),
              lambda x: F.alpha_dropout(x, 1.0, True)):
        out, (d_x,) = fxad.vjp(f, x)(x, torch.ones_like(f(x)))
        assert torch.allclose(out, f(x), equal_nan=True)  # x * 0: NaN stays NaN, as eager
        assert torch.count_nonzero(d_x) == 0
    e = torch.randn(0, 3)
    assert fxad.vjp(lambda x: F.dropout(x, 0.5), e)(e, e)[0].shape == (0, 3)


def test_bernoulli_float_p_has_zero_derivative():
    """torch.bernoulli(x, p) draws Bernoulli(p) with x's shape: eager autograd raises
    "derivative not implemented"; fxad gives the zero cotangent (the value does not depend
    on x) and the same draws."""
    x = torch.randn(4, 5, dtype=torch.float64)
    g = fxad.vjp(lambda x: torch.bernoulli(x, 0.3) * 2, x)
    torch.manual_seed(4)
    out, (d_x,) = g(x, torch.ones(4, 5, dtype=torch.float64))
    torch.manual_seed(4)
    assert torch.equal(out, torch.bernoulli(x, 0.3) * 2)
    assert d_x is None or torch.count_nonzero(d_x) == 0


def test_normal_gradient_is_autograds_zero_not_reparameterized():
    """torch.normal's derivative is zero in autograd (derivatives.yaml); fxad gives the same.
    The reparameterized form ``mean + std * randn_like(std)`` is differentiated as written."""
    m, s = torch.randn(5, dtype=torch.float64), torch.rand(5, dtype=torch.float64) + 0.5
    g = fxad.vjp(lambda m, s: torch.normal(m, s), m, s)
    _, (d_m, d_s) = g(m, s, torch.ones(5, dtype=torch.float64))
    assert all(d is None or torch.count_nonzero(d) == 0 for d in (d_m, d_s))
    g = fxad.vjp(lambda m, s: m + s * torch.randn_like(s), m, s)
    torch.manual_seed(2)
    out, (d_m, d_s) = g(m, s, torch.ones(5, dtype=torch.float64))
    torch.manual_seed(2)
    eps = torch.randn_like(s)
    assert torch.equal(d_m, torch.ones(5, dtype=torch.float64)) and torch.equal(d_s, eps)


def test_fixed_fractional_windows_are_deterministic():
    x = torch.randn(2, 3, 7, 6, dtype=torch.float64)
    samples = torch.rand(2, 3, 2, dtype=torch.float64)
    f = lambda x: F.fractional_max_pool2d(x, 2, output_size=3, _random_samples=samples)  # noqa
    assert "torch.rand(" not in fxad.vjp(f, x).code
    fxad.check(f, x)


def test_check_refuses_random_functions_clearly():
    for f, x in ((lambda x: F.dropout2d(x, 0.3), torch.randn(2, 3, 4, 4)),
                 (lambda x: F.rrelu(x, training=True), torch.randn(3, 4)),
                 (lambda x: F.fractional_max_pool2d(x, 2, output_size=2), torch.randn(1, 2, 5, 5)),
                 (lambda x: F.alpha_dropout(x, 0.3, True), torch.randn(3, 4))):
        with pytest.raises(fxad.InputError, match="random ops"):
            fxad.check(f, x)
    fxad.check(lambda x: F.rrelu(x), torch.randn(3, 4))  # eval mode: deterministic


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.drop2d = nn.Dropout2d(0.3)
        self.pool = nn.FractionalMaxPool2d(2, output_size=4)
        self.act = nn.RReLU()
        self.fc = nn.Linear(4 * 16, 10)
        self.drop = nn.Dropout(0.4)
        self.alpha = nn.AlphaDropout(0.2)

    def forward(self, x):
        h = self.act(self.pool(self.drop2d(self.conv(x))))
        return self.alpha(self.drop(self.fc(h.flatten(1)))).square().mean()


def test_module_gradients_equal_eager_under_the_same_seed():
    torch.manual_seed(0)
    m = _Net()
    x = torch.randn(5, 3, 8, 8)
    g = fxad.grad(m, x, argnums=())
    for seed in SEEDS:
        torch.manual_seed(seed)
        loss, _, grads = g(x)
        m.zero_grad()
        torch.manual_seed(seed)
        ref = m(x)
        ref.backward()
        assert torch.equal(loss, ref.detach())
        for name, p in m.named_parameters():
            assert torch.equal(grads[name], p.grad), name


@pytest.mark.parametrize("policy", ["save", "min_memory"])
def test_training_run_through_compile_follows_eager(policy):
    """The issue's comparison: the same seed, a few SGD steps, eager autograd vs
    fxad.compile: the same masks every step, so the same parameters (also where the residual
    policy recomputes values in the backward: a draw is never recomputed)."""
    torch.manual_seed(0)
    m_ag = _Net()
    m_fx = _Net()
    m_fx.load_state_dict(m_ag.state_dict())
    xs = [torch.randn(5, 3, 8, 8, generator=torch.Generator().manual_seed(k)) for k in range(3)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cm = fxad.compile(m_fx, xs[0], policy=policy)
    opt_ag = torch.optim.SGD(m_ag.parameters(), lr=0.1)
    opt_fx = torch.optim.SGD(m_fx.parameters(), lr=0.1)
    for k, x in enumerate(xs):
        for model, opt in ((m_ag, opt_ag), (cm, opt_fx)):
            torch.manual_seed(100 + k)
            opt.zero_grad()
            loss = model(x)
            loss.backward()
            opt.step()
    for (n, a), b in zip(m_ag.named_parameters(), m_fx.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7, msg=n)


def test_random_leaves_in_pytree_outputs():
    x = torch.randn(3, 4)
    g = fxad.vjp(lambda x: (F.dropout(x, 0.5), torch.native_dropout(x, 0.5, True)), x)
    torch.manual_seed(9)
    out, _ = g(x, (torch.ones(3, 4), (torch.ones(3, 4), None)))
    torch.manual_seed(9)
    ref = (F.dropout(x, 0.5), torch.native_dropout(x, 0.5, True))
    for a, b in zip(pytree.tree_leaves(out), pytree.tree_leaves(ref)):
        assert torch.equal(a, b)


def test_fused_device_dropout_calls_eagers_fused_kernel(monkeypatch):
    """On CUDA/XPU eager F.dropout runs the fused native_dropout kernel (ATen's
    is_fused_kernel_acceptable), and so does the generated code for tensors traced there.
    Without a GPU, the plumbing is checked by treating the CPU as such a device: the code then
    calls torch.native_dropout and matches eager's native_dropout bit for bit."""
    import fxad.rules.nn.dropout as dropout_rules
    monkeypatch.setattr(dropout_rules, "_FUSED_DEVICES", ("cpu",))
    x = torch.randn(4, 5, dtype=torch.float64)
    g = fxad.vjp(lambda x: F.dropout(x, 0.3), x)
    assert "torch.native_dropout(x, 0.3, True)" in g.code
    cot = torch.randn(4, 5, dtype=torch.float64)
    xr = x.clone().requires_grad_()
    torch.manual_seed(1)
    ref = torch.native_dropout(xr, 0.3, True)[0]
    (ref_g,) = torch.autograd.grad(ref, xr, cot)
    torch.manual_seed(1)
    out, (d_x,) = g(x, cot)
    assert torch.equal(out, ref) and torch.equal(d_x, ref_g)


def _scalar(f):
    """A scalar function of ``x`` through the random op, curved so that its Hessian is not
    zero: ``sum(op(sin x)^2)``."""
    return lambda x: (_value(f(x.sin())) ** 2).sum()


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
@pytest.mark.parametrize("name,f,shape", OPS, ids=[o[0] for o in OPS])
def test_hvp_through_random_ops_equals_torch_func(name, f, shape, strided):
    """Forward-over-reverse through the draws that the gradient code makes
    (``empty_like(x).bernoulli_(0.7)``): ``fxad.hvp`` under one seed equals autograd's
    double backward under the same seed (the same draws, consumed in the same amount), in
    float64."""
    fs = _scalar(f)
    x = _inputs(shape, torch.float64, strided)
    tan = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    h = fxad.hvp(fs, x)
    for seed in SEEDS[:2]:
        torch.manual_seed(seed)
        (g,), (hv,) = h(x, tan)
        xr = x.detach().clone().requires_grad_()  # (clone keeps the strides)
        torch.manual_seed(seed)
        (want_g,) = torch.autograd.grad(fs(xr), xr, create_graph=True)
        # (no check of the generator's state after the call: the HVP code returns no value,
        # and a draw that reaches neither the gradient nor the HVP, bernoulli's or normal's
        # with their zero derivative, is dead code there, as in fxad.grad)
        (want_hv,) = torch.autograd.grad(want_g, xr, tan, allow_unused=True)
        want_hv = torch.zeros_like(x) if want_hv is None else want_hv
        torch.testing.assert_close(g, want_g, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(hv, want_hv, rtol=1e-10, atol=1e-12)


def test_second_derivatives_through_dropout_module_and_gradient_code():
    """``nn.Dropout`` in training mode inside a module: fxad.hvp of a function of the input,
    ``fxad.jvp`` of the generated gradient code, and ``fxad.vjp`` of it (reverse over
    reverse) all equal torch.func's under the same seed."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 7), nn.Dropout(0.4), nn.Tanh(), nn.Linear(7, 1)).double()
    net.train()

    def loss(x):
        return net(x).pow(2).sum()

    x = torch.randn(3, 5, dtype=torch.float64)
    tan = torch.randn(3, 5, dtype=torch.float64)
    torch.manual_seed(4)
    want_g, want_hv = torch.func.jvp(torch.func.grad(loss), (x,), (tan,))
    torch.manual_seed(4)
    (g,), (hv,) = fxad.hvp(loss, x)(x, tan)
    torch.testing.assert_close(g, want_g, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(hv, want_hv, rtol=1e-10, atol=1e-12)
    grad_code = fxad.grad(loss, x)
    torch.manual_seed(4)
    (_, (g2,)), (_, (hv2,)) = fxad.jvp(grad_code, x)(x, tan)
    torch.testing.assert_close(g2, want_g, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(hv2, want_hv, rtol=1e-10, atol=1e-12)
    # reverse over reverse: the VJP of the gradient code with cotangent `tan` is H tan
    rev = fxad.vjp(lambda x: grad_code(x)[1][0], x)
    torch.manual_seed(4)
    _, (hv3,) = rev(x, tan)
    torch.testing.assert_close(hv3, want_hv, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("lower,upper,training", [(0.1, 0.3, True), (0.2, 0.2, True),
                                                  (0.1, 0.3, False)],
                         ids=["training", "equal_bounds", "eval"])
def test_rrelu_with_noise_kernel_against_finite_differences(lower, upper, training):
    """The kernel F.rrelu's generated code calls, differentiated again (fxad.hvp of rrelu
    code): VJP and JVP of ``aten.rrelu_with_noise_functional`` against central finite
    differences of the seeded function in float64 (torch 2.13's own autograd formula reads the
    noise argument, not the drawn slopes, so it is not the reference here)."""
    op = torch.ops.aten.rrelu_with_noise_functional.default
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(4, 5, dtype=torch.float64, generator=gen)
    noise = torch.rand(4, 5, dtype=torch.float64, generator=gen)
    cots = tuple(torch.randn(4, 5, dtype=torch.float64, generator=gen) for _ in range(2))
    tans = tuple(torch.randn(4, 5, dtype=torch.float64, generator=gen) for _ in range(2))

    def seeded(x, noise):
        torch.manual_seed(21)
        return op(x, noise, lower, upper, training)

    def fd(direction, eps=1e-6):
        plus = seeded(x + eps * direction[0], noise + eps * direction[1])
        minus = seeded(x - eps * direction[0], noise - eps * direction[1])
        return tuple((p - m) / (2 * eps) for p, m in zip(plus, minus))

    g = fxad.vjp(lambda x, noise: op(x, noise, lower, upper, training), x, noise)
    torch.manual_seed(21)
    out, (d_x, d_noise) = g(x, noise, cots)
    for a, b in zip(out, seeded(x, noise)):
        assert torch.equal(a, b)
    d_noise = torch.zeros_like(noise) if d_noise is None else d_noise
    # <cot, J v> = <J^T cot, v> for the basis directions of x and noise, summed
    basis = torch.eye(20, dtype=torch.float64)
    for k in range(20):
        v = basis[k].view(4, 5)
        for which, got in ((0, d_x), (1, d_noise)):
            direction = (v, torch.zeros_like(v)) if which == 0 else (torch.zeros_like(v), v)
            jv = fd(direction)
            want = sum((c * j).sum() for c, j in zip(cots, jv))
            torch.testing.assert_close((got * v).sum(), want, rtol=1e-6, atol=1e-8)
    j = fxad.jvp(lambda x, noise: op(x, noise, lower, upper, training), x, noise)
    torch.manual_seed(21)
    _, t_out = j(x, noise, *tans)
    for got, want in zip(t_out, fd(tans)):
        torch.testing.assert_close(torch.zeros_like(x) if got is None else got, want,
                                   rtol=1e-6, atol=1e-8)
