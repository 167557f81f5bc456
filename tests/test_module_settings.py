"""fxad.compile and the Python attributes of the model's modules (``self.scale``, a flag, a
configuration object): the code of a build is specialized on them, so a change between calls
builds again, like a change of shapes, and the step matches eager PyTorch."""
from __future__ import annotations

import types

import pytest
import torch
import torch.nn as nn

import fxad
from fxad.capture.module_state import Settings, changed_settings
from fxad.training.module import VALUE_BUILDS_WARN

DT = torch.float64


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4).double()
        self.scale = 2.0
        self.use_relu = True
        self.config = types.SimpleNamespace(power=1, names=["a"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x) * self.scale
        if self.use_relu:
            h = torch.relu(h)
        return (h ** self.config.power).sum()


def _step(m: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    m.zero_grad()
    out = m(x)
    out.backward()
    inner = m.module if hasattr(m, "module") else m
    return out.detach(), inner.lin.weight.grad.clone()


@pytest.mark.parametrize("change", ["scale", "flag", "config", "config list"])
def test_a_changed_attribute_builds_again_and_matches_eager(change):
    torch.manual_seed(0)
    m = Scaled()
    x = torch.randn(3, 4, dtype=DT)
    cm = fxad.compile(m, x)
    _step(cm, x)
    if change == "scale":
        m.scale = 3.0
    elif change == "flag":
        m.use_relu = False
    elif change == "config":
        m.config.power = 2
    else:
        m.config.names.append("b")  # changed in place: compared by value
    got, want = _step(cm, x), _step(m, x)
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])
    assert len(cm.builds) == 2
    assert cm.builds[1].reason.startswith("module attributes changed: ")
    named = {"scale": "scale (2.0 -> 3.0)", "flag": "use_relu (True -> False)",
             "config": "config.power (1 -> 2)", "config list": "config.names"}[change]
    assert named in cm.builds[1].reason


def test_unchanged_and_returning_values_reuse_their_builds():
    m, x = Scaled(), torch.randn(3, 4, dtype=DT)
    cm = fxad.compile(m, x)
    for _ in range(3):
        _step(cm, x)
    assert len(cm.builds) == 1
    for scale in (3.0, 2.0, 3.0, 2.0):
        m.scale = scale
        got, want = _step(cm, x), _step(m, x)
        torch.testing.assert_close(got[1], want[1])
    assert len(cm.builds) == 2  # one build per set of values


def test_a_value_changing_every_step_is_warned_about():
    m, x = Scaled(), torch.randn(3, 4, dtype=DT)
    cm = fxad.compile(m, x)
    with pytest.warns(UserWarning, match=r"Python attributes of its modules keep changing .*"
                                         r"scale \(.*register_buffer"):
        for k in range(VALUE_BUILDS_WARN + 1):
            m.scale = 1.0 + k
            _step(cm, x)


def test_settings_version_is_checked_by_identity_and_names_changes():
    m = Scaled()
    mods = list(m.modules())
    st = Settings()
    v0 = st.version(mods)
    assert st.version(mods) == v0
    m.lin.extra = (1, 2)  # a new attribute
    v1 = st.version(mods)
    assert v1 != v0
    names = [n for n, _ in m.named_modules()]
    assert changed_settings(st.frozen[v0], st.frozen[v1], names) == ["lin.extra (None -> "
                                                                     "('tuple', (1, 2)))"]
    del m.lin.extra
    assert st.version(mods) == v0
    m.lin.weight.data.mul_(2)  # tensors are not settings
    assert st.version(mods) == v0


def test_generated_code_warns_when_the_module_changed_since_capture():
    m, x = Scaled(), torch.randn(3, 4, dtype=DT)
    g = fxad.grad(m, x)
    g(x)  # unchanged: no warning
    m.scale = 3.0
    with pytest.warns(fxad.guards.ModeWarning, match=r"Python attributes .* changed since "
                                                     r"\(scale \(2.0 -> 3.0\)\)"):
        g(x)


def test_closure_modules_are_watched_too():
    m, x = Scaled(), torch.randn(3, 4, dtype=DT)
    g = fxad.grad(lambda x: m(x) * 2, x)
    m.config.power = 2
    with pytest.warns(fxad.guards.ModeWarning, match=r"config.power \(1 -> 2\)"):
        g(x)
    m.config.power = 1
    m.eval()
    with pytest.warns(fxad.guards.ModeWarning, match=r"now in eval mode"):
        g(x)


def test_configuration_objects_count_other_held_objects_do_not():
    import dataclasses

    @dataclasses.dataclass
    class Args:
        power: int = 1

    class Schedule:  # held, but state that changes every step: not a setting
        def __init__(self):
            self.last_epoch = 0

    m, x = Scaled(), torch.randn(3, 4, dtype=DT)
    m.config = Args()
    m.schedule = Schedule()
    cm = fxad.compile(m, x)
    for step in range(3):
        m.schedule.last_epoch = step
        _step(cm, x)
    assert len(cm.builds) == 1
    m.config.power = 2
    got, want = _step(cm, x), _step(m, x)
    torch.testing.assert_close(got[1], want[1])
    assert len(cm.builds) == 2 and "config.power (1 -> 2)" in cm.builds[1].reason


@pytest.mark.parametrize("what", ["buffer", "plain tensor"])
def test_a_replaced_tensor_attribute_builds_again(what):
    class Shifted(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4).double()
            self.register_buffer("shift", torch.zeros(4, dtype=DT))
            self.gain = torch.ones(4, dtype=DT)

        def forward(self, x):
            return ((self.lin(x) + self.shift) * self.gain).pow(2).sum()

    m, x = Shifted(), torch.randn(3, 4, dtype=DT)
    cm = fxad.compile(m, x)
    _step(cm, x)
    m.shift.add_(1.0)  # changed in place: the same build reads it
    torch.testing.assert_close(_step(cm, x)[1], _step(m, x)[1])
    assert len(cm.builds) == 1
    if what == "buffer":
        m.shift = torch.full((4,), 2.0, dtype=DT)
    else:
        m.gain = torch.full((4,), 3.0, dtype=DT)
    got, want = _step(cm, x), _step(m, x)
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])
    assert len(cm.builds) == 2 and "(another tensor)" in cm.builds[1].reason


def test_a_hook_registered_or_removed_after_compile_builds_again():
    m, x = Scaled(), torch.randn(3, 4, dtype=DT)
    cm = fxad.compile(m, x)
    _step(cm, x)
    handle = m.lin.register_forward_hook(lambda mod, inp, out: out * 2)
    got, want = _step(cm, x), _step(m, x)
    torch.testing.assert_close(got[1], want[1])
    assert "lin._forward_hooks (hooks changed)" in cm.builds[-1].reason
    handle.remove()
    got, want = _step(cm, x), _step(m, x)
    torch.testing.assert_close(got[1], want[1])
    assert len(cm.builds) == 2  # back to the first build's hooks: its build again


class Gated(nn.Module):
    """Reads ``k`` only where ``use_k`` is set; writes ``calls``; never reads ``step``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4).double()
        self.use_k, self.k, self.step, self.calls = False, 2.0, 0, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if self.use_k:
            h = h * self.k
        self.calls = 1  # written, not read
        return torch.tanh(h).sum()


def test_attributes_the_code_never_read_need_no_build():
    """Only the attributes a build's capture read decide it: a step counter a trainer sets,
    an attribute the code only writes, and one read only in a branch not taken change
    nothing; reading it later (the branch taken) makes it count."""
    torch.manual_seed(0)
    m, x = Gated(), torch.randn(3, 4, dtype=DT)
    cm = fxad.compile(m, x)
    for step in range(VALUE_BUILDS_WARN + 2):
        m.step = step
        m.k = 2.0 + step  # read only under use_k, which is False
        got, want = _step(cm, x), _step(m, x)
        torch.testing.assert_close(got[1], want[1])
    assert len(cm.builds) == 1
    m.use_k = True  # read at the first build: builds again, and reads k
    got, want = _step(cm, x), _step(m, x)
    torch.testing.assert_close(got[1], want[1])
    m.k = 5.0  # now read by a build: builds again
    got, want = _step(cm, x), _step(m, x)
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])
    assert len(cm.builds) == 3
    assert cm.builds[1].reason.startswith("module attributes changed: use_k (False -> True)")
    assert cm.builds[2].reason.startswith(
        f"module attributes changed: k ({2.0 + VALUE_BUILDS_WARN + 1!r} -> 5.0)")


def test_code_reading_its_dict_counts_every_attribute():
    class Vars(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(3, dtype=DT))
            self.k = 1.0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (x * self.w * vars(self)["k"]).sum()

    m, x = Vars(), torch.randn(3, dtype=DT)
    cm = fxad.compile(m, x)
    cm(x)
    m.k = 5.0
    torch.testing.assert_close(cm(x), m(x))
    assert len(cm.builds) == 2


def test_recording_reads_puts_the_classes_back():
    from fxad.capture.module_state import recording_reads

    m = Gated()
    with pytest.raises(RuntimeError):
        with recording_reads(list(m.modules())) as reads:
            m.use_k
            raise RuntimeError
    assert "__getattribute__" not in Gated.__dict__ and "__getattribute__" not in nn.Linear.__dict__
    assert "use_k" in reads[id(m)] and "step" not in reads[id(m)]


def test_a_build_is_keyed_by_the_values_its_capture_started_from():
    """``forward`` reads a flag and clears it (a one-time warm-up): the first build is for
    the flag set, the next call (flag clear) builds again, as eager takes the other path."""
    class WarmUp(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(3, dtype=DT))
            self.first = True

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = x * self.w
            if self.first:
                y = y * 2
                self.first = False
            return y.sum()

    x = torch.randn(3, dtype=DT)
    m, ref = WarmUp(), WarmUp()
    cm = fxad.compile(m)
    for _ in range(3):
        torch.testing.assert_close(cm(x), ref(x))
    assert len(cm.builds) == 2
