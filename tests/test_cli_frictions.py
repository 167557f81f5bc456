"""What a newcomer meets first on the command line: every command has its own ``--help``,
mistakes are answered by the command they belong to with the closest match, and every error
is one clean fxad report that names the user's file:line or the argument, with no PyTorch log
line or traceback before it (unless ``--debug``)."""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import fxad
from fxad.cli import benchmark_dirs, build_parser, main

ROOT = Path(__file__).resolve().parents[1]

MODEL = textwrap.dedent("""\
    import torch
    from torch import nn


    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.l1 = nn.Linear(8, 16)
            self.l2 = nn.Linear(16, 1)

        def forward(self, x):
            return self.l2(torch.tanh(self.l1(x))).mean()


    def branchy(x):
        if x.sum() > 0:
            return x.sin()
        return x.cos()


    def via_numpy(x):
        return torch.from_numpy(x.numpy()).sum()
""")


@pytest.fixture
def model_file(tmp_path):
    path = tmp_path / "m.py"
    path.write_text(MODEL)
    return path


def _line(path: Path, text: str) -> int:
    return next(i for i, ln in enumerate(path.read_text().splitlines(), 1) if text in ln)


def run_cli(*args, cwd=None, timeout=180):
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "fxad", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=cwd)


# ------------------------------------------------------------------------------------------
# one command line: every command, its own --help, suggestions
# ------------------------------------------------------------------------------------------

COMMANDS = ["demo", "show", "check", "view", "coverage", "models", "fuzz", "bench", "eject"]


def test_every_command_has_its_own_help(capsys):
    assert sorted(build_parser().commands) == sorted(COMMANDS)
    for cmd in COMMANDS:
        assert main([cmd, "--help"]) == 0
        out = capsys.readouterr().out
        assert out.startswith(f"usage: fxad {cmd} "), (cmd, out[:200])


def test_aliases_run_the_same_code(capsys, tmp_path):
    """``python -m fxad.tools.*`` and ``python -m fxad.view`` stay; ``fxad fuzz`` and
    ``python -m fxad.tools.fuzz`` run the same batch and print the same summary."""
    from fxad.tools.coverage import main as coverage_main
    from fxad.tools.fuzz.__main__ import main as fuzz_main
    from fxad.tools.models import main as models_main
    from fxad.view.__main__ import main as view_main

    for alias in (coverage_main, models_main, fuzz_main, view_main):
        with pytest.raises(SystemExit) as e:
            alias(["--help"])
        assert e.value.code == 0
        assert capsys.readouterr().out.startswith("usage: python -m fxad.")
    args = ["--n", "3", "--seed", "0", "--quiet", "--out", str(tmp_path / "f")]
    rc = fuzz_main(args)  # its exit status is the fuzzer's verdict, not tested here
    alias_out = capsys.readouterr().out
    assert main(["fuzz", *args]) == rc
    def untimed(text):
        return re.sub(r"\([\d.]+ s\)", "(s)", text)

    assert untimed(capsys.readouterr().out) == untimed(alias_out) and "3 programs" in alias_out


def test_typo_of_an_option_gets_the_commands_usage_and_a_suggestion(model_file):
    res = run_cli("show", f"{model_file}:MLP", "--inptu", "randn(4, 8)", timeout=60)
    assert res.returncode == 2
    assert res.stderr.startswith("usage: fxad show "), res.stderr
    assert "fxad show: error: unrecognized arguments: --inptu" in res.stderr
    assert "did you mean --input?" in res.stderr


@pytest.mark.parametrize("argv, usage, expect", [
    (["shwo", "m.py:MLP"], "usage: fxad ", "did you mean 'show'?"),
    (["demo", "--float46"], "usage: fxad demo ", "did you mean --float64?"),
    (["check", "m.py:f", "--dtpye", "float32"], "usage: fxad check ", "did you mean --dtype?"),
    (["view", "--policy", "min_mem", "m.py:f"], "usage: fxad view ", "did you mean 'min_memory'?"),
    (["fuzz", "--seeds", "3"], "usage: fxad fuzz ", "did you mean --seed?"),
    (["models", "--onyl", "GPT"], "usage: fxad models ", "did you mean --only?"),
])
def test_typos_everywhere(capsys, argv, usage, expect):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(usage) and expect in err, err


def test_command_lines_in_the_docs_parse(capsys):
    """Every ``fxad ...`` line in a bash block of the README and the docs pages uses a
    command and options that exist (``fxad demo --float64`` once did not)."""
    parser = build_parser()
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    seen = 0
    for page in pages:
        for block in re.findall(r"```(?:bash|console|sh)\n(.*?)```", page.read_text(), re.S):
            for line in block.replace("\\\n", " ").splitlines():
                line = line.split("  #")[0].strip().lstrip("$ ")
                if not line.startswith("fxad "):
                    continue
                argv = [a for a in shlex.split(line)[1:] if a != "..."]
                try:
                    args, extras = parser.parse_known_args(argv)
                except SystemExit:
                    pytest.fail(f"{page.name}: {line!r} does not parse: {capsys.readouterr().err}")
                assert not extras, f"{page.name}: {line!r}: unknown {extras}"
                seen += 1
    assert seen >= 8, seen


def test_demo_dtype_options():
    p = build_parser()
    assert p.parse_args(["demo", "--float32"]).dtype == "float32"
    assert p.parse_args(["demo", "--float64"]).dtype == "float64"
    assert p.parse_args(["demo", "--dtype", "float32"]).dtype == "float32"
    assert p.parse_args(["demo"]).dtype is None


# ------------------------------------------------------------------------------------------
# errors: one clean report naming the user's file:line or the argument
# ------------------------------------------------------------------------------------------

def test_wrong_input_shape_has_no_torch_log_or_traceback(model_file):
    res = run_cli("check", f"{model_file}:MLP", "--input", "randn(4, 9)", timeout=120)
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("fxad: error: torch.nn.functional.linear cannot be traced")
    assert f"m.py:{_line(model_file, 'self.l2(torch.tanh')}" in lines[0]
    assert "fake_tensor" not in res.stderr and "Traceback" not in res.stderr
    # --debug shows the traceback
    res = run_cli("check", f"{model_file}:MLP", "--input", "randn(4, 9)", "--debug", timeout=120)
    assert res.returncode == 2 and "Traceback (most recent call last)" in res.stderr


def test_wrong_input_shape_from_python_logs_nothing(capfd):
    with pytest.raises(fxad.CaptureError) as info:
        fxad.vjp(torch.nn.Linear(8, 2), torch.randn(4, 9))
    out, err = capfd.readouterr()
    assert out == "" and err == "", err
    assert info.value.loc is not None and info.value.loc.filename == __file__


def test_too_many_inputs_names_the_users_def_and_the_fix(model_file, capsys):
    rc = main(["check", f"{model_file}:MLP", "-i", "randn(4, 8)", "-i", "randn(3)"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err
    assert "2 example inputs given but MLP.forward takes 1 positional argument (x)" in err
    assert f"(at {model_file}:{_line(model_file, 'def forward')})" in err
    assert "fix: pass one example input per positional argument" in err
    assert "one --input per argument" in err
    assert "src/fxad" not in err

    def two(a, b):
        return a * b

    with pytest.raises(fxad.InputError) as info:
        fxad.vjp(two, torch.randn(2), torch.randn(2), torch.randn(2))
    e = info.value
    assert e.loc.filename == __file__ and e.loc.lineno == two.__code__.co_firstlineno
    assert "two takes 2 positional arguments (a, b)" in str(e)


def test_multi_line_fix_keeps_its_lines(model_file, capsys):
    # --values refuse: by default such decisions are taken and guarded
    assert main(["show", f"{model_file}:branchy", "-i", "randn(3)", "--values", "refuse"]) == 2
    err = capsys.readouterr().err.rstrip().splitlines()
    assert err[0].startswith("fxad: error: Python control flow depends on the value")
    assert f"m.py:{_line(model_file, 'if x.sum() > 0')}" in err[0]
    assert err[1] == "        def positive(x): return x.sin()"
    assert err[2].startswith("        y = torch.cond(")
    # as the Python API prints the same fix
    with pytest.raises(fxad.DataDependentError) as info:
        fxad.vjp(lambda x: x if x.sum() > 0 else -x, torch.randn(3), values="refuse")
    assert "\n        def positive(x): return x.sin()\n" in str(info.value)


@pytest.mark.parametrize("argv, option", [
    (["show", "{m}:MLP", "-i", "randn(4, 8)", "--html", "{d}/x.html"], "--html"),
    (["view", "{m}:MLP", "-i", "randn(4, 8)", "-o", "{d}/x.html"], "--out"),
    (["view", "{m}:MLP", "-i", "randn(4, 8)", "-o", "{t}/ok.html", "--screenshot",
      "{d}/x.png"], "--screenshot"),
    (["eject", "{m}:MLP", "-i", "randn(4, 8)", "-o", "{d}/x.py"], "--out"),
    (["coverage", "--only", "sin", "--out", "{d}/r.md"], "--out"),
])
def test_output_in_a_missing_folder_is_a_clean_error(model_file, tmp_path, capsys, argv, option):
    missing = tmp_path / "no" / "such" / "dir"
    argv = [a.format(m=model_file, d=missing, t=tmp_path) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"fxad: error: {option} {missing}/") and "\n" not in err
    assert f"the directory {missing} does not exist" in err and "mkdir -p" in err
    assert "FileNotFoundError" not in err and not missing.exists()


def test_numpy_refusal_speaks_of_numpy(model_file, capsys):
    assert main(["show", f"{model_file}:via_numpy", "-i", "randn(3)"]) == 2
    err = capsys.readouterr().err
    assert "numpy() needs the data of `x`" in err
    assert f"m.py:{_line(model_file, 'x.numpy()')}" in err
    fix = err.split("fix:", 1)[1]
    assert ".item()" not in fix and "np.exp(t.numpy())" in fix and "torch.exp(t)" in fix


def test_view_repr_and_page_count_the_same_lines():
    gm = fxad.vjp(lambda x, w: torch.tanh(x @ w).sum(), torch.randn(4, 3), torch.randn(3, 2))
    v = fxad.view(gm)
    page = v.html()
    chips = dict((w, int(n)) for n, w in re.findall(r"<b>(\d+)</b> (forward|backward) lines",
                                                   page))
    m = re.search(r"(\d+) forward lines, (\d+) backward lines in (\d+) blocks", repr(v))
    assert m, repr(v)
    assert (int(m.group(1)), int(m.group(2))) == (chips["forward"], chips["backward"])
    assert f"<small>{chips['forward']} lines</small>" in page  # the forward pane's header
    assert f"{chips['backward']} lines in {m.group(3)} blocks" in page
    # the inspector opens with an overview, not an empty box
    insp = re.search(r'<div class="fxv-insp"[^>]*>(.*?)<section', page, re.S).group(1)
    assert "overview" in insp and f"{chips['forward']} forward lines" in insp
    assert "gradients of inputs <code>x, w</code>" in insp and "memory peaks at" in insp


def test_readme_says_how_long_the_suite_takes():
    readme = (ROOT / "README.md").read_text()
    m = re.search(r"takes\s+about\s+(\d+)\s+min(?:utes)?\s+on\s+(\d+)\s+cores", readme)
    assert m, "README: say how long python3 -m pytest takes"
    assert int(m.group(1)) > 0


# ------------------------------------------------------------------------------------------
# fxad bench
# ------------------------------------------------------------------------------------------

def test_bench_lists_and_runs_scripts(tmp_path, capsys):
    d = tmp_path / "benchmarks"
    d.mkdir()
    (d / "bench_tiny.py").write_text(
        '"""A tiny benchmark: prints its arguments."""\nimport sys\n'
        'import fxad\nprint("tiny", sys.argv[1:])\nsys.exit(3)\n')
    assert main(["bench", "--dir", str(d)]) == 0
    out = capsys.readouterr().out
    assert "tiny  A tiny benchmark: prints its arguments." in out
    res = run_cli("bench", "--dir", d, "tiny", "--threads", "1", timeout=60)
    assert res.returncode == 3 and "tiny ['--threads', '1']" in res.stdout, res.stderr
    assert main(["bench", "--dir", str(d), "tinny"]) == 2
    err = capsys.readouterr().err
    assert "no benchmark 'tinny'" in err and "did you mean 'tiny'?" in err


def test_bench_finds_the_repository_and_says_when_it_cannot(tmp_path, capsys, monkeypatch):
    assert (ROOT / "benchmarks") in benchmark_dirs()
    assert main(["bench"]) == 0
    assert "fxad " in capsys.readouterr().out  # bench_fxad.py, listed by name
    assert main(["bench", "--dir", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert "no benchmarks found" in err and "not part of the installed package" in err
    assert str(tmp_path / "nowhere") in err and "--dir PATH" in err
