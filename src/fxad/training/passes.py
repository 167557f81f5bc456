"""Rewrites of the derivative graph that :func:`fxad.compile` and :func:`fxad.joint_step`
run (the code built to run; :func:`fxad.vjp` keeps the engine's form).

:func:`stack_selected_cotangents`: where a program reads every row of a tensor
(``q, k, v = proj[0], proj[1], proj[2]``, as ``F.multi_head_attention_forward`` unpacks its
packed input projection), the engine gives each read its cotangent as a zero tensor of the
whole shape with one row written (``fxad_setitem(zeros_like(proj), i, d_i)``) and sums
them.  That is one zero tensor, one copy of it per row and ``n - 1`` whole-tensor additions;
autograd's ``SelectBackward`` does the same (a zero tensor per row).  The sum is
``torch.stack([d_0, ..., d_{n-1}])``: one write of the result.

The others remove work eager autograd does not do (found by counting the ATen ops of a
training step against eager's, ``benchmarks/bench_real_models.py --profile``):

* :func:`drop_whole_writes`: ``fxad_setitem(zeros_like(x), index, d)`` where ``index``
  selects every element (``h[:, 0:, :]``, which eager's indexing returns as ``h`` itself
  and transformers writes for ``logits_to_keep=0``) is ``d``: no zero tensor, copy of it
  and write, and ``x`` is not saved for its shape;
* :func:`zeros_of_shape`: ``torch.zeros_like(x)`` of a contiguous ``x`` of static shape is
  ``torch.zeros(shape, dtype=..., device=...)``, so that the forward does not save ``x``
  only for the shape of a cotangent (a basic index's backward: ViT's ``h[:, 0]``);
* :func:`sum_to_size_as_sum`: the engine's ``d.sum_to_size(shape)`` (a bias's gradient,
  a broadcast operand's) is ``torch.sum(d, dims)``, the one kernel ``sum_to_size`` calls
  (with ``keepdim=True`` for kept size-1 dimensions), bit for bit;
* :func:`write_fresh_in_place` (on the backward graph after the split, as it mutates):
  ``fxad_setitem(z, index, v)`` on a fresh ``z`` (``torch.zeros``, an op's new result)
  that nothing else reads writes into ``z`` (:func:`write_into`) instead of a copy of it,
  as autograd's ``SelectBackward``/``SliceBackward`` write into their zero tensor;
* :func:`accumulate_into_reshaped` (also after the split): a cotangent sum with a reshaped
  fresh operand (a linear layer's input cotangent) accumulates into it in place, as
  :func:`fxad.simplify.inplace.accumulate_in_place` does for a fresh operand;
* :func:`activations_in_place` (on the forward graph after the split): ``torch.relu(x)``
  (``sigmoid``, ``tanh``) of a fresh ``x`` that nothing else reads is ``torch.relu_(x)``,
  as ``nn.ReLU(inplace=True)`` runs in eager (ResNet's ``relu(bn(conv(x)))``): one
  activation-sized allocation and write fewer per call.  The readable code shows
  ``torch.relu`` with the comment ``# in place: ...`` that capture writes.
"""
from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from .. import ops
from ..graph.proxy import substitute
from ..simplify.inplace import is_fresh
from ..naming import code_builtin

__all__ = ["stack_selected_cotangents", "drop_whole_writes", "zeros_of_shape",
           "sum_to_size_as_sum", "write_fresh_in_place", "write_into",
           "accumulate_into_reshaped", "activations_in_place", "fresh_result"]

_ADDS = (operator.add, torch.add)


def _val(n: Any) -> Any:
    return n.meta.get("val") if isinstance(n, fx.Node) else None


def _row_write(n: Any) -> tuple[fx.Node, int, fx.Node] | None:
    """``(zeros, i, d)`` where ``n`` is ``fxad_setitem(zeros, i, d)`` with ``zeros =
    zeros_like(x)``, an integer ``i`` and ``d`` of one row's shape and dtype; else None."""
    if not (isinstance(n, fx.Node) and n.op == "call_function" and n.target is ops.setitem
            and len(n.args) == 3 and not n.kwargs and len(n.users) == 1):
        return None
    z, i, d = n.args
    if not (isinstance(z, fx.Node) and z.op == "call_function" and z.target is torch.zeros_like
            and len(z.args) == 1 and not z.kwargs and type(i) is int
            and isinstance(d, fx.Node)):
        return None
    zv, dv = _val(z), _val(d)
    if not (isinstance(zv, torch.Tensor) and isinstance(dv, torch.Tensor) and zv.dim() >= 1
            and tuple(dv.shape) == tuple(zv.shape[1:]) and dv.dtype == zv.dtype
            and dv.device == zv.device and 0 <= i < zv.shape[0]):
        return None
    return z, i, d


def _leaves(n: fx.Node, root: fx.Node, inner: list[fx.Node]) -> list[fx.Node] | None:
    """The operands of the sum tree at ``n`` (adds read only inside the tree)."""
    if n.op == "call_function" and n.target in _ADDS and len(n.args) == 2 and not n.kwargs \
            and (n is root or len(n.users) == 1):
        inner.append(n)
        out = []
        for a in n.args:
            if not isinstance(a, fx.Node):
                return None
            sub = _leaves(a, root, inner)
            if sub is None:
                return None
            out.extend(sub)
        return out
    return [n]


def stack_selected_cotangents(gm: fx.GraphModule) -> int:
    """Rewrite each sum of row writes into one zero tensor covering all its rows once (see
    the module docstring) to ``torch.stack`` of the rows; returns the number of rewrites
    (and recompiles ``gm`` when there are any).  Needs ``meta['val']`` on the nodes."""
    g = gm.graph
    done = 0
    for root in reversed(list(g.nodes)):
        if getattr(root, "_erased", False) or root.op != "call_function" \
                or root.target not in _ADDS:
            continue
        inner: list[fx.Node] = []
        leaves = _leaves(root, root, inner)
        if not leaves or len(leaves) < 2:
            continue
        writes = [_row_write(n) for n in leaves]
        if any(w is None for w in writes):
            continue
        zeros = {w[0] for w in writes}  # type: ignore[index]
        rows = {w[1]: w[2] for w in writes}  # type: ignore[index]
        if len(zeros) != 1 or len(rows) != len(writes):
            continue
        z = next(iter(zeros))
        if set(rows) != set(range(_val(z).shape[0])) or _val(root).shape != _val(z).shape \
                or _val(root).dtype != _val(z).dtype:
            continue
        items = [rows[i] for i in range(len(rows))]
        if substitute(gm, root, torch.stack, (items,), {}, [*inner, *leaves, z]):
            done += 1
    if done:
        g.lint()
        gm.recompile()
    return done


# --- work eager does not do -------------------------------------------------------------------


def _static(shape: Any) -> bool:
    return all(type(s) is int for s in shape)


def _selects_all(index: Any, shape: tuple[int, ...]) -> bool:
    """``x[index]`` is every element of ``x`` (of ``shape``), in order and unbroadcast:
    only slices ``a:b`` of step 1 with ``a`` 0 or ``None`` (or ``<= -size``) and ``b``
    ``None`` or ``>= size``, and at most one ``Ellipsis``."""
    items = index if isinstance(index, tuple) else (index,)
    ellipses = [k for k, i in enumerate(items) if i is Ellipsis]
    if len(ellipses) > 1:
        return False
    dims = [i for i in items if i is not Ellipsis]
    if len(dims) > len(shape):
        return False
    if ellipses:  # the items before the Ellipsis index leading dims, those after trailing
        k = ellipses[0]
        after = len(items) - k - 1
        sizes = list(shape[:k]) + list(shape[len(shape) - after:] if after else [])
    else:
        sizes = list(shape[:len(dims)])
    for i, size in zip(dims, sizes):
        if type(i) is not slice or i.step not in (None, 1):
            return False
        if not (i.start is None or (type(i.start) is int and (i.start == 0 or i.start <= -size))):
            return False
        if not (i.stop is None or (type(i.stop) is int and i.stop >= size)):
            return False
    return True


def drop_whole_writes(gm: fx.GraphModule) -> int:
    """Rewrite ``fxad_setitem(x, index, d)`` to ``d`` where ``index`` selects every element
    of ``x`` (:func:`_selects_all`) and ``d`` (a node) has ``x``'s static shape, dtype and
    device and the result's strides; returns the number of rewrites (recompiling ``gm``
    when there are any).  Nodes left unread (the zero tensor) are erased."""
    g = gm.graph
    done = 0
    for n in list(g.nodes):
        if not (n.op == "call_function" and n.target is ops.setitem and len(n.args) == 3
                and not n.kwargs and not n.meta.get("fxad_side_effect")):
            continue
        x, index, d = n.args
        xv, dv, out = _val(x), _val(d), _val(n)
        if not (isinstance(xv, torch.Tensor) and isinstance(dv, torch.Tensor)
                and isinstance(out, torch.Tensor) and _static(xv.shape)
                and tuple(dv.shape) == tuple(xv.shape) and dv.dtype == xv.dtype
                and dv.device == xv.device and dv.stride() == out.stride()
                and _selects_all(index, tuple(xv.shape))):
            continue  # (equal strides: the rules after it were chosen for the write's layout)
        n.replace_all_uses_with(d)
        g.erase_node(n)
        if isinstance(x, fx.Node) and not x.users and x.op == "call_function" \
                and x.target in (torch.zeros_like, torch.zeros):
            g.erase_node(x)
        done += 1
    if done:
        g.lint()
        gm.recompile()
    return done


def zeros_of_shape(gm: fx.GraphModule) -> int:
    """Rewrite ``torch.zeros_like(x)`` (no other argument) to ``torch.zeros(shape,
    dtype=..., device=...)`` where ``x`` is a dense contiguous tensor of static shape (the
    same values and layout, without reading ``x``); returns the number of rewrites."""
    g = gm.graph
    done = 0
    for n in list(g.nodes):
        if not (n.op == "call_function" and n.target is torch.zeros_like and len(n.args) == 1
                and not n.kwargs and isinstance(n.args[0], fx.Node)):
            continue
        xv = _val(n.args[0])
        if not (isinstance(xv, torch.Tensor) and xv.layout == torch.strided
                and _static(xv.shape) and xv.is_contiguous() and not xv.is_complex()
                and type(xv).__name__ in ("FakeTensor", "Tensor")):
            continue
        if substitute(gm, n, torch.zeros, (tuple(xv.shape),),
                      {"dtype": xv.dtype, "device": xv.device}, [n]):
            done += 1
    if done:
        g.lint()
        gm.recompile()
    return done


def sum_to_size_as_sum(gm: fx.GraphModule) -> int:
    """Rewrite ``d.sum_to_size(shape)`` of static shapes to ``torch.sum(d, dims)`` where
    only leading dimensions are summed away, or ``torch.sum(d, dims, keepdim=True)`` where
    only size-1 dimensions are kept (``sum_to_size`` calls that kernel with
    ``keepdim=True`` and views the result: the same values); returns the number of
    rewrites."""
    g = gm.graph
    done = 0
    for n in list(g.nodes):
        if not (n.op == "call_method" and n.target == "sum_to_size" and len(n.args) == 2
                and not n.kwargs and isinstance(n.args[0], fx.Node)):
            continue
        d, target = n.args
        dv = _val(d)
        if isinstance(target, torch.Size):
            target = tuple(target)
        if not (isinstance(dv, torch.Tensor) and isinstance(target, (tuple, list))
                and _static(dv.shape) and _static(target) and len(target) <= dv.dim()):
            continue
        lead = dv.dim() - len(target)
        kept = tuple(lead + i for i, s in enumerate(target) if s == 1 and dv.shape[lead + i] != 1)
        if any(s != 1 and s != dv.shape[lead + i] for i, s in enumerate(target)):
            continue
        if lead and not kept:
            args, kwargs = (d, tuple(range(lead))), {}
        elif kept and not lead:
            args, kwargs = (d, kept), {"keepdim": True}
        else:
            continue  # nothing summed (a no-op the simplifier removes) or both kinds
        if substitute(gm, n, torch.sum, args, kwargs, [n]):
            done += 1
    if done:
        g.lint()
        gm.recompile()
    return done


def write_into(x: torch.Tensor, index: Any, value: Any) -> torch.Tensor:
    """``x[index] = value`` in place; returns ``x``.  The training code's
    :func:`fxad.ops.setitem` on a fresh tensor that nothing else reads
    (:func:`write_fresh_in_place`)."""
    x[index] = value
    return x


_ZEROS = (torch.zeros, torch.zeros_like)


def write_fresh_in_place(gm: fx.GraphModule) -> int:
    """Rewrite ``fxad_setitem(z, index, v)`` to ``write_into(z, index, v)`` where ``z`` is a
    fresh tensor (``torch.zeros``/``zeros_like``, or an op's new result:
    :func:`fxad.simplify.inplace.is_fresh`) read by nothing else, and ``v`` is not ``z``.
    The graph then mutates: run it, do not transform it again (as
    :func:`fxad.simplify.inplace.accumulate_in_place`).  Returns the number of rewrites."""
    g = gm.graph
    done = 0
    for n in list(g.nodes):
        if not (n.op == "call_function" and n.target is ops.setitem and len(n.args) == 3
                and not n.kwargs):
            continue
        z, index, v = n.args
        if not (isinstance(z, fx.Node) and len(z.users) == 1 and z is not v
                and ((z.op == "call_function" and z.target in _ZEROS) or is_fresh(z))
                and isinstance(_val(z), torch.Tensor)):
            continue
        n.target = write_into
        done += 1
    if done:
        g.lint()
        gm.recompile()
    return done


_RESHAPES = (torch.reshape,)
_RESHAPE_METHODS = ("reshape", "view")


def _reshape_of_fresh(n: Any) -> bool:
    """``n`` is ``reshape``/``view`` of a fresh tensor (:func:`is_fresh`) that nothing else
    reads: writing into ``n`` changes no other value."""
    if not (isinstance(n, fx.Node) and len(n.users) == 1 and n.args
            and ((n.op == "call_function" and n.target in _RESHAPES)
                 or (n.op == "call_method" and n.target in _RESHAPE_METHODS))):
        return False
    src = n.args[0]
    return isinstance(src, fx.Node) and len(src.users) == 1 and is_fresh(src)


def accumulate_into_reshaped(gm: fx.GraphModule) -> int:
    """Rewrite ``c = a + r`` to ``c = r.add_(a)`` where ``r`` is a reshape of a fresh tensor,
    both read by nothing else (:func:`_reshape_of_fresh`: a linear layer's input cotangent
    ``reshape(mm(d, W), shape)``), with ``c``'s shape, dtype, device and strides: what
    :func:`fxad.simplify.inplace.accumulate_in_place` does for a fresh operand, one
    activation-sized allocation fewer (autograd's engine accumulates such sums in place).
    The graph then mutates (run it, do not transform it again).  Returns the number of
    rewrites."""
    g = gm.graph
    done = 0
    for n in list(g.nodes):
        if not (n.op == "call_function" and n.target in _ADDS and len(n.args) == 2
                and not n.kwargs):
            continue
        out = _val(n)
        for acc, other in ((n.args[0], n.args[1]), (n.args[1], n.args[0])):
            av = _val(acc)
            if acc is other or not _reshape_of_fresh(acc) or not isinstance(out, torch.Tensor) \
                    or not isinstance(av, torch.Tensor):
                continue
            if not (_static(av.shape) and tuple(av.shape) == tuple(out.shape)
                    and av.dtype == out.dtype and av.device == out.device
                    and av.stride() == out.stride()):
                continue
            n.op, n.target, n.args = "call_method", "add_", (acc, other)
            done += 1
            break
    if done:
        g.lint()
        gm.recompile()
    return done


def _torch_default_overload(target: Any) -> Any:
    """The ATen ``default`` overload of a torch builtin function of the same name
    (``torch.native_batch_norm`` -> ``aten.native_batch_norm.default``), or None; None for
    the ``unsafe_`` ops (``unsafe_chunk``: views whose schema declares no alias)."""
    name = getattr(target, "__name__", "")
    if not (callable(target) and type(target).__name__ == "builtin_function_or_method"
            and getattr(torch, name, None) is target) or name.startswith("unsafe"):
        return None
    packet = getattr(torch.ops.aten, target.__name__, None)
    return getattr(packet, "default", None) if packet is not None else None


def fresh_result(n: Any) -> bool:
    """``n``'s tensor is newly allocated by its op (:func:`fxad.simplify.inplace.is_fresh`),
    also for one result of a torch builtin whose ATen ``default`` overload returns no alias
    of an input (``batch_norm, save_mean, save_invstd = torch.native_batch_norm(...)``)."""
    if not isinstance(n, fx.Node):
        return False
    if is_fresh(n):
        return True
    if n.op == "call_function" and n.target is operator.getitem and n.args \
            and isinstance(n.args[0], fx.Node) and n.args[0].op == "call_function":
        src = n.args[0]
        ov = _torch_default_overload(src.target)
        if isinstance(ov, torch._ops.OpOverload) and not ov._schema.is_mutable \
                and all(r.alias_info is None for r in ov._schema.returns) \
                and isinstance(src.meta.get("val"), (tuple, list)):
            return True
    return False


_IN_PLACE_ACTIVATIONS = {torch.relu: torch.relu_, F.relu: torch.relu_,
                         torch.sigmoid: torch.sigmoid_, torch.tanh: torch.tanh_}


def activations_in_place(gm: fx.GraphModule) -> int:
    """Rewrite ``y = torch.relu(x)`` (also ``F.relu`` without ``inplace``,
    ``torch.sigmoid``, ``torch.tanh``) to ``y = torch.relu_(x)`` where ``x`` is a fresh tensor
    (:func:`fresh_result`, not an input of the graph) that nothing else reads, of ``y``'s
    shape, dtype and strides: the same values written into ``x``'s memory, as eager's
    ``nn.ReLU(inplace=True)``.  The graph then mutates (run it, do not transform it again).
    Returns the number of rewrites."""
    g = gm.graph
    done = 0
    for n in list(g.nodes):
        if not (n.op == "call_function" and n.target in _IN_PLACE_ACTIVATIONS
                and len(n.args) == 1 and not n.kwargs):
            continue
        x = n.args[0]
        xv, out = _val(x), _val(n)
        if not (isinstance(x, fx.Node) and len(x.users) == 1 and fresh_result(x)
                and not x.meta.get("fxad_side_effect")
                and isinstance(xv, torch.Tensor) and isinstance(out, torch.Tensor)
                and xv.dtype == out.dtype and tuple(xv.shape) == tuple(out.shape)
                and xv.stride() == out.stride()):
            continue
        n.target = _IN_PLACE_ACTIVATIONS[n.target]
        done += 1
    if done:
        g.lint()
        gm.recompile()
    return done


code_builtin("fxad_write_into", write_into)
