"""Helpers shared by the built-in rule modules: the table form :func:`unary`, combinators,
sample-input makers, and the small helpers that several rule families use (defined here once;
a helper used by one family lives in that family's module or package).

A built-in rule is a class holding ``fwd``, ``bwd`` and optionally ``jvp`` and ``samples``
as plain functions, registered with :func:`fxad.rules.registry.register_vjp` (see there for
the contract, the op record and overloads).  Its docstring names the formula's source.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Iterable

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils import _pytree as pytree

from ..errors import InputError, RuleError, SourceLoc
from .registry import register_vjp
from ..naming import code_builtin


def unary(op: Callable, *, save: str, derivative: Callable[[Any, Any], Any], source: str,
          domain: tuple[float, float] = (-2.0, 2.0), residuals: str | None = None) -> None:
    """Register an elementwise unary rule ``y = op(x)`` with ``dx = dy * derivative(x_or_y)``:
    the one table form of rule declaration (a rule class built here and registered with
    :func:`~fxad.rules.registry.register_vjp`; kind ``"elementwise"``, recomputable).

    Args:
        op: the torch function.
        save: ``"input"`` or ``"output"`` — which primal the derivative is written in.
        derivative: ``f(saved) -> f'`` written with torch calls on proxies; the backward
            is ``derivative(saved) * d_out`` and the JVP ``derivative(saved) * t``.
        source: where the formula comes from.
        domain: range of sample inputs used by the tests.
        residuals: the rule's residual declaration (see :mod:`fxad.rules.registry`);
            default ``save`` (``"inputs"`` / ``"output"``); ``"inputs+output"`` when the
            derivative written in the input calls the op again (the simplifier then reads
            the forward's value).
    """
    saved_kind = "inputs" if save == "input" else "output"

    class Unary:
        kind = "elementwise"
        recompute = True
        residuals = None

        def fwd(input: Any) -> tuple[Any, Any]:
            out = op(input)
            return out, (input if save == "input" else out)

        def bwd(aux: Any, d_out: Any) -> tuple[Any]:
            return (conj(derivative(aux)) * d_out,)

        def jvp(primals: tuple, tangents: tuple) -> tuple[Any, Any]:
            (x,), (t,) = primals, tangents
            out = op(x)
            return out, derivative(x if save == "input" else out) * t

        def samples(dtype: torch.dtype) -> Iterable[tuple[tuple, dict]]:
            lo, hi = domain
            yield (uniform((3, 4), lo, hi, dtype),), {}
            yield (uniform((), lo, hi, dtype),), {}

    Unary.residuals = residuals or saved_kind
    Unary.source = source
    register_vjp(op)(Unary)


def value_of(x: Any) -> Any:
    """The value behind ``x``: a proxy's ``meta['val']`` (a fake tensor), else ``x`` itself."""
    return x.node.meta.get("val") if isinstance(x, fx.Proxy) else x


def is_complex(x: Any) -> bool:
    """Whether ``x`` (a tensor or proxy) holds complex values."""
    v = value_of(x)
    return isinstance(v, torch.Tensor) and v.is_complex()


def conj(x: Any) -> Any:
    """``conj(x)`` for complex values (a complex tensor or proxy, a Python complex), ``x``
    itself otherwise, so real code is unchanged.  PyTorch's convention for complex inputs:
    the cotangent of ``z`` in ``y = f(z)``, ``f`` holomorphic, is ``conj(f'(z)) * d_y``."""
    v = value_of(x)
    if isinstance(v, torch.Tensor) and v.is_complex():
        return torch.conj(x)
    if isinstance(x, complex):
        return x.conjugate()
    return x


def uniform(shape: tuple[int, ...], lo: float, hi: float, dtype: torch.dtype) -> torch.Tensor:
    """Sample tensor with entries uniform in ``[lo, hi)``."""
    return torch.rand(shape, dtype=dtype) * (hi - lo) + lo


def randn(*shape: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    return torch.randn(shape, dtype=dtype)


def dims_of(dim: Any, ndim: int) -> tuple[int, ...]:
    """Reduced dimensions as sorted non-negative ints (``None`` or ``()`` → all)."""
    if dim is None or (isinstance(dim, (tuple, list)) and len(dim) == 0):
        return tuple(range(ndim))  # torch reduces over all dims for dim=None and dim=()
    if isinstance(dim, int):
        dim = (dim,)
    if ndim == 0:  # a 0-d tensor: dim 0 / -1 name the tensor itself, nothing to restore
        return ()
    return tuple(sorted(d % ndim for d in dim))


def restore_reduced(d: Any, dims: tuple[int, ...], keepdim: bool) -> Any:
    """Re-insert reduced dimensions (size 1) into a cotangent so it broadcasts to the input."""
    if keepdim or not dims:
        return d
    for k in dims:
        d = torch.unsqueeze(d, k)
    return d


# --- helpers shared by several rule families ------------------------------------------------
# (helpers used by one family live in that family's module, or in its package's _common.py)


# type tests and sample makers

def _is_t(x: Any) -> bool:
    """Whether ``x`` is a tensor or a proxy standing for one (not a Python number)."""
    return isinstance(x, torch.Tensor) or hasattr(x, "node")


def _t(shape: tuple, dtype: torch.dtype, lo: float = -2.0, hi: float = 2.0) -> torch.Tensor:
    """Sample tensor of ``shape`` with entries uniform in ``[lo, hi)``."""
    return uniform(shape, lo, hi, dtype)


def _binary_samples(dtype: torch.dtype, lo: float = -2.0, hi: float = 2.0):
    """Samples of a broadcasting binary op: ``(3, 4)`` with ``(4,)``, and two ``(2, 3)``."""
    yield (_t((3, 4), dtype, lo, hi), _t((4,), dtype, lo, hi)), {}
    yield (_t((2, 3), dtype, lo, hi), _t((2, 3), dtype, lo, hi)), {}


def _spd(n: int, dtype: torch.dtype, *batch: int) -> torch.Tensor:
    """A sample symmetric positive-definite ``(*batch, n, n)`` matrix."""
    a = randn(*batch, n, n, dtype=dtype)
    return a @ a.mT + n * torch.eye(n, dtype=dtype)


# tangents and cotangents with None for zero

def _add(a: Any, b: Any) -> Any:
    """``a + b`` where ``None`` stands for zero (a missing cotangent or tangent)."""
    if a is None:
        return b
    if b is None:
        return a
    return a + b


def _select(cond: Any, a: Any, b: Any) -> Any:
    """``where(cond, a, b)`` for tangents, ``None`` meaning zero."""
    if a is None and b is None:
        return None
    return torch.where(cond, 0.0 if a is None else a, 0.0 if b is None else b)


def _tie_split(a: Any, b: Any, out: Any, d: Any) -> tuple[Any, Any]:
    """Cotangents of a binary max/min ``out`` of ``a`` and ``b``: ``d`` to the selected
    operand, split evenly on ties (derivatives.yaml ``maximum``: ``at::where(self == other,
    grad / 2, grad)`` masked to the selected side)."""
    tie = a == b
    half = d * 0.5
    return (torch.where(tie, half, torch.where(a == out, d, 0.0)),
            torch.where(tie, half, torch.where(b == out, d, 0.0)))


def _tie_select(a: Any, b: Any, out: Any, ta: Any, tb: Any) -> Any:
    """Tangent of a binary max/min: the selected operand's tangent, the mean on ties (the
    transpose of the backward's even split)."""
    return torch.where(a == b, _add(ta, tb) * 0.5, _select(a == out, ta, tb))


def _value_d(d: Any) -> Any:
    """The value's cotangent of an op returning ``(value, indices)`` (or the value)."""
    return d[0] if isinstance(d, (tuple, list)) else d


def _index_back(x: Any, dim: int, idx: Any, d: Any, keepdim: bool = True) -> Any:
    """zeros like x with d scatter-added at idx along dim (idx/d reduced if not keepdim)."""
    if x.dim() == 0:
        return d
    if not keepdim:
        idx, d = torch.unsqueeze(idx, dim), torch.unsqueeze(d, dim)
    return torch.zeros_like(x).scatter_add(dim, idx, d)


# graph code and errors

def _emit(fn: Callable, *args: Any, **kwargs: Any) -> Any:
    """Call ``fn`` as *one* graph node when an argument is a proxy (so a public composite such
    as ``torch.nn.grad.conv2d_input`` appears in the generated code as written, instead of
    being traced into its internals); call it directly on real tensors."""
    fn = getattr(fn, "__wrapped__", fn)  # capture's recording wrapper -> the function itself
    for a in pytree.tree_leaves((args, kwargs)):
        if isinstance(a, fx.Proxy):
            return a.tracer.create_proxy("call_function", fn, args, kwargs)
    return fn(*args, **kwargs)


def _meta(x: Any) -> Any:
    """The (fake or real) tensor behind ``x`` for reading its layout."""
    m = getattr(x, "meta", None)
    return m if isinstance(m, torch.Tensor) else x


def _error(op: str, message: str, hint: str) -> RuleError:
    """A :class:`~fxad.errors.RuleError` for ``op`` with a hint on what to change."""
    return RuleError(f"{op}: {message}", op=op, hint=hint)


# guard lines on the memory layout a rule's code was written for

def _layout_text(layout: Any, offset_zero: bool) -> str:
    if layout == "last":
        return "laid out with stride 1 in its last dimension"
    dense = "contiguous" if layout is None else f"dense in the order of .permute{layout}"
    return f"{dense} with storage offset 0" if offset_zero else dense


def _laid_out(x: torch.Tensor, layout: Any) -> bool:
    if layout == "last":
        return x.dim() == 0 or x.shape[-1] <= 1 or x.stride(-1) == 1
    return x.is_contiguous() if layout is None else x.permute(layout).is_contiguous()


def expect_layout(x: Any, op: str, layout: Any, offset_zero: bool, where: str) -> None:
    """Guard line of generated code after an op whose code (derivative, or a kernel chosen
    for it) was written for the build-time memory layout of its input ``x``
    (``as_strided`` in :mod:`fxad.rules.views`; the CPU flash-attention kernels of
    :mod:`fxad.rules.nn.attention`).

    Args:
        x: the tensor the op reads (any shape and dtype).
        op: the op's name, for the message (``"torch.as_strided"``).
        layout: ``None``: ``x`` must be contiguous; a permutation: ``x.permute(layout)``
            must be contiguous (a transposed or permuted view of a whole tensor);
            ``"last"``: ``x`` must have stride 1 in its last dimension (or that dimension
            has at most one element).
        offset_zero: ``x.storage_offset()`` must be 0 as well (``as_strided`` reads
            absolute storage positions; ``as_strided_scatter`` writes into a fresh clone,
            whose offset is always 0).
        where: the user's line and statement.

    Raises:
        InputError: ``x`` is laid out otherwise; the message names ``where``, the layout
            the code was built for and the strides and storage offset of this call.
    """
    if isinstance(x, (FakeTensor, torch.fx.Proxy)) or x.device.type == "meta":
        return  # a pass computing shapes runs the node: nothing to check
    if _laid_out(x, layout) and (not offset_zero or x.storage_offset() == 0):
        return
    raise InputError(
        f"{where}: {op} reads the memory layout of its input, and the code was built for "
        f"an input that is {_layout_text(layout, offset_zero)}; for these inputs it has "
        f"shape {tuple(x.shape)}, stride {tuple(x.stride())} and storage offset "
        f"{x.storage_offset()}, so the code would not compute this call's values and "
        "derivatives",
        hint="pass inputs laid out like the example inputs (.contiguous()), or rebuild with "
             f"these inputs" + ("" if layout == "last" else
                                f"; or call .contiguous() on the tensor before {op} in the "
                                "program if the strides are meant for its elements in "
                                "row-major order"))


code_builtin("fxad_expect_layout", expect_layout)


def _where(x: Any) -> str:
    """The user's line of the op a rule is writing code for, as guard lines name it (the
    engines stamp it on the nodes they create: ``fxad_fwd_src`` in the forward sweep of
    reverse mode, ``fxad_jvp_src`` in forward mode)."""
    defaults = getattr(getattr(x, "tracer", None), "node_meta_defaults", None) or {}
    loc = next((defaults[k] for k in ("fxad_fwd_src", "fxad_jvp_src", "fxad_bwd_src")
                if isinstance(defaults.get(k), SourceLoc)), None)
    if loc is None:
        return "the traced program"
    return f"{loc.short()} `{loc.code}`" if loc.code else loc.short()


def guard_layout(x: Any, op: str, layout: Any, offset_zero: bool = False) -> None:
    """Write the guard line :func:`expect_layout` on ``x`` (a proxy) into the graph the rule
    writes (arguments as there); nothing for a real tensor or ``None`` (a rule called
    eagerly checks nothing later)."""
    if not isinstance(x, torch.fx.Proxy):
        return
    node = x.tracer.create_proxy("call_function", expect_layout,
                                 (x, op, layout, offset_zero, _where(x)), {},
                                 name="layout_guard").node
    node.meta["val"] = None
    node.meta["fxad_side_effect"] = True
    node.meta["fxad_guard"] = node.args[-1]
    # not one of the statements computing the value: comments name the op's own line
    node.meta.pop("fxad_fwd_of", None)


# formulas shared by several families

_LN2, _LN10 = math.log(2.0), math.log(10.0)


def pnorm_grad(x: Any, norm: Any, p: float, d: Any, dim: Any = None) -> Any:
    """Cotangent of ``vector_norm(x, p)`` given ``norm`` and ``d`` (both with the reduced dims
    kept as size 1): derivatives.yaml ``linalg_vector_norm`` (norm_backward)."""
    p = float(p)
    if p == 0.0:
        return torch.zeros_like(x) * d
    if p == 1.0:
        return torch.sgn(x) * d
    # a zero norm divides by inf instead of being masked after the division: the same values,
    # and a cotangent that stays linear in ``d`` without a 0/0 (forward mode transposes this)
    if p == 2.0:
        return x * (d / torch.where(norm == 0, math.inf, norm))
    if math.isinf(p):
        mask = (torch.abs(x) == norm).to(x.dtype)
        cnt = torch.sum(mask) if dim is None else torch.sum(mask, dim, keepdim=True)
        return torch.sgn(x) * mask * (d / cnt)
    if p < 1.0:
        ax = torch.abs(x)
        scaled = torch.sgn(x) * torch.where(x == 0, 0.0, torch.pow(ax, p - 1))
        return scaled * d * torch.pow(norm, 1 - p)
    if p < 2.0:
        scaled = torch.sgn(x) * torch.pow(torch.abs(x), p - 1)
    else:
        scaled = x * torch.pow(torch.abs(x), p - 2)
    return scaled * (d / torch.pow(torch.where(norm == 0, math.inf, norm), p - 1))


def _excl_cumprod(x: Any, dim: int) -> Any:
    """prod_{j < k} x_j along ``dim`` (1 at k = 0), without division."""
    n = x.shape[dim]
    ones = torch.ones_like(torch.narrow(x, dim, 0, 1))
    return torch.cat([ones, torch.cumprod(torch.narrow(x, dim, 0, n - 1), dim)], dim)
