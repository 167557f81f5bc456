"""Python decisions on tensor values: taken on the real example value, re-checked by a guard
line on every call (fxad.capture.decisions, fxad.guards.expect); fxad.compile rebuilds on a
miss.  Gradients in float64 against torch.autograd."""
import linecache
import warnings

import pytest
import torch
import torch.nn as nn

import fxad
from fxad.capture.decisions import current_policy, value_policy
from fxad.training.module import VALUE_BUILDS_WARN

D = torch.float64


def _line(fn, text):
    """``file:line`` of the first line of ``fn``'s file (from its def on) containing ``text``."""
    code = fn.__code__
    n = code.co_firstlineno
    while text not in linecache.getline(code.co_filename, n):
        n += 1
    return f"test_value_guards.py:{n}"


def _autograd(f, inputs):
    xs = [x.detach().clone().requires_grad_() if x.is_floating_point() else x for x in inputs]
    out = f(*xs)
    grads = torch.autograd.grad(out, [x for x in xs if x.is_floating_point()],
                                allow_unused=True)
    return out.detach(), [torch.zeros_like(x) if g is None else g
                          for x, g in zip([x for x in xs if x.is_floating_point()], grads)]


def _check_grad(f, *inputs):
    g = fxad.grad(f, *inputs)
    value, grads = g(*inputs)[:2]
    want, wgrads = _autograd(f, inputs)
    torch.testing.assert_close(value, want)
    assert len(grads) == len(wgrads)
    for a, b in zip(grads, wgrads):
        torch.testing.assert_close(a, b)
    return g


def _miss(g, inputs, where):
    with pytest.raises(fxad.ValueGuardError) as e:
        g(*inputs)
    assert isinstance(e.value, fxad.InputError)
    assert where in str(e.value) and "fix:" in str(e.value)
    return e.value


# -- the programs -------------------------------------------------------------------------

def branch(x):
    if x.sum() > 0:
        y = x.sin()
    else:
        y = x.cos()
    return (y * x).sum()


def increasing(t):
    assert (t[1:] > t[:-1]).all()
    return (t ** 3).sum()


def kernel(x1, x2):  # gpytorch's kernel.py: a symmetric distance when both are the same
    if torch.equal(x1, x2):
        d = (x1.unsqueeze(-2) - x1.unsqueeze(-3)).pow(2).sum(-1)
        d = (d + d.transpose(-1, -2)) / 2
    else:
        d = (x1.unsqueeze(-2) - x2.unsqueeze(-3)).pow(2).sum(-1)
    return torch.exp(-d).sum()


def global_attention(x, mask):  # Longformer: global attention only if some token asks
    is_global = mask > 0
    if is_global.flatten().any().item():
        x = x + (x * is_global).sum(-1, keepdim=True)
    return x.tanh().sum()


def clamp_inf(h):  # DETR: clamp only if the activations overflowed
    h = h * 1e300
    if not torch.isfinite(h).all():
        h = h.clamp(min=-1e4, max=1e4)
    return h.sum()


def fixed_grid(y, t):  # torchdiffeq's fixed grid from a step size
    dt = (t[1] - t[0]).item()
    n = int(torch.round((t[-1] - t[0]) / dt).item())
    for _ in range(n):
        y = y + dt * torch.sin(y)
    return y.pow(2).sum()


def list_grid(y, t):  # the grid as Python numbers
    ts = t.tolist()
    for t0, t1 in zip(ts[:-1], ts[1:]):
        y = y + (t1 - t0) * torch.tanh(y)
    return y.pow(2).sum()


def adaptive(y, t1):  # an adaptive solver: accept/reject on an error norm
    t = torch.zeros((), dtype=y.dtype)
    h = torch.tensor(0.4, dtype=y.dtype)
    while t < t1:
        full = y + h * torch.sin(y)
        half = y + h / 2 * torch.sin(y)
        half = half + h / 2 * torch.sin(half)
        err = (full - half).abs().max()
        if err.item() < 1e-3:
            y, t, h = half, t + h, h * 1.5
        else:
            h = h * 0.5
        h = torch.minimum(h, t1 - t)
    return y.pow(2).sum()


torch.manual_seed(0)
_X = torch.rand(5, dtype=D) + 0.1
_GRID = torch.linspace(0, 1, 5, dtype=D)
CASES = [
    # (program, inputs the build sees, inputs that flip a decision, the line's text)
    (branch, (_X,), (-_X,), "if x.sum() > 0:"),
    (increasing, (torch.arange(5, dtype=D),), (torch.arange(5, dtype=D).flip(0),),
     "assert (t[1:] > t[:-1]).all()"),
    (kernel, (_X.view(5, 1), _X.view(5, 1).clone()), (_X.view(5, 1), _X.view(5, 1) + 1),
     "if torch.equal(x1, x2):"),
    (global_attention, (torch.randn(2, 3, dtype=D), torch.tensor([[0., 1., 0.], [0., 0., 0.]],
                                                                  dtype=D)),
     (torch.randn(2, 3, dtype=D), torch.zeros(2, 3, dtype=D)), "if is_global.flatten()"),
    (clamp_inf, (torch.tensor([1., 1e10, 2.], dtype=D),), (torch.tensor([1., 2., 3.], dtype=D),),
     "if not torch.isfinite(h).all():"),
    (fixed_grid, (torch.randn(3, dtype=D), _GRID), (torch.randn(3, dtype=D), _GRID * 2),
     "dt = (t[1] - t[0]).item()"),
    (list_grid, (torch.randn(3, dtype=D), _GRID), (torch.randn(3, dtype=D), _GRID ** 2),
     "ts = t.tolist()"),
    (adaptive, (torch.tensor([0.3, -0.2, 0.1], dtype=D), torch.tensor(1.0, dtype=D)),
     (torch.tensor([1.3, -2.0, 0.5], dtype=D), torch.tensor(1.0, dtype=D)),
     "if err.item() < 1e-3:"),
]
IDS = [c[0].__name__ for c in CASES]


@pytest.mark.parametrize("f, inputs, other, text", CASES, ids=IDS)
def test_gradient_and_guard_miss(f, inputs, other, text):
    g = _check_grad(f, *inputs)
    assert "fxad_expect(" in g.code
    err = _miss(g, other, _line(f, text))
    assert err.taken != err.now
    if f is increasing:  # eager raises on the other inputs; a build on them does the same
        with pytest.raises(AssertionError):
            fxad.grad(f, *other)
        return
    _check_grad(f, *other)  # a build on the other inputs takes the other path, correctly


class _Wrap(nn.Module):
    """A module around a program: a parameter scales its first input."""

    def __init__(self, f):
        super().__init__()
        self.f = f
        self.scale = nn.Parameter(torch.ones((), dtype=D))

    def forward(self, x, *rest):
        return self.f(x * self.scale, *rest)


@pytest.mark.parametrize("f, inputs, other, text", CASES, ids=IDS)
def test_compile_rebuilds_on_a_miss(f, inputs, other, text):
    m = _Wrap(f)
    ref = _Wrap(f)
    c = fxad.compile(m)
    if f is increasing:  # the assert fails for the other inputs: in eager, and on rebuild
        c(*inputs).backward()
        with pytest.raises(AssertionError):
            c(*other)
        assert len(c.builds) == 1
        return
    for xs in (inputs, other, inputs, other):
        xs_c = [x.clone().requires_grad_() if x.is_floating_point() else x for x in xs]
        xs_r = [x.clone().requires_grad_() if x.is_floating_point() else x for x in xs]
        m.zero_grad()
        ref.zero_grad()
        out = c(*xs_c)
        out.backward()
        want = ref(*xs_r)
        want.backward()
        torch.testing.assert_close(out, want)
        torch.testing.assert_close(m.scale.grad, ref.scale.grad)
        for a, b in zip(xs_c, xs_r):
            if a.is_floating_point():  # an input the taken path does not read: zeros
                torch.testing.assert_close(
                    a.grad if a.grad is not None else torch.zeros_like(a),
                    b.grad if b.grad is not None else torch.zeros_like(b))
    assert len(c.builds) == 2  # one per value of the decision; the third call reuses the first
    assert _line(f, text) in c.builds[1].reason


def test_guard_survives_forward_mode_and_hvp():
    x = _X
    j = fxad.jvp(branch, x)
    h = fxad.hvp(branch, x)
    v = torch.ones_like(x)
    out, tangent = j(x, v)
    want, want_t = torch.func.jvp(branch, (x,), (v,))
    torch.testing.assert_close(tangent, want_t)
    hv = h(x, v)[1]
    hv = hv[0] if isinstance(hv, tuple) else hv
    torch.testing.assert_close(hv, torch.autograd.functional.hvp(branch, x, v)[1])
    for mod in (j, h):
        with pytest.raises(fxad.ValueGuardError, match="if x.sum"):
            mod(-x, v)


def test_guard_is_a_readable_line_and_survives_to_folder(tmp_path):
    g = fxad.grad(branch, _X)
    line = next(s for s in g.code.splitlines() if "fxad_expect(" in s)
    assert "'bool'" in line and "True" in line and _line(branch, "if x.sum() > 0:") in line
    g.to_folder(tmp_path / "saved", "Saved")
    text = (tmp_path / "saved" / "module.py").read_text()
    assert "from fxad.guards import expect as fxad_expect" in text
    ejected = fxad.eject(branch, _X)  # an edited derivative keeps the guard
    assert "from fxad.guards import expect as fxad_expect" in ejected
    assert "fxad_expect('bool'" in ejected


def test_joint_step_raises_on_a_miss():
    step = fxad.joint_step(branch, _X, compile=False, argnums=0)
    value, grads = step(_X)[:2]
    want, wgrads = _autograd(branch, (_X,))
    torch.testing.assert_close(value, want)
    torch.testing.assert_close(grads[0], wgrads[0])
    with pytest.raises(fxad.ValueGuardError, match="if x.sum"):
        step(-_X)


def test_refuse_keeps_the_data_dependent_error():
    with pytest.raises(fxad.DataDependentError) as e:
        fxad.grad(branch, _X, values="refuse")
    assert "if x.sum() > 0" in str(e.value) and "values='refuse'" in str(e.value)
    with pytest.raises(fxad.InputError, match="values="):
        fxad.grad(branch, _X, values="sometimes")
    assert current_policy() == "guard"


def masked_sum(x):
    y = x[x > 0]
    return (y * y.sin()).sum() + torch.nonzero(x).shape[0]


def test_data_dependent_sizes_refused_by_default_naming_the_opt_in():
    with pytest.raises(fxad.DataDependentError) as e:
        fxad.grad(masked_sum, torch.randn(6, dtype=D))
    assert "values='guard+sizes'" in str(e.value) and "y = x[x > 0]" in str(e.value)


def test_data_dependent_sizes_with_the_opt_in():
    x = torch.tensor([0.5, -1.0, 2.0, -0.3, 1.5, 0.7], dtype=D)
    g = fxad.grad(masked_sum, x, values="guard+sizes")
    assert "torch.nonzero_static(" in g.code
    value, grads = g(x)
    want, wgrads = _autograd(masked_sum, (x,))
    torch.testing.assert_close(value, want)
    torch.testing.assert_close(grads[0], wgrads[0])
    same_count = torch.tensor([-0.5, 1.0, -2.0, 0.3, 1.5, 0.7], dtype=D)
    value, grads = g(same_count)
    want, wgrads = _autograd(masked_sum, (same_count,))
    torch.testing.assert_close(grads[0], wgrads[0])
    _miss(g, (-x.abs(),), _line(masked_sum, "y = x[x > 0]"))


def test_decision_on_a_random_value_is_not_specialized():
    def f(x):
        if torch.rand(()) < 0.5:
            return x.sin().sum()
        return x.cos().sum()

    try:
        g = fxad.grad(f, _X)
    except fxad.DataDependentError as e:  # refused, naming the line and the rewrite
        assert "torch.rand(()) < 0.5" in str(e) and "torch.cond" in str(e)
        return
    assert "fxad_expect(" not in g.code  # turned into a conditional in the graph


def test_decision_inside_a_cond_branch_is_refused_naming_the_line():
    def f(x):
        def yes(x):
            if x.max() > 1:
                return x * 2
            return x

        return torch.cond(x.sum() > 0, yes, lambda x: x.clone(), (x,)).sum()

    with pytest.raises(fxad.DataDependentError, match="if x.max"):
        fxad.grad(f, _X)


def test_parameter_values_are_guarded():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.tensor([1.0, 2.0], dtype=D))

        def forward(self, x):
            if self.w.sum() > 0:
                return (x * self.w).sum()
            return (x - self.w).sum()

    m = M()
    g = fxad.grad(m, torch.ones(2, dtype=D))
    with torch.no_grad():
        m.w.neg_()
    with pytest.raises(fxad.ValueGuardError, match="self.w.sum"):
        g(torch.ones(2, dtype=D))


def test_many_values_warn_once_naming_the_line():
    c = fxad.compile(_Wrap(lambda x, k: x.sum() * int(k.item())))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for k in range(VALUE_BUILDS_WARN + 2):
            c(torch.ones(2, dtype=D), torch.tensor(float(k), dtype=D)).backward()
    assert len(c.builds) == VALUE_BUILDS_WARN + 2
    hits = [w for w in seen if "keeps changing" in str(w.message)]
    assert len(hits) == 1 and "int(k.item())" in str(hits[0].message)
    assert "torch.where" in str(hits[0].message)


def test_value_policy_context():
    with value_policy("refuse"):
        assert current_policy() == "refuse"
        with pytest.raises(fxad.DataDependentError):
            fxad.trace(branch, _X)
    assert current_policy() == "guard"


def test_torchdiffeq_rk4_gradient():
    torchdiffeq = pytest.importorskip("torchdiffeq")
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(2, 6), nn.Tanh(), nn.Linear(6, 2)).double()

    def f(y0, t):
        return torchdiffeq.odeint(lambda t, y: net(y), y0, t, method="rk4").pow(2).sum()

    y0 = torch.randn(3, 2, dtype=D)
    t = torch.linspace(0, 1, 3, dtype=D)
    _check_grad(f, y0, t)


def test_symbolic_build_and_compile_with_changing_sizes():
    def f(x):
        if x.sum() > 0:
            return (x.sin() * x).sum()
        return x.cos().sum()

    g = fxad.grad(f, torch.rand(4, 3, dtype=D), dynamic=True)
    for n in (4, 7):
        x = torch.rand(n, 3, dtype=D)
        torch.testing.assert_close(g(x)[1][0], _autograd(f, (x,))[1][0])
    with pytest.raises(fxad.ValueGuardError, match="if x.sum"):
        g(-torch.rand(5, 3, dtype=D))
    m, ref = _Wrap(f), _Wrap(f)
    c = fxad.compile(m)
    for n, sign in ((2, 1), (3, 1), (5, -1), (6, 1)):  # new sizes, then a new decision
        x = sign * torch.rand(n, 3, dtype=D)
        m.zero_grad()
        ref.zero_grad()
        c(x).backward()
        ref(x).backward()
        torch.testing.assert_close(m.scale.grad, ref.scale.grad)
    assert any("if x.sum() > 0" in b.reason for b in c.builds)


def test_checkpoint_region_and_distribution_checks():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3).double()

        def block(self, h):
            h = self.lin(h)
            if h.sum() > 0:
                return h.relu()
            return h.tanh()

        def forward(self, x):
            h = torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)
            d = torch.distributions.Normal(h, h.exp(), validate_args=True)
            return -d.log_prob(torch.zeros_like(h)).sum()

    m, ref = M(), M()
    with torch.no_grad():  # h = x + 0.1: the decision follows the sign of x
        m.lin.weight.copy_(torch.eye(3, dtype=D))
        m.lin.bias.fill_(0.1)
    ref.load_state_dict(m.state_dict())
    c = fxad.compile(m)
    for sign in (1, -1, 1):
        x = sign * 10 * torch.rand(2, 3, dtype=D)
        m.zero_grad()
        ref.zero_grad()
        c(x).backward()
        ref(x).backward()
        torch.testing.assert_close(m.lin.weight.grad, ref.lin.weight.grad)
    assert len(c.builds) == 2


def test_jacrev_keeps_the_guard():
    def f(x):
        if x.sum() > 0:
            return x.sin() * x
        return x.cos()

    x = torch.rand(3, dtype=D)
    J = fxad.jacrev(f, x)
    out = J(x)
    jac = out[1] if isinstance(out, tuple) else out
    jac = jac[0] if isinstance(jac, tuple) else jac
    torch.testing.assert_close(jac, torch.autograd.functional.jacobian(f, x))
    with pytest.raises(fxad.ValueGuardError):
        J(-x)


def test_sizes_from_python_numbers_and_flip_dims_keyword():
    """Longformer's pattern: a size computed as a tensor from Python ints, and
    ``flip(dims=[0])``: the recorded code uses the numbers and keeps the dims."""
    def f(x):
        chunks = torch.div(x.shape[1], 2, rounding_mode="trunc") - 1
        mask = x.new_ones(2, 3).tril().flip(dims=[0])
        y = x.as_strided(size=(x.shape[0], chunks + 1, 2), stride=(x.shape[1], 2, 1))
        return (y.sin() * mask[:, :2].sum()).sum()

    x = torch.randn(3, 6, dtype=D)
    g = _check_grad(f, x)
    assert "fxad_expect(" not in g.code  # nothing depends on the inputs' values


# -- the real values of writes through a detached alias (x.data[i] = v, x.detach()[i] = v) ---

@pytest.mark.parametrize("fill", ["empty", "huge", "nan"])
def test_write_through_a_detached_alias_is_exact(fill):
    """torchdiffeq's ``_UncheckedAssign`` pattern: ``k = torch.empty(...)`` filled column by
    column through ``k.data[..., i] = v``.  The base then holds exactly the written values:
    whatever it held before (torch.empty's garbage, huge values, NaN) must not leak into the
    values, the decision taken on them at build time, or the gradients."""
    def f(x):
        if fill == "empty":
            k = torch.empty(x.shape[0], 3, dtype=x.dtype)
        else:
            k = torch.full((x.shape[0], 3), 1e20 if fill == "huge" else float("nan"),
                           dtype=x.dtype)
        k.data[:, 0] = x
        k.detach()[:, 1] = 2 * x
        k.data[..., 2] = x * x
        y = k.sum(1) * x
        if k.sum() > 0:  # decided on the real values at build time, guarded
            return y.sum()
        return -y.sum()

    x = torch.tensor([0.1, 0.2, 0.3], dtype=D)
    g = _check_grad(f, x)
    assert "fxad_expect(" in g.code
    for _ in range(3):  # the same answer every call (no uninitialized memory read)
        torch.testing.assert_close(g(x)[0], f(x))
    _miss(g, (-x,), _line(f, "if k.sum() > 0:"))


def test_write_through_a_detached_alias_of_a_differentiable_base():
    """The base keeps its own derivative history; the written values carry none."""
    def f(x, w):
        k = w * 3
        k.detach()[:, 0] = x * 1e8
        return (k * k).sum() + (k.data * x[:, None]).sum()

    _check_grad(f, torch.rand(3, dtype=D), torch.randn(3, 2, dtype=D))


class _UncheckedAssign(torch.autograd.Function):
    """torchdiffeq's: writes into its input through ``.data`` and returns it."""
    @staticmethod
    def forward(ctx, scratch, value, index):
        ctx.index = index
        scratch.data[index] = value
        return scratch

    @staticmethod
    def backward(ctx, grad):
        return grad, grad[ctx.index], None


def test_custom_function_writing_into_its_input_through_data():
    """The Function's derivative goes to the input's history on entry (as in autograd),
    not to the value the forward wrote into it."""
    def f(x):
        k = torch.empty(x.shape[0], 3, dtype=x.dtype)
        k = _UncheckedAssign.apply(k, x.sin(), (..., 0))
        for i in range(2):
            v = (k[..., :i + 1] * 2.0).sum(-1) + x
            k = _UncheckedAssign.apply(k, v, (..., i + 1))
        if k.sum() > 0:
            return (k * k).sum()
        return k.sum()

    x = torch.tensor([0.1, 0.2, 0.3], dtype=D)
    g = _check_grad(f, x)
    assert "fxad_expect(" in g.code


def test_torchdiffeq_dopri5_on_a_module_matches_eager():
    """Adaptive steps decided on the real values: value, y0 and parameter gradients equal
    autograd's on the build's inputs (t built in forward, and t passed in)."""
    torchdiffeq = pytest.importorskip("torchdiffeq")

    class Field(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 4))

        def forward(self, t, y):
            return self.net(y) * torch.cos(t)

    class Flow(nn.Module):
        def __init__(self):
            super().__init__()
            self.func = Field()

        def forward(self, y0, *t):
            tt = t[0] if t else torch.linspace(0.0, 1.0, 4, dtype=y0.dtype)
            ys = torchdiffeq.odeint(self.func, y0, tt, method="dopri5", rtol=1e-4, atol=1e-5)
            return (ys[-1] ** 2).mean()

    torch.manual_seed(0)
    m = Flow().double()
    y0 = torch.randn(3, 4, dtype=D)
    g = fxad.vjp(m, y0)
    out, (gy0,), pgrads = g(y0, torch.tensor(1.0, dtype=D))
    y = y0.clone().requires_grad_()
    loss = m(y)
    names = [n for n, _ in m.named_parameters()]
    want = torch.autograd.grad(loss, [y] + [p for _, p in m.named_parameters()])
    torch.testing.assert_close(out, loss.detach(), rtol=0, atol=0)
    torch.testing.assert_close(gy0, want[0])
    for name, w in zip(names, want[1:]):
        torch.testing.assert_close(pgrads[name], w)
    assert "fxad_expect(" in g.code


def test_module_first_imported_inside_the_program_keeps_real_constants(tmp_path, monkeypatch):
    """``from lib import f`` inside forward, lib imported for the first time during the
    build: its module-level tensors (torchdiffeq's Butcher tableaus) are real tensors, used
    as constants, and eager code keeps working after the build."""
    name = "fxad_lazy_constants_for_test"
    (tmp_path / f"{name}.py").write_text(
        "import torch\nSCALE = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(__import__("sys").modules, name, raising=False)

    def f(x):
        scale = __import__(name).SCALE
        if (x * scale).sum() > 0:
            return (x * scale.to(dtype=x.dtype)).sum()
        return x.sum()

    x = torch.rand(3, dtype=D)
    _check_grad(f, x)
    scale = __import__("sys").modules[name].SCALE
    assert type(scale) is torch.Tensor
    torch.testing.assert_close(f(x), (x * scale).sum())


class _NamedExperts(nn.Module):
    """A module picked by a name formatted from a tensor (SwitchTransformers' experts:
    ``self[f"expert_{expert_idx[0]}"]``), beside a print of another tensor."""

    def __init__(self):
        super().__init__()
        self.experts = nn.ModuleDict({f"expert_{i}": nn.Linear(3, 3) for i in range(3)})

    def forward(self, x, scores):
        best = scores.argmax()
        out = self.experts[f"expert_{best}"](x).sum()
        print(f"expert {best}: {out:.3f}")
        return out


def test_tensor_formatted_into_a_name_is_a_guarded_decision(capsys):
    torch.manual_seed(0)
    m = _NamedExperts().double()
    x = torch.randn(2, 3, dtype=D)
    pick_1 = torch.tensor([0.1, 0.9, 0.2], dtype=D)
    pick_2 = torch.tensor([0.9, 0.1, 0.2], dtype=D)
    g = fxad.grad(m, x, pick_1)
    assert g.code.count("fxad_expect(") == 1 and "'item'" in g.code  # the name, not the print
    assert "<fxad-value" not in g.code
    value, (d_x, _), d_p = g(x, pick_1)
    xr = x.clone().requires_grad_()
    m.zero_grad()
    ref = m(xr, pick_1)
    ref.backward()
    torch.testing.assert_close(value, ref.detach())
    torch.testing.assert_close(d_x, xr.grad)
    torch.testing.assert_close(d_p["experts.expert_1.weight"], m.experts.expert_1.weight.grad)
    assert f"expert 1: {ref.item():.3f}" in capsys.readouterr().out  # printed at call time
    with pytest.raises(fxad.ValueGuardError, match="expert_"):
        g(x, pick_2)
    c = fxad.compile(m)  # a build per expert picked
    for scores in (pick_1, pick_2):
        m.zero_grad()
        c(x, scores).backward()
        grads = {k: p.grad.clone() for k, p in m.named_parameters() if p.grad is not None}
        m.zero_grad()
        m(x, scores).backward()
        assert grads.keys() == {k for k, p in m.named_parameters() if p.grad is not None}
        for k, v in grads.items():
            torch.testing.assert_close(v, dict(m.named_parameters())[k].grad)
    assert len(c.builds) == 2
