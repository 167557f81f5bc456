"""Rules for elementwise arithmetic and selection: ``+``, ``-``, unary ``-``, ``*``, ``/``,
``**`` (``pow``), ``%``, ``div`` with a ``rounding_mode``, ``rsub``, ``fmod``, ``remainder``,
``float_power``, ``ldexp``, ``frexp``, ``copysign``, ``nextafter``, ``lerp``, ``addcmul``,
``addcdiv``, ``clamp``/``clamp_min``/``clamp_max``, ``maximum``/``minimum``, ``fmax``/``fmin``,
``where``, ``nan_to_num``.

Operands may be tensors or Python scalars and broadcast; broadcast cotangents are reduced by
the engine.  Formulas follow PyTorch's ``tools/autograd/derivatives.yaml`` (entry named in
each rule).  ``maximum``/``minimum`` split the cotangent evenly on ties, as autograd does.
"""
from __future__ import annotations

import math
import operator
from typing import Any

import torch

from ._base import (conj, randn, uniform, _add, _binary_samples, _is_t, _LN2, _select,
                    _t, _tie_select, _tie_split, _value_d)
from .registry import register_vjp


# --- arithmetic -----------------------------------------------------------------------------

@register_vjp(operator.add)
class Add:
    """``a + b``: d_a = d, d_b = d (derivatives.yaml ``add.Tensor``)."""

    residuals = "nothing"

    def fwd(a, b):
        return a + b, None

    def bwd(aux, d):
        return d, d

    def jvp(primals, tangents):
        (a, b), (ta, tb) = primals, tangents
        return a + b, _add(ta, tb)

    def samples(dtype):
        yield (_t((3, 4), dtype), _t((4,), dtype)), {}
        yield (_t((3, 1), dtype), 2.5), {}
        yield (1.5, _t((2, 3), dtype)), {}


@register_vjp(operator.sub)
class Sub:
    """``a - b``: d_a = d, d_b = -d (derivatives.yaml ``sub.Tensor``)."""

    residuals = "nothing"

    def fwd(a, b):
        return a - b, None

    def bwd(aux, d):
        return d, -d

    def jvp(primals, tangents):
        (a, b), (ta, tb) = primals, tangents
        return a - b, _add(ta, None if tb is None else -tb)

    def samples(dtype):
        yield (_t((3, 4), dtype), _t((3, 1), dtype)), {}
        yield (2.0, _t((3,), dtype)), {}


@register_vjp(operator.neg)
class Neg:
    """``-a``: d_a = -d (derivatives.yaml ``neg``)."""

    def fwd(a):
        return -a, None

    def bwd(aux, d):
        return (-d,)

    def jvp(primals, tangents):
        return -primals[0], -tangents[0]

    def samples(dtype):
        yield (_t((3, 4), dtype),), {}


@register_vjp(operator.mul)
class Mul:
    """``a * b``: d_a = d * b, d_b = a * d (derivatives.yaml ``mul.Tensor``; complex:
    d_a = d * conj(b), d_b = conj(a) * d)."""

    residuals = "inputs"

    def fwd(a, b):
        return a * b, (a, b)

    def bwd(aux, d):
        a, b = aux
        return d * conj(b), conj(a) * d

    def jvp(primals, tangents):
        (a, b), (ta, tb) = primals, tangents
        return a * b, _add(None if ta is None else ta * b, None if tb is None else a * tb)

    def samples(dtype):
        yield (_t((3, 4), dtype), _t((4,), dtype)), {}
        yield (_t((3, 4), dtype), 3.0), {}
        yield (-0.5, _t((2,), dtype)), {}


@register_vjp(operator.truediv)
class Div:
    """``a / b``: d_a = d / b, d_b = -d * (a / b) / b (derivatives.yaml ``div.Tensor``;
    complex: d_a = d / conj(b), d_b = -d_a * conj(a / b))."""

    def fwd(a, b):
        out = a / b
        return out, (b, out)

    def bwd(aux, d):
        b, out = aux
        d_a = d / conj(b)
        return d_a, (-d_a * conj(out) if _is_t(b) else None)

    def jvp(primals, tangents):
        (a, b), (ta, tb) = primals, tangents
        out = a / b
        t = None if ta is None else ta / b
        if tb is not None:
            t = _add(t, -(tb * out) / b)
        return out, t

    def samples(dtype):
        yield (_t((3, 4), dtype), _t((4,), dtype, 0.5, 2.0)), {}
        yield (_t((3,), dtype), 4.0), {}
        yield (2.0, _t((3,), dtype, 0.5, 2.0)), {}


def _pow_self_factor(a: Any, b: Any) -> Any:
    """d(a ** b)/da = b * a ** (b - 1) for a tensor exponent, 0 where b == 0 (also at a == 0,
    where the formula gives 0 * inf; derivatives.yaml `pow.Tensor_Tensor`:
    pow_backward_self)."""
    return torch.where(b == 0, 0.0, b * a ** (b - 1))


@register_vjp(operator.pow)
@register_vjp(torch.pow)
class Pow:
    """``a ** b``.  d_a = d * b * a ** (b - 1); d_b = d * out * log(a)
    (derivatives.yaml ``pow.Tensor_Scalar``, ``pow.Tensor_Tensor``, ``pow.Scalar``)."""

    def fwd(a, b):
        out = a ** b
        return out, (a, b, out)

    def bwd(aux, d):
        a, b, out = aux
        if not _is_t(a):  # scalar base
            return None, d * (out * math.log(a))
        if not _is_t(b):
            if b == 0:
                return None, None
            if b == 2:
                return (d * (2 * a),)
            return (d * (b * a ** (b - 1)),)
        d_a = d * _pow_self_factor(a, b)
        d_b = d * (out * torch.where(a > 0, torch.log(a), 0.0))
        return d_a, d_b

    def jvp(primals, tangents):
        (a, b), (ta, tb) = primals, tangents
        out = a ** b
        t = None
        if ta is not None and not (not _is_t(b) and b == 0):
            t = ta * (2 * a) if (not _is_t(b) and b == 2) else ta * (
                _pow_self_factor(a, b) if _is_t(b) else b * a ** (b - 1))
        if tb is not None:
            t = _add(t, tb * (out * (math.log(a) if not _is_t(a) else torch.log(a))))
        return out, t

    def samples(dtype):
        yield (_t((3, 4), dtype, 0.5, 2.0), 3), {}
        yield (_t((3, 4), dtype, 0.5, 2.0), 2), {}
        yield (_t((3,), dtype, 0.5, 2.0), -0.5), {}
        yield (_t((3, 4), dtype, 0.5, 2.0), _t((4,), dtype)), {}
        yield (2.0, _t((3,), dtype)), {}


@register_vjp(operator.mod)
class Mod:
    """``a % b`` = a - floor(a / b) * b (Python's remainder, ``torch.remainder``): d_a = d,
    d_b = -d * floor(a / b) (derivatives.yaml `remainder.Tensor`)."""

    def fwd(a, b):
        return a % b, (a, b)

    def bwd(aux, d):
        a, b = aux
        return d, (-d * torch.floor_divide(a, b) if _is_t(b) else None)

    def samples(dtype):
        yield (_t((3, 4), dtype, -3.0, 3.0), _t((4,), dtype, 0.7, 1.3)), {}
        yield (_t((3,), dtype, -3.0, 3.0), 0.9), {}


@register_vjp(torch.clamp)
@register_vjp(torch.clip)
class Clamp:
    """clamp(x, min, max): d_x = d where min <= x <= max, else 0; tensor bounds receive the
    cotangent where they are active (derivatives.yaml `clamp`, `clamp.Tensor`)."""

    def fwd(input, min=None, max=None):
        return torch.clamp(input, min, max), (input, min, max)

    def bwd(aux, d):
        x, lo, hi = aux
        keep = None
        if lo is not None:
            keep = x >= lo
        if hi is not None:
            keep = (x <= hi) if keep is None else keep & (x <= hi)
        d_x = d if keep is None else torch.where(keep, d, 0.0)
        # as PyTorch's clamp_backward_min_max: with both bounds, min wins only where
        # min < max; max takes the cotangent where x > max or max < min
        d_lo = d_hi = None
        if _is_t(lo):
            lo_wins = x < lo if hi is None else (x < lo) & (lo < hi)
            d_lo = torch.where(lo_wins, d, 0.0)
        if _is_t(hi):
            hi_wins = x > hi if lo is None else (x > hi) | (hi < lo)
            d_hi = torch.where(hi_wins, d, 0.0)
        return d_x, d_lo, d_hi

    def jvp(primals, tangents):
        (x, lo, hi), (tx, t_lo, t_hi) = primals, tangents
        # the tangent of whichever operand the value is; where x equals its only bound and
        # that bound is a tensor, the bound's, as PyTorch's clamp_jvp (its VJP gives that
        # cotangent to x instead; a number bound: x's tangent, as both of PyTorch's modes)
        if hi is None and _is_t(lo):
            return torch.clamp(x, lo, hi), _select(x > lo, tx, t_lo)
        if lo is None and _is_t(hi):
            return torch.clamp(x, lo, hi), _select(x < hi, tx, t_hi)
        t = tx if lo is None else _select(x < lo, t_lo, tx)
        if hi is not None:
            t = _select(x > hi if lo is None else (x > hi) | (hi < lo), t_hi, t)
        return torch.clamp(x, lo, hi), t

    def samples(dtype):
        yield (randn(3, 4, dtype=dtype), -0.5, 0.5), {}
        yield (randn(3, 4, dtype=dtype),), {"min": 0.1}
        yield (randn(6, dtype=dtype),), {"max": 0.2}
        yield (randn(3, 4, dtype=dtype), randn(4, dtype=dtype) - 1, randn(3, 1, dtype=dtype) + 1), {}


@register_vjp(torch.clamp_min)
class ClampMin:
    """clamp_min(x, m) = max(x, m) (derivatives.yaml `clamp_min`)."""

    def fwd(input, min):
        return torch.clamp_min(input, min), (input, min)

    def bwd(aux, d):
        x, lo = aux
        return torch.where(x >= lo, d, 0.0), (torch.where(x < lo, d, 0.0) if _is_t(lo) else None)

    def jvp(primals, tangents):
        (x, lo), (tx, t_lo) = primals, tangents
        return torch.clamp_min(x, lo), _select(x >= lo, tx, t_lo)

    def samples(dtype):
        yield (randn(3, 4, dtype=dtype), 0.1), {}


@register_vjp(torch.clamp_max)
class ClampMax:
    """clamp_max(x, m) = min(x, m) (derivatives.yaml `clamp_max`)."""

    def fwd(input, max):
        return torch.clamp_max(input, max), (input, max)

    def bwd(aux, d):
        x, hi = aux
        return torch.where(x <= hi, d, 0.0), (torch.where(x > hi, d, 0.0) if _is_t(hi) else None)

    def jvp(primals, tangents):
        (x, hi), (tx, t_hi) = primals, tangents
        return torch.clamp_max(x, hi), _select(x <= hi, tx, t_hi)

    def samples(dtype):
        yield (randn(3, 4, dtype=dtype), 0.1), {}


def _maximum_minimum(op: Any) -> type:
    class MaximumMinimum:
        """maximum/minimum(a, b): the cotangent goes to the selected operand, split evenly on
        ties (derivatives.yaml `maximum`: at::where(self == other, grad / 2,
        grad).masked_fill_(...))."""

        def fwd(input, other):
            out = op(input, other)
            return out, (input, other, out)

        def bwd(aux, d):
            return _tie_split(*aux, d)

        def jvp(primals, tangents):
            (a, b), (ta, tb) = primals, tangents
            out = op(a, b)
            return out, _tie_select(a, b, out, ta, tb)

        def samples(dtype):
            yield (randn(3, 4, dtype=dtype), randn(4, dtype=dtype)), {}

    return MaximumMinimum


register_vjp(torch.maximum)(_maximum_minimum(torch.maximum))
register_vjp(torch.minimum)(_maximum_minimum(torch.minimum))


@register_vjp(torch.where)
class Where:
    """where(cond, a, b): d_a = where(cond, d, 0), d_b = where(cond, 0, d)
    (derivatives.yaml `where.self`)."""

    def fwd(condition, input, other):
        return torch.where(condition, input, other), condition

    def bwd(cond, d):
        return None, torch.where(cond, d, 0.0), torch.where(cond, 0.0, d)

    def jvp(primals, tangents):
        (cond, a, b), (_, ta, tb) = primals, tangents
        return torch.where(cond, a, b), _select(cond, ta, tb)

    def samples(dtype):
        x = randn(3, 4, dtype=dtype)
        yield (x > 0, x, randn(4, dtype=dtype)), {}
        yield (x > 0, x, 0.0), {}


@register_vjp(torch.Tensor.where)
class TensorWhere:
    """x.where(cond, y) = where(cond, x, y): d_x = where(cond, d, 0), d_y = where(cond, 0, d)
    (derivatives.yaml `where.self`; the method takes the condition second)."""

    def fwd(self, condition, other):
        return self.where(condition, other), condition

    def bwd(cond, d):
        return torch.where(cond, d, 0.0), None, torch.where(cond, 0.0, d)

    def jvp(primals, tangents):
        (a, cond, b), (ta, _, tb) = primals, tangents
        return a.where(cond, b), _select(cond, ta, tb)

    def samples(dtype):
        x = randn(3, 4, dtype=dtype)
        yield (x, x > 0, randn(4, dtype=dtype)), {}
        yield (x, x > 0, 0.0), {}


def _fmax_fmin(op: Any, cmp: Any) -> type:
    """fmax/fmin: the cotangent goes to the selected operand; on ties it is split in half;
    NaN operands are ignored (derivatives.yaml ``fmax``/``fmin``)."""

    class FMaxMin:
        source = (f"{op.__name__}: cotangent to the selected operand, halved on ties, NaN "
                  f"operands ignored (derivatives.yaml `{op.__name__}`)")

        def fwd(input, other):
            return op(input, other), (input, other)

        def bwd(aux, d):
            a, b = aux
            pick_a = cmp(a, b) | torch.isnan(b)
            pick_b = cmp(b, a) | torch.isnan(a)
            tie = a == b
            w_a = torch.where(tie, 0.5, pick_a.to(d.dtype))
            w_b = torch.where(tie, 0.5, pick_b.to(d.dtype))
            return d * w_a, d * w_b

        def samples(dtype):
            yield from _binary_samples(dtype)

    return FMaxMin


register_vjp(torch.fmax)(_fmax_fmin(torch.fmax, torch.gt))
register_vjp(torch.fmin)(_fmax_fmin(torch.fmin, torch.lt))


@register_vjp(torch.lerp)
class Lerp:
    """lerp(a, b, w) = a + w (b - a): d_a = d (1 - w), d_b = d w, d_w = d (b - a)
    (derivatives.yaml ``lerp.Tensor`` / ``lerp.Scalar``)."""

    def fwd(input, end, weight):
        return torch.lerp(input, end, weight), (input, end, weight)

    def bwd(aux, d):
        a, b, w = aux
        return d * (1 - w), d * w, (d * (b - a) if _is_t(w) else None)

    def jvp(primals, tangents):
        (a, b, w), (ta, tb, tw) = primals, tangents
        out = torch.lerp(a, b, w)
        t = _add(None if ta is None else ta * (1 - w), None if tb is None else tb * w)
        return out, _add(t, None if tw is None else tw * (b - a))

    def samples(dtype):
        yield (_t((3, 4), dtype), _t((3, 4), dtype), _t((4,), dtype, 0.0, 1.0)), {}
        yield (_t((3, 4), dtype), _t((3, 4), dtype), 0.3), {}


@register_vjp(torch.addcmul)
class Addcmul:
    """addcmul(x, a, b, value=v) = x + v a b: d_x = d, d_a = v d b, d_b = v d a
    (derivatives.yaml ``addcmul``)."""

    def fwd(input, tensor1, tensor2, *, value=1):
        return torch.addcmul(input, tensor1, tensor2, value=value), (tensor1, tensor2, value)

    def bwd(aux, d):
        a, b, v = aux
        dv = d * v if v != 1 else d
        return d, dv * b, dv * a

    def jvp(primals, tangents):
        (x, a, b, v), (tx, ta, tb, _) = primals, tangents
        out = torch.addcmul(x, a, b, value=v)
        t = _add(None if ta is None else ta * b, None if tb is None else a * tb)
        if t is not None and v != 1:
            t = t * v
        return out, _add(tx, t)

    def samples(dtype):
        yield (_t((3, 4), dtype), _t((3, 4), dtype), _t((4,), dtype)), {"value": 0.5}
        yield (_t((3, 4), dtype), _t((3, 1), dtype), _t((3, 4), dtype)), {}


@register_vjp(torch.addcdiv)
class Addcdiv:
    """addcdiv(x, a, b, value=v) = x + v a / b: d_x = d, d_a = v d / b, d_b = -v d a / b^2
    (derivatives.yaml ``addcdiv``)."""

    def fwd(input, tensor1, tensor2, *, value=1):
        return torch.addcdiv(input, tensor1, tensor2, value=value), (tensor1, tensor2, value)

    def bwd(aux, d):
        a, b, v = aux
        dv = d * v if v != 1 else d
        q = dv / b
        return d, q, -q * a / b

    def samples(dtype):
        yield (_t((3, 4), dtype), _t((3, 4), dtype), _t((4,), dtype, 0.5, 2.0)), {"value": 0.5}


@register_vjp(torch.fmod)
class Fmod:
    """fmod(a, b) = a - trunc(a / b) b: d_a = d, d_b = -d trunc(a / b)
    (derivatives.yaml ``fmod.Tensor``)."""

    def fwd(input, other):
        return torch.fmod(input, other), (input, other)

    def bwd(aux, d):
        a, b = aux
        return d, (-d * torch.trunc(a / b) if _is_t(b) else None)

    def samples(dtype):
        yield (_t((3, 4), dtype), 1.5), {}


@register_vjp(torch.remainder)
class Remainder:
    """remainder(a, b) = a - floor(a / b) b: d_a = d, d_b = -d floor(a / b)
    (derivatives.yaml ``remainder.Tensor``)."""

    def fwd(input, other):
        return torch.remainder(input, other), (input, other)

    def bwd(aux, d):
        a, b = aux
        return (d if _is_t(a) else None), (-d * torch.floor(a / b) if _is_t(b) else None)

    def samples(dtype):
        yield (_t((3, 4), dtype), 1.5), {}


@register_vjp(torch.float_power)
class FloatPower:
    """float_power(a, b) = a^b in float64: d_a = d b a^(b-1), d_b = d out log a
    (derivatives.yaml ``float_power``; the engine casts back to the input dtype)."""

    def fwd(input, exponent):
        out = torch.float_power(input, exponent)
        return out, (input, exponent, out)

    def bwd(aux, d):
        a, b, out = aux
        d_a = d * b * torch.float_power(a, b - 1) if _is_t(a) else None
        d_b = None
        if _is_t(b):
            d_b = d * out * (torch.log(a) if _is_t(a) else math.log(a))
        return d_a, d_b

    def samples(dtype):
        yield (_t((3, 4), dtype, 0.5, 2.0), 2.5), {}
        yield (_t((3, 4), dtype, 0.5, 2.0), _t((4,), dtype)), {}


@register_vjp(torch.ldexp)
class Ldexp:
    """ldexp(a, e) = a 2^e: d_a = d 2^e, d_e = d out ln 2 (derivatives.yaml via ``mul``)."""

    def fwd(input, other):
        out = torch.ldexp(input, other)
        return out, (other, out)

    def bwd(aux, d):
        e, out = aux
        d_e = d * out * _LN2 if _is_t(e) and e.is_floating_point() else None
        return d * torch.exp2(e), d_e

    def samples(dtype):
        yield (_t((3, 4), dtype), _t((4,), dtype)), {}


@register_vjp(torch.copysign)
class Copysign:
    """copysign(a, b) = |a| sign(b): d_a = d * copysign(1, a) * copysign(1, b) (0 where a == 0),
    d_b = 0 (derivatives.yaml ``copysign.Tensor``)."""

    def fwd(input, other):
        out = torch.copysign(input, other)
        return out, (input, out)

    def bwd(aux, d):
        a, out = aux
        return d * torch.where(a == 0, 0.0, out / a), None

    def samples(dtype):
        yield (_t((3, 4), dtype), _t((4,), dtype)), {}


# --- elementwise odds and ends ----------------------------------------------------------------

@register_vjp(torch.rsub)
class Rsub:
    """rsub(x, y, alpha) = y - alpha x: d_x = -alpha d, d_y = d (derivatives.yaml `rsub`)."""

    def fwd(input, other, alpha=1):
        return torch.rsub(input, other, alpha=alpha), (input, other, alpha)

    def bwd(aux, d):
        x, y, alpha = aux
        is_t = lambda v: isinstance(v, torch.Tensor) or hasattr(v, "node")  # noqa: E731
        return (-d * alpha if is_t(x) else None), (d if is_t(y) else None)

    def samples(dtype):
        yield (randn(3, 4, dtype=dtype), randn(4, dtype=dtype)), {}
        yield (randn(3, 4, dtype=dtype), 2.0, 0.5), {}


@register_vjp(torch.nan_to_num)
class NanToNum:
    """nan_to_num(x): d_x = d where x is finite, else 0 (derivatives.yaml `nan_to_num`)."""

    def fwd(input, nan=0.0, posinf=None, neginf=None, *, out=None):
        return torch.nan_to_num(input, nan, posinf, neginf), input

    def bwd(aux, d):
        return (torch.where(torch.isfinite(aux), d, 0.0),)

    def samples(dtype):
        yield (randn(3, 4, dtype=dtype),), {}  # (non-finite inputs: no finite differences)


# ---------------------------------------------------------------------------------------------
# div with rounding_mode, nextafter, frexp
# ---------------------------------------------------------------------------------------------

def _div_call(method: bool):
    def call(x: Any, y: Any, mode: Any) -> Any:
        if method:
            return x.div(y, rounding_mode=mode)
        return torch.div(x, y, rounding_mode=mode)
    return call


def _div_rule(method: bool) -> type:
    call = _div_call(method)

    class Div:
        """div(x, y, rounding_mode): with rounding_mode 'floor' or 'trunc' the result is
        piecewise constant, so both cotangents are zero (derivatives.yaml `div.Tensor_mode`:
        zeros for self and other); with rounding_mode=None it is true division,
        d_x = d / y, d_y = -d x / y^2 (derivatives.yaml `div.Tensor`)."""

        def fwd(input, other, *, rounding_mode=None):
            return call(input, other, rounding_mode), (input, other, rounding_mode)

        def bwd(aux, d):
            x, y, mode = aux
            if mode is not None:
                return None, None
            dx = d / y
            dy = -d * x / (y * y) if _is_t(y) else None
            return dx, dy

        def jvp(primals, tangents):
            x, y, mode = primals
            tx, ty = tangents[0], tangents[1]
            out = call(x, y, mode)
            if mode is not None or (tx is None and ty is None):
                return out, None
            t = None if tx is None else tx / y
            if ty is not None:
                ty_term = -ty * x / (y * y)
                t = ty_term if t is None else t + ty_term
            return out, t

        def samples(dtype):
            for mode in ("floor", "trunc"):
                yield (randn(3, 4, dtype=dtype), uniform((4,), 0.5, 2.0, dtype)), \
                    {"rounding_mode": mode}
                yield (randn(3, 4, dtype=dtype), 1.5), {"rounding_mode": mode}
            yield (randn(3, 4, dtype=dtype), uniform((3, 4), 0.5, 2.0, dtype)), \
                {"rounding_mode": None}

    return Div


for _m, _op in ((False, torch.div), (True, torch.Tensor.div)):
    register_vjp(_op)(_div_rule(_m))


@register_vjp(torch.nextafter)
class Nextafter:
    """nextafter(x, y) moves x by one ulp toward y: PyTorch treats it as the identity in x and
    constant in y (derivatives.yaml `nextafter`: self grad, other zeros), so d_x = d."""

    def fwd(input, other):
        return torch.nextafter(input, other), None

    def bwd(aux, d):
        return d, None

    def jvp(primals, tangents):
        x, y = primals
        return torch.nextafter(x, y), tangents[0]

    def samples(dtype):
        yield (randn(3, 4, dtype=dtype), randn(4, dtype=dtype)), {}
        yield (randn(dtype=dtype), randn(2, dtype=dtype)), {}


@register_vjp(torch.frexp)
class Frexp:
    """frexp(x) -> (mantissa, exponent) with x = mantissa * 2**exponent: the exponent is
    piecewise constant, so d_x = d_mantissa / 2**exponent (derivatives.yaml `frexp.Tensor`:
    grad / exponent.exp2())."""

    def fwd(input):
        out = torch.frexp(input)
        return out, out[1]

    def bwd(aux, d):
        dm = _value_d(d)
        if dm is None:
            return (None,)
        return (dm / torch.exp2(aux.to(dm.dtype)),)

    def jvp(primals, tangents):
        (x,), (t,) = primals, tangents
        out = torch.frexp(x)
        if t is None:
            return out, (None, None)
        return out, (t / torch.exp2(out[1].to(t.dtype)), None)

    def samples(dtype):
        yield (randn(3, 4, dtype=dtype) * 10,), {}
        yield (randn(dtype=dtype),), {}
