"""Functional helpers that fxad writes into generated code where torch has no out-of-place form.

They are registered as torch.fx "custom builtins", so code saved with
``GraphModule.to_folder`` imports them (``from fxad.ops import setitem as fxad_setitem``).
"""
from __future__ import annotations

import builtins
from typing import Any

import torch
import torch.fx
from torch._prims_common import make_channels_last_strides_for


def setitem(x: torch.Tensor, index: Any, value: Any) -> torch.Tensor:
    """Out-of-place ``x[index] = value``: a copy of ``x`` with ``value`` written at ``index``.

    Args:
        x: tensor of any shape/dtype.
        index: anything valid in ``x[index]`` (ints, slices, None, Ellipsis, tensors).
        value: tensor or Python number broadcastable to ``x[index].shape``.

    Returns:
        New tensor, same shape/dtype/device as ``x``; ``x`` is not modified.
    """
    if isinstance(x, torch.fx.Proxy):  # called by a rule while writing graph code
        return x.tracer.create_proxy("call_function", setitem, (x, index, value), {})
    out = x.clone()
    if isinstance(value, torch.Tensor) and _batched(value) and not _batched(x):
        # under torch.func.vmap (fxad.jacrev / hessian) a batched value cannot be written
        # into an unbatched copy: make the copy batched first (adding a batched zero)
        out = out + torch.zeros_like(value).sum().to(out.dtype)
    out[index] = value
    return out


def _batched(t: torch.Tensor) -> bool:
    try:
        return bool(torch._C._functorch.is_batchedtensor(t))
    except (AttributeError, RuntimeError):  # pragma: no cover - other torch versions
        return False


def autograd_function(name: str, inputs: tuple, outputs: Any, saved: tuple = ()) -> Any:
    """Marks the outputs of a custom ``torch.autograd.Function`` (class ``name``) in a
    captured graph; returns ``outputs`` unchanged.

    The Function's forward ops are recorded before this call (they run without gradient
    tracking, as in eager PyTorch); ``inputs`` are its arguments and ``saved`` the tensors its
    ``ctx`` keeps for the backward (``ctx.save_for_backward`` and tensor attributes).  fxad
    differentiates this node with the Function's own ``backward`` (and ``jvp``), captured as
    code (see :mod:`fxad.capture.custom`).
    """
    if isinstance(outputs, torch.fx.Proxy):  # called while writing graph code
        return outputs.tracer.create_proxy("call_function", autograd_function,
                                           (name, inputs, outputs, saved), {})
    return outputs


def _is_proxy(*values: Any) -> Any:
    from torch.utils import _pytree as pytree
    for v in pytree.tree_leaves(values):
        if isinstance(v, torch.fx.Proxy):
            return v.tracer
    return None


def cond(pred: Any, true_fn: Any, false_fn: Any, operands: tuple, rng: Any = None) -> Any:
    """``true_fn(*operands)`` if ``pred`` else ``false_fn(*operands)``: ``torch.cond`` as fxad
    captures it (both branches are graphs of the module; the predicate is read at run time,
    so one build is right whichever branch the data takes).

    Args:
        pred: a one-element tensor (or a Python bool).
        true_fn, false_fn: callables taking ``*operands`` and returning tensors of the same
            shapes and dtypes.
        operands: tuple of tensors (the branch inputs, then the tensors the branches read
            from outside, lifted by capture).
        rng: random-number generator states saved by :func:`rng_state` before the forward
            branch ran: the branch then runs with them (and the generators are put back
            after), so a branch that recomputes the forward inside its derivative draws the
            forward's numbers again (dropout masks), as ``torch.utils.checkpoint`` does.
    """
    tracer = _is_proxy(pred, operands)
    if tracer is not None:
        args = (pred, true_fn, false_fn, operands) + (() if rng is None else (rng,))
        return tracer.create_proxy("call_function", cond, args, {})
    if type(pred).__name__ == "FakeTensor":  # fxad computing a nested cond's metadata:
        return true_fn(*operands)           # both branches have the same shapes
    branch = true_fn if bool(pred) else false_fn
    if rng is None:
        return branch(*operands)
    devices = [rng[1].device] if len(rng) > 1 else []
    with torch.random.fork_rng(devices=[d.index or 0 for d in devices]):
        torch.set_rng_state(rng[0])
        if len(rng) > 1:
            torch.cuda.set_rng_state(rng[2], rng[1].device)
        return branch(*operands)


def program_error(like: Any, kind: str, message: str) -> Any:
    """Raise what the traced program raised on this path of its random decisions (an
    exception of the builtin class named ``kind``, else ``RuntimeError``, with ``message``);
    ``like`` (a tensor the branch returns in its place) is returned when fxad only computes
    the branch's metadata on fake tensors.  See :mod:`fxad.capture.paths`."""
    tracer = _is_proxy(like)
    if tracer is not None:
        return tracer.create_proxy("call_function", program_error, (like, kind, message), {})
    if type(like).__name__ == "FakeTensor":
        return like
    cls = getattr(builtins, kind, None)
    if not (isinstance(cls, type) and issubclass(cls, Exception)):
        cls = RuntimeError
    raise cls(message)


def rng_state(pred: Any) -> tuple:
    """The states of the random-number generators a branch selected by ``pred`` draws from:
    ``(cpu_state,)``, or ``(cpu_state, device_marker, cuda_state)`` when ``pred`` is on a CUDA
    device (uint8 tensors, ``torch.get_rng_state()``'s form); see :func:`cond`'s ``rng``."""
    tracer = _is_proxy(pred)
    if tracer is not None:
        return tracer.create_proxy("call_function", rng_state, (pred,), {})
    if type(pred).__name__ == "FakeTensor":  # fxad computing the result's metadata
        with torch._C.DisableTorchFunction():
            cpu = torch.empty(torch.get_rng_state().shape, dtype=torch.uint8, device="cpu")
            if pred.device.type == "cuda":
                return (cpu, torch.empty(0, device=pred.device),
                        torch.empty(torch.cuda.get_rng_state(pred.device).shape,
                                    dtype=torch.uint8, device="cpu"))
            return (cpu,)
    if isinstance(pred, torch.Tensor) and pred.device.type == "cuda":
        return (torch.get_rng_state(), torch.empty(0, device=pred.device),
                torch.cuda.get_rng_state(pred.device))
    return (torch.get_rng_state(),)


def while_loop(cond_fn: Any, body_fn: Any, carried: tuple, additional: tuple = ()) -> tuple:
    """``torch.while_loop`` as fxad captures it: while ``cond_fn(*carried, *additional)``,
    ``carried = body_fn(*carried, *additional)``; returns the final ``carried`` tuple.
    ``additional`` are the tensors the functions read from outside (lifted by capture)."""
    tracer = _is_proxy(carried, additional)
    if tracer is not None:
        return tracer.create_proxy("call_function", while_loop,
                                   (cond_fn, body_fn, carried, additional), {})
    carried = tuple(carried)
    while bool(cond_fn(*carried, *additional)):
        carried = tuple(body_fn(*carried, *additional))
    return carried


def while_loop_vjp(cond_fn: Any, body_fn: Any, body_vjp: Any, carried: tuple,
                   additional: tuple, cotangents: tuple) -> tuple:
    """Reverse mode of :func:`while_loop`, by recomputation: the loop runs forward again
    from ``carried`` keeping every iteration's state (memory: one copy of the carried
    tensors per iteration, only while this backward runs), then the body's VJP
    (``body_vjp(*state, *additional, cotangent) -> (value, grads)``, fxad-generated code)
    runs over the states in reverse.  Returns the cotangents of ``(*carried, *additional)``
    (``None`` for non-floating ones)."""
    tracer = _is_proxy(carried, additional, cotangents)
    if tracer is not None:
        return tracer.create_proxy("call_function", while_loop_vjp,
                                   (cond_fn, body_fn, body_vjp, carried, additional,
                                    cotangents), {})
    states = []
    c = tuple(carried)
    while bool(cond_fn(*c, *additional)):
        states.append(c)
        c = tuple(body_fn(*c, *additional))
    n = len(c)
    d_c = [d if d is not None or not _floating(v) else torch.zeros_like(v)
           for d, v in zip(cotangents, c)]
    d_add: list[Any] = [None] * len(additional)
    for state in reversed(states):
        _, grads = body_vjp(*state, *additional, tuple(d_c))
        d_c = [g if g is not None or not _floating(v) else torch.zeros_like(v)
               for g, v in zip(grads[:n], state)]
        for k, g in enumerate(grads[n:]):
            if g is not None:
                d_add[k] = g if d_add[k] is None else d_add[k] + g
    return tuple(d_c) + tuple(d_add)


def while_loop_jvp(cond_fn: Any, body_jvp: Any, carried: tuple, tangents: tuple,
                   additional: tuple, additional_tangents: tuple) -> tuple:
    """Forward mode of :func:`while_loop`: the loop carries the tangents beside the values,
    each step running the body's JVP (``body_jvp(*primals, *tangents) -> (value, tangent)``,
    fxad-generated code); returns ``(carried, tangents)``."""
    tracer = _is_proxy(carried, tangents, additional)
    if tracer is not None:
        return tracer.create_proxy("call_function", while_loop_jvp,
                                   (cond_fn, body_jvp, carried, tangents, additional,
                                    additional_tangents), {})
    c, t = tuple(carried), tuple(tangents)
    while bool(cond_fn(*c, *additional)):
        c, t = body_jvp(*c, *additional, *t, *additional_tangents)
        c, t = tuple(c), tuple(t)
    return c, t


def _steps(xs: tuple, dim: int, reverse: bool) -> list[int]:
    n = xs[0].shape[dim] if xs else 0
    return list(range(n - 1, -1, -1)) if reverse else list(range(n))


def _stack(rows: list[tuple], dim: int) -> tuple:
    if not rows:
        return ()
    return tuple(None if rows[0][k] is None else torch.stack([r[k] for r in rows], dim)
                 for k in range(len(rows[0])))


def scan(body: Any, init: tuple, xs: tuple, additional: tuple = (), dim: int = 0,
         reverse: bool = False) -> tuple:
    """``torch._higher_order_ops.scan`` (and ``map``) as fxad captures them: for each index
    ``i`` of ``xs`` along ``dim`` (last to first when ``reverse``),
    ``carry, y_i = body(*carry, *[x.select(dim, i) for x in xs], *additional)``; returns
    ``(carry, ys)`` with the ``y_i`` stacked along ``dim`` in index order."""
    tracer = _is_proxy(init, xs, additional)
    if tracer is not None:
        return tracer.create_proxy("call_function", scan,
                                   (body, init, xs, additional, dim, reverse), {})
    carry = tuple(init)
    rows: list[tuple] = [()] * (xs[0].shape[dim] if xs else 0)
    for i in _steps(xs, dim, reverse):
        carry, y = body(*carry, *[x.select(dim, i) for x in xs], *additional)
        carry = tuple(carry)
        rows[i] = tuple(y)
    return carry, _stack(rows, dim)


def scan_vjp(body: Any, body_vjp: Any, init: tuple, xs: tuple, additional: tuple, dim: int,
             reverse: bool, d_carry: tuple, d_ys: tuple) -> tuple:
    """Reverse mode of :func:`scan`, by recomputation: the scan runs forward again keeping
    each step's carry (memory: one copy of the carry per step, while this backward runs),
    then the body's VJP (``body_vjp(*carry, *x_i, *additional, (d_carry, d_y_i)) -> (value,
    grads)``, fxad-generated code) runs over the steps in reverse.  Returns the cotangents
    of ``(*init, *xs, *additional)`` (``None`` for non-floating ones)."""
    tracer = _is_proxy(init, xs, additional, d_carry, d_ys)
    if tracer is not None:
        return tracer.create_proxy("call_function", scan_vjp,
                                   (body, body_vjp, init, xs, additional, dim, reverse,
                                    d_carry, d_ys), {})
    steps = _steps(xs, dim, reverse)
    carries = [tuple(init)]
    y_like: tuple = ()
    for k, i in enumerate(steps[:-1]):
        c, y = body(*carries[-1], *[x.select(dim, i) for x in xs], *additional)
        carries.append(tuple(c))
        if k == 0:
            y_like = tuple(y)
    if steps and any(d is None for d in d_ys) and not y_like:  # one step: shapes of its y
        y_like = tuple(body(*carries[0], *[x.select(dim, steps[0]) for x in xs],
                            *additional)[1])
    # an output of the scan that the program never used has no cotangent: zeros per step
    # for the body's VJP (whose generated code expects one tensor per floating output)
    zero_y = [None if d is not None or not y_like or not _floating(y_like[j])
              else torch.zeros_like(y_like[j]) for j, d in enumerate(d_ys)]
    nc, nx = len(init), len(xs)
    d_c = [d if d is not None or not _floating(v) else torch.zeros_like(v)
           for d, v in zip(d_carry, init)]
    d_x_rows: list[Any] = [None] * len(steps)
    d_add: list[Any] = [None] * len(additional)
    for k in range(len(steps) - 1, -1, -1):
        i = steps[k]
        x_i = [x.select(dim, i) for x in xs]
        d_y = tuple(d.select(dim, i) if d is not None else z for d, z in zip(d_ys, zero_y))
        _, grads = body_vjp(*carries[k], *x_i, *additional, (tuple(d_c), d_y))
        d_c = [g if g is not None or not _floating(v) else torch.zeros_like(v)
               for g, v in zip(grads[:nc], carries[k])]
        d_x_rows[i] = tuple(g if g is not None or not _floating(v) else torch.zeros_like(v)
                            for g, v in zip(grads[nc:nc + nx], x_i))
        for j, g in enumerate(grads[nc + nx:]):
            if g is not None:
                d_add[j] = g if d_add[j] is None else d_add[j] + g
    d_xs = tuple(None if not _floating(x) else torch.stack([r[j] for r in d_x_rows], dim)
                 for j, x in enumerate(xs)) if steps else \
        tuple(torch.zeros_like(x) if _floating(x) else None for x in xs)
    return tuple(d_c) + d_xs + tuple(d_add)


def scan_jvp(body_jvp: Any, init: tuple, xs: tuple, additional: tuple, dim: int,
             reverse: bool, t_init: tuple, t_xs: tuple, t_additional: tuple) -> tuple:
    """Forward mode of :func:`scan`: the carry's tangent travels beside the carry, each step
    running the body's JVP (``body_jvp(*primals, *tangents) -> (value, tangent)``); returns
    ``((carry, ys), (carry_tangent, ys_tangent))``."""
    tracer = _is_proxy(init, xs, additional, t_init, t_xs)
    if tracer is not None:
        return tracer.create_proxy("call_function", scan_jvp,
                                   (body_jvp, init, xs, additional, dim, reverse, t_init, t_xs,
                                    t_additional), {})
    c, tc = tuple(init), tuple(t_init)
    n = xs[0].shape[dim] if xs else 0
    rows: list[tuple] = [()] * n
    trows: list[tuple] = [()] * n
    for i in _steps(xs, dim, reverse):
        x_i = [x.select(dim, i) for x in xs]
        t_i = [t.select(dim, i) if t is not None else None for t in t_xs]
        (c, y), (tc, ty) = body_jvp(*c, *x_i, *additional, *tc, *t_i, *t_additional)
        c, tc = tuple(c), tuple(tc)
        rows[i], trows[i] = tuple(y), tuple(ty)
    return (c, _stack(rows, dim)), (tc, _stack(trows, dim))


def canonical_layout(t: torch.Tensor) -> torch.Tensor:
    """``t`` (a 4-D or 5-D tensor laid out channels-last, and not row-major), or a copy of it
    with the canonical channels-last strides (``make_channels_last_strides_for``, as
    ``torch.empty(..., memory_format=torch.channels_last)`` gives them) where a size-1
    dimension has another stride.  PyTorch's CPU
    ``native_batch_norm_backward`` returns wrong values (off by far more than rounding) when
    the cotangent or the input has such strides and the other does not (torch 2.13, eager
    autograd included); which strides a size-1 dimension gets differs between fake and
    real tensors, so the check runs on every call.

    Args:
        t: a tensor of any dtype and device.

    Returns:
        ``t`` itself, or a copy with the same shape, values, dtype and device.
    """
    if isinstance(t, torch.fx.Proxy):  # called by a rule while writing graph code
        return t.tracer.create_proxy("call_function", canonical_layout, (t,), {})
    if t.dim() not in (4, 5) or t.is_contiguous():
        return t
    fmt = torch.channels_last if t.dim() == 4 else torch.channels_last_3d
    if not t.is_contiguous(memory_format=fmt):
        return t
    want = tuple(make_channels_last_strides_for(t.shape))
    return t if t.stride() == want else torch.clone(t, memory_format=fmt)


def _floating(v: Any) -> bool:
    return isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex())


def _register_builtins() -> None:
    try:
        from torch.fx.graph import _register_custom_builtin
    except ImportError:  # pragma: no cover - very old torch
        return
    _register_custom_builtin("fxad_setitem", "from fxad.ops import setitem as fxad_setitem", setitem)
    _register_custom_builtin("fxad_autograd_function",
                             "from fxad.ops import autograd_function as fxad_autograd_function",
                             autograd_function)
    _register_custom_builtin("fxad_canonical_layout",
                             "from fxad.ops import canonical_layout as fxad_canonical_layout",
                             canonical_layout)
    for name, fn in (("cond", cond), ("rng_state", rng_state), ("program_error", program_error),
                     ("while_loop", while_loop), ("while_loop_vjp", while_loop_vjp),
                     ("while_loop_jvp", while_loop_jvp), ("scan", scan), ("scan_vjp", scan_vjp),
                     ("scan_jvp", scan_jvp)):
        _register_custom_builtin(f"fxad_{name}", f"from fxad.ops import {name} as fxad_{name}",
                                 fn)


_register_builtins()
