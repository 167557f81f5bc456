"""Writing a view page from the command line: the code shared by ``fxad view`` and its
alias ``python -m fxad.view --demo``.

:func:`add_page_arguments` declares the options both accept (``--out``, ``--policy``,
``--screenshot``, ``--width``, ``--height``, ``--hover``); :func:`write_page` writes the HTML
and, with ``screenshot``, renders it in a headless Chromium with one backward block hovered,
plus a picture of the dataflow graph beside it (``<name>_graph.png``).  This is how
``docs/images/view_tinygpt_block.png`` is made::

    fxad view --demo -o docs/images/view_tinygpt_block.html \\
        --screenshot docs/images/view_tinygpt_block.png
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

from . import View
from .browser import open_page

__all__ = ["add_page_arguments", "write_page", "HOVER"]

#: the element hovered in a screenshot: the lines of the backward block of one forward node
HOVER = '.fxv-blk[data-b="{b}"] .fxv-ln'


def add_page_arguments(p: argparse.ArgumentParser, *, hover: str | None = None) -> None:
    """Add the page options to ``p``; ``hover`` is the default of ``--hover``."""
    p.add_argument("--policy", default=None, choices=["save", "min_memory"],
                   help="show the training step of this residual policy (default: the code "
                        "as generated)")
    p.add_argument("--screenshot", default=None, metavar="PNG",
                   help="also save a screenshot (headless Chromium through Playwright) and "
                        "one of the dataflow graph, PNG_graph.png")
    p.add_argument("--width", type=int, default=1600, help="screenshot width in pixels")
    p.add_argument("--height", type=int, default=1250, help="screenshot height in pixels")
    p.add_argument("--hover", default=hover, metavar="NODE",
                   help="forward node whose backward block is hovered in the screenshot"
                        + (f" (default {hover})" if hover else ""))


def write_page(v: View, out: str | Path | None, *, screenshot: str | Path | None = None,
               width: int = 1600, height: int = 1250, hover: str | None = None,
               log: Callable[[str], Any] = print) -> int:
    """Write ``v`` to ``out`` (when given) and a screenshot (when asked); returns the exit
    status (1 if the page logged errors in the browser).

    Raises:
        fxad.view.browser.BrowserUnavailable: a screenshot without Chromium or Playwright.
        OSError: a file cannot be written.
    """
    with tempfile.TemporaryDirectory() as d:
        html_path = Path(out) if out else Path(d) / "view.html"
        v.save(html_path)
        if out:
            log(f"wrote {html_path} ({html_path.stat().st_size // 1024} KiB, self-contained: "
                "open it in a browser)")
        if not screenshot:
            return 0
        shot = Path(screenshot)
        graph_shot = shot.with_name(shot.stem + "_graph" + shot.suffix)
        blk = next((b.id for b in v.model.blocks if b.key == hover), None) if hover else None

        def body(page: Any, errors: list[str]) -> list[str]:
            if blk is not None:
                page.hover(HOVER.format(b=blk))
                page.wait_for_timeout(100)
            shot.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(shot))
            # the dataflow drawing, taller, fitted to its width, the same block pinned
            page.mouse.move(0, 0)
            page.evaluate("b => { const r = document.querySelector('.fxv'); r.fxv.fit(1250);"
                          " if (b !== null) r.fxv.pin(['b', b]); }", blk)
            page.wait_for_timeout(100)
            page.locator(".fxv-graph").screenshot(path=str(graph_shot))
            return list(errors)

        errors = open_page(html_path, body, width=width, height=height)
    if errors:
        print("page errors:\n  " + "\n  ".join(errors), file=sys.stderr)
        return 1
    log(f"wrote {shot} and {graph_shot}")
    return 0
