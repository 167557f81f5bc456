"""Training steps of real models: eager autograd, ``fxad.compile``, ``fxad.joint_step`` and
``torch.compile``, in one process.

Models (small configurations, random weights, nothing downloaded; dropout 0 so that the four
methods compute the same step):

* ``gpt2``: transformers' ``GPT2LMHeadModel`` (4 layers, d=256, 4 heads, vocabulary 2048,
  SDPA attention, no KV cache), batch 4 x 128 tokens, its own causal-LM loss;
* ``bert``: transformers' ``BertForMaskedLM`` (4 layers, d=256, 4 heads, FFN 1024,
  vocabulary 2048, SDPA attention), batch 4 x 128 tokens, two rows padded (attention mask),
  its own masked-LM loss on 15% of the tokens;
* ``vit``: transformers' ``ViTForImageClassification`` (4 layers, d=256, 4 heads, FFN 1024,
  64x64 images in 8x8 patches), batch 8, its own cross-entropy;
* ``resnet18``: ResNet-18 as torchvision defines it (7x7 stem, max-pool, 2-2-2-2 basic
  blocks of widths 64-512, global average pool, linear head; torchvision's initialization),
  written out in this file because torchvision is not installed here (its wheel is a CUDA
  build that does not load beside the CPU torch); batch 8, 64x64 images, 10 classes;
* ``lstm``: ``nn.Embedding(1000, 128)`` -> 2-layer ``nn.LSTM`` (hidden 256, batch first)
  -> ``nn.Linear(256, 1000)``, next-token cross-entropy, batch 8 x 64 tokens;
* ``encoder``: ``nn.TransformerEncoder`` (4 layers, d=256, 4 heads, FFN 1024, batch first,
  train mode) with a key padding mask and a causal mask, a linear head (10 classes) and
  cross-entropy per token, batch 4 x 128.

Methods (each on its own copy of the model; one step = ``zero_grad`` / forward / backward /
``SGD.step``, the optimizer the same for all):

* ``eager``: ``loss = model(*x); loss.backward()``;
* ``fxad``: ``fxad.compile(model)`` (fxad's forward and backward graphs, run eagerly through
  an ``autograd.Function``), used as the model;
* ``joint``: ``fxad.joint_step(model, *x)`` under inductor (the whole forward + backward as
  one compiled graph returning the gradients, which are handed to the optimizer);
* ``compile``: ``torch.compile(model)`` (dynamo, AOTAutograd, inductor).

Reported per model, dtype (``fp32``; ``bf16``: the forward under
``torch.autocast("cpu", bfloat16)``) and method: the set-up time (wrapping or compiling the
model plus the first step, which captures or compiles it; the eager row shows its first
step; ``joint`` and ``compile`` compile cold: inductor's in-memory caches cleared and a new
cache directory for each, unless ``--inductor-cache DIR`` names one directory for the whole
run, which measures warm set-ups when an earlier run filled it; inductor's once-per-process
start-up is paid before any set-up is timed and printed on its own line), the median step
time over interleaved rounds (each round runs every method for ``--block`` counted steps
after one uncounted step), the ratio to eager and to ``torch.compile`` (``t_other / t``: above 1 is
faster), the "paired" ratio to eager with its range (the median, minimum and maximum over
the rounds of the ratio of the two block medians in the same round: a drift of the machine's
speed between rounds cancels within each pair) and the peak tensor memory of one step (bytes
allocated by tensors above the level at the step's start, from the profiler's allocation
events; the previous step's gradients released first).  Step times are the CPU time of the
timing thread (``time.thread_time``; ``--wall`` for wall-clock time): with one torch thread
every kernel of these CPU steps runs on it, and on a shared machine the time other processes
hold the cores is not counted.  A float32 check compares fxad's and joint_step's gradients
with eager's on one step from the same weights (largest difference relative to the largest
gradient).

``--profile`` prints, per model, the ATen ops of one step of eager and ``fxad`` where their
counts differ (those fxad calls more often first: the work to look at), the ATen self CPU
time per step of the most expensive ops (the profile that guides the work on fxad's
generated code), and the share of eager's step in the arithmetic kernels fxad calls as eager
does (matrix products, convolutions, recurrent layers, fused attention: ``BOUND_OPS``) with
the speed-up a step would have if everything else took no time.

Usage::

    python benchmarks/bench_real_models.py [--models gpt2,bert,vit,resnet18,lstm,encoder]
        (also gpt2-12, gpt2-24: the same GPT-2 with 12 or 24 layers)
        [--dtypes fp32,bf16] [--methods eager,fxad,joint,compile] [--repeats 15]
        [--block 3] [--threads 1] [--quick] [--profile] [--bf16-batch 1] [--wall]
        [--inductor-cache DIR]

``--quick``: float32 only, without ``torch.compile`` (about a minute of set-up per model on
a 2-core machine), 6 timed steps per method.  bf16 on a CPU without bfloat16 instructions is
~50x slower than float32; ``--bf16-batch`` (default 1) sets the batch size of the bf16 rows.
No GPU path: the models and steps are CPU ones (``torch.set_num_threads(--threads)``).
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import math
import os
import platform
import statistics
import sys
import time
import warnings
from typing import Any, Callable


def _inductor_cache_dir(argv: list[str]) -> str | None:
    """``--inductor-cache DIR``: inductor's cache directory for the whole run, set before
    torch is imported (a second run with the same directory measures warm set-ups)."""
    if "--inductor-cache" not in argv:
        return None
    path = argv[argv.index("--inductor-cache") + 1]
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
    return path


INDUCTOR_CACHE = _inductor_cache_dir(sys.argv) if __name__ == "__main__" else None

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import fxad  # noqa: E402
from fxad.tools.torchvision_import import prepare_torchvision  # noqa: E402
from bench_fxad import peak_bytes as _peak_bytes  # noqa: E402  (this folder)

# transformers imports torchvision where it is installed; its PyPI wheel is a CUDA build
# whose import fails beside the CPU torch unless prepared (fxad.tools.torchvision_import)
prepare_torchvision()

Step = Callable[[], Any]


# --------------------------------------------------------------------------- models


class HFLoss(nn.Module):
    """A transformers model called with keyword inputs; returns its own ``.loss``."""

    def __init__(self, model: nn.Module, names: tuple[str, ...]) -> None:
        super().__init__()
        self.model = model
        self.names = names

    def forward(self, *inputs: Any) -> torch.Tensor:
        return self.model(**dict(zip(self.names, inputs))).loss


def _quiet_transformers() -> None:
    try:
        from transformers.utils import logging
        logging.set_verbosity_error()
    except ImportError:
        pass


def build_gpt2(batch: int, g: torch.Generator, layers: int = 4) -> tuple[nn.Module, tuple]:
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(n_layer=layers, n_embd=256, n_head=4, vocab_size=2048, n_positions=128,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                     bos_token_id=0, eos_token_id=0, attn_implementation="sdpa")
    ids = torch.randint(0, 2048, (batch, 128), generator=g)
    return HFLoss(GPT2LMHeadModel(cfg), ("input_ids", "labels")), (ids, ids)


def build_bert(batch: int, g: torch.Generator) -> tuple[nn.Module, tuple]:
    from transformers import BertConfig, BertForMaskedLM
    cfg = BertConfig(num_hidden_layers=4, hidden_size=256, num_attention_heads=4,
                     intermediate_size=1024, vocab_size=2048, max_position_embeddings=128,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                     attn_implementation="sdpa")
    ids = torch.randint(5, 2048, (batch, 128), generator=g)
    mask = torch.ones(batch, 128, dtype=torch.long)
    mask[: (batch + 1) // 2, 96:] = 0  # half the rows padded after 96 tokens
    labels = torch.full((batch, 128), -100, dtype=torch.long)
    pick = (torch.rand(batch, 128, generator=g) < 0.15) & mask.bool()
    labels[pick] = ids[pick]
    return HFLoss(BertForMaskedLM(cfg), ("input_ids", "attention_mask", "labels")), \
        (ids, mask, labels)


def build_vit(batch: int, g: torch.Generator) -> tuple[nn.Module, tuple]:
    from transformers import ViTConfig, ViTForImageClassification
    cfg = ViTConfig(num_hidden_layers=4, hidden_size=256, num_attention_heads=4,
                    intermediate_size=1024, image_size=64, patch_size=8, num_labels=10,
                    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                    attn_implementation="sdpa")
    x = torch.randn(batch, 3, 64, 64, generator=g)
    y = torch.randint(0, 10, (batch,), generator=g)
    return HFLoss(ViTForImageClassification(cfg), ("pixel_values", "labels")), (x, y)


class BasicBlock(nn.Module):
    """torchvision's ``BasicBlock``: 3x3 conv-BN-ReLU, 3x3 conv-BN, shortcut (1x1 conv-BN
    where the shape changes), ReLU."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                            nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class ResNet18(nn.Module):
    """ResNet-18 as ``torchvision.models.resnet18`` builds it (same layers, shapes and
    initialization), returning the cross-entropy of its logits."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        layers, cin = [], 64
        for i, cout in enumerate([64, 128, 256, 512]):
            stride = 1 if i == 0 else 2
            layers.append(nn.Sequential(BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)))
            cin = cout
        self.layer1, self.layer2, self.layer3, self.layer4 = layers
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(512, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        x = torch.flatten(self.avgpool(x), 1)
        return F.cross_entropy(self.fc(x), y)


def build_resnet18(batch: int, g: torch.Generator) -> tuple[nn.Module, tuple]:
    x = torch.randn(batch, 3, 64, 64, generator=g)
    y = torch.randint(0, 10, (batch,), generator=g)
    return ResNet18(10), (x, y)


class LSTMLM(nn.Module):
    """Embedding -> 2-layer LSTM -> linear head; next-token cross-entropy."""

    def __init__(self, vocab: int = 1000, emb: int = 128, hidden: int = 256) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, emb)
        self.lstm = nn.LSTM(emb, hidden, num_layers=2, batch_first=True)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, ids: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        h, _ = self.lstm(self.emb(ids))
        return F.cross_entropy(self.head(h).flatten(0, 1), target.flatten())


def build_lstm(batch: int, g: torch.Generator) -> tuple[nn.Module, tuple]:
    ids = torch.randint(0, 1000, (batch, 65), generator=g)
    return LSTMLM(), (ids[:, :-1].contiguous(), ids[:, 1:].contiguous())


class EncoderTagger(nn.Module):
    """``nn.TransformerEncoder`` (train mode: PyTorch's math path through
    ``F.multi_head_attention_forward``) with padding and causal masks, per-token classes."""

    def __init__(self, d: int = 256, heads: int = 4, layers: int = 4, ff: int = 1024,
                 classes: int = 10) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(d, heads, ff, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, classes)

    def forward(self, x: torch.Tensor, pad: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        # boolean like the padding mask (True: not attended): with a float causal mask
        # nn.TransformerEncoder warns, and the warning is a graph break under torch.compile
        causal = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device).triu(1)
        h = self.encoder(x, mask=causal, src_key_padding_mask=pad, is_causal=True)
        return F.cross_entropy(self.head(h).flatten(0, 1), y.flatten())


def build_encoder(batch: int, g: torch.Generator) -> tuple[nn.Module, tuple]:
    x = torch.randn(batch, 128, 256, generator=g)
    pad = torch.zeros(batch, 128, dtype=torch.bool)
    pad[: (batch + 1) // 2, 100:] = True
    y = torch.randint(0, 10, (batch, 128), generator=g)
    return EncoderTagger(), (x, pad, y)


MODELS: dict[str, tuple[str, Callable[[int, torch.Generator], tuple[nn.Module, tuple]], int]] = {
    # key: (row name with the batch size as {B}, builder, float32 batch size)
    "gpt2": ("GPT-2 (transformers) L4 d256 B{B} T128", build_gpt2, 4),
    "bert": ("BERT MLM (transformers) L4 d256 B{B} T128", build_bert, 4),
    "vit": ("ViT (transformers) L4 d256 B{B} 64x64/8", build_vit, 8),
    "resnet18": ("ResNet-18 B{B} 64x64", build_resnet18, 8),
    "lstm": ("nn.LSTM 2x256 B{B} T64", build_lstm, 8),
    "encoder": ("nn.TransformerEncoder L4 d256 B{B} T128", build_encoder, 4),
    # not in the default list: the deeper GPT-2s of the regional-compilation figures
    "gpt2-12": ("GPT-2 (transformers) L12 d256 B{B} T128",
                lambda b, g: build_gpt2(b, g, layers=12), 4),
    "gpt2-24": ("GPT-2 (transformers) L24 d256 B{B} T128",
                lambda b, g: build_gpt2(b, g, layers=24), 4),
}
DEFAULT_MODELS = ("gpt2", "bert", "vit", "resnet18", "lstm", "encoder")
METHODS = ("eager", "fxad", "joint", "compile")


# --------------------------------------------------------------------------- steps


def _autocast(bf16: bool, device: str = "cpu") -> Any:
    return torch.autocast(device, dtype=torch.bfloat16, enabled=bf16)


def _release(model: nn.Module) -> None:
    for p in model.parameters():
        p.grad = None


def make_step(method: str, model: nn.Module, inputs: tuple, bf16: bool, device: str = "cpu",
              lr: float = 1e-3) -> Step:
    """One training step of ``method`` on ``model`` (already copied for it): zero_grad,
    forward (under bfloat16 autocast of ``device``'s type when ``bf16``), backward, SGD
    update.  ``step.model`` holds the parameters it trains.  ``joint``: a gradient of
    another dtype than its parameter's raises TypeError (``p.grad = g`` would);
    ``joint:POLICY`` (``joint:save``) builds it with that residual policy, ``joint:whole``
    compiles the whole graph (``regions=False``), ``joint:regions`` compiles each repeated
    block's region once (``regions=True``); options combine with ``+``
    (``joint:save+whole``)."""
    method, _, option = method.partition(":")
    opts = set(option.split("+")) - {""}
    regions = False if "whole" in opts else True if "regions" in opts else None
    policy = next(iter(opts - {"whole", "regions"}), "")
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=lr)
    if method in ("eager", "fxad", "compile"):
        run = model if method == "eager" else \
            fxad.compile(model) if method == "fxad" else torch.compile(model)

        def step() -> Any:
            opt.zero_grad(set_to_none=True)
            with _autocast(bf16, device):
                loss = run(*inputs)
            loss.backward()
            opt.step()
            return loss
    elif method == "joint":
        with _autocast(bf16, device):
            js = fxad.joint_step(model, *inputs, policy=policy or "min_memory", regions=regions)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]

        def step() -> Any:
            loss, _, grads = js(*inputs)
            bad = [f"{n}: {grads[n].dtype}" for n, p in named if grads[n].dtype != p.dtype]
            if bad:
                raise TypeError(f"joint_step gradients of another dtype: {', '.join(bad)}")
            for n, p in named:
                p.grad = grads[n]
            opt.step()
            return loss
    else:
        raise ValueError(method)
    step.setup = lambda: _release(model)  # type: ignore[attr-defined]
    step.model = model  # type: ignore[attr-defined]
    return step


def time_interleaved(steps: dict[str, Step], repeats: int, block: int,
                     rounds: dict[str, list[float]],
                     clock: Callable[[], float] = time.thread_time) -> dict[str, float]:
    """Median seconds per step by ``clock``; the steps run round-robin in blocks of
    ``block`` counted steps after one uncounted step (which pays for the other methods having
    just reshaped the allocator's free lists and the caches).  ``rounds`` receives each
    round's block median per step (pairs for :func:`paired`).

    The default clock is the CPU time of this thread (``time.thread_time``): with one torch
    thread every kernel of a CPU step runs on it (autograd's engine runs a CPU backward on
    the calling thread), and the time other processes of a shared machine hold the cores is
    not counted, as wall-clock time (``time.perf_counter``) counts it."""
    times: dict[str, list[float]] = {k: [] for k in steps}
    while any(len(v) < repeats for v in times.values()):
        for k, s in steps.items():
            s()
            this = []
            for _ in range(min(block, repeats - len(times[k]))):
                t0 = clock()
                s()
                this.append(clock() - t0)
            times[k].extend(this)
            if this:
                rounds.setdefault(k, []).append(statistics.median(this))
    return {k: statistics.median(v) for k, v in times.items()}


def paired(rounds: dict[str, list[float]], num: str, den: str) -> tuple[float, float, float] | None:
    """Median, min and max over the rounds of ``rounds[num] / rounds[den]``."""
    if num not in rounds or den not in rounds:
        return None
    r = [a / b for a, b in zip(rounds[num], rounds[den])]
    return statistics.median(r), min(r), max(r)


def peak_bytes(step: Step) -> float | None:
    """Peak tensor bytes allocated during one step above the level at its start (the CPU
    profiler's allocation events, as bench_fxad measures them), after ``step.setup()``
    released the previous gradients."""
    return _peak_bytes(step, torch.device("cpu"), step.setup)  # type: ignore[attr-defined]


# the ATen kernels whose time is arithmetic (vendor BLAS, oneDNN, the fused attention):
# fxad calls them as eager does, so their share of eager's step bounds any gain from the
# code around them (the --profile line "a step that ran only those")
BOUND_OPS = frozenset({
    "mm", "addmm", "bmm", "baddbmm", "addbmm", "mkldnn_convolution", "convolution_backward",
    "mkldnn_rnn_layer", "mkldnn_rnn_layer_backward",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention_for_cpu_backward"})


def op_profile(step: Step, steps: int = 3) -> tuple[collections.Counter, collections.Counter]:
    """ATen ops (top-level and nested) called per step, and their self CPU time per step
    (microseconds), over ``steps`` steps under the profiler."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    n: collections.Counter = collections.Counter()
    us: collections.Counter = collections.Counter()
    for e in prof.events():
        if e.name.startswith("aten::"):
            n[e.name[6:]] += 1
            us[e.name[6:]] += e.self_cpu_time_total
    return (collections.Counter({k: v // steps for k, v in n.items()}),
            collections.Counter({k: v / steps for k, v in us.items()}))


def grad_err(ref: nn.Module, other: nn.Module) -> float:
    """max |g - g_ref| over the parameters, divided by max |g_ref|."""
    pairs = [(p.grad, q.grad) for p, q in zip(ref.parameters(), other.parameters())
             if p.grad is not None]
    diff = max(float((a.float() - b.float()).abs().max()) for a, b in pairs)
    scale = max(float(a.abs().max()) for a, _ in pairs)
    return diff / (scale or 1.0)


# --------------------------------------------------------------------------- one row


def _compiles(method: str) -> bool:
    """Whether ``method`` (``joint``, ``joint:regions``, ``compile``, ...) compiles with
    inductor."""
    return method.partition(":")[0] in ("joint", "compile")


def _cold(method: str) -> Any:
    """Around the set-up of an inductor method without ``--inductor-cache``: inductor's
    in-memory caches cleared and a new empty cache directory, so that its set-up is a cold
    compile that reuses no kernel another row or method compiled (the kernels of the GPT-2,
    BERT and ViT layers are largely the same)."""
    if INDUCTOR_CACHE is not None or not _compiles(method):
        return contextlib.nullcontext()
    try:
        from torch._inductor.utils import fresh_cache
    except ImportError:  # other torch versions
        return contextlib.nullcontext()
    return fresh_cache(delete=False)


def start_inductor(methods: list[str], device: str = "cpu") -> None:
    """When one of ``methods`` compiles, pay inductor's once-per-process start-up before
    any set-up is timed and print how long it took: a tiny function compiled in a throwaway
    cache (importing inductor, probing the CPU's vector instructions by compiling a test
    program, starting the compile workers).  Whichever method compiles first in a process
    pays it (about 10 s on the 2-core machine, where a second compilation of the same tiny
    function takes about 2 s), so without this the first compiled method's set-up would
    carry it and the later ones would not.  On ``device="cuda"`` the function is compiled
    for the GPU (Triton's start-up).  Nothing happens when inductor cannot be imported."""
    if not any(_compiles(m) for m in methods):
        return
    try:
        from torch._inductor.utils import fresh_cache
    except ImportError:
        return
    threads = torch.get_num_threads()
    t0 = time.perf_counter()
    with fresh_cache():
        fn = torch.compile(lambda x: torch.sin(x * 2.0).sum(0), backend="inductor")
        fn(torch.randn(8, 8, device=device))
        if device == "cuda":
            torch.cuda.synchronize()
    torch._dynamo.reset()
    torch.set_num_threads(threads)
    print(f"inductor start-up in this process (paid before any set-up is timed, counted in "
          f"no set-up): {time.perf_counter() - t0:.1f} s", flush=True)


def bench(key: str, bf16: bool, args: argparse.Namespace) -> dict[str, Any]:
    name, build, batch = MODELS[key]
    if bf16:
        batch = args.bf16_batch
    name = name.format(B=batch)
    torch.manual_seed(0)
    model, inputs = build(batch, torch.Generator().manual_seed(0))
    model.train()
    state = copy.deepcopy(model.state_dict())
    row: dict[str, Any] = {"key": key, "model": name, "dtype": "bf16" if bf16 else "fp32",
                           "setup": {}, "notes": []}
    steps: dict[str, Step] = {}
    for method in args.methods:
        m = copy.deepcopy(model)
        m.load_state_dict(state)
        t0 = time.perf_counter()
        try:
            with _cold(method):
                s = make_step(method, m, inputs, bf16)
                s()
        except Exception as e:  # noqa: BLE001 - reported in the table
            row["notes"].append(f"{method} failed: {type(e).__name__}: "
                                f"{str(e).splitlines()[0][:120] if str(e) else ''}")
            continue
        row["setup"][method] = time.perf_counter() - t0
        steps[method] = s
    # gradients of the first step against eager's (same weights: re-run one step each)
    if "eager" in steps and not bf16:
        ref = steps["eager"]
        for method in ("fxad", "joint"):
            if method in steps:
                for s in (ref, steps[method]):
                    s.model.load_state_dict(state)  # type: ignore[attr-defined]
                    s.setup()  # type: ignore[attr-defined]
                    s()
                other = steps[method].model  # type: ignore[attr-defined]
                row[f"err_{method}"] = grad_err(ref.model, other)  # type: ignore[attr-defined]
    if args.profile and "eager" in steps and "fxad" in steps:
        row["ops"] = {k: op_profile(steps[k]) for k in ("eager", "fxad")}
    rounds: dict[str, list[float]] = {}
    clock = time.perf_counter if args.wall else time.thread_time
    row["t"] = time_interleaved(steps, args.repeats, args.block, rounds, clock)
    row["paired"] = {k: paired(rounds, "eager", k) for k in steps}
    row["paired_c"] = {k: paired(rounds, "compile", k) for k in steps}
    row["mem"] = {k: peak_bytes(s) for k, s in steps.items()}
    return row


# --------------------------------------------------------------------------- output


def _f(x: float | None, fmt: str) -> str:
    return "n/a" if x is None else format(x, fmt)


def print_row(row: dict[str, Any], args_top: int = 25) -> None:
    t = row["t"]
    te, tc = t.get("eager"), t.get("compile")
    errs = ", ".join(f"{k} {row[f'err_{k}']:.1e}" for k in ("fxad", "joint") if f"err_{k}" in row)
    print(f"\n{row['model']} [{row['dtype']}]" + (f"  grad err vs eager: {errs}" if errs else ""))
    print(f"  {'method':8} {'setup s':>8} {'ms/step':>9} {'vs eager':>8} {'paired (min-max)':>22} "
          f"{'vs compile':>10} {'peak MiB':>8}")
    for k, tk in t.items():
        p = row["paired"].get(k)
        ps = "n/a" if p is None else f"{p[0]:.2f}x ({p[1]:.2f}-{p[2]:.2f})"
        print(f"  {k:8} {_f(row['setup'].get(k), '8.2f')} {tk * 1e3:9.2f} "
              f"{_f(None if te is None else te / tk, '7.2f')}x {ps:>22} "
              f"{_f(None if tc is None else tc / tk, '9.2f')}x "
              f"{_f(None if row['mem'].get(k) is None else row['mem'][k] / 2**20, '8.2f')}")
    for note in row["notes"]:
        print("  note:", note)
    if "ops" in row:
        (a, ta), (b, tb) = row["ops"]["eager"], row["ops"]["fxad"]
        diff = sorted((k for k in set(a) | set(b) if a[k] != b[k]), key=lambda k: a[k] - b[k])
        print(f"  ATen ops per step, eager -> fxad (where they differ; total {sum(a.values())} "
              f"-> {sum(b.values())}):")
        for label, keep in (("fxad more", lambda k: b[k] > a[k]),
                            ("fxad fewer", lambda k: b[k] < a[k])):
            print(f"   {label}: " + (", ".join(f"{k} {a[k]}->{b[k]}" for k in diff if keep(k))
                                     or "none"))
        top = sorted(set(ta) | set(tb), key=lambda k: -max(ta[k], tb[k]))[:args_top]
        print(f"  self CPU ms per step, eager -> fxad (total {sum(ta.values()) / 1e3:.1f} -> "
              f"{sum(tb.values()) / 1e3:.1f}):")
        print("   " + ", ".join(f"{k} {ta[k] / 1e3:.1f}->{tb[k] / 1e3:.1f}" for k in top))
        bound, total = sum(v for k, v in ta.items() if k in BOUND_OPS), sum(ta.values())
        if bound:
            print(f"  eager's matrix-product, convolution, recurrent and attention kernels: "
                  f"{bound / 1e3:.1f} of {total / 1e3:.1f} ms ({100 * bound / total:.0f}%); "
                  f"a step that ran only those, as fast as eager runs them, would be "
                  f"{total / bound:.2f}x eager")
    sys.stdout.flush()


def print_summary(rows: list[dict[str, Any]]) -> None:
    print("\n| model | dtype | method | set-up s | ms/step | vs eager (paired, min-max) | "
          "vs torch.compile | peak MiB |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        te, tc = row["t"].get("eager"), row["t"].get("compile")
        for k, tk in row["t"].items():
            p = row["paired"].get(k)
            ps = "" if p is None or k == "eager" else f" ({p[0]:.2f}, {p[1]:.2f}-{p[2]:.2f})"
            mem = row["mem"].get(k)
            print(f"| {row['model']} | {row['dtype']} | {k} | "
                  f"{_f(row['setup'].get(k), '.2f')} | {tk * 1e3:.1f} | "
                  f"{_f(None if te is None else te / tk, '.2f')}x{ps} | "
                  f"{_f(None if tc is None else tc / tk, '.2f')}x | "
                  f"{_f(None if mem is None else mem / 2**20, '.1f')} |")
    def geomean(xs: list[float]) -> float:
        return math.exp(statistics.mean(map(math.log, xs)))

    methods = dict.fromkeys(k for row in rows for k in row["t"])
    for k in [k for k in methods if k not in ("eager", "compile")]:
        r = [row["t"]["eager"] / row["t"][k] for row in rows
             if k in row["t"] and "eager" in row["t"]]
        both = [row for row in rows if k in row["t"] and "compile" in row["t"]]
        if r:
            print(f"geomean {k} vs eager: {geomean(r):.3f}x ({len(r)} rows)" + (
                f"; vs torch.compile: "
                f"{geomean([row['t']['compile'] / row['t'][k] for row in both]):.3f}x, "
                f"set-up {geomean([row['setup'][k] / row['setup']['compile'] for row in both]):.2f}"
                f" of torch.compile's" if both else ""))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=",".join(DEFAULT_MODELS))
    ap.add_argument("--dtypes", default=None, help="fp32,bf16 (default; --quick: fp32)")
    ap.add_argument("--methods", default=None,
                    help="eager,fxad,joint,compile (default; --quick: no compile)")
    ap.add_argument("--repeats", type=int, default=None, help="timed steps per method "
                    "(default 15; --quick 6)")
    ap.add_argument("--block", type=int, default=3, help="counted steps per method per round")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--bf16-batch", type=int, default=1)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--wall", action="store_true", help="time steps by wall clock instead of "
                    "the thread's CPU time")
    ap.add_argument("--inductor-cache", default=None, help="inductor's cache directory for "
                    "the whole run (default: a new empty one per compiled set-up, cleared "
                    "in-memory caches: cold compiles; the directory of an earlier run: warm)")
    args = ap.parse_args(argv)
    args.dtypes = (args.dtypes or ("fp32" if args.quick else "fp32,bf16")).split(",")
    args.methods = (args.methods or ("eager,fxad,joint" if args.quick else
                                     ",".join(METHODS))).split(",")
    args.repeats = args.repeats or (6 if args.quick else 15)
    if "eager" not in args.methods:
        args.methods.insert(0, "eager")
    torch.set_num_threads(args.threads)
    _quiet_transformers()
    warnings.filterwarnings("ignore")
    print(f"torch {torch.__version__}, python {platform.python_version()}, "
          f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} thread(s); "
          f"repeats {args.repeats}, block {args.block}; methods {','.join(args.methods)}; "
          f"{'wall-clock' if args.wall else 'thread CPU'} time; "
          f"inductor cache {INDUCTOR_CACHE or 'cold (new per set-up)'}")
    start_inductor(args.methods)
    rows = []
    for key in args.models.split(","):
        for dt in args.dtypes:
            rows.append(bench(key, dt == "bf16", args))
            print_row(rows[-1])
    print_summary(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
