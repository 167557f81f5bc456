"""Verify hand-written rules on complex tensors: ``python -m fxad.tools.complex_check``.

For every built-in rule with sample inputs, :func:`check_rule` makes the samples complex
and compares fxad's cotangents (reverse mode) and tangents (forward mode, through the
transpose identity) with ``torch.autograd``, with the rule applied to complex values
(the op record's complex status overridden for the check).  :func:`main` prints the set of
rules that pass, the ``VERIFIED`` data of :mod:`fxad.rules.complex` (paste it there); the
per-rule verdicts go to stderr.  Used by ``tests/test_complex.py``.
"""
from __future__ import annotations

import sys
from typing import Any

import torch
from torch.utils import _pytree as pytree

import fxad
from fxad.rules.complex import VERIFIED, VERIFIED_BY_SWEEP, ZERO_DERIVATIVE
from fxad.rules.fallback import FALLBACK_SOURCE
from fxad.rules.registry import op_name, overridden

__all__ = ["check_rule", "main", "VERIFIED", "VERIFIED_BY_SWEEP", "ZERO_DERIVATIVE"]


def _has_complex(v: Any) -> bool:
    return any(isinstance(t, torch.Tensor) and t.is_complex() for t in pytree.tree_leaves(v))


def _complexify(v: Any, gen: torch.Generator) -> Any:
    if isinstance(v, torch.Tensor) and v.dtype == torch.float64:
        return torch.complex(v, torch.randn(v.shape, dtype=v.dtype, generator=gen))
    return v


def check_rule(op: Any, rule: Any) -> str:
    """``"pass"`` when every complexified sample of ``rule`` gives autograd's cotangents
    through fxad (with the rule applied to complex values), ``"wrong"`` when one differs,
    ``"n/a"`` when autograd (or the op) does not accept the complex samples."""
    if rule.samples is None:
        return "n/a"
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    ran = 0
    cases = []
    for args, kwargs in rule.samples(torch.float64):
        # complex inputs, and the real sample itself (an op such as rfft makes complex
        # outputs from real inputs)
        cases.append((pytree.tree_map(lambda v: _complexify(v, gen), (args, kwargs)), False))
        cases.append(((args, kwargs), True))
    for (args, kwargs), real_in in cases:
        leaves, spec = pytree.tree_flatten((args, kwargs))
        slots = [i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor)
                 and (v.is_complex() or (real_in and v.is_floating_point()))]
        if not slots:
            continue

        def fn(*xs: Any) -> Any:
            vals = list(leaves)
            for i, x in zip(slots, xs):
                vals[i] = x
            a, kw = pytree.tree_unflatten(vals, spec)
            if getattr(torch.Tensor, getattr(op, "__name__", ""), None) is op or isinstance(op, str):
                meth = op if isinstance(op, str) else op.__name__
                return getattr(a[0], meth)(*a[1:], **kw)
            return op(*a, **kw)

        xs = [leaves[i].clone().requires_grad_() for i in slots]
        try:
            out = fn(*xs)
            outs = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor)
                    and (o.is_floating_point() or o.is_complex()) and o.requires_grad]
            if not outs or (real_in and not _has_complex(outs)):
                continue  # a real sample only matters here when it makes complex values
            cots = [torch.randn(o.shape, dtype=o.dtype, generator=gen) for o in outs]
            want = torch.autograd.grad(outs, xs, cots, allow_unused=True)
        except Exception:  # noqa: BLE001  autograd or the op refuses complex input
            continue
        # a single-precision output (x.cfloat()) rounds the cotangent's path
        low = any(o.dtype in (torch.float32, torch.complex64) for o in outs)
        atol, rtol, jtol = (1e-5, 1e-4, 1e-4) if low else (1e-8, 1e-6, 1e-7)
        it = iter(cots)
        cot_arg = pytree.tree_map(
            lambda o: next(it) if isinstance(o, torch.Tensor) and o.requires_grad
            and (o.is_floating_point() or o.is_complex()) else None, out)
        if isinstance(out, torch.Tensor):
            cot_arg = cots[0]
        xs0 = [x.detach() for x in xs]
        try:
            with overridden(op, complex="verified"):  # the rule itself, not the fallback
                got = fxad.vjp(fn, *xs0)(*xs0, cot_arg)[1]
        except Exception:  # noqa: BLE001
            return "wrong"
        for g, w, x in zip(got, want, xs):
            w = torch.zeros_like(x) if w is None else w
            g = torch.zeros_like(x) if g is None else g
            if g.shape != w.shape or not torch.allclose(g, w, atol=atol, rtol=rtol):
                return "wrong"
        # forward mode through the transpose identity Re<v, J t> = Re<J^H v, t>
        tans = [torch.randn(x.shape, dtype=x.dtype, generator=gen) for x in xs]
        try:
            with overridden(op, complex="verified"):
                t_out = fxad.jvp(fn, *xs0)(*xs0, *tans)[1]
        except Exception:  # noqa: BLE001
            return "wrong"
        t_leaves = [t for t, o in zip(pytree.tree_leaves(t_out), pytree.tree_leaves(out))
                    if isinstance(o, torch.Tensor) and o.requires_grad
                    and (o.is_floating_point() or o.is_complex())]
        lhs = sum(float(torch.real(torch.sum(torch.conj(v) * t))) for v, t in zip(cots, t_leaves)
                  if t is not None)
        rhs = sum(float(torch.real(torch.sum(torch.conj(w) * t))) for w, t in zip(want, tans)
                  if w is not None)
        if abs(lhs - rhs) > jtol * max(1.0, abs(rhs)):
            return "wrong"
        ran += 1
    return "pass" if ran else "n/a"


def main() -> int:
    """Check every built-in hand-written rule; print the new :data:`VERIFIED` set (the
    per-rule verdicts go to stderr)."""
    good = []
    for op, rule in sorted(fxad.all_rules().items(), key=lambda kv: op_name(kv[0])):
        if not rule.builtin or rule.source == FALLBACK_SOURCE:
            continue
        status = check_rule(op, rule)
        print(f"{op_name(op):60s} {status}", file=sys.stderr)
        if status == "pass":
            good.append(op_name(op))
    print("VERIFIED: frozenset[str] = frozenset({")
    for n in good:
        print(f"    {n!r},")
    print("})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
