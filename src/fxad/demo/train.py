"""The ``fxad demo`` run: train :class:`~fxad.demo.models.TinyGPT` twice from the same
initialisation on the same batches, once with gradients from fxad's generated code and once
with ``torch.autograd``, and compare; then differentiate :class:`~fxad.demo.models.SmallCNN`
in training mode (batch-norm batch statistics) and check it.

Everything runs on CPU in float32 unless the configuration says otherwise.  The public entry
point is :func:`run_demo`; the pieces (:func:`train_fxad`, :func:`train_autograd`,
:func:`block_backward_code`, :func:`time_steps`, :func:`cnn_demo`) are usable on their own.
"""
from __future__ import annotations

import ast
import builtins
import contextlib
import copy
import math
import re
import statistics
import sys
import textwrap
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator, Sequence, TextIO

import torch
import torch.fx as fx

import fxad

from .data import CharCorpus
from .models import SmallCNN, TinyGPT

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class DemoConfig:
    """Sizes and hyper-parameters of the demo.

    The defaults train a 2-layer, 64-wide TinyGPT on 16 x 64-character batches; 300 steps of
    both runs take well under a minute on one CPU core.  The demo uses one thread by default:
    the models are small, and multi-threaded kernels stall badly whenever another process
    competes for the cores.
    """

    steps: int = 300
    batch_size: int = 16
    block_size: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    lr: float = 3e-3
    weight_decay: float = 0.01
    seed: int = 0
    dtype: torch.dtype = torch.float64  # training comparison; timing is always float32
    corpus_bytes: int = 300_000
    log_every: int = 0          # 0: about ten rows in the loss table
    timing_reps: int = 20       # interleaved forward+backward timings (median reported)
    sample_chars: int = 200     # characters sampled from the trained model (0: none)
    cnn: bool = True            # run the SmallCNN part
    show_code: bool = True      # print the backward code of transformer block 0
    threads: int = 1            # torch CPU threads during the demo (0: torch's default)

    @property
    def every(self) -> int:
        return self.log_every or max(1, self.steps // 10)


#: A tiny configuration for smoke tests (``fxad demo --quick``): a few seconds.
QUICK = DemoConfig(steps=20, batch_size=4, block_size=16, n_layer=1, n_head=2, n_embd=16,
                   corpus_bytes=40_000, timing_reps=5, sample_chars=40)


@dataclass
class DemoResult:
    """Numbers measured by :func:`run_demo` (also printed).

    Attributes:
        losses_fxad, losses_autograd: per-step training losses of the two runs.
        max_abs_loss_diff: ``max_t |L_fxad(t) - L_autograd(t)|``.
        max_rel_loss_diff: the same divided by ``|L_autograd(t)|``.
        first_step_grad_rel_err: ``max_p max|g_fxad - g_autograd| / max_p max|g_autograd|`` at
            step 0.
        max_final_param_diff: largest absolute parameter difference after training.
        time_fxad, time_autograd: median seconds of one forward+backward.
        transform_time: seconds to build the fxad gradient graph.
        cnn: numbers of the SmallCNN part (see :func:`cnn_demo`), empty when skipped.
    """

    losses_fxad: list[float]
    losses_autograd: list[float]
    max_abs_loss_diff: float
    max_rel_loss_diff: float
    first_step_grad_rel_err: float
    max_final_param_diff: float
    time_fxad: float
    time_autograd: float
    transform_time: float
    cnn: dict[str, Any] = field(default_factory=dict)

    @property
    def speed_ratio(self) -> float:
        """autograd time / fxad time (> 1: fxad's generated code is faster)."""
        return self.time_autograd / self.time_fxad


def build_grad(model: torch.nn.Module, *example_inputs: Any) -> tuple[fx.GraphModule, float]:
    """``fxad.grad(model, *example_inputs, argnums=())`` (parameter gradients only, as a
    training step needs) with demo provenance; returns (graph, seconds)."""
    t0 = time.perf_counter()
    g = fxad.grad(model, *example_inputs, argnums=())
    return g, time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------
# training
# ---------------------------------------------------------------------------------------------

def make_optimizer(model: torch.nn.Module, cfg: DemoConfig) -> torch.optim.Optimizer:
    """AdamW over all parameters, ``foreach`` off so both runs use the same kernels."""
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay,
                             foreach=False)


def train_fxad(model: torch.nn.Module, batches: Sequence[Batch], cfg: DemoConfig,
               g: fx.GraphModule | None = None,
               on_step: Callable[[int, float], None] | None = None,
               ) -> tuple[list[float], list[float], fx.GraphModule]:
    """Train ``model`` with gradients from ``fxad.grad``: the graph is built once (or ``g`` is
    reused) and called every step; its ``param_grads`` are written to ``p.grad`` and an AdamW
    step is taken.

    Returns:
        (per-step losses, per-step forward+backward seconds, the gradient graph).
    """
    if g is None:
        g, _ = build_grad(model, *batches[0])
    opt = make_optimizer(model, cfg)
    params = dict(model.named_parameters())
    losses, times = [], []
    for step, (idx, tgt) in enumerate(batches):
        t0 = time.perf_counter()
        loss, _, grads = g(idx, tgt)
        times.append(time.perf_counter() - t0)
        for name, p in params.items():
            p.grad = grads[name]
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
        if on_step is not None:
            on_step(step, losses[-1])
    return losses, times, g


def train_autograd(model: torch.nn.Module, batches: Sequence[Batch], cfg: DemoConfig,
                   on_step: Callable[[int, float], None] | None = None,
                   ) -> tuple[list[float], list[float]]:
    """Train ``model`` with ``loss.backward()`` and AdamW.

    Returns:
        (per-step losses, per-step forward+backward seconds).
    """
    opt = make_optimizer(model, cfg)
    losses, times = [], []
    for step, (idx, tgt) in enumerate(batches):
        t0 = time.perf_counter()
        loss = model(idx, tgt)
        loss.backward()
        times.append(time.perf_counter() - t0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        if on_step is not None:
            on_step(step, losses[-1])
    return losses, times


def grad_rel_err(model: torch.nn.Module, g: fx.GraphModule, batch: Batch) -> float:
    """``max_p max|g_fxad - g_autograd| / max_p max|g_autograd|`` over the parameters ``p``
    (one scale for all parameters, so that parameters with a zero true gradient do not turn
    rounding noise into a large ratio)."""
    ref = copy.deepcopy(model)
    ref.zero_grad(set_to_none=True)
    ref(*batch).backward()
    _, _, grads = g(*batch)
    params = [(n, p) for n, p in ref.named_parameters() if p.grad is not None]
    diff = max(float((grads[n] - p.grad).abs().max()) for n, p in params)
    scale = max(float(p.grad.abs().max()) for _, p in params)
    return diff / (scale or 1.0)


def time_steps(model: torch.nn.Module, g: fx.GraphModule, batch: Batch, reps: int,
               warmup: int = 2) -> tuple[float, float]:
    """Median seconds of one forward+backward: (fxad generated code, autograd).

    The two are interleaved (fxad, autograd, fxad, ...) so that both see the same machine
    state; autograd's step is ``model(*batch).backward()`` with ``.grad`` reset to ``None``.
    """
    def fx_step() -> None:
        g(*batch)

    def ag_step() -> None:
        model.zero_grad(set_to_none=True)
        model(*batch).backward()

    for _ in range(warmup):
        fx_step()
        ag_step()
    t_fx, t_ag = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        fx_step()
        t1 = time.perf_counter()
        ag_step()
        t2 = time.perf_counter()
        t_fx.append(t1 - t0)
        t_ag.append(t2 - t1)
    model.zero_grad(set_to_none=True)
    return statistics.median(t_fx), statistics.median(t_ag)


# ---------------------------------------------------------------------------------------------
# reading the generated code
# ---------------------------------------------------------------------------------------------

def _module_nodes(g: fx.GraphModule, prefix: str) -> set[str]:
    """Names of forward nodes recorded inside submodule ``prefix`` (via ``nn_module_stack``)."""
    names: set[str] = set()
    graphs = [g.graph]
    fwd = g.meta.get("fxad_forward")
    if isinstance(fwd, fx.GraphModule):
        graphs.append(fwd.graph)
    for graph in graphs:
        for node in graph.nodes:
            stack = node.meta.get("nn_module_stack") or {}
            if any(k == prefix or k.startswith(prefix + ".") for k in stack):
                names.add(node.name)
    return names


def block_backward_code(g: fx.GraphModule, prefix: str = "blocks.0", *,
                        shapes: bool = True) -> str:
    """The backward statements of submodule ``prefix`` in the generated code of ``g``, as a
    whole: every name the excerpt reads is defined in it or listed in its first lines as an
    input (the values saved from the forward, and the cotangent flowing in from the layers
    after the block).

    The generated code groups backward statements under ``# backward of: <forward statement>``
    headers; a group is kept when one of the values its forward statement assigns
    (``layer_norm, mean, rstd = ...``) was recorded inside ``prefix``
    (``node.meta['nn_module_stack']``), or, failing that, when the statement mentions one of
    the submodule's parameters (``blocks_0_...``).

    Args:
        g: graph from :func:`fxad.grad` / :func:`fxad.vjp` of a module.
        prefix: submodule path as in ``named_modules()``.
        shapes: use :func:`fxad.code_with_shapes` (shape comments, no ``x = None`` memory
            releases) instead of the raw ``g.code``.

    Returns:
        The selected lines, dedented, after the ``# inputs`` comment; '' if nothing matches.
    """
    inside = _module_nodes(g, prefix)
    param_tag = prefix.replace(".", "_") + "_"
    keep: list[str] = []
    current: list[str] | None = None
    text = fxad.code_with_shapes(g) if shapes else g.code
    for line in text.splitlines():
        s = line.strip()
        if s.startswith("# backward of:"):
            stmt = s[len("# backward of:"):].strip()
            targets = re.findall(r"\w+", stmt.split(" = ", 1)[0]) if " = " in stmt else []
            if any(t in inside for t in targets) or (not inside and param_tag in stmt):
                current = [line]
                keep.append("")
                keep.extend(current)
            else:
                current = None
        elif s.startswith("return ") or not s:
            current = None
        elif current is not None:
            keep.append(line)
    body = "\n".join(_dedent(keep)).strip("\n")
    if not body:
        return ""
    return "\n".join(_inputs_comment(body) + ["", body])


def excerpt_inputs(code: str) -> list[str]:
    """The names a piece of generated code reads before (or without) assigning them, in the
    order it first reads them (``torch`` and Python's builtins aside)."""
    assigned: set[str] = set()
    read: dict[str, None] = {}
    for stmt in ast.parse(code).body:
        if isinstance(stmt, ast.Assign):
            value_names = [n.id for n in ast.walk(stmt.value) if isinstance(n, ast.Name)]
            for name in value_names:
                if name not in assigned and name != "torch" and not hasattr(builtins, name):
                    read.setdefault(name)
            for t in stmt.targets:
                assigned.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
        else:
            for n in ast.walk(stmt):
                if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) \
                        and n.id not in assigned and n.id != "torch" \
                        and not hasattr(builtins, n.id):
                    read.setdefault(n.id)
    return list(read)


def _inputs_comment(body: str) -> list[str]:
    names = excerpt_inputs(body)
    cots = [n for n in names if n.startswith("d_")]
    saved = [n for n in names if not n.startswith("d_")]
    lines = []
    if cots:
        lines.append(f"# cotangent flowing in: {', '.join(cots)}")
    if saved:
        lines += textwrap.wrap(", ".join(saved), 96, initial_indent="# read from the forward: ",
                               subsequent_indent="#   ")
    return lines


def _dedent(lines: list[str]) -> list[str]:
    indents = [len(ln) - len(ln.lstrip()) for ln in lines if ln.strip()]
    cut = min(indents, default=0)
    return [ln[cut:] for ln in lines]


# ---------------------------------------------------------------------------------------------
# SmallCNN: batch norm in training mode
# ---------------------------------------------------------------------------------------------

def cnn_demo(seed: int = 0, batch_size: int = 16, size: int = 16, check: bool = True,
             check_batch: int = 8, check_size: int = 8) -> dict[str, Any]:
    """Differentiate :class:`SmallCNN` in training mode with fxad and compare with eager.

    One fxad gradient call and one eager ``loss.backward()`` run on identical copies, on a
    float32 batch ``[batch_size, 3, size, size]``; both update the batch-norm running
    statistics.  Then ``fxad.check`` (float64) runs in train and in eval mode on a smaller
    batch ``[check_batch, 3, check_size, check_size]``: the finite-difference part of the
    check assumes the loss is smooth within the step ``fd_eps``, and the more ReLU / max-pool
    kinks a batch has, the likelier one lies that close.

    Returns:
        dict with ``loss_fxad``, ``loss_autograd``, ``grad_max_abs_diff`` (over parameters),
        ``buffer_max_abs_diff`` (running mean/var and ``num_batches_tracked`` after the step),
        ``check_train`` and ``check_eval`` (:class:`fxad.CheckReport`, or ``None`` if
        ``check`` is False).
    """
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = SmallCNN().train()
    ref = copy.deepcopy(model)
    x = torch.randn(batch_size, 3, size, size, generator=gen)
    y = torch.randint(0, 10, (batch_size,), generator=gen)
    g, _ = build_grad(model, x, y)
    loss_fx, _, grads = g(x, y)
    loss_ag = ref(x, y)
    loss_ag.backward()
    grad_diff = max(float((grads[n] - p.grad).abs().max()) for n, p in ref.named_parameters())
    ref_bufs = dict(ref.named_buffers())
    buf_diff = max(float((b.double() - ref_bufs[n].double()).abs().max())
                   for n, b in model.named_buffers())
    out: dict[str, Any] = {"loss_fxad": float(loss_fx), "loss_autograd": float(loss_ag.detach()),
                           "grad_max_abs_diff": grad_diff, "buffer_max_abs_diff": buf_diff,
                           "check_train": None, "check_eval": None}
    if check:
        xc = torch.randn(check_batch, 3, check_size, check_size, generator=gen)
        yc = torch.randint(0, 10, (check_batch,), generator=gen)
        out["check_train"] = fxad.check(copy.deepcopy(ref).train(), xc, yc)
        out["check_eval"] = fxad.check(copy.deepcopy(ref).eval(), xc, yc)
    return out


# ---------------------------------------------------------------------------------------------
# the demo
# ---------------------------------------------------------------------------------------------

class _Progress:
    """A ``rich.progress`` bar on a terminal, occasional plain lines otherwise."""

    def __init__(self, stream: TextIO, enabled: bool) -> None:
        self.stream = stream
        self.enabled = enabled
        self.rich: Any = None
        if enabled and stream.isatty():
            try:
                from rich.console import Console
                from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                                           TimeElapsedColumn)
                self.rich = Progress(TextColumn("{task.description}"), BarColumn(),
                                     MofNCompleteColumn(), TextColumn("loss {task.fields[loss]}"),
                                     TimeElapsedColumn(), console=Console(file=stream),
                                     transient=True)
            except ImportError:  # pragma: no cover
                self.rich = None

    @contextlib.contextmanager
    def task(self, name: str, total: int) -> Iterator[Callable[[int, float], None]]:
        if not self.enabled:
            yield lambda step, loss: None
            return
        if self.rich is not None:
            with self.rich:
                tid = self.rich.add_task(name, total=total, loss="-")
                yield lambda step, loss: self.rich.update(tid, advance=1, loss=f"{loss:.4f}")
            return
        every = max(1, total // 4)

        def line(step: int, loss: float) -> None:
            if (step + 1) % every == 0 or step + 1 == total:
                print(f"  {name}: step {step + 1}/{total}  loss {loss:.4f}", file=self.stream,
                      flush=True)
        yield line


def run_demo(cfg: DemoConfig = DemoConfig(), *, stream: TextIO | None = None,
             progress: bool = True) -> DemoResult:
    """Run the demo (see the module docstring), print a report to ``stream`` (stdout) and
    return the measured numbers."""
    threads = torch.get_num_threads()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    try:
        return _run_demo(cfg, stream or sys.stdout, progress)
    finally:
        torch.set_num_threads(threads)


def _run_demo(cfg: DemoConfig, out: TextIO, progress: bool) -> DemoResult:
    """The body of :func:`run_demo`, run with the configured thread count."""
    def say(*args: Any) -> None:
        print(*args, file=out, flush=True)

    bar = _Progress(out, progress)
    corpus = CharCorpus.stdlib(cfg.corpus_bytes)
    say(f"fxad demo — torch {torch.__version__}, {torch.get_num_threads()} CPU thread(s), "
        f"{str(cfg.dtype).replace('torch.', '')}")
    say(f"corpus: {len(corpus.train) + len(corpus.val):,} characters of the Python standard "
        f"library's source, vocabulary {corpus.vocab_size}")
    batches = corpus.batches(cfg.steps, cfg.batch_size, cfg.block_size, seed=cfg.seed)

    torch.manual_seed(cfg.seed)
    model_fx = TinyGPT(corpus.vocab_size, block_size=cfg.block_size, n_layer=cfg.n_layer,
                       n_head=cfg.n_head, n_embd=cfg.n_embd).to(cfg.dtype).train()
    model_ag = copy.deepcopy(model_fx)
    n_params = sum(p.numel() for p in model_fx.parameters())
    say(f"TinyGPT: {cfg.n_layer} layer(s), {cfg.n_head} heads, width {cfg.n_embd}, context "
        f"{cfg.block_size}, {n_params:,} parameters; batch {cfg.batch_size}; AdamW lr {cfg.lr}; "
        f"{cfg.steps} steps")

    g, t_build = build_grad(model_fx, *batches[0])
    n_lines = len(g.code.splitlines())
    say(f"fxad.grad built the gradient code in {t_build:.2f} s ({n_lines} lines of Python)")
    rel0 = grad_rel_err(model_fx, g, batches[0])
    say(f"step-0 gradients: max |fxad - autograd| / max |autograd| over all parameters = "
        f"{rel0:.2e}")

    with bar.task("fxad    ", cfg.steps) as cb:
        t0 = time.perf_counter()
        losses_fx, _, _ = train_fxad(model_fx, batches, cfg, g=g, on_step=cb)
        wall_fx = time.perf_counter() - t0
    with bar.task("autograd", cfg.steps) as cb:
        t0 = time.perf_counter()
        losses_ag, _ = train_autograd(model_ag, batches, cfg, on_step=cb)
        wall_ag = time.perf_counter() - t0

    say("")
    say(f"{'step':>6}  {'loss (fxad)':>12}  {'loss (autograd)':>15}  {'|diff|':>9}")
    for k in list(range(0, cfg.steps, cfg.every)) + ([cfg.steps - 1] if
                                                     (cfg.steps - 1) % cfg.every else []):
        d = abs(losses_fx[k] - losses_ag[k])
        say(f"{k:>6}  {losses_fx[k]:>12.6f}  {losses_ag[k]:>15.6f}  {d:>9.2e}")
    diffs = [abs(a - b) for a, b in zip(losses_fx, losses_ag, strict=True)]
    rels = [d / max(abs(b), 1e-12) for d, b in zip(diffs, losses_ag, strict=True)]
    ag_params = dict(model_ag.named_parameters())
    with torch.no_grad():
        p_diff = max(float((p - ag_params[n]).abs().max())
                     for n, p in model_fx.named_parameters())
    say(f"max |loss_fxad - loss_autograd| over {cfg.steps} steps: {max(diffs):.3e} "
        f"(relative {max(rels):.3e}); max |param diff| after training: {p_diff:.3e}")
    if cfg.dtype == torch.float32:
        say(f"  (float32: the rounding differences between the two gradient codes, "
            f"{rel0:.0e} relative at step 0, are amplified by training; the default "
            f"float64 comparison shows agreement to rounding)")
    say(f"training wall time: fxad {wall_fx:.1f} s, autograd {wall_ag:.1f} s (incl. optimizer)")

    t_fx = t_ag = math.nan
    if cfg.timing_reps:
        m_time, g_time = model_fx, g
        if cfg.dtype != torch.float32:  # time the float32 model, as one would train it
            m_time = copy.deepcopy(model_fx).float()
            g_time = fxad.grad(m_time, *batches[0], argnums=())
        t_fx, t_ag = time_steps(m_time, g_time, batches[0], cfg.timing_reps)
        say(f"forward+backward (float32), median of {cfg.timing_reps} (interleaved): fxad "
            f"{t_fx * 1e3:.2f} ms, autograd {t_ag * 1e3:.2f} ms -> autograd/fxad = "
            f"{t_ag / t_fx:.2f}x")

    if cfg.sample_chars:
        model_fx.eval()
        prompt = corpus.encode("def ")[None]
        text = corpus.decode(model_fx.generate(prompt, cfg.sample_chars,
                                               generator=torch.Generator().manual_seed(0))[0])
        model_fx.train()
        say("\nsample from the fxad-trained model:")
        say("  | " + text.replace("\n", "\n  | "))

    if cfg.show_code:
        code = block_backward_code(g, "blocks.0")
        say("\nbackward code fxad generated for transformer block 0 (lines of "
            "fxad.code_with_shapes(fxad.grad(model, idx, targets)) under blocks.0):")
        say(code or "  (no statements found)")

    cnn: dict[str, Any] = {}
    if cfg.cnn:
        say("\nSmallCNN in training mode (batch statistics):")
        cnn = cnn_demo(cfg.seed)
        say(f"  loss fxad {cnn['loss_fxad']:.6f}, autograd {cnn['loss_autograd']:.6f}; max "
            f"|grad diff| {cnn['grad_max_abs_diff']:.2e}; running stats after the step: max "
            f"|diff| {cnn['buffer_max_abs_diff']:.2e}")
        say("  fxad.check on a batch of 8 images of 8x8:")
        say(f"    train mode: {cnn['check_train']}")
        say(f"    eval mode:  {cnn['check_eval']}")

    return DemoResult(losses_fx, losses_ag, max(diffs), max(rels), rel0, p_diff, t_fx, t_ag,
                      t_build, cnn)


def quick_config(**overrides: Any) -> DemoConfig:
    """:data:`QUICK` with fields replaced."""
    return replace(QUICK, **overrides)
