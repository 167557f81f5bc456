"""An ``argparse.ArgumentParser`` that suggests the closest match for a mistyped command,
option or choice, used by ``fxad``'s command line and by the ``python -m fxad.tools.*``
aliases of its commands.

A mistake is reported by the parser it belongs to, with that parser's usage line::

    $ fxad show m.py:MLP --inptu "randn(4, 8)"
    usage: fxad show [-h] [--debug] [--input EXPR] ... FILE.py:NAME
    fxad show: error: unrecognized arguments: --inptu randn(4, 8) (did you mean --input?)
"""
from __future__ import annotations

import argparse
import difflib
import re
import sys
from typing import Iterable, NoReturn, Sequence

__all__ = ["ArgumentParser", "suggest", "unrecognized"]


def suggest(word: str, candidates: Iterable[str]) -> str | None:
    """The candidate closest to ``word`` (``difflib`` ratio at least 0.6), or ``None``."""
    found = difflib.get_close_matches(word, sorted(set(candidates)), n=1, cutoff=0.6)
    return found[0] if found else None


class ArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose errors name the closest option or choice.

    ``error()`` adds ``(did you mean --input?)`` to "unrecognized arguments" and ``(did you
    mean 'show'?)`` to "invalid choice" messages; everything else is argparse's.
    """

    def option_strings(self) -> list[str]:
        """Every option string this parser accepts (``--input``, ``-i``...)."""
        return [s for a in self._actions for s in a.option_strings]

    def choice_values(self) -> list[str]:
        """Every choice of this parser's arguments (its subcommands included)."""
        out: list[str] = []
        for a in self._actions:
            if a.choices is not None:
                out += [str(c) for c in a.choices]
        return out

    def error(self, message: str) -> NoReturn:
        """Print the usage and ``prog: error: message`` with a suggestion; exit with 2."""
        notes = []
        if message.startswith("unrecognized arguments:"):
            for tok in message.split(":", 1)[1].split():
                if tok.startswith("-") and len(tok) > 1:
                    near = suggest(tok.split("=", 1)[0], self.option_strings())
                    if near:
                        notes.append(f"{tok.split('=', 1)[0]}: did you mean {near}?")
        else:
            m = re.search(r"invalid choice: '([^']*)'", message)
            if m:
                near = suggest(m.group(1), self.choice_values())
                if near:
                    notes.append(f"did you mean {near!r}?")
        if len(notes) == 1 and message.startswith("unrecognized"):
            notes = [notes[0].split(": ", 1)[1]]
        if notes:
            message += " (" + "; ".join(notes) + ")"
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n")


def unrecognized(parser: argparse.ArgumentParser, extras: Sequence[str]) -> NoReturn:
    """Report ``extras`` (left over by ``parse_known_args``) as ``parser``'s error."""
    parser.error("unrecognized arguments: " + " ".join(extras))
