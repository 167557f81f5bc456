"""Small models written in plain ``torch.nn``; every ``forward`` returns a scalar loss so that
``fxad.grad(model, *inputs)`` applies directly.

All models use float32 parameters by default.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


def _dropout(p: float) -> nn.Module:
    """``nn.Dropout(p)``, or ``nn.Identity()`` when ``p == 0`` so that no-op dropout calls do
    not appear in the captured graph (and in fxad's generated code)."""
    return nn.Dropout(p) if p > 0 else nn.Identity()


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention.

    One ``nn.Linear`` produces q, k and v (split along the channel dimension); heads are made
    with ``view``/``transpose``; attention is ``F.scaled_dot_product_attention(is_causal=True)``.

    Shapes: ``x`` float ``[B, T, C]`` → float ``[B, T, C]`` with ``C = n_embd``.
    """

    def __init__(self, n_embd: int, n_head: int, dropout: float = 0.0) -> None:
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"n_embd={n_embd} is not divisible by n_head={n_head}")
        self.n_head = n_head
        self.n_embd = n_embd
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.resid_dropout = _dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        hs = C // self.n_head
        q = q.view(B, T, self.n_head, hs).transpose(1, 2)  # [B, nh, T, hs]
        k = k.view(B, T, self.n_head, hs).transpose(1, 2)
        v = v.view(B, T, self.n_head, hs).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class FeedForward(nn.Module):
    """Position-wise MLP ``Linear(C, 4C) → GELU → Linear(4C, C)``; float ``[B, T, C]`` →
    ``[B, T, C]``."""

    def __init__(self, n_embd: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * n_embd, n_embd)
        self.dropout = _dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: ``x + attn(ln_1(x))`` then ``x + mlp(ln_2(x))``."""

    def __init__(self, n_embd: int, n_head: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = FeedForward(n_embd, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class TinyGPT(nn.Module):
    """A small GPT-style character language model.

    Args:
        vocab_size: number of tokens ``V``.
        block_size: maximum context length (size of the position embedding table).
        n_layer, n_head, n_embd: depth, attention heads, width ``C``.
        dropout: dropout probability (embeddings, attention output, MLP output).

    ``forward(idx, targets)``: ``idx`` and ``targets`` int64 ``[B, T]`` with ``T <= block_size``;
    returns the mean cross-entropy loss, a float32 scalar ``[]``.  :meth:`logits` gives the
    float ``[B, T, V]`` logits.
    """

    def __init__(self, vocab_size: int, block_size: int = 64, n_layer: int = 2, n_head: int = 4,
                 n_embd: int = 64, dropout: float = 0.0) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.drop = _dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2 scaled init of residual projections
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def logits(self, idx: torch.Tensor) -> torch.Tensor:
        """Next-token logits: int64 ``[B, T]`` → float ``[B, T, V]``."""
        B, T = idx.shape
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.logits(idx)
        V = logits.shape[-1]
        return F.cross_entropy(logits.view(-1, V), targets.view(-1))

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        """Sample ``max_new_tokens`` tokens after the int64 ``[B, T0]`` prompt (eager PyTorch);
        returns int64 ``[B, T0 + max_new_tokens]``."""
        for _ in range(max_new_tokens):
            ctx = idx[:, -self.block_size:]
            probs = F.softmax(self.logits(ctx)[:, -1, :], dim=-1)
            nxt = torch.multinomial(probs, 1, generator=generator)
            idx = torch.cat([idx, nxt], dim=1)
        return idx


class SmallCNN(nn.Module):
    """Two conv stages with batch norm, then a linear classifier.

    ``conv(3x3) → BatchNorm2d → ReLU → max_pool2d(2) → conv(3x3) → BatchNorm2d → ReLU →
    adaptive_avg_pool2d(2) → flatten → Linear``.

    ``forward(x, y)``: ``x`` float ``[B, in_ch, H, W]`` (H, W >= 4), ``y`` int64 ``[B]`` class
    indices in ``[0, n_classes)``; returns the mean cross-entropy, a float scalar ``[]``.
    In training mode BatchNorm uses batch statistics and updates its running statistics.
    """

    def __init__(self, in_ch: int = 3, n_classes: int = 10, width: int = 8) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_ch, width, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, 2 * width, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(2 * width)
        self.fc = nn.Linear(2 * width * 4, n_classes)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Class logits: float ``[B, in_ch, H, W]`` → float ``[B, n_classes]``."""
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.adaptive_avg_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
        return self.fc(torch.flatten(x, 1))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.logits(x), y)


class MLP(nn.Module):
    """``Linear(d_in, hidden) → ReLU → Linear(hidden, d_out)`` with a loss.

    ``forward(x, y)``: ``x`` float ``[B, d_in]``.  With ``loss="mse"``, ``y`` is float
    ``[B, d_out]`` and the loss is the mean squared error; with ``loss="ce"``, ``y`` is int64
    ``[B]`` and the loss is the mean cross-entropy.  Returns a float scalar ``[]``.
    """

    def __init__(self, d_in: int = 64, hidden: int = 256, d_out: int = 10,
                 loss: str = "mse") -> None:
        super().__init__()
        if loss not in ("mse", "ce"):
            raise ValueError(f"loss must be 'mse' or 'ce', not {loss!r}")
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, d_out)
        self.loss = loss

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = self.fc2(F.relu(self.fc1(x)))
        if self.loss == "mse":
            return ((out - y) ** 2).mean()  # = F.mse_loss(out, y), spelled with basic ops
        return F.cross_entropy(out, y)
