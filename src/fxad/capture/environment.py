"""What is patched while a program is captured, and the capture it routes to.

While :func:`capture_environment` is active, ``torch.compiler.is_compiling()`` is True (as
under Dynamo, so library code takes its traceable path), and these entry points are routed
through the current capture session (:func:`fxad.capture.state.current`):
``nn.Module.__call__`` (:meth:`fxad.capture.session.Session.call_module`), custom
``autograd.Function.apply`` and both ``torch.utils.checkpoint`` implementations
(:mod:`fxad.capture.custom`), ``torch.cond`` / ``while_loop`` / ``scan`` / ``map`` /
``associative_scan`` (:mod:`fxad.capture.control`, also where the traced code imported them
by name), the Python-level convolution gradients, and the user functions recorded as one
node (those passed to ``torch.fx.wrap`` and those with a registered rule).
"""
from __future__ import annotations

import contextlib
import inspect
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.nn.grad as nn_grad
import torch.utils.checkpoint as ckpt

from ..graph.factories import CONV_GRADS, FACTORIES
from ..graph.proxy import describe_target
from ..rules.registry import all_rules
from .control import control_flow_patches
from .custom import apply_custom_function, checkpoint_region, patched_checkpoint_generator
from .patching import namespace_patches
from .state import current, has_tensor, switched_to


@contextlib.contextmanager
def capture_environment(cap: Any) -> Iterator[None]:
    """``torch.compiler.is_compiling()`` true; module calls, custom ``autograd.Function`` classes,
    checkpoint regions and the Python-level convolution gradients routed through the active
    capture.  Nested captures (a custom Function's backward) only switch the active one."""
    if current() is not None:
        with switched_to(cap):
            yield
        return
    with _patches(getattr(cap, "user_globals", ())), switched_to(cap):
        yield


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
    patched.append((torch.nn.Module, "__call__", orig_call, module_call))
    patched.append((function_cls, "apply", orig_apply, classmethod(apply)))
    gen = getattr(ckpt, "_checkpoint_without_reentrant_generator", None)
    if gen is not None:
        patched.append((ckpt, "_checkpoint_without_reentrant_generator", gen,
                        patched_checkpoint_generator(gen)))
    for name, orig in grads.items():
        patched.append((nn_grad, name, orig, leaf(orig)))
    # user functions kept as one node: torch.fx.wrap'd ones and those with a registered rule
    globs = [(glob, name, fn) for glob, name, fn in _leaf_functions()]

    # the control-flow functions imported by name into the user's modules
    # (``from torch._higher_order_ops.scan import scan``)
    replaced = {id(orig): new for ns, name, orig, new in patched
                if ns.__class__.__name__ == "module"
                and name in ("cond", "while_loop", "scan", "map", "associative_scan")}
    patched.extend(namespace_patches(user_globals, replaced))

    compiler = torch.compiler
    old_flag = getattr(compiler, "_is_compiling_flag", None)
    old_fn = compiler.is_compiling
    try:
        for ns, name, _, new in patched:
            setattr(ns, name, new)
        for glob, name, fn in globs:
            glob[name] = leaf(fn)
        if old_flag is not None:
            compiler._is_compiling_flag = True
        compiler.is_compiling = lambda: True  # type: ignore[assignment]
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
    """(module globals, name, function) of the Python functions to record as single nodes:
    those passed to ``torch.fx.wrap`` and user functions with a registered derivative rule
    (:func:`fxad.register_vjp`), patched in the module that defines them."""
    out: list[tuple[dict, str, Any]] = []
    seen: set[tuple[int, str]] = set()
    try:
        from torch.fx._symbolic_trace import _wrapped_fns_to_patch
        for (_, name), glob in list(_wrapped_fns_to_patch.items()):
            fn = glob.get(name)
            if inspect.isfunction(fn) and (id(glob), name) not in seen:
                seen.add((id(glob), name))
                out.append((glob, name, fn))
    except ImportError:  # pragma: no cover - other torch versions
        pass
    for key, rule in all_rules().items():
        if not inspect.isfunction(key) or rule.builtin \
                or (getattr(key, "__module__", "") or "").startswith("torch"):
            continue
        glob, name = key.__globals__, key.__name__
        if glob.get(name) is key and (id(glob), name) not in seen:
            seen.add((id(glob), name))
            out.append((glob, name, key))
    return out
