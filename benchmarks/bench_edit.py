"""The hand edit of docs/editing.md, measured: a GELU MLP's training step (``mse_loss`` of
``fc2(gelu(fc1(x)))``) with autograd, with ``fxad.compile`` (fxad's generated split, policy
``"save"``) and with the edited split (``fxad.compile(model, x, y, vjp=FILE)``), whose
forward saves the pre-activation and the loss residual ``fc2(...) - y`` and whose backward
recomputes the GELU: three saved tensors instead of five.

Reports, per method: the median step time (forward + backward, interleaved in blocks:
:func:`bench_fxad.time_interleaved`), the peak tensor bytes of one step (CPU: the profiler's
allocation events, :func:`bench_fxad.peak_bytes`) and, for the two fxad splits, the bytes
saved for the backward.  The gradients of the three are compared first.

Usage::

    python benchmarks/bench_edit.py [--batch 512] [--d 256] [--hidden 1024] [--repeats 40]
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import tempfile

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_fxad import autograd_step, peak_bytes, time_interleaved  # noqa: E402

import fxad  # noqa: E402

EDITED = '''
def forward(model, x, y):
    linear = torch.nn.functional.linear(x, model.fc1.weight, model.fc1.bias)
    gelu = torch.nn.functional.gelu(linear)
    linear_1 = torch.nn.functional.linear(gelu, model.fc2.weight, model.fc2.bias);  gelu = None
    sub = linear_1 - y;  linear_1 = None
    mse_loss = sub.square().mean()
    return (mse_loss, x, linear, sub)


def backward(model, args):
    x, linear, sub, d_mse_loss = args; args.clear()
    # backward of: mse_loss
    d_linear_1 = sub * (d_mse_loss * (2 / sub.numel()));  sub = None
    # backward of: linear_1
    gelu = torch.nn.functional.gelu(linear)
    d_fc2_weight = d_linear_1.t() @ gelu;  gelu = None
    d_fc2_bias = d_linear_1.sum(0)
    d_gelu = d_linear_1 @ model.fc2.weight;  d_linear_1 = None
    # backward of: gelu
    d_linear = torch.ops.aten.gelu_backward(d_gelu, linear);  d_gelu = linear = None
    # backward of: linear
    d_fc1_weight = d_linear.t() @ x;  x = None
    d_fc1_bias = d_linear.sum(0);  d_linear = None
    return (None, None, d_fc1_weight, d_fc1_bias, d_fc2_weight, d_fc2_bias)
'''


class MLP(torch.nn.Module):
    def __init__(self, d: int, h: int) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(d, h)
        self.fc2 = torch.nn.Linear(h, d)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.fc2(F.gelu(self.fc1(x))), y)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    x, y = torch.randn(a.batch, a.d), torch.randn(a.batch, a.d)
    models = {k: MLP(a.d, a.hidden) for k in ("autograd", "fxad", "edited")}
    for m in models.values():
        m.load_state_dict(models["autograd"].state_dict())
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "mlp_train_edited.py")
        text = fxad.eject(models["edited"], x, y, kind="training")
        with open(path, "w") as fh:
            fh.write(text[:text.index("def forward")] + EDITED.lstrip())
        wrapped = {"autograd": models["autograd"],
                   "fxad": fxad.compile(models["fxad"], x, y),
                   "edited": fxad.compile(models["edited"], x, y, vjp=path)}
        steps = {k: autograd_step(w, (x, y)) for k, w in wrapped.items()}
        grads = {}
        for k, s in steps.items():
            s()
            grads[k] = [p.grad.clone() for p in models[k].parameters()]
        err = max(float((g - r).abs().max() / r.abs().max().clamp(min=1e-30))
                  for k in ("fxad", "edited") for g, r in zip(grads[k], grads["autograd"]))
        med = time_interleaved(steps, torch.device("cpu"), a.repeats, a.warmup, block=10)
        peaks = {k: peak_bytes(s, torch.device("cpu"), getattr(s, "setup", None))
                 for k, s in steps.items()}
        saved_fxad = wrapped["fxad"].partition(x, y).saved_bytes
        saved_edit = sum(b for _, b in wrapped["edited"].last_saved)
        report = wrapped["edited"].report()
    print(f"# {datetime.date.today()}, {platform.machine()} {os.cpu_count()}-core CPU, "
          f"torch {torch.__version__}, {a.threads} thread(s); MLP {a.d}-{a.hidden}-{a.d}, "
          f"batch {a.batch}, float32; max rel. gradient difference to autograd {err:.2g}")
    print(f"{'method':10s} {'step ms':>9s} {'peak MiB':>9s} {'saved MiB':>10s}")
    for k in steps:
        saved = {"fxad": saved_fxad, "edited": saved_edit}.get(k)
        pk = peaks[k]
        print(f"{k:10s} {med[k] * 1e3:9.2f} {'-' if pk is None else f'{pk / 2**20:.2f}':>9s} "
              f"{'-' if saved is None else f'{saved / 2**20:.2f}':>10s}")
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
