"""Recurrent networks, forward+backward: fxad's generated code vs ``torch.autograd`` vs
``torch.compile``.

Models: ``nn.RNN`` (tanh), ``nn.LSTM`` and ``nn.GRU``, one and two layers, one and two
directions, at ``--seq`` steps, ``--batch`` sequences, ``--input`` features and
``--hidden`` units (default 32, 16, 64, 128, float32), with the loss ``mean(out^2)`` of the
output sequence.  A step is one forward and backward up to the parameter gradients, four
ways, in the same process, on identical copies of the model:

* ``fxad``: ``g = fxad.grad(model, x, argnums=())`` built once; a step is ``g(x)``.
* ``fxad.compile``: ``fxad.compile(model)``, the generated forward and backward run inside
  a ``torch.autograd.Function``; a step is ``m(x).backward()`` (``.grad`` reset to ``None``).
* ``autograd``: ``model(x).backward()`` (``.grad`` reset to ``None`` first).
* ``compile``: the same on ``torch.compile(model)`` (AOTAutograd + inductor); skipped with
  ``--no-compile``, 'n/a' if compilation fails.

Times are medians over ``--repeats`` steps after ``--warmup``, the methods interleaved in
blocks of ``--block`` steps (the first step of each block is not counted), as
``bench_training.py`` does.  Ratios ``other / fxad`` (> 1: fxad faster) are "paired": the
median over the rounds of the ratio of each round's block medians
(:func:`bench_fxad.paired_ratio`), so that a drift of a shared machine's speed cancels.
``grad err`` is ``max |g_fxad - g_autograd| / max |g_autograd|`` over all parameters.

Usage::

    python benchmarks/bench_rnn.py --threads 1 [--models rnn,lstm,gru] [--no-compile]
        [--repeats 30] [--block 5] [--seq 32] [--batch 16] [--hidden 128]
"""
from __future__ import annotations

import argparse
import copy
import os
import platform
import sys
import time
from typing import Any

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_fxad import paired_ratio, time_interleaved  # noqa: E402

import fxad  # noqa: E402


class SeqLoss(nn.Module):
    """A recurrent layer stack and ``mean(out^2)`` of its output sequence."""

    def __init__(self, rnn: nn.Module) -> None:
        super().__init__()
        self.rnn = rnn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(x)
        return (out * out).mean()


def make_model(kind: str, layers: int, bidirectional: bool, n_in: int,
               hidden: int) -> nn.Module:
    cls = {"rnn": nn.RNN, "lstm": nn.LSTM, "gru": nn.GRU}[kind]
    return SeqLoss(cls(n_in, hidden, num_layers=layers, bidirectional=bidirectional))


def autograd_step(model: nn.Module, x: torch.Tensor) -> Any:
    def step() -> Any:
        model.zero_grad(set_to_none=True)
        loss = model(x)
        loss.backward()
        return loss
    return step


def grad_err(model: nn.Module, g: Any, x: torch.Tensor) -> float:
    ref = copy.deepcopy(model)
    ref.zero_grad(set_to_none=True)
    ref(x).backward()
    _, _, grads = g(x)
    diff = max(float((grads[n] - p.grad).abs().max()) for n, p in ref.named_parameters())
    return diff / max(float(p.grad.abs().max()) for p in ref.parameters())


def bench(kind: str, layers: int, bidir: bool, args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(0)
    model = make_model(kind, layers, bidir, args.input, args.hidden)
    x = torch.randn(args.seq, args.batch, args.input)
    row: dict[str, Any] = {"name": f"{kind.upper()} {layers}L {'bi' if bidir else 'uni'}"}
    t0 = time.perf_counter()
    g = fxad.grad(model, x, argnums=())
    row["build_s"] = time.perf_counter() - t0
    row["lines"] = len(g.code.splitlines())
    row["fallback"] = "fxad_autograd_vjp" in g.code
    row["err"] = grad_err(model, g, x)
    m_fc = fxad.compile(copy.deepcopy(model))
    steps = {"fxad": lambda: g(x),
             "fxad.compile": autograd_step(m_fc, x),
             "autograd": autograd_step(copy.deepcopy(model), x)}
    if not args.no_compile:
        try:
            step_c = autograd_step(torch.compile(copy.deepcopy(model)), x)
            t0 = time.perf_counter()
            step_c()
            step_c()
            row["compile_s"] = time.perf_counter() - t0
            steps["compile"] = step_c
        except Exception as e:  # no C++ compiler, unsupported op, ...
            row["compile_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"
    rounds: dict[str, list[float]] = {}
    times = time_interleaved(steps, torch.device("cpu"), args.repeats, args.warmup,
                             block=args.block, rounds=rounds)
    for k in ("fxad", "fxad.compile", "autograd", "compile"):
        row[f"t_{k}"] = times.get(k)
    row["ag/fxad"] = paired_ratio(rounds, "autograd", "fxad")
    row["comp/fxad"] = paired_ratio(rounds, "compile", "fxad")
    row["ag/fxad.compile"] = paired_ratio(rounds, "autograd", "fxad.compile")
    row["comp/fxad.compile"] = paired_ratio(rounds, "compile", "fxad.compile")
    return row


def _ms(t: float | None) -> str:
    return "n/a" if t is None else f"{t * 1e3:.2f}"


def _x(r: float | None) -> str:
    return "n/a" if r is None else f"{r:.2f}x"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="rnn,lstm,gru")
    p.add_argument("--layers", default="1,2")
    p.add_argument("--directions", default="uni,bi")
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--input", type=int, default=64)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--repeats", type=int, default=30, help="timed steps per method")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--block", type=int, default=5)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"fxad {fxad.__version__} | torch {torch.__version__} | Python "
          f"{platform.python_version()} | cpu ({platform.processor() or platform.machine()}) | "
          f"{torch.get_num_threads()} CPU thread(s)")
    print(f"forward+backward (parameter gradients) of mean(out^2), seq {args.seq}, batch "
          f"{args.batch}, input {args.input}, hidden {args.hidden}, float32; median of "
          f"{args.repeats} steps in blocks of {args.block}; ratios: paired, other / fxad "
          "(> 1: fxad faster)")
    fxad.grad(lambda x: (x * x).sum(), torch.randn(3))  # one-off set-up cost
    rows = []
    for kind in [m.strip() for m in args.models.split(",") if m.strip()]:
        for layers in [int(v) for v in args.layers.split(",")]:
            for d in [v.strip() for v in args.directions.split(",")]:
                print(f"  running {kind} {layers} {d} ...", file=sys.stderr, flush=True)
                rows.append(bench(kind, layers, d == "bi", args))
    head = (f"{'model':<14}{'fxad ms':>9}{'fxad.comp':>10}{'autograd':>10}{'compile':>9}"
            f"{'ag/fxad':>9}{'comp/fxad':>10}{'ag/fx.comp':>11}{'comp/fx.comp':>13}"
            f"{'grad err':>10}{'build s':>9}{'lines':>7}")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['name']:<14}{_ms(r['t_fxad']):>9}{_ms(r['t_fxad.compile']):>10}"
              f"{_ms(r['t_autograd']):>10}{_ms(r['t_compile']):>9}{_x(r['ag/fxad']):>9}"
              f"{_x(r['comp/fxad']):>10}{_x(r['ag/fxad.compile']):>11}"
              f"{_x(r['comp/fxad.compile']):>13}{r['err']:>10.1e}{r['build_s']:>9.2f}"
              f"{r['lines']:>7}" + ("  (autograd fallback!)" if r["fallback"] else ""))
    for r in rows:
        if "compile_error" in r:
            print(f"  {r['name']}: torch.compile failed: {r['compile_error']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
