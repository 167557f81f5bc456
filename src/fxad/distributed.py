"""fxad under ``torch.distributed``: DDP, FSDP2 (``fully_shard``), and what does not compose.

Supported compositions (the order matters):

* ``DDP(fxad.compile(model))``: DistributedDataParallel around the fxad module.  The bridge
  passes the parameters to autograd Functions, so autograd's ``AccumulateGrad`` of each
  parameter runs and DDP's reducer hooks fire from it, as with the eager model.  With
  several processes (an initialized process group of more than one rank) the backward is
  *staged* (:func:`fxad.residuals.split_backward`): the backward graph is cut into segments,
  each run by its own autograd node, which returns the parameter gradients computed so far
  as soon as its segment ends (at least ``DDP_STAGE_BYTES`` of gradients per segment,
  DDP's default bucket size), so that DDP's bucketed all-reduce of the late layers runs
  while the backward of the early layers computes, as in eager.
* ``fully_shard`` applied to the model's blocks and then to the model itself (FSDP2's
  usual order), then ``fxad.compile(model)``: :class:`FSDPDriver` runs FSDP2's own state
  machine around fxad's graphs.  Before the forward graph every FSDP unit is unsharded
  (all-gathered) and the step sees plain unsharded parameters; after it, the units that
  FSDP reshards after forward are resharded.  The backward is staged at the FSDP units:
  before a segment runs, the units whose parameters it reads or whose gradients it
  computes are unsharded again (and the next segment's units prefetched, as FSDP's
  backward prefetch does),
  and once a unit's gradients are accumulated its ``post_backward`` reduce-scatters them
  into the sharded DTensor ``.grad`` and reshards it, while the next segment computes;
  FSDP's final callback finishes the last units.  fxad's forward is one graph, so during
  the forward all units are unsharded at once (eager FSDP holds one or two units at a
  time): parameter memory during the forward is the unsharded model's.

Not supported, with a clear error (:class:`fxad.InputError`):

* ``fxad.compile(DDP(model))`` and ``fxad.compile(FullyShardedDataParallel(model))``
  (FSDP1): fxad would trace the wrapper's own forward (its hooks and collectives);
* ``fully_shard(fxad.compile(model))``: the FSDP hooks would run around fxad's bridge
  instead of around the model's modules; apply ``fully_shard`` to the model first;
* a model whose blocks are sharded but not the model itself;
* FSDP2 mixed precision (``MixedPrecisionPolicy(param_dtype=...)``), grouped
  ``fully_shard([a, b])``, and DTensor parameters that ``fully_shard`` does not manage
  (tensor parallelism);
* ``fxad.joint_step`` of a DDP- or FSDP-wrapped model: the joint step returns the gradients
  instead of filling ``.grad``, so no hook can fire.  Run ``joint_step`` on the plain model in
  each process and average the returned gradients with :func:`all_reduce_grads`.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterable, Iterator

import torch

from .errors import InputError

__all__ = ["DDP_STAGE_BYTES", "FSDPDriver", "all_reduce_grads", "check_compile_target",
           "check_joint_step_target", "fsdp_driver", "multi_process"]

#: default minimum bytes of parameter gradients per backward stage under DDP: DDP's
#: default bucket size (``bucket_cap_mb=25``)
DDP_STAGE_BYTES = 25 * 2**20


def multi_process() -> bool:
    """Whether a default process group of more than one rank is initialized."""
    d = torch.distributed
    return bool(d.is_available() and d.is_initialized() and d.get_world_size() > 1)


def _is_ddp(model: Any) -> bool:
    return isinstance(model, torch.nn.parallel.DistributedDataParallel)


def _is_fsdp1(model: Any) -> bool:
    if not torch.distributed.is_available():
        return False
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover
        return False
    return isinstance(model, FullyShardedDataParallel)


def _fsdp_states(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, Any]]:
    """``(name, module, state)`` of each FSDP2 state in ``model``, pre-order, deduplicated."""
    if not torch.distributed.is_available():
        return []
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_state import _get_module_fsdp_state
    except ImportError:  # pragma: no cover
        return []
    out, seen = [], set()
    for name, mod in model.named_modules():
        st = _get_module_fsdp_state(mod)
        if st is not None and id(st) not in seen:
            seen.add(id(st))
            out.append((name, mod, st))
    return out


def _has_dtensor_params(model: torch.nn.Module) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover
        return False
    return any(isinstance(p, DTensor) for p in model.parameters())


def check_compile_target(model: Any) -> None:
    """Raise :class:`fxad.InputError` for the wrappers :func:`fxad.compile` cannot take."""
    if _is_ddp(model):
        raise InputError(
            "fxad.compile(DistributedDataParallel(model)) is not supported: fxad would trace "
            "DDP's own forward. Wrap the other way round: DDP(fxad.compile(model)); DDP's "
            "gradient hooks fire from the fxad module's backward as from the eager model's")
    if _is_fsdp1(model):
        raise InputError(
            "fxad.compile(FullyShardedDataParallel(model)) (FSDP1) is not supported; use "
            "FSDP2: fully_shard(block) for each block, fully_shard(model), then "
            "fxad.compile(model)")


def check_joint_step_target(model: Any) -> None:
    """Raise :class:`fxad.InputError` for the models :func:`fxad.joint_step` cannot take."""
    if _is_ddp(model) or _is_fsdp1(model):
        raise InputError(
            f"fxad.joint_step({type(model).__name__}(model)) is not supported: the joint step "
            "returns the gradients instead of filling .grad, so the wrapper's reduction hooks "
            "would never fire. Use DDP(fxad.compile(model)), or call fxad.joint_step on the "
            "plain model in every process and average the returned gradients with "
            "fxad.distributed.all_reduce_grads(param_grads)")
    if isinstance(model, torch.nn.Module) and (_fsdp_states(model) or _has_dtensor_params(model)):
        raise InputError(
            "fxad.joint_step of a model with fully_shard (FSDP2) or DTensor parameters is not "
            "supported: the joint step reads whole parameters and returns whole gradients. "
            "Use fxad.compile(model) after fully_shard (FSDP2 unshards and reduce-scatters "
            "around fxad's graphs), or joint_step on an unsharded model with "
            "fxad.distributed.all_reduce_grads")


def all_reduce_grads(grads: Any, group: Any = None, average: bool = True) -> Any:
    """Average (or sum) gradients over the ranks of ``group``, in place: a dict or list of
    tensors (``None`` entries skipped), e.g. the ``param_grads`` of :func:`fxad.joint_step`.
    The tensors of each dtype are flattened into one buffer and reduced with one
    ``all_reduce``.  Returns ``grads``."""
    d = torch.distributed
    vals = [g for g in (grads.values() if isinstance(grads, dict) else grads)
            if isinstance(g, torch.Tensor)]
    if not vals or not (d.is_available() and d.is_initialized()):
        return grads
    n = d.get_world_size(group)
    by_dtype: dict[tuple, list[torch.Tensor]] = {}
    for g in vals:
        by_dtype.setdefault((g.dtype, g.device), []).append(g)
    for ts in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in ts])
        d.all_reduce(flat, group=group)
        if average:
            flat /= n
        off = 0
        for t in ts:
            t.copy_(flat[off:off + t.numel()].view_as(t))
            off += t.numel()
    return grads


class FSDPDriver:
    """Runs FSDP2's state machine for :class:`fxad.training.FxadModule` (see the module
    docstring): unshard before the forward graph, reshard after it, and per backward stage
    unshard / prefetch / ``post_backward`` (reduce-scatter) of the units involved.  Uses
    FSDP2's own objects (``FSDPState``, ``FSDPParamGroup``) so that all communication,
    gradient division and DTensor gradients are FSDP's."""

    def __init__(self, model: torch.nn.Module) -> None:
        from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

        self._TS = TrainingState
        entries = _fsdp_states(model)
        if not entries:
            raise InputError("internal: FSDPDriver on a model without fully_shard")
        if entries[0][1] is not model:
            raise InputError(
                f"fully_shard was applied to submodule(s) ({entries[0][0]}, ...) but not to "
                "the model itself: apply fully_shard(model) too (after its blocks), then "
                "fxad.compile(model)")
        for name, mod, st in entries:
            if len(st._modules) > 1:
                raise InputError(f"grouped fully_shard([...]) ({name}) is not supported by "
                                 "fxad.compile; shard each module separately")
            mp = st._mp_policy
            if mp.param_dtype is not None or mp.output_dtype is not None:
                raise InputError(
                    f"fully_shard({name or 'model'}, mp_policy=MixedPrecisionPolicy(param_dtype"
                    "=...)) is not supported by fxad.compile: use torch.autocast around the "
                    "step instead (fxad makes autocast's casts explicit in its graphs)")
        self.model = model
        self.root = entries[0][2]
        self.states = [st for _, _, st in entries]
        self.modules = [mod for _, mod, _ in entries]
        self.group_state: dict[int, Any] = {}
        for st in self.states:
            for g in st._fsdp_param_groups:
                self.group_state[id(g)] = st
        self._by_ref: dict[tuple[int, str], Any] | None = None

    # ------------------------------------------------------------------ bookkeeping
    def groups(self) -> list[Any]:
        return [g for st in self.states for g in st._fsdp_param_groups]

    def group_of(self, owner: torch.nn.Module, attr: str) -> Any:
        """The ``FSDPParamGroup`` managing ``owner.<attr>``, or ``None``."""
        if self._by_ref is None:
            by_ref = {}
            for g in self.groups():
                for fp in g.fsdp_params:
                    info = fp._module_info
                    by_ref[(id(info.module), info.param_name)] = g
                    for m, a in zip(info.shared_modules, info.shared_param_names):
                        by_ref[(id(m), a)] = g
            self._by_ref = by_ref
        return self._by_ref.get((id(owner), attr))

    def check_params(self) -> None:
        """Raise for DTensor parameters that FSDP does not manage (tensor parallelism)."""
        from torch.distributed.tensor import DTensor

        for name, p in self.model.named_parameters():
            if isinstance(p, DTensor):
                owner, _, attr = name.rpartition(".")
                if self.group_of(self.model.get_submodule(owner), attr) is None:
                    raise InputError(f"parameter {name} is a DTensor not managed by fully_shard "
                                     "(tensor parallelism is not supported by fxad.compile)")

    # ------------------------------------------------------------------ forward
    def unshard_for_forward(self) -> None:
        """FSDP's pre-forward of every unit (root first: lazy init, then all-gathers), with
        no inputs (so no post-backward hook is registered on them: fxad's stages run
        ``post_backward`` themselves)."""
        for mod, st in zip(self.modules, self.states):
            st._pre_forward(mod, (), {})

    @contextlib.contextmanager
    def capturing(self) -> Iterator[None]:
        """While fxad captures the model (which may call the sharded modules and so their
        FSDP hooks), the hooks do nothing: FSDP's state for activation-checkpointing
        recomputation (``PRE_BACKWARD``), where they neither unshard nor reshard."""
        old = [st._training_state for st in self.states]
        for st in self.states:
            st._training_state = self._TS.PRE_BACKWARD
        try:
            yield
        finally:
            for st, o in zip(self.states, old):
                st._training_state = o

    def reshard_after_forward(self) -> None:
        """FSDP's post-forward of every unit, deepest first (reshard where FSDP reshards
        after forward; record the forward order), without the pre-backward hooks (fxad's
        stages unshard)."""
        for st in reversed(self.states):
            for g in st._fsdp_param_groups:
                g.post_forward(None, None, None)
            st._training_state = self._TS.IDLE
        root = self.root
        if root._state_ctx.iter_forward_root is root:  # as FSDP's root post-forward
            ag = root._comm_ctx.all_gather_state
            if ag is not None:  # free the last all-gather result once its streams are done
                root._comm_ctx.all_gather_copy_in_stream.wait_event(ag.event)
                root._comm_ctx.all_gather_stream.wait_event(ag.event)
                root._comm_ctx.all_gather_state = None
            root._state_ctx.iter_forward_root = None

    @contextlib.contextmanager
    def unsharded(self) -> Iterator[None]:
        """Everything unsharded (outside a training step: for a capture), then resharded."""
        self.unshard_for_forward()
        try:
            with self.capturing():
                yield
        finally:
            self.reshard_after_forward()
            for g in self.groups():
                if not g.is_sharded:
                    g._to_sharded()

    # ------------------------------------------------------------------ backward
    def before_stage(self, s: int, plan: "FSDPStagePlan") -> None:
        """Run before backward stage ``s``: ``post_backward`` of the units whose last stage
        was ``s - 1`` (their gradients are accumulated by now: autograd runs
        ``AccumulateGrad`` before the next stage), unshard the units stage ``s`` needs, and
        prefetch those of stage ``s + 1``."""
        TS = self._TS
        if s == 0:
            self.root._register_root_post_backward_final_callback()
        for g in plan.finish_before[s]:
            g.post_backward()
        for g in plan.need[s]:
            self.group_state[id(g)]._training_state = TS.PRE_BACKWARD
            g.pre_backward(False)
        if s + 1 < len(plan.need):  # prefetch as FSDP's backward prefetch does
            from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

            for g in plan.need[s + 1]:
                if not g.is_unsharded and g._all_gather_result is None:
                    FSDPParamGroup._prefetch_unshard(g, "backward")


class FSDPStagePlan:
    """Per backward stage: the FSDP units to unshard (``need``) and those whose
    ``post_backward`` runs before it (``finish_before``)."""

    def __init__(self, need: list[list[Any]], finish_before: list[list[Any]]) -> None:
        self.need = need
        self.finish_before = finish_before


def fsdp_driver(model: torch.nn.Module) -> FSDPDriver | None:
    """An :class:`FSDPDriver` when ``model`` (or a submodule) has ``fully_shard``."""
    if not _fsdp_states(model):
        return None
    return FSDPDriver(model)


def stage_plan(driver: FSDPDriver, param_refs: list[tuple[torch.nn.Module, str]],
               stage_params: list[list[int]], stage_reads: list[list[int]]) -> FSDPStagePlan:
    """The :class:`FSDPStagePlan` of a staged backward: ``stage_params[s]`` /
    ``stage_reads[s]`` are the indices (into ``param_refs``) of the parameters whose
    gradients stage ``s`` returns / whose values it reads."""
    n = len(stage_params)
    need: list[list[Any]] = []
    last: dict[int, int] = {}
    groups: dict[int, Any] = {}
    for s in range(n):
        gs: dict[int, Any] = {}
        for i in list(stage_params[s]) + list(stage_reads[s]):
            g = driver.group_of(*param_refs[i])
            if g is not None:
                gs[id(g)] = g
        need.append(list(gs.values()))
        for k, g in gs.items():
            last[k] = s
            groups[k] = g
    finish_before: list[list[Any]] = [[] for _ in range(n)]
    for k, s in last.items():
        if s + 1 < n:  # the last stage's units are finished by FSDP's final callback
            finish_before[s + 1].append(groups[k])
    return FSDPStagePlan(need, finish_before)


def _iter_units(driver: FSDPDriver, param_refs: list[tuple[torch.nn.Module, str]],
                with_grad: Iterable[int]) -> list[list[int]]:
    """Parameter indices grouped by FSDP unit (parameters FSDP does not manage: one unit
    each)."""
    units: dict[int, list[int]] = {}
    alone: list[list[int]] = []
    for i in with_grad:
        g = driver.group_of(*param_refs[i])
        if g is None:
            alone.append([i])
        else:
            units.setdefault(id(g), []).append(i)
    return list(units.values()) + alone
