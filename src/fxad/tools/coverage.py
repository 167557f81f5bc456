"""Operator-coverage sweep over PyTorch's OpInfo database.

``python -m fxad.tools.coverage [--out coverage_report.md] [--ops NAME ...] [--max-samples 3]``

For every OpInfo entry of ``torch.testing._internal.common_methods_invocations.op_db`` with
``supports_autograd``, the sweep takes the first few sample inputs (float64; the first one
also in float32 and, where the op supports it, in complex128), builds a function of the sample's floating-point tensor leaves (those of
``sample.input``, ``sample.args`` and ``sample.kwargs`` that autograd differentiates), calls
:func:`fxad.vjp` on it with a random cotangent and compares the output and every input
cotangent with ``torch.autograd.grad`` (with central finite differences instead for the
few ops whose autograd gradient is itself wrong, ``_AUTOGRAD_WRONG``).  Forward mode is
checked too (the ``jvp`` column), through ``<v, J t> = <J^T v, t>``.

Each op is classified as

``pass``      every usable sample matches, using hand-written rules only;
``fallback``  every usable sample matches, but on a real (float) sample some op went
              through a fallback rule (:mod:`fxad.rules.fallback`) instead of a
              hand-written one (complex samples are checked for correctness only: there,
              rules not verified for complex tensors hand over to the fallback by design);
``missing``   fxad raised :class:`fxad.MissingRuleError` (its clear missing-rule error);
``wrong``     numbers differ from autograd (output or a cotangent);
``crash``     any other exception (capture error, rule error, timeout...);
``skip``      no usable sample (autograd itself cannot differentiate the samples, the op
              returns uninitialized memory, or samples are too large for the sweep).

Random ops (dropout, ``rrelu``, ``bernoulli``, ``normal``, fractional max pools) are compared
like the others, under equal seeds: every evaluation, autograd's and that of fxad's generated
code, runs after ``torch.manual_seed(RNG_SEED)``, and fxad's generated forward draws the same
numbers as eager PyTorch (:func:`check_seeded` does the same comparison for tests).

The table (op, samples, status, reason) is written to ``--out`` (Markdown, or CSV when the
name ends in ``.csv``) and the totals are printed.  Each op runs under a time limit
(``SIGALRM``), so the sweep cannot hang on one op.
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import io
import itertools
import math
import signal
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
from torch.utils import _pytree as pytree

import fxad
from ..argparsing import ArgumentParser
from ..rules import fallback
from ..rules.dispatch import registered_rule, rule_key
from ..rules.registry import op_name
from ..simplify._util import is_random

STATUSES = ("pass", "fallback", "missing", "wrong", "crash", "skip")

# OpInfos whose outputs cannot be compared at all: they return uninitialized memory.  Random
# ops (dropout, rrelu, bernoulli, normal, fractional max pools...) are compared under equal
# seeds instead: the sweep seeds the global generator before the autograd run and before
# each run of fxad's generated code (whose forward draws as eager does), and calls OpInfo's
# seeded wrappers (``wrapper_set_seed``) as plain calls.
_UNCOMPARABLE = {
    name: "uninitialized memory: outputs cannot be compared"
    for name in ("empty", "empty_like", "new_empty", "new_empty_strided", "empty_strided",
                 "empty_permuted")
}
# the seed set before each evaluation of a sample (the same for autograd and fxad)
RNG_SEED = 1234


# OpInfos whose torch.autograd gradient is itself wrong in the installed torch: fxad's
# cotangents are compared with central finite differences (float64) instead
_AUTOGRAD_WRONG = {
    # as_strided_scatter_backward returns the cotangent *at* the overwritten positions for
    # ``input`` (the complement of the true derivative; pytorch/pytorch#77128 review)
    "as_strided_scatter": "torch.autograd's input cotangent is the complement of the true one",
}


def _fd_grads(fn: Callable, xs: list[torch.Tensor], cots: list[torch.Tensor],
              h: float = 1e-6) -> list[torch.Tensor]:
    """Gradient of ``sum_k <cots[k], fn(*xs)[k]>`` by central differences, element by
    element (small samples only)."""
    def loss(vals: list[torch.Tensor]) -> float:
        outs = [o for o in pytree.tree_leaves(fn(*vals)) if _is_diff(o)]
        return sum(float((o * c).sum()) for o, c in zip(outs, cots))

    grads = []
    with torch.no_grad():
        for k, x in enumerate(xs):
            g = torch.zeros_like(x)
            flat = g.view(-1)
            for i in range(x.numel()):
                e = torch.zeros_like(x).view(-1)
                e[i] = h
                e = e.view(x.shape)
                plus = [v + e if j == k else v for j, v in enumerate(xs)]
                minus = [v - e if j == k else v for j, v in enumerate(xs)]
                flat[i] = (loss(plus) - loss(minus)) / (2 * h)
            grads.append(g)
    return grads


def _fd_grads_strided(fn: Callable, xs: list[torch.Tensor], cots: list[torch.Tensor],
                      h: float = 1e-6) -> list[torch.Tensor]:
    """:func:`_fd_grads` on perturbed copies with the inputs' own strides (a random op's
    draw follows its input's layout: ``empty_like`` keeps strides)."""
    def loss(vals: list[torch.Tensor]) -> float:
        outs = [o for o in pytree.tree_leaves(fn(*vals)) if _is_diff(o)]
        return sum(float((o * c).sum()) for o, c in zip(outs, cots))

    grads = []
    with torch.no_grad():
        for k, x in enumerate(xs):
            g = torch.zeros(x.shape, dtype=x.dtype)
            for idx in itertools.product(*(range(n) for n in x.shape)):
                plus, minus = x.clone(), x.clone()  # (clone keeps the strides)
                plus[idx] += h
                minus[idx] -= h
                g[idx] = (loss([plus if j == k else v for j, v in enumerate(xs)])
                          - loss([minus if j == k else v for j, v in enumerate(xs)])) / (2 * h)
            grads.append(g)
    return grads


class _Timeout(Exception):
    pass


@dataclass
class OpResult:
    """Outcome of one OpInfo entry."""

    op: str
    samples: int = 0            # samples compared (float64 + float32)
    status: str = "skip"
    reason: str = ""
    fallback_ops: set[str] = field(default_factory=set)
    seconds: float = 0.0
    jvp_status: str = "skip"    # forward mode: pass / missing / wrong / crash / skip
    jvp_reason: str = ""


@dataclass
class _SampleOutcome:
    status: str                 # pass / missing / wrong / crash / skip
    reason: str = ""
    fallback_ops: set[str] = field(default_factory=set)
    jvp_status: str = "skip"
    jvp_reason: str = ""
    complex_dtype: bool = False  # a complex128 sample


def load_op_db() -> list[Any]:
    """The OpInfo entries that support autograd (needs ``expecttest`` installed)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torch.testing._internal.common_methods_invocations import op_db
    return [op for op in op_db if op.supports_autograd]


def op_label(op: Any) -> str:
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


def _is_diff(v: Any) -> bool:
    return isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex())


def _numel(tree: Any) -> int:
    return sum(v.numel() for v in pytree.tree_leaves(tree) if isinstance(v, torch.Tensor))


def _tol(dtype: torch.dtype) -> tuple[float, float]:
    """(rtol, atol) for comparing fxad with autograd; both are exact formulas evaluated in
    a different order, so the bound is loose only for float32."""
    if dtype in (torch.float64, torch.complex128):
        return 1e-6, 1e-8
    return 2e-3, 1e-4


def _max_err(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> tuple[bool, float]:
    """(close, max error) between fxad's ``a`` and reference ``b``, NaNs/infs matching; the
    tolerance is that of the lower-precision of the two (a float32 argument of a float64
    sample gets a float32 cotangent from autograd)."""
    if a.is_sparse:
        a = a.to_dense()
    if b.is_sparse:
        b = b.to_dense()
    low = (torch.float32, torch.complex64, torch.float16, torch.bfloat16)
    if a.dtype in low or b.dtype in low:
        dtype = torch.float32
    if a.shape != b.shape:
        return False, math.inf
    a = a.detach().to(torch.complex128 if a.is_complex() or b.is_complex() else torch.float64)
    b = b.detach().to(a.dtype)
    if a.numel() == 0:
        return True, 0.0
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    if not torch.equal(nan_a, nan_b):
        return False, math.nan
    inf_a, inf_b = torch.isinf(a), torch.isinf(b)
    if not torch.equal(inf_a, inf_b) or not torch.equal(a[inf_a], b[inf_b]):
        return False, math.inf
    ok = ~(nan_a | inf_a)
    a, b = a[ok], b[ok]
    if a.numel() == 0:
        return True, 0.0
    rtol, atol = _tol(dtype)
    err = (a - b).abs()
    scale = b.abs().max().item()
    bound = atol + rtol * max(1.0, scale)
    m = err.max().item()
    return m <= bound, m


def seeded(fn: Callable, seed: int) -> Callable:
    """``fn`` with ``torch.manual_seed(seed)`` before each call: a function with random ops
    then draws the same numbers in every evaluation (eager, finite differences, fxad's
    generated code, which draws as eager does)."""
    def call(*xs: Any) -> Any:
        torch.manual_seed(seed)
        return fn(*xs)
    return call


def draws_random(fn: Callable, inputs: list) -> bool:
    """Whether ``fn`` at ``inputs`` runs a random op (dropout in training mode, rrelu,
    bernoulli...), judged on fxad's captured graph."""

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gm = fxad.trace(fn, *inputs)
    return any(is_random(n) for n in gm.graph.nodes)


def check_seeded(fn: Callable, inputs: list, *, seed: int = 0, fd: bool = True,
                 forward: bool = True, rtol: float = 1e-7, atol: float = 1e-7) -> list[str]:
    """Compare fxad with eager PyTorch on a function with random ops, every evaluation after
    ``torch.manual_seed(seed)``: fxad's value must equal eager's *exactly* (the generated
    forward draws the same numbers), its cotangents autograd's (and, with ``fd``, central
    finite differences of the seeded function, float64), and with ``forward`` the value and
    tangent of :func:`fxad.jvp` those of eager forward-mode AD (``torch.autograd.forward_ad``;
    ``torch.func.jvp`` is not a reference here: it lays out ``empty_like`` differently for
    strided inputs, so it draws other masks).  Returns the problems found (empty: agreed)."""

    problems: list[str] = []
    call = seeded(fn, seed)
    xs = [x.detach().clone().requires_grad_(True) for x in inputs]
    out = call(*xs)
    outs = [o for o in pytree.tree_leaves(out) if _is_diff(o)]
    gen = torch.Generator().manual_seed(seed + 1)
    cots = [torch.randn(o.shape, dtype=o.dtype, generator=gen) for o in outs]
    used = [(o, c) for o, c in zip(outs, cots) if o.requires_grad]
    try:
        want = torch.autograd.grad([o for o, _ in used], xs, [c for _, c in used],
                                   allow_unused=True) if used else [None] * len(xs)
    except RuntimeError as e:  # autograd has no formula (torch.bernoulli(x, 0.3))
        if "not implemented" not in str(e):
            raise
        want = [None] * len(xs)
    want = [torch.zeros_like(x) if w is None else w for x, w in zip(inputs, want)]
    if isinstance(out, torch.Tensor):
        cot_arg: Any = cots[0]
    else:
        it = iter(cots)
        cot_arg = pytree.tree_map(lambda o: next(it) if _is_diff(o) else None, out)
    g = fxad.vjp(fn, *inputs)
    torch.manual_seed(seed)
    res = g(*inputs, cot_arg)
    got_out, got = res[0], [torch.zeros_like(x) if d is None else d
                            for x, d in zip(inputs, res[1])]

    def same(a: Any, b: Any, what: str) -> None:
        for k, (u, v) in enumerate(zip(pytree.tree_leaves(a), pytree.tree_leaves(b))):
            if isinstance(v, torch.Tensor) and not (
                    u.shape == v.shape and torch.equal(torch.nan_to_num(u.detach(), 7.0),
                                                       torch.nan_to_num(v.detach(), 7.0))
                    and torch.equal(torch.isnan(u), torch.isnan(v))):
                problems.append(f"{what} {k} differs from eager under the same seed "
                                "(another random stream or layout)")

    def close(a: torch.Tensor, b: torch.Tensor, what: str, **tol: float) -> None:
        try:
            torch.testing.assert_close(a, b, **(tol or {"rtol": rtol, "atol": atol}))
        except AssertionError as e:
            problems.append(f"{what}: {str(e).splitlines()[0]} ({str(e).splitlines()[-1]})")

    same(got_out, out, "output")
    for k, (a, b) in enumerate(zip(got, want)):
        close(a, b.to(a.dtype), f"cotangent of input {k} vs autograd")
    if fd and all(x.dtype == torch.float64 for x in inputs):
        for k, (a, b) in enumerate(zip(got, _fd_grads_strided(call, list(inputs), cots))):
            close(a, b, f"cotangent of input {k} vs finite differences", rtol=1e-5, atol=1e-6)
    if forward:
        import torch.autograd.forward_ad as fwAD

        tans = [torch.randn(x.shape, dtype=x.dtype, generator=gen) for x in inputs]
        j = fxad.jvp(fn, *inputs)
        torch.manual_seed(seed)
        j_out, j_t = j(*inputs, *tans)
        same(j_out, out, "fxad.jvp output")
        with fwAD.dual_level():
            duals = [fwAD.make_dual(x, t) for x, t in zip(inputs, tans)]
            ref = call(*duals)
            ref_t = [fwAD.unpack_dual(o).tangent for o in pytree.tree_leaves(ref)
                     if _is_diff(o)]
        out_leaves = pytree.tree_leaves(out)
        mine_all = [None] * len(out_leaves) if j_t is None else \
            pytree.tree_leaves(j_t, is_leaf=lambda v: v is None)
        mine = [t for t, o in zip(mine_all, out_leaves) if _is_diff(o)]
        for k, (a, b, o) in enumerate(zip(mine, ref_t, outs)):
            a = torch.zeros_like(o) if a is None else a
            b = torch.zeros_like(o) if b is None else b
            close(a.detach(), b.detach(), f"tangent of output {k} vs forward-mode autograd")
    return problems


def _fallback_ops(g: Any) -> set[str]:
    """Names of ops in ``g``'s forward graph whose rule is a fallback (not hand-written)."""
    fwd = g.meta.get("fxad_forward")
    if fwd is None:
        return set()
    out = set()
    for n in fwd.graph.nodes:
        if n.op in ("call_function", "call_method"):
            key = rule_key(fwd, n)
            rule = registered_rule(fwd, n)  # complex values: maybe the fallback
            if rule is not None and rule.source == fallback.FALLBACK_SOURCE:
                out.add(op_name(key))
    return out


def _run_sample(op: Any, sample: Any, dtype: torch.dtype, seed: int) -> _SampleOutcome:

    leaves, spec = pytree.tree_flatten((sample.input, tuple(sample.args), dict(sample.kwargs)))
    slots = [i for i, v in enumerate(leaves) if _is_diff(v)]
    if not slots:
        return _SampleOutcome("skip", "no floating tensor input")
    n_input = len(pytree.tree_leaves(sample.input))
    fn_op = op.op
    # a Tensor method OpInfo (``torch.Tensor.cfloat``) is called the way users write it
    name = getattr(fn_op, "__name__", "")
    is_method = name and getattr(torch.Tensor, name, None) is fn_op

    def make_fn(active: list[int]) -> Callable:
        def fn(*xs: Any) -> Any:
            vals = list(leaves)
            for i, x in zip(active, xs):
                vals[i] = x
            inp, args, kwargs = pytree.tree_unflatten(vals, spec)
            if is_method:
                return getattr(inp, name)(*args, **kwargs)
            return fn_op(inp, *args, **kwargs)
        fn.__name__ = op.name.replace(".", "_")
        return fn

    # reference: autograd; inputs autograd cannot differentiate are made constants
    ref = None
    for active in (slots, [i for i in slots if i < n_input]):
        if not active:
            continue
        xs = [leaves[i].detach().clone().requires_grad_(True) for i in active]
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                torch.manual_seed(RNG_SEED)  # random ops: fxad's code runs after the same seed
                out = make_fn(active)(*xs)
                outs = [o for o in pytree.tree_leaves(out) if _is_diff(o)]
                gen = torch.Generator().manual_seed(seed)
                cots = [torch.randn(o.shape, dtype=o.dtype, generator=gen) for o in outs]
                used = [(o, c) for o, c in zip(outs, cots) if o.requires_grad]
                grads = torch.autograd.grad([o for o, _ in used], xs, [c for _, c in used],
                                            allow_unused=True) if used else [None] * len(xs)
        except Exception as e:  # noqa: BLE001  autograd itself cannot do it
            ref_err = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            continue
        if op.name in _AUTOGRAD_WRONG:
            if dtype != torch.float64:
                return _SampleOutcome("skip", "autograd is wrong here; checked in float64")
            grads = _fd_grads(seeded(make_fn(active), RNG_SEED), [x.detach() for x in xs],
                              [c for o, c in zip(outs, cots)])
        ref = (active, out, cots, grads)
        break
    if ref is None:
        return _SampleOutcome("skip", f"autograd fails: {ref_err}"[:200])
    with torch.no_grad(), warnings.catch_warnings():  # deterministic under the seed?
        warnings.simplefilter("ignore")
        torch.manual_seed(RNG_SEED)
        again = make_fn(ref[0])(*[leaves[i] for i in ref[0]])
    for a, b in zip(pytree.tree_leaves(again), pytree.tree_leaves(ref[1])):
        if isinstance(b, torch.Tensor) and not _max_err(a, b, dtype)[0]:
            return _SampleOutcome("skip", "two evaluations differ under the same seed")
    active, out, cots, grads = ref
    if not any(o.requires_grad for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor)):
        return _SampleOutcome("skip", "output does not depend on a differentiable input")

    # fxad
    fn = make_fn(active)
    inputs = [leaves[i].detach().clone() for i in active]
    if isinstance(out, torch.Tensor):
        cot_arg: Any = cots[0] if cots else None
    else:
        it = iter(cots)
        cot_arg = pytree.tree_map(lambda o: next(it) if _is_diff(o) else None, out)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            g = fxad.vjp(fn, *inputs)
            torch.manual_seed(RNG_SEED)
            res = g(*[x.clone() for x in inputs], cot_arg)
    except fxad.MissingRuleError as e:
        return _SampleOutcome("missing", f"no rule: {e.op or e.bare_message}")
    except _Timeout:
        raise
    except Exception as e:  # noqa: BLE001
        msg = str(e).splitlines()[0] if str(e) else ""
        if isinstance(e, fxad.RuleError) and "random mask" in msg:
            # fxad's clear refusal of a random op (OpInfo seeds it, fxad cannot compare)
            return _SampleOutcome("skip", "random sample: fxad refuses it clearly")
        return _SampleOutcome("crash", f"{type(e).__name__}: {msg}"[:200])
    fb = _fallback_ops(g)
    out_fx, in_grads = res[0], res[1]
    ref_outs = pytree.tree_leaves(out)
    fx_outs = pytree.tree_leaves(out_fx)
    if len(ref_outs) != len(fx_outs):
        return _SampleOutcome("wrong", "output structure differs", fb)
    for k, (a, b) in enumerate(zip(fx_outs, ref_outs)):
        if isinstance(b, torch.Tensor):
            if not isinstance(a, torch.Tensor):
                return _SampleOutcome("wrong", f"output {k} is not a tensor", fb)
            ok, err = _max_err(a, b, dtype)
            if not ok:
                return _SampleOutcome("wrong", f"output {k} differs (max err {err:.3g})", fb)
    for k, (a, b) in enumerate(zip(in_grads, grads)):
        if b is None:
            b = torch.zeros_like(inputs[k])
        if a is None:
            a = torch.zeros_like(inputs[k])
        ok, err = _max_err(a, b, dtype)
        if not ok:
            return _SampleOutcome("wrong", f"cotangent of input {k} differs from autograd "
                                  f"(max err {err:.3g}, {dtype})", fb)
    jst, jreason = _check_jvp(fn, inputs, cots, grads, out, dtype, seed)
    return _SampleOutcome("pass", "", fb, jst, jreason)


def _check_jvp(fn: Callable, inputs: list, cots: list, grads: Any, out: Any,
               dtype: torch.dtype, seed: int) -> tuple[str, str]:
    """Forward mode: fxad.jvp with random tangents t, checked through the transpose identity
    <cotangent, J t> = <J^T cotangent, t> against autograd's VJP (works for every op autograd
    can reverse-differentiate, with or without forward-AD support in PyTorch)."""

    gen = torch.Generator().manual_seed(seed + 1)
    tans = [torch.randn(x.shape, dtype=x.dtype, generator=gen) for x in inputs]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            j = fxad.jvp(fn, *inputs)
            torch.manual_seed(RNG_SEED)
            _, t_out = j(*[x.clone() for x in inputs], *tans)
    except fxad.MissingRuleError as e:
        return "missing", f"no rule: {e.op or e.bare_message}"
    except _Timeout:
        raise
    except Exception as e:  # noqa: BLE001
        msg = str(e).splitlines()[0] if str(e) else ""
        return "crash", f"{type(e).__name__}: {msg}"[:200]
    t_leaves = [t for t in pytree.tree_leaves(t_out)]
    o_leaves = [o for o in pytree.tree_leaves(out) if _is_diff(o)]

    def inner(a: torch.Tensor, b: torch.Tensor) -> float:  # real inner product, complex-safe
        a, b = a.detach().to(torch.complex128 if a.is_complex() or b.is_complex()
                             else torch.float64), b.detach()
        b = b.to(a.dtype)
        return float((a.conj() * b).real.sum()) if a.is_complex() else float((a * b).sum())

    lhs = 0.0
    it = iter(t_leaves)
    for o, c in zip(o_leaves, cots):
        t = next(it, None)
        if isinstance(t, torch.Tensor):
            lhs += inner(c, t)
    rhs = sum(inner(g, t) for g, t in zip(grads, tans) if isinstance(g, torch.Tensor))
    if not (math.isfinite(lhs) and math.isfinite(rhs)):
        if math.isnan(lhs) and math.isnan(rhs) or lhs == rhs:
            return "pass", ""
        return "skip", f"non-finite values (<v, J t> = {lhs}, <J^T v, t> = {rhs})"
    low = any(o.dtype in (torch.float16, torch.bfloat16, torch.complex32) for o in o_leaves)
    # a float32 argument of a float64 sample (cov's aweights) gets float32 cotangents
    mixed = any(v.dtype in (torch.float32, torch.complex64) for v in list(inputs) + o_leaves)
    tol = 2e-2 if low or dtype != torch.float64 else (1e-4 if mixed else 1e-6)
    if any(o.is_complex() for o in o_leaves) or any(x.is_complex() for x in inputs):
        tol = max(tol, 1e-6)
    scale = max(1.0, abs(rhs), abs(lhs))
    if not abs(lhs - rhs) <= tol * scale:
        return "wrong", f"<v, J t> = {lhs:.6g} but <J^T v, t> = {rhs:.6g} ({dtype})"
    return "pass", ""


def _plain_call(op: Callable, *args: Any, **kwargs: Any) -> Any:
    return op(*args, **kwargs)


@contextlib.contextmanager
def _plain_opinfo_calls(op: Any) -> Iterable[None]:
    """OpInfo wraps its random ops in ``wrapper_set_seed`` (``torch.manual_seed(42)`` inside
    the call, the generator state restored after it); the sweep calls them plainly and seeds
    the generator itself before each evaluation, eager's and fxad's alike."""
    g = getattr(op.op, "__globals__", None)
    if not isinstance(g, dict) or "wrapper_set_seed" not in g:
        yield
        return
    old = g["wrapper_set_seed"]
    g["wrapper_set_seed"] = _plain_call
    try:
        yield
    finally:
        g["wrapper_set_seed"] = old


@contextlib.contextmanager
def _time_limit(seconds: float) -> Iterable[None]:
    if seconds <= 0 or not hasattr(signal, "SIGALRM"):
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise _Timeout()

    old = signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def run_op(op: Any, *, max_samples: int = 3, f32_samples: int = 1, c128_samples: int = 0,
           timeout: float = 20.0, max_numel: int = 20_000) -> OpResult:
    """Run the sweep for one OpInfo entry (``c128_samples``: complex128 samples too)."""
    label = op_label(op)
    res = OpResult(label)
    t0 = time.perf_counter()
    if op.name in _UNCOMPARABLE:
        res.reason = _UNCOMPARABLE[op.name]
        return res
    outcomes: list[_SampleOutcome] = []
    try:
        with _time_limit(timeout), _plain_opinfo_calls(op):
            for dtype, count in ((torch.float64, max_samples), (torch.float32, f32_samples),
                                 (torch.complex128, c128_samples)):
                if count <= 0 or dtype not in op.supported_dtypes("cpu"):
                    continue
                torch.manual_seed(0)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    samples = iter(op.sample_inputs("cpu", dtype, requires_grad=False))
                taken = 0
                for k, sample in enumerate(itertools.islice(samples, 4 * count)):
                    if taken >= count:
                        break
                    if _numel((sample.input, sample.args, sample.kwargs)) > max_numel:
                        outcomes.append(_SampleOutcome("skip", "sample too large"))
                        continue
                    with torch.random.fork_rng(devices=[]):  # the seeds set for the
                        o = _run_sample(op, sample, dtype, seed=k)  # sample stay in there
                    o.complex_dtype = dtype.is_complex
                    outcomes.append(o)
                    if o.status != "skip":
                        taken += 1
                    if o.status in ("missing", "crash", "wrong"):
                        break
                if outcomes and outcomes[-1].status in ("missing", "crash", "wrong"):
                    break
    except _Timeout:
        outcomes.append(_SampleOutcome("crash", f"timeout after {timeout:g}s"))
    except Exception as e:  # noqa: BLE001  sample generation itself failed
        outcomes.append(_SampleOutcome("skip", f"sample inputs fail: {type(e).__name__}: {e}"[:200]))
    res.seconds = time.perf_counter() - t0
    res.samples = sum(o.status != "skip" for o in outcomes)
    for st in ("wrong", "crash", "missing"):
        bad = [o for o in outcomes if o.status == st]
        if bad:
            res.status, res.reason = st, bad[0].reason
            return res
    passed = [o for o in outcomes if o.status == "pass"]
    if not passed:
        res.status = "skip"
        res.reason = outcomes[0].reason if outcomes else "no samples"
        return res
    jvp = [o for o in outcomes if o.status == "pass"]
    for st in ("wrong", "crash", "missing", "pass"):
        hit = [o for o in jvp if o.jvp_status == st]
        if hit:
            res.jvp_status, res.jvp_reason = st, hit[0].jvp_reason
            break
    # pass vs fallback is decided on the real samples: on complex values, rules not verified
    # for complex tensors hand over to the fallback by design (fxad.rules.complex), which the
    # complex samples check for correctness only
    real = [o for o in passed if not o.complex_dtype] or passed
    for o in real:
        res.fallback_ops |= o.fallback_ops
    if res.fallback_ops:
        res.status = "fallback"
        res.reason = "fallback for " + ", ".join(sorted(res.fallback_ops))
    else:
        res.status = "pass"
    return res


def sweep(names: Iterable[str] | None = None, *, max_samples: int = 3, f32_samples: int = 1,
          c128_samples: int = 0, timeout: float = 20.0, progress: Callable[[OpResult], None] | None = None,
          ) -> list[OpResult]:
    """Run the sweep over all autograd-supporting OpInfos (or those named in ``names``,
    matched against ``name`` or ``name.variant``)."""
    ops = load_op_db()
    if names is not None:
        wanted = set(names)
        ops = [op for op in ops if op.name in wanted or op_label(op) in wanted]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    results = []
    try:
        for op in ops:
            r = run_op(op, max_samples=max_samples, f32_samples=f32_samples,
                       c128_samples=c128_samples, timeout=timeout)
            results.append(r)
            if progress is not None:
                progress(r)
    finally:
        torch.set_num_threads(threads)
    return results


def totals(results: list[OpResult]) -> dict[str, int]:
    t = {s: 0 for s in STATUSES}
    for r in results:
        t[r.status] += 1
    t["total"] = len(results)
    return t


def jvp_totals(results: list[OpResult]) -> dict[str, int]:
    """Forward-mode column: counts over the ops whose VJP passed."""
    t = {s: 0 for s in ("pass", "missing", "wrong", "crash", "skip")}
    for r in results:
        if r.status in ("pass", "fallback"):
            t[r.jvp_status] += 1
    return t


def summary_line(results: list[OpResult]) -> str:
    t = totals(results)
    n = t["total"]
    pct = 100.0 * (t["pass"] + t["fallback"]) / n if n else 0.0
    hand = 100.0 * t["pass"] / n if n else 0.0
    j = jvp_totals(results)
    return (f"{t['pass']} pass / {t['fallback']} fallback / {t['missing']} missing / "
            f"{t['wrong']} wrong / {t['crash']} crash / {t['skip']} skip, out of {n} "
            f"autograd-supporting OpInfos ({hand:.1f}% pass with hand-written rules, "
            f"{pct:.1f}% covered); JVP of the covered ops: "
            f"{j['pass']} pass / {j['missing']} missing / {j['wrong']} wrong / "
            f"{j['crash']} crash")


def write_report(results: list[OpResult], path: str, seconds: float | None = None) -> None:
    rows = [(r.op, r.samples, r.status, r.jvp_status,
             (r.jvp_reason if r.jvp_status in ("wrong", "crash", "missing") else r.reason)
             .replace("|", "\\|").replace("\n", " "))
            for r in results]
    if path.endswith(".csv"):
        with open(path, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(("op", "samples", "status", "jvp", "reason"))
            w.writerows(rows)
        return
    buf = io.StringIO()
    buf.write("# fxad operator coverage on PyTorch's OpInfo database\n\n")
    buf.write(f"torch {torch.__version__}; generated by `python -m fxad.tools.coverage`.\n\n")
    buf.write(f"**{summary_line(results)}**")
    if seconds is not None:
        buf.write(f" (sweep took {seconds:.0f} s)")
    buf.write("\n\n| op | samples | status | jvp | reason |\n|---|---:|---|---|---|\n")
    for row in rows:
        buf.write("| {} | {} | {} | {} | {} |\n".format(*row))
    with open(path, "w") as f:
        f.write(buf.getvalue())


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of the sweep (``python -m fxad.tools.coverage`` and ``fxad coverage``)."""
    p.add_argument("--out", "-o", default="coverage_report.md",
                   help="report file (.md or .csv); default ./coverage_report.md")
    p.add_argument("--only", "--ops", dest="ops", nargs="*", metavar="OP",
                   help="only these OpInfo names")
    p.add_argument("--max-samples", type=int, default=3, help="float64 samples per op")
    p.add_argument("--f32-samples", type=int, default=1, help="float32 samples per op")
    p.add_argument("--c128-samples", type=int, default=1,
                   help="complex128 samples per op (where the op supports complex; checked "
                        "for correctness, pass vs fallback is decided on the real samples)")
    p.add_argument("--timeout", type=float, default=20.0, help="seconds per op")
    p.add_argument("-v", "--verbose", action="store_true", help="print every op")


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="python -m fxad.tools.coverage", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))


def run(a: argparse.Namespace) -> int:
    """Run the sweep with parsed options (see :func:`add_arguments`); exit status 1 on a
    wrong derivative."""

    def progress(r: OpResult) -> None:
        if a.verbose or r.status in ("wrong", "crash") or r.jvp_status == "wrong":
            print(f"{r.op:45s} {r.status:8s} {r.seconds:6.2f}s {r.reason}", flush=True)

    t0 = time.perf_counter()
    results = sweep(a.ops, max_samples=a.max_samples, f32_samples=a.f32_samples,
                    c128_samples=a.c128_samples, timeout=a.timeout, progress=progress)
    dt = time.perf_counter() - t0
    write_report(results, a.out, dt)
    print(summary_line(results))
    print(f"report written to {a.out} ({dt:.0f} s)")
    return 1 if totals(results)["wrong"] or jvp_totals(results)["wrong"] else 0


if __name__ == "__main__":
    sys.exit(main())
