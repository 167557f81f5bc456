"""Aliasing: which tensor object is a view of which, and how writes through views are made
functional.

Capture remembers how each view was computed from its base (``session.parent``: view ->
(base, the recorded call)) and how many times the storage's owner has been mutated
(``session.version``; ``session.seen``: the version a node of a view stands for).  A write
into a view is written back into its base with the matching ``*_scatter`` op (PyTorch's
functionalization; :func:`commit`), and a view read after its storage changed is rebuilt by
replaying its call on the new base (:func:`replay`).  A mutated program input is noted in
``session.mutated_inputs`` and written back at the end of the graph (:mod:`fxad.capture.tracer`).

Functions of the capture session (:class:`fxad.capture.session.Session`), passed as ``cap``.
"""
from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils import _pytree as pytree

from ..errors import InplaceError
from ..graph.proxy import compute_meta, describe_target, user_source_loc
from ..ops import setitem as functional_setitem


def _is_view_of(out: Any, base: Any) -> bool:
    """``out`` shares ``base``'s storage as a view (PyTorch's own view tracking)."""
    if not (isinstance(out, torch.Tensor) and isinstance(base, torch.Tensor)):
        return False
    if out is base:
        return False
    try:
        return out.untyped_storage()._cdata == base.untyped_storage()._cdata
    except Exception:
        return False


def _bind(names: tuple[str, ...], args: tuple, kwargs: dict,
          defaults: tuple | None = None) -> tuple:
    """Positional-or-keyword arguments ``names`` of a view op's recorded call."""
    out = []
    for k, name in enumerate(names):
        if k < len(args):
            out.append(args[k])
        elif name in kwargs:
            out.append(kwargs[name])
        elif defaults is not None:
            out.append(defaults[k])
        else:
            raise KeyError(name)
    return tuple(out)


def _split_dim(name: str, args: tuple, kwargs: dict, ndim: int) -> int | None:
    if name == "hsplit":
        return 1 if ndim > 1 else 0
    if name == "vsplit":
        return 0
    if "dim" in kwargs:
        return kwargs["dim"] % ndim
    if len(args) >= 2 and isinstance(args[1], int):
        return args[1] % ndim
    return 0


def _same_index(a: Any, b: Any) -> bool:
    """Two indexing expressions are the same (tensors compared by identity)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is b
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same_index(x, y) for x, y in zip(a, b))
    if isinstance(a, slice) and isinstance(b, slice):
        return all(_same_index(x, y) for x, y in ((a.start, b.start), (a.stop, b.stop),
                                                 (a.step, b.step)))
    return type(a) is type(b) and a == b


def root_of(cap: Any, t: Any) -> Any:
    """The tensor object that owns ``t``'s storage (``t`` itself if it is no view)."""
    while id(t) in cap.parent:
        t = cap.parent[id(t)][0]
    return t


def note_views(cap: Any, out: Any, kind: str, target: Any, args: tuple, kwargs: dict) -> None:
    """Remember how outputs that are views of a tensor argument (``args[0]`` for most view
    ops; an operand of ``torch.einsum('ij->ji', x)``, which returns a view for a
    permutation or a diagonal; an item of ``torch.broadcast_tensors(a, b)``) are computed
    from it, so that they can be rebuilt after a mutation of the storage they share, and a
    mutation of them written back into their base."""
    bases = [a for a in pytree.tree_leaves((args, kwargs))
             if isinstance(a, FakeTensor) and id(a) in cap.env]
    if not bases:
        return
    step = (kind, target, args, kwargs)
    items = [(None, out)] if isinstance(out, torch.Tensor) else \
        list(enumerate(out)) if isinstance(out, (tuple, list)) else []
    for i, o in items:
        base = next((b for b in bases if _is_view_of(o, b)), None)
        if base is not None:
            cap.parent[id(o)] = (base, step + (i,))
            cap.seen[id(o)] = cap.version.get(id(root_of(cap, base)), 0)


def replay(cap: Any, t: Any) -> fx.Node:
    base, (kind, target, args, kwargs, item) = cap.parent[id(t)]
    what = describe_target(kind, target)
    node = cap.graph.create_node(kind, target, cap.arg(args, what), cap.arg(kwargs, what))
    node.meta["val"] = compute_meta(cap.root, kind, target, node.args, node.kwargs)
    node.meta["fxad_view_replay"] = True
    if item is not None:
        parent = node
        node = cap.graph.create_node("call_function", operator.getitem, (parent, item), {})
        node.meta["val"] = parent.meta["val"][item]
    cap.stamp(node)
    cap.env[id(t)] = node
    cap.seen[id(t)] = cap.version.get(id(root_of(cap, t)), 0)
    return node


def commit(cap: Any, x: Any, new: fx.Node, what: str) -> None:
    """``x`` now holds ``new``: write it back through every view between ``x`` and the
    tensor that owns the storage (PyTorch's functionalization: the base is rebuilt with
    the matching ``*_scatter`` op), so that the base and all its other views see the
    mutation; a mutated program input is written back at the end of the graph."""
    chain = []
    cur = x
    while id(cur) in cap.parent:
        par, step = cap.parent[id(cur)]
        chain.append((cur, par, step))
        cur = par
    root = cur
    loc = user_source_loc()
    first = len(cap.graph.nodes)
    child_new = new
    for child, par, step in chain:
        if not isinstance(par, FakeTensor):
            raise InplaceError(
                f"{what} modifies a view of a buffer or parameter of the module in place",
                op=what, loc=user_source_loc(),
                hint="update the whole buffer (self.buf.add_(...)), or compute a new "
                     "tensor")
        child_new = _scatter(cap, step, cap.node_of(par), child_new, par, child, what)
    if loc is not None:  # the functional code of one in-place statement, for codegen
        new.meta["fxad_inplace"] = loc
        n = new.prev
        while n.meta.get("fxad_loc") == loc and n.op != "placeholder" \
                and "fxad_inplace" not in n.meta:
            n.meta["fxad_inplace"] = loc
            n = n.prev
        for n in list(cap.graph.nodes)[first:]:
            n.meta["fxad_inplace"] = loc
    cap.env[id(x)] = new
    cap.keep.append(x)
    version = cap.version.get(id(root), 0) + 1
    cap.version[id(root)] = version
    cap.seen[id(x)] = version
    if root is not x:
        cap.env[id(root)] = child_new
    cap.seen[id(root)] = version
    if id(root) in cap.input_roots:
        cap.mutated_inputs[id(root)] = (root, cap.input_roots[id(root)])


def _scatter(cap: Any, step: tuple, par_node: fx.Node, new: fx.Node, par: Any, child: Any,
             what: str) -> fx.Node:
    """The parent's new value when its view ``child`` (made by ``step``) becomes
    ``new``."""
    kind, target, args, kwargs, item = step
    if not args or args[0] is not par:  # a view of another argument (einsum's operand)
        return _scatter_by_positions(cap, step, par_node, new, par, what)
    name = target if kind == "call_method" else getattr(target, "__name__", "")
    rest = cap.arg(tuple(args[1:]), what)
    kw = cap.arg(dict(kwargs), what)
    pshape = tuple(par.shape)
    if name == "detach" or (name == "data" and item is None):
        # a detached alias: the base now holds exactly the alias's values, but, as in
        # autograd, no derivative flows through the write (the base keeps its own history).
        # Not ``par + (new - par).detach()``: rounding (and NaN where the base held
        # torch.empty's garbage or inf) would change the values eager computes
        value = cap.emit("call_method", "detach", (new,))
        if not par.requires_grad:  # no history to keep
            return value
        # value + (par - par.detach()): exact where par is finite; derivative 1 to par
        history = cap.emit("call_function", operator.sub,
                           (par_node, cap.emit("call_method", "detach", (par_node,))))
        finite = cap.emit("call_function", torch.isfinite, (par_node,))
        history = cap.emit("call_function", torch.where, (finite, history, 0.0))
        return cap.emit("call_function", operator.add, (value, history))
    if name in ("alias", "view_as") and tuple(child.shape) == pshape \
            or name in ("contiguous",):
        return new
    if item is None and target is operator.getitem:
        return cap.emit("call_function", functional_setitem, (par_node, rest[0], new))
    if name == "select":
        dim, index = _bind(("dim", "index"), rest, kw)
        return cap.emit("call_function", torch.select_scatter, (par_node, new, dim, index))
    if name == "narrow":
        dim, start, length = _bind(("dim", "start", "length"), rest, kw)
        if isinstance(start, int):
            return cap.emit("call_function", torch.slice_scatter,
                            (par_node, new, dim, start, start + length))
    if name == "diagonal":
        offset, dim1, dim2 = _bind(("offset", "dim1", "dim2"), rest, kw, (0, 0, 1))
        return cap.emit("call_function", torch.diagonal_scatter,
                        (par_node, new, offset, dim1, dim2))
    if name in ("view", "reshape", "view_as", "reshape_as", "flatten", "unflatten",
                "squeeze", "unsqueeze") and item is None \
            and child.numel() == par.numel():
        return cap.emit("call_function", torch.reshape, (new, pshape))
    if name in ("transpose", "swapaxes", "swapdims") and item is None:
        d0, d1 = _bind(("dim0", "dim1"), rest, kw)
        return cap.emit("call_function", torch.transpose, (new, d0, d1))
    if name in ("t", "T", "mT") and item is None:
        return cap.emit("call_function", torch.transpose, (new, -2, -1) if par.dim() > 1
                        else (new, 0, 0))
    if name == "permute" and item is None:
        dims = rest[0] if len(rest) == 1 and isinstance(rest[0], (tuple, list)) else rest
        dims = [d % par.dim() for d in dims]
        inverse = tuple(sorted(range(len(dims)), key=lambda k: dims[k]))
        return cap.emit("call_function", torch.permute, (new, inverse))
    if name in ("movedim", "moveaxis") and item is None:
        src, dst = _bind(("source", "destination"), rest, kw)
        return cap.emit("call_function", torch.movedim, (new, dst, src))
    if name == "unbind" and item is not None:
        dim = _bind(("dim",), rest, kw, (0,))[0]
        return cap.emit("call_function", torch.select_scatter, (par_node, new, dim, item))
    if name in ("split", "chunk", "split_with_sizes", "tensor_split", "hsplit", "vsplit") \
            and item is not None:
        dim = _split_dim(name, rest, kw, par.dim())
        if dim is not None:
            out_val = compute_meta(cap.root, kind, target, (par_node,) + tuple(rest), kw)
            start = sum(int(o.shape[dim]) for o in out_val[:item])
            return cap.emit("call_function", torch.slice_scatter,
                            (par_node, new, dim, start, start + int(child.shape[dim])))
    # any other view: write through the positions it reads (an index map of the parent
    # pushed through the same view op)
    return _scatter_by_positions(cap, step, par_node, new, par, what)


def _scatter_by_positions(cap: Any, step: tuple, par_node: fx.Node, new: fx.Node, par: Any,
                          what: str) -> fx.Node:
    kind, target, args, kwargs, item = step
    positions = cap.emit("call_function", torch.arange, (par.numel(),),
                         {"device": par.device})
    positions = cap.emit("call_function", torch.reshape, (positions, tuple(par.shape)))
    # the same call with the parent's positions in its place (wherever the argument is)
    call_args, call_kwargs = pytree.tree_map(
        lambda a: positions if a is par else cap.arg(a, what) if isinstance(a, torch.Tensor)
        else a, (tuple(args), dict(kwargs)))
    view = cap.emit(kind, target, call_args, call_kwargs)
    if item is not None:
        view = cap.emit("call_function", operator.getitem, (view, item))
    flat_pos = cap.emit("call_function", torch.reshape, (view, (-1,)))
    flat_new = cap.emit("call_function", torch.reshape, (new, (-1,)))
    flat_par = cap.emit("call_function", torch.reshape, (par_node, (-1,)))
    put = cap.emit("call_function", torch.index_put, (flat_par, (flat_pos,), flat_new))
    return cap.emit("call_function", torch.reshape, (put, tuple(par.shape)))


def is_current_item(cap: Any, value: Any, x: Any, index: Any) -> bool:
    """``value`` is the view ``x[index]``, unchanged since (``y[i] += v`` stores it back)."""
    if not isinstance(value, torch.Tensor) or id(value) not in cap.parent:
        return False
    par, (kind, target, args, kwargs, item) = cap.parent[id(value)]
    if par is not x or target is not operator.getitem or item is not None:
        return False
    root = root_of(cap, value)
    return cap.seen.get(id(value), 0) == cap.version.get(id(root), 0) \
        and _same_index(args[1], index)
