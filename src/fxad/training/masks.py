"""Constant causal attention masks as ``is_causal=True``, in the code built to run
(:func:`fxad.compile`, :func:`fxad.joint_step`; :func:`fxad.vjp` keeps the mask).

Under fxad's capture ``torch.compiler.is_compiling()`` is True (as under ``torch.compile``),
so transformers builds the causal mask of a decoder explicitly from constants
(``arange``, indexing, ``le``, ``&``, ``where`` ...) and passes it as ``attn_mask`` to
``F.scaled_dot_product_attention``, where eager transformers passes ``is_causal=True``
without a mask.  The mask then costs its construction, a saved residual, and the masked
kernels, which visit every key block, where the causal kernels skip the blocks above the
diagonal.

:func:`causal_masks_as_flags` finds the attention calls (``F.scaled_dot_product_attention``,
PyTorch's CPU flash-attention forward ``_scaled_dot_product_flash_attention_for_cpu`` and
its backward, the CUDA memory-efficient forward
``_scaled_dot_product_efficient_attention`` and its backward, whose mask is their
``attn_bias``) whose ``attn_mask`` is computed only from constants: every node it depends
on is a pure, deterministic call (no placeholder, parameter, buffer, module call, random draw,
uninitialized memory, in-place method or side effect), so that its value is the same on
every call of the built code.  It evaluates that mask once, at build time, and where the
value is exactly SDPA's causal pattern for the call's ``(L, S)`` = (query length, key
length) broadcast over the leading dimensions (boolean: True at ``j <= i`` and False
elsewhere; additive float: 0 at ``j <= i`` and ``-inf`` elsewhere; the top-left alignment of
``is_causal``, ``torch.ones(L, S).tril()``, also for ``L != S``), it calls the attention
with ``is_causal=True`` and no mask: the same function (no row is fully masked, so the
masked and causal kernels agree; gradients are checked against autograd in
``tests/test_causal_masks.py``).  Every call that reads the mask must qualify (the forward
kernel and its backward are rewritten together, since the backward kernel reads the
forward's logsumexp); the mask's constant subgraph, then unread, is erased.  Anything else
(a mask depending on an input, a non-causal constant mask, ``-1e9`` in place of ``-inf``)
is left as it is.  Where the training bridge captures the program before differentiating
it (under autocast), the pass also runs on the captured graph first, so that the rules see
``is_causal=True`` without a mask and pick the kernels for that (on CUDA in half
precision: flash attention, which takes no mask).
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..rules.registry import is_random_call
from ..simplify._util import is_impure

__all__ = ["causal_masks_as_flags", "is_causal_pattern", "MAX_MASK_ELEMENTS"]

#: constant masks larger than this are not evaluated (a build-time cost bound)
MAX_MASK_ELEMENTS = 1 << 24

_SDPA_NAMES = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale",
               "enable_gqa")
_KERNELS = ("_scaled_dot_product_flash_attention_for_cpu",
            "_scaled_dot_product_flash_attention_for_cpu_backward",
            "_scaled_dot_product_efficient_attention",
            "_scaled_dot_product_efficient_attention_backward")


def _kernel_overloads() -> dict[Any, tuple[str, ...]]:
    """The attention kernels of this torch that take a mask (packet and default overload)
    -> argument names (the CUDA memory-efficient kernels' ``attn_bias`` named
    ``attn_mask`` here, as the other kernels name it)."""
    out: dict[Any, tuple[str, ...]] = {}
    for name in _KERNELS:
        packet = getattr(torch.ops.aten, name, None)
        try:
            schema = packet.default._schema  # type: ignore[union-attr]
        except (AttributeError, RuntimeError):
            continue
        names = tuple("attn_mask" if a.name == "attn_bias" else a.name
                      for a in schema.arguments)
        if "attn_mask" in names and "is_causal" in names:
            out[packet] = names
            out[packet.default] = names  # type: ignore[union-attr]
    return out


_KERNEL_NAMES = _kernel_overloads()


def _argument_names(n: fx.Node) -> tuple[str, ...] | None:
    """The parameter names of an attention call ``n`` in order, or None for another node."""
    if n.op != "call_function":
        return None
    if n.target is F.scaled_dot_product_attention:
        return _SDPA_NAMES
    return _KERNEL_NAMES.get(n.target)


def _arg(n: fx.Node, names: tuple[str, ...], name: str, default: Any = None) -> Any:
    if name in n.kwargs:
        return n.kwargs[name]
    if name == "attn_mask" and "attn_bias" in n.kwargs:
        return n.kwargs["attn_bias"]
    i = names.index(name)
    return n.args[i] if i < len(n.args) else default


def _constant_subgraph(mask: fx.Node) -> list[fx.Node] | None:
    """The nodes ``mask`` is computed from (itself included), in graph order, when each is
    a pure deterministic call whose inputs are such nodes or literals; else None."""
    seen: dict[fx.Node, None] = {}
    stack = [mask]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        if n.op not in ("call_function", "call_method") or is_impure(n) \
                or is_random_call(n) or n.meta.get("fxad_side_effect"):
            return None
        seen[n] = None
        stack.extend(n.all_input_nodes)
    order = {n: i for i, n in enumerate(mask.graph.nodes)}
    return sorted(seen, key=order.__getitem__)


def _stored_elements(t: torch.Tensor) -> int:
    """The elements ``t`` holds in memory: its size without the dimensions it repeats by
    a zero stride (a mask expanded to ``(B, H, L, S)`` holds ``L * S``)."""
    return math.prod(n for n, st in zip(t.shape, t.stride()) if st != 0)


def _unexpanded(t: torch.Tensor) -> torch.Tensor:
    """``t`` with each dimension it repeats by a zero stride narrowed to one element (the
    same pattern, broadcast)."""
    for d, (n, st) in enumerate(zip(t.shape, t.stride())):
        if st == 0 and n > 1:
            t = t.narrow(d, 0, 1)
    return t


def _evaluate(gm: fx.GraphModule, nodes: list[fx.Node]) -> Any:
    """The value of the last of ``nodes`` (a constant subgraph, :func:`_constant_subgraph`),
    computed on real tensors with autocast off; None where that fails."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in nodes:
        env[n] = g.node_copy(n, lambda a: env[a])
    g.output(env[nodes[-1]])
    try:
        run = fx.GraphModule(gm, g)
        with torch.no_grad(), torch.autocast("cpu", enabled=False):
            return run()
    except Exception:  # noqa: BLE001 - a mask not evaluable here stays as it is
        return None


def is_causal_pattern(mask: torch.Tensor, q_shape: tuple, L: int, S: int) -> bool:
    """``mask`` (boolean, or an additive float mask) applied to queries of shape
    ``q_shape`` (``(..., L, E)``) and ``S`` keys is exactly ``is_causal=True`` of
    ``F.scaled_dot_product_attention``: allowed at ``j <= i`` (top-left), masked elsewhere,
    equally over its leading dimensions, which broadcast into the query's (so that the
    output's shape does not depend on the mask)."""
    if not isinstance(mask, torch.Tensor) or mask.dim() < 2 or mask.dim() > len(q_shape) \
            or mask.layout != torch.strided or mask.numel() == 0:
        return False
    if mask.shape[-1] not in (1, S) or mask.shape[-2] not in (1, L):
        return False
    lead = len(q_shape) - mask.dim()
    if any(m not in (1, q) for m, q in zip(mask.shape[:-2], q_shape[lead:-2])):
        return False
    m = mask.expand(*mask.shape[:-2], L, S)
    if m.dtype == torch.bool:
        allowed = m
    elif m.is_floating_point():
        allowed = m == 0
        if not bool((allowed | (m == float("-inf"))).all()):
            return False
    else:
        return False
    causal = torch.ones(L, S, dtype=torch.bool, device=m.device).tril()
    return bool((allowed == causal).all())


def _qualifies(n: fx.Node, names: tuple[str, ...], value: torch.Tensor) -> bool:
    q, k = _arg(n, names, "query"), _arg(n, names, "key")
    qv = q.meta.get("val") if isinstance(q, fx.Node) else None
    kv = k.meta.get("val") if isinstance(k, fx.Node) else None
    if not (isinstance(qv, torch.Tensor) and isinstance(kv, torch.Tensor)
            and qv.dim() >= 2 and kv.dim() >= 2
            and all(type(s) is int for s in (*qv.shape, *kv.shape))):
        return False
    return is_causal_pattern(value, tuple(qv.shape), qv.shape[-2], kv.shape[-2])


def _as_causal(n: fx.Node, names: tuple[str, ...]) -> None:
    """Drop ``n``'s ``attn_mask`` and set its ``is_causal`` to True."""
    args, kwargs = list(n.args), dict(n.kwargs)
    i_mask, i_causal = names.index("attn_mask"), names.index("is_causal")
    if "attn_mask" in kwargs or "attn_bias" in kwargs:
        kwargs.pop("attn_mask", None)
        kwargs.pop("attn_bias", None)
    elif i_mask < len(args):
        args[i_mask] = None
    if "is_causal" in kwargs or i_causal >= len(args):
        kwargs["is_causal"] = True
    else:
        args[i_causal] = True
    n.args, n.kwargs = tuple(args), kwargs


def causal_masks_as_flags(gm: fx.GraphModule) -> int:
    """Rewrite the attention calls of ``gm`` whose constant ``attn_mask`` is the causal
    pattern to ``is_causal=True`` without a mask (see the module docstring) and erase the
    mask's unread constant subgraph.  Needs ``meta['val']`` on the query and key.  Returns
    the number of attention calls rewritten (recompiling ``gm`` when there are any)."""
    g = gm.graph
    readers: dict[fx.Node, list[tuple[fx.Node, tuple[str, ...]]]] = {}
    for n in g.nodes:
        names = _argument_names(n)
        if names is None:
            continue
        m = _arg(n, names, "attn_mask")
        if isinstance(m, fx.Node):
            readers.setdefault(m, []).append((n, names))
    done = 0
    for mask, calls in readers.items():
        # every attention call reading the mask qualifies, or none is rewritten
        mv = mask.meta.get("val")
        if not isinstance(mv, torch.Tensor) or _stored_elements(mv) > MAX_MASK_ELEMENTS:
            continue
        nodes = _constant_subgraph(mask)
        if nodes is None:
            continue
        value = _evaluate(gm, nodes)
        if not isinstance(value, torch.Tensor) or value.shape != mv.shape \
                or value.dtype != mv.dtype:
            continue
        value = _unexpanded(value)
        if not all(_qualifies(n, names, value) for n, names in calls):
            continue
        for n, names in calls:
            _as_causal(n, names)
            done += 1
        for n in reversed(nodes):  # the constant subgraph, outputs first
            if not n.users:
                g.erase_node(n)
    if done:
        g.lint()
        gm.recompile()
    return done
