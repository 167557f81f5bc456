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
"""
from __future__ import annotations

import contextlib
import copy
import inspect
import math
import random
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from .errors import CheckError, InputError, SourceLoc

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


# ------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------

def _cast(x: Any, dtype: torch.dtype | None) -> Any:
    def f(v: Any) -> Any:
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            return v.detach().to(dtype) if dtype is not None else v.detach().clone()
        return v
    return pytree.tree_map(f, x)


def _float_leaves(x: Any) -> list[torch.Tensor]:
    return [v for v in pytree.tree_leaves(x) if isinstance(v, torch.Tensor)
            and (v.is_floating_point() or v.is_complex())]


def _eps(dtype: torch.dtype) -> float:
    if dtype.is_complex:
        dtype = torch.float32 if dtype == torch.complex64 else \
            torch.float16 if dtype == torch.complex32 else torch.float64
    return float(torch.finfo(dtype).eps)


def _wide(t: torch.Tensor) -> torch.Tensor:
    """``t`` in float64 (complex128 for complex tensors)."""
    return t.detach().to(torch.complex128 if t.is_complex() else torch.float64)


def _norm(t: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(t)) if t.numel() else 0.0


# ops that move, select or create data without rounding: not perturbed by Monte Carlo
# arithmetic (views and in-place/out= ops are recognized from their schema)
_EXACT_OPS = frozenset("""
    _to_copy clone copy detach alias lift_fresh lift_fresh_copy contiguous t transpose view
    _unsafe_view reshape expand permute select slice cat stack split split_with_sizes unbind
    squeeze unsqueeze flatten index index_select gather embedding where masked_fill relu
    threshold_backward neg abs max_pool2d_with_indices max_pool3d_with_indices
    constant_pad_nd flip roll repeat narrow zeros ones empty full zeros_like ones_like
    empty_like full_like new_zeros new_ones new_empty new_full new_empty_strided
    empty_strided fill scalar_tensor arange sign sgn floor ceil round trunc maximum minimum
    max min amax amin clamp clamp_min clamp_max hardtanh diagonal diag_embed tril triu
    _unsafe_index select_backward slice_backward unfold as_strided conj _conj resolve_conj
    resolve_neg _neg_view real imag view_as_real view_as_complex
""".split())


# fused backward kernels whose result hides the rounding of the formula inside (the zero sum
# of batch norm's input gradient survives any perturbation of the kernel's operands): Monte
# Carlo arithmetic runs their decompositions (torch._decomp), op by op, as a formula written
# out in D would run
_DECOMPOSED_OPS = frozenset("""
    native_batch_norm_backward batch_norm_backward native_layer_norm_backward
    native_group_norm_backward _softmax_backward_data _log_softmax_backward_data
    gelu_backward silu_backward tanh_backward sigmoid_backward mse_loss_backward
    softplus_backward elu_backward hardswish_backward
""".split())


def _underflow(dtype: torch.dtype) -> float:
    """Half the smallest subnormal of ``dtype``: the absolute rounding error near zero."""
    if dtype.is_complex:
        dtype = torch.float32 if dtype == torch.complex64 else \
            torch.float16 if dtype == torch.complex32 else torch.float64
    fi = torch.finfo(dtype)
    return float(fi.smallest_normal) * float(fi.eps) / 2


# remarks made while checking (fallbacks of the noise estimates), collected into the report
_NOTES: list[str] = []


class _RoundingNoise(TorchDispatchMode):
    """Monte Carlo arithmetic for ``dtype``: the floating operands and results of every
    rounding op become ``x (1 + d) + e``, ``d`` uniform in ``[-u, u]``, ``e`` (for
    ``x != 0``, float16 only: elsewhere the subnormals are far below any gradient) uniform
    in ``[-eta, eta]`` (see the module docstring).

    The uniform numbers are windows, at random offsets, of one buffer (up to ``2**20``
    numbers, as large as the largest tensor) drawn per run: drawing fresh numbers for every
    operand of every op cost 10x more than the rest of the check on TinyGPT."""

    _MAX_BUF = 1 << 20

    def __init__(self, dtype: torch.dtype, gen: torch.Generator) -> None:
        super().__init__()
        self.u = _eps(dtype) / 2
        self.eta = _underflow(dtype)
        self.use_eta = self.eta > 1e-30
        self.gen = gen
        self.offsets = random.Random(int(torch.randint(1 << 62, (), generator=gen)))
        self.bufs: dict[torch.device, tuple[int, torch.Tensor]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in _DECOMPOSED_OPS:
            from torch._decomp import decomposition_table

            decomposition = decomposition_table.get(func)
            if decomposition is not None:
                with self:
                    return decomposition(*args, **kwargs)
        if func.is_view or func._schema.is_mutable or name.rstrip("_") in _EXACT_OPS:
            return func(*args, **kwargs)
        args, kwargs = pytree.tree_map(self._perturb, (args, kwargs))
        return pytree.tree_map(self._perturb, func(*args, **kwargs))

    def _uniform(self, t: torch.Tensor) -> torch.Tensor:
        """``t.numel()`` numbers uniform in [-1, 1] (float32), shaped like ``t``."""
        n = t.numel()
        size, buf = self.bufs.get(t.device, (0, None))
        if size < min(n, self._MAX_BUF):
            size = min(self._MAX_BUF, max(4096, 1 << (n - 1).bit_length()))
            half = torch.rand(size, generator=self.gen) * 2 - 1
            buf = torch.cat([half, half]).to(t.device)
            self.bufs[t.device] = (size, buf)
        assert buf is not None
        start = self.offsets.randrange(size)
        if n <= size:
            return buf[start:start + n].view(t.shape)
        return buf[start:start + size].repeat(-(-n // size))[:n].view(t.shape)

    def _perturb(self, t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or not (t.is_floating_point() or t.is_complex()) \
                or t.numel() == 0:
            return t
        w = _wide(t)
        w = w + w * (self._uniform(t) * self.u)
        if self.use_eta:
            w = w + torch.where(w != 0, self._uniform(t) * self.eta, 0.0)
        return w.to(t.dtype)


class _Problem:
    """A function (or module) at concrete inputs: runs it, its fxad VJP and autograd."""

    def __init__(self, fn: Any, xs: tuple, with_params: bool) -> None:
        self.fn = fn
        self.xs = xs
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
                return self.fn(*pytree.tree_unflatten(leaves, self.spec))
            finally:
                self.restore()

    def autograd(self, cots: list[torch.Tensor], noise: _RoundingNoise | None = None
                 ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[bool]]:
        """(float outputs, cotangents aligned with :meth:`wrt`, which outputs autograd
        differentiates)."""
        leaves = list(self.leaves)
        for i in self.diff:
            leaves[i] = leaves[i].detach().requires_grad_(True)
        wrt = [leaves[i] for i in self.diff] + [p for _, p in self.params]
        try:
            with torch.enable_grad(), noise if noise is not None else contextlib.nullcontext():
                outs = _float_leaves(self.fn(*pytree.tree_unflatten(leaves, self.spec)))
                req = [o.requires_grad for o in outs]
                used = [o for o, r in zip(outs, req) if r]
                used_cots = [c.to(o.dtype) for o, c, r in zip(outs, cots, req) if r]
                grads = torch.autograd.grad(used, wrt, used_cots, allow_unused=True) \
                    if used and wrt else [None] * len(wrt)
        finally:
            self.restore()
        grads = [torch.zeros_like(w) if g is None else g.detach() for g, w in zip(grads, wrt)]
        return [o.detach() for o in outs], grads, req

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
            result = g(*self.xs, cot_arg)
        finally:
            self.restore()
        in_grads = pytree.tree_flatten(result[1], is_leaf=lambda v: v is None)[0]
        if len(in_grads) != len(self.leaves):
            raise CheckError(f"fxad returned {len(in_grads)} input cotangents for "
                             f"{len(self.leaves)} input leaves")
        p_grads = result[2] if len(result) > 2 and isinstance(result[2], dict) else {}
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
    from .ad.reverse import activity, differentiable_params, has_float

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


# ------------------------------------------------------------------------------------------
# the three comparisons
# ------------------------------------------------------------------------------------------

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


# ------------------------------------------------------------------------------------------
# one full comparison of a problem (the whole function, or a prefix of its graph)
# ------------------------------------------------------------------------------------------

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


def _program_eps_of(prob: _Problem, outs: list[torch.Tensor]) -> tuple[float, torch.dtype]:
    dts = [t.dtype for t in prob.wrt()] + [o.dtype for o in outs]
    if not dts:
        return _eps(torch.float64), torch.float64
    worst = max(dts, key=_eps)
    return _eps(worst), worst


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


# ------------------------------------------------------------------------------------------
# localization: bisect over prefixes of the captured graph
# ------------------------------------------------------------------------------------------

def _candidates(fw: fx.GraphModule, with_params: bool) -> list[fx.Node]:
    from .ad.reverse import activity, differentiable_params, has_float

    leaves = {n for n in fw.graph.nodes if n.op == "placeholder" and has_float(n.meta.get("val"))}
    if with_params:
        leaves |= set(differentiable_params(fw).values())
    active, useful = activity(fw, leaves)
    return [n for n in fw.graph.nodes if n in active and n in useful and n not in leaves
            and n.op in ("call_function", "call_method", "call_module")]


def _prefix(fw: fx.GraphModule, upto: fx.Node, outs: list[fx.Node], root: torch.nn.Module,
            with_params: bool) -> fx.GraphModule:
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    reached = False
    for n in fw.graph.nodes:
        if n.op == "output":
            break
        if n.op == "placeholder" or not reached:
            env[n] = graph.node_copy(n, lambda a: env[a])
            env[n].meta = dict(n.meta)
        if n is upto:
            reached = True
    graph.output(tuple(env[o] for o in outs))
    gm = fx.GraphModule(root, graph, class_name="CheckPrefix")
    gm.meta.update({k: v for k, v in fw.meta.items() if k != "fxad_rebuild"})
    gm.meta["fxad_source_module"] = gm if with_params else None
    return gm


def _is_tensor_float(n: fx.Node) -> bool:
    v = n.meta.get("val")
    return isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex())


def _localize(kind: str, fw: fx.GraphModule, xs: tuple, with_params: bool, st: _Setup,
              leaf_modules: Iterable[type], eps: float = 0.0, dtype: Any = None,
              xs64: tuple | None = None, elementwise: bool = True) -> fx.Node | None:
    """First op (in program order) whose VJP disagrees, by bisection over graph prefixes."""
    from .api import vjp

    cands = _candidates(fw, with_params)
    root64 = None
    if kind == "rounding" and xs64 is not None:
        root64 = copy.deepcopy(fw).to(torch.float64)

    def ok(k: int) -> bool:
        upto = cands[k]
        outs = [n for n in cands[:k + 1] if _is_tensor_float(n)]
        if not outs:
            return True
        gm = _prefix(fw, upto, outs, fw, with_params)
        prob = _Problem(gm, xs, with_params)
        gen = torch.Generator().manual_seed(st.seed + 1)
        g = vjp(gm, *xs, leaf_modules=leaf_modules)
        if kind == "rounding":
            if root64 is not None:
                ref = _Problem(_prefix(fw, upto, outs, root64, with_params), xs64, with_params)
            else:
                ref = prob
            fail, _ = _rounding_side(prob, g, ref, eps, dtype, gen)
        else:
            fail, _ = _formula_side(prob, g, st, gen, with_fd=kind == "fd",
                                    elementwise=elementwise)
        return fail is None

    try:
        if not cands or ok(len(cands) - 1):
            return None
        lo, hi = -1, len(cands) - 1
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if ok(mid):
                lo = mid
            else:
                hi = mid
    except Exception:  # a prefix that cannot be differentiated on its own: give up quietly
        return None
    node = cands[hi]
    from .ad.reverse import _is_structural_getitem

    while _is_structural_getitem(node):
        node = node.args[0]
    return node


def _definition_loc(f: Any) -> SourceLoc | None:
    """``file:line`` of the definition of the checked function or module's ``forward``."""
    import linecache

    target = type(f).forward if isinstance(f, torch.nn.Module) else f
    target = inspect.unwrap(getattr(target, "__func__", target))
    code = getattr(target, "__code__", None)
    if code is None:
        return None
    text = linecache.getline(code.co_filename, code.co_firstlineno).strip()
    return SourceLoc(code.co_filename, code.co_firstlineno, code.co_name, text)


def _raise(fail: _Failure, f: Any, node: fx.Node | None, fw: fx.GraphModule | None,
           checked_dtype: Any) -> None:
    from .ad.reverse import node_desc
    from .rules.dispatch import rule_key
    from .rules.registry import op_name

    affected = ", ".join(fail.names) if fail.names else "the output"
    if fail.kind == "structure":
        raise CheckError(fail.message, loc=_definition_loc(f),
                         hint="fxad.show(fxad.vjp(f, *inputs)) prints the generated code")
    if node is None or fw is None:
        raise CheckError(
            fail.message + f" (no single op's derivative disagrees on its own; affected: "
            f"{affected})", loc=_definition_loc(f),
            hint="the difference comes from how the ops combine; fxad.show(fxad.vjp(f, "
                 "*inputs)) prints the generated code to compare with the function")
    desc = node_desc(fw, node)
    key = rule_key(fw, node)
    try:
        spelled = op_name(key)
    except Exception:
        spelled = desc
    loc = node.meta.get("fxad_loc")
    what = f"differs beyond {checked_dtype} rounding" if fail.kind == "rounding" \
        else "disagrees"
    msg = (f"{fail.message}\n  the first op whose derivative {what}: {desc} (`{node.name}`); "
           f"affected: {affected}")
    hint = (f"correct the rule for {spelled}: fxad.lookup({spelled}) returns the registered rule "
            f"(its source says where the formula comes from); register a corrected one with "
            f"fxad.register_vjp({spelled}, ..., replace=True); fxad.show(fxad.vjp(f, *inputs)) "
            "prints the generated code")
    raise CheckError(msg, op=desc, loc=loc if isinstance(loc, SourceLoc) else None, hint=hint)


# ------------------------------------------------------------------------------------------
# the entry point
# ------------------------------------------------------------------------------------------

def check(f: Callable | torch.nn.Module, *inputs: Any, dtype: torch.dtype | None = torch.float64,
          atol: float = 1e-6, rtol: float = 1e-5, fd_eps: float | None = None,
          fd_rtol: float | None = None, seed: int = 0,
          leaf_modules: Iterable[type] = ()) -> CheckReport:
    """Check fxad's VJP of ``f`` at ``inputs`` against autograd and finite differences.

    See the module docstring (:mod:`fxad.check`) for what is compared in each dtype, the
    tolerances and their sources.

    Args:
        f: function or ``nn.Module`` (copied and cast to ``dtype``; the original is untouched).
        inputs: example inputs (floating tensors are cast to ``dtype``).
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

    Returns:
        :class:`CheckReport`.

    Raises:
        CheckError: a cotangent disagrees; the message names the input or parameter and the
            error, the first op whose derivative disagrees and, as its location, the user's
            line of that op.
        InputError: the function has random ops active (dropout in training mode), so no
            oracle can reproduce its values; call ``.eval()`` or set p=0.
    """
    from .capture.control import eager_semantics

    # the reference runs execute torch.cond / while_loop / scan / map as the Python programs
    # they are defined as (fxad's capture still sees them as control flow)
    with eager_semantics(f):
        return _check(f, inputs, dtype, atol, rtol, fd_eps, fd_rtol, seed, leaf_modules)


def _check(f: Any, inputs: tuple, dtype: torch.dtype | None, atol: float, rtol: float,
           fd_eps: float | None, fd_rtol: float | None, seed: int,
           leaf_modules: Iterable[type]) -> CheckReport:
    from .api import vjp
    from .simplify._util import draws_random

    st = _Setup(atol, rtol, fd_eps, fd_rtol, seed)
    gen = torch.Generator().manual_seed(seed)
    is_mod = isinstance(f, torch.nn.Module)
    fnD: Any = copy.deepcopy(f) if is_mod else f
    if is_mod and dtype is not None:
        fnD = fnD.to(dtype)
    xsD = _cast(inputs, dtype)
    gD = vjp(fnD, *xsD, leaf_modules=leaf_modules)
    fwD = gD.meta["fxad_forward"]
    if any(draws_random(n) for n in fwD.graph.nodes):
        raise InputError("fxad.check cannot compare a function with active random ops "
                         "(e.g. dropout in training mode)",
                         hint="call .eval() on the module or set the dropout probability to 0")
    probD = _Problem(fnD, xsD, is_mod)
    epsD, dtD = _program_eps(fwD, probD)
    report_dtype = dtype if dtype is not None else (dtD or torch.float64)
    precise = epsD <= _eps(torch.float64)
    notes: list[str] = []
    _NOTES.clear()

    # the formula check runs in float64: the same point (D values), cast
    prob64, g64, fw64, xs64 = probD, gD, fwD, xsD
    if not precise:
        try:
            fn64: Any = copy.deepcopy(fnD).to(torch.float64) if is_mod else f
            xs64 = _cast(xsD, torch.float64)
            g64 = vjp(fn64, *xs64, leaf_modules=leaf_modules)
            fw64 = g64.meta["fxad_forward"]
            prob64 = _Problem(fn64, xs64, is_mod)
            if _program_eps(fw64, prob64)[0] > _eps(torch.float64) or \
                    len(_float_leaves(prob64.run())) != len(_float_leaves(probD.run())):
                raise TypeError("the program keeps lower-precision values in float64")
        except Exception as e:  # noqa: BLE001 - any failure: check in D alone
            notes.append(f"the function does not run in float64 ({type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''}); formulas and finite "
                         f"differences checked in {report_dtype}, to about eps**(2/3) = "
                         f"{epsD ** (2 / 3):.2g} relative")
            prob64, g64, fw64, xs64 = probD, gD, fwD, xsD
    formula_in_D = prob64 is probD

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
                node = _localize("formula", fw64, xs64, is_mod, st, leaf_modules)
            else:
                node = _localize("rounding", fw64, xs64, is_mod, st, leaf_modules, eps=epsD,
                                 dtype=dtD or report_dtype)
            if node is None and fail.kind == "fd":
                node = _localize("fd", fw64, xs64, is_mod, st, leaf_modules,
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
                "rounding", fwD, xsD, is_mod, st, leaf_modules, eps=epsD,
                dtype=dtD or report_dtype, xs64=None if formula_in_D else xs64)
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
