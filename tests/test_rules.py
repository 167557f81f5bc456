"""Every built-in rule with sample inputs, checked in float64 against torch.autograd and
central finite differences (through the whole pipeline: capture, AD, simplifier, codegen)."""
from __future__ import annotations

import pytest
import torch
from torch.utils import _pytree as pytree

import fxad
from fxad.tools.coverage import check_seeded, draws_random
from fxad.rules.registry import op_name


def _cases():
    for op, rule in sorted(fxad.all_rules().items(), key=lambda kv: op_name(kv[0])):
        if rule.samples is None:
            continue
        torch.manual_seed(0)
        for i, (args, kwargs) in enumerate(rule.samples(torch.float64)):
            yield pytest.param(op, args, kwargs, id=f"{op_name(op)}-{i}")


def _called(op):
    """``op`` as user code reaches it: ``torch.nn.grad.conv2d_input`` through its module (the
    spelling fxad's capture records as one call)."""
    if getattr(op, "__module__", "") == "torch.nn.grad":
        return getattr(torch.nn.grad, op.__name__)
    return op


def _as_function(op, args, kwargs):
    leaves, spec = pytree.tree_flatten(args)
    slots = [i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor) and v.is_floating_point()]

    def fn(*xs):
        vals = list(leaves)
        for i, x in zip(slots, xs):
            vals[i] = x
        call_args = pytree.tree_unflatten(vals, spec)
        if getattr(torch.Tensor, getattr(op, "__name__", ""), None) is op:  # a Tensor method
            return getattr(call_args[0], op.__name__)(*call_args[1:], **kwargs)
        return _called(op)(*call_args, **kwargs)

    return fn, [leaves[i] for i in slots]


# ops whose torch.autograd gradient is itself wrong in torch 2.13: checked against finite
# differences alone (see fxad.tools.coverage._AUTOGRAD_WRONG)
AUTOGRAD_WRONG = {torch.as_strided_scatter}

# random ops whose autograd derivative is zero by definition, not the pathwise derivative that
# finite differences of the seeded function measure (torch.normal: mean + std * eps would
# give d_mean = d); checked against autograd alone
NOT_PATHWISE = {torch.normal}


@pytest.mark.parametrize("op,args,kwargs", list(_cases()))
def test_rule_matches_autograd_and_finite_differences(op, args, kwargs):
    fn, inputs = _as_function(op, args, kwargs)
    if op in AUTOGRAD_WRONG:
        _check_against_finite_differences(fn, inputs)
        return
    if draws_random(fn, inputs):
        # a random op (dropout in training, rrelu, bernoulli...): eager and fxad run after
        # the same torch.manual_seed, fxad's value must equal eager's exactly (the same
        # draws), its cotangents autograd's and finite differences of the seeded function
        # (a seed other than the samples' own: bernoulli would redraw its probabilities)
        problems = check_seeded(fn, inputs, seed=12345, forward=False,
                                fd=op not in NOT_PATHWISE)
        assert not problems, problems
        return
    report = fxad.check(fn, *inputs)
    assert report.fd_rel_err < 1e-4


def _check_against_finite_differences(fn, inputs):
    from fxad.tools.coverage import _fd_grads
    out = fn(*inputs)
    gen = torch.Generator().manual_seed(0)
    cot = torch.randn(out.shape, dtype=out.dtype, generator=gen)
    got = fxad.vjp(fn, *inputs)(*inputs, cot)[1]
    want = _fd_grads(fn, list(inputs), [cot])
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-7, rtol=1e-6)


def test_every_rule_documents_its_source():
    missing = [op_name(op) for op, r in fxad.all_rules().items() if r.builtin and not r.source]
    assert not missing
