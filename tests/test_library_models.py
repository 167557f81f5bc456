"""Library-model suite: models from torchvision, timm, diffusers, PyTorch Geometric,
torchdiffeq, einops, x-transformers, e3nn, gpytorch, zuko and the transformers families
whose Python decides on tensor values, in training mode (dropout, stochastic depth and
LayerDrop on), float64, with fxad's autograd fallback an error.  Each case must have exactly
its stated outcome: value and every parameter gradient equal to torch.autograd's under the
same seeds, or (a program whose decision cannot be taken at build time) fxad's error naming
the library's line.  The libraries are pinned in the ``test`` extras; a missing one fails
here rather than skipping.  See :mod:`fxad.tools.library_models`."""
from __future__ import annotations

import re

import pytest
import torch

import fxad
from fxad.tools.library_models import import_torchvision, library_cases, run_case

CASES = library_cases()


def _describe(out) -> str:
    e = out["error"]
    return f"{out['result']}: {type(e).__name__}: {e}" if e is not None else out["result"]


@pytest.mark.parametrize("case", CASES, ids=[f"{c.library}-{c.name}" for c in CASES])
def test_library_model_has_its_stated_outcome(case):
    out = run_case(case)
    if case.expect == "pass":
        assert out["result"] == "pass", _describe(out)
        assert out["max_err"] < 1e-7
        return
    result, cls, pattern = case.expect[:3]
    assert re.fullmatch(result, out["result"]), _describe(out)
    assert re.fullmatch(cls, type(out["error"]).__name__), _describe(out)
    # the message names the library's own line (file and number: the versions are pinned)
    assert re.search(pattern, str(out["error"])), _describe(out)
    if len(case.expect) > 3:  # and the build announced what it fixed, naming the line
        assert any(re.search(case.expect[3], w) for w in out["warnings"]), out["warnings"]
    if "FAIL" in result:
        # a known gap, never a silent one: a loud error, or a mismatch the build warned of
        assert cls != "AssertionError" or len(case.expect) > 3


def test_every_value_dependent_case_is_decided_and_half_pass():
    # the programs that decide on tensor values: each passes or is refused (never a wrong
    # gradient, asserted above); at least half of them pass with guards or torch.cond
    decided = [c for c in CASES if c.value_dependent]
    assert len(decided) >= 10
    passing = [c for c in decided if c.expect == "pass"]
    assert 2 * len(passing) >= len(decided), [c.name for c in decided if c.expect != "pass"]


def test_torchvision_imports_beside_the_cpu_torch_without_its_extension():
    tv = import_torchvision()
    model = tv.models.resnet18(num_classes=3).eval()
    assert model(torch.randn(1, 3, 32, 32)).shape == (1, 3)
    if not tv.extension._has_ops():
        # without the extension the detection ops refuse, with torchvision's own message
        with pytest.raises(RuntimeError, match=r"Couldn't load custom C\+\+ ops"):
            tv.ops.nms(torch.rand(3, 4), torch.rand(3), 0.5)
        # and the declared schema has no kernel: a direct call fails too, never silently
        with pytest.raises(NotImplementedError, match="torchvision::nms"):
            torch.ops.torchvision.nms(torch.rand(3, 4), torch.rand(3), 0.5)


def test_a_fallback_fails_the_case():
    # the suite's check turns fxad's autograd fallback into an error: an op with no
    # hand-written rule cannot pass through torch.autograd unnoticed
    from fxad.rules.fallback import is_fallback
    from fxad.tools.library_models import LibraryCase

    if not is_fallback(torch.conv_tbc):
        pytest.fail("torch.conv_tbc has a rule now: test with another fallback-covered op")

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(3, 4, 5))
            self.b = torch.nn.Parameter(torch.randn(5))

        def forward(self, x):
            return torch.conv_tbc(x, self.w, self.b, 1).pow(2).sum()

    out = run_case(LibraryCase("fallback", "torch", lambda: (M(), (torch.randn(6, 2, 4),))))
    assert out["result"] == "FAIL" and isinstance(out["error"], fxad.FallbackWarning)
    assert "torch.conv_tbc" in str(out["error"])
