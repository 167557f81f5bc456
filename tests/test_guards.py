"""Guards (no silent wrong answer): a generated module checks what it specialized on at
every call.  Symbolic sizes (``dynamic=``) are tested in test_symbolic.py."""
from __future__ import annotations


import pytest
import torch
import torch.nn as nn

import fxad

D = torch.float64


def test_other_shape_is_refused_naming_the_argument():
    g = fxad.grad(lambda x: (x * 2).mean(), torch.randn(4))
    with pytest.raises(fxad.InputError, match=r"`x` has shape \(8,\).*traced for shape \(4,\)"):
        g(torch.randn(8))


def test_python_value_is_guarded():
    def f(x, flag):
        return x.sum() if flag else -x.sum()

    g = fxad.grad(f, torch.randn(3), True)
    g(torch.randn(3), True)
    with pytest.raises(fxad.InputError, match="`flag` is False.*traced with True"):
        g(torch.randn(3), False)


def test_loop_over_a_size_is_guarded():
    def f(x):
        s = 0
        for t in range(x.shape[0]):
            s = s + x[t].sin()
        return s.sum()

    g = fxad.grad(f, torch.randn(4, 3))
    with pytest.raises(fxad.InputError, match="shape"):
        g(torch.randn(6, 3))


def test_dtype_device_and_cotangent_are_guarded():
    g = fxad.vjp(lambda x: x * 2, torch.randn(3))
    with pytest.raises(fxad.InputError, match="dtype"):
        g(torch.randn(3, dtype=D), torch.randn(3, dtype=D))
    with pytest.raises(fxad.InputError, match="`cotangent` has shape"):
        g(torch.randn(3), torch.randn(()))
    j = fxad.jvp(lambda x: x * 2, torch.randn(3))
    with pytest.raises(fxad.InputError):
        j(torch.randn(5), torch.randn(5))


def test_module_batch_size_is_guarded():
    m = nn.Linear(3, 2)
    g = fxad.grad(lambda x: m(x).sum(), torch.randn(5, 3))
    with pytest.raises(fxad.InputError, match=r"`x` has shape \(6, 3\)"):
        g(torch.randn(6, 3))


def test_compile_retraces_on_a_guard_failure_with_a_cache():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 2)

        def forward(self, x, flag, extra):
            y = self.lin(x)
            y = y * extra["scale"]
            return (y.sum() if flag else y.pow(2).sum())

    torch.manual_seed(0)
    m, ref = M().double(), M().double()
    ref.load_state_dict(m.state_dict())
    cm = fxad.compile(m)
    calls = [(torch.randn(4, 3, dtype=D), True, {"scale": torch.tensor(2.0, dtype=D)}),
             (torch.randn(6, 3, dtype=D), True, {"scale": torch.tensor(3.0, dtype=D)}),
             (torch.randn(4, 3, dtype=D), False, {"scale": torch.tensor(2.0, dtype=D)}),
             (torch.randn(4, 3, dtype=D), True, {"scale": torch.tensor(5.0, dtype=D)})]
    for args in calls:
        m.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        cm(*args).backward()
        ref(*args).backward()
        for (n, p), q in zip(m.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=n)
    # a new shape and a new Python value re-traced; a new tensor *value* in a container did not
    assert len({id(p) for p in cm._plans.values()}) == 3  # builds (a build may be filed twice)
