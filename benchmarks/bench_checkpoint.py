"""Activation checkpointing benchmark: peak memory and step time, eager vs fxad, with the
same blocks checkpointed.

A GPT (``fxad.demo.models.TinyGPT``), one training step (forward + backward to the
parameter gradients; the gradients are released before each step), for each choice of
checkpointed blocks (``--every``: none, every 2nd block, every block):

* ``eager``: eager autograd, the chosen blocks called through
  ``torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)``;
* ``fxad``: ``fxad.compile(model, checkpoint=Checkpoint(modules=Block, every=k))``
  (policy ``"save"``, the bridge's default: outside the checkpointed blocks it saves what
  autograd saves);
* ``fxad (user regions)``: ``fxad.compile`` of the eager checkpointed model itself: its
  ``torch.utils.checkpoint`` calls are honoured when the capture records them
  (``node.meta['fxad_checkpoint']``); the row says how many regions were captured;
* ``joint``: ``fxad.joint_step(model, checkpoint=...)`` (policy ``"min_memory"``), run
  uncompiled unless ``--compile`` (then through ``torch.compile``).

Then ``fxad.compile(model, checkpoint=Checkpoint(modules=Block, budget=...))`` with a budget
half-way between the simulated peaks of checkpointing none and all blocks: the blocks it
chose, and its measured peak.

Peak: tensor bytes allocated during one step above the level at its start (CPU: the torch
profiler's allocation events; CUDA: ``max_memory_allocated``), as in ``bench_training.py``;
"sim" is :func:`fxad.memory.simulate` of the joint graph (the tensors the step allocates:
not the parameters or inputs), "saved" the partition's saved bytes.  Times: medians over
``--repeats`` steps, the methods interleaved in blocks of 5.

Usage::

    python benchmarks/bench_checkpoint.py [--device cpu|cuda] [--size small|full]
        [--every none,2,1] [--repeats 20] [--threads 1] [--compile] [--bf16]
"""
from __future__ import annotations

import argparse
import copy
import os
import platform
import sys
from typing import Any, Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_fxad import peak_bytes, sync, time_interleaved  # noqa: E402

import fxad  # noqa: E402
from fxad.demo.models import Block, TinyGPT  # noqa: E402
from fxad.memory import simulate  # noqa: E402
from fxad.residuals import Checkpoint, joint_graph, partition  # noqa: E402
from fxad.training import _vjp_graph  # noqa: E402


def checkpoint_blocks(model: TinyGPT, every: int | None) -> TinyGPT:
    """Call every ``every``-th block (the 1st, the (1+every)-th, ...) of ``model`` through
    ``torch.utils.checkpoint`` (non-reentrant), in place."""
    if every:
        for i, b in enumerate(model.blocks):
            if i % every == 0:
                b.forward = (lambda h, _f=b.forward:  # type: ignore[method-assign]
                             torch.utils.checkpoint.checkpoint(_f, h, use_reentrant=False))
    return model


def ck(every: int | None) -> Checkpoint | bool:
    return Checkpoint(modules=Block, every=every) if every else False


def loop_step(model: Any, inputs: tuple, ctx: Callable) -> Callable:
    def release() -> None:
        for p in model.parameters():
            p.grad = None

    def step() -> Any:
        release()
        with ctx():
            loss = model(*inputs)
        loss.backward()
        return loss
    step.setup = release  # type: ignore[attr-defined]
    return step


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--size", choices=["small", "full"], default=None)
    ap.add_argument("--every", default="none,2,1")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--compile", action="store_true", help="joint step through torch.compile")
    ap.add_argument("--bf16", action="store_true", help="under torch.autocast(bfloat16)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("CUDA is not available on this machine: skipping (use --device cpu)")
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    size = args.size or ("full" if device.type == "cuda" else "small")
    V, L, C, H, T, B = (50257, 12, 768, 12, 1024, 8) if size == "full" else \
        (512, 4, 128, 4, 128, 4)
    torch.manual_seed(0)
    base = TinyGPT(V, block_size=T, n_layer=L, n_head=H, n_embd=C).to(device)
    g = torch.Generator().manual_seed(0)
    inputs = tuple(torch.randint(0, V, (B, T), generator=g).to(device) for _ in range(2))

    def ctx() -> Any:
        return torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16)
    print(f"torch {torch.__version__}, python {platform.python_version()}, device {device}"
          + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else
             f" ({platform.processor() or platform.machine()}, {torch.get_num_threads()} "
             "threads)")
          + f"; GPT L={L} d={C} h={H} T={T} B={B} V={V}, {'bf16' if args.bf16 else 'fp32'}, "
          f"repeats {args.repeats}")
    with ctx():  # the VJP graph as fxad.compile builds it (autocast's casts explicit)
        v = _vjp_graph(base, inputs, (), ())
    rows = []
    for e in args.every.split(","):
        every = None if e == "none" else int(e)
        steps: dict[str, Callable] = {}
        info: dict[str, str] = {}
        steps["eager"] = loop_step(checkpoint_blocks(copy.deepcopy(base), every), inputs, ctx)
        fm = fxad.compile(copy.deepcopy(base), checkpoint=ck(every))
        with ctx():
            part = fm.partition(*inputs)
        steps["fxad"] = loop_step(fm, inputs, ctx)
        info["fxad"] = f"saved {part.saved_bytes / 2**20:.2f} MiB"
        if every:
            fu = fxad.compile(checkpoint_blocks(copy.deepcopy(base), every))
            with ctx():
                pu = fu.partition(*inputs)
            steps["fxad (user regions)"] = loop_step(fu, inputs, ctx)
            info["fxad (user regions)"] = (f"{len(pu.checkpointed)} region(s) captured, saved "
                                           f"{pu.saved_bytes / 2**20:.2f} MiB")
        m_j = copy.deepcopy(base)
        with ctx():
            js = fxad.joint_step(m_j, *inputs, compile=args.compile, checkpoint=ck(every))
        steps["joint"] = lambda js=js: js(*inputs)
        sim = simulate(joint_graph(partition(v, "min_memory", checkpoint=ck(every))).graph)
        info["joint"] = (f"saved {js.partition.saved_bytes / 2**20:.2f} MiB, simulated peak "
                         f"{sim.peak_bytes / 2**20:.2f} MiB")
        for s in steps.values():  # capture, compile, warm up
            s()
            s()
        sync(device)
        times = time_interleaved(steps, device, args.repeats, 1, block=5)
        for k, s in steps.items():
            peak = peak_bytes(s, device, getattr(s, "setup", None))
            rows.append((e, k, times[k], peak, info.get(k, "")))
            print(f"checkpointed blocks: {e:>4}  {k:<20} {times[k] * 1e3:9.2f} ms  peak "
                  f"{(peak or 0) / 2**20:8.2f} MiB  {info.get(k, '')}", flush=True)
    # a memory budget
    sims = [simulate(joint_graph(partition(v, "save", checkpoint=c)).graph).peak_bytes
            for c in (False, Checkpoint(modules=Block))]
    budget = (sims[0] + sims[1]) // 2
    fb = fxad.compile(copy.deepcopy(base), checkpoint=Checkpoint(modules=Block, budget=budget))
    with ctx():
        pb = fb.partition(*inputs)
    sb = loop_step(fb, inputs, ctx)
    sb()
    peak = peak_bytes(sb, device, sb.setup)  # type: ignore[attr-defined]
    print(f"budget {budget / 2**20:.2f} MiB (half-way between the simulated peaks with no "
          f"block and every block checkpointed, {sims[0] / 2**20:.2f} / {sims[1] / 2**20:.2f} "
          f"MiB): checkpointed {[c[0] for c in pb.checkpointed]}; {pb.checkpoint_note}; "
          f"measured peak {(peak or 0) / 2**20:.2f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
