"""Helpers shared by the ``torch.nn.functional`` rule modules (and only by them): the JVP
argument binder ``_bound``, tuple/argument normalizers and the spatial contraction of the
pools and the resamplers.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable

import torch

from ...errors import RuleError
from .._base import _error


def _bound(fwd: Callable, primals: tuple, tangents: tuple) -> tuple[dict, dict]:
    """JVP helper: positional ``primals`` / ``tangents`` (in ``fwd``'s parameter order) as dicts
    by parameter name, defaults filled in, missing tangents ``None``."""
    b = inspect.signature(fwd).bind(*primals)
    names = list(b.arguments)
    b.apply_defaults()
    t = {n: None for n in b.arguments}
    t.update({n: v for n, v in zip(names, tangents)})
    return dict(b.arguments), t


def _mul(a: Any, b: Any) -> Any:
    """``a * b`` where ``b`` may be ``None`` (meaning 1)."""
    return a if b is None else a * b


def _pair(v: Any, what: str = "argument") -> tuple[int, int]:
    if isinstance(v, int):
        return (v, v)
    v = tuple(v)
    if len(v) == 1:
        return (v[0], v[0])
    if len(v) != 2:
        raise RuleError(f"expected an int or a pair for {what}, got {v!r}")
    return (v[0], v[1])


# --- pooling and resampling shapes -----------------------------------------------------------


def _ntuple(v: Any, n: int, what: str = "argument") -> tuple:
    """``v`` as an ``n``-tuple (an int or a 1-sequence is repeated)."""
    if isinstance(v, (int, float)):
        return (v,) * n
    v = tuple(v)
    if len(v) == 1:
        return v * n
    if len(v) != n:
        raise _error("pooling", f"expected {n} values for {what}, got {v!r}",
                     f"pass an int or a sequence of {n} ints")
    return v


_SPATIAL = "xyz"


def _contract_spatial(d: Any, mats: list) -> Any:
    """Contract the last ``len(mats)`` dims of ``d`` with the matrices: dim k of size m_k
    becomes size n_k through ``mats[k]`` of shape (m_k, n_k)."""
    nd = len(mats)
    src, dst = _SPATIAL[:nd], _SPATIAL[:nd].upper()
    spec = f"...{src}," + ",".join(f"{a}{b}" for a, b in zip(src, dst)) + f"->...{dst}"
    return torch.einsum(spec, d, *mats)


_aten = torch.ops.aten
