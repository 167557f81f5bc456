"""Random decisions (LayerDrop): a Python ``if`` on a random draw becomes ``torch.cond``.

Every model is compared with eager PyTorch under the same seed, in float64: the value and
every gradient (inputs and parameters), over several seeds so that both branches are taken.
"""
from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn as nn

import fxad
from fxad.capture import autograph, ifrewrite, paths
from fxad.errors import DataDependentError

SEEDS = range(8)


class Layer(nn.Module):
    def __init__(self, d: int = 4) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.drop = nn.Dropout(0.3)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.drop(torch.tanh(self.lin(h)))


class Encoder(nn.Module):
    """transformers' LayerDrop loop (Wav2Vec2-Conformer, SEW, Data2VecAudio, SpeechT5)."""

    def __init__(self, n: int = 3, layerdrop: float = 0.5, synced_gpus: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(n))
        self.layerdrop = layerdrop
        self.synced_gpus = synced_gpus

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        synced_gpus = self.synced_gpus
        for layer in self.layers:
            skip_the_layer = False
            if self.training and self.layerdrop > 0.0:
                dropout_probability = torch.rand([])
                skip_the_layer = dropout_probability < self.layerdrop
            if not skip_the_layer or synced_gpus:
                h = layer(h)
        return (h * h).sum()


class ExpressionForm(Encoder):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            skip = True if self.training and torch.rand([]) < self.layerdrop else False
            if not skip:
                h = layer(h)
        return (h * h).sum()


class NestedForm(Encoder):
    """Informer's encoder: the flag set inside a nested ``if``, read by a later one."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            to_drop = False
            if self.training and self.layerdrop > 0.0:
                dropout_probability = torch.rand([])
                if dropout_probability < self.layerdrop:  # skip the layer
                    to_drop = True
            if not to_drop:
                h = layer(h)
        return (h * h).sum()


class ContinueForm(Encoder):
    """Informer's and SpeechT5's decoders: ``continue`` skips the rest of the loop body."""

    def forward(self, h: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            if self.training and torch.rand([]) < self.layerdrop:
                continue
            out = layer(h)
            h = out * scale
        return (h * h).sum()


class NestedContinueForm(Encoder):
    """Informer's decoder: the ``continue`` inside a nested ``if``."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for idx, layer in enumerate(self.layers):
            if self.training and self.layerdrop > 0.0:
                dropout_probability = torch.rand([])
                if dropout_probability < self.layerdrop:
                    continue
            h = layer(h)
        return (h * h).sum()


class SuperForm(Layer):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if torch.rand([]) < 0.5:
            h = super().forward(h)
        return (h * h).sum()


def _conds(code: str) -> int:
    """The conditionals the generated code calls (forward and backward)."""
    return sum("fxad_cond(" in line and not line.strip().startswith("#")
               for line in code.splitlines())


def _vjp(m: nn.Module, *inputs):
    """fxad.vjp of m, and a copy of m taken before (eager reference)."""
    ref_m = copy.deepcopy(m)
    return fxad.vjp(m, *inputs), ref_m


def _grads_close(ref_m: nn.Module, g, inputs: tuple, seeds=SEEDS) -> set[float]:
    """g: fxad.vjp of a copy of ref_m; checks value and gradients against eager for each
    seed and returns the values seen."""
    values = set()
    for seed in seeds:
        torch.manual_seed(seed)
        out, d_in, d_p = g(*inputs, torch.tensor(1.0))
        xs = [x.clone().requires_grad_() for x in inputs]
        ref_m.zero_grad()
        torch.manual_seed(seed)
        ref = ref_m(*xs)
        ref.backward()
        torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
        for d, x in zip(d_in, xs):  # (no gradient in eager: every layer skipped)
            want = x.grad if x.grad is not None else torch.zeros_like(x)
            torch.testing.assert_close(d, want, rtol=1e-10, atol=1e-12)
        for name, p in ref_m.named_parameters():
            want = p.grad if p.grad is not None else torch.zeros_like(p)
            torch.testing.assert_close(d_p[name], want, rtol=1e-10, atol=1e-12)
        values.add(round(float(out), 8))
    return values


@pytest.fixture(autouse=True)
def _float64():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


@pytest.mark.parametrize("cls", [Encoder, ExpressionForm, NestedForm, NestedContinueForm,
                                 SuperForm])
def test_layerdrop_becomes_cond_and_matches_eager(cls):
    torch.manual_seed(0)
    m = cls().train()
    x = torch.randn(2, 4)
    g, ref = _vjp(m, x)
    assert _conds(g.code) >= 2 and "torch.rand([])" in g.code
    values = _grads_close(ref, g, (x,))
    assert len(values) > 2  # different layers skipped on different calls
    # the rewrite lasted the capture only
    assert type(m).forward.__code__ not in autograph.REWRITTEN


def test_continue_form_and_a_second_input():
    torch.manual_seed(1)
    m = ContinueForm().train()
    x, s = torch.randn(2, 4), torch.randn(4)
    g, ref = _vjp(m, x, s)
    assert g.code.count("torch.rand([])") == 3
    _grads_close(ref, g, (x, s))


def test_both_branches_taken_across_calls():
    torch.manual_seed(0)
    m = Encoder(n=1).train()
    x = torch.randn(2, 4)
    g = fxad.vjp(m, x)
    skipped = float((x * x).sum())
    outs = set()
    for seed in range(12):
        torch.manual_seed(seed)
        out, _, d_p = g(x, torch.tensor(1.0))
        outs.add(float(out) == skipped)
        if float(out) == skipped:
            assert torch.count_nonzero(d_p["layers.0.lin.weight"]) == 0
    assert outs == {True, False}


def test_synced_gpus_or_runs_every_layer_and_draws_like_eager():
    torch.manual_seed(0)
    m = Encoder(synced_gpus=True).train()
    x = torch.randn(2, 4)
    g, ref = _vjp(m, x)
    assert _conds(g.code) == 0  # `... or True` is true whatever the draw
    assert g.code.count("torch.rand([])") == 3  # the draws eager makes are still made
    _grads_close(ref, g, (x,))


def test_eval_mode_draws_nothing():
    torch.manual_seed(0)
    m = Encoder().eval()
    x = torch.randn(2, 4)
    g, ref = _vjp(m, x)
    assert _conds(g.code) == 0 and "rand" not in g.code
    _grads_close(ref, g, (x,), seeds=[0])


def test_grad_of_a_function_with_closures():
    torch.manual_seed(0)
    w = torch.randn(4, 4)
    layer = Layer().train()

    def f(x):
        h = x @ w
        for _ in range(2):
            if torch.rand([]) > 0.4:
                h = layer(h) * w[0]
            else:
                h = h.flip(0)
        return h.pow(2).sum()

    x = torch.randn(3, 4)
    g = fxad.grad(f, x)
    for seed in SEEDS:
        torch.manual_seed(seed)
        value, (d_x,) = g(x)
        xr = x.clone().requires_grad_()
        torch.manual_seed(seed)
        ref = f(xr)
        ref.backward()
        torch.testing.assert_close(value, ref.detach())
        torch.testing.assert_close(d_x, xr.grad)


def test_compile_training_steps_follow_eager():
    torch.manual_seed(0)
    m_fx, m_ref = Encoder().train(), None
    m_ref = copy.deepcopy(m_fx)
    xs = [torch.randn(2, 4) for _ in range(5)]
    cm = fxad.compile(m_fx, xs[0])
    opt_fx = torch.optim.SGD(m_fx.parameters(), lr=0.05)
    opt_ref = torch.optim.SGD(m_ref.parameters(), lr=0.05)
    for step, x in enumerate(xs):
        for model, opt in ((cm, opt_fx), (m_ref, opt_ref)):
            torch.manual_seed(100 + step)
            opt.zero_grad()
            model(x).backward()
            opt.step()
    for (name, p), q in zip(m_fx.named_parameters(), m_ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12, msg=name)
    assert len(cm.builds) == 1


def test_branch_that_returns_is_refused_naming_the_line():
    class Early(Encoder):
        def forward(self, h):
            for layer in self.layers:
                if torch.rand([]) < self.layerdrop:
                    return h.sum()
                h = layer(h)
            return h.sum()

    with pytest.raises(DataDependentError) as e:
        fxad.vjp(Early().train(), torch.randn(2, 4))
    msg = str(e.value)
    assert "random draw" in msg and "a branch returns from the function" in msg
    assert "if torch.rand([]) < self.layerdrop:" in msg and "torch.cond(" in msg


def test_variable_left_different_is_captured_path_by_path():
    # `hidden` grows on one path only; with every layer skipped `hidden[0]` raises
    # IndexError, in eager code and in the generated code alike (with a warning at build)
    class Collect(Encoder):
        def forward(self, h):
            hidden = ()
            for layer in self.layers:
                if torch.rand([]) < self.layerdrop:
                    continue
                h = layer(h)
                hidden = hidden + (h,)
            return h.sum() + hidden[0].sum()

    torch.manual_seed(0)
    m, x = Collect().train().double(), torch.randn(2, 4, dtype=torch.float64)
    with pytest.warns(UserWarning, match=r"raises IndexError \(tuple index out of range\) at "
                      r".*test_autograph.py:\d+ when its random decisions at .* come out "
                      r"True, True, True"):
        g, ref = _vjp(m, x)
    assert _conds(g.code) >= 2
    raised = 0
    for seed in range(24):
        torch.manual_seed(seed)
        try:
            g(x, torch.tensor(1.0, dtype=torch.float64))
        except IndexError as e:
            assert "tuple index out of range (raised at" in str(e)
            raised += 1
            torch.manual_seed(seed)
            with pytest.raises(IndexError):
                ref(x)
            continue
        assert _grads_close(ref, g, (x,), seeds=[seed])
    assert 0 < raised < 24


class _Holder:
    def __init__(self, t):
        self.t = t


def _exists(v):
    return v is not None


@pytest.mark.parametrize("read", ["is", "isinstance", "call", "store"])
def test_variable_left_none_or_an_object_is_captured_path_by_path(read):
    # Python answers `s is None`, `isinstance(s, T)` and passes `s` on without asking the
    # object: capture takes each path with its own Python value of `s`
    box = {}

    def f(x):
        s = None
        if torch.rand(()) < 0.5:
            s = _Holder(x)
        if read == "is":
            taken = s is not None
        elif read == "isinstance":
            taken = isinstance(s, _Holder)
        elif read == "call":
            taken = _exists(s)
        else:
            box["s"] = s
            taken = s is not None
        return (x * (2 if taken else 3)).sum()

    x = torch.randn(3, dtype=torch.float64)
    g = fxad.grad(f, x)
    assert "fxad_cond(" in g.code
    seen = set()
    for seed in SEEDS:
        torch.manual_seed(seed)
        value, (d_x,) = g(x)
        torch.manual_seed(seed)
        want = 2 if torch.rand(()) < 0.5 else 3
        torch.testing.assert_close(value, (x * want).sum())
        torch.testing.assert_close(d_x, torch.full_like(x, want))
        seen.add(want)
    assert seen == {2, 3}


def test_variable_left_different_but_never_read_passes():
    def f(x):
        s = None
        for _ in range(2):
            if torch.rand(()) < 0.5:
                s = _Holder(x)  # never read again
                x = torch.sin(x)
        return (x * x).sum()

    x = torch.randn(3, dtype=torch.float64)
    g = fxad.grad(f, x)
    for seed in SEEDS:
        torch.manual_seed(seed)
        got = g(x)
        torch.manual_seed(seed)
        xe = x.clone().requires_grad_()
        want = f(xe)
        want.backward()
        torch.testing.assert_close(got[0], want.detach())
        torch.testing.assert_close(got[1][0], xe.grad)


class Collecting(Encoder):
    """A LayerDrop loop whose skipped body also collects hidden states when asked."""

    def forward(self, h, output_hidden_states=False):
        hiddens = []
        for layer in self.layers:
            if torch.rand([]) < self.layerdrop:
                continue
            h = layer(h)
            if output_hidden_states:
                hiddens.append(h)
            parts = []  # a list the branch makes itself: changing it is no obstacle
            parts.append(h * 0.5)
            parts.append(h * 0.5)
            h = parts[0] + parts[1]
        return (h * h).sum() + sum(x.sum() for x in hiddens)


def test_branch_that_changes_objects_only_when_asked_becomes_cond():
    torch.manual_seed(0)
    m, x = Collecting().train(), torch.randn(2, 4)
    g, ref = _vjp(m, x)
    assert _conds(g.code) >= 2
    assert len(_grads_close(ref, g, (x,))) > 2


def test_branch_changing_an_outer_object_is_captured_path_by_path():
    torch.manual_seed(0)
    m, x = Collecting().train().double(), torch.randn(2, 4, dtype=torch.float64)
    ref = copy.deepcopy(m)
    g = fxad.vjp(lambda x: m(x, output_hidden_states=True), x)
    seen = set()
    for seed in SEEDS:
        torch.manual_seed(seed)
        out, (d_x,) = g(x, torch.tensor(1.0, dtype=torch.float64))
        torch.manual_seed(seed)
        xe = x.clone().requires_grad_()
        want = ref(xe, output_hidden_states=True)
        want.backward()
        torch.testing.assert_close(out, want.detach())
        torch.testing.assert_close(d_x, xe.grad)
        seen.add(round(float(out), 8))
    assert len(seen) > 2

    class Counting(Encoder):
        def forward(self, h):
            for layer in self.layers:
                if torch.rand([]) < self.layerdrop:
                    self.ran = layer
                    h = layer(h)
            return h.sum()

    m2 = Counting().train().double()
    g2, ref2 = _vjp(m2, x)
    assert len(_grads_close(ref2, g2, (x,))) > 2


def test_decisions_captured_path_by_path_keep_python_state_per_path():
    # x-transformers' layer_dropout: Python's generator decides, the skipped body appends to
    # outer lists and binds `first` on one path only, which later layers read
    import random

    class Residual(Encoder):
        def forward(self, h):
            hiddens, first = [], None
            for layer in self.layers:
                if self.training and random.random() < self.layerdrop:
                    continue
                hiddens.append(h)
                h = layer(h)
                if first is None:
                    first = h
                else:
                    h = h + first
            return (h * h).sum() * len(hiddens) + self.layers[0].lin.bias.sum()

    torch.manual_seed(0)
    m, x = Residual().train().double(), torch.randn(2, 4, dtype=torch.float64)
    g, ref = _vjp(m, x)
    assert g.code.count("fxad_python_draw('random')") == 3  # drawn before the conds
    values = set()
    for seed in range(16):
        random.seed(seed), torch.manual_seed(seed)
        out, (d_x,), d_p = g(x, torch.tensor(1.0, dtype=torch.float64))
        random.seed(seed), torch.manual_seed(seed)
        xe = x.clone().requires_grad_()
        ref.zero_grad(set_to_none=True)
        want = ref(xe)
        want.backward()
        torch.testing.assert_close(out, want.detach())
        torch.testing.assert_close(d_x, xe.grad)
        for name, p in ref.named_parameters():
            torch.testing.assert_close(d_p[name], p.grad if p.grad is not None
                                       else torch.zeros_like(p))
        values.add(round(float(out), 8))
    assert len(values) > 4
    # fxad.compile follows every path in training
    comp, ref3 = fxad.compile(copy.deepcopy(ref)), copy.deepcopy(ref)
    for seed in range(8):
        random.seed(seed), torch.manual_seed(seed)
        loss = comp(x)
        loss.backward()
        random.seed(seed), torch.manual_seed(seed)
        want = ref3(x)
        want.backward()
        torch.testing.assert_close(loss.detach(), want.detach())
        for p, q in zip(comp.parameters(), ref3.parameters()):
            torch.testing.assert_close(p.grad, q.grad if q.grad is not None
                                       else torch.zeros_like(q))
            p.grad = q.grad = None


class Stacking(Encoder):
    """Skipped layers leave `hs` shorter: the paths return stacks of different shapes
    (``printing``: a print after each layer instead, and the sum)."""

    def __init__(self, n: int = 3, printing: bool = False) -> None:
        super().__init__(n)
        self.printing = printing

    def forward(self, h):
        hs = []
        for layer in self.layers:
            if torch.rand([]) < self.layerdrop:
                continue
            hs.append(h)
            h = layer(h)
            if self.printing:
                print("ran", len(hs))
        return h.sum() if self.printing else torch.stack(hs)


def test_paths_that_cannot_be_joined_are_refused_naming_the_line(monkeypatch):
    x = torch.randn(2, 4)
    with pytest.raises(DataDependentError, match=r"runs after a random decision that fxad "
                       r"captures path by path(.|\n)*print\(\"ran\""):
        fxad.vjp(Stacking(printing=True).train(), x)
    with pytest.raises(DataDependentError, match=r"output 0 of the program is a tensor of "
                       r"float\d\d\[\d, 2, 4\] after one outcome"):
        fxad.vjp(Stacking().train(), x)
    monkeypatch.setattr(paths, "MAX_PATHS", 4)
    with pytest.raises(DataDependentError, match=r"more than 4 paths(.|\n)*if torch.rand"):
        fxad.vjp(Stacking(n=3).train(), x)


def test_random_number_as_python_float_is_refused():
    def f(x):
        if torch.rand(1).item() < 0.5:
            x = x * 2
        return x.sum()

    with pytest.raises(DataDependentError, match="random draw"):
        fxad.grad(f, torch.randn(3))


def test_python_semantics_kept_for_python_values():
    """The rewritten function, run with Python predicates, is the original program:
    unbound variables stay unbound, `and`/`or` return their operands."""
    def f(x, flag, other):
        if flag and other:
            y = x + 1
        z = flag or other
        if not flag:
            return z
        return y, z

    code = ifrewrite.rewrite(f)
    g = type(f)(code, f.__globals__, "g", f.__defaults__, f.__closure__)
    for flag in (0, 1, [], [2]):
        for other in (0, "", "s"):
            try:
                want = f(3, flag, other)
            except UnboundLocalError:
                with pytest.raises(UnboundLocalError):
                    g(3, flag, other)
                continue
            assert g(3, flag, other) == want


def test_python_semantics_kept_for_loops_with_continue():
    def f(xs, a, b):
        out = []
        for x in xs:
            if x % a == 0:
                if x % b == 0:
                    continue
                x = -x
            elif x > 7:
                continue
            if x == 5:
                continue
            out.append(x)
        return out

    g = type(f)(ifrewrite.rewrite(f), f.__globals__, "g")
    for a in (2, 3):
        for b in (2, 4, 5):
            assert g(range(12), a, b) == f(range(12), a, b)


def test_function_created_inside_the_program_is_refused():
    def f(x):
        def inner(h):
            if torch.rand([]) < 0.5:
                h = h * 2
            return h
        return inner(x).sum()

    with pytest.raises(DataDependentError, match="defined inside the traced program"):
        fxad.grad(f, torch.randn(3))


def test_shapes_that_differ_are_captured_path_by_path():
    def f(x):
        y = x
        if torch.rand([]) < 0.5:
            y = x[:2]
        return y.sum()

    x = torch.randn(3, dtype=torch.float64)
    g = fxad.grad(f, x)
    for seed in SEEDS:
        torch.manual_seed(seed)
        value, (d_x,) = g(x)
        torch.manual_seed(seed)
        short = bool(torch.rand([]) < 0.5)
        torch.testing.assert_close(value, x[:2].sum() if short else x.sum())
        torch.testing.assert_close(d_x, torch.tensor([1.0, 1.0, 0.0 if short else 1.0],
                                                     dtype=torch.float64))


# -- transformers' LayerDrop models, tiny configs, train mode --------------------------------

def _audio_model(name: str) -> nn.Module:
    # transformers' audio models import torchvision, whose PyPI wheel needs its C++ ops
    # declared beside the CPU build of torch (fxad.tools.library_models)
    library_models = pytest.importorskip("fxad.tools.library_models")
    library_models.import_torchvision()
    transformers = pytest.importorskip("transformers")
    common = dict(hidden_size=16, num_hidden_layers=3, num_attention_heads=2,
                  intermediate_size=32, conv_dim=(8, 8), conv_stride=(5, 4), conv_kernel=(10, 8),
                  num_conv_pos_embeddings=4, num_conv_pos_embedding_groups=2, layerdrop=0.5,
                  mask_time_prob=0.0, mask_feature_prob=0.0, hidden_dropout=0.1,
                  attention_dropout=0.1, activation_dropout=0.1, feat_proj_dropout=0.1)
    if name == "Wav2Vec2ConformerModel":
        cfg = transformers.Wav2Vec2ConformerConfig(**common, conv_depthwise_kernel_size=3,
                                                   position_embeddings_type="relative")
    elif name == "SEWModel":
        cfg = transformers.SEWConfig(**common, squeeze_factor=2)
    else:
        cfg = transformers.Data2VecAudioConfig(**common)
    return getattr(transformers, name)(cfg)


class _Loss(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x).last_hidden_state.pow(2).sum()


@pytest.mark.parametrize("name", ["Wav2Vec2ConformerModel", "SEWModel", "Data2VecAudioModel"])
def test_transformers_layerdrop_models(name):
    torch.manual_seed(0)
    m = _Loss(_audio_model(name)).train()
    ref = copy.deepcopy(m)
    x = torch.randn(2, 400)
    g = fxad.vjp(m, x, argnums=())  # (the feature encoder sets requires_grad on its output)
    assert _conds(g.code) == 6  # 3 layers, forward and backward
    values = set()
    for seed in range(4):
        torch.manual_seed(seed)
        value, _, d_p = g(x, torch.tensor(1.0))
        ref.zero_grad()
        torch.manual_seed(seed)
        want = ref(x)
        want.backward()
        torch.testing.assert_close(value, want.detach(), rtol=1e-12, atol=1e-12)
        assert set(d_p) == {k for k, p in ref.named_parameters() if p.requires_grad}
        for k, p in ref.named_parameters():
            exp = p.grad if p.grad is not None else torch.zeros_like(p)
            torch.testing.assert_close(d_p[k], exp, rtol=1e-9, atol=1e-12, msg=k)
        values.add(float(value))
    assert len(values) > 1


def test_restart_leaves_no_graphs_of_the_abandoned_capture_on_the_module():
    class Two(nn.Module):  # two functions to rewrite: two restarts
        def __init__(self):
            super().__init__()
            self.a, self.b = SuperForm(), Encoder(n=2)

        def forward(self, h):
            return self.a(h) + self.b(h)

    m = Two().train()
    g = fxad.vjp(m, torch.randn(2, 4))
    branches = {k for k in vars(m) if re.fullmatch(r"_fxad_(true|false)_branch_\d+", k)}
    assert len(branches) == 6  # three ifs captured
    assert all(f"self.{k}" in g.code for k in branches)


def _mixed(x):
    if x.sum() > 0:  # a decision on the input's value: specialized and guarded
        x = x * 2
    if torch.rand([]) < 0.5:  # a random one: a conditional
        x = torch.tanh(x) + x
    return x.pow(2).sum()


def test_value_decision_beside_a_random_one_keeps_its_guard():
    x = torch.randn(3).abs()
    g = fxad.grad(_mixed, x)
    assert _conds(g.code) == 2 and "fxad_expect(" in g.code
    assert "if x.sum() > 0:" in g.code  # the guard names the user's line
    for seed in range(4):
        torch.manual_seed(seed)
        value, (d_x,) = g(x)
        xr = x.clone().requires_grad_()
        torch.manual_seed(seed)
        ref = _mixed(xr)
        ref.backward()
        torch.testing.assert_close(value, ref.detach())
        torch.testing.assert_close(d_x, xr.grad)
    with pytest.raises(fxad.errors.InputError):
        g(-x)


def test_forward_mode_and_second_order():
    w = torch.randn(4, 4)

    def f(x):
        for _ in range(2):
            if torch.rand([]) < 0.5:
                x = torch.tanh(x @ w) + x
        return x.pow(2).sum()

    x, v = torch.randn(3, 4), torch.randn(3, 4)
    gj, gh = fxad.jvp(f, x), fxad.hvp(f, x)
    for seed in range(4):
        torch.manual_seed(seed)
        value, tangent = gj(x, v)
        torch.manual_seed(seed)
        _, (hv,) = gh(x, v)
        torch.manual_seed(seed)
        ref, ref_t = torch.func.jvp(f, (x,), (v,))
        torch.manual_seed(seed)
        _, ref_hv = torch.func.jvp(torch.func.grad(f), (x,), (v,))
        torch.testing.assert_close(value, ref)
        torch.testing.assert_close(tangent, ref_t)
        torch.testing.assert_close(hv, ref_hv)


def test_transformers_informer_nested_continue():
    """InformerModel (distil=False): the encoder's flag set in a nested `if`, the decoder's
    `continue` inside a nested `if`."""
    library_models = pytest.importorskip("fxad.tools.library_models")
    library_models.import_torchvision()
    transformers = pytest.importorskip("transformers")
    cfg = transformers.InformerConfig(
        prediction_length=4, context_length=6, input_size=1, d_model=16, encoder_layers=2,
        decoder_layers=2, encoder_attention_heads=2, decoder_attention_heads=2,
        encoder_ffn_dim=16, decoder_ffn_dim=16, encoder_layerdrop=0.5, decoder_layerdrop=0.5,
        lags_sequence=[1, 2], num_time_features=1, dropout=0.1, attention_dropout=0.1,
        activation_dropout=0.1, distil=False)

    class Loss(nn.Module):
        def __init__(self):
            super().__init__()
            self.m = transformers.InformerModel(cfg)

        def forward(self, pv, ptf, pom, ftf, fv):
            return self.m(past_values=pv, past_time_features=ptf, past_observed_mask=pom,
                          future_time_features=ftf,
                          future_values=fv).last_hidden_state.pow(2).sum()

    torch.manual_seed(0)
    m = Loss().train()
    ref = copy.deepcopy(m)
    n = cfg.context_length + max(cfg.lags_sequence)
    inputs = (torch.randn(2, n), torch.randn(2, n, 1), torch.ones(2, n), torch.randn(2, 4, 1),
              torch.randn(2, 4))
    g = fxad.vjp(m, *inputs, argnums=())
    assert _conds(g.code) >= 8
    for seed in range(3):
        torch.manual_seed(seed)
        value, _, d_p = g(*inputs, torch.tensor(1.0))
        ref.zero_grad()
        torch.manual_seed(seed)
        want = ref(*inputs)
        want.backward()
        torch.testing.assert_close(value, want.detach(), rtol=1e-12, atol=1e-12)
        for k, p in ref.named_parameters():
            if p.requires_grad:  # (the sinusoidal position tables are frozen)
                exp = p.grad if p.grad is not None else torch.zeros_like(p)
                torch.testing.assert_close(d_p[k], exp, rtol=1e-9, atol=1e-12, msg=k)


class NormLayerDrop(nn.Module):
    """A layer that may be skipped holds a BatchNorm: its statistics are updated once per
    call, by the forward, only when the layer runs (the backward recomputes the branch
    without updating them)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)

    def forward(self, h):
        if torch.rand([]) < 0.5:
            h = self.bn(self.lin(h))
        return (h * h).sum() + self.lin.bias.sum()


@pytest.mark.parametrize("builder", ["grad", "compile"])
def test_buffer_updates_in_a_branch_happen_once_as_in_eager(builder):
    torch.manual_seed(0)
    m, x = NormLayerDrop().train().double(), torch.randn(5, 4, dtype=torch.float64)
    ref = copy.deepcopy(m)
    run = fxad.grad(m, x) if builder == "grad" else fxad.compile(m)
    for seed in SEEDS:
        torch.manual_seed(seed)
        if builder == "grad":
            got = run(x)[0]
        else:
            got = run(x)
            got.backward()
        torch.manual_seed(seed)
        want = ref(x)
        want.backward()
        torch.testing.assert_close(got.detach(), want.detach())
        for (name, b), want_b in zip(m.named_buffers(), ref.buffers()):
            torch.testing.assert_close(b, want_b, msg=f"{name} after seed {seed}")
    assert 0 < int(ref.bn.num_batches_tracked) < len(SEEDS)


# pytest rewrites the `assert` statements of test modules into `if`s: the models with plain
# assertions live in a module of their own, written and imported by the fixture
_CHECKED = """
import torch
import torch.nn as nn


class CheckedDropout(nn.Module):
    \"\"\"An ``assert`` on values after dropout (as I-BERT's activation quantizer does).\"\"\"

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        h = nn.functional.dropout(torch.tanh(self.lin(x)), 0.5, training=self.training)
        assert not h.isnan().any(), "NaN after dropout"
        assert h.abs().max() < 1e6 and h.sum() == h.sum()
        return (h * x).sum()


def either(x):
    h = nn.functional.dropout(x, 0.5)
    assert (h > 0).any() or (h <= 0).all()
    return h.sum()
"""


@pytest.fixture
def checked(tmp_path):
    import importlib.util
    path = tmp_path / "checked_models.py"
    path.write_text(_CHECKED)
    spec = importlib.util.spec_from_file_location("checked_models", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_assert_on_a_random_draw_is_checked_on_every_call(checked):
    """An assertion's test on a dropped-out value cannot be taken at build time, but the
    program goes on only where it holds: the code takes that path and checks it each call."""
    torch.manual_seed(0)
    m = checked.CheckedDropout().double().train()
    x = torch.randn(3, 4, dtype=torch.float64)
    g = fxad.grad(m, x)
    assert g.code.count("fxad_expect('assert'") == 3, g.code
    assert "torch.cond" not in g.code
    for seed in range(4):
        torch.manual_seed(seed)
        value, (d_x,), d_p = g(x)
        xr = x.clone().requires_grad_()
        m.zero_grad()
        torch.manual_seed(seed)
        ref = m(xr)
        ref.backward()
        torch.testing.assert_close(value, ref.detach())
        torch.testing.assert_close(d_x, xr.grad)
        for name, p in m.named_parameters():
            torch.testing.assert_close(d_p[name], p.grad)
    bad = x.clone()
    bad[0, 0] = float("nan")  # NaN in the input: tanh(lin(x)) is NaN in a whole row
    torch.manual_seed(0)
    with pytest.raises(AssertionError, match=r"assert not h\.isnan\(\)\.any\(\)"):
        g(bad)


def test_assert_with_or_on_a_random_draw_is_refused(checked):
    # `assert a or b`: a False `a` goes on to test `b`, so `a` is a real two-way decision
    with pytest.raises(DataDependentError, match="random draw"):
        fxad.grad(checked.either, torch.randn(5))


def test_compile_steps_through_an_assert_on_a_random_draw(checked):
    torch.manual_seed(0)
    m = checked.CheckedDropout().train()
    ref = copy.deepcopy(m)
    step = fxad.compile(m)
    x = torch.randn(3, 4)
    for seed in range(3):
        torch.manual_seed(seed)
        step(x).backward()
        torch.manual_seed(seed)
        ref(x).backward()
    for (name, p), q in zip(m.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
