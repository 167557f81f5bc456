"""Helpers shared by the simplifier passes."""
from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.fx as fx

# ops whose result differs between two identical calls
RANDOM_OPS = {torch.rand, torch.randn, torch.randint, torch.randperm, torch.rand_like,
              torch.randn_like, torch.randint_like, torch.bernoulli, torch.multinomial,
              torch.normal, torch.empty, torch.empty_like,
              torch.ops.aten.rrelu_with_noise_functional.default}


def is_impure(node: fx.Node) -> bool:
    """Nodes that must stay even when unused, and must not be merged with an equal one."""
    if node.op in ("placeholder", "output"):
        return True
    if node.meta.get("fxad_side_effect"):
        return True
    if node.op == "call_method" and isinstance(node.target, str) and node.target.endswith("_") \
            and not node.target.startswith("_"):
        return True
    if node.op == "call_function" and node.target is torch.nn.functional.batch_norm \
            and _kw(node, "training", 5, False):
        return True  # updates running statistics in place
    if node.op == "call_function" and node.target is torch.native_batch_norm \
            and _kw(node, "training", 5, False) and _kw(node, "running_mean", 3, None) is not None:
        return True
    return node.op == "call_module"


def is_random(node: fx.Node) -> bool:
    if node.op == "call_function" and node.target in RANDOM_OPS:
        return True
    if node.op == "call_function" and node.target in _TRAINING_RANDOM:
        # random only when it draws: training (and, for the dropouts, 0 < p)
        flag, pos, default = _TRAINING_RANDOM[node.target]
        if not _kw(node, flag, pos, default):
            return False
        return node.target in _RRELU or _kw(node, "p", 1, 0.5) != 0
    if node.op == "call_function" and node.target in _FRACTIONAL:
        return _kw(node, "_random_samples", 5, None) is None  # draws its windows
    return node.op == "call_method" and node.target in ("bernoulli", "uniform_", "normal_",
                                                        "bernoulli_", "exponential_",
                                                        "geometric_", "cauchy_",
                                                        "log_normal_", "random_")


def draws_random(node: fx.Node) -> bool:
    """``node`` draws random numbers (:func:`is_random` without uninitialized memory:
    ``torch.empty_like(x)`` is kept apart from equal nodes like a draw, but what a program
    writes into it is not random, e.g. the inverse permutation of ``pack_padded_sequence``)."""
    return is_random(node) and not (node.op == "call_function"
                                     and node.target in (torch.empty, torch.empty_like))


F = torch.nn.functional
# ops that draw random numbers in training mode: the flag's name, position and default
_TRAINING_RANDOM = {
    F.dropout: ("training", 2, True), F.dropout1d: ("training", 2, True),
    F.dropout2d: ("training", 2, True), F.dropout3d: ("training", 2, True),
    F.alpha_dropout: ("training", 2, False), F.feature_alpha_dropout: ("training", 2, False),
    torch.dropout: ("train", 2, True), torch.feature_dropout: ("train", 2, True),
    torch.alpha_dropout: ("train", 2, True), torch.feature_alpha_dropout: ("train", 2, True),
    torch.native_dropout: ("train", 2, True),
    F.rrelu: ("training", 3, False), torch.rrelu: ("training", 3, False),
}
_RRELU = {F.rrelu, torch.rrelu}
_FRACTIONAL = {F.fractional_max_pool2d, F.fractional_max_pool3d,
               F.fractional_max_pool2d_with_indices, F.fractional_max_pool3d_with_indices}


def _kw(node: fx.Node, name: str, pos: int, default: Any) -> Any:
    if name in node.kwargs:
        return node.kwargs[name]
    if len(node.args) > pos:
        return node.args[pos]
    return default


def val(x: Any) -> Any:
    return x.meta.get("val") if isinstance(x, fx.Node) else x


def same_type(a: Any, b: Any) -> bool:
    """True when fake values ``a`` and ``b`` are tensors of equal shape and dtype."""
    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) \
        and tuple(a.shape) == tuple(b.shape) and a.dtype == b.dtype


_ALIASES: "weakref.WeakKeyDictionary[fx.Graph, dict[str, str]]" = weakref.WeakKeyDictionary()


def aliases(graph: fx.Graph) -> dict[str, str]:
    """Names of erased nodes → name of the node that replaced them (for cotangent naming)."""
    return _ALIASES.setdefault(graph, {})


def resolve(graph: fx.Graph, name: str) -> str:
    table = _ALIASES.get(graph, {})
    seen = set()
    while name in table and name not in seen:
        seen.add(name)
        name = table[name]
    return name


def replace(node: fx.Node, new: Any) -> None:
    """Replace all uses of ``node`` by ``new`` (a node or constant) and erase it."""
    if isinstance(new, fx.Node):
        aliases(node.graph)[node.name] = new.name
        for k in ("fxad_cot_of",):
            if k in node.meta and k not in new.meta and new.op != "placeholder":
                new.meta[k] = node.meta[k]
    node.replace_all_uses_with(new)
    node.graph.erase_node(node)
