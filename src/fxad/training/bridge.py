"""The autograd side of :func:`fxad.compile`: one captured plan per input signature
(:class:`_Plan`), the ``torch.autograd.Function`` that runs the forward and backward graphs
(:class:`_Bridge`), and the chain of nodes of a staged backward (:class:`_StagedBridge`,
:class:`_Stage`).  See :mod:`fxad.training`."""
from __future__ import annotations

import time
from typing import Any, Callable

import torch
import torch.fx as fx

from ..residuals import Partition, StagedBackward
from .capture import _autocast_devices, _AutocastOff

__all__: list[str] = []


class _Plan:
    """One capture of the model for one input signature: partition + bookkeeping."""

    def __init__(self, part: Partition, n_inputs: int, vjp_gm: fx.GraphModule) -> None:
        self.part = part
        self.n_inputs = n_inputs
        # the graphs hold autocast's casts explicitly and run with autocast off
        self.autocast_devices = _autocast_devices()
        self.vjp_gm = vjp_gm
        self.nondiff_outputs = [i for i, f in enumerate(part.float_outputs) if not f]
        # the graphs' generated functions, called without nn.Module.__call__ (no hooks can be
        # registered on these internal modules; the call machinery costs ~30 us per call)
        self.run_fwd = part.fwd_gm.forward
        self.run_bwd = part.bwd_gm.forward
        self.param_refs: list[tuple[torch.nn.Module, str]] = []  # (owner, attribute) per param
        # parameters without a gradient go to the Functions detached (not as autograd
        # inputs: DDP's find_unused_parameters must see them unused)
        self.unused = [i for i, h in enumerate(part.param_has_grad) if not h]
        # staged backward (split_backward): one autograd node per stage
        self.staged: StagedBackward | None = None
        self.stage_fns: list[Callable] = []
        self.before_stage: Callable[[int], None] | None = None  # FSDP's per-stage work
        self.token_grads: dict[torch.device, torch.Tensor] = {}
        self.stage_log: list | None = None  # (stage, time) per backward stage, if a list

    def set_staged(self, staged: StagedBackward | None) -> None:
        self.staged = staged
        self.stage_fns = [] if staged is None else [g.forward for g in staged.stages]

    def token_grad(self, device: torch.device) -> torch.Tensor:
        t = self.token_grads.get(device)
        if t is None:
            t = self.token_grads[device] = torch.empty(0, device=device)
        return t

    def log_stage(self, s: int) -> None:
        if self.stage_log is not None:
            self.stage_log.append((s, time.perf_counter()))


_SAVED = object()  # marks a slot filled from ctx.saved_tensors


def _slots(saved: Any, pinned: set[int]) -> tuple[list[Any], list[torch.Tensor]]:
    """The residuals ``saved`` as slots for the backward: a pinned tensor (an input,
    parameter or output, by ``id``) goes through ``save_for_backward`` and its slot is
    :data:`_SAVED`; any other value is kept in its slot as is."""
    slots: list[Any] = []
    to_save = []
    for x in saved:
        if isinstance(x, torch.Tensor) and id(x) in pinned:
            slots.append(_SAVED)
            to_save.append(x)
        else:
            slots.append(x)
    return slots, to_save


class _Bridge(torch.autograd.Function):
    """``forward(plan, *inputs, *params)`` runs the forward graph; ``backward`` the
    backward graph."""

    @staticmethod
    def forward(ctx: Any, plan: _Plan, *args: Any) -> Any:  # type: ignore[override]
        part = plan.part
        fwd_args = args if part.lifted_params else args[:plan.n_inputs]
        with _AutocastOff(plan.autocast_devices):
            res = plan.run_fwd(*fwd_args)
        outs, saved = res[:part.n_outputs], res[part.n_outputs:]
        del res
        # inputs, parameters and outputs go through save_for_backward (version checks: an
        # in-place change before backward raises as in autograd; no reference cycle through
        # the output's grad_fn); intermediates are kept in a plain list that the backward
        # graph consumes, so that each is freed after its last use there
        pinned = {id(t) for t in (*fwd_args, *outs) if isinstance(t, torch.Tensor)}
        slots, to_save = _slots(saved, pinned)
        del saved
        ctx.save_for_backward(*to_save)
        ctx.slots = slots
        ctx.plan = plan
        if plan.nondiff_outputs:
            ctx.mark_non_differentiable(*(outs[i] for i in plan.nondiff_outputs))
        return tuple(outs) if len(outs) != 1 else outs[0]

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, *d_outs: Any) -> Any:  # type: ignore[override]
        plan: _Plan = ctx.plan
        part = plan.part
        if ctx.slots is None:
            raise RuntimeError("fxad: backward through this graph a second time; the saved "
                               "tensors were freed (use retain_graph with the original model)")
        it = iter(ctx.saved_tensors)
        args = [next(it) if s is _SAVED else s for s in ctx.slots]
        ctx.slots = None
        del it
        args.extend(d for d, f in zip(d_outs, part.float_outputs) if f)
        del d_outs
        if plan.before_stage is not None:
            plan.before_stage(0)
        if plan.stage_log is not None:
            plan.log_stage(0)
        with _AutocastOff(plan.autocast_devices):
            grads = plan.run_bwd(args)
        n = len(part.input_grads)
        in_g = list(grads[:n])
        for i, need in enumerate(ctx.needs_input_grad[1:1 + n]):
            if not need:
                in_g[i] = None
        return (None, *in_g, *grads[n:])


class _Run:
    """State of one staged forward/backward, shared by its autograd nodes (no reference to
    them, so no cycle)."""

    __slots__ = ("plan", "params", "slots", "to_save", "outs", "carry")

    def __init__(self, plan: _Plan, params: list) -> None:
        self.plan = plan
        self.params: list | None = params
        self.slots: list | None = None
        self.to_save: list | None = None
        self.outs: list | None = None
        self.carry: list | None = None


class _StagedBridge(torch.autograd.Function):
    """Staged backward, first node of the chain: ``forward(run, *inputs, *params)`` runs
    the forward graph (``params``: those whose gradients the *last* backward stage returns)
    and returns a token; its backward runs the last stage."""

    @staticmethod
    def forward(ctx: Any, run: _Run, *args: Any) -> Any:  # type: ignore[override]
        plan = run.plan
        part = plan.part
        n = plan.n_inputs
        fwd_args = (*args[:n], *run.params) if part.lifted_params else args[:n]
        run.params = None
        with _AutocastOff(plan.autocast_devices):
            res = plan.run_fwd(*fwd_args)
        outs, saved = list(res[:part.n_outputs]), res[part.n_outputs:]
        del res
        pinned = {id(t) for t in fwd_args if isinstance(t, torch.Tensor)}
        for i, o in enumerate(outs):  # an input returned as is: the last node returns a copy
            if id(o) in pinned:
                outs[i] = o.clone()
        pinned.update(id(t) for t in outs if isinstance(t, torch.Tensor))
        slots, to_save = _slots(saved, pinned)
        del saved
        run.slots, run.to_save, run.outs = slots, to_save, outs
        ctx.run = run
        dev = next((t.device for t in outs if isinstance(t, torch.Tensor)), torch.device("cpu"))
        return torch.empty(0, device=dev)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, d_token: Any) -> Any:  # type: ignore[override]
        run: _Run = ctx.run
        plan = run.plan
        part = plan.part
        s = len(plan.stage_fns) - 1
        if run.carry is None:
            raise RuntimeError("fxad: backward through this graph a second time; the saved "
                               "tensors were freed (use retain_graph with the original model)")
        if plan.before_stage is not None:
            plan.before_stage(s)
        if plan.stage_log is not None:
            plan.log_stage(s)
        args, run.carry = run.carry, None
        with _AutocastOff(plan.autocast_devices):
            grads = plan.stage_fns[s](args)
        n = len(part.input_grads)
        in_g = list(grads[:n])
        for i, need in enumerate(ctx.needs_input_grad[1:1 + n]):
            if not need:
                in_g[i] = None
        return (None, *in_g, *grads[n:])


class _Stage(torch.autograd.Function):
    """Staged backward, later nodes of the chain: ``forward(run, s, token, *params)``
    returns a token for ``s > 0`` and the model's outputs for ``s == 0`` (the node the
    backward starts from, which saves the tensors kept for backward); the backward runs
    stage ``s`` and returns the gradients of ``params``, so that autograd's
    ``AccumulateGrad`` (and the hooks of DDP, FSDP) runs for them before stage ``s + 1``."""

    @staticmethod
    def forward(ctx: Any, run: _Run, s: int, token: Any,  # type: ignore[override]
                *params: Any) -> Any:
        ctx.run = run
        ctx.s = s
        if s:
            return torch.empty(0, device=token.device)
        plan = run.plan
        ctx.save_for_backward(*run.to_save)
        run.to_save = None
        outs, run.outs = run.outs, None
        if plan.nondiff_outputs:
            ctx.mark_non_differentiable(*(outs[i] for i in plan.nondiff_outputs))
        return tuple(outs) if len(outs) != 1 else outs[0]

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, *grads: Any) -> Any:  # type: ignore[override]
        run: _Run = ctx.run
        plan = run.plan
        s = ctx.s
        if s == 0:
            if run.slots is None:
                raise RuntimeError("fxad: backward through this graph a second time; the saved "
                                   "tensors were freed (use retain_graph with the original "
                                   "model)")
            it = iter(ctx.saved_tensors)
            args = [next(it) if x is _SAVED else x for x in run.slots]
            run.slots = None
            del it
            args.extend(d for d, f in zip(grads, plan.part.float_outputs) if f)
            device = next((d.device for d in grads if isinstance(d, torch.Tensor)),
                          torch.device("cpu"))
        else:
            args, run.carry = run.carry, None
            device = grads[0].device
        del grads
        if plan.before_stage is not None:
            plan.before_stage(s)
        if plan.stage_log is not None:
            plan.log_stage(s)
        with _AutocastOff(plan.autocast_devices):
            res = plan.stage_fns[s](args)
        nc = plan.staged.n_carry[s]  # type: ignore[union-attr]
        run.carry = list(res[:nc])
        return (None, None, plan.token_grad(device), *res[nc:])
