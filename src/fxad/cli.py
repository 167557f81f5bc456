"""Command line interface: ``fxad demo``, ``fxad show``, ``fxad check``.

Examples::

    fxad demo --quick
    fxad show model.py:mlp --input "randn(4, 3)" --input "randn(3, 2)"
    fxad show model.py:mlp --input "randn(4, 3)" --input "randn(3, 2)" --html mlp.html
    fxad check model.py:Net --input "randn(8, 16)" --input "randint(0, 10, (8,))"
    fxad check model.py:Net --leaf Block --input "randn(8, 16)"     # Block: one op, own rule
    fxad check model.py:mlp --dtype bfloat16 --input "randn(4, 3)" --input "randn(3, 2)"
    fxad eject model.py:Net --input "randn(8, 16)" -o net_vjp.py     # edit it, then:
    fxad check model.py:Net --input "randn(8, 16)" --vjp net_vjp.py

``FILE.py:NAME`` names a function, an ``nn.Module`` subclass (instantiated with no
arguments) or an ``nn.Module`` instance defined in ``FILE.py``.  Each ``--input`` is a Python
expression evaluated with the names of the ``torch`` namespace available (``randn``,
``randint``, ``tensor``, ``float64``...), plus ``torch``, ``nn`` and ``F``; the random
generator is seeded (``--seed``) first.  ``--leaf CLASS`` (repeatable) keeps every instance of
an ``nn.Module`` class as one op, as ``leaf_modules=`` does in the Python API; it needs a rule
(``fxad.register_vjp(CLASS)``, e.g. at the bottom of ``FILE.py``).  ``CLASS`` is a class
defined in ``FILE.py`` or a dotted path (``torch.nn.LayerNorm``, ``nn.LayerNorm``).

``fxad show`` marks the lines whose derivative comes from the autograd fallback
(``# autograd fallback``) and prints one ``fxad: warning:`` naming those ops and lines.

Errors print one line, ``fxad: error: <message> (at file:line) — fix: <hint>``, and exit
with status 2 (``fxad check`` exits with 1 when the derivatives disagree); ``--debug`` shows
the full traceback instead.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import traceback
import warnings
from dataclasses import replace
from typing import Any, Sequence

import torch

from ._version import __version__
from .api import grad, show, vjp
from .check import check
from .demo.train import QUICK, DemoConfig, run_demo
from .eject import KINDS, eject
from .errors import CheckError, FxadError
from .rules.fallback import FallbackWarning
from .view import view

EXIT_OK, EXIT_CHECK_FAILED, EXIT_ERROR = 0, 1, 2


class UsageError(Exception):
    """A problem with the command line itself (bad FILE:NAME, bad --input expression)."""

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.hint = hint


# ------------------------------------------------------------------------------------------
# loading the user's object and inputs
# ------------------------------------------------------------------------------------------

def load_target(spec: str) -> tuple[Any, str]:
    """Load ``FILE.py:NAME``; returns (object, path of the file).

    A module class is instantiated with no arguments; functions and module instances are
    returned as they are.
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
        raise UsageError(f"{path} defines no {name!r}",
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
    """Evaluate each ``--input`` expression (see the module docstring)."""
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


def _prepare(args: argparse.Namespace) -> tuple[Any, list[Any], tuple[type, ...]]:
    obj, path = load_target(args.target)
    if isinstance(obj, torch.nn.Module) and args.eval:
        obj.eval()
    leaves = resolve_leaves(args.leaf, path)
    if not args.input:
        raise UsageError("no inputs given", hint="pass one --input EXPR per argument of "
                                                 "the function, e.g. --input \"randn(4, 3)\"")
    return obj, eval_inputs(args.input, args.seed), leaves


# ------------------------------------------------------------------------------------------
# commands
# ------------------------------------------------------------------------------------------

def cmd_show(args: argparse.Namespace) -> int:
    obj, inputs, leaves = _prepare(args)
    build = grad if args.grad else vjp
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", FallbackWarning)
        gm = build(obj, *inputs, leaf_modules=leaves)
    for w in caught:  # the autograd fallback: one note (its lines are marked in the code)
        if issubclass(w.category, FallbackWarning):
            print(f"fxad: warning: {w.message} (marked `# autograd fallback` below)",
                  file=sys.stderr)
        else:
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    if args.html:  # the interactive page (fxad.view) instead of the text
        title = f"{args.target} · {'fxad.grad' if args.grad else 'fxad.vjp'}"
        path = view(gm, policy=args.policy, title=title).save(args.html)
        print(f"fxad: wrote {path} ({os.path.getsize(path) // 1024} KiB, self-contained: open "
              "it in a browser)", file=sys.stderr)
        return EXIT_OK
    show(gm, color=False if args.no_color else None)
    return EXIT_OK


_DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16,
           "float16": torch.float16, "keep": None}


def cmd_check(args: argparse.Namespace) -> int:
    obj, inputs, leaves = _prepare(args)
    if args.vjp is not None and not os.path.exists(args.vjp):
        raise UsageError(f"--vjp {args.vjp}: no such file")
    report = check(obj, *inputs, dtype=_DTYPES[args.dtype], seed=args.seed,
                   leaf_modules=leaves, vjp=args.vjp)
    print(report)
    return EXIT_OK


def cmd_eject(args: argparse.Namespace) -> int:
    obj, inputs, leaves = _prepare(args)
    if args.kind == "training":  # as in training: the model's parameters, not the inputs
        inputs = [x.requires_grad_(False) if isinstance(x, torch.Tensor) else x
                  for x in inputs]
    out = args.output or "-"
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
            raise UsageError("--steps must be at least 1")
        changes["steps"] = args.steps
    if args.float32:
        changes["dtype"] = torch.float32
    if args.threads is not None:
        if args.threads < 0:
            raise UsageError("--threads must be >= 0")
        changes["threads"] = args.threads
    if args.no_cnn:
        changes["cnn"] = False
    if args.no_code:
        changes["show_code"] = False
    run_demo(replace(cfg, **changes), progress=not args.no_progress)
    return EXIT_OK


# ------------------------------------------------------------------------------------------
# parser and error reporting
# ------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    debug = argparse.ArgumentParser(add_help=False)
    debug.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help="show full tracebacks instead of one-line errors")
    p = argparse.ArgumentParser(
        prog="fxad", description="Readable source-to-source automatic differentiation for "
        "PyTorch, on torch.fx.", parents=[debug])
    p.add_argument("--version", action="version", version=f"fxad {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)

    d = sub.add_parser("demo", parents=[debug], help="train a tiny GPT with fxad and with "
                       "autograd side by side; differentiate a CNN with batch norm",
                       description="Train TinyGPT on the Python standard library's source "
                       "twice (fxad gradients vs torch.autograd) and compare.")
    d.add_argument("--steps", type=int, default=None, help="training steps (default 300, "
                   "20 with --quick)")
    d.add_argument("--quick", action="store_true", help="tiny model and few steps: a few "
                   "seconds")
    d.add_argument("--float32", action="store_true",
                   help="run the fxad-vs-autograd training comparison in float32 (default "
                        "float64, where the two runs agree to rounding; the speed ratio is "
                        "always measured in float32)")
    d.add_argument("--threads", type=int, default=None, help="torch CPU threads (default 1; "
                   "0: torch's default)")
    d.add_argument("--no-cnn", action="store_true", help="skip the SmallCNN part")
    d.add_argument("--no-code", action="store_true", help="do not print generated code")
    d.add_argument("--no-progress", action="store_true", help="no progress display")
    d.set_defaults(func=cmd_demo)

    for name, func, text in (
            ("show", cmd_show, "print the generated VJP code with shape comments"),
            ("check", cmd_check, "compare fxad's derivatives with autograd and finite "
                                 "differences (exit status 1 if they disagree)"),
            ("eject", cmd_eject, "write the derivative as one editable Python file "
                                 "(fxad.eject)")):
        c = sub.add_parser(name, parents=[debug], help=text, description=text + ".")
        c.add_argument("target", metavar="FILE.py:NAME",
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
        if name == "show":
            c.add_argument("--grad", action="store_true",
                           help="show fxad.grad (scalar output, cotangent 1) instead of vjp")
            c.add_argument("--no-color", action="store_true", help="plain text output")
            c.add_argument("--html", metavar="OUT.html", default=None,
                           help="write an interactive, self-contained HTML view instead: "
                                "forward and backward side by side, saved tensors, memory, "
                                "dataflow graph (fxad.view)")
            c.add_argument("--policy", choices=["save", "min_memory"], default=None,
                           help="with --html: show the training step of this residual policy "
                                "(default: the code as generated)")
        elif name == "eject":
            c.add_argument("--kind", choices=list(KINDS), default="vjp",
                           help="vjp (default), grad (scalar output) or training (the "
                                "forward/backward split that fxad.compile(vjp=FILE) trains "
                                "with)")
            c.add_argument("--output", "-o", metavar="OUT.py", default=None,
                           help="file to write (default: standard output)")
        else:
            c.add_argument("--vjp", metavar="FILE.py", default=None,
                           help="check this edited derivative (written by `fxad eject`) "
                                "instead of fxad's own; names the first block that departs")
            c.add_argument("--dtype", choices=sorted(_DTYPES), default="float64",
                           help="dtype of the check (default float64; 'keep' keeps the "
                                "inputs' dtypes); in a dtype other than float64 the formulas "
                                "are checked in float64 and fxad's code in the dtype against "
                                "its rounding (see fxad.check)")
        c.set_defaults(func=func)
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
    """The one-line report ``fxad: error: <message> (at file:line) — fix: <hint>``."""
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
        text += f" — fix: {' '.join(str(hint).split())}"  # one line, even for code examples
    elif not isinstance(exc, (FxadError, UsageError)):
        text += " — rerun with --debug for the full traceback"
    return text


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``fxad`` command; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
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
    except Exception as e:  # one clear line unless --debug
        if debug:
            traceback.print_exc()
        else:
            print(format_error(e, user_file), file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
