"""fxad.eject and the edited-derivative workflow: eject -> edit -> fxad.check(vjp=) ->
fxad.compile(vjp=); the CLI (``fxad eject``, ``fxad check --vjp``); docs/editing.md runs."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import fxad
from fxad.cli import main
from fxad.eject import load, trace_values

ROOT = Path(__file__).resolve().parents[1]

MODEL_SRC = textwrap.dedent("""
    import torch


    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(1)
            self.l1 = torch.nn.Linear(16, 8)
            self.l2 = torch.nn.Linear(8, 2)

        def forward(self, x):
            return self.l2(torch.tanh(self.l1(x)))
""")


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = torch.nn.Linear(16, 8)
        self.l2 = torch.nn.Linear(8, 2)

    def forward(self, x):
        return self.l2(torch.tanh(self.l1(x)))


class Loss(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.fc2 = torch.nn.Linear(16, 8)

    def forward(self, x, y):
        return F.mse_loss(self.fc2(F.gelu(self.fc1(x))), y)


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
    return env


@pytest.fixture
def net():
    torch.manual_seed(0)
    return Net(), torch.randn(4, 16)


def test_eject_vjp_is_readable_and_matches(net, tmp_path):
    m, x = net
    path = tmp_path / "net_vjp.py"
    text = fxad.eject(m, x, path=path)
    assert path.read_text() == text
    assert "def vjp(model, x, d_linear_1):" in text
    assert "l1_weight = model.l1.weight" in text and "self" not in text.split("import torch")[1]
    assert "# backward of: tanh = torch.tanh(linear)" in text
    assert f"torch {torch.__version__}" in text and "input 0: float32[4, 16]" in text
    assert "vjp=" in text  # how to check it
    g = fxad.vjp(m, x)
    d = torch.randn(4, 2)
    mine, theirs = load(str(path)).vjp(m, x, d), g(x, d)
    assert torch.equal(mine[0], theirs[0]) and torch.equal(mine[1][0], theirs[1][0])
    assert mine[2].keys() == theirs[2].keys()
    assert all(torch.equal(mine[2][k], theirs[2][k]) for k in theirs[2])


def test_eject_grad_and_function(net):
    m, x = net
    text = fxad.eject(lambda t: torch.sin(t).sum(), x, kind="grad")
    assert "def grad(t):" in text and "TAKES_MODEL = False" in text
    value, (d_x,) = load(text).grad(x)
    assert torch.allclose(d_x, torch.cos(x))
    assert fxad.check(lambda t: torch.sin(t).sum(), x, vjp=text).n_inputs == 1
    assert "TAKES_MODEL = True" in fxad.eject(m, x, kind="vjp")


def test_eject_rejects_closed_over_tensors(net):
    m, x = net
    with pytest.raises(fxad.InputError, match="cannot eject"):
        fxad.eject(lambda t: m(t).sum(), x, kind="grad")
    with pytest.raises(fxad.InputError, match="kind"):
        fxad.eject(m, x, kind="nope")


def test_round_trip_in_a_fresh_interpreter(tmp_path):
    (tmp_path / "model.py").write_text(MODEL_SRC)
    sys.path.insert(0, str(tmp_path))
    try:
        import importlib
        model = importlib.import_module("model")
        importlib.reload(model)
        m = model.Net()
    finally:
        sys.path.remove(str(tmp_path))
    torch.manual_seed(0)
    x, d = torch.randn(4, 16), torch.randn(4, 2)
    fxad.eject(m, x, path=tmp_path / "net_vjp.py")
    out, (d_x,), pg = fxad.vjp(m, x)(x, d)
    torch.save({"x": x, "d": d}, tmp_path / "io.pt")
    script = textwrap.dedent("""
        import sys, torch
        sys.path.insert(0, sys.argv[1])
        import model, net_vjp
        assert "fxad" not in sys.modules
        io = torch.load(sys.argv[1] + "/io.pt")
        out, (d_x,), pg = net_vjp.vjp(model.Net(), io["x"], io["d"])
        assert "fxad" not in sys.modules
        torch.save({"out": out, "d_x": d_x, "pg": pg}, sys.argv[1] + "/res.pt")
    """)
    res = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True,
                         text=True, timeout=120, env={k: v for k, v in os.environ.items()
                                                      if k != "PYTHONPATH"})
    assert res.returncode == 0, res.stderr
    got = torch.load(tmp_path / "res.pt")
    assert torch.equal(got["out"], out) and torch.equal(got["d_x"], d_x)
    assert all(torch.equal(got["pg"][k], pg[k]) for k in pg)


def test_check_ejected_passes_and_callable(net, tmp_path):
    m, x = net
    path = tmp_path / "v.py"
    fxad.eject(m, x, path=path)
    rep = fxad.check(m, x, vjp=str(path))
    assert rep.n_params == 4 and rep.n_inputs == 1 and "edited" in rep.notes[0]
    fn = load(str(path)).vjp
    assert fxad.check(m, x, vjp=fn).n_params == 4
    with pytest.raises(fxad.InputError, match="float64"):
        fxad.check(m, x, vjp=str(path), dtype=torch.float32)


def test_check_names_wrong_cotangent_and_block(net, tmp_path):
    m, x = net
    text = fxad.eject(m, x)
    bad = tmp_path / "bad.py"
    bad.write_text(text.replace("sub = 1 - mul", "sub = 1 - 0.5 * mul"))
    with pytest.raises(fxad.CheckError) as ei:
        fxad.check(m, x, vjp=str(bad))
    msg = str(ei.value)
    assert "cotangent of input[0]" in msg and "parameter l1.weight" in msg
    assert "first block whose values depart from fxad's own derivative: " \
           "# backward of: tanh = torch.tanh(linear)" in msg
    assert "value `sub`" in msg
    assert ei.value.loc is not None and ei.value.loc.filename == str(bad)
    # an error in the last block: only the parameter gradients of l1 are wrong
    bad.write_text(text.replace("d_fc1_bias = d_linear.sum(0)", "d_fc1_bias = d_linear.sum(0) * 2")
                   .replace("d_l1_bias = d_linear.sum(0)", "d_l1_bias = d_linear.sum(0) * 2"))
    with pytest.raises(fxad.CheckError) as ei:
        fxad.check(m, x, vjp=str(bad))
    msg = str(ei.value)
    assert "parameter l1.bias" in msg and "input[0]" not in msg.split("\n")[0].split("also")[0]
    assert "# backward of: linear = torch.nn.functional.linear(x" in msg


def test_trace_values_blocks(net):
    m, x = net
    ns = load(fxad.eject(m, x))
    recs = trace_values(ns.vjp, m, x, torch.ones(4, 2))
    blocks = {name: block for name, _, block, _ in recs}
    assert blocks["linear"] == "forward"
    assert blocks["sub"].startswith("backward of: tanh")


def _edited_training(text):
    head = text[:text.index("def forward")]
    return head + textwrap.dedent('''
        def forward(model, x, y):
            linear = torch.nn.functional.linear(x, model.fc1.weight, model.fc1.bias)
            gelu = torch.nn.functional.gelu(linear)
            linear_1 = torch.nn.functional.linear(gelu, model.fc2.weight, model.fc2.bias)
            sub = linear_1 - y
            mse_loss = sub.square().mean()
            return (mse_loss, x, linear, sub)


        def backward(model, args):
            x, linear, sub, d_mse_loss = args; args.clear()
            # backward of: mse_loss
            d_linear_1 = sub * (d_mse_loss * (2 / sub.numel()))
            # backward of: linear_1
            gelu = torch.nn.functional.gelu(linear)
            d_fc2_weight = d_linear_1.t() @ gelu
            d_fc2_bias = d_linear_1.sum(0)
            d_gelu = d_linear_1 @ model.fc2.weight
            # backward of: gelu
            d_linear = torch.ops.aten.gelu_backward(d_gelu, linear)
            # backward of: linear
            d_fc1_weight = d_linear.t() @ x
            d_fc1_bias = d_linear.sum(0)
            return (None, None, d_fc1_weight, d_fc1_bias, d_fc2_weight, d_fc2_bias)
    ''')


def test_training_split_edit_checks_and_trains(tmp_path):
    torch.manual_seed(0)
    m, x, y = Loss(), torch.randn(4, 8), torch.randn(4, 8)
    text = fxad.eject(m, x, y, kind="training")
    assert "def forward(model, x, y):" in text and "def backward(model, args):" in text
    assert "N_OUTPUTS = 1" in text and "SAVED = ['x', 'y', 'linear', 'gelu', 'linear_1']" in text
    plain = tmp_path / "plain.py"
    plain.write_text(text)
    assert fxad.check(m, x, y, vjp=str(plain)).n_params == 4
    path = tmp_path / "edited.py"
    path.write_text(_edited_training(text))
    assert fxad.check(m, x, y, vjp=str(path)).n_params == 4
    ref = Loss()
    ref.load_state_dict(m.state_dict())
    net = fxad.compile(m, x, y, vjp=str(path))
    for _ in range(3):
        m.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        loss = net(x, y)
        loss.backward()
        ref(x, y).backward()
        assert torch.allclose(loss, ref(x, y).detach())
        for p, q in zip(m.parameters(), ref.parameters()):
            assert torch.allclose(p.grad, q.grad, atol=1e-6, rtol=1e-5)
        with torch.no_grad():
            for p, q in zip(m.parameters(), ref.parameters()):
                p -= 0.1 * p.grad
                q -= 0.1 * q.grad
    rep = net.report()
    assert "saved for backward 3 values" in rep and "x, linear, sub" not in rep.split("\n")[1]
    assert "sub (" in rep and "fxad's split (policy 'save'): saved for backward 5 values" in rep
    # the guards: other shapes or modes raise
    with pytest.raises(fxad.InputError, match="built for"):
        net(torch.randn(5, 8), torch.randn(5, 8))
    m.eval()
    with pytest.raises(fxad.InputError, match="training flags"):
        net(x, y)
    m.train()
    with torch.no_grad():  # no grad: the model itself runs
        assert torch.allclose(net(x, y), m(x, y))


@pytest.mark.parametrize("backend", [False, "eager"])
def test_joint_step_with_edited_split(tmp_path, backend):
    torch.manual_seed(0)
    m, x, y = Loss(), torch.randn(4, 8), torch.randn(4, 8)
    path = tmp_path / "edited.py"
    path.write_text(_edited_training(fxad.eject(m, x, y, kind="training")))
    step = fxad.joint_step(m, x, y, vjp=str(path), compile=backend)
    loss, in_grads, pg = step(x, y)
    assert in_grads == (None, None)
    ref, _, ref_pg = fxad.grad(m, x, y)(x, y)
    assert torch.allclose(loss, ref)
    assert pg.keys() == ref_pg.keys()
    assert all(torch.allclose(pg[k], ref_pg[k], atol=1e-6, rtol=1e-5) for k in pg)
    with pytest.raises(fxad.InputError, match="built for"):
        step(torch.randn(3, 8), torch.randn(3, 8))


def test_grad_kind_of_a_module_checks():
    torch.manual_seed(0)
    m, x, y = Loss(), torch.randn(4, 8), torch.randn(4, 8)
    text = fxad.eject(m, x, y, kind="grad")
    assert "def grad(model, x, y):" in text
    rep = fxad.check(m, x, y, vjp=text)
    assert rep.n_inputs == 2 and rep.n_params == 4
    with pytest.raises(fxad.CheckError, match="backward of: gelu"):
        fxad.check(m, x, y, vjp=text.replace("gelu_backward(d_gelu, linear", "gelu_backward("
                                             "2 * d_gelu, linear"))


def test_compile_vjp_needs_training_split(net, tmp_path):
    m, x = net
    path = tmp_path / "v.py"
    fxad.eject(m, x, path=path)
    with pytest.raises(fxad.InputError, match="training split"):
        fxad.compile(m, x, vjp=str(path))


# ------------------------------------------------------------------------------ CLI

@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "model.py"
    path.write_text(MODEL_SRC)
    return str(path)


def test_cli_eject_check_and_broken_edit(user_file, tmp_path, capsys):
    out = tmp_path / "net_vjp.py"
    rc = main(["eject", f"{user_file}:Net", "--input", "randn(8, 16)", "-o", str(out)])
    err = capsys.readouterr().err
    assert rc == 0 and out.exists() and "--vjp" in err
    text = out.read_text()
    assert f"fxad check {user_file}:Net --input 'randn(8, 16)' --vjp {out}" in text
    rc = main(["check", f"{user_file}:Net", "--input", "randn(8, 16)", "--vjp", str(out)])
    assert rc == 0 and capsys.readouterr().out.startswith("fxad.check passed")
    out.write_text(text.replace("sub = 1 - mul", "sub = 1 + mul"))
    rc = main(["check", f"{user_file}:Net", "--input", "randn(8, 16)", "--vjp", str(out)])
    err = capsys.readouterr().err
    assert rc == 1
    assert len(err.strip().splitlines()) == 1
    assert "# backward of: tanh = torch.tanh(linear)" in err and f"(at {out}:" in err or \
        "net_vjp.py:" in err


def test_cli_eject_training_to_stdout(user_file, capsys):
    rc = main(["eject", f"{user_file}:Net", "--input", "randn(8, 16)", "--kind", "training"])
    out = capsys.readouterr().out
    assert rc == 0 and "def forward(model, x):" in out and "def backward(model, args):" in out
    assert "INPUT_GRADS = []" in out


def test_cli_check_vjp_missing_file(user_file, capsys):
    rc = main(["check", f"{user_file}:Net", "--input", "randn(8, 16)", "--vjp", "nope.py"])
    assert rc == 2 and "no such file" in capsys.readouterr().err


# ------------------------------------------------------------------------------ docs

def test_docs_editing_page_runs(tmp_path, monkeypatch):
    page = (ROOT / "docs" / "editing.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", page, flags=re.S)
    assert len(blocks) >= 5
    monkeypatch.chdir(tmp_path)
    ns: dict = {"__name__": "docs_editing"}
    for code in blocks:
        exec(compile(code, "docs/editing.md", "exec"), ns)  # noqa: S102
    assert (tmp_path / "mlp_train_edited.py").exists()


def test_readme_points_at_editing_page():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "docs/editing.md" in readme
