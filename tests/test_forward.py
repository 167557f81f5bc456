"""Forward mode and higher order: every rule's JVP against ``torch.func.jvp`` (float64,
through capture, forward transform, simplifier and codegen); HVP / Jacobians / Hessians
against ``torch.func``; second derivatives against ``torch.autograd.grad(create_graph=True)``;
input errors and PyTorch's conventions at non-differentiable points.

Regenerate the golden file with ``FXAD_UPDATE_GOLDEN=1 python -m pytest tests/test_forward.py``.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils import _pytree as pytree

import fxad
from fxad.tools.coverage import check_seeded, draws_random
from fxad.rules.registry import op_name

GOLDEN = Path(__file__).parent / "golden"


def _cases():
    for op, rule in sorted(fxad.all_rules().items(), key=lambda kv: op_name(kv[0])):
        if rule.samples is None:
            continue
        torch.manual_seed(0)
        for i, (args, kwargs) in enumerate(rule.samples(torch.float64)):
            yield pytest.param(op, args, kwargs, id=f"{op_name(op)}-{i}")


def _called(op):
    """``op`` as user code reaches it: ``torch.nn.grad.conv2d_input`` through its module (the
    spelling fxad's capture records as one call)."""
    if getattr(op, "__module__", "") == "torch.nn.grad":
        return getattr(torch.nn.grad, op.__name__)
    return op


def _as_function(op, args, kwargs):
    leaves, spec = pytree.tree_flatten(args)
    kleaves, kspec = pytree.tree_flatten(kwargs)
    slots = [i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor) and v.is_floating_point()]
    kslots = [i for i, v in enumerate(kleaves)
              if isinstance(v, torch.Tensor) and v.is_floating_point()]

    def fn(*xs):
        vals, kvals = list(leaves), list(kleaves)
        for i, x in zip(slots, xs):
            vals[i] = x
        for i, x in zip(kslots, xs[len(slots):]):
            kvals[i] = x
        call_args = pytree.tree_unflatten(vals, spec)
        call_kwargs = pytree.tree_unflatten(kvals, kspec)
        if getattr(torch.Tensor, getattr(op, "__name__", ""), None) is op:  # a Tensor method
            return getattr(call_args[0], op.__name__)(*call_args[1:], **call_kwargs)
        return _called(op)(*call_args, **call_kwargs)

    return fn, [leaves[i] for i in slots] + [kleaves[i] for i in kslots]


def _float_leaves(x):
    return [v for v in pytree.tree_leaves(x) if isinstance(v, torch.Tensor) and v.is_floating_point()]


def _close(a, b, atol=1e-9, rtol=1e-7):
    la, lb = _float_leaves(a), _float_leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        torch.testing.assert_close(x, y, atol=atol, rtol=rtol)


@pytest.mark.parametrize("op,args,kwargs", list(_cases()))
def test_rule_jvp_matches_torch_func(op, args, kwargs):
    fn, inputs = _as_function(op, args, kwargs)
    if not inputs:
        pytest.skip("no floating-point input")
    if draws_random(fn, inputs):
        # a random op: fxad.jvp's value must equal eager's under the same seed and its tangent
        # eager forward-mode AD's (torch.func.jvp lays out empty_like differently for strided
        # inputs, so it draws other masks than eager)
        problems = check_seeded(fn, inputs, seed=12345, fd=False)
        assert not problems, problems
        return
    gm = fxad.jvp(fn, *inputs)
    gen = torch.Generator().manual_seed(1)
    tangents = [torch.randn(x.shape, dtype=x.dtype, generator=gen) for x in inputs]
    torch.manual_seed(2)
    out, t_out = gm(*inputs, *tangents)
    # central finite differences in float64, taken before torch.func runs (a failed
    # torch.func.jvp can leave forward-AD state behind that changes later evaluations)
    h = 1e-6
    fd_out = fn(*inputs)
    plus = fn(*[x + h * t for x, t in zip(inputs, tangents)])
    minus = fn(*[x - h * t for x, t in zip(inputs, tangents)])
    fd_t = pytree.tree_map(lambda a, b: (a - b) / (2 * h) if a.is_floating_point() else a,
                           plus, minus)
    torch.manual_seed(2)
    try:
        ref_out, ref_t = torch.func.jvp(fn, tuple(inputs), tuple(tangents))
    except (NotImplementedError, RuntimeError):  # PyTorch has no forward AD here (CPU flash
        _close(out, fd_out)          # attention, margin losses) or refuses an input
        _close(t_out, fd_t, atol=1e-6, rtol=1e-5)
        return
    _close(out, ref_out)
    try:
        _close(t_out, ref_t)
    except AssertionError:
        # PyTorch's own forward AD is wrong on a few ops (prod-reduce with zeros in
        # scatter_reduce, a tensor q in quantile, triangular_solve, the class weight of
        # linear_cross_entropy): fxad's
        # tangent must then agree with both reverse-mode autograd and finite differences
        _settle_with_reverse_mode_and_finite_differences(fn, inputs, tangents, t_out)


def _settle_with_reverse_mode_and_finite_differences(fn, inputs, tangents, t_out):
    mine = _float_leaves(t_out)
    try:
        xs = [x.detach().clone().requires_grad_() for x in inputs]
        outs = _float_leaves(fn(*xs))
    except RuntimeError:  # autograd refuses an input (a class weight of nll_loss): finite
        outs = None       # differences alone then
    if outs is not None:
        assert len(outs) == len(mine)
        gen = torch.Generator().manual_seed(3)
        vs = [torch.randn(o.shape, dtype=o.dtype, generator=gen) for o in outs]
        used = [(o, v) for o, v in zip(outs, vs) if o.requires_grad]
        grads = torch.autograd.grad([o for o, _ in used], xs, [v for _, v in used],
                                    allow_unused=True)
        lhs = sum(float((v * m).sum()) for o, v, m in zip(outs, vs, mine) if o.requires_grad)
        rhs = sum(float((g * t).sum()) for g, t in zip(grads, tangents) if g is not None)
        assert abs(lhs - rhs) <= 1e-8 * max(1.0, abs(rhs)), (lhs, rhs)
        compared = [o.requires_grad for o in outs]  # as autograd differentiates them
    else:
        compared = [True] * len(mine)
    h = 1e-6
    with torch.no_grad():
        plus = _float_leaves(fn(*[x + h * t for x, t in zip(inputs, tangents)]))
        minus = _float_leaves(fn(*[x - h * t for x, t in zip(inputs, tangents)]))
    for m, a, b, c in zip(mine, plus, minus, compared):
        if c:
            torch.testing.assert_close(m, (a - b) / (2 * h), atol=1e-5, rtol=1e-5)


def test_rules_without_jvp_use_transposition():
    """Rules registered without ``jvp`` get their JVP by transposing ``bwd``.  Every such
    built-in rule must have sample inputs (so the JVP test above covers its transposed JVP),
    except zero-derivative rules, whose tangent is zero."""
    untested = sorted(op_name(op) for op, r in fxad.all_rules().items()
                      if r.builtin and r.jvp is None and r.samples is None
                      and "zero derivative" not in r.source)
    assert not untested, untested


# --- demo-like models -----------------------------------------------------------------------

D = torch.float64


def mlp_loss(w1, b1, w2, b2, x, y):
    h = torch.tanh(x @ w1 + b1)
    return ((h @ w2 + b2 - y) ** 2).mean()


def _mlp_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, dtype=D, generator=g)  # noqa: E731
    return r(3, 4), r(4), r(4, 2), r(2), r(5, 3), r(5, 2)


def block(p, x):
    """A small transformer-like block: layer norm, single-head attention, GELU MLP, residuals."""
    h = F.layer_norm(x, (8,), p["ln_w"], p["ln_b"])
    q, k, v = h @ p["wq"], h @ p["wk"], h @ p["wv"]
    att = torch.softmax(q @ k.transpose(-2, -1) / 8 ** 0.5, dim=-1)
    x = x + att @ v
    return x + F.gelu(F.linear(x, p["w1"], p["b1"])) @ p["w2"]


def block_loss(p, x):
    return (block(p, x) ** 2).mean()


def _block_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, dtype=D, generator=g)  # noqa: E731
    p = {"ln_w": r(8), "ln_b": r(8), "wq": r(8, 8) / 3, "wk": r(8, 8) / 3, "wv": r(8, 8) / 3,
         "w1": r(16, 8) / 3, "b1": r(16), "w2": r(16, 8) / 3}
    return p, r(2, 5, 8)


def _randn_like_tree(tree, seed=3):
    g = torch.Generator().manual_seed(seed)
    return pytree.tree_map(lambda v: torch.randn(v.shape, dtype=v.dtype, generator=g), tree)


def test_jvp_mlp_matches_torch_func():
    xs = _mlp_inputs()
    ts = _randn_like_tree(xs)
    out, t = fxad.jvp(mlp_loss, *xs)(*xs, *ts)
    ref = torch.func.jvp(mlp_loss, xs, ts)
    _close((out, t), ref)


def test_jvp_block_with_pytree_inputs():
    p, x = _block_inputs()
    tp, tx = _randn_like_tree((p, x))
    gm = fxad.jvp(block, p, x)
    _close(gm(p, x, tp, tx), torch.func.jvp(block, (p, x), (tp, tx)))
    # a None leaf of a tangent pytree is a zero tangent
    tp0 = dict(tp, ln_w=None)
    ref = torch.func.jvp(block, (p, x), (dict(tp, ln_w=torch.zeros(8, dtype=D)), tx))
    _close(gm(p, x, tp0, tx), ref)


def test_jvp_of_module_differentiates_inputs():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 2)).double()
    x, t = torch.randn(3, 4, dtype=D), torch.randn(3, 4, dtype=D)
    out, t_out = fxad.jvp(m, x)(x, t)
    ref = torch.func.jvp(m, (x,), (t,))
    _close((out, t_out), ref)


def test_hvp_mlp_matches_torch_func():
    xs = _mlp_inputs()
    ts = _randn_like_tree(xs[:4]) + (None, None)
    h = fxad.hvp(mlp_loss, *xs, argnums=(0, 1, 2, 3))
    grads, hvps = h(*xs, *ts)
    assert grads[4] is None and hvps[5] is None
    ref_g, ref_h = torch.func.jvp(lambda *w: torch.func.grad(mlp_loss, argnums=(0, 1, 2, 3))(*w, *xs[4:]),
                                  xs[:4], ts[:4])
    _close(grads[:4], ref_g)
    _close(hvps[:4], ref_h)


def test_hvp_block_matches_torch_func():
    p, x = _block_inputs()
    tp, tx = _randn_like_tree((p, x))
    grads, hvps = fxad.hvp(block_loss, p, x)(p, x, tp, tx)
    ref = torch.func.jvp(torch.func.grad(block_loss, argnums=(0, 1)), (p, x), (tp, tx))
    _close(grads, ref[0])
    _close(hvps, ref[1])


def test_jacobians_match_torch_func():
    p, x = _block_inputs()
    for jac, ref in ((fxad.jacrev, torch.func.jacrev), (fxad.jacfwd, torch.func.jacfwd)):
        J = jac(block, p, x, argnums=(0, 1))
        got, want = J(p, x), ref(block, argnums=(0, 1))(p, x)
        assert pytree.tree_structure(got) == pytree.tree_structure(want)
        _close(got, want)
        assert "def forward" in J.code
    xs = _mlp_inputs()
    _close(fxad.jacfwd(mlp_loss, *xs, argnums=2)(*xs), torch.func.jacfwd(mlp_loss, argnums=2)(*xs))
    _close(fxad.jacrev(mlp_loss, *xs, argnums=2)(*xs), torch.func.jacrev(mlp_loss, argnums=2)(*xs))


def test_higher_order_of_modules_is_with_respect_to_inputs():
    """A module given to jacrev/jacfwd/hessian/hvp is a function of its inputs; its
    parameters are constants (as torch.func.jacrev(model) treats them)."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2)).double()
    x = torch.randn(5, 3, dtype=torch.float64)
    _close(fxad.jacrev(m, x)(x), torch.func.jacrev(m)(x))
    _close(fxad.jacfwd(m, x)(x), torch.func.jacfwd(m)(x))

    class Loss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = m

        def forward(self, x):
            return self.m(x).pow(2).sum()

    loss = Loss()
    _close(fxad.hessian(loss, x)(x), torch.func.hessian(loss)(x))
    v = torch.randn_like(x)
    _close(fxad.hvp(loss, x)(x, v)[1][0], torch.func.jvp(torch.func.grad(loss), (x,), (v,))[1])
    assert not hasattr(loss, "loss")  # the user's module is left as it was


def test_hessian_mlp_matches_torch_func():
    xs = _mlp_inputs()
    H = fxad.hessian(mlp_loss, *xs, argnums=(0, 1, 2, 3))(*xs)
    ref = torch.func.hessian(mlp_loss, argnums=(0, 1, 2, 3))(*xs)
    assert pytree.tree_structure(H) == pytree.tree_structure(ref)
    _close(H, ref)
    H0 = fxad.hessian(mlp_loss, *xs, argnums=0)(*xs)
    assert H0.shape == (3, 4, 3, 4)
    _close(H0, ref[0][0])


def _autograd_hessian_block(p, x, wrt_a, wrt_b):
    """d(grad wrt_a)/d(wrt_b) with autograd double backward (create_graph=True)."""
    pp = {k: v.clone().requires_grad_() for k, v in p.items()}
    xx = x.clone().requires_grad_()
    leaf = lambda k: xx if k == "x" else pp[k]  # noqa: E731
    g = torch.autograd.grad(block_loss(pp, xx), leaf(wrt_a), create_graph=True)[0]
    rows = [torch.autograd.grad(gi, leaf(wrt_b), retain_graph=True)[0] for gi in g.reshape(-1)]
    return torch.stack(rows).reshape(g.shape + leaf(wrt_b).shape)


def test_hessian_block_matches_autograd_double_backward():
    # reference: autograd double backward (torch.func.hessian disagrees with both for the
    # ln_w / x block in torch 2.x: its forward-over-reverse of native_layer_norm_backward)
    p, x = _block_inputs()
    H = fxad.hessian(block_loss, p, x, argnums=(0, 1))(p, x)
    for a, b in (("ln_w", "x"), ("wq", "wk"), ("x", "x"), ("w1", "ln_b")):
        got = H[0 if a != "x" else 1]
        got = got[a] if a != "x" else got
        got = got[0 if b != "x" else 1]
        got = got[b] if b != "x" else got
        _close(got, _autograd_hessian_block(p, x, a, b))


def test_second_order_composition_matches_autograd():
    x = torch.randn(5, dtype=D)

    def f(x):
        return (torch.sin(x) * torch.exp(x / 3)).sum() + (x ** 3).sum()

    g = fxad.grad(f, x)
    xr = x.clone().requires_grad_()
    (dx,) = torch.autograd.grad(f(xr), xr, create_graph=True)
    v = torch.randn(5, dtype=D)
    (ref,) = torch.autograd.grad(dx, xr, v)
    # reverse over reverse
    (_, (d_x,)), (vjp_x,) = fxad.vjp(g, x)(x, (torch.zeros((), dtype=D), (v,)))
    torch.testing.assert_close(d_x, dx.detach())
    torch.testing.assert_close(vjp_x, ref)
    # forward over reverse
    (_, (d_x,)), (_, (t_d_x,)) = fxad.jvp(g, x)(x, v)
    torch.testing.assert_close(t_d_x, ref)
    # the Hessian, three ways
    H = torch.func.hessian(f)(x)
    torch.testing.assert_close(fxad.hessian(f, x)(x), H)
    torch.testing.assert_close(fxad.jacfwd(g, x)(x)[1][0], H)


def test_third_order():
    x = torch.randn(4, dtype=D)

    def f(x):
        return torch.tanh(x).pow(3).sum()

    h = fxad.hvp(f, x)                     # (grads, hvps) in forward-over-reverse code
    v, w = torch.randn(4, dtype=D), torch.randn(4, dtype=D)
    (_, (hv,)), (_, (t_hv,)) = fxad.jvp(h, x, v)(x, v, w, None)
    ref = torch.func.jvp(lambda x: torch.func.jvp(torch.func.grad(f), (x,), (v,))[1], (x,), (w,))[1]
    torch.testing.assert_close(t_hv, ref)


# --- code quality -----------------------------------------------------------------------------

def mlp_hvp_loss(x, w1, w2):
    h = torch.tanh(x @ w1)
    return (h @ w2).pow(2).mean()


def test_golden_hvp_mlp():
    xs = (torch.randn(5, 4), torch.randn(4, 8), torch.randn(8, 2))
    gm = fxad.hvp(mlp_hvp_loss, *xs, argnums=(1, 2))
    # line numbers dropped so that edits to this file do not churn the golden file
    code = re.sub(r"\[(\w+\.py):\d+\]", r"[\1]", fxad.code_with_shapes(gm))
    path = GOLDEN / "hvp_mlp.py.txt"
    if os.environ.get("FXAD_UPDATE_GOLDEN") or not path.exists():
        path.write_text(code)
    assert code == path.read_text(), f"generated HVP code changed; see {path}"
    assert fxad.hvp(mlp_hvp_loss, *xs, argnums=(1, 2)).code == gm.code  # deterministic


def test_second_order_code_has_no_zero_towers():
    xs = _mlp_inputs()
    code = fxad.hvp(mlp_loss, *xs, argnums=(0, 1, 2, 3)).code
    assert "zeros" not in code
    assert "# tangent of:" in code and "# backward of:" in code
    assert "dot_d_w1" in code  # the HVP w.r.t. w1 is named after the gradient it perturbs
    body = code.split("return")[0]
    assert "dot_x" not in body.split("):", 1)[1]  # x is data: no tangent code for it


def test_jvp_code_is_readable():
    def f(x, w):
        return torch.tanh(x @ w).sum()

    code = fxad.jvp(f, torch.randn(3, 4), torch.randn(4, 2)).code
    assert "def forward(self, x, w, dot_x, dot_w):" in code
    assert "# tangent of: tanh = torch.tanh(matmul)" in code
    assert "dot_tanh" in code and "return (sum_1, dot_sum_1)" in code


# --- rules without jvp ------------------------------------------------------------------------

def my_softplus(x):
    return torch.log1p(torch.exp(x))


torch.fx.wrap("my_softplus")


def test_user_rule_without_jvp_is_transposed():
    class Softplus:
        def fwd(x):
            return my_softplus(x), x

        def bwd(x, d):
            return (d * torch.sigmoid(x),)

    fxad.register_vjp(my_softplus, fwd=Softplus.fwd, bwd=Softplus.bwd)
    try:
        def f(x, y):
            return my_softplus(x * y) * y

        x, y, tx, ty = (torch.randn(3, 4, dtype=D) for _ in range(4))
        gm = fxad.jvp(f, x, y)
        _close(gm(x, y, tx, ty), torch.func.jvp(f, (x, y), (tx, ty)))
        assert "torch.sigmoid" in gm.code
    finally:
        fxad.unregister(my_softplus)


# --- bad input and conventions ----------------------------------------------------------------

def test_mismatched_tangent_shape_raises_before_running():
    calls = []

    def f(x, w):
        calls.append(1)
        return (x @ w).sum()

    x, w = torch.randn(3, 4), torch.randn(4, 2)
    gm = fxad.jvp(f, x, w)
    with pytest.raises(fxad.InputError, match=r"tangent `dot_w` has shape \(2, 4\).*\(4, 2\)"):
        gm(x, w, torch.randn(3, 4), torch.randn(2, 4))
    with pytest.raises(fxad.InputError, match="dtype"):
        gm(x, w, torch.randn(3, 4, dtype=D), torch.randn(4, 2))
    with pytest.raises(fxad.InputError, match="2 primal"):
        gm(x, w, torch.randn(3, 4))
    with pytest.raises(fxad.InputError, match="structure"):
        fxad.jvp(block, *_block_inputs())(*_block_inputs(), {"ln_w": None}, None)
    h = fxad.hvp(f, x, w)
    with pytest.raises(fxad.InputError):
        h(x, w, torch.randn(4), None)


def test_integer_inputs_get_none_tangents():
    def f(x, idx):
        return x[idx].sum(0), idx * 2

    x, idx = torch.randn(5, 3), torch.tensor([0, 2, 2])
    gm = fxad.jvp(f, x, idx)
    t = torch.randn(5, 3)
    (out, idx2), (t_out, t_idx2) = gm(x, idx, t, None)
    assert t_idx2 is None
    torch.testing.assert_close(t_out, t[idx].sum(0))
    with pytest.raises(fxad.InputError, match="must be None"):
        gm(x, idx, t, torch.ones(3))
    grads, hvps = fxad.hvp(lambda x, idx: x[idx].pow(3).sum(), x, idx)(x, idx, t, None)
    assert grads[1] is None and hvps[1] is None


@pytest.mark.parametrize("op", [torch.relu, torch.abs, F.relu])
def test_nondifferentiable_points_follow_pytorch(op):
    x = torch.tensor([-1.0, 0.0, 2.0], dtype=D)
    t = torch.ones(3, dtype=D)
    _, t_out = fxad.jvp(lambda x: op(x), x)(x, t)
    _, ref = torch.func.jvp(op, (x,), (t,))
    torch.testing.assert_close(t_out, ref)
    assert t_out[1] == 0
    f = lambda x: (op(x) ** 2).sum()  # noqa: E731
    torch.testing.assert_close(fxad.hessian(f, x)(x), torch.func.hessian(f)(x))
