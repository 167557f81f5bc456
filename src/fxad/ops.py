"""Functional helpers that fxad writes into generated code where torch has no out-of-place form.

They are registered as torch.fx "custom builtins", so code saved with
``GraphModule.to_folder`` imports them (``from fxad.ops import setitem as fxad_setitem``).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx


def setitem(x: torch.Tensor, index: Any, value: Any) -> torch.Tensor:
    """Out-of-place ``x[index] = value``: a copy of ``x`` with ``value`` written at ``index``.

    Args:
        x: tensor of any shape/dtype.
        index: anything valid in ``x[index]`` (ints, slices, None, Ellipsis, tensors).
        value: tensor or Python number broadcastable to ``x[index].shape``.

    Returns:
        New tensor, same shape/dtype/device as ``x``; ``x`` is not modified.
    """
    if isinstance(x, torch.fx.Proxy):  # called by a rule while writing graph code
        return x.tracer.create_proxy("call_function", setitem, (x, index, value), {})
    out = x.clone()
    out[index] = value
    return out


def _register_builtins() -> None:
    try:
        from torch.fx.graph import _register_custom_builtin
    except ImportError:  # pragma: no cover - very old torch
        return
    _register_custom_builtin("fxad_setitem", "from fxad.ops import setitem as fxad_setitem", setitem)


_register_builtins()
