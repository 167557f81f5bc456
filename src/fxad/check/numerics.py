"""Numerical helpers of the check: dtype precision (:func:`_eps`, :func:`_underflow`),
widening to float64, casts of pytrees, and the notes collected while checking."""
from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree

def _cast(x: Any, dtype: torch.dtype | None) -> Any:
    def f(v: Any) -> Any:
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            return v.detach().to(dtype) if dtype is not None else v.detach().clone()
        return v
    return pytree.tree_map(f, x)


def _float_leaves(x: Any) -> list[torch.Tensor]:
    return [v for v in pytree.tree_leaves(x) if isinstance(v, torch.Tensor)
            and (v.is_floating_point() or v.is_complex())]


def _eps(dtype: torch.dtype) -> float:
    if dtype.is_complex:
        dtype = torch.float32 if dtype == torch.complex64 else \
            torch.float16 if dtype == torch.complex32 else torch.float64
    return float(torch.finfo(dtype).eps)


def _wide(t: torch.Tensor) -> torch.Tensor:
    """``t`` in float64 (complex128 for complex tensors)."""
    return t.detach().to(torch.complex128 if t.is_complex() else torch.float64)


def _norm(t: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(t)) if t.numel() else 0.0


def _underflow(dtype: torch.dtype) -> float:
    """Half the smallest subnormal of ``dtype``: the absolute rounding error near zero."""
    if dtype.is_complex:
        dtype = torch.float32 if dtype == torch.complex64 else \
            torch.float16 if dtype == torch.complex32 else torch.float64
    fi = torch.finfo(dtype)
    return float(fi.smallest_normal) * float(fi.eps) / 2


# remarks made while checking (fallbacks of the noise estimates), collected into the report
_NOTES: list[str] = []
