"""Open a page in a real headless Chromium (tests, screenshots for the docs).

Uses Playwright's Python package driving the *system* Chromium (Debian's ``chromium``
package; ``FXAD_CHROMIUM`` names another binary), so nothing is downloaded: ``playwright
install`` is not needed.  :func:`find_chromium` says where the browser is,
:func:`render_page` loads a page, records console errors, optionally hovers an element and
saves a screenshot.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Callable

from ..errors import FxadError

__all__ = ["BrowserUnavailable", "find_chromium", "playwright_available", "render_page",
           "open_page"]

_CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")


class BrowserUnavailable(FxadError, ImportError):
    """No headless browser can be driven: no Chromium binary, or no Playwright package."""


def find_chromium() -> str | None:
    """Path of a Chromium/Chrome binary: ``$FXAD_CHROMIUM``, else the first of
    ``chromium``, ``chromium-browser``, ``google-chrome`` on ``PATH``; ``None`` if none."""
    env = os.environ.get("FXAD_CHROMIUM")
    if env and os.path.exists(env):
        return env
    for name in _CANDIDATES:
        p = shutil.which(name)
        if p:
            return p
    return None


def playwright_available() -> bool:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return False
    return True


def _require() -> str:
    exe = find_chromium()
    if exe is None:
        raise BrowserUnavailable("no Chromium found (looked for $FXAD_CHROMIUM and "
                                 f"{', '.join(_CANDIDATES)} on PATH)",
                                 hint="apt-get install chromium, or set FXAD_CHROMIUM")
    if not playwright_available():
        raise BrowserUnavailable("the playwright package is not installed",
                                 hint='pip install "fxad[test]" (or pip install playwright; '
                                      "the system Chromium is used, no browser download)")
    return exe


def open_page(html_path: str | os.PathLike, body: Callable[[Any, list[str]], Any], *,
              width: int = 1600, height: int = 1000) -> Any:
    """Load ``html_path`` in headless Chromium and call ``body(page, errors)`` (``errors``:
    console errors and uncaught exceptions, filled as they happen); returns what it returns.

    Raises:
        BrowserUnavailable: no Chromium or no Playwright.
    """
    exe = _require()
    from playwright.sync_api import sync_playwright

    errors: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=exe, headless=True,
                                    args=["--no-sandbox", "--disable-gpu",
                                          "--disable-dev-shm-usage"])
        try:
            page = browser.new_page(viewport={"width": width, "height": height},
                                    device_scale_factor=1)
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(f"uncaught: {e}"))
            # block every request that is not the page itself: the view must be self-contained
            page.route("**/*", lambda route: route.continue_()
                       if route.request.url.startswith("file:")
                       else (errors.append(f"network request: {route.request.url}"),
                             route.abort())[1])
            page.goto(Path(html_path).resolve().as_uri())
            page.wait_for_load_state("load")
            return body(page, errors)
        finally:
            browser.close()


def render_page(html_path: str | os.PathLike, *, screenshot: str | os.PathLike | None = None,
                width: int = 1600, height: int = 1000, full_page: bool = False,
                hover: str | None = None) -> list[str]:
    """Load a page, optionally hover the element ``hover`` (a CSS selector) and save a PNG
    screenshot; returns the console errors (empty when the page is clean).

    Raises:
        BrowserUnavailable: no Chromium or no Playwright.
    """
    def body(page: Any, errors: list[str]) -> list[str]:
        if hover:
            page.hover(hover)
            page.wait_for_timeout(100)
        if screenshot is not None:
            Path(screenshot).parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(screenshot), full_page=full_page)
        return list(errors)

    return open_page(html_path, body, width=width, height=height)
