"""Helpers shared by the linear-algebra rule modules (and only by them).
"""
from __future__ import annotations

from typing import Any


def _first(d: Any, i: int) -> Any:
    """Entry ``i`` of a tuple cotangent (``None`` when absent)."""
    if isinstance(d, (tuple, list)):
        return d[i] if i < len(d) else None
    return d if i == 0 else None
