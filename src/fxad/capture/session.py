"""One capture session: the graph being built and which node each tensor object is.

:class:`Session` holds what the other capture modules read and write (they are functions
of the session, passed as ``cap``): the graph and its root module, the tensor -> node map,
what is addressable on the root (parameters, buffers, tensor attributes, submodules), the
aliasing bookkeeping of :mod:`fxad.capture.views`, the known values of
:mod:`fxad.capture.values`, the modules being called and the checkpoint regions entered.
Its own methods turn Python values into node arguments (:meth:`Session.arg`), run an op on
fake values (:meth:`Session.compute`), record a node (:meth:`Session.record`) and bind the
op's outputs to it, and route ``nn.Module`` calls (:meth:`Session.call_module`: traced
through, or one ``call_module`` node for a leaf module; a module built inside the program is
traced through when it holds no state of its own).  A NumPy array argument is the node of the
draw that made it, a ``torch.Generator`` argument the program's input it was passed as
(:mod:`fxad.capture.effects`).
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Any, Callable, ContextManager

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import (DataDependentOutputException,
                                           DynamicOutputShapeException, FakeTensor)
from torch.utils import _pytree as pytree

from ..errors import CaptureError, DataDependentError, InplaceError, SourceLoc
from ..graph.fastmeta import fast_meta
from ..graph.proxy import compute_meta, reference_of, to_fake, user_source_loc
from ..graph.shapes import OUTPUT_META
from .effects import is_numpy_array, numpy_node
from .environment import capture_environment
from .mode import CaptureMode, handle
from .state import has_tensor, snapshot, symbolic
from .values import compute_with_values, is_data_dependent, knows_some, note_index_bounds
from .views import replay, root_of

_SCALAR_TYPES = (bool, int, float, complex, str, torch.dtype, torch.device, torch.memory_format,
                 torch.layout, type(None), type(Ellipsis))


def _hashable(x: Any) -> bool:
    try:
        hash(x)
    except TypeError:
        return False
    return True


def _set_loc(node: fx.Node, loc: SourceLoc) -> None:
    node.meta["fxad_loc"] = loc
    node.meta["stack_trace"] = (
        f'  File "{loc.filename}", line {loc.lineno}, in {loc.function}\n    {loc.code}\n')


class Session:
    """State of one capture: the graph being built and which node each tensor object is."""

    def __init__(self, root: torch.nn.Module, function_root: bool,
                 leaf_types: tuple[type, ...]) -> None:
        self.graph = fx.Graph()
        self.root = root
        self.function_root = function_root
        self.leaf_types = leaf_types
        self.mode = CaptureMode(self)
        self.env: dict[int, fx.Node] = {}         # id(tensor object) -> node
        self.keep: list[Any] = []                 # keeps recorded objects alive (stable ids)
        self.attr_paths: dict[int, str] = {}      # id(real tensor) -> attribute path on root
        self.attr_nodes: dict[str, fx.Node] = {}
        self.module_paths: dict[int, str] = {}    # id(module) -> path on root
        self.closure_modules: list[torch.nn.Module] = []  # attached: a function's modules
        # functionalization (fxad.capture.views): which object is a view of which, and how
        self.parent: dict[int, tuple[Any, tuple]] = {}   # id(view) -> (parent object, step)
        self.version: dict[int, int] = {}                 # id(root object) -> mutation count
        self.seen: dict[int, int] = {}                    # id(object) -> version of its node
        self.mutated_inputs: dict[int, tuple[Any, fx.Node]] = {}  # id(root) -> (obj, input)
        self.input_roots: dict[int, fx.Node] = {}        # id(input object) -> its node
        self.suspended = 0                        # >0 while running a leaf module's forward
        self.lift: list[Any] | None = None        # control-flow subgraphs: lifted tensors
        # values fxad can know at capture (small integer inputs and constants, and what is
        # computed from them only): id(fake) -> real CPU tensor, and the inputs it came from
        self.known: dict[int, torch.Tensor] = {}
        self.known_src: dict[int, frozenset[int]] = {}
        self.index_bounds: dict[int, Any] = {}    # id(fake) -> exclusive bound (symbolic)
        self.value_inputs: set = set()            # inputs / constants whose values it read
        self.const_objs: dict[int, torch.Tensor] = {}
        self.module_stack: dict[str, tuple[str, type]] = {}  # modules being called
        self.checkpoint_stack: list[int] = []     # torch.utils.checkpoint regions entered
        self.checkpoint_count = 0
        self._index_root(root, "")

    # -- what is addressable on the root ------------------------------------------------------
    def _index_root(self, mod: torch.nn.Module, prefix: str) -> None:
        for name, m in mod.named_modules(prefix=prefix.rstrip("."), remove_duplicate=False):
            self.module_paths.setdefault(id(m), name)
        for name, p in mod.named_parameters(prefix=prefix.rstrip("."), remove_duplicate=False):
            self.attr_paths.setdefault(id(p), name)
        for name, b in mod.named_buffers(prefix=prefix.rstrip("."), remove_duplicate=False):
            self.attr_paths.setdefault(id(b), name)
        # plain tensor attributes (``self.mask = torch.ones(...)``), as torch.fx does
        for mname, m in mod.named_modules(prefix=prefix.rstrip("."), remove_duplicate=False):
            for k, v in vars(m).items():
                if isinstance(v, torch.Tensor) and not k.startswith("_"):
                    self.attr_paths.setdefault(id(v), f"{mname}.{k}" if mname else k)

    # -- tensors <-> nodes --------------------------------------------------------------------
    def track(self, obj: Any, node: fx.Node) -> None:
        self.env[id(obj)] = node
        self.keep.append(obj)

    def node_of(self, t: torch.Tensor) -> fx.Node:
        n = self.env.get(id(t))
        if n is not None:
            if id(t) in self.parent:
                root = root_of(self, t)
                if self.seen.get(id(t), 0) != self.version.get(id(root), 0):
                    n = replay(self, t)  # an alias of a tensor mutated since: rebuild it
            return n
        if self.lift is not None:
            # a control-flow branch reading a tensor from outside: a new input of the graph
            phs = [p for p in self.graph.nodes if p.op == "placeholder"]
            if phs:
                with self.graph.inserting_after(phs[-1]):
                    ph = self.graph.placeholder(f"lifted{len(self.lift)}")
            else:
                with self.graph.inserting_before(next(iter(self.graph.nodes), None)):
                    ph = self.graph.placeholder(f"lifted{len(self.lift)}")
            ph.meta["val"] = snapshot(t) if isinstance(t, FakeTensor) else to_fake(t)
            self.track(t, ph)
            self.lift.append(t)
            return ph
        if isinstance(t, FakeTensor):
            raise CaptureError(
                "a tensor reached a torch call without fxad having seen it created (it was "
                "made by code that bypasses the torch API, e.g. a C extension)",
                loc=user_source_loc(),
                hint="create it with torch functions inside the traced code, or pass it in "
                     "as an input")
        path = self.attr_paths.get(id(t))
        if path is None:
            path = self._new_constant(t)
        node = self.attr_nodes.get(path)
        if node is None:
            node = self.graph.create_node("get_attr", path, (), {})
            node.meta["val"] = to_fake(t)
            self.attr_nodes[path] = node
        return node

    def _new_constant(self, t: torch.Tensor) -> str:
        if isinstance(t, torch.nn.Parameter):
            if not self.function_root:
                raise CaptureError(
                    f"a parameter of shape {list(t.shape)} that does not belong to the traced "
                    f"module ({type(self.root).__name__}) is used here; its gradient would have "
                    "no key", loc=user_source_loc(),
                    hint="register it on the module (self.w = nn.Parameter(...)) or pass it "
                         "as an input")
            k = 0
            while hasattr(self.root, f"param_{k}"):
                k += 1
            self.root.register_parameter(f"param_{k}", t)
            path = f"param_{k}"
        else:
            k = 0
            while hasattr(self.root, f"_tensor_constant{k}"):
                k += 1
            path = f"_tensor_constant{k}"
            setattr(self.root, path, t)
        self.attr_paths[id(t)] = path
        return path

    # -- node arguments -----------------------------------------------------------------------
    def to_fake_arg(self, a: Any) -> Any:
        """Real tensors (parameters, buffers, constants) replaced by their fake values."""
        def conv(v: Any) -> Any:
            if isinstance(v, torch.Tensor) and not isinstance(v, FakeTensor):
                return to_fake(v)
            return v
        return pytree.tree_map(conv, a)

    def arg(self, a: Any, what: str) -> Any:
        """A node argument: tensors become nodes, containers are rebuilt."""
        if isinstance(a, torch.Tensor):
            return self.node_of(a)
        if type(a).__module__ == "numpy" and hasattr(a, "item") and getattr(a, "ndim", 1) == 0:
            # a NumPy scalar (np.float64 subclasses float, but its repr, np.float64(5.6),
            # would need numpy imported in the generated code): its Python value, which
            # torch's type promotion treats the same way
            return a.item()
        if isinstance(a, _SCALAR_TYPES) or isinstance(a, fx.Node):
            return a
        if isinstance(a, (torch.SymInt, torch.SymFloat, torch.SymBool)) and symbolic():
            return a  # a symbolic size (fxad.symbolic): bound to size code before codegen
        if isinstance(a, tuple) and hasattr(a, "_fields"):
            return type(a)(*[self.arg(v, what) for v in a])
        if isinstance(a, torch.Size):
            return torch.Size([self.arg(v, what) for v in a])
        if isinstance(a, (tuple, list)):
            items = [self.arg(v, what) for v in a]
            return tuple(items) if isinstance(a, tuple) else items
        if isinstance(a, dict):
            return {k: self.arg(v, what) for k, v in a.items()}
        if isinstance(a, slice):
            return slice(self.arg(a.start, what), self.arg(a.stop, what), self.arg(a.step, what))
        if isinstance(a, range):
            return a
        if dataclasses.is_dataclass(a) and not isinstance(a, type):
            # an options object (F.linear_cross_entropy's LinearCrossEntropyOptions): built
            # in the code from its fields, as torch.fx records it
            node = self.graph.create_node(
                "call_function", type(a), (),
                {f.name: self.arg(getattr(a, f.name), what) for f in dataclasses.fields(a)
                 if f.init})
            node.meta["val"] = a
            return node
        if is_numpy_array(a):  # a NumPy draw the generated code repeats, or refused
            return numpy_node(self, a, what)
        if isinstance(a, torch.Generator):
            ph = next((n for n in self.graph.nodes if n.op == "placeholder"
                       and n.meta.get("fxad_input") and n.meta.get("val") is a), None)
            if ph is not None:  # an input of the program: the generator passed at call time
                return ph
            raise CaptureError(
                f"{what} is called with a torch.Generator created inside the traced program "
                "or held outside it, which generated code cannot hold", op=what,
                loc=user_source_loc(),
                hint="pass the generator in as an argument of the traced function, or draw "
                     "from the default generator (seeded with torch.manual_seed) inside the "
                     "traced code")
        raise CaptureError(f"{what} is called with an argument of type {type(a).__name__}, "
                           "which a graph cannot hold", op=what, loc=user_source_loc(),
                           hint="pass tensors, numbers, strings, dtypes or devices to torch "
                                "functions in the traced code")

    # -- recording ----------------------------------------------------------------------------
    def compute(self, func: Callable, args: tuple, kwargs: dict, what: str) -> Any:
        """Run ``func`` on fake values, turning failures into fxad errors."""
        fargs, fkwargs = self.to_fake_arg(args), self.to_fake_arg(kwargs)
        run = OUTPUT_META.get(func, func) if _hashable(func) else func
        self.suspended += 1  # the patched entry points (modules, autograd.Function) pass through
        try:
            with torch._C.DisableTorchFunction():
                try:
                    out = fast_meta(func, fargs, fkwargs, history=True) \
                        if symbolic() and run is func else NotImplemented
                    if out is NotImplemented:
                        out = run(*fargs, **fkwargs)
                    if symbolic():
                        note_index_bounds(self, func, fargs, fkwargs, out)
                    return out
                except RuntimeError as e:
                    if "requires_grad" not in str(e) or not torch.is_grad_enabled():
                        raise
                # an argument autograd does not differentiate (a batch norm's running
                # statistics) that is an input of the program, seen with requires_grad=True:
                # fxad does its own activity analysis, so compute the value without autograd
                with torch.no_grad():
                    return run(*fargs, **fkwargs)
        except CaptureError:
            raise
        except Exception as e:
            if symbolic() and "expected to contain only concrete integers" in str(e):
                # a kernel without symbolic-size support: the output metadata from PyTorch's
                # Python reference of the op (torch._refs), which computes on SymInts
                ref = reference_of(func)
                if ref is not None:
                    with torch._C.DisableTorchFunction():
                        return ref(*fargs, **fkwargs)
            if (is_data_dependent(e) or "data is not allocated" in str(e)) \
                    and knows_some(self, args, kwargs):
                try:
                    return compute_with_values(self, func, args, kwargs)
                except Exception:  # noqa: BLE001 - report the original failure
                    pass
            raise _op_error(what, e) from e
        finally:
            self.suspended -= 1

    def record(self, kind: str, target: Any, args: tuple, kwargs: dict, val: Any,
               what: str) -> fx.Node:
        loc = user_source_loc()
        node = self.graph.create_node(kind, target, self.arg(args, what), self.arg(kwargs, what))
        node.meta["val"] = snapshot(val)
        if loc is not None:
            _set_loc(node, loc)
        if not torch.is_grad_enabled():
            node.meta["fxad_no_grad"] = True
        if self.module_stack:
            node.meta["nn_module_stack"] = dict(self.module_stack)
        if self.checkpoint_stack:
            node.meta["fxad_checkpoint"] = self.checkpoint_stack[-1]
        return node

    def bind_outputs(self, out: Any, node: fx.Node) -> None:
        """Make the tensors in ``out`` stand for ``node`` (or its items)."""
        if isinstance(out, torch.Tensor):
            self.track(out, node)
            return
        if isinstance(out, (tuple, list)):
            self.keep.append(out)
            for i, v in enumerate(out):
                if isinstance(v, torch.Tensor):
                    item = self.graph.create_node("call_function", operator.getitem, (node, i), {})
                    item.meta["val"] = snapshot(v)
                    item.meta["fxad_auto_getitem"] = True
                    for k in ("fxad_loc", "stack_trace", "fxad_no_grad", "nn_module_stack",
                              "fxad_checkpoint"):
                        if k in node.meta:
                            item.meta[k] = node.meta[k]
                    self.track(v, item)
                elif isinstance(v, (tuple, list)) and has_tensor(v):
                    item = self.graph.create_node("call_function", operator.getitem, (node, i), {})
                    item.meta["val"] = snapshot(v)
                    item.meta["fxad_auto_getitem"] = True
                    self.bind_outputs(v, item)

    def stamp(self, node: fx.Node) -> None:
        loc = user_source_loc()
        if loc is not None:
            _set_loc(node, loc)
        if self.module_stack:
            node.meta["nn_module_stack"] = dict(self.module_stack)

    def emit(self, kind: str, target: Any, args: tuple, kwargs: dict | None = None
             ) -> fx.Node:
        """A node fxad adds itself (args already node arguments), with its value."""
        kwargs = kwargs or {}
        node = self.graph.create_node(kind, target, args, kwargs)
        node.meta["val"] = compute_meta(self.root, kind, target, args, kwargs)
        node.meta["fxad_functionalized"] = True
        self.stamp(node)
        return node

    def handle(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """Record the torch call ``func(*args, **kwargs)`` (:func:`fxad.capture.mode.handle`)."""
        return handle(self, func, args, kwargs)

    # -- modules ------------------------------------------------------------------------------
    def call_module(self, mod: torch.nn.Module, call: Callable, args: tuple,
                    kwargs: dict) -> Any:
        if self.suspended:
            return call(mod, *args, **kwargs)
        path = self.module_paths.get(id(mod))
        if path is None:
            if self._program_data(mod) and not isinstance(mod, self.leaf_types):
                # no state of its own (a loss module built in forward, whose buffer the
                # program computed: BCEWithLogitsLoss(pos_weight=torch.tensor(5.0)); a wrapper
                # around a submodule): its forward is code like any other
                return call(mod, *args, **kwargs)
            if not self.function_root:
                raise CaptureError(
                    f"the {type(mod).__name__} module called here is not a submodule of the "
                    "traced module (it belongs to another object, or holds tensors fxad did "
                    "not see created), so its parameters and buffers cannot be addressed",
                    op=type(mod).__name__, loc=user_source_loc(),
                    hint="create it in __init__ and assign it to self (or call the matching "
                         "torch.nn.functional function)")
            # a module the traced function closes over (``lambda x: model(x).sum()``): attach
            # it to the graph's root; its parameters are constants of the function
            base = type(mod).__name__.lower() or "module"
            path, k = base, 1
            while hasattr(self.root, path):
                path, k = f"{base}_{k}", k + 1
            self.root.add_module(path, mod)
            self.closure_modules.append(mod)
            self._index_root(mod, path + ".")
        if self.leaf_types and isinstance(mod, self.leaf_types):
            what = f"module {type(mod).__name__}"
            self.suspended += 1
            try:
                out = self.compute(lambda *a, **k: call(mod, *a, **k), args, kwargs, what)
            finally:
                self.suspended -= 1
            node = self.record("call_module", path, args, kwargs, out, what)
            self.bind_outputs(out, node)
            return out
        if not path or path in self.module_stack:
            return call(mod, *args, **kwargs)
        self.module_stack[path] = (path, type(mod))
        try:
            return call(mod, *args, **kwargs)
        finally:
            self.module_stack.pop(path, None)

    def _program_data(self, mod: torch.nn.Module) -> bool:
        """``mod`` (not addressable on the root: built inside the traced code) holds no state
        of its own: each parameter is one the root already holds (a wrapper around one of
        its submodules, such as torchdiffeq's ``_PerturbFunc``), each buffer one of those or
        a tensor the traced program computed."""
        return all(id(p) in self.attr_paths for p in mod.parameters()) \
            and all(id(b) in self.env or id(b) in self.attr_paths for b in mod.buffers())

    # -- nested captures ----------------------------------------------------------------------
    def subcapture(self) -> "Session":
        """A fresh session on the same root, for a graph captured while this one runs (a
        control-flow branch, a custom Function's backward)."""
        return Session(self.root, self.function_root, self.leaf_types)

    def environment(self) -> ContextManager[None]:
        """This session made the current one, with capture's patches in place
        (:func:`fxad.capture.environment.capture_environment`)."""
        return capture_environment(self)


def _op_error(what: str, e: Exception) -> CaptureError:
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    dyn = isinstance(e, (DataDependentOutputException, DynamicOutputShapeException)) \
        or "data-dependent" in str(e) or "DataDependent" in type(e).__name__ \
        or "DynamicOutputShape" in type(e).__name__
    if dyn:
        return DataDependentError(
            f"{what} cannot be traced on the example shapes: its output shape or value "
            "depends on tensor data", op=what, loc=user_source_loc(),
            hint="fxad needs shapes that follow from the input shapes: use masking "
                 "(torch.where(mask, x, 0)) instead of selecting (x[mask]), or compute this "
                 "outside the traced function and pass it in as an input")
    if "inplace" in msg or "in-place" in msg:
        return InplaceError(f"{what}: PyTorch rejects this in-place operation when gradients "
                            f"are recorded: {type(e).__name__}: {msg}", op=what,
                            loc=user_source_loc(),
                            hint="use the out-of-place form of the op (y = x.mul(a) instead "
                                 "of x.mul_(a)), or clone before mutating")
    return CaptureError(f"{what} cannot be traced on the example shapes: "
                        f"{type(e).__name__}: {msg}", op=what, loc=user_source_loc(),
                        hint="check the shapes and dtypes of the example inputs")
