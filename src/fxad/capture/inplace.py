"""In-place operations and ``x[i] = v``, recorded out of place.

``y.add_(1)`` becomes ``add = y + 1`` and the Python object ``y`` is rebound to the new node;
a write into a view is written back into its base (:func:`fxad.capture.views.commit`).  The
in-place op also runs on the fake value, so PyTorch's own errors (a dtype that cannot be
cast back, a shape that does not broadcast) are raised as in eager mode, and a result dtype
that differs from the tensor's (in-place ops keep ``self``'s dtype) gets an explicit cast.
An in-place update of a buffer the program does not otherwise trace (BatchNorm's
``num_batches_tracked.add_(1)``) stays an in-place call (``meta['fxad_side_effect']``).

Functions of the capture session (:class:`fxad.capture.session.Session`), passed as ``cap``.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from ..errors import InplaceError
from ..graph.proxy import describe_target, user_source_loc
from ..ops import setitem as functional_setitem
from .calls import IDUNDER, RANDOM_INPLACE, method_name
from .state import snapshot
from .views import commit, is_current_item


def setitem(cap: Any, func: Any, args: tuple, kwargs: dict) -> None:
    x, index, value = args
    _check_mutable(cap, x, "Tensor.__setitem__")
    if id(x) not in cap.env:
        return _side_effect(cap, func, args, kwargs, "__setitem__")
    if is_current_item(cap, value, x, index):
        # ``y[i] += v`` is ``t = y[i]; t += v; y[i] = t``: the in-place add already wrote
        # through the view ``t``, and storing ``t`` back is a no-op, as in eager
        cap.compute(func, args, kwargs, "Tensor.__setitem__")
        return None
    if isinstance(index, torch.Tensor) and index.dim() == 0 and index.dtype == torch.bool:
        # x[flag] = v with a 0-d boolean tensor: every element or none, whatever the data
        # (a static shape): torch.where(flag, v, x)
        val = cap.compute(torch.where, (index, value, x), {}, "Tensor.__setitem__")
        if tuple(val.shape) != tuple(x.shape):
            raise InplaceError("x[flag] = v with a value that does not broadcast to x",
                               op="Tensor.__setitem__", loc=user_source_loc())
        new = cap.record("call_function", torch.where, (index, value, x), {}, val,
                         "Tensor.__setitem__")
        if val.dtype != x.dtype:
            new = cap.emit("call_method", "to", (new, x.dtype))
        commit(cap, x, new, "Tensor.__setitem__")
        return None
    val = cap.compute(functional_setitem, (x, index, value), {}, "Tensor.__setitem__")
    cap.compute(func, args, kwargs, "Tensor.__setitem__")  # PyTorch's own checks
    new = cap.record("call_function", functional_setitem, (x, index, value), {}, val,
                     "Tensor.__setitem__")
    commit(cap, x, new, "Tensor.__setitem__")
    return None


def inplace(cap: Any, func: Any, args: tuple, kwargs: dict, oop: tuple[str, Any], what: str,
            oop_kwargs: dict | None = None) -> Any:
    x = args[0]
    _check_mutable(cap, x, what)
    if id(x) not in cap.env:
        return _side_effect(cap, func, args, kwargs, getattr(func, "__name__", what))
    kind, target = oop
    okw = dict(kwargs if oop_kwargs is None else oop_kwargs)
    if kind == "call_function" and target in IDUNDER.values():
        okw = {}
    name = getattr(func, "__name__", "")
    if kind == "call_method" and (not hasattr(torch.Tensor, target)
                                  or name in RANDOM_INPLACE):
        # (an in-place draw has an out-of-place namesake, x.bernoulli(p), that draws into
        # a contiguous tensor: a different stream for strided x)
        return _inplace_special(cap, func, name, args, kwargs, what)
    oop_fn = getattr(torch.Tensor, target) if kind == "call_method" else target
    val = cap.compute(oop_fn, args, okw, what)  # before x changes
    # the in-place op itself, on the fake value: eager's errors and result metadata
    out = cap.compute(func, args, kwargs, what)
    new = cap.record(kind, target, args, okw, val, what)
    if isinstance(val, torch.Tensor) and isinstance(x, torch.Tensor) \
            and val.dtype != x.dtype:
        # in-place ops keep self's dtype (x.mul_(float) on a half x stays half)
        cast = cap.graph.create_node("call_method", "to", (new, x.dtype), {})
        cast.meta.update({k: v for k, v in new.meta.items() if k != "val"})
        cast.meta["val"] = snapshot(out if isinstance(out, torch.Tensor) else x)
        new = cast
    if isinstance(out, torch.Tensor) and tuple(out.shape) != tuple(val.shape):
        # an in-place op that changes the shape (x.t_(), x.unsqueeze_(0)): x is a new
        # tensor value, not a write into its storage
        cap.parent.pop(id(x), None)
        cap.track(x, new)
        return out
    commit(cap, x, new, what)
    return out if out is not None else x


def _inplace_special(cap: Any, func: Any, name: str, args: tuple, kwargs: dict,
                     what: str) -> Any:
    """In-place methods without an out-of-place method: ``zero_``, ``fill_``, ``copy_``
    and the in-place random draws (``uniform_``, ``normal_``, ``bernoulli_``...)."""
    x = args[0]
    out = cap.compute(func, args, kwargs, what)  # eager's checks, on the fake value
    xn = cap.node_of(x)
    if name == "zero_":
        new = cap.emit("call_function", torch.zeros_like, (xn,))
    elif name == "fill_":
        v = cap.arg(args[1] if len(args) > 1 else kwargs["value"], what)
        if isinstance(v, fx.Node):
            v = cap.emit("call_method", "to", (v, x.dtype))
            new = cap.emit("call_method", "expand", (v, tuple(x.shape)))
        else:
            new = cap.emit("call_function", torch.full_like, (xn, v))
    elif name == "copy_":
        src = cap.arg(args[1] if len(args) > 1 else kwargs["src"], what)
        if not isinstance(src, fx.Node):
            raise InplaceError(f"{what} needs a tensor source", op=what,
                               loc=user_source_loc())
        if src.meta["val"].dtype != x.dtype:
            src = cap.emit("call_method", "to", (src, x.dtype))
        new = src if tuple(src.meta["val"].shape) == tuple(x.shape) else \
            cap.emit("call_method", "expand", (src, tuple(x.shape)))
    elif name in RANDOM_INPLACE:
        # a fresh tensor of x's layout filled by the same kernel: the same random
        # numbers as eager PyTorch under the same seed; no derivative flows through
        fresh = cap.emit("call_function", torch.empty_like, (xn,))
        new = cap.emit("call_method", name, (fresh,) + cap.arg(tuple(args[1:]), what),
                       cap.arg(dict(kwargs), what))
        new.meta["fxad_no_grad"] = True
    else:
        raise InplaceError(f"{what} has no out-of-place form that fxad can record",
                           op=what, loc=user_source_loc(),
                           hint="compute a new tensor with an out-of-place op instead")
    new.meta["fxad_functionalized"] = False
    commit(cap, x, new, what)
    return out if out is not None else x


def _side_effect(cap: Any, func: Any, args: tuple, kwargs: dict, name: str) -> Any:
    """An in-place update of a buffer (BatchNorm's ``num_batches_tracked.add_(1)``): kept
    as the in-place call, exactly as eager PyTorch runs it; not on a derivative path."""
    x = args[0]
    out = cap.compute(func, args, kwargs, f"Tensor.{name}")
    method, _ = method_name(func)
    if method is None:
        raise InplaceError(f"{describe_target('call_function', func)} modifies a buffer "
                           "in place", op=name, loc=user_source_loc(),
                           hint="use the method form (buffer.add_(1)) or compute a new "
                                "tensor")
    node = cap.record("call_method", method, args, kwargs, out, f"Tensor.{method}")
    node.meta["fxad_side_effect"] = True
    node.meta["fxad_buffer_write"] = True  # (a recomputation leaves it out: ad.control_flow)
    return x


def _check_mutable(cap: Any, x: Any, what: str) -> None:
    loc = user_source_loc()
    if not isinstance(x, torch.Tensor) or id(x) in cap.env:
        return
    path = cap.attr_paths.get(id(x))
    if isinstance(x, torch.nn.Parameter) and x.requires_grad:
        raise InplaceError(
            f"{what} modifies the trainable parameter `{path or 'parameter'}` in place",
            op=what, loc=loc, hint="compute a new tensor instead")
    if path is None:
        raise InplaceError(f"{what} modifies a tensor from outside the traced program "
                           "in place", op=what, loc=loc,
                           hint="clone it first (t = t.clone()) or compute a new tensor")
