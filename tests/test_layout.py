"""The layout of :mod:`fxad.rules` (see its docstring and docs/architecture.md): rule modules
named for the op family they hold, importing only torch, the standard library, the registry,
the shared helpers and their own package's ``_common`` module, so that the rules form one
layer under the engines.  Read from the source with ``ast``; nothing is imported."""
from __future__ import annotations

import ast
import pathlib
import re
import sys

import pytest

RULES = pathlib.Path(__file__).resolve().parents[1] / "src" / "fxad" / "rules"

# modules that serve the whole package rather than hold a rule family: the package itself,
# the registry, the complex-verification machinery and the autograd fallback (the shared
# helpers in _base.py and the fused-kernel switch are held to the rule modules' imports)
SUPPORT = {"fxad.rules", "fxad.rules.registry", "fxad.rules.complex", "fxad.rules.fallback",
           "fxad.rules.dispatch"}

# fxad modules every rule module may import
ALLOWED = {"fxad.rules.registry", "fxad.rules._base", "fxad.rules.fused", "fxad.errors",
           "fxad.ops", "fxad.naming"}

# function-local imports of higher layers that the support modules need, with the reason;
# a new one has to be added here deliberately
SUPPORT_EXCEPTIONS = {
    # the autograd fallback evaluates ops on capture's fake tensors and registers the names
    # generated code spells them with
    ("fxad.rules.fallback", "fxad.capture"),
    ("fxad.rules.fallback", "fxad.graph.proxy"),
    ("fxad.rules.fallback", "fxad.graph.shapes"),
    ("fxad.rules.fallback", "fxad.codegen"),
    # check_rule / main verify rules on complex samples end to end, through the public API
    ("fxad.rules.complex", "fxad"),
}


def _modules() -> list[tuple[str, pathlib.Path]]:
    out = []
    for path in sorted(RULES.rglob("*.py")):
        parts = ["fxad", "rules", *path.relative_to(RULES).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out.append((".".join(parts), path))
    return out


def _imports(name: str, path: pathlib.Path) -> list[tuple[str, int, bool]]:
    """``(absolute module, line, at module level)`` for every import in the file."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    top = {id(n) for n in tree.body}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno, id(node) in top) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if node.level and not node.module:  # from . import fused
                out += [(f"{mod}.{a.name}", node.lineno, id(node) in top) for a in node.names]
            else:
                out.append((mod, node.lineno, id(node) in top))
    return out


def _family(name: str) -> str:
    """``fxad.rules.nn`` for ``fxad.rules.nn.losses``; the module itself at the top level."""
    parts = name.split(".")
    return ".".join(parts[:3])


def _problems(name: str, path: pathlib.Path) -> list[str]:
    rel = path.relative_to(RULES.parent)
    out = []
    for mod, line, top_level in _imports(name, path):
        root = mod.split(".")[0]
        if root == "__future__" or root == "torch" or root in sys.stdlib_module_names:
            continue
        if root != "fxad":
            out.append(f"{rel}:{line}: imports {mod} (not torch or the standard library)")
            continue
        if mod in ALLOWED:
            continue
        if name in SUPPORT:
            if mod.startswith("fxad.rules."):
                continue  # support modules serve the whole package
            if not top_level and (name, mod) in SUPPORT_EXCEPTIONS:
                continue
            out.append(f"{rel}:{line}: imports {mod}, a layer above the rules")
            continue
        if mod.startswith("fxad.rules."):
            family = _family(name)
            if name == family and mod.startswith(name + "."):
                continue  # a family package's __init__ imports its modules
            if mod == family + "._common" and not name.endswith("._common"):
                continue  # the family package's own helpers
            if mod == family or mod.startswith(family + "."):
                out.append(f"{rel}:{line}: imports {mod}, a sibling rule module; helpers "
                           "shared within a package go to its _common.py")
            else:
                out.append(f"{rel}:{line}: imports {mod}, another rule family; helpers shared "
                           "by several families go to fxad/rules/_base.py")
            continue
        out.append(f"{rel}:{line}: imports {mod}, a layer above the rules (the engine, "
                   "capture, API, training or code generation)")
    return out


@pytest.mark.parametrize("name,path", _modules(), ids=lambda v: str(v) if isinstance(v, str)
                         else "")
def test_rule_module_imports(name, path):
    assert _problems(name, path) == []


def test_rule_module_names():
    bad = [str(p.relative_to(RULES)) for p in RULES.rglob("*.py")
           if re.search(r"extra|\d", str(p.relative_to(RULES)))]
    assert bad == [], "name rule modules for the op family they hold"


def test_checks_catch_bad_imports(tmp_path, monkeypatch):
    """The checks above fail on the imports they are meant to refuse."""
    monkeypatch.setattr(sys.modules[__name__], "RULES", tmp_path / "rules")

    def problems(name: str, src: str) -> list[str]:
        path = tmp_path / (name.replace("fxad.", "", 1).replace(".", "/") + ".py")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(src)
        return _problems(name, path)

    assert problems("fxad.rules.nn.losses", "from ..activations import x\n")  # no such family
    assert problems("fxad.rules.nn.losses", "from .activations import x\n")  # a sibling
    assert problems("fxad.rules.nn._common", "from .losses import x\n")
    assert problems("fxad.rules.math", "from .arithmetic import _helper\n")
    assert problems("fxad.rules.math", "from ..ad.reverse import vjp\n")
    assert problems("fxad.rules.math", "def f():\n    from ..capture.proxy import fake_mode\n")
    assert problems("fxad.rules.views", "import fxad.training\n")
    assert problems("fxad.rules.registry", "from ..api import vjp\n")
    assert problems("fxad.rules.registry", "from ..capture.proxy import describe_target\n")
    assert not problems("fxad.rules.nn.losses",
                        "import math\nimport torch\nfrom .._base import builtin\n"
                        "from ._common import _bound\nfrom ..registry import add_rule\n"
                        "from ...errors import RuleError\nfrom .. import fused\n"
                        "from ... import ops\n")
