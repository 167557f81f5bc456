"""The real-model benchmark script (``benchmarks/bench_real_models.py``) runs and reports what
its docstring says: a smoke run on the smallest model, and the summary's arithmetic."""
from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location(
        "bench_real_models", ROOT / "benchmarks" / "bench_real_models.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_real_models"] = mod
    sys.path.insert(0, str(ROOT / "benchmarks"))  # it imports its neighbour bench_fxad
    try:
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
        sys.modules.pop("bench_real_models", None)


def test_summary_geomeans_and_set_up_against_torch_compile(bench, capsys):
    rows = [
        {"model": "a", "dtype": "fp32", "paired": {}, "mem": {},
         "t": {"eager": 1.0, "fxad": 0.5, "joint:regions": 2.0, "compile": 1.0},
         "setup": {"eager": 0.1, "fxad": 1.0, "joint:regions": 4.0, "compile": 40.0}},
        {"model": "b", "dtype": "fp32", "paired": {}, "mem": {},
         "t": {"eager": 1.0, "fxad": 2.0, "joint:regions": 0.5, "compile": 0.5},
         "setup": {"eager": 0.1, "fxad": 1.0, "joint:regions": 1.0, "compile": 10.0}},
    ]
    bench.print_summary(rows)
    out = capsys.readouterr().out
    # fxad: eager/t = 2 and 0.5 -> 1.0; vs compile 2 and 0.25 -> 0.707; set-up
    # sqrt(1/40 * 1/10) = 0.05
    assert "geomean fxad vs eager: 1.000x (2 rows); vs torch.compile: 0.707x, set-up 0.05" \
        in out
    # regions: 0.5 and 2 -> 1.0; vs compile 0.5 and 1 -> 0.707; set-up 0.1 and 0.1
    assert "geomean joint:regions vs eager: 1.000x (2 rows); vs torch.compile: 0.707x, " \
        "set-up 0.10 of torch.compile's" in out
    assert "geomean compile" not in out and "geomean eager" not in out


def test_smoke_run_with_profile_prints_rows_and_the_kernel_bound(bench, capsys):
    threads = torch.get_num_threads()
    try:  # the script sets one torch thread for the process
        rc = bench.main(["--models", "lstm", "--dtypes", "fp32", "--methods", "eager,fxad",
                         "--repeats", "2", "--block", "1", "--profile"])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert rc == 0
    assert "| nn.LSTM 2x256 B8 T64 | fp32 | eager |" in out
    assert "| nn.LSTM 2x256 B8 T64 | fp32 | fxad |" in out
    assert "grad err vs eager: fxad" in out
    # the LSTM's step is its oneDNN layers and products: their share bounds any speed-up
    line = next(ln for ln in out.splitlines() if "a step that ran only those" in ln)
    share = float(line.split("(")[1].split("%")[0])
    bound = float(line.rsplit("be ", 1)[1].rstrip("x eager"))
    assert 50 < share <= 100 and math.isclose(bound, 100 / share, rel_tol=0.05)
    assert "inductor start-up" not in out  # no inductor method, nothing compiled
