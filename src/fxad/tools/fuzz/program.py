"""A fuzz program: straight-line PyTorch source text plus the code that makes its inputs.

A :class:`Program` is kept as data (statements with the names they define) so that the
shrinker can delete statements and rename operands, and rendered as Python source so that
every program, and every reproducer, is a readable, self-contained function.
"""
from __future__ import annotations

import itertools
import linecache
import re
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch
import torch.nn.functional as F

# program variables: float inputs x0.., integer inputs n0.., intermediates v0..
NAME_RE = re.compile(r"\b[xnv]\d+\b")


@dataclass(frozen=True)
class Stmt:
    """One line of the program body.

    Attributes:
        text: the Python statement (``v3 = torch.sin(v1)``, ``v2.add_(x0)``).
        defs: the names it binds (empty for an in-place statement).
        family: the op family it was drawn from (see :data:`fxad.tools.fuzz.generator.FAMILIES`).
    """

    text: str
    defs: tuple[str, ...] = ()
    family: str = ""

    def uses(self) -> list[str]:
        """Program variables the statement reads (for in-place statements: also the target)."""
        text = self.text
        if self.defs:  # drop the assignment target(s)
            text = text.split("=", 1)[1]
        return list(dict.fromkeys(NAME_RE.findall(text)))

    def renamed(self, old: str, new: str) -> "Stmt":
        pat = re.compile(rf"\b{re.escape(old)}\b")
        if self.defs:
            lhs, rhs = self.text.split("=", 1)
            return replace(self, text=lhs + "=" + pat.sub(new, rhs))
        return replace(self, text=pat.sub(new, self.text))


@dataclass(frozen=True)
class Input:
    """A program input: its name and the expression that makes it from ``gen``."""

    name: str
    ctor: str

    @property
    def is_float(self) -> bool:
        return self.name.startswith("x")


_counter = itertools.count()


@dataclass(frozen=True)
class Program:
    """A straight-line program ``f(*inputs) -> outputs`` and how to make its inputs.

    Attributes:
        inputs: the parameters of ``f`` with their constructors.
        stmts: the body.
        outputs: returned names (one name: a single tensor is returned, else a tuple).
        input_seed: seed of the ``torch.Generator`` the input constructors draw from (also
            the seed of the random cotangents and tangents of the oracle).
        tag: where the program came from (``seed0-17``), used in file names.
    """

    inputs: tuple[Input, ...]
    stmts: tuple[Stmt, ...]
    outputs: tuple[str, ...]
    input_seed: int
    tag: str = ""
    families: frozenset[str] = field(default=frozenset(), compare=False)

    # ----------------------------------------------------------------------------- source
    def source(self) -> str:
        """The function ``f`` as Python source."""
        lines = [f"def f({', '.join(i.name for i in self.inputs)}):"]
        lines += [f"    {s.text}" for s in self.stmts]
        ret = self.outputs[0] if len(self.outputs) == 1 else ", ".join(self.outputs)
        lines.append(f"    return {ret}")
        return "\n".join(lines) + "\n"

    def input_source(self) -> str:
        """Statements that make the inputs (``gen`` seeded with ``input_seed``)."""
        lines = [f"gen = torch.Generator().manual_seed({self.input_seed})"]
        lines += [f"{i.name} = {i.ctor}" for i in self.inputs]
        lines.append(f"inputs = ({', '.join(i.name for i in self.inputs)},)")
        return "\n".join(lines) + "\n"

    def used_families(self) -> set[str]:
        return {s.family for s in self.stmts if s.family}

    # ------------------------------------------------------------------------------- run
    def compile(self) -> Callable[..., Any]:
        """The function ``f``, compiled from :meth:`source` under a file name of its own that
        ``linecache`` knows (so errors and generated code can quote its lines)."""
        src = "import torch\nimport torch.nn.functional as F\n\n" + self.source()
        fname = f"<fuzz-{self.tag or 'program'}-{next(_counter)}>"
        linecache.cache[fname] = (len(src), None, src.splitlines(True), fname)
        ns: dict[str, Any] = {}
        exec(compile(src, fname, "exec"), ns)
        f = ns["f"]
        f.__fuzz_filename__ = fname  # type: ignore[attr-defined]
        return f

    def make_inputs(self) -> tuple:
        ns: dict[str, Any] = {"torch": torch}
        exec(self.input_source(), ns)
        return ns["inputs"]

    def n_lines(self) -> int:
        return len(self.stmts)

    @classmethod
    def from_source(cls, source: str, inputs: dict[str, str], *, seed: int = 0,
                    tag: str = "regression") -> "Program":
        """A program from the text of ``def f(...): ... return ...`` (straight-line, one
        statement per line, as the generator writes them) and ``{name: constructor}`` for its
        parameters, e.g. ``{"x0": "torch.randn((3,), dtype=torch.float64, generator=gen)"}``."""
        lines = [ln.strip() for ln in source.strip().splitlines()]
        head = re.match(r"def f\((.*)\):$", lines[0])
        if head is None or not lines[-1].startswith("return "):
            raise ValueError("expected `def f(...):`, statements, `return ...`")
        params = [p.strip() for p in head.group(1).split(",") if p.strip()]
        stmts = []
        for ln in lines[1:-1]:
            m = re.match(r"((?:[xnv]\d+\s*,\s*)*[xnv]\d+)\s*=(?!=)", ln)
            defs = tuple(d.strip() for d in m.group(1).split(",")) if m else ()
            stmts.append(Stmt(ln, defs))
        outs = tuple(o.strip() for o in lines[-1][len("return "):].split(",") if o.strip())
        return cls(tuple(Input(p, inputs[p]) for p in params), tuple(stmts), outs, seed, tag)


def forget(f: Callable[..., Any]) -> None:
    """Drop a compiled program's source from ``linecache`` (bounded memory in long runs)."""
    linecache.cache.pop(getattr(f, "__fuzz_filename__", ""), None)


def namespace() -> dict[str, Any]:
    """Globals the generator's eager evaluation runs statements in."""
    return {"torch": torch, "F": F}
