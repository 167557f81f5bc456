"""Every hint in fxad's error messages names options that exist (issue 16, item 4).

The hints are collected from the source with ``ast`` (``hint=`` keyword arguments, positional
``hint`` parameters of helpers such as ``_error(op, message, hint)``, ``hint = ...``
assignments passed on as ``hint=hint``), together with the messages of raised ``...Error(...)``
calls.  Each option-like token they mention is resolved:

* ``fxad.name`` / ``torch.name`` / ``F.name`` / ``nn.name``: an attribute (or submodule);
* ``--flag``: an option of the ``fxad`` command line (any subcommand), or of the module a
  ``python -m fxad.xxx`` in the text names;
* ``name=``: inside ``f(...)``, a parameter of ``f``; elsewhere a parameter of fxad's public
  API, ``torch.nn.functional``, ``torch.nn`` modules, ``torch`` functions, ``torch.Tensor``
  methods or the function that raises (``pass report=``);
* a bare ``snake_case`` word: one of the above, an attribute of fxad/torch/Tensor, or a
  name the raising function binds (``return (new_carry, y)``);
* advice to mark a module as a leaf must name the option (``leaf_modules=``), and advice to
  register a rule must name ``fxad.register_vjp``.

Error messages (as opposed to hints) describe the user's code, so only their ``fxad.``/
``torch.`` names and flags are checked.  ``test_checker_rejects_made_up_options`` and
``test_self_test_finds_a_bad_hint_in_source`` show the checker fails on hints naming options
that do not exist (``concrete_args``, which fxad never had, among them).
"""
from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

import fxad

SRC = Path(fxad.__file__).parent


@dataclass(frozen=True)
class Hint:
    file: str
    line: int
    text: str
    kind: str  # "hint" or "message"
    context: frozenset[str] = frozenset()  # names bound in the enclosing function(s)

    def __str__(self) -> str:
        return f"{self.file}:{self.line} ({self.kind}): {self.text!r}"


# ------------------------------------------------------------------------------------------
# collection
# ------------------------------------------------------------------------------------------

def _texts(node: ast.AST | None, consts: dict[str, ast.AST] | None = None) -> list[str]:
    """The string alternatives an expression can produce ('{}' for formatted values);
    ``consts``: the file's module-level ``NAME = "..."`` assignments."""
    consts = consts or {}
    if node is None:
        return []
    if isinstance(node, ast.Constant):
        return [node.value] if isinstance(node.value, str) else []
    if isinstance(node, ast.Name) and node.id in consts:
        return _texts(consts[node.id], {k: v for k, v in consts.items() if k != node.id})
    if isinstance(node, ast.JoinedStr):
        parts = [""]
        for v in node.values:
            alts = _texts(v) if isinstance(v, ast.Constant) else ["{}"]
            parts = [p + a for p in parts for a in alts]
        return parts
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left = _texts(node.left, consts) or ["{}"]
        right = _texts(node.right, consts) or ["{}"]
        return [a + b for a in left for b in right]
    if isinstance(node, ast.IfExp):
        return _texts(node.body, consts) + _texts(node.orelse, consts)
    if isinstance(node, ast.BoolOp):
        return [t for v in node.values for t in _texts(v, consts)]
    return []


def _call_name(call: ast.Call) -> str:
    f = call.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""


def _hint_takers(tree: ast.AST) -> dict[str, int]:
    """Functions/classes of this file with a ``hint`` parameter -> its positional index."""
    out: dict[str, int] = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names = [a.arg for a in node.args.posonlyargs + node.args.args]
            if "hint" in names:
                idx = names.index("hint")
                if node.name == "__init__":
                    owner = next((c for c in ast.walk(tree) if isinstance(c, ast.ClassDef)
                                  and node in c.body), None)
                    if owner is not None:
                        out[owner.name] = idx - 1
                else:
                    out[node.name] = idx
    return out


def collect_hints(root: Path = SRC) -> list[Hint]:
    trees = {path.relative_to(root).as_posix(): ast.parse(path.read_text(), filename=str(path))
             for path in sorted(root.rglob("*.py"))}
    takers: dict[str, int] = {}  # helpers are shared between files (rules/_base.py: _error)
    for tree in trees.values():
        takers.update(_hint_takers(tree))
    hints: list[Hint] = []
    for rel, tree in trees.items():
        consts = {t.id: node.value for node in tree.body if isinstance(node, ast.Assign)
                  for t in node.targets if isinstance(t, ast.Name)}
        _collect(tree, rel, consts, takers, frozenset(), hints)
    return hints


def _collect(node: ast.AST, rel: str, consts: dict, takers: dict[str, int],
             context: frozenset[str], out: list[Hint]) -> None:
    """Hints under ``node``; ``context``: parameter and variable names of the enclosing
    functions (a hint saying "pass report=" means the function the user called)."""
    def add(value: ast.AST, kind: str) -> None:
        out.extend(Hint(rel, value.lineno, t, kind, context) for t in _texts(value, consts))

    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        a = node.args
        context = context | {x.arg for x in a.posonlyargs + a.args + a.kwonlyargs} | {
            n.id for n in ast.walk(node) if isinstance(n, ast.Name)
            and isinstance(n.ctx, ast.Store)}  # "return (new_carry, y)": the code's names
        if any(isinstance(k, ast.keyword) and k.arg == "hint" and isinstance(k.value, ast.Name)
               and k.value.id == "hint" for k in ast.walk(node)):
            for sub in ast.walk(node):  # hint = "..."; hint += "..."; ...(hint=hint)
                targets = sub.targets if isinstance(sub, ast.Assign) else \
                    [sub.target] if isinstance(sub, (ast.AugAssign, ast.AnnAssign)) else []
                if any(isinstance(t, ast.Name) and t.id == "hint" for t in targets):
                    add(sub.value, "hint")
    elif isinstance(node, ast.Call):
        for kw in node.keywords:
            if kw.arg == "hint":
                add(kw.value, "hint")
        name = _call_name(node)
        if name in takers and len(node.args) > takers[name]:
            add(node.args[takers[name]], "hint")
        if name.endswith("Error") and node.args:
            add(node.args[0], "message")
    for child in ast.iter_child_nodes(node):
        _collect(child, rel, consts, takers, context, out)


# ------------------------------------------------------------------------------------------
# resolution of the tokens
# ------------------------------------------------------------------------------------------

_ALIASES = {"F": "torch.nn.functional", "nn": "torch.nn"}


def _resolve(dotted: str) -> object | None:
    head, *rest = dotted.split(".")
    head = _ALIASES.get(head, head)
    try:
        obj: object = importlib.import_module(head)
    except ImportError:
        return None
    path = head
    for part in rest:
        path += "." + part
        if hasattr(obj, part):
            obj = getattr(obj, part)
            continue
        try:
            obj = importlib.import_module(path)
        except ImportError:
            return None
    return obj


def _params(obj: object) -> set[str]:
    """Parameter names of a callable (from the docstring's signature lines for builtins)."""
    names: set[str] = set()
    try:
        names |= set(inspect.signature(obj).parameters)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        pass
    if isinstance(obj, type):
        names |= _params(obj.__init__)
    doc = getattr(obj, "__doc__", None)
    doc = doc if isinstance(doc, str) else ""
    for line in doc.splitlines()[:12]:
        if "(" in line:
            names |= set(re.findall(r"\b(\w+)\s*=", line))
            names |= set(re.findall(r"[(,]\s*\*?(\w+)", line))
    return names


@lru_cache(maxsize=None)
def _universe() -> frozenset[str]:
    """Parameter names of fxad's API, torch.nn.functional, torch.nn modules, torch functions
    and Tensor methods: where a keyword of a hint that names no callable must come from."""
    names: set[str] = set()
    spaces = [(fxad, fxad.__all__), (torch.nn.functional, dir(torch.nn.functional)),
              (torch.nn, dir(torch.nn)), (torch, dir(torch)), (torch.Tensor, dir(torch.Tensor))]
    for mod, attrs in spaces:
        for a in attrs:
            if a.startswith("_"):
                continue
            obj = getattr(mod, a, None)
            if callable(obj):
                names |= _params(obj)
    return frozenset(names)


@lru_cache(maxsize=None)
def _cli_flags() -> frozenset[str]:
    import argparse

    from fxad.cli import build_parser

    flags: set[str] = set()
    stack = [build_parser()]
    while stack:
        p = stack.pop()
        for action in p._actions:
            flags |= {s for s in action.option_strings if s.startswith("--")}
            if isinstance(action, argparse._SubParsersAction):
                stack += list(action.choices.values())
    return frozenset(flags)


@lru_cache(maxsize=None)
def _module_flags(module: str) -> frozenset[str]:
    """``--flags`` that ``python -m module`` accepts: the ``add_argument`` literals in the
    module's source (all files of a package)."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        return frozenset()
    origin = Path(spec.origin)
    files = sorted(origin.parent.rglob("*.py")) if origin.name == "__init__.py" else [origin]
    flags: set[str] = set()
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and _call_name(node) == "add_argument":
                flags |= {a.value for a in node.args if isinstance(a, ast.Constant)
                          and isinstance(a.value, str) and a.value.startswith("--")}
    return frozenset(flags)


_DOTTED = re.compile(r"(?<![\w.])((?:fxad|torch|F|nn)(?:\.[A-Za-z_]\w*)+)")
_FLAG = re.compile(r"(?<![\w-])(--[a-z][\w-]*)")
_KEYWORD = re.compile(r"(?<![\w.])([a-z_]\w*)=(?!=)")
_METHOD = re.compile(r"\.([a-z_]\w*)\(")
_SNAKE = re.compile(r"(?<![\w.\-])([a-z][a-z0-9]*(?:_[a-z0-9]+)+)(?![\w(]|\.[a-z])")
_PYTHON_M = re.compile(r"python3? -m ([\w.]+)")


def _called(text: str) -> list[tuple[object | None, str]]:
    """(callable, its argument text) for each ``name(...)`` call the text spells out."""
    out = []
    for m in re.finditer(r"((?:fxad|torch|F|nn)(?:\.\w+)+|\.\w+)\(([^()]*)\)", text):
        name, args = m.group(1), m.group(2)
        obj = getattr(torch.Tensor, name[1:], None) if name.startswith(".") else _resolve(name)
        out.append((obj, args))
    return out


def problems(text: str, kind: str = "hint", context: frozenset[str] = frozenset()
             ) -> list[str]:
    """What is wrong with the options one hint names (empty: all exist).  For error messages
    (``kind="message"``) only ``fxad.``/``torch.`` names and command-line flags are checked:
    their other words describe the user's own code.  ``context``: parameters of the function
    that raises (a keyword of the function the user called)."""
    out: list[str] = []
    for dotted in _DOTTED.findall(text):
        if _resolve(dotted) is None:
            out.append(f"{dotted} does not exist")
    modules = [m for m in _PYTHON_M.findall(text) if m != "fxad"]
    flags = set().union(*(_module_flags(m) for m in modules)) if modules else _cli_flags()
    for flag in _FLAG.findall(text):
        if flag not in flags:
            where = f"python -m {' / '.join(modules)}" if modules else "the fxad command line"
            out.append(f"{where} has no option {flag}")
    if kind != "hint":
        return out
    checked: set[str] = set()
    for obj, args in _called(text):
        if obj is None:
            continue
        own = _params(obj)
        if isinstance(obj, type(torch.Tensor.add)) or not own:  # a Tensor method: torch.name
            own |= _params(getattr(torch, getattr(obj, "__name__", ""), None))
        for kw in _KEYWORD.findall(args):
            checked.add(kw)
            if own and kw not in own:
                out.append(f"keyword {kw}= is not a parameter of {getattr(obj, '__name__', obj)}")
    for kw in _KEYWORD.findall(text):
        if kw not in checked and kw not in _universe() and kw not in context:
            out.append(f"keyword {kw}= is not a parameter of fxad's API or torch")
    for word in _SNAKE.findall(text):
        if word in _universe() or word in context or any(
                hasattr(m, word) for m in (fxad, torch, torch.Tensor, torch.nn.functional,
                                           torch.autograd, torch.autograd.function)) \
                or f"--{word.replace('_', '-')}" in _cli_flags():
            continue
        out.append(f"{word} is neither an option nor a function of fxad or torch")
    lowered = text.lower()
    # ("stop marking this module as a leaf": undoing what the user did with leaf_modules=)
    if re.search(r"\bas a leaf\b|\bleaf module\b", lowered) and "leaf_modules" not in text \
            and "--leaf" not in text and "stop marking" not in lowered:
        out.append("advises marking a module as a leaf without naming leaf_modules= / --leaf")
    if re.search(r"\bregister (a|the) (derivative )?rule\b", lowered) \
            and "register_vjp" not in text:
        out.append("advises registering a rule without naming fxad.register_vjp")
    return out


def _bad(hints: list[Hint]) -> list[str]:
    return [f"{h}: {'; '.join(p)}" for h in hints
            if (p := problems(h.text, h.kind, h.context))]


@lru_cache(maxsize=None)
def _source_hints() -> list[Hint]:
    return collect_hints()


def test_hints_are_collected():
    hints = _source_hints()
    texts = [h.text for h in hints if h.kind == "hint"]
    assert len(texts) >= 20
    assert any("register_vjp" in t for t in texts)            # rules/registry.py
    assert any("--input" in t for t in texts)                 # cli.py
    assert any(h.file.startswith("check/") for h in hints)


def test_every_hint_names_existing_options():
    bad = _bad(_source_hints())
    assert not bad, "hints naming options that do not exist:\n" + "\n".join(bad)


def test_checker_rejects_made_up_options():
    made_up = [
        "pass the flag through concrete_args",
        "mark the enclosing module as a leaf and register a rule for it",
        "call fxad.no_such_function(f)",
        "use torch.nn.functional.no_such_op instead",
        "rerun with fxad check --no-such-flag",
        "pass frobnicate=True to fxad.vjp",
        "use F.conv2d(x, w, stride_mode=2)",
        "set use_magic=True",
        "write one with `python -m fxad.tools.coverage --no-such-flag x.md`",
        "remove @no_such_decorator from the function",
    ]
    for text in made_up:
        assert problems(text), text
    good = [
        "register a rule with fxad.register_vjp(MyOp, ..., replace=True)",
        "keep the module a single op with leaf_modules=(Block,) (fxad check --leaf Block) and "
        "register a rule for it with fxad.register_vjp(Block)",
        "use reduction='none', 'mean' or 'sum'",
        "pad explicitly with F.pad and use padding=0",
        "index with integer tensors (mask.nonzero(as_tuple=True)) instead",
        "pass one --input EXPR per argument of the function",
        "build it with fused kernels off: `with fxad.fused_kernels(False): g = fxad.grad(f, x)`",
        "write one with `python -m fxad.tools.coverage --out coverage_report.md`",
        "remove @once_differentiable from Fn.backward",
    ]
    for text in good:
        assert not problems(text), (text, problems(text))


def test_self_test_finds_a_bad_hint_in_source(tmp_path):
    (tmp_path / "mod.py").write_text(
        "from fxad.errors import CaptureError\n"
        "def _error(op, message, hint):\n"
        "    return CaptureError(message, hint=hint)\n"
        "def f():\n"
        "    raise CaptureError('x', hint='pass the integer through concrete_args')\n"
        "def g():\n"
        "    raise _error('op', 'msg', 'call fxad.nonexistent()')\n"
        "def h(kind):\n"
        "    hint = 'use fxad.vjp'\n"
        "    if kind:\n"
        "        hint += ' with bogus_option=1'\n"
        "    return CaptureError('y', hint=hint)\n")
    hints = collect_hints(tmp_path)
    bad = _bad(hints)
    assert any("concrete_args" in b for b in bad)
    assert any("fxad.nonexistent" in b for b in bad)
    assert any("bogus_option" in b for b in bad)


def test_cli_leaf_option(tmp_path, capsys):
    """The option the leaf hints name on the command line: --leaf CLASS (a class of FILE.py
    or a dotted path) keeps the module as one op, differentiated by its registered rule."""
    import textwrap

    from fxad.cli import main

    path = tmp_path / "leafy.py"
    path.write_text(textwrap.dedent("""
        import torch
        import torch.nn as nn
        import fxad


        class Scale(nn.Module):
            def __init__(self):
                super().__init__()
                self.w = nn.Parameter(torch.tensor(3.0))

            def forward(self, x):
                return x * self.w


        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.s = Scale()

            def forward(self, x):
                return self.s(x).sum()


        @fxad.register_vjp(Scale, replace=True)
        class ScaleRule:
            def fwd(mod, x):
                return mod(x), (x, mod.param("w"))

            def bwd(aux, d):
                x, w = aux
                return {"w": (x * d).sum()}, d * w
    """))
    try:
        assert main(["show", f"{path}:Net", "--leaf", "Scale", "-i", "randn(5)"]) == 0
        assert "self.s(x)" in capsys.readouterr().out  # one op, not traced through
        assert main(["check", f"{path}:Net", "--leaf", "Scale", "--dtype", "bfloat16",
                     "-i", "randn(5)"]) == 0
        assert capsys.readouterr().out.startswith("fxad.check passed (torch.bfloat16)")
        assert main(["check", f"{path}:Net", "--leaf", "torch.nn.Linear", "-i", "randn(5)"]) == 0
        capsys.readouterr()
        assert main(["check", f"{path}:Net", "--leaf", "Nope", "-i", "randn(5)"]) == 2
        err = capsys.readouterr().err
        assert "--leaf Nope" in err and "choose one of: Net, Scale" in err
    finally:
        import sys

        mod = sys.modules.get("_fxad_cli_leafy")
        if mod is not None:
            fxad.unregister(mod.Scale)
