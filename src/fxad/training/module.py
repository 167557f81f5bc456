"""The compiled module: :func:`compile` and :class:`FxadModule`, which run fxad's generated
forward and backward graphs in an ordinary training loop.  See :mod:`fxad.training`."""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Iterable

import torch
import torch.fx as fx
from torch.export import Dim
from torch.utils import _pytree as pytree

from .. import distributed as _dist
from ..capture.decisions import check_policy, value_policy
from ..capture.module_state import Settings, changed_settings, recording_reads
from ..capture.outputs import OUTPUT_SPEC, restore_output
from ..capture.tracer import KeywordCall
from ..errors import InputError, ValueGuardError
from ..guards import expect
from ..residuals import Checkpoint, Partition, Policy, partition, split_backward
from ..simplify.calls import cast_methods
from ..simplify.inplace import accumulate_in_place
from .bridge import _Bridge, _Plan, _Run, _Stage, _StagedBridge
from .capture import (_autocast_devices, _AutocastOff, _default_layout, _vjp_graph,
                      autocast_state)
from .edited import EditedModule
from .passes import accumulate_into_reshaped, activations_in_place, write_fresh_in_place

__all__ = ["compile", "FxadModule", "Build", "VALUE_BUILDS_WARN"]

# builds for one input signature (each for other values of the program's decisions on tensor
# values) past which fxad.compile warns: the decision changes from call to call
VALUE_BUILDS_WARN = 8


@dataclass(frozen=True)
class Build:
    """One capture :func:`compile` made (``FxadModule.builds``).

    Attributes:
        number: 1 for the first build.
        shapes: the input shapes it was built at (``None`` for a non-tensor input).
        reason: why it was built: the first call; sizes changed (the changed dimensions are
            made symbolic, as ``torch.compile``'s automatic dynamic shapes do); a symbolic
            build's guard failed; a decision on a tensor value came out differently (the
            reason names the line, :mod:`fxad.capture.decisions`); or a new dtype, device,
            structure, Python value, training flags or autocast state.
        symbols: the symbolic sizes of the build and the input dimensions that carry them
            (empty for a build on the example shapes).
    """
    number: int
    shapes: list
    reason: str
    symbols: dict


class FxadModule(torch.nn.Module):
    """Module returned by :func:`compile`; see there.  ``self.module`` is the wrapped model
    (its parameters are this module's parameters, so optimizers work unchanged)."""

    def __init__(self, module: torch.nn.Module, *, policy: str | Policy | None = "save",
                 leaf_modules: Iterable[type] = (), channels_last: bool | None = None,
                 checkpoint: Checkpoint | bool | None = None,
                 grad_release: str | int | None = None, values: str = "guard") -> None:
        super().__init__()
        self.values = check_policy(values)
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
        # automatic dynamic shapes: per shape-free signature, the plans built on symbolic
        # sizes and the input shapes every build saw
        self._symbolic: dict[Any, list[_Plan]] = {}
        self._shapes_seen: dict[Any, list[list[tuple[int, ...] | None]]] = {}
        self._dynamic_dims: dict[Any, set[tuple[int, int]]] = {}
        self.builds: list[Build] = []
        self._structure: tuple[list, list, list] | None = None
        self._fsdp: Any = None  # FSDPDriver, found on the first call
        self._fsdp_checked = False
        self.stage_log: list | None = None  # set to a list to record the backward stages
        # builds for other values of the decisions on tensor values, per signature (newest
        # first), and whether a plan's forward graph has value guards
        self._value_plans: dict[Any, list[_Plan]] = {}
        self._guarded: dict[int, bool] = {}
        self._warned: set[Any] = set()
        # the modules' plain Python attributes (self.scale, config flags): part of the
        # signature, as the code of a build is specialized on them
        self._settings = Settings()
        # where the last build changed the attributes compared: its values' version then
        self._learned: int | None = None

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
        return tuple(sig), modes, trainable, autocast_state(), self._keywords, \
            self._settings.version(mods)

    def _shape_free(self, key: Any) -> Any:
        """The signature with every tensor shape replaced by its rank."""
        sig, *rest = key

        def strip(entry: Any) -> Any:
            if isinstance(entry, tuple) and len(entry) == 4 and isinstance(entry[0], tuple) \
                    and isinstance(entry[1], torch.dtype):
                return (len(entry[0]),) + entry[1:]
            if isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[0], str):
                return (entry[0], tuple(strip(v) for v in entry[1]))
            return entry
        return (tuple(strip(e) for e in sig), *rest)

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

    def plan(self, *inputs: Any, **kwargs: Any) -> _Plan:
        """The captured plan for ``inputs`` (capturing it on first use)."""
        inputs = self._flat(inputs, kwargs)
        drv = self._driver()
        if drv is not None and not self._in_step:
            with drv.unsharded():
                return self._plan(inputs)
        return self._plan(inputs)

    _in_step = False

    def _plan(self, inputs: tuple) -> _Plan:
        key = self._signature(inputs)
        p = self._plans.get(key)
        if p is not None:
            return p
        free = self._shape_free(key)
        for q in self._symbolic.get(free, ()):
            if q.vjp_gm.meta["fxad_input_spec"].admits(inputs) is None:
                self._plans[key] = q  # this size is served by a build on symbolic sizes
                return q
        shapes = [tuple(x.shape) if isinstance(x, torch.Tensor) else None for x in inputs]
        seen = self._shapes_seen.setdefault(free, [])
        dims = self._dynamic_dims.setdefault(free, set())
        for old in seen:  # like torch.compile: the dimensions that changed become symbolic
            for i, (a, b) in enumerate(zip(old, shapes)):
                if a is not None and b is not None:
                    dims.update((i, d) for d, (x, y) in enumerate(zip(a, b)) if x != y)
        seen.append(shapes)
        dynamic_shapes = None
        if dims:
            dynamic_shapes = tuple(
                {d: Dim.AUTO for i2, d in sorted(dims) if i2 == i} or None
                if isinstance(x, torch.Tensor) else None for i, x in enumerate(inputs))
        p = self._build(inputs, dynamic_shapes)
        self._plans[key] = p
        if dynamic_shapes is not None:
            self._symbolic.setdefault(free, []).append(p)
        if not self.builds:
            reason = "first call"
        elif dynamic_shapes is not None and len(self._symbolic[free]) == 1:
            reason = "sizes changed: " + ", ".join(
                f"dimension {d} of input {i}" for i, d in sorted(dims)) + " made symbolic"
        elif dynamic_shapes is not None:
            reason = "the sizes broke a guard of the symbolic build"
        else:
            reason = self._settings_reason(key) or (
                "new dtype, device, structure, Python value, training flags or autocast state")
        self.builds.append(Build(len(self.builds) + 1, shapes, reason,
                                 p.vjp_gm.meta.get("fxad_shapes", {}).get("symbols", {})))
        if self._learned is not None:  # the key of this build under the attributes compared
            self._rekey(key, key[:-1] + (self._learned,), p)
        return p

    def _rekey(self, old: Any, new: Any, p: _Plan) -> None:
        """File the build ``p`` made for signature ``old`` also under ``new`` (the same
        values under the attributes compared since the build), with the sizes seen and the
        symbolic builds of its shape-free signature."""
        self._plans[new] = p
        of, nf = self._shape_free(old), self._shape_free(new)
        if of == nf:
            return
        seen = self._shapes_seen.setdefault(nf, [])
        seen.extend(s for s in self._shapes_seen.get(of, []) if s not in seen)
        self._dynamic_dims.setdefault(nf, set()).update(self._dynamic_dims.get(of, ()))
        sym = self._symbolic.setdefault(nf, [])
        sym.extend(q for q in self._symbolic.get(of, []) if q not in sym)

    def _settings_reason(self, key: Any) -> str | None:
        """Why ``key`` needs a build when an earlier build differs from it only in the
        modules' Python attributes: the attributes that changed (and a warning once past
        :data:`VALUE_BUILDS_WARN` such builds)."""
        olds = [k[-1] for k in self._plans if k[:-1] == key[:-1] and k[-1] != key[-1]]
        if not olds:
            return None
        names = [n for n, _ in self.module.named_modules(remove_duplicate=False)]
        frozen = self._settings.frozen
        changed = changed_settings(frozen[olds[-1]], frozen[key[-1]], names)
        if len(olds) + 1 > VALUE_BUILDS_WARN and ("settings", key[:-1]) not in self._warned:
            self._warned.add(("settings", key[:-1]))
            warnings.warn(
                f"fxad.compile has built this model {len(olds) + 1} times for the same inputs "
                "because Python attributes of its modules keep changing between calls ("
                + ", ".join(changed[:3]) + "); the code of a build is specialized on them. "
                "Keep a value that changes from step to step in a tensor (register_buffer) or "
                "pass it as an argument of forward", stacklevel=5)
        return "module attributes changed: " + ", ".join(changed[:4])

    def _build(self, inputs: tuple, dynamic_shapes: Any) -> _Plan:
        argnums = tuple(i for i, x in enumerate(inputs)
                        if isinstance(x, torch.Tensor) and x.requires_grad
                        and (x.is_floating_point() or x.is_complex()))
        layout: bool | str = self.channels_last
        if layout is None:  # where the cast copies the weight anyway: see the module doc
            layout = _default_layout()
        mods = self._modules_and_params()[0]
        before = self._settings.snapshot(mods)  # the values the capture starts from
        with value_policy(self.values), recording_reads(mods) as reads:
            g = _vjp_graph(self._callee(), inputs, argnums, self.leaf_modules, layout,
                           dynamic_shapes=dynamic_shapes)
        # the attributes compared changed: the version of this build's values under them
        self._learned = self._settings.version_of(before, mods) \
            if self._settings.learn(reads) else None
        with _AutocastOff(_autocast_devices()):  # node dtypes as the code runs
            part = partition(g, self.policy, lift_params=True, checkpoint=self.checkpoint)
            accumulate_in_place(part.bwd_gm)  # run once, never transformed again
            accumulate_into_reshaped(part.bwd_gm)
            write_fresh_in_place(part.bwd_gm)
            activations_in_place(part.fwd_gm)
            cast_methods(part.fwd_gm)
            cast_methods(part.bwd_gm)
        p = _Plan(part, len(inputs), g)
        p.dynamic_shapes = dynamic_shapes  # a rebuild for other values keeps them
        how = self._stage_units(p)
        if how is not None:
            p.set_staged(split_backward(part, *how))
        if "fxad_shape_plan" in g.meta:  # decisions the passes took on symbolic sizes
            g.meta["fxad_shape_plan"].refresh(g)
        drv = self._fsdp
        if drv is not None:
            self._params(p)
            if p.staged is not None:
                sp = _dist.stage_plan(drv, p.param_refs, p.staged.params, p.staged.reads)
            else:  # one stage: everything unsharded for it
                allp = list(range(len(part.param_names)))
                sp = _dist.stage_plan(drv, p.param_refs, [allp], [allp])
            p.before_stage = lambda s, _d=drv, _sp=sp: _d.before_stage(s, _sp)
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
    # keyword arguments of the current call: the inputs are the positional ones followed by
    # the keyword values, and the module is called with them as keywords (KeywordCall)
    _keywords: tuple[str, ...] = ()

    def _flat(self, inputs: tuple, kwargs: dict) -> tuple:
        self._keywords = tuple(kwargs)
        return inputs + tuple(kwargs.values())

    def _callee(self) -> Any:
        return KeywordCall(self.module, self._keywords, differentiable=True) \
            if self._keywords else self.module

    def _call_module(self, inputs: tuple) -> Any:
        n = len(inputs) - len(self._keywords)
        return self.module(*inputs[:n], **dict(zip(self._keywords, inputs[n:])))

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.module(*inputs, **kwargs)
        inputs = self._flat(inputs, kwargs)
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
        if not self._has_guards(plan):
            return self._run(plan, inputs)
        tried: list[_Plan] = []
        fresh = False
        while True:
            saved = self._save_state()
            try:
                out = self._run(plan, inputs)
            except ValueGuardError as miss:
                self._restore_state(saved)  # undo the buffer updates and draws made so far
                if fresh:  # the build made for these very inputs disagrees with them
                    raise
                tried.append(plan)
                plan, fresh = self._other_plan(inputs, tried, miss)
                continue
            key = self._signature(inputs)
            if self._plans.get(key) is not plan:
                self._plans[key] = plan  # the build these values use, tried first next time
            return out

    def _has_guards(self, plan: _Plan) -> bool:
        """Whether ``plan``'s forward graph checks decisions on tensor values."""
        got = self._guarded.get(id(plan))
        if got is None:
            got = any(n.op == "call_function" and n.target is expect
                      and n.args[0] != "assert"  # (no other build serves a failed one)
                      for n in plan.part.fwd_gm.graph.nodes)
            self._guarded[id(plan)] = got
        return got

    def _save_state(self) -> tuple:
        """The buffers and random generators, restored when a value guard fails midway."""
        bufs = [(b, b.detach().clone()) for b in self.module.buffers()]
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() \
            and torch.cuda.is_initialized() else None
        return bufs, torch.get_rng_state(), cuda

    @staticmethod
    def _restore_state(saved: tuple) -> None:
        bufs, cpu, cuda = saved
        with torch.no_grad():
            for b, v in bufs:
                b.copy_(v)
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)

    def _other_plan(self, inputs: tuple, tried: list[_Plan],
                    miss: ValueGuardError) -> tuple[_Plan, bool]:
        """After ``miss``: a build for other values
        of this signature not tried yet (``fresh`` False), else a new build for these inputs
        (True; a warning past :data:`VALUE_BUILDS_WARN` builds)."""
        key = self._signature(inputs)
        alts = self._value_plans.setdefault(key, [])
        if tried[0] not in alts:
            alts.append(tried[0])
        for q in alts:
            if q not in tried:
                return q, False
        p = self._build(inputs, getattr(tried[0], "dynamic_shapes", None))
        alts.insert(0, p)
        self._plans[key] = p
        if self._learned is not None:  # the key of these builds under the attributes compared
            now = key[:-1] + (self._learned,)
            self._rekey(key, now, p)
            self._value_plans[now] = alts
        shapes = [tuple(x.shape) if isinstance(x, torch.Tensor) else None for x in inputs]
        self.builds.append(Build(
            len(self.builds) + 1, shapes,
            f"a decision on a tensor value changed: {miss.where}: built for {miss.taken!r}, "
            f"now {miss.now!r}", p.vjp_gm.meta.get("fxad_shapes", {}).get("symbols", {})))
        if len(alts) > VALUE_BUILDS_WARN and key not in self._warned:
            self._warned.add(key)
            warnings.warn(
                f"fxad.compile has built this model {len(alts)} times for the same input "
                f"shapes because a Python decision on a tensor value keeps changing: "
                f"{miss.where}. Each build is kept and tried in turn. Write the choice as "
                "tensor code (torch.where(pred, a, b); torch.cond for two code paths), or pass "
                "the value as an argument of forward", stacklevel=4)
        return p, True

    def _run(self, plan: _Plan, inputs: tuple) -> Any:
        part = plan.part
        params = self._params(plan)
        if not any(p.requires_grad for p in params) and not any(part.input_grads):
            return self._call_module(inputs)
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
        # in the program's own containers (a ModelOutput: out.loss), as eager returns them
        return restore_output(pytree.tree_unflatten(leaves, part.out_spec),
                              plan.vjp_gm.meta.get(OUTPUT_SPEC))


def compile(model: torch.nn.Module, *example_inputs: Any,
            policy: str | Policy | None = "save",
            leaf_modules: Iterable[type] = (), channels_last: bool | None = None,
            checkpoint: Checkpoint | bool | None = None,
            grad_release: str | int | None = None, vjp: Any = None,
            values: str = "guard", **example_kwargs: Any) -> FxadModule | EditedModule:
    """Wrap ``model`` so that an ordinary training loop runs fxad's generated backward.

    >>> m = fxad.compile(model)                       # doctest: +SKIP
    >>> loss = m(x, y); loss.backward(); opt.step()  # doctest: +SKIP

    Each call of the returned :class:`FxadModule` with grad mode on runs the forward graph
    inside a ``torch.autograd.Function`` whose backward is fxad's backward graph; the
    parameters (and inputs with ``requires_grad``) receive ``.grad`` through autograd, as
    with the original model.  Under ``torch.no_grad()`` the original model runs.

    The model is captured on first call for each input signature (shapes, dtypes,
    ``requires_grad``), set of ``training`` flags and autocast state; pass
    ``example_inputs`` (and the model's keyword arguments) to capture eagerly.  Keyword
    arguments of ``forward`` are inputs like positional ones (``m(ids,
    attention_mask=mask)``): a tensor with ``requires_grad`` gets its ``.grad``, a new
    Python value builds again.  Shapes are dynamic automatically, as in
    ``torch.compile``: the first call at new sizes rebuilds once with the dimensions that
    changed made symbolic (:mod:`fxad.symbolic`); later sizes its guards admit reuse that
    build.  ``m.builds`` lists every build and why it happened (:class:`Build`).
    Parameters are explicit inputs of the forward graph, read from the live model on every
    call (optimizer updates and replaced parameters are seen) and saved for backward as
    autograd saves them (an in-place change between forward and backward raises); buffers
    are read and updated in the model.  Structure changes (a replaced submodule) are
    detected on the next call.

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

    Python decisions on tensor values (``if x.sum() > 0:``, ``t.item()``,
    ``torch.equal(a, b)``; :mod:`fxad.capture.decisions`) are taken on the first call's
    values and checked on every call; when one comes out differently the call restores the
    buffers and random state, and runs an earlier build made for the new values or builds
    one (``m.builds`` names the line); past :data:`VALUE_BUILDS_WARN` builds for one
    signature a warning names the line and the fix.  ``values``: ``"guard"`` (default),
    ``"guard+sizes"`` (data-dependent sizes too) or ``"refuse"``, as in :func:`fxad.vjp`.
    Each guard reads a value: one device synchronization per guard on a GPU.  The modules'
    plain Python attributes that their code read while a build was captured (numbers,
    flags, strings, short containers of them; every field of an object a module holds, such
    as a configuration) are part of what a build is specialized on: changing one between
    calls (``m.scale = 3.0``, ``m.config.use_cache = False``), assigning another tensor to a
    buffer or tensor attribute, or registering or removing a module hook builds again, and
    ``m.builds`` names the attribute (:class:`fxad.capture.module_state.Settings`, checked
    by identity on every call).  An attribute no build's code read (a step counter a trainer
    sets, one the code only writes) changes nothing.

    Edited derivative (``vjp=``): the path (or text) of a training split written by
    ``fxad.eject(model, *inputs, kind="training")`` and edited by hand; the returned
    :class:`fxad.training.edited.EditedModule` runs its ``forward`` and ``backward``
    (whatever tensors the edit saves), checks the inputs against the file's guards on every
    call, and ``report()`` compares its saved set with fxad's own.  The other options do not
    apply to it.  Check the edit first: ``fxad.check(model, *inputs, vjp=FILE)``.
    """
    if vjp is not None:
        if example_kwargs:
            raise InputError("fxad.compile(vjp=...) runs an ejected file, whose inputs are "
                             "positional: keyword arguments are not supported there")
        em = EditedModule(model, vjp)
        if example_inputs:
            em._guard(example_inputs)
        return em
    _dist.check_compile_target(model)
    m = FxadModule(model, policy=policy, leaf_modules=leaf_modules, channels_last=channels_last,
                   checkpoint=checkpoint, grad_release=grad_release, values=values)
    if example_inputs or example_kwargs:  # keyword arguments of the model's forward too
        m.plan(*example_inputs, **example_kwargs)
    return m
