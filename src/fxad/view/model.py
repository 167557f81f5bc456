"""What the view shows, computed from a generated graph: lines, blocks, saved tensors, memory.

:func:`build` turns a graph module made by fxad (``fxad.vjp``, ``fxad.grad``, ``fxad.jvp``,
``fxad.hvp``...) into a :class:`ViewModel`, a plain description of the page that
:mod:`fxad.view.render` draws:

* **lines**: the generated code, one line per graph node, split into the *forward* (primal)
  part and the *derivative* part (backward or tangent code).  A node is derivative code when
  the engine tagged it (``meta['fxad_bwd_of']`` / ``meta['fxad_jvp_of']``) or it reads a
  cotangent/tangent input, unless the primal outputs need it.  Each line carries its
  statement (as ``gm.code`` spells it, without FX's ``x = None`` deletions), shape, dtype and
  bytes (``meta['val']``), the user's source line (``meta['fxad_loc']``) and the bytes alive
  after it (:func:`fxad.memory.simulate`).
* **blocks**: runs of derivative lines written by one rule (same ``fxad_bwd_of``), each
  linked to the forward lines of the op it differentiates (the node itself and the nodes the
  rule's ``fwd`` wrote, ``meta['fxad_fwd_of']``) and to the user's source line.
* **saved tensors** (residuals): the forward values the backward reads, chosen by a residual
  policy through :func:`fxad.partition`.  Without a policy the code is shown as generated, in
  which every forward value the backward reads stays alive (the ``"save"`` policy); with one
  (``"min_memory"``, a :class:`fxad.Policy`), the page shows the training step that policy
  runs, :func:`fxad.residuals.joint_graph`: forward, then backward with the recomputed
  forward values written where the backward needs them.
* **memory**: live tensor bytes after each line, the peak, and the tensors alive there.
"""
from __future__ import annotations

import linecache
import operator
import os
import re
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from .. import codegen
from ..errors import InputError, SourceLoc
from ..memory import nbytes, simulate
from ..naming import op_kind
from ..rules.registry import kind_of
from ..residuals import joint_graph, partition
from ..simplify._util import resolve

__all__ = ["Line", "Block", "Source", "Saved", "ViewModel", "build", "fmt_bytes"]

_DELETION = re.compile(r";  (\w+ = )+None")
_RECOMPUTED = "_recomputed"


def fmt_bytes(n: int) -> str:
    """``1.0 MiB``, ``264.0 KiB``, ``12 B``."""
    x = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(x) < 1024 or unit == "GiB":
            return f"{int(x)} B" if unit == "B" else f"{x:.1f} {unit}"
        x /= 1024
    return f"{n} B"  # pragma: no cover


@dataclass
class Source:
    """One line of the user's code that the graph was recorded from."""

    id: int
    path: str            # as recorded (absolute path, or <stdin>)
    short: str           # file.py:LINE
    lineno: int
    function: str
    code: str
    context: list[tuple[int, str]] = field(default_factory=list)  # (lineno, text) around it


@dataclass
class Line:
    """One line of the displayed code."""

    id: int
    pane: str                    # "fwd" or "bwd"
    kind: str                    # "def", "input", "param", "op", "return"
    text: str                    # the statement
    node: str | None = None      # name of the graph node it computes
    op: str = ""                 # op kind (``linear``, ``mul``, ``view``)
    shape: str = ""              # ``f32[16,64,64]``
    nbytes: int = 0
    block: int | None = None     # index into ViewModel.blocks (derivative lines)
    src: int | None = None       # index into ViewModel.sources
    saved: bool = False          # a saved tensor (read by the backward)
    recomputed_from: str | None = None  # recomputed in the backward: the forward node's name
    grad: str | None = None      # returned as the gradient of this input / parameter
    mem: int = 0                 # bytes alive after this line (simulated)
    refs: list[str] = field(default_factory=list)  # node names this line reads


@dataclass
class Block:
    """A run of derivative lines written by one rule."""

    id: int
    key: str                     # the forward node it differentiates (resolved name)
    kind: str                    # "backward" or "tangent"
    header: str                  # ``backward of: <forward statement>``
    lines: list[int] = field(default_factory=list)
    targets: list[int] = field(default_factory=list)  # forward line ids it differentiates
    src: int | None = None
    reads_saved: list[str] = field(default_factory=list)
    saved_bytes: int = 0
    recomputes: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)  # values used after the block


@dataclass
class Saved:
    """A saved tensor: a forward value kept for (or read by) the backward."""

    name: str
    line: int | None
    shape: str
    nbytes: int
    role: str                    # "input", "activation", "parameter"
    readers: list[int] = field(default_factory=list)  # block ids that read it


@dataclass
class ViewModel:
    """Everything the page shows (see the module docstring)."""

    title: str
    subtitle: str
    mode: str                    # "reverse", "forward" (tangents), "mixed", "graph"
    lines: list[Line]
    blocks: list[Block]
    sources: list[Source]
    saved: list[Saved]
    policy: str                  # "save", "min_memory", "custom", "" (no backward)
    policy_note: str
    saved_bytes: int
    recomputed: list[str]
    peak_bytes: int
    peak_line: int | None
    live_at_peak: list[tuple[str, int, str, int | None]]  # (name, bytes, shape, line id)
    boundary: int                # index of the first derivative line in ``lines``
    graph: fx.GraphModule        # the graph shown (gm itself, or the policy's joint step)
    node_line: dict[str, int] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    saved_storage: set[str] = field(default_factory=set)  # storages a saved view keeps alive
    saved_storage_bytes: int = 0  # bytes of the storages the saved tensors keep alive

    @property
    def fwd_lines(self) -> list[Line]:
        return [ln for ln in self.lines if ln.pane == "fwd"]

    @property
    def bwd_lines(self) -> list[Line]:
        return [ln for ln in self.lines if ln.pane == "bwd"]

    def code_lines(self, pane: str) -> int:
        """Lines of code in a pane (``"fwd"`` or ``"bwd"``): the operations and parameter
        reads, as the page and ``repr`` count them (the ``def`` line, the input comments and
        the ``return`` are not counted)."""
        return sum(1 for ln in self.lines if ln.pane == pane and ln.kind in ("op", "param"))

    @property
    def derivative_word(self) -> str:
        """What the derivative lines are called: ``"backward"`` (reverse mode, also when
        tangent code is mixed in), ``"tangent"`` (forward mode) or ``""`` (a captured graph
        without derivative code)."""
        return {"reverse": "backward", "mixed": "backward", "forward": "tangent"}.get(
            self.mode, "")


# ------------------------------------------------------------------------------ statements

def statements(gm: fx.GraphModule) -> tuple[dict[str, str], str]:
    """Node name → its statement in the generated code of ``gm`` (public spellings, without
    FX's ``x = None`` deletions), and the ``def`` line."""
    graph = gm.graph
    found: dict[str, str] = {}
    nodes = list(graph.nodes)
    inner = codegen.BodyTransformer(graph)

    def record(body: list[str]) -> list[str]:
        out = inner(body)
        idx: int | None = None
        buf: list[str] = []

        def flush() -> None:
            if idx is not None and idx < len(nodes):
                text = "".join(e for e in buf if not e.lstrip().startswith("# "))
                found[nodes[idx].name] = _DELETION.sub("", text).strip()

        for entry in out:
            m = re.fullmatch(r"# COUNTER: (\d+)\n?", entry)
            if m:
                flush()
                idx, buf = int(m.group(1)), []
            else:
                buf.append(entry)
        flush()
        return out

    old = graph._codegen._body_transformer
    try:
        graph._codegen._body_transformer = record
        src = graph.python_code("self").src
    finally:
        graph._codegen._body_transformer = old
    def_line = next((ln.strip() for ln in src.splitlines() if ln.strip().startswith("def ")),
                    "def forward(self, ...):")
    return found, def_line


# ------------------------------------------------------------------------------ helpers

def _is_reverse_graph(gm: fx.GraphModule) -> bool:
    return any("fxad_bwd_of" in n.meta for n in gm.graph.nodes)


def _is_forward_mode(gm: fx.GraphModule) -> bool:
    return any("fxad_jvp_of" in n.meta for n in gm.graph.nodes)


def _with_cotangent(gm: fx.GraphModule) -> fx.GraphModule | None:
    """``gm`` if it takes cotangents (``fxad.vjp``).  For ``fxad.grad``, whose backward is
    seeded with ``ones_like(output)``, a copy in which that seed is a cotangent input again,
    which is what :func:`fxad.partition` expects of a VJP graph; ``None`` when the seed was
    folded away by simplification (``tanh(x).sum()``) or there is no backward."""
    nodes = list(gm.graph.nodes)
    if any(n.op == "placeholder" and n.meta.get("fxad_cotangent") for n in nodes):
        return gm
    result = gm.graph.output_node().args[0]
    first = result[0] if isinstance(result, (tuple, list)) and result else None
    if not isinstance(first, fx.Node) or not isinstance(first.meta.get("val"), torch.Tensor):
        return None
    seed = next((n for n in nodes if n.op == "call_function" and n.target is torch.ones_like
                 and n.args and n.args[0] is first
                 and n.meta.get("fxad_bwd_of") == first.name), None)
    if seed is None:
        return None
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    out = g.graph_copy(gm.graph, env)
    phs = [env[n] for n in nodes if n.op == "placeholder"]
    if phs:
        ctx = g.inserting_after(phs[-1])
    else:
        ctx = g.inserting_before(next(iter(g.nodes)))
    with ctx:
        ph = g.placeholder(f"d_{first.name}")
    ph.meta = {"val": first.meta["val"], "fxad_cotangent": True}
    env[seed].replace_all_uses_with(ph)
    g.erase_node(env[seed])
    g.output(out)
    codegen.install(g)
    root = gm.meta.get("fxad_source_module") or gm
    new = fx.GraphModule(root, g, class_name=type(gm).__name__)
    new.meta.update(gm.meta)
    return new


def _policy_name(policy: Any) -> str:
    if policy is None or policy in ("min_memory", "default"):
        return "min_memory"
    if isinstance(policy, str):
        return policy
    return "custom"


def _short_path(path: str) -> str:
    return os.path.basename(path) if path else "?"


def _context(path: str, lineno: int, radius: int = 2) -> list[tuple[int, str]]:
    out = []
    for k in range(max(1, lineno - radius), lineno + radius + 1):
        text = linecache.getline(path, k)
        if not text and k > lineno:
            break
        if text:
            out.append((k, text.rstrip("\n")))
    return out


def _tensor_leaves(v: Any) -> list[torch.Tensor]:
    return [x for x in pytree.tree_leaves(v) if isinstance(x, torch.Tensor)]


def _shape(node: fx.Node) -> str:
    try:
        return codegen.shape_note(node)
    except Exception:  # noqa: BLE001  (an exotic meta value: show nothing)
        return ""


# ------------------------------------------------------------------------------ build

def build(gm: fx.GraphModule, *, policy: Any = None, title: str | None = None) -> ViewModel:
    """Compute the :class:`ViewModel` of ``gm`` (see the module docstring).

    Args:
        gm: a graph module made by fxad (``vjp``, ``grad``, ``jvp``, ``hvp``, ``trace``).
        policy: ``None`` (the code as generated), or a residual policy of
            :func:`fxad.partition` (``"save"``, ``"min_memory"``, a :class:`fxad.Policy`): show
            the training step that policy runs.
        title: heading of the page (default: the module's class name).

    Raises:
        fxad.InputError: ``policy`` given for a graph without backward code, or a graph
            that :func:`fxad.partition` cannot split.
    """
    if not isinstance(gm, fx.GraphModule):
        raise InputError(f"fxad.view needs a GraphModule made by fxad, got {type(gm).__name__}")
    reverse = _is_reverse_graph(gm)
    warnings: list[str] = []
    part = None
    shown = gm
    orig_meta: dict[str, dict] = {n.name: n.meta for n in gm.graph.nodes}
    if policy is not None:
        if not reverse:
            raise InputError("a residual policy applies to backward code: pass a graph made "
                             "by fxad.vjp or fxad.grad (this one has no backward)")
        vg = _with_cotangent(gm)
        if vg is None:
            raise InputError("this fxad.grad graph has no ones_like seed left to split at "
                             "(simplification folded it); view fxad.vjp of the same function "
                             "to see a residual policy")
        part = partition(vg, policy)
        result = vg.graph.output_node().args[0]
        shown = joint_graph(part, with_params=len(result) > 2)
        policy_name = _policy_name(policy)
        policy_note = (f"residual policy {policy_name!r}: the training step of "
                       "fxad.residuals.joint_graph: the forward, then the backward with the "
                       "values the policy recomputes written where they are needed")
    elif reverse:
        policy_name = "save"
        policy_note = ("code as generated: every forward value the backward reads stays "
                       "alive (residual policy 'save'); pass policy='min_memory' to see "
                       "what a policy recomputes")
        try:
            vg = _with_cotangent(gm)
            part = partition(vg, "save") if vg is not None else None
        except Exception:  # noqa: BLE001  (outputs the split does not handle: read the graph)
            part = None
    else:
        policy_name, policy_note = "", ""

    graph = shown.graph
    nodes = list(graph.nodes)
    by_name = {n.name: n for n in nodes}
    stmts, def_line = statements(shown)
    out_node = graph.output_node()
    result = out_node.args[0]

    # --- which nodes are derivative code
    def tag(n: fx.Node) -> tuple[str, str] | None:
        if n.meta.get("fxad_jvp_of") is not None:
            return ("tangent", str(n.meta["fxad_jvp_of"]))
        if n.meta.get("fxad_bwd_of") is not None:
            return ("backward", str(n.meta["fxad_bwd_of"]))
        return None

    seeds = {n for n in nodes if n.op == "placeholder"
             and (n.meta.get("fxad_cotangent") or n.meta.get("fxad_tangent"))}
    deriv: set[fx.Node] = set()
    for n in nodes:
        if n.op in ("placeholder", "output"):
            continue
        if tag(n) is not None or any(a in seeds or a in deriv for a in n.all_input_nodes):
            deriv.add(n)
    primal_out = None
    if isinstance(result, (tuple, list)) and result and (
            "fxad_cotangent_names" in gm.meta or "fxad_jvp_inputs" in gm.meta or part is not None):
        primal_out = result[0]
    if primal_out is not None:
        need: set[fx.Node] = set()
        stack = [x for x in pytree.tree_leaves(primal_out) if isinstance(x, fx.Node)]
        while stack:
            n = stack.pop()
            if n in need or n in seeds:
                continue
            need.add(n)
            stack.extend(n.all_input_nodes)
        deriv -= need
    # get_attr reads inside the backward (parameters read again): derivative when only
    # derivative code uses them
    for n in nodes:
        if n.op == "get_attr" and n.users and all(u in deriv for u in n.users):
            deriv.add(n)

    # --- map nodes of the shown graph to the original one (a joint step renames the
    # recomputed nodes ``<name>_recomputed``; the backward nodes keep their names)
    def original_meta(n: fx.Node) -> dict:
        if shown is gm:
            return n.meta
        if n.meta.get("fxad_recomputed") and n.name.endswith(_RECOMPUTED):
            return orig_meta.get(n.name[:-len(_RECOMPUTED)], n.meta)
        return orig_meta.get(n.name, n.meta)

    # block key of each derivative node: the forward node it differentiates
    orig_graph = gm.graph

    def block_key(n: fx.Node) -> tuple[str, str] | None:
        if n.meta.get("fxad_recomputed"):
            return None  # decided below: the block of the backward node that needs it
        meta = original_meta(n)
        if meta.get("fxad_jvp_of") is not None:
            kind, of = "tangent", str(meta["fxad_jvp_of"])
        elif meta.get("fxad_bwd_of") is not None:
            kind, of = "backward", str(meta["fxad_bwd_of"])
        else:
            return None
        try:
            of = resolve(orig_graph, of)
        except Exception:  # noqa: BLE001
            pass
        return kind, of

    deriv_nodes = [n for n in nodes if n in deriv]
    keys: dict[fx.Node, tuple[str, str] | None] = {n: block_key(n) for n in deriv_nodes}
    nxt: tuple[str, str] | None = None
    for n in reversed(deriv_nodes):  # recomputed nodes join the block that follows them
        if keys[n] is None and n.meta.get("fxad_recomputed"):
            keys[n] = nxt
        elif keys[n] is not None:
            nxt = keys[n]
    prev: tuple[str, str] | None = None
    for n in deriv_nodes:  # untagged derivative nodes join the block before them
        if keys[n] is None:
            keys[n] = prev
        prev = keys[n]

    # --- sources
    sources: list[Source] = []
    src_index: dict[tuple[str, int], int] = {}

    def src_of(loc: Any) -> int | None:
        if not isinstance(loc, SourceLoc):
            return None
        k = (loc.filename, loc.lineno)
        if k not in src_index:
            src_index[k] = len(sources)
            ctx = _context(loc.filename, loc.lineno)
            sources.append(Source(id=len(sources), path=loc.filename,
                                  short=f"{_short_path(loc.filename)}:{loc.lineno}",
                                  lineno=loc.lineno, function=loc.function, code=loc.code,
                                  context=ctx or [(loc.lineno, loc.code)]))
        return src_index[k]

    fwd_of_name: dict[str, str] = {}
    for n in nodes:
        of = n.meta.get("fxad_fwd_of")
        if of is not None and n not in deriv:
            fwd_of_name[n.name] = str(of)

    def fwd_loc(n: fx.Node) -> Any:
        loc = n.meta.get("fxad_loc")
        if loc is None and n.name in fwd_of_name:
            owner = by_name.get(fwd_of_name[n.name])
            loc = owner.meta.get("fxad_loc") if owner is not None else None
        if loc is None and n.op == "call_function" and n.target is operator.getitem \
                and isinstance(n.args[0], fx.Node):
            loc = n.args[0].meta.get("fxad_loc")
        return loc

    # --- gradients returned
    grad_label: dict[str, str] = {}
    if reverse and isinstance(result, (tuple, list)) and len(result) >= 2:
        inputs = [n for n in nodes if n.op == "placeholder" and n not in seeds
                  and not n.name.startswith("no_cotangent")]
        in_grads = result[1]
        if isinstance(in_grads, (tuple, list)):
            for ph, gnode in zip(inputs, in_grads):
                if isinstance(gnode, fx.Node):
                    grad_label.setdefault(gnode.name, f"gradient of input {ph.name}")
        if len(result) > 2 and isinstance(result[2], dict):
            for pname, gnode in result[2].items():
                if isinstance(gnode, fx.Node):
                    grad_label.setdefault(gnode.name, f"gradient of parameter {pname}")

    # --- saved tensors
    saved_names: list[str] = []
    recomputed: list[str] = []
    if part is not None:
        saved_names = [s for s in part.saved_names if s in by_name]
        recomputed = list(part.recomputed)
    elif reverse:
        seen: set[str] = set()
        for n in deriv_nodes:
            for a in n.all_input_nodes:
                if a not in deriv and a.op != "get_attr" and a not in seeds \
                        and a.name not in seen:
                    seen.add(a.name)
                    saved_names.append(a.name)
        saved_names.sort(key=lambda s: nodes.index(by_name[s]))
    saved_set = set(saved_names)

    # --- lines
    lines: list[Line] = []
    node_line: dict[str, int] = {}
    mem = simulate(graph)
    sim_nodes = [n for n in nodes if n.op != "output"]
    mem_after = dict(zip((n.name for n in sim_nodes), mem.bytes_per_node))
    def refs(node: fx.Node) -> list[str]:
        # the values a line reads: the node's inputs in the graph (not names found in the
        # text, where ``torch.nn.functional.linear`` would read as the node ``linear``)
        return list(dict.fromkeys(a.name for a in node.all_input_nodes))

    def add_line(pane: str, kind: str, text: str, node: fx.Node | None = None,
                 **kw: Any) -> Line:
        ln = Line(id=len(lines), pane=pane, kind=kind, text=text, **kw)
        if node is not None:
            ln.node = node.name
            ln.shape = _shape(node)
            ln.nbytes = sum(int(t.numel()) * t.element_size()
                            for t in _tensor_leaves(node.meta.get("val")))
            ln.mem = mem_after.get(node.name, 0)
            ln.refs = refs(node)
            node_line[node.name] = ln.id
        lines.append(ln)
        return ln

    # one line per node, in the order the code runs (so that the memory timeline reads left
    # to right); each line goes to the forward or the derivative pane
    add_line("fwd", "def", def_line)
    blocks: list[Block] = []
    first_fwd: dict[str, str] = {}
    for name, of in fwd_of_name.items():
        first_fwd.setdefault(of, name)
    running = 0
    boundary: int | None = None
    cur_key: Any = object()
    for n in nodes:
        if n.op == "placeholder":
            if n.name.startswith("no_cotangent") or (n in seeds and not n.users):
                continue
            if n in seeds:  # shown at the top of the derivative code
                what = "cotangent" if n.meta.get("fxad_cotangent") else "tangent"
                of = n.meta.get("fxad_tan_of")
                ln = add_line("bwd", "input",
                              f"# {what} input {n.name}" + (f" (of {of})" if of else ""), n)
            else:
                ln = add_line("fwd", "input", f"# input {n.name}", n, src=src_of(fwd_loc(n)))
                ln.saved = n.name in saved_set
            ln.mem = running
            continue
        if n.op == "output":
            continue
        text = stmts.get(n.name, n.name)
        kind = "param" if n.op == "get_attr" else "op"
        if n not in deriv:
            ln = add_line("fwd", kind, text, n, op=op_kind(n) if kind == "op" else "",
                          src=src_of(fwd_loc(n)), saved=n.name in saved_set,
                          grad=grad_label.get(n.name))
            running = ln.mem
            continue
        key = keys[n]
        if key != cur_key or not blocks:
            cur_key = key
            bkind, of = key if key is not None else ("backward", "")
            target = by_name.get(of)
            stmt_node = first_fwd.get(of, of)
            fstmt = stmts.get(stmt_node) or stmts.get(of) or of
            header = f"{bkind} of: {fstmt}" if of else f"{bkind} code"
            meta = original_meta(n)
            loc = meta.get("fxad_jvp_src" if bkind == "tangent" else "fxad_bwd_src")
            if loc is None and target is not None:
                loc = fwd_loc(target)
            blocks.append(Block(id=len(blocks), key=of, kind=bkind, header=header,
                                src=src_of(loc)))
        b = blocks[-1]
        rec_from = None
        if n.meta.get("fxad_recomputed"):
            rec_from = n.name[:-len(_RECOMPUTED)] if n.name.endswith(_RECOMPUTED) else n.name
            b.recomputes.append(n.name)
        ln = add_line("bwd", kind, text, n, op=op_kind(n) if kind == "op" else "",
                      block=b.id, grad=grad_label.get(n.name), recomputed_from=rec_from,
                      src=src_of(fwd_loc(n)) if rec_from else b.src)
        running = ln.mem
        if boundary is None and kind == "op":
            boundary = ln.id
        b.lines.append(ln.id)
        for a in n.all_input_nodes:
            if a.name in saved_set and a.name not in b.reads_saved:
                b.reads_saved.append(a.name)
    ret_text = stmts.get(out_node.name, "return ...")
    ret = add_line("bwd" if deriv_nodes else "fwd", "return", ret_text)
    ret.refs = refs(out_node)
    ret.mem = lines[ret.id - 1].mem if ret.id else 0
    if boundary is None:
        boundary = len(lines)

    # forward lines each block differentiates: the node itself, the nodes its rule's forward
    # wrote, and the items picked out of a multi-output result
    group: dict[str, list[str]] = {}
    for name, of in fwd_of_name.items():
        group.setdefault(of, []).append(name)
    readers_of: dict[str, set] = {}
    for ln in lines:
        for r in ln.refs:
            readers_of.setdefault(r, set()).add(ln.block)
    for b in blocks:
        b.outputs = [lines[i].node for i in b.lines if lines[i].kind == "op"
                     and readers_of.get(lines[i].node or "", set()) - {b.id}]
        names_ = [b.key] + [x for x in group.get(b.key, []) if x != b.key]
        ids = sorted({node_line[x] for x in names_ if x in node_line})
        b.targets = ids
        b.saved_bytes = sum(nbytes(by_name[s]) for s in b.reads_saved if s in by_name)

    # --- saved tensor table
    saved: list[Saved] = []
    for s in saved_names:
        n = by_name[s]
        role = "input" if n.op == "placeholder" else "activation"
        if n.meta.get("fxad_param"):
            role = "parameter"
        readers = [b.id for b in blocks if s in b.reads_saved]
        saved.append(Saved(name=s, line=node_line.get(s), shape=_shape(n),
                           nbytes=0 if role == "parameter" else nbytes(n), role=role,
                           readers=readers))
    saved_bytes = sum(s.nbytes for s in saved)

    # storages that saved tensors keep alive through views (``transpose`` keeps ``linear``)
    saved_storage: set[str] = set()
    roots: dict[str, fx.Node] = {}
    for s in saved_names:
        n = by_name[s]
        while (n.op == "call_function" and n.target is operator.getitem
               or n.op in ("call_function", "call_method") and kind_of(n) == "view") \
                and n.all_input_nodes:
            n = n.all_input_nodes[0]
        if n.name != s:
            saved_storage.add(n.name)
        roots[n.name] = n
    # bytes of those storages, as fxad.memory.simulate counts them (inputs and parameters: 0)
    storage_bytes = sum(nbytes(n) for n in roots.values()
                        if n.op not in ("placeholder", "get_attr"))

    # --- memory peak
    live = []
    for name in mem.live_at_peak:
        n = by_name.get(name)
        if n is not None:
            live.append((name, nbytes(n), _shape(n), node_line.get(name)))

    mode = "graph"
    if reverse and _is_forward_mode(shown):
        mode = "mixed"
    elif reverse:
        mode = "reverse"
    elif _is_forward_mode(shown):
        mode = "forward"
    cls = type(gm).__name__
    m_ = re.fullmatch(r"(.*?)(VJP|JVP|HVP)", cls)
    if m_ and m_.group(1):
        api = {"JVP": "fxad.jvp", "HVP": "fxad.hvp"}.get(m_.group(2))
        if api is None:
            api = "fxad.vjp" if any(n.meta.get("fxad_cotangent") for n in gm.graph.nodes
                                    if n.op == "placeholder") else "fxad.grad"
        cls = f"{m_.group(1)} · {api}"
    base = title or cls
    what = {"reverse": "forward and backward", "forward": "primal and tangent code",
            "mixed": "primal and derivative code", "graph": "captured graph"}[mode]
    ins = [f"{ln.node}: {ln.shape}" for ln in lines if ln.kind == "input" and ln.shape]
    subtitle = what + (f" at {', '.join(ins)}" if ins else "")
    return ViewModel(title=base, subtitle=subtitle, mode=mode, lines=lines, blocks=blocks,
                     sources=sources, saved=saved, policy=policy_name,
                     policy_note=policy_note, saved_bytes=saved_bytes, recomputed=recomputed,
                     peak_bytes=mem.peak_bytes, peak_line=node_line.get(mem.peak_node),
                     live_at_peak=live, boundary=boundary, graph=shown, node_line=node_line,
                     warnings=warnings, saved_storage=saved_storage,
                     saved_storage_bytes=storage_bytes)
