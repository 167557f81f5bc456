"""fxad under torch.distributed: DDP(fxad.compile(model)), FSDP2 (fully_shard, then
fxad.compile), joint_step + all_reduce_grads, the errors for what does not compose, and
the torchrun example.

Each group of checks runs once in 2 processes (``torch.multiprocessing`` spawn, gloo on
127.0.0.1), which write their results to JSON; the tests read them.  Every rank trains the
model with fxad and an identical copy with eager autograd under the same wrapper, in
float64, and compares the gradients and the parameters after each optimizer step.
"""
from __future__ import annotations

import copy
import datetime
import json
import os
import re
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="torch.distributed with the gloo backend is not available")

ROOT = Path(__file__).resolve().parents[1]
WORLD = 2
STEPS = 3


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------- workers

def _gpt():
    from fxad.demo.models import TinyGPT
    torch.manual_seed(0)
    return TinyGPT(40, block_size=16, n_layer=2, n_head=2, n_embd=32).double()


def _batches(rank: int, n: int = STEPS):
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randint(0, 40, (2, 16), generator=g), torch.randint(0, 40, (2, 16), generator=g))
            for _ in range(n)]


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _train_pair(ref, mine, batches, *, after_backward=None):
    """Train ``ref`` (eager) and ``mine`` (fxad) side by side with AdamW; per step the max
    |grad diff| and, after the optimizer step, the max |param diff|."""
    o_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    o_mine = torch.optim.AdamW(mine.parameters(), lr=1e-2)
    out = {"grad": [], "param": [], "loss": []}
    for x, y in batches:
        o_ref.zero_grad(set_to_none=True)
        o_mine.zero_grad(set_to_none=True)
        l_ref = ref(x, y)
        l_ref.backward()
        l_mine = mine(x, y)
        l_mine.backward()
        if after_backward is not None:
            after_backward()
        pr, pm = list(ref.parameters()), list(mine.parameters())
        assert len(pr) == len(pm)
        gd = 0.0
        for a, b in zip(pr, pm):
            assert (a.grad is None) == (b.grad is None)
            if a.grad is not None:
                assert type(a.grad) is type(b.grad)
                gd = max(gd, float((_local(a.grad) - _local(b.grad)).abs().max()))
        o_ref.step()
        o_mine.step()
        with torch.no_grad():
            pd = max(float((_local(a) - _local(b)).abs().max()) for a, b in zip(pr, pm))
        out["grad"].append(gd)
        out["param"].append(pd)
        out["loss"].append(abs(float(l_ref.detach()) - float(l_mine.detach())))
    return out


def _logged_hook(log):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    def hook(state, bucket):
        log.append(time.perf_counter())
        return allreduce_hook(state, bucket)
    return hook


class _WithUnused(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 4)
        self.unused = torch.nn.Linear(3, 3)

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.b(torch.tanh(self.a(x))), y)


def _ddp_worker(rank: int, world: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    import fxad
    from fxad.distributed import all_reduce_grads

    res: dict = {}
    batches = _batches(rank)
    base = _gpt()
    # staged backward (a stage per gradient), small buckets: several all-reduces per step
    for release in (0, "end"):
        ref = DDP(copy.deepcopy(base), bucket_cap_mb=0.02)
        fm = fxad.compile(copy.deepcopy(base), grad_release=release)
        mine = DDP(fm, bucket_cap_mb=0.02)
        logs = {"ref": [], "mine": []}
        ref.register_comm_hook(None, _logged_hook(logs["ref"]))
        mine.register_comm_hook(None, _logged_hook(logs["mine"]))
        fm.stage_log = []
        early = []

        def after():
            # buckets launched before fxad's last backward stage began
            last = fm.stage_log[-1][1]
            early.append((sum(t < last for t in logs["mine"]), len(logs["mine"]),
                          len({s for s, _ in fm.stage_log})))
            logs["mine"].clear()
            logs["ref"].clear()
            fm.stage_log.clear()
        r = _train_pair(ref, mine, batches, after_backward=after)
        r["early"] = early
        res[f"gpt_{release}"] = r
    # an unused parameter, find_unused_parameters=True
    for release in (0, "end"):
        m0 = _WithUnused().double()
        g = torch.Generator().manual_seed(rank)
        data = [(torch.randn(4, 8, generator=g, dtype=torch.float64),
                 torch.randn(4, 4, generator=g, dtype=torch.float64)) for _ in range(STEPS)]
        ref = DDP(copy.deepcopy(m0), find_unused_parameters=True)
        mine = DDP(fxad.compile(copy.deepcopy(m0), grad_release=release),
                   find_unused_parameters=True)
        res[f"unused_{release}"] = _train_pair(ref, mine, data)
    # joint_step on the plain model + all_reduce_grads == DDP's averaged gradients
    ref = DDP(copy.deepcopy(base))
    plain = copy.deepcopy(base)
    step = fxad.joint_step(plain, *batches[0], compile=False)
    jd = []
    o_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    o_pl = torch.optim.SGD(plain.parameters(), lr=0.1)
    for x, y in batches:
        o_ref.zero_grad()
        ref(x, y).backward()
        _, _, grads = step(x, y)
        all_reduce_grads(grads)
        for name, p in plain.named_parameters():
            p.grad = grads[name]
        jd.append(max(float((a.grad - b.grad).abs().max())
                      for a, b in zip(ref.parameters(), plain.parameters())))
        o_ref.step()
        o_pl.step()
    res["joint_all_reduce"] = jd
    # what does not compose: clear errors
    errs = {}
    for name, fn in {
        "compile_of_ddp": lambda: fxad.compile(DDP(copy.deepcopy(base))),
        "joint_step_of_ddp": lambda: fxad.joint_step(DDP(copy.deepcopy(base)), *batches[0]),
    }.items():
        try:
            fn()
            errs[name] = None
        except fxad.InputError as e:
            errs[name] = str(e)
    res["errors"] = errs
    return res


def _shard(model):
    from torch.distributed.fsdp import fully_shard
    for b in model.blocks:
        fully_shard(b)
    fully_shard(model)
    return model


def _fsdp_worker(rank: int, world: int) -> dict:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    import fxad

    res: dict = {}
    batches = _batches(rank)
    base = _gpt()
    for release in (None, "end"):
        ref = _shard(copy.deepcopy(base))
        mine_model = _shard(copy.deepcopy(base))
        fm = fxad.compile(mine_model, grad_release=release)
        # inspecting the split before training: captured unsharded, left sharded
        report = fm.partition(*batches[0]).report()
        assert "saved for backward" in report
        assert all(isinstance(p, DTensor) for p in mine_model.parameters())
        seen: dict = {"sharded_after_forward": [], "stages": [], "unsharded_at_stage": []}
        orig_forward = fm.forward

        def forward(*a, _f=orig_forward):
            out = _f(*a)
            # after the forward the blocks are resharded (DTensor parameters again)
            seen["sharded_after_forward"].append(
                all(isinstance(p, DTensor) for b in mine_model.blocks for p in b.parameters()))
            return out
        fm.forward = forward
        r = _train_pair(ref, fm, batches)
        plan = fm._last()
        drv = fm._fsdp
        r["n_stages"] = 1 if plan.staged is None else len(plan.staged.stages)
        r["grads_are_dtensors"] = all(isinstance(p.grad, DTensor) for p in fm.parameters())
        r["sharded_after_forward"] = seen["sharded_after_forward"]
        # one more step recording, per stage, how many units were unsharded when it began
        counts = []
        inner = plan.before_stage

        def before(s, _inner=inner):
            _inner(s)
            counts.append(sum(g.is_unsharded for g in drv.groups()))
        plan.before_stage = before
        fm(*batches[0]).backward()
        plan.before_stage = inner
        r["unsharded_per_stage"] = counts
        r["n_groups"] = len(drv.groups())
        res[f"gpt_{release}"] = r
    errs = {}

    def blocks_only():
        m = copy.deepcopy(base)
        for b in m.blocks:
            fully_shard(b)
        fxad.compile(m)(*batches[0])

    def shard_the_fxad_module():
        fm = fxad.compile(copy.deepcopy(base))
        fully_shard(fm)
        fm(*batches[0])

    for name, fn in {
        "blocks_only": blocks_only,
        "fully_shard_of_compile": shard_the_fxad_module,
        "joint_step_of_fsdp": lambda: fxad.joint_step(_shard(copy.deepcopy(base)), *batches[0]),
    }.items():
        try:
            fn()
            errs[name] = None
        except fxad.InputError as e:
            errs[name] = str(e)
    res["errors"] = errs
    return res


WORKERS = {"ddp": _ddp_worker, "fsdp": _fsdp_worker}


def _entry(rank: int, name: str, out_dir: str, port: int, world: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=90))
    try:
        try:
            res = WORKERS[name](rank, world)
        except Exception:
            res = {"exception": traceback.format_exc()}
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(res, f)
    finally:
        dist.destroy_process_group()


def _spawn(name: str, out_dir: Path, timeout: float = 150.0) -> list[dict]:
    import torch.multiprocessing as mp

    ctx = mp.start_processes(_entry, args=(name, str(out_dir), _free_port(), WORLD),
                             nprocs=WORLD, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            pytest.fail(f"the {name} workers did not finish within {timeout:.0f} s")
    out = []
    for r in range(WORLD):
        res = json.loads((out_dir / f"rank{r}.json").read_text())
        assert "exception" not in res, f"rank {r}:\n{res.get('exception')}"
        out.append(res)
    return out


@pytest.fixture(scope="module")
def ddp_results(tmp_path_factory):
    return _spawn("ddp", tmp_path_factory.mktemp("ddp"))


@pytest.fixture(scope="module")
def fsdp_results(tmp_path_factory):
    return _spawn("fsdp", tmp_path_factory.mktemp("fsdp"))


TOL = 1e-12  # float64


# --------------------------------------------------------------------------- DDP

@pytest.mark.parametrize("release", ["0", "end"])
def test_ddp_of_fxad_matches_eager_ddp_on_every_rank(ddp_results, release):
    for rank, res in enumerate(ddp_results):
        r = res[f"gpt_{release}"]
        assert len(r["grad"]) == STEPS
        assert max(r["grad"]) <= TOL, (rank, r["grad"])
        assert max(r["param"]) <= TOL, (rank, r["param"])
        assert max(r["loss"]) <= TOL, (rank, r["loss"])


def test_ddp_all_reduce_overlaps_the_staged_backward(ddp_results):
    """grad_release=0: a backward stage per gradient, so DDP launches buckets while fxad's
    backward still computes; grad_release='end': every bucket after the last stage."""
    for res in ddp_results:
        staged, end = res["gpt_0"]["early"], res["gpt_end"]["early"]
        for early, total, n_stages in staged[1:]:  # after DDP's bucket rebuild (step 0)
            assert n_stages > 5 and total >= 3
            assert early >= total - 2, (early, total)  # all but the first stage's buckets
        for early, total, n_stages in end:
            assert n_stages == 1 and early == 0


@pytest.mark.parametrize("release", ["0", "end"])
def test_ddp_find_unused_parameters(ddp_results, release):
    for res in ddp_results:
        r = res[f"unused_{release}"]
        assert max(r["grad"]) <= TOL and max(r["param"]) <= TOL


def test_joint_step_with_all_reduce_grads_equals_ddp(ddp_results):
    for res in ddp_results:
        assert max(res["joint_all_reduce"]) <= TOL


def test_ddp_compositions_that_do_not_work_raise(ddp_results):
    errs = ddp_results[0]["errors"]
    assert errs["compile_of_ddp"] and "DDP(fxad.compile(model))" in errs["compile_of_ddp"]
    assert errs["joint_step_of_ddp"] and "all_reduce_grads" in errs["joint_step_of_ddp"]


# --------------------------------------------------------------------------- FSDP2

@pytest.mark.parametrize("release", ["None", "end"])
def test_fsdp2_matches_eager_fsdp2_on_every_rank(fsdp_results, release):
    for rank, res in enumerate(fsdp_results):
        r = res[f"gpt_{release}"]
        assert max(r["grad"]) <= TOL, (rank, r["grad"])
        assert max(r["param"]) <= TOL, (rank, r["param"])
        assert max(r["loss"]) <= TOL, (rank, r["loss"])
        assert r["grads_are_dtensors"]
        assert all(r["sharded_after_forward"])


def test_fsdp2_backward_is_staged_per_unit(fsdp_results):
    """Default: a backward stage per FSDP unit (2 blocks + the root); each stage begins with
    the units it needs unsharded and the finished blocks resharded (reduce-scattered)."""
    for res in fsdp_results:
        r = res["gpt_None"]
        assert r["n_groups"] == 3 and r["n_stages"] == 3
        # stage 0 (last block): root + block 1; stage 1: root + block 0 (block 1 resharded)
        assert r["unsharded_per_stage"][:2] == [2, 2], r["unsharded_per_stage"]
        e = res["gpt_end"]
        assert e["n_stages"] == 1 and e["unsharded_per_stage"] == [3]


def test_fsdp2_compositions_that_do_not_work_raise(fsdp_results):
    errs = fsdp_results[0]["errors"]
    assert errs["blocks_only"] and "fully_shard(model)" in errs["blocks_only"]
    assert errs["fully_shard_of_compile"] and "fully_shard(fxad.compile(model))" in \
        errs["fully_shard_of_compile"]
    assert errs["joint_step_of_fsdp"] and "fully_shard" in errs["joint_step_of_fsdp"]


# --------------------------------------------------------------------------- torchrun

@pytest.mark.parametrize("mode", [[], ["--fsdp"]], ids=["ddp", "fsdp"])
def test_torchrun_example_runs(mode, tmp_path):
    """The README's example: torchrun, 2 processes, fxad and eager side by side (each
    rank's output in its own file: the two ranks' lines interleave on a shared stdout)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(__import__("fxad").__file__).resolve().parents[1])]
        + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_addr", "127.0.0.1", "--master_port", str(_free_port()),
           "--log-dir", str(tmp_path), "--redirects", "3",
           str(ROOT / "examples" / "ddp_train.py"), "--compare", "--float64", "--steps", "3",
           "--layers", "2", "--width", "32", "--seq", "16", "--batch", "2", *mode]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env, cwd=ROOT)
    logs = sorted(tmp_path.rglob("stdout.log"))
    out = "".join(f.read_text() for f in logs)
    err = "".join(f.read_text() for f in tmp_path.rglob("stderr.log"))
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:] + out[-2000:] + err[-3000:]
    done = [ln for ln in out.splitlines() if " done: " in ln]
    assert len(logs) == 2 and len(done) == 2, out
    for ln in done:
        m = re.search(r"max\|grad diff\| ([0-9.e+-]+), max\|param diff\| ([0-9.e+-]+)", ln)
        assert m and float(m.group(1)) <= TOL and float(m.group(2)) <= TOL, ln


# --------------------------------------------------------------------------- staged backward, one process

def test_staged_backward_in_one_process_matches_autograd():
    """grad_release=0 (a backward stage per completed gradient) gives autograd's gradients,
    input gradients included, and refuses a second backward like the one-stage bridge."""
    import fxad
    from fxad.residuals import split_backward

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    x = torch.randn(5, 6, requires_grad=True)
    ref = copy.deepcopy(model)
    fm = fxad.compile(copy.deepcopy(model), grad_release=0)
    fm.stage_log = []
    out, out_ref = fm(x).square().sum(), ref(x).square().sum()
    (gx,) = torch.autograd.grad(out, x, retain_graph=True)
    (gx_ref,) = torch.autograd.grad(out_ref, x, retain_graph=True)
    torch.testing.assert_close(gx, gx_ref)
    fm2 = fxad.compile(copy.deepcopy(model), grad_release=0)
    fm2(x).square().sum().backward()
    ref(x).square().sum().backward()
    for a, b in zip(ref.parameters(), fm2.parameters()):
        torch.testing.assert_close(b.grad, a.grad)
    plan = fm2._last()
    assert plan.staged is not None and len(plan.staged.stages) == 4  # one per parameter
    assert [s for s, _ in fm.stage_log] == [0, 1, 2, 3]
    assert "backward stage 1 of 4" in plan.staged.stages[0].code
    with pytest.raises(RuntimeError, match="a second time"):
        out.backward()
    assert split_backward(plan.part, units=[list(range(4))]) is None  # one unit: one stage
    with pytest.raises(fxad.InputError, match="grad_release"):
        fxad.compile(model, grad_release="early")
