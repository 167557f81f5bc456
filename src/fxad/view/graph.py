"""The dataflow drawing of the view: forward ops on the left, their derivative code on the right.

The forward column has one box per forward *op group*: a node together with the nodes its
rule's forward wrote (``native_layer_norm`` and the items picked out of it are one box,
``layer_norm``) and the inputs.  The derivative column has one card per op differentiated:
the backward (or tangent) code that rule wrote, line by line.  Each card sits in the same row
as the op it differentiates, so the backward graph reads upward next to the forward graph it
mirrors.  Edges: forward dataflow (grey-blue), cotangent flow between cards (orange), and the
saved tensors each card reads (dashed purple).  Every box carries a stripe colored by the
user's source line it came from, shared by an op and its card.

Both columns are laid out by :mod:`fxad.view.layout` (pure Python; the derivative column
with its ranks fixed to those of the forward ops).  :func:`draw` returns the SVG text.
"""
from __future__ import annotations

import html
import operator
from dataclasses import dataclass, field

import torch.fx as fx

from .layout import Placement, place, rank_geometry, route
from .model import ViewModel, fmt_bytes

__all__ = ["draw", "GraphDrawing", "PALETTE", "LAYOUT_NAME"]

LAYOUT_NAME = "fxad layered layout (pure Python)"
CHAR = 6.7          # px per character of the 11px monospace font
LINE_H = 15.0
PAD = 8.0
GUTTER = 150.0
MAX_CARD_LINES = 9
MAX_CHARS = 54

PALETTE = ["#2563eb", "#0d9488", "#d97706", "#7c3aed", "#db2777", "#16a34a", "#0891b2",
           "#ca8a04", "#9333ea", "#e11d48", "#4f46e5", "#059669", "#ea580c", "#64748b"]


def _esc(s: str) -> str:
    return html.escape(s, quote=True)


def _clip(s: str, n: int) -> str:
    return s if len(s) <= n else s[: n - 1] + "…"


@dataclass
class _Box:
    id: str
    title: str
    sub: str
    rows: list[tuple[str, str]]          # (text, css class)
    lines: list[int]                     # line ids it stands for
    src: int | None
    kind: str                            # "fwd", "input", "card", "seed"
    blocks: list[int] = field(default_factory=list)
    w: float = 0.0
    h: float = 0.0
    title_attr: str = ""
    tag_chars: int = 12

    def measure(self) -> None:
        texts = [self.title + " " * (self.tag_chars + 3), self.sub] + [t for t, _ in self.rows]
        chars = max(len(t) for t in texts)
        self.w = max(96.0, min(chars, MAX_CHARS) * CHAR + 2 * PAD + 6)
        n = (1 if self.title else 0) + (1 if self.sub else 0) + len(self.rows)
        self.h = n * LINE_H + 2 * PAD - 2


@dataclass
class GraphDrawing:
    svg: str
    width: float
    height: float
    n_boxes: int
    n_edges: int


def _groups(model: ViewModel) -> tuple[dict[str, str], dict[str, list[int]]]:
    """Forward op groups: node name → group key, and group key → line ids."""
    graph = model.graph.graph
    by_name = {n.name: n for n in graph.nodes}
    fwd_lines = [ln for ln in model.lines if ln.pane == "fwd" and ln.node
                 and ln.kind in ("op", "input")]
    group_of: dict[str, str] = {}
    for ln in fwd_lines:
        n = by_name[ln.node]
        key = n.meta.get("fxad_fwd_of")
        if key is not None and str(key) in by_name and model.node_line.get(str(key)) is not None \
                and model.lines[model.node_line[str(key)]].pane == "fwd":
            key = str(key)
        else:
            key = None
        if key is None and n.op == "call_function" and n.target is operator.getitem \
                and isinstance(n.args[0], fx.Node) and n.args[0].name in group_of \
                and isinstance(n.args[0].meta.get("val"), (tuple, list)):
            key = group_of[n.args[0].name]
        group_of[ln.node] = key if key is not None else ln.node
    # a group is keyed by its first member's key; re-key groups whose key node is a member
    members: dict[str, list[int]] = {}
    for ln in fwd_lines:
        members.setdefault(group_of[ln.node], []).append(ln.id)
    return group_of, members


def draw(model: ViewModel, uid: str, *, max_boxes: int = 1500) -> GraphDrawing | None:
    """The SVG of ``model``'s dataflow (see the module docstring), or ``None`` when the graph
    has more than ``max_boxes`` boxes (too large to be read as a drawing)."""
    lines = model.lines
    group_of, members = _groups(model)
    boxes: dict[str, _Box] = {}
    # ---- forward boxes
    for key, ids in members.items():
        main_line = lines[model.node_line.get(key, ids[0])] if key in model.node_line else lines[ids[0]]
        first = lines[ids[0]]
        if main_line.kind == "input":
            box = _Box(id="f:" + key, title=key, sub=f"input {main_line.shape}", rows=[],
                       lines=ids, src=main_line.src, kind="input")
        else:
            opline = first if first.op != "getitem" else main_line
            sub = f"{opline.op} · {main_line.shape}" if main_line.shape else opline.op
            rows = []
            for i in ids:
                ln = lines[i]
                if ln.id == main_line.id:
                    continue
                cls = "saved" if ln.saved else ""
                rows.append((f"{ln.node} {ln.shape}", cls))
            rows = [(_clip(t, MAX_CHARS), c) for t, c in rows]
            box = _Box(id="f:" + key, title=key, sub=_clip(sub, MAX_CHARS), rows=rows[:6],
                       lines=ids, src=main_line.src, kind="fwd")
            if len(rows) > 6:
                box.rows.append((f"+{len(rows) - 6} more", "more"))
        box.title_attr = "\n".join(lines[i].text for i in ids)
        boxes[box.id] = box
    fwd_ids = list(boxes)
    line_box: dict[int, str] = {}
    for b in boxes.values():
        for i in b.lines:
            line_box[i] = b.id
    # ---- derivative cards (one per op differentiated) and seeds
    card_of_block: dict[int, str] = {}
    for blk in model.blocks:
        cid = "c:" + (blk.key or f"#{blk.id}")
        card_of_block[blk.id] = cid
        if cid not in boxes:
            head = ("∂ " if blk.kind == "backward" else "tangent of ") + (blk.key or "?")
            boxes[cid] = _Box(id=cid, title=head, sub="", rows=[], lines=[], src=blk.src,
                              kind="card", blocks=[])
        box = boxes[cid]
        box.blocks.append(blk.id)
        for i in blk.lines:
            ln = lines[i]
            box.lines.append(i)
            line_box[i] = cid
            if ln.kind == "param":
                continue
            cls = "grad" if ln.grad else ("recomputed" if ln.recomputed_from else "")
            box.rows.append((ln.text, cls))
    seed_ids: list[str] = []
    for ln in lines:
        if ln.pane == "bwd" and ln.kind == "input" and ln.node:
            sid = "s:" + ln.node
            boxes[sid] = _Box(id=sid, title=ln.node, sub=("cotangent " if ln.text.find("cotangent") >= 0
                                                             else "tangent ") + ln.shape,
                              rows=[], lines=[ln.id], src=None, kind="seed")
            line_box[ln.id] = sid
            seed_ids.append(sid)
    card_ids = seed_ids + [c for c in dict.fromkeys(card_of_block.values())]
    for cid in card_ids:
        b = boxes[cid]
        if len(b.rows) > MAX_CARD_LINES:
            extra = len(b.rows) - MAX_CARD_LINES + 1
            b.rows = b.rows[:MAX_CARD_LINES - 1] + [(f"+{extra} more lines", "more")]
        b.rows = [(_clip(t, MAX_CHARS), c) for t, c in b.rows]
        if b.kind == "card":
            b.title_attr = "\n".join(lines[i].text for i in b.lines)
    if len(boxes) > max_boxes:
        return None
    for b in boxes.values():
        if b.kind in ("fwd", "input") and any(lines[i].saved for i in b.lines):
            b.tag_chars = len("saved ") + len(fmt_bytes(sum(lines[i].nbytes for i in b.lines
                                                            if lines[i].saved)))
        elif b.src is not None and b.kind in ("card", "fwd"):
            b.tag_chars = min(len(model.sources[b.src].short), 24)
        else:
            b.tag_chars = 0
        b.measure()

    # ---- edges
    name_box: dict[str, str] = {}
    for ln in lines:
        if ln.node and ln.id in line_box:
            name_box[ln.node] = line_box[ln.id]
    saved = {s.name for s in model.saved}
    f_edges: set[tuple[str, str]] = set()
    b_edges: set[tuple[str, str]] = set()
    r_edges: dict[tuple[str, str], list[str]] = {}
    for ln in lines:
        if ln.id not in line_box or ln.kind == "param":
            continue
        me = line_box[ln.id]
        for r in ln.refs:
            other = name_box.get(r)
            if other is None or other == me:
                continue
            if me.startswith("f:") and other.startswith("f:"):
                f_edges.add((other, me))
            elif not me.startswith("f:") and not other.startswith("f:"):
                b_edges.add((other, me))
            elif other.startswith("f:") and not me.startswith("f:"):
                if r in saved or model.policy == "":
                    r_edges.setdefault((other, me), [])
                    if r not in r_edges[(other, me)]:
                        r_edges[(other, me)].append(r)

    # ---- layout: forward column, then the cards in the rows of the ops they differentiate
    size = {k: (b.w, b.h) for k, b in boxes.items()}
    pf = place(fwd_ids, sorted(f_edges, key=lambda e: (fwd_ids.index(e[0]), fwd_ids.index(e[1]))),
               size, node_sep=22, tag="f")
    rank_b: dict[str, int] = {}
    out_node = model.graph.graph.output_node()
    for cid in card_ids:
        b = boxes[cid]
        if b.kind == "card":
            key = cid[2:]
            fb = name_box.get(key)
            if fb in pf.rank:
                rank_b[cid] = pf.rank[fb]
    # seeds: next to the output they seed (vjp) or the input they perturb (jvp)
    outs = [a.name for a in out_node.all_input_nodes]
    for sid in seed_ids:
        node = sid[2:]
        n = next((x for x in model.graph.graph.nodes if x.name == node), None)
        of = n.meta.get("fxad_tan_of") if n is not None else None
        target = name_box.get(str(of)) if of else None
        if target is None:
            fouts = [name_box.get(o) for o in outs if name_box.get(o, "").startswith("f:")]
            target = fouts[0] if fouts else None
        if target in pf.rank:
            rank_b[sid] = pf.rank[target]
    # cards of derivative nodes (a tangent of backward code): the row of that card
    for _ in range(3):
        for cid in card_ids:
            if cid in rank_b:
                continue
            key = cid[2:]
            other = name_box.get(key)
            if other in rank_b:
                rank_b[cid] = rank_b[other]
    # anything left: one row past its lowest placed input
    for cid in card_ids:
        if cid not in rank_b:
            ins = [rank_b[u] for u, v in b_edges if v == cid and u in rank_b]
            rank_b[cid] = (max(ins) + 1) if ins else 0
    pb = place(card_ids, sorted(b_edges, key=lambda e: (card_ids.index(e[0]) if e[0] in card_ids else 0,
                                                       card_ids.index(e[1]) if e[1] in card_ids else 0)),
               size, rank={c: rank_b[c] for c in card_ids}, node_sep=22, tag="b") \
        if card_ids else None
    n_ranks = max(len(pf.layers), len(pb.layers) if pb else 0, 1)

    def heights(p: Placement | None) -> list[float]:
        if p is None:
            return [0.0] * n_ranks
        hs = [max((p.size[n][1] for n in L), default=0.0) for L in p.layers]
        return hs + [0.0] * (n_ranks - len(hs))

    hf, hb = heights(pf), heights(pb)
    row_h = [max(a, b, 30.0) for a, b in zip(hf, hb)]
    margin = 24.0
    top0 = 40.0
    tops = rank_geometry(row_h, 34.0, top0)
    x0_f = margin
    x0_b = margin + pf.width + GUTTER
    pos: dict[str, tuple[float, float]] = {}
    for n, xv in pf.x.items():
        pos[n] = (x0_f + xv, tops[pf.rank[n]] + row_h[pf.rank[n]] / 2)
    if pb is not None:
        for n, xv in pb.x.items():
            r = pb.rank[n]
            pos[n] = (x0_b + xv, tops[r] + row_h[r] / 2)
    routes_f = route(pf, pos, tops, row_h)
    routes_b = route(pb, pos, tops, row_h) if pb is not None else []
    width = x0_b + (pb.width if pb else 0) + margin
    height = (tops[-1] + row_h[-1] + margin) if tops else 200.0

    # ---- SVG
    colors = {s.id: PALETTE[s.id % len(PALETTE)] for s in model.sources}
    out: list[str] = []
    out.append(f'<svg xmlns="http://www.w3.org/2000/svg" class="fxv-graph-svg" '
               f'viewBox="0 0 {width:.0f} {height:.0f}" width="{width:.0f}" '
               f'height="{height:.0f}" font-family="var(--fxv-mono)" font-size="11">')
    out.append(f'<defs><marker id="{uid}-af" viewBox="0 0 8 8" refX="7" refY="4" '
               'markerWidth="7" markerHeight="7" orient="auto-start-reverse">'
               '<path d="M0,0 L8,4 L0,8 z" class="fxv-ah-f"/></marker>'
               f'<marker id="{uid}-ab" viewBox="0 0 8 8" refX="7" refY="4" markerWidth="7" '
               'markerHeight="7" orient="auto-start-reverse"><path d="M0,0 L8,4 L0,8 z" '
               'class="fxv-ah-b"/></marker>'
               f'<marker id="{uid}-ar" viewBox="0 0 8 8" refX="7" refY="4" markerWidth="6" '
               'markerHeight="6" orient="auto-start-reverse"><path d="M0,0 L8,4 L0,8 z" '
               'class="fxv-ah-r"/></marker></defs>')
    # column titles and backgrounds
    if pb is not None:
        out.append(f'<rect class="fxv-col-bg fxv-col-bwd" x="{x0_b - GUTTER / 3:.0f}" y="8" '
                   f'width="{width - x0_b + GUTTER / 3 - 8:.0f}" height="{height - 16:.0f}" rx="10"/>')
    out.append(f'<text class="fxv-col-title" x="{x0_f:.0f}" y="26">FORWARD · ops, top to '
               'bottom</text>')
    if pb is not None:
        word = "BACKWARD" if model.mode in ("reverse", "mixed") else "TANGENTS"
        flow = "bottom to top, beside the op each card differentiates" \
            if model.mode in ("reverse", "mixed") else "beside the op each card differentiates"
        out.append(f'<text class="fxv-col-title fxv-col-title-b" x="{x0_b:.0f}" y="26">'
                   f'{word} · {flow}</text>')

    def path_d(pts: list[tuple[float, float]]) -> str:
        d = f"M{pts[0][0]:.1f},{pts[0][1]:.1f}"
        for (ax, ay), (bx, by) in zip(pts, pts[1:]):
            if abs(ax - bx) < 0.5 or abs(ay - by) < 0.5:
                d += f" L{bx:.1f},{by:.1f}"
            else:
                my = (by - ay) / 2
                d += f" C{ax:.1f},{ay + my:.1f} {bx:.1f},{by - my:.1f} {bx:.1f},{by:.1f}"
        return d

    n_edges = 0
    out.append('<g class="fxv-edges">')
    for u, v, pts in routes_f:
        out.append(f'<path class="fxv-e fxv-e-f" data-u="{_esc(u)}" data-v="{_esc(v)}" '
                   f'd="{path_d(pts)}" marker-end="url(#{uid}-af)"/>')
        n_edges += 1
    for u, v, pts in routes_b:
        out.append(f'<path class="fxv-e fxv-e-b" data-u="{_esc(u)}" data-v="{_esc(v)}" '
                   f'd="{path_d(pts)}" marker-end="url(#{uid}-ab)"/>')
        n_edges += 1
    for (u, v), names in r_edges.items():
        if u not in pos or v not in pos:
            continue
        (ux, uy), (vx, vy) = pos[u], pos[v]
        sx, ex = ux + boxes[u].w / 2, vx - boxes[v].w / 2
        mx = (sx + ex) / 2
        d = f"M{sx:.1f},{uy:.1f} C{mx:.1f},{uy:.1f} {mx:.1f},{vy:.1f} {ex - 2:.1f},{vy:.1f}"
        label = ", ".join(names)
        out.append(f'<path class="fxv-e fxv-e-r" data-u="{_esc(u)}" data-v="{_esc(v)}" d="{d}" '
                   f'marker-end="url(#{uid}-ar)"><title>saved: {_esc(label)}</title></path>')
        n_edges += 1
    out.append('</g><g class="fxv-boxes">')
    for bid, b in boxes.items():
        if bid not in pos:
            continue
        cx, cy = pos[bid]
        x, y = cx - b.w / 2, cy - b.h / 2
        cls = {"fwd": "fxv-box-f", "input": "fxv-box-in", "card": "fxv-box-c",
               "seed": "fxv-box-seed"}[b.kind]
        is_saved = any(lines[i].saved for i in b.lines) and b.kind in ("fwd", "input")
        is_rec = any(lines[i].node in model.recomputed for i in b.lines if lines[i].node)
        extra = (" fxv-box-saved" if is_saved else "") + (" fxv-box-rec" if is_rec else "")
        attrs = f'data-box="{_esc(bid)}" data-lines="{" ".join(map(str, b.lines))}"'
        if b.blocks:
            attrs += f' data-blocks="{" ".join(map(str, b.blocks))}"'
        out.append(f'<g class="fxv-box {cls}{extra}" {attrs} transform="translate({x:.1f},{y:.1f})">')
        out.append(f'<title>{_esc(b.title_attr or b.title)}</title>')
        out.append(f'<rect class="fxv-box-bg" width="{b.w:.1f}" height="{b.h:.1f}" rx="6"/>')
        if b.src is not None and b.src in colors:
            out.append(f'<rect class="fxv-stripe" width="4" height="{b.h - 8:.1f}" x="3" y="4" '
                       f'rx="2" fill="{colors[b.src]}"/>')
        ty = PAD + 9
        tx = PAD + 4
        out.append(f'<text class="fxv-bt" x="{tx}" y="{ty:.1f}">{_esc(_clip(b.title, MAX_CHARS))}</text>')
        if is_saved:  # the bytes kept for the backward, where the source tag would be
            total = sum(lines[i].nbytes for i in b.lines if lines[i].saved)
            tag, tcls = f"saved {fmt_bytes(total)}", "fxv-bsaved"
        elif b.src is not None and b.kind in ("card", "fwd"):
            tag, tcls = model.sources[b.src].short, "fxv-bsrc"
        else:
            tag, tcls = "", ""
        if tag and len(b.title) + len(tag) + 3 > b.w / CHAR - 2:
            b_w_new = (len(b.title) + len(tag) + 5) * CHAR + 2 * PAD
            tag = tag if b_w_new <= b.w else ""
        if tag:
            out.append(f'<text class="{tcls}" x="{b.w - PAD:.1f}" y="{ty:.1f}" '
                       f'text-anchor="end">{_esc(tag)}</text>')
        ty += LINE_H
        if b.sub:
            out.append(f'<text class="fxv-bsub" x="{tx}" y="{ty:.1f}">{_esc(b.sub)}</text>')
            ty += LINE_H
        for text, c in b.rows:
            out.append(f'<text class="fxv-brow {("fxv-brow-" + c) if c else ""}" x="{tx}" '
                       f'y="{ty:.1f}">{_esc(text)}</text>')
            ty += LINE_H
        out.append("</g>")
    out.append("</g></svg>")
    return GraphDrawing(svg="".join(out), width=width, height=height, n_boxes=len(boxes),
                        n_edges=n_edges)

