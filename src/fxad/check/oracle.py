"""The function under check at concrete inputs (:class:`_Problem`): run eagerly, through
``torch.autograd`` (the oracle, optionally under Monte Carlo arithmetic) and through
fxad's VJP module; random cotangents; the precision of the program's values."""
from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from ..ad.reverse import activity, differentiable_params, has_float
from ..errors import CheckError, FxadError
from .noise import _RoundingNoise
from .numerics import _eps, _float_leaves

def _phase(what: str, hint: str) -> Any:
    """Decorator: an exception other than fxad's own raised by a run of the check becomes a
    :class:`CheckError` saying which run failed (the original chained)."""
    def wrap(method: Any) -> Any:
        def run(self: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return method(self, *args, **kwargs)
            except FxadError:
                raise
            except Exception as e:  # noqa: BLE001 - named, with the original chained
                first = str(e).splitlines()[0] if str(e) else ""
                raise CheckError(f"fxad.check: {what} failed ({type(e).__name__}: {first})",
                                 hint=hint) from e
        run.__name__ = method.__name__
        run.__doc__ = method.__doc__
        return run
    return wrap


def _fresh(tree: Any) -> Any:
    """``tree`` with every tensor replaced by a copy: each run gets its own inputs, so that a
    program that mutates its inputs (``x.mul_(2)``) leaves nothing behind for the next."""
    return pytree.tree_map(lambda v: v.detach().clone() if isinstance(v, torch.Tensor) else v,
                           tree)


class _Problem:
    """A function (or module) at concrete inputs: runs it, its fxad VJP and autograd.

    ``kwargs``: keyword inputs (passed to every run, not differentiated, as by
    :func:`fxad.vjp`); ``has_aux``: the function returns ``(output, aux)`` and only
    ``output`` is compared.  Every run gets fresh copies of the inputs."""

    def __init__(self, fn: Any, xs: tuple, with_params: bool, kwargs: dict | None = None,
                 has_aux: bool = False) -> None:
        self.fn = fn
        self.xs = xs
        self.kwargs = dict(kwargs or {})
        self.has_aux = has_aux
        self.leaves, self.spec = pytree.tree_flatten(xs)
        self.diff = [i for i, x in enumerate(self.leaves) if isinstance(x, torch.Tensor)
                     and x.is_floating_point()]
        self.mod = fn if isinstance(fn, torch.nn.Module) else None
        self.params = [(n, p) for n, p in self.mod.named_parameters() if p.requires_grad] \
            if with_params and self.mod is not None else []
        self.state = {k: v.detach().clone() for k, v in self.mod.state_dict().items()} \
            if self.mod is not None else {}
        paths = [pytree.keystr(k) for k, _ in pytree.tree_flatten_with_path(xs)[0]]
        self.names = [f"input{paths[i]}" for i in self.diff] + \
            [f"parameter {n}" for n, _ in self.params]

    def restore(self) -> None:
        if self.mod is not None:
            with torch.no_grad():
                for k, v in self.mod.state_dict().items():
                    v.copy_(self.state[k])

    def wrt(self) -> list[torch.Tensor]:
        return [self.leaves[i] for i in self.diff] + [p for _, p in self.params]

    @_phase("running the function on the inputs", "call f(*inputs) yourself: it must run "
            "eagerly on the inputs given to fxad.check")
    def run(self, values: list[torch.Tensor] | None = None) -> Any:
        """Forward value (no autograd) at ``values`` (aligned with :meth:`wrt`) or at x."""
        leaves = list(self.leaves)
        with torch.no_grad():
            if values is not None:
                for k, i in enumerate(self.diff):
                    leaves[i] = values[k]
                for (_, p), v in zip(self.params, values[len(self.diff):]):
                    p.copy_(v)
            try:
                return self._call(leaves)
            finally:
                self.restore()

    def _call(self, leaves: list[Any]) -> Any:
        """The function at ``leaves`` (fresh copies of the other inputs), without aux."""
        args = pytree.tree_unflatten(_fresh(leaves), self.spec)
        out = self.fn(*args, **_fresh(self.kwargs))
        if self.has_aux:
            if not (isinstance(out, (tuple, list)) and len(out) == 2):
                raise CheckError("has_aux=True, but the function does not return a pair "
                                 "(output, aux)")
            out = out[0]
        return out

    @_phase("the torch.autograd reference", "fxad.check compares with torch.autograd on the "
            "same inputs: the function must be differentiable by torch.autograd there")
    def autograd(self, cots: list[torch.Tensor], noise: _RoundingNoise | None = None
                 ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[bool]]:
        """(float outputs, cotangents aligned with :meth:`wrt`, which outputs autograd
        differentiates)."""
        leaves = _fresh(list(self.leaves))
        for i in self.diff:
            leaves[i] = leaves[i].requires_grad_(True)
        wrt = [leaves[i] for i in self.diff] + [p for _, p in self.params]
        # the program gets non-leaf copies (in-place updates of its inputs are then legal, as
        # in fxad's capture) and its other inputs fresh; gradients w.r.t. the leaves
        with torch.enable_grad():
            given = [v.clone() if k in self.diff else v for k, v in enumerate(leaves)]
        args = pytree.tree_unflatten(given, self.spec)
        kwargs = _fresh(self.kwargs)
        try:
            with torch.enable_grad(), noise if noise is not None else contextlib.nullcontext():
                out = self.fn(*args, **kwargs)
                if self.has_aux:
                    out = out[0]
                outs = _float_leaves(out)
                req = [o.requires_grad for o in outs]
                used = [o for o, r in zip(outs, req) if r]
                used_cots = [c.to(o.dtype) for o, c, r in zip(outs, cots, req) if r]
                grads = torch.autograd.grad(used, wrt, used_cots, allow_unused=True) \
                    if used and wrt else [None] * len(wrt)
        finally:
            self.restore()
        grads = [torch.zeros_like(w) if g is None else g.detach() for g, w in zip(grads, wrt)]
        return [o.detach() for o in outs], grads, req

    @_phase("running fxad's generated VJP", "fxad.show(fxad.vjp(f, *inputs)) prints the "
            "generated code")
    def fxad(self, g: Any, out_ref: Any, cots: list[torch.Tensor]
             ) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """(float outputs, cotangents aligned with :meth:`wrt`) of fxad's VJP module ``g``."""
        if isinstance(out_ref, torch.Tensor):
            cot_arg: Any = cots[0] if cots else None
        else:
            it = iter(cots)
            cot_arg = pytree.tree_map(lambda o: next(it) if isinstance(o, torch.Tensor) and (
                o.is_floating_point() or o.is_complex()) else None, out_ref)
        try:
            result = g(*_fresh(self.xs), cot_arg, **_fresh(self.kwargs))
        finally:
            self.restore()
        in_grads = pytree.tree_flatten(result[1], is_leaf=lambda v: v is None)[0]
        if len(in_grads) != len(self.leaves):
            raise CheckError(f"fxad returned {len(in_grads)} input cotangents for "
                             f"{len(self.leaves)} input leaves")
        p_grads = result[2] if self.params and len(result) > 2 \
            and isinstance(result[2], dict) else {}
        mine = [in_grads[i] for i in self.diff] + [p_grads.get(n) for n, _ in self.params]
        return _float_leaves(result[0]), mine


def _draw_cotangents(outs: list[torch.Tensor], gen: torch.Generator) -> list[torch.Tensor]:
    """Random cotangents, drawn in float64/complex128 and rounded to each output's dtype:
    normal entries pushed away from zero (``sign(z) (1/2 + |z|)``), so that a scalar output's
    cotangent is never tiny enough to push low-precision gradients into the subnormals."""
    out = []
    for o in outs:
        z = torch.randn(o.shape, dtype=torch.complex128 if o.is_complex() else torch.float64,
                        generator=gen)
        mag = z.abs()
        out.append(torch.where(mag > 0, z / mag.clamp(min=1e-300) * (0.5 + mag), 0.5)
                   .to(device=o.device, dtype=o.dtype))
    return out


def _program_eps(fw: fx.GraphModule, prob: _Problem) -> tuple[float, torch.dtype | None]:
    """Largest eps (and its dtype) over the differentiated floating values of the program
    (constants are computed the same way by fxad and autograd and do not count)."""
    leaves = {n for n in fw.graph.nodes if n.op == "placeholder" and has_float(n.meta.get("val"))}
    if prob.params:
        leaves |= set(differentiable_params(fw).values())
    active, _ = activity(fw, leaves)
    dts: list[torch.dtype] = []
    for n in fw.graph.nodes:
        if n not in active:
            continue
        for v in pytree.tree_leaves(n.meta.get("val")):
            if isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex()):
                dts.append(v.dtype)
    dts += [t.dtype for t in prob.wrt()]
    if not dts:
        return _eps(torch.float64), None
    worst = max(dts, key=_eps)
    return _eps(worst), worst



def _program_eps_of(prob: _Problem, outs: list[torch.Tensor]) -> tuple[float, torch.dtype]:
    dts = [t.dtype for t in prob.wrt()] + [o.dtype for o in outs]
    if not dts:
        return _eps(torch.float64), torch.float64
    worst = max(dts, key=_eps)
    return _eps(worst), worst

