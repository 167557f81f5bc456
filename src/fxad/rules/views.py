"""Rules for shape ops: views, their ``*_copy`` forms, joins and splits, casts and copies.

* reshaping and permuting: ``reshape``, ``flatten``/``unflatten``/``ravel``, ``squeeze``/
  ``unsqueeze``, ``permute``, ``transpose``, ``t``, ``movedim``, ``expand``/``broadcast_to``/
  ``broadcast_tensors``, ``sum_to_size``, ``repeat``/``tile``/``repeat_interleave``, ``flip``/
  ``fliplr``/``flipud``, ``roll``, ``rot90``, ``atleast_{1,2,3}d``, ``Tensor.unfold``;
* selecting views: ``narrow``, ``select``, ``diagonal``/``diag``/``diag_embed``/``diagflat``,
  ``tril``/``triu``, ``as_strided``;
* joins and splits: ``cat``, ``stack``, ``hstack``/``vstack``/``dstack``/``column_stack``,
  ``split``/``chunk``/``unbind`` and their variants, ``block_diag``, ``meshgrid``,
  ``cartesian_prod``;
* casts and copies: ``Tensor.to``, ``contiguous``, ``clone``, ``x.float()``/``x.double()``/...,
  and the ops with a zero derivative (``detach``, ``zeros_like``, ``fill``, ...).

These are linear maps whose transpose is another shape op: reshape <-> reshape, permute <->
inverse permute, cat <-> split, stack <-> unbind, a selecting view <-> its ``*_scatter`` into
zeros (derivatives.yaml entries `view`, `permute`, `transpose.int`, `cat`, `stack`,
`split.Tensor`, `slice.Tensor`, `expand`, named in each rule).  A cast is the identity on
values: the cotangent is passed through and the engine casts it back to the input dtype
(derivatives.yaml ``_to_copy``: ``_to_copy_backward``); for a cast to a complex dtype the real
part is taken.

``as_strided(x, size, stride, storage_offset)`` reads the storage positions
``p(i) = storage_offset + sum_k i_k * stride_k``.  For an input that owns its whole storage
contiguously (checked while tracing; anything else is refused with a :class:`RuleError`),
storage position ``p`` is element ``p`` of ``x.reshape(-1)``, so

* VJP: ``d_x = zeros(numel).index_add(0, p, d)`` reshaped like ``x`` -- repeated positions
  (overlapping strides) accumulate (derivatives.yaml ``as_strided``: as_strided_backward);
* JVP: ``t_out = torch.take(t_x, p)`` (the same gather, independent of the tangent's layout).

Eager ``as_strided`` reads the memory layout of the tensor it is given, and the generated
code calls it on whatever tensor arrives, while the derivative above is written for the
layout seen at build time.  Called with an input laid out otherwise (a transposed or
permuted tensor, a view with a storage offset), the value would follow eager and the
derivative would not, so wherever the derivative needs it the code checks the layout with a
guard line (:func:`fxad.rules._base.expect_layout`, metadata only, no device
synchronization)::

    fxad_expect_layout(x, 'torch.as_strided', None, True, 'model.py:12 `y = x.as_strided(...)`')

that raises :class:`fxad.InputError` naming the user's line when the tensor is not dense in
the build-time order with storage offset 0.  The CPU flash-attention rules
(:mod:`fxad.rules.nn.attention`) use the same guard for the unit last-dimension stride their
kernels need.

``as_strided_scatter(x, src, size, stride, storage_offset)`` is ``x`` with the positions ``p``
overwritten by ``src``: ``d_x`` is ``d`` with the positions ``p`` zeroed and
``d_src = take(d, p)`` (derivatives.yaml ``as_strided_scatter``, ``src`` entry; with overlapping
positions every ``src`` element receives the cotangent of its position, autograd's convention).
PyTorch 2.13's own ``d_x`` is the complement (``d`` kept at ``p``, zero elsewhere; finite
differences side with the rule), so that rule is checked against finite differences.

Indexing (``x[i]``, ``gather``, ``scatter``, the ``*_scatter`` ops) is in
:mod:`fxad.rules.indexing`.
"""
from __future__ import annotations

from typing import Any

import torch

from ._base import guard_layout, randn, uniform, _error, _meta
from .registry import register_vjp


@register_vjp(torch.reshape)
class Reshape:
    """reshape(x, shape): d_x = reshape(d, x.shape) (derivatives.yaml `view`)."""

    def fwd(input, shape):
        return torch.reshape(input, shape), tuple(input.shape)

    def bwd(shape, d):
        return (torch.reshape(d, shape),)

    def jvp(primals, tangents):
        return torch.reshape(*primals), torch.reshape(tangents[0], primals[1])

    def samples(dtype):
        yield (randn(3, 4, dtype=dtype), (2, 6)), {}
        yield (randn(3, 4, dtype=dtype), (-1,)), {}


@register_vjp(torch.flatten)
class Flatten:
    """flatten(x, start, end): d_x = reshape(d, x.shape) (derivatives.yaml `view`)."""

    def fwd(input, start_dim=0, end_dim=-1):
        return torch.flatten(input, start_dim, end_dim), tuple(input.shape)

    def bwd(shape, d):
        return (torch.reshape(d, shape),)

    def jvp(primals, tangents):
        return torch.flatten(*primals), torch.flatten(tangents[0], *primals[1:])

    def samples(dtype):
        yield (randn(2, 3, 4, dtype=dtype),), {}
        yield (randn(2, 3, 4, dtype=dtype), 1), {}


@register_vjp(torch.squeeze)
class Squeeze:
    """squeeze(x, dim): d_x = reshape(d, x.shape) (derivatives.yaml `squeeze.dim`)."""

    def fwd(input, dim=None):
        out = torch.squeeze(input) if dim is None else torch.squeeze(input, dim)
        return out, tuple(input.shape)

    def bwd(shape, d):
        return (torch.reshape(d, shape),)

    def jvp(primals, tangents):
        (x, dim), t = primals, tangents[0]
        if dim is None:
            return torch.squeeze(x), torch.squeeze(t)
        return torch.squeeze(x, dim), torch.squeeze(t, dim)

    def samples(dtype):
        yield (randn(3, 1, 4, 1, dtype=dtype),), {}
        yield (randn(3, 1, 4, dtype=dtype), 1), {}


@register_vjp(torch.unsqueeze)
class Unsqueeze:
    """unsqueeze(x, dim): d_x = squeeze(d, dim) (derivatives.yaml `unsqueeze`)."""

    def fwd(input, dim):
        return torch.unsqueeze(input, dim), dim

    def bwd(dim, d):
        return (torch.squeeze(d, dim),)

    def jvp(primals, tangents):
        return torch.unsqueeze(*primals), torch.unsqueeze(tangents[0], primals[1])

    def samples(dtype):
        yield (randn(3, 4, dtype=dtype), 1), {}
        yield (randn(3, 4, dtype=dtype), -1), {}


@register_vjp(torch.permute)
class Permute:
    """permute(x, dims): d_x = permute(d, inverse(dims)) (derivatives.yaml `permute`)."""

    def fwd(input, dims):
        return torch.permute(input, dims), (input.dim(), dims)

    def bwd(aux, d):
        n, dims = aux
        inverse = [0] * n
        for i, p in enumerate(dims):
            inverse[p % n] = i
        return (torch.permute(d, tuple(inverse)),)

    def jvp(primals, tangents):
        return torch.permute(*primals), torch.permute(tangents[0], primals[1])

    def samples(dtype):
        yield (randn(2, 3, 4, dtype=dtype), (2, 0, 1)), {}


@register_vjp(torch.transpose)
class Transpose:
    """transpose(x, a, b): d_x = transpose(d, a, b) (derivatives.yaml `transpose.int`)."""

    def fwd(input, dim0, dim1):
        return torch.transpose(input, dim0, dim1), (dim0, dim1)

    def bwd(aux, d):
        return (torch.transpose(d, *aux),)

    def jvp(primals, tangents):
        return torch.transpose(*primals), torch.transpose(tangents[0], *primals[1:])

    def samples(dtype):
        yield (randn(2, 3, 4, dtype=dtype), 0, 2), {}


@register_vjp(torch.t)
class T:
    """t(x): d_x = t(d) (derivatives.yaml `t`)."""

    def fwd(input):
        return torch.t(input), None

    def bwd(aux, d):
        return (torch.t(d),)

    def jvp(primals, tangents):
        return torch.t(primals[0]), torch.t(tangents[0])

    def samples(dtype):
        yield (randn(3, 4, dtype=dtype),), {}


@register_vjp(torch.Tensor.expand)
class Expand:
    """x.expand(shape): d_x = d summed over the expanded dims (done by the engine;
    derivatives.yaml `expand`: at::sum_to)."""

    def fwd(self, *sizes):
        return self.expand(*sizes), None

    def bwd(aux, d):
        return (d,)

    def jvp(primals, tangents):
        return primals[0].expand(*primals[1:]), tangents[0].expand(*primals[1:])

    def samples(dtype):
        yield (randn(3, 1, dtype=dtype), (2, 3, 4)), {}


@register_vjp(torch.Tensor.sum_to_size)
class SumToSize:
    """x.sum_to_size(shape): d_x = d expanded back to x.shape (done by the engine)."""

    def fwd(self, *size):
        return self.sum_to_size(*size), None

    def bwd(aux, d):
        return (d,)

    def jvp(primals, tangents):
        return primals[0].sum_to_size(*primals[1:]), tangents[0].sum_to_size(*primals[1:])

    def samples(dtype):
        yield (randn(2, 3, 4, dtype=dtype), (3, 1)), {}


@register_vjp(torch.Tensor.repeat)
class Repeat:
    """x.repeat(reps): d_x = d folded into (rep, size) pairs and summed over the reps
    (derivatives.yaml `repeat`: repeat_backward)."""

    def fwd(self, *sizes):
        reps = tuple(sizes[0]) if len(sizes) == 1 and isinstance(sizes[0], (tuple, list)) \
            else tuple(sizes)
        return self.repeat(reps), (tuple(self.shape), reps)

    def bwd(aux, d):
        shape, reps = aux
        padded = (1,) * (len(reps) - len(shape)) + shape
        folded: list[int] = []
        for r, s in zip(reps, padded):
            folded += [r, s]
        d = torch.reshape(d, tuple(folded)).sum(tuple(range(0, 2 * len(reps), 2)))
        return (torch.reshape(d, shape),)

    def jvp(primals, tangents):
        x, *sizes = primals
        reps = tuple(sizes[0]) if len(sizes) == 1 and isinstance(sizes[0], (tuple, list)) \
            else tuple(sizes)
        return x.repeat(reps), tangents[0].repeat(reps)

    def samples(dtype):
        yield (randn(2, 3, dtype=dtype), (2, 1, 2)), {}


@register_vjp(torch.flip)
class Flip:
    """flip(x, dims): d_x = flip(d, dims) (derivatives.yaml `flip`)."""

    def fwd(input, dims):
        return torch.flip(input, dims), dims

    def bwd(dims, d):
        return (torch.flip(d, dims),)

    def jvp(primals, tangents):
        return torch.flip(*primals), torch.flip(tangents[0], primals[1])

    def samples(dtype):
        yield (randn(3, 4, dtype=dtype), (0, 1)), {}


@register_vjp(torch.movedim)
class Movedim:
    """movedim(x, src, dst): d_x = movedim(d, dst, src) (derivatives.yaml `movedim`)."""

    def fwd(input, source, destination):
        return torch.movedim(input, source, destination), (source, destination)

    def bwd(aux, d):
        return (torch.movedim(d, aux[1], aux[0]),)

    def jvp(primals, tangents):
        return torch.movedim(*primals), torch.movedim(tangents[0], *primals[1:])

    def samples(dtype):
        yield (randn(2, 3, 4, dtype=dtype), 0, -1), {}


def _triangular(op: Any) -> type:

    class Triangular:
        source = (f"{op.__name__}(x, k): the same mask applied to d (derivatives.yaml "
                  f"`{op.__name__}`)")

        def fwd(input, diagonal=0):
            return op(input, diagonal), diagonal

        def bwd(diagonal, d):
            return (op(d, diagonal),)

        def jvp(primals, tangents):
            return op(*primals), op(tangents[0], primals[1])

        def samples(dtype):
            yield (randn(4, 4, dtype=dtype),), {}
            yield (randn(2, 3, 4, dtype=dtype), 1), {}

    return Triangular


register_vjp(torch.tril)(_triangular(torch.tril))
register_vjp(torch.triu)(_triangular(torch.triu))


@register_vjp(torch.cat)
@register_vjp(torch.concat)
@register_vjp(torch.concatenate)
class Cat:
    """cat(xs, dim): d_xs = split(d, sizes, dim) (derivatives.yaml `cat`).  A legacy empty
    1-D operand (``torch.tensor([])`` beside tensors of more dimensions, as transformers'
    KV cache starts) is skipped by ``torch.cat`` and gets no cotangent."""

    def fwd(tensors, dim=0):
        out = torch.cat(tensors, dim)
        nd = len(out.shape)
        dim = dim % nd if nd else 0
        sizes = [None if nd != 1 and t.dim() == 1 and t.shape[0] == 0 else t.shape[dim]
                 for t in tensors]
        return out, (sizes, dim)

    def bwd(aux, d):
        sizes, dim = aux
        parts = iter(torch.split(d, [s for s in sizes if s is not None], dim))
        return ([None if s is None else next(parts) for s in sizes],)

    def jvp(primals, tangents):
        (xs, dim), ts = primals, tangents[0]
        return torch.cat(xs, dim), torch.cat(_filled(xs, ts), dim)

    def samples(dtype):
        yield ([randn(2, 3, dtype=dtype), randn(4, 3, dtype=dtype)],), {}
        yield ([randn(2, 3, dtype=dtype), randn(2, 1, dtype=dtype)], 1), {}
        yield ([torch.tensor([], dtype=dtype), randn(2, 3, dtype=dtype)], -2), {}


@register_vjp(torch.stack)
class Stack:
    """stack(xs, dim): d_xs = unbind(d, dim) (derivatives.yaml `stack`)."""

    def fwd(tensors, dim=0):
        return torch.stack(tensors, dim), (len(tensors), dim)

    def bwd(aux, d):
        n, dim = aux
        parts = torch.unbind(d, dim)
        return ([parts[i] for i in range(n)],)

    def jvp(primals, tangents):
        (xs, dim), ts = primals, tangents[0]
        return torch.stack(xs, dim), torch.stack(_filled(xs, ts), dim)

    def samples(dtype):
        yield ([randn(2, 3, dtype=dtype), randn(2, 3, dtype=dtype)],), {}
        yield ([randn(2, 3, dtype=dtype), randn(2, 3, dtype=dtype)], -1), {}


def _filled(xs: Any, ts: Any) -> list[Any]:
    """Tangents of a list argument with zeros for the constant entries."""
    xs = list(xs)
    ts = [None] * len(xs) if ts is None else list(ts)
    return [torch.zeros_like(x) if t is None else t for x, t in zip(xs, ts)]


def _joined(out: Any, d: tuple, dim: int, join: Any) -> Any:
    parts = [c if c is not None else torch.zeros_like(out[i]) for i, c in enumerate(d)]
    return join(parts, dim)


@register_vjp(torch.split)
class Split:
    """split(x, sizes, dim): d_x = cat of the pieces' cotangents, zeros for unused pieces
    (derivatives.yaml `split.Tensor`: split_backward)."""

    def fwd(tensor, split_size_or_sections, dim=0):
        out = torch.split(tensor, split_size_or_sections, dim)
        return out, (out, dim)

    def bwd(aux, d):
        out, dim = aux
        return (_joined(out, d, dim, torch.cat),)

    def jvp(primals, tangents):
        return torch.split(*primals), torch.split(tangents[0], *primals[1:])

    def samples(dtype):
        yield (randn(5, 3, dtype=dtype), 2), {}
        yield (randn(5, 3, dtype=dtype), [1, 2]), {"dim": 1}


@register_vjp(torch.chunk)
class Chunk:
    """chunk(x, n, dim): as split (derivatives.yaml `chunk` via split)."""

    def fwd(input, chunks, dim=0):
        out = torch.chunk(input, chunks, dim)
        return out, (out, dim)

    def bwd(aux, d):
        out, dim = aux
        return (_joined(out, d, dim, torch.cat),)

    def jvp(primals, tangents):
        return torch.chunk(*primals), torch.chunk(tangents[0], *primals[1:])

    def samples(dtype):
        yield (randn(6, 3, dtype=dtype), 3), {}
        yield (randn(4, 5, dtype=dtype), 2, 1), {}


@register_vjp(torch.unbind)
class Unbind:
    """unbind(x, dim): d_x = stack of the slices' cotangents (derivatives.yaml `unbind`)."""

    def fwd(input, dim=0):
        out = torch.unbind(input, dim)
        return out, (out, dim)

    def bwd(aux, d):
        out, dim = aux
        return (_joined(out, d, dim, torch.stack),)

    def jvp(primals, tangents):
        return torch.unbind(*primals), torch.unbind(tangents[0], primals[1])

    def samples(dtype):
        yield (randn(3, 4, dtype=dtype),), {}
        yield (randn(3, 4, dtype=dtype), 1), {}


# --- identities and casts -------------------------------------------------------------------

def _identity(op: Any, call: Any) -> type:

    class Identity:
        source = ("identity up to a cast or copy: d_x = d cast back to x's dtype "
                  "(derivatives.yaml `_to_copy`, `clone`)")

        def fwd(self, *args, **kwargs):
            return call(self, *args, **kwargs), None

        def bwd(aux, d):
            return (d,)

        def jvp(primals, tangents):  # primals: (self, *args, kwargs)
            x, *args, kwargs = primals
            return call(x, *args, **kwargs), call(tangents[0], *args, **kwargs)

        def samples(dtype):
            yield (randn(3, 4, dtype=dtype),), {}

    return Identity


for _op, _call in ((torch.Tensor.to, lambda x, *a, **k: x.to(*a, **k)),
                   (torch.Tensor.contiguous, lambda x, *a, **k: x.contiguous(*a, **k)),
                   (torch.Tensor.clone, lambda x, *a, **k: x.clone(*a, **k)),
                   (torch.clone, lambda x, *a, **k: torch.clone(x, *a, **k))):
    register_vjp(_op)(_identity(_op, _call))


def _zero_derivative(op: Any) -> type:
    """Ops whose value does not depend differentiably on their tensor inputs."""

    class ZeroDerivative:
        source = (f"{getattr(op, '__name__', op)} has zero derivative (piecewise constant or "
                  "a new tensor built from shape only)")

        def fwd(*args, **kwargs):
            return op(*args, **kwargs), None

        def bwd(aux, d):
            return ()

        def jvp(primals, tangents):  # primals: (*args, kwargs)
            return op(*primals[:-1], **primals[-1]), None

    return ZeroDerivative


for _op in (torch.detach, torch.Tensor.detach, torch.zeros_like, torch.ones_like,
            torch.empty_like, torch.full_like, torch.rand_like, torch.randn_like,
            torch.floor, torch.ceil, torch.round, torch.trunc):
    register_vjp(_op)(_zero_derivative(_op))


def _make_cast(method: str, complex_out: bool) -> None:
    class Cast:
        __doc__ = (f"``x.{method}()``: a dtype cast; d_x = d"
                   + (".real (for a real x)" if complex_out else "")
                   + " cast back to x's dtype (derivatives.yaml ``_to_copy``).")

        def fwd(self, memory_format=torch.preserve_format):
            out = getattr(self, method)(memory_format=memory_format) \
                if memory_format is not torch.preserve_format else getattr(self, method)()
            return out, self.dtype.is_complex

        def bwd(input_is_complex, d):
            # a complex cotangent of a real input: its real part (a complex input keeps it)
            return (torch.real(d) if complex_out and not input_is_complex else d),

        def samples(dtype):
            if method in ("float", "half", "bfloat16", "chalf", "cfloat"):
                return  # single/low precision (finite differences fail): the OpInfo sweep
            yield (uniform((3, 4), -2.0, 2.0, dtype),), {}

    register_vjp(getattr(torch.Tensor, method))(Cast)


for _m in ("float", "double", "half", "bfloat16"):
    _make_cast(_m, False)
for _m in ("cfloat", "cdouble", "chalf"):
    _make_cast(_m, True)


def _pieces(out: Any, d: Any) -> list:
    """Cotangents of a tuple output with zeros for the unused pieces."""
    return [c if c is not None else torch.zeros_like(out[i]) for i, c in enumerate(d)]


@register_vjp(torch.narrow)
class Narrow:
    """narrow(x, dim, start, length): d_x = slice_scatter(zeros, d, dim, start, start + length)
    (derivatives.yaml `narrow` via `slice`: slice_backward).  A 0-d tensor ``start`` (read at
    run time): d_x = index_add(zeros, dim, (arange(length) + start) mod size, d)."""

    def fwd(input, dim, start, length):
        return torch.narrow(input, dim, start, length), (input, dim, start, length)

    def bwd(aux, d):
        x, dim, start, length = aux
        if not isinstance(start, int):  # a tensor (a proxy while the backward is built)
            size = x.shape[dim]
            idx = torch.remainder(torch.arange(length, device=x.device) + start, size)
            return (torch.index_add(torch.zeros_like(x), dim, idx, d), None)
        start = start % x.shape[dim] if start < 0 else start
        return (torch.slice_scatter(torch.zeros_like(x), d, dim, start, start + length),)

    def jvp(primals, tangents):
        x, dim, start, length = primals
        t = tangents[0]
        return (torch.narrow(x, dim, start, length),
                None if t is None else torch.narrow(t, dim, start, length))

    def samples(dtype):
        yield (randn(4, 5, dtype=dtype), 1, 1, 3), {}
        yield (randn(4, 5, dtype=dtype), 0, -2, 2), {}
        yield (randn(4, 5, dtype=dtype), 1, torch.tensor(2), 3), {}
        yield (randn(4, 5, dtype=dtype), -1, torch.tensor(-3), 2), {}


@register_vjp(torch.narrow_copy)
class NarrowCopy:
    """narrow_copy(x, dim, start, length): d_x = slice_scatter(zeros, d, dim, start,
    start + length) (derivatives.yaml `narrow_copy`)."""

    def fwd(input, dim, start, length):
        return torch.narrow_copy(input, dim, start, length), (input, dim, start, length)

    def bwd(aux, d):
        return Narrow.bwd(aux, d)

    def samples(dtype):
        yield (randn(4, 5, dtype=dtype), 1, 1, 3), {}


@register_vjp(torch.select)
class Select:
    """select(x, dim, i): d_x = select_scatter(zeros, d, dim, i) (derivatives.yaml
    `select.int`: select_backward)."""

    def fwd(input, dim, index):
        return torch.select(input, dim, index), (input, dim, index)

    def bwd(aux, d):
        x, dim, index = aux
        return (torch.select_scatter(torch.zeros_like(x), d, dim, index),)

    def jvp(primals, tangents):
        x, dim, index = primals
        t = tangents[0]
        return torch.select(x, dim, index), (None if t is None else torch.select(t, dim, index))

    def samples(dtype):
        yield (randn(4, 5, dtype=dtype), 1, 2), {}
        yield (randn(4, 5, dtype=dtype), 0, -1), {}


def _diagonal_rule(op: Any, kw_only: bool, defaults: tuple, name: str) -> type:
    o0, a0, b0 = defaults

    class Diagonal:
        source = (f"{name}(x, offset, dim1, dim2): d_x = diagonal_scatter(zeros, d, offset, "
                  "dim1, dim2) (derivatives.yaml `diagonal`: diagonal_backward)")

        if kw_only:
            def fwd(A, *, offset=o0, dim1=a0, dim2=b0):
                return op(A, offset=offset, dim1=dim1, dim2=dim2), (A, offset, dim1, dim2)
        else:
            def fwd(input, offset=o0, dim1=a0, dim2=b0):
                return op(input, offset, dim1, dim2), (input, offset, dim1, dim2)

        def bwd(aux, d):
            x, offset, dim1, dim2 = aux
            return (torch.diagonal_scatter(torch.zeros_like(x), d, offset, dim1, dim2),)

        def jvp(primals, tangents):
            x, offset, dim1, dim2 = primals
            t = tangents[0]
            return (torch.diagonal(x, offset, dim1, dim2),
                    None if t is None else torch.diagonal(t, offset, dim1, dim2))

        def samples(dtype):
            yield (randn(4, 5, dtype=dtype),), {}
            yield (randn(2, 4, 5, dtype=dtype),), {"offset": -1, "dim1": 1, "dim2": 2}

    return Diagonal


for _op, _kw_only, _defaults, _name in (
        (torch.diagonal, False, (0, 0, 1), "diagonal"),
        (torch.diagonal_copy, False, (0, 0, 1), "diagonal_copy"),
        (torch.linalg.diagonal, True, (0, -2, -1), "linalg.diagonal")):
    register_vjp(_op)(_diagonal_rule(_op, _kw_only, _defaults, _name))


@register_vjp(torch.diag_embed)
class DiagEmbed:
    """diag_embed(x, offset, dim1, dim2): d_x = diagonal(d, offset, dim1, dim2)
    (derivatives.yaml `diag_embed`)."""

    def fwd(input, offset=0, dim1=-2, dim2=-1):
        return torch.diag_embed(input, offset, dim1, dim2), (offset, dim1, dim2)

    def bwd(aux, d):
        return (torch.diagonal(d, *aux),)

    def samples(dtype):
        yield (randn(2, 3, dtype=dtype),), {}
        yield (randn(2, 3, dtype=dtype), 1, 0, 2), {}


@register_vjp(torch.diag)
class Diag:
    """diag(x, k): a 1-d x is embedded (d_x = diagonal(d, k)); a 2-d x has its diagonal read
    (d_x = diagonal_scatter(zeros, d, k)) (derivatives.yaml `diag` via `diag_embed`/
    `diagonal`)."""

    def fwd(input, diagonal=0):
        return torch.diag(input, diagonal), (input, diagonal)

    def bwd(aux, d):
        x, k = aux
        if x.dim() == 1:
            return (torch.diagonal(d, k),)
        return (torch.diagonal_scatter(torch.zeros_like(x), d, k),)

    def samples(dtype):
        yield (randn(4, dtype=dtype),), {}
        yield (randn(4, 5, dtype=dtype), 1), {}
        yield (randn(4, 3, dtype=dtype), -1), {}


@register_vjp(torch.diagflat)
class Diagflat:
    """diagflat(x, k) = diag(x.flatten(), k): d_x = diagonal(d, k) reshaped to x
    (derivatives.yaml via `diag_embed`)."""

    def fwd(input, offset=0):
        return torch.diagflat(input, offset), (tuple(input.shape), offset)

    def bwd(aux, d):
        shape, k = aux
        return (torch.reshape(torch.diagonal(d, k), shape),)

    def samples(dtype):
        yield (randn(2, 3, dtype=dtype), 1), {}


@register_vjp(torch.roll)
class Roll:
    """roll(x, shifts, dims): d_x = roll(d, -shifts, dims) (derivatives.yaml `roll`)."""

    def fwd(input, shifts, dims=()):
        return torch.roll(input, shifts, dims), (shifts, dims)

    def bwd(aux, d):
        shifts, dims = aux
        neg = -shifts if isinstance(shifts, int) else [-s for s in shifts]
        return (torch.roll(d, neg, dims),)

    def samples(dtype):
        yield (randn(3, 4, dtype=dtype), 1), {}
        yield (randn(3, 4, dtype=dtype), (1, -3), (0, 1)), {}


@register_vjp(torch.rot90)
class Rot90:
    """rot90(x, k, dims): d_x = rot90(d, -k, dims) (derivatives.yaml `rot90`)."""

    def fwd(input, k=1, dims=(0, 1)):
        return torch.rot90(input, k, dims), (k, dims)

    def bwd(aux, d):
        k, dims = aux
        return (torch.rot90(d, -k, dims),)

    def samples(dtype):
        yield (randn(3, 4, dtype=dtype),), {}
        yield (randn(2, 3, 4, dtype=dtype), 3, (2, 0)), {}


def _flip_rule(op: Any, dim: int, name: str) -> type:
    class Flip:
        source = (f"{name}(x) = flip(x, [{dim}]), its own inverse: d_x = {name}(d) "
                  "(derivatives.yaml `flip`)")

        def fwd(input):
            return op(input), None

        def bwd(aux, d):
            return (op(d),)

        def samples(dtype):
            yield (randn(3, 4, dtype=dtype),), {}

    return Flip


register_vjp(torch.fliplr)(_flip_rule(torch.fliplr, 1, "fliplr"))
register_vjp(torch.flipud)(_flip_rule(torch.flipud, 0, "flipud"))


def _reshape_back(op: Any, forward: Any, name: str, sampler: Any) -> type:
    """An op that only rearranges elements in row-major order: d_x = d.reshape(x.shape)."""

    class ReshapeBack:
        source = (f"{name}: a reshape; d_x = reshape(d, x.shape) (derivatives.yaml "
                  "`view`/`_reshape_alias`)")
        fwd = forward
        samples = sampler

        def bwd(aux, d):
            return (torch.reshape(d, aux),)

    return ReshapeBack


for _op, _fwd, _name, _samples in (
        (torch.unflatten,
         lambda input, dim, sizes: (torch.unflatten(input, dim, sizes), tuple(input.shape)),
         "unflatten", lambda dt: iter([((randn(3, 4, dtype=dt), 1, (2, 2)), {})])),
        (torch.ravel, lambda input: (torch.ravel(input), tuple(input.shape)),
         "ravel", lambda dt: iter([((randn(3, 4, dtype=dt),), {})])),
        (torch.view_copy,
         lambda input, size: (torch.view_copy(input, size), tuple(input.shape)),
         "view_copy", lambda dt: iter([((randn(3, 4, dtype=dt), (2, 6)), {})])),
        (torch.squeeze_copy,
         lambda input, dim=None: (torch.squeeze_copy(input) if dim is None else
                                  torch.squeeze_copy(input, dim), tuple(input.shape)),
         "squeeze_copy", lambda dt: iter([((randn(3, 1, 4, dtype=dt),), {})])),
        (torch.unsqueeze_copy,
         lambda input, dim: (torch.unsqueeze_copy(input, dim), tuple(input.shape)),
         "unsqueeze_copy", lambda dt: iter([((randn(3, 4, dtype=dt), 1), {})])),
        (torch.alias_copy, lambda input: (torch.alias_copy(input), tuple(input.shape)),
         "alias_copy", lambda dt: iter([((randn(3, 4, dtype=dt),), {})]))):
    register_vjp(_op)(_reshape_back(_op, _fwd, _name, _samples))


@register_vjp(torch.permute_copy)
class PermuteCopy:
    """permute_copy(x, dims): d_x = permute(d, inverse(dims)) (derivatives.yaml `permute`)."""

    def fwd(input, dims):
        n = input.dim()
        return torch.permute_copy(input, dims), [d % n for d in dims]

    def bwd(aux, d):
        inv = [0] * len(aux)
        for i, p in enumerate(aux):
            inv[p] = i
        return (torch.permute(d, inv),)

    def samples(dtype):
        yield (randn(2, 3, 4, dtype=dtype), (2, 0, 1)), {}


@register_vjp(torch.transpose_copy)
class TransposeCopy:
    """transpose_copy(x, a, b): d_x = transpose(d, a, b) (derivatives.yaml `transpose`)."""

    def fwd(input, dim0, dim1):
        return torch.transpose_copy(input, dim0, dim1), (dim0, dim1)

    def bwd(aux, d):
        return (torch.transpose(d, *aux),)

    def samples(dtype):
        yield (randn(2, 3, 4, dtype=dtype), 0, 2), {}


@register_vjp(torch.t_copy)
class TCopy:
    """t_copy(x): d_x = t(d) (derivatives.yaml `t`)."""

    def fwd(input):
        return torch.t_copy(input), None

    def bwd(aux, d):
        return (torch.t(d),)

    def samples(dtype):
        yield (randn(3, 4, dtype=dtype),), {}


@register_vjp(torch.expand_copy)
class ExpandCopy:
    """expand_copy(x, size): d_x = d (summed to x's shape by the engine) (derivatives.yaml
    `expand`)."""

    def fwd(input, size, *, implicit=False):
        return torch.expand_copy(input, size), None

    def bwd(aux, d):
        return (d,)

    def samples(dtype):
        yield (randn(3, 1, dtype=dtype), (2, 3, 4)), {}


@register_vjp(torch.broadcast_to)
class BroadcastTo:
    """broadcast_to(x, size): d_x = d (summed to x's shape by the engine) (derivatives.yaml
    `expand`)."""

    def fwd(input, size):
        return torch.broadcast_to(input, size), None

    def bwd(aux, d):
        return (d,)

    def jvp(primals, tangents):
        x, size = primals
        t = tangents[0]
        return torch.broadcast_to(x, size), (None if t is None else torch.broadcast_to(t, size))

    def samples(dtype):
        yield (randn(3, 1, dtype=dtype), (2, 3, 4)), {}


@register_vjp(torch.broadcast_tensors)
class BroadcastTensors:
    """broadcast_tensors(*xs): d_x_i = d_i (summed to x_i's shape by the engine)
    (derivatives.yaml `expand`)."""

    def fwd(*tensors):
        return torch.broadcast_tensors(*tensors), len(tensors)

    def bwd(aux, d):
        return {"tensors": tuple(d)}

    def samples(dtype):
        yield (randn(3, 1, dtype=dtype), randn(4, dtype=dtype)), {}


@register_vjp(torch.tile)
class Tile:
    """tile(x, reps): with x padded to len(reps) dims and d viewed as (r0, s0, r1, s1, ...),
    d_x = sum of d over the r axes (derivatives.yaml `repeat`: repeat_backward)."""

    def fwd(input, dims):
        return torch.tile(input, dims), (tuple(input.shape), tuple(dims))

    def bwd(aux, d):
        shape, reps = aux
        n = max(len(shape), len(reps))
        s = (1,) * (n - len(shape)) + shape
        r = (1,) * (n - len(reps)) + reps
        dr = torch.reshape(d, [v for pair in zip(r, s) for v in pair])
        return (torch.reshape(torch.sum(dr, list(range(0, 2 * n, 2))), shape),)

    def samples(dtype):
        yield (randn(3, 4, dtype=dtype), (2,)), {}
        yield (randn(3, dtype=dtype), (2, 1, 3)), {}


# --- stacks and splits ----------------------------------------------------------------------

def _stack_rule(op: Any, name: str, arrange: Any, cat_dim: Any) -> type:
    """``op(tensors) = cat([arrange(x) for x in tensors], cat_dim(tensors))``."""

    class Stack:
        source = (f"{name}: a cat of reshaped inputs; d_x_i = the matching split of d, "
                  "reshaped to x_i (derivatives.yaml `cat`)")

        def fwd(tensors, *, out=None):
            shapes = [tuple(x.shape) for x in tensors]
            return op(tensors), shapes

        def bwd(aux, d):
            shapes = aux
            arranged = [arrange(s) for s in shapes]
            dim = cat_dim(arranged)
            pieces = torch.split(d, [a[dim] for a in arranged], dim)
            return ([torch.reshape(p, s) for p, s in zip(pieces, shapes)],)

        def samples(dtype):
            yield ([randn(3, 2, dtype=dtype), randn(3, 2, dtype=dtype)],), {}
            yield ([randn(3, dtype=dtype), randn(3, dtype=dtype)],), {}

    return Stack


def _at1(s):
    return s if len(s) >= 1 else (1,)


def _at2(s):
    return s if len(s) >= 2 else (1, 1) if len(s) == 0 else (1,) + s


def _at3(s):
    if len(s) >= 3:
        return s
    return {0: (1, 1, 1), 1: (1,) + s + (1,), 2: s + (1,)}[len(s)]


def _col(s):
    return s if len(s) >= 2 else ((s[0] if s else 1), 1)


for _op, _name, _shape, _dim in (
        (torch.hstack, "hstack", _at1, lambda a: 0 if len(a[0]) == 1 else 1),
        (torch.vstack, "vstack", _at2, lambda a: 0),
        (torch.row_stack, "row_stack", _at2, lambda a: 0),
        (torch.dstack, "dstack", _at3, lambda a: 2),
        (torch.column_stack, "column_stack", _col, lambda a: 1)):
    register_vjp(_op)(_stack_rule(_op, _name, _shape, _dim))


def _split_rule(op: Any, name: str, dim_of: Any, forward: Any, sampler: Any) -> type:
    class Split:
        source = (f"{name}: d_x = cat of the pieces' cotangents (zeros for unused pieces) "
                  "(derivatives.yaml `split`: split_backward)")
        fwd = forward
        samples = sampler

        def bwd(aux, d):
            out, dim = aux
            return (torch.cat(_pieces(out, d), dim),)

    return Split


def _split_fwd_factory(op, dim_of):
    def fwd(input, indices_or_sections):
        out = op(input, indices_or_sections)
        return out, (out, dim_of(input))
    return fwd


def _sec_samples(dt):
    yield (randn(4, 6, 2, dtype=dt), 2), {}
    yield (randn(4, 6, 2, dtype=dt), [1, 3]), {}


for _op, _name, _dim_of in ((torch.hsplit, "hsplit", lambda x: 1 if x.dim() > 1 else 0),
                            (torch.vsplit, "vsplit", lambda x: 0),
                            (torch.dsplit, "dsplit", lambda x: 2)):
    register_vjp(_op)(_split_rule(_op, _name, None, _split_fwd_factory(_op, _dim_of),
                                  _sec_samples))


def _sws_fwd(input, split_sizes, dim=0):
    out = torch.split_with_sizes(input, split_sizes, dim)
    return out, (out, dim)


def _us_fwd(input, split_size, dim=0):
    out = torch.unsafe_split(input, split_size, dim)
    return out, (out, dim)


def _uc_fwd(input, chunks, dim=0):
    out = torch.unsafe_chunk(input, chunks, dim)
    return out, (out, dim)


for _op, _name, _fwd, _samples in (
        (torch.split_with_sizes, "split_with_sizes", _sws_fwd,
         lambda dt: iter([((randn(5, 3, dtype=dt), [2, 3]), {})])),
        (torch.unsafe_split, "unsafe_split", _us_fwd,
         lambda dt: iter([((randn(5, 3, dtype=dt), 2), {})])),
        (torch.unsafe_chunk, "unsafe_chunk", _uc_fwd,
         lambda dt: iter([((randn(5, 3, dtype=dt), 2, 1), {})]))):
    register_vjp(_op)(_split_rule(_op, _name, None, _fwd, _samples))


@register_vjp(torch.unbind_copy)
class UnbindCopy:
    """unbind_copy(x, dim): d_x = stack of the pieces' cotangents (zeros for unused ones)
    (derivatives.yaml `unbind`: unbind_backward)."""

    def fwd(input, dim=0):
        out = torch.unbind_copy(input, dim)
        return out, (out, dim)

    def bwd(aux, d):
        out, dim = aux
        return (torch.stack(_pieces(out, d), dim),)

    def samples(dtype):
        yield (randn(3, 4, dtype=dtype), 1), {}


@register_vjp(torch.block_diag)
class BlockDiag:
    """block_diag(*xs): d_x_i = the i-th diagonal block of d (0-d/1-d inputs are 1x1 / 1xn
    blocks) (derivatives.yaml `block_diag`: block_diag_backward)."""

    def fwd(*tensors):
        return torch.block_diag(*tensors), [tuple(t.shape) for t in tensors]

    def bwd(aux, d):
        r = c = 0
        cts = []
        for s in aux:
            h, w = (1, 1) if len(s) == 0 else (1, s[0]) if len(s) == 1 else s
            cts.append(torch.reshape(d[r:r + h, c:c + w], s))
            r, c = r + h, c + w
        return {"tensors": tuple(cts)}

    def samples(dtype):
        yield (randn(2, 3, dtype=dtype), randn(4, dtype=dtype), randn(dtype=dtype)), {}


@register_vjp(torch.Tensor.unfold)
class Unfold:
    """x.unfold(dim, size, step): windows along dim as a new last axis; d_x = index_add of the
    windows' cotangents at their source positions (derivatives.yaml `unfold`:
    unfold_backward)."""

    def fwd(self, dimension, size, step):
        return self.unfold(dimension, size, step), (self, dimension, size, step)

    def bwd(aux, d):
        x, dim, size, step = aux
        if x.dim() == 0:
            return (torch.reshape(d, ()),)
        dim = dim % x.dim()
        n = x.shape[dim]
        idx = torch.arange(n, device=d.device).unfold(0, size, step).reshape(-1)
        dd = torch.flatten(torch.movedim(d, -1, dim + 1), dim, dim + 1)
        return (torch.zeros_like(x).index_add(dim, idx, dd),)

    def jvp(primals, tangents):
        x, dim, size, step = primals
        t = tangents[0]
        return x.unfold(dim, size, step), (None if t is None else t.unfold(dim, size, step))

    def samples(dtype):
        yield (randn(3, 7, dtype=dtype), 1, 3, 2), {}
        yield (randn(5, 2, dtype=dtype), 0, 2, 1), {}


@register_vjp(torch.unfold_copy)
class UnfoldCopy:
    """unfold_copy(x, dim, size, step): as Tensor.unfold (derivatives.yaml `unfold_copy`:
    unfold_backward)."""

    def fwd(input, dimension, size, step):
        return torch.unfold_copy(input, dimension, size, step), (input, dimension, size, step)

    def bwd(aux, d):
        return Unfold.bwd(aux, d)

    def jvp(primals, tangents):
        x, dim, size, step = primals
        t = tangents[0]
        return (torch.unfold_copy(x, dim, size, step),
                None if t is None else torch.unfold_copy(t, dim, size, step))

    def samples(dtype):
        yield (randn(3, 7, dtype=dtype), 1, 3, 2), {}


@register_vjp(torch.fill)
class Fill:
    """fill(x, v): d_x = 0, d_v = sum(d) for a tensor v (derivatives.yaml `fill.Tensor`)."""

    def fwd(input, value):
        return torch.fill(input, value), value

    def bwd(aux, d):
        is_t = isinstance(aux, torch.Tensor) or hasattr(aux, "node")
        return None, (torch.sum(d) if is_t else None)

    def samples(dtype):
        yield (randn(3, 4, dtype=dtype), randn(dtype=dtype)), {}


def _atleast_rule(op: Any, name: str) -> type:
    class AtLeast:
        source = (f"{name}: reshapes; d_x_i = reshape(d_i, x_i.shape) (derivatives.yaml "
                  "`view`)")

        def fwd(*tensors):
            return op(*tensors), [tuple(t.shape) for t in (
                tensors[0] if len(tensors) == 1 and isinstance(tensors[0], (list, tuple))
                else tensors)] + [len(tensors) == 1 and isinstance(tensors[0], (list, tuple))]

        def bwd(aux, d):
            shapes, listed = aux[:-1], aux[-1]
            ds = list(d) if isinstance(d, (tuple, list)) else [d]
            cts = [None if c is None else torch.reshape(c, s) for c, s in zip(ds, shapes)]
            return {"tensors": ([cts] if listed else tuple(cts))}

        def samples(dtype):
            yield (randn(3, dtype=dtype),), {}
            yield (randn(dtype=dtype), randn(2, 3, dtype=dtype)), {}

    return AtLeast


register_vjp(torch.atleast_1d)(_atleast_rule(torch.atleast_1d, "atleast_1d"))
register_vjp(torch.atleast_2d)(_atleast_rule(torch.atleast_2d, "atleast_2d"))
register_vjp(torch.atleast_3d)(_atleast_rule(torch.atleast_3d, "atleast_3d"))


def _swsc_fwd(input, split_sizes, dim=0):
    out = torch.split_with_sizes_copy(input, split_sizes, dim)
    return out, (out, dim)


register_vjp(torch.split_with_sizes_copy)(_split_rule(
    torch.split_with_sizes_copy, "split_with_sizes_copy", None, _swsc_fwd,
    lambda dt: iter([((randn(5, 3, dtype=dt), [2, 3]), {})])))


@register_vjp(torch.cartesian_prod)
class CartesianProd:
    """cartesian_prod(*xs) -> (N, k): column i repeats x_i over a meshgrid; d_x_i = the sum of
    d[:, i] viewed as the grid over the other axes (a single input is returned as is)
    (derivatives.yaml via `meshgrid`/`stack`)."""

    def fwd(*tensors):
        return torch.cartesian_prod(*tensors), [t.shape[0] for t in tensors]

    def bwd(aux, d):
        sizes = aux
        if len(sizes) == 1:
            return {"tensors": (d,)}
        cts = []
        for i in range(len(sizes)):
            g = torch.reshape(d[:, i], sizes)
            other = [j for j in range(len(sizes)) if j != i]
            cts.append(torch.sum(g, other))
        return {"tensors": tuple(cts)}

    def samples(dtype):
        yield (randn(3, dtype=dtype), randn(2, dtype=dtype)), {}


@register_vjp(torch.repeat_interleave)
class RepeatInterleave:
    """repeat_interleave(x, repeats, dim): an int repeat views d as (..., n, r, ...) and sums
    the r axis; tensor repeats index_add d back at repeat_interleave(arange(n), repeats);
    dim=None works on x.flatten() (derivatives.yaml `repeat_interleave` via `index_select`)."""

    def fwd(input, repeats=None, dim=None, *, output_size=None):
        kw = {} if output_size is None else {"output_size": output_size}
        out = torch.repeat_interleave(input, repeats, dim, **kw)
        return out, (input, repeats, dim)

    def bwd(aux, d):
        x, reps, dim = aux
        shape = tuple(x.shape)
        xs = shape if dim is not None else (x.numel(),)
        dim = 0 if dim is None else dim % max(len(shape), 1)
        if len(xs) == 0:
            return torch.reshape(torch.sum(d), shape), None
        if isinstance(reps, int) or (not hasattr(reps, "node") and not
                                     isinstance(reps, torch.Tensor)):
            r = int(reps)
            g = torch.reshape(d, xs[:dim] + (xs[dim], r) + xs[dim + 1:])
            return torch.reshape(torch.sum(g, dim + 1), shape), None
        if reps.dim() == 0 or reps.numel() == 1:
            r_t = reps
            idx = torch.repeat_interleave(torch.arange(xs[dim], device=d.device), r_t)
        else:
            idx = torch.repeat_interleave(torch.arange(xs[dim], device=d.device), reps)
        base = torch.reshape(torch.zeros_like(x), xs)
        return torch.reshape(base.index_add(dim, idx, d), shape), None

    def jvp(primals, tangents):
        x, reps, dim, output_size = primals
        t = tangents[0]
        kw = {} if output_size is None else {"output_size": output_size}
        return (torch.repeat_interleave(x, reps, dim, **kw),
                None if t is None else torch.repeat_interleave(t, reps, dim, **kw))

    def samples(dtype):
        yield (randn(3, 4, dtype=dtype), 2, 1), {}
        yield (randn(3, 4, dtype=dtype), 3), {}


@register_vjp(torch.meshgrid)
class Meshgrid:
    """meshgrid(*xs, indexing): grid i repeats x_i along one axis (axis i for 'ij'; axes 0
    and 1 swapped for 'xy'); d_x_i = sum of d_i over the other axes (derivatives.yaml via
    `expand`)."""

    def fwd(*tensors, indexing=None):
        listed = len(tensors) == 1 and isinstance(tensors[0], (list, tuple))
        xs = list(tensors[0]) if listed else list(tensors)
        kw = {} if indexing is None else {"indexing": indexing}
        out = torch.meshgrid(*xs, **kw)
        return out, ([tuple(x.shape) for x in xs], indexing == "xy", listed)

    def bwd(aux, d):
        shapes, xy, listed = aux
        k = len(shapes)
        cts = []
        for i, (c, s) in enumerate(zip(d, shapes)):
            if c is None:
                cts.append(None)
                continue
            ax = i
            if xy and k >= 2 and i < 2:
                ax = 1 - i
            other = [j for j in range(k) if j != ax]
            g = torch.sum(c, other) if other else c
            cts.append(torch.reshape(g, s))
        return {"tensors": ([cts] if listed else tuple(cts))}

    def samples(dtype):
        yield (randn(3, dtype=dtype), randn(2, dtype=dtype)), {"indexing": "ij"}
        yield (randn(3, dtype=dtype), randn(2, dtype=dtype), randn(4, dtype=dtype)), \
            {"indexing": "xy"}


def _check_owns_storage(op: str, x: Any, *, offset_matters: bool = True) -> None:
    """Refuse an input whose elements are not storage positions 0..numel-1 in order."""
    v = _meta(x)
    ok = v.is_contiguous()
    if ok and offset_matters:
        try:
            nbytes = v.untyped_storage().nbytes()
        except Exception:  # noqa: BLE001  storage not inspectable: be conservative
            nbytes = -1
        ok = v.storage_offset() == 0 and nbytes == v.numel() * v.element_size()
    if not ok:
        raise _error(op, "the input is not a contiguous tensor owning its whole storage "
                     f"(shape {tuple(v.shape)}, stride {tuple(v.stride())}, storage offset "
                     f"{v.storage_offset()}), so its storage positions are not its elements",
                     "call .contiguous() (or .clone()) on the input first, so the strided "
                     "positions refer to the input's own elements")


def _storage_order(op: str, x: Any) -> tuple[int, ...] | None:
    """``None`` for an input that owns its whole storage contiguously; for one that owns it
    in another dense order (a transposed or permuted view of a whole contiguous tensor,
    offset 0), the permutation ``perm`` with ``x.permute(perm)`` contiguous, so that storage
    position ``p`` is element ``p`` of ``x.permute(perm).reshape(-1)``; anything else is
    refused."""
    v = _meta(x)
    if v.is_contiguous():
        _check_owns_storage(op, x)
        return None
    perm = tuple(sorted(range(v.dim()), key=lambda k: (-v.stride(k), -v.shape[k], k)))
    try:
        nbytes = v.untyped_storage().nbytes()
    except Exception:  # noqa: BLE001  storage not inspectable: be conservative
        nbytes = -1
    if not (v.permute(perm).is_contiguous() and v.storage_offset() == 0
            and nbytes == v.numel() * v.element_size()):
        _check_owns_storage(op, x)  # raises, naming the layout
    return perm


def _check_in_bounds(op: str, x: Any, size: Any, stride: Any, offset: int) -> None:
    """Refuse positions past the input's elements (eager as_strided raises there too)."""
    n = _meta(x).numel()
    if all(int(k) > 0 for k in size):
        last = int(offset) + sum((int(k) - 1) * int(s) for k, s in zip(size, stride))
        if int(offset) < 0 or last >= n:
            raise _error(op, f"size {tuple(size)}, stride {tuple(stride)} and storage offset "
                         f"{offset} read storage position {last}, past the input's {n} "
                         "elements", "keep the strided positions inside the input")


def _positions(size: Any, stride: Any, offset: int, device: Any) -> Any:
    """int64 tensor of shape ``size``: the storage position each output element reads."""
    size, stride = tuple(int(s) for s in size), tuple(int(s) for s in stride)
    p = None
    for k, (n, s) in enumerate(zip(size, stride)):
        if n > 1 and s != 0:
            shape = [1] * len(size)
            shape[k] = n
            term = torch.reshape(torch.arange(0, n * s, s, device=device), tuple(shape))
            p = term if p is None else p + term
    if p is None:
        return torch.full(size, int(offset), dtype=torch.int64, device=device)
    if offset:
        p = p + int(offset)
    return p if tuple(p.shape) == size else p.expand(size)


def _offset(x: Any, storage_offset: Any) -> int:
    return _meta(x).storage_offset() if storage_offset is None else int(storage_offset)


_AS_STRIDED_DOC = (
    """as_strided(x, size, stride, storage_offset): d_x = zeros.index_add(0, p, d) with p the
    storage positions read (derivatives.yaml `as_strided`: as_strided_backward, for an input
    owning its storage contiguously); JVP: take(t, p).  The input's build-time layout is
    checked on every call (a guard line: fxad.InputError naming the line).""")


def _as_strided_rule(op: Any, name: str) -> type:
    class AsStrided:
        source = _AS_STRIDED_DOC.replace("as_strided(", f"{name}(", 1)

        def fwd(input, size, stride, storage_offset=None):
            _check_in_bounds(name, input, size, stride, _offset(input, storage_offset))
            perm = _storage_order(name, input)
            out = op(input, size, stride, storage_offset)
            guard_layout(input, name, perm, True)
            return out, (tuple(input.shape), input.numel(), tuple(size), tuple(stride),
                         _offset(input, storage_offset), perm)

        def bwd(aux, d):
            shape, numel, size, stride, offset, perm = aux
            p = _positions(size, stride, offset, d.device)
            flat = torch.zeros(numel, dtype=d.dtype, device=d.device)
            d_x = flat.index_add(0, torch.reshape(p, (-1,)), torch.reshape(d, (-1,)))
            if perm is None:
                return torch.reshape(d_x, shape), None, None, None
            # storage order back to the input's layout: undo the sorting permutation
            d_x = torch.reshape(d_x, tuple(shape[k] for k in perm))
            inverse = tuple(sorted(range(len(perm)), key=lambda k: perm[k]))
            return torch.permute(d_x, inverse), None, None, None

        def jvp(primals, tangents):
            x, size, stride, storage_offset = primals
            _check_in_bounds(name, x, size, stride, _offset(x, storage_offset))
            perm = _storage_order(name, x)
            out = op(x, size, stride, storage_offset)
            t = tangents[0]
            if t is None:
                return out, None
            guard_layout(x, name, perm, True)
            p = _positions(size, stride, _offset(x, storage_offset), x.device)
            return out, torch.take(t if perm is None else torch.permute(t, perm), p)

        samples = _as_strided_samples

    return AsStrided


def _as_strided_samples(dtype: torch.dtype):
    yield (randn(3, 3, dtype=dtype), (2, 2), (1, 2)), {}
    yield (randn(3, 3, dtype=dtype), (2, 2), (1, 2), 1), {}
    yield (randn(3, 3, dtype=dtype), (2, 2), (1, 2)), {"storage_offset": 1}
    yield (randn(16, dtype=dtype), (2, 1, 1, 2), (1, 7, 7, 1)), {}
    # overlapping windows: positions repeat, cotangents accumulate
    yield (randn(10, dtype=dtype), (4, 4), (2, 1)), {"storage_offset": 0}
    yield (randn(4, dtype=dtype), (3, 2), (0, 1), 2), {}       # zero stride
    yield (randn(2, 3, dtype=dtype), (), (), 4), {}             # 0-d output
    yield (randn(dtype=dtype), (1,), (1,)), {}                   # 0-d input
    # a transposed view of a whole tensor: storage positions in the base's order
    yield (randn(4, 3, dtype=dtype).t(), (2, 3), (1, 4)), {}
    yield (randn(2, 4, 3, dtype=dtype).permute(2, 0, 1), (3, 2, 2), (2, 12, 1), 1), {}


register_vjp(torch.as_strided)(_as_strided_rule(torch.as_strided, "torch.as_strided"))
register_vjp(torch.as_strided_copy)(_as_strided_rule(torch.as_strided_copy,
                                                        "torch.as_strided_copy"))


# PyTorch 2.13's own backward for ``input`` (as_strided_scatter_backward) returns ``d`` *at*
# the strided positions and zeros elsewhere, the complement of the true derivative, so the
# autograd fallback would be wrong here; this rule is checked against finite differences
# instead (fxad.tools.coverage._AUTOGRAD_WRONG, tests/test_rules.py).
@register_vjp(torch.as_strided_scatter)
class AsStridedScatter:
    """as_strided_scatter(x, src, size, stride, storage_offset): d_x = d with the strided
    positions p zeroed, d_src = take(d, p) (derivatives.yaml `as_strided_scatter`:
    as_strided_scatter_backward; for overlapping positions autograd's convention: every src
    element gets its position's cotangent); JVP: as_strided_scatter of the tangents."""

    def fwd(input, src, size, stride, storage_offset=None):
        # the op writes into a fresh clone of input, so only contiguity matters
        _check_owns_storage("torch.as_strided_scatter", input, offset_matters=False)
        out = torch.as_strided_scatter(input, src, size, stride, storage_offset)
        guard_layout(input, "torch.as_strided_scatter", None, False)
        off = 0 if storage_offset is None else int(storage_offset)
        return out, (tuple(input.shape), tuple(src.shape), tuple(size), tuple(stride), off)

    def bwd(aux, d):
        shape, src_shape, size, stride, off = aux
        p = _positions(size, stride, off, d.device)
        flat_p = torch.reshape(p, (-1,))
        d_flat = torch.reshape(d, (-1,))
        d_input = torch.reshape(torch.index_fill(d_flat, 0, flat_p, 0.0), shape)
        d_src = torch.reshape(torch.take(d, p), src_shape)
        return d_input, d_src, None, None, None

    def jvp(primals, tangents):
        x, src, size, stride, storage_offset = primals
        _check_owns_storage("torch.as_strided_scatter", x, offset_matters=False)
        out = torch.as_strided_scatter(x, src, size, stride, storage_offset)
        t_x, t_src = tangents[0], tangents[1]
        if t_x is None and t_src is None:
            return out, None
        guard_layout(x, "torch.as_strided_scatter", None, False)
        t_x = torch.zeros_like(x) if t_x is None else t_x.contiguous()
        if t_src is None:
            t_src = torch.zeros_like(src)
        return out, torch.as_strided_scatter(t_x, t_src, size, stride, storage_offset)

    def samples(dtype):
        yield (randn(3, 3, dtype=dtype), randn(2, 2, dtype=dtype), (2, 2), (1, 2)), {}
        yield (randn(3, 3, dtype=dtype), randn(2, 2, dtype=dtype), (2, 2), (1, 2), 1), {}
        yield (randn(3, 3, dtype=dtype), randn(2, 2, dtype=dtype), (2, 2), (2, 1)), \
            {"storage_offset": 0}
        yield (randn(16, dtype=dtype), randn(2, 1, 1, 2, dtype=dtype), (2, 1, 1, 2),
               (1, 2, 4, 8)), {}
        yield (randn(1, dtype=dtype), randn(dtype=dtype), (), ()), {}
