"""Generated code: golden files (readability regressions show up as diffs), determinism,
provenance comments, names, and self-containment after ``to_folder``.

Regenerate the golden files with ``FXAD_UPDATE_GOLDEN=1 python -m pytest tests/test_codegen.py``.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxad

GOLDEN = Path(__file__).parent / "golden"


def sin_plus_x(x):
    return torch.sin(x) + x


def tanh_mlp(x, w1, w2):
    return torch.tanh(x @ w1) @ w2


def softmax_xent_like(x, w):
    return -(torch.log_softmax(x @ w, -1) * 0.5).sum()


def broadcast_mul(x, b):
    return (x * b).mean()


def shapes(x):
    return torch.cat([x.reshape(2, 6), x.t().reshape(2, 6)], 0).sum(0)


class TwoLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(4, 8)
        self.l2 = nn.Linear(8, 2)

    def forward(self, x):
        return F.relu(self.l1(x)).pow(2) @ self.l2.weight.t()


CASES = {
    "sin_plus_x": (sin_plus_x, lambda: (torch.randn(3),)),
    "tanh_mlp": (tanh_mlp, lambda: (torch.randn(5, 4), torch.randn(4, 8), torch.randn(8, 2))),
    "log_softmax_sum": (softmax_xent_like, lambda: (torch.randn(5, 4), torch.randn(4, 3))),
    "broadcast_mul": (broadcast_mul, lambda: (torch.randn(4, 3), torch.randn(3))),
    "shapes": (shapes, lambda: (torch.randn(3, 4),)),
    "two_layer_module": (TwoLayer, lambda: (torch.randn(5, 4),)),
}


def _strip_paths(code: str) -> str:
    # provenance comments name the file; keep only its base name (already the case) and
    # drop line numbers so edits to this test file do not churn the goldens
    return re.sub(r"\[(\w+\.py):\d+\]", r"[\1]", code)


def _vjp(name):
    f, make = CASES[name]
    torch.manual_seed(0)
    obj = f() if isinstance(f, type) else f
    return fxad.vjp(obj, *make()), obj, make


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden(name):
    g, _, _ = _vjp(name)
    code = _strip_paths(g.code).strip() + "\n"
    path = GOLDEN / f"{name}.py.txt"
    if os.environ.get("FXAD_UPDATE_GOLDEN") or not path.exists():
        path.write_text(code)
    assert code == path.read_text(), f"generated code for {name} changed; see {path}"


def test_issue_example_reads_like_hand_written():
    g, _, _ = _vjp("sin_plus_x")
    body = [ln.split(";")[0].strip() for ln in g.code.splitlines()
            if "=" in ln and not ln.strip().startswith("#")]
    assert body == ["sin = torch.sin(x)", "add = sin + x", "cos = torch.cos(x)",
                    "mul = cos * d_add", "d_x = d_add + mul"]


@pytest.mark.parametrize("name", sorted(CASES))
def test_code_is_clean(name):
    g, _, _ = _vjp(name)
    code = g.code
    assert "torch.ops.aten" not in code and "torch._C" not in code
    assert not re.search(r"\b0 \+ |\+ 0\b|\* 1\b|\b1 \* ", code)
    # no dead nodes: every non-output node is used
    for n in g.graph.nodes:
        if n.op not in ("output", "placeholder"):
            assert n.users, f"dead node {n.name}"


@pytest.mark.parametrize("name", sorted(CASES))
def test_deterministic(name):
    assert _vjp(name)[0].code == _vjp(name)[0].code


def test_backward_blocks_name_their_forward_line_and_source():
    g, _, _ = _vjp("tanh_mlp")
    comments = [ln.strip() for ln in g.code.splitlines() if ln.strip().startswith("# backward of")]
    assert any("tanh = torch.tanh(matmul)" in c and "test_codegen.py:" in c for c in comments)


def test_parameter_cotangents_named_after_parameters():
    g, _, _ = _vjp("two_layer_module")
    assert "d_l1_weight" in g.code and "d_l1_bias" in g.code and "d_x" in g.code


def test_show_annotates_shapes(capsys):
    g, _, _ = _vjp("tanh_mlp")
    text = fxad.show(g, color=False)
    assert "# f32[5,8]" in text and "= None" not in text
    assert capsys.readouterr().out == text


@pytest.mark.parametrize("name", ["tanh_mlp", "two_layer_module", "shapes"])
def test_to_folder_runs_in_fresh_interpreter(tmp_path, name):
    g, obj, make = _vjp(name)
    folder = tmp_path / "saved"
    g.to_folder(folder, "Saved")
    torch.manual_seed(1)
    inputs = make()
    out = g(*inputs, *[torch.ones_like(o) for o in
                       [g.meta["fxad_forward"](*inputs)] if isinstance(o, torch.Tensor)])
    torch.save({"inputs": inputs, "expected": out}, tmp_path / "data.pt")
    script = f"""
import sys, torch
sys.path.insert(0, {str(tmp_path)!r})
from saved import Saved
data = torch.load({str(tmp_path / 'data.pt')!r}, weights_only=False)
inputs = data["inputs"]
m = Saved()
out = m(*inputs, *[torch.ones_like(o) for o in [data["expected"][0]]])
torch.testing.assert_close(out[1], data["expected"][1])
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


def test_generated_modules_and_graphs_deep_copy():
    """``copy.deepcopy`` of a generated module (and of its graph) gives a working copy that
    prints the same code: fxad's code generator keeps no reference to its graph's nodes
    (FX deep-copies a graph's code generator without the copy's memo)."""
    import copy

    m = nn.Sequential(nn.Linear(4, 4), nn.Tanh()).double()
    x = torch.randn(3, 4, dtype=torch.float64)
    g = fxad.grad(lambda x: m(x).sum(), x)
    c = copy.deepcopy(g)
    assert c.code == g.code
    for a, b in zip(c(x)[1], g(x)[1]):
        torch.testing.assert_close(a, b)
    graph = copy.deepcopy(g.graph)
    graph.lint()
    assert graph.python_code("self").src == g.graph.python_code("self").src


class _LayerDrop(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    def forward(self, h):
        for layer in self.layers:
            if not (self.training and torch.rand([]) < 0.5):
                h = h + torch.tanh(layer(h))
        return h.pow(2).sum()


def test_a_model_trained_through_control_flow_deep_copies():
    # the branches of its torch.cond stay on the model for the graphs built from it: a copy
    # of the model (an EMA, a best checkpoint) must still be possible, and train alike
    import copy

    torch.manual_seed(0)
    m = _LayerDrop().double().train()
    x = torch.randn(3, 4, dtype=torch.float64)
    fxad.compile(m)(x).backward()
    twin = copy.deepcopy(m)
    for model in (m, twin):
        model.zero_grad()
        torch.manual_seed(1)
        fxad.compile(model)(x).backward()
    for p, q in zip(m.parameters(), twin.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def test_control_flow_module_saves_with_to_folder_and_torch_save(tmp_path):
    # the branch graphs (kept on the model and the generated module) pickle without fxad's
    # build-time records: to_folder's saved submodules and torch.save of the model work
    import io

    torch.manual_seed(0)
    m = _LayerDrop().double().train()
    x = torch.randn(3, 4, dtype=torch.float64)
    g = fxad.grad(m, x)
    folder = tmp_path / "saved"
    g.to_folder(folder, "Saved")
    torch.manual_seed(5)
    expected = g(x)
    torch.save({"x": x, "expected": expected}, tmp_path / "data.pt")
    script = f"""
import sys, torch
sys.path.insert(0, {str(tmp_path)!r})
from saved import Saved
data = torch.load({str(tmp_path / 'data.pt')!r}, weights_only=False)
torch.manual_seed(5)
out = Saved()(data["x"])
torch.testing.assert_close(out[0], data["expected"][0])
torch.testing.assert_close(out[1][0], data["expected"][1][0])
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"
    buf = io.BytesIO()
    torch.save(m, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    torch.manual_seed(2)
    want = m(x)
    torch.manual_seed(2)
    torch.testing.assert_close(loaded(x), want)
