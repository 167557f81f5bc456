"""``fxad.compile(model, *inputs, vjp=FILE)``: train with a training split ejected by
:func:`fxad.eject` (``kind="training"``) and edited by hand.

The edited ``forward(model, *inputs)`` runs in the forward of a ``torch.autograd.Function``
and its saved tensors (whatever the edit returns after the ``N_OUTPUTS`` outputs: a changed
saved set is fine) are kept for its backward, where the edited ``backward(model, [*saved,
*cotangents])`` runs; parameters get ``.grad`` through autograd as with :func:`fxad.compile`.
The guards are the file's: every call checks the inputs' shapes, dtypes and devices and the
model's training mode against ``BUILT_FOR`` (an edited derivative cannot be rebuilt for
other shapes: eject again and redo the edit).  :meth:`EditedModule.report` prints the saved
set of the last call beside fxad's own split.
"""
from __future__ import annotations

from typing import Any

import torch

from ..api import vjp as _vjp
from ..errors import InputError
from ..eject import load, returned_names
from ..residuals import partition


def _fmt(n: int) -> str:
    return f"{n / 1024:.1f} KiB" if n >= 1024 else f"{n} B"


class _EditedBridge(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, em: "EditedModule", n_in: int, *args: Any) -> Any:
        mod = em.ejected
        with torch.no_grad():
            res = mod.forward(em.module, *args[:n_in])
        n = mod.N_OUTPUTS
        outs, saved = res[:n], list(res[n:])
        em.last_saved = [(nm, int(t.numel() * t.element_size()) if isinstance(t, torch.Tensor)
                          else 0) for nm, t in zip(em.saved_names, saved)]
        ctx.em, ctx.n_in = em, n_in
        ctx.kinds = [isinstance(t, torch.Tensor) for t in saved]
        ctx.others = [t for t in saved if not isinstance(t, torch.Tensor)]
        ctx.save_for_backward(*[t for t in saved if isinstance(t, torch.Tensor)])
        return outs[0] if n == 1 else tuple(outs)

    @staticmethod
    def backward(ctx: Any, *cots: Any) -> Any:
        em = ctx.em
        tensors, others = iter(ctx.saved_tensors), iter(ctx.others)
        saved = [next(tensors) if k else next(others) for k in ctx.kinds]
        with torch.no_grad():
            grads = em.ejected.backward(em.module, [*saved, *cots])
        return (None, None, *grads)


class EditedModule(torch.nn.Module):
    """Module returned by ``fxad.compile(model, *inputs, vjp=FILE)``; ``self.module`` is the
    wrapped model."""

    def __init__(self, module: torch.nn.Module, source: Any) -> None:
        super().__init__()
        self.module = module
        self.ejected = load(source)
        self.source = source
        if getattr(self.ejected, "KIND", None) != "training":
            raise InputError(
                f"fxad.compile(vjp=...) trains with a training split (forward and backward), "
                f"got a {getattr(self.ejected, 'KIND', 'non-ejected')!r} file",
                hint="eject it with fxad.eject(model, *inputs, kind='training') or "
                     "`fxad eject FILE.py:Net --kind training ...`")
        self.saved_names = returned_names(self.ejected.forward)[self.ejected.N_OUTPUTS:]
        self.last_saved: list[tuple[str, int]] | None = None
        self._examples: tuple | None = None

    def _guard(self, inputs: tuple) -> None:
        built = self.ejected.BUILT_FOR
        want = built["inputs"]
        if len(inputs) != len(want):
            raise InputError(f"the edited derivative was built for {len(want)} input(s), got "
                             f"{len(inputs)}")
        for i, (x, w) in enumerate(zip(inputs, want)):
            got = (tuple(x.shape), str(x.dtype), str(x.device)) \
                if isinstance(x, torch.Tensor) else ("value", repr(x))
            if got != tuple(w):
                raise InputError(
                    f"input {i} is {got}, but the edited derivative was built for {tuple(w)}",
                    hint="eject again for these inputs (fxad.eject(..., kind='training')) and "
                         "redo the edit")
        modes = sorted({m.training for m in self.module.modules()})
        if built.get("training") and modes != built["training"]:
            raise InputError(f"the model's training flags are {modes}, but the edited "
                             f"derivative was built for {built['training']}",
                             hint="call .train() / .eval() as when it was ejected")

    def forward(self, *inputs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.module(*inputs)
        self._guard(inputs)
        if self._examples is None:
            self._examples = tuple(x.detach().clone() if isinstance(x, torch.Tensor) else x
                                   for x in inputs)
            self._argnums = tuple(i for i, x in enumerate(inputs)
                                  if isinstance(x, torch.Tensor) and x.requires_grad)
        params = [self.module.get_parameter(n) for n in self.ejected.PARAMS]
        return _EditedBridge.apply(self, len(inputs), *inputs, *params)

    def report(self) -> str:
        """The saved tensors of the last call, beside fxad's own split (policy ``"save"``) at
        the same inputs."""
        if self.last_saved is None or self._examples is None:
            raise InputError("nothing run yet: call the module first")
        mine = self.last_saved
        total = sum(b for _, b in mine)
        lines = [f"edited split ({self.source}): saved for backward {len(mine)} values, "
                 f"{_fmt(total)}: " + ", ".join(f"{n} ({_fmt(b)})" for n, b in mine)]
        part = partition(_vjp(self.module, *self._examples, argnums=self._argnums), "save")
        lines.append(f"fxad's split (policy 'save'): saved for backward "
                     f"{len(part.saved_names)} values, {_fmt(part.saved_bytes)}: "
                     + ", ".join(part.saved_names))
        return "\n".join(lines)


def edited_joint_step(model: torch.nn.Module, source: Any, example_inputs: tuple,
                      compile: bool | str, compile_kwargs: dict) -> Any:
    """``fxad.joint_step(model, *inputs, vjp=FILE)``: the edited training split as one step
    ``step(*inputs) -> (loss, input_grads, param_grads)``: the edited ``forward``, then its
    ``backward`` with cotangent 1 (``param_grads`` by name, zeros for unused parameters),
    the file's guards checked first; through ``torch.compile`` when ``compile`` is true
    (``compile="eager"`` etc. picks the backend)."""
    em = EditedModule(model, source)
    if example_inputs:
        em._guard(example_inputs)
    mod = em.ejected
    if mod.N_OUTPUTS != 1:
        raise InputError("fxad.joint_step needs a model whose output is one floating-point "
                         "scalar (the loss)")

    def run(*inputs: Any) -> Any:
        res = mod.forward(model, *inputs)
        loss = res[0]
        grads = mod.backward(model, [*res[1:], torch.ones_like(loss)])
        n = len(inputs)
        params = dict(model.named_parameters())
        pg = {k: torch.zeros_like(params[k]) if g is None else g
              for k, g in zip(mod.PARAMS, grads[n:])}
        return loss, tuple(grads[:n]), pg

    fn: Any = run
    if compile:
        fn = torch.compile(run, backend=compile if isinstance(compile, str) else "inductor",
                           **compile_kwargs)

    def step(*inputs: Any) -> Any:
        em._guard(inputs)
        with torch.no_grad():
            return fn(*inputs)

    step.ejected = mod  # type: ignore[attr-defined]
    return step
