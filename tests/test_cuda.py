"""On a CUDA GPU (skipped without one): fxad's attention rules call PyTorch's CUDA flash and
memory-efficient attention kernels (forward and fused backward) and match eager autograd;
transformers' GPT-2 trains through ``fxad.compile`` with the causal flag, in float32 and
under bfloat16 autocast; a sample of rules runs on CUDA tensors and matches autograd."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxad

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

CUDA = "cuda"


class Attend(nn.Module):
    """q, k, v projections of x and attention with ``mask`` (a tensor or None)."""

    def __init__(self, E=64, H=2, mask=None, causal=False, S=None):
        super().__init__()
        self.H, self.mask, self.causal, self.S = H, mask, causal, S
        self.q, self.k, self.v = (nn.Linear(E, E) for _ in range(3))

    def forward(self, x):
        B, L, E = x.shape
        kv = x if self.S is None else x[:, :self.S]
        S = kv.shape[1]
        q = self.q(x).view(B, L, self.H, E // self.H).transpose(1, 2)
        k = self.k(kv).view(B, S, self.H, E // self.H).transpose(1, 2)
        v = self.v(kv).view(B, S, self.H, E // self.H).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask, is_causal=self.causal)
        return y.float().pow(2).mean()


def _steps(model, x, autocast=None):
    """Loss and parameter gradients of eager and of fxad.compile from the same weights."""
    out = []
    for m in (copy.deepcopy(model), fxad.compile(copy.deepcopy(model))):
        with torch.autocast(CUDA, dtype=autocast, enabled=autocast is not None):
            loss = m(x)
        loss.backward()
        grads = [p.grad for p in m.parameters()]
        out.append((loss.detach(), grads, m))
    return out


def _compiled_like_eager(model, x, autocast, rtol, atol):
    """fxad.compile(model) after checking its loss and gradients against eager's (float32:
    tight; under autocast within ``rtol``/``atol``)."""
    (ref_loss, ref, _), (loss, got, c) = _steps(model, x, autocast=autocast)
    tol = dict(rtol=1e-4, atol=1e-5) if autocast is None else dict(rtol=rtol, atol=atol)
    torch.testing.assert_close(loss, ref_loss, **tol)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, **tol)
    return c


def _code(compiled):
    return compiled.fwd_gm.code + compiled.bwd_gm.code


_KERNELS = ("flash", "cudnn", "efficient")  # fxad calls flash where eager picks cuDNN


def _run_lines(code):
    """The lines of ``code`` that run (not comments)."""
    return [ln for ln in code.splitlines() if not ln.strip().startswith("#")]


def _kernel_lines(code, kernel):
    """Code lines (not comments) calling the CUDA forward and backward ``kernel``."""
    fwd = f"_scaled_dot_product_{kernel}_attention("
    bwd = f"_scaled_dot_product_{kernel}_attention_backward("
    lines = _run_lines(code)
    return [ln for ln in lines if fwd in ln], [ln for ln in lines if bwd in ln]


def _kernels_called(code):
    return {k for k in _KERNELS if any(_kernel_lines(code, k))}


@pytest.mark.parametrize("case", ["plain", "causal", "bool_mask", "float_mask", "causal_6x4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_attention_kernels_match_eager(case, dtype):
    torch.manual_seed(0)
    L = 6 if case == "causal_6x4" else 24
    mask = None
    if case == "bool_mask":
        mask = torch.rand(L, L, device=CUDA) > 0.3
        mask[:, 0] = True
    elif case == "float_mask":
        mask = torch.randn(1, 2, L, L, device=CUDA)
    model = Attend(mask=mask, causal=case in ("causal", "causal_6x4"),
                   S=4 if case == "causal_6x4" else None).to(CUDA)
    x = torch.randn(3, L, 64, device=CUDA)
    auto = None if dtype == torch.float32 else dtype
    if auto is not None and mask is not None and mask.is_floating_point():
        model.mask = mask.to(dtype)
    c = _compiled_like_eager(model, x, auto, 3e-2, 3e-3)
    code = _code(c)
    called = _kernels_called(code)
    assert len(called) == 1, code
    (kernel,) = called
    if auto is None or mask is not None:  # flash and cuDNN attention: half precision, no mask
        assert kernel == "efficient", code
    fwd, bwd = _kernel_lines(code, kernel)
    assert len(fwd) == 1 and len(bwd) == 1, code


@pytest.mark.parametrize("backend", ["FLASH_ATTENTION", "EFFICIENT_ATTENTION",
                                     "CUDNN_ATTENTION"])
def test_kernel_follows_eager_choice(backend):
    """Under ``sdpa_kernel(backend)`` fxad's code calls the kernel eager runs (flash
    attention where eager runs cuDNN attention: see ``attention._cuda_kernel``)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    torch.manual_seed(0)
    model = Attend(causal=True).to(CUDA)
    x = torch.randn(3, 32, 64, device=CUDA)
    with sdpa_kernel(getattr(SDPBackend, backend)):
        try:
            with torch.autocast(CUDA, dtype=torch.bfloat16):
                copy.deepcopy(model)(x).backward()
        except RuntimeError as e:  # this GPU or build has no such kernel for these inputs
            pytest.skip(f"eager has no {backend} here: {e}")
        (ref_loss, ref, _), (loss, got, c) = _steps(model, x, autocast=torch.bfloat16)
    for a, b in zip(got, ref):  # bfloat16; under CUDNN_ATTENTION another kernel than eager's
        torch.testing.assert_close(a, b, rtol=5e-2, atol=5e-3)
    want = {"FLASH_ATTENTION": "flash", "EFFICIENT_ATTENTION": "efficient",
            "CUDNN_ATTENTION": "flash"}[backend]
    assert _kernels_called(_code(c)) == {want}, _code(c)


def _gpt2(n_layer=2, n_embd=64, n_head=2, vocab=128, T=32):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(
        n_layer=n_layer, n_embd=n_embd, n_head=n_head, vocab_size=vocab, n_positions=T,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=0,
        eos_token_id=0, attn_implementation="sdpa")

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = transformers.GPT2LMHeadModel(cfg)

        def forward(self, ids):
            return self.model(input_ids=ids, labels=ids).loss

    torch.manual_seed(0)
    return LM().to(CUDA), torch.randint(0, vocab, (2, T), device=CUDA)


@pytest.mark.parametrize("autocast", [None, torch.bfloat16])
def test_gpt2_trains_with_the_causal_kernels(autocast):
    model, ids = _gpt2()
    c = _compiled_like_eager(model, ids, autocast, 5e-2, 5e-3)
    code = _code(c)
    (kernel,) = _kernels_called(code)
    if autocast is None:
        assert kernel == "efficient"
    fwd, bwd = _kernel_lines(code, kernel)
    assert len(fwd) == 2 and len(bwd) == 2, code  # 2 layers
    for ln in fwd + bwd:  # the constant causal mask became the flag
        assert "attn_mask" not in ln and "attn_bias" not in ln and "True" in ln, ln
    # GPT-2's written-out tanh GELU runs as the kernel, under autocast on x cast to float32
    # (CUDA autocast runs the formula's pow in float32)
    run = "\n".join(_run_lines(code))
    assert run.count("approximate = 'tanh'") >= 2 and "gelu_backward" in run, code
    assert "torch.pow(" not in run and "** 3" not in run, code


@pytest.mark.parametrize("compiled", [False, True])
def test_joint_step_gradients_have_the_parameters_dtype(compiled):
    """bfloat16 autocast: every gradient ``joint_step`` returns is float32, as the
    parameters (``p.grad = g`` refuses another dtype), and matches eager's."""
    model, ids = _gpt2(vocab=100)
    eager = copy.deepcopy(model)
    with torch.autocast(CUDA, dtype=torch.bfloat16):
        eager(ids).backward()
        step = fxad.joint_step(model, ids, compile=compiled)
    _, _, grads = step(ids)
    bad = {n: g.dtype for n, g in grads.items() if g is not None and g.dtype != torch.float32}
    assert not bad, f"{bad}\n{step.graph_module.code}"
    for (n, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(grads[n], q.grad, rtol=5e-2, atol=5e-3)


def test_rules_on_cuda_match_autograd():
    torch.manual_seed(0)

    def f(x, w, b, t):
        h = F.layer_norm(x @ w + b, (w.shape[1],))
        h = F.gelu(h) * torch.sigmoid(h).sin()
        h = torch.softmax(h, -1).log1p() + h.cumsum(-1).tanh()
        return F.cross_entropy(h, t) + h.pow(2).mean()

    x = torch.randn(5, 7, device=CUDA, dtype=torch.float64)
    w = torch.randn(7, 6, device=CUDA, dtype=torch.float64)
    b = torch.randn(6, device=CUDA, dtype=torch.float64)
    t = torch.randint(0, 6, (5,), device=CUDA)
    _, got = fxad.grad(f, x, w, b, t, argnums=(0, 1, 2))(x, w, b, t)
    ref = torch.autograd.grad(f(*(a.requires_grad_() for a in (x, w, b)), t), (x, w, b))
    for a, r in zip(got, ref):
        torch.testing.assert_close(a, r)
