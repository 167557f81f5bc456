"""The ``fxad`` command line: one entry point for everything fxad does from a shell.

Commands (each has its own ``--help``)::

    fxad demo [--quick] [--steps N] [--float32]        # TinyGPT trained with fxad vs autograd
    fxad show model.py:mlp -i "randn(4, 3)" -i "randn(3, 2)"        # VJP code with shapes
    fxad check model.py:Net -i "randn(8, 16)" -i "randint(0, 10, (8,))"  # vs autograd
    fxad check model.py:Net --leaf Block -i "randn(8, 16)"  # Block: one op, its own rule
    fxad view model.py:Net -i "randn(8, 16)" -o net.html   # the interactive page
    fxad view --demo -o block.html --screenshot block.png  # the demo's transformer block
    fxad eject model.py:Net -i "randn(8, 16)" -o net_vjp.py  # edit it, then:
    fxad check model.py:Net -i "randn(8, 16)" --vjp net_vjp.py
    fxad coverage --only sin matmul     # the OpInfo sweep  (python -m fxad.tools.coverage)
    fxad models --only GPT-2            # real models       (python -m fxad.tools.models)
    fxad fuzz --n 500 --seed 0          # random programs   (python -m fxad.tools.fuzz)
    fxad bench                          # list benchmarks/*.py; fxad bench NAME [ARGS...] runs one

``FILE.py:NAME`` names a function, an ``nn.Module`` subclass (instantiated with no
arguments) or an ``nn.Module`` instance defined in ``FILE.py``.  Each ``--input`` (``-i``) is
a Python expression evaluated with the names of the ``torch`` namespace available
(``randn``, ``randint``, ``tensor``, ``float64``...), plus ``torch``, ``nn`` and ``F``; the
random generator is seeded (``--seed``) first.  ``--leaf CLASS`` (repeatable) keeps every
instance of an ``nn.Module`` class as one op, as ``leaf_modules=`` does in the Python API; it
needs a rule (``fxad.register_vjp(CLASS)``, e.g. at the bottom of ``FILE.py``).  ``CLASS`` is
a class defined in ``FILE.py`` or a dotted path (``torch.nn.LayerNorm``, ``nn.LayerNorm``).

The same option means the same thing in every command: ``-i/--input``, ``--seed``,
``--eval``, ``--leaf``, ``-o/--out`` (the file or folder written), ``--only`` (a subset),
``--threads``, ``--dtype``, ``--policy``, ``--debug``.  A mistyped command or option is
answered with the usage of the command it belongs to and the closest match
(``fxad show m.py:MLP --inptu ...``: ``did you mean --input?``).

``fxad show`` marks the lines whose derivative comes from the autograd fallback
(``# autograd fallback``) and prints one ``fxad: warning:`` naming those ops and lines.

Errors print ``fxad: error: <message> (at file:line) — fix: <hint>`` (a fix that shows code
keeps its lines) and exit with status 2 (``fxad check`` exits with 1 when the derivatives
disagree); ``--debug`` shows the full traceback instead.  No PyTorch log line or traceback
comes before the message.
"""
from __future__ import annotations

import argparse
import ast
import importlib.util
import os
import subprocess
import sys
import traceback
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any, Sequence

import torch

from ._version import __version__
from .api import grad, show, vjp
from .argparsing import ArgumentParser, suggest, unrecognized
from .capture.decisions import POLICIES
from .check import check
from .demo.train import QUICK, DemoConfig, run_demo
from .eject import KINDS, eject
from .errors import CheckError, FxadError
from .rules.fallback import FallbackWarning
from .tools import coverage as coverage_tool
from .tools import models as models_tool
from .tools.fuzz import __main__ as fuzz_tool
from .view import demo_view, view
from .view.command import add_page_arguments, write_page

EXIT_OK, EXIT_CHECK_FAILED, EXIT_ERROR = 0, 1, 2

#: the forward node whose backward block ``fxad view --demo --screenshot`` hovers
DEMO_HOVER = "gelu"


class UsageError(Exception):
    """A problem with the command line itself (bad FILE:NAME, bad --input expression, an
    output path in a folder that does not exist)."""

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.hint = hint


# ------------------------------------------------------------------------------------------
# loading the user's object and inputs
# ------------------------------------------------------------------------------------------

def load_target(spec: str) -> tuple[Any, str]:
    """Load ``FILE.py:NAME``; returns (object, absolute path of the file).

    A module class is instantiated with no arguments; functions and module instances are
    returned as they are.

    Raises:
        UsageError: no colon, no such file, no such name, a class that needs arguments.
    """
    path, sep, name = spec.rpartition(":")
    if not sep or not path or not name:
        raise UsageError(f"expected FILE.py:NAME, got {spec!r}",
                         hint="name the function or nn.Module class after a colon, e.g. "
                              "model.py:Net")
    if not os.path.isfile(path):
        raise UsageError(f"no such file: {path}")
    abspath = os.path.abspath(path)
    mod_name = _module_name(path)
    mspec = importlib.util.spec_from_file_location(mod_name, abspath)
    if mspec is None or mspec.loader is None:
        raise UsageError(f"cannot import {path} (is it a .py file?)")
    module = importlib.util.module_from_spec(mspec)
    sys.modules[mod_name] = module
    sys.path.insert(0, os.path.dirname(abspath))  # let the file import its neighbours
    try:
        mspec.loader.exec_module(module)
    finally:
        sys.path.remove(os.path.dirname(abspath))
    if not hasattr(module, name):
        public = sorted(k for k, v in vars(module).items()
                        if not k.startswith("_") and _is_target(v) and
                        getattr(v, "__module__", mod_name) == mod_name)
        near = suggest(name, public)
        raise UsageError(f"{path} defines no {name!r}" + (f" (did you mean {near!r}?)"
                                                           if near else ""),
                         hint=f"choose one of: {', '.join(public)}" if public else None)
    obj = getattr(module, name)
    if isinstance(obj, type) and issubclass(obj, torch.nn.Module):
        try:
            obj = obj()
        except TypeError as e:
            raise UsageError(f"cannot instantiate {name}() with no arguments: {e}",
                             hint="give the constructor's arguments defaults, or define a "
                                  "module instance in the file and name that") from e
    elif not callable(obj):
        raise UsageError(f"{name} in {path} is a {type(obj).__name__}, not a function or "
                         "nn.Module")
    return obj, abspath


def _module_name(path: str) -> str:
    return "_fxad_cli_" + os.path.splitext(os.path.basename(path))[0].replace("-", "_")


def resolve_leaves(names: Sequence[str], path: str) -> tuple[type, ...]:
    """``--leaf`` names: module classes from the user's ``FILE.py`` (loaded by
    :func:`load_target`) or dotted paths such as ``torch.nn.LayerNorm``."""
    user = sys.modules.get(_module_name(path))
    out = []
    for name in names:
        obj: Any = getattr(user, name, None) if user is not None and "." not in name else None
        if obj is None:
            head, _, rest = name.partition(".")
            head = {"nn": "torch.nn", "F": "torch.nn.functional"}.get(head, head)
            obj = None
            try:
                obj = importlib.import_module(head)
                for part in rest.split(".") if rest else []:
                    obj = getattr(obj, part)
            except (ImportError, AttributeError):
                obj = None
        if not (isinstance(obj, type) and issubclass(obj, torch.nn.Module)):
            classes = sorted(k for k, v in vars(user or object).items()
                             if isinstance(v, type) and issubclass(v, torch.nn.Module)
                             and not k.startswith("_"))
            raise UsageError(f"--leaf {name}: not an nn.Module class in {path} or an importable "
                             "dotted path",
                             hint=f"choose one of: {', '.join(classes)}" if classes else
                             "name a module class, e.g. --leaf torch.nn.LayerNorm")
        out.append(obj)
    return tuple(out)


def _is_target(v: Any) -> bool:
    if isinstance(v, type):
        return issubclass(v, torch.nn.Module)
    return callable(v)


def input_namespace() -> dict[str, Any]:
    """Names available to ``--input`` expressions."""
    ns: dict[str, Any] = {k: getattr(torch, k) for k in dir(torch) if not k.startswith("_")}
    ns.update(torch=torch, nn=torch.nn, F=torch.nn.functional)
    return ns


def eval_inputs(exprs: Sequence[str], seed: int = 0) -> list[Any]:
    """Evaluate each ``--input`` expression (see the module docstring).

    Raises:
        UsageError: an expression that does not evaluate, naming it (``--input #2 ...``).
    """
    torch.manual_seed(seed)
    ns = input_namespace()
    values = []
    for i, expr in enumerate(exprs):
        try:
            values.append(eval(expr, ns))  # noqa: S307  (the user's own command line)
        except Exception as e:
            raise UsageError(f"--input #{i + 1} {expr!r}: {type(e).__name__}: {e}",
                             hint="write a torch expression such as \"randn(4, 3)\" or "
                                  "\"randint(0, 10, (4,))\"") from e
    return values


def output_path(path: str, option: str) -> str:
    """``path`` if a file can be written there, else a :class:`UsageError` naming the option
    and the path (its folder does not exist, or it is a folder)."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise UsageError(f"{option} {path}: is a directory", hint="give a file name, e.g. "
                         f"{option} {os.path.join(path, 'out' + (os.path.splitext(path)[1]))}")
    if not os.path.isdir(folder):
        raise UsageError(f"{option} {path}: the directory {folder} does not exist",
                         hint=f"create it first (mkdir -p {folder}), or write to an existing "
                              "directory")
    return path


def _prepare(args: argparse.Namespace) -> tuple[Any, list[Any], tuple[type, ...]]:
    obj, path = load_target(args.target)
    if isinstance(obj, torch.nn.Module) and args.eval:
        obj.eval()
    leaves = resolve_leaves(args.leaf, path)
    if not args.input:
        raise UsageError("no inputs given", hint="pass one --input EXPR per argument of "
                                                 "the function, e.g. --input \"randn(4, 3)\"")
    return obj, eval_inputs(args.input, args.seed), leaves


def _build(args: argparse.Namespace) -> Any:
    """``fxad.vjp`` (``fxad.grad`` with ``--grad``) of the target; the autograd fallback's
    warning becomes one ``fxad: warning:`` line."""
    obj, inputs, leaves = _prepare(args)
    build = grad if args.grad else vjp
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", FallbackWarning)
        gm = build(obj, *inputs, leaf_modules=leaves, values=args.values)
    for w in caught:  # the autograd fallback: one note (its lines are marked in the code)
        if issubclass(w.category, FallbackWarning):
            print(f"fxad: warning: {w.message} (marked `# autograd fallback` in the code)",
                  file=sys.stderr)
        else:
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    return gm


# ------------------------------------------------------------------------------------------
# commands
# ------------------------------------------------------------------------------------------

def cmd_show(args: argparse.Namespace) -> int:
    if args.html:
        output_path(args.html, "--html")
    gm = _build(args)
    if args.html:  # the interactive page (fxad.view) instead of the text
        title = f"{args.target} · {'fxad.grad' if args.grad else 'fxad.vjp'}"
        write_page(view(gm, policy=args.policy, title=title), args.html,
                   log=lambda s: print(f"fxad: {s}", file=sys.stderr))
        return EXIT_OK
    show(gm, color=False if args.no_color else None)
    return EXIT_OK


def cmd_view(args: argparse.Namespace) -> int:
    if args.demo and args.target:
        raise UsageError(f"give FILE.py:NAME or --demo, not both (got {args.target} and --demo)")
    if not args.demo and not args.target:
        raise UsageError("nothing to view", hint="name a function or module, fxad view "
                         "model.py:Net --input \"randn(8, 16)\", or view the demo's "
                         "transformer block: fxad view --demo")
    name = "tinygpt_block" if args.demo else args.target.rpartition(":")[2]
    out = args.out if args.out is not None else f"{name}.html"
    output_path(out, "--out")
    if args.screenshot:
        output_path(args.screenshot, "--screenshot")
    if args.demo:
        v = demo_view(policy=args.policy)
        hover = args.hover or DEMO_HOVER
    else:
        gm = _build(args)
        v = view(gm, policy=args.policy,
                 title=f"{args.target} · {'fxad.grad' if args.grad else 'fxad.vjp'}")
        hover = args.hover
    return write_page(v, out, screenshot=args.screenshot, width=args.width,
                      height=args.height, hover=hover,
                      log=lambda s: print(f"fxad: {s}", file=sys.stderr))


_DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16,
           "float16": torch.float16, "keep": None}


def cmd_check(args: argparse.Namespace) -> int:
    obj, inputs, leaves = _prepare(args)
    if args.vjp is not None and not os.path.exists(args.vjp):
        raise UsageError(f"--vjp {args.vjp}: no such file",
                         hint="write one with fxad eject FILE.py:NAME --input ... -o FILE")
    report = check(obj, *inputs, dtype=_DTYPES[args.dtype], seed=args.seed,
                   leaf_modules=leaves, vjp=args.vjp, values=args.values)
    print(report)
    return EXIT_OK


def cmd_eject(args: argparse.Namespace) -> int:
    out = args.out or "-"
    if out != "-":
        output_path(out, "--out")
    obj, inputs, leaves = _prepare(args)
    if args.kind == "training":  # as in training: the model's parameters, not the inputs
        inputs = [x.requires_grad_(False) if isinstance(x, torch.Tensor) else x
                  for x in inputs]
    flags = " ".join(f"--input {e!r}" for e in args.input)
    flags += "".join(f" --leaf {c}" for c in args.leaf) + (" --eval" if args.eval else "")
    flags += f" --seed {args.seed}" if args.seed else ""
    cmd = f"fxad check {args.target} {flags} --vjp {out if out != '-' else 'FILE.py'}"
    text = eject(obj, *inputs, kind=args.kind, leaf_modules=leaves, check_command=cmd)
    if out == "-":
        sys.stdout.write(text)
    else:
        with open(out, "w", encoding="utf-8") as fh:
            fh.write(text)
        print(f"fxad: wrote {out} ({args.kind}; check an edit with: {cmd})", file=sys.stderr)
    return EXIT_OK


def cmd_demo(args: argparse.Namespace) -> int:
    cfg = QUICK if args.quick else DemoConfig()
    changes: dict[str, Any] = {}
    if args.steps is not None:
        if args.steps < 1:
            raise UsageError(f"--steps {args.steps}: must be at least 1")
        changes["steps"] = args.steps
    if args.dtype is not None:
        changes["dtype"] = _DTYPES[args.dtype]
    if args.threads is not None:
        if args.threads < 0:
            raise UsageError(f"--threads {args.threads}: must be >= 0")
        changes["threads"] = args.threads
    if args.no_cnn:
        changes["cnn"] = False
    if args.no_code:
        changes["show_code"] = False
    run_demo(replace(cfg, **changes), progress=not args.no_progress)
    return EXIT_OK


def cmd_coverage(args: argparse.Namespace) -> int:
    output_path(args.out, "--out")
    return coverage_tool.run(args)


def cmd_models(args: argparse.Namespace) -> int:
    return models_tool.run(args)


def cmd_fuzz(args: argparse.Namespace) -> int:
    return fuzz_tool.run(args)


# ------------------------------------------------------------------------------------------
# benchmarks: scripts of the repository, not installed with the package
# ------------------------------------------------------------------------------------------

def benchmark_dirs(explicit: str | None = None) -> list[Path]:
    """Where ``fxad bench`` looks for ``bench_*.py``, in order: ``--dir``, else
    ``$FXAD_BENCHMARKS``, the ``benchmarks/`` folder of the checkout fxad is installed from
    (``src/fxad/../../benchmarks``), and ``./benchmarks``."""
    if explicit:
        return [Path(explicit)]
    out = []
    if os.environ.get("FXAD_BENCHMARKS"):
        out.append(Path(os.environ["FXAD_BENCHMARKS"]))
    out += [Path(__file__).resolve().parents[2] / "benchmarks", Path.cwd() / "benchmarks"]
    return out


def find_benchmarks(explicit: str | None = None) -> tuple[Path, dict[str, Path]]:
    """The benchmarks folder and its scripts by name (``bench_fxad.py`` is ``fxad``).

    Raises:
        UsageError: no folder with ``bench_*.py`` scripts, naming the places looked in.
    """
    looked = benchmark_dirs(explicit)
    for d in looked:
        scripts = sorted(d.glob("bench_*.py")) if d.is_dir() else []
        if scripts:
            return d, {p.stem[len("bench_"):]: p for p in scripts}
    raise UsageError(
        "no benchmarks found: the benchmark scripts are files of fxad's repository "
        "(benchmarks/bench_*.py), not part of the installed package; looked in "
        + ", ".join(str(d) for d in looked),
        hint="run fxad bench from a checkout of the repository, or pass --dir PATH "
             "(or set FXAD_BENCHMARKS) to its benchmarks folder")


def _first_doc_line(path: Path) -> str:
    try:
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    except (OSError, SyntaxError):
        return ""
    line = doc.strip().split("\n\n")[0].replace("\n", " ").replace("``", "")
    line = line.split(": ")[0] if len(line) > 90 else line  # the first clause of a long one
    return line if len(line) <= 90 else line[:87].rstrip() + "..."


def cmd_bench(args: argparse.Namespace) -> int:
    folder, scripts = find_benchmarks(args.dir)
    if not args.name:
        print(f"benchmarks in {folder} (run one: fxad bench NAME [ARGS...]; "
              "fxad bench NAME --help for its options):")
        width = max(len(n) for n in scripts)
        for name, path in scripts.items():
            print(f"  {name:{width}}  {_first_doc_line(path)}")
        return EXIT_OK
    name = args.name[len("bench_"):] if args.name.startswith("bench_") else args.name
    name = name[:-3] if name.endswith(".py") else name
    if name not in scripts:
        near = suggest(name, scripts)
        raise UsageError(f"no benchmark {args.name!r} in {folder}"
                         + (f" (did you mean {near!r}?)" if near else ""),
                         hint=f"choose one of: {', '.join(scripts)}")
    env = dict(os.environ)  # the script imports this fxad, however it was found
    pkg_root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = pkg_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH")
                                    else "")
    print(f"fxad: running {scripts[name]} {' '.join(args.args)}".rstrip(), file=sys.stderr,
          flush=True)
    return subprocess.run([sys.executable, str(scripts[name]), *args.args], env=env).returncode


# ------------------------------------------------------------------------------------------
# parser and error reporting
# ------------------------------------------------------------------------------------------

def _target_arguments(c: argparse.ArgumentParser, *, optional: bool = False) -> None:
    """FILE.py:NAME and the options that build it: -i/--input, --seed, --eval, --leaf."""
    c.add_argument("target", metavar="FILE.py:NAME", nargs="?" if optional else None,
                   help="function, nn.Module class (built with no arguments) or module "
                        "instance in FILE.py")
    c.add_argument("--input", "-i", action="append", default=[], metavar="EXPR",
                   help="one positional input, a torch expression such as "
                        "\"randn(4, 3)\"; repeat per argument")
    c.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    c.add_argument("--eval", action="store_true", help="call .eval() on a module first")
    c.add_argument("--leaf", action="append", default=[], metavar="CLASS",
                   help="keep instances of this nn.Module class as single ops (like "
                        "leaf_modules=; the class needs an fxad.register_vjp rule); a "
                        "class in FILE.py or a dotted path; repeatable")
    c.add_argument("--values", choices=POLICIES, default="guard",
                   help="Python decisions on tensor values (if, assert, .item()): taken on "
                        "the inputs' values and checked on every call ('guard', default), "
                        "data-dependent sizes too ('guard+sizes'), integers read from data "
                        "and the sizes of selections (x[mask], nonzero, masked_select, "
                        "unique) read again on every call ('guard+unbacked'), or refused "
                        "('refuse')")


def build_parser() -> ArgumentParser:
    """The ``fxad`` parser; ``parser.commands`` maps each command to its own parser."""
    debug = argparse.ArgumentParser(add_help=False)
    debug.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help="show full tracebacks instead of one-line errors")
    p = ArgumentParser(
        prog="fxad", description="Readable source-to-source automatic differentiation for "
        "PyTorch, on torch.fx. Each command has its own --help.", parents=[debug])
    p.add_argument("--version", action="version", version=f"fxad {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True,
                           parser_class=ArgumentParser)
    commands: dict[str, ArgumentParser] = {}

    def command(name: str, func: Any, text: str, description: str | None = None) -> Any:
        c = sub.add_parser(name, parents=[debug], help=text,
                           description=description or text[0].upper() + text[1:] + ".")
        c.set_defaults(func=func)
        commands[name] = c
        return c

    d = command("demo", cmd_demo, "train a tiny GPT with fxad and with autograd side by side; "
                "differentiate a CNN with batch norm",
                "Train TinyGPT on the Python standard library's source twice (fxad gradients "
                "vs torch.autograd) and compare; then a small CNN with batch norm.")
    d.add_argument("--quick", action="store_true", help="tiny model and few steps: a few "
                   "seconds")
    d.add_argument("--steps", type=int, default=None, help="training steps (default 300, "
                   "20 with --quick)")
    d.add_argument("--dtype", choices=["float64", "float32"], default=None,
                   help="dtype of the fxad-vs-autograd training comparison (default float64, "
                        "where the two runs agree to rounding; the speed ratio is always "
                        "measured in float32)")
    d.add_argument("--float32", dest="dtype", action="store_const", const="float32",
                   help="the same as --dtype float32")
    d.add_argument("--float64", dest="dtype", action="store_const", const="float64",
                   help="the same as --dtype float64 (the default)")
    d.add_argument("--threads", type=int, default=None, help="torch CPU threads (default 1; "
                   "0: torch's default)")
    d.add_argument("--no-cnn", action="store_true", help="skip the SmallCNN part")
    d.add_argument("--no-code", action="store_true", help="do not print generated code")
    d.add_argument("--no-progress", action="store_true", help="no progress display")

    c = command("show", cmd_show, "print the generated VJP code with shape comments")
    _target_arguments(c)
    c.add_argument("--grad", action="store_true",
                   help="show fxad.grad (scalar output, cotangent 1) instead of vjp")
    c.add_argument("--no-color", action="store_true", help="plain text output")
    c.add_argument("--html", metavar="OUT.html", default=None,
                   help="write the interactive page instead (as fxad view --out)")
    c.add_argument("--policy", choices=["save", "min_memory"], default=None,
                   help="with --html: show the training step of this residual policy "
                        "(default: the code as generated)")

    c = command("check", cmd_check, "compare fxad's derivatives with autograd and finite "
                "differences (exit status 1 if they disagree)")
    _target_arguments(c)
    c.add_argument("--vjp", metavar="FILE.py", default=None,
                   help="check this edited derivative (written by `fxad eject`) "
                        "instead of fxad's own; names the first block that departs")
    c.add_argument("--dtype", choices=sorted(_DTYPES), default="float64",
                   help="dtype of the check (default float64; 'keep' keeps the "
                        "inputs' dtypes); in a dtype other than float64 the formulas "
                        "are checked in float64 and fxad's code in the dtype against "
                        "its rounding (see fxad.check)")

    c = command("view", cmd_view, "write the interactive HTML page of the derivative: forward "
                "and backward side by side, saved tensors, memory, dataflow graph (fxad.view)")
    _target_arguments(c, optional=True)
    c.add_argument("--demo", action="store_true",
                   help="view the demo's transformer block instead of FILE.py:NAME")
    c.add_argument("--out", "-o", metavar="OUT.html", default=None,
                   help="the page to write (default NAME.html; tinygpt_block.html with "
                        "--demo)")
    c.add_argument("--grad", action="store_true",
                   help="view fxad.grad (scalar output, cotangent 1) instead of vjp")
    add_page_arguments(c)

    c = command("eject", cmd_eject, "write the derivative as one editable Python file "
                "(fxad.eject)")
    _target_arguments(c)
    c.add_argument("--kind", choices=list(KINDS), default="vjp",
                   help="vjp (default), grad (scalar output) or training (the forward/"
                        "backward split that fxad.compile(vjp=FILE) trains with)")
    c.add_argument("--out", "-o", "--output", dest="out", metavar="OUT.py", default=None,
                   help="file to write (default: standard output)")

    c = command("coverage", cmd_coverage, "sweep PyTorch's OpInfo database: every op's "
                "derivatives against torch.autograd (python -m fxad.tools.coverage)")
    coverage_tool.add_arguments(c)
    c = command("models", cmd_models, "check, train and time real models built from "
                "configurations (python -m fxad.tools.models)")
    models_tool.add_arguments(c)
    c = command("fuzz", cmd_fuzz, "random programs through fxad.vjp and fxad.jvp against "
                "eager PyTorch (python -m fxad.tools.fuzz)", fuzz_tool.DESCRIPTION)
    fuzz_tool.add_arguments(c)

    c = command("bench", cmd_bench, "list the benchmark scripts of the repository "
                "(benchmarks/), or run one: fxad bench NAME [ARGS...]")
    c.add_argument("--dir", metavar="PATH", default=None,
                   help="the benchmarks folder (default: $FXAD_BENCHMARKS, the checkout "
                        "fxad is installed from, ./benchmarks)")
    c.add_argument("name", nargs="?", metavar="NAME",
                   help="benchmark to run (bench_NAME.py); none: list them")
    c.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS",
                   help="passed to the script (fxad bench NAME --help: its options)")
    p.commands = commands  # type: ignore[attr-defined]
    return p


def _where(exc: BaseException, user_file: str | None = None) -> str | None:
    """``file:line`` for an exception: the fxad error's location, else the innermost frame
    of the traceback in the user's file, else the innermost frame."""
    loc = getattr(exc, "loc", None)
    if loc is not None:
        return f"{_short_path(loc.filename)}:{loc.lineno}"
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return None
    pick = frames[-1]
    if user_file is not None:
        mine = [f for f in frames if os.path.abspath(f.filename) == user_file]
        pick = mine[-1] if mine else pick
    return f"{_short_path(pick.filename)}:{pick.lineno}"


def _short_path(path: str) -> str:
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return path
    return path if rel.startswith("..") else rel


def format_error(exc: BaseException, user_file: str | None = None) -> str:
    """The report ``fxad: error: <message> (at file:line) — fix: <hint>``: one line, and the
    fix's further lines as they are when it shows code (as the Python API prints it)."""
    if isinstance(exc, FxadError):
        msg = exc.bare_message
    elif isinstance(exc, UsageError):
        msg = str(exc)
    else:
        msg = f"{type(exc).__name__}: {exc}"
    msg = " ".join(part.strip() for part in str(msg).splitlines() if part.strip()) or \
        type(exc).__name__
    text = f"fxad: error: {msg}"
    where = None if isinstance(exc, UsageError) else _where(exc, user_file)
    if where:
        text += f" (at {where})"
    hint = getattr(exc, "hint", None)
    if hint:
        first, *more = str(hint).strip("\n").splitlines()
        text += f" — fix: {' '.join(first.split())}"
        text += "".join(f"\n{line.rstrip()}" for line in more if line.strip())
    elif not isinstance(exc, (FxadError, UsageError)):
        text += " — rerun with --debug for the full traceback"
    return text


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``fxad`` command; returns the exit status."""
    parser = build_parser()
    try:
        args, extras = parser.parse_known_args(argv)
        if extras:  # reported by the command they were given to, with its usage
            unrecognized(parser.commands.get(getattr(args, "command", None), parser), extras)
    except SystemExit as e:  # --help, --version, a usage error (already printed)
        return e.code if isinstance(e.code, int) else EXIT_ERROR
    debug = getattr(args, "debug", False)
    user_file = None
    target = getattr(args, "target", None)
    if target and ":" in target:
        user_file = os.path.abspath(target.rpartition(":")[0])
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("fxad: interrupted", file=sys.stderr)
        return 130
    except CheckError as e:
        if debug:
            traceback.print_exc()
        else:
            print(format_error(e, user_file), file=sys.stderr)
        return EXIT_CHECK_FAILED
    except Exception as e:  # one clear report unless --debug
        if debug:
            traceback.print_exc()
        else:
            print(format_error(e, user_file), file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
