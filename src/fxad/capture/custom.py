"""Capture of custom ``torch.autograd.Function``\\ s and ``torch.utils.checkpoint`` regions.

Custom Functions
----------------
``MyFn.apply(x, ...)`` inside a traced program is captured as PyTorch runs it: ``forward``
(or ``forward`` + ``setup_context``) runs with gradients disabled, so its ops are recorded
with ``meta['fxad_no_grad']`` (no derivative flows through them), followed by one marker node
``fxad.ops.autograd_function('MyFn', inputs, outputs, saved)`` whose value is the
Function's output.  The Function's ``backward`` is captured as code right away, on fake
cotangents shaped like the outputs and on the tensors its ``ctx`` keeps
(``ctx.save_for_backward(...)`` / ``ctx.saved_tensors``, tensor attributes such as
``ctx.mask = m``); Python attributes (``ctx.scale = 2.0``), ``ctx.needs_input_grad``,
``ctx.mark_non_differentiable`` and ``ctx.set_materialize_grads`` are honoured.  A
``jvp`` staticmethod is captured the same way for forward mode (``ctx.save_for_forward``).
The derivative engines write those graphs into the generated code in place of derivative
rules (:mod:`fxad.ad.custom_function`).  A ``backward`` decorated with
``@once_differentiable`` is recorded with ``meta['fxad_once_differentiable']``;
differentiating through it again raises, as in PyTorch.

Limits (each raises a clear :class:`~fxad.errors.CaptureError`): ``ctx.mark_dirty`` (an
in-place forward), a backward whose result count differs from the number of ``forward``
inputs.  ``set_materialize_grads(False)`` is accepted, but the backward always receives
tensors (zeros for unused outputs): for a backward linear in its cotangents, as backward
functions are, that gives the same result.

An operator another library defines with ``torch.library.custom_op`` and an autograd formula
(``register_autograd``) is captured the same way, as the Function that formula makes
(:func:`library_autograd`): the op as one node, its registered ``backward`` as code.

Checkpoint regions
------------------
``torch.utils.checkpoint.checkpoint(fn, *args, ...)`` (both implementations, and through
``checkpoint_sequential`` or a ``functools.partial`` of it) runs ``fn`` once; every node it
records gets ``meta['fxad_checkpoint'] = <region id>`` (the innermost region's id), which
the residual policies read (:mod:`fxad.residuals`).
"""
from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from ..errors import CaptureError, InplaceError
from ..graph.proxy import fake_mode, user_source_loc
from ..ops import autograd_function
from ..rules.registry import lookup
from .normalize import normalize
from .state import current, has_tensor, snapshot


@dataclass
class CustomFunction:
    """What fxad recorded of one ``MyFn.apply(...)`` call (``meta['fxad_custom_function']``
    of its marker node).

    Attributes:
        cls: the ``torch.autograd.Function`` subclass.
        backward: graph of ``cls.backward``; placeholders: one cotangent per tensor output,
            then the ``ctx`` tensors (the marker node's ``saved`` argument, in order); output:
            a tuple with one cotangent (or None) per ``forward`` input.
        jvp: graph of ``cls.jvp`` when the class defines one; placeholders: one tangent per
            tensor input (in input order), then the ``ctx`` tensors; output: the tangents of
            the outputs (a tuple for several outputs).
        n_outputs: number of outputs (1 for a single tensor).
        tensor_outputs: positions of the tensor outputs.
        non_differentiable: positions of outputs marked with ``ctx.mark_non_differentiable``.
        once_differentiable: ``backward`` is decorated with ``@once_differentiable``.
    """

    cls: type
    backward: fx.GraphModule
    jvp: fx.GraphModule | None
    n_outputs: int
    tensor_outputs: tuple[int, ...]
    non_differentiable: tuple[int, ...] = ()
    once_differentiable: bool = False
    tuple_output: bool = False
    extra: dict = field(default_factory=dict)


class _Ctx:
    """The ``ctx`` a custom Function's ``forward``/``setup_context`` sees during capture."""

    def __init__(self, needs_input_grad: tuple[bool, ...]) -> None:
        self.needs_input_grad = needs_input_grad
        self._fxad_saved: tuple = ()
        self._fxad_saved_fwd: tuple = ()
        self._fxad_non_diff: tuple = ()
        self._fxad_dirty: tuple = ()
        self.materialize_grads = True

    def save_for_backward(self, *tensors: Any) -> None:
        self._fxad_saved = tensors

    def save_for_forward(self, *tensors: Any) -> None:
        self._fxad_saved_fwd = tensors

    def mark_dirty(self, *tensors: Any) -> None:
        self._fxad_dirty = tensors

    def mark_non_differentiable(self, *tensors: Any) -> None:
        self._fxad_non_diff = tensors

    def set_materialize_grads(self, value: bool) -> None:
        self.materialize_grads = value

    @property
    def saved_tensors(self) -> tuple:
        return self._fxad_saved


class _ReplayCtx:
    """The ``ctx`` the captured ``backward``/``jvp`` sees: the same attributes, with every
    tensor replaced by the graph input that stands for it."""

    def __init__(self, attrs: dict, saved: tuple, saved_fwd: tuple) -> None:
        self.__dict__.update(attrs)
        self._fxad_saved = saved
        self._fxad_saved_fwd = saved_fwd

    @property
    def saved_tensors(self) -> tuple:
        return self._fxad_saved

    # a backward may call these harmlessly
    def set_materialize_grads(self, value: bool) -> None:
        self.materialize_grads = value

    def mark_non_differentiable(self, *tensors: Any) -> None:
        pass


def _is_once_differentiable(fn: Any) -> bool:
    code = getattr(fn, "__code__", None)
    return getattr(fn, "__wrapped__", None) is not None and code is not None \
        and code.co_name == "wrapper" and code.co_filename.replace("\\", "/").endswith(
            "torch/autograd/function.py")


def _overrides(cls: type, name: str) -> bool:
    base = getattr(torch.autograd.function._SingleLevelFunction, name, None)
    mine = inspect.getattr_static(cls, name, None)
    mine = getattr(mine, "__func__", mine)
    base = getattr(base, "__func__", base)
    return mine is not None and mine is not base


def _fake_like(t: torch.Tensor) -> torch.Tensor:
    with torch._C.DisableTorchFunction(), fake_mode():
        return torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype,
                                   device=t.device)


def apply_custom_function(cap: Any, cls: type, args: tuple, kwargs: dict) -> Any:
    """Capture ``cls.apply(*args, **kwargs)`` (see the module docstring)."""
    name = cls.__name__
    what = f"{name}.apply"
    loc = user_source_loc()
    setup_style = _overrides(cls, "setup_context")
    if setup_style:
        bound = inspect.signature(cls.forward).bind(*args, **kwargs)
        bound.apply_defaults()
        args, kwargs = tuple(bound.args), dict(bound.kwargs)
    if kwargs:
        raise CaptureError(f"{what} is called with keyword arguments, which "
                           "torch.autograd.Function.apply does not take", op=what, loc=loc,
                           hint="pass the arguments positionally")
    ctx = _Ctx(tuple(isinstance(a, torch.Tensor) and a.requires_grad
                     and (a.is_floating_point() or a.is_complex()) for a in args))
    # the inputs as they are on entry: a forward that writes into one through ``.data``
    # (torchdiffeq's _UncheckedAssign) rebinds it, but derivatives go to its history
    entry = tuple(cap.arg(a, what) if isinstance(a, torch.Tensor) else a for a in args)
    with torch.no_grad():
        if setup_style:
            out = cls.forward(*args)
            cls.setup_context(ctx, args, out)
        else:
            out = cls.forward(ctx, *args)
    if ctx._fxad_dirty:
        raise InplaceError(f"{what}: the forward modifies its inputs in place "
                           "(ctx.mark_dirty), which fxad does not capture", op=what, loc=loc,
                           hint="return a new tensor from forward instead of modifying an "
                                "input")
    tuple_output = isinstance(out, tuple)
    outs = list(out) if tuple_output else [out]
    # an output that is an input object: a new alias of it, as autograd returns a view
    input_ids = {id(a) for a in args if isinstance(a, torch.Tensor)}
    for i, o in enumerate(outs):
        if isinstance(o, torch.Tensor) and id(o) in input_ids:
            outs[i] = cap.handle(torch.Tensor.view_as, (o, o), {})
    tensor_outputs = tuple(i for i, o in enumerate(outs) if isinstance(o, torch.Tensor))
    if not tensor_outputs:
        return out
    non_diff_ids = {id(t) for t in ctx._fxad_non_diff}
    non_differentiable = tuple(i for i in tensor_outputs if id(outs[i]) in non_diff_ids)

    # the tensors ctx keeps, by identity, in first-seen order
    attrs = {k: v for k, v in vars(ctx).items() if not k.startswith("_fxad_")}
    kept: list[torch.Tensor] = []
    seen: set[int] = set()
    for t in pytree.tree_leaves((ctx._fxad_saved, ctx._fxad_saved_fwd, attrs)):
        if isinstance(t, torch.Tensor) and id(t) not in seen:
            seen.add(id(t))
            kept.append(t)

    def sub_capture(fn: Callable, lead: list[Any], what_sub: str) -> fx.GraphModule:
        sub = cap.subcapture()
        sub.attr_paths = cap.attr_paths
        sub.module_paths = cap.module_paths
        lead_vals = []
        for i, v in enumerate(lead):
            ph = sub.graph.placeholder(f"g{i}")
            if v is None:
                ph.meta["val"] = None
                lead_vals.append(None)
                continue
            fv = _fake_like(v)
            ph.meta["val"] = snapshot(fv)
            sub.track(fv, ph)
            lead_vals.append(fv)
        repl: dict[int, torch.Tensor] = {}
        for i, t in enumerate(kept):
            ph = sub.graph.placeholder(f"saved{i}")
            fv = _fake_like(t)
            ph.meta["val"] = snapshot(fv)
            sub.track(fv, ph)
            repl[id(t)] = fv

        def swap(x: Any) -> Any:
            return repl.get(id(x), x) if isinstance(x, torch.Tensor) else x

        # in jvp, ctx.saved_tensors are those of ctx.save_for_forward (as in PyTorch)
        saved = ctx._fxad_saved_fwd if what_sub == "jvp" else ctx._fxad_saved
        rctx = _ReplayCtx({k: pytree.tree_map(swap, v) for k, v in attrs.items()},
                          tuple(swap(t) for t in saved),
                          tuple(swap(t) for t in ctx._fxad_saved_fwd))
        rctx.needs_input_grad = ctx.needs_input_grad
        with sub.environment(), torch.enable_grad(), sub.mode:
            res = fn(rctx, *lead_vals)
        sub.graph.output(sub.arg(res, f"{name}.{what_sub}"))
        gm = fx.GraphModule(cap.root, sub.graph, class_name=f"{name}_{what_sub}")
        normalize(gm)
        return gm

    backward_fn = cls.backward
    once = _is_once_differentiable(backward_fn)
    bwd_gm = sub_capture(cls.backward, [outs[i] for i in tensor_outputs], "backward")
    out_node = next(n for n in reversed(bwd_gm.graph.nodes) if n.op == "output")
    grads = out_node.args[0]
    grads = tuple(grads) if isinstance(grads, (tuple, list)) else (grads,)
    if len(grads) != len(args):
        raise CaptureError(
            f"{name}.backward returned {len(grads)} gradient(s), but forward takes "
            f"{len(args)} input(s)", op=f"{name}.backward", loc=loc,
            hint="return one gradient (or None) per forward input")
    out_node.args = (grads,)
    if once:
        for n in bwd_gm.graph.nodes:
            if n.op not in ("placeholder", "output"):
                n.meta["fxad_once_differentiable"] = name
    jvp_gm = None
    if _overrides(cls, "jvp"):
        jvp_gm = sub_capture(cls.jvp, [a if isinstance(a, torch.Tensor) else None
                                       for a in args], "jvp")
    record = CustomFunction(cls=cls, backward=bwd_gm, jvp=jvp_gm, n_outputs=len(outs),
                            tensor_outputs=tensor_outputs,
                            non_differentiable=non_differentiable, once_differentiable=once,
                            tuple_output=tuple_output)
    inputs = tuple(e if isinstance(a, torch.Tensor) or _representable(a) else None
                   for a, e in zip(args, entry))
    value = tuple(outs) if tuple_output else outs[0]
    node = cap.record("call_function", autograd_function,
                      (name, inputs, value, tuple(kept)), {}, value, what)
    node.meta.pop("fxad_no_grad", None)
    node.meta["fxad_custom_function"] = record
    if not has_tensor(value):
        return out
    cap.bind_outputs(value, node)
    return value


# -- operators of other libraries with an autograd formula ---------------------------------

_OWN_FORWARD: set[Any] = set()  # library ops whose forward is being recorded as one node


def library_autograd(cap: Any, op: Any, args: tuple, kwargs: dict) -> Any:
    """Capture a call of an operator another library defined with ``torch.library.custom_op``
    and gave an autograd formula (``register_autograd``: ``torch.ops.transformers.
    grouped_mm_fallback``, the mixture-of-experts product of transformers on CPU) as PyTorch
    differentiates it: as the ``torch.autograd.Function`` that formula makes.  The op is
    recorded as one node (without derivative), its ``setup_context`` runs on the capture's
    ``ctx`` and its ``backward`` is captured as code (:func:`apply_custom_function`), so the
    VJP code calls the library's own backward instead of re-running the op under autograd.

    Returns:
        The op's output, or ``NotImplemented`` when the op is none of those: a PyTorch op, an
        op registered otherwise, one without a formula, one with tensor-list arguments or
        results, one with a rule registered in fxad (which wins), or the op's own forward.
    """
    if op in _OWN_FORWARD:
        return NotImplemented
    overload = op.default if isinstance(op, torch._ops.OpOverloadPacket) \
        and hasattr(op, "default") else op
    if not isinstance(overload, torch._ops.OpOverload) \
            or overload.namespace in ("aten", "prims", "prim", "quantized", "_quantized"):
        return NotImplemented
    try:
        from torch._library.custom_ops import OPDEFS
    except ImportError:  # pragma: no cover - older torch
        return NotImplemented
    opdef = OPDEFS.get(f"{overload.namespace}::{overload._opname}")
    backward = getattr(opdef, "_backward_fn", None)
    own = lookup(op) or lookup(overload)
    if backward is None or (own is not None and not own.builtin):
        return NotImplemented
    schema = overload._schema
    if any(isinstance(a.type, torch.ListType) for a in (*schema.arguments, *schema.returns)):
        return NotImplemented
    positional, keyword_only = [], {}
    for i, a in enumerate(schema.arguments):
        if not a.kwarg_only and i < len(args):
            value = args[i]
        elif a.name in kwargs:
            value = kwargs[a.name]
        elif a.has_default_value():
            value = a.default_value
        else:
            return NotImplemented  # a call the op rejects: let the ordinary path say so
        if a.kwarg_only:
            keyword_only[a.name] = value
        else:
            positional.append(value)
    setup = getattr(opdef, "_setup_context_fn", None)
    has_kwarg_only = any(a.kwarg_only for a in schema.arguments)

    def forward(*inputs: Any) -> Any:
        _OWN_FORWARD.add(op)
        try:
            return op(*inputs, **keyword_only)
        finally:
            _OWN_FORWARD.discard(op)

    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        if setup is None:
            return
        if has_kwarg_only:
            setup(ctx=ctx, inputs=inputs, keyword_only_inputs=keyword_only, output=output)
        else:
            setup(ctx=ctx, inputs=inputs, output=output)

    cls = type(overload._opname, (torch.autograd.Function,), {
        "forward": staticmethod(forward), "setup_context": staticmethod(setup_context),
        "backward": staticmethod(backward)})
    return apply_custom_function(cap, cls, tuple(positional), {})


def _representable(a: Any) -> bool:
    return a is None or isinstance(a, (bool, int, float, complex, str, torch.dtype,
                                       torch.device))


# -- checkpoint regions -----------------------------------------------------------------------

@contextlib.contextmanager
def checkpoint_region(cap: Any) -> Iterator[None]:
    """Tag every node recorded inside with a fresh checkpoint region id."""
    cap.checkpoint_count = getattr(cap, "checkpoint_count", 0) + 1
    stack = getattr(cap, "checkpoint_stack", None)
    if stack is None:
        stack = cap.checkpoint_stack = []
    stack.append(cap.checkpoint_count)
    try:
        yield
    finally:
        stack.pop()


def patched_checkpoint_generator(original: Callable) -> Callable:
    """``torch.utils.checkpoint._checkpoint_without_reentrant_generator`` for capture: no RNG
    stashing or saved-tensor hooks, the region tagged instead."""
    def gen(fn: Any, *args: Any, **kwargs: Any) -> Iterator[None]:
        cap = current()
        if cap is None:
            yield from original(fn, *args, **kwargs)
            return
        with checkpoint_region(cap):
            yield
    return gen
