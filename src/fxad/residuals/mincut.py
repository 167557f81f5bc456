"""The policy's choice of saved values as a minimum s-t cut (the formulation of
AOTAutograd's rematerialization partitioner).

Each forward value ``v`` that the backward could read is an edge ``v_in -> v_out`` whose
capacity is the bytes saving it costs (infinite where it must be recomputed); the source
feeds the values that must be saved, every value feeds its users, and the values the
backward reads feed the sink.  A minimum cut saves the values whose edge it cuts and
recomputes the ones on the sink side; among minimum cuts the one closest to the sink is
taken, which recomputes least.
"""
from __future__ import annotations

import sys
from collections import deque
from typing import Callable

import torch.fx as fx

from ..errors import InputError

__all__ = ["min_cut"]

INF = 1 << 62


class Flow:
    """Dinic's max-flow on an adjacency-list graph with integer capacities."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.adj: list[list[int]] = [[] for _ in range(n)]
        self.to: list[int] = []
        self.cap: list[int] = []

    def add(self, u: int, v: int, c: int) -> None:
        self.adj[u].append(len(self.to)); self.to.append(v); self.cap.append(c)
        self.adj[v].append(len(self.to)); self.to.append(u); self.cap.append(0)

    def maxflow(self, s: int, t: int) -> int:
        total = 0
        while True:
            level = [-1] * self.n
            level[s] = 0
            q = deque([s])
            while q:
                u = q.popleft()
                for e in self.adj[u]:
                    if self.cap[e] > 0 and level[self.to[e]] < 0:
                        level[self.to[e]] = level[u] + 1
                        q.append(self.to[e])
            if level[t] < 0:
                return total
            it = [0] * self.n

            def dfs(u: int, f: int) -> int:
                if u == t:
                    return f
                while it[u] < len(self.adj[u]):
                    e = self.adj[u][it[u]]
                    v = self.to[e]
                    if self.cap[e] > 0 and level[v] == level[u] + 1:
                        d = dfs(v, min(f, self.cap[e]))
                        if d:
                            self.cap[e] -= d
                            self.cap[e ^ 1] += d
                            return d
                    it[u] += 1
                return 0

            while True:
                f = dfs(s, INF)
                if not f:
                    break
                total += f

    def reaches_sink(self, t: int) -> list[bool]:
        """Nodes that can reach ``t`` in the residual graph (the sink side of the min cut
        closest to the sink)."""
        seen = [False] * self.n
        seen[t] = True
        q = deque([t])
        while q:
            v = q.popleft()
            for e in self.adj[v]:  # reverse edge e^1 goes u -> v with residual cap[e^1]
                u = self.to[e]
                if not seen[u] and self.cap[e ^ 1] > 0:
                    seen[u] = True
                    q.append(u)
        return seen



def min_cut(avail: list[fx.Node], choice: dict[fx.Node, str], needed: set[fx.Node],
            cost: Callable[[fx.Node], int]) -> tuple[list[fx.Node], set[fx.Node]]:
    """``(saved, recomputed)``: the values of ``avail`` (the inputs and forward nodes, in
    graph order) to save, in that order, and the ones to recompute, given each one's
    ``choice`` (``"save"``, ``"recompute"`` or ``"cheap"``: recomputable where that saves
    bytes), the values the backward reads (``needed``) and the bytes saving a value costs.

    Raises:
        fxad.InputError: a forced recomputation needs a value that cannot be recomputed.
    """
    idx = {n: i for i, n in enumerate(avail)}
    # node v -> (in = 2i, out = 2i+1); source S, sink T
    N = len(avail)
    S, T = 2 * N, 2 * N + 1
    flow = Flow(2 * N + 2)
    for v in avail:
        i = idx[v]
        c = choice[v]
        flow.add(2 * i, 2 * i + 1, INF if c == "recompute" else cost(v))
        if c == "save":
            flow.add(S, 2 * i, INF)
        for a in v.all_input_nodes:
            if a in idx:
                flow.add(2 * idx[a] + 1, 2 * i, INF)
        if v in needed:
            flow.add(2 * i + 1, T, INF)
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 4 * N + 1000))
    try:
        cut = flow.maxflow(S, T)
    finally:
        sys.setrecursionlimit(limit)
    if cut >= INF:
        raise InputError("the residual policy forces recomputation of a value that cannot be "
                         "recomputed (it depends on an input, a side effect or a random op "
                         "through a node marked 'recompute')")
    sink_side = flow.reaches_sink(T)
    saved = [v for v in avail if not sink_side[2 * idx[v]] and sink_side[2 * idx[v] + 1]]
    recompute = {v for v in avail if sink_side[2 * idx[v]] and sink_side[2 * idx[v] + 1]}
    return saved, recompute
