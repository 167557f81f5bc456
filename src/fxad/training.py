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

Convolution layout (:mod:`fxad.simplify.layout`, ``channels_last=``): on the CPU,
:func:`joint_step` by default uses 2-D convolution weights channels-last, so that oneDNN
runs the convolutions and everything between them in NHWC, as inductor's layout
optimization does for ``torch.compile(model)`` (which :data:`JOINT_INDUCTOR_OPTIONS`
switches off because it stores activations twice in a joint graph).  :func:`compile`, run
eagerly, pays PyTorch's strided copies of the weights into NHWC (and of their gradients
back) on every step, so by default it moves only the weights that autocast casts: there the
weight is copied anyway and the permute adds one bfloat16 copy.  On the small ResNet-18
benchmark (bfloat16 autocast) that made the bridge 1.03x autograd's speed instead of 0.99x,
peak 6.74 instead of 6.80 MiB (autograd: 7.27), in one interleaved run.  In float32,
``channels_last=True`` made it 1.09x but raised the peak to 12.17 MiB against autograd's
11.05 (each float32 weight copied), so float32 weights stay NCHW unless asked.

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
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from .api import trace as _trace
from .api import vjp as _vjp
from .errors import InputError
from . import distributed as _dist
from .residuals import (Checkpoint, Partition, Policy, StagedBackward, joint_graph, op_kind,
                        partition, split_backward)
from .rules import fused
from .simplify.calls import cast_methods
from .simplify.inplace import accumulate_in_place
from .simplify.layout import channels_last_convolutions
from .simplify.schedule import defer_widening_output_casts

__all__ = ["compile", "FxadModule", "joint_step", "JOINT_INDUCTOR_OPTIONS", "autocast_state",
           "inductor_available", "materialize_autocast"]


def autocast_state(device_types: Iterable[str] = ("cpu", "cuda")) -> tuple:
    """The current autocast state: ``((device_type, enabled, dtype), ...)``."""
    out = []
    for d in device_types:
        try:
            on = torch.is_autocast_enabled(d)
            dt = torch.get_autocast_dtype(d) if on else None
        except (RuntimeError, TypeError):  # device type unknown to this build
            continue
        out.append((d, bool(on), dt))
    return tuple(out)


def _autocast_devices() -> tuple[str, ...]:
    """The device types :func:`autocast_state` knows in this build."""
    return tuple(d for d, _, _ in autocast_state())


class _AutocastOff:
    """``with _AutocastOff(devices):`` runs with autocast disabled on ``devices`` (device
    types, :func:`_autocast_devices`), restoring the flags on exit.  It only flips the
    per-device flags, without entering ``torch.autocast(enabled=False)`` objects (~6 µs per
    entry inside an autocast region on a 2-core CPU, against well under 1 µs here), as the
    bridge does twice per training step.  Autocast's cast cache is untouched: nothing is
    cast while autocast is off."""

    __slots__ = ("devices", "was_on")

    def __init__(self, devices: tuple[str, ...]) -> None:
        self.devices = devices
        self.was_on: list[str] = []

    def __enter__(self) -> None:
        self.was_on = [d for d in self.devices if torch.is_autocast_enabled(d)]
        for d in self.was_on:
            torch.set_autocast_enabled(d, False)

    def __exit__(self, *exc: Any) -> None:
        for d in self.was_on:
            torch.set_autocast_enabled(d, True)


def _first_float(v: Any) -> torch.Tensor | None:
    for x in pytree.tree_leaves(v):
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            return x
    return None


#: ops autocast runs in its lower-precision dtype (``autocast_mode.cpp``: CPU and CUDA lists)
AUTOCAST_LOWER_OPS = frozenset({
    "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
    "convolution", "_convolution", "conv_tbc", "bmm", "mm", "baddbmm", "addmm", "addbmm",
    "linear", "matmul", "prelu", "scaled_dot_product_attention", "addmv", "addr",
    "chain_matmul", "multi_dot", "linalg_vecdot", "_native_multi_head_attention",
})


def materialize_autocast(gm: fx.GraphModule) -> int:
    """Make the casts of ``torch.autocast`` explicit in a graph captured under autocast.

    The capture records autocast's result dtypes in ``meta['val']`` but not its casts.  For
    each op whose floating inputs have another dtype than its floating output, the op is
    evaluated again on fake tensors with autocast disabled; where that fails (a ``linear``
    of bfloat16 activations and float32 weights; ops of :data:`AUTOCAST_LOWER_OPS` are not
    evaluated, as fake kernels do not always check dtypes) or gives another dtype (``cross_entropy``
    run in float32), ``.to(dtype)`` casts of the mismatching inputs to the output dtype are
    inserted, which is what autocast does for its lower-precision and float32 op lists.
    Returns the number of casts inserted.  Capturing the result again outside autocast and
    differentiating it gives autograd's backward of an autocast region (``.to`` backward
    casts the cotangents back).
    """
    graph = gm.graph
    n_casts = 0
    for n in list(graph.nodes):
        if n.op not in ("call_function", "call_method"):
            continue
        out = _first_float(n.meta.get("val"))
        if out is None:
            continue
        dt = out.dtype
        bad = [a for a in n.all_input_nodes
               if isinstance(a.meta.get("val"), torch.Tensor)
               and a.meta["val"].is_floating_point() and a.meta["val"].dtype != dt]
        if not bad:
            continue
        mode = getattr(out, "fake_mode", None)
        if op_kind(n) in AUTOCAST_LOWER_OPS:
            pass  # autocast casts every floating input (fake kernels may not check dtypes)
        else:
            try:
                args, kwargs = fx.node.map_arg((n.args, n.kwargs), lambda a: a.meta["val"])
                with contextlib.ExitStack() as st:
                    if mode is not None:
                        st.enter_context(mode)
                    st.enter_context(_AutocastOff(_autocast_devices()))
                    if n.op == "call_method":
                        v = getattr(args[0], n.target)(*args[1:], **kwargs)
                    else:
                        v = n.target(*args, **kwargs)
                plain = _first_float(v)
                if plain is not None and plain.dtype == dt:
                    continue
            except Exception:
                pass
        for a in bad:
            with graph.inserting_before(n):
                c = graph.call_method("to", (a, dt))
            c.meta.update({k: v for k, v in a.meta.items() if k == "fxad_loc"})
            with contextlib.ExitStack() as st:
                if mode is not None:
                    st.enter_context(mode)
                c.meta["val"] = a.meta["val"].to(dt)
            n.replace_input_with(a, c)
            n_casts += 1
    if n_casts:
        gm.recompile()
    return n_casts


def _capture_for_autocast(model: Any, inputs: tuple, leaf_modules: Iterable[type]) -> Any:
    """``model`` itself outside autocast; inside, its graph with explicit casts."""
    if not any(on for _, on, _ in autocast_state()):
        return model
    gm = _trace(model, *inputs, leaf_modules=leaf_modules)
    materialize_autocast(gm)
    return gm


def _onednn_enabled() -> bool:
    """Whether oneDNN runs the CPU convolutions (what ``channels_last=None`` looks at in
    :func:`joint_step` and :func:`compile`)."""
    return bool(torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled)


def _vjp_graph(model: Any, inputs: tuple, argnums: Any, leaf_modules: Iterable[type],
               channels_last: bool | str = False) -> fx.GraphModule:
    """``fxad.vjp`` of ``model`` as captured in the current autocast state (casts explicit),
    differentiated with autocast off; run the result under ``_AutocastOff``.
    The code is built to run, not to be read: fused backward kernels at level ``"all"``
    (relu's ``threshold_backward``; :mod:`fxad.rules.fused`) unless switched off, and CPU
    convolution weights channels-last (:mod:`fxad.simplify.layout`) when
    ``channels_last`` (``"casts"``: only the weights autocast casts)."""
    f = _capture_for_autocast(model, inputs, leaf_modules)
    with _AutocastOff(_autocast_devices()), fused.for_execution():
        g = _vjp(f, *inputs, argnums=argnums, leaf_modules=leaf_modules)
    if channels_last:
        channels_last_convolutions(g, casts_only=channels_last == "casts")
    return g


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
            import time
            self.stage_log.append((s, time.perf_counter()))


_SAVED = object()  # marks a slot filled from ctx.saved_tensors


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
        slots: list[Any] = []
        to_save = []
        for s in saved:
            if isinstance(s, torch.Tensor) and id(s) in pinned:
                slots.append(_SAVED)
                to_save.append(s)
            else:
                slots.append(s)
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
        slots: list[Any] = []
        to_save = []
        for x in saved:
            if isinstance(x, torch.Tensor) and id(x) in pinned:
                slots.append(_SAVED)
                to_save.append(x)
            else:
                slots.append(x)
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


class FxadModule(torch.nn.Module):
    """Module returned by :func:`compile`; see there.  ``self.module`` is the wrapped model
    (its parameters are this module's parameters, so optimizers work unchanged)."""

    def __init__(self, module: torch.nn.Module, *, policy: str | Policy | None = "save",
                 leaf_modules: Iterable[type] = (), channels_last: bool | None = None,
                 checkpoint: Checkpoint | bool | None = None,
                 grad_release: str | int | None = None) -> None:
        super().__init__()
        if not (grad_release is None or grad_release == "end"
                or (isinstance(grad_release, int) and not isinstance(grad_release, bool)
                    and grad_release >= 0)):
            raise InputError(f"grad_release={grad_release!r}: use None (automatic), 'end' or "
                             "a number of bytes >= 0")
        self.module = module
        self.policy = policy
        self.leaf_modules = tuple(leaf_modules)
        self.channels_last = channels_last
        self.checkpoint = checkpoint
        self.grad_release = grad_release
        self._plans: dict[Any, _Plan] = {}
        self._structure: tuple[list, list, list] | None = None
        self._fsdp: Any = None  # FSDPDriver, found on the first call
        self._fsdp_checked = False
        self.stage_log: list | None = None  # set to a list to record the backward stages

    # ------------------------------------------------------------------ capture
    def _modules_and_params(self) -> tuple[list, list]:
        """The wrapped model's modules and parameters, cached; the cache is checked on every
        call (each ``parent._modules[name] is child`` and ``owner._parameters[name] is p``)
        and rebuilt when a submodule or parameter was replaced or added."""
        st = self._structure
        if st is not None:
            links, mods, prefs = st
            if all(par._modules.get(k) is ch for par, k, ch in links) and \
                    all(o._parameters.get(k) is q for o, k, q in prefs):
                return mods, prefs
        mods = list(self.module.modules())
        links = [(par, k, ch) for par in mods for k, ch in par._modules.items()]
        prefs = [(o, k, q) for o in mods for k, q in o._parameters.items() if q is not None]
        self._structure = (links, mods, prefs)
        for plan in self._plans.values():
            plan.param_refs = []  # owners may have changed
        return mods, prefs

    def _signature(self, inputs: tuple) -> Any:
        # what a capture specializes on (fxad.guards): every tensor leaf's shape, dtype,
        # device (and requires_grad, which decides what is differentiated); every other leaf's
        # value; and the containers' structure.  A change re-traces (cached per signature).
        sig = []
        for x in inputs:
            if isinstance(x, torch.Tensor):
                sig.append((tuple(x.shape), x.dtype, x.device, x.requires_grad))
                continue
            leaves, spec = pytree.tree_flatten(x)
            sig.append((str(spec), tuple(
                (tuple(v.shape), v.dtype, v.device, v.requires_grad)
                if isinstance(v, torch.Tensor) else ("const", type(v).__name__, repr(v))
                for v in leaves)))
        mods, prefs = self._modules_and_params()
        modes = tuple(m.training for m in mods)
        trainable = tuple(q.requires_grad for _, _, q in prefs)
        return tuple(sig), modes, trainable, autocast_state()

    def _driver(self) -> Any:
        """The FSDP2 driver when the wrapped model uses ``fully_shard`` (found once)."""
        if not self._fsdp_checked:
            if torch.distributed.is_available():
                from torch.distributed.fsdp import FSDPModule
                if isinstance(self, FSDPModule):
                    raise InputError(
                        "fully_shard(fxad.compile(model)) is not supported: FSDP's hooks would "
                        "run around fxad's bridge, not around the model's modules. Apply "
                        "fully_shard to the model's blocks and to the model first, then "
                        "fxad.compile(model)")
            self._fsdp = _dist.fsdp_driver(self.module)
            if self._fsdp is not None:
                self._fsdp.check_params()
            self._fsdp_checked = True
        return self._fsdp

    def _stage_units(self, plan: _Plan) -> tuple[list[list[int]] | None, int] | None:
        """How the backward is staged: ``(units, min_bytes)`` for :func:`split_backward`, or
        ``None`` for one stage (see ``grad_release`` in :func:`compile`)."""
        drv = self._fsdp
        if drv is not None:
            if self.grad_release == "end":
                return None
            self._params(plan)
            units = _dist._iter_units(drv, plan.param_refs,
                                      [i for i, h in enumerate(plan.part.param_has_grad) if h])
            return units, 0
        if self.grad_release == "end":
            return None
        if isinstance(self.grad_release, int):
            return None, self.grad_release
        if _dist.multi_process():
            return None, _dist.DDP_STAGE_BYTES
        return None

    def plan(self, *inputs: Any) -> _Plan:
        """The captured plan for ``inputs`` (capturing it on first use)."""
        drv = self._driver()
        if drv is not None and not self._in_step:
            with drv.unsharded():
                return self._plan(inputs)
        return self._plan(inputs)

    _in_step = False

    def _plan(self, inputs: tuple) -> _Plan:
        key = self._signature(inputs)
        p = self._plans.get(key)
        if p is None:
            argnums = tuple(i for i, x in enumerate(inputs)
                            if isinstance(x, torch.Tensor) and x.requires_grad
                            and (x.is_floating_point() or x.is_complex()))
            layout: bool | str = self.channels_last
            if layout is None:  # where the cast copies the weight anyway: see the module doc
                layout = "casts" if _onednn_enabled() else False
            g = _vjp_graph(self.module, inputs, argnums, self.leaf_modules, layout)
            part = partition(g, self.policy, lift_params=True, checkpoint=self.checkpoint)
            accumulate_in_place(part.bwd_gm)  # run once, never transformed again
            cast_methods(part.fwd_gm)
            cast_methods(part.bwd_gm)
            p = _Plan(part, len(inputs), g)
            how = self._stage_units(p)
            if how is not None:
                p.set_staged(split_backward(part, *how))
            drv = self._fsdp
            if drv is not None:
                self._params(p)
                if p.staged is not None:
                    sp = _dist.stage_plan(drv, p.param_refs, p.staged.params, p.staged.reads)
                else:  # one stage: everything unsharded for it
                    allp = list(range(len(part.param_names)))
                    sp = _dist.stage_plan(drv, p.param_refs, [allp], [allp])
                p.before_stage = lambda s, _d=drv, _sp=sp: _d.before_stage(s, _sp)
            self._plans[key] = p
        return p

    def _params(self, plan: _Plan) -> list[torch.Tensor]:
        """The live parameters of ``plan.part.param_names`` (read through their owning
        module, so that a replaced parameter is seen)."""
        if not plan.param_refs:
            for name in plan.part.param_names:
                owner, _, attr = name.rpartition(".")
                plan.param_refs.append((self.module.get_submodule(owner), attr))
        return [o._parameters[a] for o, a in plan.param_refs]

    def partition(self, *inputs: Any) -> Partition:
        """The forward/backward :class:`~fxad.residuals.Partition` used for ``inputs``."""
        return self.plan(*inputs).part

    @property
    def fwd_gm(self) -> fx.GraphModule:
        """Forward graph of the most recent capture."""
        return self._last().part.fwd_gm

    @property
    def bwd_gm(self) -> fx.GraphModule:
        """Backward graph of the most recent capture."""
        return self._last().part.bwd_gm

    def _last(self) -> _Plan:
        if not self._plans:
            raise InputError("nothing captured yet: call the module (or .plan(*inputs)) first")
        return next(reversed(self._plans.values()))

    # ------------------------------------------------------------------ call
    def forward(self, *inputs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.module(*inputs)
        drv = self._driver()
        if drv is None:
            return self._step(inputs)
        # FSDP2: every unit unsharded for the forward graph (plain tensors), resharded after
        drv.unshard_for_forward()
        self._in_step = True
        try:
            with drv.capturing():
                self._plan(inputs)
            return self._step(inputs)
        finally:
            self._in_step = False
            drv.reshard_after_forward()

    def _step(self, inputs: tuple) -> Any:
        plan = self._plan(inputs)
        part = plan.part
        params = self._params(plan)
        if not any(p.requires_grad for p in params) and not any(part.input_grads):
            return self.module(*inputs)
        plan.stage_log = self.stage_log
        if plan.staged is not None:
            st = plan.staged
            k = len(st.stages)
            run = _Run(plan, params)
            token = _StagedBridge.apply(run, *inputs, *(params[i] for i in st.params[k - 1]))
            for s in range(k - 2, -1, -1):
                token = _Stage.apply(run, s, token, *(params[i] for i in st.params[s]))
            out = token
        else:
            if plan.unused:
                params = list(params)
                for i in plan.unused:
                    params[i] = params[i].detach()
            out = _Bridge.apply(plan, *inputs, *params)
        if part.out_spec.is_leaf():  # a single tensor
            return out
        leaves = list(out) if isinstance(out, tuple) else [out]
        return pytree.tree_unflatten(leaves, part.out_spec)


def compile(model: torch.nn.Module, *example_inputs: Any,
            policy: str | Policy | None = "save",
            leaf_modules: Iterable[type] = (), channels_last: bool | None = None,
            checkpoint: Checkpoint | bool | None = None,
            grad_release: str | int | None = None) -> FxadModule:
    """Wrap ``model`` so that an ordinary training loop runs fxad's generated backward.

    >>> m = fxad.compile(model)                       # doctest: +SKIP
    >>> loss = m(x, y); loss.backward(); opt.step()  # doctest: +SKIP

    Each call of the returned :class:`FxadModule` with grad mode on runs the forward graph
    inside a ``torch.autograd.Function`` whose backward is fxad's backward graph; the
    parameters (and inputs with ``requires_grad``) receive ``.grad`` through autograd, as
    with the original model.  Under ``torch.no_grad()`` the original model runs.

    The model is captured on first call for each input signature (shapes, dtypes,
    ``requires_grad``), set of ``training`` flags and autocast state; pass
    ``example_inputs`` to capture eagerly.  Parameters are explicit inputs of the forward
    graph, read from the live model on every call (optimizer updates and replaced parameters
    are seen) and saved for backward as autograd saves them (an in-place change between
    forward and backward raises); buffers are read and updated in the model.  Structure
    changes (a replaced submodule) are detected on the next call.

    Args:
        policy: residual policy: ``"save"`` (default: recompute nothing, keeping what
            autograd keeps), ``"min_memory"`` (save least, recomputing only elementwise ops
            and views) or a :class:`fxad.residuals.Policy` with per-op / per-node choices.
            The default is autograd's trade: the same saved set and peak, no work done twice.
            ``"min_memory"`` gives up speed for memory: on the small GPT benchmark (2 layers,
            d=128, T=128, B=4, float32, 2-core CPU) it recomputes the GELU outputs, the
            residual sums and the casts, peak 9.5 MiB instead of autograd's 11.5, at 0.985x to
            0.995x autograd's speed over three interleaved runs, where ``"save"`` ran at 1.008x
            to 1.055x with autograd's peak.
        leaf_modules: as in :func:`fxad.vjp`.
        channels_last: run 2-D convolutions with channels-last (NHWC) weights on the CPU
            (:mod:`fxad.simplify.layout`): ``True``, ``False``, or ``None`` (default): only
            the weights that autocast casts, where oneDNN runs the convolutions (see the
            module docstring).  Gradients keep the parameters' layout either way.

        checkpoint: activation checkpointing (:class:`fxad.residuals.Checkpoint`): by default
            the model's own ``torch.utils.checkpoint`` regions are honoured (their inside is
            recomputed in the backward, not saved); ``Checkpoint(modules=Block, every=2)``
            checkpoints every second ``Block``, ``Checkpoint(modules=Block, budget=bytes)``
            as many leading blocks as the simulated peak needs; ``False`` ignores all
            regions.
        grad_release: when the backward hands parameter gradients to autograd (and so to
            DDP's and FSDP's hooks): ``"end"``: all at once when the backward is done;
            a number of bytes: in stages of at least that many bytes of gradients
            (:func:`fxad.residuals.split_backward`; ``0``: each as soon as it is computed);
            ``None`` (default): ``"end"`` in a single process, stages of
            :data:`fxad.distributed.DDP_STAGE_BYTES` (DDP's bucket size) when a process
            group of several ranks is initialized, and one stage per FSDP unit under
            ``fully_shard``.  See :mod:`fxad.distributed` for DDP and FSDP2.

    The split is inspectable: ``m.partition(*inputs)`` gives the
    :class:`fxad.residuals.Partition` (``fwd_gm``, ``bwd_gm``, ``saved_names``,
    ``saved_bytes``, ``report()``).

    Distributed training: ``DDP(fxad.compile(model))``, or ``fully_shard`` on the model's
    blocks and on the model, then ``fxad.compile(model)`` (:mod:`fxad.distributed`);
    ``fxad.compile(DDP(model))`` raises :class:`fxad.InputError`.
    """
    _dist.check_compile_target(model)
    m = FxadModule(model, policy=policy, leaf_modules=leaf_modules, channels_last=channels_last,
                   checkpoint=checkpoint, grad_release=grad_release)
    if example_inputs:
        m.plan(*example_inputs)
    return m


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
JOINT_INDUCTOR_OPTIONS = {"layout_optimization": False, "reorder_for_locality": False,
                          "reorder_for_peak_memory": False}


def joint_step(model: torch.nn.Module | Callable, *example_inputs: Any,
               compile: bool | str = True, argnums: Any = (),
               policy: str | Policy | None = "min_memory",
               leaf_modules: Iterable[type] = (), channels_last: bool | None = None,
               checkpoint: Checkpoint | bool | None = None,
               **compile_kwargs: Any) -> Callable:
    """The whole training step as one FX graph: ``step(*inputs) -> (loss, input_grads,
    param_grads)`` (as :func:`fxad.grad` returns them: ``param_grads`` a dict by parameter
    name, zeros for unused parameters; ``input_grads`` per input, ``None`` outside
    ``argnums``), through ``torch.compile`` when ``compile`` is true (``compile="aot_eager"``
    etc. picks the backend), so that inductor fuses across the forward/backward boundary.

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

    ``channels_last`` (default ``None``: where oneDNN runs the CPU convolutions) makes the
    2-D convolution weights channels-last inside the graph (:mod:`fxad.simplify.layout`),
    which moves the convolutions and the activations between them to NHWC without storing
    any activation twice; parameter gradients come back in the parameters' layout.  On the
    small ResNet-18 benchmark (fp32) that took the compiled step from 0.96-1.02x the speed
    of ``torch.compile(model)`` (three runs) to 1.10x (two runs), peak 12.2 MiB against its
    13.4 MiB.

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

    Raises:
        fxad.InputError: the model's output is not one floating-point scalar; the model is
            wrapped in DDP/FSDP or sharded with ``fully_shard``.
    """
    _dist.check_joint_step_target(model)
    if channels_last is None:
        channels_last = _onednn_enabled()
    v = _vjp_graph(model, example_inputs, argnums, leaf_modules, channels_last)
    devices = _autocast_devices()
    out = v.graph.output_node().args[0]
    val = out[0].meta.get("val") if isinstance(out[0], fx.Node) else None
    if not (isinstance(val, torch.Tensor) and val.numel() == 1 and val.is_floating_point()):
        raise InputError("fxad.joint_step needs a model whose output is one floating-point "
                         "scalar (the loss); use fxad.compile or fxad.vjp for other outputs")
    part = partition(v, policy, checkpoint=checkpoint)
    g = joint_graph(part, with_params=len(out) > 2)
    backend = (compile if isinstance(compile, str) else "inductor") if compile else None
    if defer_widening_output_casts(g.graph, grouped=backend == "inductor"):
        g.recompile()
    fn: Callable = g.forward
    if backend is not None:
        if backend == "inductor" and "options" not in compile_kwargs \
                and "mode" not in compile_kwargs:
            compile_kwargs["options"] = dict(JOINT_INDUCTOR_OPTIONS)
        fn = torch.compile(g.forward, backend=backend, **compile_kwargs)

    def step(*inputs: Any) -> Any:
        with torch.no_grad(), _AutocastOff(devices):
            return fn(*inputs)

    step.graph_module = g  # type: ignore[attr-defined]
    step.partition = part  # type: ignore[attr-defined]
    return step
