"""fxad.plot: the memory timeline and the coverage chart (matplotlib, the ``plot`` extra), and
the error that names the extra when matplotlib is missing."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import fxad
from fxad.plot import MissingExtraError, read_coverage

REPORT = Path(__file__).resolve().parents[1] / "coverage_report.md"


def _mlp_grad():
    from fxad.demo.models import MLP

    torch.manual_seed(0)
    return fxad.grad(MLP(d_in=8, hidden=16, d_out=1), torch.randn(32, 8), torch.randn(32, 1))


def test_memory_plot_png_and_svg(tmp_path):
    pytest.importorskip("matplotlib")
    g = _mlp_grad()
    fig = fxad.plot.memory(g, tmp_path / "mem.png", policies=[None, "min_memory"])
    assert (tmp_path / "mem.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels[0].startswith("as generated: peak") and labels[1].startswith("min_memory")
    assert any(t.get_text().startswith("peak ") for t in ax.texts)
    assert fig._repr_png_()[:4] == b"\x89PNG"   # displays in Jupyter without pyplot
    fxad.plot.memory(fxad.view(g), tmp_path / "mem.svg", title="MLP")
    svg = (tmp_path / "mem.svg").read_text()
    assert svg.lstrip().startswith("<?xml") and "<svg" in svg


def test_coverage_plot_from_a_report(tmp_path):
    pytest.importorskip("matplotlib")
    md = tmp_path / "cov.md"
    md.write_text("# coverage\n\n| op | samples | status | jvp | reason |\n|---|---:|---|---|---|\n"
                  "| sin | 3 | pass | pass |  |\n| linalg.svd | 3 | pass | pass |  |\n"
                  "| nn.functional.dropout | 0 | skip | skip | random |\n"
                  "| masked_select | 2 | crash | skip | data \\| dependent |\n")
    rows = read_coverage(md)
    assert [r["status"] for r in rows] == ["pass", "pass", "skip", "crash"]
    assert rows[3]["reason"] == "data \\| dependent"
    fig = fxad.plot.coverage(tmp_path / "cov.png", report=md)
    assert (tmp_path / "cov.png").read_bytes()[:4] == b"\x89PNG"
    ylabels = [t.get_text() for t in fig.axes[1].get_yticklabels()]
    assert "torch (2)" in ylabels and "torch.linalg (1)" in ylabels
    assert "2 of 4 pass" in fig._suptitle.get_text()
    with pytest.raises(fxad.InputError, match="python -m fxad.tools.coverage"):
        fxad.plot.coverage(report=tmp_path / "missing.md")


@pytest.mark.skipif(not REPORT.exists(), reason="no coverage_report.md in this checkout")
def test_the_repository_report_reads_without_running_the_sweep():
    rows = read_coverage(REPORT)
    assert len(rows) > 500
    assert {r["status"] for r in rows} <= {"pass", "fallback", "missing", "wrong", "crash", "skip"}


def test_missing_matplotlib_names_the_extra(monkeypatch):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(MissingExtraError) as e:
        fxad.plot.memory(_mlp_grad())
    assert isinstance(e.value, ImportError) and isinstance(e.value, fxad.FxadError)
    assert 'pip install "fxad[plot]"' in str(e.value)
    with pytest.raises(ImportError, match=r"fxad\[plot\]"):
        fxad.plot.coverage(report=REPORT)
