"""``fxad.check``: compare fxad's VJP with ``torch.autograd`` and with central finite
differences, in any floating dtype, and name the op whose derivative disagrees.

What a check in dtype ``D`` means
---------------------------------
1. **The formulas are right** (checked in float64).  The function, its inputs and its
   parameters are cast to float64 (the *values* of the ``D`` inputs, so both checks look at the
   same point), fxad's VJP is built and run in float64 and compared elementwise with
   ``torch.autograd`` in float64 (``atol``/``rtol``, ``torch.allclose``), and the directional
   derivative along a random direction is compared with central finite differences.  In
   float64 a disagreement above ``rtol = 1e-5`` is ~1e10 units of rounding: a formula error,
   not rounding, even for ill-conditioned ops.  A wrong rule is therefore caught whatever
   ``D`` is, even when its error (1 % say) is below ``D``'s own rounding (bfloat16: 0.4 %).
2. **fxad's code run in D is as accurate as D allows** (``D`` other than float64).  fxad's
   ``D`` cotangents and outputs are compared with the float64 autograd reference ``r``: for
   each compared tensor, ``|fxad_D - r| <= ROUNDING_FACTOR * noise`` (2-norms over the
   tensor), where ``noise`` is the largest of

   * ``|autograd_D - r|``: how far PyTorch's own ``D`` computation lands from the reference;
   * the spread of ``MCA_SAMPLES`` *Monte Carlo arithmetic* runs: autograd in float64 with
     the floating operands and results of every op multiplied by ``1 + d``, ``d`` uniform
     in ``[-u, u]``, ``u = eps(D) / 2`` the unit roundoff of ``D``.  Perturbed results are
     the standard model ``fl(a op b) = (a op b)(1 + d)``, ``|d| <= u``; perturbed operands
     model backward-stable kernels (the exact result for operands perturbed by ``O(u)``),
     which brings in each op's condition (a matmul's accumulation, a subtraction's
     cancellation): Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed.,
     §§1.5, 2.2; Parker, Pierce and Eggert, "Monte Carlo arithmetic", Computing in Science &
     Engineering 2(4), 2000, which randomizes operands and results alike.  Fused backward
     kernels (batch/layer norm, softmax, GELU...) run decomposed into their formulas
     (``torch._decomp``), each op perturbed, as fxad's formulas run in ``D`` under
     ``fxad.fused_kernels(False)`` (the exact kernel would keep, say, the zero sum of batch
     norm's input gradient whatever its operands).  Ops that only move or select data
     (views, copies, ``cat``, ``where``, ``relu``, pooling indices...) and constants are
     exact and are not perturbed.  This measures the rounding sensitivity of *this*
     computation (the gradient of a bias before batch norm is zero in exact arithmetic: its
     ``D`` value is all rounding noise);
   * ``u * |r| + eta * sqrt(n)``: storing the ``n`` entries of the result in ``D``; ``eta``,
     half the smallest subnormal of ``D``, is the absolute rounding error near zero, which
     the Monte Carlo runs add as well (Higham §2.2's model with underflow:
     ``fl(x) = x (1 + d) + e``, ``|e| <= eta``; it matters in float16, where gradients of
     1e-6 are subnormal).

   ``ROUNDING_FACTOR = 8``: over 100 seeds per case (``(3*x).sum()``, ``sin(x) + x``,
   softmax, log_softmax, layer_norm, a matmul chain, two MLPs, SmallCNN with batch norm in
   eval and train mode, TinyGPT; ``FXAD_CHECK_SWEEP=100 pytest tests/test_check.py -k sweep``
   reruns it) in float32, bfloat16 and float16, with fused kernels on and off (8,800
   checks), the largest ratio ``|fxad_D - r| / noise`` was 2.1 (``CheckReport.rounding_ratio``
   reports it for each check) and no correct program failed; a dtype-dependent rule error
   (float32 code that rounds through float16) gives ratios above 100.

If the function cannot run in float64 (it mixes in ``D`` tensors of its own, say), both
parts run in ``D`` (the report says so in ``notes``): the reference is autograd in ``D``, the
Monte Carlo runs are in ``D``, and finite differences resolve about ``eps(D)**(2/3)``
relative.  A rule error must then stand out of ``D``'s rounding: on ``sin(tanh(x @ w))``,
a sign error in ``sin``'s rule is caught in every dtype and a 1 % error (``1.01 cos``) in
float32, but not in bfloat16 or float16.

Finite differences (float64, or ``D`` in the fallback)
------------------------------------------------------
Along a random direction ``w`` (entries ``u_i * max(1, |x_i|)``, ``u`` normal, scaled so
``max |u_i| = 1``), ``g(t) = <v, f(x + t w)>`` for the random cotangent ``v``.  The step is
``h = eps**(1/3)`` of the evaluation dtype (6.1e-6 in float64, 0.0049 in float32): the central
difference has truncation error ``h**2 |g'''| / 6`` and rounding error ``~ eps |g| / h``, and
``h ~ eps**(1/3)`` balances them (Press et al., *Numerical Recipes*, 3rd ed., §5.7; Nocedal
and Wright, *Numerical Optimization*, 2nd ed., §8.1).  The perturbed points are rounded to
the evaluation dtype and fxad's directional derivative uses the actual difference of the two
points.  Tolerance (a posteriori, so kinks and discontinuities within the step widen it
instead of raising false alarms):

``|fd(h) - fxad(h)| <= 4 |err(2h) - err(h)| + 4 |d(h) - d(2h)/2| + 4 (rho + eps S) / h
+ max(FD_KERNEL_RTOL, 16 eps**(2/3)) T``

where ``err(s) = fd(s) - fxad(s)`` (its change from ``h`` to ``2h`` is 3x the truncation
error), ``d(s) = e+(s) - e-(s)`` the difference of the one-sided errors
``e+(s) = (g(s) - g(0))/s - fxad``, ``e-(s) = (g(0) - g(-s))/s - fxad`` (``s g''`` when ``g``
is smooth, so ``d(h) - d(2h)/2 = O(h**3)``; of the order of the jump of ``g'`` when a kink of
``relu``/``max`` lies within the step, where ``err(2h) - err(h)`` can vanish), ``rho`` the
spread of ``g(x)`` under Monte Carlo arithmetic with the evaluation dtype's unit roundoff (the
evaluation error of ``g``), ``S = sum |v| |f(x)|`` and ``T = sum |grad_i| |w_i|`` the
magnitude of the directional derivative's terms.  The last term is a floor: ``eps**(2/3)``
is the best relative accuracy of a central difference (3.7e-11 in float64, 2.4e-5 in
float32, 0.039 in bfloat16, where finite differences alone only catch gross errors in the
fallback), and ``FD_KERNEL_RTOL = 1e-6``
because torch's float64 kernels are not all accurate to float64 (``leaky_relu`` multiplies by
its slope rounded to float32, 2.2e-8 relative; special functions such as ``digamma`` lose
digits near their poles): such differences are not a rule's fault, and a rule error smaller
than 1e-6 of the terms is still caught by the elementwise autograd comparison (``rtol``).

Where it fails
--------------
When a comparison fails, the captured graph is bisected: prefixes of the program (all their
intermediate values made outputs, with random cotangents) are differentiated by fxad and by
autograd until the first op whose VJP disagrees is found; the :class:`CheckError` names that
op, the user's ``file:line`` of it (``node.meta['fxad_loc']``) and the inputs/parameters
whose cotangents disagree.  If no single op is to blame the error points at the definition
of the checked function.

Layout: :mod:`~fxad.check.report` (:class:`CheckReport`, the tolerances),
:mod:`~fxad.check.numerics` (dtype precision), :mod:`~fxad.check.noise` (Monte Carlo
arithmetic), :mod:`~fxad.check.oracle` (the function run eagerly, by autograd and by fxad),
:mod:`~fxad.check.finite_diff`, :mod:`~fxad.check.compare` (the comparisons),
:mod:`~fxad.check.localize` (the op to blame), :mod:`~fxad.check.edited` (``vjp=``: a
derivative edited by hand, :mod:`fxad.eject`); this module: :func:`check`.
"""
from __future__ import annotations

import copy
from typing import Any, Callable, Iterable

import torch

from ..api import vjp as _vjp
from ..capture.control import eager_semantics
from ..errors import InputError
from ..pipeline import example_keywords, value_policy
from ..simplify._util import draws_random
from .edited import check_edited
from .compare import _Failure, _formula_side, _rounding_side, _Setup  # noqa: F401
from .finite_diff import _FD
from .localize import _localize, _raise
from .numerics import _NOTES, _cast, _eps, _float_leaves, _wide
from .oracle import _draw_cotangents, _Problem, _program_eps
from .report import FD_KERNEL_RTOL, FD_MCA_SAMPLES, MCA_SAMPLES, ROUNDING_FACTOR, CheckReport

__all__ = ["check", "CheckReport", "ROUNDING_FACTOR", "MCA_SAMPLES", "FD_MCA_SAMPLES",
           "FD_KERNEL_RTOL"]


def check(f: Callable | torch.nn.Module, *inputs: Any, dtype: torch.dtype | None = torch.float64,
          atol: float = 1e-6, rtol: float = 1e-5, fd_eps: float | None = None,
          fd_rtol: float | None = None, seed: int = 0,
          leaf_modules: Iterable[type] = (), vjp: Any = None, has_aux: bool = False,
          values: str = "guard", example_kwargs: dict[str, Any] | None = None,
          **kwargs: Any) -> CheckReport:
    """Check fxad's VJP of ``f`` at ``inputs`` against autograd and finite differences.

    See the module docstring (:mod:`fxad.check`) for what is compared in each dtype, the
    tolerances and their sources.

    Every run (fxad's, autograd's, each finite-difference evaluation) gets fresh copies of
    the inputs, so a program that updates its inputs in place (``x.mul_(2)``) is checked as
    :func:`fxad.grad` differentiates it: autograd differentiates with respect to leaves the
    program receives copies of.

    Args:
        f: function or ``nn.Module`` (copied and cast to ``dtype``; the original is untouched).
        inputs: example inputs (floating tensors are cast to ``dtype``).
        kwargs, example_kwargs: keyword arguments of ``f``, as in :func:`fxad.vjp`: passed to
            every run (floating tensors cast to ``dtype``), not differentiated.
        has_aux: ``f`` returns ``(output, aux)`` (as for :func:`fxad.grad`); ``output`` is
            checked.
        values: as in :func:`fxad.vjp`.
        dtype: dtype of the check (any floating dtype), ``None`` to keep the inputs' dtypes.
        atol, rtol: elementwise tolerance (``torch.allclose``) of the float64 formula check
            against autograd.
        fd_eps: finite-difference step (default ``eps**(1/3)`` of the evaluation dtype,
            relative to ``max(1, |x|)``).
        fd_rtol: if given, a fixed tolerance on the relative error
            ``|fxad - fd| / max(1, |fd|)`` instead of the error estimate.
        seed: seed of the random cotangent and direction.
        leaf_modules: module classes kept as single ops (they need a rule, see
            :func:`fxad.register_vjp`), as in :func:`fxad.vjp`.
        vjp: check this derivative instead of fxad's own: the path (or text) of a file
            written by :func:`fxad.eject` and edited by hand, or a callable with the
            signature of an ejected ``vjp`` (``vjp(model, *inputs, cotangent)``).  The check
            runs in float64 (``dtype`` must be float64); on a disagreement the error names
            the cotangent and the first ``# backward of:`` block whose values depart from
            fxad's own derivative at the same point (:mod:`fxad.check.edited`).

    Returns:
        :class:`CheckReport`.

    Raises:
        CheckError: a cotangent disagrees; the message names the input or parameter and the
            error, the first op whose derivative disagrees and, as its location, the user's
            line of that op.
        CheckError: also when a run the check needs fails (the function called eagerly on
            the inputs, torch.autograd's reference, fxad's generated code), naming which.
        InputError: the function has random ops active (dropout in training mode), so no
            oracle can reproduce its values; call ``.eval()`` or set p=0.
    """
    # the reference runs execute torch.cond / while_loop / scan / map as the Python programs
    # they are defined as (fxad's capture still sees them as control flow)
    kwargs = example_keywords(example_kwargs, kwargs)
    value_policy(values)  # (validated here; the builds run under it)
    if vjp is not None:
        if kwargs or has_aux:
            raise InputError("fxad.check(vjp=...) checks a derivative of positional inputs: "
                             "keyword arguments and has_aux are not supported there",
                             hint="check a function that calls f with its keywords and "
                                  "returns its output only")
        if dtype not in (torch.float64, None):
            raise InputError(f"fxad.check(vjp=...) checks in float64, not {dtype}")
        with eager_semantics(f):
            return check_edited(f, inputs, vjp, atol, rtol, fd_eps, fd_rtol, seed,
                                tuple(leaf_modules))
    with eager_semantics(f):
        return _check(f, inputs, dtype, atol, rtol, fd_eps, fd_rtol, seed, leaf_modules,
                      kwargs, has_aux, values)


def _check(f: Any, inputs: tuple, dtype: torch.dtype | None, atol: float, rtol: float,
           fd_eps: float | None, fd_rtol: float | None, seed: int,
           leaf_modules: Iterable[type], kwargs: dict, has_aux: bool,
           values: str) -> CheckReport:
    st = _Setup(atol, rtol, fd_eps, fd_rtol, seed)
    gen = torch.Generator().manual_seed(seed)
    is_mod = isinstance(f, torch.nn.Module)
    fnD: Any = copy.deepcopy(f) if is_mod else f
    if is_mod and dtype is not None:
        fnD = fnD.to(dtype)
    xsD = _cast(inputs, dtype)
    kwD = _cast(kwargs, dtype)
    opts = {"leaf_modules": leaf_modules, "has_aux": has_aux, "values": values}
    gD = _build(fnD, xsD, kwD, opts)
    fwD = gD.meta["fxad_forward"]
    if any(draws_random(n) for n in fwD.graph.nodes):
        raise InputError("fxad.check cannot compare a function with active random ops "
                         "(e.g. dropout in training mode)",
                         hint="call .eval() on the module or set the dropout probability to 0")
    probD = _Problem(fnD, xsD, is_mod, kwD, has_aux)
    epsD, dtD = _program_eps(fwD, probD)
    report_dtype = dtype if dtype is not None else (dtD or torch.float64)
    precise = epsD <= _eps(torch.float64)
    notes: list[str] = []
    _NOTES.clear()

    # the formula check runs in float64: the same point (D values), cast
    prob64, g64, fw64, xs64, kw64 = probD, gD, fwD, xsD, kwD
    if not precise:
        try:
            fn64: Any = copy.deepcopy(fnD).to(torch.float64) if is_mod else f
            xs64 = _cast(xsD, torch.float64)
            kw64 = _cast(kwD, torch.float64)
            g64 = _build(fn64, xs64, kw64, opts)
            fw64 = g64.meta["fxad_forward"]
            prob64 = _Problem(fn64, xs64, is_mod, kw64, has_aux)
            if _program_eps(fw64, prob64)[0] > _eps(torch.float64) or \
                    len(_float_leaves(prob64.run())) != len(_float_leaves(probD.run())):
                raise TypeError("the program keeps lower-precision values in float64")
        except Exception as e:  # noqa: BLE001 - any failure: check in D alone
            notes.append(f"the function does not run in float64 ({type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''}); formulas and finite "
                         f"differences checked in {report_dtype}, to about eps**(2/3) = "
                         f"{epsD ** (2 / 3):.2g} relative")
            prob64, g64, fw64, xs64, kw64 = probD, gD, fwD, xsD, kwD
    formula_in_D = prob64 is probD
    # the captured graph takes the keyword inputs last, positionally (for the bisection)
    flat64, flatD = xs64 + tuple(kw64.values()), xsD + tuple(kwD.values())

    # cotangents: drawn in float64, rounded to D; the float64 checks use the rounded values
    out_refD = probD.run()
    cotsD = _draw_cotangents(_float_leaves(out_refD), gen)
    # (both in a low-precision D: fxad vs autograd is the rounding check's job below)
    elementwise = not (formula_in_D and not precise)
    fail, info = _formula_side(prob64, g64, st, gen, cots=[_wide(c) for c in cotsD]
                               if not formula_in_D else cotsD, elementwise=elementwise)
    if fail is not None:
        node = None
        if fail.kind != "structure":
            # the autograd comparison first (deterministic, most sensitive; in the fallback the
            # rounding check plays its part), then finite differences
            if elementwise:
                node = _localize("formula", fw64, flat64, is_mod, st, leaf_modules)
            else:
                node = _localize("rounding", fw64, flat64, is_mod, st, leaf_modules, eps=epsD,
                                 dtype=dtD or report_dtype)
            if node is None and fail.kind == "fd":
                node = _localize("fd", fw64, flat64, is_mod, st, leaf_modules,
                                 elementwise=elementwise)
        _raise(fail, f, node, fw64, report_dtype)
    fd: _FD = info["fd"]
    formula_max = info["max_abs"]

    ratio = None
    worst_name = ""
    max_abs = formula_max
    if not precise:
        fail, rinfo = _rounding_side(probD, gD, prob64, epsD, dtD or report_dtype, gen,
                                     cots=cotsD)
        if fail is not None:
            node = None if fail.kind == "structure" else _localize(
                "rounding", fwD, flatD, is_mod, st, leaf_modules, eps=epsD,
                dtype=dtD or report_dtype, xs64=None if formula_in_D else flat64)
            _raise(fail, f, node, fwD, report_dtype)
        ratio = rinfo["ratio"]
        worst_name = rinfo["worst"]
        max_abs = rinfo["max_abs"]
    return CheckReport(dtype=report_dtype, n_inputs=len(probD.diff), n_params=len(probD.params),
                       max_abs_err=max_abs, fd_directional=(fd.analytic, fd.fd),
                       fd_rel_err=fd.rel, compared=list(probD.names), fd_tol=fd.tol,
                       fd_step=fd.step, formula_dtype=next(
                           (t.dtype for t in prob64.wrt()), torch.float64),
                       formula_max_abs_err=formula_max, rounding_ratio=ratio,
                       rounding_worst=worst_name, notes=notes + sorted(set(_NOTES)))


def _build(fn: Any, xs: tuple, kwargs: dict, opts: dict) -> Any:
    """fxad's VJP of ``fn`` for the check."""
    return _vjp(fn, *xs, example_kwargs=kwargs, **opts)
