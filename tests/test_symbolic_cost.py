"""What keeps a symbolic build cheap: memoized size arithmetic (fxad.graph.symcache) and the
engines reusing capture's values for the forward computation (Emitter.known_value)."""
from __future__ import annotations

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.sym_node import SymNode
from torch.fx.experimental.symbolic_shapes import (DimDynamic, ShapeEnv,
                                                   StatelessSymbolicContext)

import fxad
from fxad.demo.models import TinyGPT
from fxad.graph.proxy import Emitter
from fxad.graph.symcache import memoized


def _symbolic(shape: tuple[int, ...]) -> tuple[ShapeEnv, FakeTensorMode, torch.Tensor]:
    env = ShapeEnv(duck_shape=False)
    mode = FakeTensorMode(shape_env=env)
    x = mode.from_tensor(torch.randn(shape), symbolic_context=StatelessSymbolicContext(
        dynamic_sizes=[DimDynamic.DYNAMIC] * len(shape)))
    return env, mode, x


def test_memo_returns_the_same_size_for_the_same_question_and_restores_torch():
    originals = {a: getattr(SymNode, a) for a in ("_mul", "_eq", "wrap_int", "maybe_as_int")}
    env, mode, x = _symbolic((3, 5))
    a, b = x.shape
    with memoized(env):
        assert SymNode._mul is not originals["_mul"]
        p, q = a * b, a * b
        assert p.node is q.node  # one sympy expression built, not two
        assert str(p.node.expr) == str((a * b).node.expr)
        with memoized(env):  # re-entrant
            assert (a * b).node is p.node
        assert SymNode._mul is not originals["_mul"]
    for attr, fn in originals.items():  # torch's own methods back outside
        assert getattr(SymNode, attr) is fn
    r, s = a * b, a * b
    assert r.node is not s.node


def test_memo_follows_a_tie_made_after_the_first_question():
    env, mode, x = _symbolic((4, 4))
    a, b = x.shape
    with memoized(env):
        before = a * b
        assert len(before.node.expr.free_symbols) == 2
        with mode:
            torch._check(a == b)  # the program ties the two sizes: one symbol
        after = a * b
        assert after.node is not before.node
        assert len(after.node.expr.free_symbols) == 1
        assert after.node.maybe_as_int() is None


def test_memo_leaves_other_shape_envs_alone():
    env1, _, x1 = _symbolic((2, 3))
    env2, _, x2 = _symbolic((2, 3))
    with memoized(env1):
        a2, b2 = x2.shape
        assert (a2 * b2).node is not (a2 * b2).node  # env2 has no memo
        a1, b1 = x1.shape
        assert (a1 * b1).node is (a1 * b1).node


def test_known_value_is_taken_only_for_the_same_call():
    g = fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.zeros(2, 3)
    em = Emitter(g)
    p = em.value(x)
    marker = torch.zeros(2, 3)
    with em.known_value("call_function", torch.sin, (p,), {}, marker):
        same = torch.sin(p)
        other_args = torch.sin(p * 2)
        other_target = torch.cos(p)
    assert same.node.meta["val"] is marker
    assert other_args.node.meta["val"] is not marker
    assert other_target.node.meta["val"] is not marker
    after = torch.sin(p)
    assert after.node.meta["val"] is not marker


def test_symbolic_gpt_with_reused_values_is_right_at_other_sizes():
    torch.manual_seed(0)
    m = TinyGPT(40, block_size=16, n_layer=1, n_head=2, n_embd=8).double()
    idx, tgt = torch.randint(0, 40, (2, 5)), torch.randint(0, 40, (2, 5))
    g = fxad.grad(m, idx, tgt, argnums=(), dynamic=True)
    for B, T in [(1, 1), (3, 7), (2, 16)]:
        i, t = torch.randint(0, 40, (B, T)), torch.randint(0, 40, (B, T))
        loss, _, grads = g(i, t)
        m.zero_grad()
        ref = m(i, t)
        ref.backward()
        assert torch.allclose(loss, ref, atol=1e-12, rtol=1e-9)
        for name, p in m.named_parameters():
            assert torch.allclose(grads[name], p.grad, atol=1e-9, rtol=1e-9), name
