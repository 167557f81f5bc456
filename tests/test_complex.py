"""Complex tensors: hand-written rules are used for complex values only where verified
(:mod:`fxad.rules.complex`); everything else goes through the autograd fallback, so complex
programs get autograd's (conjugate Wirtinger) cotangents."""
from __future__ import annotations

import pytest
import torch

import fxad
from fxad.tools import complex_check as cx
from fxad.rules.registry import op_name

C = torch.complex128


def _verified_rules():
    return [pytest.param(op, rule, id=op_name(op)) for op, rule in
            sorted(fxad.all_rules().items(), key=lambda kv: op_name(kv[0]))
            if op_name(op) in cx.VERIFIED]


def test_verified_list_names_registered_rules():
    names = {op_name(op) for op in fxad.all_rules()}
    assert cx.VERIFIED <= names and len(cx.VERIFIED) > 100


@pytest.mark.parametrize("op,rule", _verified_rules())
def test_verified_rule_matches_autograd_on_complex_samples(op, rule):
    assert cx.check_rule(op, rule) == "pass"


def test_complex_mul_is_written_with_conjugates():
    a, b = torch.randn(3, dtype=C), torch.randn(3, dtype=C)
    g = fxad.vjp(lambda a, b: a * b, a, b)
    assert "torch.conj(b)" in g.code and "autograd" not in g.code
    d = torch.randn(3, dtype=C)
    _, (d_a, d_b) = g(a, b, d)
    torch.testing.assert_close(d_a, d * b.conj())
    torch.testing.assert_close(d_b, d * a.conj())
    # real tensors: no conj at all
    r = torch.randn(3, dtype=torch.float64)
    assert "conj" not in fxad.vjp(lambda a, b: a * b, r, r).code


def test_unverified_rule_on_complex_values_uses_the_fallback():
    assert "torch.abs" not in cx.VERIFIED  # its real rule (d * sign(x)) is wrong for complex
    z = torch.randn(4, dtype=C)
    g = fxad.vjp(lambda z: torch.abs(z), z)
    assert "fxad_autograd_vjp('torch.abs'" in g.code
    d = torch.randn(4, dtype=torch.float64)
    zr = z.clone().requires_grad_()
    want = torch.autograd.grad(torch.abs(zr), zr, d)[0]
    torch.testing.assert_close(g(z, d)[1][0], want)
    r = torch.randn(4, dtype=torch.float64)
    assert "autograd" not in fxad.vjp(lambda x: torch.abs(x), r).code


def test_mixed_real_complex_program_matches_autograd():
    x = torch.randn(8, dtype=torch.float64)
    f = lambda x: (torch.fft.fft(x) * 1j).exp().abs().sum()  # noqa: E731
    fxad.check(f, x)
    fxad.check(lambda z: (z * z.conj()).real.sum(), torch.randn(4, dtype=C), dtype=None)


def test_complex_generated_code_runs_after_to_folder(tmp_path):
    import subprocess
    import sys
    z = torch.randn(3, dtype=C)
    g = fxad.vjp(lambda z: torch.sin(z) * z, z)
    g.to_folder(tmp_path / "pkg", "Mod")
    torch.save((z, torch.randn(3, dtype=C), g(z, torch.ones(3, dtype=C))), tmp_path / "io.pt")
    code = (f"import sys, torch; sys.path.insert(0, {str(tmp_path)!r}); from pkg import Mod; "
            f"z, _, want = torch.load({str(tmp_path / 'io.pt')!r}); "
            "got = Mod()(z, torch.ones(3, dtype=torch.complex128)); "
            "torch.testing.assert_close(got[1][0], want[1][0]); print('ok')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.stdout.strip() == "ok", r.stderr


def test_rules_verified_by_the_sweep_match_autograd():
    names = {op_name(op) for op in fxad.all_rules()}
    assert cx.VERIFIED_BY_SWEEP <= names
    z = torch.randn(3, 4, dtype=C)
    for f in (torch.imag, torch.view_as_real, lambda z: z.chalf().cdouble(),
              lambda z: torch.linalg.eigvals(z.real[:, :3]) * z[:, 0].conj()):
        g = fxad.vjp(f, z)
        out = f(z)
        d = torch.randn(out.shape, dtype=out.dtype)
        zr = z.clone().requires_grad_()
        want = torch.autograd.grad(f(zr), zr, d)[0]
        low = out.dtype == torch.complex32
        torch.testing.assert_close(g(z, d)[1][0], want, atol=1e-2 if low else 1e-10,
                                   rtol=1e-2 if low else 1e-8)
        assert "autograd_vjp" not in g.code
