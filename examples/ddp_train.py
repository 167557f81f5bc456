"""Multi-process training with fxad on the CPU: DDP or FSDP2 around fxad's generated code.

Run with torchrun (2 processes, gloo backend, loopback only)::

    torchrun --nproc_per_node 2 examples/ddp_train.py                 # DDP(fxad.compile(model))
    torchrun --nproc_per_node 2 examples/ddp_train.py --fsdp          # fully_shard, then fxad.compile
    torchrun --nproc_per_node 2 examples/ddp_train.py --compare       # + eager autograd, same wrapper

Each rank trains a small GPT (``fxad.demo.models.TinyGPT``) on its own random batches;
the wrapper averages the gradients over the ranks.  With ``--compare`` an identical copy of
the model is trained by eager autograd under the same wrapper, and every step prints, per
rank, the largest difference of the gradients and of the parameters after the optimizer
step, and the median step times; the DDP run also reports how many gradient buckets DDP
launched before fxad's backward finished computing (the all-reduce overlapping the
backward).  ``--float64`` compares in double precision.
"""
from __future__ import annotations

import argparse
import copy
import gc
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import fxad
from fxad.demo.models import TinyGPT


def logged_allreduce(log: list):
    """DDP's default all-reduce hook (divide by the world size, then sum), recording when
    each bucket is launched."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    def hook(state, bucket):
        log.append((bucket.index(), time.perf_counter()))
        return allreduce_hook(state, bucket)
    return hook


def wrap(model: torch.nn.Module, fsdp: bool, bucket_mb: float, compiled: bool,
         grad_release) -> tuple[torch.nn.Module, object]:
    """``DDP(fxad.compile(model))``, or ``fully_shard`` of the blocks and the model then
    ``fxad.compile``; the eager model under the same wrapper when not ``compiled``."""
    fm = None
    if fsdp:
        from torch.distributed.fsdp import fully_shard
        for b in model.blocks:
            fully_shard(b)
        fully_shard(model)
        if compiled:
            fm = fxad.compile(model, grad_release=grad_release)
            return fm, fm
        return model, None
    if compiled:
        fm = fxad.compile(model, grad_release=grad_release)
        model = fm
    return DDP(model, bucket_cap_mb=bucket_mb), fm


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fsdp", action="store_true", help="FSDP2 (fully_shard) instead of DDP")
    ap.add_argument("--compare", action="store_true", help="also train eager autograd")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--bucket-mb", type=float, default=0.25, help="DDP bucket_cap_mb")
    ap.add_argument("--grad-release", default="auto",
                    help="fxad.compile grad_release: auto, end, or bytes per stage")
    ap.add_argument("--float64", action="store_true")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    release = {"auto": None, "end": "end"}.get(args.grad_release)
    if release is None and args.grad_release not in ("auto",):
        release = int(args.grad_release)
    if release is None and not args.fsdp:  # small model: stages of 1/4 bucket
        release = int(args.bucket_mb * 2**20 / 4)

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    train(args, release)
    # Everything that holds the process group (DDP reducers, comm-hook futures, FSDP states)
    # is gone once train() returns; destroying the group while they were alive let gloo's
    # worker threads outlive the interpreter now and then (an abort at exit).  On an error
    # torchrun stops the other ranks, so there is no barrier to hang on.
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def train(args: argparse.Namespace, release) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = torch.float64 if args.float64 else torch.float32
    torch.manual_seed(0)  # the same initial model on every rank
    V = 96
    base = TinyGPT(V, block_size=args.seq, n_layer=args.layers, n_head=4,
                   n_embd=args.width).to(dtype)
    runs = {"fxad": wrap(copy.deepcopy(base), args.fsdp, args.bucket_mb, True, release)}
    if args.compare:
        runs["eager"] = wrap(copy.deepcopy(base), args.fsdp, args.bucket_mb, False, None)
    logs: dict[str, list] = {k: [] for k in runs}
    if not args.fsdp:
        for k, (m, _) in runs.items():
            m.register_comm_hook(None, logged_allreduce(logs[k]))
    opts = {k: torch.optim.AdamW(m.parameters(), lr=3e-3) for k, (m, _) in runs.items()}
    g = torch.Generator().manual_seed(1000 + rank)  # each rank its own data
    times: dict[str, list[float]] = {k: [] for k in runs}
    overlap: list[tuple[int, int]] = []
    first: dict[str, list[float]] = {k: [] for k in runs}
    max_gd = max_pd = 0.0
    for step in range(args.steps):
        x = torch.randint(0, V, (args.batch, args.seq), generator=g)
        y = torch.randint(0, V, (args.batch, args.seq), generator=g)
        losses = {}
        for k, (m, fm) in runs.items():
            opts[k].zero_grad(set_to_none=True)
            logs[k].clear()
            if fm is not None:
                fm.stage_log = []
            t0 = time.perf_counter()
            loss = m(x, y)
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            times[k].append(t2 - t0)
            losses[k] = float(loss.detach())
            if logs[k]:  # when the first bucket left, as a fraction of the backward's time
                first[k].append((min(t for _, t in logs[k]) - t1) / (t2 - t1))
            if k == "fxad" and not args.fsdp and fm.stage_log:
                last_stage_start = fm.stage_log[-1][1]
                overlap.append((sum(1 for _, t in logs[k] if t < last_stage_start),
                                len(logs[k])))
        line = f"rank {rank} step {step:3d} loss {losses['fxad']:.6f}"
        if args.compare:
            pf = list(runs["fxad"][0].parameters())
            pe = list(runs["eager"][0].parameters())
            gd = max(float((local(a.grad) - local(b.grad)).abs().max())
                     for a, b in zip(pf, pe) if b.grad is not None)
            for o in opts.values():
                o.step()
            pd = max(float((local(a) - local(b)).detach().abs().max()) for a, b in zip(pf, pe))
            max_gd, max_pd = max(max_gd, gd), max(max_pd, pd)
            line += (f" (eager {losses['eager']:.6f}) max|grad diff| {gd:.1e} "
                     f"max|param diff| {pd:.1e}")
        else:
            for o in opts.values():
                o.step()
        print(line, flush=True)
    # the ranks' parameters must agree (DDP: replicated; FSDP: the shards concatenated)
    fm_params = list(runs["fxad"][0].parameters())
    s = torch.stack([local(p).detach().double().sum() for p in fm_params]).sum().reshape(1)
    sums = [torch.zeros(1, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(sums, s)
    summary = f"rank {rank} done: {args.steps} steps, " + ", ".join(
        f"{k} {statistics.median(v[1:] or v) * 1e3:.1f} ms/step" for k, v in times.items())
    if args.compare:
        summary += f"; over all steps max|grad diff| {max_gd:.1e}, max|param diff| {max_pd:.1e}"
    if overlap:
        early = sum(a for a, _ in overlap[1:] or overlap)
        total = sum(b for _, b in overlap[1:] or overlap)
        summary += (f"; DDP buckets launched before fxad's last backward stage: {early} of "
                    f"{total}")
    if any(first.values()):
        summary += "; first all-reduce launched at " + ", ".join(
            f"{k} {100 * statistics.median(v[1:] or v):.0f}%" for k, v in first.items() if v) \
            + " of loss.backward()'s time"
    if not args.fsdp:
        summary += f"; parameter checksums per rank: {[round(float(t), 10) for t in sums]}"
    print(summary, flush=True)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
