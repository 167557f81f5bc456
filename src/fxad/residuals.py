"""Residual (saved-tensor) policies: split a VJP graph into a forward and a backward graph.

:func:`partition` takes the graph of ``fxad.vjp(model, *inputs)`` (forward nodes, then the
backward nodes tagged ``meta['fxad_bwd_of']``) and returns a :class:`Partition`:

* ``fwd_gm(*inputs) -> (*outputs, *saved)``: the nodes the outputs need, the side effects
  (batch-norm running statistics) and the residuals;
* ``bwd_gm([*saved, *cotangents]) -> (*input_grads, *param_grads)`` (one list, emptied on
  entry so that saved tensors are freed after their last use): the backward nodes, plus
  the forward nodes the policy chose to *recompute* (each one emitted just before its first
  use, under the header of the backward block that needs it).

:func:`joint_graph` puts the two back into one graph, forward then backward, with the
recomputations where ``bwd_gm`` has them: the whole training step for ``torch.compile``,
whose saved set is the policy's (a single graph compiled as it comes keeps alive whatever
its backward reads; duplicating the recomputed nodes after the forward is what lets a
compiler free their inputs' results early).

The residuals are a named, printed thing: ``part.saved_names`` lists them; the generated
code of ``fwd_gm`` carries ``# saved for backward: ...`` above its ``return`` and
``bwd_gm``'s code lists them (with shapes and bytes) under its ``def`` line; every
``# backward of: ...`` block header of ``bwd_gm`` ends with ``[saved N B: a, b]``, the
saved tensors that block reads, so ``fxad.show(part.bwd_gm)`` reports saved bytes per block.
:meth:`Partition.report` prints a table: per backward block, whether the residuals its rule
reads are the op's *inputs*, its *output*, *intermediates* of its forward (statistics,
indices) or *other* values (:func:`residual_kind`), beside the rule's own ``residuals``
declaration (see :mod:`fxad.rules.registry`), and their bytes.

Policies
--------
A node in the forward graph is available to the backward either by **saving** it (it is
returned by ``fwd_gm``) or by **recomputing** it in ``bwd_gm`` from values that are
themselves available.  ``policy`` chooses:

``"save"``
    recompute nothing: every forward value a backward node reads is saved (what the joint
    ``fxad.grad`` code keeps alive).
``"min_memory"`` (the default)
    minimize the saved bytes (``meta['val']``: ``numel * itemsize``) subject to recomputing
    only *cheap* ops: elementwise ops and views (:data:`CHEAP_OPS`).  Solved exactly as a
    minimum s-t cut (the same formulation as AOTAutograd's rematerialization partitioner);
    among minimum cuts the one that recomputes least is taken.
:class:`Policy`
    the default plus overrides: ``Policy(by_op={"gelu": "save", "matmul": "recompute"},
    by_node={"relu_3": "recompute"}, recompute_cheap=True)``.  Keys of ``by_op`` are op kinds
    as :func:`op_kind` spells them (``"relu"``, ``"add"``, ``"view"``, ``"linear"``) or the
    callables themselves (``torch.relu``); ``by_node`` keys are node names of the VJP graph.
    ``"recompute"`` makes any pure op recomputable (activation checkpointing of a
    ``matmul``); ``"save"`` forbids recomputing it.  Random ops (dropout) and ops with side
    effects are never recomputed; a ``"recompute"`` that cannot be honoured (an input
    placeholder) raises :class:`fxad.InputError`.

Activation checkpointing
------------------------
Whatever the policy, the forward values computed inside a ``torch.utils.checkpoint`` region
(``node.meta['fxad_checkpoint']``, set by the capture) or inside a submodule selected by a
:class:`Checkpoint` (``checkpoint=`` of :func:`partition`), and used only inside it, are
recomputed in the backward; the region's inputs and outputs are saved as the policy says
(its outputs are kept as computed, as ``torch.utils.checkpoint`` keeps them), random ops
and ops with side effects inside it are saved (:func:`checkpoint_regions`,
``Partition.checkpointed``, ``report()``).

Staged backward
---------------
:func:`split_backward` cuts ``bwd_gm`` into stages that return parameter gradients as they
are completed, for :func:`fxad.compile`'s bridge under DDP and FSDP (``grad_release=``).

Which ops count as cheap comes from the rules: a rule declares ``recompute=True`` (every
elementwise unary rule does) or ``recompute=False``; ops without a declaration are cheap when
their name is in :data:`CHEAP_OPS`.  Op-kind defaults can also be set globally with
:func:`set_residual_policy` (``set_residual_policy(torch.nn.functional.gelu, "save")``).
"""
from __future__ import annotations

import operator
import sys
import textwrap
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from . import codegen
from .errors import InputError
from .simplify import dce, fold_algebra, fold_shapes
from .simplify._util import is_impure, is_random, resolve

__all__ = ["Policy", "Checkpoint", "Partition", "partition", "joint_graph", "op_kind",
           "set_residual_policy", "checkpoint_regions", "split_backward", "StagedBackward",
           "CHEAP_OPS", "ELEMENTWISE_OPS", "VIEW_OPS", "nbytes", "residual_kind"]

ELEMENTWISE_OPS = frozenset({
    "add", "sub", "mul", "truediv", "div", "neg", "pow", "rsub", "floordiv", "mod",
    "abs", "exp", "log", "log1p", "expm1", "sqrt", "rsqrt", "sin", "cos", "tanh", "sigmoid",
    "relu", "gelu", "silu", "elu", "leaky_relu", "softplus", "hardtanh", "sign", "reciprocal",
    "square", "erf", "clamp", "clamp_min", "clamp_max", "where", "maximum", "minimum",
    "eq", "ne", "lt", "le", "gt", "ge", "logical_not", "logical_and", "logical_or",
    "to", "float", "half", "bfloat16", "double", "type_as", "clone", "contiguous",
    "masked_fill", "lerp", "addcmul", "addcdiv", "ones_like", "zeros_like", "full_like",
})
VIEW_OPS = frozenset({
    "view", "reshape", "flatten", "unflatten", "transpose", "t", "permute", "unsqueeze",
    "squeeze", "expand", "expand_as", "view_as", "reshape_as", "getitem", "split", "chunk",
    "unbind", "narrow", "select", "movedim", "swapaxes", "unfold", "detach", "alias",
})
CHEAP_OPS = ELEMENTWISE_OPS | VIEW_OPS

_GLOBAL_POLICY: dict[str, str] = {}
_INF = 1 << 62


def op_kind(node: fx.Node) -> str:
    """The op kind used by policies: ``torch.relu`` → ``"relu"``, ``operator.mul`` →
    ``"mul"``, ``x.view(...)`` → ``"view"``, ``torch.ops.aten.foo`` → ``"foo"``."""
    t = node.target
    if node.op == "call_method":
        return str(t)
    if node.op == "call_function":
        name = getattr(t, "__name__", None) or str(t)
        if isinstance(t, torch._ops.OpOverloadPacket) or isinstance(t, torch._ops.OpOverload):
            name = str(t).split(".")[-2] if isinstance(t, torch._ops.OpOverload) else t.__name__
        return name.rsplit(".", 1)[-1]
    return node.op


def _key(k: Any) -> str:
    if isinstance(k, str):
        return k
    name = getattr(k, "__name__", None)
    if name is None:
        raise InputError(f"policy key {k!r}: use an op name such as 'relu' or a torch callable")
    return name


def set_residual_policy(op: Any, choice: str | None) -> None:
    """Register the default residual choice for an op kind: ``"save"`` or ``"recompute"``
    (``None`` removes the entry).  :class:`Policy` overrides still take precedence."""
    if choice is None:
        _GLOBAL_POLICY.pop(_key(op), None)
        return
    if choice not in ("save", "recompute"):
        raise InputError(f"residual policy must be 'save' or 'recompute', not {choice!r}")
    _GLOBAL_POLICY[_key(op)] = choice


@dataclass
class Policy:
    """A residual policy (see the module docstring).

    Attributes:
        recompute_cheap: let the min-cut recompute elementwise ops and views.
        by_op: op kind (or callable) → ``"save"`` / ``"recompute"``.
        by_node: node name → ``"save"`` / ``"recompute"`` (wins over ``by_op``).
    """

    recompute_cheap: bool = True
    by_op: Mapping[Any, str] = field(default_factory=dict)
    by_node: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for d in (self.by_op, self.by_node):
            for k, v in d.items():
                if v not in ("save", "recompute"):
                    raise InputError(f"policy for {k!r} must be 'save' or 'recompute', not {v!r}")
        self.by_op = {_key(k): v for k, v in self.by_op.items()}

    def choice(self, node: fx.Node) -> str:
        """``"save"``, ``"recompute"`` (forced) or ``"cheap"`` (recomputable when that saves
        bytes) for a forward node."""
        if node.name in self.by_node:
            return self.by_node[node.name]
        kind = op_kind(node)
        if kind in self.by_op:
            return self.by_op[kind]
        if kind in _GLOBAL_POLICY:
            return _GLOBAL_POLICY[kind]
        if not self.recompute_cheap:
            return "save"
        declared = _declared_recompute(node)
        if declared is not None:
            return "cheap" if declared else "save"
        return "cheap" if kind in CHEAP_OPS else "save"


def _declared_recompute(node: fx.Node) -> bool | None:
    """The ``recompute`` declaration of the rule registered for ``node``'s op, if any."""
    from .rules.dispatch import rule_key
    from .rules.registry import lookup

    if node.op not in ("call_function", "call_method"):
        return None
    rule = lookup(rule_key(node.graph.owning_module, node))
    return None if rule is None else rule.recompute


def as_policy(policy: str | Policy | None) -> Policy:
    if policy is None or policy in ("min_memory", "default"):
        return Policy()
    if policy == "save":
        return Policy(recompute_cheap=False)
    if isinstance(policy, Policy):
        return policy
    raise InputError(f"unknown residual policy {policy!r}: use 'save', 'min_memory' or a "
                     "fxad.residuals.Policy")


@dataclass
class Checkpoint:
    """Activation checkpointing chosen at the model level (``checkpoint=`` of
    :func:`partition`, :func:`fxad.compile`, :func:`fxad.joint_step`).

    The forward values computed inside a checkpointed submodule are recomputed in the
    backward instead of being saved; only what enters the submodule (and what leaves it,
    when the code after it needs that) is saved, as ``torch.utils.checkpoint`` around the
    submodule's call would do.

    Attributes:
        modules: which submodules are candidates: a module class or a tuple of classes
            (every instance, e.g. ``Block``), or module names as in ``named_modules()``
            (``["blocks.0", "blocks.3"]``).  Candidates are ordered as the forward first
            runs them.
        every: checkpoint every ``every``-th candidate (``1``: all of them; ``2``: the 1st,
            3rd, 5th, ...).
        budget: instead of ``every``: a memory budget in bytes.  The fewest leading
            candidates are checkpointed (the first ``j``, found by bisection) for which the
            simulated peak of the training step (:func:`fxad.memory.simulate` of
            :func:`joint_graph`: the tensors allocated during the step, not the parameters
            or inputs) is at most ``budget``; if even all of them do not reach it, all are
            checkpointed and a warning says so.  The leading blocks are chosen because
            their activations live longest and their recomputation runs at the end of the
            backward, where the least memory is in use.
        user_regions: also honour the model's own ``torch.utils.checkpoint`` regions
            (captured as ``node.meta['fxad_checkpoint']``).
    """

    modules: Any = None
    every: int = 1
    budget: int | None = None
    user_regions: bool = True

    def __post_init__(self) -> None:
        if self.every < 1:
            raise InputError(f"Checkpoint(every={self.every}): must be 1 or more")
        if self.budget is not None and self.budget < 0:
            raise InputError(f"Checkpoint(budget={self.budget}): must be a number of bytes >= 0")
        if self.modules is None and (self.budget is not None or self.every != 1):
            raise InputError("Checkpoint(every=/budget=) needs modules=: a module class (e.g. "
                             "your transformer block) or a list of module names")


def as_checkpoint(checkpoint: "Checkpoint | bool | None") -> "Checkpoint | None":
    """``None``/``True``: the user's ``torch.utils.checkpoint`` regions only; ``False``: no
    regions at all; a :class:`Checkpoint` as given."""
    if checkpoint is None or checkpoint is True:
        return Checkpoint()
    if checkpoint is False:
        return None
    if isinstance(checkpoint, Checkpoint):
        return checkpoint
    raise InputError(f"checkpoint={checkpoint!r}: use a fxad.residuals.Checkpoint, True/None "
                     "(honour torch.utils.checkpoint regions) or False (ignore them)")


def _origin_meta(vjp_gm: fx.GraphModule) -> Any:
    """``node -> meta`` of the captured node a forward node of the VJP graph comes from (the
    node a rule's ``fwd`` wrote it for, ``meta['fxad_fwd_of']``, in the captured graph
    ``vjp_gm.meta['fxad_forward']``), else the node's own meta."""
    fw = vjp_gm.meta.get("fxad_forward")
    by_name = {n.name: n for n in fw.graph.nodes} if isinstance(fw, fx.GraphModule) else {}

    def meta_of(n: fx.Node) -> dict:
        o = n.meta.get("fxad_fwd_of")
        if o is not None and o in by_name:
            return by_name[o].meta
        return n.meta
    return meta_of


def _module_path_entries(meta: dict) -> list[tuple[str, Any]]:
    """``(module path, module class)`` of each entry of ``meta['nn_module_stack']``."""
    out = []
    for k, v in (meta.get("nn_module_stack") or {}).items():
        if isinstance(v, tuple) and len(v) == 2:
            out.append((str(v[0]), v[1]))
        else:
            out.append((str(k), v))
    return out


def _class_matches(cls: Any, wanted: tuple) -> bool:
    if isinstance(cls, type):
        return issubclass(cls, wanted)
    name = str(cls)  # some captures record the class as a string
    return any(name in (t.__name__, t.__qualname__, f"{t.__module__}.{t.__qualname__}")
               for t in wanted)


def checkpoint_candidates(vjp_gm: fx.GraphModule, modules: Any) -> list[str]:
    """Module paths of the graph's forward nodes matching ``modules`` (a class, a tuple of
    classes or module names), in the order the forward first reaches them."""
    meta_of = _origin_meta(vjp_gm)
    if isinstance(modules, type) or (isinstance(modules, tuple) and modules
                                     and all(isinstance(t, type) for t in modules)):
        wanted = modules if isinstance(modules, tuple) else (modules,)

        def match(path: str, cls: Any) -> bool:
            return _class_matches(cls, wanted)
    else:
        names = [modules] if isinstance(modules, str) else list(modules)
        if not all(isinstance(x, str) for x in names):
            raise InputError("Checkpoint(modules=...): a module class, a tuple of classes, or "
                             "module names (strings) as in named_modules()")
        name_set = set(names)

        def match(path: str, cls: Any) -> bool:
            return path in name_set
    found: dict[str, None] = {}
    for n in vjp_gm.graph.nodes:
        if n.op == "output" or n.meta.get("fxad_bwd_of") is not None:
            continue
        for path, cls in _module_path_entries(meta_of(n)):
            if path not in found and match(path, cls):
                found[path] = None
    return list(found)


def checkpoint_regions(vjp_gm: fx.GraphModule, forward_nodes: list[fx.Node],
                       user_regions: bool = True, modules: Iterable[str] = ()
                       ) -> list[tuple[str, list[fx.Node]]]:
    """The activation-checkpointing regions of the forward nodes ``forward_nodes`` (in graph
    order): ``[(label, nodes), ...]`` in forward order.

    A node belongs to a region when its captured node carries ``meta['fxad_checkpoint']``
    (the id of the innermost ``torch.utils.checkpoint`` call it was recorded in; with
    ``user_regions``) or was recorded inside one of the submodules ``modules`` (paths, from
    ``meta['nn_module_stack']``).  Regions whose spans in the forward order overlap (a call
    nested in another, a checkpointed call inside a checkpointed module) are merged into the
    outermost one, which is what ``torch.utils.checkpoint`` recomputes; every forward node
    within a merged span belongs to it."""
    meta_of = _origin_meta(vjp_gm)
    mods = set(modules)
    pos = {n: i for i, n in enumerate(forward_nodes)}
    spans: dict[Any, list[int]] = {}
    names: dict[Any, str] = {}
    for n in forward_nodes:
        if n.op in ("placeholder", "get_attr", "output"):
            continue
        m = meta_of(n)
        labels = []
        rid = m.get("fxad_checkpoint", n.meta.get("fxad_checkpoint")) if user_regions else None
        if rid is not None:
            labels.append(("user", rid))
            names[("user", rid)] = f"torch.utils.checkpoint #{rid}"
        if mods:
            for path, _ in _module_path_entries(m):
                if path in mods:
                    labels.append(("module", path))
                    names[("module", path)] = path
                    break
        for lab in labels:
            sp = spans.setdefault(lab, [pos[n], pos[n]])
            sp[1] = pos[n]
    merged: list[tuple[int, int, list[Any]]] = []
    for lab, (a, b) in sorted(spans.items(), key=lambda kv: (kv[1][0], -kv[1][1])):
        if merged and a <= merged[-1][1]:
            lo, hi, labs = merged[-1]
            merged[-1] = (lo, max(hi, b), labs + [lab])
        else:
            merged.append((a, b, [lab]))
    out = []
    for a, b, labs in merged:
        label = " + ".join(names[x] for x in labs)
        out.append((label, [n for n in forward_nodes[a:b + 1]
                            if n.op not in ("placeholder", "get_attr", "output")]))
    return out


def nbytes(node: fx.Node) -> int:
    """Bytes of a node's value from ``meta['val']`` (0 for non-tensor values)."""
    return sum(int(v.numel()) * v.element_size()
               for v in pytree.tree_leaves(node.meta.get("val"))
               if isinstance(v, torch.Tensor))


def _cost(node: fx.Node) -> int:
    """Bytes that saving ``node`` adds: 0 for a lifted parameter (the model holds it)."""
    return 0 if node.meta.get("fxad_param") else nbytes(node)


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return f"{n} B"


# --------------------------------------------------------------------------- min cut

class _Flow:
    """Dinic's max-flow on an adjacency-list graph with integer capacities."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.adj: list[list[int]] = [[] for _ in range(n)]
        self.to: list[int] = []
        self.cap: list[int] = []

    def add(self, u: int, v: int, c: int) -> None:
        self.adj[u].append(len(self.to)); self.to.append(v); self.cap.append(c)
        self.adj[v].append(len(self.to)); self.to.append(u); self.cap.append(0)

    def maxflow(self, s: int, t: int) -> int:
        total = 0
        while True:
            level = [-1] * self.n
            level[s] = 0
            q = deque([s])
            while q:
                u = q.popleft()
                for e in self.adj[u]:
                    if self.cap[e] > 0 and level[self.to[e]] < 0:
                        level[self.to[e]] = level[u] + 1
                        q.append(self.to[e])
            if level[t] < 0:
                return total
            it = [0] * self.n

            def dfs(u: int, f: int) -> int:
                if u == t:
                    return f
                while it[u] < len(self.adj[u]):
                    e = self.adj[u][it[u]]
                    v = self.to[e]
                    if self.cap[e] > 0 and level[v] == level[u] + 1:
                        d = dfs(v, min(f, self.cap[e]))
                        if d:
                            self.cap[e] -= d
                            self.cap[e ^ 1] += d
                            return d
                    it[u] += 1
                return 0

            while True:
                f = dfs(s, _INF)
                if not f:
                    break
                total += f

    def reaches_sink(self, t: int) -> list[bool]:
        """Nodes that can reach ``t`` in the residual graph (the sink side of the min cut
        closest to the sink)."""
        seen = [False] * self.n
        seen[t] = True
        q = deque([t])
        while q:
            v = q.popleft()
            for e in self.adj[v]:  # reverse edge e^1 goes u -> v with residual cap[e^1]
                u = self.to[e]
                if not seen[u] and self.cap[e ^ 1] > 0:
                    seen[u] = True
                    q.append(u)
        return seen


# --------------------------------------------------------------------------- partition

class _CommentCodeGen(fx.graph.CodeGen):
    """Default codegen plus a comment under the ``def`` line and one above ``return``."""

    def __init__(self, head: str = "", tail: str = "", boxed: bool = False) -> None:
        super().__init__()
        self.head, self.tail, self.boxed = head, tail, boxed

    def gen_fn_def(self, free_vars: list[str], maybe_return_annotation: str,
                   **kw: Any) -> str:
        if self.boxed:  # one list argument, emptied on entry: the graph owns its inputs
            names = [v for v in free_vars if v != "self"]
            text = super().gen_fn_def(["self", "args"], maybe_return_annotation)
            if names:
                text += (f"\n    {', '.join(names)}{',' if len(names) == 1 else ''} = args; "
                         "args.clear()")
            else:
                text += "\n    args.clear()"
        else:
            text = super().gen_fn_def(free_vars, maybe_return_annotation, **kw)
        if self.head:
            text += "".join(f"\n    {ln}" for ln in self.head.splitlines())
        return text

    def generate_output(self, output_args: Any, **kw: Any) -> str:
        text = super().generate_output(output_args, **kw)
        return f"{self.tail}\n{text}" if self.tail else text


@dataclass
class Partition:
    """Result of :func:`partition` (see the module docstring).

    Attributes:
        fwd_gm: ``fwd_gm(*inputs) -> (*outputs, *saved)``.
        bwd_gm: ``bwd_gm([*saved, *cotangents]) -> (*input_grads, *param_grads)``: one
            list argument, emptied on entry, so that each saved tensor is freed after its
            last use in the backward (as autograd frees a node's saved tensors).
        saved_names: names of the saved tensors, in ``fwd_gm``'s output order.
        saved_bytes: total bytes of the saved values (from ``meta['val']``).
        recomputed: names of the forward nodes recomputed in ``bwd_gm``.
        n_outputs: number of output leaves; ``out_spec`` their pytree structure.
        float_outputs: per output leaf, whether it takes a cotangent.
        input_grads: per input, whether ``bwd_gm`` returns a gradient (else ``None``).
        param_names: parameter names, in the order of ``bwd_gm``'s parameter gradients;
            ``param_has_grad``: False where the gradient is identically zero (unused
            parameter: autograd leaves its ``.grad`` at ``None``).
        blocks: per backward block ``(forward statement, saved names, bytes, kind,
            declared)``: ``kind`` from :func:`residual_kind` (plus ``" (recomputing)"`` when
            the block recomputes forward values), ``declared`` the rule's ``residuals``
            declaration (``""`` if none).
        lifted_params: ``fwd_gm`` takes the parameters of ``param_names`` after the inputs.
        root: the module both graphs read their parameters and buffers from.
        checkpointed: per activation-checkpointing region ``(label, recomputed node
            names, names of the saved values entering it (parameters aside), their bytes,
            names of its saved outputs)``; ``checkpoint_note``: how a memory budget was met.
    """

    fwd_gm: fx.GraphModule
    bwd_gm: fx.GraphModule
    saved_names: list[str]
    saved_bytes: int
    recomputed: list[str]
    n_outputs: int
    out_spec: Any
    float_outputs: list[bool]
    input_grads: list[bool]
    param_names: list[str]
    param_has_grad: list[bool]
    blocks: list[tuple[str, list[str], int, str, str]]
    lifted_params: bool = False
    root: Any = field(default=None, repr=False)
    checkpointed: list[tuple[str, list[str], list[str], int, list[str]]] = \
        field(default_factory=list)
    checkpoint_note: str = ""

    def report(self) -> str:
        """Table of saved bytes per backward block, and the totals; then the activation
        checkpointing regions, if any."""
        lines = [f"saved for backward: {len(self.saved_names)} values, "
                 f"{_fmt_bytes(self.saved_bytes)}; recomputed in backward: "
                 f"{len(self.recomputed)} nodes"]
        for stmt, names, b, kind, decl in self.blocks:
            note = f" (rule declares {decl})" if decl and decl != kind.split(" ")[0] else ""
            lines.append(f"  {_fmt_bytes(b):>10}  saves {kind + note:<24} "
                         f"{', '.join(names) or '-':<40}  <- {stmt}")
        if self.checkpointed:
            lines.append(f"activation checkpointing: {len(self.checkpointed)} region(s); the "
                         "values computed inside a region are recomputed in the backward, "
                         "not saved")
            if self.checkpoint_note:
                lines.append(f"  {self.checkpoint_note}")
            for label, rec, ins, b, outs in self.checkpointed:
                extra = f"; saves its output(s) {', '.join(outs)}" if outs else ""
                lines.append(f"  region {label}: recomputes {len(rec)} node(s); saves its "
                             f"inputs {', '.join(ins) or '-'} ({_fmt_bytes(b)}){extra}")
        return "\n".join(lines) + "\n"


def _statements(gm: fx.GraphModule) -> dict[str, str]:
    """Node name → its statement in the generated code of ``gm``."""
    found: dict[str, str] = {}

    class Grab(codegen.BodyTransformer):
        def _header(self, block: Any, node: fx.Node, stmt_of: dict[str, str]) -> str:
            found.update(stmt_of)
            return super()._header(block, node, stmt_of)

    graph = gm.graph
    old = graph._codegen._body_transformer
    try:
        t = Grab(graph)
        graph._codegen._body_transformer = t
        graph.python_code("self")
    finally:
        graph._codegen._body_transformer = old
    return found


def _lift_params(vjp_gm: fx.GraphModule, names: list[str]) -> fx.GraphModule:
    """A copy of ``vjp_gm`` whose reads of the parameters ``names`` (``get_attr`` nodes, under
    any alias of a tied parameter) are placeholders, one per parameter, after the inputs."""
    root = vjp_gm.meta.get("fxad_source_module") or vjp_gm
    by_id: dict[int, str] = {}
    for n in names:
        try:
            by_id[id(root.get_parameter(n))] = n
        except AttributeError:
            continue
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    nodes = list(vjp_gm.graph.nodes)
    last_input = max((i for i, n in enumerate(nodes) if n.op == "placeholder"
                      and not n.meta.get("fxad_cotangent")), default=-1)
    lifted: dict[str, fx.Node] = {}
    param_of: dict[fx.Node, str] = {}  # get_attr node -> name of the parameter it reads
    readers: dict[str, fx.Node] = {}  # the first read of each parameter names its placeholder
    for n in nodes:
        if n.op == "get_attr":
            try:
                key = by_id.get(id(root.get_parameter(n.target)))
            except AttributeError:
                key = None
            if key is not None:
                param_of[n] = key
                readers.setdefault(key, n)

    def add_placeholders() -> None:
        for name in names:
            r = readers.get(name)
            ph = g.placeholder(r.name if r is not None else name.replace(".", "_"))
            ph.meta = dict(r.meta) if r is not None else {}
            if "val" not in ph.meta:
                ph.meta["val"] = root.get_parameter(name).detach().to("meta")
            ph.meta["fxad_param"] = name
            lifted[name] = ph

    if last_input < 0:  # a model without tensor inputs
        add_placeholders()
    for i, n in enumerate(nodes):
        if n in param_of:
            env[n] = lifted[param_of[n]]
            continue
        env[n] = g.node_copy(n, lambda a: env[a])
        if i == last_input:
            add_placeholders()
    out = fx.GraphModule(root, g, class_name=type(vjp_gm).__name__)
    out.meta.update(vjp_gm.meta)
    return out


def residual_kind(value: fx.Node | None, emitted: Iterable[fx.Node],
                  reads: list[fx.Node]) -> str:
    """Classify the forward values a backward block reads, relative to the rule that wrote
    ``value`` (the forward node of the block) and ``emitted`` (the nodes its ``fwd`` wrote,
    tagged ``meta['fxad_fwd_of']``): ``"inputs"`` (arguments of those nodes), ``"output"``
    (``value`` and its items), ``"intermediates"`` (the other emitted nodes) and
    ``"other"``; joined with ``+`` in that order, ``"nothing"`` for no reads."""
    if not reads:
        return "nothing"
    if value is None:
        return "other"
    own = set(emitted) | {value}
    outputs = {value} | {u for u in value.users
                         if u.op == "call_function" and u.target is operator.getitem}
    args = {a for n in own for a in n.all_input_nodes} - own
    kinds = set()
    for r in reads:
        if r in outputs:
            kinds.add("output")
        elif r in own:
            kinds.add("intermediates")
        elif r in args:
            kinds.add("inputs")
        else:
            kinds.add("other")
    return "+".join(k for k in ("inputs", "output", "intermediates", "other") if k in kinds)


def partition(vjp_gm: fx.GraphModule, policy: str | Policy | None = "min_memory", *,
              lift_params: bool = False,
              checkpoint: "Checkpoint | bool | None" = None) -> Partition:
    """Split the graph of ``fxad.vjp(model_or_fn, *inputs)`` into forward and backward graphs
    with the residual policy ``policy`` (see the module docstring).

    With ``lift_params``, the parameters that receive gradients are explicit inputs:
    ``fwd_gm(*inputs, *params)`` (``params`` in the order of ``param_names``), and the
    backward reads them as saved values (which cost no memory: the model holds them);
    otherwise both graphs read them from the module (``self.fc.weight``).

    Activation checkpointing (``checkpoint``; default: the model's own
    ``torch.utils.checkpoint(fn, ..., use_reentrant=False)`` regions, captured as
    ``node.meta['fxad_checkpoint']``): the forward values computed inside a region and used
    only inside it are recomputed in the backward instead of being saved, whatever the
    policy (random ops and ops with side effects excepted: they are saved); the region's
    inputs are saved, and so are its outputs where code after the region needs them, as
    ``torch.utils.checkpoint`` keeps them.  A :class:`Checkpoint` adds regions by submodule
    (every k-th block, or as many as a memory budget needs); ``False`` ignores all regions.
    ``part.checkpointed`` and ``part.report()`` list the regions, what each recomputes and
    the inputs it saves.
    """
    ck = as_checkpoint(checkpoint)
    if ck is None:
        return _partition(vjp_gm, policy, lift_params, False, [])
    if ck.modules is None:
        return _partition(vjp_gm, policy, lift_params, ck.user_regions, [])
    cands = checkpoint_candidates(vjp_gm, ck.modules)
    if not cands:
        raise InputError(f"Checkpoint(modules={ck.modules!r}): no forward node was recorded "
                         "inside a matching submodule")
    if ck.budget is None:
        part = _partition(vjp_gm, policy, lift_params, ck.user_regions, cands[::ck.every])
        return part
    from .memory import simulate

    peaks: dict[int, int] = {}

    def peak(j: int) -> int:
        if j not in peaks:
            p = _partition(vjp_gm, policy, False, ck.user_regions, cands[:j])
            peaks[j] = simulate(joint_graph(p).graph).peak_bytes
        return peaks[j]

    lo, hi = 0, len(cands)
    if peak(hi) > ck.budget:
        import warnings
        warnings.warn(f"fxad: Checkpoint(budget={ck.budget}): even with all {len(cands)} "
                      f"candidate modules checkpointed the simulated peak is {peak(hi)} bytes; "
                      "checkpointing all of them", stacklevel=2)
        lo = hi
    while lo < hi:  # the smallest j with peak(j) <= budget
        mid = (lo + hi) // 2
        if peak(mid) <= ck.budget:
            hi = mid
        else:
            lo = mid + 1
    part = _partition(vjp_gm, policy, lift_params, ck.user_regions, cands[:lo])
    part.checkpoint_note = (f"budget {_fmt_bytes(ck.budget)}: {lo} of {len(cands)} candidate "
                            f"modules checkpointed, simulated step peak {_fmt_bytes(peak(lo))} "
                            f"(none checkpointed: {_fmt_bytes(peak(0))})")
    return part


def _partition(vjp_gm: fx.GraphModule, policy: str | Policy | None, lift_params: bool,
               user_regions: bool, ckpt_modules: list[str]) -> Partition:
    pol = as_policy(policy)
    result = vjp_gm.graph.output_node().args[0]
    if lift_params and len(result) > 2:
        vjp_gm = _lift_params(vjp_gm, list(dict(result[2])))
    graph = vjp_gm.graph
    nodes = list(graph.nodes)
    out_node = nodes[-1]
    assert out_node.op == "output"
    result = out_node.args[0]
    outputs, in_grads = result[0], result[1]
    param_grads: dict[str, Any] = dict(result[2]) if len(result) > 2 else {}
    out_leaves, out_spec = pytree.tree_flatten(outputs)
    if not all(isinstance(x, fx.Node) and isinstance(x.meta.get("val"), torch.Tensor)
               for x in out_leaves):
        raise InputError("fxad.compile supports functions whose output is a tensor or a "
                         "tuple/list/dict of tensors")
    inputs = [n for n in nodes if n.op == "placeholder" and not n.meta.get("fxad_cotangent")
              and n.meta.get("val") is not None]
    cots = [n for n in nodes if n.op == "placeholder" and n.meta.get("fxad_cotangent")]
    extra_phs = [n for n in nodes if n.op == "placeholder" and n not in inputs and n not in cots]
    float_outputs = [x.meta["val"].is_floating_point() or x.meta["val"].is_complex()
                     for x in out_leaves]
    if sum(float_outputs) != len(cots):
        raise InputError("internal: cotangents do not match the floating outputs")

    # --- classify: backward = tagged or depends on a cotangent; forward = the rest
    depends_cot: set[fx.Node] = set(cots) | set(extra_phs)
    for n in nodes:
        if n.op != "placeholder" and any(a in depends_cot for a in n.all_input_nodes):
            depends_cot.add(n)
    need_fwd: set[fx.Node] = set()
    stack = list(out_leaves) + [n for n in nodes if n.op not in ("placeholder", "output", "get_attr")
                                and is_impure(n) and not n.meta.get("fxad_bwd_of")
                                and n not in depends_cot]
    while stack:
        n = stack.pop()
        if n in need_fwd or n.op in ("placeholder", "get_attr"):
            continue
        need_fwd.add(n)
        stack.extend(n.all_input_nodes)
    if need_fwd & depends_cot:
        raise InputError("internal: a forward output depends on a cotangent")
    bwd: list[fx.Node] = [n for n in nodes if n.op in ("call_function", "call_method", "call_module")
                          and n not in need_fwd
                          and (n in depends_cot or n.meta.get("fxad_bwd_of") is not None)]
    bwd_set = set(bwd)
    fwd: list[fx.Node] = [n for n in nodes if n.op in ("call_function", "call_method", "call_module")
                          and n not in bwd_set]
    avail = inputs + fwd  # candidates for saving / recomputing
    idx = {n: i for i, n in enumerate(avail)}

    # --- activation checkpointing: values used only inside a region are recomputed
    regions = checkpoint_regions(vjp_gm, fwd, user_regions, ckpt_modules) \
        if (user_regions or ckpt_modules) else []
    region_of: dict[fx.Node, int] = {}
    for ri, (_, rn) in enumerate(regions):
        for n in rn:
            region_of[n] = ri
    fwd_set = set(fwd)
    out_set = set(out_leaves)
    internal: set[fx.Node] = set()
    for n, ri in region_of.items():
        if n not in out_set and all(region_of.get(u) == ri for u in n.users if u in fwd_set):
            internal.add(n)

    # values read by the backward (directly, or by the graph outputs as gradients)
    grad_nodes = [g for g in list(in_grads) + list(param_grads.values()) if isinstance(g, fx.Node)]
    needed_b: set[fx.Node] = set()
    for n in bwd:
        needed_b.update(a for a in n.all_input_nodes if a in idx)
    needed_b.update(g for g in grad_nodes if g in idx)

    # --- min cut: node v -> (in = 2i, out = 2i+1); source S, sink T
    N = len(avail)
    S, T = 2 * N, 2 * N + 1
    flow = _Flow(2 * N + 2)
    choice: dict[fx.Node, str] = {}
    for v in avail:
        i = idx[v]
        if v.op == "placeholder" or is_impure(v) or is_random(v):
            c = "save"
            if v.name in pol.by_node and pol.by_node[v.name] == "recompute":
                raise InputError(f"cannot recompute `{v.name}`: it is an input, has a side "
                                 "effect or is random")
        elif v in internal and pol.by_node.get(v.name) != "save":
            c = "recompute"  # inside an activation-checkpointing region
        elif v in region_of and v.name not in pol.by_node:
            # a region's output is kept as computed (as torch.utils.checkpoint's outputs
            # are): recomputing it would recompute the region's insides early in the
            # backward and keep them alive until the region's own backward
            c = "save"
        else:
            c = pol.choice(v)
        choice[v] = c
        flow.add(2 * i, 2 * i + 1, _INF if c == "recompute" else _cost(v))
        if c == "save":
            flow.add(S, 2 * i, _INF)
        for a in v.all_input_nodes:
            if a in idx:
                flow.add(2 * idx[a] + 1, 2 * i, _INF)
        if v in needed_b:
            flow.add(2 * i + 1, T, _INF)
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 4 * N + 1000))
    try:
        cut = flow.maxflow(S, T)
    finally:
        sys.setrecursionlimit(limit)
    if cut >= _INF:
        raise InputError("the residual policy forces recomputation of a value that cannot be "
                         "recomputed (it depends on an input, a side effect or a random op "
                         "through a node marked 'recompute')")
    sink_side = flow.reaches_sink(T)
    saved = [v for v in avail if not sink_side[2 * idx[v]] and sink_side[2 * idx[v] + 1]]
    recompute = {v for v in avail if sink_side[2 * idx[v]] and sink_side[2 * idx[v] + 1]}
    saved_set = set(saved)

    # --- forward graph
    stmts = _statements(vjp_gm)
    keep: set[fx.Node] = set()
    stack = list(out_leaves) + saved + [n for n in fwd if is_impure(n)]
    while stack:
        n = stack.pop()
        if n in keep:
            continue
        keep.add(n)
        stack.extend(n.all_input_nodes)
    fg = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in nodes:
        if n in inputs or (n in keep and n.op != "placeholder"):
            env[n] = fg.node_copy(n, lambda a: env[a])
    # an input the program mutates is written back at the end of the forward (copy_): a
    # backward that reads its value before the mutation gets a copy taken just before that
    writes = {n.args[0]: env[n] for n in nodes
              if n.meta.get("fxad_input_mutation") and n in env}
    saved_out = []
    for s_ in saved:
        if s_ in writes:
            with fg.inserting_before(writes[s_]):
                c = fg.call_method("clone", (env[s_],))
            c.meta = dict(s_.meta)
            saved_out.append(c)
        else:
            saved_out.append(env[s_])
    fg.output(tuple(env[x] for x in out_leaves) + tuple(saved_out))
    saved_total = sum(_cost(s) for s in saved)
    desc = [f"{s.name} {codegen.shape_note(s)} "
            + ("(parameter)" if s.meta.get("fxad_param") else f"({_fmt_bytes(nbytes(s))})")
            for s in saved]
    fg._codegen = _CommentCodeGen(
        tail=f"# saved for backward ({len(saved)} values, {_fmt_bytes(saved_total)}): "
             + ", ".join(s.name for s in saved))
    codegen.install(fg)

    # --- backward graph: saved placeholders, cotangents, then backward nodes with the
    # recomputed forward nodes emitted lazily before their first use
    bg = fx.Graph()
    benv: dict[fx.Node, fx.Node] = {}
    for s in saved:
        benv[s] = bg.placeholder(s.name)
        benv[s].meta.update(s.meta)
    for c in cots:
        benv[c] = bg.node_copy(c, lambda a: benv[a])
    for ph in extra_phs:  # `no_cotangent_k` placeholders of pytree outputs: constant None
        benv[ph] = None  # type: ignore[assignment]

    def block_label(n: fx.Node) -> str:
        of = n.meta.get("fxad_bwd_of")
        if of is None:
            return "(recomputed)"
        return of

    block_reads: dict[str, list[fx.Node]] = {}
    block_recomputes: set[str] = set()  # blocks that recompute forward values

    def reads_saved(n: fx.Node, label: str) -> None:
        for a in n.all_input_nodes:
            if a in saved_set:
                lst = block_reads.setdefault(label, [])
                if a not in lst:
                    lst.append(a)

    def materialize(a: fx.Node, label: str) -> None:
        if a in benv:
            return
        if a.op == "get_attr":
            benv[a] = bg.node_copy(a)
            benv[a].meta = dict(a.meta)
            benv[a].meta["fxad_bwd_of"] = label
            return
        if a not in recompute:
            raise InputError(f"internal: `{a.name}` is neither saved nor recomputed")
        for x in a.all_input_nodes:
            materialize(x, label)
        reads_saved(a, label)
        block_recomputes.add(label)
        new = bg.node_copy(a, lambda x: benv[x])
        new.meta = dict(a.meta)
        new.meta["fxad_bwd_of"] = label
        new.meta["fxad_recomputed"] = True
        benv[a] = new

    order = {n: i for i, n in enumerate(nodes)}
    for n in bwd:
        label = block_label(n)
        for a in sorted(n.all_input_nodes, key=order.__getitem__):
            materialize(a, label)
        reads_saved(n, label)
        benv[n] = bg.node_copy(n, lambda x: benv[x])
    outs: list[Any] = []
    input_grads: list[bool] = []
    for g in in_grads:
        if isinstance(g, fx.Node):
            materialize(g, "(gradient)")
            outs.append(benv[g])
            input_grads.append(True)
        else:
            outs.append(None)
            input_grads.append(False)
    param_names = list(param_grads)
    has_grad: list[bool] = []
    for name in param_names:
        g = param_grads[name]
        live = isinstance(g, fx.Node) and g in depends_cot
        has_grad.append(live)
        if live:
            outs.append(benv[g])
        else:
            outs.append(None)
    bg.output(tuple(outs))

    # block headers: "<forward statement>  [saved N B: a, b]"
    blocks: list[tuple[str, list[str], int, str, str]] = []
    fwd_by_name = {n.name: n for n in nodes}
    declared: dict[str, str] = {}
    for n in bwd:
        if "fxad_residuals" in n.meta:
            declared.setdefault(block_label(n), n.meta["fxad_residuals"])
    emitted: dict[str, list[fx.Node]] = {}  # forward node name -> nodes its rule's fwd wrote
    for n in nodes:
        if "fxad_fwd_of" in n.meta:
            emitted.setdefault(n.meta["fxad_fwd_of"], []).append(n)
    relabel: dict[str, str] = {}
    for label, reads in block_reads.items():
        fname = resolve(graph, label)
        stmt = stmts.get(fname, fname)
        b = sum(_cost(r) for r in reads)
        kind = residual_kind(fwd_by_name.get(fname), emitted.get(fname, ()), reads)
        if label in block_recomputes:
            kind += " (recomputing)"
        names = [r.name for r in reads]
        blocks.append((stmt, names, b, kind, declared.get(label, "")))
        relabel[label] = f"{stmt}  [saved {_fmt_bytes(b)}: {', '.join(names)}]"
    for n in bg.nodes:
        of = n.meta.get("fxad_bwd_of")
        if of is not None:
            n.meta = dict(n.meta)
            n.meta["fxad_bwd_of"] = relabel.get(of, stmts.get(resolve(graph, of), of))
    head = [f"# saved tensors ({len(saved)} values, {_fmt_bytes(saved_total)}):"]
    head += [f"#   {d}" for d in desc]
    if recompute:
        head.append("# recomputed here: " + ", ".join(n.name for n in avail if n in recompute))
    bg._codegen = _CommentCodeGen(head="\n".join(head), boxed=True)
    codegen.install(bg)
    root = vjp_gm.meta.get("fxad_source_module") or vjp_gm
    fwd_gm = fx.GraphModule(root, fg, class_name="ForwardGraph")
    bwd_gm = fx.GraphModule(root, bg, class_name="BackwardGraph")
    fwd_gm.saved_names = [s.name for s in saved]  # type: ignore[assignment]
    bwd_gm.saved_names = fwd_gm.saved_names  # type: ignore[assignment]
    checkpointed = []
    for label, rn in regions:
        rset = set(rn)
        rec = [n.name for n in rn if n in recompute]
        ins = [s for s in saved if s not in rset and any(u in rset for u in s.users)
               and not s.meta.get("fxad_param")]  # (lifted parameters cost nothing)
        outs_saved = [s for s in saved if s in rset]
        checkpointed.append((label, rec, [s.name for s in ins], sum(_cost(s) for s in ins),
                             [s.name for s in outs_saved]))
    return Partition(fwd_gm=fwd_gm, bwd_gm=bwd_gm, saved_names=[s.name for s in saved],
                     saved_bytes=saved_total,
                     recomputed=[n.name for n in avail if n in recompute],
                     n_outputs=len(out_leaves), out_spec=out_spec,
                     float_outputs=float_outputs, input_grads=input_grads,
                     param_names=param_names, param_has_grad=has_grad, blocks=blocks,
                     lifted_params=lift_params and bool(param_names), root=root,
                     checkpointed=checkpointed)


def joint_graph(part: Partition, *, with_params: bool = True) -> fx.GraphModule:
    """The forward and backward graphs of ``part`` as one graph: ``gm(*inputs) -> (value,
    input_grads)``, plus ``param_grads`` (a dict by parameter name, zeros for unused
    parameters) when ``with_params``; the same outputs as :func:`fxad.grad`.

    The forward nodes come first, then ``ones_like`` seeds for the floating outputs (the
    step differentiates ``value``; for a scalar loss, its gradient), then the backward
    nodes with the recomputed forward nodes emitted just before their first use, as in
    ``bwd_gm``; then the seeds are folded (``ones_like(loss) * x`` becomes ``x``: the
    algebra, shape and dead-code passes of :mod:`fxad.simplify`, not CSE, which would merge
    each recomputed node back into its forward twin).  The code lists the values that cross
    from forward to backward and the recomputed ones under its ``def`` line.  Parameters and buffers are read from the model
    (the graph module shares their tensors; batch-norm running statistics are updated in
    place as by the model).

    Raises:
        fxad.InputError: ``part`` was made with ``lift_params=True`` (its forward graph
            takes the parameters as inputs).
    """
    if part.lifted_params:
        raise InputError("joint_graph needs a partition made with lift_params=False")
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    attr_nodes: dict[str, fx.Node] = {}  # one get_attr per parameter/buffer
    fwd_out: list[fx.Node] = []
    for n in part.fwd_gm.graph.nodes:
        if n.op == "output":
            fwd_out = [env[a] for a in n.args[0]]
            continue
        env[n] = g.node_copy(n, lambda a: env[a])
        if n.op == "get_attr":
            attr_nodes.setdefault(n.target, env[n])
    outs, saved = fwd_out[:part.n_outputs], fwd_out[part.n_outputs:]
    seeds = []
    for o, is_float in zip(outs, part.float_outputs):
        if is_float:
            seed = g.call_function(torch.ones_like, (o,))
            seed.meta = {"val": o.meta.get("val"), "fxad_bwd_of": o.name}
            seeds.append(seed)
    bph = [n for n in part.bwd_gm.graph.nodes if n.op == "placeholder"]
    benv: dict[fx.Node, Any] = dict(zip(bph, saved + seeds))
    grads: list[Any] = []
    for n in part.bwd_gm.graph.nodes:
        if n.op == "placeholder":
            continue
        if n.op == "output":
            grads = [benv[a] if isinstance(a, fx.Node) else a for a in n.args[0]]
            continue
        if n.op == "get_attr" and n.target in attr_nodes:
            benv[n] = attr_nodes[n.target]
            continue
        benv[n] = g.node_copy(n, lambda a: benv[a])
        if n.meta.get("fxad_recomputed"):  # the forward has a node of that name
            benv[n]._rename(f"{n.name}_recomputed")
    n_in = len(part.input_grads)
    result: list[Any] = [pytree.tree_unflatten(outs, part.out_spec), tuple(grads[:n_in])]
    if with_params:
        pgrads: dict[str, Any] = {}
        for name, gr in zip(part.param_names, grads[n_in:]):
            if gr is None:  # unused parameter: zeros, as fxad.grad returns
                p = attr_nodes[name] if name in attr_nodes else g.get_attr(name)
                gr = g.call_function(torch.zeros_like, (p,))
                gr.meta = {"fxad_bwd_of": "(unused parameter)"}
            pgrads[name] = gr
        result.append(pgrads)
    g.output(tuple(result))
    # fold the seed (``ones_like(loss) * x`` -> ``x``) and what it enables; no CSE, which
    # would merge each recomputed node back into its forward twin
    for _ in range(20):
        if not fold_algebra(g) + fold_shapes(g) + dce(g):
            break
    recomputed = [n.name for n in g.nodes if n.meta.get("fxad_recomputed")]
    head = [f"# saved from forward to backward ({len(saved)} values, "
            f"{_fmt_bytes(part.saved_bytes)}):"]
    head += ["#   " + ln for ln in textwrap.wrap(", ".join(s.name for s in saved), 88)]
    if recomputed:
        head.append(f"# recomputed in the backward ({len(recomputed)}):")
        head += ["#   " + ln for ln in textwrap.wrap(", ".join(recomputed), 88)]
    g._codegen = _CommentCodeGen(head="\n".join(head))
    codegen.install(g)
    return fx.GraphModule(part.root, g, class_name="JointGraph")


# --------------------------------------------------------------------------- staged backward

@dataclass
class StagedBackward:
    """The backward graph of a :class:`Partition` cut into stages (:func:`split_backward`).

    Attributes:
        stages: ``stages[s]([...]) -> (*carry, *grads)``: stage 0 takes the list
            ``[*saved, *cotangents]`` as ``bwd_gm`` does, each later stage the ``carry`` list
            of the one before (the values still needed, emptied on entry); the last stage
            returns ``(*input_grads, *grads)``.
        n_carry: number of carried values each stage returns before its gradients.
        params: per stage, the indices (into ``part.param_names``) of the parameter
            gradients it returns, in order.
        reads: per stage, the indices of the (lifted) parameters whose values it reads.
    """

    stages: list[fx.GraphModule]
    n_carry: list[int]
    params: list[list[int]]
    reads: list[list[int]]


def split_backward(part: Partition, units: list[list[int]] | None = None,
                   min_bytes: int = 0) -> StagedBackward | None:
    """Cut ``part.bwd_gm`` so that parameter gradients can be released while the rest of
    the backward still runs (DDP's bucketed all-reduce, FSDP's reduce-scatter).

    ``units``: groups of parameter indices whose gradients are released together (default:
    each parameter alone); only parameters with a gradient count.  A unit is complete at
    the backward node that computes its last gradient; going through the units in that
    order, a stage ends after a unit once the stage holds at least ``min_bytes`` bytes of
    gradients (``0``: a stage per completion point).  The last stage also returns the input
    gradients.  Returns ``None`` when there would be a single stage.  The stages run the
    nodes of ``bwd_gm`` in its order: the values computed are the same, and each stage
    passes on only the values still needed (the rest is freed at its end).
    """
    bg = part.bwd_gm.graph
    nodes = list(bg.nodes)
    phs = [n for n in nodes if n.op == "placeholder"]
    comp = [n for n in nodes if n.op not in ("placeholder", "output")]
    out_args = list(bg.output_node().args[0])
    n_in = len(part.input_grads)
    pos = {n: i for i, n in enumerate(comp)}
    grad_of: dict[int, fx.Node] = {}
    for i, g in enumerate(out_args[n_in:]):
        if isinstance(g, fx.Node):
            grad_of[i] = g
    if units is None:
        units = [[i] for i in grad_of]
    units = [[i for i in u if i in grad_of] for u in units]
    units = [u for u in units if u]
    if len(units) < 2:
        return None
    done: dict[int, list[int]] = {}  # completion position -> param indices
    for u in units:
        c = max(pos.get(grad_of[i], -1) for i in u)
        done.setdefault(c, []).extend(u)
    order = sorted(done)
    cuts: list[int] = []  # a stage ends after comp[c] for c in cuts
    stage_params: list[list[int]] = [[]]
    acc = 0
    for k, c in enumerate(order):
        stage_params[-1].extend(done[c])
        acc += sum(nbytes(grad_of[i]) for i in done[c])
        if k < len(order) - 1 and acc >= min_bytes and (not cuts or c > cuts[-1]) and c >= 0:
            cuts.append(c)
            stage_params.append([])
            acc = 0
    if not cuts:
        return None
    if not stage_params[-1]:  # nothing left for the last stage
        stage_params.pop()
        cuts.pop()
        if not cuts:
            return None
    n_st = len(cuts) + 1
    bounds = [0] + [c + 1 for c in cuts] + [len(comp)]
    seg = {n: s for s in range(n_st) for n in comp[bounds[s]:bounds[s + 1]]}
    for p in phs:
        seg[p] = -1
    last_use: dict[fx.Node, int] = {}
    for n in comp:
        for a in n.all_input_nodes:
            last_use[a] = max(last_use.get(a, -1), seg[n])
    for g in out_args[:n_in]:
        if isinstance(g, fx.Node):
            last_use[g] = n_st - 1
    for s, ps in enumerate(stage_params):
        for i in ps:
            last_use[grad_of[i]] = max(last_use.get(grad_of[i], -1), s)
    order_all = phs + comp
    param_ph = {p: p.meta.get("fxad_param") for p in phs if p.meta.get("fxad_param")}
    index_of = {name: i for i, name in enumerate(part.param_names)}
    stages: list[fx.GraphModule] = []
    n_carry: list[int] = []
    reads: list[list[int]] = []
    for s in range(n_st):
        g = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        ins = phs if s == 0 else [v for v in order_all
                                  if seg[v] < s and last_use.get(v, -1) >= s]
        for v in ins:
            env[v] = g.placeholder(v.name)
            env[v].meta = dict(v.meta)
        r: set[int] = set()
        for n in comp[bounds[s]:bounds[s + 1]]:
            env[n] = g.node_copy(n, lambda x: env[x])
            for a in n.all_input_nodes:
                if a in param_ph and param_ph[a] in index_of:
                    r.add(index_of[param_ph[a]])
        reads.append(sorted(r))
        if s < n_st - 1:
            carry = [v for v in order_all if seg[v] <= s and last_use.get(v, -1) >= s + 1]
            outs = [env[v] for v in carry] + [env[grad_of[i]] for i in stage_params[s]]
            n_carry.append(len(carry))
            what = f"gradients of {', '.join(part.param_names[i] for i in stage_params[s])}"
        else:
            outs = [env[x] if isinstance(x, fx.Node) else x for x in out_args[:n_in]]
            outs += [env[grad_of[i]] for i in stage_params[s]]
            n_carry.append(0)
            what = ("input gradients and " if any(part.input_grads) else "") + \
                f"gradients of {', '.join(part.param_names[i] for i in stage_params[s])}"
        g.output(tuple(outs))
        head = "\n".join("# " + ln for ln in textwrap.wrap(
            f"backward stage {s + 1} of {n_st}: returns the {what}", 88))
        g._codegen = _CommentCodeGen(head=head, boxed=True)
        codegen.install(g)
        stages.append(fx.GraphModule(part.root, g, class_name=f"BackwardStage{s}"))
    return StagedBackward(stages=stages, n_carry=n_carry, params=stage_params, reads=reads)
