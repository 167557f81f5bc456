"""Real-model suite: fxad on model code it did not write.

``python -m fxad.tools.models [--only NAME ...] [--threads 1] [--steps 20]``

Models built from small configurations with random weights (nothing is downloaded):
Hugging Face ``transformers`` GPT-2 (with its default KV cache on), BERT, Llama (grouped-query
attention, rotary embeddings), T5, ViT, CLIP and Whisper, and ``torch.nn``'s ``Transformer``
(causal and padding masks), ``TransformerEncoder`` (padding mask, eval mode, its fast path
declined as under ``torch.compile``), ``LSTM`` and ``GRU``.  Each model is wrapped in a loss
(the mean square of its main output) and

* **checked** in float64: the value and every parameter and floating input gradient of
  :func:`fxad.grad` against ``torch.autograd`` (:func:`check_case`), and
* **trained** through :func:`fxad.compile` for a few optimizer steps beside the same model
  trained by eager autograd, comparing every parameter after each step
  (:func:`train_case`);

the command also **times** one float32 forward+backward step (fxad's generated code against
autograd, median of interleaved runs, 1 thread by default) and prints, per model: result,
transform time, lines of generated code and the speed ratio ``autograd / fxad`` (> 1: fxad is
faster).  Dropout is set to 0 in the configurations so that the comparisons are exact (fxad's
dropout draws the same masks as eager PyTorch under the same seed, but a comparison of random
programs proves less).

The same cases run in the test suite (``tests/test_real_models.py``).
"""
from __future__ import annotations

import argparse
import copy
import random
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn

import fxad
from ..argparsing import ArgumentParser
from .torchvision_import import prepare_torchvision

__all__ = ["Case", "cases", "check_case", "train_case", "time_case", "main", "add_arguments",
           "run"]

D = torch.float64


@dataclass
class Case:
    """One model: ``build()`` returns ``(model, example_inputs)`` with the model in float32
    (the caller casts); ``loss`` picks the scalar to differentiate from the output."""

    name: str
    build: Callable[[], tuple[nn.Module, tuple]]
    source: str = "transformers"
    train_mode: bool = True


def weighted_loss(out: torch.Tensor) -> torch.Tensor:
    """``mean(w * out ** 2) + mean(w * out)`` in float64 with ``w = linspace(-1, 2)`` along
    the last dimension (a 0-d ``out`` is returned as it is): unlike ``mean(out ** 2)`` it is
    not constant on a layer norm's output (whose mean square is 1 whatever its input), so a
    wrong forward shows in the gradients."""
    out = out.to(torch.float64)
    if out.dim() == 0:  # already a loss
        return out
    w = torch.linspace(-1.0, 2.0, out.shape[-1], dtype=torch.float64)
    return (w * out ** 2).mean() + (w * out).mean()


class LossOf(nn.Module):
    """``mean(output ** 2)`` of the wrapped model's main output (``logits``,
    ``last_hidden_state``, or the first tensor it returns); keyword arguments by name;
    ``weighted=True``: :func:`weighted_loss` of it instead."""

    def __init__(self, model: nn.Module, names: tuple[str, ...] | None = None,
                 key: str | None = None, weighted: bool = False) -> None:
        super().__init__()
        self.model = model
        self.names = names
        self.key = key
        self.weighted = weighted

    def forward(self, *inputs: Any) -> torch.Tensor:
        out = self.model(**dict(zip(self.names, inputs))) if self.names else self.model(*inputs)
        if self.key is not None:
            out = out[self.key]
        elif not isinstance(out, torch.Tensor):
            out = next(v for v in (out.values() if hasattr(out, "values") else out)
                       if isinstance(v, torch.Tensor))
        if self.weighted:
            return weighted_loss(out)
        return (out.to(torch.float64) ** 2).mean()


def _ids(*shape: int, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, vocab, shape, generator=torch.Generator().manual_seed(seed))


def _gpt2() -> tuple[nn.Module, tuple]:
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=50, n_positions=32,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1,
                     eos_token_id=2)
    return LossOf(GPT2LMHeadModel(cfg), ("input_ids",), "logits"), (_ids(2, 8),)


def _bert() -> tuple[nn.Module, tuple]:
    from transformers import BertConfig, BertModel
    cfg = BertConfig(num_hidden_layers=2, num_attention_heads=2, hidden_size=32,
                     intermediate_size=64, vocab_size=50, max_position_embeddings=32,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 6:] = 0
    return LossOf(BertModel(cfg), ("input_ids", "attention_mask"), "last_hidden_state"), \
        (_ids(2, 8), mask)


def _llama() -> tuple[nn.Module, tuple]:
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      hidden_size=32, intermediate_size=64, vocab_size=50,
                      max_position_embeddings=32, bos_token_id=1, eos_token_id=2,
                      pad_token_id=0)
    return LossOf(LlamaForCausalLM(cfg), ("input_ids",), "logits"), (_ids(2, 8),)


def _t5() -> tuple[nn.Module, tuple]:
    from transformers import T5Config, T5Model
    cfg = T5Config(num_layers=2, num_heads=2, d_model=32, d_kv=16, d_ff=64, vocab_size=50,
                   dropout_rate=0.0, decoder_start_token_id=0)
    return LossOf(T5Model(cfg), ("input_ids", "decoder_input_ids"), "last_hidden_state"), \
        (_ids(2, 8), _ids(2, 5, seed=1))


def _vit() -> tuple[nn.Module, tuple]:
    from transformers import ViTConfig, ViTModel
    cfg = ViTConfig(num_hidden_layers=2, num_attention_heads=2, hidden_size=32,
                    intermediate_size=64, image_size=16, patch_size=8, hidden_dropout_prob=0.0,
                    attention_probs_dropout_prob=0.0)
    return LossOf(ViTModel(cfg), ("pixel_values",), "last_hidden_state"), \
        (torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(0)),)


def _clip() -> tuple[nn.Module, tuple]:
    from transformers import CLIPConfig, CLIPModel
    cfg = CLIPConfig(
        text_config=dict(num_hidden_layers=2, num_attention_heads=2, hidden_size=32,
                         intermediate_size=64, vocab_size=50, max_position_embeddings=16,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0),
        vision_config=dict(num_hidden_layers=2, num_attention_heads=2, hidden_size=32,
                           intermediate_size=64, image_size=16, patch_size=8),
        projection_dim=16)
    return LossOf(CLIPModel(cfg), ("input_ids", "pixel_values"), "logits_per_image"), \
        (_ids(2, 8), torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(0)))


def _whisper() -> tuple[nn.Module, tuple]:
    from transformers import WhisperConfig, WhisperModel
    cfg = WhisperConfig(encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                        decoder_attention_heads=2, d_model=32, encoder_ffn_dim=64,
                        decoder_ffn_dim=64, vocab_size=50, num_mel_bins=8,
                        max_source_positions=8, max_target_positions=16, pad_token_id=0,
                        bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
                        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
    return LossOf(WhisperModel(cfg), ("input_features", "decoder_input_ids"),
                  "last_hidden_state"), \
        (torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(0)), _ids(2, 5))


class _Seq2Seq(nn.Module):
    """``nn.Transformer`` with a causal target mask and source/target padding masks."""

    def __init__(self) -> None:
        super().__init__()
        self.t = nn.Transformer(d_model=32, nhead=4, num_encoder_layers=2,
                                num_decoder_layers=2, dim_feedforward=64, dropout=0.0,
                                batch_first=True)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor, src_pad: torch.Tensor,
                tgt_pad: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1], dtype=src.dtype)
        return self.t(src, tgt, tgt_mask=mask, src_key_padding_mask=src_pad,
                      tgt_key_padding_mask=tgt_pad, memory_key_padding_mask=src_pad,
                      tgt_is_causal=True)


def _transformer() -> tuple[nn.Module, tuple]:
    g = torch.Generator().manual_seed(0)
    src_pad = torch.zeros(2, 7, dtype=torch.bool)
    src_pad[1, 5:] = True
    tgt_pad = torch.zeros(2, 6, dtype=torch.bool)
    tgt_pad[0, 4:] = True
    return LossOf(_Seq2Seq()), (torch.randn(2, 7, 32, generator=g),
                                torch.randn(2, 6, 32, generator=g), src_pad, tgt_pad)


class _Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        self.e = nn.TransformerEncoder(layer, 2, enable_nested_tensor=True)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        return self.e(x, src_key_padding_mask=pad)


def _encoder() -> tuple[nn.Module, tuple]:
    pad = torch.zeros(2, 7, dtype=torch.bool)
    pad[0, 4:] = True
    return LossOf(_Encoder()), (torch.randn(2, 7, 32, generator=torch.Generator().manual_seed(0)),
                                pad)


def _rnn(kind: str) -> Callable[[], tuple[nn.Module, tuple]]:
    def build() -> tuple[nn.Module, tuple]:
        cls = {"lstm": nn.LSTM, "gru": nn.GRU}[kind]
        m = cls(16, 32, num_layers=2, bidirectional=True, batch_first=True)
        return LossOf(m), (torch.randn(4, 12, 16, generator=torch.Generator().manual_seed(0)),)
    return build


def cases() -> list[Case]:
    """Every case of the suite, in table order."""
    return [
        Case("GPT-2 (KV cache on)", _gpt2),
        Case("BERT", _bert),
        Case("Llama (GQA, RoPE)", _llama),
        Case("T5", _t5),
        Case("ViT", _vit),
        Case("CLIP", _clip),
        Case("Whisper", _whisper),
        Case("nn.Transformer (masks)", _transformer, "torch.nn"),
        Case("nn.TransformerEncoder (padding, eval)", _encoder, "torch.nn", train_mode=False),
        Case("nn.LSTM (2 layers, bidirectional)", _rnn("lstm"), "torch.nn"),
        Case("nn.GRU (2 layers, bidirectional)", _rnn("gru"), "torch.nn"),
    ]


def _prepared(case: Case, dtype: torch.dtype, seed: int = 0) -> tuple[nn.Module, tuple]:
    prepare_torchvision()  # transformers imports torchvision where it is installed
    torch.manual_seed(seed)
    model, inputs = case.build()
    model = model.to(dtype).train(case.train_mode)
    inputs = tuple(x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x
                   for x in inputs)
    return model, inputs


def _reseed(seed: int) -> None:
    """Seed every generator a model may draw from (torch's, NumPy's, Python's)."""
    torch.manual_seed(seed)
    random.seed(seed)
    try:
        import numpy
    except ImportError:
        return
    numpy.random.seed(seed)


def check_case(case: Case, dtype: torch.dtype = D, seed: int = 0, *, input_grads: bool = True,
               seeds: tuple[int, ...] | None = None, **build_options: Any) -> dict:
    """fxad.grad vs torch.autograd: value, every trainable parameter's and every floating
    input's gradient (``input_grads=False``: parameters only, the inputs not requiring grad
    in the eager run, as in training).  One build is compared on each of ``seeds`` (default
    ``(seed,)``): before each run torch's, NumPy's and Python's generators are seeded alike
    and the module's state is restored, so that dropout and other random ops draw the same
    numbers, and a random choice fixed at build time shows as a mismatch; ``build_options``
    go to :func:`fxad.grad`.  Returns ``{"max_err": ..., "lines": ..., "build_s": ...}``;
    raises AssertionError on a mismatch."""
    model, inputs = _prepared(case, dtype)
    state = copy.deepcopy(model.state_dict())
    _reseed(10_000 + seed)  # the build draws under a seed of its own (see above)
    t0 = time.perf_counter()
    g = fxad.grad(model, *inputs, **build_options) if input_grads else \
        fxad.grad(model, *inputs, argnums=(), **build_options)
    build_s = time.perf_counter() - t0
    errs = []
    for s in (seed,) if seeds is None else seeds:
        model.load_state_dict(state)
        _reseed(s)
        value, d_inputs, d_params = g(*inputs)
        req = [x.detach().clone().requires_grad_() if input_grads and x.is_floating_point()
               else x for x in inputs]
        model.load_state_dict(state)  # buffers (batch-norm statistics) as before fxad's call
        model.zero_grad(set_to_none=True)
        _reseed(s)
        ref = model(*req)
        ref.backward()
        errs.append((value - ref.detach()).abs().item())
        torch.testing.assert_close(value, ref.detach(), msg=f"value (seed {s})")
        for i, (x, d) in enumerate(zip(req, d_inputs)):
            if x.requires_grad:
                torch.testing.assert_close(d, x.grad, msg=f"input {i} (seed {s})")
                errs.append((d - x.grad).abs().max().item())
        for name, p in model.named_parameters():
            if not p.requires_grad:
                continue
            want = p.grad if p.grad is not None else torch.zeros_like(p)
            torch.testing.assert_close(d_params[name], want, msg=f"{name} (seed {s})")
            errs.append((d_params[name] - want).abs().max().item())
    return {"max_err": max(errs), "lines": len(g.code.splitlines()), "build_s": build_s,
            "fallback": "fxad_autograd_vjp" in g.code}


def train_case(case: Case, steps: int = 3, dtype: torch.dtype = D) -> float:
    """``fxad.compile`` vs eager autograd for ``steps`` SGD-with-momentum steps from the same
    weights; returns the largest parameter difference after the last step.  (SGD keeps the
    comparison meaningful: Adam divides each gradient by its own magnitude, so on entries
    whose gradient is zero up to rounding (an embedding row no token used) it turns
    1e-17 differences of summation order into steps of the learning rate's size.)"""
    model, inputs = _prepared(case, dtype, seed=1)
    ref, _ = _prepared(case, dtype, seed=1)
    ref.load_state_dict(model.state_dict())
    compiled = fxad.compile(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    worst = 0.0
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)
        loss = compiled(*inputs)
        loss.backward()
        ref_loss = ref(*inputs)
        ref_loss.backward()
        torch.testing.assert_close(loss.detach(), ref_loss.detach())
        opt.step()
        ref_opt.step()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, msg=name)
            worst = max(worst, (p - q).abs().max().item())
    return worst


def time_case(case: Case, *, rounds: int = 20, threads: int = 1) -> dict:
    """Median time of one float32 forward+backward step: fxad's generated code (``fxad.grad``
    with parameter gradients) and eager autograd, interleaved."""
    torch.set_num_threads(threads)
    model, inputs = _prepared(case, torch.float32)
    t0 = time.perf_counter()
    g = fxad.grad(model, *inputs, argnums=())
    build_s = time.perf_counter() - t0

    def run_fxad() -> None:
        g(*inputs)

    def run_autograd() -> None:
        model.zero_grad(set_to_none=True)
        model(*inputs).backward()

    for fn in (run_fxad, run_autograd):
        fn()
    tf, ta = [], []
    for _ in range(rounds):
        for fn, acc in ((run_fxad, tf), (run_autograd, ta)):
            t = time.perf_counter()
            fn()
            acc.append(time.perf_counter() - t)
    mf, ma = statistics.median(tf), statistics.median(ta)
    return {"fxad_ms": mf * 1e3, "autograd_ms": ma * 1e3, "ratio": ma / mf,
            "build_s": build_s, "lines": len(g.code.splitlines())}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The options of the suite (``python -m fxad.tools.models`` and ``fxad models``)."""
    ap.add_argument("--only", nargs="*", metavar="NAME", help="substrings of case names to run")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    ap.add_argument("--rounds", type=int, default=20, help="timed rounds per model")
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps through fxad.compile")


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog="python -m fxad.tools.models", description=__doc__.split("\n")[0])
    add_arguments(ap)
    return run(ap.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """Run the suite with parsed options (see :func:`add_arguments`); exit status 1 unless
    every model passes."""
    torch.set_num_threads(args.threads)
    print(f"fxad real-model suite - torch {torch.__version__}, {args.threads} thread(s)")
    rows = []
    for case in cases():
        if args.only and not any(s.lower() in case.name.lower() for s in args.only):
            continue
        try:
            chk = check_case(case)
            trained = train_case(case, args.steps)
            tim = time_case(case, rounds=args.rounds, threads=args.threads)
            result = "pass" + (" (fallback)" if chk["fallback"] else "")
            rows.append((case.name, result, f"{chk['build_s']:.2f} s", str(chk["lines"]),
                         f"{chk['max_err']:.1e}", f"{trained:.1e}",
                         f"{tim['fxad_ms']:.2f} / {tim['autograd_ms']:.2f} ms",
                         f"{tim['ratio']:.2f}x"))
        except Exception as e:  # noqa: BLE001 - reported in the table
            msg = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            rows.append((case.name, "FAIL " + msg[:70], "", "", "", "", "", ""))
        print("  " + " | ".join(rows[-1]), flush=True)
    head = ("model", "result", "transform", "lines", "max grad err (f64)",
            f"params after {args.steps} steps (compile)", "fxad / autograd (f32)",
            "autograd/fxad")
    print()
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        print("| " + " | ".join(r) + " |")
    return 0 if all(r[1].startswith("pass") for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
