"""Values capture can know: small integer CPU tensors (inputs, constants, ``torch.tensor`` of
Python data) and what is computed from them alone keep their real values beside the fake
ones (``session.known``: id(fake) -> real tensor; ``session.known_src``: the inputs, by
position, and constants, ``("const", id)``, each came from).  Where the program needs such
a value (``int(t)``, a size, the output shape of ``pack_padded_sequence`` from its lengths)
capture uses it, and the inputs and constants it came from are noted in
``session.value_inputs``: the generated module guards them on their values
(:mod:`fxad.guards`).

Functions of the capture session (:class:`fxad.capture.session.Session`), passed as ``cap``.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch._subclasses.fake_tensor import (DataDependentOutputException,
                                           DynamicOutputShapeException, FakeTensor)
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import _disable_current_modes

from ..graph.proxy import fake_mode, to_fake
from ..graph.sizes import check_squeeze, has_symbolic_shape

KNOWN_NUMEL = 1 << 14


def is_data_dependent(e: Exception) -> bool:
    return isinstance(e, (DataDependentOutputException, DynamicOutputShapeException)) \
        or "DataDependent" in type(e).__name__ or "DynamicOutputShape" in type(e).__name__


def _from_python_data(args: tuple, kwargs: dict) -> bool:
    """A factory call whose values come from Python data (``torch.tensor([2, 5, 3])``,
    ``torch.arange(n)``), not uninitialized memory."""
    return bool(args) and isinstance(args[0], (list, tuple, int, float, bool))


def known_value(cap: Any, t: torch.Tensor) -> torch.Tensor | None:
    """The real value of ``t`` if capture knows it: a known fake, or a small real tensor
    the program holds that is neither a parameter nor an attribute of the module (those
    can change between calls)."""
    if id(t) in cap.known:
        return cap.known[id(t)]
    if isinstance(t, FakeTensor) or isinstance(t, torch.nn.Parameter) \
            or t.numel() > KNOWN_NUMEL or t.device.type != "cpu":
        return None
    path = cap.attr_paths.get(id(t))
    if path is not None and not path.startswith("_tensor_constant"):
        return None
    return t


def knows_some(cap: Any, *a: Any) -> bool:
    return any(isinstance(v, torch.Tensor) and known_value(cap, v) is not None
               for v in pytree.tree_leaves(a))


def compute_with_values(cap: Any, func: Callable, args: tuple, kwargs: dict) -> Any:
    """An op whose output shape needs the values of its integer arguments
    (``_pack_padded_sequence(input, lengths)``): run it with the known arguments' values
    and the others as meta tensors, and return fake results (real values recorded)."""
    device = next((v.device for v in pytree.tree_leaves((args, kwargs))
                   if isinstance(v, torch.Tensor) and (v.is_floating_point()
                                                       or known_value(cap, v) is None)), None)

    def conv(v: Any) -> Any:
        if not isinstance(v, torch.Tensor):
            return v
        if known_value(cap, v) is not None and not (v.is_floating_point() or v.is_complex()):
            return known_value(cap, v)  # the integer arguments whose values decide shapes
        return torch.empty_strided(tuple(v.shape), tuple(v.stride()), dtype=v.dtype,
                                   device="meta")

    with _disable_current_modes(), torch._C.DisableTorchFunction():
        rargs, rkwargs = pytree.tree_map(conv, (args, kwargs))
        out = func(*rargs, **rkwargs)
    # the result's shape depends on those values: the inputs they came from are guarded
    ints = [v for v in pytree.tree_leaves((args, kwargs)) if isinstance(v, torch.Tensor)
            and not (v.is_floating_point() or v.is_complex()) and known_value(cap, v) is not None]
    cap.value_inputs |= sources(cap, ints)
    mode = fake_mode()

    def back(v: Any) -> Any:
        if not isinstance(v, torch.Tensor):
            return v
        if v.device.type == "meta":
            with torch._C.DisableTorchFunction(), mode:
                return torch.empty_strided(tuple(v.shape), tuple(v.stride()), dtype=v.dtype,
                                           device=device or "cpu")
        fv = to_fake(v.clone())
        cap.known[id(fv)] = v
        cap.known_src[id(fv)] = sources(cap, args, kwargs)
        cap.keep.append(fv)
        return fv

    return pytree.tree_map(back, out)


def sources(cap: Any, *a: Any) -> frozenset:
    """The inputs (their positions) and constant tensors (``("const", id)``) a known
    value is computed from."""
    out: frozenset = frozenset()
    for v in pytree.tree_leaves(a):
        if isinstance(v, torch.Tensor):
            if id(v) in cap.known_src:
                out = out | cap.known_src[id(v)]
            elif not isinstance(v, FakeTensor):
                cap.const_objs[id(v)] = v
                out = out | {("const", id(v))}
    return out


def note_known(cap: Any, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
    """``out``'s real value when every tensor the op reads is known (small integer inputs,
    constants, what was computed from them), for data-dependent questions about it."""
    name = getattr(func, "__name__", "")
    if name.startswith(("rand", "empty", "normal", "bernoulli", "multinomial", "poisson",
                        "dropout", "uniform", "exponential", "geometric", "cauchy")):
        return
    tensors = [v for v in pytree.tree_leaves((args, kwargs)) if isinstance(v, torch.Tensor)]
    if any(known_value(cap, v) is None for v in tensors):
        return
    outs = [v for v in pytree.tree_leaves(out) if isinstance(v, torch.Tensor)]
    if any(has_symbolic_shape(v) for v in outs):  # values that depend on symbolic sizes
        return
    if not outs or any(v.numel() > KNOWN_NUMEL or v.is_floating_point() and
                       v.numel() > 64 for v in outs):
        return
    if not tensors and not _from_python_data(args, kwargs):
        return

    def real(v: Any) -> Any:
        return known_value(cap, v) if isinstance(v, torch.Tensor) else v

    try:
        rargs, rkwargs = pytree.tree_map(real, (args, kwargs))
        with _disable_current_modes(), torch._C.DisableTorchFunction():
            rout = func(*rargs, **rkwargs)
    except Exception:  # noqa: BLE001 - not knowable: stays unknown
        return
    src = sources(cap, args, kwargs)
    for fv, rv in zip(pytree.tree_leaves(out), pytree.tree_leaves(rout)):
        if isinstance(fv, torch.Tensor) and isinstance(rv, torch.Tensor) \
                and tuple(fv.shape) == tuple(rv.shape):
            cap.known[id(fv)] = rv
            cap.known_src[id(fv)] = src
            node = cap.env.get(id(fv))
            if node is not None:
                node.meta["fxad_value"] = rv


def known_answer(cap: Any, func: Any, args: tuple, kwargs: dict) -> tuple[bool, Any]:
    """(True, answer) for a question about data fxad knows (``int(batch_sizes[0])`` of a
    packed sequence built from constant lengths); the inputs it came from are then guarded
    on their values."""
    tensors = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
    if not tensors or any(known_value(cap, t) is None for t in tensors):
        return False, None
    real = pytree.tree_map(lambda v: known_value(cap, v) if isinstance(v, torch.Tensor)
                           else v, (args, kwargs))
    with _disable_current_modes(), torch._C.DisableTorchFunction():
        answer = func(*real[0], **real[1])
    for src in sources(cap, tensors):
        cap.value_inputs.add(src)
    return True, answer


# -- index bounds of symbolic sizes --------------------------------------------------------
# ``torch.arange(T)`` on a symbolic ``T`` has no known values, but its largest value is known
# (``T - 1``).  Used as indices into a table of static size (a position embedding), it makes
# the program valid only for ``T <= rows``: that becomes a guard at the user's line, as eager
# would raise an IndexError there.

_BOUND_KEEPING = {"unsqueeze", "view", "reshape", "expand", "expand_as", "to", "long", "int",
                  "contiguous", "flatten", "squeeze", "__getitem__", "repeat", "detach",
                  "clone", "type", "view_as", "reshape_as", "broadcast_to"}
_INDEXING = {"embedding", "index_select", "__getitem__", "take_along_dim", "gather"}


def note_index_bounds(cap: Any, func: Callable, args: tuple, kwargs: dict, out: Any) -> None:
    """Record the exclusive upper bound of ``torch.arange`` results over a symbolic size (and
    of shape-only views of them), and guard their use as indices into a static dimension;
    guard the sizes ``squeeze`` decides on (:func:`fxad.graph.sizes.check_squeeze`)."""
    name = getattr(func, "__name__", "")
    with fake_mode():
        check_squeeze(name, args, kwargs)
    bounds = cap.index_bounds
    if name == "arange" and isinstance(out, torch.Tensor) and has_symbolic_shape(out):
        ends = [a for a in args if isinstance(a, (int, torch.SymInt))]
        step = kwargs.get("step", args[2] if len(ends) >= 3 else 1)
        if ends and (step == 1) and all(isinstance(a, (int, torch.SymInt)) for a in ends[:2]):
            bounds[id(out)] = ends[1] if len(ends) >= 2 else ends[0]
            cap.keep.append(out)
        return
    tensors = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
    bounded = [(t, bounds[id(t)]) for t in tensors if id(t) in bounds]
    if not bounded:
        return
    if name in _BOUND_KEEPING and args and isinstance(args[0], torch.Tensor) \
            and id(args[0]) in bounds and isinstance(out, torch.Tensor):
        bounds[id(out)] = bounds[id(args[0])]
        cap.keep.append(out)
    if name not in _INDEXING:
        return
    if name == "embedding":
        idx, table, dim = args[0], args[1] if len(args) > 1 else kwargs.get("weight"), 0
    elif name == "__getitem__":
        table, idx, dim = args[0], args[1] if len(args) > 1 else None, 0
    else:  # index_select(x, dim, index), gather(x, dim, index), take_along_dim(x, idx, dim)
        table = args[0]
        idx = next((t for t, _ in bounded if t is not table), None)
        dim = next((a for a in args[1:] if isinstance(a, int)), kwargs.get("dim", 0))
    if not isinstance(idx, torch.Tensor) or id(idx) not in bounds \
            or not isinstance(table, torch.Tensor) or table.dim() == 0:
        return
    rows = table.shape[dim % table.dim()]
    if isinstance(rows, int):
        with fake_mode():
            torch._check(bounds[id(idx)] <= rows)
