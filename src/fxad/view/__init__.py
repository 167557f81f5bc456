"""See the derivative: an interactive HTML view of generated forward, backward and memory.

``fxad.view(gm)`` returns a :class:`View` of a graph module made by fxad: one self-contained
HTML page (inline CSS, SVG and script; nothing is fetched from the network) with

* the forward code and the backward code side by side, shapes and dtypes on every line;
  hovering (or clicking, to pin) a backward block highlights the forward line it
  differentiates and shows the user's source line it was recorded from;
* the saved tensors (residuals) marked, with their bytes, per the residual policy;
* a memory timeline: live tensor bytes after each line (:func:`fxad.memory.simulate`), the
  peak, and the tensors alive at the peak;
* a dataflow drawing (SVG, pan and zoom): forward ops on the left, the backward code of each
  op on the right in the same row, colored by source line.

In Jupyter the object displays itself (``_repr_html_``); ``.save(path)`` writes the page;
``fxad view FILE.py:NAME --input ... -o OUT.html`` does the same from the command line.
``fxad view --demo -o OUT.html`` (or ``python -m fxad.view --demo OUT.html``) writes the view
of the demo's transformer block (``--screenshot PNG`` also renders it with a headless
Chromium).  ``repr(view)`` counts lines as the page's header does.

The function ``fxad.view`` shadows this module's name on the ``fxad`` package; import the
rest from the module itself (``from fxad.view import View``).
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx

from ..api import vjp
from ..demo.models import TinyGPT
from ..errors import InputError
from ..training import FxadModule
from .browser import render_page
from .model import ViewModel, build, fmt_bytes
from .render import fragment, new_uid, page

__all__ = ["view", "View", "ViewModel", "demo_module", "fmt_bytes"]

_UNSET: Any = object()


class View:
    """The view of one graph module (see the module docstring).

    Attributes:
        model: the :class:`~fxad.view.model.ViewModel` drawn (lines, blocks, saved tensors,
            memory); ``model.graph`` is the graph shown.
    """

    def __init__(self, model: ViewModel) -> None:
        self.model = model

    def html(self) -> str:
        """The complete HTML document (self-contained)."""
        return page(self.model, new_uid())

    def _repr_html_(self) -> str:
        # a fresh id per display: two outputs of the same view must not share element ids
        return fragment(self.model, new_uid())

    def save(self, path: str | os.PathLike) -> Path:
        """Write the page to ``path`` (UTF-8 HTML); returns the path.

        Raises:
            OSError: the file cannot be written.
        """
        p = Path(path)
        p.write_text(self.html(), encoding="utf-8")
        return p

    def screenshot(self, path: str | os.PathLike, *, width: int = 1600, height: int = 1000,
                   full_page: bool = False) -> Path:
        """Render the page in a headless Chromium and save a PNG screenshot (needs a Chromium
        and Playwright, see :mod:`fxad.view.browser`); returns the path.

        Raises:
            fxad.view.browser.BrowserUnavailable: no browser or no Playwright.
            RuntimeError: the page logged errors to the console.
        """
        with tempfile.TemporaryDirectory() as d:
            html_path = self.save(Path(d) / "view.html")
            errors = render_page(html_path, screenshot=Path(path), width=width, height=height,
                                 full_page=full_page)
        if errors:
            raise RuntimeError("the page logged errors: " + "; ".join(errors))
        return Path(path)

    def __repr__(self) -> str:
        m = self.model  # the counts of the page's header, in its words
        text = f"<fxad.View {m.title}: {m.code_lines('fwd')} forward lines"
        if m.derivative_word:
            text += (f", {m.code_lines('bwd')} {m.derivative_word} lines in "
                     f"{len(m.blocks)} blocks")
        if m.mode in ("reverse", "mixed"):
            text += f", saved {len(m.saved)} tensors ({fmt_bytes(m.saved_bytes)})"
        return text + f", peak {fmt_bytes(m.peak_bytes)}>"


def view(obj: Any, *inputs: Any, policy: Any = _UNSET, title: str | None = None) -> View:
    """An interactive HTML view of generated derivative code (see :mod:`fxad.view`).

    Args:
        obj: a graph module made by fxad (``fxad.vjp``, ``fxad.grad``, ``fxad.jvp``,
            ``fxad.hvp``, ``fxad.trace``); or a module returned by ``fxad.compile`` (its
            capture for ``inputs``, or its latest one; its policy); or a function or
            ``nn.Module`` with example ``inputs`` (viewed as ``fxad.vjp(obj, *inputs)``).
        inputs: example inputs, for a function, a module or an ``fxad.compile`` module.
        policy: residual policy.  Default: the code as generated, where every forward value
            the backward reads is kept (``"save"``); for an ``fxad.compile`` module, its own
            policy.  ``"min_memory"`` or a :class:`fxad.Policy`: the page shows the training
            step that policy runs (``fxad.residuals.joint_graph``), with the values it
            recomputes in the backward and its smaller saved set.
        title: heading of the page (default: the class name of the graph module).

    Returns:
        :class:`View`: ``_repr_html_()`` for Jupyter, ``.save(path)``, ``.html()``.

    Raises:
        fxad.InputError: ``obj`` is not something fxad generated and no inputs were given; a
            policy for a graph without backward code.
        fxad.FxadError: from ``fxad.vjp`` when ``obj`` is a function or module.
    """
    if isinstance(obj, View):
        return obj
    if isinstance(obj, FxadModule):
        plan = obj.plan(*inputs) if inputs else _latest_plan(obj)
        gm = plan.vjp_gm
        pol = obj.policy if policy is _UNSET else policy
        if pol in (None, "save"):
            pol = None
        name = title or f"{type(obj.module).__name__} (fxad.compile, policy {obj.policy!r})"
        return View(build(gm, policy=pol, title=name))
    if isinstance(obj, fx.GraphModule) and ("fxad_forward" in obj.meta or not inputs):
        return View(build(obj, policy=None if policy is _UNSET else policy, title=title))
    if not inputs:
        raise InputError(f"fxad.view needs a graph module made by fxad, or example inputs to "
                         f"differentiate {type(obj).__name__} (fxad.view(model, x, y))")
    gm = vjp(obj, *inputs)
    name = title or (type(obj).__name__ if isinstance(obj, torch.nn.Module)
                     else getattr(obj, "__name__", "f"))
    return View(build(gm, policy=None if policy is _UNSET else policy, title=name))


def _latest_plan(m: Any) -> Any:
    plans = getattr(m, "_plans", None)
    if not plans:
        raise InputError("this fxad.compile module has not run yet: call it once, or pass "
                         "example inputs: fxad.view(m, x, y)")
    return next(reversed(plans.values()))


def demo_module(batch: int = 16, seed: int = 0) -> tuple[torch.nn.Module, torch.Tensor]:
    """The demo's transformer block (block 0 of ``TinyGPT`` as ``fxad demo`` builds it:
    width 64, 4 heads, context 64) and an input batch ``[batch, 64, 64]``."""
    torch.manual_seed(seed)
    model = TinyGPT(96, block_size=64, n_layer=2, n_head=4, n_embd=64)
    return model.blocks[0], torch.randn(batch, 64, 64)


def demo_view(policy: Any = None) -> View:
    """The view of ``fxad.vjp`` of the demo's transformer block (:func:`demo_module`)."""
    block, x = demo_module()
    return View(build(vjp(block, x), policy=policy, title="TinyGPT block 0 · fxad.vjp"))
