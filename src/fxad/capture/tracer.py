"""Capture of a function or ``nn.Module`` on example inputs, as PyTorch runs it.

Mechanism (the choice, and why)
-------------------------------
The program runs on **fake tensors** (:class:`torch._subclasses.FakeTensor`: real tensor
objects with shapes, dtypes, devices, strides and autograd metadata but no data) under a
:class:`torch.overrides.TorchFunctionMode` that records one graph node per call of the public
torch API.  The values the user's code sees are therefore genuine ``torch.Tensor`` objects:
``isinstance(x, torch.Tensor)``, ``torch.is_tensor(x)``, unbound methods
(``torch.Tensor.__radd__(x, 1)``, ``torch.Tensor.cfloat(x)``), ``x.dtype``/``x.device``/
``x.shape``/``x.layout``/``x.requires_grad``/``x.is_leaf`` all behave as for a real tensor,
and library code written against tensors (``torch.nn``'s argument checks, transformers'
mask helpers) takes the same path as in eager mode.  A proxy object (torch.fx's symbolic
tracer) cannot pass those checks; a dispatch-level tracer (``make_fx``) would record
``torch.ops.aten`` calls instead of the torch-level calls fxad's rules and readers work with.
The mode sees calls at the level the user wrote them (``torch.sin``, ``x.view(...)``,
``F.layer_norm``, ``x + y``), which are recorded in torch.fx's usual node forms
(``call_function torch.sin``, ``call_method view``, ``call_function operator.add``).

Policies:

* While capturing, ``torch.compiler.is_compiling()`` is True, as under Dynamo, so library
  code takes its traceable path (``nn.TransformerEncoder`` skips its data-dependent mask
  check; transformers skips data-dependent attention-mask shortcuts).
* ``torch.nn`` modules are traced *through* (their hooks run) down to torch calls, so their
  derivative rules are the functional ones (``F.linear``, ``F.layer_norm``...).  Modules whose
  class is in ``leaf_modules`` stay ``call_module`` nodes and need a rule registered for
  their class (:func:`fxad.register_vjp`).  A module built inside the program with no state
  of its own (a loss module; a wrapper around a submodule) is traced the same way; creating
  an ``nn.Parameter`` inside the program is refused, naming the line.
* Python functions are traced through, ``torch.fx.wrap``-marked ones included, unless a
  derivative rule is registered for them.  A torch function a library replaced in the
  ``torch`` namespace (PyG's ``torch.index_select``) is Python like any other: traced down
  to PyTorch's own op, which is what op names resolve to (:mod:`fxad.originals`).
* Parameters, buffers and tensor attributes of the traced module become ``get_attr`` nodes
  named after their path (``l1.weight`` → ``l1_weight``), created where first used.  A
  function's closure modules are attached to the graph's own root (their parameters are
  constants of the function); other tensors from outside become ``_tensor_constant<k>``.
* Floating-point inputs are seen with ``requires_grad=True`` (fxad differentiates with
  respect to them, as ``torch.func.vjp`` does); ops run under ``torch.no_grad()`` or
  ``torch.inference_mode()`` inside the program are marked ``meta['fxad_no_grad']`` and
  carry no derivative, as in autograd.
* Non-tensor inputs (ints, floats, bools, None, strings) are specialized: the graph keeps a
  placeholder for them so the call signature is unchanged, but the traced code used the
  example value.  A ``torch.Generator`` input stays an input: the code draws from the one
  passed at call time.
* Side effects (:mod:`~fxad.capture.effects`): ``torch.manual_seed``, the RNG state and
  ``fork_rng``, ``print`` and NumPy's global random draws become lines of the generated code
  (nodes marked ``fxad_side_effect``), in the program's order; an array computed by NumPy
  from a draw is refused, unless the program seeded NumPy with a constant itself (its draws
  and the NumPy code on them are then constants).  Other Python state the program changes (globals, outer
  containers, module attributes) gets a ``UserWarning`` naming the line
  (:mod:`~fxad.capture.python_state`).
* Keyword arguments (a :class:`KeywordCall`) are inputs like positional ones: placeholders
  after the positional ones, named by their keyword; the program is called with them as
  keywords.
* Metadata queries (``x.size(0)``, ``x.dim()``, ``torch.is_floating_point(x)``) are answered
  from the fake tensor and not recorded.  A question about tensor *data* (``bool(x)`` of an
  ``if`` or ``assert``, ``x.item()``, ``int(x)``, ``x.tolist()``, ``torch.equal``) is answered
  with the real value, computed from the example inputs by running only the recorded graph's
  ancestors of ``x``; the generated code re-checks it on every call with a guard line that
  raises :class:`~fxad.errors.ValueGuardError` naming the user's line
  (:mod:`~fxad.capture.decisions`).  Data-dependent output sizes (``x[mask]``, ``nonzero``)
  are specialized the same way only with ``values="guard+sizes"``; ``values="refuse"``, a
  value computed from a random draw, ``numpy()`` and decisions inside ``torch.cond`` bodies
  raise :class:`~fxad.errors.DataDependentError` naming the user's line.
* Tensor constructors (``torch.zeros(n)``, ``torch.arange(T)``, ``torch.tensor([...])``) are
  recorded as graph nodes rather than baked in as constants.
* Values capture can know: small integer CPU tensors (inputs, constants, ``torch.tensor`` of
  Python data) and what is computed from them alone keep their real values beside the fake
  ones (``meta['fxad_value']``).  Where the program needs such a value (``int(t)``, a size,
  the output shape of ``pack_padded_sequence`` from its lengths), capture uses it, the code is
  specialized on it, and the generated module guards the inputs (and constants) it came from
  on their values (:mod:`fxad.guards`); other data-dependent questions raise
  :class:`~fxad.errors.DataDependentError`.
* In-place operations are recorded out of place and the Python object rebound to the new
  value (``y.add_(1)`` → ``add = y + 1``); the in-place op also runs on the fake value, so
  PyTorch's own errors (a dtype that cannot be cast back, a shape that does not broadcast)
  are raised as in eager mode, and a result dtype that differs from the tensor's (in-place
  ops keep ``self``'s dtype) gets an explicit cast.

Node meta keys written by capture: ``val`` and ``fxad_loc`` (see :mod:`fxad.graph.proxy`),
``fxad_input`` (placeholders of the program's inputs), ``fxad_side_effect`` (a buffer update
such as BatchNorm's ``num_batches_tracked.add_(1)``, kept as an in-place call; a seeding, a
print, a NumPy draw: :mod:`~fxad.capture.effects`),
``fxad_no_grad`` (computed with gradients disabled), ``fxad_value`` (a known value, above),
``fxad_inplace`` (the user's in-place statement a functional node stands for),
``fxad_checkpoint`` (the ``torch.utils.checkpoint`` region), ``fxad_custom_function`` (a
custom ``autograd.Function``, :mod:`fxad.capture.custom`), ``nn_module_stack`` (the modules
being called, as torch.fx records it).

Modules (each imports only those listed before it, and fxad's lower layers)
---------------------------------------------------------------------------
* :mod:`~fxad.capture.state`: the capture running in this thread, symbolic runs, a node's
  value form (``snapshot``).
* :mod:`~fxad.capture.patching`: patch lists for names in modules, the traced code's
  globals and its closure cells.
* :mod:`~fxad.capture.normalize`: the recorded graph in fxad's canonical node forms.
* :mod:`~fxad.capture.calls`: how a torch call is classified (operator, in-place form, data
  read, view property, composite traced through) and put in node form.
* :mod:`~fxad.capture.views`: aliasing; writes through views made functional, views
  rebuilt after their storage changed.
* :mod:`~fxad.capture.values`: the known values, and the inputs they guard.
* :mod:`~fxad.capture.decisions`: decisions on tensor values taken on the real example
  value, and their guards; :mod:`~fxad.capture.layouts`: memory layouts read as values.
* :mod:`~fxad.capture.inplace`: in-place operations and ``x[i] = v``, recorded out of place.
* :mod:`~fxad.capture.mode`: the TorchFunctionMode and the dispatch of each torch call.
* :mod:`~fxad.capture.control` and :mod:`~fxad.capture.custom`: ``torch.cond`` & co., custom
  ``autograd.Function``\\ s and checkpoint regions, each captured in a nested session.
* :mod:`~fxad.capture.effects` and :mod:`~fxad.capture.python_state`: side effects
  recorded as nodes, and Python state changes announced.
* :mod:`~fxad.capture.paths` and :mod:`~fxad.capture.autograph`: random decisions as
  ``torch.cond``, captured path by path where the branches end in different Python state.
* :mod:`~fxad.capture.environment`: what is patched while capturing (module calls, control
  flow, custom Functions, checkpoint, leaf functions, ``is_compiling``).
* :mod:`~fxad.capture.session`: :class:`~fxad.capture.session.Session`, the state of one
  capture (graph, tensor -> node map, aliasing, known values) and its recording methods.
* :mod:`~fxad.capture.module_state`: the traced module's attributes restored after capture.
* this module: the entry point :func:`capture` and the program's inputs.
"""
from __future__ import annotations

import contextlib
import inspect
import linecache
import logging
import operator
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor

from ..errors import DataDependentError, InputError, SourceLoc
from ..graph.proxy import compute_meta, fake_mode, to_fake
from .autograph import MAX_RESTARTS, RestartCapture, attached_graphs, patched
from .decisions import note_example
from .environment import compiling_answer
from .module_state import module_state, restore_module_state, warn_rebound
from .outputs import OUTPUT_SPEC, output_spec
from .paths import (Forks, ForkSite, capture_paths, current_forks, forks_scope,
                    program_error_of)
from .patching import user_globals
from .session import Session
from .state import capturing, has_tensor, symbolic_shapes
from .values import KNOWN_NUMEL

__all__ = ["capture", "capturing", "symbolic_shapes", "argument_names", "KeywordCall"]


class KeywordCall:
    """``f`` called with keyword arguments: the last ``len(keywords)`` example inputs given to
    :func:`capture` are passed to ``f`` as ``keyword=value``.  They become placeholders after
    the positional ones, named by their keyword (``def forward(self, x, mask)``): tensors are
    inputs like positional ones, Python values are specialized (and guarded by the generated
    module, :mod:`fxad.guards`).

    Attributes:
        f: the function or ``nn.Module`` called.
        keywords: the keyword names, in the order of the trailing example inputs.
        differentiable: whether the keyword inputs may be differentiated (``fxad.compile``:
            as eager autograd does) or, as in ``torch.func.grad``, not (the public
            derivatives: ``argnums`` index the positional inputs and the input gradients are
            theirs).
    """

    def __init__(self, f: Callable | torch.nn.Module, keywords: Sequence[str],
                 differentiable: bool = False) -> None:
        self.f = f
        self.keywords = tuple(keywords)
        self.differentiable = differentiable
        self.__name__ = getattr(f, "__name__", type(f).__name__)

    def __repr__(self) -> str:
        return f"KeywordCall({self.__name__}, keywords={self.keywords})"


def _check_keywords(params: list[inspect.Parameter], n: int, keywords: Sequence[str],
                    fn: Any, what: str) -> None:
    """Raise :class:`InputError` naming ``fn``'s def line when ``fn`` cannot take
    ``keywords`` after ``n`` positional arguments (an unknown keyword, or one that the
    positional arguments already bind)."""
    by_name = {p.name: p for p in params}
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params)
    positional = [p.name for p in params
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][:n]
    for k in keywords:
        p = by_name.get(k)
        if k in positional:
            why = f"argument `{k}` is given both as positional input #{positional.index(k)} " \
                  "and as a keyword"
        elif p is None and not takes_any:
            why = f"{what} takes no keyword argument `{k}`"
        elif p is not None and p.kind is p.POSITIONAL_ONLY:
            why = f"argument `{k}` of {what} is positional-only"
        else:
            continue
        hint = f"pass the keyword arguments {what} takes, as you would call it"
        if k in ("has_aux", "argnums", "dynamic", "values"):  # an option of another builder
            hint += f" (`{k}=` is not an option of this fxad function; see its signature)"
        raise InputError(why, loc=_def_loc(fn), hint=hint)


def _def_loc(fn: Any) -> SourceLoc | None:
    code = getattr(inspect.unwrap(fn), "__code__", None) if fn is not None else None
    return None if code is None else SourceLoc(
        code.co_filename, code.co_firstlineno, code.co_name,
        linecache.getline(code.co_filename, code.co_firstlineno).strip())


def argument_names(f: Callable | torch.nn.Module, n: int) -> list[str]:
    """The names :func:`capture` gives the ``n`` inputs of ``f`` (its parameter names;
    ``args_<k>`` for a ``*args``; for a :class:`KeywordCall`, the keywords last).

    Raises:
        InputError: ``f`` takes fewer than ``n`` positional arguments.
    """
    if isinstance(f, KeywordCall):
        k = len(f.keywords)
        return argument_names(f.f, n - k) + list(f.keywords)
    if isinstance(f, fx.GraphModule) and "fxad_input_spec" in f.meta:
        return list(f.meta["fxad_input_spec"].names[:n])
    if callable(f) and not inspect.isfunction(f) and not isinstance(f, torch.nn.Module):
        f = _as_function(f, n)
    if isinstance(f, torch.nn.Module):
        fn = inspect.unwrap(type(f).forward)
        return _input_names(list(inspect.signature(fn).parameters.values())[1:], n, fn,
                            f"{type(f).__name__}.forward")
    return _input_names(list(inspect.signature(f).parameters.values()), n, f,
                        getattr(f, "__name__", "f"))


def _input_names(params: list[inspect.Parameter], n: int, fn: Any = None,
                 what: str = "the function") -> list[str]:
    names: list[str] = []
    for p in params:
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            names.append(p.name)
        elif p.kind == p.VAR_POSITIONAL:
            while len(names) < n:
                names.append(f"{p.name}_{len(names)}")
            break
        if len(names) == n:
            break
    if len(names) < n:  # named at the user's def line, with the arguments it does take
        loc = _def_loc(fn)
        raise InputError(
            f"{n} example inputs given but {what} takes {len(names)} positional "
            f"argument{'' if len(names) == 1 else 's'} ({', '.join(names) or 'none'})",
            loc=loc, hint=f"pass one example input per positional argument of {what}, in "
                          "order (on the command line: one --input per argument)")
    return names


def _program_value(t: torch.Tensor) -> torch.Tensor:
    """The fake tensor the program sees for an input tensor: its own object (two inputs
    that are the same real tensor are still two inputs), same metadata, and, for floating
    inputs, ``requires_grad=True`` as a non-leaf (fxad differentiates with respect to it;
    in-place updates of it are then as legal as in eager code)."""
    mode = fake_mode()
    if t.layout != torch.strided:  # sparse and other layouts: a fake of the same layout
        with torch._C.DisableTorchFunction():
            return mode.fake_tensor_converter.from_real_tensor(mode, t) \
                if hasattr(mode, "fake_tensor_converter") else to_fake(t)
    with mode:
        v = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype,
                                device=t.device)
        if v.is_floating_point() or v.is_complex():
            v = v.requires_grad_().clone()
    return v


def _inputs(cap: Session, names: list[str], examples: Sequence[Any]) -> list[Any]:
    values: list[Any] = []
    for name, example in zip(names, examples):
        ph = cap.graph.placeholder(name)
        ph.meta["val"] = to_fake(example)
        ph.meta["fxad_input"] = True
        note_example(cap, ph, example)  # decisions on tensor values are taken on it
        if isinstance(example, torch.Tensor):
            v = _program_value(example)
            cap.track(v, ph)
            cap.input_roots[id(v)] = ph
            if not isinstance(example, FakeTensor) \
                    and not (example.is_floating_point() or example.is_complex()) \
                    and example.device.type == "cpu" and example.numel() <= KNOWN_NUMEL:
                # a small integer input: its value is known, and guarded if the program
                # reads it (lengths of a packed sequence)
                cap.known[id(v)] = example.detach().clone()
                cap.known_src[id(v)] = frozenset({len(values)})
                ph.meta["fxad_value"] = cap.known[id(v)]
            values.append(v)
        elif isinstance(example, (tuple, list, dict)) and has_tensor(example):
            values.append(_unpack(cap, ph, example))
        else:
            values.append(example)
    return values


def _unpack(cap: Session, node: fx.Node, example: Any) -> Any:
    """The container ``example`` rebuilt with fake tensors standing for ``node[k]...``, so the
    user's code sees a real dict/list/tuple (``torch.func.functional_call(m, params, ...)``)."""
    def item(k: Any, v: Any) -> Any:
        n = cap.graph.create_node("call_function", operator.getitem, (node, k), {})
        n.meta["val"] = to_fake(v)
        return _unpack(cap, n, v)

    if isinstance(example, dict):
        return {k: item(k, v) for k, v in example.items()}
    if isinstance(example, (tuple, list)):
        items = [item(i, v) for i, v in enumerate(example)]
        return type(example)(items) if type(example) in (tuple, list) else type(example)(*items)
    if isinstance(example, torch.Tensor):
        v = _program_value(example)
        cap.track(v, node)
        cap.input_roots[id(v)] = node
        return v
    return example


def capture(f: Callable | torch.nn.Module, example_inputs: Sequence[Any], *,
            leaf_modules: Iterable[type] = ()) -> fx.GraphModule:
    """Trace ``f`` on ``example_inputs`` into a torch-level GraphModule (not yet normalized).

    ``torch.compiler.is_compiling()`` answers True (library code takes its traceable path).
    When the program asks it and then fails with an error of its own (transformers'
    SwitchTransformers and LongT5 index an attention mask they create only on the eager
    path), capture starts again with the answer False; if that fails too, fxad's error
    there is raised (it names what to change), else the program's first error.

    A Python ``if`` on a random draw (LayerDrop) makes capture start again with the
    function that decides rewritten, its ``if`` recorded as ``torch.cond``
    (:mod:`fxad.capture.autograph`; at most ``MAX_RESTARTS`` times), or, where its
    branches end in different Python state, with the program captured once per path and
    the paths joined into nested conditionals (:mod:`fxad.capture.paths`).

    Args:
        f: a function of tensors (pytrees allowed) or an ``nn.Module``; a
            :class:`KeywordCall` passes the trailing example inputs as keyword arguments.
        example_inputs: positional example inputs; tensors give shapes/dtypes only.
        leaf_modules: module classes kept as ``call_module`` nodes.

    Returns:
        GraphModule whose placeholders are named after ``f``'s parameters and whose nodes carry
        ``meta['val']`` (fake values) and ``meta['fxad_loc']`` (user source line).

    Raises:
        CaptureError: an op fails on the example shapes, data-dependent control flow, etc.
        InputError: ``f`` does not take the keyword arguments of a :class:`KeywordCall`.
    """
    with compiling_answer(True) as asked:
        try:
            return _capture_restarting(f, example_inputs, leaf_modules)
        except Exception as e:  # noqa: BLE001 - re-raised unless the eager path serves
            if not asked or program_error_of(e) is None:
                raise
            first = e
    # the program asked is_compiling() and then failed on its traceable path (transformers'
    # SwitchTransformers and LongT5 without an attention mask): its eager path, as eager runs
    with compiling_answer(False):
        try:
            return _capture_restarting(f, example_inputs, leaf_modules)
        except Exception as e:  # noqa: BLE001 - one of the two errors is reported
            if program_error_of(e) is None:
                raise  # fxad's own error on the eager path: it says what to change
            raise first from None


def _capture_restarting(f: Callable | torch.nn.Module, example_inputs: Sequence[Any],
                        leaf_modules: Iterable[type]) -> fx.GraphModule:
    """:func:`capture` with one answer to ``is_compiling()``: restarts for rewritten
    functions and paths of random decisions."""
    patches: list[Any] = []
    attached = attached_graphs(f)
    sites: set[tuple[str, int]] = set()
    first: ForkSite | None = None

    def run(forced: tuple) -> tuple[fx.GraphModule | None, list, Exception | None]:
        with forks_scope(Forks(sites, forced)) as forks:
            try:
                return _capture_once(f, example_inputs, leaf_modules, merged=False), \
                    forks.taken, None
            except (ForkSite, RestartCapture):
                raise
            except Exception as e:  # the program's own error on this path (capture.paths)
                own = program_error_of(e)
                if not forks.taken or own is None:
                    raise
                return None, forks.taken, own

    for _ in range(MAX_RESTARTS + 1):
        try:
            with patched(patches):
                if first is None:
                    with forks_scope(Forks()):
                        return _capture_once(f, example_inputs, leaf_modules)
                return capture_paths(run, first)
        except ForkSite as fork:
            if fork.site in sites:  # forced already, yet the branch capture met it again
                raise DataDependentError(
                    f"a random decision captured path by path is met inside a torch.cond "
                    f"branch ({fork.why})", op="if", loc=fork.loc,
                    hint="write the choice with torch.cond") from None
            sites.add(fork.site)
            first = first or fork
            attached()
        except RestartCapture as restart:
            patches.extend(restart.patches)
            attached()  # the branch graphs the abandoned capture attached are dropped
    raise DataDependentError(
        f"capture restarted {MAX_RESTARTS} times to rewrite functions whose `if` decides on "
        "a random draw, and still meets another", op="if", loc=None,
        hint="write the remaining random decisions with torch.cond")


def _capture_once(f: Callable | torch.nn.Module, example_inputs: Sequence[Any],
                  leaf_modules: Iterable[type], merged: bool = True) -> fx.GraphModule:
    keywords: tuple[str, ...] = ()
    if isinstance(f, KeywordCall):
        keywords, f = f.keywords, f.f
        if not keywords:
            return capture(f, example_inputs, leaf_modules=leaf_modules)
    if not keywords and isinstance(f, fx.GraphModule) and all(
            "val" in n.meta for n in f.graph.nodes if n.op not in ("placeholder", "output")):
        return _recapture_graphmodule(f, example_inputs)
    n_pos = len(example_inputs) - len(keywords)
    if callable(f) and not inspect.isfunction(f) and not isinstance(f, torch.nn.Module):
        f = _as_function(f, n_pos, keywords)
    if isinstance(f, torch.nn.Module):
        root: torch.nn.Module = f
        name = type(f).__name__
        fn = inspect.unwrap(type(f).forward)
        params = list(inspect.signature(fn).parameters.values())[1:]
    elif callable(f):
        root = torch.nn.Module()
        name = getattr(f, "__name__", "f")
        params = list(inspect.signature(f).parameters.values())
    else:
        raise InputError(f"fxad expects a function or nn.Module, got {type(f).__name__}")
    cap = Session(root, not isinstance(f, torch.nn.Module), tuple(leaf_modules))
    forks = current_forks()
    if forks is not None and forks.session is None:
        forks.session = cap  # decisions taken in this capture may be forked (capture.paths)
    cap.user_globals = user_globals(f)
    cap.program = f  # its Python state is compared after capture (capture.python_state)
    user_fn = fn if isinstance(f, torch.nn.Module) else f
    what = f"{name}.forward" if isinstance(f, torch.nn.Module) else name
    names = _input_names(params, n_pos, user_fn, what)
    if keywords:
        _check_keywords(params, n_pos, keywords, user_fn, what)
    values = _inputs(cap, names + list(keywords), example_inputs)
    args, kwargs = values[:n_pos], dict(zip(keywords, values[n_pos:]))
    state = module_state(root)
    try:
        with _quiet_meta_log(), cap.environment(), fake_mode(), torch.enable_grad(), cap.mode:
            result = f(*args, **kwargs)
        out_args = cap.arg(result, "return")
        out_spec = output_spec(result, out_args)  # the output's containers (capture.outputs)
    finally:
        rebound = restore_module_state(state)
    warn_rebound(cap, rebound)
    for obj, ph in cap.mutated_inputs.values():
        # the program mutated its input: write the final value back, as PyTorch would
        # (after everything else; the derivative engines keep it last)
        node = cap.graph.create_node("call_method", "copy_", (ph, cap.node_of(obj)), {})
        node.meta["val"] = ph.meta["val"]
        node.meta["fxad_side_effect"] = True
        node.meta["fxad_input_mutation"] = ph.name
    cap.graph.output(out_args)
    for n in list(cap.graph.nodes) if merged else ():  # items of multi-output ops unused
        if n.meta.get("fxad_auto_getitem") and not n.users:
            cap.graph.erase_node(n)
    gm = fx.GraphModule(cap.root, cap.graph, class_name=name)
    # inputs and constant tensors whose values the trace read: guarded on their values
    gm.meta["fxad_value_inputs"] = sorted(v for v in cap.value_inputs if isinstance(v, int))
    gm.meta["fxad_value_constants"] = [
        (cap.const_objs[k[1]], cap.const_objs[k[1]].clone()) for k in cap.value_inputs
        if not isinstance(k, int) and k[1] in cap.const_objs]
    gm.meta["fxad_training"] = bool(f.training) if isinstance(f, torch.nn.Module) else None
    gm.meta["fxad_source_module"] = f if isinstance(f, torch.nn.Module) else None
    gm.meta["fxad_closure_modules"] = list(cap.closure_modules)
    gm.meta[OUTPUT_SPEC] = out_spec
    return gm


@contextlib.contextmanager
def _quiet_meta_log() -> Iterator[None]:
    """PyTorch's fake tensors log each meta kernel that fails, with its traceback; capture
    reports the failure itself (a ``CaptureError`` naming the user's line), so that logger
    is silenced while capturing."""
    log = logging.getLogger("torch._subclasses.fake_tensor")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(level)


def _as_function(method: Any, n: int, keywords: Sequence[str] = ()) -> Callable:
    """A bound method (``model.logits``), a builtin (``torch.sin``) or another callable as a
    function of its arguments; a module it is bound to is reached through the closure, its
    parameters constants of the function."""
    def bound(*args: Any, **kwargs: Any) -> Any:
        return method(*args, **kwargs)

    try:
        sig = inspect.signature(method)
        if any(p.kind is p.VAR_POSITIONAL for p in sig.parameters.values()) \
                or len(sig.parameters) < n:
            raise ValueError
    except (TypeError, ValueError):  # builtins often have no usable signature
        sig = inspect.Signature([inspect.Parameter(
            "x" if n == 1 else f"x{i}", inspect.Parameter.POSITIONAL_ONLY) for i in range(n)]
            + [inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY) for k in keywords])
    bound.__signature__ = sig  # type: ignore[attr-defined]
    bound.__name__ = getattr(method, "__name__", "f")
    return bound


def _recapture_graphmodule(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> fx.GraphModule:
    """A GraphModule fxad produced (metadata present): re-use its graph with fresh input meta."""
    new_graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(phs) != len(example_inputs):
        raise InputError(f"the GraphModule takes {len(phs)} inputs, {len(example_inputs)} given")
    it = iter(example_inputs)
    for n in gm.graph.nodes:
        new = new_graph.node_copy(n, lambda a: env[a])
        new.meta = dict(n.meta)
        if n.op == "placeholder":
            new.meta["val"] = to_fake(next(it))
            new.meta["fxad_input"] = True
        elif n.op != "output" and not (n.meta.get("fxad_side_effect")
                                       and n.op == "call_function"):
            # (an effect, such as a print or a seeding, is not run again: it keeps its value)
            new.meta["val"] = compute_meta(gm, n.op, n.target, new.args, new.kwargs)
        env[n] = new
    out = fx.GraphModule(gm, new_graph, class_name=type(gm).__name__)
    out.meta.update(gm.meta)
    return out
