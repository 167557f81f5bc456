"""Output metadata for ops whose fake-tensor execution needs data.

Capture learns every op's result shape by running it on fake tensors.  A few ops answer a
question about the *values* while computing (``torch.cov`` checks its weights with
``torch.equal``, ``torch.combinations`` builds its result with ``masked_select``,
``F.gaussian_nll_loss`` checks ``var >= 0``, ``torch.narrow`` reads a tensor ``start``), although their result's shape depends on the
input shapes alone.  For those this module gives the shape and dtype directly, as a
documented function of the arguments; the op itself still runs on real data in the generated
code.  Ops whose result shape truly depends on values (``nonzero``) are not listed: capture
refuses them with a clear error, or (on a ShapeEnv) gives them a size of their own;
``masked_select`` is listed only so that it takes the mask's own count, as ``x[mask]`` does.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.nn.functional as F

from .. import ops


def _float_dtype(x: torch.Tensor) -> torch.dtype:
    return x.dtype if (x.is_floating_point() or x.is_complex()) else torch.get_default_dtype()


def _cov_like(input: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """cov/corrcoef of ``(vars, obs)`` → ``(vars, vars)``; a 1-D input or a single variable
    gives a 0-d result."""
    if input.dim() > 2:
        raise RuntimeError(f"cov(): expected input to have two or fewer dimensions but got "
                           f"an input with {input.dim()} dimensions")
    n = 1 if input.dim() < 2 else input.shape[0]
    shape = () if n == 1 else (n, n)
    return torch.empty(shape, dtype=_float_dtype(input), device=input.device)


def _combinations(input: torch.Tensor, r: int = 2, with_replacement: bool = False) -> torch.Tensor:
    """combinations of a 1-D input of length n: ``(C(n, r), r)`` rows, ``C(n + r - 1, r)`` with
    replacement; ``r == 0`` gives an empty 1-D tensor."""
    if input.dim() != 1:
        raise RuntimeError(f"Expect a 1D vector, but got shape {list(input.shape)}")
    if r < 0:
        raise RuntimeError(f"Expect a non-negative number, but got {r}")
    if r == 0:
        return torch.empty((0,), dtype=input.dtype, device=input.device)
    n = input.shape[0]
    rows = math.comb(n + r - 1, r) if with_replacement else math.comb(n, r)
    if n == 0:
        rows = 0
    return torch.empty((rows, r), dtype=input.dtype, device=input.device)


def _reduced(shape: tuple, reduction: str, dtype: torch.dtype, device: Any) -> torch.Tensor:
    if reduction not in ("none", "mean", "sum"):
        raise ValueError(f"{reduction} is not a valid value for reduction")
    return torch.empty(shape if reduction == "none" else (), dtype=dtype, device=device)


def _gaussian_nll_loss(input: torch.Tensor, target: torch.Tensor, var: Any, full: bool = False,
                       eps: float = 1e-6, reduction: str = "mean") -> torch.Tensor:
    """gaussian_nll_loss: elementwise over ``broadcast(input, target)`` before reduction."""
    shape = torch.broadcast_shapes(input.shape, target.shape)
    dtype = torch.result_type(input, target)
    return _reduced(tuple(shape), reduction, dtype, input.device)


def _ctc_loss(log_probs: torch.Tensor, targets: torch.Tensor, input_lengths: Any,
              target_lengths: Any, blank: int = 0, reduction: str = "mean",
              zero_infinity: bool = False) -> torch.Tensor:
    """ctc_loss of ``(T, N, C)`` log-probabilities: ``(N,)`` losses (``()`` unbatched)."""
    shape = (log_probs.shape[1],) if log_probs.dim() == 3 else ()
    return _reduced(shape, reduction, log_probs.dtype, log_probs.device)


def _narrow(input: torch.Tensor, dim: int, start: Any, length: int) -> torch.Tensor:
    """narrow with a 0-d tensor ``start``: the result's shape depends on ``length`` only."""
    if not isinstance(start, torch.Tensor):
        return torch.narrow(input, dim, start, length)
    shape = list(input.shape)
    shape[dim] = length
    return torch.empty(shape, dtype=input.dtype, device=input.device)


def _unbatched_loss(op: Callable) -> Callable[..., torch.Tensor]:
    """multi_margin_loss / multilabel_margin_loss of unbatched ``(C,)`` scores with
    ``reduction='none'``: PyTorch's fake kernels say ``(1,)``, eager says ``()``."""

    def meta(input: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        out = op(input, *args, **kwargs)
        return out.reshape(()) if input.dim() == 1 and out.dim() == 1 else out

    return meta


def _like(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return torch.empty_strided(tuple(v.shape), tuple(v.stride()), dtype=v.dtype,
                                   device=v.device)
    return v


def _floating_like(v: Any) -> Any:
    if isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex()):
        return _like(v)
    return None


def _cond(pred: Any, true_fn: Any, false_fn: Any, operands: tuple, rng: Any = None) -> Any:
    """fxad.ops.cond: the true branch's result (both branches have the same shapes)."""
    return true_fn(*operands)


def _while_loop(cond_fn: Any, body_fn: Any, carried: tuple, additional: tuple = ()) -> tuple:
    """fxad.ops.while_loop: tensors like the carried inputs."""
    return tuple(_like(c) for c in carried)


def _while_loop_vjp(cond_fn: Any, body_fn: Any, body_vjp: Any, carried: tuple,
                    additional: tuple, cotangents: tuple) -> tuple:
    """fxad.ops.while_loop_vjp: one cotangent per carried and additional input."""
    return tuple(_floating_like(v) for v in tuple(carried) + tuple(additional))


def _while_loop_jvp(cond_fn: Any, body_jvp: Any, carried: tuple, tangents: tuple,
                    additional: tuple, additional_tangents: tuple) -> tuple:
    """fxad.ops.while_loop_jvp: (carried, tangents)."""
    return tuple(_like(c) for c in carried), tuple(_floating_like(c) for c in carried)


def _control_flow() -> dict[Any, Callable[..., Any]]:
    return {ops.cond: _cond, ops.while_loop: _while_loop, ops.while_loop_vjp: _while_loop_vjp,
            ops.while_loop_jvp: _while_loop_jvp}


def _masked_select(input: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """masked_select(x, mask) as ``x[mask]`` after broadcasting both: one dimension, the
    mask's count.  Without a ShapeEnv PyTorch raises its data-dependent-size error, as for
    masked_select itself; on one, the count is the mask's ``nonzero`` count, which PyTorch
    memoizes on the mask, so every selection by the same mask (``x[mask]``, ``nonzero``, other
    ``masked_select`` calls) has the same size, where masked_select's own fake kernel makes a
    new one per call."""
    shape = torch.broadcast_shapes(input.shape, mask.shape)
    x = input if tuple(input.shape) == tuple(shape) else input.expand(shape)
    m = mask if tuple(mask.shape) == tuple(shape) else mask.expand(shape)
    return x[m].reshape(-1)


OUTPUT_META: dict[Any, Callable[..., torch.Tensor]] = {
    torch.masked_select: _masked_select,
    torch.Tensor.masked_select: _masked_select,
    torch.cov: _cov_like,
    torch.corrcoef: _cov_like,
    torch.combinations: _combinations,
    F.gaussian_nll_loss: _gaussian_nll_loss,
    F.ctc_loss: _ctc_loss,
    torch.narrow: _narrow,
    F.multi_margin_loss: _unbatched_loss(F.multi_margin_loss),
    F.multilabel_margin_loss: _unbatched_loss(F.multilabel_margin_loss),
}
OUTPUT_META.update(_control_flow())
