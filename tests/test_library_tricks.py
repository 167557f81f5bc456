"""Tricks libraries play that fxad sees through: functions marked with ``torch.fx.wrap``
(traced like any code unless a rule is registered for them) and torch functions a library
replaced in the ``torch`` namespace (traced as Python, down to PyTorch's own op); checked in
float64 against autograd."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn

import fxad
from fxad.originals import original, torch_function

DT = torch.float64


def _x(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=DT)


def _check_module(m: nn.Module, *inputs: torch.Tensor, seed: int = 0) -> fxad.VJPModule:
    """Value, input and parameter gradients of ``m(*inputs).sum()`` against autograd, the
    RNG seeded alike before both."""
    class Summed(nn.Module):
        def __init__(self):
            super().__init__()
            self.m = m

        def forward(self, *xs):
            return self.m(*xs).pow(2).sum()

    s = Summed()
    g = fxad.vjp(s, *inputs)
    torch.manual_seed(seed)
    out, grads, pgrads = g(*inputs, torch.tensor(1.0, dtype=DT))
    xs = [a.clone().requires_grad_() if a.is_floating_point() else a for a in inputs]
    s.zero_grad()
    torch.manual_seed(seed)
    loss = s(*xs)
    loss.backward()
    torch.testing.assert_close(out, loss.detach())
    for got, a in zip(grads, xs):
        if a.is_floating_point():
            torch.testing.assert_close(got, a.grad)
    for name, p in s.named_parameters():
        torch.testing.assert_close(pgrads[name], p.grad)
    return g


# -- torch.fx.wrap ---------------------------------------------------------------------------
def stochastic_depth(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """torchvision's stochastic depth ("row" mode), written out."""
    if not training or p == 0.0:
        return x
    survival = 1.0 - p
    noise = torch.empty([x.shape[0]] + [1] * (x.ndim - 1), dtype=x.dtype, device=x.device)
    noise = noise.bernoulli_(survival)
    if survival > 0.0:
        noise.div_(survival)
    return x * noise


torch.fx.wrap("stochastic_depth")


def relative_position_bias(table: torch.Tensor, index: torch.Tensor, window: int
                           ) -> torch.Tensor:
    """Swin's relative position bias: a table gathered by a precomputed index."""
    n = window * window
    bias = table[index].view(n, n, -1)
    return bias.permute(2, 0, 1).contiguous().unsqueeze(0)


torch.fx.wrap("relative_position_bias")


class Block(nn.Module):
    def __init__(self, window: int = 2, heads: int = 3):
        super().__init__()
        self.window = window
        self.table = nn.Parameter(torch.randn((2 * window - 1) ** 2, heads, dtype=DT))
        coords = torch.stack(torch.meshgrid(torch.arange(window), torch.arange(window),
                                            indexing="ij")).flatten(1)
        rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0) + window - 1
        self.register_buffer("index", (rel[..., 0] * (2 * window - 1) + rel[..., 1]).flatten())
        self.lin = nn.Linear(window * window, window * window, dtype=DT)

    def forward(self, x):
        attn = self.lin(x) + relative_position_bias(self.table, self.index, self.window)
        return x + stochastic_depth(attn.softmax(-1), 0.5, self.training)


def test_fx_wrapped_functions_are_traced_through():
    torch.manual_seed(0)
    m = Block()
    x = _x(2, 3, 4, 4)
    g = _check_module(m, x, seed=1)
    code = g.code
    assert "stochastic_depth" not in code and "relative_position_bias" not in code
    assert "bernoulli_" in code
    _check_module(m, x, seed=2)  # a new draw: still autograd's numbers


def fused_cube(x):
    return x * x * x


torch.fx.wrap("fused_cube")


def test_fx_wrapped_function_with_a_rule_stays_one_call():
    class Cube:
        def fwd(x):
            return fused_cube(x), x

        def bwd(x, d):
            return (3 * x * x * d,)

    fxad.register_vjp(fused_cube, fwd=Cube.fwd, bwd=Cube.bwd)
    try:
        def f(x):
            return fused_cube(x.sin()).sum()

        x = _x(5)
        g = fxad.grad(f, x)
        assert "3 * sin" in g.code  # the rule's backward, not the traced body's
        torch.testing.assert_close(g(x)[1][0], 3 * x.sin() ** 2 * x.cos())
    finally:
        fxad.unregister(fused_cube)


# -- torch functions replaced by a library -----------------------------------------------------
_CALLS: list[str] = []


def _library_index_select(input, dim, index, *, out=None):  # noqa: A002 - torch's names
    """A library's replacement of torch.index_select: Python around the real op."""
    _CALLS.append("index_select")
    if out is None:
        return _NATIVE_INDEX_SELECT(input, dim, index)
    return _NATIVE_INDEX_SELECT(input, dim, index, out=out)


_NATIVE_INDEX_SELECT = torch._C._VariableFunctions.index_select


def test_replaced_torch_function_resolves_to_pytorchs(monkeypatch):
    monkeypatch.setattr(torch, "index_select", _library_index_select)
    assert torch_function("index_select") is _NATIVE_INDEX_SELECT
    assert original(_library_index_select) is _NATIVE_INDEX_SELECT
    idx = torch.tensor([2, 0, 2])

    def f(x):
        # the method form is resolved by name: to PyTorch's function, not the replacement
        a = x.index_select(0, idx)
        b = torch.index_select(x, 1, idx[:2])  # the replacement: traced as Python
        return (a.sum(0) * b.sum(1).sum() + a.exp().sum()).sum()

    x = _x(3, 4)
    g = fxad.grad(f, x)
    assert "_library_index_select" not in g.code and "torch.index_select(" in g.code
    assert _CALLS, "the replacement ran while tracing"
    xr = x.clone().requires_grad_()
    f(xr).backward()
    torch.testing.assert_close(g(x)[1][0], xr.grad)


def test_torch_function_replaced_before_fxad_import():
    """A library imported before fxad: rules and op names still key on PyTorch's own."""
    script = textwrap.dedent("""
        import torch
        native = torch.index_select
        def replacement(input, dim, index, *, out=None):
            return native(input, dim, index)
        torch.index_select = replacement
        import fxad
        idx = torch.tensor([1, 1, 0])
        def f(x):
            return (torch.index_select(x, 0, idx) * x.index_select(0, idx)).sum()
        x = torch.randn(3, 2, dtype=torch.float64)
        g = fxad.grad(f, x)
        xr = x.clone().requires_grad_()
        f(xr).backward()
        torch.testing.assert_close(g(x)[1][0], xr.grad)
        print("ok")
    """)
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-2000:]


# -- PyTorch Geometric (replaces torch.index_select / torch.select at import) -----------------
@pytest.mark.parametrize("name", ["GCNConv", "GATConv", "SAGEConv"])
def test_pyg_convolutions(name):
    pyg_nn = pytest.importorskip("torch_geometric.nn")
    torch.manual_seed(0)
    conv = getattr(pyg_nn, name)(3, 4).double()
    edges = torch.tensor([[0, 1, 2, 3, 4, 0, 2], [1, 2, 3, 4, 0, 2, 4]])

    class OnGraph(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = conv

        def forward(self, x):
            return self.conv(x, edges)

    _check_module(OnGraph(), _x(5, 3))


# -- a module built in forward around the model's own submodule (torchdiffeq) ----------------
def test_torchdiffeq_odeint_on_a_module():
    torchdiffeq = pytest.importorskip("torchdiffeq")

    class Field(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(2, 6), nn.Tanh(), nn.Linear(6, 2)).double()

        def forward(self, t, y):
            return self.net(y)

    class Flow(nn.Module):
        def __init__(self):
            super().__init__()
            self.f = Field()

        def forward(self, y0):
            # odeint wraps self.f in a module of its own (_PerturbFunc), built here
            t = torch.linspace(0, 1, 3, dtype=DT)
            return torchdiffeq.odeint(self.f, y0, t, method="rk4")

    torch.manual_seed(0)
    _check_module(Flow(), _x(3, 2))
