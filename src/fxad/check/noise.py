"""Monte Carlo arithmetic (:class:`_RoundingNoise`): the rounding noise of a computation in
a low-precision dtype, measured by perturbing every op's operands and results in float64
(see :mod:`fxad.check`)."""
from __future__ import annotations

import random
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from .numerics import _eps, _underflow, _wide

# ops that move, select or create data without rounding: not perturbed by Monte Carlo
# arithmetic (views and in-place/out= ops are recognized from their schema)
_EXACT_OPS = frozenset("""
    _to_copy clone copy detach alias lift_fresh lift_fresh_copy contiguous t transpose view
    _unsafe_view reshape expand permute select slice cat stack split split_with_sizes unbind
    squeeze unsqueeze flatten index index_select gather embedding where masked_fill relu
    threshold_backward neg abs max_pool2d_with_indices max_pool3d_with_indices
    constant_pad_nd flip roll repeat narrow zeros ones empty full zeros_like ones_like
    empty_like full_like new_zeros new_ones new_empty new_full new_empty_strided
    empty_strided fill scalar_tensor arange sign sgn floor ceil round trunc maximum minimum
    max min amax amin clamp clamp_min clamp_max hardtanh diagonal diag_embed tril triu
    _unsafe_index select_backward slice_backward unfold as_strided conj _conj resolve_conj
    resolve_neg _neg_view real imag view_as_real view_as_complex
""".split())


# fused backward kernels whose result hides the rounding of the formula inside (the zero sum
# of batch norm's input gradient survives any perturbation of the kernel's operands): Monte
# Carlo arithmetic runs their decompositions (torch._decomp), op by op, as a formula written
# out in D would run
_DECOMPOSED_OPS = frozenset("""
    native_batch_norm_backward batch_norm_backward native_layer_norm_backward
    native_group_norm_backward _softmax_backward_data _log_softmax_backward_data
    gelu_backward silu_backward tanh_backward sigmoid_backward mse_loss_backward
    softplus_backward elu_backward hardswish_backward
""".split())



class _RoundingNoise(TorchDispatchMode):
    """Monte Carlo arithmetic for ``dtype``: the floating operands and results of every
    rounding op become ``x (1 + d) + e``, ``d`` uniform in ``[-u, u]``, ``e`` (for
    ``x != 0``, float16 only: elsewhere the subnormals are far below any gradient) uniform
    in ``[-eta, eta]`` (see the module docstring).

    The uniform numbers are windows, at random offsets, of one buffer (up to ``2**20``
    numbers, as large as the largest tensor) drawn per run: drawing fresh numbers for every
    operand of every op cost 10x more than the rest of the check on TinyGPT."""

    _MAX_BUF = 1 << 20

    def __init__(self, dtype: torch.dtype, gen: torch.Generator) -> None:
        super().__init__()
        self.u = _eps(dtype) / 2
        self.eta = _underflow(dtype)
        self.use_eta = self.eta > 1e-30
        self.gen = gen
        self.offsets = random.Random(int(torch.randint(1 << 62, (), generator=gen)))
        self.bufs: dict[torch.device, tuple[int, torch.Tensor]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in _DECOMPOSED_OPS:
            from torch._decomp import decomposition_table

            decomposition = decomposition_table.get(func)
            if decomposition is not None:
                with self:
                    return decomposition(*args, **kwargs)
        if func.is_view or func._schema.is_mutable or name.rstrip("_") in _EXACT_OPS:
            return func(*args, **kwargs)
        args, kwargs = pytree.tree_map(self._perturb, (args, kwargs))
        return pytree.tree_map(self._perturb, func(*args, **kwargs))

    def _uniform(self, t: torch.Tensor) -> torch.Tensor:
        """``t.numel()`` numbers uniform in [-1, 1] (float32), shaped like ``t``."""
        n = t.numel()
        size, buf = self.bufs.get(t.device, (0, None))
        if size < min(n, self._MAX_BUF):
            size = min(self._MAX_BUF, max(4096, 1 << (n - 1).bit_length()))
            half = torch.rand(size, generator=self.gen) * 2 - 1
            buf = torch.cat([half, half]).to(t.device)
            self.bufs[t.device] = (size, buf)
        assert buf is not None
        start = self.offsets.randrange(size)
        if n <= size:
            return buf[start:start + n].view(t.shape)
        return buf[start:start + size].repeat(-(-n // size))[:n].view(t.shape)

    def _perturb(self, t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or not (t.is_floating_point() or t.is_complex()) \
                or t.numel() == 0:
            return t
        w = _wide(t)
        w = w + w * (self._uniform(t) * self.u)
        if self.use_eta:
            w = w + torch.where(w != 0, self._uniform(t) * self.eta, 0.0)
        return w.to(t.dtype)

