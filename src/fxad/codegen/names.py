"""Names for the items of multi-output ops.

FX names every item picked out of a tuple-valued node ``getitem_<k>``.  :func:`name_outputs`
renames them, in this order of preference:

1. the names the user gave them, where the user's line unpacks the call
   (``q, k, v = self.c_attn(x).split(self.n_embd, dim=2)`` names the three items of that
   ``split`` ``q``, ``k``, ``v``);
2. the names declared in the op's record (``OpRecord.outputs``: ``out, mean, rstd`` for
   ``torch.native_layer_norm``), else the names of the ATen schema's returns where they are
   named (``values, indices`` for ``torch.max(x, 1)``; ``output, logsumexp`` for the CPU
   flash-attention kernel);
3. ``<op>_out<k>`` (``split_out0``).

Items already named (the first item of a rule's forward carries the forward value's name,
``layer_norm``; cotangents are ``d_<value>``) keep their names; FX adds ``_1``, ``_2`` to
repeated names.  A renamed value's cotangent ``d_<old>`` and tangent ``dot_<old>`` follow it.
"""
from __future__ import annotations

import ast
import operator
import re
from typing import Any

import torch
import torch.fx as fx

from ..rules.registry import record_of
from ..simplify._util import aliases
from .defaults import candidates

AUTO_NAME = re.compile(r"getitem(_\d+)?")
"""The names FX gives the items of a tuple-valued node."""

_TANGENT_PREFIXES = ("d_", "dot_")


def is_tuple_value(v: Any) -> bool:
    """A tuple or list of values (a multi-output op's result; not a ``torch.Size``)."""
    return isinstance(v, (tuple, list)) and not isinstance(v, torch.Size)


def items(node: fx.Node) -> dict[int, fx.Node] | None:
    """The items picked out of tuple-valued ``node``, by index (``node[i]`` with a constant
    ``0 <= i < len``, one node per index), or None when ``node`` is used otherwise too."""
    val = node.meta.get("val")
    if not is_tuple_value(val) or not node.users:
        return None
    out: dict[int, fx.Node] = {}
    for u in node.users:
        if u.op != "call_function" or u.target is not operator.getitem or u.kwargs \
                or len(u.args) != 2 or u.args[0] is not node:
            return None
        i = u.args[1]
        if type(i) is not int or not 0 <= i < len(val) or i in out:
            return None
        out[i] = u
    return out


def _shape_of(names: Any, val: Any) -> bool:
    """``names`` (a name, or a tuple of them, nested) fits the structure of ``val``."""
    if isinstance(names, tuple):
        return is_tuple_value(val) and len(names) == len(val) \
            and all(_shape_of(n, v) for n, v in zip(names, val))
    return isinstance(names, str) and names.isidentifier() and names != "_"


def _call_name(node: fx.Node) -> str | None:
    if node.op == "call_method":
        return str(node.target)
    if node.op == "call_module":
        return str(node.target).rsplit(".", 1)[-1]
    if node.op == "call_function":
        return getattr(node.target, "__name__", None)
    return None


def _target_names(target: ast.expr) -> Any:
    if isinstance(target, ast.Name):
        return target.id
    if isinstance(target, ast.Tuple):
        return tuple(_target_names(e) for e in target.elts)
    return None  # a starred or subscripted target: not names


def _func_name(call: ast.Call) -> str | None:
    f = call.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None


def source_names(node: fx.Node) -> tuple | None:
    """The names the user's line gives the items of ``node``: its source line is
    ``a, b = <call>`` where the outermost call is ``node``'s op and no other call of that
    name is on the line; None otherwise."""
    name = _call_name(node)
    loc = node.meta.get("fxad_loc")
    if loc is None:
        loc = next((u.meta.get("fxad_loc") for u in node.users if u.meta.get("fxad_loc")), None)
    code = getattr(loc, "code", None)
    if not name or not code:
        return None
    try:
        tree = ast.parse(code.strip())
    except SyntaxError:
        return None
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.Assign):
        return None
    stmt = tree.body[0]
    if len(stmt.targets) != 1 or not isinstance(stmt.targets[0], ast.Tuple) \
            or not isinstance(stmt.value, ast.Call) or _func_name(stmt.value) != name:
        return None
    if sum(isinstance(c, ast.Call) and _func_name(c) == name
           for c in ast.walk(stmt.value)) != 1:
        return None
    names = _target_names(stmt.targets[0])
    return names if _shape_of(names, node.meta.get("val")) else None


def declared_names(node: fx.Node) -> tuple | None:
    """The names of ``node``'s items from its op: the record's ``outputs``, else the names
    of the ATen schema's returns (where every schema with that many returns names them
    alike; None for an unnamed one)."""
    val = node.meta.get("val")
    if not is_tuple_value(val):
        return None
    rec = record_of(node)
    if rec is not None and rec.outputs is not None:
        names = tuple(rec.outputs)
        return names if _shape_of(names, val) else None
    if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
        schemas = [node.target._schema]
    elif node.op == "call_function" and isinstance(node.target, torch._ops.OpOverloadPacket):
        schemas = [getattr(node.target, o)._schema for o in node.target.overloads()]
    elif candidates(node).schema and node.op in ("call_function", "call_method"):
        name = _call_name(node)
        try:
            schemas = torch._C._jit_get_schemas_for_operator(f"aten::{name}") if name else []
        except RuntimeError:
            schemas = []
    else:
        schemas = []
    found = {tuple(r.name or None for r in s.returns) for s in schemas
             if len(s.returns) == len(val)}
    if len(found) != 1:
        return None
    names = found.pop()  # an unnamed return: None (named ``<op>_out<k>``)
    given = [n for n in names if n is not None]
    if not given or len(set(given)) != len(given) \
            or any(n is not None and not _shape_of(n, v) for n, v in zip(names, val)):
        return None
    return names


def _rename(node: fx.Node, name: str, by_name: dict[str, fx.Node]) -> None:
    """Rename ``node`` (FX adds a suffix if the name is taken); its cotangent ``d_<old>`` and
    tangent ``dot_<old>`` follow, and cotangent naming resolves the old name to the new."""
    old = node.name
    node._rename(name)
    if node.name == old:
        return
    aliases(node.graph)[old] = node.name
    by_name[node.name] = node
    for p in _TANGENT_PREFIXES:
        other = by_name.pop(p + old, None)
        if other is not None and other.name == p + old:
            other._rename(p + node.name)
            by_name[other.name] = other


def name_outputs(graph: fx.Graph) -> int:
    """Rename the items of multi-output ops still named ``getitem_<k>`` (see the module
    docstring); returns the number renamed."""
    nested: dict[fx.Node, tuple] = {}
    by_name = {n.name: n for n in graph.nodes}
    renamed = 0
    for node in list(graph.nodes):
        got = items(node)
        if not got or all(not AUTO_NAME.fullmatch(g.name) for g in got.values()):
            continue
        names = nested.get(node) or source_names(node) or declared_names(node)
        for i, g in sorted(got.items()):
            want = names[i] if names is not None else None
            if isinstance(want, tuple):
                nested[g] = want
                want = None
            if not AUTO_NAME.fullmatch(g.name):
                continue
            _rename(g, want or f"{node.name}_out{i}", by_name)
            renamed += 1
    return renamed
