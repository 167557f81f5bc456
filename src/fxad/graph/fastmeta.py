"""Output metadata of common ops on symbolic sizes, written as functions of the input sizes.

A build on symbolic sizes (``dynamic=True``) learns each op's result by running it on fake
tensors whose sizes are ``SymInt``\\ s.  For some ops PyTorch has no symbolic meta kernel and
runs a Python decomposition instead, a dozen fake ops each building sympy expressions:
``F.layer_norm`` costs 10-25 ms a call, ``F.linear`` on a 3-d input 10-20 ms,
``F.cross_entropy`` about 100 ms, against 0.5-1 ms to create one fake tensor of the same
sizes.  For those ops this module states the result directly: its sizes (from the input
sizes), dtype, device and strides (contiguous for a computed result; for a view op, a view
sharing the input's storage with the strides and offset PyTorch gives it).

Every function applies only where its result is certain without a new guard on a size: the
sizes it must compare are equal for every value of the symbols
(:func:`fxad.graph.sizes.known_equal`), the dtypes
agree, no autocast is active, and the input layouts are the ones for which PyTorch's result
is contiguous.  Anything else returns ``NotImplemented`` and the caller runs the op through
PyTorch as before, which then raises the op's own error or records its guards.  A function
is used only when some tensor argument has a symbolic size: on static sizes PyTorch's
fake-tensor cache answers these ops in about 0.1 ms.

``tests/test_fastmeta.py`` compares every function with PyTorch's fake result (sizes,
strides, dtype, device) on static and symbolic samples.

Formulas (sizes only; PyTorch's meta kernels / ``torch._decomp`` give the same):

* ``linear(x (..., k), w (n, k), b (n,) | None)`` → ``(..., n)``
* ``layer_norm(x (..., *S), S, w S | None, b S | None)`` → like ``x``;
  ``native_layer_norm`` → ``(y, mean, rstd)``, ``mean``/``rstd`` ``(..., 1, ..., 1)``
  (one 1 per normalized dimension); ``native_layer_norm_backward`` → ``(d_x like x, d_w like
  w, d_b like b)``, each ``None`` where its output mask is False
* ``embedding(idx (...), w (V, D))`` → ``(..., D)``
* ``gelu(x)``, ``gelu_backward(d, x)`` → like ``x`` (contiguous ``x``)
* ``cross_entropy(x (N, C), t (N,) int64)`` with ``reduction`` ``mean``/``sum`` → ``()``
  (``N`` of both checked equal with ``torch._check``, as PyTorch's kernel checks it)
* ``add``/``sub``/``mul`` of two contiguous floating tensors of the same sizes, or of one and
  a Python number → like the first
* ``sum(x, dims, keepdim)`` over explicit dimensions → the reduced sizes
* ``matmul(a (..., m, k), b (k, n))`` and ``mm``/2-d ``matmul`` → ``(..., m, n)``
* ``t``/``transpose``: the sizes and strides swapped; ``unsqueeze``: a size-1 dimension;
  ``split`` of an integer-sized dimension into integer pieces: views at their offsets
* ``reshape``/``view`` to sizes that split or merge runs of dimensions lying contiguously in
  memory (one ``-1`` inferred where the quotient is exact as written) → a view's sizes and
  strides
"""
from __future__ import annotations

import operator
from typing import Any, Callable

import sympy
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor, in_kernel_invocation_manager
from torch.utils._python_dispatch import _disable_current_modes

from .sizes import known_equal as same

__all__ = ["fast_meta", "FAST_META", "symbolic_tensor", "fake_like"]

Result = Any


def _is_sym(s: Any) -> bool:
    return type(s) is torch.SymInt


def symbolic_tensor(t: Any) -> bool:
    """Whether ``t`` is a tensor with a ``SymInt`` size."""
    return isinstance(t, torch.Tensor) and any(type(s) is torch.SymInt for s in t.shape)


def _expr(s: Any) -> Any:
    return s.node.expr if type(s) is torch.SymInt else s


def _same_shape(a: Any, b: Any) -> bool:
    return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))


def _contiguous_strides(shape: Any) -> list:
    out, acc = [], 1
    for s in reversed(tuple(shape)):
        out.append(acc)
        acc = acc * s
    return out[::-1]


def _is_contiguous(t: torch.Tensor) -> bool:
    """The strides are the contiguous ones for every value of the symbols (sizes of 1 ignored)."""
    acc: Any = 1
    for s, st in zip(reversed(tuple(t.shape)), reversed(tuple(t.stride()))):
        if not (not _is_sym(s) and s == 1) and not same(st, acc):
            return False
        acc = acc * s
    return True


def _numel_expr(shape: Any) -> Any:
    return sympy.Mul(*[_expr(s) for s in shape])


def _new(like: torch.Tensor, shape: Any, dtype: torch.dtype | None = None) -> torch.Tensor:
    shape = tuple(shape)
    return _empty_strided(like, shape, _contiguous_strides(shape), dtype)


def _empty_strided(like: torch.Tensor, shape: tuple, strides: Any,
                   dtype: torch.dtype | None = None) -> torch.Tensor:
    """A fake tensor of ``like``'s fake mode and device: made as a meta tensor and wrapped,
    a third of the cost of a fake ``empty_strided`` (which hashes its arguments for
    PyTorch's fake-tensor cache)."""
    dtype = like.dtype if dtype is None else dtype
    mode = getattr(like, "fake_mode", None)
    if mode is None or not isinstance(like, FakeTensor):
        return like.new_empty_strided(shape, tuple(strides), dtype=dtype)
    with _disable_current_modes():
        meta = torch.empty_strided(shape, tuple(strides), dtype=dtype, device="meta")
    return FakeTensor(mode, meta, like.device)


def _view(t: torch.Tensor, shape: tuple, strides: Any, offset: Any = None) -> torch.Tensor:
    """A view of ``t`` (sharing its storage, at ``offset``, by default ``t``'s) of
    ``shape``/``strides``: PyTorch's meta kernel of ``as_strided`` run directly on the fake
    tensor's meta data, as the fake mode itself runs kernels, without the fake mode's
    bookkeeping around it."""
    mode = getattr(t, "fake_mode", None)
    offset = t.storage_offset() if offset is None else offset
    if mode is None or not isinstance(t, FakeTensor):
        return t.as_strided(shape, tuple(strides), offset)
    with in_kernel_invocation_manager(mode), torch.no_grad():
        out = torch.ops.aten.as_strided.default(t, list(shape), list(strides), offset)
    return FakeTensor(mode, out, t.device)


def fake_like(t: Any) -> torch.Tensor | None:
    """A new fake tensor with ``t``'s sizes, strides, dtype and device, sharing nothing with
    it (what ``t.detach()`` gives a node's metadata, at a third of the cost on symbolic
    sizes); None where that would not be exact or not cheaper: not a fake tensor with a
    symbolic size, a tensor at a storage offset, or one whose value PyTorch tracks as a
    constant."""
    if type(t) is not FakeTensor or t.layout != torch.strided or t.constant is not None \
            or not symbolic_tensor(t):
        return None
    offset = t.storage_offset()
    if _is_sym(offset) or offset != 0:
        return None
    return _empty_strided(t, tuple(t.shape), t.stride())


def _floating(*ts: Any) -> bool:
    return all(t is None or (isinstance(t, torch.Tensor) and t.dtype in
                             (torch.float32, torch.float64)) for t in ts)


def _same_place(a: torch.Tensor, *ts: Any) -> bool:
    return all(t is None or (t.dtype == a.dtype and t.device == a.device
                             and t.layout == torch.strided) for t in ts)


# -- the functions ------------------------------------------------------------------------------

def _linear(input: Any, weight: Any, bias: Any = None) -> Result:
    if not (isinstance(input, torch.Tensor) and isinstance(weight, torch.Tensor)
            and (bias is None or isinstance(bias, torch.Tensor))):
        return NotImplemented
    if input.dim() < 1 or weight.dim() != 2 or not _floating(input, weight, bias) \
            or not _same_place(input, weight, bias):
        return NotImplemented
    if not same(input.shape[-1], weight.shape[1]):
        return NotImplemented
    if bias is not None and not (bias.dim() == 1 and same(bias.shape[0], weight.shape[0])):
        return NotImplemented
    return _new(input, (*input.shape[:-1], weight.shape[0]))


def _norm_ok(input: Any, normalized_shape: Any, weight: Any, bias: Any) -> bool:
    if not isinstance(input, torch.Tensor) or not _floating(input, weight, bias) \
            or not _same_place(input, weight, bias):
        return False
    shape = tuple(normalized_shape) if isinstance(normalized_shape, (list, tuple, torch.Size)) \
        else (normalized_shape,)
    k = len(shape)
    if k == 0 or input.dim() < k or not _same_shape(input.shape[input.dim() - k:], shape):
        return False
    return all(t is None or _same_shape(t.shape, shape) for t in (weight, bias))


def _layer_norm(input: Any, normalized_shape: Any, weight: Any = None, bias: Any = None,
                eps: float = 1e-5) -> Result:
    if not _norm_ok(input, normalized_shape, weight, bias):
        return NotImplemented
    return _new(input, input.shape)


def _native_layer_norm(input: Any, normalized_shape: Any, weight: Any, bias: Any,
                       eps: float) -> Result:
    if not _norm_ok(input, normalized_shape, weight, bias):
        return NotImplemented
    k = len(tuple(normalized_shape))
    stat = (*input.shape[:input.dim() - k], *([1] * k))
    return _new(input, input.shape), _new(input, stat), _new(input, stat)


def _native_layer_norm_backward(grad_out: Any, input: Any, normalized_shape: Any, mean: Any,
                                rstd: Any, weight: Any, bias: Any, output_mask: Any) -> Result:
    if not _norm_ok(input, normalized_shape, weight, bias) \
            or not isinstance(grad_out, torch.Tensor) \
            or not _same_shape(grad_out.shape, input.shape) \
            or not _same_place(input, grad_out, mean, rstd):
        return NotImplemented
    mask = list(output_mask)
    return (_new(input, input.shape) if mask[0] else None,
            _new(weight, weight.shape) if mask[1] and weight is not None else None,
            _new(bias, bias.shape) if mask[2] and bias is not None else None)


def _embedding(input: Any, weight: Any, padding_idx: Any = None, max_norm: Any = None,
               norm_type: float = 2.0, scale_grad_by_freq: bool = False,
               sparse: bool = False) -> Result:
    if max_norm is not None or sparse or not isinstance(input, torch.Tensor) \
            or not isinstance(weight, torch.Tensor) or weight.dim() != 2 \
            or input.dtype not in (torch.int64, torch.int32) or not _floating(weight) \
            or input.device != weight.device:
        return NotImplemented
    return _new(weight, (*input.shape, weight.shape[1]))


def _gelu(input: Any, approximate: str = "none") -> Result:
    if not isinstance(input, torch.Tensor) or not _floating(input) or not _is_contiguous(input):
        return NotImplemented
    return _new(input, input.shape)


def _gelu_backward(grad_output: Any, self: Any, approximate: str = "none") -> Result:
    if not (isinstance(grad_output, torch.Tensor) and isinstance(self, torch.Tensor)) \
            or not _floating(self) or not _same_place(self, grad_output) \
            or not _same_shape(grad_output.shape, self.shape) \
            or not (_is_contiguous(self) and _is_contiguous(grad_output)):
        return NotImplemented
    return _new(self, self.shape)


def _matmul(input: Any, other: Any) -> Result:
    if not (isinstance(input, torch.Tensor) and isinstance(other, torch.Tensor)) \
            or not _floating(input, other) or not _same_place(input, other) \
            or other.dim() != 2 or input.dim() < 2 \
            or not same(input.shape[-1], other.shape[0]):
        return NotImplemented
    if input.dim() > 2 and not _is_contiguous(input):
        return NotImplemented
    return _new(input, (*input.shape[:-1], other.shape[1]))


def _swapped(t: Any, d0: int, d1: int) -> Result:
    if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
        return NotImplemented
    n = t.dim()
    if n == 0:
        return NotImplemented
    if not (-n <= d0 < n and -n <= d1 < n):
        return NotImplemented
    d0, d1 = d0 % n, d1 % n
    size, stride = list(t.shape), list(t.stride())
    size[d0], size[d1] = size[d1], size[d0]
    stride[d0], stride[d1] = stride[d1], stride[d0]
    return _view(t, tuple(size), stride)


def _transpose(input: Any, dim0: int, dim1: int) -> Result:
    if not (isinstance(dim0, int) and isinstance(dim1, int)):
        return NotImplemented
    return _swapped(input, dim0, dim1)


def _t(input: Any) -> Result:
    if not isinstance(input, torch.Tensor) or input.dim() != 2:
        return NotImplemented
    return _swapped(input, 0, 1)


def _unsqueeze(input: Any, dim: int) -> Result:
    """A size-1 dimension inserted at ``dim``: stride ``stride[dim] * size[dim]`` (1 at the
    end), as PyTorch's ``unsqueeze``."""
    if not isinstance(input, torch.Tensor) or input.layout != torch.strided \
            or not isinstance(dim, int) or not -input.dim() - 1 <= dim <= input.dim():
        return NotImplemented
    d = dim % (input.dim() + 1)
    size, stride = list(input.shape), list(input.stride())
    new_stride = stride[d] * size[d] if d < input.dim() else 1
    return _view(input, (*size[:d], 1, *size[d:]), (*stride[:d], new_stride, *stride[d:]))


def _split(tensor: Any, split_size_or_sections: Any, dim: int = 0) -> Result:
    """``split`` into pieces of an integer size along a dimension of integer size: views at
    offsets ``i * size * stride[dim]``."""
    size = split_size_or_sections
    if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.strided \
            or type(size) is not int or size <= 0 or not isinstance(dim, int) \
            or not -tensor.dim() <= dim < tensor.dim():
        return NotImplemented
    d = dim % tensor.dim()
    n = tensor.shape[d]
    if _is_sym(n) or n == 0:
        return NotImplemented
    shape, stride = list(tensor.shape), list(tensor.stride())
    base, out = tensor.storage_offset(), []
    for start in range(0, n, size):
        shape[d] = min(size, n - start)
        out.append(_view(tensor, tuple(shape), stride, base + start * stride[d]))
    return tuple(out)


def _inferred(shape: tuple, numel: Any) -> tuple | None:
    """``shape`` with its one ``-1`` replaced by ``numel / (product of the others)`` when
    that quotient is exact as written (``s0*s1*64 / (s0*4)`` is ``16*s1``); None otherwise."""
    holes = [i for i, s in enumerate(shape) if not _is_sym(s) and s == -1]
    if not holes:
        return shape
    if len(holes) > 1:
        return None
    others = [s for i, s in enumerate(shape) if i != holes[0]]
    if any(not _is_sym(s) and s <= 0 for s in others):
        return None
    syms = [s for s in (*others, numel) if _is_sym(s)]
    if not syms:
        known = 1
        for s in others:
            known *= s
        if numel % known:
            return None
        size: Any = numel // known
    else:
        q = _expr(numel) / _numel_expr(others)
        if sympy.fraction(q)[1] != 1:
            return None
        env = syms[0].node.shape_env
        values = getattr(env, "backed_var_to_val", None)
        hint = q.xreplace(env.var_to_val if values is None else values)
        if not hint.is_Integer:
            return None
        size = int(q) if q.is_Integer else env.create_symintnode(q, hint=int(hint))
    return (*shape[:holes[0]], size, *shape[holes[0] + 1:])


def view_strides(sizes: tuple, strides: tuple, shape: tuple) -> list | None:
    """The strides of ``x.view(shape)`` for ``x`` of ``sizes``/``strides``, by PyTorch's
    rule (``computeStride`` in ATen's TensorUtils.cpp: the new dimensions must split or merge
    runs of dimensions that lie contiguously in memory), with sizes compared without a
    guard; None where that is not certain (PyTorch's own path then decides, with its guards)."""
    out: list = [0] * len(shape)
    view_d = len(shape) - 1
    base = strides[-1] if strides else 1
    t_numel: Any = 1
    v_numel: Any = 1
    for d in range(len(sizes) - 1, -1, -1):
        t_numel = t_numel * sizes[d]
        boundary = d == 0 or (not (not _is_sym(sizes[d - 1]) and sizes[d - 1] == 1)
                              and not same(strides[d - 1], t_numel * base))
        if not boundary:
            continue
        while view_d >= 0 and (not same(v_numel, t_numel)
                               or (not _is_sym(shape[view_d]) and shape[view_d] == 1)):
            out[view_d] = v_numel * base
            v_numel = v_numel * shape[view_d]
            view_d -= 1
        if not same(v_numel, t_numel):
            return None
        if d > 0:
            base = strides[d - 1]
            t_numel = v_numel = 1
    if view_d != -1:
        return None
    return out


def _reshape(input: Any, *shape: Any) -> Result:
    if len(shape) == 1 and isinstance(shape[0], (list, tuple, torch.Size)):
        shape = tuple(shape[0])
    if not isinstance(input, torch.Tensor) or input.layout != torch.strided or input.dim() == 0 \
            or not shape or not all(isinstance(s, (int, torch.SymInt)) for s in shape) \
            or any(not _is_sym(s) and s < -1 for s in shape):
        return NotImplemented
    if _same_shape(shape, input.shape):
        return _view(input, tuple(input.shape), input.stride())
    shape = _inferred(tuple(shape), input.numel())
    if shape is None:
        return NotImplemented
    strides = view_strides(tuple(input.shape), tuple(input.stride()), shape)
    if strides is None:
        return NotImplemented
    return _view(input, tuple(shape), strides)


def _pointwise(input: Any, other: Any, *, alpha: Any = 1) -> Result:
    """``input (op) other`` for two floating tensors of the same sizes, dtype and contiguous
    layout, or a floating tensor and a Python number: like ``input``."""
    if not isinstance(input, torch.Tensor) or not _floating(input) \
            or not _is_contiguous(input) or isinstance(alpha, torch.Tensor):
        return NotImplemented
    if isinstance(other, torch.Tensor):
        if not (_same_place(input, other) and _same_shape(input.shape, other.shape)
                and _is_contiguous(other)):
            return NotImplemented
    elif type(other) not in (int, float):
        return NotImplemented
    return _new(input, input.shape)


def _sum(input: Any, dim: Any = None, keepdim: bool = False, *, dtype: Any = None) -> Result:
    """``input.sum(dim, keepdim)`` of a floating tensor over explicit integer dimensions."""
    if not isinstance(input, torch.Tensor) or not _floating(input) or dtype is not None:
        return NotImplemented
    dims = (dim,) if isinstance(dim, int) else dim
    if not isinstance(dims, (list, tuple)) or not dims \
            or not all(isinstance(d, int) and -input.dim() <= d < input.dim() for d in dims):
        return NotImplemented
    n = input.dim()
    picked = {d % n for d in dims}
    if len(picked) != len(dims):
        return NotImplemented
    shape = [1 if i in picked else s for i, s in enumerate(input.shape)] if keepdim \
        else [s for i, s in enumerate(input.shape) if i not in picked]
    return _new(input, shape)


def _cross_entropy(input: Any, target: Any, weight: Any = None, size_average: Any = None,
                   ignore_index: int = -100, reduce: Any = None, reduction: str = "mean",
                   label_smoothing: float = 0.0) -> Result:
    """Class-index targets of ``(N, C)`` scores, reduced: a 0-d result.  The batch sizes of
    scores and targets are checked equal as PyTorch's kernel does (``torch._check``: a guard
    that ties them where they are different symbols)."""
    if weight is not None or size_average is not None or reduce is not None \
            or reduction not in ("mean", "sum") \
            or not (isinstance(input, torch.Tensor) and isinstance(target, torch.Tensor)) \
            or input.dim() != 2 or target.dim() != 1 or target.dtype != torch.int64 \
            or not _floating(input) or input.device != target.device:
        return NotImplemented
    n, m = input.shape[0], target.shape[0]
    if not same(n, m):
        if not (_is_sym(n) and _is_sym(m)) or n.node.hint != m.node.hint:
            return NotImplemented  # (PyTorch's own path raises its error)
        torch._check(n == m, lambda: f"Expected input batch_size ({n}) to match target "
                                     f"batch_size ({m}).")
    return _new(input, ())


FAST_META: dict[Any, Callable[..., Result]] = {
    F.linear: _linear,
    F.layer_norm: _layer_norm,
    torch.native_layer_norm: _native_layer_norm,
    torch.ops.aten.native_layer_norm_backward: _native_layer_norm_backward,
    torch.ops.aten.native_layer_norm_backward.default: _native_layer_norm_backward,
    F.embedding: _embedding,
    F.gelu: _gelu,
    torch.ops.aten.gelu_backward: _gelu_backward,
    torch.ops.aten.gelu_backward.default: _gelu_backward,
    F.cross_entropy: _cross_entropy,
    torch.matmul: _matmul,
    torch.mm: _matmul,
    operator.matmul: _matmul,
    torch.transpose: _transpose,
    torch.t: _t,
    torch.reshape: _reshape,
    torch.add: _pointwise,
    torch.sub: _pointwise,
    torch.mul: _pointwise,
    operator.add: _pointwise,
    operator.sub: _pointwise,
    operator.mul: _pointwise,
    ("method", "add"): _pointwise,
    ("method", "sub"): _pointwise,
    ("method", "mul"): _pointwise,
    ("method", "sum"): _sum,
    torch.sum: _sum,
    ("method", "transpose"): _transpose,
    ("method", "t"): _t,
    ("method", "reshape"): _reshape,
    ("method", "view"): _reshape,
    ("method", "matmul"): _matmul,
    torch.Tensor.transpose: _transpose,
    torch.Tensor.t: _t,
    torch.Tensor.reshape: _reshape,
    torch.Tensor.view: _reshape,
    torch.unsqueeze: _unsqueeze,
    ("method", "unsqueeze"): _unsqueeze,
    torch.Tensor.unsqueeze: _unsqueeze,
    torch.split: _split,
    ("method", "split"): _split,
    torch.Tensor.split: _split,
}

def fast_meta(key: Any, args: tuple, kwargs: dict, *, history: bool = False) -> Result:
    """The output metadata of ``key(*args, **kwargs)`` (``key``: a function, or
    ``("method", name)`` for a Tensor method) from :data:`FAST_META` when some tensor argument
    has a symbolic size and the function applies; else ``NotImplemented``.  The results of
    view ops share their input's storage, as PyTorch's do; ``history=True``
    gives the result the autograd history the op's own result would have (capture).  Runs
    under the fake mode of the arguments; raises nothing of its own (a failing check is
    ``NotImplemented``)."""
    try:
        fn = FAST_META.get(key)
    except TypeError:  # an unhashable target
        return NotImplemented
    if fn is None or _autocast():
        return NotImplemented
    if not any(symbolic_tensor(a) for a in args) \
            and not any(symbolic_tensor(a) for a in kwargs.values()):
        return NotImplemented
    try:
        with torch.no_grad():
            out = fn(*args, **kwargs)
    except TypeError:  # a call form the function does not take: PyTorch's path
        return NotImplemented
    if not history or out is NotImplemented or not torch.is_grad_enabled():
        return out
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    if not any(t.requires_grad for t in tensors):
        return out
    return _WithHistory.apply([out], *tensors)


def _autocast() -> bool:
    any_enabled = getattr(torch._C, "_is_any_autocast_enabled", None)
    if any_enabled is not None:
        return bool(any_enabled())
    return any(torch.is_autocast_enabled(d) for d in ("cpu", "cuda"))


class _WithHistory(torch.autograd.Function):
    """The result of a :data:`FAST_META` function as a non-leaf that requires grad, as the
    op's own result is when an input requires grad (capture's values answer
    ``requires_grad``/``is_leaf`` as real tensors do).  Never differentiated: fxad builds
    derivatives from its own rules."""

    @staticmethod
    def forward(ctx: Any, box: list, *tensors: Any) -> Any:
        return box[0]

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:  # pragma: no cover - never differentiated
        raise RuntimeError("fxad: metadata-only value differentiated by autograd")
