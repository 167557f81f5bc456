"""Rules for the random sampling functions outside ``torch.nn``: ``torch.bernoulli`` (tensor
and float probability; ``x.bernoulli()`` is recorded as it) and ``torch.normal`` (tensor or
float mean and std).  The dropout family is in :mod:`fxad.rules.nn.dropout`, ``rrelu`` in
:mod:`fxad.rules.nn.activations`, the fractional max pools in :mod:`fxad.rules.nn.pooling`.

The generated forward calls the op itself, with the user's arguments: the same kernel on
the same shapes, so under the same ``torch.manual_seed`` it draws the same numbers as eager
PyTorch, on any device (``torch.bernoulli(p)`` and ``torch.bernoulli(x, 0.3)`` are
different kernels, and each stays the one the user called).  In-place draws in user code
(``x.bernoulli_(0.3)``, ``x.normal_()``, ``x.uniform_()``) are recorded by capture as the
same in-place method on ``torch.empty_like(x)`` and carry no derivative.  Generated code
draws the same way (dropout's ``torch.empty_like(x).bernoulli_(0.7)``), and where it is
differentiated again (:func:`fxad.hvp`, ``fxad.jvp(fxad.grad(f, x), x)``) those calls have
the rules below: the same call again, with a zero derivative (the draw overwrites every
element of its tensor, and autograd gives no derivative with respect to the distribution's
parameters: derivatives.yaml ``bernoulli_.Tensor``, ``bernoulli_.float``, ``uniform_``,
``normal_``, ...: zeros).

Derivatives are autograd's (derivatives.yaml): ``bernoulli`` has a zero derivative with
respect to its probabilities, and so does ``normal`` with respect to ``mean`` and ``std``
(``normal.Tensor_Tensor``, ``normal.Tensor_float``, ``normal.float_Tensor``: zeros), which
is what ``torch.autograd`` returns, and what fxad returns.  ``torch.normal`` is not the
reparameterized sample: for pathwise gradients write ``mean + std * torch.randn_like(std)``
(differentiated as written; ``torch.distributions.Normal(mean, std).rsample()`` does that).
"""
from __future__ import annotations

from typing import Any

import torch

from ._base import _error, _t, randn
from .registry import register_vjp


def _no_generator(op: str, generator: Any) -> None:
    if generator is not None:
        raise _error(op, "a generator argument cannot be written into generated code",
                     "draw from the default generator (seed it with torch.manual_seed)")


@register_vjp(torch.bernoulli)
class Bernoulli:
    """``torch.bernoulli(p)`` (out[i] ~ Bernoulli(p[i])) and ``torch.bernoulli(x, p)``
    (Bernoulli(p) with x's shape and dtype): the generated forward calls the op itself, so
    it draws what eager draws under the same seed.  Zero derivative with respect to the
    probabilities and to x (derivatives.yaml `bernoulli`, `bernoulli.p`: zeros_like(grad));
    zero tangent."""

    residuals = "nothing"
    recompute = False

    def fwd(input, p=None, *, generator=None):
        _no_generator("torch.bernoulli", generator)
        out = torch.bernoulli(input) if p is None else torch.bernoulli(input, p)
        return out, None

    def bwd(aux, d):
        return (None,)

    def jvp(primals, tangents):
        input, p = primals[:2]
        return (torch.bernoulli(input) if p is None else torch.bernoulli(input, p)), None

    def samples(dtype):
        yield (_t((3, 4), dtype, 0.0, 1.0),), {}
        yield (_t((3, 4), dtype, 0.0, 1.0).mT,), {}  # a strided input
        # (torch.bernoulli(x, 0.3): autograd raises "derivative not implemented", so it is
        # compared with eager in tests/test_random_ops.py instead)


def _normal(mean: Any, std: Any, size: Any, kwargs: dict) -> Any:
    if size is not None:
        return torch.normal(mean, std, size, **kwargs)
    return torch.normal(mean, std, **kwargs)


@register_vjp(torch.normal)
class Normal:
    """``torch.normal(mean, std)`` with tensor or float mean and std (out = mean + std * eps,
    eps ~ N(0, 1) drawn into a contiguous tensor of the broadcast shape): the generated
    forward calls the op itself, so it draws what eager draws under the same seed.  Zero
    derivative with respect to mean and std, as torch.autograd gives (derivatives.yaml
    `normal.Tensor_Tensor`, `normal.Tensor_float`, `normal.float_Tensor`: zeros); zero
    tangent.  (Not reparameterized: ``mean + std * torch.randn_like(std)`` is.)"""

    residuals = "nothing"
    recompute = False

    def fwd(mean, std=1.0, size=None, *, generator=None, **kwargs):
        _no_generator("torch.normal", generator)
        return _normal(mean, std, size, kwargs), None

    def bwd(aux, d):
        return (None, None)

    def jvp(primals, tangents):
        mean, std, size = primals[:3]
        return _normal(mean, std, size, dict(primals[-1] or {})), None

    def samples(dtype):
        yield (randn(3, 4, dtype=dtype), _t((3, 4), dtype, 0.5, 2.0)), {}
        yield (randn(2, 3, dtype=dtype), _t((3,), dtype, 0.5, 2.0)), {}  # broadcast
        yield (randn(3, 4, dtype=dtype), 2.0), {}
        yield (1.5, _t((4, 2), dtype, 0.5, 2.0)), {}


# the in-place draws of generated code (capture records the user's own as these calls too)
_DRAWS_IN_PLACE = ("bernoulli_", "uniform_", "normal_", "exponential_", "random_",
                   "geometric_", "cauchy_", "log_normal_")


def _draw_in_place_rule(name: str) -> type:
    op = f"Tensor.{name}"

    class DrawInPlace:
        __doc__ = (f"``x.{name}(...)`` fills ``x`` with random numbers: the generated code calls "
                   "it again, on the same tensor, so it draws what eager draws under the same "
                   f"seed.  Zero derivative with respect to ``x`` (overwritten) and to the "
                   f"distribution's parameters (derivatives.yaml `{name}`: zeros_like(grad)); "
                   "zero tangent.")

        residuals = "nothing"
        recompute = False

        def fwd(input, *args, generator=None, **kwargs):
            _no_generator(op, generator)
            return getattr(input, name)(*args, **kwargs), None

        def bwd(aux, d):
            return (None,)

        def jvp(primals, tangents):
            # primals: (input, *args, generator, kwargs) (see fxad.ad.forward)
            input, args, generator, kwargs = primals[0], primals[1:-2], primals[-2], primals[-1]
            _no_generator(op, generator)
            return getattr(input, name)(*args, **dict(kwargs or {})), None

    DrawInPlace.__name__ = DrawInPlace.__qualname__ = \
        "DrawInPlace_" + name.strip("_").title().replace("_", "")
    return DrawInPlace


for _name in _DRAWS_IN_PLACE:
    register_vjp(getattr(torch.Tensor, _name))(_draw_in_place_rule(_name))


_rrelu_with_noise = torch.ops.aten.rrelu_with_noise_functional.default


def _rrelu_slopes(self: Any, noise_out: Any, lower: Any, upper: Any, training: bool,
                  t: Any) -> Any:
    """``t`` times the derivative of ``rrelu_with_noise`` (rrelu_with_noise_backward): the
    drawn slopes ``noise_out`` in training with ``upper - lower > 1e-6``, else leaky_relu's
    (1 where self > 0, (lower + upper) / 2 elsewhere)."""
    if training and float(upper) - float(lower) > 1e-6:
        return t * noise_out
    slope = (float(lower) + float(upper)) / 2
    return torch.where(self > 0, t, t * slope)


@register_vjp(_rrelu_with_noise)
class RreluWithNoiseFunctional:
    """``aten.rrelu_with_noise_functional(x, noise, lower, upper, training) -> (out,
    noise_out)``, the kernel the generated code of ``F.rrelu`` calls (so that it draws the
    slopes as eager does): called again as it is, the same kernel and draws.  d_x = d_out *
    noise_out in training (leaky_relu's derivative otherwise, or where upper - lower <=
    1e-6; derivatives.yaml `rrelu_with_noise`: rrelu_with_noise_backward).  In training
    noise_out (uniform draws where x <= 0, 1 elsewhere) has a zero derivative; in eval it is
    a copy of ``noise`` (d_noise = d_noise_out).  JVP: t_out = t_x * noise_out (the same
    slopes), t_noise_out = t_noise in eval."""

    outputs = ("out", "noise_out")
    residuals = "inputs+output"
    recompute = False

    def fwd(input, noise, lower=1.0 / 8, upper=1.0 / 3, training=False, generator=None):
        _no_generator("rrelu_with_noise", generator)
        both = _rrelu_with_noise(input, noise, lower, upper, training)
        return both, (input, both[1], lower, upper, training)

    def bwd(aux, d):
        d_out, d_noise = d if isinstance(d, tuple) else (d, None)
        training = aux[-1]
        d_x = None if d_out is None else _rrelu_slopes(*aux, d_out)
        return d_x, (None if training else d_noise)

    def jvp(primals, tangents):
        input, noise, lower, upper, training, generator = primals[:6]
        _no_generator("rrelu_with_noise", generator)
        both = _rrelu_with_noise(input, noise, lower, upper, training)
        t, t_noise = tangents[0], (None if training else tangents[1])
        if t is None and t_noise is None:
            return both, None
        t_out = None if t is None else _rrelu_slopes(input, both[1], lower, upper, training, t)
        return both, (t_out, t_noise)

    # (no samples for tests/test_rules.py: torch 2.13's autograd formula for this op reads
    # the noise *argument*, not noise_out, and gives zeros in training; the rule is checked
    # against finite differences in tests/test_random_ops.py)
