"""Code generation: readable names, provenance comments and torch-API spellings.

:func:`name_cotangents` renames cotangent nodes ``d_<primal>``; :func:`install` attaches a
body transformer to a graph so that its generated Python (``gm.code``, ``to_folder``)

* spells functions by their public name (``torch.nn.functional.gelu``, not
  ``torch._C._nn.gelu``; ``torch.split``, not ``torch.functional.split``);
* carries, above each backward block, ``# backward of: <forward statement>  [file.py:line]``
  (``# tangent of: ...`` above forward-mode tangent code).

The transformer relies on the ``# COUNTER: i`` markers FX puts in the body (torch >= 2.1);
without them the code is unchanged apart from the spellings.
"""
from __future__ import annotations

import operator
import re
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..simplify._util import is_random, resolve

_COUNTER = re.compile(r"# COUNTER: (\d+)")
_PRIVATE_NN = re.compile(r"\btorch\._C\._nn\.(\w+)\b")
_PRIVATE_VAR = re.compile(r"\btorch\._C\._VariableFunctions\.(\w+)\b")
# torch.fft.rfft is the binding torch._C._fft.fft_rfft (likewise linalg, special)
_PRIVATE_NS = re.compile(r"\btorch\._C\._(fft|linalg|special)\.(?:fft|linalg|special)_(\w+)\b")


def _public_ns(m: re.Match) -> str:
    ns, name = m.group(1), m.group(2)
    if hasattr(getattr(torch, ns), name):
        return f"torch.{ns}.{name}"
    return m.group(0)


def _public_name(m: re.Match) -> str:
    name = m.group(1)
    if hasattr(F, name):
        return f"torch.nn.functional.{name}"
    return m.group(0)


def public_spelling(line: str) -> str:
    """Rewrite private module paths of public functions in one line of generated code."""
    line = _PRIVATE_NN.sub(_public_name, line)
    line = _PRIVATE_VAR.sub(lambda m: f"torch.{m.group(1)}", line)
    line = _PRIVATE_NS.sub(_public_ns, line)
    return line.replace("torch.functional.", "torch.")


def _statement(lines: list[str]) -> str:
    """The first code line of a node's emitted text, without FX's `x = None` deletions."""
    for ln in lines:
        s = ln.strip()
        if s and not s.startswith("#"):
            return s.split(";  ")[0]
    return ""


class BodyTransformer:
    """Callable installed as the graph's body transformer (see module docstring)."""

    def __init__(self, graph: fx.Graph, *, annotate: Any = None) -> None:
        self.graph = graph
        self.annotate = annotate  # optional node -> str appended to its line (fxad.show)

    def __call__(self, body: list[str]) -> list[str]:
        nodes = list(self.graph.nodes)
        self._by_name = {n.name: n for n in nodes}
        self._first_fwd: dict[str, str] = {}
        for n in nodes:
            of = n.meta.get("fxad_fwd_of")
            if of is not None and "fxad_bwd_of" not in n.meta:
                self._first_fwd.setdefault(of, n.name)
        # group body entries by node
        groups: list[tuple[int | None, list[str]]] = []
        cur: tuple[int | None, list[str]] = (None, [])
        for entry in body:
            m = _COUNTER.fullmatch(entry.strip())
            if m:
                groups.append(cur)
                cur = (int(m.group(1)), [])
            else:
                cur[1].append(public_spelling(entry))
        groups.append(cur)
        stmt_of: dict[str, str] = {}
        out: list[str] = []
        prev_block: Any = None
        for idx, entries in groups:
            node = nodes[idx] if idx is not None and idx < len(nodes) else None
            if node is not None:
                stmt = _statement(entries)
                stmt_of[node.name] = stmt
                block = _block(node)
                if block is not None and block != prev_block and node.op != "placeholder":
                    out.append(self._header(block, node, stmt_of))
                elif block is None and node.meta.get("fxad_inplace") is not None:
                    # the functional form of an in-place statement of the user's
                    block = ("inplace", node.meta["fxad_inplace"])
                    if block != prev_block:
                        loc = node.meta["fxad_inplace"]
                        out.append(f"# in place: {loc.code}  [{loc.short()}]\n")
                prev_block = block if node.op != "placeholder" else prev_block
                if self.annotate is not None and entries:
                    note = self.annotate(node)
                    if note:
                        entries = _append_note(entries, note)
            out.append(f"# COUNTER: {idx}\n" if idx is not None else "")
            out.extend(entries)
        return [e for e in out if e != ""]

    def _header(self, block: tuple[str, str], node: fx.Node, stmt_of: dict[str, str]) -> str:
        kind, block = block  # type: ignore[assignment]
        # the statement that computed the forward value: the first node the rule's forward
        # wrote (``native_layer_norm = torch.native_layer_norm(...)`` rather than the
        # ``layer_norm = native_layer_norm[0]`` that picks the value out of its result)
        first = self._first_fwd.get(block)
        if first is not None and _is_draw(self._by_name.get(first)):
            # a random op's rule draws its noise first (``empty_like(x).bernoulli_(0.7)``):
            # name the statement that computes the value instead
            first = self._value_source(block)
        fwd = (stmt_of.get(first, "") if first else "") or stmt_of.get(block, block)
        text = f"# {kind} of: {fwd}" if fwd else f"# {kind} of {block}"
        loc = node.meta.get("fxad_jvp_src" if kind == "tangent" else "fxad_bwd_src")
        if loc is None:
            fwd_node = self._by_name.get(block)
            loc = fwd_node.meta.get("fxad_loc") if fwd_node is not None else None
        if loc is not None:
            text += f"  [{loc.short()}]"
        return text + "\n"


    def _value_source(self, block: str) -> str:
        """The node computing forward value ``block``: the value itself, or the node it picks
        its result out of (``rrelu = rrelu_with_noise_functional[0]``)."""
        node = self._by_name.get(block)
        if node is not None and node.op == "call_function" and node.target is operator.getitem \
                and isinstance(node.args[0], fx.Node) \
                and node.args[0].meta.get("fxad_fwd_of") == block:
            return node.args[0].name
        return block


def _is_draw(node: fx.Node | None) -> bool:
    """A node that allocates or fills random noise (``torch.empty_like``, ``x.new_empty``,
    ``torch.rand``, an in-place random method)."""
    if node is None:
        return False
    # the in-place random methods are random ops in their records; x.new_empty allocates
    return is_random(node) or (node.op == "call_method" and node.target == "new_empty")


def _block(node: fx.Node) -> tuple[str, str] | None:
    """The provenance block of a node: ``("tangent", fwd)`` for forward-mode tangent code
    (``meta['fxad_jvp_of']``), ``("backward", fwd)`` for reverse-mode code."""
    if node.meta.get("fxad_jvp_of") is not None:
        return ("tangent", node.meta["fxad_jvp_of"])
    if node.meta.get("fxad_bwd_of") is not None:
        return ("backward", node.meta["fxad_bwd_of"])
    return None


def _append_note(entries: list[str], note: str) -> list[str]:
    """Append ``  # note`` to the end of the node's statement (its last body entry)."""
    for i in range(len(entries) - 1, -1, -1):
        if entries[i].endswith("\n") and not entries[i].strip().startswith("#"):
            entries = list(entries)
            entries[i] = entries[i][:-1] + f"  # {note}\n"
            return entries
    return entries


def install(graph: fx.Graph, *, annotate: Any = None) -> None:
    """Attach the fxad body transformer to ``graph`` (replacing any previous one)."""
    graph._codegen._body_transformer = BodyTransformer(graph, annotate=annotate)


def name_cotangents(graph: fx.Graph, output_names: dict[fx.Node, str]) -> None:
    """Give cotangent nodes readable names.

    Args:
        graph: VJP graph.
        output_names: nodes returned as gradients → the name they should carry
            (``d_x``, ``d_l1_weight``); other nodes with ``meta['fxad_cot_of'] = v`` become
            ``d_v``.  Placeholders keep their names; clashes get FX's numeric suffix.
    """
    taken: set[fx.Node] = set()
    for node, name in output_names.items():
        if node.op in ("placeholder", "get_attr") or node in taken:
            continue
        if node.name != name:
            node._rename(name)
        taken.add(node)
    for node in graph.nodes:
        if node in taken or node.op != "call_function" and node.op != "call_method":
            continue
        of = node.meta.get("fxad_cot_of")
        if of:
            of = resolve(graph, of)
        if of and not node.name.startswith("d_"):
            node._rename(f"d_{of}")


def shape_note(node: fx.Node) -> str:
    """``f32[64,128]`` for a tensor node (used by :func:`fxad.show`)."""
    v = node.meta.get("val")
    if isinstance(v, torch.Tensor):
        return f"{_DT.get(v.dtype, str(v.dtype).replace('torch.', ''))}[{','.join(map(str, v.shape))}]"
    if isinstance(v, (tuple, list)) and v and all(isinstance(x, torch.Tensor) for x in v):
        return "(" + ", ".join(
            f"{_DT.get(x.dtype, str(x.dtype))}[{','.join(map(str, x.shape))}]" for x in v) + ")"
    return ""


_DT = {torch.float32: "f32", torch.float64: "f64", torch.float16: "f16", torch.bfloat16: "bf16",
       torch.int64: "i64", torch.int32: "i32", torch.bool: "b8", torch.uint8: "u8",
       torch.int8: "i8", torch.complex64: "c64", torch.complex128: "c128"}
