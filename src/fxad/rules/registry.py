"""The op record: one record per op holding what fxad knows about it, and the one way to
declare a derivative rule.

Op records
----------
Every op fxad knows something about has exactly one :class:`OpRecord`, keyed by the Python
callable of the canonical graph: ``torch.sin``, ``operator.add``,
``torch.nn.functional.layer_norm``, ``torch.Tensor.expand`` (for ``x.expand(...)`` method
calls), an ``OpOverload`` / ``OpOverloadPacket``, or an ``nn.Module`` subclass for user leaf
modules.  A record holds:

``kind``
    One of :data:`KINDS`:

    * ``"elementwise"`` — pointwise arithmetic, comparisons, activations, casts, ``clone``,
      ``where``, ``*_like`` constructors;
    * ``"view"`` — shape ops and views, whose result aliases the input: ``view``,
      ``reshape``, ``transpose``, ``expand``, ``getitem``, ``split``, ``detach``, ...;
    * ``"random"`` — a call may draw random numbers (``torch.rand``, ``bernoulli``,
      ``normal``; dropout and ``rrelu`` in training, fractional max pooling without
      ``_random_samples``: :attr:`OpRecord.draws` says which calls draw);
    * ``"uninitialized"`` — ``torch.empty`` / ``empty_like``: not random, but two calls
      must never be merged into one;
    * ``"other"`` — everything else (matmul, reductions, normalizations, ...).

    :func:`kind_of` answers it for a graph node or a target (``call_method`` names through
    ``torch.Tensor``, an ``OpOverload`` through its packet).  Rule classes may declare it
    (``kind = "elementwise"``; the table form :func:`fxad.rules._base.unary` does);
    the initial assignment of the other ops is at the bottom of this module.
``recompute``
    Whether the op is cheap enough for the ``"min_memory"`` residual policy to recompute it
    in the backward instead of saving it: the default rule's declaration (below) if it has
    one, else ``kind in ("elementwise", "view")`` (:attr:`OpRecord.recompute`).
``complex``
    How the op's built-in rule stands for complex tensors, one of :data:`COMPLEX_STATUSES`:
    ``"verified"`` (its own samples, made complex, give autograd's cotangents),
    ``"verified-by-sweep"`` (right, shown by the OpInfo sweep), ``"zero-derivative"`` (right
    for any dtype) or ``"unverified"`` (complex values go to the autograd fallback).  The
    data is kept and installed by :mod:`fxad.rules.complex`.
``rules``
    The op's derivative rules (:class:`Rule`): one *default* rule, and optionally
    *overloads* — rules that apply only to some calls, chosen per call (below).  Ops with
    facts but no rule (``torch.empty``, ``torch.rand``) have a record without rules.

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
    The op's recomputability for the ``"min_memory"`` residual policy (``True`` for
    elementwise ops and views); undeclared, it follows the op's kind (see above).

Rule bodies are written in the public torch API: what they call is what the user reads in
the generated code.

Declaring a rule
----------------
One way, a class registered with :func:`register_vjp` (built-in rules and users' alike; a
rule registered from a module under ``fxad.rules`` is a built-in one)::

    @register_vjp(torch.hypot)
    class Hypot:
        \"\"\"hypot(x, y) = sqrt(x^2 + y^2): d_x = d x / out, d_y = d y / out
        (derivatives.yaml `hypot`).\"\"\"          # the formula's source

        residuals = "inputs+output"                 # optional declarations:
        recompute = True                            # residuals, recompute, kind

        def fwd(input, other): ...
        def bwd(aux, d): ...
        def jvp(primals, tangents): ...             # optional
        def samples(dtype): ...                     # optional

An op with several names gets one ``@register_vjp`` line each.  A family of similar rules
is written as a function returning such a class, registered with ``register_vjp(op)(cls)``.
The one table form, for one-line elementwise rules, is :func:`fxad.rules._base.unary`.
``fxad.register_vjp(op, fwd=..., bwd=...)`` remains as a user convenience building the same
record.  A second default rule for an op is an error (:class:`~fxad.errors.RuleError`)
unless ``replace=True``, which replaces the op's rules (overloads included); an autograd
fallback rule (:mod:`fxad.rules.fallback`) is replaced silently.

Overloads
---------
Where an op's calls need different backwards (``torch.max(x)`` / ``torch.max(x, dim)`` /
``torch.max(x, other)``; a fused-kernel backward versus the closed form), each case is its
own rule class, registered for the op like the default one, with a selector:

``applies(*args, **kwargs) -> bool`` (static)
    Called with the call's argument values (fake tensors for tensors, constants as they
    are), in ``fwd``'s signature: whether this rule differentiates the call.
``fused = True`` / ``"all"``
    The rule calls fused backward kernels of that level (:mod:`fxad.rules.fused`): it
    applies only while they are enabled.  :attr:`OpRecord.fused` is this rule.

:meth:`OpRecord.select` tries the overloads in registration order and falls back to the
default rule; :func:`fxad.rules.dispatch.registered_rule` asks it for every node the engines
differentiate.  :func:`lookup` and :func:`all_rules` give the default rule, whose
``samples`` include those of every overload (so the rule tests exercise them all).
"""
from __future__ import annotations

import builtins
import contextlib
import contextvars
import dataclasses
import inspect
import operator
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..errors import MissingRuleError, RuleError, SourceLoc
from ..naming import describe_target
from ..originals import original

KINDS = ("elementwise", "view", "random", "uninitialized", "other")
"""The op kinds (see the module docstring)."""

COMPLEX_STATUSES = ("verified", "verified-by-sweep", "zero-derivative", "unverified")
"""How a built-in rule stands for complex tensors (see the module docstring)."""

RESIDUAL_KINDS = ("inputs", "output", "intermediates")


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
        applies: an overload's selector ``(*args, **kwargs) -> bool``, or None.
        fused: the fused-kernel level an overload needs (``True`` / ``"all"``), or None.
        name: the name of the class that declared the rule ("" for the functional form).
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
    applies: Callable[..., bool] | None = None
    fused: bool | str | None = None
    name: str = ""

    @property
    def signature(self) -> inspect.Signature:
        return inspect.signature(self.fwd)

    @property
    def is_overload(self) -> bool:
        """Whether the rule applies to some calls only (a selector or a fused level)."""
        return self.applies is not None or self.fused is not None


@dataclass(frozen=True)
class OpRecord:
    """Everything fxad knows about one op (see the module docstring).

    Attributes:
        op: the key (the canonical callable).
        kind: one of :data:`KINDS`.
        complex: one of :data:`COMPLEX_STATUSES`.
        rules: the overloads in selection order, then the default rule (if any).
        draws: for a ``"random"`` op drawing only in some calls,
            ``(args, kwargs) -> bool`` on the call's arguments; None: every call draws.
        outputs: names of the items of a tuple-valued result, for generated code
            (``("out", "mean", "rstd")``: ``out, mean, rstd = torch.native_layer_norm(...)``;
            an item that is itself a tuple has a tuple of names); None: the names of the
            ATen schema's returns, where it names them (``values, indices``).  A rule class
            declares it as ``outputs = (...)``.
    """

    op: Any
    kind: str = "other"
    complex: str = "unverified"
    rules: tuple[Rule, ...] = ()
    draws: Callable[[tuple, dict], bool] | None = None
    outputs: tuple[Any, ...] | None = None
    default: Rule | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise RuleError(f"{op_name(self.op)}: kind {self.kind!r}; use one of {KINDS}")
        if self.complex not in COMPLEX_STATUSES:
            raise RuleError(f"{op_name(self.op)}: complex status {self.complex!r}; use one of "
                            f"{COMPLEX_STATUSES}")
        base = next((r for r in self.rules if not r.is_overload), None)
        with_samples = [r.samples for r in self.rules if r.samples is not None]
        if base is not None and len(with_samples) > 1:
            base = dataclasses.replace(base, samples=_chained(tuple(with_samples)))
        object.__setattr__(self, "default", base)

    @property
    def rule(self) -> Rule | None:
        """The default rule (what :func:`lookup` returns; ``samples`` of all overloads)."""
        return self.default

    @property
    def overloads(self) -> tuple[Rule, ...]:
        """The rules that apply to some calls only, in selection order."""
        return tuple(r for r in self.rules if r.is_overload)

    @property
    def fused(self) -> Rule | None:
        """The overload that calls fused backward kernels, if the op has one."""
        return next((r for r in self.rules if r.fused is not None), None)

    @property
    def recompute(self) -> bool:
        """Recomputable by the ``"min_memory"`` residual policy: the default rule's
        declaration, else whether the op is elementwise or a view."""
        declared = None if self.default is None else self.default.recompute
        return declared if declared is not None else self.kind in ("elementwise", "view")

    def select(self, args: tuple, kwargs: dict,
               fused_enabled: Callable[[Any], bool] = lambda level: False) -> Rule | None:
        """The rule for a call with argument values ``args`` / ``kwargs`` (fake tensors for
        tensors): the first overload whose fused level is enabled (``fused_enabled(level)``)
        and whose ``applies`` accepts the arguments, else the default rule."""
        for r in self.rules:
            if not r.is_overload:
                continue
            if r.fused is not None and not fused_enabled(r.fused):
                continue
            if r.applies is not None:
                try:
                    if not r.applies(*args, **kwargs):
                        continue
                except (TypeError, AttributeError, ValueError):
                    continue  # the call does not bind (the default rule reports it) or the
                    # selector cannot read an argument: not this overload
            return r
        return self.default


def _chained(samplers: tuple[Callable, ...]) -> Callable[..., Iterable[Any]]:
    def samples(dtype: torch.dtype) -> Iterable[Any]:
        for s in samplers:
            yield from s(dtype)
    return samples


_RECORDS: dict[Any, OpRecord] = {}

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
    return describe_target("call_function", op)


# --- the record store -------------------------------------------------------------------------


def record(op: Any) -> OpRecord | None:
    """The record of ``op`` (a registry key), or None."""
    try:
        return _RECORDS.get(original(op))  # a library's replacement: torch's own record
    except TypeError:  # unhashable target
        return None


def records() -> dict[Any, OpRecord]:
    """A copy of the record store (every op with facts or rules)."""
    return dict(_RECORDS)


def _store(rec: OpRecord) -> OpRecord:
    _RECORDS[rec.op] = rec
    return rec


def declare(op: Any, *, kind: str | None = None, complex: str | None = None,
            draws: Callable[[tuple, dict], bool] | None = None,
            outputs: tuple[Any, ...] | None = None) -> OpRecord:
    """Set facts of ``op``'s record (created if needed); returns the record."""
    op = original(op)
    rec = record(op) or OpRecord(op)
    changes: dict[str, Any] = {}
    if outputs is not None:
        changes["outputs"] = tuple(outputs)
    if kind is not None:
        changes["kind"] = kind
    if complex is not None:
        changes["complex"] = complex
    if draws is not None:
        changes["draws"] = draws
    return _store(dataclasses.replace(rec, **changes) if changes else rec)


@contextlib.contextmanager
def overridden(op: Any, **facts: Any) -> Iterator[OpRecord]:
    """Within the block, ``op``'s record has ``facts`` (e.g. ``complex="verified"``); the
    record is restored after it."""
    saved = record(op)
    try:
        yield _store(dataclasses.replace(saved or OpRecord(op), **facts))
    finally:
        if saved is None:
            _RECORDS.pop(op, None)
        else:
            _RECORDS[op] = saved


def _record_of_target(target: Any) -> OpRecord | None:
    rec = record(target)
    if rec is None and isinstance(target, torch._ops.OpOverload):
        rec = record(target.overloadpacket)
    return rec


def record_of(node: Any) -> OpRecord | None:
    """The record of a graph node's op (``call_function``: its target, ``call_method``: the
    ``torch.Tensor`` method, ``call_module``: the module class when ``node`` belongs to a
    GraphModule), or of a target given directly (an ``OpOverload`` falls back to its
    packet's record); None when there is none."""
    if isinstance(node, fx.Node):
        if node.op == "call_function":
            return _record_of_target(node.target)
        if node.op == "call_method":
            return record(getattr(torch.Tensor, node.target, None))
        if node.op == "call_module":
            gm = node.graph.owning_module
            try:
                return record(type(gm.get_submodule(node.target))) if gm is not None else None
            except AttributeError:
                return None
        return None
    return _record_of_target(node)


def kind_of(node: Any) -> str:
    """The kind (:data:`KINDS`) of a graph node's op or of a target; ``"other"`` for
    placeholders, outputs and ops without a record."""
    rec = record_of(node)
    return "other" if rec is None else rec.kind


def is_random_call(node: fx.Node) -> bool:
    """Whether the call ``node`` draws random numbers or reads uninitialized memory (kind
    ``"random"`` — where the op draws only in some calls, this one draws — or
    ``"uninitialized"``)."""
    if node.meta.get("fxad_draws_random"):  # control flow whose branches draw
        return True
    rec = record_of(node) if node.op in ("call_function", "call_method") else None
    if rec is None or rec.kind not in ("random", "uninitialized"):
        return False
    return rec.draws is None or bool(rec.draws(tuple(node.args), dict(node.kwargs)))


# --- rules ------------------------------------------------------------------------------------


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


def check_residuals(op: Any, residuals: str | None) -> str | None:
    """Validate a ``residuals`` declaration (see the module docstring); returns it."""
    if residuals is None or residuals == "nothing":
        return residuals
    parts = residuals.split("+") if isinstance(residuals, str) else []
    if not parts or any(p not in RESIDUAL_KINDS for p in parts) or len(set(parts)) != len(parts):
        raise RuleError(f"rule for {op_name(op)}: residuals={residuals!r}; use 'nothing' or "
                        f"kinds from {RESIDUAL_KINDS} joined with '+' (e.g. 'inputs+output')")
    return "+".join(k for k in RESIDUAL_KINDS if k in parts)


FALLBACK_PREFIX = "fallback:"


def _install(op: Any, fwd: Callable, bwd: Callable, *, jvp: Callable | None = None,
             samples: Callable | None = None, source: str = "", builtin: bool | None = None,
             replace: bool = False, residuals: str | None = None,
             recompute: bool | None = None, applies: Callable | None = None,
             fused: bool | str | None = None, kind: str | None = None,
             name: str = "", outputs: tuple[Any, ...] | None = None) -> Rule:
    """Put a rule into ``op``'s record (the one place that does).  ``builtin=None``: decided
    from the registering module.  Raises :class:`RuleError` on a duplicate (unless
    ``replace``) or a malformed declaration."""
    if op is None:
        raise RuleError("cannot register a rule for None")
    op = original(op)  # keyed by PyTorch's own function, whatever a library put in torch
    residuals = check_residuals(op, residuals)
    if recompute is not None and not isinstance(recompute, bool):
        raise RuleError(f"rule for {op_name(op)}: recompute must be True, False or None")
    if fused is not None and fused is not True and fused != "all":
        raise RuleError(f"rule for {op_name(op)}: fused must be True or 'all'")
    if applies is not None and not callable(applies):
        raise RuleError(f"rule for {op_name(op)}: applies must be a callable")
    params = _validate(op, fwd, bwd)
    module = _registering_module()
    if builtin is None:
        builtin = module == "fxad.rules" or module.startswith("fxad.rules.")
    rule = Rule(op=op, fwd=fwd, bwd=bwd, jvp=jvp, samples=samples, source=source,
                params=params, builtin=builtin, residuals=residuals, recompute=recompute,
                module=module, applies=applies, fused=fused, name=name)
    rec = record(op) or OpRecord(op)
    if rule.is_overload:
        same = [r for r in rec.overloads if r.name == name]
        if same and not replace:
            raise RuleError(f"an overload {name!r} of the rule for {op_name(op)} is already "
                            "registered; pass replace=True to override it deliberately")
        kept = tuple(r for r in rec.rules if not (r.is_overload and r.name == name))
        overloads = tuple(r for r in kept if r.is_overload) + (rule,)
        rules = overloads + tuple(r for r in kept if not r.is_overload)
    else:
        old = rec.default
        if old is not None and not replace and not old.source.startswith(FALLBACK_PREFIX):
            # (a fallback rule, see fxad.rules.fallback, is replaced silently)
            raise RuleError(
                f"a derivative rule for {op_name(op)} is already registered; pass replace=True "
                "to override it deliberately")
        # replacing the default replaces the whole set (a user's rule serves every call)
        rules = (rule,) if replace or old is not None else rec.overloads + (rule,)
    changes: dict[str, Any] = {"rules": rules}
    if kind is not None:
        changes["kind"] = kind
    if outputs is not None:
        changes["outputs"] = tuple(outputs)
    _store(dataclasses.replace(rec, **changes))
    return rule


# modules whose functions register rules on behalf of the module calling them
_HELPER_MODULES = ("fxad.rules.registry", "fxad.rules._base")


def _registering_module() -> str:
    """The module on whose behalf a rule is being registered: the innermost caller outside the
    registry and the shared helper modules (``_base``, a family's ``_common``)."""
    f = sys._getframe(1)
    while f is not None:
        name = f.f_globals.get("__name__", "")
        if name not in _HELPER_MODULES and not name.endswith("._common"):
            return name
        f = f.f_back
    return ""


_CLASS_FIELDS = ("jvp", "samples", "residuals", "recompute", "applies", "fused", "kind",
                 "outputs")


def register_vjp(op: Any, fwd: Callable | None = None, bwd: Callable | None = None, *,
                 jvp: Callable | None = None, samples: Callable | None = None,
                 source: str = "", replace: bool = False, residuals: str | None = None,
                 recompute: bool | None = None) -> Any:
    """Register a VJP rule for ``op`` (a function, a ``torch.Tensor`` method, or a module class).

    Two spellings::

        @fxad.register_vjp(my_op)
        class MyOpRule:
            \"\"\"Where the formula comes from.\"\"\"
            def fwd(x, y):                  # same parameters as my_op
                out = my_op(x, y)
                return out, (x, y)          # (value, aux)
            def bwd(aux, d_out):
                x, y = aux
                return d_out * y, d_out * x # one cotangent per fwd parameter
            # optional: def jvp(primals, tangents) / samples / source = "..."
            # optional declarations: residuals = "inputs" / recompute = True / kind = "..."
            # an overload (some calls only): applies(*args, **kwargs) -> bool / fused = True

        fxad.register_vjp(my_op, fwd=my_fwd, bwd=my_bwd)   # the same, as functions

    For a module class marked as a leaf (``leaf_modules=``), ``fwd`` receives the module
    instance first and must return ``{param_name: cotangent}`` for it in ``bwd``.
    The class form returns the class, so one class may be registered for several ops.

    Raises:
        RuleError: ``op`` already has a rule (pass ``replace=True``), or fwd/bwd are malformed.
    """
    if fwd is not None or bwd is not None:
        if fwd is None or bwd is None:
            raise RuleError(f"register_vjp({op_name(op)}): give both fwd= and bwd=")
        return _install(op, fwd, bwd, jvp=jvp, samples=samples, source=source, replace=replace,
                        residuals=residuals, recompute=recompute, builtin=False)
    given = {"jvp": jvp, "samples": samples, "residuals": residuals, "recompute": recompute}

    def deco(cls: Any) -> Any:
        d = cls.__dict__ if isinstance(cls, type) else {}
        f, b = d.get("fwd"), d.get("bwd")
        if f is None or b is None:
            raise RuleError(f"@register_vjp({op_name(op)}) expects a class defining fwd and bwd")
        opts = {k: _unwrap_static(d.get(k, given.get(k))) for k in _CLASS_FIELDS}
        src = d.get("source", source) or (inspect.getdoc(cls) or "")
        _install(op, _unwrap_static(f), _unwrap_static(b), source=src, replace=replace,
                 name=cls.__name__, **opts)
        return cls

    return deco


def _unwrap_static(f: Any) -> Any:
    return f.__func__ if isinstance(f, (staticmethod, classmethod)) else f


def lookup(op: Any) -> Rule | None:
    """The default rule registered for ``op`` (see "Overloads" in the module docstring), or
    None."""
    rec = record(op)
    return None if rec is None else rec.default


def unregister(op: Any) -> None:
    """Remove an op's rules (mainly for tests of user-registered rules); its other facts
    stay."""
    rec = record(op)
    if rec is not None and rec.rules:
        _store(dataclasses.replace(rec, rules=()))


def all_rules() -> dict[Any, Rule]:
    """``op -> default rule`` for every op with a rule (a copy)."""
    return {op: rec.default for op, rec in _RECORDS.items() if rec.default is not None}


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


# --- the initial kinds ------------------------------------------------------------------------
# Ops named here get their kind under every spelling the canonical graph can hold: the
# torch / torch.nn.functional / operator / builtins function of that name, the torch.Tensor
# method (``x.add(y)``) and the ATen operator packet (with its overloads).  Rule classes may
# declare a kind of their own.

_ELEMENTWISE = """
    add sub mul truediv div neg pow rsub floordiv mod abs exp log log1p expm1 sqrt rsqrt sin
    cos tanh sigmoid relu gelu silu elu leaky_relu softplus hardtanh sign reciprocal square erf
    clamp clamp_min clamp_max where maximum minimum eq ne lt le gt ge logical_not logical_and
    logical_or to float half bfloat16 double type_as clone contiguous masked_fill lerp addcmul
    addcdiv ones_like zeros_like full_like
"""
_VIEW = """
    view reshape flatten unflatten transpose t permute unsqueeze squeeze expand expand_as
    view_as reshape_as getitem split chunk unbind narrow select movedim swapaxes unfold detach
    alias
"""
# Tensor methods that draw random numbers in place
_RANDOM_METHODS = """
    bernoulli uniform_ normal_ bernoulli_ exponential_ geometric_ cauchy_ log_normal_ random_
"""
_RANDOM = (torch.rand, torch.randn, torch.randint, torch.randperm, torch.rand_like,
           torch.randn_like, torch.randint_like, torch.bernoulli, torch.multinomial,
           torch.normal, torch.ops.aten.rrelu_with_noise_functional.default)
_UNINITIALIZED = (torch.empty, torch.empty_like)


def _bare_name(target: Any) -> str:
    """A callable's bare name, as residual policies spell op kinds: ``torch.relu`` →
    ``relu``, ``torch.ops.aten.add.Tensor`` → ``add``."""
    if isinstance(target, torch._ops.OpOverload):
        return str(target).split(".")[-2]
    name = getattr(target, "__name__", None) or str(target)
    return name.rsplit(".", 1)[-1]


def _spellings(name: str) -> list[Any]:
    out = []
    for ns in (torch, F, torch._C._nn, torch.functional, operator, builtins):
        fn = getattr(ns, name, None)
        if fn is not None and callable(fn) and not isinstance(fn, type) \
                and _bare_name(fn) == name:
            out.append(fn)
    method = getattr(torch.Tensor, name, None)
    if method is not None and callable(method):
        out.append(method)
    packet = getattr(torch.ops.aten, name, None) if hasattr(torch.ops.aten, name) else None
    if packet is not None:
        out.append(packet)
    return out


def _arg(args: tuple, kwargs: dict, name: str, pos: int, default: Any) -> Any:
    if name in kwargs:
        return kwargs[name]
    return args[pos] if len(args) > pos else default


def _draws_in_training(flag: str, default: bool, needs_p: bool = True) -> Callable:
    """A dropout-like op draws when its training flag (position 2, or 3 for rrelu) is set
    and, for the dropouts, ``p`` (position 1) is not 0."""
    pos = 2 if needs_p else 3

    def draws(args: tuple, kwargs: dict) -> bool:
        if not _arg(args, kwargs, flag, pos, default):
            return False
        return not needs_p or _arg(args, kwargs, "p", 1, 0.5) != 0
    return draws


def _draws_windows(args: tuple, kwargs: dict) -> bool:
    """Fractional max pooling draws its windows unless ``_random_samples`` is given."""
    return _arg(args, kwargs, "_random_samples", 5, None) is None


def _draws_attention(args: tuple, kwargs: dict) -> bool:
    """Scaled dot-product attention draws a dropout mask of its probabilities when
    ``dropout_p`` (position 4) is not 0."""
    return bool(_arg(args, kwargs, "dropout_p", 4, 0.0))


def _declare_initial_kinds() -> None:
    for kind, names in (("elementwise", _ELEMENTWISE), ("view", _VIEW),
                        ("random", _RANDOM_METHODS)):
        for name in names.split():
            for fn in (_spellings(name) if kind != "random" else [getattr(torch.Tensor, name)]):
                declare(fn, kind=kind)
    declare(F.unfold, kind="other")  # im2col writes a new tensor: not a view like x.unfold
    for fn in _RANDOM:
        declare(fn, kind="random")
    for fn in _UNINITIALIZED:
        declare(fn, kind="uninitialized")
    for fn, flag, default in (
            (F.dropout, "training", True), (F.dropout1d, "training", True),
            (F.dropout2d, "training", True), (F.dropout3d, "training", True),
            (F.alpha_dropout, "training", False), (F.feature_alpha_dropout, "training", False),
            (torch.dropout, "train", True), (torch.feature_dropout, "train", True),
            (torch.alpha_dropout, "train", True), (torch.feature_alpha_dropout, "train", True),
            (torch.native_dropout, "train", True)):
        declare(fn, kind="random", draws=_draws_in_training(flag, default))
    for fn in (F.rrelu, torch.rrelu):
        declare(fn, kind="random", draws=_draws_in_training("training", False, needs_p=False))
    declare(F.scaled_dot_product_attention, kind="random", draws=_draws_attention)
    for fn in (F.fractional_max_pool2d, F.fractional_max_pool3d,
               F.fractional_max_pool2d_with_indices, F.fractional_max_pool3d_with_indices):
        declare(fn, kind="random", draws=_draws_windows)


_declare_initial_kinds()
