"""``fxad.check`` on every kind of program ``fxad.grad`` accepts: in-place updates of the
inputs, outputs without a derivative, integer inputs, keyword arguments, ``has_aux``; the
reference is ``torch.autograd`` in float64 (and ``torch.func`` here).  What it cannot run
raises a clear ``CheckError``, never a raw exception."""
from __future__ import annotations

import pytest
import torch

import fxad
from fxad.rules.registry import overridden

D = torch.float64


def _t(*shape, seed=0, dtype=D):
    return torch.randn(*shape, dtype=dtype, generator=torch.Generator().manual_seed(seed))


def scale_in_place(x):
    x.mul_(2)
    return x.sum()


def sin_in_place(x):
    x.sin_()
    return (x * x).sum()


def through_a_view(x):
    v = x.view(2, 2)
    v.add_(1)
    return (x * x).sum()


def both_inputs(x, y):
    y.add_(x)
    x.exp_()
    return (x * y).sum()


@pytest.mark.parametrize("fn", [scale_in_place, sin_in_place, through_a_view, both_inputs],
                         ids=lambda f: f.__name__)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_programs_that_update_their_inputs(fn, dtype):
    n_args = fn.__code__.co_argcount
    xs = [_t(4, seed=k, dtype=dtype) for k in range(n_args)]
    before = [x.clone() for x in xs]
    report = fxad.check(fn, *xs, dtype=dtype)
    assert report.n_inputs == n_args
    for x, b in zip(xs, before):  # the check leaves the caller's tensors alone
        assert torch.equal(x, b)
    # and fxad's gradient is torch.func's (the leaf is what is differentiated)
    if dtype == torch.float64:
        grads = fxad.grad(fn, *[x.clone() for x in xs])(*[x.clone() for x in xs])[1]
        ref = torch.func.grad(lambda *a: fn(*[t.clone() for t in a]),
                              argnums=tuple(range(n_args)))(*xs)
        for a, b in zip(grads, ref):
            torch.testing.assert_close(a, b)


def argmax_only(x):
    return x.argmax()


def returns_none(x):
    return None


def detached(x):
    return x.detach() * 2


def constant(x):
    return torch.ones(3, dtype=x.dtype)


def mixed(x):
    return (x * 2).sum(), x.argmax(), "label"


def gather(x, idx):
    idx.add_(0)  # an in-place update of an integer input
    return x[idx].pow(2).sum()


@pytest.mark.parametrize("fn,args", [
    (argmax_only, (_t(5),)), (returns_none, (_t(5),)), (detached, (_t(5),)),
    (constant, (_t(5),)), (mixed, (_t(5),)), (gather, (_t(5), torch.tensor([0, 3, 3]))),
], ids=lambda v: getattr(v, "__name__", ""))
def test_outputs_and_inputs_without_derivatives(fn, args):
    report = fxad.check(fn, *args)
    assert report.max_abs_err == 0.0 or report.max_abs_err < 1e-12


def masked_loss(x, w, *, mask, scale=1.0):
    return ((x @ w).tanh() * mask * scale).sum()


def test_keywords_are_passed_to_every_run():
    x, w = _t(3, 4), _t(4, 2, seed=1)
    mask = (_t(3, 2, seed=2) > 0).to(D)
    report = fxad.check(masked_loss, x, w, mask=mask, scale=2.5)
    assert report.compared == ["input[0]", "input[1]"]  # keyword tensors: not differentiated
    report32 = fxad.check(masked_loss, x, w, mask=mask, scale=2.5, dtype=torch.float32)
    assert report32.rounding_ratio is not None


class _Replaced:
    def __init__(self, op, fwd, bwd):
        self.op, self.fwd, self.bwd = op, fwd, bwd

    def __enter__(self):
        self.saved = overridden(self.op)
        self.saved.__enter__()
        fxad.register_vjp(self.op, fwd=self.fwd, bwd=self.bwd, replace=True)

    def __exit__(self, *exc):
        self.saved.__exit__(*exc)


def test_wrong_rule_still_caught_with_keywords_has_aux_and_in_place():
    def f(x, *, w):
        x.mul_(w)
        loss = torch.tanh(x).sum()
        return loss, {"x": x}

    x, w = _t(5), _t(5, seed=3)
    assert fxad.check(f, x, w=w, has_aux=True).max_abs_err < 1e-12
    with _Replaced(torch.tanh, lambda input: (torch.tanh(input), torch.tanh(input)),
                   lambda y, d: ((1 + y * y) * d,)):  # wrong sign
        with pytest.raises(fxad.CheckError) as info:
            fxad.check(f, x, w=w, has_aux=True)
    assert info.value.op == "torch.tanh"


def test_a_run_that_fails_is_a_check_error():
    calls = []

    def once(x):
        calls.append(1)
        if len(calls) > 1:
            raise ValueError("this program may run only once")
        return x.sin().sum()

    with pytest.raises(fxad.CheckError, match="running the function.*ValueError"):
        fxad.check(once, _t(3))


def test_check_options_are_validated():
    with pytest.raises(fxad.InputError, match="values="):
        fxad.check(scale_in_place, _t(3), values="sometimes")
    with pytest.raises(fxad.InputError, match="has_aux"):
        fxad.check(scale_in_place, _t(3), has_aux=True)
