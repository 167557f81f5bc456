"""Eject a derivative: fxad's generated code as one readable Python file that you can edit.

:func:`eject` writes the VJP (``kind="vjp"``), the gradient (``kind="grad"``) or the training
split of :func:`fxad.compile` (``kind="training"``: forward-with-saved-tensors and backward)
of a model as plain functions that take the model instance and read its parameters from it::

    def vjp(model, x, d_linear_1):
        fc1_weight = model.fc1.weight
        ...
        # backward of: linear_1 = torch.nn.functional.linear(tanh, fc2_weight, fc2_bias)
        d_tanh = d_linear_1 @ fc2_weight
        ...

The file needs only ``torch``; its header states what it was built for (input shapes and
dtypes, the guards, the fxad and torch versions) and how to check an edit of it
(``fxad check FILE.py:Net --input ... --vjp FILE``, :func:`fxad.check` with ``vjp=``); the
``# backward of:`` provenance comments are kept, so that :func:`fxad.check` can name the
block where an edited derivative departs from fxad's own (:func:`trace_values`).  An edited
training split trains with ``fxad.compile(model, *inputs, vjp=FILE)``.

Calling conventions (the constants at the top of the file record them):

* ``vjp(model, *inputs, cotangent) -> (outputs, input_grads, param_grads)``;
* ``grad(model, *inputs) -> (value, input_grads, param_grads)``;
* ``forward(model, *inputs) -> (*outputs, *saved)`` (``N_OUTPUTS`` outputs) and
  ``backward(model, [*saved, *cotangents]) -> (*input_grads, *param_grads)``: one entry per
  input (``None`` except at ``INPUT_GRADS``), then the gradients of the parameters
  ``PARAMS``.

For a plain function (not an ``nn.Module``) the functions take no ``model`` argument
(``TAKES_MODEL = False``); a function that reads tensors other than its arguments cannot be
ejected (wrap it in an ``nn.Module``).
"""
from __future__ import annotations

import ast
import importlib.util
import itertools
import os
import re
import sys
import types
from typing import Any, Callable, Iterable

import torch
import torch.fx as fx

from .api import grad as _grad
from .api import vjp as _vjp
from .errors import InputError
from .residuals import partition

__all__ = ["eject", "load", "trace_values", "returned_names", "KINDS"]

KINDS = ("vjp", "grad", "training")
#: globals of fx's generated code that the ejected file provides itself
_PROVIDED = {"torch": "import torch", "inf": "from math import inf",
             "nan": "from math import nan", "device": "from torch import device",
             "NoneType": "NoneType = type(None)",
             # side effects replayed by the code (fxad.capture.effects)
             "print": "from builtins import print", "numpy": "import numpy",
             "float": "from builtins import float", "int": "from builtins import int",
             "bool": "from builtins import bool", "complex": "from builtins import complex",
             "fxad_numpy_of": "from fxad.capture.effects import numpy_of as fxad_numpy_of",
             "fxad_log": "from fxad.capture.effects import log_at_call as fxad_log",
             "fxad_printed": "from fxad.capture.printed import printed as fxad_printed",
             "fxad_python_draw":
                 "from fxad.capture.effects import python_draw as fxad_python_draw",
             "fxad_numpy_draw": "from fxad.capture.effects import numpy_draw as fxad_numpy_draw",
             # guards of decisions on tensor values (fxad.capture.decisions)
             "fxad_expect": "from fxad.guards import expect as fxad_expect",
             "fxad_expect_size": "from fxad.guards import expect_size as fxad_expect_size",
             # layout guards of strided ops (fxad.rules._base)
             "fxad_expect_layout":
                 "from fxad.rules._base import expect_layout as fxad_expect_layout"}
_counter = itertools.count()


def _fxad_version() -> str:
    # the package's attribute, read when called (fxad/__init__ imports this module)
    mod = sys.modules.get("fxad")
    return getattr(mod, "__version__", "?")


def _resolve(model: Any, target: str) -> bool:
    obj = model
    for part in target.split("."):
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return isinstance(obj, torch.Tensor)


def _function_source(gm: fx.GraphModule, name: str, model: Any) -> tuple[str, set[str]]:
    """The code of ``gm`` as ``def name(model, ...)`` (or without ``model``)."""
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            if model is None:
                raise InputError(
                    f"cannot eject: the derivative reads the tensor {n.target!r}, which is not "
                    "an argument of the function",
                    hint="wrap the function in an nn.Module whose parameters/buffers hold it")
            if not _resolve(model, str(n.target)):
                raise InputError(
                    f"cannot eject: the derivative reads the tensor {n.target!r}, which is not "
                    "a parameter or buffer of the model (a constant captured in the trace)",
                    hint="register the tensor as a buffer of the model")
    code = gm.graph.python_code("self")
    src = code.src
    if "tree_flatten_spec" in src or "_in_spec" in src:
        raise InputError("cannot eject a module with pytree calling conventions")
    used = {g for g in code.globals if re.search(rf"\b{re.escape(g)}\b", src)}
    missing = sorted(used - set(_PROVIDED))
    if missing:
        raise InputError(f"cannot eject: the generated code calls fxad runtime helpers "
                         f"({', '.join(missing)}) that a standalone file cannot hold")
    lines = src.strip("\n").splitlines()
    head = lines[0]
    if not head.startswith("def forward(self"):
        raise InputError(f"cannot eject: unexpected generated code {head!r}")
    rest = head[len("def forward(self"):]
    rest = rest[2:] if rest.startswith(", ") else rest
    first = f"def {name}(model, {rest}" if model is not None else f"def {name}({rest}"
    first = first.replace(", )", ")")
    body = []
    for line in lines[1:]:
        line = line.rstrip()
        if not line:
            continue
        line = re.sub(r"\bself\.", "model.", line)
        line = re.sub(r"getattr\(self, ", "getattr(model, ", line)
        body.append(line)
    text = "\n".join([first] + body) + "\n"
    if re.search(r"\bself\b", "\n".join(ln.split("#")[0] for ln in body)):
        raise InputError("cannot eject: the generated code refers to the module itself")
    return text, used


def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        dt = str(x.dtype).replace("torch.", "")
        return f"{dt}[{', '.join(str(s) for s in x.shape)}] on {x.device}" + \
            (" requires_grad" if x.requires_grad else "")
    return repr(x)


def _guard_lines(gm: fx.GraphModule) -> list[str]:
    spec = gm.meta.get("fxad_input_spec")
    out = []
    if spec is not None:
        for text in (t for _, _, t in getattr(spec, "predicates", [])):
            out.append(f"#   size decision: {text}")
        if getattr(spec, "values", None):
            out.append("#   the values of integer inputs " +
                       ", ".join(spec.names[i] for i in spec.values) + " (used as sizes)")
    return out


def _built_for(inputs: tuple, model: Any) -> dict:
    shapes = []
    for x in inputs:
        if isinstance(x, torch.Tensor):
            shapes.append((tuple(int(s) for s in x.shape), str(x.dtype), str(x.device)))
        else:
            shapes.append(("value", repr(x)))
    mods = [(n, m.training) for n, m in model.named_modules()] if model is not None else []
    return {"inputs": shapes, "training": sorted({t for _, t in mods}) if mods else [],
            "fxad": _fxad_version(), "torch": torch.__version__}


def eject(f: Callable | torch.nn.Module, *inputs: Any, kind: str = "vjp",
          path: str | os.PathLike | None = None, policy: Any = "save",
          leaf_modules: Iterable[type] = (), check_command: str | None = None) -> str:
    """The derivative of ``f`` at the shapes of ``inputs`` as one self-contained Python file.

    Args:
        f: ``nn.Module`` (its parameters are read from the instance passed to the ejected
            functions) or function of tensors.
        inputs: example inputs (the code is specialized on their shapes and dtypes).
        kind: ``"vjp"`` (``vjp(model, *inputs, cotangent)``), ``"grad"`` (scalar output:
            ``grad(model, *inputs)``) or ``"training"`` (``forward`` and ``backward``, the
            split that :func:`fxad.compile` runs with ``policy``; only the inputs with
            ``requires_grad`` get gradients, as in training).
        path: if given, the file is written there too.
        policy: residual policy of the training split (see :func:`fxad.residuals.partition`).
        check_command: the command line shown in the header for checking an edit (default:
            the Python call).

    Returns:
        The file's text.
    """
    if kind not in KINDS:
        raise InputError(f"eject(kind={kind!r}): use one of {', '.join(KINDS)}")
    model = f if isinstance(f, torch.nn.Module) else None
    leaf_modules = tuple(leaf_modules)
    what = type(f).__name__ if model is not None else getattr(f, "__name__", "function")
    sig = "model, " if model is not None else ""
    consts: list[str] = [f"KIND = {kind!r}", f"TAKES_MODEL = {model is not None}"]
    if kind == "vjp":
        gm = _vjp(f, *inputs, leaf_modules=leaf_modules)
        funcs, used = _function_source(gm, "vjp", model)
        usage = [f"#   outputs, input_grads, param_grads = vjp({sig}*inputs, cotangent)"]
        gms = [gm]
    elif kind == "grad":
        gm = _grad(f, *inputs, leaf_modules=leaf_modules)
        funcs, used = _function_source(gm, "grad", model)
        usage = [f"#   value, input_grads{', param_grads' if model is not None else ''} = "
                 f"grad({sig}*inputs)"]
        gms = [gm]
    else:
        argnums = tuple(i for i, x in enumerate(inputs) if isinstance(x, torch.Tensor)
                        and x.requires_grad and (x.is_floating_point() or x.is_complex()))
        gm = _vjp(f, *inputs, leaf_modules=leaf_modules, argnums=argnums)
        part = partition(gm, policy)
        fwd, u1 = _function_source(part.fwd_gm, "forward", model)
        bwd, u2 = _function_source(part.bwd_gm, "backward", model)
        funcs, used = fwd + "\n\n" + bwd, u1 | u2
        grads_of = [i for i, g in enumerate(part.input_grads) if g]
        consts += [f"N_OUTPUTS = {part.n_outputs}", f"INPUT_GRADS = {grads_of!r}",
                   f"PARAMS = {list(part.param_names)!r}",
                   f"SAVED = {list(part.saved_names)!r}"]
        usage = [f"#   *outputs, *saved = forward({sig}*inputs)   (N_OUTPUTS outputs)",
                 f"#   grads = backward({sig}[*saved, *cotangents])   (one per input, None "
                 "where not in INPUT_GRADS, then PARAMS)",
                 "#   train with it: fxad.compile(model, *inputs, vjp=THIS_FILE)"]
        gms = [gm]
    built = _built_for(inputs, model)
    header = [f"# fxad eject: the {kind} derivative of {what}, generated by fxad "
              f"{built['fxad']} with torch {built['torch']}.",
              "# Edit it freely: fxad checks an edit against autograd, finite differences and "
              "its own code.",
              "# Built for (the guards: the code is specialized on these; other shapes, dtypes "
              "or modes need a new eject):"]
    for i, x in enumerate(inputs):
        header.append(f"#   input {i}: {_describe(x)}")
    if model is not None:
        header.append(f"#   model mode: {'training' if model.training else 'eval'}")
    for g in gms:
        header += _guard_lines(g)
    header += ["# Call:"] + usage + ["# Check an edit:",
               f"#   {check_command}" if check_command else
               f"#   fxad.check({'model' if model is not None else 'f'}, *inputs, "
               "vjp=\"THIS_FILE.py\")",
               "#   (the first `# backward of:` block that departs from fxad's own derivative "
               "is named)"]
    imports = sorted({_PROVIDED[g] for g in used} | {"import torch"})
    text = "\n".join(header) + "\n" + "\n".join(imports) + "\n\n" + "\n".join(consts) + \
        f"\nBUILT_FOR = {built!r}\n\n\n" + funcs
    compile(text, "<fxad eject>", "exec")  # it must parse
    if path is not None:
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(text)
    return text


def load(source: str | os.PathLike | types.ModuleType) -> types.ModuleType:
    """An ejected file as a Python module (``source``: a path, the file's text or a module)."""
    if isinstance(source, types.ModuleType):
        return source
    text = str(source)
    if "\n" not in text and os.path.exists(text):
        name = f"fxad_ejected_{next(_counter)}"
        spec = importlib.util.spec_from_file_location(name, text)
        if spec is None or spec.loader is None:
            raise InputError(f"cannot load {text!r} as Python")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod  # importable by name (torch.compile looks its globals up)
        spec.loader.exec_module(mod)
        return mod
    if "\n" not in text:
        raise InputError(f"no ejected file at {text!r}")
    mod = types.ModuleType(f"fxad_ejected_{next(_counter)}")
    mod.__file__ = f"<fxad eject {mod.__name__}>"
    mod.__dict__["__fxad_source__"] = text
    sys.modules[mod.__name__] = mod
    exec(compile(text, mod.__file__, "exec"), mod.__dict__)  # noqa: S102 - the user's code
    return mod


# ------------------------------------------------------------------------------------------
# values by name and block (to localize an edit)
# ------------------------------------------------------------------------------------------

def _source_of(fn: Callable) -> tuple[str, str]:
    """(the text of the file defining ``fn``, its file name)."""
    g = getattr(fn, "__globals__", {})
    text = g.get("__fxad_source__")
    if text is not None:
        return text, fn.__code__.co_filename
    fname = fn.__code__.co_filename
    with open(fname, encoding="utf-8") as fh:
        return fh.read(), fname


def trace_values(fn: Callable, *args: Any) -> list[tuple[str, Any, str, int]]:
    """Run ``fn(*args)`` recording every value it assigns to a name, in order: a list of
    ``(name, value, block, line)``, ``block`` the last ``# backward of:`` comment above the
    assignment (``"forward"`` before the first), ``line`` the assignment's line.  ``fn`` is
    a plain function whose source is available (an ejected or edited derivative)."""
    text, fname = _source_of(fn)
    tree = ast.parse(text)
    line0 = fn.__code__.co_firstlineno
    fdef = next((n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)
                 and n.name == fn.__name__ and (n.lineno == line0 or any(
                     d.lineno == line0 for d in n.decorator_list))), None)
    if fdef is None:
        raise InputError(f"cannot find the source of {fn.__name__} in {fname}")
    lines = text.splitlines()
    blocks: dict[int, str] = {}
    current = "forward"
    for i in range(fdef.lineno, (fdef.end_lineno or len(lines)) + 1):
        s = lines[i - 1].strip()
        if s.startswith("# backward of:"):
            current = s[2:]
        blocks[i] = current

    def instrument(body: list[ast.stmt]) -> list[ast.stmt]:
        out: list[ast.stmt] = []
        for st in body:
            out.append(st)
            if isinstance(st, ast.Assign) and not (isinstance(st.value, ast.Constant)
                                                   and st.value.value is None):
                names = []
                for t in st.targets:
                    elts = t.elts if isinstance(t, (ast.Tuple, ast.List)) else [t]
                    names += [e.id for e in elts if isinstance(e, ast.Name)]
                for nm in names:
                    out.append(ast.parse(f"__fxad_rec__({nm!r}, {nm}, {st.lineno})").body[0])
        return out

    fdef.body = instrument(fdef.body)
    fdef.decorator_list = []
    mod = ast.Module(body=[fdef], type_ignores=[])
    ast.fix_missing_locations(mod)
    records: list[tuple[str, Any, str, int]] = []
    ns = dict(getattr(fn, "__globals__", {}))
    ns["__fxad_rec__"] = lambda name, value, line: records.append(
        (name, value, blocks.get(line, "forward"), line))
    exec(compile(mod, fname, "exec"), ns)  # noqa: S102 - the user's own function
    ns[fn.__name__](*args)
    return records


def returned_names(fn: Callable) -> list[str]:
    """The names in ``fn``'s (last) ``return (a, b, ...)`` statement (``"?"`` for an
    expression that is not a name)."""
    text, _ = _source_of(fn)
    line0 = fn.__code__.co_firstlineno
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.FunctionDef) and node.name == fn.__name__ and \
                node.lineno == line0:
            rets = [n for n in ast.walk(node) if isinstance(n, ast.Return)]
            if not rets or rets[-1].value is None:
                return []
            v = rets[-1].value
            elts = v.elts if isinstance(v, (ast.Tuple, ast.List)) else [v]
            return [e.id if isinstance(e, ast.Name) else "?" for e in elts]
    return []
