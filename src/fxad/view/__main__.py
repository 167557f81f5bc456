"""``python -m fxad.view --demo [OUT.html] [--screenshot PNG] [--policy P]``: an alias of
``fxad view --demo`` (the same code, :mod:`fxad.view.command`).

Writes the view of ``fxad.vjp`` of the demo's transformer block (block 0 of TinyGPT as
``fxad demo`` builds it) and, with ``--screenshot``, renders it in a headless Chromium with the
backward block of the MLP's GELU hovered, and a picture of the dataflow graph beside it
(``<name>_graph.png``)::

    python -m fxad.view --demo docs/images/view_tinygpt_block.html \\
        --screenshot docs/images/view_tinygpt_block.png
"""
from __future__ import annotations

import sys
from typing import Sequence

from ..argparsing import ArgumentParser
from . import demo_view
from .command import add_page_arguments, write_page

#: the forward node whose backward block is hovered in the demo's screenshot
DEMO_HOVER = "gelu"


def main(argv: Sequence[str] | None = None) -> int:
    p = ArgumentParser(prog="python -m fxad.view", description=__doc__.split("\n\n")[0])
    p.add_argument("--demo", action="store_true", required=True,
                   help="view the demo's transformer block")
    p.add_argument("out", nargs="?", default=None, help="HTML file to write")
    add_page_arguments(p, hover=DEMO_HOVER)
    a = p.parse_args(argv)
    if a.out is None and a.screenshot is None:
        p.error("give an OUT.html and/or --screenshot PNG")
    return write_page(demo_view(policy=a.policy), a.out, screenshot=a.screenshot,
                      width=a.width, height=a.height, hover=a.hover)


if __name__ == "__main__":
    sys.exit(main())
