"""The generated code reads as a person writes it: multi-output calls unpacked into names
from the user's line or the op (no ``getitem_<k>``), no argument equal to the op's default,
the forward as the user wrote it, and the demo's excerpt of one block a whole.  The code
still runs, matches autograd (float64), is deterministic, and survives ``to_folder``,
``torch.compile`` and a second differentiation."""
from __future__ import annotations

import ast
import builtins
import inspect
import math
import operator
import re
import subprocess
import sys
import types

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

import fxad
from fxad import codegen
from fxad.codegen.defaults import printed_arguments
from fxad.demo.models import TinyGPT
from fxad.demo.train import block_backward_code

DT = torch.float64
GETITEM = re.compile(r"\bgetitem(_\d+)?\b")


def _gpt(n_layer: int = 2) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = TinyGPT(vocab_size=11, block_size=8, n_layer=n_layer, n_head=2, n_embd=8).to(DT)
    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 11, (2, 8), generator=gen)
    tgt = torch.randint(0, 11, (2, 8), generator=gen)
    return model, idx, tgt


@pytest.fixture(scope="module")
def gpt():
    model, idx, tgt = _gpt()
    return model, idx, tgt, fxad.grad(model, idx, tgt, argnums=())


# ---------------------------------------------------------------- an independent reader


def _names(code: str) -> set[str]:
    """Every name the code assigns or reads."""
    return {n.id for n in ast.walk(ast.parse(code)) if isinstance(n, ast.Name)}


def _callee(func: ast.expr) -> object | None:
    """The object a dotted name ``torch.nn.functional.gelu`` in the code stands for."""
    parts = []
    while isinstance(func, ast.Attribute):
        parts.append(func.attr)
        func = func.value
    if not isinstance(func, ast.Name) or func.id != "torch":
        return None
    obj: object = torch
    for p in reversed(parts):
        obj = getattr(obj, p, None)
        if obj is None:
            return None
    return obj


def _defaults(fn: object) -> list[dict[str, object]]:
    """Per signature of ``fn``: keyword name -> default (Python signature, or schemas)."""
    if isinstance(fn, types.FunctionType):
        sig = inspect.signature(fn)
        return [{p.name: p.default for p in sig.parameters.values()
                 if p.default is not p.empty}]
    if isinstance(fn, torch._ops.OpOverloadPacket):
        schemas = [getattr(fn, o)._schema for o in fn.overloads()]
    elif isinstance(fn, types.BuiltinFunctionType):
        schemas = torch._C._jit_get_schemas_for_operator(f"aten::{fn.__name__}")
    else:
        return []
    return [{a.name: a.default_value for a in s.arguments if a.has_default_value()}
            for s in schemas]


def _equal(value: object, default: object) -> bool:
    if isinstance(value, (list, tuple)) and isinstance(default, (list, tuple)):
        return len(value) == len(default) and all(map(_equal, value, default))
    if type(value) is not type(default):
        return False
    if isinstance(value, float):
        return value == default and math.copysign(1, value) == math.copysign(1, default)
    return value == default


def default_keywords(code: str) -> list[str]:
    """``f(..., k = v)`` calls in ``code`` where every signature of ``f`` that has ``k``
    gives it the default ``v``."""
    found = []
    for call in ast.walk(ast.parse(code)):
        if not isinstance(call, ast.Call):
            continue
        fn = _callee(call.func)
        sigs = _defaults(fn) if fn is not None else []
        for kw in call.keywords:
            try:
                value = ast.literal_eval(kw.value)
            except ValueError:
                continue
            having = [s for s in sigs if kw.arg in s]
            if having and all(_equal(value, s[kw.arg]) for s in having):
                found.append(f"{ast.unparse(call.func)}({kw.arg}={value!r})")
    return found


# ---------------------------------------------------------------- the demo GPT


def test_gpt_code_has_no_getitem_names_and_no_default_arguments(gpt):
    model, idx, tgt, g = gpt
    code = g.code
    assert not GETITEM.search(code), GETITEM.findall(code)
    assert default_keywords(code) == []
    # the forward as the user wrote it
    assert "torch.nn.functional.embedding(idx, wte_weight)" in code
    assert "torch.nn.functional.cross_entropy(view_8, view_9)" in code
    # multi-output calls unpacked into names from the user's line and from the op
    assert "layer_norm, mean, rstd = torch.native_layer_norm(add, [8], " in code
    assert "q, k, v = torch.split(linear, 8, dim = 2)" in code
    assert "d_linear = torch.cat([d_q, d_k, d_v], 2)" in code
    assert re.search(r"\n    scaled_dot_product_attention, logsumexp = torch\.ops\.aten\."
                     r"_scaled_dot_product_flash_attention_for_cpu\(transpose, transpose_1, "
                     r"transpose_2, is_causal = True\)", code)
    assert "d_add_part, d_blocks_0_ln_1_weight, d_blocks_0_ln_1_bias = " in code
    assert "d_add = d_add_1 + d_add_part" in code
    # no statement picks an item out of a tuple by hand
    assert not re.search(r"^\s*\w+ = \w+\[\d+\]", code, re.M)


def test_gpt_code_matches_autograd(gpt):
    model, idx, tgt, g = gpt
    loss, _, grads = g(idx, tgt)
    model.zero_grad(set_to_none=True)
    ref = model(idx, tgt)
    ref.backward()
    torch.testing.assert_close(loss, ref.detach())
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, msg=name)


def test_gpt_code_is_deterministic(gpt):
    model, idx, tgt, g = gpt
    assert fxad.grad(model, idx, tgt, argnums=()).code == g.code


def test_printing_leaves_the_graph_as_it_was(gpt):
    model, idx, tgt, g = gpt
    emb = [n for n in g.graph.nodes if n.target is F.embedding]
    assert emb and all(n.kwargs.get("sparse") is False for n in emb)  # kept in the graph
    ln = [n for n in g.graph.nodes if n.target is torch.native_layer_norm]
    assert ln and all(len(n.users) == 3 for n in ln)
    before = g.code
    g.recompile()
    assert g.code == before


def test_gpt_code_survives_to_folder(gpt, tmp_path):
    model, idx, tgt, g = gpt
    g.to_folder(tmp_path / "saved", "Saved")
    expected = g(idx, tgt)
    torch.save({"idx": idx, "tgt": tgt, "expected": expected}, tmp_path / "data.pt")
    script = f"""
import sys, torch
sys.path.insert(0, {str(tmp_path)!r})
from saved import Saved
data = torch.load({str(tmp_path / 'data.pt')!r}, weights_only=False)
loss, _, grads = Saved()(data["idx"], data["tgt"])
torch.testing.assert_close(loss, data["expected"][0])
for k, v in data["expected"][2].items():
    torch.testing.assert_close(grads[k], v)
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


def test_gpt_code_runs_under_torch_compile(gpt):
    model, idx, tgt, g = gpt
    torch._dynamo.reset()
    try:
        compiled = torch.compile(g, backend="eager", fullgraph=True)
        loss, _, grads = compiled(idx, tgt)
    finally:
        torch._dynamo.reset()
    loss_ref, _, grads_ref = g(idx, tgt)
    torch.testing.assert_close(loss, loss_ref)
    for k in grads_ref:
        torch.testing.assert_close(grads[k], grads_ref[k])


def test_demo_excerpt_is_whole(gpt):
    """Every name the excerpt of block 0 reads is defined in it, is a value of the forward,
    or is the cotangent of the block's output (the one cotangent flowing in)."""
    model, idx, tgt, g = gpt
    text = block_backward_code(g, "blocks.0", shapes=False)
    assert text.startswith("# cotangent flowing in: d_add_2\n")
    assigned: set[str] = set()
    undefined: list[str] = []
    for stmt in ast.parse(text).body:
        reads = [n.id for n in ast.walk(stmt.value if isinstance(stmt, ast.Assign) else stmt)
                 if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)]
        undefined += [r for r in reads if r not in assigned and r != "torch"
                      and not hasattr(builtins, r)]
        for t in getattr(stmt, "targets", []):
            assigned |= {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}
    nodes = {n.name: n for n in g.graph.nodes}
    backward = {u for u in undefined if "fxad_bwd_of" in nodes[u].meta}
    assert backward == {"d_add_2"}, backward  # add_2 = the output of block 0
    assert not GETITEM.search(text)
    # every backward block of the layer norms, the attention and the split is in it
    for header in ("# backward of: layer_norm, mean, rstd = ",
                   "# backward of: layer_norm_1, mean_1, rstd_1 = ",
                   "# backward of: scaled_dot_product_attention, logsumexp = ",
                   "# backward of: q, k, v = torch.split("):
        assert header in text
    assert "blocks_1_" not in text
    assert "d_add = d_add_1 + d_add_part" in text  # the cotangent flowing out


# ---------------------------------------------------------------- other multi-output ops


class _LSTM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(3, 4, batch_first=True)

    def forward(self, x):
        out, (h, c) = self.lstm(x)
        return out.pow(2).sum() + (h * c).sum()


class _BatchNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x):
        return self.bn(x).pow(2).sum()


def _max(x):
    values, where = x.max(1)
    return values.pow(2).sum()


def _sort(x):
    s, i = torch.sort(x, dim=1)
    return (s * torch.arange(4.0, dtype=x.dtype)).sum()


def _topk(x):
    v, i = x.topk(2)
    return v.pow(2).sum()


def _var_mean(x):
    return (torch.var_mean(x, 1)[0] * x.sum(1)).sum()


@pytest.mark.parametrize("name,f,make,expect", [
    ("max", _max, lambda: (torch.randn(3, 4, dtype=DT),),
     r"values, where = torch\.max\(x, 1"),
    ("sort", _sort, lambda: (torch.randn(3, 4, dtype=DT),), r"s, i = torch\.sort\(x, dim = 1\)"),
    ("topk", _topk, lambda: (torch.randn(3, 4, dtype=DT),), r"v, i = torch\.topk\(x, 2\)"),
    ("var_mean", _var_mean, lambda: (torch.randn(3, 4, dtype=DT),),
     r"var, _ = torch\.var_mean\(x, 1"),
    ("batch_norm", _BatchNorm, lambda: (torch.randn(5, 4, dtype=DT),),
     r"batch_norm, save_mean, save_invstd = torch\.native_batch_norm\("),
    ("lstm", _LSTM, lambda: (torch.randn(2, 5, 3, dtype=DT),), None),
])
def test_multi_output_ops_print_as_unpacking(name, f, make, expect):
    torch.manual_seed(0)
    obj = f().to(DT) if isinstance(f, type) else f
    args = make()
    g = fxad.grad(obj, *args)
    code = g.code
    if expect is not None:
        assert re.search(expect, code), code
    # no tuple item picked out by hand: every item of a tuple is named by an unpacking
    for n in g.graph.nodes:
        if n.target is operator.getitem and isinstance(n.args[0].meta.get("val"), tuple):
            assert not GETITEM.fullmatch(n.name), n.name
            assert not re.search(rf"^\s*{n.name} = \w+\[", code, re.M), n.name
    assert default_keywords(code) == []
    # the code still computes autograd's gradients
    if isinstance(obj, nn.Module):
        _, (gx,), grads = g(*args)
        xr = args[0].clone().requires_grad_()
        obj.zero_grad(set_to_none=True)
        obj(xr).backward()
        torch.testing.assert_close(gx, xr.grad)
        for k, p in obj.named_parameters():
            torch.testing.assert_close(grads[k], p.grad, msg=k)
    else:
        _, (gx,) = g(*args)
        xr = args[0].clone().requires_grad_()
        obj(xr).backward()
        torch.testing.assert_close(gx, xr.grad)


def test_native_dropout_items_named_by_the_user():
    def f(x):
        y, mask = torch.native_dropout(x, 0.3, True)
        return (y * 2).sum()

    g = fxad.vjp(f, torch.randn(3, 4, dtype=DT))
    assert "y, mask = torch.native_dropout(x, 0.3, True)" in g.code


def test_second_derivative_of_unpacked_code():
    """The code with unpacked layer norm, split and attention is differentiated again."""
    def f(x, w, b, wqkv, attention=F.scaled_dot_product_attention):
        h = F.layer_norm(x, (8,), w, b)
        q, k, v = (h @ wqkv).split(8, dim=-1)
        q, k, v = (t.reshape(2, 5, 2, 4).transpose(1, 2) for t in (q, k, v))
        return attention(q, k, v, is_causal=True).pow(2).sum()

    def attention(q, k, v, is_causal):  # the reference: autograd has no second derivative
        s = (q @ k.transpose(-1, -2)) / 2.0  # of the CPU flash-attention kernel
        s = s.masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), float("-inf"))
        return s.softmax(-1) @ v

    torch.manual_seed(0)
    x, w, b = (torch.randn(2, 5, 8, dtype=DT), torch.randn(8, dtype=DT),
               torch.randn(8, dtype=DT))
    wqkv = torch.randn(8, 24, dtype=DT)
    g = fxad.grad(f, x, w, b, wqkv)
    assert "q, k, v = torch.split(" in g.code and not GETITEM.search(g.code)
    h = fxad.vjp(g, x, w, b, wqkv)
    ones = tuple(torch.ones_like(t) for t in (x, w, b, wqkv))
    _, hs = h(x, w, b, wqkv, (torch.ones((), dtype=DT), ones))
    leaves = [t.clone().requires_grad_() for t in (x, w, b, wqkv)]
    loss = f(*leaves, attention=attention)
    grads = torch.autograd.grad(loss, leaves, create_graph=True)
    refs = torch.autograd.grad(loss + sum(gr.sum() for gr in grads), leaves)
    for got, ref in zip(hs, refs, strict=True):
        torch.testing.assert_close(got, ref)


# ---------------------------------------------------------------- the printing rules


def _call(target, args, kwargs=None):
    """A node calling ``target(x, w, *args, **kwargs)`` (x, w placeholders)."""
    g = fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    node = g.call_function(target, (x, w) + tuple(args), kwargs or {})
    g.output(node)
    return node


@pytest.mark.parametrize("target,args,kwargs,printed", [
    # Python functions: their one signature
    (F.embedding, (), dict(padding_idx=None, max_norm=None, norm_type=2.0,
                           scale_grad_by_freq=False, sparse=False), ((), {})),
    (F.layer_norm, (None, None, 1e-05), {}, ((), {})),
    # a positional default before other arguments: the rest by keyword
    (F.layer_norm, (None, None, 1e-03), {}, ((), {"eps": 1e-03})),
    (F.cross_entropy, (), dict(weight=None, ignore_index=-100, reduction="mean",
                               label_smoothing=0.0), ((), {})),
    (F.batch_norm, (None, None, None, True, 0.1, 1e-05), {}, ((None,), {"training": True})),
    # a different value, an int for a float default, -0.0 for 0.0: kept
    (F.cross_entropy, (), dict(reduction="sum"), None),
    (F.embedding, (), dict(norm_type=2), None),
    (F.cross_entropy, (), dict(label_smoothing=-0.0), None),
    # one schema takes the call (the out= overload needs out)
    (F.linear, (None,), {}, ((), {})),
    (torch.ops.aten.gelu_backward, (), dict(approximate="none"), ((), {})),
    (torch.ops.aten.gelu_backward, (), dict(approximate="tanh"), None),
    # overloads: torch.max(x, w) is another overload than torch.max(x, 1, keepdim=False)
    (torch.max, (False,), {}, None),
])
def test_printed_arguments(target, args, kwargs, printed):
    node = _call(target, args, kwargs)
    got = printed_arguments(node)
    if printed is None:
        assert got is None
        return
    x, w = node.args[:2]
    assert got == ((x, w) + printed[0], printed[1])


def test_positional_default_before_other_arguments_becomes_keywords():
    g = fx.Graph()
    q = g.placeholder("q")
    node = g.call_function(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu,
                           (q, q, q, 0.0, True), {"scale": None})
    assert printed_arguments(node) == ((q, q, q), {"is_causal": True})
    node.args = (q, q, q, 0.5, True)  # dropout: kept
    assert printed_arguments(node) == ((q, q, q, 0.5, True), {})


def test_fused_layer_norm_whose_statistics_nothing_reads_prints_as_layer_norm():
    g = fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    xv, wv = torch.randn(3, 4, dtype=DT), torch.randn(4, dtype=DT)
    x.meta["val"], w.meta["val"] = xv, wv
    ln = g.call_function(torch.native_layer_norm, (x, [4], w, None, 1e-05))
    ln.meta["val"] = torch.native_layer_norm(xv, [4], wv, None, 1e-05)
    y = g.call_function(operator.getitem, (ln, 0))
    y.meta["val"] = ln.meta["val"][0]
    g.output(y)
    codegen.install(g)
    gm = fx.GraphModule(nn.Module(), g)
    lines = [line.strip() for line in gm.code.splitlines() if " = " in line]
    assert lines == ["out = torch.nn.functional.layer_norm(x, [4], w);  x = w = None"]
    torch.testing.assert_close(gm(xv, wv), F.layer_norm(xv, (4,), wv))
    assert ln.target is torch.native_layer_norm and len(ln.args) == 5  # the graph is kept
