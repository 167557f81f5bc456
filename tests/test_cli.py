"""The ``fxad`` command line: show, check, one-line errors vs --debug, demo --quick."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from fxad.cli import main

USER_FILE = textwrap.dedent("""
    import torch
    import torch.nn as nn


    def f(x, w):
        return torch.tanh(x @ w).sum(1)


    def branchy(x):
        if x.sum() > 0:
            return x * 2
        return x


    def uses_item(x):
        return x * x.sum().item()


    def raises(x):
        raise ValueError("broken model")


    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.l1 = nn.Linear(3, 5)

        def forward(self, x):
            return torch.tanh(self.l1(x)).pow(2).mean()


    class NeedsArgs(nn.Module):
        def __init__(self, width):
            super().__init__()
""")


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "model.py"
    path.write_text(USER_FILE)
    return str(path)


def _env():
    env = dict(os.environ)
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    return env


def run_cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "fxad", *args], capture_output=True,
                          text=True, timeout=timeout, env=_env())


def test_show_function_prints_code_with_shapes(user_file, capsys):
    rc = main(["show", f"{user_file}:f", "--input", "randn(4, 3)", "--input", "randn(3, 2)"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "def forward(self, x, w, d_sum_1)" in out
    assert "# f32[4,2]" in out and "# backward of:" in out
    assert "d_x = " in out and "d_w = " in out


def test_show_module_class_and_grad(user_file, capsys):
    rc = main(["show", "--grad", f"{user_file}:Net", "-i", "randn(6, 3)"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "d_l1_weight" in out and "# f32[5,3]" in out


def test_check_passes(user_file, capsys):
    rc = main(["check", f"{user_file}:Net", "--input", "randn(6, 3)"])
    out = capsys.readouterr().out
    assert rc == 0
    assert out.startswith("fxad.check passed (torch.float64)")
    assert "2 parameter(s)" in out


def test_check_failure_exit_code_1(tmp_path):
    path = tmp_path / "wrong.py"
    path.write_text(textwrap.dedent("""
        import torch
        import fxad


        @fxad.register_vjp(torch.exp, replace=True)
        class WrongExp:  # deliberately wrong: d exp(x) = 2 exp(x)
            def fwd(x):
                y = torch.exp(x)
                return y, y

            def bwd(y, d_out):
                return (2 * d_out * y,)


        def f(x):
            return torch.exp(x).sum()
    """))
    res = run_cli("check", f"{path}:f", "--input", "randn(3)")
    assert res.returncode == 1, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fxad: error: cotangent of input")
    assert "Traceback" not in res.stderr


@pytest.mark.parametrize("name, expect", [
    ("branchy", "Python control flow depends on the value of tensor"),
    ("uses_item", ".item()"),
])
def test_capture_error_is_one_line(user_file, capsys, name, expect):
    """One line, the fix included; a fix that shows code keeps its lines, as the Python API
    prints it (``branchy``'s torch.cond example)."""
    # --values refuse: by default such decisions are taken and guarded
    rc = main(["show", f"{user_file}:{name}", "--input", "randn(4, 3)", "--values", "refuse"])
    err = capsys.readouterr().err
    assert rc == 2
    lines = err.strip().splitlines()
    line = lines[0]
    assert line.startswith("fxad: error: ") and expect in line
    assert "model.py:" in line and " — fix: " in line
    if name == "uses_item":
        assert len(lines) == 1, err
    else:
        assert lines[1:] == ["        def positive(x): return x.sin()",
                             "        y = torch.cond(x.sum() > 0, positive, lambda x: x.cos(), "
                             "(x,))"], err


def test_debug_shows_traceback(user_file, capsys):
    rc = main(["--debug", "show", f"{user_file}:branchy", "--input", "randn(4, 3)",
               "--values", "refuse"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "Traceback (most recent call last)" in err and "DataDependentError" in err
    # --debug is accepted after the command as well
    rc = main(["show", f"{user_file}:branchy", "-i", "randn(4, 3)", "--values", "refuse",
               "--debug"])
    assert rc == 2 and "Traceback" in capsys.readouterr().err


def test_other_exceptions_and_usage_errors_are_one_line(user_file, capsys):
    assert main(["show", f"{user_file}:raises", "-i", "randn(2)"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("fxad: error: ValueError: broken model (at ")
    assert "model.py:" in err and "\n" not in err

    assert main(["show", f"{user_file}:missing", "-i", "randn(2)"]) == 2
    err = capsys.readouterr().err.strip()
    assert "defines no 'missing'" in err and "Net" in err and "\n" not in err

    assert main(["show", f"{user_file}:NeedsArgs", "-i", "randn(2)"]) == 2
    assert "cannot instantiate NeedsArgs()" in capsys.readouterr().err

    assert main(["show", f"{user_file}:f", "-i", "randn(4,"]) == 2
    assert "--input #1" in capsys.readouterr().err

    assert main(["check", "no_such_file.py:f", "-i", "randn(2)"]) == 2
    assert "no such file" in capsys.readouterr().err


def test_input_expressions(user_file, capsys):
    from fxad.cli import eval_inputs

    a, b, c = eval_inputs(["randn(2, 3)", "randint(0, 10, (4,))", "tensor([1., 2.])"])
    assert a.shape == (2, 3) and b.dtype.is_floating_point is False and c.tolist() == [1, 2]
    a2, = eval_inputs(["randn(2, 3)"])
    assert (a == a2).all()  # seeded


def test_python_m_fxad_help():
    res = run_cli("--help", timeout=60)
    assert res.returncode == 0
    assert "demo" in res.stdout and "show" in res.stdout and "check" in res.stdout


def test_demo_quick():
    t0 = time.perf_counter()
    res = run_cli("demo", "--quick", "--no-progress", timeout=120)
    elapsed = time.perf_counter() - t0
    assert res.returncode == 0, res.stderr[-3000:]
    out = res.stdout
    assert "max |loss_fxad - loss_autograd|" in out
    assert "backward of:" in out
    assert "fxad.check passed" in out
    assert elapsed < 60, f"fxad demo --quick took {elapsed:.1f} s"
