"""Forward mode and higher order: every rule's JVP against ``torch.func.jvp`` (float64,
through capture, forward transform, simplifier and codegen); HVP / Jacobians / Hessians
against ``torch.func``; second derivatives against ``torch.autograd.grad(create_graph=True)``;
input errors and PyTorch's conventions at non-differentiable points.

Regenerate the golden file with ``FXAD_UPDATE_GOLDEN=1 python -m pytest tests/test_forward.py``.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils import _pytree as pytree

import fxad
from fxad.rules.registry import op_name

GOLDEN = Path(__file__).parent / "golden"


def _cases():
    for op, rule in sorted(fxad.all_rules().items(), key=lambda kv: op_name(kv[0])):
        if rule.samples is None:
            continue
        torch.manual_seed(0)
        for i, (args, kwargs) in enumerate(rule.samples(torch.float64)):
            yield pytest.param(op, args, kwargs, id=f"{op_name(op)}-{i}")


def _as_function(op, args, kwargs):
    leaves, spec = pytree.tree_flatten(args)
    kleaves, kspec = pytree.tree_flatten(kwargs)
    slots = [i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor) and v.is_floating_point()]
    kslots = [i for i, v in enumerate(kleaves)
              if isinstance(v, torch.Tensor) and v.is_floating_point()]

    def fn(*xs):
        vals, kvals = list(leaves), list(kleaves)
        for i, x in zip(slots, xs):
            vals[i] = x
        for i, x in zip(kslots, xs[len(slots):]):
            kvals[i] = x
        call_args = pytree.tree_unflatten(vals, spec)
        call_kwargs = pytree.tree_unflatten(kvals, kspec)
        if getattr(torch.Tensor, getattr(op, "__name__", ""), None) is op:  # a Tensor method
            return getattr(call_args[0], op.__name__)(*call_args[1:], **call_kwargs)
        return op(*call_args, **call_kwargs)

    return fn, [leaves[i] for i in slots] + [kleaves[i] for i in kslots]


def _float_leaves(x):
    return [v for v in pytree.tree_leaves(x) if isinstance(v, torch.Tensor) and v.is_floating_point()]


def _close(a, b, atol=1e-9, rtol=1e-7):
    la, lb = _float_leaves(a), _float_leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        torch.testing.assert_close(x, y, atol=atol, rtol=rtol)


@pytest.mark.parametrize("op,args,kwargs", list(_cases()))
def test_rule_jvp_matches_torch_func(op, args, kwargs):
    fn, inputs = _as_function(op, args, kwargs)
    if not inputs:
        pytest.skip("no floating-point input")
    gm = fxad.jvp(fn, *inputs)
    gen = torch.Generator().manual_seed(1)
    tangents = [torch.randn(x.shape, dtype=x.dtype, generator=gen) for x in inputs]
    torch.manual_seed(2)
    out, t_out = gm(*inputs, *tangents)
    torch.manual_seed(2)
    try:
        ref_out, ref_t = torch.func.jvp(fn, tuple(inputs), tuple(tangents))
    except NotImplementedError:  # no forward AD in PyTorch (CPU flash attention): central
        h = 1e-6                     # finite differences in float64
        ref_out = fn(*inputs)
        plus = fn(*[x + h * t for x, t in zip(inputs, tangents)])
        minus = fn(*[x - h * t for x, t in zip(inputs, tangents)])
        ref_t = pytree.tree_map(lambda a, b: (a - b) / (2 * h), plus, minus)
        _close(out, ref_out)
        _close(t_out, ref_t, atol=1e-6, rtol=1e-5)
        return
    _close(out, ref_out)
    _close(t_out, ref_t)


def test_rules_without_jvp_use_transposition():
    """Rules registered without ``jvp`` get their JVP by transposing ``bwd``; the built-in
    ones are listed here (all in fxad.rules.nn) and covered by the test above."""
    missing = sorted(op_name(op) for op, r in fxad.all_rules().items() if r.jvp is None)
    assert all(name.startswith(("torch.nn.functional.", "torch.dropout")) for name in missing), \
        missing
