"""``fxad.check``: compare fxad's VJP with ``torch.autograd`` and with central finite
differences.

Both oracles run in float64 where possible (floating inputs and the module are cast; the
original objects are not modified).

* **autograd**: for a random cotangent ``v``, every input/parameter cotangent from fxad's
  generated code is compared with ``torch.autograd.grad(f(x), x, v)``.
* **finite differences**: for a random direction ``u`` over all inputs and parameters,
  ``<v, (f(x + h u) - f(x - h u)) / 2h>`` is compared with ``sum_i <grad_i, u_i>``.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
from torch.utils import _pytree as pytree

from .errors import CheckError, InputError


@dataclass
class CheckReport:
    """Result of a successful :func:`check`.

    Attributes:
        dtype: dtype the check ran in.
        n_inputs: number of differentiable inputs checked.
        n_params: number of parameters checked.
        max_abs_err: largest absolute difference from autograd over all cotangents.
        fd_directional: (fxad, finite differences) directional derivatives.
        fd_rel_err: their relative difference.
        compared: names of the compared cotangents.
    """

    dtype: torch.dtype
    n_inputs: int
    n_params: int
    max_abs_err: float
    fd_directional: tuple[float, float]
    fd_rel_err: float
    compared: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        a, b = self.fd_directional
        return (f"fxad.check passed ({self.dtype}): {self.n_inputs} input(s), {self.n_params} "
                f"parameter(s); max |fxad - autograd| = {self.max_abs_err:.3g}; directional "
                f"derivative fxad {a:.10g} vs finite differences {b:.10g} (rel. err "
                f"{self.fd_rel_err:.2g})")


def _cast(x: Any, dtype: torch.dtype | None) -> Any:
    def f(v: Any) -> Any:
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            return v.detach().to(dtype) if dtype is not None else v.detach().clone()
        return v
    return pytree.tree_map(f, x)


def _float_leaves(x: Any) -> list[torch.Tensor]:
    return [v for v in pytree.tree_leaves(x) if isinstance(v, torch.Tensor)
            and (v.is_floating_point() or v.is_complex())]


def check(f: Callable | torch.nn.Module, *inputs: Any, dtype: torch.dtype | None = torch.float64,
          atol: float = 1e-6, rtol: float = 1e-5, fd_eps: float = 1e-6, fd_rtol: float = 1e-4,
          seed: int = 0, leaf_modules: Iterable[type] = ()) -> CheckReport:
    """Check fxad's VJP of ``f`` at ``inputs`` against autograd and finite differences.

    Args:
        f: function or ``nn.Module`` (copied and cast to ``dtype``; the original is untouched).
        inputs: example inputs (floating tensors are cast to ``dtype``).
        dtype: dtype of the check, ``None`` to keep the inputs' dtypes.
        atol, rtol: tolerance against autograd (elementwise, as ``torch.allclose``).
        fd_eps: finite-difference step; fd_rtol: tolerance of the directional derivative.
        seed: seed of the random cotangent and direction.

    Returns:
        :class:`CheckReport`.

    Raises:
        CheckError: a cotangent disagrees; the message names the input or parameter, the
            largest absolute difference and where it occurs.
        InputError: the function has random ops active (dropout in training mode), so no
            oracle can reproduce its values; call ``.eval()`` or set p=0.
    """
    from .api import vjp
    from .simplify._util import is_random

    gen = torch.Generator().manual_seed(seed)
    is_mod = isinstance(f, torch.nn.Module)
    fn: Any = copy.deepcopy(f) if is_mod else f
    if is_mod and dtype is not None:
        fn = fn.to(dtype)
    xs = _cast(inputs, dtype)
    g = vjp(fn, *xs, leaf_modules=leaf_modules)
    fwd_graph = g.meta["fxad_forward"].graph
    if any(is_random(n) for n in fwd_graph.nodes):
        raise InputError("fxad.check cannot compare a function with active random ops "
                         "(e.g. dropout in training mode)",
                         hint="call .eval() on the module or set the dropout probability to 0")
    state = {k: v.clone() for k, v in fn.state_dict().items()} if is_mod else {}

    def restore() -> None:
        if is_mod:
            with torch.no_grad():
                for k, v in fn.state_dict().items():
                    v.copy_(state[k])

    # reference output to shape the random cotangent
    with torch.no_grad():
        out_ref = fn(*xs)
    restore()
    cot_leaves = [torch.randn(o.shape, dtype=o.dtype, generator=gen)
                  for o in _float_leaves(out_ref)]
    if isinstance(out_ref, torch.Tensor):
        cot_arg: Any = cot_leaves[0] if cot_leaves else None
    else:
        it = iter(cot_leaves)
        cot_arg = pytree.tree_map(lambda o: next(it) if isinstance(o, torch.Tensor)
                                  and (o.is_floating_point() or o.is_complex()) else None,
                                  out_ref)
    result = g(*xs, cot_arg)
    restore()
    out_fx, in_grads = result[0], result[1]
    p_grads = result[2] if is_mod else {}

    # autograd
    leaves, spec = pytree.tree_flatten(_cast(xs, None))
    diff_inputs = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)
                   and x.is_floating_point()]
    for i in diff_inputs:
        leaves[i].requires_grad_(True)
    x_req = pytree.tree_unflatten(leaves, spec)
    params = [(n, p) for n, p in fn.named_parameters() if p.requires_grad] if is_mod else []
    out_ag = fn(*x_req)
    outs = _float_leaves(out_ag)
    wrt = [leaves[i] for i in diff_inputs] + [p for _, p in params]
    used = [o for o in outs if o.requires_grad]
    used_cots = [c for o, c in zip(outs, cot_leaves) if o.requires_grad]
    ag = torch.autograd.grad(used, wrt, used_cots, allow_unused=True) if used \
        else [None] * len(wrt)
    restore()
    in_grad_leaves = pytree.tree_flatten(in_grads, is_leaf=lambda v: v is None)[0]
    if len(in_grad_leaves) != len(leaves):
        raise CheckError(f"fxad returned {len(in_grad_leaves)} input cotangents for "
                         f"{len(leaves)} input leaves")
    input_paths = [pytree.keystr(k) for k, _ in pytree.tree_flatten_with_path(xs)[0]]
    names = [f"input{input_paths[i]}" for i in diff_inputs] + [f"parameter {n}" for n, _ in params]
    mine = [in_grad_leaves[i] for i in diff_inputs] + [p_grads.get(n) for n, _ in params]
    worst = 0.0
    for o_fx, o_ag in zip(_float_leaves(out_fx), outs):
        if not torch.allclose(o_fx, o_ag.detach(), atol=atol, rtol=rtol):
            raise CheckError(f"fxad's forward output differs from eager: max |diff| = "
                             f"{(o_fx - o_ag).abs().max().item():.3g}")
    for name, a, b in zip(names, mine, ag):
        b = torch.zeros_like(a) if b is None and a is not None else b
        if a is None:
            raise CheckError(f"fxad returned no cotangent for {name}")
        if a.shape != b.shape:
            raise CheckError(f"cotangent of {name}: fxad shape {tuple(a.shape)}, autograd "
                             f"{tuple(b.shape)}")
        diff = (a - b).abs()
        err = diff.max().item() if diff.numel() else 0.0
        worst = max(worst, err)
        if not torch.allclose(a, b, atol=atol, rtol=rtol) or not math.isfinite(err):
            where = tuple(int(k) for k in torch.nonzero(diff == diff.max())[0]) if diff.numel() else ()
            raise CheckError(
                f"cotangent of {name} disagrees with torch.autograd: max |fxad - autograd| = "
                f"{err:.3g} at index {where} (fxad {a[where].item():.6g}, autograd "
                f"{b[where].item():.6g})", hint="a derivative rule on this path is wrong; "
                "fxad.show(fxad.vjp(...)) shows the generated code")

    # finite differences along a random direction
    dirs = [torch.randn(t.shape, dtype=t.dtype, generator=gen) for t in wrt]
    analytic = sum(float((m.detach() * u).sum()) for m, u in zip(mine, dirs))

    def shifted(h: float) -> float:
        leaves_h = pytree.tree_leaves(_cast(xs, None))
        for k, i in enumerate(diff_inputs):
            leaves_h[i] = leaves_h[i] + h * dirs[k]
        xs_h = pytree.tree_unflatten(leaves_h, spec)
        with torch.no_grad():
            for (_, p), u in zip(params, dirs[len(diff_inputs):]):
                p.add_(h * u)
            out = fn(*xs_h)
            for (_, p), u in zip(params, dirs[len(diff_inputs):]):
                p.sub_(h * u)
        restore()
        # outputs autograd does not differentiate (saved statistics of native_layer_norm...)
        # are left out of the directional derivative, as they are of the autograd reference
        # real inner product <c, o> = Re(sum conj(c) o) (PyTorch's convention for complex
        # outputs)
        return sum(float(torch.real(torch.sum(torch.conj(c) * o)))
                   for o, c, r in zip(_float_leaves(out), cot_leaves, outs) if r.requires_grad)

    fd = (shifted(fd_eps) - shifted(-fd_eps)) / (2 * fd_eps)
    rel = abs(analytic - fd) / max(1.0, abs(fd))
    if rel > fd_rtol:
        raise CheckError(f"directional derivative disagrees with finite differences: fxad "
                         f"{analytic:.10g}, central difference {fd:.10g} (rel. err {rel:.2g})")
    return CheckReport(dtype=dtype or torch.float32, n_inputs=len(diff_inputs),
                       n_params=len(params), max_abs_err=worst,
                       fd_directional=(analytic, fd), fd_rel_err=rel, compared=names)
