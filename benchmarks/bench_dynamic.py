"""Builds on symbolic sizes against builds on the example's sizes (fxad.symbolic).

Three measurements, each printed as a table with medians and ratios:

1. **Build time**, ``fxad.grad(gpt, idx, tgt, argnums=())`` static against
   ``dynamic=True``, for GPTs of 1, 2, 8 and 32 blocks (d=64, 4 heads, vocabulary 256):
   wall-clock medians, and the ratio of the process's CPU time too (steadier on a shared
   machine, where other jobs stretch the wall clock).
2. **Step time** of the generated code: the symbolic build's code (reads its sizes from the
   inputs) against the static build's code at the same size, interleaved rounds; and both
   against ``torch.autograd`` and ``torch.compile(dynamic=True)`` of the model's
   forward + backward.
3. **A training loop over 26 sequence lengths** (5..30) through ``fxad.compile``: how many
   builds, and the loop's time against a static build per length.

Usage::

    python benchmarks/bench_dynamic.py            # all, 1 thread
    python benchmarks/bench_dynamic.py --quick    # blocks 1, 2, 8; fewer rounds
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import fxad
from fxad.demo.models import TinyGPT


def GPT(blocks: int, d: int = 64) -> torch.nn.Module:
    """fxad's demo GPT (token and position embeddings, SDPA blocks, cross-entropy of
    ``(idx, targets)``), 4 heads, vocabulary 256, 128 positions."""
    return TinyGPT(256, block_size=128, n_layer=blocks, n_head=4, n_embd=d)


def _ids(B: int, T: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (B, T), generator=g), torch.randint(0, 256, (B, T), generator=g)


def build_times(blocks: list[int], repeats: int) -> None:
    print("1. build time: fxad.grad(gpt, idx, tgt, argnums=()), B=4, T=32 (median of "
          f"{repeats}; s)")
    print(f"{'blocks':>6} {'static':>8} {'dynamic':>8} {'ratio':>6} {'cpu ratio':>10}")
    idx, tgt = _ids(4, 32)
    # warm-up: first-use costs of torch and fxad
    fxad.grad(GPT(1), idx, tgt, argnums=())
    fxad.grad(GPT(1), idx, tgt, argnums=(), dynamic=True)
    for n in blocks:
        torch.manual_seed(0)
        m = GPT(n)
        times: dict[bool, list[float]] = {False: [], True: []}
        cpu: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(repeats):  # interleaved
            for dynamic in (False, True):
                t0, c0 = time.perf_counter(), time.process_time()
                fxad.grad(m, idx, tgt, argnums=(), dynamic=dynamic)
                times[dynamic].append(time.perf_counter() - t0)
                cpu[dynamic].append(time.process_time() - c0)
        s, d = statistics.median(times[False]), statistics.median(times[True])
        c = statistics.median(cpu[True]) / statistics.median(cpu[False])
        print(f"{n:>6} {s:8.2f} {d:8.2f} {d / s:6.2f} {c:10.2f}")


def _median_ms(fn, rounds: int) -> float:
    ts = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(ts)


def step_times(rounds: int) -> None:
    torch.manual_seed(0)
    m = GPT(2, d=128)
    idx, tgt = _ids(4, 64)
    g_static = fxad.grad(m, idx, tgt, argnums=())
    g_dynamic = fxad.grad(m, idx, tgt, argnums=(), dynamic=True)

    def autograd() -> None:
        m.zero_grad(set_to_none=True)
        m(idx, tgt).backward()

    compiled = torch.compile(m, dynamic=True)

    def compiled_step() -> None:
        m.zero_grad(set_to_none=True)
        compiled(idx, tgt).backward()

    for fn in (lambda: g_static(idx, tgt), lambda: g_dynamic(idx, tgt), autograd,
               compiled_step):
        for _ in range(3):
            fn()
    rows = {"static code": [], "symbolic code": [], "torch.autograd": [],
            "torch.compile(dynamic=True)": []}
    fns = dict(zip(rows, (lambda: g_static(idx, tgt), lambda: g_dynamic(idx, tgt), autograd,
                          compiled_step)))
    for _ in range(rounds):  # interleaved rounds of 5 calls each
        for k, fn in fns.items():
            rows[k].append(_median_ms(fn, 5))
    base = statistics.median(rows["static code"])
    print(f"\n2. step time (value and gradients), GPT 2 blocks d=128, B=4, T=64 "
          f"(median of {rounds} rounds; ms, ratio to the static code; paired: the median of "
          f"each round's own ratio, steadier on a shared machine)")
    for k, v in rows.items():
        med = statistics.median(v)
        paired = statistics.median(a / b for a, b in zip(v, rows["static code"]))
        print(f"   {k:28s} {med:8.2f}  {med / base:5.3f}  paired {paired:5.3f}")


def length_loop() -> None:
    torch.manual_seed(0)
    m = GPT(2)
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    cm = fxad.compile(m)
    t0 = time.perf_counter()
    for T in range(5, 31):
        idx, tgt = _ids(4, T, seed=T)
        opt.zero_grad(set_to_none=True)
        cm(idx, tgt).backward()
        opt.step()
    auto = time.perf_counter() - t0
    t0 = time.perf_counter()
    for T in range(5, 31):  # what a build per length costs
        idx, tgt = _ids(4, T, seed=T)
        fxad.grad(m, idx, tgt, argnums=())
    static = time.perf_counter() - t0
    print(f"\n3. fxad.compile over 26 lengths (T = 5..30), GPT 2 blocks d=64, B=4: "
          f"{len(cm.builds)} builds, {auto:.1f} s for the loop; a static build per length "
          f"alone: {static:.1f} s")
    for b in cm.builds:
        print(f"   build {b.number}: {b.reason}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s)")
    build_times([1, 2, 8] if args.quick else [1, 2, 8, 32], 3 if args.quick else 5)
    step_times(5 if args.quick else 30)
    length_loop()


if __name__ == "__main__":
    main()
