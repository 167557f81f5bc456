"""Channels-last convolution weights, for VJP graphs that are run on the CPU.

oneDNN (mkldnn), which runs PyTorch's CPU convolutions, is faster on NHWC (channels-last)
data than on NCHW, and a convolution runs NHWC when its input *or its weight* is
channels-last; its output is then channels-last too, and so is everything elementwise
downstream (batch norm, ReLU, residual adds), including the next convolution's input.  So
storing only the 2-D convolution weights channels-last moves the whole network's
activations and cotangents to NHWC, with no copy of any activation.

:func:`channels_last_convolutions` does that inside a VJP graph (the output of
:func:`fxad.vjp`'s graph builder: ``(outputs, input_grads, param_grads)``), for each
parameter that is a 4-D contiguous CPU tensor used as a convolution weight (forward
``torch.conv2d`` or ``convolution_backward``), directly or through one dtype cast:

* the weight, or its cast when that feeds only convolutions, is copied once to
  channels-last, ``w_nhwc = w.contiguous(memory_format=torch.channels_last)`` (a cheap op:
  the residual policies recompute it rather than save it);
* the parameter's gradient, channels-last like the weight the convolution saw, is returned
  in the parameter's own (contiguous) layout, ``.contiguous(memory_format=
  torch.contiguous_format)``, applied before its final cast to float32 when it has one.

Under autocast the layout change and the cast are separate copies: PyTorch's eager CPU copy
that casts *and* permutes is slow (a 128x128x3x3 float32 weight to channels-last bfloat16:
143 µs in one copy, 20 + 46 µs as a cast then a bfloat16 permute; its gradient back: 116
against 68 µs); inductor fuses the two into one kernel either way.

Values are unchanged; only strides differ, and oneDNN's NHWC kernels may round differently
(gradients agree with autograd's NCHW ones to float tolerance, not bit for bit).  This is
the layout change inductor makes for CPU convolutions ("layout optimization"), done at the
source level, where no activation has to be stored twice.  Not part of
:data:`fxad.simplify.PASSES`: :func:`fxad.joint_step` applies it by default on the CPU,
:func:`fxad.compile` by default only to the weights autocast casts (``casts_only``;
``channels_last=`` in both; :mod:`fxad.training` says why and gives the figures).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from ..graph.proxy import fetch_attr, is_dtype_cast

__all__ = ["channels_last_convolutions", "convolution_weight_slot"]

_CONV_BACKWARD = (torch.ops.aten.convolution_backward,
                  torch.ops.aten.convolution_backward.default)


def convolution_weight_slot(n: fx.Node) -> int | None:
    """Position of the weight among ``n.args`` when ``n`` is a 2-D convolution (forward
    ``torch.conv2d`` or ATen ``convolution_backward``), else None."""
    if n.op != "call_function":
        return None
    if n.target is torch.conv2d or n.target is torch.nn.functional.conv2d:
        return 1 if len(n.args) > 1 else None
    if n.target in _CONV_BACKWARD:
        return 2
    return None


def _movable(gm: fx.GraphModule, n: Any) -> bool:
    """Whether ``n`` reads (``get_attr``) a 4-D contiguous floating CPU tensor that is not
    already channels-last: a weight this pass may move."""
    if not isinstance(n, fx.Node) or n.op != "get_attr":
        return False
    try:
        t = fetch_attr(gm, n.target)
    except AttributeError:
        return False
    return (isinstance(t, torch.Tensor) and t.dim() == 4 and t.is_floating_point()
            and t.device.type == "cpu" and t.is_contiguous()
            and not t.is_contiguous(memory_format=torch.channels_last))


def _only_weight_of_convolutions(n: fx.Node) -> bool:
    """Whether every user of ``n`` is a convolution reading it as its weight."""
    for u in n.users:
        slot = convolution_weight_slot(u)
        if slot is None or u.args[slot] is not n:
            return False
    return True


def _restride(n: fx.Node, memory_format: torch.memory_format) -> None:
    """Give ``n.meta['val']`` (a fake tensor) the strides of ``memory_format``."""
    v = n.meta.get("val")
    if isinstance(v, torch.Tensor):
        n.meta["val"] = v.contiguous(memory_format=memory_format)


def channels_last_convolutions(gm: fx.GraphModule, *, casts_only: bool = False) -> int:
    """Move the 2-D convolution weights of the VJP graph ``gm`` to channels-last (see the
    module docstring); with ``casts_only``, only weights that reach their convolutions
    through a dtype cast (autocast's), which are copied on every step anyway.  Returns the
    number of parameters moved (and recompiles ``gm`` when there are any)."""
    graph = gm.graph
    out = graph.output_node()
    result = out.args[0]
    if not (isinstance(result, (tuple, list)) and len(result) > 2
            and isinstance(result[2], dict)):
        return 0  # no parameter gradients in this graph: nothing to keep consistent
    moved: set[str] = set()
    nhwc: dict[fx.Node, fx.Node] = {}  # weight (parameter or its cast) -> channels-last copy
    for conv in list(graph.nodes):
        slot = convolution_weight_slot(conv)
        if slot is None:
            continue
        w = conv.args[slot]
        if not isinstance(w, fx.Node):
            continue
        w_cl = nhwc.get(w)
        if w_cl is None:
            if is_dtype_cast(w) and _movable(gm, w.args[0]) \
                    and _only_weight_of_convolutions(w):
                moved.add(w.args[0].target)
            elif not casts_only and _movable(gm, w):
                moved.add(w.target)
            else:
                continue
            with graph.inserting_after(w):
                w_cl = graph.create_node("call_method", "contiguous", (w,),
                                         {"memory_format": torch.channels_last},
                                         name=f"{w.name}_nhwc")
            w_cl.meta = dict(w.meta)
            _restride(w_cl, torch.channels_last)
            nhwc[w] = w_cl
        conv.args = conv.args[:slot] + (w_cl,) + conv.args[slot + 1:]
    if not moved:
        return 0
    grads = dict(result[2])
    for name in sorted(moved):
        g = grads.get(name)
        if not isinstance(g, fx.Node):
            continue
        # (an explicit memory_format: the simplifier drops a bare .contiguous() of a value
        # whose recorded strides, from before this pass, are contiguous)
        src = g.args[0] if is_dtype_cast(g) and len(g.users) == 1 else g
        with graph.inserting_after(src):
            g_c = graph.create_node("call_method", "contiguous", (src,),
                                    {"memory_format": torch.contiguous_format},
                                    name=f"{src.name}_nchw")
        g_c.meta = dict(src.meta)
        if src is g:
            grads[name] = g_c
        else:  # permute before the cast to float32: half the bytes to move
            g.args = (g_c, g.args[1])
    out.args = ((*result[:2], grads, *result[3:]),)
    graph.lint()
    gm.recompile()
    return len(moved)
