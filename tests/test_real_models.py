"""Real-model suite (issue: real models): models fxad did not write, from transformers and
torch.nn, built from small configurations with random weights.  Each is checked in float64
(value, every parameter and floating-input gradient vs torch.autograd) and trained through
fxad.compile for a few SGD steps beside eager autograd.  See :mod:`fxad.tools.models`."""
from __future__ import annotations

import pytest
import torch

from fxad.tools.models import cases, check_case, train_case

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
    from fxad.tools.models import _gpt2
    torch.manual_seed(0)
    model, (ids,) = _gpt2()
    model = model.double()
    code = fxad.grad(model, ids).code
    assert "torch.cat" in code


# --- models beyond the suite: constructs found by trying more transformers models -------------

def _param_grads_match(model, inputs, dtype, tol, seeds=(3,), **options):
    """fxad.grad's value and parameter gradients vs eager autograd with inputs that do not
    require grad (as users train), under each of ``seeds``; the module's state is left as
    eager's.  ``options`` go to :func:`fxad.grad`."""
    import copy

    import fxad
    model = model.to(dtype).train()
    inputs = tuple(x.to(dtype) if x.is_floating_point() else x for x in inputs)
    before = copy.deepcopy(model.state_dict())
    g = fxad.grad(model, *inputs, **options)
    for seed in seeds:
        model.load_state_dict(before)
        torch.manual_seed(seed)
        value, _, d_params = g(*inputs)
        model.load_state_dict(before)
        torch.manual_seed(seed)
        model.zero_grad(set_to_none=True)
        ref = model(*inputs)
        ref.backward()
        torch.testing.assert_close(value, ref.detach(), rtol=tol, atol=tol)
        for name, p in model.named_parameters():
            want = p.grad if p.grad is not None else torch.zeros_like(p)
            torch.testing.assert_close(d_params[name], want, rtol=tol, atol=tol, msg=name)
    return g


def _from_config(kind, cls_name, **cfg):
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.for_model(kind, **cfg)
    torch.manual_seed(0)
    return getattr(transformers, cls_name).from_config(config)


def test_wav2vec2_weight_norm_and_requires_grad_assignment():
    # its feature encoder sets `hidden_states.requires_grad = True` on a view of the input, and
    # its positional convolution is weight-normalized (torch._weight_norm)
    from fxad.tools.models import LossOf
    model = _from_config("wav2vec2", "AutoModel", num_hidden_layers=2, hidden_size=32,
                         num_attention_heads=2, intermediate_size=64, conv_dim=(8, 8),
                         conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=8,
                         num_conv_pos_embedding_groups=2, hidden_dropout=0.0,
                         activation_dropout=0.0, attention_dropout=0.0, feat_proj_dropout=0.0,
                         layerdrop=0.0, mask_time_prob=0.0)
    x = torch.randn(2, 400, generator=torch.Generator().manual_seed(0))
    g = _param_grads_match(LossOf(model, ("input_values",)), (x,), torch.float64, 1e-9)
    assert "torch._weight_norm" in g.code and "fxad_autograd_vjp" not in g.code


def test_ctrl_numpy_scalar_and_module_attribute_rebinding():
    # CTRL scales by np.sqrt(d) (a NumPy scalar) and rebinds a buffer in forward
    # (self.pos_encoding = self.pos_encoding.to(...)): the code must not need numpy, and the
    # user's module must not keep a traced value
    import warnings

    from fxad.tools.models import LossOf
    model = _from_config("ctrl", "AutoModelForCausalLM", n_layer=2, n_embd=32, n_head=2,
                         dff=64, vocab_size=64, n_positions=64, resid_pdrop=0.0,
                         embd_pdrop=0.0)
    ids = torch.randint(3, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the rebinding keeps the value: nothing to say
        g = _param_grads_match(LossOf(model, ("input_ids",), "logits"), (ids,),
                               torch.float64, 1e-9)
    assert "np.float64" not in g.code and "5.65685424949238" in g.code
    assert type(model.transformer.pos_encoding) is torch.Tensor


def test_mixtral_experts_custom_op_backward_as_code():
    # transformers' MoE experts call its torch.library op `transformers::grouped_mm_fallback`
    # on the compile path (fxad answers is_compiling() like Dynamo): differentiated by the
    # op's registered autograd formula, captured as code (its backward op in the VJP code)
    import warnings

    import fxad
    from fxad.tools.models import LossOf
    model = _from_config("mixtral", "AutoModelForCausalLM", num_hidden_layers=2, hidden_size=32,
                         num_attention_heads=2, num_key_value_heads=1, intermediate_size=64,
                         vocab_size=64, max_position_embeddings=64, num_local_experts=4,
                         num_experts_per_tok=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    ids = torch.randint(3, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("error", fxad.FallbackWarning)
        # float32: eager's F.grouped_mm has no float64 CPU kernel
        g = _param_grads_match(LossOf(model, ("input_ids",), "logits"), (ids,), torch.float32,
                               2e-5)
    assert g.code.count("torch.ops.transformers.grouped_mm_fallback_backward(") == 4


def test_longt5_without_attention_mask_on_its_eager_path():
    # LongT5's transient-global attention indexes an attention mask it creates only when not
    # is_compiling(): capture fails on the compile path and goes on on the eager one
    from fxad.tools.models import LossOf
    model = _from_config("longt5", "AutoModel", d_model=32, d_ff=64, d_kv=8, num_heads=4,
                         num_layers=1, num_decoder_layers=1, vocab_size=64,
                         decoder_start_token_id=0, local_radius=4, global_block_size=4,
                         encoder_attention_type="transient-global", dropout_rate=0.0)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 64, (2, 12), generator=g)
    _param_grads_match(LossOf(model, ("input_ids", "decoder_input_ids"), "last_hidden_state"),
                       (ids, ids[:, :7]), torch.float64, 1e-9)


def test_switch_transformers_experts_picked_by_name():
    # its router converts itself to the router dtype in forward (a no-op here), and its
    # experts are picked by `self[f"expert_{expert_idx[0]}"]` over the nonzero expert hits:
    # with values="guard+sizes", a build specialized on the experts hit, guarded
    from fxad.tools.models import LossOf
    model = _from_config("switch_transformers", "AutoModel", d_model=32, d_ff=64, d_kv=8,
                         num_heads=4, num_layers=2, num_decoder_layers=2,
                         num_sparse_encoder_layers=1, num_sparse_decoder_layers=1,
                         num_experts=4, vocab_size=64, decoder_start_token_id=0,
                         router_jitter_noise=0.0, dropout_rate=0.0)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 64, (2, 12), generator=g)
    code = _param_grads_match(
        LossOf(model, ("input_ids", "decoder_input_ids"), "last_hidden_state"),
        (ids, ids[:, :7]), torch.float32, 2e-5, values="guard+sizes").code
    assert "nonzero_static" in code and "'item'" in code


def test_ibert_asserts_on_dropped_out_values():
    # I-BERT's activation quantizer asserts on values after dropout (a random draw) and calls
    # x.mean(axis=2): the assertion is checked on every call, the NumPy keyword is PyTorch's
    from fxad.tools.models import LossOf
    model = _from_config("ibert", "AutoModel", num_hidden_layers=2, hidden_size=32,
                         num_attention_heads=4, intermediate_size=64, vocab_size=64,
                         max_position_embeddings=64)
    ids = torch.randint(3, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    code = _param_grads_match(LossOf(model, ("input_ids",), "last_hidden_state"), (ids,),
                              torch.float64, 1e-9, seeds=(0, 1)).code
    assert "fxad_expect('assert'" in code and "axis" not in code


def test_mamba_associative_scan():
    # on the compile path Mamba's selective scan is torch's associative_scan
    from fxad.tools.models import LossOf
    model = _from_config("mamba", "AutoModelForCausalLM", num_hidden_layers=2, hidden_size=32,
                         state_size=4, vocab_size=64, expand=2, conv_kernel=4)
    ids = torch.randint(3, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    g = _param_grads_match(LossOf(model, ("input_ids",), "logits"), (ids,), torch.float64,
                           1e-9)
    assert "fxad_scan(" in g.code and "fxad_scan_vjp(" in g.code
