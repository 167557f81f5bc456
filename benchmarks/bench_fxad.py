"""Forward+backward benchmark: fxad's generated code vs ``torch.autograd`` vs ``torch.compile``.

For each demo model (TinyGPT, SmallCNN, MLP) one training step's gradient computation is
timed three ways, in the same process, on identical copies of the model:

* ``fxad``: ``g = fxad.grad(model, *inputs, argnums=())`` (parameter gradients, no input
  gradients) built once; a step is ``g(*inputs)``.
* ``autograd``: ``model(*inputs).backward()`` (``.grad`` reset to ``None`` first).
* ``compile``: the same autograd step on ``torch.compile(model)`` (AOTAutograd compiles the
  forward and the backward); skipped with ``--no-compile``, 'n/a' if compilation fails.

Timings are medians over ``--repeats`` steps after ``--warmup`` steps, the three methods
interleaved round-robin.  "ratio" columns are ``other_time / fxad_time`` (> 1: fxad faster).

Peak memory is the peak of the bytes *allocated by torch tensors* during one step above the
level at its start (inputs and parameters are not counted; gradients are): on CUDA
``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``, on CPU the running
sum of the allocation/free events recorded by ``torch.profiler(profile_memory=True)``.
It is not the process RSS (allocator caching and fragmentation are not included).  The
previous step's gradients are released *before* the measured step (``setup``): on the CPU the
profiler cannot size the free of a block allocated before it started, so freeing them inside
the measured step would count the new gradients but not the release of the old ones (that
inflated autograd's and torch.compile's CPU peaks by up to the parameters' size, depending on
which blocks the profiler had seen before).

Also printed: the time ``fxad.grad`` takes to build the gradient code of a 12-block TinyGPT.

Usage::

    python benchmarks/bench_fxad.py [--device cpu|cuda] [--repeats 20] [--no-compile] [--large]
"""
from __future__ import annotations

import argparse
import copy
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

import fxad
from fxad.demo.models import MLP, SmallCNN, TinyGPT

Step = Callable[[], Any]


@dataclass
class Case:
    """A model and its inputs; ``model(*inputs)`` is a scalar loss."""

    name: str
    model: torch.nn.Module
    inputs: tuple[torch.Tensor, ...]
    desc: str


def make_cases(device: torch.device, large: bool) -> list[Case]:
    """The benchmark models at the demo's sizes (or larger ones with ``large``)."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    V = 96
    if large:
        gpt_kw, (B, T) = dict(block_size=128, n_layer=4, n_head=8, n_embd=256), (32, 128)
        cnn_kw, (Bc, S) = dict(width=32), (128, 32)
        mlp_kw, Bm = dict(d_in=512, hidden=2048, d_out=10), 512
    else:
        gpt_kw, (B, T) = dict(block_size=64, n_layer=2, n_head=4, n_embd=64), (16, 64)
        cnn_kw, (Bc, S) = dict(width=8), (32, 16)
        mlp_kw, Bm = dict(d_in=64, hidden=256, d_out=10), 128
    idx = torch.randint(0, V, (B, T), generator=gen)
    tgt = torch.randint(0, V, (B, T), generator=gen)
    x = torch.randn(Bc, 3, S, S, generator=gen)
    y = torch.randint(0, 10, (Bc,), generator=gen)
    xm = torch.randn(Bm, mlp_kw["d_in"], generator=gen)
    ym = torch.randn(Bm, mlp_kw["d_out"], generator=gen)
    cases = [
        Case("TinyGPT", TinyGPT(V, **gpt_kw), (idx, tgt),
             f"{gpt_kw['n_layer']} layers, C={gpt_kw['n_embd']}, B={B}, T={T}"),
        Case("SmallCNN (train)", SmallCNN(**cnn_kw).train(), (x, y),
             f"width {cnn_kw['width']}, B={Bc}, {S}x{S}"),
        Case("MLP (mse)", MLP(**mlp_kw), (xm, ym),
             f"{mlp_kw['d_in']}-{mlp_kw['hidden']}-{mlp_kw['d_out']}, B={Bm}"),
    ]
    for c in cases:
        c.model.to(device)
        c.inputs = tuple(t.to(device) for t in c.inputs)
    return cases


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def autograd_step(model: torch.nn.Module, inputs: tuple) -> Step:
    def step() -> Any:
        model.zero_grad(set_to_none=True)
        loss = model(*inputs)
        loss.backward()
        return loss
    step.setup = lambda: model.zero_grad(set_to_none=True)  # type: ignore[attr-defined]
    return step


def time_interleaved(steps: dict[str, Step], device: torch.device, repeats: int,
                     warmup: int, block: int = 1,
                     rounds: dict[str, list[float]] | None = None) -> dict[str, float]:
    """Median seconds per call of each step, the steps run round-robin in blocks of
    ``block`` consecutive calls (``repeats`` counted calls each).  With ``block > 1`` the
    first call of each block is run but not counted: it pays for the other methods having
    just reshaped the allocator's free lists and the caches, which a training loop running
    one method does not see.  ``rounds``, if given, receives per step the median of each
    round's block (the rounds run every step once, back to back, so that two steps' block
    medians of the same round form a pair: :func:`paired_ratio`)."""
    for _ in range(warmup):
        for s in steps.values():
            s()
    sync(device)
    times: dict[str, list[float]] = {k: [] for k in steps}
    while any(len(v) < repeats for v in times.values()):
        for k, s in steps.items():
            if block > 1:
                s()
            this: list[float] = []
            for _ in range(min(block, repeats - len(times[k]))):
                sync(device)
                t0 = time.perf_counter()
                s()
                sync(device)
                this.append(time.perf_counter() - t0)
            times[k].extend(this)
            if rounds is not None and this:
                rounds.setdefault(k, []).append(statistics.median(this))
    return {k: statistics.median(v) for k, v in times.items()}


def paired_ratio(rounds: dict[str, list[float]], num: str, den: str) -> float | None:
    """Median over the rounds of ``num``'s block median / ``den``'s block median (from
    :func:`time_interleaved`): a slow drift of the machine's speed cancels within each pair,
    where a ratio of the two overall medians keeps it.  ``None`` if a step is missing."""
    if num not in rounds or den not in rounds:
        return None
    return statistics.median(a / b for a, b in zip(rounds[num], rounds[den]))


def peak_bytes(step: Step, device: torch.device,
               setup: Callable[[], Any] | None = None) -> float | None:
    """Peak tensor bytes allocated during one call of ``step`` above the starting level
    (see the module docstring), after ``setup()`` (run outside the measurement: release the
    previous step's gradients there); ``None`` if it cannot be measured."""
    if setup is not None:
        setup()
    if device.type == "cuda":
        sync(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        out = step()
        sync(device)
        peak = torch.cuda.max_memory_allocated(device) - base
        del out
        return float(peak)
    try:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            out = step()
            del out
        events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"
                  and e.device_type() == torch.autograd.DeviceType.CPU]
    except Exception:  # private profiler API changed: say so rather than guess
        return None
    cur = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        cur += e.nbytes()
        peak = max(peak, cur)
    return float(peak)


def grad_rel_err(case: Case, g: Any) -> float:
    """Sanity check of fxad's gradients: ``max_p max|g_fxad - g_autograd|`` divided by
    ``max_p max|g_autograd|`` (one scale for all parameters: a per-parameter ratio is
    meaningless for a parameter whose true gradient is 0, such as a conv bias before
    batch norm)."""
    ref = copy.deepcopy(case.model)
    ref.zero_grad(set_to_none=True)
    ref(*case.inputs).backward()
    _, _, grads = g(*case.inputs)
    diff = max(float((grads[n] - p.grad).abs().max()) for n, p in ref.named_parameters())
    scale = max(float(p.grad.abs().max()) for p in ref.parameters())
    return diff / (scale or 1.0)


def bench_case(case: Case, device: torch.device, repeats: int, warmup: int,
               use_compile: bool) -> dict[str, Any]:
    """Time and measure one case; returns a row of the result table."""
    row: dict[str, Any] = {"model": case.name, "desc": case.desc}
    m_fx = case.model
    m_ag = copy.deepcopy(case.model)
    t0 = time.perf_counter()
    # parameter gradients only: the autograd step (loss.backward() with inputs that do not
    # require grad) computes no input gradients either
    g = fxad.grad(m_fx, *case.inputs, argnums=())
    row["build_s"] = time.perf_counter() - t0
    row["grad_err"] = grad_rel_err(case, g)
    steps: dict[str, Step] = {"fxad": lambda: g(*case.inputs),
                              "autograd": autograd_step(m_ag, case.inputs)}
    row["compile_s"] = None
    if use_compile:
        m_c = copy.deepcopy(case.model)
        try:
            compiled = torch.compile(m_c)
            step_c = autograd_step(compiled, case.inputs)
            t0 = time.perf_counter()
            step_c()  # compiles forward and backward
            step_c()
            sync(device)
            row["compile_s"] = time.perf_counter() - t0
            steps["compile"] = step_c
        except Exception as e:  # no C++ compiler, unsupported op, ...
            row["compile_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
    times = time_interleaved(steps, device, repeats, warmup)
    for k in ("fxad", "autograd", "compile"):
        row[f"t_{k}"] = times.get(k)
        row[f"mem_{k}"] = peak_bytes(steps[k], device, getattr(steps[k], "setup", None)) \
            if k in steps else None
    return row


def transform_time(n_layer: int, device: torch.device, reps: int = 3) -> dict[str, float]:
    """Seconds to build ``fxad.grad`` for an ``n_layer``-block TinyGPT (median of ``reps``),
    the capture alone, and the generated code's line count."""
    torch.manual_seed(0)
    model = TinyGPT(96, block_size=64, n_layer=n_layer, n_head=4, n_embd=64).to(device)
    idx = torch.randint(0, 96, (8, 64), device=device)
    builds, traces, lines = [], [], 0
    for _ in range(reps):
        t0 = time.perf_counter()
        fxad.trace(model, idx, idx)
        traces.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        g = fxad.grad(model, idx, idx)
        builds.append(time.perf_counter() - t0)
        lines = len(g.code.splitlines())
    return {"grad_s": statistics.median(builds), "trace_s": statistics.median(traces),
            "lines": lines, "n_nodes": len(g.graph.nodes)}


def _ms(t: float | None) -> str:
    return "n/a" if t is None else f"{t * 1e3:.2f}"


def _mb(b: float | None) -> str:
    return "n/a" if b is None else f"{b / 2**20:.1f}"


def _ratio(a: float | None, b: float | None) -> str:
    return "n/a" if a is None or b is None else f"{a / b:.2f}x"


def print_table(rows: list[dict[str, Any]]) -> None:
    head = (f"{'model':<18}{'fxad ms':>9}{'autograd':>10}{'compile':>9}{'ag/fxad':>9}"
            f"{'comp/fxad':>10}{'peak MB fxad':>13}{'autograd':>9}{'compile':>9}"
            f"{'grad rel err':>13}")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['model']:<18}{_ms(r['t_fxad']):>9}{_ms(r['t_autograd']):>10}"
              f"{_ms(r['t_compile']):>9}{_ratio(r['t_autograd'], r['t_fxad']):>9}"
              f"{_ratio(r['t_compile'], r['t_fxad']):>10}{_mb(r['mem_fxad']):>13}"
              f"{_mb(r['mem_autograd']):>9}{_mb(r['mem_compile']):>9}"
              f"{r['grad_err']:>13.1e}")
    print()
    for r in rows:
        extra = f"; torch.compile warm-up {r['compile_s']:.1f} s" if r["compile_s"] else ""
        if "compile_error" in r:
            extra = f"; torch.compile failed: {r['compile_error']}"
        print(f"  {r['model']}: {r['desc']}; fxad.grad build {r['build_s']:.2f} s{extra}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--repeats", type=int, default=20, help="timed steps per method")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per method")
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    p.add_argument("--large", action="store_true", help="larger models (for GPUs)")
    p.add_argument("--transform-layers", type=int, default=12,
                   help="blocks of the GPT whose transform time is measured (0: skip)")
    p.add_argument("--models", default="gpt,cnn,mlp",
                   help="comma-separated subset of gpt,cnn,mlp (default: all)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    args = p.parse_args(argv)

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"torch {torch.__version__}: CUDA is not available; skipping the "
              f"--device {args.device} benchmark")
        return 0
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else \
        (platform.processor() or platform.machine())
    print(f"fxad {fxad.__version__} | torch {torch.__version__} | Python "
          f"{platform.python_version()} | device {device} ({dev_name}) | "
          f"{torch.get_num_threads()} CPU thread(s)")
    print(f"forward+backward of one step, median of {args.repeats} (after {args.warmup} "
          "warm-up); ratios = other time / fxad time (> 1: fxad faster)")
    print("peak MB: peak torch tensor bytes allocated during one step above the starting "
          "level" + (" (torch.cuda.max_memory_allocated)" if device.type == "cuda"
                     else " (torch.profiler allocation events; not RSS)"))
    t0 = time.perf_counter()  # the first transform in a process pays one-off set-up costs
    fxad.grad(lambda x: (x * x).sum(), torch.randn(3, device=device))
    print(f"first fxad transform in this process (one-off set-up): "
          f"{time.perf_counter() - t0:.2f} s; build times below exclude it")
    print()
    rows = []
    wanted = {m.strip().lower() for m in args.models.split(",") if m.strip()}
    keys = {"TinyGPT": "gpt", "SmallCNN (train)": "cnn", "MLP (mse)": "mlp"}
    for case in make_cases(device, args.large):
        if keys[case.name] not in wanted:
            continue
        print(f"  running {case.name} ...", file=sys.stderr, flush=True)
        rows.append(bench_case(case, device, args.repeats, args.warmup,
                               use_compile=not args.no_compile))
    print_table(rows)
    if args.transform_layers:
        tt = transform_time(args.transform_layers, device)
        print(f"\ntransform time, TinyGPT with {args.transform_layers} blocks (C=64): "
              f"fxad.grad {tt['grad_s']:.2f} s (capture alone {tt['trace_s']:.2f} s; "
              f"{tt['n_nodes']} graph nodes, {tt['lines']} lines of code)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
