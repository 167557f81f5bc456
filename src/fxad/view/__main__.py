"""``python -m fxad.view --demo [OUT.html] [--screenshot PNG] [--policy P]``.

Writes the view of ``fxad.vjp`` of the demo's transformer block (block 0 of TinyGPT as
``fxad demo`` builds it) and, with ``--screenshot``, renders it in a headless Chromium with a
backward block hovered, and a picture of the dataflow graph beside it (``<name>_graph.png``): this is how
``docs/images/view_tinygpt_block.png`` (the README's picture) is made::

    python -m fxad.view --demo docs/images/view_tinygpt_block.html \\
        --screenshot docs/images/view_tinygpt_block.png
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Sequence

from . import demo_view
from .browser import open_page

#: the block hovered in the README screenshot: the backward of the MLP's GELU
HOVER = '.fxv-blk[data-b="{b}"] .fxv-ln'


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fxad.view", description=__doc__.split("\n\n")[0])
    p.add_argument("--demo", action="store_true", required=True,
                   help="view the demo's transformer block")
    p.add_argument("out", nargs="?", default=None, help="HTML file to write")
    p.add_argument("--policy", default=None, choices=["save", "min_memory"],
                   help="residual policy (default: the code as generated)")
    p.add_argument("--screenshot", default=None, metavar="PNG",
                   help="also save a screenshot (headless Chromium through Playwright)")
    p.add_argument("--width", type=int, default=1600)
    p.add_argument("--height", type=int, default=1250)
    p.add_argument("--hover", default="gelu", help="forward node whose backward block is "
                   "hovered in the screenshot (default gelu)")
    a = p.parse_args(argv)
    v = demo_view(policy=a.policy)
    if a.out is None and a.screenshot is None:
        p.error("give an OUT.html and/or --screenshot PNG")
    with tempfile.TemporaryDirectory() as d:
        html_path = Path(a.out) if a.out else Path(d) / "view.html"
        v.save(html_path)
        if a.out:
            print(f"wrote {html_path} ({html_path.stat().st_size // 1024} KiB)")
        if a.screenshot:
            shot = Path(a.screenshot)
            graph_shot = shot.with_name(shot.stem + "_graph" + shot.suffix)
            blk = next((b.id for b in v.model.blocks if b.key == a.hover), 0)

            def body(page: object, errors: list[str]) -> list[str]:
                page.hover(HOVER.format(b=blk))  # type: ignore[attr-defined]
                page.wait_for_timeout(100)  # type: ignore[attr-defined]
                shot.parent.mkdir(parents=True, exist_ok=True)
                page.screenshot(path=str(shot))  # type: ignore[attr-defined]
                # the dataflow drawing, taller, fitted to its width, the same block pinned
                page.mouse.move(0, 0)  # type: ignore[attr-defined]
                page.evaluate(  # type: ignore[attr-defined]
                    "b => { const r = document.querySelector('.fxv'); r.fxv.fit(1250);"
                    " r.fxv.pin(['b', b]); }", blk)
                page.wait_for_timeout(100)  # type: ignore[attr-defined]
                page.locator(".fxv-graph").screenshot(  # type: ignore[attr-defined]
                    path=str(graph_shot))
                return list(errors)

            errors = open_page(html_path, body, width=a.width, height=a.height)
            if errors:
                print("page errors:\n  " + "\n  ".join(errors), file=sys.stderr)
                return 1
            print(f"wrote {shot} and {graph_shot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
