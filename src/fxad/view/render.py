"""HTML of the view: one self-contained fragment (inline CSS, SVG, JSON and script).

The page is drawn on the Python side (code panes, memory chart, tables, graph), so that it
reads without JavaScript (an untrusted notebook); the script only links things on hover and
click and pans/zooms the graph.  All CSS rules are scoped under ``.fxv`` and the script looks
everything up inside its own root element (``id`` unique per view), so several views can
share one notebook page.
"""
from __future__ import annotations

import html
import json
import re
import secrets
from importlib import resources
from typing import Any

import torch

from .._version import __version__
from .graph import LAYOUT_NAME, PALETTE, draw
from .model import Line, ViewModel, fmt_bytes

__all__ = ["fragment", "page", "new_uid"]

_KEYWORDS = {"None", "True", "False", "return", "def", "self", "and", "or", "not", "in", "is",
             "lambda", "if", "else"}
_TOKEN = re.compile(r"""(?P<com>\#.*$)|(?P<str>'[^']*'|"[^"]*")|(?P<num>\b\d+(?:\.\d+)?(?:e[-+]?\d+)?\b)"""
                    r"""|(?P<id>[A-Za-z_][\w.]*)|(?P<other>.)""", re.S)


def new_uid() -> str:
    return "fxv-" + secrets.token_hex(4)


def _asset(name: str) -> str:
    return resources.files("fxad.view").joinpath(name).read_text(encoding="utf-8")


def _esc(s: Any) -> str:
    return html.escape(str(s), quote=True)


def highlight(text: str, names: set[str], own: str | None = None) -> str:
    """Syntax-colored HTML of one statement; names of graph values become hover targets."""
    out: list[str] = []
    for m in _TOKEN.finditer(text):
        kind = m.lastgroup
        tok = m.group(0)
        if kind == "com":
            out.append(f'<span class="fxv-t-com">{_esc(tok)}</span>')
        elif kind == "str":
            out.append(f'<span class="fxv-t-str">{_esc(tok)}</span>')
        elif kind == "num":
            out.append(f'<span class="fxv-t-num">{_esc(tok)}</span>')
        elif kind == "id":
            head, dot, rest = tok.partition(".")
            if head in names:  # a value of the graph (``reshape_4.t`` reads reshape_4)
                d = " fxv-t-d" if head.startswith("d_") else ""
                out.append(f'<span class="fxv-t-ref{d}" data-r="{_esc(head)}">{_esc(head)}</span>'
                           + _esc(dot + rest))
            elif tok in _KEYWORDS:
                out.append(f'<span class="fxv-t-kw">{_esc(tok)}</span>')
            elif head in ("torch", "operator", "fxad", "math"):
                out.append(f'<span class="fxv-t-fn">{_esc(tok)}</span>')
            else:
                out.append(_esc(tok))
        else:
            out.append(_esc(tok))
    return "".join(out)


def _line_html(ln: Line, model: ViewModel, names: set[str]) -> str:
    cls = [f"fxv-ln fxv-k-{ln.kind}"]
    if ln.saved:
        cls.append("fxv-saved")
    if ln.grad:
        cls.append("fxv-grad")
    if ln.recomputed_from:
        cls.append("fxv-rec")
    badges = []
    if ln.saved:
        badges.append(f'<span class="fxv-badge fxv-badge-saved" title="saved for the backward">'
                      f'saved {fmt_bytes(ln.nbytes)}</span>')
    if ln.recomputed_from:
        badges.append('<span class="fxv-badge fxv-badge-rec" title="a forward value the residual '
                      'policy recomputes here instead of saving it">recomputed</span>')
    elif ln.node and ln.node in model.recomputed:
        badges.append('<span class="fxv-badge fxv-badge-rec" title="not saved: the backward '
                      'recomputes it">recomputed in backward</span>')
    if ln.grad:
        short = ln.grad.replace("gradient of parameter ", "∂ ").replace("gradient of input ", "∂ ")
        badges.append(f'<span class="fxv-badge fxv-badge-grad" title="{_esc(ln.grad)}">'
                      f'{_esc(short)}</span>')
    if model.peak_line == ln.id:
        badges.append(f'<span class="fxv-badge fxv-badge-peak" title="simulated peak of live '
                      f'tensor memory">peak {fmt_bytes(model.peak_bytes)}</span>')
    pct = 100.0 * ln.mem / model.peak_bytes if model.peak_bytes else 0.0
    text = highlight(ln.text, names, ln.node) if ln.kind not in ("def",) else _esc(ln.text)
    if ln.kind == "input":
        text = f'<span class="fxv-t-com">{_esc(ln.text)}</span>'
    title = f"{fmt_bytes(ln.mem)} alive after this line"
    return (f'<div class="{" ".join(cls)}" data-l="{ln.id}"'
            f'{f" data-n={chr(34)}{_esc(ln.node)}{chr(34)}" if ln.node else ""}>'
            f'<span class="fxv-no" style="--m:{pct:.1f}%" title="{title}">{ln.id + 1}</span>'
            f'<code class="fxv-tx">{text}</code>'
            f'<span class="fxv-bd">{"".join(badges)}</span>'
            f'<span class="fxv-sh" title="{_esc(ln.shape)}">{_esc(ln.shape)}</span></div>')


def _panes(model: ViewModel) -> str:
    names = set(model.node_line)
    fwd = [ln for ln in model.lines if ln.pane == "fwd"]
    bwd = [ln for ln in model.lines if ln.pane == "bwd"]
    f_html = "".join(_line_html(ln, model, names) for ln in fwd)
    parts: list[str] = []
    cur: int | None = -1
    open_ = False
    for ln in bwd:
        if ln.block != cur:
            if open_:
                parts.append("</div>")
                open_ = False
            cur = ln.block
            if ln.block is not None:
                b = model.blocks[ln.block]
                src = model.sources[b.src].short if b.src is not None else ""
                sv = (f'<span class="fxv-blk-sv" title="{_esc(", ".join(b.reads_saved))}">reads '
                      f'saved {fmt_bytes(b.saved_bytes)}</span>') if b.reads_saved else ""
                parts.append(f'<div class="fxv-blk" data-b="{b.id}"><div class="fxv-blk-h">'
                             f'<span class="fxv-blk-t" title="{_esc(b.header)}"># {_esc(b.header)}'
                             f'</span>{sv}<span class="fxv-blk-src">{_esc(src)}</span></div>')
                open_ = True
        parts.append(_line_html(ln, model, names))
    if open_:
        parts.append("</div>")
    n_f, n_b = model.code_lines("fwd"), model.code_lines("bwd")
    if model.mode == "reverse":
        left, right = "Forward", "Backward"
        rnote = f"{n_b} lines in {len(model.blocks)} blocks · hover a block"
    elif model.mode == "forward":
        left, right = "Primal", "Tangents"
        rnote = f"{n_b} lines in {len(model.blocks)} blocks"
    elif model.mode == "mixed":
        left, right = "Primal", "Derivative code"
        rnote = f"{n_b} lines in {len(model.blocks)} blocks"
    else:
        left, right = "Graph", "Derivative code"
        rnote = "none"
    return (f'<section class="fxv-code"><div class="fxv-pane fxv-pane-fwd"><div class="fxv-pane-head">'
            f'<h2>{left}</h2><small>{n_f} lines</small></div><div class="fxv-scroll">{f_html}</div></div>'
            f'<div class="fxv-pane fxv-pane-bwd"><div class="fxv-pane-head"><h2>{right}</h2>'
            f'<small>{rnote}</small></div><div class="fxv-scroll">{"".join(parts)}</div></div>'
            f'</section>')


def _nice_step(top: float) -> float:
    import math

    if top <= 0:
        return 1.0
    raw = top / 4
    mag = 10 ** math.floor(math.log10(raw))
    for m in (1, 2, 2.5, 5, 10):
        if raw <= m * mag:
            return m * mag
    return 10 * mag


def _mem_unit(top: int) -> tuple[float, str]:
    for div, unit in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if top >= div:
            return float(div), unit
    return 1.0, "B"


def _memory_chart(model: ViewModel) -> str:
    lines = model.lines
    n = len(lines)
    W, H = 1000.0, 310.0
    x0, x1, y0, y1 = 58.0, W - 14.0, 40.0, H - 30.0
    dx = (x1 - x0) / max(1, n - 1)
    peak = max(model.peak_bytes, 1)
    div, unit = _mem_unit(peak)
    step = _nice_step(peak / div) * div
    top = step * (int(peak / step) + 1)

    def X(i: float) -> float:
        return x0 + i * dx

    def Y(b: float) -> float:
        return y1 - (y1 - y0) * b / top

    out = [f'<svg viewBox="0 0 {W:.0f} {H:.0f}" data-x0="{x0}" data-dx="{dx:.4f}" data-w="{W:.0f}" '
           f'role="img" aria-label="live tensor bytes per line">']
    if model.boundary < n and model.mode == "reverse":
        bx = X(model.boundary - 0.5)
        out.append(f'<rect class="fxv-m-bwdbg" x="{bx:.1f}" y="2" width="{x1 - bx:.1f}" '
                   f'height="{y1 - 2}"/>')
    t = 0.0
    while t <= top + 1:
        y = Y(t)
        out.append(f'<line class="fxv-m-grid" x1="{x0}" x2="{x1}" y1="{y:.1f}" y2="{y:.1f}"/>')
        label = f"{t / div:g} {unit}" if t else "0"
        out.append(f'<text class="fxv-m-axis" x="{x0 - 6}" y="{y + 4:.1f}" text-anchor="end">'
                   f'{label}</text>')
        t += step
    pts = " ".join(f"{X(i):.1f},{Y(ln.mem):.1f}" for i, ln in enumerate(lines))
    # steps: a value is alive from its line on
    step_pts = []
    for i, ln in enumerate(lines):
        if i:
            step_pts.append(f"{X(i - 0.5):.1f},{Y(lines[i - 1].mem):.1f}")
            step_pts.append(f"{X(i - 0.5):.1f},{Y(ln.mem):.1f}")
        else:
            step_pts.append(f"{X(0):.1f},{Y(ln.mem):.1f}")
    step_pts.append(f"{X(n - 1):.1f},{Y(lines[-1].mem):.1f}")
    del pts
    poly = " ".join(step_pts)
    out.append(f'<polygon class="fxv-m-area" points="{X(0):.1f},{y1:.1f} {poly} '
               f'{X(n - 1):.1f},{y1:.1f}"/>')
    out.append(f'<polyline class="fxv-m-line" points="{poly}"/>')
    if model.boundary < n and model.mode == "reverse":
        bx = X(model.boundary - 0.5)
        out.append(f'<line class="fxv-m-split" x1="{bx:.1f}" x2="{bx:.1f}" y1="2" '
                   f'y2="{y1}"/>')
        word = "backward" if model.mode in ("reverse", "mixed") else "derivative"
        out.append(f'<text class="fxv-m-lab" x="{bx - 6:.1f}" y="14" text-anchor="end">'
                   f'forward</text><text class="fxv-m-lab" x="{bx + 6:.1f}" y="14">{word}</text>')
        if model.saved_storage_bytes:
            sy = Y(model.saved_storage_bytes)
            out.append(f'<line class="fxv-m-saved" x1="{x0}" x2="{x1}" y1="{sy:.1f}" y2="{sy:.1f}"/>')
            out.append(f'<text class="fxv-m-savedlab" x="{x0 + 6}" y="{sy + 14:.1f}">'
                       f'storage held by the saved tensors: '
                       f'{fmt_bytes(model.saved_storage_bytes)}</text>')
    if model.peak_line is not None:
        px, py = X(model.peak_line), Y(model.peak_bytes)
        name = lines[model.peak_line].node or ""
        anchor = "end" if px > W * 0.6 else "start"
        tx = px - 9 if anchor == "end" else px + 9
        out.append(f'<circle class="fxv-m-peak" cx="{px:.1f}" cy="{py:.1f}" r="5"/>')
        out.append(f'<text class="fxv-m-peaklab" x="{tx:.1f}" y="{py - 8:.1f}" '
                   f'text-anchor="{anchor}">peak {fmt_bytes(model.peak_bytes)} at line '
                   f'{model.peak_line + 1} ({_esc(name)})</text>')
    # x axis: line numbers
    ticks = max(1, round(n / 10))
    k = 0
    while k < n:
        out.append(f'<text class="fxv-m-axis" x="{X(k):.1f}" y="{y1 + 16}" text-anchor="middle">'
                   f'{k + 1}</text>')
        k += ticks
    out.append(f'<text class="fxv-m-axis" x="{x1:.1f}" y="{H - 2}" text-anchor="end">line</text>')
    out.append(f'<line class="fxv-m-cursor" x1="0" x2="0" y1="{y0 - 14}" y2="{y1}"/>')
    out.append(f'<text class="fxv-m-curlab" x="0" y="{y1 - 8}"></text>')
    out.append(f'<rect class="fxv-m-hit" x="{x0 - 4}" y="{y0 - 14}" width="{x1 - x0 + 8:.1f}" '
               f'height="{y1 - y0 + 14}"/>')
    out.append("</svg>")
    return "".join(out)


def _role(model: ViewModel, name: str) -> tuple[str, str]:
    i = model.node_line.get(name)
    if i is None:
        return "fxv-role-fwd", "value"
    ln = model.lines[i]
    if ln.saved:
        return "fxv-role-saved", "saved"
    if name in model.saved_storage:
        return "fxv-role-saved", "saved (view)"
    if ln.grad:
        return "fxv-role-grad", "gradient"
    if ln.pane == "bwd":
        return "fxv-role-bwd", "backward" if model.mode != "forward" else "tangent"
    if ln.kind == "input":
        return "fxv-role-fwd", "input"
    return "fxv-role-fwd", "forward"


def _memory_section(model: ViewModel) -> str:
    chart = _memory_chart(model)
    rows = []
    peak = max(model.peak_bytes, 1)
    for name, nb, shape, line in model.live_at_peak[:14]:
        cls, role = _role(model, name)
        rows.append(f'<tr class="fxv-row"'
                    f'{f" data-l={chr(34)}{line}{chr(34)}" if line is not None else ""}>'
                    f'<td class="fxv-name"><code>{_esc(name)}</code><div class="fxv-bar fxv-bar-peak" '
                    f'style="width:{100 * nb / peak:.1f}%"></div></td>'
                    f'<td class="fxv-dimc fxv-clip" title="{_esc(shape)}">{_esc(shape)}</td>'
                    f'<td><span class="fxv-role {cls}">{role}</span></td>'
                    f'<td class="fxv-num">{fmt_bytes(nb)}</td></tr>')
    more = len(model.live_at_peak) - 14
    if more > 0:
        rows.append(f'<tr><td colspan="4" class="fxv-dimc">+{more} smaller</td></tr>')
    pl = model.lines[model.peak_line] if model.peak_line is not None else None
    where = (f"after line {pl.id + 1}, <code>{_esc(pl.node)}</code>" if pl is not None
             and pl.node else "")
    side = (f'<div class="fxv-side"><h3>Alive at the peak · {fmt_bytes(model.peak_bytes)}</h3>'
            f'<div class="fxv-note" style="padding:0 0 6px">{where}; storages shared by views '
            f'are counted once, under the tensor that allocated them</div>'
            f'<table class="fxv-tbl fxv-tbl-fixed"><colgroup><col style="width:44%"><col style="width:25%">'
            f'<col style="width:17%"><col style="width:14%"></colgroup><tbody>{"".join(rows)}'
            f'</tbody></table></div>')
    return (f'<section class="fxv-sec fxv-mem"><div class="fxv-sec-head"><h2>Memory</h2>'
            f'<small>live tensor bytes after each line, simulated from the shapes '
            f'(<code>fxad.memory.simulate</code>); inputs and parameters are the caller\'s and '
            f'count 0</small></div><div class="fxv-mem-grid"><div class="fxv-mem-chart">{chart}'
            f'</div>{side}</div></section>')


def _saved_section(model: ViewModel) -> str:
    if model.mode not in ("reverse", "mixed"):
        return ""
    rows = []
    biggest = max((s.nbytes for s in model.saved), default=1) or 1
    for s in sorted(model.saved, key=lambda s: -s.nbytes):
        readers = ", ".join(f"∂ {model.blocks[b].key}" for b in s.readers) or "-"
        rows.append(f'<tr class="fxv-row"{f" data-l={chr(34)}{s.line}{chr(34)}" if s.line is not None else ""}>'
                    f'<td class="fxv-name"><code>{_esc(s.name)}</code></td><td class="fxv-dimc fxv-clip">'
                    f'{_esc(s.shape)}</td><td class="fxv-dimc">{_esc(s.role)}</td>'
                    f'<td class="fxv-dimc">{_esc(readers)}</td><td class="fxv-num">'
                    f'{fmt_bytes(s.nbytes)}</td><td class="fxv-barc"><div class="fxv-bar" style="width:'
                    f'{100 * s.nbytes / biggest:.1f}%"></div></td></tr>')
    rec = ""
    if model.recomputed:
        rec = (" · recomputed in the backward instead: "
               + ", ".join(f"<code>{_esc(r)}</code>" for r in model.recomputed))
    return (f'<section class="fxv-sec fxv-saved-sec"><div class="fxv-sec-head"><h2>Saved tensors'
            f'</h2><small>{len(model.saved)} values, {fmt_bytes(model.saved_bytes)} kept from the '
            f'forward for the backward (each at its size, as <code>fxad.partition</code> counts; '
            f'views share storage: together they hold {fmt_bytes(model.saved_storage_bytes)} of '
            f'storage besides inputs and parameters) · policy <code>{_esc(model.policy)}</code>'
            f'{rec}</small></div>'
            f'<div class="fxv-side" style="max-height:300px"><table class="fxv-tbl"><thead><tr><th>tensor</th>'
            f'<th>shape</th><th>kind</th><th>read by</th><th class="fxv-num">bytes</th><th></th></tr></thead>'
            f'<tbody>{"".join(rows)}</tbody></table></div><div class="fxv-note">'
            f'{_esc(model.policy_note)}</div></section>')


def _graph_section(model: ViewModel, uid: str) -> str:
    g = draw(model, uid)
    if g is None:
        return ('<section class="fxv-sec"><div class="fxv-sec-head"><h2>Dataflow</h2><small>'
                'not drawn: the graph has too many nodes to read as a drawing</small></div></section>')
    svg = g.svg.replace('<svg ', f'<svg data-w="{g.width:.0f}" data-h="{g.height:.0f}" ', 1)
    rev = model.mode in ("reverse", "mixed")
    legend = ('<span class="fxv-lg"><s style="border-color:#b8c9e6;background:#f7faff"></s>forward op'
              '</span><span class="fxv-lg"><s style="border-color:#f1c2a3;background:#fffaf6"></s>'
              + ('backward code of an op' if rev else 'tangent code of an op') + '</span>'
              '<span class="fxv-lg"><i style="border-color:#8aa4cf"></i>dataflow</span>'
              '<span class="fxv-lg"><i style="border-color:#f0a070"></i>'
              + ('cotangents' if rev else 'tangents') + '</span>'
              '<span class="fxv-lg"><i class="fxv-lg-r" style="border-color:#7c3aed"></i>'
              + ('saved tensor read by the backward' if rev else 'primal value read by the tangent '
                 'code') + '</span>')
    if rev:
        legend += ('<span class="fxv-lg"><s style="border-color:#7c3aed"></s>saved</span>'
                   '<span class="fxv-lg"><b style="color:#15803d">bold green</b>&nbsp;a gradient '
                   'returned</span>')
    srcs = "".join(f'<span data-s="{s.id}" title="{_esc(s.path)}:{s.lineno}"><b style="background:'
                   f'{PALETTE[s.id % len(PALETTE)]}"></b>{_esc(s.short)} {_esc(s.code)}</span>'
                   for s in model.sources)
    return (f'<section class="fxv-sec fxv-graph"><div class="fxv-sec-head"><h2>Dataflow</h2>'
            f'<small>{g.n_boxes} boxes · drag or scroll to pan · Ctrl+scroll or the buttons to '
            f'zoom · click a box to pin it</small><span class="fxv-spacer"></span>'
            f'<span class="fxv-graph-tools"><button class="fxv-btn" data-act="out" title="zoom out">−'
            f'</button><button class="fxv-btn" data-act="in" title="zoom in">+</button>'
            f'<button class="fxv-btn" data-act="width" title="fit the width (F)">fit width</button>'
            f'<button class="fxv-btn" data-act="all" title="show everything">whole graph</button>'
            f'</span></div><div class="fxv-graph-vp">{svg}</div>'
            f'<div class="fxv-graph-legend">{legend}</div>'
            f'<div class="fxv-srcleg" title="your source lines; the stripe on each box">{srcs}</div>'
            f'</section>')


def _data(model: ViewModel, uid: str) -> dict:
    fwd_blocks: dict[int, list[int]] = {}
    for b in model.blocks:
        for t in b.targets:
            fwd_blocks.setdefault(t, []).append(b.id)
    saved = {}
    for s in model.saved:
        rl = [i for b in s.readers for i in model.blocks[b].lines
              if s.name in model.lines[i].refs]
        saved[s.name] = {"l": s.line, "by": s.nbytes, "rb": s.readers, "rl": rl}
    return {
        "uid": uid,
        "lines": [{"p": "f" if ln.pane == "fwd" else "b", "n": ln.node, "b": ln.block,
                   "s": ln.src, "m": ln.mem, "k": ln.kind, "sv": int(ln.saved), "g": ln.grad,
                   "rc": ln.recomputed_from, "sh": ln.shape, "by": ln.nbytes, "tx": ln.text}
                  for ln in model.lines],
        "blocks": [{"k": b.key, "h": b.header, "l": b.lines, "t": b.targets, "s": b.src,
                    "rs": b.reads_saved, "sb": b.saved_bytes, "kind": b.kind,
                    "rc": b.recomputes,
                    "o": [[o, model.lines[model.node_line[o]].shape] for o in b.outputs
                          if o in model.node_line]} for b in model.blocks],
        "sources": [{"f": s.short, "p": s.path, "fn": s.function, "l": s.lineno,
                     "c": s.context} for s in model.sources],
        "saved": saved,
        "fwdBlocks": {str(k): v for k, v in fwd_blocks.items()},
        "nodeLine": model.node_line,
        "peak": {"l": model.peak_line, "by": model.peak_bytes},
        "boundary": model.boundary,
    }


def _json_script(data: dict) -> str:
    text = json.dumps(data, separators=(",", ":"), ensure_ascii=True)
    return text.replace("</", "<\\/").replace("<!--", "<\\!--")


def _overview(model: ViewModel) -> str:
    """What the inspector shows while nothing is hovered: the page's derivative in one
    paragraph (what it takes, what it returns, what it keeps, where memory peaks)."""
    grads = [ln.grad for ln in model.lines if ln.grad]
    n_par = sum(1 for g in grads if g.startswith("gradient of parameter"))
    ins = [g.replace("gradient of input ", "") for g in grads
           if g.startswith("gradient of input")]
    facts = [f"{model.code_lines('fwd')} forward lines"]
    if model.derivative_word:
        facts.append(f"{model.code_lines('bwd')} {model.derivative_word} lines in "
                     f"{len(model.blocks)} blocks")
    if grads:
        parts = ([f"inputs <code>{_esc(', '.join(ins))}</code>"] if ins else []) + \
            ([f"{n_par} parameter{'s' if n_par != 1 else ''}"] if n_par else [])
        facts.append("gradients of " + " and ".join(parts))
    if model.mode in ("reverse", "mixed"):
        facts.append(f"{len(model.saved)} saved tensors ({fmt_bytes(model.saved_bytes)}, "
                     f"policy {_esc(model.policy)})")
    if model.peak_line is not None:
        facts.append(f"memory peaks at {fmt_bytes(model.peak_bytes)} after line "
                     f"{model.peak_line + 1} (<code>{_esc(model.lines[model.peak_line].node or '')}"
                     "</code>)")
    return ('<div class="fxv-insp-main"><div class="fxv-insp-k">overview</div>'
            f'<div class="fxv-insp-what">{_esc(model.title)}</div>'
            f'<div class="fxv-insp-meta">{_esc(model.subtitle)}</div>'
            f'<div class="fxv-insp-meta">{" · ".join(facts)}</div></div>')


def fragment(model: ViewModel, uid: str | None = None) -> str:
    """The view as one ``<div>`` (with its ``<style>`` and ``<script>``), for a notebook
    cell or to embed in a page."""
    uid = uid or new_uid()
    n_bwd, n_fwd = model.code_lines("bwd"), model.code_lines("fwd")  # as repr(View) counts
    chips = [f'<span class="fxv-chip fxv-c-fwd"><b>{n_fwd}</b> forward lines</span>']
    if model.derivative_word:
        chips.append(f'<span class="fxv-chip fxv-c-bwd"><b>{n_bwd}</b> {model.derivative_word} '
                     f'lines · <b>{len(model.blocks)}</b> blocks</span>')
    if model.mode in ("reverse", "mixed"):
        chips.append(f'<span class="fxv-chip fxv-c-saved" title="values kept for the backward, each '
                     f'at its size; their storage: {fmt_bytes(model.saved_storage_bytes)}">saved '
                     f'<b>{len(model.saved)}</b> tensors · '
                     f'<b>{fmt_bytes(model.saved_bytes)}</b> · policy <b>{_esc(model.policy)}</b></span>')
    if model.peak_line is not None:
        pn = model.lines[model.peak_line].node or ""
        chips.append(f'<span class="fxv-chip fxv-c-peak">peak <b>{fmt_bytes(model.peak_bytes)}</b> at '
                     f'<code>{_esc(pn)}</code></span>')
    warn = "".join(f'<div class="fxv-warn">{_esc(w)}</div>' for w in model.warnings)
    hint = _overview(model) + (
        '<div class="fxv-insp-hint"><div class="fxv-insp-k">how to read it</div>Hover a '
        'backward block to see the forward line it differentiates and your source line; hover '
        'a forward line to see its backward. Click to pin, <kbd>Esc</kbd> to release. Shapes '
        'and dtypes are on every line; <span class="fxv-badge fxv-badge-saved">saved</span> '
        'marks the tensors kept for the backward, the bar behind each line number the memory '
        'alive after it.</div>')
    css = _asset("view.css")
    js = _asset("view.js")
    n_rows = max(sum(1 for ln in model.lines if ln.pane == "fwd"),
                 sum(1 for ln in model.lines if ln.pane == "bwd") + 1.4 * len(model.blocks))
    code_h = int(min(520, max(120, 20 * n_rows + 24)))
    graph = _graph_section(model, uid)
    m = re.search(r'data-h="(\d+)" ', graph)
    gw = re.search(r'data-w="(\d+)" ', graph)
    graph_h = 620
    if m and gw:
        graph_h = int(min(620, max(200, int(m.group(1)) * min(1.0, 1400 / max(1, int(gw.group(1))))
                                  + 12)))
    body = [
        f'<div class="fxv" id="{uid}" style="--fxv-code-h:{code_h}px;--fxv-graph-h:{graph_h}px">',
        f"<style>{css}</style>",
        f'<header class="fxv-head"><div class="fxv-titlebox"><span class="fxv-brand">fxad.view'
        f'</span><h1>{_esc(model.title)}</h1><div class="fxv-sub">{_esc(model.subtitle)}</div>'
        f'</div><div class="fxv-stats">{"".join(chips)}</div></header>',
        warn,
        f'<div class="fxv-insp" aria-live="polite">{hint}</div>',
        _panes(model),
        _memory_section(model),
        _saved_section(model),
        graph,
        f'<div class="fxv-foot"><span>fxad {__version__} · torch {_esc(torch.__version__)}</span>'
        f'<span>graph layout: {LAYOUT_NAME}</span><span>memory: fxad.memory.simulate (an '
        f'estimate from shapes)</span><span>self-contained page: no network needed</span></div>',
        f'<script type="application/json" class="fxv-data">{_json_script(_data(model, uid))}</script>',
        f'<script>(function(){{{js}\nfxvInit(document.getElementById("{uid}"));}})();</script>',
        "</div>",
    ]
    return "".join(body)


def page(model: ViewModel, uid: str | None = None) -> str:
    """A complete HTML document around :func:`fragment`."""
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
            f"<title>{_esc(model.title)} · fxad.view</title>"
            "<style>html,body{margin:0;background:#eceef2}body{padding:16px}</style></head><body>"
            + fragment(model, uid) + "</body></html>\n")
