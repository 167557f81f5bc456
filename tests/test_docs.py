"""Every Python example of the documentation runs: each ```` ```python ```` block of
``README.md`` and ``docs/*.md``, page by page, top to bottom in one namespace (as a reader
would paste them), in a fresh working folder, after ``torch.manual_seed(0)``.

* A block whose first line starts with ``>>>`` is checked like a doctest: each statement runs
  as typed at the prompt (compiled as ``<stdin>``, so source comments read ``[<stdin>:N]``)
  and what it prints must match the page (``...`` matches anything, as doctest's
  ``ELLIPSIS``; blank lines and trailing spaces are ignored); an expected ``Traceback`` must be raised with a matching last line.
* Any other block runs as a script, compiled under the page's path and line numbers (a
  source comment or error then points at the page's line).
* A block may opt out only with a marker on the line before it,
  ``<!-- docs-test: skip (REASON) -->``, where REASON begins with ``needs a GPU``,
  ``needs a browser`` or ``needs a distributed launch``; the opt-outs are counted and
  reported (``test_opt_outs_are_few_and_explained``), and no page may hide more than
  :data:`MAX_SKIPS` of them.

``python tests/test_docs.py [PAGE...]`` runs the pages outside pytest and prints the first
difference of each failing example (handy while writing a page).
"""
from __future__ import annotations

import contextlib
import doctest
import io
import linecache
import os
import re
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SKIP = re.compile(r"<!--\s*docs-test:\s*skip\s*\((?P<why>[^)]*)\)\s*-->\s*$")
REASONS = ("needs a GPU", "needs a browser", "needs a distributed launch")
MAX_SKIPS = 12
FENCE = re.compile(r"^```(?P<lang>[\w+-]*)[^\n]*\n(?P<body>.*?)^```[ \t]*$", re.M | re.S)
FLAGS = doctest.ELLIPSIS


@dataclass
class Block:
    page: Path
    line: int          # 1-based line of the first code line on the page
    code: str
    skip: str | None   # the reason of an opt-out marker

    @property
    def prompt(self) -> bool:
        return self.code.lstrip().startswith(">>>")

    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """The ```` ```python ```` blocks of a page, with the opt-out marker before each."""
    text = page.read_text(encoding="utf-8")
    out = []
    for m in FENCE.finditer(text):
        if m.group("lang") not in ("python", "py", "pycon"):
            continue
        before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        marker = SKIP.search(before)
        line = text.count("\n", 0, m.start("body")) + 1
        out.append(Block(page, line, m.group("body"), marker.group("why") if marker else None))
    return out


class ExampleFailed(AssertionError):
    pass


def _run_script(block: Block, ns: dict) -> None:
    name = str(block.page.relative_to(ROOT))
    full = block.page.read_text(encoding="utf-8")
    linecache.cache[name] = (len(full), None, full.splitlines(True), name)
    code = "\n" * (block.line - 1) + block.code  # the page's line numbers
    try:
        exec(compile(code, name, "exec"), ns)  # noqa: S102
    except Exception as e:
        raise ExampleFailed(f"{block.where()}: the example raised\n"
                            + "".join(traceback.format_exception(e))) from e


def _squeeze(text: str) -> str:
    """Output as compared: blank lines and trailing spaces dropped (``gm.code`` starts with
    blank lines and a page does not show them)."""
    lines = [ln.rstrip() for ln in text.splitlines()]
    return "".join(ln + "\n" for ln in lines if ln)


def _run_prompt(block: Block, ns: dict) -> None:
    checker = doctest.OutputChecker()
    for ex in doctest.DocTestParser().get_examples(block.code):
        where = f"{block.page.relative_to(ROOT)}:{block.line + ex.lineno}"
        got_out = io.StringIO()
        exc_line = None
        with contextlib.redirect_stdout(got_out):
            try:
                code = compile(ex.source, "<stdin>", "single")
                # a displayed value goes to the redirected stdout, as doctest does
                old_hook = sys.displayhook
                sys.displayhook = lambda v: (print(repr(v)) if v is not None else None)
                try:
                    exec(code, ns)  # noqa: S102
                finally:
                    sys.displayhook = old_hook
            except Exception as e:  # compared with an expected traceback below
                if ex.exc_msg is None:
                    raise ExampleFailed(f"{where}: {ex.source.strip()!r} raised\n"
                                        + "".join(traceback.format_exception(e))) from e
                exc_line = "".join(traceback.format_exception_only(type(e), e))
        got = _squeeze(got_out.getvalue())
        ex.want = _squeeze(ex.want)
        if ex.exc_msg is not None:
            if exc_line is None:
                raise ExampleFailed(f"{where}: {ex.source.strip()!r} raised nothing; the page "
                                    f"expects {ex.exc_msg!r}")
            if not checker.check_output(ex.exc_msg, exc_line, FLAGS) and not \
                    checker.check_output(ex.exc_msg, exc_line.split(": ", 1)[-1], FLAGS):
                raise ExampleFailed(f"{where}: the exception differs from the page:\n"
                                    + checker.output_difference(
                                        doctest.Example(ex.source, ex.exc_msg), exc_line, FLAGS))
            continue
        if not checker.check_output(ex.want, got, FLAGS):
            raise ExampleFailed(f"{where}: {ex.source.strip()!r} printed something else than "
                                "the page shows:\n" + checker.output_difference(ex, got, FLAGS))


def run_page(page: Path, workdir: Path) -> tuple[int, int]:
    """Run every block of ``page`` in ``workdir``; returns (examples run, opted out)."""
    ns: dict = {"__name__": "__main__"}
    ran = skipped = 0
    old = os.getcwd()
    os.chdir(workdir)
    torch.manual_seed(0)
    try:
        for block in blocks(page):
            if block.skip is not None:
                skipped += 1
                continue
            (_run_prompt if block.prompt else _run_script)(block, ns)
            ran += 1
    finally:
        os.chdir(old)
    return ran, skipped


PAGES_WITH_CODE = [p for p in PAGES if blocks(p)]


@pytest.mark.parametrize("page", PAGES_WITH_CODE, ids=lambda p: p.name)
def test_page_examples_run(page, tmp_path):
    try:
        ran, skipped = run_page(page, tmp_path)
    except ExampleFailed as e:
        pytest.fail(str(e), pytrace=False)
    assert ran + skipped == len(blocks(page))


def test_opt_outs_are_few_and_explained(capsys):
    """Count the examples and the opt-outs; every opt-out names an allowed reason."""
    total = 0
    skips = []
    for page in PAGES:
        for b in blocks(page):
            total += 1
            if b.skip is not None:
                skips.append(b)
    bad = [b.where() for b in skips if not b.skip.startswith(REASONS)]
    assert not bad, f"opt-outs without an allowed reason ({', '.join(REASONS)}): {bad}"
    assert len(skips) <= MAX_SKIPS, [b.where() for b in skips]
    with capsys.disabled():
        print(f"\ndocs examples: {total} python blocks, {total - len(skips)} executed, "
              f"{len(skips)} opted out" + "".join(f"\n  opted out: {b.where()} ({b.skip})"
                                                   for b in skips))
    assert total - len(skips) >= 30  # the guide pages are examples, not prose only


def test_relative_links_exist():
    """Every relative link of the README and the pages names a file that exists (the site
    build checks the pages again, with anchors; the README is read on GitHub)."""
    missing = []
    for page in PAGES:
        text = FENCE.sub("", page.read_text(encoding="utf-8"))
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            path = target.split("#")[0]
            if path and "://" not in path and not (page.parent / path).exists():
                missing.append(f"{page.relative_to(ROOT)}: {target}")
    assert not missing, missing


def test_marker_and_fence_parsing(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# t\n\n<!-- docs-test: skip (needs a GPU: cuda) -->\n```python\nx = 1\n```\n"
                    "\n```python\n>>> 1 + 1\n2\n```\n\n```text\nnot code\n```\n")
    found = blocks(page)
    assert [(b.line, b.skip, b.prompt) for b in found] == [
        (5, "needs a GPU: cuda", False), (9, None, True)]


def test_prompt_blocks_compare_output():
    page = ROOT / "docs" / "p.md"  # not read: the blocks are given
    ok = Block(page, 1, ">>> print('a b c')\na ...\n", None)
    _run_prompt(ok, {})
    wrong = Block(page, 1, ">>> print(1 + 1)\n3\n", None)
    with pytest.raises(ExampleFailed, match="printed something else"):
        _run_prompt(wrong, {})
    raises = Block(page, 1, ">>> 1 / 0\nTraceback (most recent call last):\n"
                   "  ...\nZeroDivisionError: division by zero\n", None)
    _run_prompt(raises, {})
    silent = Block(page, 1, ">>> 1\nTraceback (most recent call last):\n"
                   "  ...\nZeroDivisionError: division by zero\n", None)
    with pytest.raises(ExampleFailed, match="raised nothing"):
        _run_prompt(silent, {})


if __name__ == "__main__":  # python tests/test_docs.py [PAGE...]
    import tempfile

    chosen = [Path(a).resolve() for a in sys.argv[1:]] or PAGES_WITH_CODE
    status = 0
    for page in chosen:
        with tempfile.TemporaryDirectory() as d:
            try:
                print(page.name, "ran %d, opted out %d" % run_page(page, Path(d)))
            except ExampleFailed as e:
                print(f"{page.name} FAILED\n{e}")
                status = 1
    sys.exit(status)
