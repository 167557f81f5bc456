"""Regional compilation of the joint training step (fxad.training.regional): each repeated
block's forward and backward regions compiled once, the glue run as written."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fxad.training import joint_step
from fxad.training.step import inductor_available


class Block(nn.Module):
    def __init__(self, d, norm=nn.LayerNorm):
        super().__init__()
        self.norm = norm(d)
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)

    def forward(self, x):
        h = self.norm(x) if not isinstance(self.norm, nn.BatchNorm1d) else \
            self.norm(x.transpose(1, 2)).transpose(1, 2)
        return x + self.fc2(F.gelu(self.fc1(h)))


class Stack(nn.Module):
    def __init__(self, widths=(8, 8, 8), norm=nn.LayerNorm, vocab=11):
        super().__init__()
        self.emb = nn.Embedding(vocab, widths[0])
        self.blocks = nn.ModuleList(Block(d, norm) for d in widths)
        self.proj = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths, widths[1:])
                                  if a != b)
        self.head = nn.Linear(widths[-1], vocab)

    def forward(self, ids, y):
        h = self.emb(ids)
        k = 0
        for i, b in enumerate(self.blocks):
            if h.shape[-1] != b.fc1.in_features:
                h = self.proj[k](h)
                k += 1
            h = b(h)
        return F.cross_entropy(self.head(h).flatten(0, 1), y.flatten())


def _inputs(vocab=11):
    g = torch.Generator().manual_seed(0)
    return (torch.randint(0, vocab, (2, 5), generator=g),
            torch.randint(0, vocab, (2, 5), generator=g))


def _autograd(model, inputs):
    ref = copy.deepcopy(model)
    loss = ref(*inputs)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in ref.named_parameters()}, ref


def _check(step, model, inputs, atol=1e-6):
    ref_loss, ref_grads, ref = _autograd(model, inputs)
    loss, _, grads = step(*inputs)
    torch.testing.assert_close(loss, ref_loss)
    for n, g in ref_grads.items():
        torch.testing.assert_close(grads[n], g, atol=atol, rtol=1e-5)
    return ref


def test_equal_blocks_share_one_function_per_phase():
    torch.manual_seed(0)
    model, inputs = Stack().double(), _inputs()
    step = joint_step(copy.deepcopy(model), *inputs, compile="eager", regions=True)
    plan = step.regions
    assert [r.label for r in plan.regions] == (
        [f"blocks.{i} forward" for i in range(3)]
        + [f"blocks.{i} backward" for i in (2, 1, 0)])
    # the last block's backward differs from the others: its cotangent arrives as the
    # head's 2-D product (the reshape to 3-D folded away), theirs as the next block's 3-D one
    assert plan.group_of == [0, 0, 0, 1, 2, 2] and plan.groups == 3
    assert plan.glue_nodes > 0  # the embedding, the head, the loss and their backward
    _check(step, model, inputs, atol=1e-12)


def test_driver_code_calls_the_regions_and_keeps_the_names():
    torch.manual_seed(0)
    model, inputs = Stack(), _inputs()
    built = []

    def compile_count(gm, example_inputs):
        built.append(gm)
        return gm.forward

    step = joint_step(copy.deepcopy(model), *inputs, compile=compile_count, regions=True)
    step(*inputs)
    assert len(built) == 3  # one dynamo graph per group, reused by every block
    whole = step.graph_module
    # a region's outputs keep their names of the joint graph, so the driver reads like it
    driver_code = step.driver.code
    assert driver_code.count("self.region_0(") == 3 and driver_code.count("self.region_2(") == 2
    names = {n.name for n in whole.graph.nodes}
    read = [n.name for n in step.driver.graph.nodes if n.op == "call_function"
            and n.args and getattr(n.args[0], "op", None) == "call_module"]
    assert read and set(read) <= names
    assert "blocks.0 forward" in repr(step.driver.region_0)


def test_blocks_of_different_widths_are_compiled_apart():
    torch.manual_seed(0)
    model, inputs = Stack(widths=(8, 8, 6, 6)).double(), _inputs()
    step = joint_step(copy.deepcopy(model), *inputs, compile="eager", regions=True)
    plan = step.regions
    group = {r.label: k for r, k in zip(plan.regions, plan.group_of)}
    # shapes are part of a region's identity: width 8 and width 6 blocks never share
    assert group["blocks.0 forward"] == group["blocks.1 forward"]
    assert group["blocks.2 forward"] != group["blocks.0 forward"]
    assert group["blocks.3 forward"] != group["blocks.0 forward"]
    assert "proj.0 forward" in group  # a list of projections is a block list too
    _check(step, model, inputs, atol=1e-12)


def test_no_repeated_block_compiles_the_whole_graph():
    torch.manual_seed(0)
    model, inputs = Stack(widths=(8, 6, 4)), _inputs()
    with pytest.warns(UserWarning, match="no two of the model's 10 block regions"):
        step = joint_step(copy.deepcopy(model), *inputs, compile="eager", regions=True)
    assert step.regions is None and step.driver is None
    _check(step, model, inputs)


def test_batch_norm_running_statistics_inside_regions():
    torch.manual_seed(0)
    model, inputs = Stack(norm=nn.BatchNorm1d).double().train(), _inputs()
    m = copy.deepcopy(model)
    step = joint_step(m, *inputs, compile="eager", regions=True)
    assert step.regions.group_of == [0, 0, 0, 1, 2, 2]
    ref = _check(step, model, inputs, atol=1e-12)
    for b, rb in zip(m.blocks, ref.blocks):  # the regions update the buffers in place
        torch.testing.assert_close(b.norm.running_mean, rb.norm.running_mean)
        torch.testing.assert_close(b.norm.running_var, rb.norm.running_var)
        assert b.norm.num_batches_tracked == rb.norm.num_batches_tracked == 1


def test_transformer_encoder_layers_with_masks():
    """The merged attention mask is computed in the first layer and read by all: it is glue,
    so the first layer's forward region equals the others.  The backward recomputes the
    mask's float form, read by every backward region: glue too, so the last layer's
    backward region (where it was first read) equals the middle ones.  The first layer's
    backward differs (no cotangent for the undifferentiated input)."""
    torch.manual_seed(0)

    class Enc(nn.Module):
        def __init__(self):
            super().__init__()
            layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
            self.enc = nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)
            self.head = nn.Linear(16, 3)

        def forward(self, x, pad, y):
            causal = nn.Transformer.generate_square_subsequent_mask(x.shape[1],
                                                                    dtype=x.dtype)
            h = self.enc(x, mask=causal, src_key_padding_mask=pad)
            return F.cross_entropy(self.head(h).flatten(0, 1), y.flatten())

    model = Enc().double()
    pad = torch.zeros(2, 5, dtype=torch.bool)
    pad[1, 3:] = True
    inputs = (torch.randn(2, 5, 16, dtype=torch.float64), pad, torch.randint(0, 3, (2, 5)))
    step = joint_step(copy.deepcopy(model), *inputs, compile="eager", regions=True)
    assert step.regions.group_of == [0, 0, 0, 0, 1, 1, 1, 2]
    _check(step, model, inputs, atol=1e-12)


def test_regions_are_opt_in():
    torch.manual_seed(0)
    model, inputs = Stack(widths=(8,) * 6), _inputs()
    for kw in ({}, {"regions": False}):
        step = joint_step(copy.deepcopy(model), *inputs, compile="eager", **kw)
        assert step.regions is None and step.driver is None
    step = joint_step(copy.deepcopy(model), *inputs, compile=False, regions=True)
    assert step.regions is None and step.driver is None  # nothing is compiled
    step = joint_step(copy.deepcopy(model), *inputs, compile="eager", regions=True)
    plan = step.regions
    assert plan.group_of == [0] * 6 + [1] + [2] * 5
    sizes = [len(r.nodes) for r in plan.regions]
    assert plan.compiled_nodes() == sizes[0] + sizes[6] + sizes[7] < plan.region_nodes / 3
    _check(step, model, inputs, atol=1e-5)


def test_inductor_regions_match_autograd():
    if not inductor_available():
        pytest.skip("torch.compile (inductor) unavailable here")
    torch.manual_seed(0)
    model, inputs = Stack(widths=(16, 16, 16)), _inputs()
    step = joint_step(copy.deepcopy(model), *inputs, regions=True)
    assert step.regions.group_of == [0, 0, 0, 1, 2, 2]
    _check(step, model, inputs, atol=1e-5)


def test_regions_on_symbolic_sizes_serve_other_sizes():
    torch.manual_seed(0)
    model = Stack(widths=(8,) * 4).double()
    step = joint_step(copy.deepcopy(model), *_inputs(), compile="eager", regions=True,
                      dynamic=True)
    assert step.regions.groups < len(step.regions.regions)  # symbolic shapes still group
    g = torch.Generator().manual_seed(1)
    other = (torch.randint(0, 11, (3, 7), generator=g), torch.randint(0, 11, (3, 7),
                                                                      generator=g))
    for inputs in (_inputs(), other):
        _check(step, model, inputs, atol=1e-12)


def test_regions_without_blocks_warn_and_compile_the_whole_graph():
    torch.manual_seed(0)
    w, x = torch.randn(4, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)

    def loss(w, x):  # no modules at all
        return torch.tanh(x @ w).pow(2).sum()

    with pytest.warns(UserWarning, match="the model has no repeated block"):
        step = joint_step(loss, w, x, compile="eager", regions=True, argnums=0)
    assert step.regions is None and step.driver is None
    value, (d_w, d_x) = step(w, x)  # a function: no parameter gradients
    torch.testing.assert_close(value, loss(w, x))
    torch.testing.assert_close(d_w, torch.func.grad(loss)(w, x))
    assert d_x is None
