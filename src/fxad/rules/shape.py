"""Rules for shape ops, views, indexing, joins/splits and casts.

These are linear maps whose transpose is another shape op: reshape ↔ reshape, permute ↔
inverse permute, cat ↔ split, stack ↔ unbind, indexing ↔ scatter into zeros
(derivatives.yaml entries `view`, `permute`, `transpose.int`, `cat`, `stack`, `split.Tensor`,
`index.Tensor`, `slice.Tensor`, `expand`).
"""
from __future__ import annotations

import operator
from typing import Any

import torch

from .. import ops
from ._base import builtin, randn


def _has_tensor_index(index: Any) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) or hasattr(i, "node") or isinstance(i, list)
               for i in items)


@builtin(operator.getitem)
class GetItem:
    """x[index] with ints, slices, None, Ellipsis and integer/bool tensors.  Basic indexing:
    d_x = zeros with d written at ``index``; advanced indexing (repeated indices possible):
    d is accumulated at the selected flat positions with ``index_add`` (derivatives.yaml
    `index.Tensor`: index_put with accumulate=True)."""

    def fwd(input, index):
        return input[index], (input, index)

    def bwd(aux, d):
        x, index = aux
        if not _has_tensor_index(index):
            return ops.setitem(torch.zeros_like(x), index, d), None
        n = x.numel()
        positions = torch.reshape(torch.arange(n, device=x.device), tuple(x.shape))[index]
        flat = torch.zeros(n, dtype=x.dtype, device=x.device).index_add(
            0, torch.reshape(positions, (-1,)), torch.reshape(d, (-1,)))
        return torch.reshape(flat, tuple(x.shape)), None

    def jvp(primals, tangents):
        (x, index), tx = primals, tangents[0]
        return x[index], tx[index]

    def samples(dtype):
        x = randn(4, 5, dtype=dtype)
        yield (x, (slice(None), None, Ellipsis, slice(1, 3))), {}
        yield (x, 2), {}
        yield (x, (slice(None, None, 2), -1)), {}
        yield (x, torch.tensor([0, 2, 2, 3])), {}
        yield (x, (slice(None), torch.tensor([[1, 1], [0, 4]]))), {}


@builtin(ops.setitem)
class SetItem:
    """Functional ``x[index] = v``: d_x = d with ``index`` zeroed, d_v = d[index]
    (derivatives.yaml `index_put`)."""

    def fwd(x, index, value):
        return ops.setitem(x, index, value), index

    def bwd(index, d):
        return ops.setitem(d, index, 0.0), None, d[index]

    def jvp(primals, tangents):
        (x, index, value), (tx, _, t_value) = primals, tangents
        base = torch.zeros_like(x) if tx is None else tx
        return ops.setitem(x, index, value), ops.setitem(base, index,
                                                        0.0 if t_value is None else t_value)

    def samples(dtype):
        yield (randn(4, 5, dtype=dtype), (slice(1, 3),), randn(5, dtype=dtype)), {}
        yield (randn(4, 5, dtype=dtype), (0, slice(None)), 1.5), {}


@builtin(torch.reshape)
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


@builtin(torch.flatten)
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


@builtin(torch.squeeze)
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


@builtin(torch.unsqueeze)
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


@builtin(torch.permute)
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


@builtin(torch.transpose)
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


@builtin(torch.t)
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


@builtin(torch.Tensor.expand)
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


@builtin(torch.Tensor.sum_to_size)
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


@builtin(torch.Tensor.repeat)
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


@builtin(torch.flip)
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


@builtin(torch.movedim)
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


def _triangular(op: Any) -> None:
    from .registry import add_rule

    def fwd(input, diagonal=0):
        return op(input, diagonal), diagonal

    def bwd(diagonal, d):
        return (op(d, diagonal),)

    def jvp(primals, tangents):
        return op(*primals), op(tangents[0], primals[1])

    def samples(dtype):
        yield (randn(4, 4, dtype=dtype),), {}
        yield (randn(2, 3, 4, dtype=dtype), 1), {}

    add_rule(op, fwd, bwd, jvp=jvp, samples=samples, builtin=True,
             source=f"{op.__name__}(x, k): the same mask applied to d (derivatives.yaml "
                    f"`{op.__name__}`)")


_triangular(torch.tril)
_triangular(torch.triu)


@builtin(torch.cat, torch.concat, torch.concatenate)
class Cat:
    """cat(xs, dim): d_xs = split(d, sizes, dim) (derivatives.yaml `cat`)."""

    def fwd(tensors, dim=0):
        return torch.cat(tensors, dim), ([t.shape[dim] for t in tensors], dim)

    def bwd(aux, d):
        sizes, dim = aux
        parts = torch.split(d, sizes, dim)
        return ([parts[i] for i in range(len(sizes))],)

    def jvp(primals, tangents):
        (xs, dim), ts = primals, tangents[0]
        return torch.cat(xs, dim), torch.cat(_filled(xs, ts), dim)

    def samples(dtype):
        yield ([randn(2, 3, dtype=dtype), randn(4, 3, dtype=dtype)],), {}
        yield ([randn(2, 3, dtype=dtype), randn(2, 1, dtype=dtype)], 1), {}


@builtin(torch.stack)
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


@builtin(torch.split)
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


@builtin(torch.chunk)
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


@builtin(torch.unbind)
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


@builtin(torch.gather)
class Gather:
    """gather(x, dim, idx): d_x = zeros.scatter_add(dim, idx, d) (derivatives.yaml `gather`)."""

    def fwd(input, dim, index, *, sparse_grad=False):
        return torch.gather(input, dim, index), (input, dim, index)

    def bwd(aux, d):
        x, dim, index = aux
        return torch.zeros_like(x).scatter_add(dim, index, d), None, None

    def jvp(primals, tangents):
        (x, dim, index, _), tx = primals, tangents[0]
        return torch.gather(x, dim, index), torch.gather(tx, dim, index)

    def samples(dtype):
        yield (randn(3, 4, dtype=dtype), 1, torch.tensor([[0, 0], [1, 3], [2, 2]])), {}


def _zeros_if_none(t: Any, like: Any) -> Any:
    return torch.zeros_like(like) if t is None else t


@builtin(torch.scatter_add)
class ScatterAdd:
    """scatter_add(x, dim, idx, src): d_x = d, d_src = gather(d, dim, idx) (derivatives.yaml
    `scatter_add`).  Linear in (x, src): the JVP is the same scatter_add of the tangents.
    Needed to differentiate the backward of ``gather`` / ``max_pool2d`` a second time."""

    def fwd(input, dim, index, src):
        return torch.scatter_add(input, dim, index, src), (dim, index)

    def bwd(aux, d):
        dim, index = aux
        return d, None, None, torch.gather(d, dim, index)

    def jvp(primals, tangents):
        (x, dim, index, src), (tx, _, _, t_src) = primals, tangents
        return (torch.scatter_add(x, dim, index, src),
                torch.scatter_add(_zeros_if_none(tx, x), dim, index, _zeros_if_none(t_src, src)))

    def samples(dtype):
        yield (randn(3, 4, dtype=dtype), 1, torch.tensor([[0, 0], [1, 3], [2, 2]]),
               randn(3, 2, dtype=dtype)), {}


@builtin(torch.scatter)
class Scatter:
    """scatter(x, dim, idx, src): d_x = d with the written positions zeroed, d_src =
    gather(d, dim, idx) (derivatives.yaml `scatter.src`, `scatter.value`); indices are assumed
    unique, as PyTorch's own derivative does."""

    def fwd(input, dim, index, src):
        return torch.scatter(input, dim, index, src), (dim, index, _is_tensor(src))

    def bwd(aux, d):
        dim, index, src_is_tensor = aux
        return (torch.scatter(d, dim, index, 0.0), None, None,
                torch.gather(d, dim, index) if src_is_tensor else None)

    def jvp(primals, tangents):
        (x, dim, index, src), (tx, _, _, t_src) = primals, tangents
        base = _zeros_if_none(tx, x)
        if not _is_tensor(src):
            return torch.scatter(x, dim, index, src), torch.scatter(base, dim, index, 0.0)
        return (torch.scatter(x, dim, index, src),
                torch.scatter(base, dim, index, _zeros_if_none(t_src, src)))

    def samples(dtype):
        yield (randn(3, 4, dtype=dtype), 1, torch.tensor([[0, 1], [3, 2], [2, 0]]),
               randn(3, 2, dtype=dtype)), {}
        yield (randn(3, 4, dtype=dtype), 1, torch.tensor([[0], [3], [2]]), 0.5), {}


@builtin(torch.index_add)
class IndexAdd:
    """index_add(x, dim, idx, src, alpha): d_x = d, d_src = alpha * index_select(d, dim, idx)
    (derivatives.yaml `index_add`).  Linear in (x, src).  Needed to differentiate the backward
    of indexing / ``index_select`` a second time."""

    def fwd(input, dim, index, source, *, alpha=1):
        out = torch.index_add(input, dim, index, source) if alpha == 1 else \
            torch.index_add(input, dim, index, source, alpha=alpha)
        return out, (dim, index, alpha)

    def bwd(aux, d):
        dim, index, alpha = aux
        d_src = torch.index_select(d, dim, index)
        return d, None, None, (d_src if alpha == 1 else d_src * alpha)

    def jvp(primals, tangents):
        (x, dim, index, src, alpha), (tx, _, _, t_src, _) = primals, tangents
        kw = {} if alpha == 1 else {"alpha": alpha}
        return (torch.index_add(x, dim, index, src, **kw),
                torch.index_add(_zeros_if_none(tx, x), dim, index, _zeros_if_none(t_src, src), **kw))

    def samples(dtype):
        yield (randn(3, 4, dtype=dtype), 1, torch.tensor([0, 3, 3]), randn(3, 3, dtype=dtype)), {}
        yield (randn(5, dtype=dtype), 0, torch.tensor([1, 1]), randn(2, dtype=dtype)), \
            {"alpha": 2.0}


def _is_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor) or hasattr(x, "node")


@builtin(torch.index_select)
class IndexSelect:
    """index_select(x, dim, idx): d_x = zeros.index_add(dim, idx, d)
    (derivatives.yaml `index_select`)."""

    def fwd(input, dim, index):
        return torch.index_select(input, dim, index), (input, dim, index)

    def bwd(aux, d):
        x, dim, index = aux
        return torch.zeros_like(x).index_add(dim, index, d), None, None

    def jvp(primals, tangents):
        (x, dim, index), tx = primals, tangents[0]
        return torch.index_select(x, dim, index), torch.index_select(tx, dim, index)

    def samples(dtype):
        yield (randn(3, 4, dtype=dtype), 1, torch.tensor([0, 3, 3])), {}


# --- identities and casts -------------------------------------------------------------------

def _identity(op: Any, call: Any) -> None:
    from .registry import add_rule

    def fwd(self, *args, **kwargs):
        return call(self, *args, **kwargs), None

    def bwd(aux, d):
        return (d,)

    def jvp(primals, tangents):  # primals: (self, *args, kwargs)
        x, *args, kwargs = primals
        return call(x, *args, **kwargs), call(tangents[0], *args, **kwargs)

    def samples(dtype):
        yield (randn(3, 4, dtype=dtype),), {}

    add_rule(op, fwd, bwd, jvp=jvp, samples=samples, builtin=True,
             source="identity up to a cast or copy: d_x = d cast back to x's dtype "
                    "(derivatives.yaml `_to_copy`, `clone`)")


_identity(torch.Tensor.to, lambda x, *a, **k: x.to(*a, **k))
_identity(torch.Tensor.contiguous, lambda x, *a, **k: x.contiguous(*a, **k))
_identity(torch.Tensor.clone, lambda x, *a, **k: x.clone(*a, **k))
_identity(torch.clone, lambda x, *a, **k: torch.clone(x, *a, **k))


def _zero_derivative(op: Any) -> None:
    """Ops whose value does not depend differentiably on their tensor inputs."""
    from .registry import add_rule

    def fwd(*args, **kwargs):
        return op(*args, **kwargs), None

    def bwd(aux, d):
        return ()

    def jvp(primals, tangents):  # primals: (*args, kwargs)
        return op(*primals[:-1], **primals[-1]), None

    add_rule(op, fwd, bwd, jvp=jvp, builtin=True,
             source=f"{getattr(op, '__name__', op)} has zero derivative (piecewise constant or "
                    "a new tensor built from shape only)")


for _op in (torch.detach, torch.Tensor.detach, torch.zeros_like, torch.ones_like,
            torch.empty_like, torch.full_like, torch.rand_like, torch.randn_like,
            torch.floor, torch.ceil, torch.round, torch.trunc):
    _zero_derivative(_op)
