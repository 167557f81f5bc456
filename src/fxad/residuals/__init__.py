"""Residual (saved-tensor) policies: split a VJP graph into a forward and a backward graph.

:func:`partition` takes the graph of ``fxad.vjp(model, *inputs)`` (forward nodes, then the
backward nodes tagged ``meta['fxad_bwd_of']``) and returns a :class:`Partition`:

* ``fwd_gm(*inputs) -> (*outputs, *saved)``: the nodes the outputs need, the side effects
  (batch-norm running statistics) and the residuals;
* ``bwd_gm([*saved, *cotangents]) -> (*input_grads, *param_grads)`` (one list, emptied on
  entry so that saved tensors are freed after their last use): the backward nodes, plus
  the forward nodes the policy chose to *recompute* (each one emitted just before its first
  use, under the header of the backward block that needs it).

:func:`joint_graph` puts the two back into one graph, forward then backward, with the
recomputations where ``bwd_gm`` has them: the whole training step for ``torch.compile``,
whose saved set is the policy's (a single graph compiled as it comes keeps alive whatever
its backward reads; duplicating the recomputed nodes after the forward is what lets a
compiler free their inputs' results early).

The residuals are a named, printed thing: ``part.saved_names`` lists them; the generated
code of ``fwd_gm`` carries ``# saved for backward: ...`` above its ``return`` and
``bwd_gm``'s code lists them (with shapes and bytes) under its ``def`` line; every
``# backward of: ...`` block header of ``bwd_gm`` ends with ``[saved N B: a, b]``, the
saved tensors that block reads, so ``fxad.show(part.bwd_gm)`` reports saved bytes per block.
:meth:`Partition.report` prints a table: per backward block, whether the residuals its rule
reads are the op's *inputs*, its *output*, *intermediates* of its forward (statistics,
indices) or *other* values (:func:`residual_kind`), beside the rule's own ``residuals``
declaration (see :mod:`fxad.rules.registry`), and their bytes.

Policies
--------
A node in the forward graph is available to the backward either by **saving** it (it is
returned by ``fwd_gm``) or by **recomputing** it in ``bwd_gm`` from values that are
themselves available.  ``policy`` chooses:

``"save"``
    recompute nothing: every forward value a backward node reads is saved (what the joint
    ``fxad.grad`` code keeps alive).
``"min_memory"`` (the default)
    minimize the saved bytes (``meta['val']``: ``numel * itemsize``) subject to recomputing
    only *cheap* ops: elementwise ops and views (the op record's ``recompute``).  Solved exactly as a
    minimum s-t cut (the same formulation as AOTAutograd's rematerialization partitioner);
    among minimum cuts the one that recomputes least is taken.
:class:`Policy`
    the default plus overrides: ``Policy(by_op={"gelu": "save", "matmul": "recompute"},
    by_node={"relu_3": "recompute"}, recompute_cheap=True)``.  Keys of ``by_op`` are op kinds
    as :func:`op_kind` spells them (``"relu"``, ``"add"``, ``"view"``, ``"linear"``) or the
    callables themselves (``torch.relu``); ``by_node`` keys are node names of the VJP graph.
    ``"recompute"`` makes any pure op recomputable (activation checkpointing of a
    ``matmul``); ``"save"`` forbids recomputing it.  Random ops (dropout) and ops with side
    effects are never recomputed; a ``"recompute"`` that cannot be honoured (an input
    placeholder) raises :class:`fxad.InputError`.

Activation checkpointing
------------------------
Whatever the policy, the forward values computed inside a ``torch.utils.checkpoint`` region
(``node.meta['fxad_checkpoint']``, set by the capture) or inside a submodule selected by a
:class:`Checkpoint` (``checkpoint=`` of :func:`partition`), and used only inside it, are
recomputed in the backward; the region's inputs and outputs are saved as the policy says
(its outputs are kept as computed, as ``torch.utils.checkpoint`` keeps them), random ops
and ops with side effects inside it are saved (:func:`checkpoint_regions`,
``Partition.checkpointed``, ``report()``).

Staged backward
---------------
:func:`split_backward` cuts ``bwd_gm`` into stages that return parameter gradients as they
are completed, for :func:`fxad.compile`'s bridge under DDP and FSDP (``grad_release=``).

Which ops count as cheap is a fact of each op's record (:mod:`fxad.rules.registry`): its
rule's declaration ``recompute=True`` (every elementwise unary rule has it) or
``recompute=False``, else whether the op's kind is ``"elementwise"`` or ``"view"``.  Op-kind defaults can also be set globally with
:func:`set_residual_policy` (``set_residual_policy(torch.nn.functional.gelu, "save")``).

Layout: :mod:`~fxad.residuals.policy` (policies),
:mod:`~fxad.residuals.regions` (activation checkpointing regions),
:mod:`~fxad.residuals.mincut` (the policy's choice as a minimum cut),
:mod:`~fxad.residuals.partition` (the split, step by step), :mod:`~fxad.residuals.report`
(:class:`Partition` and its printing), :mod:`~fxad.residuals.joint` (:func:`joint_graph`),
:mod:`~fxad.residuals.staged` (:func:`split_backward`).
"""
from __future__ import annotations

from ..memory import nbytes
from ..naming import op_kind
from .joint import joint_graph
from .partition import partition
from .policy import Policy, as_policy, set_residual_policy
from .regions import Checkpoint, as_checkpoint, checkpoint_candidates, checkpoint_regions
from .report import Partition, residual_kind
from .staged import StagedBackward, split_backward

__all__ = ["Policy", "Checkpoint", "Partition", "partition", "joint_graph", "op_kind",
           "set_residual_policy", "checkpoint_regions", "split_backward", "StagedBackward",
           "nbytes", "residual_kind"]
