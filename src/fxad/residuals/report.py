"""How a partition is printed: :class:`Partition` and its :meth:`~Partition.report`, the
comments of the generated code (:class:`CommentCodeGen`), the statement each backward block
differentiates (:func:`statements`) and the kind of residuals a block reads
(:func:`residual_kind`).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch.fx as fx

from .. import codegen

__all__ = ["Partition", "residual_kind", "CommentCodeGen", "fmt_bytes", "statements"]


def fmt_bytes(n: int) -> str:
    """``n`` bytes for a reader: ``512 B``, ``1.5 KiB``, ``3.0 MiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return f"{n} B"


class CommentCodeGen(fx.graph.CodeGen):
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
    """Result of :func:`fxad.residuals.partition` (see :mod:`fxad.residuals`).

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
                 f"{fmt_bytes(self.saved_bytes)}; recomputed in backward: "
                 f"{len(self.recomputed)} nodes"]
        for stmt, names, b, kind, decl in self.blocks:
            note = f" (rule declares {decl})" if decl and decl != kind.split(" ")[0] else ""
            lines.append(f"  {fmt_bytes(b):>10}  saves {kind + note:<24} "
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
                             f"inputs {', '.join(ins) or '-'} ({fmt_bytes(b)}){extra}")
        return "\n".join(lines) + "\n"


def statements(gm: fx.GraphModule) -> dict[str, str]:
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

