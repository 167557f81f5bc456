"""Outputs in the program's own containers (ModelOutput, namedtuple, OrderedDict, dict) from
fxad.compile and fxad.vjp / fxad.grad, and Python-state warnings: one per changed object,
naming the line that changes it, attributed to the user's call of fxad."""
from __future__ import annotations

import collections
import copy
import os
import warnings

import pytest
import torch
import torch.nn as nn

import fxad
from fxad.capture.outputs import output_spec, restore_output

DT = torch.float64
P = collections.namedtuple("P", "value scaled")


def _x(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=DT)


def _state_warnings(record: list) -> list:
    return [w for w in record if "by the traced program" in str(w.message)]


# -- outputs: plain functions --------------------------------------------------------------------
def pair_nt(x):
    return P(x.sin().sum(), x.cos() * 2)


def pair_dict(x):
    return {"value": x.sin().sum(), "scaled": x.cos() * 2}


def pair_odict(x):
    return collections.OrderedDict(value=x.sin().sum(), scaled=x.cos() * 2)


@pytest.mark.parametrize("f", [pair_nt, pair_dict, pair_odict])
def test_vjp_returns_the_programs_container(f):
    x = _x(4)
    g = fxad.vjp(f, x)
    ref = f(x)
    cot = type(ref)(*[torch.ones_like(v) for v in ref]) if isinstance(ref, tuple) else \
        type(ref)((k, torch.full_like(v, 0.5)) for k, v in ref.items())
    out, (d_x,) = g(x, cot)
    assert type(out) is type(ref)
    leaves = list(out) if isinstance(out, tuple) else list(out.values())
    refs = list(ref) if isinstance(ref, tuple) else list(ref.values())
    assert [k for k in (out._fields if isinstance(out, tuple) else out)] == \
        [k for k in (ref._fields if isinstance(ref, tuple) else ref)]
    for a, b in zip(leaves, refs):
        torch.testing.assert_close(a, b)
    xr = x.clone().requires_grad_()
    r = f(xr)
    rl = list(r) if isinstance(r, tuple) else list(r.values())
    cl = list(cot) if isinstance(cot, tuple) else list(cot.values())
    (want,) = torch.autograd.grad(rl, [xr], cl)
    torch.testing.assert_close(d_x, want)


def test_grad_has_aux_returns_aux_in_its_container():
    def loss(x):
        r = pair_nt(x)
        return r.value, P(r.scaled.detach(), r.value.detach())

    x = _x(5)
    value, (d_x,), aux = fxad.grad(loss, x, has_aux=True)(x)
    assert type(aux) is P
    torch.testing.assert_close(aux.scaled, x.sin().sum())
    torch.testing.assert_close(aux.value, x.cos() * 2)
    torch.testing.assert_close(d_x, x.cos())
    torch.testing.assert_close(value, x.sin().sum())


def triple_odict(x):
    return collections.OrderedDict(value=x.sin().sum(), scaled=x.cos() * 2, top=x.argmax())


def _items(out):
    return list(out) if isinstance(out, tuple) else list(out.values())


def _keys(out):
    return list(out._fields) if isinstance(out, tuple) else list(out)


@pytest.mark.parametrize("f", [pair_nt, pair_dict, pair_odict, triple_odict])
def test_jvp_returns_output_and_tangent_in_the_programs_container(f):
    x, t = _x(4), _x(4, seed=1)
    out, tan = fxad.jvp(f, x)(x, t)
    ref, ref_t = torch.func.jvp(f, (x,), (t,))
    assert type(out) is type(ref) and type(tan) is type(ref)
    assert _keys(out) == _keys(ref) and _keys(tan) == _keys(ref)
    for a, b in zip(_items(out), _items(ref)):
        torch.testing.assert_close(a, b)
    for a, b, v in zip(_items(tan), _items(ref_t), _items(ref)):
        if v.is_floating_point():
            torch.testing.assert_close(a, b)
        else:  # an integer output: no tangent (torch.func gives float0 zeros)
            assert a is None


@pytest.mark.parametrize("f", [pair_nt, pair_odict])
def test_jacfwd_returns_the_programs_container(f):
    x = _x(3)
    jac = fxad.jacfwd(f, x)(x)
    ref = torch.func.jacfwd(f)(x)
    assert type(jac) is type(ref) and _keys(jac) == _keys(ref)
    for a, b in zip(_items(jac), _items(ref)):
        torch.testing.assert_close(a, b)


def test_hvp_returns_per_input_tuples():
    """fxad.hvp returns (gradients, Hessian-vector products), one per input: shaped like the
    inputs, not like the program's output, so plain tuples."""
    def loss(x, y):
        return pair_nt(x * y).value

    x, y, tx, ty = _x(3), _x(3, seed=1), _x(3, seed=2), _x(3, seed=3)
    grads, hvps = fxad.hvp(loss, x, y)(x, y, tx, ty)
    assert type(grads) is tuple and type(hvps) is tuple and len(hvps) == 2
    want = torch.func.jvp(torch.func.grad(loss, argnums=(0, 1)), (x, y), (tx, ty))
    for a, b in zip(grads + hvps, want[0] + want[1]):
        torch.testing.assert_close(a, b)


def test_plain_tuple_and_tensor_outputs_unchanged():
    x = _x(3)
    out, _ = fxad.vjp(lambda x: (x.sin(), x.cos()), x)(x, (torch.ones_like(x),
                                                           torch.ones_like(x)))
    assert type(out) is tuple and len(out) == 2
    out, _ = fxad.vjp(lambda x: x.sin(), x)(x, torch.ones_like(x))
    assert isinstance(out, torch.Tensor)
    out, tan = fxad.jvp(lambda x: (x.sin(), [x.cos()]), x)(x, torch.ones_like(x))
    assert type(out) is tuple and type(out[1]) is list and type(tan) is tuple
    out, tan = fxad.jvp(lambda x: x.sin(), x)(x, torch.ones_like(x))
    assert isinstance(out, torch.Tensor) and isinstance(tan, torch.Tensor)


# -- outputs: fxad.compile -----------------------------------------------------------------------
class _Heads(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.lin = nn.Linear(3, 4)
        self.kind = kind

    def forward(self, x):
        h = self.lin(x)
        loss, scaled = (h ** 2).mean(), h * 2
        if self.kind == "namedtuple":
            return P(loss, scaled)
        if self.kind == "odict":
            return collections.OrderedDict(value=loss, scaled=scaled)
        return {"value": loss, "scaled": scaled}


@pytest.mark.parametrize("kind", ["namedtuple", "odict", "dict"])
def test_compile_returns_the_programs_container(kind):
    torch.manual_seed(0)
    m = _Heads(kind).double()
    ref = copy.deepcopy(m)
    x = _x(2, 3)
    out = fxad.compile(m)(x)
    want = ref(x)
    assert type(out) is type(want)
    value = out.value if kind == "namedtuple" else out["value"]
    want_value = want.value if kind == "namedtuple" else want["value"]
    torch.testing.assert_close(value, want_value)
    value.backward()
    want_value.backward()
    for (n, p), (_, q) in zip(m.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=n)


# -- transformers ------------------------------------------------------------------------------------
def _bert():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1,
                                  num_attention_heads=2, intermediate_size=32,
                                  max_position_embeddings=16, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(cfg).double()


def test_bert_compile_model_output_and_one_located_warning():
    m = _bert()
    ref = copy.deepcopy(m)
    ids = torch.randint(0, 50, (2, 5), generator=torch.Generator().manual_seed(1))
    lab = torch.tensor([0, 1])
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        out = fxad.compile(m)(ids, labels=lab)  # the line the warning points at
    state = _state_warnings(rec)
    assert len(state) == 1, [str(w.message) for w in state]
    w = state[0]
    msg = str(w.message)
    assert "`config`" in msg and "`problem_type`" in msg, msg
    assert "modeling_bert.py:" in msg and "self.config.problem_type = " in msg, msg
    assert "single_label_classification" in msg, msg  # the store that ran, not another one
    assert os.path.basename(w.filename) == "test_outputs_and_warnings.py", w.filename
    assert "fxad" not in os.path.dirname(w.filename).split(os.sep)[-1:]
    want = ref(ids, labels=lab)
    assert type(out) is type(want)
    torch.testing.assert_close(out.loss, want.loss)
    torch.testing.assert_close(out.logits, want.logits)
    out.loss.backward()
    want.loss.backward()
    for (n, p), (_, q) in zip(m.named_parameters(), ref.named_parameters()):
        if q.grad is None:
            assert p.grad is None or not p.grad.any(), n
        else:
            torch.testing.assert_close(p.grad, q.grad, msg=n)
    # the configuration is set now: a second build of the model warns no more
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        fxad.compile(m)(ids[:, :4], labels=lab)
    assert not _state_warnings(rec), [str(w.message) for w in rec]


def test_jvp_of_a_model_returns_its_model_output():
    """A transformers model called on embeddings: fxad.jvp gives the ModelOutput for both the
    output and its tangent, as torch.func.jvp does, with its numbers (eager attention:
    forward-mode autograd has no formula for the CPU flash attention kernel)."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1,
                                  num_attention_heads=2, intermediate_size=32,
                                  max_position_embeddings=16, attn_implementation="eager")
    torch.manual_seed(0)
    m = transformers.BertForSequenceClassification(cfg).double().eval()
    emb = _x(2, 5, 16)
    t = _x(2, 5, 16, seed=1)

    def run(e):
        return m(inputs_embeds=e)

    out, tan = fxad.jvp(run, emb)(emb, t)
    with torch.no_grad():
        ref, ref_t = torch.func.jvp(run, (emb,), (t,))
    assert type(out) is type(ref) and type(tan) is type(ref)
    assert list(out.keys()) == list(ref.keys()) == list(tan.keys())
    torch.testing.assert_close(out.logits, ref.logits)
    torch.testing.assert_close(tan.logits, ref_t.logits)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_decoder_models_give_no_state_warning(name):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if name == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=50, n_embd=16, n_layer=1, n_head=2,
                                      n_positions=16, use_cache=False)
        m = transformers.GPT2LMHeadModel(cfg)
    else:
        cfg = transformers.LlamaConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1,
                                       num_attention_heads=2, num_key_value_heads=2,
                                       intermediate_size=32, max_position_embeddings=16,
                                       use_cache=False)
        m = transformers.LlamaForCausalLM(cfg)
    ids = torch.randint(0, 50, (2, 6), generator=torch.Generator().manual_seed(2))
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        out = fxad.compile(m.eval())(ids, labels=ids)
    assert not _state_warnings(rec), [str(w.message) for w in _state_warnings(rec)]
    with torch.no_grad():
        want = m(ids, labels=ids)
    assert type(out) is type(want) and out.loss.ndim == 0
    torch.testing.assert_close(out.loss.detach(), want.loss)


# -- warnings: shared objects ------------------------------------------------------------------------
class _Cfg:
    def __init__(self):
        self.mode = None


class _Inner(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg

    def forward(self, x):
        return x * 2


class _Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.cfg = _Cfg()
        self.a = _Inner(self.cfg)
        self.b = nn.Sequential(_Inner(self.cfg))

    def forward(self, x):
        if self.cfg.mode is None:
            self.cfg.mode = "sum"
        return self.b(self.a(x)).sum()


def test_shared_object_changed_once_is_warned_once_at_the_users_call():
    m = _Outer()
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        fxad.grad(m, _x(3))
    state = _state_warnings(rec)
    assert len(state) == 1, [str(w.message) for w in state]
    msg = str(state[0].message)
    line = _Outer.forward.__code__.co_firstlineno + 2
    assert "module attribute `cfg` gets its `mode` changed" in msg, msg
    assert f"test_outputs_and_warnings.py:{line}: `self.cfg.mode = \"sum\"`" in msg, msg
    assert os.path.basename(state[0].filename) == "test_outputs_and_warnings.py"
    assert m.cfg.mode == "sum"


def test_restore_output_leaves_a_value_of_another_shape_alone():
    a, b = torch.ones(2), torch.zeros(2)
    spec = output_spec(P(a, b), (torch.fx.Graph().placeholder("a"),
                                 torch.fx.Graph().placeholder("b")))
    assert type(restore_output((a, b), spec)) is P
    assert restore_output({"value": a, "scaled": b}, spec).scaled is b
    odd = ((a,), b)  # two children, but the first is a tuple: not the program's output
    assert restore_output(odd, spec) is odd
    assert restore_output(a, spec) is a
    dspec = output_spec({"value": a}, {"value": torch.fx.Graph().placeholder("v")})
    other = {"other": a}
    assert restore_output(other, dspec) is other
