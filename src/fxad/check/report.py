"""What a check reports (:class:`CheckReport`) and the tolerances it states (see
:mod:`fxad.check` for where they come from)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["CheckReport", "ROUNDING_FACTOR", "MCA_SAMPLES", "FD_MCA_SAMPLES", "FD_KERNEL_RTOL"]

#: allowed ratio of fxad's ``D`` error to the rounding noise of the computation
ROUNDING_FACTOR = 8.0
#: Monte Carlo arithmetic runs per noise estimate of the cotangents, and of ``g(x)`` for the
#: finite-difference tolerance
MCA_SAMPLES = 4
FD_MCA_SAMPLES = 3
#: finite differences do not blame a rule for differences below this fraction of the
#: directional derivative's terms (module docstring)
FD_KERNEL_RTOL = 1e-6


@dataclass
class CheckReport:
    """Result of a successful :func:`check`.

    Attributes:
        dtype: dtype the check ran in (the lowest-precision floating dtype of the program for
            ``dtype=None``).
        n_inputs: number of differentiable inputs checked.
        n_params: number of parameters checked.
        max_abs_err: largest ``|fxad - autograd|`` over all cotangents, both in ``dtype``.
        fd_directional: (fxad, finite differences) directional derivatives.
        fd_rel_err: their relative difference ``|a - b| / max(1, |b|)``.
        compared: names of the compared cotangents.
        fd_tol: the finite-difference tolerance on ``|a - b|`` (see the module docstring).
        fd_step: the finite-difference step ``h``.
        formula_dtype: dtype of the formula check and finite differences (float64, or
            ``dtype`` when the function cannot run in float64).
        formula_max_abs_err: largest ``|fxad - autograd|`` in ``formula_dtype``.
        rounding_ratio: for ``dtype`` other than float64, the largest ratio of fxad's error
            to the rounding noise of the computation (fails above ``ROUNDING_FACTOR``).
        rounding_worst: the output or cotangent where that ratio is largest.
        notes: remarks (e.g. why float64 was not available).
    """

    dtype: torch.dtype
    n_inputs: int
    n_params: int
    max_abs_err: float
    fd_directional: tuple[float, float]
    fd_rel_err: float
    compared: list[str] = field(default_factory=list)
    fd_tol: float = 0.0
    fd_step: float = 0.0
    formula_dtype: torch.dtype = torch.float64
    formula_max_abs_err: float = 0.0
    rounding_ratio: float | None = None
    rounding_worst: str = ""
    notes: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        a, b = self.fd_directional
        text = (f"fxad.check passed ({self.dtype}): {self.n_inputs} input(s), {self.n_params} "
                f"parameter(s); max |fxad - autograd| = {self.max_abs_err:.3g}")
        if self.rounding_ratio is not None:
            text += (f" (error / rounding noise <= {self.rounding_ratio:.2g} at "
                     f"{self.rounding_worst}, allowed {ROUNDING_FACTOR:g}); formulas in "
                     f"{self.formula_dtype}: max |fxad - autograd| = "
                     f"{self.formula_max_abs_err:.3g}")
        text += (f"; directional derivative fxad {a:.10g} vs finite differences {b:.10g} "
                 f"(rel. err {self.fd_rel_err:.2g}; allowed |diff| {self.fd_tol:.2g})")
        for note in self.notes:
            text += f"; note: {note}"
        return text

