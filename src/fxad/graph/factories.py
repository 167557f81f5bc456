"""Factory recording for the graph emitters of the AD transforms.

Capture's mode sees every torch call, but a derivative rule runs outside it: ``torch.zeros(n)``
called by a rule on concrete sizes would allocate a tensor and bake it into the code as a
constant.  :func:`record_factories` makes those calls (and the Python-level convolution
gradients of ``torch.nn.grad``) write graph nodes through the emitter instead.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from .proxy import in_meta_computation


FACTORIES = (
    "zeros", "ones", "empty", "full", "arange", "linspace", "logspace", "eye",
    "rand", "randn", "randint", "randperm", "tril_indices", "triu_indices", "tensor",
)

CONV_GRADS = tuple(f"conv{n}d_{w}" for n in (1, 2, 3) for w in ("input", "weight"))


@contextlib.contextmanager
def record_factories(tracer: Any) -> Iterator[None]:
    """While active, ``torch.zeros(...)`` and the other factories (and the Python-level
    convolution gradients of ``torch.nn.grad``) called with concrete arguments append a node
    through ``tracer.create_proxy`` instead of allocating: used by the emitters that write
    derivative code (:class:`fxad.graph.proxy.Emitter`)."""
    originals = {name: getattr(torch, name) for name in FACTORIES}

    def make(name: str, orig: Callable) -> Callable:
        orig = getattr(orig, "__wrapped__", orig)  # nested: the real factory, not the outer one

        def factory(*args: Any, **kwargs: Any) -> Any:
            if in_meta_computation():
                return orig(*args, **kwargs)
            return tracer.create_proxy("call_function", orig, args, kwargs)
        factory.__name__ = name
        factory.__wrapped__ = orig  # type: ignore[attr-defined]
        return factory

    import torch.nn.grad as nn_grad
    grads = {name: getattr(nn_grad, name) for name in CONV_GRADS if hasattr(nn_grad, name)}

    def make_grad(orig: Callable) -> Callable:
        orig = getattr(orig, "__wrapped__", orig)

        def conv_grad(*args: Any, **kwargs: Any) -> Any:
            if in_meta_computation() or not any(isinstance(a, fx.Proxy) for a in
                                                pytree.tree_leaves((args, kwargs))):
                return orig(*args, **kwargs)
            return tracer.create_proxy("call_function", orig, args, kwargs)
        conv_grad.__name__ = orig.__name__
        conv_grad.__wrapped__ = orig  # type: ignore[attr-defined]
        return conv_grad

    try:
        for name, orig in originals.items():
            setattr(torch, name, make(name, orig))
        for name, orig in grads.items():
            setattr(nn_grad, name, make_grad(orig))
        yield
    finally:
        for name, orig in originals.items():
            setattr(torch, name, orig)
        for name, orig in grads.items():
            setattr(nn_grad, name, orig)
