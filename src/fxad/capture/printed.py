"""Numbers read from tensors only to be printed: read at call time, with no value guard.

``print(f"loss {loss.item():.3f}")`` asks for a tensor's value while tracing.  A value the
program decides on is specialized and guarded (:mod:`fxad.capture.decisions`); a value that
only goes into a ``print`` needs neither: the generated code reads it when it prints::

    printed_1 = fxad_printed(sum_1, 'float')
    format_1 = 'loss {:.3f}'.format(printed_1)
    print(format_1)

Which it is, the program's own line says: the syntax tree of the call the program is making
(``<expr>.item()``, ``float(<expr>)``, ``int(<expr>)``, found by the frame's instruction
position) and what it is nested in: an argument of the builtin ``print`` (no ``file=``) or
of a logging call (``log.info("loss %.3f", loss.item())``, ``logging.warning(...)``, on a
``logging.Logger`` / ``LoggerAdapter`` or the ``logging`` module, found without running the
program's code, with no keyword but ``stacklevel``), directly or through f-string fields and
``'...'.format(...)`` arguments.  Anything else (a number kept in a variable, compared,
computed with, ``%``-formatted by the program) is a value of the program, guarded as
before.  Formatting a traced value gives a marker (:func:`marker`), which
:func:`fxad.capture.effects.formatted` uses for tensors too and the ``print`` of the text
turns into a ``str.format`` line of the graph.

Functions of the capture session (:class:`fxad.capture.session.Session`), passed as ``cap``.
"""
from __future__ import annotations

import ast
import builtins
import inspect
import linecache
import logging
import os
import sys
from typing import Any

import torch
import torch.fx as fx

from ..naming import code_builtin
from .state import current

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_FXAD_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def marker(cap: Any, value: Any, method: str, spec: str = "") -> str:
    """A marker standing for ``format(value, spec)`` (``method`` ``'__format__'``), ``str``
    or ``repr`` of a traced value (a tensor, or the node of a number), remembered in the
    session's table: ``'<fxad-value k>'``."""
    table = cap.__dict__.setdefault("formatted", [])
    table.append((value, method, spec))
    return f"<fxad-value {len(table) - 1}>"


class PrintedNumber:
    """What ``t.item()`` returns while tracing when the program reads the number only to
    print it (:func:`printed_number`): no value and no guard, but the graph node that reads
    it at call time (``fxad_printed(loss, 'float')``).  Formatting it gives a marker (as a formatted tensor
    does, :func:`fxad.capture.effects.formatted`), and ``print`` of it prints the node."""

    __slots__ = ("cap", "node")

    def __init__(self, cap: Any, node: fx.Node) -> None:
        self.cap, self.node = cap, node

    def __format__(self, spec: str) -> str:
        return marker(self.cap, self.node, "__format__", spec)

    def __str__(self) -> str:
        return marker(self.cap, self.node, "__str__")

    def __repr__(self) -> str:
        return marker(self.cap, self.node, "__repr__")


def printed_node(cap: Any, a: Any) -> Any:
    """The node a ``print`` argument stands for: a :class:`PrintedNumber`, or the number
    ``float(t)`` / ``int(t)`` returned for it (Python makes those plain numbers, so they are
    known by identity); ``a`` itself otherwise."""
    if isinstance(a, PrintedNumber):
        return a.node
    hit = getattr(cap, "printed_numbers", {}).get(id(a))
    return hit[1] if hit is not None and hit[0] is a else a


_READS = {"item": None, "__float__": float, "__int__": int}
_SOURCE_TREES: dict[int, Any] = {}


def _user_frame() -> Any:
    """The program's frame that asked torch for a tensor's value (fxad's and torch's own
    dispatch frames skipped)."""
    frame = sys._getframe(2)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(
            (_FXAD_DIR, _TORCH_DIR)):
        frame = frame.f_back
    return frame


def _parsed(text: str) -> Any:
    """``text`` parsed, with parent links (cached), or None."""
    key = hash(text)
    if key not in _SOURCE_TREES:
        try:
            tree = ast.parse(text)
        except SyntaxError:
            tree = None
        if tree is not None:
            for parent in ast.walk(tree):
                for child in ast.iter_child_nodes(parent):
                    child.fxad_parent = parent  # type: ignore[attr-defined]
        _SOURCE_TREES[key] = tree
    return _SOURCE_TREES[key]


def _call_at(filename: str, pos: tuple, kinds: tuple = (ast.Call,)) -> Any:
    """The ``ast.Call`` (a node of ``kinds``) spanning ``pos`` (line, end line, column, end
    column) in the source of ``filename`` (with parent links), or None.  A file that does
    not parse as a whole (code shown on a page) is read statement by statement: the lines
    around ``pos`` that parse."""
    lines = linecache.getlines(filename)
    line, end_line, col, end_col = pos
    if not lines or end_line > len(lines):
        return None
    windows = [(0, 0, lines)]
    for first in range(max(line - 10, 1), line + 1):  # the widest context first
        indent = len(lines[first - 1]) - len(lines[first - 1].lstrip())
        if indent <= col and lines[first - 1].strip():
            windows += [(first - 1, indent, lines[first - 1:last])
                        for last in range(min(end_line + 10, len(lines)), end_line - 1, -1)]
    for skip, shift, chunk in windows:
        tree = _parsed("".join(ln[shift:] if ln[:shift].isspace() and len(ln) > shift
                               else ln if ln.strip() else "\n" for ln in chunk))
        if tree is None:
            continue
        want = (line - skip, end_line - skip, col - shift, end_col - shift)
        hit = next((n for n in ast.walk(tree) if isinstance(n, kinds)
                    and (n.lineno, n.end_lineno, n.col_offset, n.end_col_offset) == want),
                   None)
        if hit is not None:
            return hit
    return None


# the methods of a ``logging.Logger`` (and ``LoggerAdapter``, and the module's functions of the
# root logger) that log a message; keyword arguments other than ``stacklevel``
# (``exc_info``, ``extra``, ``stack_info``) are not replayed
LOG_METHODS = {"debug", "info", "warning", "warn", "error", "critical", "fatal", "log"}


def _resolved(frame: Any, expr: ast.expr) -> Any:
    """The object a name or a chain of attributes (``log``, ``self.logger``,
    ``logging``) stands for in ``frame``, looked up without running any code (no property,
    no ``__getattr__``); None when it is anything else or not found."""
    if isinstance(expr, ast.Name):
        for scope in (frame.f_locals, frame.f_globals, vars(builtins)):
            if expr.id in scope:
                return scope[expr.id]
        return None
    if isinstance(expr, ast.Attribute):
        owner = _resolved(frame, expr.value)
        if owner is None:
            return None
        try:
            return inspect.getattr_static(owner, expr.attr)
        except AttributeError:
            return None
    return None


def _sink(frame: Any, call: ast.Call) -> str | None:
    """What the call ``call`` in ``frame`` is, when it only prints its arguments: ``'print'``
    (the builtin, no ``file=``), or the logging method (``'info'``, ``'log'``, ...) of a
    ``logging.Logger`` / ``LoggerAdapter`` or of the ``logging`` module; None otherwise."""
    if isinstance(call.func, ast.Name) and call.func.id == "print":
        if "print" in frame.f_locals or "print" in frame.f_globals:
            return None  # not the builtin
        return None if any(k.arg == "file" for k in call.keywords) else "print"
    if not (isinstance(call.func, ast.Attribute) and call.func.attr in LOG_METHODS) \
            or any(k.arg != "stacklevel" for k in call.keywords):
        return None
    owner = _resolved(frame, call.func.value)
    if isinstance(owner, (logging.Logger, logging.LoggerAdapter)) or owner is logging:
        return call.func.attr
    return None


def _executing(frame: Any, kinds: tuple = (ast.Call,)) -> Any:
    """The expression (a node of ``kinds``) of the program's source that ``frame`` is
    executing, found by the instruction's position, or None."""
    code = frame.f_code
    try:
        pos = list(code.co_positions())[frame.f_lasti // 2]
    except (AttributeError, IndexError):  # pragma: no cover - Python < 3.11
        return None
    return None if None in pos else _call_at(code.co_filename, pos, kinds)


def _only_printed(frame: Any, method: str) -> bool:
    """The call the frame is executing is ``<expr>.item()`` / ``float(<expr>)`` /
    ``int(<expr>)``, and its value goes only into a ``print`` of the builtin (no ``file=``)
    or a logging call (:func:`_sink`): as an argument (``float(t)`` / ``int(t)``: only so),
    or through f-string fields and ``'...'.format(...)`` arguments."""
    call = _executing(frame)
    if call is None or call.keywords:
        return False
    if method == "item":
        if call.args or not (isinstance(call.func, ast.Attribute) and call.func.attr == "item"):
            return False
    elif not (isinstance(call.func, ast.Name) and call.func.id == _READS[method].__name__
              and len(call.args) == 1):
        return False
    direct = method != "item"  # float(t), int(t): plain numbers, printed as arguments only
    node: Any = call
    while True:
        parent = getattr(node, "fxad_parent", None)
        if isinstance(parent, ast.Call) and node in parent.args:
            sink = _sink(frame, parent)
            if sink is not None:
                # the level of `logger.log(level, msg, ...)` is not printed
                return not (sink == "log" and parent.args.index(node) == 0)
        if direct:
            return False
        if isinstance(parent, ast.FormattedValue) and parent.value is node:
            node = getattr(parent, "fxad_parent", None)  # the f-string
            if not isinstance(node, ast.JoinedStr):
                return False
        elif isinstance(parent, ast.Call) and node in parent.args \
                and isinstance(parent.func, ast.Attribute) and parent.func.attr == "format" \
                and isinstance(parent.func.value, (ast.Constant, ast.JoinedStr)):
            node = parent  # '...'.format(value)
        else:
            return False


_TEXT_CALLS = ("str", "repr", "format")


def printed_text(frame: Any) -> bool:
    """The formatting of a value the frame is executing (an f-string, ``str(t)``,
    ``repr(t)``, ``format(t, spec)``, ``'...'.format(t)``, ``'...' % t``) makes text that
    goes only into a ``print`` or logging call (:func:`_sink`), directly or through other
    such formatting and string concatenation."""
    node = _executing(frame, (ast.Call, ast.JoinedStr, ast.BinOp))
    while node is not None:
        parent = getattr(node, "fxad_parent", None)
        if isinstance(parent, ast.Call) and node in parent.args:
            sink = _sink(frame, parent)
            if sink is not None:
                return not (sink == "log" and parent.args.index(node) == 0)
            text = (isinstance(parent.func, ast.Name) and parent.func.id in _TEXT_CALLS
                    and parent.func.id not in frame.f_locals
                    and parent.func.id not in frame.f_globals) \
                or (isinstance(parent.func, ast.Attribute) and parent.func.attr == "format"
                    and isinstance(parent.func.value, (ast.Constant, ast.JoinedStr)))
            if not text:
                return False
        elif not (isinstance(parent, (ast.FormattedValue, ast.JoinedStr))
                  or isinstance(parent, ast.BinOp) and isinstance(parent.op, (ast.Add, ast.Mod))):
            return False
        node = parent
    return False


def printed_number(cap: Any, method: str, args: tuple) -> Any:
    """``t.item()`` / ``float(t)`` / ``int(t)`` whose value the program's line only prints
    (``print(f"loss {loss.item():.3f}")``, ``print(float(t))``): a :class:`PrintedNumber`
    read at call time by a line ``fxad_printed(loss, 'float')`` before the ``print``, with no guard (for
    ``float(t)`` / ``int(t)``, an argument of the print itself, a number known to the print
    by identity); None otherwise (the value is then a decision, guarded)."""
    if method not in _READS or len(args) != 1 or not isinstance(args[0], torch.Tensor) \
            or cap.lift is not None or id(args[0]) not in cap.env:
        return None
    frame = _user_frame()
    if frame is None or not _only_printed(frame, method):
        return None
    t = args[0]
    read = _READS[method] or (bool if t.dtype == torch.bool else complex if t.is_complex()
                              else float if t.is_floating_point() else int)
    node = _read_node(cap, t, read)
    if method == "item":
        return PrintedNumber(cap, node)
    # a fresh object print will recognize by identity (a NaN, or an int beyond the cached ones)
    table = cap.__dict__.setdefault("printed_numbers", {})
    number = float("nan") if read is float else (1 << 62) + len(table)
    table[id(number)] = (number, node)
    return number


def _read_node(cap: Any, t: torch.Tensor, read: type) -> fx.Node:
    """The line ``printed_1 = fxad_printed(t, 'float')`` reading the number at call time."""
    node = cap.graph.create_node("call_function", printed, (cap.arg(t, "print"), read.__name__),
                                 {})
    # a placeholder of the number's type: the value is read at call time only
    node.meta.update(val=read(0), fxad_no_grad=True, fxad_side_effect=True)
    cap.stamp(node)
    return node


_KINDS = {"float": float, "int": int, "bool": bool, "complex": complex}


def printed(t: torch.Tensor, kind: str) -> Any:
    """What the generated code runs for a number read from a tensor only to be printed or
    logged: ``float(t)`` (``kind`` ``'float'``; ``'int'``, ``'bool'``, ``'complex'``) at call
    time.  While fxad traces code it generated (the gradient of a gradient), the same read
    again (:class:`PrintedNumber`): no value, no guard."""
    cap = current()
    if cap is not None and not cap.suspended and cap.lift is None and id(t) in cap.env:
        return PrintedNumber(cap, _read_node(cap, t, _KINDS[kind]))
    return _KINDS[kind](t)


code_builtin("fxad_printed", printed)
