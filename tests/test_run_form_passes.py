"""Rewrites of the code fxad.compile runs that remove work eager autograd does not do
(fxad.training.passes): gradients equal autograd's in float64, and the rewrite is where it
is sound and nowhere else."""
from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

import fxad
from fxad.training.passes import activations_in_place, fresh_result

D = torch.float64


class Block(nn.Module):
    """conv-BN-ReLU, conv-BN, shortcut, ReLU (ResNet's basic block, ReLU in place)."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 4, 3, padding=1, bias=False, dtype=D)
        self.b1 = nn.BatchNorm2d(4, dtype=D)
        self.c2 = nn.Conv2d(4, 3, 3, padding=1, bias=False, dtype=D)
        self.b2 = nn.BatchNorm2d(3, dtype=D)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        out = self.relu(self.b1(self.c1(x)))
        out = self.b2(self.c2(out))
        return self.relu(out + x).square().mean()


def _train(model, x, steps=2):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for _ in range(steps):
        opt.zero_grad()
        loss = model(x)
        loss.backward()
        out.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
        opt.step()
    return out


def _same_training(model, x):
    eager = copy.deepcopy(model)
    ref = _train(eager, x)
    c = fxad.compile(model)
    got = _train(c, x)
    for (l1, g1), (l2, g2) in zip(got, ref):
        torch.testing.assert_close(l1, l2)
        for a, b in zip(g1, g2):
            torch.testing.assert_close(a, b)
    for a, b in zip(model.buffers(), eager.buffers()):  # running statistics as eager's
        torch.testing.assert_close(a, b)
    return c


def test_relu_of_fresh_values_runs_in_place():
    torch.manual_seed(0)
    m = Block()
    c = _same_training(m, torch.randn(2, 3, 5, 5, dtype=D))
    code = c.fwd_gm.code
    assert code.count("torch.relu_(") == 2 and "torch.relu(" not in code


def test_activation_of_a_value_read_elsewhere_is_not_in_place():
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4, dtype=D)

        def forward(self, x):
            h = self.lin(x)
            return (torch.tanh(h) * h).sum() + torch.sigmoid(h * 2).sum() + F.relu(x).sum()

    torch.manual_seed(0)
    c = _same_training(Two(), torch.randn(3, 4, dtype=D, requires_grad=False))
    code = c.fwd_gm.code
    assert "torch.tanh(" in code  # h is read by the product too
    assert "torch.sigmoid_(" in code  # h * 2 is fresh and read only by sigmoid
    assert "relu_(" not in code  # x is an input


def test_in_place_pass_on_a_traced_graph():
    def f(x, w):
        a = x @ w
        return torch.tanh(a), torch.relu(x)

    x, w = torch.randn(3, 3, dtype=D), torch.randn(3, 3, dtype=D)
    gm = fxad.trace(f, x, w)
    assert activations_in_place(gm) == 1
    assert "torch.tanh_(" in gm.code
    got = gm(x, w)
    torch.testing.assert_close(got[0], torch.tanh(x @ w))
    torch.testing.assert_close(got[1], torch.relu(x))


def test_fresh_result_of_multi_output_builtins():
    def f(x, w, b):
        y, mean, rstd = torch.native_layer_norm(x, [3], w, b, 1e-5)
        u, v = torch.unsafe_chunk(x, 2, 0)
        return y, mean, u, v

    x = torch.randn(4, 3, dtype=D)
    gm = fxad.trace(f, x, torch.ones(3, dtype=D), torch.zeros(3, dtype=D))
    by_name = {n.name: n for n in gm.graph.nodes}
    outs = list(gm.graph.nodes)[-1].args[0]
    assert fresh_result(outs[0]) and fresh_result(outs[1])
    assert not fresh_result(outs[2]) and not fresh_result(outs[3])  # views of x
    assert not fresh_result(by_name["x"])
