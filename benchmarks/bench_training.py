"""Training-step benchmark: autograd vs fxad's generated code, eager and under torch.compile.

Models: a deep MLP, a ResNet-18-style CNN and a GPT-2-small-style model (``TinyGPT`` with
12 layers, d=768, 12 heads, T=1024, batch 8 at full size; ``--size small``, the default on
CPU, shrinks every model).  Each in fp32 and under ``torch.autocast(bfloat16)``, four ways,
in the same process, on identical copies of the model:

* ``a`` eager autograd: ``model(*inputs).backward()``;
* ``b`` fxad eager: ``fxad.compile(model)`` (fxad's forward/backward graphs bridged through
  ``torch.autograd.Function``), ``m(*inputs).backward()``;
* ``c`` ``torch.compile(model)`` with autograd (AOTAutograd + inductor);
* ``d`` ``torch.compile`` of fxad's joint forward+backward graph (``fxad.joint_step``).

A step is forward + backward up to the parameter gradients (``.grad`` reset to ``None``
first for a-c; d returns them); the optimizer update is the same for all and is not timed.
Times are medians over ``--repeats`` steps after ``--warmup``, the methods interleaved in
blocks of ``--block`` consecutive steps (default 10; the first step of each block is not
counted), so that slow drifts of a shared machine hit all methods alike while each method
runs as in a training loop, without another method's allocations between its steps.
(``--block 1`` interleaves step by step; on the CPU that shifts the ratios by up to ~10%,
as each method then runs on heap free lists and caches shaped by the others.)
Ratios: ``t_a / t`` and ``t_c / t`` (> 1: faster than a / c) of the medians, and the
"paired" ratios: the median over the rounds of the same ratio of each round's block medians
(:func:`bench_fxad.paired_ratio`; a drift of the machine's speed between rounds cancels
within each pair).  Peak memory: as in
``bench_fxad.py`` (tensor bytes allocated during one step above the level at its start;
CUDA: ``max_memory_allocated``; CPU: the profiler's allocation events).

Usage::

    python benchmarks/bench_training.py [--device cpu|cuda] [--size small|full]
        [--models mlp,resnet,gpt] [--dtypes fp32,bf16] [--no-compile] [--repeats 30]
        [--block 10]
        [--policy min_memory|save]

``--policy`` applies one residual policy to b and d; by default each uses its API's own default
(``fxad.compile``: ``"save"``, autograd's saved set; ``fxad.joint_step``: ``"min_memory"``).

The GPU runs of docs/performance.md (GPT-2 small: 12 layers, d=768, batch 8, sequence 1024, bf16)::

    python benchmarks/bench_training.py --device cuda --size full --models gpt --dtypes bf16

Activation checkpointing (peak memory vs eager with the same blocks checkpointed):
``benchmarks/bench_checkpoint.py``.  Multi-process (DDP, FSDP2): ``examples/ddp_train.py``.
"""
from __future__ import annotations

import argparse
import copy
import os
import platform
import sys
import time
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_fxad import paired_ratio, peak_bytes, sync, time_interleaved  # noqa: E402

import fxad  # noqa: E402
from fxad.demo.models import TinyGPT  # noqa: E402


# --------------------------------------------------------------------------- models

class DeepMLP(nn.Module):
    """``depth`` x (Linear → ReLU), then a classifier and cross-entropy."""

    def __init__(self, d_in: int, width: int, depth: int, n_classes: int = 10) -> None:
        super().__init__()
        dims = [d_in] + [width] * depth
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims, dims[1:]))
        self.head = nn.Linear(width, n_classes)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for lin in self.layers:
            x = F.relu(lin(x))
        return F.cross_entropy(self.head(x), y)


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                      nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + (x if self.down is None else self.down(x)))


class ResNet18(nn.Module):
    """ResNet-18 layout (2-2-2-2 basic blocks) with base width ``w`` (64 in the original)."""

    def __init__(self, w: int = 64, n_classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, w, 3, 1, 1, bias=False), nn.BatchNorm2d(w),
                                  nn.ReLU())
        blocks, cin = [], w
        for i, cout in enumerate([w, 2 * w, 4 * w, 8 * w]):
            for j in range(2):
                blocks.append(BasicBlock(cin, cout, 2 if (j == 0 and i > 0) else 1))
                cin = cout
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(cin, n_classes)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.blocks(self.stem(x))
        h = torch.flatten(F.adaptive_avg_pool2d(h, 1), 1)
        return F.cross_entropy(self.fc(h), y)


def make_cases(size: str, device: torch.device, names: list[str]) -> list[tuple[str, nn.Module, tuple]]:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    full = size == "full"
    out = []
    if "mlp" in names:
        d, w, depth, B = (1024, 2048, 16, 256) if full else (256, 256, 8, 64)
        out.append((f"DeepMLP {depth}x{w} B={B}", DeepMLP(d, w, depth),
                    (torch.randn(B, d, generator=g), torch.randint(0, 10, (B,), generator=g))))
    if "resnet" in names:
        w, B, S = (64, 64, 32) if full else (16, 8, 32)
        out.append((f"ResNet18 w={w} B={B} {S}x{S}", ResNet18(w).train(),
                    (torch.randn(B, 3, S, S, generator=g), torch.randint(0, 10, (B,), generator=g))))
    if "gpt" in names:
        V, L, C, H, T, B = (50257, 12, 768, 12, 1024, 8) if full else (512, 2, 128, 4, 128, 4)
        out.append((f"GPT L={L} d={C} h={H} T={T} B={B}",
                    TinyGPT(V, block_size=T, n_layer=L, n_head=H, n_embd=C),
                    (torch.randint(0, V, (B, T), generator=g),
                     torch.randint(0, V, (B, T), generator=g))))
    return [(n, m.to(device), tuple(t.to(device) for t in x)) for n, m, x in out]


# --------------------------------------------------------------------------- steps

def _ctx(device: torch.device, bf16: bool) -> Any:
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)


def autograd_step(model: nn.Module, inputs: tuple, device: torch.device, bf16: bool) -> Callable:
    def release_grads() -> None:
        for p in model.parameters():
            p.grad = None

    def step() -> Any:
        release_grads()
        with _ctx(device, bf16):
            loss = model(*inputs)
        loss.backward()
        return loss
    step.setup = release_grads  # type: ignore[attr-defined]  # before a peak measurement
    return step


def _policy(policy: str | None) -> dict[str, Any]:
    """``policy=`` keyword for fxad's APIs: none (the API's default) when ``policy`` is None."""
    return {} if policy is None else {"policy": policy}


def joint(model: nn.Module, inputs: tuple, device: torch.device, bf16: bool,
          compile: bool, policy: str | None = None) -> Callable:
    with _ctx(device, bf16):
        s = fxad.joint_step(model, *inputs, compile=compile, **_policy(policy))
    return lambda: s(*inputs)


def grad_err(ref: nn.Module, other: nn.Module) -> float:
    diff = max(float((p.grad.float() - q.grad.float()).abs().max())
               for p, q in zip(ref.parameters(), other.parameters()) if p.grad is not None)
    scale = max(float(p.grad.abs().max()) for p in ref.parameters() if p.grad is not None)
    return diff / (scale or 1.0)


def bench(name: str, model: nn.Module, inputs: tuple, device: torch.device, bf16: bool,
          args: argparse.Namespace) -> dict[str, Any]:
    row: dict[str, Any] = {"model": name, "prec": "bf16" if bf16 else "fp32", "notes": []}
    steps: dict[str, Callable] = {}
    state = copy.deepcopy(model.state_dict())
    m_a = copy.deepcopy(model)
    steps["a"] = autograd_step(m_a, inputs, device, bf16)
    m_b = copy.deepcopy(model)
    t0 = time.perf_counter()
    fm = fxad.compile(m_b, **_policy(args.policy))
    with _ctx(device, bf16):
        part = fm.partition(*inputs)
    row["build_b"] = time.perf_counter() - t0
    row["saved"] = part.saved_bytes
    steps["b"] = autograd_step(fm, inputs, device, bf16)
    # gradient check of b against a (same start state: batch-norm statistics move)
    steps["a"]()
    steps["b"]()
    row["err_b"] = grad_err(m_a, m_b)
    m_a.load_state_dict(state)
    m_b.load_state_dict(state)
    if not args.no_compile:
        try:
            m_c = copy.deepcopy(model)
            steps["c"] = autograd_step(torch.compile(m_c), inputs, device, bf16)
            t0 = time.perf_counter()
            steps["c"]()
            steps["c"]()
            sync(device)
            row["build_c"] = time.perf_counter() - t0
        except Exception as e:  # no C++ compiler, unsupported op ...
            steps.pop("c", None)
            row["notes"].append(f"c failed: {type(e).__name__}: {str(e).splitlines()[0][:100]}")
        try:
            m_d = copy.deepcopy(model)
            t0 = time.perf_counter()
            steps["d"] = joint(m_d, inputs, device, bf16, compile=True, policy=args.policy)
            steps["d"]()
            steps["d"]()
            sync(device)
            row["build_d"] = time.perf_counter() - t0
        except Exception as e:
            steps.pop("d", None)
            row["notes"].append(f"d failed: {type(e).__name__}: {str(e).splitlines()[0][:100]}")
    rounds: dict[str, list[float]] = {}
    times = time_interleaved(steps, device, args.repeats, args.warmup, block=args.block,
                             rounds=rounds)
    for k in "abcd":
        row[f"t_{k}"] = times.get(k)
        row[f"pa_{k}"] = paired_ratio(rounds, "a", k)
        row[f"pc_{k}"] = paired_ratio(rounds, "c", k)
        row[f"mem_{k}"] = peak_bytes(steps[k], device, getattr(steps[k], "setup", None)) \
            if k in steps else None
    return row


def _ms(t: float | None) -> str:
    return "n/a" if t is None else f"{t * 1e3:9.2f}"


def _ratio(num: float | None, den: float | None) -> str:
    return "n/a" if num is None or den is None else f"{num / den:5.2f}x"


def _mb(b: float | None) -> str:
    return "n/a" if b is None else f"{b / 2**20:8.2f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--size", choices=["small", "full"], default=None)
    ap.add_argument("--models", default="mlp,resnet,gpt")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--block", type=int, default=10)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--policy", default=None, help="residual policy for b and d "
                    "(default: each API's own, b 'save', d 'min_memory')")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("CUDA is not available on this machine: skipping (use --device cpu)")
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    size = args.size or ("full" if device.type == "cuda" else "small")
    print(f"torch {torch.__version__}, python {platform.python_version()}, device {device}"
          + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else
             f" ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)")
          + f", size {size}, policy {args.policy or 'b save, d min_memory'}, "
          f"repeats {args.repeats}, block {args.block}")
    print("a = eager autograd, b = fxad eager (autograd.Function bridge), "
          "c = torch.compile(model)+autograd, d = torch.compile(fxad joint graph)")
    rows = []
    for name, model, inputs in make_cases(size, device, args.models.split(",")):
        for prec in args.dtypes.split(","):
            row = bench(name, model, inputs, device, prec == "bf16", args)
            rows.append(row)
            print(f"\n{row['model']} [{row['prec']}]  fxad saved {row['saved'] / 2**20:.1f} MiB, "
                  f"grad err b vs a {row['err_b']:.1e}")
            print(f"  {'':2} {'median ms':>9} {'vs a':>7} {'vs c':>7} {'paired a':>8} "
                  f"{'paired c':>8} {'peak MiB':>8}")
            for k in "abcd":
                print(f"  {k:2} {_ms(row[f't_{k}'])} {_ratio(row['t_a'], row[f't_{k}']):>7} "
                      f"{_ratio(row.get('t_c'), row[f't_{k}']):>7} "
                      f"{_ratio(row[f'pa_{k}'], 1.0):>8} {_ratio(row[f'pc_{k}'], 1.0):>8} "
                      f"{_mb(row[f'mem_{k}'])}")
            for note in row["notes"]:
                print("  note:", note)
            sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
