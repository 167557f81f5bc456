"""The graphs the training wrappers run: the model captured in the current autocast state
with autocast's casts made explicit (:func:`materialize_autocast`), differentiated for
execution (:func:`_vjp_graph`: fused backward kernels, channels-last convolution weights),
and run with autocast off (:class:`_AutocastOff`).  See :mod:`fxad.training`."""
from __future__ import annotations

import contextlib
from typing import Any, Iterable, Iterator

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from ..api import trace as _trace
from ..api import vjp as _vjp
from ..capture.decisions import current_policy
from ..naming import op_kind
from ..rules import fused
from ..simplify.layout import channels_last_convolutions
from .masks import causal_masks_as_flags
from .padding import pad_unaligned_matmuls
from .passes import (drop_whole_writes, stack_selected_cotangents, sum_to_size_as_sum,
                     zeros_of_shape)

__all__ = ["autocast_state", "materialize_autocast", "AUTOCAST_LOWER_OPS"]


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


@contextlib.contextmanager
def _one_recompile(gm: fx.GraphModule) -> Iterator[None]:
    """Passes that each end with ``gm.recompile()`` regenerate ``gm``'s code once, on exit,
    instead of after each one (a pass edits ``gm.graph``; none reads the code).  Each
    regeneration of a training graph's code costs 0.1-0.2 s on a 12-layer GPT-2."""
    stale: list[bool] = []
    gm.recompile = lambda: stale.append(True)  # type: ignore[method-assign]
    try:
        yield
    finally:
        del gm.recompile
        if stale:
            gm.recompile()


def _capture_for_autocast(model: Any, inputs: tuple, leaf_modules: Iterable[type]) -> Any:
    """``model`` itself outside autocast; inside, its graph with explicit casts."""
    if not any(on for _, on, _ in autocast_state()):
        return model
    gm = _trace(model, *inputs, leaf_modules=leaf_modules)
    materialize_autocast(gm)
    return gm


def _default_layout() -> str | bool:
    """What ``channels_last=None`` means in :func:`joint_step` and :func:`compile`: the
    convolution weights autocast casts go channels-last (``"casts"``: the cast copies them
    anyway) where oneDNN runs the CPU convolutions, none elsewhere (see the package doc)."""
    onednn = torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled
    return "casts" if onednn else False


def _vjp_graph(model: Any, inputs: tuple, argnums: Any, leaf_modules: Iterable[type],
               channels_last: bool | str = False, dynamic_shapes: Any = None) -> fx.GraphModule:
    """``fxad.vjp`` of ``model`` as captured in the current autocast state (casts explicit),
    differentiated with autocast off; run the result under ``_AutocastOff``.
    The code is built to run, not to be read: fused backward kernels at level ``"all"``
    (relu's ``threshold_backward``; :mod:`fxad.rules.fused`) unless switched off, and CPU
    convolution weights channels-last (:mod:`fxad.simplify.layout`) when
    ``channels_last`` (``"casts"``: only the weights autocast casts); the rewrites of
    :mod:`fxad.training.passes` that remove work eager autograd does not do, and constant
    causal attention masks as ``is_causal=True`` (:mod:`fxad.training.masks`); on CUDA,
    half-precision matrix products of unaligned sizes padded (:mod:`fxad.training.padding`).
    ``dynamic_shapes``
    (a tuple in argument order, :mod:`fxad.symbolic`): build on symbolic sizes."""
    f = _capture_for_autocast(model, inputs, leaf_modules)
    if isinstance(f, fx.GraphModule):  # a captured graph (autocast): rules see the flag
        with _AutocastOff(_autocast_devices()):
            causal_masks_as_flags(f)
    with _AutocastOff(_autocast_devices()), fused.for_execution():
        g = _vjp(f, *inputs, argnums=argnums, leaf_modules=leaf_modules,
                 dynamic_shapes=dynamic_shapes, values=current_policy())
    # the passes compute the dtypes of the nodes they write with autocast off, as the code
    # runs (CUDA autocast would give torch.sum a float32 result: a cast then looks redundant)
    with _AutocastOff(_autocast_devices()), _one_recompile(g):
        causal_masks_as_flags(g)
        pad_unaligned_matmuls(g)
        stack_selected_cotangents(g)
        drop_whole_writes(g)
        zeros_of_shape(g)
        sum_to_size_as_sum(g)
        if channels_last:
            channels_last_convolutions(g, casts_only=channels_last == "casts")
    return g
