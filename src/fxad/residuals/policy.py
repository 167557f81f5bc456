"""Residual policies: which forward values the backward may recompute instead of saving.

:class:`Policy` answers, per forward node, ``"save"``, ``"recompute"`` or ``"cheap"``
(recomputable where that saves bytes); :func:`set_residual_policy` sets op-kind defaults
for every policy.  Which ops are cheap is a fact of the op's record
(:attr:`fxad.rules.registry.OpRecord.recompute`: the ``recompute`` declaration of its rule,
else whether it is elementwise or a view).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import torch.fx as fx

from ..errors import InputError
from ..memory import nbytes
from ..naming import op_kind
from ..rules.registry import record_of

__all__ = ["Policy", "set_residual_policy", "as_policy", "saved_cost", "op_kind"]

_GLOBAL_POLICY: dict[str, str] = {}


def _key(k: Any) -> str:
    if isinstance(k, str):
        return k
    name = getattr(k, "__name__", None)
    if name is None:
        raise InputError(f"policy key {k!r}: use an op name such as 'relu' or a torch callable")
    return name


def set_residual_policy(op: Any, choice: str | None) -> None:
    """Register the default residual choice for an op kind: ``"save"`` or ``"recompute"``
    (``None`` removes the entry).  :class:`Policy` overrides still take precedence."""
    if choice is None:
        _GLOBAL_POLICY.pop(_key(op), None)
        return
    if choice not in ("save", "recompute"):
        raise InputError(f"residual policy must be 'save' or 'recompute', not {choice!r}")
    _GLOBAL_POLICY[_key(op)] = choice


@dataclass
class Policy:
    """A residual policy (see :mod:`fxad.residuals`).

    Attributes:
        recompute_cheap: let the min-cut recompute elementwise ops and views.
        by_op: op kind (or callable) → ``"save"`` / ``"recompute"``.
        by_node: node name → ``"save"`` / ``"recompute"`` (wins over ``by_op``).
    """

    recompute_cheap: bool = True
    by_op: Mapping[Any, str] = field(default_factory=dict)
    by_node: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for d in (self.by_op, self.by_node):
            for k, v in d.items():
                if v not in ("save", "recompute"):
                    raise InputError(f"policy for {k!r} must be 'save' or 'recompute', not {v!r}")
        self.by_op = {_key(k): v for k, v in self.by_op.items()}

    def choice(self, node: fx.Node) -> str:
        """``"save"``, ``"recompute"`` (forced) or ``"cheap"`` (recomputable when that saves
        bytes) for a forward node."""
        if node.name in self.by_node:
            return self.by_node[node.name]
        kind = op_kind(node)
        if kind in self.by_op:
            return self.by_op[kind]
        if kind in _GLOBAL_POLICY:
            return _GLOBAL_POLICY[kind]
        if not self.recompute_cheap:
            return "save"
        if node.op not in ("call_function", "call_method"):
            return "save"  # a leaf module's call: saved whatever its rule declares
        rec = record_of(node)
        return "cheap" if rec is not None and rec.recompute else "save"


def as_policy(policy: str | Policy | None) -> Policy:
    if policy is None or policy in ("min_memory", "default"):
        return Policy()
    if policy == "save":
        return Policy(recompute_cheap=False)
    if isinstance(policy, Policy):
        return policy
    raise InputError(f"unknown residual policy {policy!r}: use 'save', 'min_memory' or a "
                     "fxad.residuals.Policy")


def saved_cost(node: fx.Node) -> int:
    """Bytes that saving ``node`` adds: 0 for a lifted parameter (the model holds it)."""
    return 0 if node.meta.get("fxad_param") else nbytes(node)
