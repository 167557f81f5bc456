"""Exceptions raised by fxad.

Every error fxad raises derives from :class:`FxadError`.  Errors that concern a
particular operation of the user's program carry the op's name and, when it is
known, the user's ``file:line`` and source text, and end with a hint on how to
fix the problem.  A hint names only options that exist (``leaf_modules=`` of
:func:`fxad.vjp` and friends / ``--leaf`` of the command line,
:func:`fxad.register_vjp`, ``torch.where``...); ``tests/test_hints.py`` checks every
hint in the source.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SourceLoc:
    """Where in the user's code an operation was recorded.

    Attributes:
        filename: absolute path of the Python file.
        lineno: 1-based line number.
        function: name of the enclosing function (``forward`` for modules).
        code: the stripped source text of that line ('' when unavailable).
    """

    filename: str
    lineno: int
    function: str
    code: str

    def short(self) -> str:
        """``basename.py:LINE`` — short form used in generated-code comments."""
        import os

        return f"{os.path.basename(self.filename)}:{self.lineno}"

    def __str__(self) -> str:
        text = f"{self.filename}:{self.lineno} in {self.function}"
        return f"{text}: {self.code}" if self.code else text


class FxadError(Exception):
    """Base class of all fxad errors."""

    def __init__(self, message: str, *, op: str | None = None,
                 loc: SourceLoc | None = None, hint: str | None = None) -> None:
        self.op = op
        self.loc = loc
        self.hint = hint
        self.bare_message = message
        parts = [message]
        if loc is not None:
            parts.append(f"  at {loc}")
        if hint:
            parts.append(f"  fix: {hint}")
        super().__init__("\n".join(parts))


class CaptureError(FxadError):
    """The program could not be captured as a graph (unsupported Python or tensor op)."""


class DataDependentError(CaptureError):
    """Python control flow or a Python value depends on tensor *data*, not only shapes."""


class InplaceError(CaptureError):
    """An in-place operation that fxad cannot rewrite out-of-place without changing results."""


class MissingRuleError(FxadError):
    """An operation on the differentiation path has no registered derivative rule."""


class RuleError(FxadError):
    """A derivative rule is malformed, or returned something the engine cannot use."""


class CheckError(FxadError):
    """``fxad.check`` found a derivative that disagrees with autograd or finite differences."""


class InputError(FxadError):
    """Inputs or cotangents handed to fxad do not match what was captured."""


class ValueGuardError(InputError):
    """A decision the program took on a tensor's value at build time (``if x.sum() > 0``,
    ``t.item()``, ``torch.equal(a, b)``) comes out differently for the inputs of this call;
    the generated code was specialized on the build-time value (a guard line
    ``fxad_expect(...)`` in the code raised it).  ``where`` is the user's line and
    expression, ``taken`` the value at build time, ``now`` the value for this call."""

    def __init__(self, message: str, *, where: str = "", taken: object = None,
                 now: object = None, hint: str | None = None) -> None:
        self.where = where
        self.taken = taken
        self.now = now
        super().__init__(message, hint=hint)
