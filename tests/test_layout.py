"""The layout of fxad (docs/architecture.md): the layer order of the whole package (a module
imports only from its own layer or below, with no import cycle and no function-local import of
an fxad module), and inside the rules layer, rule modules named for the op family they hold,
importing only torch, the standard library, the op record, the shared helpers and their own
package's ``_common`` module.  Read from the source with ``ast``; nothing is imported."""
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
           "fxad.rules.dispatch", "fxad.rules.builtin"}

# fxad modules every rule module may import: the op record and the layers below the rules
# (the autograd fallback evaluates ops on fake tensors with the graph layer and registers the
# names generated code spells them with)
ALLOWED = {"fxad.rules.registry", "fxad.rules._base", "fxad.rules.fused", "fxad.errors",
           "fxad.ops", "fxad.naming", "fxad.originals", "fxad.graph.proxy", "fxad.graph.shapes", "fxad.codegen"}

# function-local imports of higher layers that the support modules need, with the reason;
# a new one has to be added here deliberately (none: the complex-rule verification that
# needs the public API is fxad.tools.complex_check)
SUPPORT_EXCEPTIONS: set[tuple[str, str]] = set()


def _modules() -> list[tuple[str, pathlib.Path]]:
    out = []
    for path in sorted(RULES.rglob("*.py")):
        parts = ["fxad", "rules", *path.relative_to(RULES).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out.append((".".join(parts), path))
    return out


def _import_statements(name: str, path: pathlib.Path):
    """``(absolute module, imported names, line, at module level, names are modules)`` for
    every import in the file, function-local ones included: ``import a.b`` gives ``("a.b",
    [], ...)``, ``from .x import y, z`` gives ``("fxad.pkg.x", ["y", "z"], ...)``, and the
    last item is True for ``from . import fused`` (no module named)."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    top = {id(n) for n in tree.body}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, [], node.lineno, id(node) in top, False
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            yield (mod, [a.name for a in node.names], node.lineno, id(node) in top,
                   bool(node.level) and not node.module)


def _imports(name: str, path: pathlib.Path) -> list[tuple[str, int, bool]]:
    """``(absolute module, line, at module level)`` for every import in the file; ``from .
    import fused`` names the module ``fxad.rules.fused``."""
    out = []
    for mod, names, line, top_level, bare in _import_statements(name, path):
        if bare:  # from . import fused
            out += [(f"{mod}.{n}", line, top_level) for n in names]
        else:
            out.append((mod, line, top_level))
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
                        "from ._common import _bound\nfrom ..registry import register_vjp\n"
                        "from ...errors import RuleError\nfrom .. import fused\n"
                        "from ... import ops\n")


# --- the layer order of the whole package (docs/architecture.md, "Layers") ------------------

SRC = RULES.parent

# bottom up; a module belongs to the layer of its longest matching prefix (a prefix matches
# the module itself and its submodules; "fxad" only the package's __init__)
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("fxad.errors", "fxad.naming", "fxad.ops", "fxad._version", "fxad.argparsing",
              "fxad.originals")),
    ("op record", ("fxad.rules.registry",)),
    ("graph", ("fxad.graph",)),
    ("passes", ("fxad.simplify", "fxad.codegen", "fxad.memory", "fxad.op_kinds",
                "fxad.guards")),
    ("capture", ("fxad.capture",)),
    ("rules", ("fxad.rules",)),
    ("engines", ("fxad.ad",)),
    ("pipeline", ("fxad.pipeline", "fxad.symbolic")),
    ("public", ("fxad", "fxad.api", "fxad.higher", "fxad.check", "fxad.residuals",
                "fxad.training", "fxad.distributed", "fxad.view", "fxad.plot", "fxad.demo",
                "fxad.eject")),
    ("tools", ("fxad.tools", "fxad.cli", "fxad.__main__")),  # the command line runs the tools
]


def _all_modules(src: pathlib.Path) -> dict[str, pathlib.Path]:
    out = {}
    for path in sorted((src).rglob("*.py")):
        parts = ["fxad", *path.relative_to(src).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def layer_of(module: str) -> int:
    best, found = -1, None
    for k, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            # the package itself ("fxad") names only its __init__, not everything under it
            inside = module.startswith(p + ".") and p != "fxad"
            if (module == p or inside) and len(p) > best:
                best, found = len(p), k
    if found is None:
        raise KeyError(module)
    return found


def _has_layer(module: str) -> bool:
    try:
        layer_of(module)
    except KeyError:
        return False
    return True


def _fxad_imports(name: str, path: pathlib.Path, mods: dict) -> list[tuple[str, int, bool]]:
    """``(imported fxad module, line, at module level)`` for every import of an fxad module
    in the file, function-local ones included (``from x import y`` counts ``x.y`` where that
    is a module, else ``x``)."""
    out = []
    for mod, names, line, top_level, _ in _import_statements(name, path):
        targets = [f"{mod}.{n}" if f"{mod}.{n}" in mods else mod for n in names] or [mod]
        for t in targets:
            while t and t not in mods:
                t = t.rpartition(".")[0]
            if t and t != name and t.split(".")[0] == "fxad":
                # a package's __init__ importing its own submodules is not a dependency
                if path.name == "__init__.py" and t.startswith(name + "."):
                    continue
                out.append((t, line, top_level))
    return out


def layer_problems(src: pathlib.Path) -> list[str]:
    mods = _all_modules(src)
    problems, edges = [], {}
    for name, path in mods.items():
        try:
            mine = layer_of(name)
        except KeyError:
            problems.append(f"{name}: in no layer; add it to LAYERS (and docs/architecture.md)")
            continue
        edges[name] = set()
        for target, line, top_level in _fxad_imports(name, path, mods):
            rel = path.relative_to(src.parent)
            edges[name].add(target)
            if not top_level:
                problems.append(f"{rel}:{line}: function-local import of {target}; import it "
                                "at module level (a local import hides a layering problem)")
            theirs = layer_of(target) if target in edges or _has_layer(target) else -1
            if theirs > mine:
                problems.append(f"{rel}:{line}: {name} ({LAYERS[mine][0]}) imports {target} "
                                f"({LAYERS[theirs][0]}), a layer above it")
    # no cycle, within a layer either (Tarjan's strongly connected components)
    index, low, stack, on, counter = {}, {}, [], set(), [0]

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                problems.append("import cycle: " + " <-> ".join(sorted(comp)))

    for v in sorted(edges):
        if v not in index:
            strong(v)
    return problems


def test_layers():
    assert layer_problems(SRC) == []


def test_no_module_outside_rules_over_800_lines():
    long = [f"{p.relative_to(SRC.parent)}: {n} lines" for p in sorted(SRC.rglob("*.py"))
            if "rules" not in p.relative_to(SRC).parts
            and (n := len(p.read_text().splitlines())) > 800]
    assert long == []


def test_layer_checks_catch_bad_imports(tmp_path):
    """The layer check fails on an upward import, a function-local import, a cycle and a
    module in no layer."""
    src = tmp_path / "fxad"

    def tree(files: dict[str, str]) -> list[str]:
        for rel, text in files.items():
            p = src / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(text)
        return layer_problems(src)

    base = {"__init__.py": "", "errors.py": "", "graph/__init__.py": "",
            "graph/proxy.py": "from ..errors import X\n", "ad/__init__.py": "",
            "ad/reverse.py": "from ..graph.proxy import Emitter\n"}
    assert tree(base) == []
    assert any("a layer above" in p for p in tree({"graph/proxy.py": "from ..ad import reverse\n"}))
    (src / "graph/proxy.py").write_text("from ..errors import X\n")
    assert any("function-local" in p
               for p in tree({"ad/reverse.py": "def f():\n    from ..graph import proxy\n"}))
    (src / "ad/reverse.py").write_text("from ..graph.proxy import Emitter\n")
    assert any("cycle" in p for p in tree({"ad/forward.py": "from . import reverse\n",
                                           "ad/reverse.py": "from . import forward\n"}))
    assert any("in no layer" in p for p in tree({"stray.py": ""}))
