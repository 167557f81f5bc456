"""The capture in progress and the value form of a node, shared by every capture module.

:func:`current` is the capture session (:class:`fxad.capture.session.Session`) that records
the program now running in this thread, None outside capture; the entry points patched
during capture (:mod:`fxad.capture.environment`: module calls, control flow, custom
Functions, checkpoint regions) route their calls through it.  Nested captures (a
control-flow branch, a custom Function's backward) switch the current session while they
run (:func:`switched_to`).
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

import torch
from torch.utils import _pytree as pytree

from ..graph import proxy
from ..graph.fastmeta import fake_like

_STATE = threading.local()


def current() -> Any:
    """The capture session recording in this thread, or None."""
    return getattr(_STATE, "capture", None)


def capturing() -> bool:
    """True while :func:`capture` runs the user's program (on fake tensors)."""
    return getattr(_STATE, "capture", None) is not None


@contextlib.contextmanager
def switched_to(cap: Any) -> Iterator[None]:
    """``cap`` is the current session inside; the previous one (or none) after."""
    prev = getattr(_STATE, "capture", None)
    _STATE.capture = cap
    try:
        yield
    finally:
        _STATE.capture = prev


@contextlib.contextmanager
def symbolic_shapes(mode: Any) -> Iterator[None]:
    """Build with ``mode`` (a FakeTensorMode with a ShapeEnv) as the fake mode, accepting
    symbolic sizes (``SymInt``) as node arguments: the symbolic build of
    :mod:`fxad.symbolic`."""
    old = proxy._FAKE_MODE
    proxy._FAKE_MODE = mode
    _STATE.symbolic = True
    try:
        yield
    finally:
        proxy._FAKE_MODE = old
        _STATE.symbolic = False


def symbolic() -> bool:
    """Inside :func:`symbolic_shapes`: sizes may be ``SymInt``\\ s."""
    return getattr(_STATE, "symbolic", False)


def has_tensor(x: Any) -> bool:
    return any(isinstance(v, torch.Tensor) for v in pytree.tree_leaves(x))


def snapshot(v: Any) -> Any:
    """A node's ``val``: the fake value with its own metadata (a later in-place change of the
    user-visible object's shape does not reach it) and without autograd history."""
    def one(t: Any) -> Any:
        if isinstance(t, torch.Tensor):
            fresh = fake_like(t)  # symbolic sizes: without PyTorch's detach dispatch
            if fresh is not None:
                return fresh
            with torch._C.DisableTorchFunction(), torch.no_grad():
                return t.detach()
        return t
    if isinstance(v, torch.Tensor):
        return one(v)
    if isinstance(v, (tuple, list)):
        items = [one(t) for t in v]
        if type(v) in (tuple, list):
            return type(v)(items)
        try:  # torch.return_types structseqs and namedtuples
            return type(v)(items)
        except TypeError:
            return type(v)(*items)
    return v
