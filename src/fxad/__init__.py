"""fxad: readable source-to-source automatic differentiation for PyTorch, built on torch.fx.

>>> import torch, fxad
>>> g = fxad.vjp(lambda x: torch.sin(x) + x, torch.randn(3))
>>> out, (d_x,) = g(torch.zeros(3), torch.ones(3))
>>> d_x
tensor([2., 2., 2.])
"""
from __future__ import annotations

from ._version import __version__
from .rules import builtin as _builtin  # noqa: F401  (registers the built-in rules)
from .api import ModeWarning, VJPModule, code_with_shapes, grad, show, trace, vjp
from .check import CheckReport, check
from .higher import BatchedDerivative, JVPModule, hessian, hvp, jacfwd, jacrev, jvp
from .errors import (CaptureError, CheckError, DataDependentError, FxadError, InplaceError,
                     InputError, MissingRuleError, RuleError, SourceLoc, ValueGuardError)
from .rules.fused import fused_kernels
from .rules.fallback import FallbackWarning  # noqa: F401  (fxad.FallbackWarning)
from .residuals import Partition, Policy, partition, set_residual_policy
from .training import FxadModule, compile, joint_step
from .rules.registry import Rule, all_rules, lookup, register_vjp, unregister
from . import plot  # noqa: E402  (fxad.plot.memory/coverage; matplotlib loads on use)
from .view import View, view  # noqa: E402  (the function shadows the module name)
from .eject import eject  # noqa: E402  (the function shadows the module name)


__all__ = [
    "fused_kernels", "trace", "vjp", "grad", "check", "show", "code_with_shapes", "register_vjp", "lookup",
    "all_rules", "unregister", "Rule", "CheckReport", "VJPModule", "ModeWarning", "FxadError",
    "CaptureError", "DataDependentError", "InplaceError", "MissingRuleError", "RuleError",
    "CheckError", "InputError", "ValueGuardError", "SourceLoc", "jvp", "hvp", "jacrev", "jacfwd", "hessian",
    "JVPModule", "BatchedDerivative", "compile", "FxadModule", "joint_step", "partition",
    "Partition", "Policy", "set_residual_policy", "view", "View", "plot", "eject",
]
