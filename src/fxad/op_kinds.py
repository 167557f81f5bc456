"""Op kinds by name, for the residual policies and the memory simulation.

:func:`op_kind` names the op of a graph node as policies spell it (``torch.relu`` →
``"relu"``, ``x.view(...)`` → ``"view"``); :data:`VIEW_OPS` are the ops whose result shares
its input's storage (:mod:`fxad.memory`), :data:`ELEMENTWISE_OPS` the pointwise ones, and
:data:`CHEAP_OPS` (both) the ops the ``"min_memory"`` residual policy may recompute when their
rule declares nothing (:mod:`fxad.residuals`).

This module sits with the graph passes (it imports only torch), so that :mod:`fxad.memory`
and :mod:`fxad.residuals` read the same sets.
"""
from __future__ import annotations

import torch
import torch.fx as fx

__all__ = ["op_kind", "ELEMENTWISE_OPS", "VIEW_OPS", "CHEAP_OPS"]

ELEMENTWISE_OPS = frozenset({
    "add", "sub", "mul", "truediv", "div", "neg", "pow", "rsub", "floordiv", "mod",
    "abs", "exp", "log", "log1p", "expm1", "sqrt", "rsqrt", "sin", "cos", "tanh", "sigmoid",
    "relu", "gelu", "silu", "elu", "leaky_relu", "softplus", "hardtanh", "sign", "reciprocal",
    "square", "erf", "clamp", "clamp_min", "clamp_max", "where", "maximum", "minimum",
    "eq", "ne", "lt", "le", "gt", "ge", "logical_not", "logical_and", "logical_or",
    "to", "float", "half", "bfloat16", "double", "type_as", "clone", "contiguous",
    "masked_fill", "lerp", "addcmul", "addcdiv", "ones_like", "zeros_like", "full_like",
})
VIEW_OPS = frozenset({
    "view", "reshape", "flatten", "unflatten", "transpose", "t", "permute", "unsqueeze",
    "squeeze", "expand", "expand_as", "view_as", "reshape_as", "getitem", "split", "chunk",
    "unbind", "narrow", "select", "movedim", "swapaxes", "unfold", "detach", "alias",
})
CHEAP_OPS = ELEMENTWISE_OPS | VIEW_OPS


def op_kind(node: fx.Node) -> str:
    """The op kind used by policies: ``torch.relu`` → ``"relu"``, ``operator.mul`` →
    ``"mul"``, ``x.view(...)`` → ``"view"``, ``torch.ops.aten.foo`` → ``"foo"``."""
    t = node.target
    if node.op == "call_method":
        return str(t)
    if node.op == "call_function":
        name = getattr(t, "__name__", None) or str(t)
        if isinstance(t, torch._ops.OpOverloadPacket) or isinstance(t, torch._ops.OpOverload):
            name = str(t).split(".")[-2] if isinstance(t, torch._ops.OpOverload) else t.__name__
        return name.rsplit(".", 1)[-1]
    return node.op
