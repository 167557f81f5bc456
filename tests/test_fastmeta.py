"""fxad.graph.fastmeta: each function's result against PyTorch's own fake result (sizes,
strides, dtype, device), on symbolic and static sizes; where a function declines
(``NotImplemented``), PyTorch's path runs instead."""
from __future__ import annotations

import operator

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import (DimDynamic, ShapeEnv,
                                                   StatelessSymbolicContext)

import fxad
from fxad.graph.fastmeta import FAST_META, fast_meta, same, view_strides

aten = torch.ops.aten


def _mode(symbolic: bool) -> FakeTensorMode:
    env = ShapeEnv(duck_shape=False, should_record_events=False) if symbolic else None
    return FakeTensorMode(shape_env=env, allow_non_fake_inputs=True)


def _fake(mode: FakeTensorMode, t: torch.Tensor, dyn: tuple[int, ...] = ()) -> torch.Tensor:
    if mode.shape_env is None or not dyn:
        return mode.from_tensor(t, static_shapes=True)
    ctx = StatelessSymbolicContext(dynamic_sizes=[
        DimDynamic.DYNAMIC if d in dyn else DimDynamic.STATIC for d in range(t.dim())])
    return mode.from_tensor(t, symbolic_context=ctx)


def _same_meta(a, b) -> None:
    if isinstance(a, (tuple, list)):
        assert isinstance(b, (tuple, list)) and len(a) == len(b)
        for x, y in zip(a, b):
            _same_meta(x, y)
        return
    if a is None or b is None:
        assert a is None and b is None
        return
    assert a.dim() == b.dim(), (a.shape, b.shape)
    assert all(same(x, y) for x, y in zip(a.shape, b.shape)), (a.shape, b.shape)
    assert all(same(x, y) for x, y in zip(a.stride(), b.stride())), (a.stride(), b.stride())
    assert same(a.storage_offset(), b.storage_offset()), (a.storage_offset(), b.storage_offset())
    assert a.dtype == b.dtype and a.device == b.device


def _cases(mode):
    """(key, op, args, kwargs, expect_fast) on fakes of ``mode``; B and T symbolic where
    the mode has a ShapeEnv."""
    r = torch.randn
    x = _fake(mode, r(4, 6, 8), (0, 1))
    xt = _fake(mode, r(6, 4, 8), (0, 1)).transpose(0, 1)
    x2 = _fake(mode, r(24, 8), (0,))
    w, b = _fake(mode, r(5, 8)), _fake(mode, r(5))
    g, beta = _fake(mode, r(8)), _fake(mode, r(8))
    qkv = _fake(mode, r(4, 6, 24), (0, 1))
    idx = _fake(mode, torch.randint(0, 10, (4, 6)), (0, 1))
    emb = _fake(mode, r(10, 8))
    logits = _fake(mode, r(24, 10), (0,))
    k2 = _fake(mode, r(8, 3))
    yield F.linear, F.linear, (x, w, b), {}, True
    yield F.linear, F.linear, (x, w), {}, True
    yield F.linear, F.linear, (xt, w, b), {}, True
    yield F.linear, F.linear, (x2, w, b), {}, True
    yield F.linear, F.linear, (x, w, _fake(mode, r(3))), {}, False
    yield F.layer_norm, F.layer_norm, (x, (8,), g, beta), {}, True
    yield F.layer_norm, F.layer_norm, (x, [8], None, None, 1e-3), {}, True
    yield F.layer_norm, F.layer_norm, (xt, (8,), g, beta), {}, True
    yield F.layer_norm, F.layer_norm, (x, (6, 8), None, None), {}, False
    yield torch.native_layer_norm, torch.native_layer_norm, (x, [8], g, beta, 1e-5), {}, True
    yield torch.native_layer_norm, torch.native_layer_norm, (x2, [8], None, None, 1e-5), {}, True
    with mode:
        y, mean, rstd = torch.native_layer_norm(x, [8], g, beta, 1e-5)
        d = torch.empty_like(y)
    for mask in ([True, True, True], [True, False, False], [False, True, True]):
        yield (aten.native_layer_norm_backward, aten.native_layer_norm_backward,
               (d, x, [8], mean, rstd, g, beta, mask), {}, True)
    yield (aten.native_layer_norm_backward, aten.native_layer_norm_backward,
           (d, x, [8], mean, rstd, None, None, [True, True, True]), {}, True)
    yield F.embedding, F.embedding, (idx, emb), {}, True
    yield F.embedding, F.embedding, (idx, emb), {"padding_idx": 0}, True
    yield F.gelu, F.gelu, (x,), {}, True
    yield F.gelu, F.gelu, (x,), {"approximate": "tanh"}, True
    yield F.gelu, F.gelu, (xt,), {}, False
    yield aten.gelu_backward, aten.gelu_backward, (d, x), {}, True
    yield aten.gelu_backward, aten.gelu_backward, (d, x), {"approximate": "tanh"}, True
    tgt = _fake(mode, torch.randint(0, 10, (24,)))
    if mode.shape_env is not None:
        with mode:
            tgt = torch.empty(logits.shape[0], dtype=torch.int64)
    yield F.cross_entropy, F.cross_entropy, (logits, tgt), {}, True
    yield F.cross_entropy, F.cross_entropy, (logits, tgt), {"reduction": "sum"}, True
    yield F.cross_entropy, F.cross_entropy, (logits, tgt), {"reduction": "none"}, False
    if mode.shape_env is not None:  # targets of a size of their own: checked equal (a guard)
        tgt2 = _fake(mode, torch.randint(0, 10, (24,)), (0,))
        yield F.cross_entropy, F.cross_entropy, (logits, tgt2), {}, True
    yield torch.add, torch.add, (x, d), {}, True
    yield operator.mul, operator.mul, (x, 2.5), {}, True
    yield ("method", "sub"), torch.Tensor.sub, (x, d), {"alpha": 2}, True
    yield torch.add, torch.add, (x, g), {}, False  # broadcasting: PyTorch's path
    yield torch.mul, torch.mul, (xt, xt), {}, False
    yield ("method", "sum"), torch.Tensor.sum, (x, [0, 1]), {}, True
    yield ("method", "sum"), torch.Tensor.sum, (x, (1,), True), {}, True
    yield torch.sum, torch.sum, (x, -1), {}, True
    yield ("method", "sum"), torch.Tensor.sum, (x,), {}, False
    yield torch.matmul, torch.matmul, (x, k2), {}, True
    yield torch.matmul, torch.matmul, (x2, k2), {}, True
    yield torch.mm, torch.mm, (x2, k2), {}, True
    yield operator.matmul, operator.matmul, (x, k2), {}, True
    yield torch.matmul, torch.matmul, (xt, k2), {}, False
    yield torch.transpose, torch.transpose, (x, 0, 2), {}, True
    yield torch.transpose, torch.transpose, (xt, -1, 1), {}, True
    yield torch.t, torch.t, (x2,), {}, True
    yield ("method", "t"), torch.Tensor.t, (x2,), {}, True
    yield ("method", "transpose"), torch.Tensor.transpose, (x, 1, 0), {}, True
    yield torch.reshape, torch.reshape, (x, (-1, 8)), {}, True
    yield torch.reshape, torch.reshape, (x, (-1,)), {}, True
    yield ("method", "view"), torch.Tensor.view, (x, x.shape[0], x.shape[1], 2, 4), {}, True
    yield ("method", "view"), torch.Tensor.view, (x, (x.shape[0], -1)), {}, True
    yield ("method", "reshape"), torch.Tensor.reshape, (x, [x.shape[0] * x.shape[1], 8]), {}, \
        True
    # a slice of a fused projection (not contiguous) split into heads: a view
    q = qkv[..., :8]
    yield ("method", "view"), torch.Tensor.view, (q, q.shape[0], q.shape[1], 2, 4), {}, True
    yield ("method", "view"), torch.Tensor.view, (q, (-1, 8)), {}, True
    yield torch.unsqueeze, torch.unsqueeze, (x, 1), {}, True
    yield ("method", "unsqueeze"), torch.Tensor.unsqueeze, (xt, -1), {}, True
    yield torch.Tensor.unsqueeze, torch.Tensor.unsqueeze, (q, 0), {}, True
    yield torch.split, torch.split, (qkv, 8, 2), {}, True
    yield torch.Tensor.split, torch.Tensor.split, (qkv, 10), {"dim": -1}, True
    yield ("method", "split"), torch.Tensor.split, (q, 3, 2), {}, True
    yield torch.split, torch.split, (x, 2), {}, False  # along a symbolic size
    # merging dimensions that are not contiguous: PyTorch's reshape copies
    yield ("method", "reshape"), torch.Tensor.reshape, (xt, (-1, 8)), {}, False


@pytest.mark.parametrize("symbolic", [True, False], ids=["symbolic", "static"])
def test_fast_metadata_is_pytorchs(symbolic):
    mode = _mode(symbolic)
    fast_count = 0
    cases = list(_cases(mode))  # (real example tensors are made outside the fake mode)
    with mode:
        for key, op, args, kwargs, expect_fast in cases:
            assert key in FAST_META
            got = fast_meta(key, args, kwargs)
            if not symbolic:
                # static sizes: PyTorch's cached path, never this module's
                assert got is NotImplemented
                got = FAST_META[key](*args, **kwargs)
                if got is NotImplemented:
                    continue
            elif got is NotImplemented:
                assert not expect_fast, (key, args, kwargs)
                continue
            else:
                assert expect_fast, ("applied where it should decline", key, args, kwargs)
            fast_count += 1
            want = op(*args, **kwargs)
            _same_meta(got, want)
    assert fast_count >= 30


def test_a_declined_check_adds_no_guard():
    mode = _mode(True)
    a = _fake(mode, torch.randn(4, 8), (1,))
    c = _fake(mode, torch.randn(8, 3), (0,))  # another symbol: equal only under a guard
    w = _fake(mode, torch.randn(3, 8))
    a2 = _fake(mode, torch.randn(4, 8), (0,))
    with mode:
        n = len(mode.shape_env.guards)
        assert fast_meta(torch.matmul, (a, c), {}) is NotImplemented
        assert fast_meta(F.linear, (a, w), {}) is NotImplemented
        assert fast_meta(F.linear, (a2, w), {}) is not NotImplemented
        assert len(mode.shape_env.guards) == n


def test_view_strides_follow_pytorchs_rule():
    # (2, 3, 4) contiguous: merge and split
    assert view_strides((2, 3, 4), (12, 4, 1), (6, 4)) == [4, 1]
    assert view_strides((2, 3, 4), (12, 4, 1), (2, 3, 2, 2)) == [12, 4, 2, 1]
    # a transposed tensor cannot merge its dimensions without a copy
    assert view_strides((3, 2), (1, 3), (6,)) is None
    # size-1 dimensions anywhere
    assert view_strides((2, 1, 4), (4, 4, 1), (2, 4, 1)) == [4, 1, 1]


def test_capture_value_keeps_autograd_facts():
    """In capture, a fast result answers requires_grad/is_leaf as the op's own result."""
    seen = {}

    def f(x, w):
        y = F.linear(x, w)
        seen["rg"], seen["leaf"] = y.requires_grad, y.is_leaf
        with torch.no_grad():
            z = F.linear(x, w)
        seen["rg_nograd"] = z.requires_grad
        return y.sum()

    x, w = torch.randn(3, 4, dtype=torch.float64), torch.randn(5, 4, dtype=torch.float64)
    with pytest.warns(UserWarning, match="changed in place"):  # (``seen``: build time only)
        g = fxad.grad(f, x, w, argnums=(0, 1), dynamic=True)
    assert seen == {"rg": True, "leaf": False, "rg_nograd": False}
    for n in (2, 7):
        xs = torch.randn(n, 4, dtype=torch.float64, requires_grad=True)
        ws = w.clone().requires_grad_()
        F.linear(xs, ws).sum().backward()
        _, (dx, dw) = g(xs.detach(), w)
        torch.testing.assert_close(dx, xs.grad)
        torch.testing.assert_close(dw, ws.grad)


def test_writes_through_fast_views_reach_their_base():
    """Views made here share storage with their base, so capture follows writes through
    them (on symbolic sizes) as through PyTorch's own views."""

    def f(x):
        y = x * 1.0
        v = y.view(y.shape[0], -1, 2)
        v.mul_(3.0)
        t = y.transpose(0, 1)
        t[0].add_(1.0)
        r = y.reshape(-1)
        r[:2].mul_(2.0)
        return (y * y).sum()

    g = fxad.grad(f, torch.randn(4, 6, dtype=torch.float64), dynamic=True)
    for shape in ((4, 6), (5, 8), (3, 4)):
        x = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
        want = f(x)
        want.backward()
        value, (dx,) = g(x.detach())
        torch.testing.assert_close(value, want.detach())
        torch.testing.assert_close(dx, x.grad)
