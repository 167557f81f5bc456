"""The autograd fallback (``fxad.rules.fallback``) stays available but is never silent: a build
that uses it emits one ``fxad.FallbackWarning`` naming each op and the user's line (once per
build, not per call of the generated module), and ``fxad.show`` / ``fxad.code_with_shapes`` /
``fxad show`` mark its lines with ``# autograd fallback``."""
from __future__ import annotations

import io
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

import fxad
from fxad.rules import fallback


def _two_fallbacks(x):
    y = torch.special.i0(x)  # no hand-written rule: the autograd fallback
    return torch.kl_div(y, x.exp()).sum() + y.sum()


def _builds(build, *args, **kwargs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = build(*args, **kwargs)
    return out, [w for w in caught if issubclass(w.category, fxad.FallbackWarning)]


def test_the_ops_used_here_have_fallback_rules():
    assert fallback.is_fallback(torch.special.i0) and fallback.is_fallback(torch.kl_div)
    assert issubclass(fxad.FallbackWarning, UserWarning)


def test_one_warning_per_build_naming_each_op_and_line():
    x = torch.randn(4, dtype=torch.float64)
    g, caught = _builds(fxad.vjp, _two_fallbacks, x)
    assert len(caught) == 1
    w = caught[0]
    msg = str(w.message)
    line = _two_fallbacks.__code__.co_firstlineno
    assert "torch.special.i0 at test_fallback.py:" + str(line + 1) in msg
    assert "torch.kl_div at test_fallback.py:" + str(line + 2) in msg
    assert "fxad.vjp" in msg and "register_vjp" in msg and "FXAD_NO_FALLBACK" in msg
    assert [name for name, _ in w.message.uses] == ["torch.kl_div", "torch.special.i0"]
    assert w.filename == __file__  # points at the user's call of fxad.vjp
    # calling the generated module warns no more: the warning is about the build
    with warnings.catch_warnings():
        warnings.simplefilter("error", fxad.FallbackWarning)
        for _ in range(3):
            out, (d_x,) = g(x, torch.tensor(1.0, dtype=torch.float64))
    xr = x.clone().requires_grad_()
    (ref,) = torch.autograd.grad(_two_fallbacks(xr), xr)
    torch.testing.assert_close(d_x, ref)  # still correct
    _, again = _builds(fxad.vjp, _two_fallbacks, x)  # a second build warns again
    assert len(again) == 1


def test_other_entry_points_warn_once():
    x = torch.randn(4, dtype=torch.float64)
    _, caught = _builds(fxad.grad, _two_fallbacks, x)
    assert len(caught) == 1 and str(caught[0].message).startswith("fxad.grad:")
    j, caught = _builds(fxad.jvp, _two_fallbacks, x)
    assert len(caught) == 1 and str(caught[0].message).startswith("fxad.jvp:")
    assert "torch.special.i0 at test_fallback.py" in str(caught[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error", fxad.FallbackWarning)
        j(x, torch.ones_like(x))


def test_module_and_training_builds_warn():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(3, 3)

        def forward(self, x):
            return torch.special.i0(self.lin(x)).mean()

    x = torch.randn(2, 3)
    _, caught = _builds(fxad.grad, Net(), x, argnums=())
    assert len(caught) == 1 and "torch.special.i0" in str(caught[0].message)
    m, caught = _builds(fxad.compile, Net(), x)
    assert len(caught) >= 1 and "torch.special.i0" in str(caught[0].message)


def test_show_marks_the_fallback_lines():
    x = torch.randn(4, dtype=torch.float64)
    g, _ = _builds(fxad.vjp, _two_fallbacks, x)
    text = fxad.show(g, file=io.StringIO())
    marked = [ln for ln in text.splitlines() if ln.endswith("# autograd fallback")]
    assert len(marked) == 2
    assert any("fxad_autograd_vjp('torch.kl_div'" in ln for ln in marked)
    assert any("fxad_autograd_vjp('torch.special.i0'" in ln for ln in marked)
    assert all("f64[4]" in ln for ln in marked)  # the shape note stays
    assert text == fxad.code_with_shapes(g)
    assert "autograd fallback" not in g.code  # the code itself is unchanged
    j, _ = _builds(fxad.jvp, _two_fallbacks, x)
    assert sum(ln.endswith("# autograd fallback")
               for ln in fxad.code_with_shapes(j).splitlines()) == 2


def test_no_fallback_no_warning_no_mark():
    x = torch.randn(4, dtype=torch.float64)
    f = lambda x: (torch.sin(x) * torch.nn.functional.dropout(x, 0.2)).sum()  # noqa: E731
    for build in (fxad.vjp, fxad.grad, fxad.jvp):
        g, caught = _builds(build, f, x)
        assert caught == []
        assert "autograd fallback" not in fxad.code_with_shapes(g)


def test_fallback_whose_backward_is_unused_does_not_warn():
    """Only code that calls the fallback counts: an op whose cotangent is never needed."""
    x, w = torch.randn(4, dtype=torch.float64), torch.randn(4, dtype=torch.float64)
    g, caught = _builds(fxad.vjp, lambda x, w: (torch.special.i0(w) * x).sum(), x, w,
                        argnums=0)
    assert caught == []


def test_cli_show_prints_one_warning_and_marks_lines(tmp_path):
    src = tmp_path / "model.py"
    src.write_text(textwrap.dedent("""\
        import torch

        def f(x):
            return torch.special.i0(x).sum()
        """))
    r = subprocess.run([sys.executable, "-m", "fxad", "show", f"{src}:f", "--input",
                        "randn(3)", "--no-color"], capture_output=True, text=True,
                       cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("fxad: warning:") == 1
    assert "torch.special.i0 at model.py:4" in r.stderr
    assert any(ln.endswith("# autograd fallback") for ln in r.stdout.splitlines())


@pytest.mark.parametrize("name", ["vjp", "jvp"])
def test_warning_can_be_turned_into_an_error(name):
    x = torch.randn(4, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error", fxad.FallbackWarning)
        with pytest.raises(fxad.FallbackWarning, match="torch.special.i0"):
            getattr(fxad, name)(_two_fallbacks, x)


def test_custom_torch_library_op_with_a_formula_and_without():
    # an op another library made with torch.library.custom_op and register_autograd: its
    # backward is captured as code (tests/test_custom_function.py), no fallback; one defined
    # with torch.library.define and given a formula: the autograd fallback, announced; one
    # without a formula: a MissingRuleError at build time
    from fxad.rules.fallback import FallbackWarning

    lib = "fxad_test_ns"

    @torch.library.custom_op(f"{lib}::cube", mutates_args=())
    def cube(x: torch.Tensor) -> torch.Tensor:
        return x * x * x

    @cube.register_fake
    def _(x):
        return torch.empty_like(x)

    def setup(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])

    def backward(ctx, d):
        (x,) = ctx.saved_tensors
        return 3 * x * x * d

    cube.register_autograd(backward, setup_context=setup)

    torch.library.define(f"{lib}::cube_defined", "(Tensor x) -> Tensor")

    @torch.library.impl(f"{lib}::cube_defined", "cpu")
    def _(x):
        return x * x * x

    @torch.library.register_fake(f"{lib}::cube_defined")
    def _(x):
        return torch.empty_like(x)

    torch.library.register_autograd(f"{lib}::cube_defined", backward, setup_context=setup)

    @torch.library.custom_op(f"{lib}::square_no_grad", mutates_args=())
    def square(x: torch.Tensor) -> torch.Tensor:
        return x * x

    @square.register_fake
    def _(x):
        return torch.empty_like(x)

    x = torch.randn(4, dtype=torch.float64)
    want = 3 * torch.sin(x) ** 2 * torch.cos(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        g = fxad.grad(lambda x: torch.ops.fxad_test_ns.cube(torch.sin(x)).sum(), x)
    assert "fxad_autograd_vjp" not in g.code
    torch.testing.assert_close(g(x)[1][0], want)
    with pytest.warns(FallbackWarning, match=f"torch.ops.{lib}.cube_defined"):
        g = fxad.grad(lambda x: torch.ops.fxad_test_ns.cube_defined(torch.sin(x)).sum(), x)
    torch.testing.assert_close(g(x)[1][0], want)
    with pytest.raises(fxad.MissingRuleError, match="square_no_grad"):
        fxad.grad(lambda x: torch.ops.fxad_test_ns.square_no_grad(x).sum(), x)
