"""What is patched while a program is captured, and the capture it routes to.

While :func:`capture_environment` is active, ``torch.compiler.is_compiling()`` is True (as
under Dynamo, so library code takes its traceable path; False inside :func:`compiling_answer`,
for a program whose traceable path fails), and these entry points are routed through the
current capture session (:func:`fxad.capture.state.current`):
``nn.Module.__call__`` (:meth:`fxad.capture.session.Session.call_module`), custom
``autograd.Function.apply`` and both ``torch.utils.checkpoint`` implementations
(:mod:`fxad.capture.custom`), ``torch.cond`` / ``while_loop`` / ``scan`` / ``map`` /
``associative_scan`` (:mod:`fxad.capture.control`, also where the traced code imported them
by name), the Python-level convolution gradients, and the user functions recorded as one
node (those with a registered rule; a ``torch.fx.wrap``-marked function is traced through),
the functions whose side effects are recorded (:func:`fxad.capture.effects.effect_patches`:
seeding, RNG state, ``print``, NumPy's and Python's random draws, ``torch.from_numpy``) and
``nn.Parameter`` creation (refused inside the program).  After a successful capture it
announces the Python state the program changed (:mod:`fxad.capture.python_state`).
"""
from __future__ import annotations

import builtins
import contextlib
import contextvars
import inspect
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.nn.grad as nn_grad
import torch.utils.checkpoint as ckpt
from torch.utils._python_dispatch import _disable_current_modes

from ..errors import CaptureError
from ..graph.factories import CONV_GRADS, FACTORIES
from ..graph.proxy import describe_target, user_source_loc
from ..rules.registry import all_rules
from .control import control_flow_patches
from .custom import apply_custom_function, checkpoint_region, patched_checkpoint_generator
from .effects import (effect_patches, generator_inputs_kept, numpy_state_kept,
                      warn_unused_draws)
from .patching import namespace_patches
from .python_state import announce, snapshot
from .state import current, has_tensor, switched_to


def _converts_nothing(mod: torch.nn.Module, args: tuple, kwargs: dict) -> bool:
    """Whether ``mod.to(*args, **kwargs)`` leaves every parameter and buffer as it is: the
    same device, the same dtype for the floating-point and complex ones (the only ones
    ``Module.to`` casts), the memory format already held."""
    try:
        device, dtype, _, memory_format = torch._C._nn._parse_to(*args, **kwargs)
    except (TypeError, RuntimeError):
        return False
    for t in (*mod.parameters(), *mod.buffers()):
        if device is not None and (t.device.type != device.type or (
                device.index is not None and t.device.index != device.index)):
            return False
        if dtype is not None and (t.is_floating_point() or t.is_complex()) \
                and t.dtype != dtype:
            return False
        if memory_format is not None and t.dim() == 4 \
                and not t.is_contiguous(memory_format=memory_format):
            return False
    return True


# what torch.compiler.is_compiling() answers under capture, and a list the patched function
# appends to whenever the program asks
_COMPILING: contextvars.ContextVar[tuple[bool, list]] = contextvars.ContextVar(
    "fxad_is_compiling", default=(True, []))


@contextlib.contextmanager
def compiling_answer(answer: bool) -> Iterator[list]:
    """Within, captures answer ``torch.compiler.is_compiling()`` with ``answer``; yields a
    list that is non-empty once the captured program has asked."""
    asked: list = []
    token = _COMPILING.set((answer, asked))
    try:
        yield asked
    finally:
        _COMPILING.reset(token)


@contextlib.contextmanager
def capture_environment(cap: Any) -> Iterator[None]:
    """``torch.compiler.is_compiling()`` true; module calls, custom ``autograd.Function`` classes,
    checkpoint regions and the Python-level convolution gradients routed through the active
    capture.  Nested captures (a custom Function's backward) only switch the active one."""
    if current() is not None:
        with switched_to(cap):
            yield
        return
    program = getattr(cap, "program", None)
    watched = snapshot(program, getattr(cap, "user_globals", [])) if program is not None else []
    with numpy_state_kept(), generator_inputs_kept(cap), \
            _patches(getattr(cap, "user_globals", ())), switched_to(cap):
        yield
    # the capture succeeded: say which Python effects ran only now
    warn_unused_draws(cap)
    if program is not None:
        announce(program, watched)


@contextlib.contextmanager
def _patches(user_globals: Iterable[dict] = ()) -> Iterator[None]:
    orig_call = torch.nn.Module.__call__

    def module_call(mod: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        active = current()
        if active is None:
            return orig_call(mod, *args, **kwargs)
        return active.call_module(mod, orig_call, args, kwargs)

    def leaf(orig: Callable) -> Callable:
        """``orig`` recorded as one node when called with tensors."""
        def call(*args: Any, **kwargs: Any) -> Any:
            active = current()
            if active is None or active.suspended or not has_tensor((args, kwargs)):
                return orig(*args, **kwargs)
            what = describe_target("call_function", orig)
            out = active.compute(orig, args, kwargs, what)
            node = active.record("call_function", orig, args, kwargs, out, what)
            active.bind_outputs(out, node)
            return out
        call.__name__ = orig.__name__
        call.__wrapped__ = orig  # type: ignore[attr-defined]
        return call

    function_cls = torch.autograd.function.Function
    orig_apply = function_cls.__dict__["apply"]

    def apply(cls: type, *args: Any, **kwargs: Any) -> Any:
        active = current()
        if active is None or active.suspended:
            return orig_apply.__get__(None, cls)(*args, **kwargs)
        if cls is getattr(ckpt, "CheckpointFunction", None):  # reentrant checkpoint
            function, _preserve, *rest = args
            with checkpoint_region(active):
                return function(*rest)
        return apply_custom_function(active, cls, args, kwargs)

    patched: list[tuple[Any, str, Any, Any]] = control_flow_patches()  # (ns, name, old, new)
    # a capture started while a derivative engine writes code (a rule differentiating a
    # control-flow branch) must see the real factories, not the engine's recording ones
    for name in FACTORIES:
        cur = getattr(torch, name)
        real = getattr(cur, "__wrapped__", cur)
        if real is not cur:
            patched.append((torch, name, cur, real))
    grads = {}
    for name in CONV_GRADS:
        cur = getattr(nn_grad, name, None)
        if cur is not None:
            grads[name] = getattr(cur, "__wrapped__", cur)
            if grads[name] is not cur:
                patched.append((nn_grad, name, cur, grads[name]))
    patched.extend(effect_patches())  # seeding, RNG state, print, NumPy draws: recorded
    patched.append((torch.nn.Module, "__call__", orig_call, module_call))
    orig_param_new = torch.nn.Parameter.__dict__["__new__"]

    def param_new(cls: type, data: Any = None, requires_grad: bool = True) -> Any:
        active = current()
        if active is not None and not active.suspended:
            raise CaptureError(
                "an nn.Parameter is created inside the traced program (a module with "
                "parameters of its own, such as nn.Linear, built in forward): its gradient "
                "would reach nothing", op="nn.Parameter", loc=user_source_loc(),
                hint="create the module in __init__ and assign it to self (a module with no "
                     "parameters, such as a loss, may be built in forward)")
        return orig_param_new(cls, data, requires_grad)
    patched.append((torch.nn.Parameter, "__new__", orig_param_new, staticmethod(param_new)))
    orig_module_to = torch.nn.Module.to

    def module_to(mod: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        # ``self.router = self.router.to(self.dtype)`` in forward (SwitchTransformers): a
        # conversion that changes nothing returns the module, as eager's does in effect;
        # one that converts a tensor goes on (and a new Parameter is refused above)
        active = current()
        if active is not None and not active.suspended and _converts_nothing(mod, args,
                                                                             kwargs):
            return mod
        return orig_module_to(mod, *args, **kwargs)
    patched.append((torch.nn.Module, "to", orig_module_to, module_to))
    patched.append((function_cls, "apply", orig_apply, classmethod(apply)))
    orig_import = builtins.__import__

    def import_(*args: Any, **kwargs: Any) -> Any:
        # a module imported for the first time inside the program (``from torchdiffeq
        # import odeint`` in forward) runs its module-level code for real: its constants
        # (torchdiffeq's Butcher tableaus) must be real tensors, not fake ones kept forever
        active = current()
        if active is None or active.suspended:
            return orig_import(*args, **kwargs)
        active.suspended += 1
        try:
            with _disable_current_modes(), torch._C.DisableTorchFunction():
                return orig_import(*args, **kwargs)
        finally:
            active.suspended -= 1
    patched.append((builtins, "__import__", orig_import, import_))
    gen = getattr(ckpt, "_checkpoint_without_reentrant_generator", None)
    if gen is not None:
        patched.append((ckpt, "_checkpoint_without_reentrant_generator", gen,
                        patched_checkpoint_generator(gen)))
    for name, orig in grads.items():
        patched.append((nn_grad, name, orig, leaf(orig)))
    # user functions kept as one node: those with a registered rule
    globs = [(glob, name, fn) for glob, name, fn in _leaf_functions()]

    # the control-flow functions imported by name into the user's modules
    # (``from torch._higher_order_ops.scan import scan``)
    replaced = {id(orig): new for ns, name, orig, new in patched
                if ns.__class__.__name__ == "module"
                and (name in ("cond", "while_loop", "scan", "map", "associative_scan")
                     or getattr(new, "__module__", "") == effect_patches.__module__)}
    patched.extend(namespace_patches(user_globals, replaced))

    compiler = torch.compiler
    old_flag = getattr(compiler, "_is_compiling_flag", None)
    old_fn = compiler.is_compiling
    try:
        for ns, name, _, new in patched:
            setattr(ns, name, new)
        for glob, name, fn in globs:
            glob[name] = leaf(fn)
        answer, asked = _COMPILING.get()
        if old_flag is not None:
            compiler._is_compiling_flag = answer

        def is_compiling() -> bool:
            asked.append(True)
            return answer

        compiler.is_compiling = is_compiling  # type: ignore[assignment]
        yield
    finally:
        for ns, name, orig, _ in reversed(patched):
            setattr(ns, name, orig)
        for glob, name, fn in reversed(globs):
            glob[name] = fn
        if old_flag is not None:
            compiler._is_compiling_flag = old_flag
        compiler.is_compiling = old_fn  # type: ignore[assignment]


def _leaf_functions() -> list[tuple[dict, str, Any]]:
    """(module globals, name, function) of the user functions with a registered derivative
    rule (:func:`fxad.register_vjp`), patched in the module that defines them, to record as
    single nodes.  A function passed to ``torch.fx.wrap`` without a rule is traced through
    like any other code (the mark is for torch.fx's symbolic tracer, which cannot run it on
    proxies; fxad runs it on fake tensors)."""
    out: list[tuple[dict, str, Any]] = []
    seen: set[tuple[int, str]] = set()
    for key, rule in all_rules().items():
        module = getattr(key, "__module__", "") or ""
        if not inspect.isfunction(key) or rule.builtin \
                or module == "torch" or module.startswith("torch."):
            continue
        glob, name = key.__globals__, key.__name__
        if glob.get(name) is key and (id(glob), name) not in seen:
            seen.add((id(glob), name))
            out.append((glob, name, key))
    return out
