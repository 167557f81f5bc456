"""The comparisons of a check: structure, the elementwise formula check against autograd,
the rounding check of a low-precision dtype, and one full comparison of a problem (the whole
function, or a prefix of its graph) on the formula side (with finite differences) or the
rounding side."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from .finite_diff import _finite_differences
from .noise import _RoundingNoise
from .numerics import _NOTES, _float_leaves, _norm, _underflow, _wide
from .oracle import _Problem, _draw_cotangents, _program_eps_of
from .report import MCA_SAMPLES, ROUNDING_FACTOR

@dataclass
class _Failure:
    kind: str                      # "structure", "formula", "fd", "rounding"
    message: str
    names: list[str] = field(default_factory=list)


def _structure(names: list[str], mine: list[Any], ag: list[torch.Tensor]) -> _Failure | None:
    for name, a, b in zip(names, mine, ag):
        if a is None:
            return _Failure("structure", f"fxad returned no cotangent for {name}", [name])
        if a.shape != b.shape:
            return _Failure("structure", f"cotangent of {name}: fxad shape {tuple(a.shape)}, "
                            f"autograd {tuple(b.shape)}", [name])
    return None


def _formula(names: list[str], out_fx: list[torch.Tensor], out_ag: list[torch.Tensor],
             mine: list[torch.Tensor], ag: list[torch.Tensor], atol: float, rtol: float,
             dtype: torch.dtype) -> tuple[_Failure | None, float]:
    """Elementwise ``torch.allclose`` of outputs and cotangents (the float64 formula check)."""
    for k, (o_fx, o_ag) in enumerate(zip(out_fx, out_ag)):
        if o_fx.shape != o_ag.shape or not torch.allclose(o_fx, o_ag, atol=atol, rtol=rtol,
                                                          equal_nan=True):
            d = (o_fx - o_ag).abs().max().item() if o_fx.shape == o_ag.shape else math.nan
            return _Failure("formula", f"fxad's forward output #{k} differs from eager ({dtype}): "
                            f"max |diff| = {d:.3g}", [f"output #{k}"]), 0.0
    worst = 0.0
    bad: list[str] = []
    first = ""
    for name, a, b in zip(names, mine, ag):
        diff = (a - b).abs()
        err = diff.max().item() if diff.numel() else 0.0
        worst = max(worst, err) if math.isfinite(err) else math.inf
        if not torch.allclose(a, b, atol=atol, rtol=rtol) or not math.isfinite(err):
            bad.append(name)
            if not first:
                flat = torch.nan_to_num(diff, nan=math.inf)
                where = tuple(int(k) for k in torch.nonzero(flat == flat.max())[0]) \
                    if diff.numel() else ()
                first = (f"cotangent of {name} disagrees with torch.autograd ({dtype}): max "
                         f"|fxad - autograd| = {err:.3g} at index {where} (fxad "
                         f"{a[where].item():.6g}, autograd {b[where].item():.6g})")
    if bad:
        more = f"; also {', '.join(bad[1:])}" if len(bad) > 1 else ""
        return _Failure("formula", first + more, bad), worst
    return None, worst


def _rounding(names: list[str], dtype: torch.dtype, eps: float,
              fx_vals: list[torch.Tensor], ag_vals: list[torch.Tensor],
              ref_vals: list[torch.Tensor], mca_vals: list[list[torch.Tensor]],
              ref_desc: str = "the float64 autograd reference"
              ) -> tuple[_Failure | None, float, str]:
    """fxad's ``D`` values vs the reference, against the rounding noise (module docstring);
    returns (failure, largest ratio, where)."""
    worst, worst_name = 0.0, ""
    bad: list[tuple[str, str]] = []
    for k, name in enumerate(names):
        a, b, r = _wide(fx_vals[k]), _wide(ag_vals[k]), _wide(ref_vals[k])
        fin_a, fin_b = torch.isfinite(a), torch.isfinite(b)
        same_nonfinite = (~fin_a & ~fin_b & ((a == b) | (torch.isnan(a) & torch.isnan(b))))
        if bool((~fin_a & ~same_nonfinite).any()):
            bad.append((name, f"fxad's {dtype} value of {name} is inf/nan where autograd's "
                              f"{dtype} value is not"))
            worst, worst_name = math.inf, name
            continue
        keep = fin_a & fin_b & torch.isfinite(r)
        zero = torch.zeros((), dtype=a.dtype, device=a.device)
        a, b, r = torch.where(keep, a, zero), torch.where(keep, b, zero), \
            torch.where(keep, r, zero)
        e_fx = _norm(a - r)
        floor = eps / 2 * _norm(r) + _underflow(dtype) * math.sqrt(r.numel())
        noise = max([_norm(b - r), floor] +
                    [_norm(torch.where(keep, _wide(s[k]), zero) - r) for s in mca_vals
                     if torch.isfinite(_wide(s[k])[keep]).all()])
        ratio = 0.0 if e_fx == 0 else (e_fx / noise if noise > 0 else math.inf)
        if ratio > worst or not worst_name:
            worst, worst_name = max(worst, ratio), name
        if ratio > ROUNDING_FACTOR:
            bad.append((name, f"{name}: |fxad - reference| = {e_fx:.3g} is {ratio:.3g}x the "
                              f"rounding noise ({noise:.3g}; autograd's {dtype} error "
                              f"{_norm(b - r):.3g})"))
    if bad:
        return _Failure("rounding", f"fxad's {dtype} result differs from {ref_desc} by more "
                        f"than {dtype} rounding explains (allowed {ROUNDING_FACTOR:g}x the "
                        "noise, 2-norms): "
                        + "; ".join(m for _, m in bad), [n for n, _ in bad]), worst, worst_name
    return None, worst, worst_name


@dataclass
class _Setup:
    atol: float
    rtol: float
    fd_eps: float | None
    fd_rtol: float | None
    seed: int


def _formula_side(prob: _Problem, g: Any, st: _Setup, gen: torch.Generator,
                  cots: list[torch.Tensor] | None = None, with_fd: bool = True,
                  elementwise: bool = True) -> tuple[_Failure | None, dict]:
    """Formula check (elementwise vs autograd; skipped with ``elementwise=False``, when both
    run in a low-precision dtype and the rounding check compares them instead) and finite
    differences of ``prob`` in its own dtype."""
    out_ref = prob.run()
    outs = _float_leaves(out_ref)
    if cots is None:
        cots = _draw_cotangents(outs, gen)
    cots = [c.to(o.dtype) for c, o in zip(cots, outs)]
    out_fx, mine = prob.fxad(g, out_ref, cots)
    out_ag, ag, req = prob.autograd(cots)
    info: dict = {"cots": cots, "mine": mine, "ag": ag, "out_fx": out_fx, "out_ag": out_ag,
                  "req": req, "out_ref": out_ref, "max_abs": 0.0}
    fail = _structure(prob.names, mine, ag)
    if fail is not None:
        return fail, info
    dtype = next((t.dtype for t in prob.wrt()), torch.float64)
    if elementwise:
        fail, info["max_abs"] = _formula(prob.names, out_fx, out_ag, mine, ag, st.atol,
                                         st.rtol, dtype)
    else:
        info["max_abs"] = max([float(torch.nan_to_num((_wide(a) - _wide(b)).abs()).max())
                               for a, b in zip(mine, ag) if a.numel()] + [0.0])
    if fail is not None or not with_fd:
        return fail, info
    _, eval_dtype = _program_eps_of(prob, outs)
    fd = _finite_differences(prob, mine, cots, req, gen, eval_dtype, st.fd_eps)
    if st.fd_rtol is not None:  # the caller's fixed tolerance replaces the estimate
        fd.tol = st.fd_rtol * max(1.0, abs(fd.fd))
    info["fd"] = fd
    too_far = not fd.err <= fd.tol
    if too_far:
        allowed = (f"allowed rel. err {st.fd_rtol:.2g}" if st.fd_rtol is not None
                   else f"allowed |diff| {fd.tol:.3g}")
        return _Failure("fd", f"directional derivative disagrees with finite differences "
                        f"({dtype}, step {fd.step:.3g}): fxad {fd.analytic:.10g}, central "
                        f"difference {fd.fd:.10g} (|diff| {fd.err:.3g}, rel. err {fd.rel:.2g}; "
                        f"{allowed})", list(prob.names)), info
    return None, info


def _rounding_side(probD: _Problem, gD: Any, ref: _Problem, eps: float, dtype: torch.dtype,
                   gen: torch.Generator, cots: list[torch.Tensor] | None = None
                   ) -> tuple[_Failure | None, dict]:
    """fxad in ``D`` vs the reference problem ``ref`` (float64, or ``probD`` itself)."""
    out_ref = probD.run()
    outs = _float_leaves(out_ref)
    if cots is None:
        cots = _draw_cotangents(outs, gen)
    cots = [c.to(o.dtype) for c, o in zip(cots, outs)]
    out_fx, mine = probD.fxad(gD, out_ref, cots)
    out_ag, ag, req = probD.autograd(cots)
    info: dict = {"cots": cots, "mine": mine, "ag": ag, "req": req, "out_ref": out_ref,
                  "max_abs": 0.0, "ratio": 0.0}
    fail = _structure(probD.names, mine, ag)
    if fail is not None:
        return fail, info
    info["max_abs"] = max([float((_wide(a) - _wide(b)).abs().max()) for a, b in zip(mine, ag)
                           if a.numel()] + [0.0])
    wide_cots = [_wide(c) for c in cots]
    r_out, r_grads, _ = ref.autograd(wide_cots)
    noise_gen = torch.Generator().manual_seed(int(gen.initial_seed()) + 11)
    try:
        mca = [ref.autograd(wide_cots, _RoundingNoise(dtype, noise_gen))
               for _ in range(MCA_SAMPLES)]
    except Exception as e:  # noqa: BLE001 - e.g. torch.cond, which a dispatch mode cannot run
        mca = []
        _NOTES.append(f"rounding noise estimated without Monte Carlo arithmetic "
                      f"({type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''}): "
                      f"from autograd's own {dtype} error and one rounding")
    n_out = len(out_fx)
    names = [f"output #{k}" for k in range(n_out)] + probD.names
    fail, info["ratio"], info["worst"] = _rounding(
        names, dtype, eps, list(out_fx) + list(mine), list(out_ag) + list(ag),
        list(r_out) + list(r_grads), [list(o) + list(g) for o, g, _ in mca],
        "the float64 autograd reference" if ref is not probD else f"torch.autograd in {dtype}")
    return fail, info

