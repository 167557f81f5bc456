"""The tutorial notebook (docs/tutorial.ipynb) runs top to bottom without an error.

nbclient starts a real Jupyter kernel and executes every cell in order; a cell that raises
fails the test with the cell's traceback.  The notebook is stored without outputs.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

NOTEBOOK = Path(__file__).resolve().parents[1] / "docs" / "tutorial.ipynb"


def test_notebook_is_stored_without_outputs():
    nb = json.loads(NOTEBOOK.read_text(encoding="utf-8"))
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert code, "the tutorial has no code cells"
    assert all(not c.get("outputs") and c.get("execution_count") is None for c in code), \
        "store docs/tutorial.ipynb without outputs (clear them before committing)"
    text = "".join("".join(c["source"]) for c in nb["cells"])
    for topic in ("fxad.vjp", "fxad.grad", "register_vjp", "fxad.unregister", "fxad.jvp",
                  "fxad.hvp", "fxad.compile", "min_memory", "fxad.view", "fxad.plot.memory"):
        assert topic in text, f"the tutorial should cover {topic}"


def test_tutorial_runs_top_to_bottom(tmp_path):
    nbformat = pytest.importorskip("nbformat", reason="nbformat is in the test extra")
    nbclient = pytest.importorskip("nbclient", reason="nbclient is in the test extra")
    pytest.importorskip("ipykernel", reason="ipykernel is in the test extra")
    pytest.importorskip("matplotlib", reason="matplotlib is in the test extra")
    from nbclient.exceptions import CellExecutionError

    nb = nbformat.read(str(NOTEBOOK), as_version=4)
    # the kernel imports the same fxad as this test (an editable checkout or a path override)
    src = str(Path(__file__).resolve().parents[1] / "src")
    env_path = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (env_path, src) if p)
    client = nbclient.NotebookClient(nb, timeout=240, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    t0 = time.time()
    try:
        client.execute()
    except CellExecutionError as e:  # the failing cell's source and traceback
        pytest.fail(f"a tutorial cell failed:\n{e}")
    finally:
        os.environ["PYTHONPATH"] = env_path
        if not env_path:
            del os.environ["PYTHONPATH"]
    elapsed = time.time() - t0
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    errors = [o for o in outputs if o.get("output_type") == "error"]
    assert not errors, errors
    # what it made: the saved view, the plots, and an inline view in the outputs
    assert (tmp_path / "tinygpt_min_memory.html").stat().st_size > 10_000
    assert (tmp_path / "tinygpt_memory.png").read_bytes()[:4] == b"\x89PNG"
    html = [o for o in outputs if "text/html" in o.get("data", {})]
    assert any('class="fxv"' in o["data"]["text/html"] for o in html), "fxad.view did not display"
    print(f"tutorial ran in {elapsed:.1f} s", file=sys.stderr)
