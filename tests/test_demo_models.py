"""The demo models under fxad: checks against autograd/finite differences, a short training
run (fxad vs autograd), batch-norm running statistics, the corpus and the code extraction."""
from __future__ import annotations

import copy

import pytest
import torch
from torch.utils import _pytree as pytree

import fxad
from fxad.demo.data import CharCorpus, stdlib_text
from fxad.demo.models import MLP, SmallCNN, TinyGPT
from fxad.demo.train import (DemoConfig, block_backward_code, build_grad, cnn_demo,
                             train_autograd, train_fxad)

V = 11


def tiny_gpt(**kw):
    torch.manual_seed(0)
    return TinyGPT(V, block_size=8, n_layer=kw.pop("n_layer", 1), n_head=2, n_embd=8, **kw)


def gpt_batch(B=2, T=6, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randint(0, V, (B, T), generator=gen),
            torch.randint(0, V, (B, T), generator=gen))


def cnn_batch(B=4, size=8, seed=2):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(B, 3, size, size, generator=gen), torch.randint(0, 10, (B,), generator=gen)


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_check_tinygpt(mode):
    model = tiny_gpt(n_layer=2)
    model.train(mode == "train")
    report = fxad.check(model, *gpt_batch())
    assert report.n_params == len(list(model.parameters()))
    assert report.max_abs_err < 1e-8


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_check_smallcnn(mode):
    torch.manual_seed(0)
    model = SmallCNN(width=4)
    model.train(mode == "train")
    report = fxad.check(model, *cnn_batch())
    assert report.n_params == len(list(model.parameters()))


@pytest.mark.parametrize("loss", ["mse", "ce"])
def test_check_mlp(loss):
    torch.manual_seed(0)
    model = MLP(6, 16, 3, loss=loss)
    x = torch.randn(5, 6)
    y = torch.randn(5, 3) if loss == "mse" else torch.randint(0, 3, (5,))
    fxad.check(model, x, y)


def test_tinygpt_forward_value_matches_eager():
    model = tiny_gpt()
    idx, tgt = gpt_batch()
    g = fxad.grad(model, idx, tgt)
    loss, (d_idx, d_tgt), grads = g(idx, tgt)
    assert d_idx is None and d_tgt is None
    assert list(grads) == [n for n, _ in model.named_parameters()]
    torch.testing.assert_close(loss, model(idx, tgt))
    # the graph is shape-specialized but reusable for new data of the same shape
    idx2, tgt2 = gpt_batch(seed=5)
    torch.testing.assert_close(g(idx2, tgt2)[0], model(idx2, tgt2))


def test_short_training_run_agrees_with_autograd():
    corpus = CharCorpus.from_text(stdlib_text(20_000))
    cfg = DemoConfig(steps=5, batch_size=4, block_size=16, n_layer=1, n_head=2, n_embd=16)
    batches = corpus.batches(cfg.steps, cfg.batch_size, cfg.block_size, seed=0)
    torch.manual_seed(0)
    m_fx = TinyGPT(corpus.vocab_size, block_size=16, n_layer=1, n_head=2, n_embd=16)
    m_ag = copy.deepcopy(m_fx)
    losses_fx, times, _ = train_fxad(m_fx, batches, cfg)
    losses_ag, _ = train_autograd(m_ag, batches, cfg)
    assert len(losses_fx) == len(times) == 5
    torch.testing.assert_close(torch.tensor(losses_fx), torch.tensor(losses_ag),
                               rtol=1e-5, atol=1e-6)
    assert losses_fx[-1] < losses_fx[0]  # it learns
    for (n, p), q in zip(m_fx.named_parameters(), m_ag.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=n)


def test_batchnorm_running_stats_match_eager():
    torch.manual_seed(0)
    model = SmallCNN(width=4).train()
    ref = copy.deepcopy(model)
    x, y = cnn_batch()
    g, _ = build_grad(model, x, y)
    for _ in range(2):  # two steps: running stats are read back from the live module
        loss, _, grads = g(x, y)
        ref.zero_grad(set_to_none=True)
        ref_loss = ref(x, y)
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss.detach())
        for n, p in ref.named_parameters():
            torch.testing.assert_close(grads[n], p.grad, msg=n)
    for (n, b), rb in zip(model.named_buffers(), ref.buffers(), strict=True):
        torch.testing.assert_close(b, rb, msg=n)
    assert int(model.bn1.num_batches_tracked) == 2


def test_cnn_demo_numbers():
    res = cnn_demo(seed=0, batch_size=4, size=8, check=False)
    assert abs(res["loss_fxad"] - res["loss_autograd"]) < 1e-5
    assert res["grad_max_abs_diff"] < 1e-5 and res["buffer_max_abs_diff"] < 1e-6


def test_block_backward_code_is_block_zero_only():
    model = tiny_gpt(n_layer=2)
    g = fxad.grad(model, *gpt_batch())
    code = block_backward_code(g, "blocks.0")
    assert code.count("# backward of:") >= 5
    assert "blocks_0_" in code and "blocks_1_" not in code
    assert "scaled_dot_product_attention" in code and "layer_norm" in code
    assert block_backward_code(g, "no.such.module") == ""


def test_corpus_is_deterministic():
    text = stdlib_text(5_000)
    assert len(text) == 5_000 and text == stdlib_text(5_000)
    corpus = CharCorpus.from_text(text)
    b1 = corpus.batches(3, 2, 8, seed=7)
    b2 = corpus.batches(3, 2, 8, seed=7)
    for (i1, t1), (i2, t2) in zip(b1, b2, strict=True):
        assert i1.shape == (2, 8) and i1.dtype == torch.long
        assert torch.equal(i1, i2) and torch.equal(t1, t2)
        assert torch.equal(i1[:, 1:], t1[:, :-1])  # targets are shifted inputs
    assert corpus.decode(corpus.encode("def f")) == "def f"


# --- forward mode and second order on the demo models --------------------------------------

def _close64(a, b):
    for x, y in zip(pytree.tree_leaves(a), pytree.tree_leaves(b)):
        torch.testing.assert_close(x, y, atol=1e-9, rtol=1e-7)


def test_jvp_hvp_jacobian_of_tinygpt_block():
    from fxad.demo.models import Block
    torch.manual_seed(0)
    blk = Block(8, 2).double().eval()
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2, 5, 8, dtype=torch.float64, generator=gen)
    t = torch.randn(2, 5, 8, dtype=torch.float64, generator=gen)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    got_jvp = fxad.jvp(blk, x)(x, t)
    loss = lambda x: blk(x).pow(2).mean()  # noqa: E731
    got_hvp = fxad.hvp(loss, x)(x, t)[1][0]
    xs = x[:1, :3]
    got_jac = fxad.jacrev(blk, xs)(xs)
    with sdpa_kernel(SDPBackend.MATH):  # PyTorch's CPU flash attention has no forward AD
        _close64(got_jvp, torch.func.jvp(blk, (x,), (t,)))
        _close64(got_hvp, torch.func.jvp(torch.func.grad(loss), (x,), (t,))[1])
        _close64(got_jac, torch.func.jacrev(blk)(xs))


def test_jvp_hvp_of_smallcnn_logits():
    torch.manual_seed(0)
    cnn = SmallCNN(width=4).double().eval()
    x, _ = cnn_batch(B=2)
    x = x.double()
    t = torch.randn_like(x)
    _close64(fxad.jvp(cnn.logits, x)(x, t), torch.func.jvp(cnn.logits, (x,), (t,)))
    loss = lambda x: torch.logsumexp(cnn.logits(x), 1).sum()  # noqa: E731
    _close64(fxad.hvp(loss, x)(x, t)[1][0],
             torch.func.jvp(torch.func.grad(loss), (x,), (t,))[1])
