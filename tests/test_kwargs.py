"""Keyword arguments at build and call time: ``fxad.grad(f, x, scale=3.0, mask=m)`` and
``g(x, scale=3.0, mask=m)``.  Tensor keywords are inputs of the generated code (named by
their keyword, not differentiated, as in ``torch.func.grad``); Python keywords are
specialized and guarded.  ``fxad.compile`` and ``fxad.joint_step`` take them too (there a
keyword tensor with ``requires_grad`` gets its gradient, as in eager autograd)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import fxad
from fxad.errors import InputError

D = torch.float64


def _t(*shape, seed=0):
    return torch.randn(*shape, dtype=D, generator=torch.Generator().manual_seed(seed))


def f(x, y, *, scale, mask=None, shift=0.0):
    h = torch.tanh(x * y) * scale + shift
    if mask is not None:
        h = h * mask
    return (h.sin() * x).sum()


def _ref_grad(x, y, **kw):
    return torch.func.grad(lambda a, b: f(a, b, **kw), argnums=(0, 1))(x, y)


def test_grad_with_tensor_and_python_keywords_matches_torch_func():
    x, y, m = _t(5), _t(5, seed=1), _t(5, seed=2).abs()
    g = fxad.grad(f, x, y, scale=3.0, mask=m)
    assert "def forward(self, x, y, scale, mask)" in g.code
    assert "3.0" in g.code  # the Python keyword is specialized
    val, grads = g(x, y, scale=3.0, mask=m)
    assert len(grads) == 2  # the positional inputs only
    ref = _ref_grad(x, y, scale=3.0, mask=m)
    torch.testing.assert_close(val, f(x, y, scale=3.0, mask=m))
    for a, b in zip(grads, ref):
        torch.testing.assert_close(a, b)
    # new values of the tensor keyword are inputs, not constants
    m2 = _t(5, seed=3)
    val2, grads2 = g(x, y, scale=3.0, mask=m2)
    torch.testing.assert_close(val2, f(x, y, scale=3.0, mask=m2))
    torch.testing.assert_close(grads2[0], _ref_grad(x, y, scale=3.0, mask=m2)[0])
    # the keyword order at call time does not matter; all positional in the code's order too
    torch.testing.assert_close(g(x, y, mask=m2, scale=3.0)[1][1], grads2[1])
    torch.testing.assert_close(g(x, y, 3.0, m2)[1][1], grads2[1])


def test_python_keyword_is_guarded_naming_the_argument():
    x, y = _t(4), _t(4, seed=1)
    g = fxad.grad(f, x, y, scale=2.0, shift=0.5)
    with pytest.raises(InputError, match="`scale` is 4.0.*traced with 2.0"):
        g(x, y, scale=4.0, shift=0.5)
    with pytest.raises(InputError, match="`shift`"):
        g(x, y, scale=2.0, shift=0.25)
    torch.testing.assert_close(g(x, y, scale=2.0, shift=0.5)[1][0],
                               _ref_grad(x, y, scale=2.0, shift=0.5)[0])


def test_none_and_tensor_keywords_do_not_swap():
    x, y, m = _t(4), _t(4, seed=1), _t(4, seed=2)
    with_mask = fxad.grad(f, x, y, scale=1.0, mask=m)
    with pytest.raises(InputError, match="`mask` must be a tensor"):
        with_mask(x, y, scale=1.0, mask=None)
    without = fxad.grad(f, x, y, scale=1.0, mask=None)
    with pytest.raises(InputError, match="`mask`"):
        without(x, y, scale=1.0, mask=m)
    torch.testing.assert_close(without(x, y, scale=1.0, mask=None)[1][0],
                               _ref_grad(x, y, scale=1.0)[0])


def test_missing_and_unknown_keywords():
    x, y = _t(3), _t(3, seed=1)
    g = fxad.grad(f, x, y, scale=1.0)
    with pytest.raises(InputError, match="missing: scale"):
        g(x, y)
    with pytest.raises(InputError, match="unknown: mask"):
        g(x, y, scale=1.0, mask=x)
    with pytest.raises(InputError, match="takes no keyword argument `bogus`") as info:
        fxad.grad(f, x, y, scale=1.0, bogus=1)
    assert info.value.loc is not None and info.value.loc.function == "f"
    with pytest.raises(InputError, match="both as positional"):
        fxad.grad(lambda x, y: (x * y).sum(), x, x=y)


def test_keyword_named_like_an_option_through_example_kwargs():
    def h(x, *, dynamic):
        return (x * dynamic).sum()

    x = _t(3)
    g = fxad.grad(h, x, example_kwargs={"dynamic": 2.0})
    torch.testing.assert_close(g(x, dynamic=2.0)[1][0], torch.full((3,), 2.0, dtype=D))


def test_argnums_index_positional_inputs():
    x, y, m = _t(4), _t(4, seed=1), _t(4, seed=2)
    g = fxad.grad(f, x, y, argnums=-1, scale=1.5, mask=m)
    _, grads = g(x, y, scale=1.5, mask=m)
    assert grads[0] is None
    torch.testing.assert_close(grads[1], _ref_grad(x, y, scale=1.5, mask=m)[1])
    with pytest.raises(InputError, match="out of range"):
        fxad.grad(f, x, y, argnums=2, scale=1.5, mask=m)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x, *, mask=None, temperature=1.0):
        y = self.lin(x) / temperature
        if mask is not None:
            y = y.masked_fill(mask, 0.0)
        return y.pow(2).sum()


def _param_grads(model, *args, **kw):
    model.zero_grad()
    model(*args, **kw).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_module_vjp_and_grad_with_keywords():
    torch.manual_seed(0)
    model = Net().double()
    x = _t(5, 4)
    mask = torch.rand(5, 3, generator=torch.Generator().manual_seed(1)) > 0.5
    g = fxad.grad(model, x, mask=mask, temperature=0.5)
    assert "def forward(self, x, mask, temperature)" in g.code
    val, (dx,), pg = g(x, mask=mask, temperature=0.5)
    ref = _param_grads(model, x, mask=mask, temperature=0.5)
    for k in ref:
        torch.testing.assert_close(pg[k], ref[k])
    xr = x.clone().requires_grad_()
    model(xr, mask=mask, temperature=0.5).backward()
    torch.testing.assert_close(dx, xr.grad)
    v = fxad.vjp(model, x, mask=mask, temperature=0.5)
    out, (dx2,), pg2 = v(x, torch.tensor(2.0, dtype=D), mask=mask, temperature=0.5)
    torch.testing.assert_close(dx2, 2 * xr.grad)


def test_dynamic_build_with_keywords():
    model = Net().double()
    x = _t(5, 4)
    mask = torch.zeros(5, 3, dtype=torch.bool)
    g = fxad.grad(model, x, mask=mask, temperature=2.0, dynamic=True)
    x7, mask7 = _t(7, 4, seed=3), torch.ones(7, 3, dtype=torch.bool)
    mask7[:, 0] = False
    _, (dx,), pg = g(x7, mask=mask7, temperature=2.0)
    ref = _param_grads(model, x7, mask=mask7, temperature=2.0)
    for k in ref:
        torch.testing.assert_close(pg[k], ref[k])


def test_forward_mode_and_higher_derivatives_with_keywords():
    x, y, m = _t(4), _t(4, seed=1), _t(4, seed=2)
    kw = {"scale": 2.0, "mask": m}
    v = _t(4, seed=5)
    j = fxad.jvp(f, x, y, **kw)
    _, tangent = j(x, y, v, None, **kw)
    ref = torch.func.jvp(lambda a: f(a, y, **kw), (x,), (v,))[1]
    torch.testing.assert_close(tangent, ref)
    h = fxad.hvp(f, x, y, **kw)
    _, hv = h(x, y, v, None, **kw)
    ref_h = torch.autograd.functional.hvp(lambda a: f(a, y, **kw), x, v)[1]
    torch.testing.assert_close(hv[0], ref_h)
    H = fxad.hessian(f, x, y, **kw)
    torch.testing.assert_close(H(x, y, **kw), torch.func.hessian(lambda a: f(a, y, **kw))(x))

    def elementwise(x, *, w):
        return torch.sin(x * w)

    w = _t(4, seed=7)
    ref_j = torch.func.jacrev(lambda a: elementwise(a, w=w))(x)
    torch.testing.assert_close(fxad.jacrev(elementwise, x, w=w)(x, w=w), ref_j)
    torch.testing.assert_close(fxad.jacfwd(elementwise, x, w=w)(x, w=w), ref_j)


def test_compile_with_keywords_matches_eager_and_rebuilds_for_python_values():
    torch.manual_seed(0)
    model = Net().double()
    cm = fxad.compile(model)
    x = _t(5, 4)
    mask = torch.rand(5, 3, generator=torch.Generator().manual_seed(2)) > 0.5
    for t in (0.5, 0.5, 2.0):
        model.zero_grad()
        cm(x, mask=mask, temperature=t).backward()
        got = {n: p.grad.clone() for n, p in model.named_parameters()}
        ref = _param_grads(model, x, mask=mask, temperature=t)
        for k in ref:
            torch.testing.assert_close(got[k], ref[k])
    assert len(cm.builds) == 2  # one per temperature


def test_compile_differentiates_keyword_tensors_that_require_grad():
    def loss_of(model, x, bias):
        return (model.lin(x) + bias).pow(2).sum()

    class WithBias(Net):
        def forward(self, x, *, bias):
            return loss_of(self, x, bias)

    model = WithBias().double()
    x = _t(3, 4)
    bias = _t(3, seed=4).requires_grad_()
    fxad.compile(model)(x, bias=bias).backward()
    got = bias.grad.clone()
    bias.grad = None
    model(x, bias=bias).backward()
    torch.testing.assert_close(got, bias.grad)


def test_joint_step_with_keywords():
    torch.manual_seed(0)
    model = Net().double()
    x = _t(5, 4)
    mask = torch.zeros(5, 3, dtype=torch.bool)
    mask[0] = True
    step = fxad.joint_step(model, x, mask=mask, temperature=0.5, compile=False)
    loss, input_grads, pg = step(x, mask=mask, temperature=0.5)
    assert len(input_grads) == 1
    ref = _param_grads(model, x, mask=mask, temperature=0.5)
    for k in ref:
        torch.testing.assert_close(pg[k], ref[k])
    with pytest.raises(InputError, match="`temperature`"):
        step(x, mask=mask, temperature=1.0)
    with pytest.raises(InputError, match="missing: mask"):
        step(x, temperature=0.5)


def test_trace_with_keywords_names_the_placeholders():
    gm = fxad.trace(f, _t(3), _t(3), scale=1.0, mask=_t(3))
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    assert names == ["x", "y", "scale", "mask"]


def test_bert_tiny_compile_with_attention_mask_matches_eager():
    pytest.importorskip("transformers")
    from fxad.tools.library_models import import_torchvision

    import_torchvision()  # transformers imports torchvision, whose CUDA wheel needs this
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=32, max_position_embeddings=16,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = BertForSequenceClassification(cfg).double().train()
    ids = torch.randint(0, 64, (2, 8))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 5:] = 0
    labels = torch.tensor([0, 1])
    cm = fxad.compile(model)
    out = cm(ids, attention_mask=mask, labels=labels)
    out["loss"].backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    ref = model(ids, attention_mask=mask, labels=labels)
    ref.loss.backward()
    torch.testing.assert_close(out["loss"], ref.loss)
    torch.testing.assert_close(out["logits"], ref.logits)
    assert got.keys() == {n for n, p in model.named_parameters() if p.grad is not None}
    for n, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(got[n], p.grad)
    # another mask of the same shape: the same build, eager's numbers
    mask2 = torch.ones(2, 8, dtype=torch.long)
    mask2[0, 3:] = 0
    torch.testing.assert_close(cm(ids, attention_mask=mask2, labels=labels)["logits"],
                               model(ids, attention_mask=mask2, labels=labels).logits)
    # the one more build is for the configuration the first call changed (the model sets
    # config.problem_type in forward); another mask needs none
    assert len(cm.builds) == 2 and "config.problem_type (None -> " in cm.builds[1].reason
    cm(ids, attention_mask=mask, labels=labels)
    assert len(cm.builds) == 2
