"""Effects of the traced program besides its value: replayed in the generated code, or refused.

The program runs once, at capture, on fake tensors; a Python effect there happens once and
never again when the generated code runs.  The effects the generated code can repeat are
recorded as graph nodes in the program's order, marked ``meta['fxad_side_effect'] = True``
(kept by dead-code elimination, never merged, placed in the forward part of a training
step), so they run on every call, ordered with the random ops around them:

* the random-number generator's state: ``torch.manual_seed(s)`` (and ``torch.random.``,
  ``torch.cuda.manual_seed(_all)``), ``torch.get_rng_state()`` / ``torch.set_rng_state(s)``,
  and ``with torch.random.fork_rng():`` (the state read on entry, written back on exit), so
  the draws after them match eager PyTorch's on every call;
* ``print(...)``: one ``print`` line in the code, printing the values of that call (tensors
  among its arguments are the graph's values; a print never carries a derivative).  Text the
  program's own code formats from a traced tensor (an f-string, ``str(t)``,
  ``"{:.3f}".format(t)``) is a marker while tracing (:func:`formatted`), and a ``print`` of it
  prints ``'...{:.3f}'.format(t)`` of the call's values.  A number read from a tensor only to
  be printed, in the print's own line (``print(f"{loss.item():.3f}")``, ``print(float(t))``),
  is read at call time too (``printed_1 = fxad_printed(loss, 'float')``), with no value guard
  (:func:`fxad.capture.printed.printed_number`: the line's syntax tree says where the
  number goes);
* a logging call of the program (``log.info("loss %.3f", loss.item())``, an f-string message,
  a tensor argument, ``logging.warning(...)``) whose message or arguments hold traced values:
  one line of the code, ``fxad_log(name, level, msg, *args)`` (:func:`log_at_call`), with
  the call's values, so the logger's level and handlers are those at call time; a number
  read only to be logged is read at call time with no guard, as for ``print``.  A message
  holding no traced value is logged once, at build time, as Python logs it (library
  warnings logged once per process stay so), and so is one with ``exc_info``, ``extra`` or
  ``stack_info``; a call below the logger's level at build time is not in the code;
* NumPy's global random draws (every draw of its global ``RandomState``, and ``seed``,
  ``get_state``, ``set_state``): each draw is a line of the code, so NumPy's state advances as
  in eager code, and an array drawn there that becomes a tensor directly
  (``torch.tensor(a)``, ``torch.from_numpy(a)``, ``torch.as_tensor(a)``) is the value of that
  line.  An array that went through further NumPy computation first cannot be replayed: that
  conversion raises :class:`~fxad.errors.CaptureError` naming the draws and the conversion;
* NumPy seeded inside the program with a constant (``np.random.seed(0)``, or ``set_state``
  of a known state): NumPy's state is known at build time from there, so its draws and the
  NumPy code on them run for real and are constants (an array becoming a tensor is read from
  a constant of the module, :func:`numpy_of`); one line at the seed's place sets NumPy's state
  to the one eager code has after those draws (:func:`_open_stretch`).

A ``torch.Generator`` argument of the program is a placeholder the random ops draw from
(:meth:`fxad.capture.session.Session.arg`); one the program reseeds itself is restored and
announced (:func:`generator_inputs_kept`).  Capture leaves NumPy's global state as it found
it (:func:`numpy_state_kept`).  A draw from Python's ``random`` module is a Python value the
code would fix at build time: refused with :class:`~fxad.errors.CaptureError` naming the line.
Other effects (a global counter, an outer list appended to, an attribute set on an outer
object or a module) are announced by :mod:`fxad.capture.python_state`.

Only calls made by the program's own code are recorded (not torch's or fxad's: a checkpoint
saving the RNG state), and not inside a control-flow body (a ``print`` there is announced).
"""
from __future__ import annotations

import builtins
import contextlib
import logging
import os
import random as py_random
import re
import sys
import sysconfig
import warnings
from typing import Any, Iterator, NoReturn

import torch
import torch.fx as fx
from torch.utils._python_dispatch import _disable_current_modes

from ..errors import CaptureError, SourceLoc
from ..graph.proxy import to_fake, user_source_loc
from ..naming import code_builtin
from .printed import marker, printed_node, printed_text
from .state import current, has_tensor

try:
    import numpy as np
    import numpy.random as np_random
except ImportError:  # pragma: no cover - torch without NumPy
    np = np_random = None  # type: ignore[assignment]

# NumPy's module-level draws (the methods of its global RandomState), and its seeding
NUMPY_DRAWS = tuple(sorted(
    {n for n in dir(np_random) if not n.startswith("_")
     and getattr(getattr(np_random, n), "__self__", None) is getattr(
         getattr(np_random, "mtrand", None), "_rand", object())}
    | {"seed", "ranf", "sample", "random_sample", "get_state", "set_state"})) \
    if np_random is not None else ()
_TORCH_SEEDING = (("manual_seed", torch), ("manual_seed", torch.random),
                  ("set_rng_state", torch), ("set_rng_state", torch.random),
                  ("get_rng_state", torch), ("get_rng_state", torch.random))
_CUDA_SEEDING = ("manual_seed", "manual_seed_all", "set_rng_state", "get_rng_state")
# Python's own random module: its float draws are replayed by the generated code
# (:func:`python_draw`); the others (integers, choices, permutations) would be fixed at build
# time: refused
PYTHON_FLOAT_DRAWS = ("random", "uniform", "gauss", "normalvariate", "lognormvariate",
                      "betavariate", "expovariate", "gammavariate", "vonmisesvariate",
                      "paretovariate", "weibullvariate", "triangular")
PYTHON_DRAWS = PYTHON_FLOAT_DRAWS + ("randint", "randrange", "choice", "choices", "shuffle",
                                     "sample", "getrandbits", "binomialvariate")
_GET_STATE, _SET_STATE = torch.random.get_rng_state, torch.random.set_rng_state


def _loc_text(loc: SourceLoc | None) -> str:
    return f"{loc.short()} (`{loc.code}`)" if loc is not None else "an unknown line"


def record_effect(cap: Any, target: Any, args: tuple, kwargs: dict, val: Any,
                  what: str) -> fx.Node:
    """A node for the effect ``target(*args, **kwargs)`` (arguments converted by
    :meth:`~fxad.capture.session.Session.arg`), kept in place by every pass."""
    node = cap.graph.create_node("call_function", target, cap.arg(args, what),
                                 cap.arg(kwargs, what))
    node.meta["val"] = val
    node.meta["fxad_side_effect"] = True
    node.meta["fxad_no_grad"] = True
    cap.stamp(node)
    return node


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_FXAD_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _active(depth: int = 2, bodies: bool = False) -> Any:
    """The capture to record an effect in: a call from the program's code (not from torch's
    or fxad's own, e.g. a checkpoint saving the RNG state), outside a control-flow body
    (``bodies``: inside one too)."""
    cap = current()
    if cap is None or cap.suspended or (cap.lift is not None and not bodies):
        return None
    caller = os.path.abspath(sys._getframe(depth).f_code.co_filename)
    return None if caller.startswith((_TORCH_DIR, _FXAD_DIR)) else cap


def _effect_site(what: str) -> Any:
    """:func:`_active` for an effect that cannot happen inside a control-flow body: the
    capture to record it in, None for a call that is not the program's, and
    :func:`_refuse_in_body` inside a body."""
    cap = _active(depth=3, bodies=True)
    if cap is not None and cap.lift is not None:
        _refuse_in_body(what, user_source_loc())
    return cap


# -- torch's random-number generator ---------------------------------------------------------
def _seeding(orig: Any, name: str) -> Any:
    """``orig`` (a seeding or RNG-state function) recorded as an effect while capturing."""
    def seeding(*args: Any, **kwargs: Any) -> Any:
        cap = _effect_site(f"torch.{name}")
        if cap is None:
            return orig(*args, **kwargs)
        if name == "get_rng_state":
            with torch._C.DisableTorchFunction():
                val = to_fake(orig(*args, **kwargs))
            node = record_effect(cap, orig, args, kwargs, val, f"torch.{name}")
            cap.track(val, node)
            return val
        record_effect(cap, orig, args, kwargs, None, f"torch.{name}")
        return torch.default_generator if name == "manual_seed" else None
    seeding.__name__ = name
    seeding.__wrapped__ = orig  # type: ignore[attr-defined]
    return seeding


def _fork_rng(orig: Any) -> Any:
    """``torch.random.fork_rng`` recorded as reading the state on entry and writing it back
    on exit (the CPU generator's, and CUDA's where CUDA is initialized)."""
    def fork_rng(devices: Any = None, enabled: bool = True, *args: Any, **kwargs: Any) -> Any:
        cap = _effect_site("torch.random.fork_rng")
        if cap is None or not enabled:
            return orig(devices, enabled, *args, **kwargs)
        return forked(cap, devices, kwargs)

    @contextlib.contextmanager
    def forked(cap: Any, devices: Any, kwargs: dict) -> Iterator[None]:
        get, put = _GET_STATE, _SET_STATE
        with torch._C.DisableTorchFunction():
            val = to_fake(get())
        state = record_effect(cap, get, (), {}, val, "torch.random.fork_rng")
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized() \
            and kwargs.get("device_type", "cuda") == "cuda" and devices != []
        if cuda:
            cuda_state = record_effect(cap, torch.cuda.get_rng_state_all, (), {}, None,
                                       "torch.random.fork_rng")
        try:
            yield
        finally:
            node = cap.graph.create_node("call_function", put, (state,), {})
            node.meta.update(val=None, fxad_side_effect=True, fxad_no_grad=True)
            cap.stamp(node)
            if cuda:
                node = cap.graph.create_node("call_function", torch.cuda.set_rng_state_all,
                                             (cuda_state,), {})
                node.meta.update(val=None, fxad_side_effect=True, fxad_no_grad=True)
                cap.stamp(node)
    fork_rng.__wrapped__ = orig  # type: ignore[attr-defined]
    return fork_rng


# -- print ------------------------------------------------------------------------------------
_MARK = re.compile(r"<fxad-value (\d+)>")
_STDLIB = os.path.abspath(sysconfig.get_paths()["stdlib"]) + os.sep


def _formatting_frame() -> Any:
    """The program's frame that asked torch to format the tensor (an f-string or ``str(t)``
    there), or None when the code asking is fxad's own or the standard library's
    (``logging`` formatting a message)."""
    frame = sys._getframe(2)
    # fxad's dispatch of the call, then torch's (Tensor.__format__, handle_torch_function)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_FXAD_DIR):
        frame = frame.f_back
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_TORCH_DIR):
        frame = frame.f_back
    if frame is None:
        return None
    name = os.path.abspath(frame.f_code.co_filename)
    return frame if not name.startswith((_FXAD_DIR, _STDLIB)) or "site-packages" in name \
        else None


def formats_a_value(cap: Any, method: str, args: tuple) -> bool:
    """``format(t, spec)`` of a 0-d integer or boolean traced tensor in the program's code,
    into text it uses otherwise than printing (:func:`fxad.capture.printed.printed_text`;
    ``self[f"expert_{i}"]`` in SwitchTransformers): a value of the program, its text taken
    from the real value as a guarded decision (:func:`fxad.capture.decisions.decide`).  A
    float formatted into text (a warning's message) keeps the marker of :func:`formatted`."""
    t = args[0] if args else None
    if method != "__format__" or not isinstance(t, torch.Tensor) or t.dim() != 0 \
            or t.is_floating_point() or t.is_complex() or id(t) not in cap.env \
            or cap.lift is not None:
        return False
    return (frame := _formatting_frame()) is not None and not printed_text(frame)


def formatted(cap: Any, method: str, args: tuple) -> str | None:
    """``format(t, spec)`` / ``str(t)`` / ``repr(t)`` of a traced tensor in the program's own
    code, while tracing: a marker standing for the text the value will give at call time (a
    ``print`` of a string holding it prints ``'...{:.3f}'.format(t)``); None when the call
    is not the program's (it then formats the fake value as usual)."""
    if not args or id(args[0]) not in cap.env or cap.lift is not None \
            or _formatting_frame() is None:
        return None
    spec = args[1] if method == "__format__" and len(args) > 1 else ""
    return marker(cap, args[0], method, spec)


def _format_node(cap: Any, text: str) -> Any:
    """``text`` with its markers (:func:`formatted`) as a ``str.format`` node of the tensors
    they stand for; ``text`` itself when it holds none."""
    table = cap.__dict__.get("formatted", [])
    parts: list[str] = []
    values: list[Any] = []
    pos = 0
    for m in _MARK.finditer(text):
        k = int(m.group(1))
        if k >= len(table):
            continue
        t, method, spec = table[k]
        field = "{!r}" if method == "__repr__" else "{!s}" if method == "__str__" \
            else "{:" + spec + "}" if spec else "{}"
        parts.append(text[pos:m.start()].replace("{", "{{").replace("}", "}}") + field)
        values.append(t)
        pos = m.end()
    if not values:
        return text
    parts.append(text[pos:].replace("{", "{{").replace("}", "}}"))
    node = cap.graph.create_node("call_method", "format",
                                 ("".join(parts), *cap.arg(tuple(values), "print")), {})
    node.meta["val"] = text
    node.meta["fxad_no_grad"] = True
    cap.stamp(node)
    return node


def _print(orig: Any) -> Any:
    def print_(*args: Any, **kwargs: Any) -> None:
        cap = _active()
        inner = current()
        if cap is None and inner is not None and inner.lift is not None \
                and _active(depth=2, bodies=True) is not None:
            warnings.warn(
                f"print at {_loc_text(user_source_loc())} is inside a torch.cond / "
                "while_loop / scan body: it printed once, at build time, and the generated "
                "code does not print it; print before or after the call", UserWarning,
                stacklevel=2)
        if cap is None or kwargs.get("file") is not None:
            return orig(*args, **kwargs)
        loc = user_source_loc()
        args = tuple(printed_node(cap, a) for a in args)
        if any(isinstance(a, str) and _MARK.search(a) for a in args):
            # text formatted from tensors (f"y {y:.3f}"): formatted again at call time
            args = tuple(_format_node(cap, a) if isinstance(a, str) else a for a in args)
        try:
            record_effect(cap, orig, args, kwargs, None, "print")
        except CaptureError:
            # an argument a graph cannot hold (an arbitrary object): printed once, now
            args = tuple(a.meta["val"] if isinstance(a, fx.Node) else a for a in args)
            warnings.warn(
                f"print at {_loc_text(loc)} has an argument fxad cannot put in the "
                "generated code; it printed once, at build time, and the generated code "
                "does not print it: print tensors, numbers and strings", UserWarning,
                stacklevel=2)
            return orig(*args, **kwargs)
        if any(isinstance(a, str) and "FakeTensor(" in a for a in args):
            warnings.warn(
                f"print at {_loc_text(loc)} prints a string formatted from a tensor before "
                "the call (an f-string or str(t)), while fxad traced the program without "
                "values: the generated code prints that text, not the values; pass the "
                "tensor to print itself (print('y', y) instead of print(f'y {y}'))",
                UserWarning, stacklevel=2)
        return None
    print_.__wrapped__ = orig  # type: ignore[attr-defined]
    return print_


# -- logging ----------------------------------------------------------------------------------
_LOGGING_FILE = os.path.abspath(logging.__file__)


def log_at_call(name: str, level: int, msg: Any, *args: Any) -> None:
    """What the generated code runs for a logging call of the program that logs traced values
    (``log.info("loss %.3f", loss.item())``): ``logging.getLogger(name).log(level, msg,
    *args)`` with the call's values, so the logger's level and handlers are consulted at
    call time."""
    logging.getLogger(name).log(level, msg, *args)


code_builtin("fxad_log", log_at_call)


def _logged(orig: Any) -> Any:
    """``Logger._log`` while capturing: a message of the program's code that holds traced
    values (a tensor, a number read only to be logged, text formatted from them) becomes a
    :func:`log_at_call` line of the code at the call's place; any other message is logged
    now, as Python logs it."""
    def _log(self: logging.Logger, level: int, msg: Any, args: Any, exc_info: Any = None,
             extra: Any = None, stack_info: bool = False, stacklevel: int = 1) -> None:
        cap = current()
        frame = sys._getframe(1)
        # the program's frame: past logging's own, and past log_at_call when fxad traces
        # code it generated (grad of grad)
        while frame is not None and (frame.f_code is log_at_call.__code__ or os.path.abspath(
                frame.f_code.co_filename) == _LOGGING_FILE):
            frame = frame.f_back
        caller = os.path.abspath(frame.f_code.co_filename) if frame is not None else _FXAD_DIR
        if cap is None or cap.suspended or caller.startswith((_TORCH_DIR, _FXAD_DIR)):
            return orig(self, level, msg, args, exc_info, extra, stack_info, stacklevel)
        plain = (msg, *args) if isinstance(args, tuple) else (msg, args)
        traced = [printed_node(cap, a) for a in plain]
        if not any(t is not a or (isinstance(a, torch.Tensor) and id(a) in cap.env)
                   or (isinstance(a, str) and _MARK.search(a)) for t, a in zip(traced, plain)):
            return orig(self, level, msg, args, exc_info, extra, stack_info, stacklevel)
        if cap.lift is not None or exc_info or extra is not None or stack_info \
                or not isinstance(args, tuple):
            where = "inside a torch.cond / while_loop / scan body" if cap.lift is not None \
                else "with exc_info, extra, stack_info or a mapping of arguments"
            warnings.warn(
                f"logging call at {_loc_text(user_source_loc())} {where} logs tensor values: it "
                "logged once, at build time, without values, and the generated code does not "
                "log it; log after the call, or with a message and plain arguments",
                UserWarning, stacklevel=3)
            return orig(self, level, msg, args, exc_info, extra, stack_info, stacklevel)
        traced = [_format_node(cap, a) if isinstance(a, str) else a for a in traced]
        record_effect(cap, log_at_call, (self.name, level, *traced), {}, None, "logging")
    _log.__wrapped__ = orig  # type: ignore[attr-defined]
    return _log


# -- NumPy's global random draws ---------------------------------------------------------------
# A stretch of the program in which NumPy's global state is known at build time: from an
# in-program ``np.random.seed(c)`` (or ``set_state`` of a known state) to the next seeding
# from entropy, a ``set_state`` of a state read inside the program, or the end.  Its draws
# run for real at build time and are constants; the generated code sets the state at the
# seed's place to the state eager code has after the stretch's last draw (the 624-word
# MT19937 key a constant of the module), so NumPy's state leaves the call as eager leaves it.
_OPEN_STRETCHES: list[list[Any]] = []
_NP_GET_STATE = np_random.get_state if np_random is not None else None
_NP_SET_STATE = np_random.set_state if np_random is not None else None


def _open_stretch(cap: Any) -> None:
    """Start a known-state stretch at this point of the program (NumPy has just been seeded
    for real): a ``numpy.random.set_state`` line whose state :func:`_close_stretch` fills."""
    if getattr(cap, "numpy_stretch", None) is not None:
        return  # still known: the stretch goes on (one state line for both seeds)
    name, key, pos, has_gauss, cached = _NP_GET_STATE()
    with _disable_current_modes(), torch._C.DisableTorchFunction():
        words = torch.from_numpy(np.asarray(key, dtype=np.int64).copy())
    key_node = cap.graph.create_node("call_function", numpy_of,
                                     (cap.arg(words, "numpy.random.seed"),), {}, name="key")
    key_node.meta.update(val=np.asarray(key, dtype=np.int64).copy(), fxad_no_grad=True)
    cap.stamp(key_node)
    node = record_effect(cap, _NP_SET_STATE,
                         ((name, key_node, int(pos), int(has_gauss), float(cached)),), {},
                         None, "numpy.random.seed")
    cap.numpy_stretch = (node, words)
    cap.numpy_seeded = True
    if _OPEN_STRETCHES:
        _OPEN_STRETCHES[-1].append(cap)


def _close_stretch(cap: Any) -> None:
    """End the open known-state stretch: its line sets the state NumPy has now."""
    stretch = getattr(cap, "numpy_stretch", None)
    if stretch is None:
        return
    node, words = stretch
    name, key, pos, has_gauss, cached = _NP_GET_STATE()
    with _disable_current_modes(), torch._C.DisableTorchFunction():
        words.copy_(torch.from_numpy(np.asarray(key, dtype=np.int64)))
    (_, held, *_rest), = node.args
    node.args = ((name, held, int(pos), int(has_gauss), float(cached)),)
    cap.numpy_stretch = None


def _known_seed(args: tuple, kwargs: dict) -> bool:
    """``np.random.seed(args)`` gives a state known at build time (not entropy)."""
    seed = args[0] if args else kwargs.get("seed")
    if seed is None:
        return False
    leaves = [seed] if not isinstance(seed, (list, tuple, np.ndarray)) else list(np.ravel(seed))
    return all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in leaves)


def _numpy_state_call(cap: Any, orig: Any, name: str, args: tuple, kwargs: dict) -> Any:
    """``np.random.seed`` / ``set_state`` / ``get_state`` inside the program."""
    states = cap.__dict__.setdefault("numpy_states", {})
    if name == "get_state":
        out = orig(*args, **kwargs)
        if getattr(cap, "numpy_stretch", None) is None:
            # the state at call time, unknown now: read by the code, for a set_state later
            node = record_effect(cap, orig, args, kwargs, None, "numpy.random.get_state")
            states[id(out)] = (out, node)
        return out
    replayed = None
    if name == "set_state":
        st = args[0] if args else kwargs.get("state")
        replayed = states.get(id(st))
        known = replayed is None or replayed[0] is not st
    else:
        known = _known_seed(args, kwargs)
    if known:
        out = orig(*args, **kwargs)
        _open_stretch(cap)
        return out
    # from entropy, or back to a state read inside the program: a line of the code
    _close_stretch(cap)
    if replayed is not None:
        record_effect(cap, orig, (replayed[1],), {}, None, f"numpy.random.{name}")
    else:
        record_effect(cap, orig, args, kwargs, None, f"numpy.random.{name}")
    return orig(*args, **kwargs)


def _numpy_draw(orig: Any, name: str) -> Any:
    def draw(*args: Any, **kwargs: Any) -> Any:
        cap = _effect_site(f"numpy.random.{name}")
        if cap is None or has_tensor((args, kwargs)):
            return orig(*args, **kwargs)
        if name in ("seed", "set_state", "get_state"):
            return _numpy_state_call(cap, orig, name, args, kwargs)
        if getattr(cap, "numpy_stretch", None) is not None:
            # NumPy's state is known: the draw is a constant of the program
            return orig(*args, **kwargs)
        loc = user_source_loc()
        if any(isinstance(a, np.ndarray) for a in (*args, *kwargs.values())) \
                or name == "shuffle":
            raise CaptureError(
                f"numpy.random.{name} is called with a NumPy array inside the traced "
                "program; fxad replays NumPy's draws in the generated code only with "
                "Python numbers as arguments", op=f"numpy.random.{name}", loc=loc,
                hint="draw with numbers as arguments (np.random.permutation(n)), seed NumPy "
                     "with a constant inside the program (np.random.seed(0): its draws are "
                     "then constants), or draw outside the traced function and pass the "
                     "result in as a tensor input")
        out = orig(*args, **kwargs)
        if isinstance(out, (float, np.floating)) and not kwargs \
                and all(isinstance(a, (int, float)) for a in args):
            # one float (`if np.random.rand() < p:`): drawn by the code on every call, a
            # 0-d float64 tensor while tracing, as Python's float draws
            return _draw_node(cap, numpy_draw, (name, *args))
        if out is not None and not isinstance(out, np.ndarray):
            raise CaptureError(
                f"numpy.random.{name} draws a number ({type(out).__name__}) that the "
                "program uses as a Python value: the traced code would keep the number "
                "drawn once, at build time, on every call", op=f"numpy.random.{name}",
                loc=loc, hint="draw with torch (torch.rand(()) < p, or torch.randint) so "
                              "the draw is part of the graph, seed NumPy with a constant "
                              "inside the program, or draw outside the traced function "
                              "and pass the value in")
        node = record_effect(cap, orig, args, kwargs,
                             out.copy() if isinstance(out, np.ndarray) else None,
                             f"numpy.random.{name}")
        if isinstance(out, np.ndarray):
            draws = cap.__dict__.setdefault("numpy_draws", {})
            draws[id(out)] = (out, node, loc, out.copy())
            cap.__dict__.setdefault("numpy_draw_locs", []).append(loc)
        return out
    draw.__name__ = name
    draw.__wrapped__ = orig  # type: ignore[attr-defined]
    return draw


def _default_rng(orig: Any) -> Any:
    """``np.random.default_rng`` inside the program: one seeded from entropy makes arrays no
    capture sees the draws of, so NumPy arrays stop being constants (refused instead)."""
    def default_rng(*args: Any, **kwargs: Any) -> Any:
        cap = _active()
        seed = args[0] if args else kwargs.get("seed")
        if cap is not None and seed is None:
            cap.numpy_unseen = user_source_loc()
        return orig(*args, **kwargs)
    default_rng.__wrapped__ = orig  # type: ignore[attr-defined]
    return default_rng


def numpy_of(t: torch.Tensor) -> Any:
    """The NumPy array a tensor constant of the generated code holds (``t.numpy()``, on the
    CPU): a NumPy array the program computed while NumPy's state was known
    (:func:`_constant_array`).  On a fake tensor (fxad computing metadata), an array of the
    same shape and dtype (any tensor subclass: fake, functional)."""
    with _disable_current_modes(), torch._C.DisableTorchFunction():
        if type(t) is not torch.Tensor or t.device.type == "meta":
            return np.zeros(tuple(t.shape), dtype=torch.zeros((), dtype=t.dtype).numpy().dtype)
        return t.detach().cpu().numpy()


def _constant_array(cap: Any, arr: Any, what: str) -> fx.Node:
    """The node of a NumPy array known at build time, read from a constant of the module:
    ``array = fxad_numpy_of(_tensor_constant0)``.  A conversion that shares the array's
    memory (``torch.from_numpy``) shares the constant's: capture writes the program's in-place
    ops on it as out-of-place code."""
    try:
        with _disable_current_modes(), torch._C.DisableTorchFunction():
            held = torch.from_numpy(np.array(arr, copy=True))
    except TypeError as e:
        raise CaptureError(
            f"{what} is called with a NumPy array of dtype {arr.dtype}, which a tensor "
            "constant cannot hold", op=what, loc=user_source_loc(),
            hint="convert it to a numeric dtype first") from e
    node = cap.graph.create_node("call_function", numpy_of, (cap.arg(held, what),), {},
                                 name="array")
    node.meta.update(val=np.array(arr, copy=True), fxad_no_grad=True)
    cap.stamp(node)
    return node


def numpy_node(cap: Any, arr: Any, what: str) -> fx.Node:
    """The node of NumPy array ``arr`` passed to ``what`` (a conversion to a tensor): the
    draw that returned it, or a constant when NumPy's state was known for every draw the
    program made (it seeded NumPy with a constant itself, :func:`_open_stretch`).

    Raises:
        CaptureError: ``arr`` is not an array a draw returned (computed from one, or by other
            NumPy code) and the program's draws are not all known.
    """
    hit = getattr(cap, "numpy_draws", {}).get(id(arr))
    if hit is not None and hit[0] is arr and arr.dtype == hit[3].dtype \
            and np.array_equal(arr, hit[3], equal_nan=arr.dtype.kind in "fc"):
        # the drawn array as drawn (not changed in place since)
        cap.__dict__.setdefault("numpy_used", set()).add(id(arr))
        return hit[1]
    loc = user_source_loc()
    draws = getattr(cap, "numpy_draw_locs", [])
    unseen = getattr(cap, "numpy_unseen", None)
    if getattr(cap, "numpy_seeded", False) and not draws and unseen is None:
        return _constant_array(cap, arr, what)
    if draws:
        raise CaptureError(
            f"{what} is called with a NumPy array; the program drew NumPy random numbers "
            f"({', '.join(_loc_text(d) for d in draws[:4])}) and this array is not a drawn "
            f"array as drawn: NumPy code computed or changed it (used at {_loc_text(loc)}): "
            "fxad replays draws, not the NumPy computation after them",
            op=what, loc=loc,
            hint="turn the drawn array into a tensor right away and compute with torch "
                 "(torch.from_numpy(np.random.permutation(n)).reshape(...)), seed NumPy with "
                 "a constant inside the program before drawing (np.random.seed(0): the "
                 "arrays are then constants), or draw outside the traced function and pass "
                 "the result in as an input")
    raise CaptureError(
        f"{what} is called with a NumPy array computed by NumPy code while tracing; fxad "
        "records torch calls, not NumPy code"
        + (f" (a np.random.default_rng() seeded from entropy at {_loc_text(unseen)} "
           "draws numbers fxad does not see)" if unseen is not None else ""),
        op=what, loc=loc,
        hint="create the values with torch functions inside the traced code, or pass the "
             "array in as a tensor input")


def _from_numpy(orig: Any) -> Any:
    def from_numpy(arr: Any) -> Any:
        cap = _active()
        if cap is None:
            return orig(arr)
        node = numpy_node(cap, arr, "torch.from_numpy")
        with torch._C.DisableTorchFunction():
            val = to_fake(orig(arr))
        out = cap.graph.create_node("call_function", orig, (node,), {})
        out.meta["val"] = val
        cap.stamp(out)
        cap.track(val, out)
        return val
    from_numpy.__wrapped__ = orig  # type: ignore[attr-defined]
    return from_numpy


# -- Python's random module ---------------------------------------------------------------------
def _refuse_in_body(what: str, loc: SourceLoc | None) -> NoReturn:
    """Refuse an effect inside a control-flow body (a ``torch.cond`` branch, also one made
    from an ``if`` on a random draw, a ``while_loop`` / ``scan`` body): capture runs every
    branch once, and the body's derivative runs it again, so the effect cannot happen as in
    eager code."""
    raise CaptureError(
        f"{what} is called inside a torch.cond / while_loop / scan body (the branches of an "
        "`if` on a random draw are one): fxad runs every branch while tracing and the "
        "derivative runs the body again, so the effect cannot happen once per call as in "
        "eager code", op=what, loc=loc,
        hint="make the call before the `if` or the loop (draw the number there and use it "
             "inside)")


def python_draw(name: str, *args: Any) -> torch.Tensor:
    """What the generated code runs for a draw of Python's ``random`` module that returns a
    float (``random.random()``, ``random.uniform(a, b)``, ``random.gauss(mu, sigma)``, ...):
    the same call on Python's generator, at the program's place, as a 0-d float64 tensor
    (exact: a Python float is an IEEE double), so Python's state advances as in eager code
    and the program's decisions on it (``if random() < p:``) are taken on every call."""
    cap = _effect_site(f"random.{name}")  # code that fxad traces again (grad of grad)
    if cap is not None:
        return _draw_node(cap, python_draw, (name, *args))
    return torch.tensor(getattr(py_random, name)(*args), dtype=torch.float64)


def numpy_draw(name: str, *args: Any) -> torch.Tensor:
    """As :func:`python_draw`, for a draw of NumPy's global generator that returns one float
    (``np.random.rand()``, ``np.random.uniform(a, b)``, ``np.random.normal()``)."""
    cap = _effect_site(f"numpy.random.{name}")
    if cap is not None:
        return _draw_node(cap, numpy_draw, (name, *args))
    return torch.tensor(float(getattr(np_random, name)(*args)), dtype=torch.float64)


code_builtin("fxad_python_draw", python_draw)
code_builtin("fxad_numpy_draw", numpy_draw)


def _draw_node(cap: Any, target: Any, args: tuple) -> torch.Tensor:
    """A node ``target(*args)`` drawing one float at call time (a 0-d float64 tensor), kept
    in place and never merged or recomputed: its fake value, which random decisions see as
    drawn (``meta['fxad_draws_random']``)."""
    with torch._C.DisableTorchFunction(), _disable_current_modes():
        val = to_fake(torch.zeros((), dtype=torch.float64))
    node = cap.graph.create_node("call_function", target, args, {})
    node.meta.update(val=val, fxad_side_effect=True, fxad_no_grad=True, fxad_draws_random=True)
    cap.stamp(node)
    cap.track(val, node)
    return val


def _python_draw(orig: Any, name: str) -> Any:
    def draw(*args: Any, **kwargs: Any) -> Any:
        cap = _effect_site(f"random.{name}")
        if cap is None:
            return orig(*args, **kwargs)
        loc = user_source_loc()
        if name not in PYTHON_FLOAT_DRAWS or kwargs or has_tensor(args) \
                or not all(isinstance(a, (int, float)) for a in args):
            # an integer, a choice, a permutation: the value would be drawn once, at build
            # time, and kept by the generated code on every call (a layer kept or skipped
            # stays so)
            raise CaptureError(
                f"random.{name} draws a Python value inside the traced program: the "
                "generated code would keep the value drawn once, at build time, on every "
                "call", op=f"random.{name}", loc=loc,
                hint="draw with torch (`if torch.rand(()) < p:`, which fxad turns into a "
                     "torch.cond drawn on every call, or torch.randint / torch.randperm), "
                     "draw a float with random.random() / random.uniform(a, b), or draw "
                     "outside the traced function and pass the value in as an argument")
        # a float: drawn by the generated code on every call, a 0-d float64 tensor while
        # tracing (nothing is drawn from Python's generator now)
        return _draw_node(cap, python_draw, (name, *args))
    draw.__name__ = name
    draw.__wrapped__ = orig  # type: ignore[attr-defined]
    return draw


# -- the patch list ------------------------------------------------------------------------------
def effect_patches() -> list[tuple[Any, str, Any, Any]]:
    """``(namespace, name, original, replacement)`` for the functions whose effects capture
    records (see the module docstring)."""
    out: list[tuple[Any, str, Any, Any]] = []
    made: dict[int, Any] = {}

    def add(ns: Any, name: str, make: Any) -> None:
        orig = getattr(ns, name, None)
        if orig is None:
            return
        new = made.get(id(orig))
        if new is None:
            new = made[id(orig)] = make(orig)
        out.append((ns, name, orig, new))

    for name, ns in _TORCH_SEEDING:
        add(ns, name, lambda o, n=name: _seeding(o, n))
    for name in _CUDA_SEEDING:
        add(torch.cuda, name, lambda o, n=name: _seeding(o, n))
    add(torch.random, "fork_rng", _fork_rng)
    add(builtins, "print", _print)
    add(logging.Logger, "_log", _logged)
    add(torch, "from_numpy", _from_numpy)
    for name in PYTHON_DRAWS:
        add(py_random, name, lambda o, n=name: _python_draw(o, n))
    if np_random is not None:
        for name in NUMPY_DRAWS:
            add(np_random, name, lambda o, n=name: _numpy_draw(o, n))
        add(np_random, "default_rng", _default_rng)
    return out


@contextlib.contextmanager
def numpy_state_kept() -> Iterator[None]:
    """NumPy's global random state as it was before capture, after it: the draws capture makes
    (to give the program arrays of the right shapes and values) are not the program's calls.
    A known-state stretch still open when the program returns gets its state line's state
    (:func:`_close_stretch`) first."""
    state = np_random.get_state() if np_random is not None else None
    _OPEN_STRETCHES.append([])
    done = False
    try:
        yield
        done = True
    finally:
        caps = _OPEN_STRETCHES.pop()
        if done:
            for cap in caps:
                _close_stretch(cap)
        if state is not None:
            np_random.set_state(state)


@contextlib.contextmanager
def generator_inputs_kept(cap: Any) -> Iterator[None]:
    """The ``torch.Generator`` inputs of the program as they were, after capture; a program
    that reseeds one itself (``g.manual_seed(0)``: a method fxad cannot record) is told so."""
    gens = [(n.name, n.meta["val"], n.meta["val"].get_state()) for n in cap.graph.nodes
            if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Generator)]
    try:
        yield
    finally:
        changed = []
        for name, gen, state in gens:
            if not torch.equal(gen.get_state(), state):
                gen.set_state(state)
                changed.append(name)
        if changed:
            warnings.warn(
                "the traced program changes the state of its torch.Generator argument "
                f"{', '.join(f'`{c}`' for c in changed)} itself (g.manual_seed(...) or "
                "g.set_state(...)): fxad cannot put a generator's own methods in the "
                "generated code, which draws from the generator as passed; seed it before "
                "the call", UserWarning, stacklevel=4)


def is_numpy_array(a: Any) -> bool:
    """``a`` is a NumPy array."""
    return np is not None and isinstance(a, np.ndarray)


def warn_unused_draws(cap: Any) -> None:
    """Warn about NumPy arrays drawn in the program that never became tensors (directly):
    whatever Python did with them ran once, at build time."""
    draws = getattr(cap, "numpy_draws", {})
    used = getattr(cap, "numpy_used", set())
    locs = [entry[2] for k, entry in draws.items() if k not in used]
    if locs:
        warnings.warn(
            "NumPy random draws at " + ", ".join(_loc_text(loc) for loc in locs[:4]) + " are "
            "repeated by the generated code, but their arrays were used by Python code, not "
            "turned into tensors: what that code did with them ran once, at build time, "
            "with the numbers drawn then; turn the drawn array into a tensor "
            "(torch.from_numpy) to use it in the program", UserWarning, stacklevel=4)


def _register_numpy_of() -> None:
    """``fxad_numpy_of`` importable by saved code (``GraphModule.to_folder``)."""
    try:
        from torch.fx.graph import _register_custom_builtin
    except ImportError:  # pragma: no cover - very old torch
        return
    if np is not None:
        _register_custom_builtin("fxad_numpy_of",
                                 "from fxad.capture.effects import numpy_of as fxad_numpy_of",
                                 numpy_of)


_register_numpy_of()
