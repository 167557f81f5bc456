"""Static plots for reports: the memory timeline of a generated step, and operator coverage.

* :func:`memory` — live tensor bytes after each line of a graph made by fxad (from
  :func:`fxad.memory.simulate`), forward and backward shaded, the peak marked with the tensors
  alive there, the saved-tensor level dashed; one curve per residual policy when asked.
* :func:`coverage` — the OpInfo coverage table (``coverage_report.md``, written by
  ``python -m fxad.tools.coverage``) as a chart: the totals of the VJP and JVP columns and, per op
  namespace, how many ops pass, fall back, are missing, wrong, crash or are skipped.  It reads
  the report; it does not run the sweep.

Both return a ``matplotlib.figure.Figure`` (built without ``pyplot``, so they leave the
notebook's backend alone; Jupyter displays the figure) and write it to ``path`` when given
(``.png``, ``.svg``, ``.pdf``: the suffix picks the format).  matplotlib is an optional extra:
``pip install "fxad[plot]"``; without it these functions raise :class:`MissingExtraError`.
"""
from __future__ import annotations

import csv
import os
import re
from pathlib import Path
from typing import Any, Iterable, Sequence

from .errors import FxadError, InputError
from .view import View
from .view.model import build, fmt_bytes

__all__ = ["memory", "coverage", "read_coverage", "default_report", "MissingExtraError",
           "STATUS_COLORS"]

STATUS_COLORS = {"pass": "#16a34a", "fallback": "#84cc16", "missing": "#f59e0b",
                 "wrong": "#dc2626", "crash": "#7c3aed", "skip": "#cbd5e1"}
_FWD, _BWD, _SAVED, _PEAK = "#2563eb", "#d9480f", "#7c3aed", "#dc2626"


class MissingExtraError(FxadError, ImportError):
    """An optional dependency is not installed (the message names the extra to install)."""


def _matplotlib() -> tuple[Any, Any]:
    """``(Figure, FigureCanvasAgg)``, or :class:`MissingExtraError` naming the extra."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise MissingExtraError(
            f"fxad.plot needs matplotlib, which is not installed ({e})",
            hint='pip install "fxad[plot]"') from e
    return Figure, FigureCanvasAgg


def _save(fig: Any, path: str | os.PathLike | None) -> None:
    def png() -> bytes:  # Jupyter displays the figure without pyplot's inline backend
        import io

        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=110, bbox_inches="tight", facecolor="white")
        return buf.getvalue()

    fig._repr_png_ = png
    if path is None:
        return
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fmt = p.suffix.lstrip(".").lower() or "png"
    fig.savefig(p, format=fmt, dpi=150, bbox_inches="tight", facecolor="white")


def _unit(top: float) -> tuple[float, str]:
    for div, unit in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if top >= div:
            return float(div), unit
    return 1.0, "B"


# ------------------------------------------------------------------------------ memory

def memory(gm: Any, path: str | os.PathLike | None = None, *,
           policies: Sequence[Any] | None = None, title: str | None = None,
           width: float = 10.0, height: float = 4.2) -> Any:
    """Plot the simulated memory timeline of ``gm`` (see the module docstring).

    Args:
        gm: a graph module made by fxad (``fxad.vjp``, ``fxad.grad``, ``fxad.jvp``...) or a
            :class:`fxad.View`.
        path: where to save the figure (``.png``, ``.svg``, ``.pdf``); ``None``: do not save.
        policies: residual policies to compare (``[None, "min_memory"]``; ``None`` is the code
            as generated): one curve each, with each policy's saved bytes and peak in the
            legend.  Default: only the code as generated (or the view's own step).
        title: the figure title (default: the module's class name).
        width, height: figure size in inches.

    Returns:
        ``matplotlib.figure.Figure``.

    Raises:
        MissingExtraError: matplotlib is not installed (``pip install "fxad[plot]"``).
        fxad.InputError: a policy for a graph without backward code.
    """
    Figure, Canvas = _matplotlib()
    if isinstance(gm, View):
        models = [(gm.model.policy or "as generated", gm.model)]
    else:
        pols = list(policies) if policies is not None else [None]
        models = []
        for p in pols:
            m = build(gm, policy=p)
            label = "as generated" if p is None else (p if isinstance(p, str) else "custom policy")
            models.append((label, m))
    fig = Figure(figsize=(width, height), layout="constrained")
    Canvas(fig)
    ax = fig.add_subplot()
    top = max((m.peak_bytes for _, m in models), default=1) or 1
    div, unit = _unit(top)
    first = models[0][1]
    colors = [_FWD, "#0d9488", "#9333ea", "#ea580c"]
    if first.boundary < len(first.lines) and first.mode == "reverse":
        ax.axvspan(first.boundary + 0.5, len(first.lines) + 0.5, color=_BWD, alpha=0.05, lw=0)
        ax.axvline(first.boundary + 0.5, color=_BWD, lw=1, ls="--", alpha=0.7)
        ax.text(first.boundary + 0.3, 0.985, "forward ", transform=ax.get_xaxis_transform(),
                ha="right", va="top", fontsize=9, color="#555")
        ax.text(first.boundary + 0.7, 0.985, " backward" if first.mode != "forward" else " tangents",
                transform=ax.get_xaxis_transform(), ha="left", va="top", fontsize=9,
                color="#555")
    for k, (label, m) in enumerate(models):
        xs = [ln.id + 1 for ln in m.lines]
        ys = [ln.mem / div for ln in m.lines]
        c = colors[k % len(colors)]
        leg = f"{label}: peak {fmt_bytes(m.peak_bytes)}"
        if m.mode in ("reverse", "mixed"):
            leg += f", saved {fmt_bytes(m.saved_bytes)}"
        ax.step(xs, ys, where="mid", color=c, lw=1.6, label=leg)
        if k == 0:
            ax.fill_between(xs, ys, step="mid", color=c, alpha=0.13, lw=0)
        if m.peak_line is not None:
            px, py = m.peak_line + 1, m.peak_bytes / div
            ax.plot([px], [py], "o", color=_PEAK, ms=6, zorder=5)
            if k == 0:
                names = ", ".join(n for n, *_ in m.live_at_peak[:3])
                more = len(m.live_at_peak) - 3
                txt = (f"peak {fmt_bytes(m.peak_bytes)} at line {px} "
                       f"({m.lines[m.peak_line].node})\nalive: {names}"
                       + (f" +{more} more" if more > 0 else ""))
                right = px > 0.6 * len(m.lines)
                ax.annotate(txt, (px, py), xytext=(-10 if right else 10, -4),
                            textcoords="offset points", ha="right" if right else "left",
                            va="top", fontsize=8.5, color="#991b1b",
                            bbox=dict(boxstyle="round,pad=0.3", fc="white", ec="#fecaca",
                                      alpha=0.92))
        if m.saved_storage_bytes and m.mode in ("reverse", "mixed") and k == 0:
            sy = m.saved_storage_bytes / div
            ax.axhline(sy, color=_SAVED, lw=1, ls=(0, (5, 4)), alpha=0.8)
            ax.annotate(f"storage held by the saved tensors: {fmt_bytes(m.saved_storage_bytes)}",
                        (1, sy), xytext=(4, -3), textcoords="offset points", va="top",
                        ha="left", fontsize=8.5, color=_SAVED)
    ax.set_xlim(0.5, max(len(m.lines) for _, m in models) + 0.5)
    ax.set_ylim(0, top / div * 1.15)
    ax.set_xlabel("line of the generated code (forward, then backward)")
    ax.set_ylabel(f"live tensors ({unit})")
    ax.grid(axis="y", color="#e5e7eb", lw=0.8)
    ax.set_axisbelow(True)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    ax.legend(loc="upper left", fontsize=8.5, frameon=True, framealpha=0.9, edgecolor="none")
    ax.set_title(title or f"{first.title}: simulated memory (fxad.memory.simulate)",
                 fontsize=11, loc="left")
    _save(fig, path)
    return fig


# ------------------------------------------------------------------------------ coverage

_NAMESPACES = ("nn.functional", "linalg", "fft", "special", "masked", "sparse", "signal", "nn")


def _family(op: str) -> str:
    for ns in _NAMESPACES:
        if op.startswith(ns + "."):
            return "torch.nn.functional" if ns == "nn.functional" else f"torch.{ns}"
    return "torch"


def default_report() -> Path:
    """Where :func:`coverage` looks for a report by default: ``./coverage_report.md`` if it
    exists, else ``coverage_report.md`` at the root of the fxad checkout (which may not
    exist for an installed package)."""
    here = Path.cwd() / "coverage_report.md"
    if here.exists():
        return here
    repo = Path(__file__).resolve().parents[2] / "coverage_report.md"
    return repo


def read_coverage(report: str | os.PathLike | None = None) -> list[dict[str, Any]]:
    """Rows of a coverage report (``.md`` as written by ``python -m fxad.tools.coverage``, or
    ``.csv``): dicts with ``op``, ``samples``, ``status``, ``jvp``, ``reason``.

    Raises:
        fxad.InputError: the file does not exist or holds no coverage table.
    """
    path = Path(report) if report is not None else default_report()
    if not path.exists():
        raise InputError(f"no coverage report at {path}",
                         hint="write one with `python -m fxad.tools.coverage --out coverage_report.md` "
                              "(the OpInfo sweep; a few minutes on 2 cores) or pass report=")
    rows: list[dict[str, Any]] = []
    if path.suffix.lower() == ".csv":
        with open(path, newline="") as f:
            for r in csv.DictReader(f):
                rows.append({"op": r["op"], "samples": int(r.get("samples") or 0),
                             "status": r["status"], "jvp": r.get("jvp", "skip"),
                             "reason": r.get("reason", "")})
    else:
        cell = re.compile(r"(?<!\\)\|")
        for line in path.read_text(encoding="utf-8").splitlines():
            if not line.startswith("|") or line.startswith("|---") or line.startswith("| op "):
                continue
            parts = [c.strip() for c in cell.split(line.strip())[1:-1]]
            if len(parts) < 4:
                continue
            try:
                samples = int(parts[1])
            except ValueError:
                continue
            rows.append({"op": parts[0], "samples": samples, "status": parts[2],
                         "jvp": parts[3], "reason": parts[4] if len(parts) > 4 else ""})
    if not rows:
        raise InputError(f"{path} holds no coverage table (| op | samples | status | jvp | "
                         "reason | rows)")
    return rows


def coverage(path: str | os.PathLike | None = None, *,
             report: str | os.PathLike | Iterable[Any] | None = None,
             title: str | None = None, width: float = 10.0, height: float = 5.4) -> Any:
    """Plot operator coverage from a coverage report (see the module docstring).

    Args:
        path: where to save the figure (``.png``, ``.svg``, ``.pdf``); ``None``: do not save.
        report: the report to read (``coverage_report.md`` or ``.csv``; default:
            ``./coverage_report.md``, else the one at the root of the fxad checkout), or the
            ``OpResult`` list that :func:`fxad.tools.coverage.sweep` returns.
        title: figure title (default: the totals).
        width, height: figure size in inches.

    Returns:
        ``matplotlib.figure.Figure``.

    Raises:
        MissingExtraError: matplotlib is not installed (``pip install "fxad[plot]"``).
        fxad.InputError: no report found (it says how to make one).
    """
    Figure, Canvas = _matplotlib()
    if report is not None and not isinstance(report, (str, os.PathLike)):
        rows = [{"op": r.op, "samples": r.samples, "status": r.status, "jvp": r.jvp_status,
                 "reason": r.reason} for r in report]
    else:
        rows = read_coverage(report)
    statuses = list(STATUS_COLORS)
    n = len(rows)
    vjp = {s: sum(1 for r in rows if r["status"] == s) for s in statuses}
    covered = [r for r in rows if r["status"] in ("pass", "fallback")]
    jvp = {s: sum(1 for r in covered if r["jvp"] == s) for s in statuses}
    fams: dict[str, dict[str, int]] = {}
    for r in rows:
        d = fams.setdefault(_family(r["op"]), {s: 0 for s in statuses})
        d[r["status"]] = d.get(r["status"], 0) + 1
    order = sorted(fams, key=lambda f: -sum(fams[f].values()))

    fig = Figure(figsize=(width, height), layout="constrained")
    Canvas(fig)
    gs = fig.add_gridspec(2, 1, height_ratios=[1.1, max(2.0, 0.42 * len(order))])
    ax0 = fig.add_subplot(gs[0])
    ax1 = fig.add_subplot(gs[1])

    def stacked(ax: Any, labels: list[str], counts: list[dict[str, int]], show: bool) -> None:
        lefts = [0] * len(labels)
        xmax = max(sum(c.values()) for c in counts) or 1
        for s in statuses:
            vals = [c.get(s, 0) for c in counts]
            ax.barh(labels, vals, left=lefts, color=STATUS_COLORS[s], edgecolor="white",
                    lw=0.6, label=s if show else None, height=0.62)
            for i, v in enumerate(vals):
                total = sum(counts[i].values())
                if v and v / max(total, 1) > 0.06 and v >= 0.03 * xmax:
                    ax.text(lefts[i] + v / 2, i, str(v), ha="center", va="center",
                            fontsize=8.5, color="white" if s not in ("skip", "fallback")
                            else "#1f2937")
            lefts = [a + b for a, b in zip(lefts, vals)]
        ax.invert_yaxis()
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
        ax.tick_params(axis="y", length=0)

    n_cov = len(covered)
    stacked(ax0, [f"VJP ({n} ops)", f"JVP ({n_cov} covered)"], [vjp, jvp], True)
    ax0.set_xlim(0, n)
    ax0.legend(ncols=len(statuses), loc="lower center", bbox_to_anchor=(0.5, 1.0),
               frameon=False, fontsize=9)
    stacked(ax1, [f"{f} ({sum(fams[f].values())})" for f in order], [fams[f] for f in order],
            False)
    ax1.set_xlabel("OpInfo entries")
    ax1.grid(axis="x", color="#e5e7eb", lw=0.8)
    ax1.set_axisbelow(True)
    pct = 100.0 * vjp["pass"] / n if n else 0.0
    fig.suptitle(title or f"fxad operator coverage on PyTorch's OpInfo database: "
                          f"{vjp['pass']} of {n} pass with hand-written rules ({pct:.1f}%)",
                 fontsize=11, x=0.01, ha="left")
    _save(fig, path)
    return fig
