"""Forward mode and higher-order derivatives: :func:`jvp`, :func:`hvp`, :func:`jacrev`,
:func:`jacfwd`, :func:`hessian`.

Design
------
* **One rule table.**  Each rule keeps its VJP (``fwd``/``bwd``) and its JVP (``jvp``) side
  by side in one class (see :mod:`fxad.rules.registry`).  A rule registered without ``jvp``
  still works in forward mode: the engine transposes its ``bwd`` (which is linear in the
  cotangent) with the reverse transform (:mod:`fxad.ad.forward`).  Adding an op is therefore a
  one-place change: register ``fwd``/``bwd``; add ``jvp`` beside them for shorter tangent code.
* **Generated code all the way down.**  :func:`jvp` writes torch-level code like :func:`vjp`;
  compositions (``fxad.jvp(fxad.grad(f, x), x)``, ``fxad.vjp(fxad.grad(f, x), x)``) re-capture
  the generated module and differentiate it again, so second derivatives are plain code too.
  :func:`hvp` is forward-over-reverse: the JVP of the generated gradient code (built with
  ``fxad.fused_kernels(False)``, since fused backward kernels have no rules; when composing
  by hand, fxad rebuilds a generated module that contains fused kernels the same way).
* **Jacobians and Hessians** are computed by ``torch.func.vmap`` over the generated code,
  batched over basis vectors (one VJP per output element for :func:`jacrev`, one JVP per input
  element for :func:`jacfwd`, one HVP per input element for :func:`hessian`).  The returned
  :class:`BatchedDerivative` exposes the generated per-vector module (``.module``, ``.code``).

Names in generated forward-mode code: the tangent of input ``x`` is the placeholder
``dot_x``; the tangent of an intermediate value ``v`` is ``dot_v`` (so in an HVP, ``dot_d_x``
is the tangent of the gradient ``d_x``: the Hessian-vector product).  ``dot_`` rather than
``t_`` because FX already names transposes ``t``, ``t_1``.

Keyword arguments of ``f`` are given after the example inputs (``fxad.jvp(f, x, mask=m)``)
and passed again when calling (``J(x, mask=m)``), as in :func:`fxad.vjp`: inputs of the
generated code that are not differentiated.

Argument handling and documentation only: the builds run in :mod:`fxad.pipeline`.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, Iterable

import torch
import torch.fx as fx

from .ad.generated import JVPModule
from .errors import InputError
from .pipeline import (BatchedDerivative, argnum_positions, build_hessian, build_hvp,
                       build_jacfwd, build_jacrev, build_jvp, example_keywords)

__all__ = ["JVPModule", "BatchedDerivative", "jvp", "hvp", "jacrev", "jacfwd", "hessian"]


def jvp(f: Callable | torch.nn.Module, *example_inputs: Any, leaf_modules: Iterable[type] = (),
        argnums: int | Iterable[int] | None = None, simplify: bool = True,
        dynamic: bool | None = None, dynamic_shapes: Any = None, values: str = "guard",
        example_kwargs: dict[str, Any] | None = None, **kwargs: Any) -> JVPModule:
    """Source-to-source Jacobian-vector product (forward mode) of ``f``.

    Returns:
        :class:`JVPModule` ``g``: ``g(*primals, *tangents)`` returns ``(output,
        output_tangent)``, ``output_tangent`` shaped like ``output`` (``None`` for
        non-floating leaves).  One tangent per input, a pytree like it (the generated
        placeholders are named ``t_<input>``); pass ``None`` for inputs that are not
        differentiated (integer tensors, inputs outside ``argnums``).  For an ``nn.Module``
        the parameters are constants (tangents of the inputs only).

    Args:
        argnums: positions of the positional inputs to differentiate (default: all floating
            positional inputs).
        kwargs, example_kwargs: keyword arguments of ``f``, as in :func:`fxad.vjp`: inputs
            that take no tangent; ``g(*primals, *tangents, **kwargs)``.
        dynamic, dynamic_shapes: build on symbolic sizes, as in :func:`fxad.vjp`
            (:mod:`fxad.symbolic`).
        values: as in :func:`fxad.vjp`.

    Raises:
        fxad.errors.MissingRuleError: an op on the differentiation path has no rule.
        fxad.errors.InputError (when called): wrong number of arguments, a primal unlike the
            traced one (shape, dtype, device, Python value), or a tangent whose structure,
            shape or dtype does not match its primal.
    """
    return build_jvp(f, example_inputs, leaf_modules=leaf_modules, simplify=simplify,
                     argnums=argnums, dynamic=dynamic, dynamic_shapes=dynamic_shapes,
                     kwargs=example_keywords(example_kwargs, kwargs), values=values)


def _function_only(f: Any, what: str) -> Any:
    """``f`` itself, or for an ``nn.Module`` a function of its inputs that calls it: its
    parameters and buffers are constants of the derivative (as ``torch.func.jacrev(model)``
    treats them).  For derivatives with respect to parameters, write a function of them."""
    if isinstance(f, torch.nn.Module) and not isinstance(f, fx.GraphModule):
        mod = f

        def of_inputs(*xs: Any, **kw: Any) -> Any:
            return mod(*xs, **kw)

        of_inputs.__signature__ = inspect.signature(mod.forward)  # type: ignore[attr-defined]
        of_inputs.__name__ = type(mod).__name__
        return of_inputs
    return f


def hvp(f: Callable, *example_inputs: Any, argnums: int | Iterable[int] | None = None,
        leaf_modules: Iterable[type] = (), simplify: bool = True,
        dynamic: bool | None = None, dynamic_shapes: Any = None, values: str = "guard",
        example_kwargs: dict[str, Any] | None = None, **kwargs: Any) -> JVPModule:
    """Hessian-vector product of a scalar-valued ``f``, forward-over-reverse: the generated
    JVP of the generated gradient code (:func:`fxad.grad`).

    ``f`` may be an ``nn.Module``: derivatives are then with respect to its inputs, its
    parameters being constants (as ``torch.func.jacrev(model)`` treats them).

    Returns:
        :class:`JVPModule` ``h``: ``h(*inputs, *tangents)`` returns ``(grads, hvps)``, both
        tuples with one entry per input (``None`` for inputs that are not differentiated);
        ``hvps[i] = Σ_j ∂²f/∂x_i∂x_j · tangents[j]``.

    ``dynamic`` / ``dynamic_shapes``: build on symbolic sizes, as in :func:`fxad.vjp`.
    Keyword arguments of ``f`` (and ``values``) as in :func:`fxad.vjp`: inputs that are not
    differentiated; ``h(*inputs, *tangents, **kwargs)``.
    """
    f = _function_only(f, "hvp")
    return build_hvp(f, example_inputs, argnums=argnums, leaf_modules=leaf_modules,
                     simplify=simplify, dynamic=dynamic, dynamic_shapes=dynamic_shapes,
                     kwargs=example_keywords(example_kwargs, kwargs), values=values)


def _nums(argnums: int | Iterable[int], n: int) -> tuple[tuple[int, ...], bool]:
    single = isinstance(argnums, int)
    nums = argnum_positions(argnums, n)
    assert nums is not None
    if not nums:
        raise InputError("argnums must name at least one input")
    return nums, single


def jacrev(f: Callable, *example_inputs: Any, argnums: int | Iterable[int] = 0,
           leaf_modules: Iterable[type] = (), simplify: bool = True, values: str = "guard",
           example_kwargs: dict[str, Any] | None = None, **kwargs: Any
           ) -> BatchedDerivative:
    """Jacobian of a tensor-valued ``f`` by reverse mode: the generated VJP (:func:`fxad.vjp`)
    vmapped over the basis of the output space.

    ``f`` may be an ``nn.Module``: derivatives are then with respect to its inputs, its
    parameters being constants (as ``torch.func.jacrev(model)`` treats them).

    Returns:
        :class:`BatchedDerivative` ``J``; ``J(*inputs)`` has shape ``out.shape + x.shape`` for
        ``argnums`` an int (a pytree like ``x`` for a pytree input), a tuple over ``argnums``
        otherwise (as ``torch.func.jacrev``).

    Raises:
        InputError: ``f`` does not return a single floating-point tensor (use :func:`jacfwd`).
    """
    f = _function_only(f, "jacrev")
    nums, single = _nums(argnums, len(example_inputs))
    return build_jacrev(f, example_inputs, nums, single, leaf_modules=leaf_modules,
                        simplify=simplify, values=values,
                        kwargs=example_keywords(example_kwargs, kwargs))


def jacfwd(f: Callable, *example_inputs: Any, argnums: int | Iterable[int] = 0,
           leaf_modules: Iterable[type] = (), simplify: bool = True, values: str = "guard",
           example_kwargs: dict[str, Any] | None = None, **kwargs: Any
           ) -> BatchedDerivative:
    """Jacobian of ``f`` by forward mode: the generated JVP (:func:`jvp`) vmapped over the
    basis of the inputs in ``argnums``.

    ``f`` may be an ``nn.Module``: derivatives are then with respect to its inputs, its
    parameters being constants (as ``torch.func.jacrev(model)`` treats them).

    Returns:
        :class:`BatchedDerivative` ``J``; ``J(*inputs)`` is shaped like ``f``'s output pytree
        with, at each floating leaf ``o``, a tensor of shape ``o.shape + x.shape`` (``argnums``
        an int) or a tuple of them over ``argnums`` (as ``torch.func.jacfwd``).
    """
    f = _function_only(f, "jacfwd")
    nums, single = _nums(argnums, len(example_inputs))
    return build_jacfwd(f, example_inputs, nums, single, leaf_modules=leaf_modules,
                        simplify=simplify, values=values,
                        kwargs=example_keywords(example_kwargs, kwargs))


def hessian(f: Callable, *example_inputs: Any, argnums: int | Iterable[int] = 0,
            leaf_modules: Iterable[type] = (), simplify: bool = True, values: str = "guard",
            example_kwargs: dict[str, Any] | None = None, **kwargs: Any
            ) -> BatchedDerivative:
    """Hessian of a scalar-valued ``f``: the generated HVP (:func:`hvp`, forward-over-reverse)
    vmapped over the basis of the inputs in ``argnums``.

    ``f`` may be an ``nn.Module``: derivatives are then with respect to its inputs, its
    parameters being constants (as ``torch.func.jacrev(model)`` treats them).

    Returns:
        :class:`BatchedDerivative` ``H``; ``H(*inputs)`` has shape ``x.shape + x.shape`` for
        ``argnums`` an int, ``H[a][b]`` of shape ``x_a.shape + x_b.shape`` for a tuple (as
        ``torch.func.hessian``).
    """
    f = _function_only(f, "hessian")
    nums, single = _nums(argnums, len(example_inputs))
    return build_hessian(f, example_inputs, nums, single, leaf_modules=leaf_modules,
                         simplify=simplify, values=values,
                        kwargs=example_keywords(example_kwargs, kwargs))
