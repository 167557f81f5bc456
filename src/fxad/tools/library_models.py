"""Library-model suite: fxad on models from the libraries people use beside PyTorch.

``python -m fxad.tools.library_models [--only NAME ...]``

Models from torchvision, timm, diffusers, PyTorch Geometric, torchdiffeq, einops,
x-transformers, e3nn, gpytorch and zuko, and the Hugging Face ``transformers`` families whose
code takes Python decisions on tensor values (LayerDrop, Longformer/LED, DETR, JetMoE,
BigBird-Pegasus, SpeechT5's loss built in ``forward``), each built from a tiny configuration
with random weights (nothing is downloaded), in **training mode** with its dropout, stochastic
depth and LayerDrop **on**, in float64.  Each case is run through :func:`fxad.grad` with
fxad's autograd fallback turned into an error (a :class:`fxad.FallbackWarning` fails the
case), and the value and every parameter (and floating input) gradient are compared with
``torch.autograd`` under the same seeds (torch's, NumPy's and Python's generators), by
:func:`fxad.tools.models.check_case`.

Every case states its expected outcome: ``"pass"``, or (for the few programs whose Python
decision cannot be taken at build time) the error fxad raises, which must name the line of
the library's code that takes the decision.  The test suite
(``tests/test_library_models.py``) asserts exactly that outcome; the command prints the table.

torchvision and timm are imported through
:func:`fxad.tools.torchvision_import.import_torchvision` (torchvision's PyPI wheel for Linux
is a CUDA build whose import fails beside the CPU torch; see that module).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import re
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn

from ..argparsing import ArgumentParser
from ..errors import FxadError, InputError
from ..rules.fallback import FallbackWarning
from .models import LossOf, _prepared, check_case, weighted_loss
from .torchvision_import import import_torchvision

__all__ = ["LibraryCase", "library_cases", "run_case", "has_expected_outcome",
           "import_torchvision", "markdown", "summary_markdown", "main", "run"]

# one build compared with eager autograd under each of these seeds (the build itself runs
# under another, see check_case): a random draw that the build fixed instead of drawing it
# on every call gives a mismatch under at least one of them (LayerDrop with p = 0.5 over two
# layers: 4 patterns, so the check misses it with probability 1/16 per model at most)
SEEDS = (0, 1)


@dataclass
class LibraryCase:
    """One library model.  ``build()`` returns ``(module, example_inputs)`` in float32 (the
    module returns a scalar loss); ``expect`` is ``"pass"`` or ``(result, exception class
    name, regular expression the message must match[, regular expression one of the
    UserWarnings must match])`` with result ``"refused"`` (fxad's error while building) or
    ``"FAIL"`` (a known gap, stated so that the table shows it and the test notices when it
    closes); result and class name are regular expressions matched whole;
    ``value_dependent`` marks the programs whose Python code decides on tensor values;
    ``input_grads=False`` checks the parameter gradients only (the model's own code sets
    ``requires_grad`` on a view of its input, which eager autograd allows only when the input
    does not require grad); ``options`` go to :func:`fxad.grad`."""

    name: str
    library: str
    build: Callable[[], tuple[nn.Module, tuple]]
    expect: Any = "pass"
    value_dependent: bool = False
    train_mode: bool = True
    input_grads: bool = True
    options: dict | None = None


def _g(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _img(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=_g())


def _loss_of(model: nn.Module, names: tuple[str, ...] | None = None,
             key: str | None = None) -> LossOf:
    return LossOf(model, names, key, weighted=True)


class _Loss(nn.Module):
    """:func:`fxad.tools.models.weighted_loss` of ``fn(module, *inputs)``, for a module whose
    call needs glue code."""

    def __init__(self, model: nn.Module, fn: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.model = model
        self.fn = fn

    def forward(self, *inputs: Any) -> torch.Tensor:
        return weighted_loss(self.fn(self.model, *inputs))


# --- torchvision ---------------------------------------------------------------------------

def _tv_resnet() -> tuple[nn.Module, tuple]:
    import_torchvision()
    from torchvision.models.resnet import BasicBlock, ResNet
    return _loss_of(ResNet(BasicBlock, [1, 1, 1, 1], num_classes=5)), (_img(2, 3, 16, 16),)


def _tv_efficientnet() -> tuple[nn.Module, tuple]:
    import_torchvision()
    from torchvision.models.efficientnet import EfficientNet, MBConvConfig
    setting = [MBConvConfig(1, 3, 1, 8, 8, 1), MBConvConfig(4, 3, 2, 8, 16, 2)]
    model = EfficientNet(setting, dropout=0.2, stochastic_depth_prob=0.5, num_classes=5,
                         last_channel=32)
    return _loss_of(model), (_img(2, 3, 16, 16),)


def _tv_convnext() -> tuple[nn.Module, tuple]:
    import_torchvision()
    from torchvision.models.convnext import CNBlockConfig, ConvNeXt
    model = ConvNeXt([CNBlockConfig(8, 16, 1), CNBlockConfig(16, None, 2)],
                     stochastic_depth_prob=0.5, num_classes=5)
    return _loss_of(model), (_img(2, 3, 16, 16),)


def _tv_swin() -> tuple[nn.Module, tuple]:
    import_torchvision()
    from torchvision.models.swin_transformer import SwinTransformer
    model = SwinTransformer(patch_size=[2, 2], embed_dim=8, depths=[1, 1], num_heads=[1, 2],
                            window_size=[2, 2], dropout=0.1, attention_dropout=0.1,
                            stochastic_depth_prob=0.5, num_classes=5)
    return _loss_of(model), (_img(2, 3, 8, 8),)


def _tv_vit() -> tuple[nn.Module, tuple]:
    import_torchvision()
    from torchvision.models.vision_transformer import VisionTransformer
    model = VisionTransformer(image_size=16, patch_size=8, num_layers=2, num_heads=2,
                              hidden_dim=16, mlp_dim=32, dropout=0.1, attention_dropout=0.1,
                              num_classes=5)
    return _loss_of(model), (_img(2, 3, 16, 16),)


# --- timm ----------------------------------------------------------------------------------

def _timm(name: str, **kw: Any) -> Callable[[], tuple[nn.Module, tuple]]:
    def build() -> tuple[nn.Module, tuple]:
        import_torchvision()
        import timm
        size = kw.pop("img", 16)
        model = timm.create_model(name, pretrained=False, num_classes=5, **kw)
        return _loss_of(model), (_img(2, 3, size, size),)
    return build


def _timm_vit() -> tuple[nn.Module, tuple]:
    import_torchvision()
    from timm.models.vision_transformer import VisionTransformer
    model = VisionTransformer(img_size=16, patch_size=8, embed_dim=16, depth=2, num_heads=2,
                              mlp_ratio=2.0, num_classes=5, drop_rate=0.1, attn_drop_rate=0.1,
                              proj_drop_rate=0.1, drop_path_rate=0.5, init_values=1e-2)
    return _loss_of(model), (_img(2, 3, 16, 16),)


def _timm_convnext() -> tuple[nn.Module, tuple]:
    import_torchvision()
    from timm.models.convnext import ConvNeXt
    model = ConvNeXt(depths=(1, 1, 2, 1), dims=(8, 8, 16, 16), num_classes=5, drop_rate=0.1,
                     drop_path_rate=0.5, patch_size=2, ls_init_value=0.5)
    return _loss_of(model), (_img(2, 3, 32, 32),)


def _timm_swin() -> tuple[nn.Module, tuple]:
    import_torchvision()
    from timm.models.swin_transformer import SwinTransformer
    model = SwinTransformer(img_size=16, patch_size=2, window_size=4, embed_dim=8,
                            depths=(1, 1), num_heads=(1, 2), num_classes=5, drop_rate=0.1,
                            attn_drop_rate=0.1, drop_path_rate=0.5)
    return _loss_of(model), (_img(2, 3, 16, 16),)


def _timm_mobilenet() -> tuple[nn.Module, tuple]:
    import_torchvision()
    import timm
    model = timm.create_model("mobilenetv3_small_050", pretrained=False, num_classes=5,
                              drop_rate=0.1, drop_path_rate=0.5)
    # 4 images of 48 x 48: the last batch norms see 2 x 2 maps (on 1 x 1 maps of 2 images
    # batch norm's gradient is a cancellation that rounding dominates).  Eager's backward of
    # hardsigmoid multiplies by 1/6 rounded to float32 (3e-8 relative), inside tolerance
    return _loss_of(model), (_img(4, 3, 48, 48),)


# --- diffusers -----------------------------------------------------------------------------

def _unet2d() -> tuple[nn.Module, tuple]:
    from diffusers import UNet2DModel
    model = UNet2DModel(sample_size=8, in_channels=3, out_channels=3, layers_per_block=1,
                        block_out_channels=(8, 16), norm_num_groups=4,
                        down_block_types=("DownBlock2D", "AttnDownBlock2D"),
                        up_block_types=("AttnUpBlock2D", "UpBlock2D"), dropout=0.1,
                        attention_head_dim=4)
    t = torch.tensor([3, 7])
    return _Loss(model, lambda m, x, t: m(x, t).sample), (_img(2, 3, 8, 8), t)


def _unet2d_cond() -> tuple[nn.Module, tuple]:
    from diffusers import UNet2DConditionModel
    model = UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1,
        block_out_channels=(8, 16), norm_num_groups=4, cross_attention_dim=12,
        attention_head_dim=4,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"))
    t = torch.tensor([3, 7])
    ctx = torch.randn(2, 5, 12, generator=_g(1))
    return _Loss(model, lambda m, x, t, c: m(x, t, encoder_hidden_states=c).sample), \
        (_img(2, 4, 8, 8), t, ctx)


def _vae() -> tuple[nn.Module, tuple]:
    from diffusers import AutoencoderKL
    model = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=2,
                          block_out_channels=(8, 16), norm_num_groups=4, layers_per_block=1,
                          down_block_types=("DownEncoderBlock2D",) * 2,
                          up_block_types=("UpDecoderBlock2D",) * 2, sample_size=8)
    # sample_posterior draws from the latent Gaussian (torch.randn): same seed, same draw
    return _Loss(model, lambda m, x: m(x, sample_posterior=True).sample), (_img(2, 3, 8, 8),)


# --- PyTorch Geometric ---------------------------------------------------------------------

def _graph() -> tuple[torch.Tensor, torch.Tensor]:
    g = _g()
    x = torch.randn(7, 5, generator=g)
    src = torch.tensor([0, 1, 2, 3, 4, 5, 6, 0, 2, 4, 1, 3])
    dst = torch.tensor([1, 2, 3, 4, 5, 6, 0, 3, 5, 0, 6, 2])
    return x, torch.stack([torch.cat([src, dst]), torch.cat([dst, src])])


def _pyg(cls_name: str, **kw: Any) -> Callable[[], tuple[nn.Module, tuple]]:
    def build() -> tuple[nn.Module, tuple]:
        import torch_geometric.nn as pyg_nn
        model = getattr(pyg_nn.models, cls_name)(5, 16, num_layers=2, out_channels=3,
                                                 dropout=0.2, **kw)
        return _loss_of(model), _graph()
    return build


# --- torchdiffeq ---------------------------------------------------------------------------

class _ODEFunc(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 4))

    def forward(self, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.net(y) * torch.cos(t)


class _ODE(nn.Module):
    def __init__(self, method: str, **options: Any) -> None:
        super().__init__()
        self.func = _ODEFunc()
        self.method = method
        self.options = options

    def forward(self, y0: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        from torchdiffeq import odeint
        ys = odeint(self.func, y0, t, method=self.method, **self.options)
        return (ys[-1] ** 2).mean()


def _ode(method: str, **options: Any) -> Callable[[], tuple[nn.Module, tuple]]:
    def build() -> tuple[nn.Module, tuple]:
        return _ODE(method, **options), (torch.randn(3, 4, generator=_g()),
                                         torch.linspace(0.0, 1.0, 4))
    return build


# --- einops, x-transformers ----------------------------------------------------------------

class _Mixer(nn.Module):
    """A small MLP-Mixer written with einops layers and functions."""

    def __init__(self) -> None:
        super().__init__()
        from einops.layers.torch import Rearrange, Reduce
        self.patch = Rearrange("b c (h p1) (w p2) -> b (h w) (p1 p2 c)", p1=4, p2=4)
        self.embed = nn.Linear(48, 16)
        self.token_mix = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Dropout(0.1),
                                       nn.Linear(8, 4))
        self.norm = nn.LayerNorm(16)
        self.pool = Reduce("b n d -> b d", "mean")
        self.head = nn.Linear(16, 5)

    def forward(self, img: torch.Tensor) -> torch.Tensor:
        from einops import einsum, rearrange, repeat
        x = self.embed(self.patch(img))
        y = rearrange(self.norm(x), "b n d -> b d n")
        x = x + rearrange(self.token_mix(y), "b d n -> b n d")
        scale = repeat(torch.linspace(0.5, 1.5, 16, dtype=x.dtype), "d -> b d", b=x.shape[0])
        return einsum(self.head(self.pool(x) * scale), self.head.weight, "b k, k d -> b d")


def _einops() -> tuple[nn.Module, tuple]:
    return _loss_of(_Mixer()), (_img(2, 3, 8, 8),)


def _xtransformer() -> tuple[nn.Module, tuple]:
    from x_transformers import Decoder, TransformerWrapper
    model = TransformerWrapper(num_tokens=50, max_seq_len=16,
                               attn_layers=Decoder(dim=16, depth=2, heads=2, rotary_pos_emb=True,
                                                   attn_dropout=0.1, ff_dropout=0.1),
                               emb_dropout=0.1)
    ids = torch.randint(0, 50, (2, 8), generator=_g())
    return _loss_of(model), (ids,)


def _xtransformer_layerdrop() -> tuple[nn.Module, tuple]:
    from x_transformers import Encoder, TransformerWrapper
    model = TransformerWrapper(num_tokens=50, max_seq_len=16,
                               attn_layers=Encoder(dim=16, depth=2, heads=2, layer_dropout=0.3))
    ids = torch.randint(0, 50, (2, 8), generator=_g())
    return _loss_of(model), (ids,)


# --- e3nn ----------------------------------------------------------------------------------

class _E3NN(nn.Module):
    """Spherical harmonics of edge vectors, a tensor product with node features, a gate."""

    def __init__(self) -> None:
        super().__init__()
        from e3nn import o3
        from e3nn.nn import Gate
        self.irreps_sh = o3.Irreps.spherical_harmonics(2)
        self.lin = o3.Linear("4x0e", "4x0e + 2x1o")
        self.gate = Gate("4x0e", [torch.tanh], "2x0e", [torch.sigmoid], "2x1o")
        self.tp = o3.FullyConnectedTensorProduct("4x0e + 2x1o", self.irreps_sh,
                                                 self.gate.irreps_in)
        self.out = o3.Linear(self.gate.irreps_out, "3x0e + 1x1o")

    def forward(self, feats: torch.Tensor, vecs: torch.Tensor) -> torch.Tensor:
        from e3nn import o3
        sh = o3.spherical_harmonics(self.irreps_sh, vecs, normalize=True)
        return self.out(self.gate(self.tp(self.lin(feats), sh)))


def _e3nn() -> tuple[nn.Module, tuple]:
    g = _g()
    return _loss_of(_E3NN()), (torch.randn(6, 4, generator=g), torch.randn(6, 3, generator=g))


# --- gpytorch ------------------------------------------------------------------------------

def _gp() -> tuple[nn.Module, tuple]:
    import gpytorch

    class ExactGP(gpytorch.models.ExactGP):
        def __init__(self, x: torch.Tensor, y: torch.Tensor, lik: Any) -> None:
            super().__init__(x, y, lik)
            self.mean = gpytorch.means.ConstantMean()
            self.cov = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())

        def forward(self, x: torch.Tensor) -> Any:
            return gpytorch.distributions.MultivariateNormal(self.mean(x), self.cov(x))

    class NegMLL(nn.Module):
        def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
            super().__init__()
            self.lik = gpytorch.likelihoods.GaussianLikelihood()
            self.gp = ExactGP(x, y, self.lik)
            self.mll = gpytorch.mlls.ExactMarginalLogLikelihood(self.lik, self.gp)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return -self.mll(self.gp(x), y)

    g = _g()
    x = torch.linspace(0, 1, 10).unsqueeze(-1)
    y = torch.sin(6 * x[:, 0]) + 0.1 * torch.randn(10, generator=g)
    return NegMLL(x, y), (x, y)


# --- zuko ----------------------------------------------------------------------------------

class _Flow(nn.Module):
    def __init__(self, flow: nn.Module) -> None:
        super().__init__()
        self.flow = flow

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return -self.flow(c).log_prob(x).mean()


def _zuko(cls_name: str, **kw: Any) -> Callable[[], tuple[nn.Module, tuple]]:
    def build() -> tuple[nn.Module, tuple]:
        import zuko
        flow = getattr(zuko.flows, cls_name)(features=3, context=2, transforms=2,
                                             hidden_features=[16], **kw)
        g = _g()
        return _Flow(flow), (torch.randn(8, 3, generator=g), torch.randn(8, 2, generator=g))
    return build


# --- transformers: value-dependent Python ---------------------------------------------------

def _hf(cls_name: str, cfg_kind: str, names: tuple[str, ...], key: str | None,
        inputs: Callable[[], tuple], **cfg: Any) -> Callable[[], tuple[nn.Module, tuple]]:
    def build() -> tuple[nn.Module, tuple]:
        import_torchvision()  # transformers imports torchvision where it is installed
        import transformers
        config = transformers.AutoConfig.for_model(cfg_kind, **cfg)
        model = getattr(transformers, cls_name)(config)
        return _loss_of(model, names, key), inputs()
    return build


def _ids(*shape: int, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, vocab, shape, generator=_g(seed))


_AUDIO = dict(num_hidden_layers=2, hidden_size=16, num_attention_heads=2, intermediate_size=32,
              conv_dim=(8, 8), conv_stride=(5, 2), conv_kernel=(10, 3),
              num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=2, hidden_dropout=0.1,
              activation_dropout=0.1, attention_dropout=0.1, feat_proj_dropout=0.1,
              layerdrop=0.5, mask_time_prob=0.0)


def _wave() -> tuple:
    return (torch.randn(2, 400, generator=_g()),)


def _speecht5_loss() -> tuple[nn.Module, tuple]:
    import_torchvision()
    import transformers
    cfg = transformers.SpeechT5Config(
        vocab_size=40, hidden_size=16, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
        decoder_ffn_dim=32, num_mel_bins=8, speech_decoder_prenet_units=16,
        speech_decoder_postnet_units=16, speech_decoder_postnet_layers=2,
        max_text_positions=32, max_speech_positions=64, encoder_layerdrop=0.5,
        decoder_layerdrop=0.5, reduction_factor=1, use_guided_attention_loss=False)
    model = transformers.SpeechT5ForTextToSpeech(cfg)
    ids = _ids(2, 6, vocab=40)
    labels = torch.randn(2, 4, 8, generator=_g(1))
    return _Loss(model, lambda m, i, lab: m(input_ids=i, labels=lab).loss), (ids, labels)


def _informer() -> tuple[nn.Module, tuple]:
    import_torchvision()
    import transformers
    cfg = transformers.InformerConfig(
        prediction_length=3, context_length=6, input_size=1, lags_sequence=[1, 2],
        num_time_features=1, d_model=16, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
        decoder_ffn_dim=32, encoder_layerdrop=0.5, decoder_layerdrop=0.5, dropout=0.1)
    model = transformers.InformerModel(cfg)
    g = _g()
    past = 6 + 2
    inputs = (torch.randn(2, past, generator=g), torch.randn(2, past, 1, generator=g),
              torch.ones(2, past), torch.randn(2, 3, 1, generator=g),
              torch.randn(2, 3, generator=g))
    names = ("past_values", "past_time_features", "past_observed_mask",
             "future_time_features", "future_values")
    return _loss_of(model, names, "last_hidden_state"), inputs


def _detr() -> tuple[nn.Module, tuple]:
    import_torchvision()
    import transformers
    cfg = transformers.DetrConfig(
        use_timm_backbone=False, use_pretrained_backbone=False,
        backbone_config=transformers.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16],
                                                  depths=[1, 1], layer_type="basic",
                                                  out_features=["stage2"]),
        d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, num_queries=4,
        dropout=0.1, num_labels=3)
    model = transformers.DetrModel(cfg)
    return _loss_of(model, ("pixel_values",), "last_hidden_state"), (_img(2, 3, 32, 32),)


def _hf_cases() -> list[LibraryCase]:
    layerdrop = [
        LibraryCase("Wav2Vec2-Conformer (LayerDrop)", "transformers",
                    _hf("Wav2Vec2ConformerModel", "wav2vec2-conformer", ("input_values",),
                        "last_hidden_state", _wave, **_AUDIO, conv_depthwise_kernel_size=3),
                    value_dependent=True, input_grads=False),
        LibraryCase("SEW (LayerDrop)", "transformers",
                    _hf("SEWModel", "sew", ("input_values",), "last_hidden_state", _wave,
                        **_AUDIO, squeeze_factor=2), value_dependent=True, input_grads=False),
        LibraryCase("Data2VecAudio (LayerDrop)", "transformers",
                    _hf("Data2VecAudioModel", "data2vec-audio", ("input_values",),
                        "last_hidden_state", _wave, **_AUDIO),
                    value_dependent=True, input_grads=False),
        # its distilling convolution (with BatchNorm) halves the length after each encoder
        # layer but the last, so a dropped layer gives hidden states of another shape: no
        # torch.cond holds both, so capture takes the program path by path
        LibraryCase("Informer (LayerDrop)", "transformers", _informer, value_dependent=True),
        LibraryCase("SpeechT5 (LayerDrop, loss built in forward)", "transformers",
                    # the loss selects the unpadded frames (masked_select by a mask of the
                    # labels) after the LayerDrop conditionals: with values="guard+unbacked"
                    # their count is read on every call, one build for any padding
                    _speecht5_loss, value_dependent=True,
                    options={"values": "guard+unbacked"}),
    ]
    small = dict(hidden_size=16, num_attention_heads=2, intermediate_size=32, vocab_size=50,
                 hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    return layerdrop + [
        LibraryCase("Longformer", "transformers",
                    _hf("LongformerModel", "longformer", ("input_ids",), "last_hidden_state",
                        lambda: (_ids(2, 8),), num_hidden_layers=2, attention_window=4,
                        max_position_embeddings=32, pad_token_id=1, **small),
                    value_dependent=True),
        LibraryCase("LED", "transformers",
                    _hf("LEDModel", "led", ("input_ids", "decoder_input_ids"),
                        "last_hidden_state", lambda: (_ids(2, 8), _ids(2, 5, seed=1)),
                        encoder_layers=1, decoder_layers=1, d_model=16,
                        encoder_attention_heads=2, decoder_attention_heads=2,
                        encoder_ffn_dim=32, decoder_ffn_dim=32, vocab_size=50,
                        attention_window=4, max_encoder_position_embeddings=32,
                        max_decoder_position_embeddings=32, dropout=0.1,
                        encoder_layerdrop=0.5, decoder_layerdrop=0.5),
                    value_dependent=True),
        LibraryCase("DETR (ResNet backbone)", "transformers", _detr, value_dependent=True),
        LibraryCase("JetMoE", "transformers",
                    _hf("JetMoeForCausalLM", "jetmoe", ("input_ids",), "logits",
                        lambda: (_ids(2, 8),), num_hidden_layers=2, hidden_size=16,
                        num_key_value_heads=2, kv_channels=8, intermediate_size=32,
                        num_local_experts=4, num_experts_per_tok=2, vocab_size=50,
                        max_position_embeddings=32, attention_dropout=0.1),
                    value_dependent=True,
                    # the experts' token counts (.tolist()) depend on attention dropout: sizes
                    # drawn anew on every call, read by the generated code (unbacked sizes)
                    expect="pass"),
        LibraryCase("BigBird-Pegasus (block-sparse, np.random)", "transformers",
                    _hf("BigBirdPegasusModel", "bigbird_pegasus",
                        ("input_ids", "decoder_input_ids"), "last_hidden_state",
                        lambda: (_ids(1, 64), _ids(1, 5, seed=1)),
                        encoder_layers=1, decoder_layers=1, d_model=16,
                        encoder_attention_heads=2, decoder_attention_heads=2,
                        encoder_ffn_dim=32, decoder_ffn_dim=32, vocab_size=50,
                        max_position_embeddings=64, attention_type="block_sparse",
                        block_size=4, num_random_blocks=2, dropout=0.1),
                    # its random blocks come from np.random.permutation of an index array
                    # and NumPy code after an in-program np.random.seed(layer index): NumPy's
                    # state is known at build time, so the blocks are constants of the code
                    value_dependent=True),
    ]


def library_cases() -> list[LibraryCase]:
    """Every case of the suite, in table order."""
    return [
        LibraryCase("ResNet (BasicBlock)", "torchvision", _tv_resnet),
        LibraryCase("EfficientNet (stochastic depth)", "torchvision", _tv_efficientnet),
        LibraryCase("ConvNeXt (stochastic depth)", "torchvision", _tv_convnext),
        LibraryCase("Swin (relative position bias)", "torchvision", _tv_swin),
        LibraryCase("ViT", "torchvision", _tv_vit),
        LibraryCase("ViT (drop path, layer scale)", "timm", _timm_vit),
        LibraryCase("ConvNeXt", "timm", _timm_convnext),
        LibraryCase("Swin", "timm", _timm_swin),
        LibraryCase("MobileNetV3", "timm", _timm_mobilenet),
        LibraryCase("UNet2DModel", "diffusers", _unet2d),
        LibraryCase("UNet2DConditionModel", "diffusers", _unet2d_cond),
        LibraryCase("AutoencoderKL (sampled latent)", "diffusers", _vae),
        LibraryCase("GCN", "torch_geometric", _pyg("GCN")),
        LibraryCase("GAT", "torch_geometric", _pyg("GAT", heads=2)),
        LibraryCase("GraphSAGE", "torch_geometric", _pyg("GraphSAGE")),
        LibraryCase("odeint rk4 (fixed step)", "torchdiffeq", _ode("rk4"), value_dependent=True),
        LibraryCase("odeint dopri5 (adaptive)", "torchdiffeq", _ode("dopri5", rtol=1e-4,
                                                                   atol=1e-5),
                    value_dependent=True),
        LibraryCase("MLP-Mixer (einops layers)", "einops", _einops),
        LibraryCase("Decoder (rotary)", "x_transformers", _xtransformer),
        # `if random() < layer_dropout: continue` with Python's own generator (drawn by the
        # generated code): the loop body it skips appends to outer lists and binds
        # `first_self_attn_inter` on one path only, so capture takes it path by path
        LibraryCase("Encoder (layer dropout)", "x_transformers", _xtransformer_layerdrop,
                    value_dependent=True),
        LibraryCase("tensor product + gate", "e3nn", _e3nn),
        LibraryCase("exact GP marginal likelihood", "gpytorch", _gp, value_dependent=True),
        LibraryCase("MAF (log-likelihood)", "zuko", _zuko("MAF")),
        LibraryCase("NSF (log-likelihood)", "zuko", _zuko("NSF")),
    ] + _hf_cases()


def _seeded_outcome(case: LibraryCase, seen: list[str]) -> dict:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.simplefilter("error", FallbackWarning)
        try:
            return check_case(case, torch.float64, input_grads=case.input_grads, seeds=SEEDS,
                              **(case.options or {}))
        finally:
            seen.extend(str(w.message) for w in caught if issubclass(w.category, UserWarning))


def run_case(case: LibraryCase) -> dict:
    """Check one case (see :func:`fxad.tools.models.check_case`, with every
    :class:`fxad.FallbackWarning` an error).  Returns ``{"result": "pass" | "refused" |
    "FAIL", "error": exception or None, "warnings": [the build's and calls' UserWarning
    messages], "seconds": ..., "cpu_seconds": ...}`` plus
    ``check_case``'s figures on a pass ("refused": fxad's own error while building;
    "FAIL": anything else, a mismatch with autograd included)."""
    t0, c0 = time.perf_counter(), time.process_time()
    seen: list[str] = []
    try:
        out = _seeded_outcome(case, seen)
        out.update(result="pass", error=None)
    except Exception as e:  # noqa: BLE001 - classified below and reported
        out = {"result": "refused" if _is_refusal(e) else "FAIL", "error": e}
    out["seconds"] = time.perf_counter() - t0
    out["cpu_seconds"] = time.process_time() - c0
    out["warnings"] = seen
    return out


def export_captures(case: LibraryCase) -> bool:
    """Whether ``torch.export.export`` (non-strict) captures the case's model on its example
    inputs, in the same mode and dtype: the yardstick for the cases fxad must pass."""
    model, inputs = _prepared(case, torch.float64)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            torch.export.export(model, inputs, strict=False)
    except Exception:  # noqa: BLE001 - any failure to capture is the answer
        return False
    return True


def has_expected_outcome(case: LibraryCase, out: dict) -> bool:
    """Whether :func:`run_case`'s ``out`` is the outcome ``case.expect`` states."""
    if case.expect == "pass":
        return out["result"] == "pass"
    result, cls, pattern = case.expect[:3]
    warned = case.expect[3] if len(case.expect) > 3 else None
    return (re.fullmatch(result, out["result"]) is not None
            and re.fullmatch(cls, type(out["error"]).__name__) is not None
            and re.search(pattern, str(out["error"])) is not None
            and (warned is None or any(re.search(warned, w) for w in out["warnings"])))


def _is_refusal(e: BaseException) -> bool:
    # fxad's own error at build time; an InputError (a guard that misses) comes from calling
    # the built code on the very inputs it was built for: a failure, not a refusal
    return isinstance(e, FxadError) and not isinstance(e, InputError)


def _first_line(e: BaseException | None) -> str:
    if e is None:
        return ""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def _version(library: str) -> str:
    import importlib.metadata
    dist = {"torch_geometric": "torch-geometric", "x_transformers": "x-transformers"}
    try:
        return importlib.metadata.version(dist.get(library, library))
    except importlib.metadata.PackageNotFoundError:
        return "?"


def _refusal_place(e: BaseException | None) -> str:
    """``file.py:LINE`` of the library line a refusal names."""
    m = re.search(r"([\w.]+\.py):(\d+)", str(e)) if e is not None else None
    return f"{m.group(1)}:{m.group(2)}" if m else "?"


def markdown(rows: list[tuple[LibraryCase, dict]]) -> str:
    """The results as a Markdown table, one row per case."""
    export = all("export" in out for _, out in rows)
    lines = ["| library | model | result |" + (" torch.export |" if export else ""),
             "|---|---|---|" + ("---|" if export else "")]
    for case, out in rows:
        if out["result"] == "pass":
            result = "pass"
        elif out["result"] == "refused":
            result = f"refused: {type(out['error']).__name__} at `{_refusal_place(out['error'])}`"
        else:
            result = f"FAIL: {_first_line(out['error'])[:80]}"
        lib = f"{case.library} {_version(case.library)}"
        lines.append(f"| {lib} | {case.name} | {result} |"
                     + (f" {'captures' if out['export'] else 'fails'} |" if export else ""))
    return "\n".join(lines)


def summary_markdown(rows: list[tuple[LibraryCase, dict]]) -> str:
    """The results as a Markdown table, one row per library: the models that pass, those
    refused (with the line the error names) and any other outcome."""
    libs: dict[str, list[tuple[LibraryCase, dict]]] = {}
    for case, out in rows:
        libs.setdefault(case.library, []).append((case, out))
    lines = ["| library | pass | refused, naming the line |", "|---|---|---|"]
    for lib, items in libs.items():
        passed = ", ".join(c.name for c, o in items if o["result"] == "pass") or "–"
        def gap(c: LibraryCase, o: dict) -> bool:  # a known gap, whatever error it gives
            return o["result"] == "FAIL" or (c.expect != "pass" and "FAIL" in c.expect[0])
        refused = ", ".join(f"{c.name} (`{_refusal_place(o['error'])}`)"
                            for c, o in items if o["result"] == "refused" and not gap(c, o))
        refused = refused or "–"
        failed = [c.name for c, o in items if gap(c, o)]
        if failed:
            refused = ("" if refused == "–" else refused + "; ") + "FAIL: " + ", ".join(failed)
        lines.append(f"| {lib} {_version(lib)} | {passed} | {refused} |")
    return "\n".join(lines)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The options of the suite."""
    ap.add_argument("--only", nargs="*", metavar="NAME",
                    help="substrings of case or library names to run")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    ap.add_argument("--markdown", action="store_true", help="end with a Markdown table")
    ap.add_argument("--export", action="store_true",
                    help="also try torch.export.export (non-strict) on each case")


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog="python -m fxad.tools.library_models",
                        description=__doc__.split("\n")[0])
    add_arguments(ap)
    return run(ap.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """Run the suite; exit status 1 unless every case has its expected outcome."""
    torch.set_num_threads(args.threads)
    print(f"fxad library-model suite - torch {torch.__version__}, {args.threads} thread(s)")
    ok = True
    rows = []
    for case in library_cases():
        label = f"{case.library} {case.name}"
        if args.only and not any(s.lower() in label.lower() for s in args.only):
            continue
        out = run_case(case)
        if args.export:
            out["export"] = export_captures(case)
        rows.append((case, out))
        good = has_expected_outcome(case, out)
        ok = ok and good
        extra = (f"max err {out['max_err']:.1e}" if out["result"] == "pass"
                 else _first_line(out["error"])[:160])
        if args.export:
            extra = f"torch.export: {'yes' if out['export'] else 'no'}; {extra}"
        print(f"  {case.library:16s} {case.name:42s} {out['result']:8s} "
              f"{out['seconds']:6.1f} s ({out['cpu_seconds']:5.1f} s CPU)  {extra}", flush=True)
    decided = [(case, out) for case, out in rows if case.value_dependent]
    refused = [out for case, out in decided if out["result"] == "refused"
               and (case.expect == "pass" or case.expect[0] == "refused")]
    print(f"\n{sum(out['result'] == 'pass' for _, out in rows)} of {len(rows)} cases pass; "
          f"of the {len(decided)} that decide on tensor values, "
          f"{sum(out['result'] == 'pass' for _, out in decided)} pass and "
          f"{len(refused)} are refused naming the line")
    if args.export:
        exported = [out for _, out in rows if out["export"]]
        print(f"torch.export captures {len(exported)} of {len(rows)} cases; fxad passes "
              f"{sum(out['result'] == 'pass' for out in exported)} of those")
    if args.markdown:
        print("\n" + markdown(rows) + "\n\n" + summary_markdown(rows))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
