"""Demo models, data and a side-by-side training run (fxad vs ``torch.autograd``).

* :mod:`fxad.demo.models`: ``TinyGPT`` (character-level transformer LM), ``SmallCNN``
  (conv + batch norm classifier) and ``MLP``; each ``forward`` returns a scalar loss.
* :mod:`fxad.demo.data`: a character corpus read from the Python standard library's own
  source files, and deterministic batches.
* :mod:`fxad.demo.train`: the demo run behind ``fxad demo``.
"""
from __future__ import annotations

from .models import MLP, SmallCNN, TinyGPT

__all__ = ["TinyGPT", "SmallCNN", "MLP"]
