"""Real-model suite (issue: real models): models fxad did not write, from transformers and
torch.nn, built from small configurations with random weights.  Each is checked in float64
(value, every parameter and floating-input gradient vs torch.autograd) and trained through
fxad.compile for a few SGD steps beside eager autograd.  See :mod:`fxad.models`."""
from __future__ import annotations

import pytest
import torch

from fxad.models import cases, check_case, train_case

CASES = cases()


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_gradients_match_autograd(case):
    if case.source == "transformers":
        pytest.importorskip("transformers")
    res = check_case(case, torch.float64)
    assert res["max_err"] < 1e-9
    assert not res["fallback"], "the generated code calls the autograd fallback"


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_training_through_compile_matches_eager(case):
    if case.source == "transformers":
        pytest.importorskip("transformers")
    assert train_case(case, steps=2) < 1e-8


def test_gpt2_default_cache_concatenates_a_legacy_empty_tensor():
    # transformers' default DynamicCache starts from torch.tensor([]) and torch.cat's it with
    # the first keys: the case that used to raise a bare IndexError inside the cat rule
    pytest.importorskip("transformers")
    import fxad
    from fxad.models import _gpt2
    torch.manual_seed(0)
    model, (ids,) = _gpt2()
    model = model.double()
    code = fxad.grad(model, ids).code
    assert "torch.cat" in code
