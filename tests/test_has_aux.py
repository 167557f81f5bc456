"""``has_aux=True`` on :func:`fxad.grad` and :func:`fxad.vjp`, as in ``torch.func``: the
function returns ``(output, aux)``; only ``output`` is differentiated and ``aux`` (tensors
detached, Python values as they are) comes last in what the generated module returns."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxad
from fxad.errors import InputError

D = torch.float64


def _t(*shape, seed=0):
    return torch.randn(*shape, dtype=D, generator=torch.Generator().manual_seed(seed))


def loss_and_logits(w, x, target):
    logits = x @ w
    loss = F.cross_entropy(logits, target)
    return loss, {"logits": logits, "probs": logits.softmax(-1), "tag": "ce", "k": 3}


def test_grad_has_aux_matches_torch_func():
    w, x = _t(4, 3), _t(5, 4, seed=1)
    target = torch.tensor([0, 2, 1, 1, 0])
    g = fxad.grad(loss_and_logits, w, x, target, has_aux=True)
    value, grads, aux = g(w, x, target)
    def tensors_only(*args):  # torch.func's aux takes tensors only; fxad's any pytree
        loss, aux = loss_and_logits(*args)
        return loss, {k: v for k, v in aux.items() if isinstance(v, torch.Tensor)}

    ref_grads, ref_aux = torch.func.grad(tensors_only, argnums=(0, 1), has_aux=True)(
        w, x, target)
    torch.testing.assert_close(value, loss_and_logits(w, x, target)[0])
    torch.testing.assert_close(grads[0], ref_grads[0])
    torch.testing.assert_close(grads[1], ref_grads[1])
    assert grads[2] is None
    assert set(aux) == {"logits", "probs", "tag", "k"}
    torch.testing.assert_close(aux["logits"], ref_aux["logits"])
    torch.testing.assert_close(aux["probs"], ref_aux["probs"])
    assert aux["tag"] == "ce" and aux["k"] == 3
    # new inputs: aux is computed from them, not a constant of the build
    w2 = _t(4, 3, seed=5)
    torch.testing.assert_close(g(w2, x, target)[2]["logits"], x @ w2)


def test_vjp_has_aux_matches_torch_func():
    def f(x):
        y = torch.sin(x) * x
        return y, (y.sum(), x.cos())

    x = _t(6)
    v = fxad.vjp(f, x, has_aux=True)
    ct = _t(6, seed=2)
    out, (dx,), aux = v(x, ct)
    ref_out, ref_fn, ref_aux = torch.func.vjp(f, x, has_aux=True)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(dx, ref_fn(ct)[0])
    torch.testing.assert_close(aux[0], ref_aux[0])
    torch.testing.assert_close(aux[1], ref_aux[1])


def test_aux_tensors_are_detached_and_take_no_cotangent():
    def f(x):
        loss = (x ** 2).sum()
        return loss, loss  # the same value as output and aux

    x = _t(3)
    g = fxad.grad(f, x, has_aux=True)
    g.record_autograd = True
    xr = x.clone().requires_grad_()
    value, (dx,), aux = g(xr)
    torch.testing.assert_close(dx, 2 * x)
    torch.testing.assert_close(aux, value)
    assert not aux.requires_grad
    assert ".detach()" in g.code


def test_module_grad_has_aux():
    class Classifier(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 3)

        def forward(self, x, y):
            logits = self.lin(x)
            return F.cross_entropy(logits, y), logits

    torch.manual_seed(0)
    model = Classifier().double()
    x, y = _t(5, 4), torch.tensor([0, 1, 2, 1, 0])
    g = fxad.grad(model, x, y, has_aux=True)
    value, input_grads, param_grads, logits = g(x, y)
    model.zero_grad()
    loss, ref_logits = model(x, y)
    loss.backward()
    torch.testing.assert_close(value, loss)
    torch.testing.assert_close(logits, ref_logits)
    for n, p in model.named_parameters():
        torch.testing.assert_close(param_grads[n], p.grad)


def test_has_aux_with_keywords_and_tuple_valued_aux():
    def f(x, *, chunks):
        parts = torch.split(x * 2, chunks)
        return sum(p.sum() for p in parts), parts

    x = _t(6)
    g = fxad.grad(f, x, chunks=2, has_aux=True)
    value, (dx,), parts = g(x, chunks=2)
    torch.testing.assert_close(dx, torch.full((6,), 2.0, dtype=D))
    assert len(parts) == 3
    torch.testing.assert_close(torch.cat(parts), x * 2)


def test_has_aux_needs_a_pair():
    with pytest.raises(InputError, match="has_aux=True.*pair"):
        fxad.grad(lambda x: x.sum(), _t(3), has_aux=True)
    with pytest.raises(InputError, match="3-tuple"):
        fxad.vjp(lambda x: (x, x, x), _t(3), has_aux=True)


def test_grad_without_has_aux_still_refuses_a_pair():
    with pytest.raises(InputError, match="one scalar"):
        fxad.grad(lambda x: (x.sum(), x), _t(3))


def test_check_with_has_aux():
    w, x = _t(4, 3), _t(5, 4, seed=1)
    target = torch.tensor([0, 2, 1, 1, 0])
    report = fxad.check(loss_and_logits, w, x, target, has_aux=True)
    assert report.max_abs_err < 1e-10
