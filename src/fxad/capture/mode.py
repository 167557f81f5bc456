"""The TorchFunctionMode that records the program, and the dispatch of each torch call.

Every call of the public torch API made while capturing reaches :func:`handle`, which
decides what it is (:mod:`fxad.capture.calls`): a property (views such as ``x.T`` are
recorded as the equivalent calls), a read of tensor data (answered from a known value,
:mod:`fxad.capture.values`, or a :class:`~fxad.errors.DataDependentError`), ``x[i] = v`` or
an in-place op (:mod:`fxad.capture.inplace`), a Python composite whose body is traced
through, or an ordinary call: run on the fake values, recorded as one node, its outputs
bound to the node and their aliasing noted (:mod:`fxad.capture.views`).

Functions of the capture session (:class:`fxad.capture.session.Session`), passed as ``cap``.
"""
from __future__ import annotations

from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from ..errors import CaptureError, DataDependentError, InplaceError
from ..graph.proxy import describe_target, user_source_loc
from .calls import (DATA_FUNCTIONS, DATA_METHODS, IDUNDER, LAYOUT_METHODS, NOT_INPLACE,
                    VIEW_PROPERTIES, call_body, method_name, node_form, out_of_place_function,
                    takes_callable)
from .custom import library_autograd
from .decisions import (current_policy, data_dependent_size, decide, has_examples,
                        python_sizes, question_of)
from .effects import formats_a_value, formatted
from .inplace import inplace, setitem
from .layouts import read_layout
from .printed import printed_number
from .state import has_tensor
from .values import is_data_dependent, known_answer, note_known
from .views import note_views

_COND_HINT = (
    "fxad traces one path for the example inputs' shapes; for a choice between values use "
    "torch.where(pred, a, b), and for a choice between code paths use torch.cond, e.g.\n"
    "        def positive(x): return x.sin()\n"
    "        y = torch.cond(x.sum() > 0, positive, lambda x: x.cos(), (x,))")


class CaptureMode(TorchFunctionMode):
    """Hands every torch API call of the user's program to :func:`handle`."""

    def __init__(self, cap: Any) -> None:
        super().__init__()
        self.cap = cap

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        return handle(self.cap, func, tuple(args), dict(kwargs or {}))


def handle(cap: Any, func: Any, args: tuple, kwargs: dict) -> Any:  # noqa: C901
    if cap.suspended:
        return func(*cap.to_fake_arg(args), **cap.to_fake_arg(kwargs))
    method, prop = method_name(func)
    what = f"Tensor.{method}" if method else describe_target("call_function", func)
    if prop is not None:
        return _property(cap, func, prop, args, kwargs)
    if method in ("__format__", "__repr__", "__str__"):  # an f-string in the program's code
        if formats_a_value(cap, method, args):  # text the program uses: a guarded decision
            value = decide(cap, torch.Tensor.item, "item", (args[0],), {})
            return format(value, args[1] if len(args) > 1 else "")
        text = formatted(cap, method, args)  # (fxad.capture.effects: re-formatted by print)
        if text is not None:
            return text
    if method in ("item", "__float__", "__int__"):  # a number read only to be printed:
        printed = printed_number(cap, method, args)  # read at call time, no guard (printed)
        if printed is not None:
            return printed
    if method in LAYOUT_METHODS and args and isinstance(args[0], torch.Tensor):
        return read_layout(cap, func, args, kwargs)  # guarded on the inputs' layouts
    if method in DATA_METHODS or func in DATA_FUNCTIONS:
        question = question_of(func, method)
        decides = question is not None and current_policy() != "refuse"
        if decides and has_examples(cap):
            return decide(cap, func, question, args, kwargs)  # real value, guarded
        known, answer = known_answer(cap, func, args, kwargs)
        if known:
            return answer
        if decides:
            return decide(cap, func, question, args, kwargs)  # raises, naming the line
        _data_dependent(cap, method or getattr(func, "__name__", "op"), args)
    if method == "__setitem__":
        return setitem(cap, func, args, kwargs)
    if method in ("register_hook", "register_post_accumulate_grad_hook", "backward"):
        raise CaptureError(
            f"Tensor.{method} inside the traced program is not supported: fxad writes the "
            "derivative code itself, so a hook or a nested backward would be ignored",
            op=f"Tensor.{method}", loc=user_source_loc(),
            hint="remove it from the traced code; to change a gradient, register a rule "
                 "(fxad.register_vjp) or use a custom torch.autograd.Function")
    if method == "retain_grad":
        return None
    if method == "__iter__":
        t = args[0]
        if t.dim() == 0:
            raise TypeError("iteration over a 0-d tensor")
        return iter([handle(cap, torch.Tensor.__getitem__, (t, i), {})
                     for i in range(t.shape[0])])
    if kwargs.get("out") is not None:
        if torch.is_grad_enabled() and any(
                isinstance(a, torch.Tensor) and id(a) in cap.env and a.is_floating_point()
                for a in pytree.tree_leaves((args, kwargs))):
            # as eager PyTorch, which refuses out= where an argument requires grad
            raise InplaceError(
                f"{what}(..., out=...) writes into an existing tensor where gradients are "
                "recorded (eager PyTorch refuses it too when an argument requires grad)",
                op=what, loc=user_source_loc(),
                hint="assign the result instead (y = op(...)), or write it under "
                     "torch.no_grad() (a buffer update: then recorded as one)")
        return _into_out(cap, func, args, kwargs, what)
    # -- in-place forms
    if method in IDUNDER and args and isinstance(args[0], torch.Tensor):
        return inplace(cap, func, args, kwargs, ("call_function", IDUNDER[method]),
                       f"Tensor.{method}")
    if method is not None and method.endswith("_") and not method.startswith("_") \
            and method not in NOT_INPLACE:
        return inplace(cap, func, args, kwargs, ("call_method", method[:-1]), what)
    if method is None and getattr(func, "__name__", "").endswith("_") \
            and not func.__name__.endswith("__") and args \
            and isinstance(args[0], torch.Tensor):
        oop = out_of_place_function(func)
        if oop is not None:
            return inplace(cap, func, args, kwargs, oop, what)
    if kwargs.get("inplace") is True and args and isinstance(args[0], torch.Tensor):
        oop_kwargs = {**kwargs, "inplace": False}
        return inplace(cap, func, args, kwargs, ("call_function", func), what,
                       oop_kwargs=oop_kwargs)
    if method in NOT_INPLACE:  # requires_grad_() & co.: run on the fake, no node
        return func(*cap.to_fake_arg(args), **cap.to_fake_arg(kwargs))
    # -- Python composites traced through
    if method is None and takes_callable(func, args, kwargs):
        with cap.mode:
            return call_body(func, args, kwargs)
    # -- another library's operator with an autograd formula: its backward captured as code
    if method is None and isinstance(func, (torch._ops.OpOverloadPacket, torch._ops.OpOverload)):
        with cap.mode:  # (inside this handler the mode is off: the op's forward records)
            out = library_autograd(cap, func, args, kwargs)
        if out is not NotImplemented:
            return out
    # -- an ordinary call
    args, kwargs = python_sizes(cap, func, method, args, kwargs)  # sizes from Python numbers
    versions = [(a, a._version) for a in pytree.tree_leaves((args, kwargs))
                if isinstance(a, FakeTensor) and id(a) in cap.env]
    try:
        out = cap.compute(func, args, kwargs, what)
    except DataDependentError as e:
        if not is_data_dependent(e.__cause__):
            raise
        # an output size that depends on data: specialized and guarded, or refused
        return data_dependent_size(cap, func, method, args, kwargs, what, e.__cause__)
    for a, v in versions:
        if a._version != v:  # an op that writes into a traced tensor, unannounced
            raise InplaceError(
                f"{what} modifies one of its tensor arguments in place, which fxad cannot "
                "record", op=what, loc=user_source_loc(),
                hint="call the out-of-place form of the op, or clone the argument first")
    if not has_tensor(out):
        return out  # metadata (x.size(), torch.result_type(...)): specialized, no node
    if isinstance(out, torch.Tensor) and id(out) in cap.env:
        return out  # x.contiguous(), x.to(x.dtype): PyTorch returns the same tensor
    kind, target, nargs = node_form(func, method, args)
    node = cap.record(kind, target, nargs, kwargs, out, what)
    cap.bind_outputs(out, node)
    note_views(cap, out, kind, target, nargs, kwargs)
    note_known(cap, func, args, kwargs, out)
    for v in pytree.tree_leaves(out):  # values computed with known arguments' values
        if isinstance(v, torch.Tensor) and id(v) in cap.known and id(v) in cap.env:
            cap.env[id(v)].meta["fxad_value"] = cap.known[id(v)]
    return out


def _into_out(cap: Any, func: Any, args: tuple, kwargs: dict, what: str) -> Any:
    """``func(*args, out=o)``: the result computed as a new tensor, then written into ``o``
    in place (``o.copy_(result)``, recorded as any in-place write: a buffer the program
    updates this way, spectral norm's power iteration, is updated by the generated code on
    every call); ``o`` (a tuple of tensors: each) returned.

    Raises:
        InplaceError: ``o`` does not have the result's shape (PyTorch would resize it).
        RuntimeError: the result's dtype cannot be cast to ``o``'s, as PyTorch raises."""
    out = kwargs["out"]
    result = handle(cap, func, args, {k: v for k, v in kwargs.items() if k != "out"})
    outs = out if isinstance(out, (tuple, list)) else (out,)
    results = result if isinstance(result, (tuple, list)) else (result,)
    if len(outs) != len(results) or any(
            not isinstance(o, torch.Tensor) or not isinstance(r, torch.Tensor)
            or tuple(o.shape) != tuple(r.shape) for o, r in zip(outs, results)):
        raise InplaceError(
            f"{what}(..., out=...) writes into a tensor of another shape than the result, "
            "which PyTorch resizes", op=what, loc=user_source_loc(),
            hint="assign the result instead: y = op(...)")
    for o, r in zip(outs, results):
        if not torch.can_cast(r.dtype, o.dtype):  # as PyTorch refuses it
            raise RuntimeError(f"result type {str(r.dtype)[6:].capitalize()} can't be cast to "
                               f"the desired output type {str(o.dtype)[6:].capitalize()}")
    for o, r in zip(outs, results):
        handle(cap, torch.Tensor.copy_, (o, r), {})
    return out


def _data_dependent(cap: Any, name: str, args: tuple) -> None:
    t = next((a for a in args if isinstance(a, torch.Tensor)), None)
    desc = f"`{cap.node_of(t).name}`" if t is not None and id(t) in cap.env else "a tensor"
    refused = (" (the build asked for values='refuse'; the default, values='guard', takes "
               "the decision on the example's value and checks it on every call)"
               if current_policy() == "refuse" else "")
    if name == "__bool__":
        raise DataDependentError(
            f"Python control flow depends on the value of tensor {desc}{refused}",
            op="bool(Tensor)", loc=user_source_loc(), hint=_COND_HINT)
    if name == "numpy":  # NumPy code cannot be differentiated: the torch spelling can
        hint = ("write the NumPy computation with torch functions on the tensor itself "
                "(torch.exp(t) instead of np.exp(t.numpy())), or compute the array outside "
                "the traced function and pass it in as a tensor input")
    else:
        hint = ("keep the value as a tensor (x * t instead of x * t.item()); a Python number "
                "that must stay a number can be passed as an argument of the traced "
                "function, which fxad specializes on")
    raise DataDependentError(
        f"{name}() needs the data of {desc}, which is not available while tracing{refused}",
        op=f"Tensor.{name}", loc=user_source_loc(), hint=hint)


def _property(cap: Any, func: Any, prop: str, args: tuple, kwargs: dict) -> Any:
    kind, name = prop.split(":")
    t = args[0]
    if kind == "__get__" and name in VIEW_PROPERTIES and isinstance(t, torch.Tensor):
        if name == "T":
            return handle(cap, torch.Tensor.permute, (t, tuple(reversed(range(t.dim())))), {})
        if name == "mT":
            return handle(cap, torch.Tensor.transpose, (t, -2, -1), {})
        if name in ("H", "mH"):
            tt = handle(cap, torch.Tensor.transpose, (t, -2, -1), {}) \
                if name == "mH" or t.dim() == 2 else t
            return handle(cap, torch.conj, (tt,), {}) if t.is_complex() else tt
        if name in ("real", "imag"):
            return handle(cap, getattr(torch, name), (t,), {})
        if name == "data":
            return handle(cap, torch.Tensor.detach, (t,), {})
    if kind == "__set__" and name not in ("requires_grad", "grad", "retains_grad"):
        raise CaptureError(f"setting Tensor.{name} inside the traced program is not "
                           "supported", op=f"Tensor.{name}", loc=user_source_loc(),
                           hint="compute a new tensor instead")
    if kind == "__set__" and name == "requires_grad" and isinstance(t, torch.Tensor) \
            and len(args) > 1 and args[1] is True and t.requires_grad:
        # ``h.requires_grad = True`` (transformers' feature encoders do this "for gradient
        # checkpointing"): h already carries a derivative here, because fxad sees floating
        # inputs as differentiable.  Eager code with an input that does not require grad
        # makes h a leaf that does; the derivatives to every parameter are the same either
        # way, so this is a no-op (eager raises only when the input itself requires grad)
        return None
    try:
        out = func(*cap.to_fake_arg(args), **cap.to_fake_arg(kwargs))
    except RuntimeError as e:
        raise CaptureError(f"Tensor.{name} ({kind.strip('_')}) failed while tracing: {e}",
                           op=f"Tensor.{name}", loc=user_source_loc(),
                           hint="use x.detach() for a value that must not carry a "
                                "derivative") from e
    if isinstance(out, torch.Tensor) and id(out) not in cap.env and kind == "__get__":
        if name == "grad":  # a parameter's .grad: not part of the program's value
            raise CaptureError("reading Tensor.grad inside the traced program is not "
                               "supported", op="Tensor.grad", loc=user_source_loc(),
                               hint="pass gradients in as inputs")
    return out
