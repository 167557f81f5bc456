"""A character-level corpus that every Python installation has: the standard library's
own source files.

The selection is deterministic: ``*.py`` files directly in the standard library directory
(``os.path.dirname(os.__file__)``), sorted by name, private modules (``_*.py``) skipped,
concatenated until ``max_bytes`` characters are reached.  The exact text therefore depends
on the Python version, but is fixed for a given installation.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch


def stdlib_text(max_bytes: int = 300_000) -> str:
    """Concatenated source of standard-library modules, at most ``max_bytes`` characters.

    Files are separated by a header line ``# ==== name.py ====``; non-UTF-8 bytes are
    replaced.  Raises ``RuntimeError`` if no source file is found (e.g. a stripped install
    with only ``.pyc`` files).
    """
    root = os.path.dirname(os.__file__)
    names = sorted(n for n in os.listdir(root) if n.endswith(".py") and not n.startswith("_"))
    parts: list[str] = []
    size = 0
    for name in names:
        with open(os.path.join(root, name), encoding="utf-8", errors="replace") as fh:
            src = fh.read()
        chunk = f"# ==== {name} ====\n{src}\n"
        parts.append(chunk[: max_bytes - size])
        size += len(parts[-1])
        if size >= max_bytes:
            break
    if not parts:
        raise RuntimeError(f"no Python source files found in {root}")
    return "".join(parts)


@dataclass
class CharCorpus:
    """A text encoded as character ids, split 90/10 into train and validation parts.

    Attributes:
        chars: the vocabulary, sorted; id ``i`` is ``chars[i]``.
        train, val: int64 ``[N]`` token ids.
    """

    chars: list[str]
    train: torch.Tensor
    val: torch.Tensor

    @classmethod
    def from_text(cls, text: str, val_fraction: float = 0.1) -> "CharCorpus":
        chars = sorted(set(text))
        stoi = {c: i for i, c in enumerate(chars)}
        data = torch.tensor([stoi[c] for c in text], dtype=torch.long)
        n = int(len(data) * (1 - val_fraction))
        return cls(chars, data[:n], data[n:])

    @classmethod
    def stdlib(cls, max_bytes: int = 300_000) -> "CharCorpus":
        """Corpus built from :func:`stdlib_text`."""
        return cls.from_text(stdlib_text(max_bytes))

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, s: str) -> torch.Tensor:
        """int64 ``[len(s)]``; characters outside the vocabulary map to id 0."""
        stoi = {c: i for i, c in enumerate(self.chars)}
        return torch.tensor([stoi.get(c, 0) for c in s], dtype=torch.long)

    def decode(self, ids: torch.Tensor) -> str:
        return "".join(self.chars[int(i)] for i in ids)

    def batches(self, n: int, batch_size: int, block_size: int, *, seed: int = 0,
                split: str = "train") -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``n`` deterministic batches ``(idx, targets)``, each int64 ``[batch_size,
        block_size]``, ``targets`` being ``idx`` shifted by one character."""
        data = self.train if split == "train" else self.val
        gen = torch.Generator().manual_seed(seed)
        out = []
        for _ in range(n):
            start = torch.randint(len(data) - block_size - 1, (batch_size,), generator=gen)
            offs = start[:, None] + torch.arange(block_size + 1)
            chunk = data[offs]
            out.append((chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()))
        return out
