"""Leaf modules inside rules: :class:`ModuleRef` is what a module rule's ``fwd`` receives."""
from __future__ import annotations

from typing import Any

import torch

from ..graph.proxy import Emitter


class ModuleSlot:
    """Marks the module argument of a ``call_module`` node when cotangents are matched."""

    def __init__(self, target: str) -> None:
        self.target = target


class ModuleRef:
    """Stands for a leaf submodule while its rule writes code.

    Attributes:
        module: the real ``nn.Module`` (read its configuration, never its data).
        target: its qualified name in the root module (``blocks.0.attn``).

    ``ref(*args)`` writes ``self.<target>(*args)``; ``ref.param("weight")`` writes a read of
    the parameter (``get_attr``) so the rule can use it in backward formulas.
    """

    def __init__(self, em: Emitter, target: str, module: torch.nn.Module) -> None:
        self.em = em
        self.target = target
        self.module = module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.em.create_proxy("call_module", self.target, args, kwargs)

    def param(self, name: str) -> Any:
        return self.em.create_proxy("get_attr", f"{self.target}.{name}", (), {})

    def __repr__(self) -> str:
        return f"ModuleRef({self.target}: {type(self.module).__name__})"
