"""Rule for ``F.scaled_dot_product_attention`` (masks, causal, ``scale``, grouped-query
``enable_gqa``, dropout with a mask saved for the backward).

The forward calls the op itself for the value; the backward recomputes the attention
weights in plain tensor code (the formulas are in the rule's docstring), or calls PyTorch's
fused CPU flash-attention backward where :mod:`fxad.rules.fused` allows it
(``docs/fused_kernels.md``): without a mask at the default level, with a boolean or
additive mask (with or without ``is_causal``) at level ``"all"`` (code built to run:
:func:`fxad.compile`, :func:`fxad.joint_step`) where this torch's kernels take a mask
(:data:`CPU_FLASH_TAKES_MASK`, read from their schemas).  So the readable and the run forms
differ for a masked attention: :func:`fxad.vjp` shows the formulas of
:class:`ScaledDotProductAttention`, the training code calls the kernels
(:class:`ScaledDotProductAttentionFusedMask`); there, a mask computed from constants alone
that is exactly the causal pattern (transformers' decoders build one under capture) becomes
``is_causal=True`` without a mask (:mod:`fxad.training.masks`).  On CUDA the rules call
PyTorch's CUDA flash attention (half precision, no mask) or memory-efficient attention
(float32, or a mask as its additive bias) forward and backward, as eager SDPA picks them
(:class:`ScaledDotProductAttentionCudaFlash`,
:class:`ScaledDotProductAttentionCudaEfficient`: the kernel eager's dispatch picks, flash
where it picks cuDNN attention).  With ``dropout_p > 0`` both forms write the probabilities
out (:class:`ScaledDotProductAttentionDropout`), as eager PyTorch's CPU dispatch runs its
math reference with dropout.  Configurations the rule cannot
differentiate exactly raise :class:`~fxad.errors.RuleError` naming what to change.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import unset_fake_temporarily

from .. import fused
from .._base import guard_layout, randn, _add
from ..registry import needs_cotangent, register_vjp
from ._common import _bound


# --- attention ------------------------------------------------------------------------------


def _sdpa_scores(q: Any, k: Any, attn_mask: Any, is_causal: bool, scale: float) -> Any:
    """softmax(q k^T * scale + mask): the attention probabilities, recomputed."""
    s = (q @ k.mT) * scale
    if is_causal:
        L, S = q.shape[-2], k.shape[-2]
        above = q.new_ones((L, S), dtype=torch.bool).triu(1)
        s = s.masked_fill(above, float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            s = s.masked_fill(attn_mask.logical_not(), float("-inf"))
        else:
            s = s + attn_mask
    return torch.softmax(s, -1)


def _sdpa_check(q: Any, k: Any, enable_gqa: bool) -> int:
    """Number of query heads per key head (1 without grouped-query attention)."""
    if enable_gqa and q.dim() >= 3 and k.shape[-3] != q.shape[-3]:
        return q.shape[-3] // k.shape[-3]
    return 1


def _sdpa_dropout_fwd(q: Any, k: Any, v: Any, mask: Any, dropout_p: float, is_causal: bool,
                      scale: Any, group: int) -> tuple[Any, Any, Any]:
    """Attention with dropout on the probabilities, written out: ``(P * M) v`` with the
    dropout mask ``M = bernoulli(1 - p) / (1 - p)`` drawn in the generated forward as eager
    PyTorch's CPU attention draws it (``empty_like(P).bernoulli_(1 - p)``: the same masks
    under the same seed).
    Returns ``(out, P, M)``."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if group > 1:
        k, v = k.repeat_interleave(group, -3), v.repeat_interleave(group, -3)
    p = _sdpa_scores(q, k, mask, is_causal, scale)
    keep = torch.empty_like(p).bernoulli_(1.0 - dropout_p) / (1.0 - dropout_p)
    return (p * keep) @ v, p, keep


def _sdpa_scores_vjp(q: Any, k: Any, mask: Any, p: Any, d_v: Any, dp: Any, scale: float,
                     group: int) -> tuple[Any, Any, Any, Any]:
    """Cotangents of q, k, v and a float mask from those of the probabilities (``dp``) and of
    v (``d_v``): dS = P * (dP - sum(dP * P, -1)), d_q = dS k * scale, d_k = dS^T q * scale,
    summed over each group of repeated key/value heads."""
    ds = p * (dp - (dp * p).sum(-1, keepdim=True))
    d_q = (ds @ k) * scale
    d_k = (ds.mT @ q) * scale
    if group > 1:
        d_k = d_k.unflatten(-3, (d_k.shape[-3] // group, group)).sum(-3)
        d_v = d_v.unflatten(-3, (d_v.shape[-3] // group, group)).sum(-3)
    d_mask = ds if mask is not None and mask.dtype != torch.bool else None
    return d_q, d_k, d_v, d_mask


def _cpu_flash_ok(q: Any, k: Any, v: Any, mask: Any, enable_gqa: bool) -> bool:
    """The CPU flash-attention kernels apply (the conditions of PyTorch's CPU dispatch,
    ``sdp_utils_cpp``): 4-D CPU float inputs of one dtype, equal batch, heads and head size,
    unit stride in the last dimension (the kernels read a strided last dimension wrongly
    instead of refusing it), no mask."""
    return mask is None and _cpu_flash_shapes_ok(q, k, v, enable_gqa)


def _cpu_flash_shapes_ok(q: Any, k: Any, v: Any, enable_gqa: bool) -> bool:
    return (not enable_gqa and q.dim() == 4 and k.dim() == 4 and v.dim() == 4
            and all(t.device.type == "cpu" for t in (q, k, v))
            and q.dtype in (torch.float32, torch.float64, torch.bfloat16)
            and q.dtype == k.dtype == v.dtype
            and q.shape[0] == k.shape[0] == v.shape[0] and q.shape[1] == k.shape[1] == v.shape[1]
            and q.shape[-1] == k.shape[-1] == v.shape[-1] and min(q.shape[-2], k.shape[-2]) > 0
            and all(t.stride(-1) == 1 for t in (q, k, v))
            and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward"))


def _takes_attn_mask(name: str) -> bool:
    """Whether ``torch.ops.aten.<name>`` exists and its schema has an ``attn_mask`` argument
    (the CPU flash-attention kernels take one since PyTorch 2.3; read from the schema at run
    time so that another torch build without it gets the formulas instead of a call that
    fails)."""
    try:
        schema = getattr(torch.ops.aten, name).default._schema
    except (AttributeError, RuntimeError):
        return False
    return any(a.name == "attn_mask" for a in schema.arguments)


#: the CPU flash-attention forward and backward kernels of this torch take a mask
CPU_FLASH_TAKES_MASK = all(_takes_attn_mask(f"_scaled_dot_product_flash_attention_for_cpu{s}")
                           for s in ("", "_backward"))


def _cpu_flash_mask_ok(q: Any, mask: Any) -> bool:
    """A mask the CPU flash kernels take once converted (:func:`_flash_mask`): boolean, or
    floating-point of the query's dtype, broadcastable to ``(B, H, L, S)`` (checked by the
    capture), with a unit stride in its last dimension; and kernels of this torch that take
    a mask (:data:`CPU_FLASH_TAKES_MASK`)."""
    return (CPU_FLASH_TAKES_MASK and mask is not None and 2 <= mask.dim() <= 4
            and mask.device.type == "cpu"
            and (mask.dtype == torch.bool or mask.dtype == q.dtype)
            and (mask.shape[-1] == 1 or mask.stride(-1) == 1))


def _guard_unit_stride(*tensors: Any) -> None:
    """The CPU flash kernels read the last dimension of q, k and v as contiguous (chosen for
    the traced strides, :func:`_cpu_flash_shapes_ok`; eager PyTorch takes its math path
    otherwise, the kernels compute garbage; a mask of any strides they take): a guard line
    per tensor refuses a call where one has another stride there
    (:func:`fxad.rules._base.expect_layout`)."""
    for t in tensors:
        guard_layout(t, "F.scaled_dot_product_attention", "last")


def _flash_mask(mask: Any, dtype: torch.dtype) -> Any:
    """``mask`` as the CPU flash kernels take it: additive, of the query's dtype (a boolean
    mask becomes 0 where True and -inf where False, as eager PyTorch converts it; a floating
    one detached), 2-D or 4-D (a 3-D mask gets a leading 1: the same broadcast)."""
    if mask.dtype == torch.bool:
        mask = torch.where(mask, 0.0, float("-inf"))
        if dtype != torch.float32:
            mask = mask.to(dtype)
    else:  # the kernels refuse a mask that requires grad (a learned bias: see the rule)
        mask = mask.detach()
    if mask.dim() == 3:
        mask = mask.unsqueeze(0)
    return mask


@register_vjp(F.scaled_dot_product_attention)
class ScaledDotProductAttention:
    """y = P v with P = softmax(q k^T * scale + mask) (causal: upper triangle masked to -inf;
    bool mask: False masked to -inf; float mask added).  Backward recomputes P:
    d_v = P^T d; dP = d v^T; dS = P * (dP - sum(dP * P, -1)); d_q = dS k * scale;
    d_k = dS^T q * scale; a float mask gets dS (derivatives.yaml
    `_scaled_dot_product_flash_attention` / math reference `_scaled_dot_product_attention_math`).
    ``enable_gqa``: k and v heads are repeated (repeat_interleave) and their cotangents summed
    over each group.

    ``dropout_p > 0``: the probabilities are computed in the generated forward and multiplied
    by a dropout mask ``M = bernoulli(1 - p) / (1 - p)`` (drawn as eager PyTorch draws it)
    saved for the backward, y = (P*M) v
    (as PyTorch's math reference does; the mask differs from the fused kernel's for the same
    seed, with the same distribution): d_v = (P*M)^T d, dP = (d v^T) * M, then as above."""

    residuals = "inputs+output+intermediates"
    recompute = False

    def fwd(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
            enable_gqa=False):
        kw: dict[str, Any] = {}
        if attn_mask is not None:
            kw["attn_mask"] = attn_mask
        if is_causal:
            kw["is_causal"] = True
        if scale is not None:
            kw["scale"] = scale
        if enable_gqa:
            kw["enable_gqa"] = True
        out = F.scaled_dot_product_attention(query, key, value, **kw)
        return out, (query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)

    def bwd(aux, d):
        q, k, v, mask, dropout_p, is_causal, scale, enable_gqa = aux
        group = _sdpa_check(q, k, enable_gqa)
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
        if group > 1:
            k = k.repeat_interleave(group, -3)
            v = v.repeat_interleave(group, -3)
        p = _sdpa_scores(q, k, mask, is_causal, scale)
        d_v = p.mT @ d
        dp = d @ v.mT
        return _sdpa_scores_vjp(q, k, mask, p, d_v, dp, scale, group)

    def jvp(primals, tangents):
        pr, t = _bound(ScaledDotProductAttention.fwd, primals, tangents)
        q, k, v, mask = pr["query"], pr["key"], pr["value"], pr["attn_mask"]
        group = _sdpa_check(q, k, pr["enable_gqa"])
        keep = None
        if pr["dropout_p"] > 0.0:
            out, _, keep = _sdpa_dropout_fwd(q, k, v, mask, pr["dropout_p"], pr["is_causal"],
                                             pr["scale"], group)
        else:
            out = F.scaled_dot_product_attention(q, k, v, mask, 0.0, pr["is_causal"],
                                                 scale=pr["scale"], enable_gqa=pr["enable_gqa"])
        scale = 1.0 / math.sqrt(q.shape[-1]) if pr["scale"] is None else pr["scale"]
        tk, tv = t["key"], t["value"]
        if group > 1:
            k, v = k.repeat_interleave(group, -3), v.repeat_interleave(group, -3)
            tk = None if tk is None else tk.repeat_interleave(group, -3)
            tv = None if tv is None else tv.repeat_interleave(group, -3)
        p = _sdpa_scores(q, k, mask, pr["is_causal"], scale)
        ts = None
        if t["query"] is not None:
            ts = (t["query"] @ k.mT) * scale
        if tk is not None:
            ts = _add(ts, (q @ tk.mT) * scale)
        if t["attn_mask"] is not None:
            ts = _add(ts, t["attn_mask"])
        pk = p if keep is None else p * keep
        t_out = None
        if ts is not None:
            tp = p * (ts - (ts * p).sum(-1, keepdim=True))
            t_out = (tp if keep is None else tp * keep) @ v
        if tv is not None:
            t_out = _add(t_out, pk @ tv)
        return out, t_out

    def samples(dtype):
        q, k = randn(2, 3, 4, dtype=dtype), randn(2, 5, 4, dtype=dtype)
        v = randn(2, 5, 3, dtype=dtype)
        yield (q, k, v), {}
        yield (randn(2, 2, 4, 3, dtype=dtype), randn(2, 2, 4, 3, dtype=dtype),
               randn(2, 2, 4, 3, dtype=dtype)), {"is_causal": True}
        yield (q, k, v, randn(3, 5, dtype=dtype)), {"scale": 0.3}
        yield (q, k, v, torch.tensor([[True, False, True, True, False]] * 3)), {}
        yield (randn(1, 4, 3, 2, dtype=dtype), randn(1, 2, 5, 2, dtype=dtype),
               randn(1, 2, 5, 3, dtype=dtype)), {"enable_gqa": True}


@register_vjp(F.scaled_dot_product_attention)
class ScaledDotProductAttentionDropout:
    """``dropout_p > 0``: y = (P*M) v with the dropout mask M drawn in the generated forward
    and saved; d_v = (P*M)^T d, dP = (d v^T) * M, then as without dropout."""

    residuals = "inputs+output+intermediates"
    recompute = False

    def applies(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                enable_gqa=False):
        return dropout_p > 0.0

    def fwd(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
            enable_gqa=False):
        group = _sdpa_check(query, key, enable_gqa)
        out, p, keep = _sdpa_dropout_fwd(query, key, value, attn_mask, dropout_p, is_causal,
                                         scale, group)
        return out, (query, key, value, attn_mask, p, keep, scale, group)

    def bwd(aux, d):
        q, k, v, mask, p, keep, scale, group = aux
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
        if group > 1:
            k = k.repeat_interleave(group, -3)
            v = v.repeat_interleave(group, -3)
        d_v = (p * keep).mT @ d
        dp = (d @ v.mT) * keep
        return _sdpa_scores_vjp(q, k, mask, p, d_v, dp, scale, group)

    jvp = ScaledDotProductAttention.jvp


@register_vjp(F.scaled_dot_product_attention)
class ScaledDotProductAttentionFused:
    """Without dropout, for 4-D CPU float inputs of equal heads and no mask: PyTorch's CPU
    flash attention, whose logsumexp is saved for its fused backward kernel
    (``docs/fused_kernels.md``)."""

    residuals = "inputs+output+intermediates"
    recompute = False
    fused = True

    def applies(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                enable_gqa=False):
        return not dropout_p > 0.0 and _cpu_flash_ok(query, key, value, attn_mask, enable_gqa)

    def fwd(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
            enable_gqa=False):
        # CPU flash attention: save its logsumexp for the fused backward kernel
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, 0.0, bool(is_causal), scale=scale)
        _guard_unit_stride(query, key, value)
        return out, (query, key, value, out, lse, bool(is_causal), scale)

    def bwd(aux, d):
        q, k, v, out, lse, is_causal, scale = aux
        d_q, d_k, d_v = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            d, q, k, v, out, lse, 0.0, is_causal, scale=scale)
        return d_q, d_k, d_v, None

    jvp = ScaledDotProductAttention.jvp


@register_vjp(F.scaled_dot_product_attention)
class ScaledDotProductAttentionFusedMask:
    """Without dropout, with an ``attn_mask`` (boolean, or additive of the query's dtype),
    for 4-D CPU float inputs of equal heads: PyTorch's CPU flash attention with the mask, as
    eager PyTorch runs it (a boolean mask converted to an additive one, 0 where True and
    -inf where False), the logsumexp saved for its fused backward kernel, which takes the
    same mask (derivatives.yaml ``_scaled_dot_product_flash_attention_for_cpu``).  A
    floating mask whose cotangent is needed (a learned bias) gets the math backward
    instead, as :class:`ScaledDotProductAttention` with P = exp(S - logsumexp) from the
    kernel's logsumexp, d_mask = dS.

    Fused level ``"all"``: code built to run (:func:`fxad.compile`, :func:`fxad.joint_step`)
    calls the kernels, while :func:`fxad.vjp` at the default level keeps the formulas of
    :class:`ScaledDotProductAttention` (``docs/fused_kernels.md``).  Rows where every key
    is masked give 0 (the kernel's convention, eager's result) where the formulas give
    NaN."""

    residuals = "inputs+output+intermediates"
    recompute = False
    fused = "all"

    def applies(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                enable_gqa=False):
        return (not dropout_p > 0.0 and _cpu_flash_mask_ok(query, attn_mask)
                and _cpu_flash_shapes_ok(query, key, value, enable_gqa))

    def fwd(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
            enable_gqa=False):
        mask = _flash_mask(attn_mask, query.dtype)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, 0.0, bool(is_causal), attn_mask=mask, scale=scale)
        _guard_unit_stride(query, key, value)
        return out, (query, key, value, out, lse, attn_mask, mask, bool(is_causal), scale)

    def bwd(aux, d):
        q, k, v, out, lse, attn_mask, mask, is_causal, scale = aux
        if attn_mask.dtype != torch.bool and needs_cotangent("attn_mask"):
            # P = exp(S - logsumexp(S)) from the kernel's logsumexp (no second softmax)
            scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
            s = (q @ k.mT) * scale
            if is_causal:
                above = q.new_ones((q.shape[-2], k.shape[-2]), dtype=torch.bool).triu(1)
                s = s.masked_fill(above, float("-inf"))
            p = torch.exp(s + attn_mask - lse.unsqueeze(-1))
            return _sdpa_scores_vjp(q, k, attn_mask, p, p.mT @ d, d @ v.mT, scale, 1)
        d_q, d_k, d_v = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            d, q, k, v, out, lse, 0.0, is_causal, attn_mask=mask, scale=scale)
        return d_q, d_k, d_v, None

    jvp = ScaledDotProductAttention.jvp

    def samples(dtype):
        q, k, v = (randn(2, 3, 4, 5, dtype=dtype) for _ in range(3))
        keep = torch.rand(2, 1, 4, 4) > 0.4
        keep[..., 0] = True  # no row masked entirely (the formulas give NaN there)
        yield (q, k, v, keep), {}
        yield (q, k, v, keep[0, 0]), {"is_causal": True, "scale": 0.3}
        yield (q, k, v, randn(2, 3, 4, 4, dtype=dtype)), {}
        yield (q, randn(2, 3, 6, 5, dtype=dtype), randn(2, 3, 6, 5, dtype=dtype),
               randn(3, 1, 6, dtype=dtype)), {}


# --- CUDA: PyTorch's flash and memory-efficient attention kernels ---------------------------


#: device types the CUDA kernels serve (a test runs the rules' code on another device)
CUDA_DEVICE_TYPES = ("cuda",)


def _capability(device: Any) -> tuple[int, int]:
    """The compute capability of the GPU ``device`` (``torch.cuda.get_device_capability``)."""
    return torch.cuda.get_device_capability(device)


def _cuda_shapes_ok(q: Any, k: Any, v: Any, enable_gqa: bool) -> bool:
    """PyTorch's CUDA attention kernels apply (the conditions of PyTorch's CUDA dispatch,
    ``sdp_utils.cpp``, kept to the common case): 4-D CUDA inputs of one floating dtype
    (float16, bfloat16, float32), equal batch and heads, equal query and key head sizes,
    head sizes a multiple of 8, unit stride in the last dimension, no empty sequence."""
    return (not enable_gqa and q.dim() == 4 and k.dim() == 4 and v.dim() == 4
            and all(t.device.type in CUDA_DEVICE_TYPES for t in (q, k, v))
            and q.dtype in (torch.float16, torch.bfloat16, torch.float32)
            and q.dtype == k.dtype == v.dtype
            and q.shape[0] == k.shape[0] == v.shape[0] and q.shape[1] == k.shape[1] == v.shape[1]
            and q.shape[-1] == k.shape[-1] and k.shape[-2] == v.shape[-2]
            and q.shape[-1] % 8 == 0 and v.shape[-1] % 8 == 0
            and min(q.shape[-2], k.shape[-2]) > 0
            and all(t.stride(-1) == 1 for t in (q, k, v)))


def _cuda_flash_ok(q: Any, k: Any, v: Any, is_causal: bool, switch: bool = True) -> bool:
    """PyTorch's CUDA flash attention (FlashAttention-2) applies: float16 or bfloat16,
    equal head sizes of at most 256, a square causal mask (the kernel aligns a causal mask
    bottom-right where SDPA aligns it top-left), a GPU of compute capability 8.0 or later,
    and (``switch``) the backend not switched off (``torch.backends.cuda.enable_flash_sdp``,
    ``torch.nn.attention.sdpa_kernel``)."""
    return (q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] == v.shape[-1]
            and q.shape[-1] <= 256 and (not is_causal or q.shape[-2] == k.shape[-2])
            and (not switch or torch.backends.cuda.flash_sdp_enabled())
            and _capability(q.device) >= (8, 0))


# torch.nn.attention.SDPBackend's values
_FLASH, _EFFICIENT, _CUDNN = 1, 2, 3


def _eager_choice(q: Any, k: Any, v: Any, mask: Any, is_causal: bool, scale: Any,
                  enable_gqa: bool) -> int:
    """The backend eager SDPA picks for these inputs (``torch._fused_sdp_choice``, which
    follows the backend switches and ``torch.nn.attention.sdpa_kernel``), asked with
    stand-ins of the inputs (:func:`_stand_in`), or -1 where it cannot say."""
    try:
        with unset_fake_temporarily(), torch._C.DisableTorchFunction():
            args = [_stand_in(q, True), _stand_in(k, True), _stand_in(v, True),
                    None if mask is None else _stand_in(mask, False)]
            return int(torch._fused_sdp_choice(*args, 0.0, bool(is_causal), scale=scale,
                                               enable_gqa=bool(enable_gqa)))
    except Exception:  # noqa: BLE001 - another torch, or sizes it cannot read
        return -1


def _stand_in(t: Any, grad: bool) -> torch.Tensor:
    """An uninitialized tensor with ``t``'s sizes, strides, dtype and device (a fake value
    at capture has no storage, and the choice reads metadata only); ``grad``: requiring
    grad, as the query, key and value of a derivative do."""
    shape, stride = [_example_size(n) for n in t.shape], [_example_size(n) for n in t.stride()]
    x = torch.empty_strided(shape, stride, dtype=t.dtype, device=t.device)
    return x.requires_grad_(grad and t.is_floating_point())


def _example_size(n: Any) -> int:
    """A size, or a symbolic size's value at the example inputs, read without a guard (so
    that a symbolic build stays symbolic); ValueError for a size read from data."""
    if isinstance(n, torch.SymInt):
        hint = n.node.hint
        if hint is None:
            raise ValueError("a size read from tensor data")
        return int(hint)
    return int(n)


def _cuda_kernel(q: Any, k: Any, v: Any, mask: Any, is_causal: bool, scale: Any,
                 enable_gqa: bool) -> str | None:
    """The CUDA kernel the rules call for these inputs (read from their fake values at
    capture): ``"flash"`` where eager picks flash or cuDNN attention (no mask) and
    :func:`_cuda_flash_ok` holds, else ``"efficient"`` where eager picks a fused kernel;
    None where eager runs the math reference or :func:`_cuda_shapes_ok` does not hold (the
    formulas of :class:`ScaledDotProductAttention`).  Where eager picks cuDNN attention
    (PyTorch 2.11 on an H200 does for half-precision causal attention), the rules call
    flash attention, which computes the same function: cuDNN attention's backward called
    from here gave gradients that differed from eager's by more than bfloat16 rounding
    (``tests/test_cuda.py``, 2026-11-26), so it is not used.  Where flash attention's own
    switch is off, the memory-efficient kernel stands in for cuDNN's if its switch is on,
    else flash attention still does (``sdpa_kernel(SDPBackend.CUDNN_ATTENTION)`` allows
    cuDNN's alone), and the memory-efficient kernel where flash cannot (a mask): a fused
    kernel of the same function, not the formulas."""
    if not _cuda_shapes_ok(q, k, v, enable_gqa):
        return None
    choice = _eager_choice(q, k, v, mask, is_causal, scale, enable_gqa)
    efficient = torch.backends.cuda.mem_efficient_sdp_enabled()
    if mask is None and choice in (_FLASH, _CUDNN, -1) \
            and _cuda_flash_ok(q, k, v, is_causal, switch=choice != _CUDNN or efficient):
        return "flash"
    if choice in (_FLASH, _EFFICIENT, _CUDNN, -1) and (efficient or choice == _CUDNN):
        return "efficient"
    return None


def _cuda_forward(kernel: str, q: Any, k: Any, v: Any, bias: Any, is_causal: bool,
                  scale: Any) -> tuple[Any, tuple]:
    """The kernel's forward: its output and what its backward reads (logsumexp and the
    random-state outputs, saved as autograd saves them)."""
    if kernel == "flash":
        res = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, is_causal, False, scale=scale)
        return res[0], (res[1], res[6], res[7])
    out, lse, seed, offset = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, bias, True, 0.0, is_causal, scale=scale)
    return out, (lse, seed, offset)


def _cuda_backward(kernel: str, d: Any, q: Any, k: Any, v: Any, out: Any, saved: tuple,
                   bias: Any, is_causal: bool, scale: Any) -> tuple[Any, Any, Any]:
    """The kernel's fused backward: the cotangents of q, k and v (derivatives.yaml
    ``_scaled_dot_product_{flash,efficient}_attention``)."""
    lse, seed, offset = saved
    if d.stride(-1) != 1:  # the kernels read the cotangent's last dimension as contiguous
        d = d.contiguous()
    L, S = q.shape[-2], k.shape[-2]
    if kernel == "flash":
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            d, q, k, v, out, lse, None, None, L, S, 0.0, is_causal, seed, offset, scale=scale)
    d_q, d_k, d_v, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        d, q, k, v, bias, out, lse, seed, offset, 0.0, [True, True, True, False], is_causal,
        scale=scale)
    return d_q, d_k, d_v


def _efficient_bias(mask: Any, q: Any, k: Any) -> Any:
    """``mask`` as the memory-efficient kernels take it (what eager SDPA's
    ``preprocess_mask`` does): additive of the query's dtype, expanded to
    ``(B, H, L, S)``; where the key length is not a multiple of 16 the bias is padded to
    one and sliced back, so that its rows start at aligned addresses."""
    bias = _flash_mask(mask, q.dtype)
    if bias.dim() == 2:
        bias = bias.unsqueeze(0).unsqueeze(0)
    S = k.shape[-2]
    if S % 16 != 0:
        bias = F.pad(bias, (0, 16 - S % 16))[..., :S]
    return bias.expand(q.shape[0], q.shape[1], q.shape[-2], S)


def _no_mask_kernel(query: Any, key: Any, value: Any, attn_mask: Any, dropout_p: float,
                    is_causal: bool, scale: Any, enable_gqa: bool) -> str | None:
    if dropout_p > 0.0 or attn_mask is not None:
        return None
    return _cuda_kernel(query, key, value, None, is_causal, scale, enable_gqa)


@register_vjp(F.scaled_dot_product_attention)
class ScaledDotProductAttentionCudaFlash:
    """Without dropout or mask (``is_causal`` allowed), for 4-D half-precision CUDA inputs
    where eager SDPA runs flash or cuDNN attention (:func:`_cuda_kernel`): PyTorch's CUDA
    FlashAttention-2 forward, its logsumexp and random-state outputs saved for its fused
    backward (derivatives.yaml ``_scaled_dot_product_flash_attention``)."""

    residuals = "inputs+output+intermediates"
    recompute = False
    fused = True

    def applies(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                enable_gqa=False):
        return _no_mask_kernel(query, key, value, attn_mask, dropout_p, is_causal, scale,
                               enable_gqa) == "flash"

    def fwd(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
            enable_gqa=False):
        out, saved = _cuda_forward("flash", query, key, value, None, bool(is_causal), scale)
        _guard_unit_stride(query, key, value)
        return out, (query, key, value, out, saved, bool(is_causal), scale)

    def bwd(aux, d):
        q, k, v, out, saved, is_causal, scale = aux
        return (*_cuda_backward("flash", d, q, k, v, out, saved, None, is_causal, scale), None)

    jvp = ScaledDotProductAttention.jvp


@register_vjp(F.scaled_dot_product_attention)
class ScaledDotProductAttentionCudaEfficient:
    """Without dropout, for 4-D CUDA inputs where eager SDPA runs a fused kernel and flash
    attention does not apply (float32, a mask, a causal mask with L != S):
    PyTorch's CUDA memory-efficient attention, a mask as its additive bias
    (:func:`_efficient_bias`, as eager SDPA prepares it), the logsumexp saved for its
    fused backward (derivatives.yaml ``_scaled_dot_product_efficient_attention``).  A
    floating mask whose cotangent is needed gets the math backward, as
    :class:`ScaledDotProductAttentionFusedMask`.  Fused level ``True`` without a mask;
    with a mask only at level ``"all"`` (code built to run): :func:`fxad.vjp` keeps the
    formulas there, as on the CPU."""

    residuals = "inputs+output+intermediates"
    recompute = False
    fused = True

    def applies(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                enable_gqa=False):
        if dropout_p > 0.0:
            return False
        if attn_mask is not None:
            if not (fused.enabled("all") and 2 <= attn_mask.dim() <= 4
                    and attn_mask.device.type in CUDA_DEVICE_TYPES
                    and (attn_mask.dtype == torch.bool or attn_mask.dtype == query.dtype)):
                return False
        return _cuda_kernel(query, key, value, attn_mask, is_causal, scale,
                            enable_gqa) == "efficient"

    def fwd(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
            enable_gqa=False):
        bias = None if attn_mask is None else _efficient_bias(attn_mask, query, key)
        out, saved = _cuda_forward("efficient", query, key, value, bias, bool(is_causal), scale)
        _guard_unit_stride(query, key, value)
        return out, (query, key, value, out, saved, attn_mask, bias, bool(is_causal), scale)

    def bwd(aux, d):
        q, k, v, out, saved, attn_mask, bias, is_causal, scale = aux
        if attn_mask is not None and attn_mask.dtype != torch.bool \
                and needs_cotangent("attn_mask"):
            scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
            p = _sdpa_scores(q, k, attn_mask, is_causal, scale)
            return _sdpa_scores_vjp(q, k, attn_mask, p, p.mT @ d, d @ v.mT, scale, 1)
        return (*_cuda_backward("efficient", d, q, k, v, out, saved, bias, is_causal, scale),
                None)

    jvp = ScaledDotProductAttention.jvp
