"""An LSTM layer two ways through fxad, forward+backward: ``nn.LSTM`` (differentiated by the
hand-written rule of :mod:`fxad.rules.nn.recurrent`, whose generated code is the unrolled
time loop) against the same cell written as the body of ``torch._higher_order_ops.scan``
(differentiated by fxad's generic scan machinery, :mod:`fxad.ad.control_flow`), with
``torch.autograd`` on ``nn.LSTM`` as the reference.

Both fxad forms compute the same function with the same weights (checked: gradients within
1e-5 of autograd's in float32).  A step is ``g(x)`` of ``g = fxad.grad(loss, x, ...)`` built
once; ``autograd`` is ``loss(x).backward()``.  Times are medians over ``--repeats`` steps
after ``--warmup``, interleaved in blocks of ``--block`` as the other benchmarks do; ratios are
paired (:func:`bench_fxad.paired_ratio`, > 1: the second form is slower).

Usage::

    python benchmarks/bench_rnn_scan.py --threads 1 [--seq 32] [--batch 16] [--input 64]
        [--hidden 128] [--repeats 30] [--block 5]
"""
from __future__ import annotations

import argparse
import os
import platform
import sys

import torch
import torch.nn as nn
from torch._higher_order_ops.scan import scan

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_fxad import paired_ratio, time_interleaved  # noqa: E402

import fxad  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--input", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--block", type=int, default=5)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    lstm = nn.LSTM(a.input, a.hidden)
    w_ih, w_hh = lstm.weight_ih_l0.detach(), lstm.weight_hh_l0.detach()
    b = (lstm.bias_ih_l0 + lstm.bias_hh_l0).detach()
    x = torch.randn(a.seq, a.batch, a.input)
    h0 = torch.zeros(a.batch, a.hidden)

    def by_module(x: torch.Tensor) -> torch.Tensor:
        out, _ = lstm(x)
        return (out * out).mean()

    def by_scan(x: torch.Tensor, w_ih: torch.Tensor, w_hh: torch.Tensor,
                b: torch.Tensor) -> torch.Tensor:
        def cell(carry, x_t):
            h, c = carry
            gates = x_t @ w_ih.t() + h @ w_hh.t() + b
            i, f, g, o = gates.chunk(4, 1)
            c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
            h = torch.sigmoid(o) * torch.tanh(c)
            return (h, c), h.clone()
        _, out = scan(cell, (h0, h0), x)
        return (out * out).mean()

    g_mod = fxad.grad(by_module, x)
    g_scan = fxad.grad(by_scan, x, w_ih, w_hh, b)
    ref = x.clone().requires_grad_()
    by_module(ref).backward()
    err = (g_mod(x)[1][0] - ref.grad).abs().max().item()
    err_scan = (g_scan(x, w_ih, w_hh, b)[1][0] - ref.grad).abs().max().item()

    def autograd_step() -> None:
        xr = x.clone().requires_grad_()
        by_module(xr).backward()

    runs = {"autograd (nn.LSTM)": autograd_step,
            "fxad, hand-written rule": lambda: g_mod(x),
            "fxad, scan body": lambda: g_scan(x, w_ih, w_hh, b)}
    rounds: dict[str, list[float]] = {}
    medians = time_interleaved(runs, torch.device("cpu"), a.repeats, a.warmup, a.block, rounds)
    print(f"torch {torch.__version__}, {platform.machine()}, {a.threads} thread(s); "
          f"seq {a.seq}, batch {a.batch}, {a.input}->{a.hidden}, float32")
    print(f"max |d_x - autograd|: hand-written {err:.1e}, scan {err_scan:.1e}")
    base = "fxad, hand-written rule"
    for name in runs:
        med = medians[name] * 1e3
        ratio = paired_ratio(rounds, name, base)
        print(f"{name:26s} {med:8.2f} ms   / hand-written {ratio:5.2f}x")


if __name__ == "__main__":
    main()
