"""The derivative-rule registry: one typed table, one way to register.

Rule contract (stated once, here)
---------------------------------
A rule for op ``f`` is a :class:`Rule` with

``fwd(*args, **kwargs) -> (value, aux)``
    Called with the op's arguments, where tensors are proxies that write graph code.  It
    must return the op's value (normally by calling ``f`` itself) and ``aux``: any Python
    structure of residuals (saved tensors, shapes, flags) the backward needs.
``bwd(aux, d_out) -> cotangents``
    ``d_out`` is the cotangent of the value (a tensor proxy; for tuple-valued ops a tuple
    whose unused entries are ``None``).  Returns one cotangent per parameter of ``fwd``'s
    signature, in signature order (a tuple; a shorter tuple means trailing ``None``), or a
    dict ``{param_name: cotangent}``.  Use ``None`` for non-differentiable or zero
    cotangents; for a list parameter (``torch.cat(tensors)``) return a list.  Cotangents may
    have the *broadcast* shape of the value: the engine reduces them to each input's shape and
    dtype and accumulates fan-out, so rules never call ``sum_to_size`` themselves.
``jvp(primals, tangents) -> (value, tangent)`` (optional)
    Forward-mode counterpart, kept beside the VJP.  ``primals`` are the op's arguments bound
    to ``fwd``'s signature as one positional tuple in parameter order, defaults filled in,
    ``*args`` spread in place, keyword-only parameters after the positional ones, and a
    ``**kwargs`` parameter as one dict in the last slot.  ``tangents`` is aligned with
    ``primals``: a tensor proxy or ``None`` (zero) per tensor argument, a list for a list
    argument, ``None`` for constants.  Return the value (normally by calling the op) and its
    tangent (``None`` if zero; for tuple-valued ops a tuple with ``None`` for non-floating
    entries); a tangent with the broadcast shape of an operand is expanded by the engine.
    Without ``jvp``, forward mode transposes ``bwd`` (linear in ``d_out``) automatically
    (see :mod:`fxad.ad.forward`), so registering ``fwd``/``bwd`` is enough for both modes;
    a ``jvp`` gives shorter tangent code.
``samples(dtype) -> iterable of (args, kwargs)`` (optional)
    Example inputs used by the rule tests.
``residuals`` (optional declaration)
    What ``bwd`` reads from the forward: ``"inputs"`` (the op's arguments), ``"output"``
    (its value), ``"intermediates"`` (other values its ``fwd`` computed: batch statistics,
    pooling indices, a dropout mask), joined with ``+``, or ``"nothing"``.  A rule that
    saves inputs recomputes what else it needs (``silu`` recomputes ``sigmoid(x)``).
    :meth:`fxad.residuals.Partition.report` prints the declaration beside what the split
    actually saves, and the rule tests check that they agree.
``recompute`` (optional declaration)
    Whether the op is cheap enough for the ``"min_memory"`` residual policy to recompute it
    in the backward instead of saving it (True for elementwise ops and views; by default
    decided from the op's name, see :data:`fxad.residuals.CHEAP_OPS`).

Rule bodies are written in the public torch API: what they call is what the user reads in
the generated code.

Keys are the Python callables of the canonical graph: ``torch.sin``, ``operator.add``,
``torch.nn.functional.layer_norm``, ``torch.Tensor.expand`` (for ``x.expand(...)`` method
calls), or an ``nn.Module`` subclass for user leaf modules.
"""
from __future__ import annotations

import contextvars
import inspect
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch

from ..errors import MissingRuleError, RuleError, SourceLoc


@dataclass(frozen=True)
class Rule:
    """A registered derivative rule (see the module docstring for the contract).

    Attributes:
        op: the registry key.
        fwd: forward ``(*args, **kwargs) -> (value, aux)``.
        bwd: backward ``(aux, d_out) -> cotangents``.
        jvp: optional forward-mode rule.
        samples: optional sample-input generator for tests.
        source: where the formula comes from (textbook identity, paper, derivatives.yaml).
        params: parameter names of ``fwd`` (cotangents are matched to these).
        builtin: True for rules shipped with fxad.
        residuals: declared residual kind (see the module docstring), or None.
        recompute: declared recomputability (see the module docstring), or None.
        module: the module that registered the rule (``fxad.rules.nn.losses`` for a built-in
            rule; ``docs/supported_ops.md`` lists it as the rule's file).
    """

    op: Any
    fwd: Callable[..., tuple[Any, Any]]
    bwd: Callable[[Any, Any], Any]
    jvp: Callable[..., Any] | None = None
    samples: Callable[..., Iterable[Any]] | None = None
    source: str = ""
    params: tuple[str, ...] = field(default=())
    builtin: bool = False
    residuals: str | None = None
    recompute: bool | None = None
    module: str = ""

    @property
    def signature(self) -> inspect.Signature:
        return inspect.signature(self.fwd)


_RULES: dict[Any, Rule] = {}

# parameter name -> whether the engine will use its cotangent (set around each bwd call)
_NEEDED: contextvars.ContextVar[dict[str, bool] | None] = contextvars.ContextVar(
    "fxad_needed", default=None)


def needs_cotangent(param: str) -> bool:
    """Inside a rule's ``bwd``: False when the engine will discard the cotangent of ``param``
    (a constant or non-differentiable argument), so a rule calling a fused kernel can skip
    that output.  True outside the engine or when unknown.  Returning a cotangent anyway is
    always allowed (the simplifier removes unused code)."""
    needed = _NEEDED.get()
    return True if needed is None else needed.get(param, True)


def op_name(op: Any) -> str:
    """Printable name of a registry key."""
    if isinstance(op, type):
        return f"{op.__module__}.{op.__qualname__}"
    from ..naming import describe_target

    return describe_target("call_function", op)


def _validate(op: Any, fwd: Any, bwd: Any) -> tuple[str, ...]:
    if not callable(fwd) or not callable(bwd):
        raise RuleError(f"rule for {op_name(op)}: fwd and bwd must be callables")
    try:
        sig = inspect.signature(fwd)
    except (TypeError, ValueError) as e:
        raise RuleError(f"rule for {op_name(op)}: cannot read the signature of fwd") from e
    try:
        bsig = inspect.signature(bwd)
        bsig.bind(None, None)
    except TypeError as e:
        raise RuleError(f"rule for {op_name(op)}: bwd must take exactly (aux, d_out)") from e
    except ValueError:
        pass
    return tuple(sig.parameters)


RESIDUAL_KINDS = ("inputs", "output", "intermediates")


def check_residuals(op: Any, residuals: str | None) -> str | None:
    """Validate a ``residuals`` declaration (see the module docstring); returns it."""
    if residuals is None or residuals == "nothing":
        return residuals
    parts = residuals.split("+") if isinstance(residuals, str) else []
    if not parts or any(p not in RESIDUAL_KINDS for p in parts) or len(set(parts)) != len(parts):
        raise RuleError(f"rule for {op_name(op)}: residuals={residuals!r}; use 'nothing' or "
                        f"kinds from {RESIDUAL_KINDS} joined with '+' (e.g. 'inputs+output')")
    return "+".join(k for k in RESIDUAL_KINDS if k in parts)


def add_rule(op: Any, fwd: Callable, bwd: Callable, *, jvp: Callable | None = None,
             samples: Callable | None = None, source: str = "", builtin: bool = False,
             replace: bool = False, residuals: str | None = None,
             recompute: bool | None = None) -> Rule:
    """Register a rule.  Raises :class:`RuleError` on a duplicate (unless ``replace``) or a
    malformed ``residuals`` declaration."""
    if op is None:
        raise RuleError("cannot register a rule for None")
    residuals = check_residuals(op, residuals)
    if recompute is not None and not isinstance(recompute, bool):
        raise RuleError(f"rule for {op_name(op)}: recompute must be True, False or None")
    if op in _RULES and not replace and not _RULES[op].source.startswith("fallback:"):
        # (a fallback rule, see fxad.rules.fallback, is replaced silently)
        raise RuleError(
            f"a derivative rule for {op_name(op)} is already registered; pass replace=True to "
            "override it deliberately")
    params = _validate(op, fwd, bwd)
    rule = Rule(op=op, fwd=fwd, bwd=bwd, jvp=jvp, samples=samples, source=source,
                params=params, builtin=builtin, residuals=residuals, recompute=recompute,
                module=_registering_module())
    _RULES[op] = rule
    return rule


# modules whose functions register rules on behalf of the module calling them
_HELPER_MODULES = ("fxad.rules.registry", "fxad.rules._base")


def _registering_module() -> str:
    """The module on whose behalf a rule is being registered: the innermost caller outside the
    registry and the shared helper modules (``_base``, a family's ``_common``)."""
    f = sys._getframe(2)
    while f is not None:
        name = f.f_globals.get("__name__", "")
        if name not in _HELPER_MODULES and not name.endswith("._common"):
            return name
        f = f.f_back
    return ""


def register_vjp(op: Any, fwd: Callable | None = None, bwd: Callable | None = None, *,
                 jvp: Callable | None = None, samples: Callable | None = None,
                 source: str = "", replace: bool = False, residuals: str | None = None,
                 recompute: bool | None = None) -> Any:
    """Register a VJP rule for ``op`` (a function, a ``torch.Tensor`` method, or a module class).

    Two spellings::

        fxad.register_vjp(my_op, fwd=my_fwd, bwd=my_bwd)

        @fxad.register_vjp(my_op)
        class MyOpRule:
            def fwd(x, y):                  # same parameters as my_op
                out = my_op(x, y)
                return out, (x, y)          # (value, aux)
            def bwd(aux, d_out):
                x, y = aux
                return d_out * y, d_out * x # one cotangent per fwd parameter
            # optional: def jvp(primals, tangents) / samples / source = "..."
            # optional declarations: residuals = "inputs" / recompute = True

    For a module class marked as a leaf (``leaf_modules=``), ``fwd`` receives the module
    instance first and must return ``{param_name: cotangent}`` for it in ``bwd``.

    Raises:
        RuleError: ``op`` already has a rule (pass ``replace=True``), or fwd/bwd are malformed.
    """
    if fwd is not None or bwd is not None:
        if fwd is None or bwd is None:
            raise RuleError(f"register_vjp({op_name(op)}): give both fwd= and bwd=")
        return add_rule(op, fwd, bwd, jvp=jvp, samples=samples, source=source, replace=replace,
                        residuals=residuals, recompute=recompute)

    def deco(obj: Any) -> Any:
        f = obj.__dict__.get("fwd") if isinstance(obj, type) else None
        b = obj.__dict__.get("bwd") if isinstance(obj, type) else None
        if f is None or b is None:
            raise RuleError(f"@register_vjp({op_name(op)}) expects a class defining fwd and bwd")
        f, b = _unwrap_static(f), _unwrap_static(b)
        j = _unwrap_static(obj.__dict__.get("jvp", jvp))
        s = _unwrap_static(obj.__dict__.get("samples", samples))
        src = obj.__dict__.get("source", source) or (inspect.getdoc(obj) or "")
        add_rule(op, f, b, jvp=j, samples=s, source=src, replace=replace,
                 residuals=obj.__dict__.get("residuals", residuals),
                 recompute=obj.__dict__.get("recompute", recompute))
        return obj

    return deco


def _unwrap_static(f: Any) -> Any:
    return f.__func__ if isinstance(f, (staticmethod, classmethod)) else f


def lookup(op: Any) -> Rule | None:
    """The rule registered for ``op``, or None."""
    try:
        return _RULES.get(op)
    except TypeError:  # unhashable target
        return None


def unregister(op: Any) -> None:
    """Remove a rule (mainly for tests of user-registered rules)."""
    _RULES.pop(op, None)


def all_rules() -> dict[Any, Rule]:
    """A copy of the registry."""
    return dict(_RULES)


def missing_rule(op_desc: str, loc: SourceLoc | None, *, module: bool = False) -> MissingRuleError:
    hint = (
        f"register a rule: @fxad.register_vjp({op_desc}) on a class with fwd(...)->(value, aux) "
        "and bwd(aux, d_out)->cotangents"
    )
    if module:
        hint += ", or stop marking this module as a leaf so fxad traces through it"
    if any(k in op_desc for k in ("_backward", "native_layer_norm", "native_batch_norm",
                                  "flash_attention")):
        hint = ("this is a fused kernel written by a first-order rule; to differentiate fxad's "
                "generated code again, build it with fused kernels off: "
                "`with fxad.fused_kernels(False): g = fxad.grad(f, x)`")
    return MissingRuleError(f"no derivative rule for {op_desc}", op=op_desc, loc=loc, hint=hint)


def is_float_tensor(v: Any) -> bool:
    return isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex())
