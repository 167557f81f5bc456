"""Builds on symbolic sizes (fxad.symbolic): one build serves every size the guards admit,
the code reads its sizes from its inputs, and every assumption is checked on each call."""
from __future__ import annotations

import re

import pytest
import torch
import torch.nn as nn
from torch.export import Dim

import fxad
from fxad.demo.models import TinyGPT

D = torch.float64


def _autograd(m, *args):
    m.zero_grad(set_to_none=True)
    loss = m(*args)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in m.named_parameters()}


def _gpt(positions: int = 12):
    """fxad's demo GPT: token and position embeddings, SDPA blocks, cross-entropy of
    ``(idx, targets)``."""
    torch.manual_seed(0)
    return TinyGPT(40, block_size=positions, n_layer=2, n_head=2, n_embd=16).to(D)


def test_gpt_one_build_serves_every_batch_and_length():
    m = _gpt()
    idx, tgt = torch.randint(0, 40, (3, 5)), torch.randint(0, 40, (3, 5))
    g = fxad.grad(m, idx, tgt, argnums=(), dynamic=True)
    code = g.code
    assert "idx_size_0 = idx.size(0)" in code and "idx_size_1 = idx.size(1)" in code
    assert not re.search(r"\(3, 5\b|\b15\b", code)  # no example size baked in
    for B in range(1, 9):
        for T in range(1, 13):
            i, t = torch.randint(0, 40, (B, T)), torch.randint(0, 40, (B, T))
            value, _, grads = g(i, t)
            want_value, want = _autograd(m, i, t)
            torch.testing.assert_close(value, want_value, rtol=1e-9, atol=1e-9)
            for n, w in want.items():
                torch.testing.assert_close(grads[n], w, rtol=1e-9, atol=1e-9, msg=n)
    # past the position table: refused, naming the embedding line
    with pytest.raises(fxad.InputError, match=r"idx_size_1 <= 12.*self\.wpe\(pos\)"):
        g(torch.randint(0, 40, (2, 13)), torch.randint(0, 40, (2, 13)))
    # the program ties the token counts of idx and tgt together
    with pytest.raises(fxad.InputError, match=r"targets_size_0.*cross_entropy"):
        g(torch.randint(0, 40, (2, 7)), torch.randint(0, 40, (3, 7)))


def test_dynamic_shapes_in_torch_export_format_names_and_ties_sizes():
    m = _gpt()
    idx, tgt = torch.randint(0, 40, (2, 6)), torch.randint(0, 40, (2, 6))
    B, T = Dim("B"), Dim("T", max=10)
    g = fxad.grad(m, idx, tgt, argnums=(),
                  dynamic_shapes={"idx": {0: B, 1: T}, "targets": {0: B, 1: T}})
    assert "B = idx.size(0)" in g.code and "T = idx.size(1)" in g.code
    assert "targets.size(" not in g.code
    for b, t in [(1, 1), (4, 10), (5, 3)]:
        i, y = torch.randint(0, 40, (b, t)), torch.randint(0, 40, (b, t))
        value, _, grads = g(i, y)
        want_value, want = _autograd(m, i, y)
        torch.testing.assert_close(value, want_value)
        torch.testing.assert_close(grads["wpe.weight"], want["wpe.weight"])
    with pytest.raises(fxad.InputError, match=r"T <= 10 \(declared in dynamic_shapes"):
        g(torch.randint(0, 40, (2, 11)), torch.randint(0, 40, (2, 11)))
    with pytest.raises(fxad.InputError, match=r"`targets`.size\(0\) is 3.*`idx`.size\(0\) is 2"):
        g(torch.randint(0, 40, (2, 4)), torch.randint(0, 40, (3, 4)))


def _mean_of_scaled_rows(x, w, b):
    return ((x @ w + b).tanh() * torch.arange(x.shape[1], dtype=x.dtype)[:, None]).mean()


def _symbolic_grad_matches_autograd(shapes):
    """fxad.grad of :func:`_mean_of_scaled_rows` built once with dynamic=True, against
    autograd at each x shape of ``shapes``; returns the built module and w, b."""
    f = _mean_of_scaled_rows
    w, b = torch.randn(3, 4, dtype=D), torch.randn(4, dtype=D)
    g = fxad.grad(f, torch.randn(2, 5, 3, dtype=D), w, b, dynamic=True)
    for shape in shapes:
        x = torch.randn(shape, dtype=D)
        args = [a.clone().requires_grad_() for a in (x, w, b)]
        want = torch.autograd.grad(f(*args), args)
        _, got = g(x, w, b)
        for a, e in zip(got, want):
            torch.testing.assert_close(a, e)
    return g, w, b


def test_size_one_broadcasting_and_mean_at_every_size():
    g, w, b = _symbolic_grad_matches_autograd([(1, 1, 3), (1, 7, 3), (6, 1, 3), (4, 9, 3)])
    with pytest.raises(fxad.InputError, match=r"`w`.size\(0\) is 3, but `x`.size\(2\) is 4"):
        g(torch.randn(2, 5, 4, dtype=D), w, b)  # sizes the matmul ties together


def test_python_decision_on_a_size_is_a_guard_naming_the_line():
    def f(x):
        if x.shape[0] > 10:
            return x.sum()
        return (x * x.exp()).sum()

    g = fxad.grad(f, torch.randn(3, dtype=D), dynamic=True)
    for n in (1, 7, 10):
        x = torch.randn(n, dtype=D)
        xr = x.clone().requires_grad_()
        torch.testing.assert_close(g(x)[1][0], torch.autograd.grad(f(xr), xr)[0])
    with pytest.raises(fxad.InputError,
                       match=r"x_size_0 <= 10 \(required by `if x.shape\[0\] > 10:`"):
        g(torch.randn(12, dtype=D))


def test_a_loop_over_a_size_fixes_it():
    def f(x):
        s = 0
        for t in range(x.shape[0]):
            s = s + x[t].sin()
        return s.sum()

    g = fxad.grad(f, torch.randn(4, 3, dtype=D), dynamic=True)  # Dim.AUTO: stays static
    x = torch.randn(4, 5, dtype=D)
    xr = x.clone().requires_grad_()
    torch.testing.assert_close(g(x)[1][0], torch.autograd.grad(f(xr), xr)[0])
    with pytest.raises(fxad.InputError, match=r"`x` has shape \(6, 3\)"):
        g(torch.randn(6, 3, dtype=D))
    with pytest.raises(fxad.InputError,
                       match=r"declared dynamic \(N\).*fixes it to 4 at .*range\(x.shape\[0\]\)"):
        fxad.grad(f, torch.randn(4, 3, dtype=D), dynamic_shapes={"x": {0: Dim("N")}})


def test_sizes_the_program_ties_together_share_one_symbol():
    def f(x, y):
        return torch.cat([x, y], 1).sum()

    g = fxad.grad(f, torch.randn(4, 2, dtype=D), torch.randn(4, 3, dtype=D), dynamic=True)
    g(torch.randn(7, 2, dtype=D), torch.randn(7, 5, dtype=D))
    with pytest.raises(fxad.InputError, match="must agree"):
        g(torch.randn(7, 2, dtype=D), torch.randn(6, 3, dtype=D))


def test_forward_mode_on_symbolic_sizes():
    def f(x):
        return (x.softmax(-1) * torch.arange(x.shape[1], dtype=x.dtype)).sum(1)

    j = fxad.jvp(f, torch.randn(3, 5, dtype=D), dynamic_shapes={"x": {1: Dim("T")}})
    assert "T = x.size(1)" in j.code
    for T in (1, 5, 9):
        x, t = torch.randn(3, T, dtype=D), torch.randn(3, T, dtype=D)
        torch.testing.assert_close(j(x, t)[1], torch.func.jvp(f, (x,), (t,))[1])


def test_bad_specs_are_refused():
    x = torch.randn(3, 4)
    with pytest.raises(fxad.InputError, match="no such argument: 'y'"):
        fxad.grad(lambda x: x.sum(), x, dynamic_shapes={"y": {0: Dim("B")}})
    with pytest.raises(fxad.InputError, match="no dimension 2"):
        fxad.grad(lambda x: x.sum(), x, dynamic_shapes={"x": {2: Dim("B")}})
    with pytest.raises(fxad.InputError, match="dynamic= takes True or False"):
        fxad.grad(lambda x: x.sum(), x, dynamic={"x": 0})
    with pytest.raises(fxad.InputError, match="derived dimensions"):
        fxad.grad(lambda x: x.sum(), torch.randn(4, 4), dynamic_shapes={"x": {0: 2 * Dim("B")}})
    with pytest.raises(fxad.InputError, match="outside the range"):
        fxad.grad(lambda x: x.sum(), x, dynamic_shapes={"x": {0: Dim("B", max=2)}})


def test_compile_is_dynamic_automatically_and_records_its_builds():
    m, ref = _gpt(32).float(), _gpt(32).float()
    cm = fxad.compile(m)
    for T in range(5, 31):  # 26 sequence lengths
        idx, tgt = torch.randint(0, 40, (4, T)), torch.randint(0, 40, (4, T))
        m.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        cm(idx, tgt).backward()
        ref(idx, tgt).backward()
        for (n, p), q in zip(m.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=n)
    assert [b.reason for b in cm.builds] == [
        "first call", "sizes changed: dimension 1 of input 0, dimension 1 of input 1 made "
                      "symbolic"]
    assert cm.builds[1].symbols == {"idx_size_1": ["idx.size(1)", "targets.size(1)"]}
    idx = torch.randint(0, 40, (2, 9))  # a new batch size: one more build, B symbolic too
    cm(idx, idx).backward()
    assert len(cm.builds) == 3 and "idx_size_0" in cm.builds[2].symbols


def test_transformers_models_one_build_at_other_shapes():
    pytest.importorskip("transformers")
    from fxad.tools.models import _prepared, cases

    for name in ("GPT-2 (KV cache on)", "BERT", "Llama (GQA, RoPE)"):
        case = next(c for c in cases() if c.name == name)
        m, inputs = _prepared(case, D)
        g = fxad.grad(m, *inputs, argnums=(), dynamic=True)
        symbols = g.meta["fxad_shapes"]["symbols"]
        assert any(k.endswith("size_0") for k in symbols) and \
            any(k.endswith("size_1") for k in symbols), (name, symbols)
        for B, T in [(1, 5), (3, 2), (4, 13)]:
            args = [torch.randint(3, 50, (B, T)) if x.dtype == torch.long and x.max() > 1
                    else torch.ones(B, T, dtype=x.dtype) for x in inputs]
            value, _, grads = g(*args)
            want_value, want = _autograd(m, *args)
            torch.testing.assert_close(value, want_value, msg=name)
            for n, w in want.items():
                if w is not None:
                    torch.testing.assert_close(grads[n], w, msg=f"{name}: {n}")


def test_hvp_checkpoint_cond_and_joint_step_on_symbolic_sizes():
    import torch.utils.checkpoint as cp

    def f(x, w):
        return ((x @ w).tanh() ** 2).sum() / x.shape[0]

    w = torch.randn(3, 4, dtype=D)
    h = fxad.hvp(f, torch.randn(5, 3, dtype=D), w, dynamic_shapes={"x": {0: Dim("B")}})
    assert "B = x.size(0)" in h.code
    for B in (1, 2, 7):
        x = torch.randn(B, 3, dtype=D)
        tx, tw = torch.randn_like(x), torch.randn_like(w)
        want = torch.func.jvp(torch.func.grad(f, argnums=(0, 1)), (x, w), (tx, tw))[1]
        for a, b in zip(h(x, w, tx, tw)[1], want):
            torch.testing.assert_close(a, b)

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(3, 8), nn.Linear(8, 1)

        def forward(self, x):
            h = cp.checkpoint(lambda t: torch.tanh(self.a(t)), x, use_reentrant=False)
            h = torch.cond(h.sum() > 0, lambda t: t.sin(), lambda t: t.cos(), (h,))
            return self.b(h).pow(2).mean()

    torch.manual_seed(0)
    m = M().to(D)
    g = fxad.grad(m, torch.randn(5, 3, dtype=D), argnums=(), dynamic=True)
    step = fxad.joint_step(m, torch.randn(5, 3, dtype=D), compile=False, dynamic=True)
    static_step = fxad.joint_step(m, torch.randn(5, 3, dtype=D), compile=False)
    for B in (1, 4, 9):
        x = torch.randn(B, 3, dtype=D)
        _, want = _autograd(m, x)
        for got in (g(x)[2], step(x)[2]):
            for n, w_ in want.items():
                torch.testing.assert_close(got[n], w_, msg=n)
    with pytest.raises(fxad.InputError, match=r"joint_step: argument `x` has shape \(4, 3\)"):
        static_step(torch.randn(4, 3, dtype=D))  # built for 5 rows: refused, not wrong


def test_fuzzer_dynamic_mode_checks_other_sizes():
    from fxad.tools.fuzz import generate, run_program

    results = [run_program(generate(11, i), ("dynamic",)) for i in range(12)]
    classes = [r.outcomes["dynamic"].cls for r in results]
    assert "wrong" not in classes and "crash" not in classes, classes
    assert classes.count("pass") >= 10


def test_custom_function_and_scan_on_symbolic_sizes():
    from torch._higher_order_ops.scan import scan

    class Square(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x * x

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return 2 * x * g

    def f(x):
        return Square.apply(x.tanh()).sum(1).mean()

    def g(x):
        def step(c, xt):
            c = torch.tanh(c + xt)
            return c, c * 2
        return scan(step, torch.zeros_like(x[0]), x)[1].sum()

    for fn, dyn in ((f, {"x": {0: Dim("B"), 1: Dim("N")}}), (g, {"x": {1: Dim("N")}})):
        d = fxad.grad(fn, torch.randn(6, 3, dtype=D), dynamic_shapes=dyn)
        for shape in [(6, 1), (6, 4)] + ([(2, 5)] if fn is f else []):
            x = torch.randn(shape, dtype=D)
            xr = x.clone().requires_grad_()
            torch.testing.assert_close(d(x)[1][0], torch.autograd.grad(fn(xr), xr)[0])


def test_build_through_the_python_dispatcher(monkeypatch):
    """Where a torch's C++ composite operators would fix symbolic sizes (PyTorch 2.11's
    ``matmul`` of a 3-D by a 2-D tensor), the build runs under PyTorch's Python dispatcher:
    the code stays generic over the sizes and matches autograd at other sizes."""
    import fxad.symbolic as symbolic
    monkeypatch.setattr(symbolic, "composites_fix_sizes", lambda: True)
    g, _, _ = _symbolic_grad_matches_autograd([(1, 7, 3), (4, 9, 3)])
    assert "torch.arange(x_size_1" in g.code
