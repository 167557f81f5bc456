"""Layered drawing of a directed graph (the Sugiyama scheme), in pure Python.

:func:`place` puts each node in a rank (a row) and orders the nodes of every rank:

1. **ranks**: given, or the longest path from the sources, with source nodes pulled down
   next to their first user;
2. **long edges** get one dummy node per rank they cross, so that they can bend around nodes;
3. **order** within ranks: barycenter sweeps, down and up, keeping the order with the fewest
   crossings, then swaps of neighbours that remove crossings;
4. **x**: each node moves toward the mean x of its neighbours in the ranks above and below,
   under the constraint that the order is kept with a gap between boxes: for one rank, the
   least-squares placement under ordering constraints is an isotonic regression, solved
   exactly by pool-adjacent-violators.  A few sweeps straighten long edges and center nodes
   over their inputs.

:func:`layered_layout` adds y (rank heights from the tallest box of each rank) and edge routes
through the dummies.  Edges may point up or down (a backward graph flows upward); edges
inside one rank are routed as arcs.  Used by :mod:`fxad.view.graph`; no third-party library.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Iterable, Sequence

Node = Hashable

__all__ = ["Placement", "Layout", "place", "layered_layout", "assign_ranks", "crossings"]


@dataclass
class Placement:
    """Ranks, order and x of the nodes of one graph (see :func:`place`)."""

    rank: dict[Node, int]
    layers: list[list[Node]]               # per rank, left to right (dummies included)
    x: dict[Node, float]                   # center x
    chains: list[tuple[Node, Node, list[Node]]]  # edge (u, v) through its dummies
    flat: list[tuple[Node, Node]]          # edges within one rank
    size: dict[Node, tuple[float, float]]
    width: float = 0.0

    def is_dummy(self, n: Node) -> bool:
        return isinstance(n, tuple) and len(n) == 3 and n[0] == "~dummy"


@dataclass
class Layout:
    """A finished drawing: node centers, edge polylines and the canvas size."""

    pos: dict[Node, tuple[float, float]]
    size: dict[Node, tuple[float, float]]
    routes: list[tuple[Node, Node, list[tuple[float, float]]]]
    width: float
    height: float
    rank: dict[Node, int] = field(default_factory=dict)
    rank_top: list[float] = field(default_factory=list)
    rank_height: list[float] = field(default_factory=list)


def assign_ranks(nodes: Sequence[Node], edges: Iterable[tuple[Node, Node]]) -> dict[Node, int]:
    """Longest-path ranks of a DAG (``nodes`` in a topological order); nodes without inputs
    are moved down to just above their first user."""
    preds: dict[Node, list[Node]] = {n: [] for n in nodes}
    succs: dict[Node, list[Node]] = {n: [] for n in nodes}
    for u, v in edges:
        if u in preds and v in preds and u != v:
            preds[v].append(u)
            succs[u].append(v)
    rank: dict[Node, int] = {}
    for n in nodes:
        rank[n] = max((rank[p] + 1 for p in preds[n] if p in rank), default=0)
    for n in reversed(list(nodes)):
        if not preds[n] and succs[n]:
            rank[n] = max(0, min(rank[s] for s in succs[n]) - 1)
    low = min(rank.values(), default=0)
    return {n: r - low for n, r in rank.items()}


def _count(layer_a: list[Node], layer_b: list[Node], adj: dict[Node, list[Node]]) -> int:
    """Crossings between two neighbouring ranks (``adj``: neighbours in ``layer_b``)."""
    pos_b = {n: i for i, n in enumerate(layer_b)}
    seq: list[int] = []
    for n in layer_a:
        seq.extend(sorted(pos_b[m] for m in adj.get(n, ()) if m in pos_b))
    # inversions of seq (merge sort)
    def sort(a: list[int]) -> tuple[list[int], int]:
        if len(a) <= 1:
            return a, 0
        mid = len(a) // 2
        left, c1 = sort(a[:mid])
        right, c2 = sort(a[mid:])
        out, i, j, c = [], 0, 0, c1 + c2
        while i < len(left) and j < len(right):
            if left[i] <= right[j]:
                out.append(left[i]); i += 1
            else:
                out.append(right[j]); j += 1
                c += len(left) - i
        out.extend(left[i:]); out.extend(right[j:])
        return out, c
    return sort(seq)[1]


def crossings(layers: list[list[Node]], down: dict[Node, list[Node]]) -> int:
    """Total edge crossings of an ordered layering (``down``: neighbours one rank below)."""
    return sum(_count(layers[r], layers[r + 1], down) for r in range(len(layers) - 1))


def _pav(target: list[float], weight: list[float], gap: list[float]) -> list[float]:
    """Least-squares x for targets, keeping ``x[i+1] - x[i] >= gap[i]`` (isotonic regression
    on ``x - offset``, pool-adjacent-violators)."""
    n = len(target)
    off = [0.0] * n
    for i in range(1, n):
        off[i] = off[i - 1] + gap[i - 1]
    # blocks: [sum w*t, sum w, count]
    blocks: list[list[float]] = []
    for i in range(n):
        blocks.append([weight[i] * (target[i] - off[i]), weight[i], 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s, w, c = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += w
            blocks[-1][2] += c
    out: list[float] = []
    for s, w, c in blocks:
        out.extend([s / w] * int(c))
    return [out[i] + off[i] for i in range(n)]


def place(nodes: Sequence[Node], edges: Iterable[tuple[Node, Node]],
          size: dict[Node, tuple[float, float]], *, rank: dict[Node, int] | None = None,
          node_sep: float = 18.0, sweeps: int = 12, x_iterations: int = 24,
          tag: str = "") -> Placement:
    """Ranks, order and x of a graph (see the module docstring).

    Args:
        nodes: node ids, in a topological order (it seeds the order within ranks).
        edges: ``(u, v)`` pairs; edges to unknown nodes and self loops are ignored.
        size: ``(width, height)`` of each node.
        rank: fixed ranks (any integers); default :func:`assign_ranks`.
        node_sep: horizontal gap between boxes.
        tag: prefix of the dummy ids (distinct tags keep two placements' dummies apart).
    """
    nodes = list(nodes)
    known = set(nodes)
    elist = [(u, v) for u, v in edges if u in known and v in known and u != v]
    seen_e: set[tuple[Node, Node]] = set()
    elist = [e for e in elist if not (e in seen_e or seen_e.add(e))]  # type: ignore[func-returns-value]
    rk = dict(rank) if rank is not None else assign_ranks(nodes, elist)
    low = min(rk.values(), default=0)
    if rank is None or low < 0:  # given ranks keep their rows (they align with another column)
        rk = {n: rk[n] - low for n in nodes}
    n_ranks = max(rk.values(), default=-1) + 1
    order_key: dict[Node, float] = {n: float(i) for i, n in enumerate(nodes)}
    sz = dict(size)
    chains: list[tuple[Node, Node, list[Node]]] = []
    flat: list[tuple[Node, Node]] = []
    down: dict[Node, list[Node]] = {n: [] for n in nodes}
    up: dict[Node, list[Node]] = {n: [] for n in nodes}
    k = 0
    for u, v in elist:
        ru, rv = rk[u], rk[v]
        if ru == rv:
            flat.append((u, v))
            continue
        step = 1 if rv > ru else -1
        path = [u]
        for r in range(ru + step, rv, step):
            d = ("~dummy", f"{tag}{k}", r)
            k += 1
            rk[d] = r
            sz[d] = (0.0, 0.0)
            order_key[d] = (order_key[u] + order_key[v]) / 2
            down[d], up[d] = [], []
            path.append(d)
        path.append(v)
        for a, b in zip(path, path[1:]):
            if rk[a] < rk[b]:
                down[a].append(b); up[b].append(a)
            else:
                down[b].append(a); up[a].append(b)
        chains.append((u, v, path[1:-1]))
    layers: list[list[Node]] = [[] for _ in range(n_ranks)]
    for n in sorted(rk, key=lambda m: order_key[m]):
        layers[rk[n]].append(n)

    # --- order: barycenter sweeps, keep the best
    def reorder(layer: list[Node], fixed: list[Node], adj: dict[Node, list[Node]]) -> list[Node]:
        pos = {n: i for i, n in enumerate(fixed)}
        scale = len(fixed) / max(1, len(layer))
        keyed = []
        for i, n in enumerate(layer):
            ps = [pos[m] for m in adj[n] if m in pos]
            keyed.append((sum(ps) / len(ps) if ps else i * scale, i, n))
        keyed.sort(key=lambda t: (t[0], t[1]))
        return [t[2] for t in keyed]

    best = [list(L) for L in layers]
    best_c = crossings(layers, down)
    for it in range(sweeps):
        if best_c == 0:
            break
        if it % 2 == 0:
            for r in range(1, n_ranks):
                layers[r] = reorder(layers[r], layers[r - 1], up)
        else:
            for r in range(n_ranks - 2, -1, -1):
                layers[r] = reorder(layers[r], layers[r + 1], down)
        c = crossings(layers, down)
        if c < best_c:
            best_c, best = c, [list(L) for L in layers]
    layers = best

    # adjacent swaps that remove crossings
    def local(a: Node, b: Node, r: int) -> int:
        c = 0
        for nb, other in ((up, r - 1), (down, r + 1)):
            if not 0 <= other < n_ranks:
                continue
            pos = {n: i for i, n in enumerate(layers[other])}
            pa = [pos[m] for m in nb[a] if m in pos]
            pb = [pos[m] for m in nb[b] if m in pos]
            c += sum(1 for x in pa for y in pb if x > y)
        return c

    for _ in range(4):
        improved = False
        for r in range(n_ranks):
            L = layers[r]
            for i in range(len(L) - 1):
                if local(L[i + 1], L[i], r) < local(L[i], L[i + 1], r):
                    L[i], L[i + 1] = L[i + 1], L[i]
                    improved = True
        if not improved:
            break

    # --- x: pull toward neighbours, keep order and gaps
    x: dict[Node, float] = {}
    dummy_sep = node_sep / 2

    def gaps(L: list[Node]) -> list[float]:
        out = []
        for a, b in zip(L, L[1:]):
            sep = dummy_sep if (sz[a][0] == 0 or sz[b][0] == 0) else node_sep
            out.append((sz[a][0] + sz[b][0]) / 2 + sep)
        return out

    for L in layers:
        cur = 0.0
        for i, n in enumerate(L):
            if i:
                cur += gaps([L[i - 1], n])[0]
            x[n] = cur
    if n_ranks:
        widest = max(range(n_ranks), key=lambda r: x[layers[r][-1]] if layers[r] else 0)
        span = x[layers[widest][-1]] if layers[widest] else 0
        for L in layers:  # center every rank under the widest one to start
            if L:
                shift = (span - x[L[-1]]) / 2
                for n in L:
                    x[n] += shift
    for it in range(x_iterations):
        order = range(n_ranks) if it % 2 == 0 else range(n_ranks - 1, -1, -1)
        for r in order:
            L = layers[r]
            if not L:
                continue
            target, weight = [], []
            for n in L:
                nb = up[n] + down[n]
                if nb:
                    target.append(sum(x[m] for m in nb) / len(nb))
                    is_d = sz[n][0] == 0
                    weight.append(4.0 if is_d else 1.0 + 0.25 * len(nb))
                else:
                    target.append(x[n])
                    weight.append(0.2)
            new = _pav(target, weight, gaps(L))
            for n, v in zip(L, new):
                x[n] = v
    lo = min((x[n] - sz[n][0] / 2 for n in x), default=0.0)
    for n in x:
        x[n] -= lo
    width = max((x[n] + sz[n][0] / 2 for n in x), default=0.0)
    return Placement(rank=rk, layers=layers, x=x, chains=chains, flat=flat, size=sz,
                     width=width)


def rank_geometry(heights: Sequence[float], rank_sep: float, top: float = 0.0
                  ) -> list[float]:
    """Top y of each rank given the rank heights."""
    out, y = [], top
    for h in heights:
        out.append(y)
        y += h + rank_sep
    return out


def route(p: Placement, pos: dict[Node, tuple[float, float]], rank_top: list[float],
          rank_height: list[float]) -> list[tuple[Node, Node, list[tuple[float, float]]]]:
    """Polylines of the edges of ``p``: from the side of ``u`` that faces ``v``, down (or up)
    through the dummies (vertical inside each rank they cross), to ``v``; ports spread along
    the box edge in the order of the other end."""
    routes = []
    out_ports: dict[tuple[Node, int], list[tuple[float, int]]] = {}
    in_ports: dict[tuple[Node, int], list[tuple[float, int]]] = {}
    for i, (u, v, dummies) in enumerate(p.chains):
        first = dummies[0] if dummies else v
        last = dummies[-1] if dummies else u
        d = 1 if p.rank[v] > p.rank[u] else -1
        out_ports.setdefault((u, d), []).append((pos[first][0], i))
        in_ports.setdefault((v, d), []).append((pos[last][0], i))

    def spread(ports: dict[tuple[Node, int], list[tuple[float, int]]]) -> dict[int, float]:
        res: dict[int, float] = {}
        for (n, _), lst in ports.items():
            lst.sort()
            w = p.size[n][0]
            k = len(lst)
            step = min(10.0, (w * 0.7) / max(1, k - 1)) if k > 1 else 0.0
            for j, (_, i) in enumerate(lst):
                res[i] = pos[n][0] + (j - (k - 1) / 2) * step
        return res

    ox, ix = spread(out_ports), spread(in_ports)
    for i, (u, v, dummies) in enumerate(p.chains):
        d = 1 if p.rank[v] > p.rank[u] else -1
        (ux, uy), (vx, vy) = pos[u], pos[v]
        pts = [(ox[i], uy + d * p.size[u][1] / 2)]
        for dm in dummies:
            r = p.rank[dm]
            a, b = rank_top[r], rank_top[r] + rank_height[r]
            pts.extend([(pos[dm][0], a if d > 0 else b), (pos[dm][0], b if d > 0 else a)])
        pts.append((ix[i], vy - d * p.size[v][1] / 2))
        routes.append((u, v, pts))
    for u, v in p.flat:
        (ux, uy), (vx, vy) = pos[u], pos[v]
        s = 1 if vx > ux else -1
        routes.append((u, v, [(ux + s * p.size[u][0] / 2, uy), (vx - s * p.size[v][0] / 2, vy)]))
    return routes


def layered_layout(nodes: Sequence[Node], edges: Iterable[tuple[Node, Node]],
                   size: dict[Node, tuple[float, float]], *, rank: dict[Node, int] | None = None,
                   rank_sep: float = 36.0, node_sep: float = 18.0, margin: float = 16.0
                   ) -> Layout:
    """A complete layered drawing of one graph (see the module docstring)."""
    p = place(nodes, edges, size, rank=rank, node_sep=node_sep)
    heights = [max((p.size[n][1] for n in L), default=0.0) for L in p.layers]
    tops = rank_geometry(heights, rank_sep, margin)
    pos = {n: (p.x[n] + margin, tops[p.rank[n]] + heights[p.rank[n]] / 2) for n in p.x}
    routes = route(p, pos, tops, heights)
    height = (tops[-1] + heights[-1] + margin) if tops else 2 * margin
    real = {n: pos[n] for n in nodes if n in pos}
    return Layout(pos=real, size={n: p.size[n] for n in real}, routes=routes,
                  width=p.width + 2 * margin, height=height, rank=dict(p.rank),
                  rank_top=tops, rank_height=heights)
