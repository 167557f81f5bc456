"""Helpers shared by the built-in rule modules: the ``builtin`` decorator, combinators and
sample-input makers.

A built-in rule is a class holding ``fwd``, ``bwd`` and optionally ``jvp`` and ``samples``
as plain functions (see :mod:`fxad.rules.registry` for the contract).  Its docstring names
the formula's source.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, Iterable

import torch

from .registry import add_rule


def builtin(*ops: Any) -> Callable[[type], type]:
    """Register the decorated rule class for each op in ``ops`` (built-in rules)."""

    def deco(cls: type) -> type:
        d = cls.__dict__
        for op in ops:
            add_rule(op, _fn(d["fwd"]), _fn(d["bwd"]), jvp=_fn(d.get("jvp")),
                     samples=_fn(d.get("samples")), source=inspect.getdoc(cls) or "",
                     builtin=True, residuals=d.get("residuals"), recompute=d.get("recompute"))
        return cls

    return deco


def _fn(f: Any) -> Any:
    return f.__func__ if isinstance(f, (staticmethod, classmethod)) else f


def unary(op: Callable, *, save: str, derivative: Callable[[Any, Any], Any], source: str,
          domain: tuple[float, float] = (-2.0, 2.0), residuals: str | None = None) -> None:
    """Register an elementwise unary rule ``y = op(x)`` with ``dx = dy * derivative(x_or_y)``.

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

    add_rule(op, fwd, bwd, jvp=jvp, samples=samples, source=source, builtin=True,
             residuals=residuals or ("inputs" if save == "input" else "output"), recompute=True)


def value_of(x: Any) -> Any:
    """The value behind ``x``: a proxy's ``meta['val']`` (a fake tensor), else ``x`` itself."""
    import torch.fx as fx

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
