"""Public entry points: :func:`trace`, :func:`vjp`, :func:`grad`, :func:`show`.

The checker lives in :mod:`fxad.check`.
"""
from __future__ import annotations

import re
import sys
import warnings
from typing import Any, Callable, Iterable, TextIO

import torch
import torch.fx as fx

from . import codegen
from .ad.reverse import build_vjp_graph, is_float
from .capture.normalize import normalize
from .graph.proxy import Emitter
from .capture.tracer import capture, capturing
from .errors import InputError
from .rules.fallback import is_fallback_node, warn_fallbacks
from .simplify import simplify as run_simplifier
from .simplify.effects import input_mutations_last


class VJPModule(fx.GraphModule):
    """GraphModule returned by :func:`vjp` and :func:`grad`.

    Calls run under ``torch.no_grad()`` by default: the generated code already computes the
    derivatives, so recording an autograd graph (parameters have ``requires_grad=True``)
    would only cost time and memory.  Set ``gm.record_autograd = True`` to differentiate
    the generated code with ``torch.autograd``.
    """

    record_autograd: bool = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        spec = self.meta.get("fxad_input_spec")
        if spec is not None and not kwargs:
            spec.check(args)  # what the trace specialized on (fxad.guards)
        if self.record_autograd or capturing():  # captured by fxad again: keep grad mode
            return super().__call__(*args, **kwargs)
        with torch.no_grad():
            return super().__call__(*args, **kwargs)


class ModeWarning(UserWarning):
    """A graph captured in training (eval) mode was called while the module is in eval
    (training) mode: flags such as dropout and batch-norm statistics were baked in."""


def trace(f: Callable | torch.nn.Module, *example_inputs: Any,
          leaf_modules: Iterable[type] = ()) -> fx.GraphModule:
    """Capture ``f`` on ``example_inputs`` as a normalized torch-level ``GraphModule``.

    Args:
        f: function of tensors, or an ``nn.Module`` (its parameters and buffers become
            ``get_attr`` nodes).
        example_inputs: positional inputs; only their shapes/dtypes/devices are used (no real
            computation runs during capture).
        leaf_modules: module classes kept as ``call_module`` nodes (they need a rule, see
            :func:`fxad.register_vjp`).

    Returns:
        GraphModule; every node has ``meta['val']`` (a fake tensor with shape and dtype) and,
        where known, ``meta['fxad_loc']`` (the user's file and line).

    Raises:
        fxad.errors.CaptureError: untraceable Python (data-dependent control flow, ``.item()``,
            a shape error on the example inputs), with the source line and a fix.
        fxad.errors.InplaceError: an in-place op that cannot be rewritten safely.
    """
    f = _without_fused_kernels(f)
    gm = capture(f, example_inputs, leaf_modules=leaf_modules)
    normalize(gm)
    return gm


def _without_fused_kernels(f: Any) -> Any:
    """An fxad-generated module about to be differentiated again: fused backward kernels have
    no rules, so rebuild it with the plain-torch formulas (same values, differentiable)."""
    if not (isinstance(f, fx.GraphModule) and "fxad_rebuild" in f.meta):
        return f
    if not any(n.op == "call_function" and isinstance(
            n.target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket))
            for n in f.graph.nodes):
        return f
    from .rules.fused import fused_kernels

    with fused_kernels(False):
        return f.meta["fxad_rebuild"]()


def _source_module(f: Any) -> torch.nn.Module | None:
    if isinstance(f, fx.GraphModule):
        return f.meta.get("fxad_source_module")
    return f if isinstance(f, torch.nn.Module) else None


def _trainable(mod: torch.nn.Module | None) -> list[tuple[str, torch.nn.Parameter]]:
    if mod is None:
        return []
    return [(n, p) for n, p in mod.named_parameters() if p.requires_grad and is_float(p)]


def _argnums(argnums: int | Iterable[int] | None, n: int) -> tuple[int, ...] | None:
    if argnums is None:
        return None
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    bad = [a for a in nums if not -n <= a < n]
    if bad:
        raise InputError(f"argnums {bad} out of range for {n} inputs")
    return tuple(a % n for a in nums)


def _build(f: Any, example_inputs: tuple, *, leaf_modules: Iterable[type], simplify: bool,
           seed_ones: bool, argnums: Any = None, dynamic: Any = None) -> fx.GraphModule:
    out = _build_static(f, example_inputs, leaf_modules=leaf_modules, simplify=simplify,
                        seed_ones=seed_ones, argnums=argnums)
    if dynamic is None or dynamic is False:
        warn_fallbacks(out.graph, "fxad.grad" if seed_ones else "fxad.vjp")
        return out
    from .dynamic import generalize
    names = out.meta["fxad_input_spec"].names[:len(example_inputs)]

    def build(inputs: tuple) -> fx.GraphModule:
        return _build_static(f, inputs, leaf_modules=leaf_modules, simplify=simplify,
                             seed_ones=seed_ones, argnums=argnums)

    out = generalize(build, f, names, example_inputs, dynamic, out, run=_verification_run)
    warn_fallbacks(out.graph, "fxad.grad" if seed_ones else "fxad.vjp")
    out.meta["fxad_rebuild"] = lambda: _build(
        f, example_inputs, leaf_modules=leaf_modules, simplify=simplify, seed_ones=seed_ones,
        argnums=argnums, dynamic=dynamic)
    return out


def _verification_run(gm: fx.GraphModule, inputs: tuple, template: fx.GraphModule) -> Any:
    """Call ``gm`` on ``inputs`` and seeded random cotangents shaped as ``template``'s."""
    from torch.utils import _pytree as pytree

    from .guards import _TensorSlot
    spec = template.meta["fxad_input_spec"]
    gen = torch.Generator().manual_seed(0)
    extra = []
    for slots, tree in zip(spec.leaves[len(inputs):], spec.trees[len(inputs):]):
        leaves = [torch.randn(s.shape, dtype=s.dtype, generator=gen).to(s.device)
                  if isinstance(s, _TensorSlot) and (s.dtype.is_floating_point or
                                                     s.dtype.is_complex) else None
                  for s in slots]
        extra.append(leaves[0] if tree is None else pytree.tree_unflatten(leaves, tree))
    return gm(*inputs, *extra)


def _build_static(f: Any, example_inputs: tuple, *, leaf_modules: Iterable[type],
                  simplify: bool, seed_ones: bool, argnums: Any = None) -> fx.GraphModule:
    gm = trace(f, *example_inputs, leaf_modules=leaf_modules)
    src_mod = _source_module(f)
    with_params = src_mod is not None
    graph, info = build_vjp_graph(gm, with_params=with_params,
                                  argnums=_argnums(argnums, len(example_inputs)))
    root: torch.nn.Module = src_mod if src_mod is not None else gm
    out_node = next(n for n in reversed(graph.nodes) if n.op == "output")
    result = list(out_node.args[0])
    em = Emitter(graph, root)
    if with_params:
        given = result[2]
        ordered: dict[str, Any] = {}
        graph.inserting_before(out_node)
        with graph.inserting_before(out_node), em.meta_defaults(fxad_bwd_of="(unused parameter)"):
            for name, _ in _trainable(src_mod):
                if name in given:
                    ordered[name] = given[name]
                else:
                    ordered[name] = torch.zeros_like(
                        em.create_proxy("get_attr", name, (), {})).node
        result[2] = ordered
    if seed_ones:
        _seed_with_ones(graph, em, result[0])
    out_node.args = (tuple(result),)
    if simplify:
        run_simplifier(graph)
    result = list(out_node.args[0])  # simplification replaced nodes
    names: dict[fx.Node, str] = {}
    input_phs = [n for n in graph.nodes if n.op == "placeholder" and not n.meta.get("fxad_cotangent")]
    for ph, g in zip(input_phs, result[1]):
        if isinstance(g, fx.Node):
            names.setdefault(g, f"d_{ph.name}")
    if with_params:
        for pname, g in result[2].items():
            if isinstance(g, fx.Node):
                names.setdefault(g, "d_" + pname.replace(".", "_"))
    codegen.name_cotangents(graph, names)
    single = isinstance(result[0], fx.Node) and isinstance(result[0].meta.get("val"), torch.Tensor)
    if not single and not seed_ones:
        _pytree_cotangent(graph, result[0], len(input_phs))
    input_mutations_last(graph)
    codegen.install(graph)
    name = type(src_mod).__name__ if src_mod is not None else getattr(f, "__name__", "f")
    out = VJPModule(root, graph, class_name=f"{name}VJP")
    out.meta.update(gm.meta)
    out.meta["fxad_forward"] = gm
    out.meta["fxad_cotangent_names"] = info["cotangent_names"]
    if src_mod is not None:
        _install_mode_check(out, src_mod)
    out.meta["fxad_rebuild"] = lambda: _build(
        f, example_inputs, leaf_modules=leaf_modules, simplify=simplify, seed_ones=seed_ones,
        argnums=argnums)
    out.meta["fxad_input_spec"] = _input_spec(
        [n.name for n in input_phs], example_inputs, None if seed_ones else result[0],
        "fxad.grad" if seed_ones else "fxad.vjp", gm.meta)
    return out


def _input_spec(names: list[str], example_inputs: tuple, outputs: Any, api: str,
                meta: dict | None = None) -> Any:
    """The guard of a generated VJP: the inputs as traced, then the cotangent (shaped like the
    output; ``None`` for non-floating outputs)."""
    from torch.utils import _pytree as pytree

    from .guards import spec_of

    examples = list(example_inputs)
    names = list(names)
    if outputs is not None:
        def cot(x: Any) -> Any:
            v = x.meta.get("val") if isinstance(x, fx.Node) else None
            if isinstance(v, (tuple, list)):
                return tuple(t if is_float(t) else None for t in v)
            return v if is_float(v) else None
        plain = pytree.tree_map(lambda x: x, outputs, is_leaf=lambda x: isinstance(x, fx.Node))
        examples.append(pytree.tree_map(cot, plain, is_leaf=lambda x: isinstance(x, fx.Node)))
        names.append("cotangent")
    meta = meta or {}
    return spec_of(names, examples, rebuild=f"rebuild it with {api}(f, *inputs) on inputs "
                                            "like these",
                   values=meta.get("fxad_value_inputs", ()),
                   constants=meta.get("fxad_value_constants", ()))


class _Slot:
    """A leaf marker used to build the input TreeSpec."""


def _pytree_cotangent(graph: fx.Graph, outputs: Any, n_inputs: int) -> None:
    """Make the graph take one ``cotangent`` argument shaped like the output pytree.

    Floating tensor leaves of the output take a cotangent tensor; other leaves take ``None``.
    """
    from torch.fx.graph import _PyTreeCodeGen, _PyTreeInfo
    from torch.utils import _pytree as pytree

    def slot(leaf: Any) -> Any:
        v = leaf.meta.get("val") if isinstance(leaf, fx.Node) else None
        if isinstance(v, (tuple, list)):
            return type(v)(_Slot() if is_float(x) else None for x in v) \
                if type(v) in (tuple, list) else tuple(_Slot() if is_float(x) else None for x in v)
        return _Slot() if is_float(v) else None

    def plain(x: Any) -> Any:  # FX stores immutable_dict / immutable_list in node args
        if isinstance(x, dict):
            return {k: plain(v) for k, v in x.items()}
        if isinstance(x, list):
            return [plain(v) for v in x]
        if isinstance(x, tuple) and type(x) is tuple:
            return tuple(plain(v) for v in x)
        return x

    cot_tree = pytree.tree_map(slot, plain(outputs), is_leaf=lambda x: isinstance(x, fx.Node))
    # every leaf of the cotangent is an argument; non-floating outputs take an ignored one
    # (pass None), so that the argument pytree mirrors the output pytree exactly
    flat, tree_spec = pytree.tree_flatten(cot_tree, is_leaf=lambda x: x is None)
    cots = [n for n in graph.nodes if n.op == "placeholder" and n.meta.get("fxad_cotangent")]
    last = [n for n in graph.nodes if n.op == "placeholder"][-1]
    it = iter(cots)
    prev = last if not cots else None
    for k, leaf in enumerate(flat):
        if leaf is None:
            anchor = prev if prev is not None else cots[0].prev
            with graph.inserting_after(anchor):
                ph = graph.placeholder(f"no_cotangent_{k}")
            ph.meta["val"] = None
            prev = ph
        else:
            prev = next(it)
    cot_tree = pytree.tree_unflatten([_Slot() for _ in flat], tree_spec)
    spec = pytree.tree_structure(tuple(_Slot() for _ in range(n_inputs)) + (cot_tree,))
    names = [n.name for n in graph.nodes if n.op == "placeholder"][:n_inputs] + ["cotangent"]
    graph._codegen = _PyTreeCodeGen(_PyTreeInfo(orig_args=names, in_spec=spec, out_spec=None))


def _seed_with_ones(graph: fx.Graph, em: Emitter, outputs: Any) -> None:
    cots = [n for n in graph.nodes if n.op == "placeholder" and n.meta.get("fxad_cotangent")]
    if len(cots) != 1 or not isinstance(outputs, fx.Node) \
            or outputs.meta["val"].numel() != 1:
        raise InputError("fxad.grad needs a function with one scalar floating-point output; "
                         "use fxad.vjp for other outputs")
    ph = cots[0]
    with graph.inserting_after(outputs), em.meta_defaults(fxad_bwd_of=outputs.name):
        ones = torch.ones_like(em.value(outputs)).node
    ph.replace_all_uses_with(ones)
    graph.erase_node(ph)


def _install_mode_check(gm: fx.GraphModule, mod: torch.nn.Module) -> None:
    captured = {n: m.training for n, m in mod.named_modules()}
    gm.meta["fxad_training_flags"] = captured

    pairs = [(m, m.training) for _, m in mod.named_modules()]

    def hook(_gm: Any, _args: Any) -> None:
        if all(m.training is flag for m, flag in pairs):  # cheap per-call check
            return
        now = {n: m.training for n, m in mod.named_modules()}
        if now != captured:
            diff = next(n for n in captured if now.get(n) != captured[n])
            mode = "training" if captured[diff] else "eval"
            warnings.warn(
                f"this fxad graph was captured with {type(mod).__name__}"
                f"{'.' + diff if diff else ''} in {mode} mode, but the module is now in "
                f"{'eval' if mode == 'training' else 'training'} mode; dropout and "
                "batch-norm behaviour are baked in at capture: capture again after "
                "switching modes", ModeWarning, stacklevel=2)

    gm.register_forward_pre_hook(hook)


def vjp(f: Callable | torch.nn.Module, *example_inputs: Any, leaf_modules: Iterable[type] = (),
        argnums: int | Iterable[int] | None = None, simplify: bool = True,
        dynamic: Any = None) -> fx.GraphModule:
    """Source-to-source vector-Jacobian product of ``f`` at shapes of ``example_inputs``.

    Returns:
        GraphModule ``g``.  For a function, ``g(*inputs, cotangent)`` returns
        ``(output, input_grads)``, where ``input_grads`` has one entry per input (``None``
        for non-floating inputs) and ``cotangent`` has the output's shape/dtype (one
        cotangent per floating output tensor, in output order, for multi-output functions).
        For an ``nn.Module``, ``g(*inputs, cotangent)`` returns ``(output, input_grads,
        param_grads)``, ``param_grads`` keyed like ``module.named_parameters()`` (frozen
        parameters left out).  Parameters are read from the live module, so optimizer
        updates are seen by later calls.

    Args:
        argnums: positions of the inputs to differentiate (default: all floating inputs);
            the others get ``None`` and no code is generated for them (``argnums=()`` for a
            module: parameter gradients only, as in a training step).
        dynamic: dimensions whose size the code reads from its inputs instead of baking in
            (``True``: dimension 0 of every tensor input; ``{"x": (0, 1)}`` or ``{0: 1}`` by
            argument name or position); see :mod:`fxad.dynamic`.  Without it, the module
            checks on every call that the inputs have the traced shapes, dtypes, devices and
            Python values (:mod:`fxad.guards`).

    Raises:
        fxad.errors.MissingRuleError: an op on the differentiation path has no rule (the error
            names the op, the user's line and how to register one).
        fxad.errors.CaptureError: see :func:`trace`.
        fxad.errors.InputError: when called: inputs unlike the traced ones (shape, dtype,
            device, Python value), naming the argument.
    """
    return _build(f, example_inputs, leaf_modules=leaf_modules, simplify=simplify,
                  seed_ones=False, argnums=argnums, dynamic=dynamic)


def grad(f: Callable | torch.nn.Module, *example_inputs: Any, leaf_modules: Iterable[type] = (),
         argnums: int | Iterable[int] | None = None, simplify: bool = True,
         dynamic: Any = None) -> fx.GraphModule:
    """Gradient of a scalar-valued ``f``: ``g(*inputs)`` returns ``(value, input_grads)`` or,
    for an ``nn.Module``, ``(value, input_grads, param_grads)``.  ``argnums`` and
    ``dynamic`` as in :func:`vjp`.

    Raises:
        fxad.errors.InputError: the output is not a single floating-point scalar; when called,
            inputs unlike the traced ones.
    """
    return _build(f, example_inputs, leaf_modules=leaf_modules, simplify=simplify,
                  seed_ones=True, argnums=argnums, dynamic=dynamic)


_DELETION = re.compile(r";  (\w+ = )+None")


def _show_note(node: fx.Node) -> str:
    """A line's note in :func:`code_with_shapes`: its shape and dtype, and
    ``# autograd fallback`` on the calls of the autograd fallback."""
    note = codegen.shape_note(node)
    if is_fallback_node(node):
        return f"{note}  # autograd fallback" if note else "autograd fallback"
    return note


def code_with_shapes(gm: fx.GraphModule) -> str:
    """``gm.code`` with each statement annotated by its shape and dtype (``# f32[64,128]``)
    and without FX's ``x = None`` memory-release statements; a derivative computed by the
    autograd fallback (:mod:`fxad.rules.fallback`) ends with ``# autograd fallback``."""
    graph = gm.graph
    old = graph._codegen._body_transformer
    try:
        codegen.install(graph, annotate=_show_note)
        src = graph.python_code("self").src
    finally:
        graph._codegen._body_transformer = old
    return _DELETION.sub("", src).strip("\n") + "\n"


def show(gm: fx.GraphModule, *, file: TextIO | None = None, color: bool | None = None) -> str:
    """Print ``gm``'s code annotated with shapes and dtypes; returns the plain text.  Lines
    that call the autograd fallback end with ``# autograd fallback``.

    Uses ``rich`` syntax highlighting when writing to a terminal.
    """
    text = code_with_shapes(gm)
    stream = file or sys.stdout
    use_color = color if color is not None else (file is None and stream.isatty())
    if use_color:
        try:
            from rich.console import Console
            from rich.syntax import Syntax

            Console(file=stream).print(Syntax(text, "python", theme="ansi_dark"))
            return text
        except ImportError:  # pragma: no cover
            pass
    stream.write(text)
    return text
