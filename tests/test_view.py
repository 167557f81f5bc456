"""fxad.view: the model of the page (split, blocks, saved tensors, memory), the page itself
(self-contained, scoped for notebooks), the layout, the CLI, and the page in a real browser.

The browser test drives the system Chromium through Playwright (``.ci/run`` installs
Chromium; the ``test`` extra installs Playwright) and skips, saying why, where either is
missing.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import fxad
from fxad.memory import simulate
from fxad.view import View, demo_module
from fxad.view.browser import find_chromium, playwright_available
from fxad.view.layout import crossings, layered_layout, place
from fxad.view.model import fmt_bytes


@pytest.fixture(scope="module")
def block_vjp():
    block, x = demo_module(batch=4)
    return fxad.vjp(block, x)


@pytest.fixture(scope="module")
def block_view(block_vjp):
    return fxad.view(block_vjp, title="TinyGPT block 0")


def _line_of(model, name):
    return model.lines[model.node_line[name]]


# --------------------------------------------------------------------------- the model

def test_forward_and_backward_split(block_view, block_vjp):
    m = block_view.model
    assert m.mode == "reverse"
    tagged = {n.name for n in block_vjp.graph.nodes if "fxad_bwd_of" in n.meta}
    for ln in m.lines:
        if ln.node in tagged:
            assert ln.pane == "bwd", ln
        if ln.pane == "fwd" and ln.kind == "op":
            assert ln.node not in tagged
    # every backward statement is in a block; forward lines are not
    assert all(ln.block is not None for ln in m.bwd_lines if ln.kind == "op")
    assert all(ln.block is None for ln in m.fwd_lines)
    # lines are in the order the code runs: the forward statements, then the backward
    ops = [ln.pane for ln in m.lines if ln.kind == "op"]
    assert ops == sorted(ops, key=lambda p: p == "bwd")
    assert m.lines[m.boundary].pane == "bwd" and m.lines[m.boundary - 1].pane == "fwd"
    # shapes and dtypes on every statement that computes a value; a guard line (the
    # attention kernel's check of its inputs' layout) computes none and shows none
    vals = {n.name: n.meta.get("val") for n in block_vjp.graph.nodes}
    ops = [ln for ln in m.lines if ln.kind == "op"]
    assert all(re.match(r"\(?f32\[", ln.shape) for ln in ops if vals.get(ln.node) is not None)
    assert all(ln.shape == "" and ln.text.startswith("fxad_expect")
               for ln in ops if vals.get(ln.node) is None)


def test_blocks_link_to_forward_lines_and_source(block_view, block_vjp):
    m = block_view.model
    by_key = {b.key: b for b in m.blocks}
    gelu = by_key["gelu"]
    assert gelu.targets == [m.node_line["gelu"]]
    assert gelu.header.startswith("backward of: gelu = torch.nn.functional.gelu(")
    assert m.lines[gelu.lines[0]].text.startswith("d_linear_2 = ")
    # the rule's forward wrote native_layer_norm and picked items out of it: all highlighted
    ln = by_key["layer_norm"]
    names = {m.lines[i].node for i in ln.targets}
    native = next(n for n in m.graph.graph.nodes if n.name == "native_layer_norm")
    items = {u.name for u in native.users}  # layer_norm and the saved mean and rstd
    assert len(items) == 3 and {"native_layer_norm", "layer_norm"} | items <= names
    # the user's source line, as recorded by the engine
    src = m.sources[gelu.src]
    assert src.short == "models.py:64" and "self.gelu(self.c_fc(x))" in src.code
    assert any(k == 64 for k, _ in src.context)
    loc = next(n.meta["fxad_bwd_src"] for n in block_vjp.graph.nodes
               if n.meta.get("fxad_bwd_of") == "gelu")
    assert (src.path, src.lineno) == (loc.filename, loc.lineno)
    # every block of the demo block has a source line and a forward line
    assert all(b.src is not None and b.targets for b in m.blocks)


def test_saved_tensors_follow_partition(block_view, block_vjp):
    m = block_view.model
    part = fxad.partition(block_vjp, "save")
    assert [s.name for s in m.saved] == part.saved_names
    assert m.saved_bytes == part.saved_bytes
    assert _line_of(m, "gelu").saved and _line_of(m, "linear_2").saved
    assert not _line_of(m, "linear_3").saved
    by = {s.name: s for s in m.saved}
    assert [m.blocks[b].key for b in by["gelu"].readers] == ["linear_3"]
    assert m.policy == "save"


def test_memory_timeline_is_simulate(block_view, block_vjp):
    m = block_view.model
    est = simulate(block_vjp.graph)
    assert m.peak_bytes == est.peak_bytes
    assert m.lines[m.peak_line].node == est.peak_node
    assert [x[0] for x in m.live_at_peak] == est.live_at_peak
    per = dict(zip((n.name for n in block_vjp.graph.nodes if n.op != "output"),
                   est.bytes_per_node))
    for ln in m.lines:
        if ln.kind == "op":
            assert ln.mem == per[ln.node]


def test_min_memory_policy_shows_the_step_it_runs(block_vjp):
    v = fxad.view(block_vjp, policy="min_memory")
    m = v.model
    part = fxad.partition(block_vjp, "min_memory")
    assert m.policy == "min_memory"
    assert [s.name for s in m.saved] == part.saved_names
    rec = [ln for ln in m.bwd_lines if ln.recomputed_from]
    assert {ln.recomputed_from for ln in rec} == set(part.recomputed) and rec
    # a recomputed line sits in the block of the backward code that needs it
    gelu_rec = next(ln for ln in rec if ln.recomputed_from == "gelu")
    assert m.blocks[gelu_rec.block].key == "linear_3"
    assert m.saved_bytes < fxad.view(block_vjp).model.saved_bytes


def test_other_generated_modules():
    x, w = torch.randn(5, 4), torch.randn(4, 3)

    def f(x, w):
        return torch.tanh(x @ w).sum()

    g = fxad.view(fxad.grad(f, x, w))
    assert g.model.mode == "reverse" and g.model.saved
    j = fxad.view(fxad.jvp(f, x, w)).model
    assert j.mode == "forward" and all(b.kind == "tangent" for b in j.blocks)
    assert {m_.split(" ")[-1] for m_ in (ln.text for ln in j.bwd_lines if ln.kind == "input")} \
        == {"dot_x", "dot_w"} or any("dot_x" in ln.text for ln in j.bwd_lines)
    h = fxad.view(fxad.hvp(lambda x: torch.tanh(x).sum(), torch.randn(5))).model
    assert h.mode == "mixed"
    t = fxad.view(fxad.trace(f, x, w)).model
    assert t.mode == "graph" and not t.blocks
    # a function or module with inputs is viewed as its VJP
    v = fxad.view(f, x, w)
    assert v.model.mode == "reverse" and v.model.title == "f"
    with pytest.raises(fxad.InputError, match="policy applies to backward code"):
        fxad.view(fxad.jvp(f, x, w), policy="min_memory")
    with pytest.raises(fxad.InputError, match="example inputs"):
        fxad.view(f)


def test_grad_with_a_policy_and_a_compiled_module():
    from fxad.demo.models import MLP

    torch.manual_seed(0)
    net = MLP(d_in=8, hidden=16, d_out=1)
    X, Y = torch.randn(32, 8), torch.randn(32, 1)
    g = fxad.grad(net, X, Y)
    for pol in ("save", "min_memory"):
        m = fxad.view(g, policy=pol).model
        # the parameter gradients are still computed (not zeros of unused parameters)
        assert {ln.grad for ln in m.lines if ln.grad} >= {
            "gradient of parameter fc1.weight", "gradient of parameter fc2.weight"}
        assert m.saved
    c = fxad.compile(net)
    c(X, Y).backward()
    v = fxad.view(c)
    assert "fxad.compile" in v.model.title and v.model.saved
    assert fxad.view(c, X, Y).model.saved_bytes == v.model.saved_bytes


# --------------------------------------------------------------------------- the page

def test_page_is_self_contained_and_complete(block_view, tmp_path):
    html = block_view.html()
    assert html.startswith("<!DOCTYPE html>")
    # nothing is fetched: no external scripts, styles, images or fonts
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html)
    assert "<link" not in html and "@import" not in html and "url(http" not in html
    assert not re.search(r"<script[^>]+src=", html)
    # the code, shapes, blocks, saved tensors, memory and graph are in the page
    for text in ("d_linear_2 = torch.ops.aten.gelu_backward", "f32[4,64,256]",
                 "# backward of: gelu = torch.nn.functional.gelu", "Saved tensors",
                 "Alive at the peak", "fxv-graph-svg", "models.py:64",
                 "graph layout: fxad layered layout (pure Python)"):
        assert text in html, text
    p = block_view.save(tmp_path / "v.html")
    assert p.read_text(encoding="utf-8").count('class="fxv"') == 1


def test_two_views_in_one_notebook_do_not_clash(block_view):
    a, b = block_view._repr_html_(), block_view._repr_html_()
    ida = re.search(r'<div class="fxv" id="([\w-]+)"', a).group(1)
    idb = re.search(r'<div class="fxv" id="([\w-]+)"', b).group(1)
    assert ida != idb
    assert f'getElementById("{ida}")' in a and f'getElementById("{idb}")' in b
    assert f'id="{ida}-af"' in a  # SVG markers are per view as well
    # every CSS rule is scoped under .fxv
    css = (Path(sys.modules["fxad.view"].__file__).parent / "view.css").read_text()
    css = re.sub(r"/\*.*?\*/", "", css, flags=re.S)
    for sel in re.findall(r"([^{}]+)\{", css):
        for part in sel.split(","):
            part = part.strip()
            if part and not part.startswith("@"):
                assert part.startswith(".fxv"), part


def test_graph_drawing(block_view):
    from fxad.view.graph import draw

    g = draw(block_view.model, "t")
    svg = g.svg
    for b in block_view.model.blocks:
        assert f'data-blocks="{b.id}' in svg or f' {b.id}"' in svg or f' {b.id} ' in svg
    assert svg.count('class="fxv-e fxv-e-r"') >= 8          # saved tensors read by cards
    assert 'data-box="f:gelu"' in svg and 'data-box="c:gelu"' in svg
    assert 'data-box="s:d_add_1"' in svg                     # the cotangent input
    # the card of an op is in the row of the op
    pos = {m.group(1): float(m.group(2)) for m in re.finditer(
        r'data-box="([^"]+)"[^>]*transform="translate\([\d.-]+,([\d.-]+)\)"', svg)}
    assert pos["c:gelu"] > pos["c:linear_2"] > pos["c:layer_norm"]
    assert pos["f:gelu"] > pos["f:linear_2"]


def test_fmt_bytes():
    assert fmt_bytes(12) == "12 B"
    assert fmt_bytes(4096) == "4.0 KiB"
    assert fmt_bytes(3 * 2 ** 20 + 2 ** 19) == "3.5 MiB"


# --------------------------------------------------------------------------- layout

def test_layout_orders_ranks_without_overlap():
    # a small DAG with a diamond and a long edge
    nodes = ["a", "b", "c", "d", "e", "f"]
    edges = [("a", "b"), ("a", "c"), ("b", "d"), ("c", "d"), ("d", "e"), ("a", "e"), ("e", "f")]
    size = {n: (60.0, 24.0) for n in nodes}
    lay = layered_layout(nodes, edges, size, node_sep=10)
    r = lay.rank
    assert all(r[u] < r[v] for u, v in edges)
    for u in nodes:
        for v in nodes:
            if u < v and r[u] == r[v]:
                assert abs(lay.pos[u][0] - lay.pos[v][0]) >= 60 + 10 - 1e-6
    # the long edge a -> e bends through dummies, one route per edge
    assert len(lay.routes) == len(edges)
    route_ae = next(pts for u, v, pts in lay.routes if (u, v) == ("a", "e"))
    assert len(route_ae) > 2
    # barycenter ordering removes the crossings of a crossed bipartite graph
    p = place(["x1", "x2", "y1", "y2"], [("x1", "y2"), ("x2", "y1")],
              {n: (10.0, 10.0) for n in ["x1", "x2", "y1", "y2"]})
    down = {"x1": ["y2"], "x2": ["y1"]}
    assert crossings(p.layers, down) == 0


def test_layout_with_fixed_ranks_and_upward_edges():
    nodes = ["p", "q", "r"]
    lay = layered_layout(nodes, [("r", "q"), ("q", "p")], {n: (40.0, 20.0) for n in nodes},
                         rank={"p": 0, "q": 1, "r": 3})
    assert lay.rank["r"] == 3 and lay.pos["r"][1] > lay.pos["q"][1] > lay.pos["p"][1]
    up = next(pts for u, v, pts in lay.routes if (u, v) == ("r", "q"))
    assert up[0][1] > up[-1][1]  # drawn upward, through a dummy in rank 2
    assert len(up) == 4


# --------------------------------------------------------------------------- CLI

def test_cli_show_html(tmp_path):
    model = tmp_path / "model.py"
    model.write_text(textwrap.dedent("""
        import torch

        def f(x, w):
            return torch.tanh(x @ w).sum()
    """))
    out = tmp_path / "view.html"
    env = dict(os.environ)
    src = str(Path(fxad.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    r = subprocess.run([sys.executable, "-m", "fxad", "show", f"{model}:f", "--input",
                        "randn(5, 4)", "--input", "randn(4, 3)", "--grad", "--html", str(out)],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "wrote" in r.stderr and out.exists()
    html = out.read_text(encoding="utf-8")
    assert "model.py:f · fxad.grad" in html and "backward of: tanh" in html
    r = subprocess.run([sys.executable, "-m", "fxad", "show", f"{model}:f", "--input",
                        "randn(5, 4)", "--input", "randn(4, 3)", "--html", str(out),
                        "--policy", "min_memory"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "policy <b>min_memory</b>" in out.read_text(encoding="utf-8")


# --------------------------------------------------------------------------- a real browser

def _browser_or_skip() -> None:
    if find_chromium() is None:
        pytest.skip("no Chromium installed (apt-get install chromium; .ci/run installs it, or "
                    "set FXAD_CHROMIUM)")
    if not playwright_available():
        pytest.skip('Playwright is not installed (pip install -e ".[test]")')


def test_page_in_a_real_browser(block_view, tmp_path):
    """Open the page in headless Chromium: it renders with no console error and no network
    request; hovering a backward block highlights the forward line it differentiates, shows
    the user's source line, and highlights its card and op in the graph; a click pins it."""
    _browser_or_skip()
    from fxad.view.browser import open_page

    m = block_view.model
    gelu_block = next(b for b in m.blocks if b.key == "gelu")
    gelu_line = m.node_line["gelu"]
    path = block_view.save(tmp_path / "view.html")
    shot = tmp_path / "view.png"

    def body(page, errors):
        root = page.locator(".fxv")
        assert root.count() == 1
        assert page.locator(".fxv-pane-fwd .fxv-ln").count() == len(m.fwd_lines)
        fwd = page.locator(f'.fxv-ln[data-l="{gelu_line}"]')
        before = fwd.evaluate("e => getComputedStyle(e).backgroundColor")
        page.hover(f'.fxv-blk[data-b="{gelu_block.id}"] .fxv-ln')
        page.wait_for_timeout(50)
        assert "fxv-hl-target" in fwd.get_attribute("class")
        after = fwd.evaluate("e => getComputedStyle(e).backgroundColor")
        assert after != before and after not in ("rgba(0, 0, 0, 0)", "transparent")
        # the inspector names the forward statement and shows the source line
        insp = page.locator(".fxv-insp").inner_text()
        assert "backward of: gelu = torch.nn.functional.gelu" in insp
        assert "models.py:64" in insp and "self.gelu(self.c_fc(x))" in insp
        assert page.locator(".fxv-sl-hit").count() == 1
        # graph: the op's box and the block's card light up
        assert "fxv-hl-box" in page.locator('[data-box="f:gelu"]').get_attribute("class")
        assert "fxv-hl-box" in page.locator('[data-box="c:gelu"]').get_attribute("class")
        # hovering a forward line lights up its backward block
        page.hover(f'.fxv-ln[data-l="{m.node_line["linear_2"]}"]')
        blk2 = next(b for b in m.blocks if b.key == "linear_2")
        assert "fxv-hl-block" in page.locator(f'.fxv-blk[data-b="{blk2.id}"]') \
            .get_attribute("class")
        # click pins: moving away keeps the highlight, Escape releases it
        page.click(f'.fxv-blk[data-b="{gelu_block.id}"] .fxv-ln')
        page.mouse.move(5, 5)
        page.hover(".fxv-head")
        assert "fxv-hl-target" in fwd.get_attribute("class")
        page.keyboard.press("Escape")
        assert "fxv-hl-target" not in (fwd.get_attribute("class") or "")
        # the graph pans and zooms
        vb0 = page.locator(".fxv-graph-vp svg").get_attribute("viewBox")
        page.click('.fxv-graph-tools [data-act="in"]')
        assert page.locator(".fxv-graph-vp svg").get_attribute("viewBox") != vb0
        page.hover(f'.fxv-blk[data-b="{gelu_block.id}"] .fxv-ln')
        page.screenshot(path=str(shot))
        return list(errors)

    errors = open_page(path, body, width=1500, height=1000)
    assert errors == [], errors
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 50_000


def test_screenshot_command(tmp_path):
    """``python -m fxad.view --demo ... --screenshot`` (how the README picture is made)."""
    _browser_or_skip()
    from fxad.view.__main__ import main

    png = tmp_path / "demo.png"
    assert main(["--demo", str(tmp_path / "demo.html"), "--screenshot", str(png)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG" and (tmp_path / "demo_graph.png").exists()


def test_view_object_basics(block_view):
    assert isinstance(block_view, View)
    assert fxad.view(block_view) is block_view
    assert "fxad.View" in repr(block_view) and "blocks" in repr(block_view)
