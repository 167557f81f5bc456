"""fxad in an ordinary PyTorch training loop.

:func:`compile` wraps a model so that ``loss = m(x); loss.backward(); opt.step()`` runs
fxad's generated code: the forward graph of :func:`fxad.residuals.partition` runs in the
forward of a ``torch.autograd.Function`` and saves the residuals, the backward graph runs in
its backward.  The parameters are explicit inputs of that Function and of the forward graph
(``partition(..., lift_params=True)``), so ``loss.backward()`` fills their ``.grad`` exactly
where autograd would (accumulating, ``None`` for unused ones), and a parameter changed in
place between forward and backward raises as in autograd.  Per call, the wrapper checks the
input signature, the modules' ``training`` flags, parameters' ``requires_grad`` and that no
submodule or parameter was replaced (cached identity checks, no module walk), then calls the
two generated functions directly.  That code is built to run, not to be transformed again:
relu's backward is the one-kernel ``threshold_backward`` and cross-entropy's is autograd's
two kernels (fused level ``"all"``, :mod:`fxad.rules.fused`), cotangent sums
accumulate in place into a fresh operand (``d_x = getitem_3.add_(d_y)``;
:func:`fxad.simplify.inplace.accumulate_in_place`), as autograd's engine accumulates, and
casts call the dtype's method (``w.bfloat16()``, ``d_w.float()``;
:func:`fxad.simplify.calls.cast_methods`), which Python parses faster than ``.to(dtype)``.
A ReLU (``sigmoid``, ``tanh``) of a fresh value nothing else reads runs in place
(``torch.relu_``, as ``nn.ReLU(inplace=True)`` in eager), and an attention mask computed from
constants alone that is exactly the causal pattern runs as ``is_causal=True`` without the
mask (:mod:`fxad.training.masks`: transformers' decoders build such a mask when traced).
:func:`fxad.vjp` shows ``torch.relu`` and the mask.

Convolution layout (:mod:`fxad.simplify.layout`, ``channels_last=``): on the CPU,
:func:`compile` and :func:`joint_step` by default move to channels-last only the 2-D
convolution weights that autocast casts, so that oneDNN runs those convolutions and
everything between them in NHWC: the weight is copied on every step anyway and the permute
adds one bfloat16 copy.  On the small ResNet-18 benchmark (2026-11-26, 2-core CPU, torch
2.13, one interleaved run each) under bfloat16 autocast that made the bridge 2.92x eager
autograd's speed (NCHW weights: 0.99x; oneDNN's bfloat16 NCHW convolutions are slow there)
and the compiled joint step 2.82x (NCHW: 0.99x).  In float32 every weight channels-last
(``channels_last=True``) made the bridge 0.61x and the joint step 0.53x: PyTorch's strided
copies of the weights into NHWC, and of their gradients back, on every step cost more than
NHWC saves at 2x2 to 16x16 activations, so float32 weights stay NCHW unless asked.  (Inductor's
own layout optimization, which does the same for ``torch.compile(model)``, is off in
:data:`JOINT_INDUCTOR_OPTIONS` because it stores activations twice in a joint graph.)

:func:`joint_step` returns the whole training step (forward + backward, the code of
:func:`fxad.grad` with the residual policy's recomputations: :func:`fxad.residuals.joint_graph`)
as one callable, optionally through ``torch.compile``, so that inductor can fuse across the
forward/backward boundary.

Staged backward (``grad_release=``): with one autograd node every parameter gradient reaches
autograd (and DDP's or FSDP's hooks) when the whole backward is done.  When gradients should
leave earlier (several processes: DDP's bucketed all-reduce, FSDP's reduce-scatter), the
backward graph is cut by :func:`fxad.residuals.split_backward` and run by a chain of autograd
nodes: ``_StagedBridge`` runs the forward graph and returns a token, each ``_Stage`` passes
the token on (the first one in the backward, ``_Stage`` 0, returns the model's outputs and
saves the tensors kept for backward), and each node's backward runs one segment and returns
the gradients it completed, so that autograd's ``AccumulateGrad`` runs for them before the
next segment.  With ``fully_shard`` (FSDP2) :class:`fxad.distributed.FSDPDriver` unshards
before the forward graph, reshards after it, and per segment unshards / reduce-scatters the
FSDP units involved (``_Plan.before_stage``).  See :mod:`fxad.distributed`.

Activation checkpointing (``checkpoint=``): :func:`fxad.residuals.partition` recomputes the
inside of ``torch.utils.checkpoint`` regions and of the submodules a
:class:`fxad.residuals.Checkpoint` selects.

Mixed precision: a capture inside ``torch.autocast`` records autocast's result dtypes in
``meta['val']`` (the fake tensors go through the autocast dispatch key) but not its casts,
and the generated backward would mix dtypes (``convolution_backward`` of a bfloat16
cotangent and a float32 weight fails).  So under autocast, :func:`compile` and
:func:`joint_step` capture the model, make autocast's casts explicit
(:func:`materialize_autocast`: ``w.to(torch.bfloat16)`` before a ``linear``), and
differentiate that graph: the generated code shows every cast, and runs with autocast
disabled (whatever the state at ``loss.backward()`` time).  :func:`compile` captures once
per autocast state, as once per input shape.

Layout: :mod:`~fxad.training.capture` (autocast, the graphs built for execution),
:mod:`~fxad.training.bridge` (the autograd Functions), :mod:`~fxad.training.module`
(:func:`compile`, :class:`FxadModule`), :mod:`~fxad.training.step` (:func:`joint_step`).
"""
from __future__ import annotations

from .capture import (AUTOCAST_LOWER_OPS, _autocast_devices, _AutocastOff,  # noqa: F401
                      _vjp_graph, autocast_state, materialize_autocast)
from .module import FxadModule, compile
from .step import JOINT_INDUCTOR_OPTIONS, inductor_available, joint_step

__all__ = ["compile", "FxadModule", "joint_step", "JOINT_INDUCTOR_OPTIONS", "autocast_state",
           "inductor_available", "materialize_autocast"]
