"""Training steps of transformers' GPT-2 on a CUDA GPU: eager autograd, ``fxad.compile``,
``fxad.joint_step`` (inductor) and ``torch.compile``, in one process.

The model is ``GPT2LMHeadModel`` built from a configuration (random weights, nothing
downloaded; dropout 0 so that the four methods compute the same step; SDPA attention, no KV
cache), by default GPT-2 small: 12 layers, d=768, 12 heads, vocabulary 50257, 1024
positions; batch 8 x 1024 tokens, its own causal-LM loss, the forward under
``torch.autocast("cuda", bfloat16)`` (``--dtype fp32``: no autocast).  One step =
``zero_grad`` / forward / backward / ``SGD.step`` on the model's float32 parameters (for
``joint``: the gradients ``joint_step`` returns are handed to the optimizer).

Reported per method: the set-up seconds (wrapping or compiling the model plus the first
step, which captures or compiles it; ``joint`` and ``compile`` compile cold: inductor's
in-memory caches cleared and a new cache directory for each; inductor's once-per-process
start-up is paid before any set-up is timed and printed on its own line), the median step
time in ms over interleaved rounds (each round runs every method for ``--block`` timed
steps after one untimed step; CUDA events around the block), the ratio to eager and to
``torch.compile`` (``t_other / t``: above 1 is faster), the peak GPU memory of a step as if
the model were alone on the GPU (its parameters plus the most
``torch.cuda.max_memory_allocated`` rose
above the level at the step's start, the previous gradients released first), and the
largest difference of one step's gradients from eager's, every method starting that step
from eager's weights (relative to the largest gradient; bfloat16 autocast rounds
differently in each method).  ``--profile`` adds each method's ATen op counts that differ
from eager's and its most expensive GPU kernels; ``--cpu`` runs the script itself on the
CPU at tiny sizes (a check of the script, without memory figures).

Usage::

    python benchmarks/bench_gpu.py [--layers 12] [--d 768] [--heads 12] [--vocab 50257]
        [--batch 8] [--seq 1024] [--dtype bf16|fp32] [--methods eager,fxad,joint,compile]
        [--rounds 5] [--block 5] [--setup-budget 360] [--no-cudnn-sdp] [--profile]

A method ``joint:POLICY`` (``joint:save``) runs ``joint_step`` with that residual policy
(``joint``: its default, ``"min_memory"``).

``--setup-budget`` (seconds): a method whose set-up would start after this much time spent
on set-ups is left out (reported as such), so that a run fits a time limit.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from typing import Any, Callable

import torch
import torch.nn as nn

from fxad.tools.torchvision_import import prepare_torchvision
from bench_real_models import (_cold, _release, grad_err, make_step,  # (this folder)
                               start_inductor)

METHODS = ("eager", "fxad", "joint", "compile")
# size flag: (GPT-2 small on the GPU, the --cpu dry run's tiny model)
SIZES = {"layers": (12, 2), "d": (768, 64), "heads": (12, 2), "vocab": (50257, 1001),
         "batch": (8, 2), "seq": (1024, 32)}
GiB = 1024 ** 3


def build_gpt2(args: argparse.Namespace) -> tuple[nn.Module, tuple]:
    prepare_torchvision()  # transformers imports torchvision wherever it is installed
    import transformers
    cfg = transformers.GPT2Config(
        n_layer=args.layers, n_embd=args.d, n_head=args.heads, vocab_size=args.vocab,
        n_positions=args.seq, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        use_cache=False, bos_token_id=0, eos_token_id=0, attn_implementation="sdpa")

    class LM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = transformers.GPT2LMHeadModel(cfg)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.model(input_ids=ids, labels=ids).loss

    torch.manual_seed(0)
    model = LM().to(DEVICE).train()
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), device=DEVICE)
    return model, (ids,)


DEVICE = "cuda"


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def peak_gib(step: Callable[[], Any], model: nn.Module) -> float:
    """The model's parameters plus the peak allocation of one step above its start level."""
    _release(model)
    if DEVICE != "cuda":
        return float("nan")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return (params + torch.cuda.max_memory_allocated() - start) / GiB


def time_rounds(steps: dict[str, Callable[[], Any]], rounds: int,
                block: int) -> dict[str, list[float]]:
    """Per-step milliseconds of each round's block, by CUDA events, methods interleaved."""
    out: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(rounds):
        for k, s in steps.items():
            s()
            if DEVICE != "cuda":  # a dry run of this script on the CPU: wall clock
                t0 = time.perf_counter()
                for _ in range(block):
                    s()
                out[k].append((time.perf_counter() - t0) * 1e3 / block)
                continue
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            begin.record()
            for _ in range(block):
                s()
            end.record()
            torch.cuda.synchronize()
            out[k].append(begin.elapsed_time(end) / block)
    return out


def profile(step: Callable[[], Any], top: int = 15) -> tuple[dict[str, int], list[tuple]]:
    """ATen op counts of one step and its ``top`` most expensive GPU kernels (name, calls,
    total µs), from the profiler."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as run_profile
    with run_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        _sync()
    ops: dict[str, int] = {}
    kernels: dict[str, list[float]] = {}
    for e in prof.events():
        if e.name.startswith("aten::"):
            ops[e.name[6:]] = ops.get(e.name[6:], 0) + 1
        elif e.device_type == torch.autograd.DeviceType.CUDA:
            k = kernels.setdefault(e.name[:90], [0, 0.0])
            k[0] += 1
            k[1] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
    worst = sorted(((n, c, t) for n, (c, t) in kernels.items()), key=lambda r: -r[2])[:top]
    return ops, worst


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for flag in SIZES:
        ap.add_argument(f"--{flag}", type=int, default=None,
                        help=f"default {SIZES[flag][0]} (--cpu: {SIZES[flag][1]})")
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--block", type=int, default=5)
    ap.add_argument("--setup-budget", type=float, default=360.0)
    ap.add_argument("--no-cudnn-sdp", action="store_true", help="switch PyTorch's cuDNN "
                    "attention off for every method (torch.backends.cuda.enable_cudnn_sdp)")
    ap.add_argument("--profile", action="store_true", help="per method: the ATen ops whose "
                    "counts differ from eager's and the most expensive GPU kernels of a step")
    ap.add_argument("--cpu", action="store_true", help="a dry run of this script on the CPU "
                    "(tiny sizes; no memory figures)")
    args = ap.parse_args(argv)
    for flag, (full, tiny) in SIZES.items():
        if getattr(args, flag) is None:
            setattr(args, flag, tiny if args.cpu else full)
    global DEVICE
    DEVICE = "cpu" if args.cpu else "cuda"
    if not args.cpu and not torch.cuda.is_available():
        print("bench_gpu: no CUDA GPU here (--cpu: a dry run on the CPU)", file=sys.stderr)
        return 2
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bf16 = args.dtype == "bf16"
    if args.no_cudnn_sdp:
        torch.backends.cuda.enable_cudnn_sdp(False)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU"
    print(f"# {name} | torch {torch.__version__} | "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", flush=True)
    print(f"# GPT-2 L{args.layers} d{args.d} h{args.heads} V{args.vocab} "
          f"B{args.batch} T{args.seq} {args.dtype}", flush=True)
    base, inputs = build_gpt2(args)
    steps: dict[str, Callable[[], Any]] = {}
    models: dict[str, nn.Module] = {}
    setup: dict[str, float] = {}
    spent = 0.0
    start_inductor(methods, DEVICE)
    for m in methods:
        if spent > args.setup_budget:
            print(f"{m}: left out (set-ups took {spent:.0f} s)", flush=True)
            continue
        model = copy.deepcopy(base)
        t0 = time.perf_counter()
        try:
            with _cold(m):
                s = make_step(m, model, inputs, bf16, device=DEVICE, lr=1e-4)
                _release(model)
                s()
            _sync()
        except Exception as e:  # noqa: BLE001 - a method that fails is reported, not fatal
            print(f"{m}: FAILED {type(e).__name__}: {str(e)[:2000]}", flush=True)
            spent += time.perf_counter() - t0
            continue
        setup[m] = time.perf_counter() - t0
        spent += setup[m]
        steps[m], models[m] = s, model
        print(f"{m}: set-up {setup[m]:.1f} s", flush=True)
    # gradients of one step from the same weights (eager's, now), against eager's
    errs: dict[str, float] = {}
    if "eager" in steps:
        with torch.no_grad():
            for k in steps:
                for p, q in zip(models["eager"].parameters(), models[k].parameters()):
                    if q is not p:
                        q.copy_(p)
        for k in steps:
            _release(models[k])
            steps[k]()
        for k in steps:
            if k != "eager":
                errs[k] = grad_err(models["eager"], models[k])
    peaks = {k: peak_gib(s, models[k]) for k, s in steps.items()}
    ms = time_rounds(steps, args.rounds, args.block)
    med = {k: statistics.median(v) for k, v in ms.items()}
    print(f"\n{'method':8} {'set-up s':>9} {'ms/step':>8} {'vs eager':>9} {'vs compile':>10} "
          f"{'paired':>18} {'peak GiB':>9} {'grad err':>9}")
    for k in steps:
        pair = ""
        if "eager" in ms:
            r = [e / t for e, t in zip(ms["eager"], ms[k])]
            pair = f"{statistics.median(r):.3f} [{min(r):.2f}-{max(r):.2f}]"
        ve = f"{med['eager'] / med[k]:.3f}" if "eager" in med else "-"
        vc = f"{med['compile'] / med[k]:.3f}" if "compile" in med else "-"
        err = f"{errs[k]:.1e}" if k in errs else "-"
        print(f"{k:8} {setup[k]:9.1f} {med[k]:8.2f} {ve:>9} {vc:>10} {pair:>18} "
              f"{peaks[k]:9.2f} {err:>9}", flush=True)
    print("rounds (ms/step):", {k: [round(x, 2) for x in v] for k, v in ms.items()})
    if args.profile:
        prof = {k: profile(s) for k, s in steps.items()}
        base_ops = prof.get("eager", ({}, []))[0]
        for k, (ops, worst) in prof.items():
            print(f"\n## {k}: {sum(ops.values())} ATen ops, "
                  f"{sum(t for _, _, t in worst) / 1e3:.2f} ms in its {len(worst)} top kernels")
            if k != "eager":
                diff = sorted(((n, c, base_ops.get(n, 0)) for n, c in ops.items()
                               if c != base_ops.get(n, 0)), key=lambda r: -(r[1] - r[2]))
                print("   op counts (this / eager):",
                      ", ".join(f"{n} {c}/{e}" for n, c, e in diff[:25]))
            for n, c, t in worst:
                print(f"   {t / 1e3:8.3f} ms {c:5d}x  {n}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
