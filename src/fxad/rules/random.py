"""Rules for the random sampling functions outside ``torch.nn``: ``torch.bernoulli`` (tensor
and float probability; ``x.bernoulli()`` is recorded as it) and ``torch.normal`` (tensor or
float mean and std).  The dropout family is in :mod:`fxad.rules.nn.dropout`, ``rrelu`` in
:mod:`fxad.rules.nn.activations`, the fractional max pools in :mod:`fxad.rules.nn.pooling`.

The generated forward calls the op itself, with the user's arguments: the same kernel on
the same shapes, so under the same ``torch.manual_seed`` it draws the same numbers as eager
PyTorch, on any device (``torch.bernoulli(p)`` and ``torch.bernoulli(x, 0.3)`` are
different kernels, and each stays the one the user called).  In-place draws in user code
(``x.bernoulli_(0.3)``, ``x.normal_()``, ``x.uniform_()``) are recorded by capture as the
same in-place method on ``torch.empty_like(x)`` and carry no derivative.

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
