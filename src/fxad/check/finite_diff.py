"""Finite differences: fxad's directional derivative against central differences, with an
a posteriori tolerance (see :mod:`fxad.check`)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from .noise import _RoundingNoise
from .numerics import _NOTES, _eps, _float_leaves, _wide
from .oracle import _Problem
from .report import FD_KERNEL_RTOL, FD_MCA_SAMPLES

@dataclass
class _FD:
    analytic: float
    fd: float
    tol: float
    step: float
    rel: float

    @property
    def err(self) -> float:
        return abs(self.analytic - self.fd)


def _finite_differences(prob: _Problem, grads: list[torch.Tensor], cots: list[torch.Tensor],
                        req: list[bool], gen: torch.Generator, dtype: torch.dtype,
                        fd_eps: float | None) -> _FD:
    """Directional derivative vs central differences (module docstring)."""
    eps = _eps(dtype)
    wrt = prob.wrt()
    dirs = [torch.randn(t.shape, dtype=torch.float64, generator=gen).to(t.device) for t in wrt]
    top = max([float(d.abs().max()) for d in dirs if d.numel()] + [1e-300])
    # (non-finite entries, e.g. the NaNs nansum ignores, stay where they are)
    w = [torch.where(torch.isfinite(_wide(t)), d / top * _wide(t).abs().clamp(min=1.0), 0.0)
         for d, t in zip(dirs, wrt)]
    h = fd_eps if fd_eps is not None else eps ** (1 / 3)

    def value(out: Any) -> float:
        return float(sum(torch.real(torch.sum(torch.conj(_wide(c)) * _wide(o)))
                         for o, c, r in zip(_float_leaves(out), cots, req) if r))

    def magnitude(out: Any) -> float:
        return float(sum(torch.sum(_wide(c).abs() * _wide(o).abs())
                         for o, c, r in zip(_float_leaves(out), cots, req) if r))

    base_out = prob.run()
    g0 = value(base_out)
    x0 = [_wide(t) for t in wrt]

    def at(step: float) -> tuple[float, float, float, float]:
        """(central difference, fxad's directional derivative, one-sided errors e+, e-):
        the displacements are those of the points after rounding to the evaluation dtype."""
        xp = [(x + step * wi).to(t.dtype) for x, t, wi in zip(x0, wrt, w)]
        xm = [(x - step * wi).to(t.dtype) for x, t, wi in zip(x0, wrt, w)]
        gp, gm = value(prob.run(xp)), value(prob.run(xm))

        def inner(a: list[torch.Tensor], b: list[torch.Tensor], absolute: bool = False
                  ) -> float:
            total = 0.0
            for g, u, v in zip(grads, a, b):
                step_ = torch.nan_to_num((_wide(u) - _wide(v)).real, nan=0.0, posinf=0.0,
                                         neginf=0.0)
                gr = _wide(g).real
                total += float(torch.sum(gr.abs() * step_.abs() if absolute else gr * step_))
            return total

        up, down = inner(xp, x0), inner(x0, xm)
        terms = inner(xp, xm, absolute=True) / (2 * step)
        return ((gp - gm) / (2 * step), (up + down) / (2 * step),
                (gp - g0 - up) / step, (g0 - gm - down) / step, terms)

    fd1, an1, ep1, em1, terms = at(h)
    _, _, ep2, em2, _ = at(2 * h)
    s_mag = magnitude(base_out)
    noise_gen = torch.Generator().manual_seed(int(gen.initial_seed()) + 7)
    rho = 0.0
    try:
        for _ in range(FD_MCA_SAMPLES):
            rho = max(rho, abs(value(_run_noisy(prob, _RoundingNoise(dtype, noise_gen))) - g0))
    except Exception as e:  # noqa: BLE001 - e.g. torch.cond under a dispatch mode
        rho = 64 * eps * abs(g0)
        _NOTES.append(f"finite-difference noise estimated as 64 eps |f| (Monte Carlo "
                      f"arithmetic could not run the program: {type(e).__name__})")
    # truncation: the central error changes by 3x itself from h to 2h; a kink within the step
    # shows in the one-sided errors, whose difference is ~h g'' (linear in the step) when
    # smooth: |d(h) - d(2h)/2| is O(h**3) then, O(jump of g') at a kink
    trunc = abs((ep2 + em2) / 2 - (ep1 + em1) / 2)
    kink = abs((ep1 - em1) - (ep2 - em2) / 2)
    tol = 4 * trunc + 4 * kink + 4 * (rho + eps * s_mag) / h \
        + max(FD_KERNEL_RTOL, 16 * eps ** (2 / 3)) * terms
    if not math.isfinite(tol):
        tol = math.inf
    rel = abs(an1 - fd1) / max(1.0, abs(fd1))
    return _FD(an1, fd1, tol, h, rel)


def _run_noisy(prob: _Problem, noise: _RoundingNoise) -> Any:
    with noise:
        return prob.run()

