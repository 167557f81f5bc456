"""The container type of a program's output, kept for the values fxad returns.

The generated code returns a program's output as torch.fx records it: tuples, lists and
plain dicts (a transformers ``ModelOutput``, an ``OrderedDict``, a dataclass registered with
:mod:`torch.utils._pytree` all print as a dict or tuple).  Capture notes the pytree structure
of the program's real result (:func:`output_spec`, kept in ``gm.meta["fxad_output_spec"]``),
and the wrappers (:class:`fxad.VJPModule`, :func:`fxad.compile`) rebuild it from the values
the code returns (:func:`restore_output`), so that ``out.loss`` works as in eager mode.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

__all__ = ["output_spec", "restore_output", "OUTPUT_SPEC"]

OUTPUT_SPEC = "fxad_output_spec"  # the meta key


def output_spec(result: Any, recorded: Any) -> pytree.TreeSpec | None:
    """The pytree structure of the program's ``result``, where it holds the same leaves, in
    the same order, as ``recorded`` (the output node's argument: a tensor leaf of ``result``
    is a node there); None for a single value, or where the two do not correspond (a value
    the generated code returns as it is)."""
    try:
        leaves, spec = pytree.tree_flatten(result)
        rec_leaves, rec_spec = pytree.tree_flatten(recorded)
    except Exception:  # noqa: BLE001 - a container pytree cannot flatten: left as it is
        return None
    if spec.is_leaf() or len(leaves) != len(rec_leaves):
        return None
    if any(isinstance(v, torch.Tensor) != isinstance(r, fx.Node)
           for v, r in zip(leaves, rec_leaves)):
        return None
    return spec


def restore_output(value: Any, spec: pytree.TreeSpec | None) -> Any:
    """``value`` (as the generated code returns it) rebuilt with the program's own containers
    (``spec`` from :func:`output_spec`); ``value`` unchanged when ``spec`` is None or does
    not have ``value``'s shape."""
    if spec is None:
        return value
    leaves, have = pytree.tree_flatten(value)
    if not _same_shape(have, spec):
        return value
    return pytree.tree_unflatten(leaves, spec)


def _same_shape(have: pytree.TreeSpec, want: pytree.TreeSpec) -> bool:
    """The two trees have the same shape (children and leaves at the same places, the same
    keys where both are keyed), whatever their container types."""
    if have.is_leaf() or want.is_leaf():
        return have.is_leaf() and want.is_leaf()
    if have.num_children != want.num_children:
        return False
    a, b = have.context, want.context
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and list(a) != list(b):
        return False
    return all(_same_shape(have.child(i), want.child(i)) for i in range(have.num_children))
