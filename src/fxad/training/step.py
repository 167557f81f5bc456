"""The whole training step as one graph (:func:`joint_step`), optionally through
``torch.compile``.  See :mod:`fxad.training`."""
from __future__ import annotations

import warnings
from typing import Any, Callable, Iterable

import torch
import torch.fx as fx
from torch.export import Dim

from .. import distributed as _dist
from ..ad.generated import keyword_values
from ..capture.decisions import value_policy
from ..capture.tracer import KeywordCall
from ..errors import InputError
from ..pipeline import argnum_positions
from ..residuals import Checkpoint, Policy, joint_graph, partition
from ..simplify.schedule import defer_widening_output_casts
from .capture import _autocast_devices, _AutocastOff, _default_layout, _vjp_graph
from .edited import edited_joint_step
from .regional import RegionPlan, plan_regions, regional_graph, tag_blocks

__all__ = ["joint_step", "JOINT_INDUCTOR_OPTIONS", "inductor_available"]


_INDUCTOR_OK: bool | None = None


def inductor_available() -> bool:
    """Whether ``torch.compile`` with inductor works here (tried once on a tiny function:
    it needs a C++ compiler on CPU)."""
    global _INDUCTOR_OK
    if _INDUCTOR_OK is None:
        try:
            f = torch.compile(lambda x: (x.sin() + 1).sum(), backend="inductor")
            f(torch.randn(8))
            _INDUCTOR_OK = True
        except Exception:
            _INDUCTOR_OK = False
    return _INDUCTOR_OK


# inductor options joint_step adds unless given: see its docstring
# the keywords joint_step passes on to torch.compile; other keywords are the model's
_COMPILE_OPTIONS = frozenset({"fullgraph", "dynamic", "backend", "mode", "options", "name",
                              "disable", "recompile_limit", "isolate_recompiles",
                              "shapes_spec"})

JOINT_INDUCTOR_OPTIONS = {"layout_optimization": False, "reorder_for_locality": False,
                          "reorder_for_peak_memory": False}


def joint_step(model: torch.nn.Module | Callable, *example_inputs: Any,
               compile: bool | str | Callable = True, argnums: Any = (),
               policy: str | Policy | None = "min_memory",
               leaf_modules: Iterable[type] = (), channels_last: bool | None = None,
               checkpoint: Checkpoint | bool | None = None, vjp: Any = None,
               dynamic: bool | None = None, dynamic_shapes: Any = None,
               values: str = "guard", example_kwargs: dict[str, Any] | None = None,
               regions: bool = False, **compile_kwargs: Any) -> Callable:
    """The whole training step as one FX graph: ``step(*inputs) -> (loss, input_grads,
    param_grads)`` (as :func:`fxad.grad` returns them: ``param_grads`` a dict by parameter
    name, zeros for unused parameters; ``input_grads`` per input, ``None`` outside
    ``argnums``), through ``torch.compile`` when ``compile`` is true (``compile="aot_eager"``
    etc., or a backend function, picks the backend), so that inductor fuses across the
    forward/backward boundary.

    The graph is :func:`fxad.residuals.joint_graph` of the residual ``policy``'s partition
    (default ``"min_memory"``): forward, then backward with the cheap forward values the
    policy recomputes duplicated before their use, so the compiled step keeps alive only the
    policy's saved set (as AOTAutograd's partitioner does for two graphs).  Under inductor,
    ``options`` default to :data:`JOINT_INDUCTOR_OPTIONS`, two inductor passes that suit a
    forward-only graph but not a forward + backward one:

    * ``layout_optimization=False``: with one graph holding both a convolution's forward and
      its backward, the channels-last layout optimization stores an activation once per
      consumer that needs a fixed layout (the next convolution, ``convolution_backward``, the
      residual add); on the ResNet benchmark it raised the step's peak from 11.2 to 16.6 MiB
      and slowed it.
    * ``reorder_for_locality=False``: inductor runs this FX pass on graphs that need no
      autograd, which the joint graph is.  It moves each node's producers next to their
      consumer, and the gradients' consumer is the output node, so every weight-gradient
      product (and the activations and cotangents it reads) moves to the end of the step and
      stays alive through the whole backward; with the pass on, the GPT benchmark's peak was
      9.9 instead of 8.8 MiB (fp32) and 7.2 instead of 5.8 MiB (bf16 autocast).
    * ``reorder_for_peak_memory=False``: the joint graph's order is already fxad's schedule
      (each recomputation just before its use, each gradient cast where
      :func:`fxad.simplify.schedule.defer_widening_output_casts` puts it).  Inductor's
      reordering picks among orders by an estimate that does not model its C++ backend
      emitting adjacent elementwise nodes as one kernel: on the bf16 MLP benchmark it moved
      the eight float32 casts of the weight gradients next to each other (an estimate
      8 bytes lower), and the one kernel they became allocated all eight float32 results
      before freeing any bfloat16 input: 3.02 MiB instead of 2.17 (``torch.compile(model)``:
      2.17).

    Passing ``options=`` or ``mode=`` replaces that default.

    The widening casts of the gradients under autocast (``d_w = d_to_3.to(torch.float32)``,
    read only by the output) run right after their products or all at the end, whichever
    :func:`fxad.memory.simulate` gives the lower peak (modelling that grouping under
    inductor): at the end on the bf16 ResNet-18 benchmark (simulated 9.0 -> 7.9 MiB; measured
    6.88 MiB, ``torch.compile(model)`` 6.89), where the peak falls inside the backward.

    ``channels_last`` (default ``None``: the weights autocast casts, where oneDNN runs the CPU
    convolutions; ``True``: every 2-D convolution weight) makes those weights channels-last
    inside the graph (:mod:`fxad.simplify.layout`), which moves the convolutions and the
    activations between them to NHWC without storing any activation twice; parameter
    gradients come back in the parameters' layout.  On the small ResNet-18 benchmark
    (2026-11-26, 2-core CPU, torch 2.13, one interleaved run each) under bfloat16 autocast,
    NHWC took the compiled step from 0.99x to 2.82x eager autograd's speed (oneDNN's
    bfloat16 NCHW convolutions are slow there); in float32 every weight channels-last made it
    0.53x (NCHW: 0.98x): the weights' copies into NHWC and their gradients' back cost more
    than NHWC saves at 2x2 to 16x16 activations.

    Captured inside ``torch.autocast``, autocast's casts are explicit in the graph (see the
    module docstring) and the step runs with autocast disabled.  The uncompiled graph module
    is ``step.graph_module``; ``step.partition`` is the partition it was built from.

    ``checkpoint``: activation checkpointing, as in :func:`compile` (the recomputed values
    are duplicated after the forward like the policy's).

    Distributed training: the step returns the gradients instead of filling ``.grad``, so
    it does not compose with DDP or FSDP (a wrapped or sharded model raises
    :class:`fxad.InputError`); run it on the plain model in every process and average the
    gradients with :func:`fxad.distributed.all_reduce_grads` (the tests check that this
    equals DDP), or use ``DDP(fxad.compile(model))``.

    ``vjp``: the path (or text) of a training split written by ``fxad.eject(model, *inputs,
    kind="training")`` and edited by hand: the step runs its ``forward`` and ``backward``
    (with cotangent 1) instead of fxad's graph, checking the file's guards on every call;
    ``compile`` as above, the other options do not apply.

    ``dynamic`` / ``dynamic_shapes``: build on symbolic sizes, as in :func:`fxad.vjp`
    (:mod:`fxad.symbolic`); the step then serves every size its guards admit (and
    ``torch.compile`` is asked for dynamic shapes).  Every call checks the inputs against
    what the step was built for (shapes, or the symbolic build's guards).

    Keyword arguments of the model: ``joint_step(model, x, attention_mask=m)`` (keywords
    that are not options of ``torch.compile``; or ``example_kwargs={...}``), and
    ``step(x, attention_mask=m)``; as in :func:`fxad.grad`, keyword tensors are inputs
    that are not differentiated and ``input_grads`` has one entry per positional input.
    ``values``: as in :func:`fxad.vjp`.

    ``regions=True`` (with ``compile``): regional compilation
    (:mod:`fxad.training.regional`).  The graph is cut at the model's repeated blocks (the
    entries of ``nn.ModuleList``/``nn.Sequential`` containers: ``transformer.h.3``), forward
    and backward apart; equal regions share one compiled function and the glue between them
    (embeddings, output layer, loss) runs uncompiled.  ``step.regions`` is the
    :class:`fxad.training.regional.RegionPlan`, ``step.driver`` the graph module that calls
    the regions.  It trades step time and memory for set-up time: on transformers' GPT-2 at
    d=256 with 12 layers (2026-11-26, 2-core CPU, torch 2.13, float32, inductor cold, its
    once-per-process start-up not counted) the set-up fell from 49.5 to 13.5 s
    (``torch.compile(model)``: 64.7 s), the step (paired with eager's) went from 1.03x to
    1.00x eager's speed and the peak from 80.7 to 85.2 MiB (a region keeps its inputs until
    it returns); docs/performance.md has the other real models.  Without a repeated block
    the whole graph is compiled, with a warning.

    Raises:
        fxad.InputError: the model's output is not one floating-point scalar; the model is
            wrapped in DDP/FSDP or sharded with ``fully_shard``; when called, inputs the
            step was not built for.
    """
    kwargs = dict(example_kwargs or {})
    for k in [k for k in compile_kwargs if k not in _COMPILE_OPTIONS]:
        kwargs[k] = compile_kwargs.pop(k)
    if vjp is not None:
        if kwargs:
            raise InputError("fxad.joint_step(vjp=...) runs an ejected file, whose inputs "
                             "are positional: keyword arguments are not supported there")
        return edited_joint_step(model, vjp, example_inputs, compile, compile_kwargs)
    _dist.check_joint_step_target(model)
    keywords = tuple(kwargs)
    n_pos = len(example_inputs)
    if keywords:
        example_inputs = tuple(example_inputs) + tuple(kwargs.values())
        model = KeywordCall(model, keywords, differentiable=True)
    if channels_last is None:  # as fxad.compile: where autocast copies the weight anyway
        channels_last = _default_layout()
    if dynamic and dynamic_shapes is None:
        dynamic_shapes = tuple({d: Dim.AUTO for d in range(x.dim())}
                               if isinstance(x, torch.Tensor) else None for x in example_inputs)
    argnums = argnum_positions(argnums, n_pos)
    with value_policy(values):
        v = _vjp_graph(model, example_inputs, argnums, leaf_modules, channels_last,
                       dynamic_shapes=dynamic_shapes)
    if regions and compile:
        tag_blocks(v)  # before the partition, whose nodes keep the labels
    spec = v.meta["fxad_input_spec"]
    devices = _autocast_devices()
    out = v.graph.output_node().args[0]
    val = out[0].meta.get("val") if isinstance(out[0], fx.Node) else None
    if not (isinstance(val, torch.Tensor) and val.numel() == 1 and val.is_floating_point()):
        raise InputError("fxad.joint_step needs a model whose output is one floating-point "
                         "scalar (the loss); use fxad.compile or fxad.vjp for other outputs")
    backend = (compile if isinstance(compile, str) or callable(compile) else "inductor") \
        if compile else None
    plan: RegionPlan | None = None
    driver: fx.GraphModule | None = None
    with _AutocastOff(devices):  # node dtypes as the code runs
        part = partition(v, policy, checkpoint=checkpoint)
        g = joint_graph(part, with_params=len(out) > 2)
        if defer_widening_output_casts(g.graph, grouped=backend == "inductor"):
            g.recompile()
    fn: Callable = g.forward
    if backend is not None:
        if backend == "inductor" and "options" not in compile_kwargs \
                and "mode" not in compile_kwargs:
            compile_kwargs["options"] = dict(JOINT_INDUCTOR_OPTIONS)
        if dynamic_shapes is not None:
            compile_kwargs.setdefault("dynamic", True)
        plan = plan_regions(g) if regions else None
        if plan is not None and plan.groups < len(plan.regions):
            def compile_region(m: fx.GraphModule) -> Callable:
                return torch.compile(m, backend=backend, **compile_kwargs)
            driver = regional_graph(g, plan, compile_region)
            fn = driver.forward
        else:
            if plan is not None:
                found = (f"no two of the model's {len(plan.regions)} block regions are the "
                         f"same graph (the entries of its nn.ModuleList/nn.Sequential "
                         f"containers differ in their ops, shapes or dtypes)"
                         if plan.regions else "the model has no repeated block (no entries "
                         "of nn.ModuleList/nn.Sequential containers)")
                warnings.warn(f"fxad.joint_step(regions=True): {found}, so none would be "
                              f"compiled once for several blocks; compiling the whole graph "
                              f"instead", stacklevel=2)
            plan = None
            fn = torch.compile(g.forward, backend=backend, **compile_kwargs)
    if "fxad_shape_plan" in v.meta:  # decisions the passes took on symbolic sizes
        v.meta["fxad_shape_plan"].refresh(v)

    def step(*inputs: Any, **kw: Any) -> Any:
        if kw or keywords:
            inputs = inputs + keyword_values(kw, keywords, "this training step")
        why = spec.admits(inputs)
        if why is not None:
            raise InputError(f"fxad.joint_step: {why}")
        with torch.no_grad(), _AutocastOff(devices):
            out = fn(*inputs)
        if keywords:  # the input gradients of the positional inputs (as fxad.grad)
            out = (out[0], tuple(out[1][:n_pos]), *out[2:])
        return out

    step.graph_module = g  # type: ignore[attr-defined]
    step.partition = part  # type: ignore[attr-defined]
    step.regions = plan  # type: ignore[attr-defined]
    step.driver = driver  # type: ignore[attr-defined]
    return step
