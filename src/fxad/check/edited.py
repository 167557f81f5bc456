"""``fxad.check(f, *inputs, vjp=...)``: check a derivative the user edited (an ejected file,
:mod:`fxad.eject`, or a callable with the ejected signature) with the float64 comparison
against autograd and finite differences; on a disagreement, name the wrong cotangent and the
first ``# backward of:`` block whose values depart from fxad's own derivative at the same
point (both run with every assigned value recorded, :func:`fxad.eject.trace_values`;
values are matched by name)."""
from __future__ import annotations

import copy
import os
import types
from typing import Any, Callable, Iterable

import torch
from torch.utils import _pytree as pytree

from ..eject import eject, load, trace_values
from ..errors import CheckError, InputError, SourceLoc
from .compare import _formula_side, _Setup
from .numerics import _cast
from .oracle import _Problem
from .report import CheckReport


class _Edited:
    """The user's derivative called as fxad's VJP modules are: ``g(*inputs, cotangent) ->
    (outputs, input_grads, param_grads)``."""

    def __init__(self, source: Any, model: torch.nn.Module | None) -> None:
        self.model = model
        if callable(source) and not isinstance(source, (str, types.ModuleType)):
            self.mod: types.ModuleType | None = None
            self.kind = "vjp"
            self.fn = source
            self.where = getattr(source, "__name__", "the given callable")
        else:
            self.mod = load(source)
            self.kind = getattr(self.mod, "KIND", "vjp")
            self.fn = getattr(self.mod, {"training": "backward"}.get(self.kind, self.kind),
                              None)
            if self.fn is None:
                raise InputError(f"{source}: no function {self.kind!r} (an ejected file "
                                 "defines vjp, grad, or forward and backward)")
            self.where = str(source) if "\n" not in str(source) else "the edited code"
        self.takes_model = model is not None and getattr(self.mod, "TAKES_MODEL", True)

    def _pre(self) -> tuple:
        return (self.model,) if self.takes_model else ()

    def __call__(self, *args: Any) -> tuple:
        *xs, cot = args
        pre = self._pre()
        if self.kind == "vjp":
            return self.fn(*pre, *xs, cot)
        if self.kind == "grad":
            out, ig, *pg = self.fn(*pre, *xs)
            scale = cot if isinstance(cot, torch.Tensor) else 1.0
            ig = tuple(None if g is None else g * scale for g in ig)
            return (out, ig) + tuple({k: v * scale for k, v in p.items()} for p in pg)
        mod = self.mod
        res = mod.forward(*pre, *xs)
        n = mod.N_OUTPUTS
        outs, saved = list(res[:n]), list(res[n:])
        cots = [c for c in pytree.tree_leaves(cot) if isinstance(c, torch.Tensor)]
        grads = mod.backward(*pre, [*saved, *cots])
        k = len(xs)  # one gradient (or None) per input, then the parameters'
        ig = list(grads[:k])
        pg = dict(zip(mod.PARAMS, grads[k:]))
        return (outs[0] if n == 1 else tuple(outs), tuple(ig), pg)

    def trace(self, *args: Any) -> list[tuple[str, Any, str, int]]:
        """Every named value the derivative computes at ``args`` (see ``__call__``)."""
        *xs, cot = args
        pre = self._pre()
        if self.kind == "vjp":
            return trace_values(self.fn, *pre, *xs, cot)
        if self.kind == "grad":
            return trace_values(self.fn, *pre, *xs)
        mod = self.mod
        rec = trace_values(mod.forward, *pre, *xs)
        res = mod.forward(*pre, *xs)
        cots = [c for c in pytree.tree_leaves(cot) if isinstance(c, torch.Tensor)]
        return rec + trace_values(mod.backward, *pre, [*res[mod.N_OUTPUTS:], *cots])


def _departs(a: Any, b: Any, atol: float, rtol: float) -> float | None:
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return None
    if a.shape != b.shape or not (a.is_floating_point() and b.is_floating_point()):
        return None
    if torch.allclose(a, b, atol=atol, rtol=rtol, equal_nan=True):
        return None
    return float((a - b).abs().nan_to_num(nan=float("inf")).max())


def _first_departure(user: _Edited, own: _Edited, args: tuple, atol: float,
                     rtol: float) -> tuple[str, str, float, int] | None:
    """(block, name, max |diff|, line) of the first value of the user's derivative that departs
    from the value of the same name in fxad's own, or None."""
    with torch.no_grad():
        mine = user.trace(*args)
        other = own.trace(*args)
    theirs: dict[str, Any] = {}
    for name, value, _, _ in other:
        theirs.setdefault(name, value)
    for name, value, block, line in mine:
        if name in theirs:
            d = _departs(value, theirs[name], atol, rtol)
            if d is not None:
                return block, name, d, line
    return None


def check_edited(f: Callable | torch.nn.Module, inputs: tuple, vjp: Any, atol: float,
                 rtol: float, fd_eps: float | None, fd_rtol: float | None, seed: int,
                 leaf_modules: Iterable[type]) -> CheckReport:
    """See :func:`fxad.check` (``vjp=``)."""
    st = _Setup(atol, rtol, fd_eps, fd_rtol, seed)
    gen = torch.Generator().manual_seed(seed)
    is_mod = isinstance(f, torch.nn.Module)
    fn: Any = copy.deepcopy(f).to(torch.float64) if is_mod else f
    xs = _cast(inputs, torch.float64)
    user = _Edited(vjp, fn if is_mod else None)
    prob = _Problem(fn, xs, is_mod)
    if user.kind == "training":  # gradients of the inputs the split differentiates only
        keep = set(user.mod.INPUT_GRADS)
        n_in = len(prob.diff)
        prob.names = [nm for i, nm in zip(prob.diff, prob.names[:n_in]) if i in keep] + \
            prob.names[n_in:]
        prob.diff = [i for i in prob.diff if i in keep]
    fail, info = _formula_side(prob, user, st, gen)
    if fail is not None:
        where, loc = "", None
        try:
            text = eject(fn, *[x.detach().clone().requires_grad_(i in prob.diff)
                               if isinstance(x, torch.Tensor) and x.is_floating_point() else x
                               for i, x in enumerate(xs)], kind=user.kind,
                         leaf_modules=leaf_modules)
            own = _Edited(text, fn if is_mod else None)
            cot = info["cots"]
            out_ref = info["out_ref"]
            if isinstance(out_ref, torch.Tensor):
                cot_arg: Any = cot[0]
            else:
                it = iter(cot)
                cot_arg = pytree.tree_map(lambda o: next(it) if isinstance(o, torch.Tensor)
                                          and o.is_floating_point() else None, out_ref)
            found = _first_departure(user, own, (*xs, cot_arg), atol, rtol)
            prob.restore()
            if found is None:
                where = ("; no named value departs from fxad's own derivative (the edit "
                         "changes the values returned, not the names they are computed in)")
            else:
                block, name, d, line = found
                fname = user.fn.__code__.co_filename
                if os.path.exists(fname):
                    loc = SourceLoc(fname, line, user.fn.__name__, "")
                where = (f"\n  the first block whose values depart from fxad's own derivative: "
                         f"# {block}\n  (value `{name}`: max |edited - fxad| = {d:.3g})")
        except Exception as e:  # noqa: BLE001 - the comparison is best effort
            where = f"; (fxad's own derivative could not be compared: {type(e).__name__}: {e})"
        raise CheckError(f"the edited derivative ({user.where}) is wrong: {fail.message}"
                         f"{where}", loc=loc,
                         hint="compare the named block with fxad.eject(...) of the same model "
                              "(the unedited code)")
    fd = info["fd"]
    return CheckReport(dtype=torch.float64, n_inputs=len(prob.diff), n_params=len(prob.params),
                       max_abs_err=info["max_abs"], fd_directional=(fd.analytic, fd.fd),
                       fd_rel_err=fd.rel, compared=list(prob.names), fd_tol=fd.tol,
                       fd_step=fd.step, formula_dtype=torch.float64,
                       formula_max_abs_err=info["max_abs"],
                       notes=[f"checked the edited derivative {user.where} ({user.kind})"])
