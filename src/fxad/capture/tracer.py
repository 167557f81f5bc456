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
  their class (:func:`fxad.register_vjp`).
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
  example value.
* Metadata queries (``x.size(0)``, ``x.dim()``, ``torch.is_floating_point(x)``) are answered
  from the fake tensor and not recorded; anything that needs tensor *data* (``bool(x)``,
  ``x.item()``, ``x.tolist()``, ``torch.equal``) raises :class:`~fxad.errors.DataDependentError`
  naming the user's line.
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

Node meta keys written here: ``val`` and ``fxad_loc`` (see :mod:`fxad.graph.proxy`),
``fxad_input`` (placeholders of the program's inputs), ``fxad_side_effect`` (a buffer update
such as BatchNorm's ``num_batches_tracked.add_(1)``, kept as an in-place call),
``fxad_no_grad`` (computed with gradients disabled), ``fxad_value`` (a known value, above),
``fxad_inplace`` (the user's in-place statement a functional node stands for),
``fxad_checkpoint`` (the ``torch.utils.checkpoint`` region), ``fxad_custom_function`` (a
custom ``autograd.Function``, :mod:`fxad.capture.custom`), ``nn_module_stack`` (the modules
being called, as torch.fx records it).
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import operator
import threading
import types
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from ..errors import CaptureError, DataDependentError, InplaceError, InputError, SourceLoc
from ..graph.factories import CONV_GRADS, FACTORIES
from ..graph.proxy import (compute_meta, describe_target, fake_mode, in_meta_computation, to_fake,
                    user_source_loc)

# ---------------------------------------------------------------------------------------------
# How each torch call is recorded
# ---------------------------------------------------------------------------------------------

# composites of ops that have rules, whose single-node form would need a fallback
_TRACE_THROUGH = frozenset({F.multi_head_attention_forward})

_NO_OVERRIDE = {name: (lambda *a, **k: False) for name in (
    "has_torch_function", "has_torch_function_unary", "has_torch_function_variadic")}

# Tensor dunder methods -> (operator function, operands reversed)
_DUNDER: dict[str, tuple[Callable, bool]] = {}
for _op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or",
            "xor", "lshift", "rshift"):
    _fn = getattr(operator, _op + "_" if _op in ("and", "or") else _op)
    _DUNDER[f"__{_op}__"] = (_fn, False)
    _DUNDER[f"__r{_op}__"] = (_fn, True)
_DUNDER["__div__"] = (operator.truediv, False)
_DUNDER["__rdiv__"] = (operator.truediv, True)
for _op in ("eq", "ne", "lt", "le", "gt", "ge"):
    _DUNDER[f"__{_op}__"] = (getattr(operator, _op), False)
_UNARY_DUNDER = {"__neg__": operator.neg, "__pos__": operator.pos, "__abs__": operator.abs,
                 "__invert__": operator.invert}
# in-place dunders -> the out-of-place operator
_IDUNDER = {f"__i{k[2:]}": v[0] for k, v in _DUNDER.items()
            if not k.startswith("__r") and k[2:-2] not in ("eq", "ne", "lt", "le", "gt", "ge")}

# calls that need tensor data
_DATA_METHODS = {"item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__complex__",
                 "__index__", "__array__", "__contains__", "data_ptr", "equal", "allclose",
                 "is_nonzero", "__array_wrap__"}
_DATA_FUNCTIONS = {torch.equal, torch.allclose, torch.is_nonzero}
# methods that end in "_" but are not in-place value updates
_NOT_INPLACE = {"requires_grad_", "share_memory_", "retain_grad", "pin_memory_"}
# in-place random draws: they overwrite every element (no out-of-place method)
_RANDOM_INPLACE = {"uniform_", "normal_", "bernoulli_", "exponential_", "random_",
                   "geometric_", "cauchy_", "log_normal_"}
# properties that are views of the tensor: recorded as the equivalent calls
_VIEW_PROPERTIES = {"T", "mT", "H", "mH", "real", "imag", "data"}

_STATE = threading.local()


@contextlib.contextmanager
def symbolic_shapes(mode: Any) -> Iterator[None]:
    """Capture with ``mode`` (a FakeTensorMode with a ShapeEnv) as the fake mode, accepting
    symbolic sizes as arguments: the run :mod:`fxad.dynamic` uses to find the program's
    decisions on sizes (its graph is discarded)."""
    from ..graph import proxy
    old = proxy._FAKE_MODE
    proxy._FAKE_MODE = mode
    _STATE.symbolic = True
    try:
        yield
    finally:
        proxy._FAKE_MODE = old
        _STATE.symbolic = False


def capturing() -> bool:
    """True while :func:`capture` runs the user's program (on fake tensors)."""
    return getattr(_STATE, "capture", None) is not None


_TENSOR_METHODS: dict[int, str] | None = None


def _tensor_method_table() -> dict[int, str]:
    """id(attribute of torch.Tensor) -> its name; where one object has several names, the
    plain name wins over the dunder (``Tensor.abs`` over ``Tensor.__abs__``)."""
    global _TENSOR_METHODS
    if _TENSOR_METHODS is None:
        table: dict[int, str] = {}
        for cls in (torch._C.TensorBase, torch.Tensor):
            for name in dir(cls):
                try:
                    obj = getattr(cls, name)
                except AttributeError:
                    continue
                if not callable(obj) or isinstance(obj, type):
                    continue
                prev = table.get(id(obj))
                if prev is None or (prev.startswith("__") and not name.startswith("__")):
                    table[id(obj)] = name
        _TENSOR_METHODS = table
    return _TENSOR_METHODS


def _method_name(func: Any) -> tuple[str | None, str | None]:
    """(method name, property accessor) of a ``torch.Tensor`` method or property accessor
    (``"__get__:shape"``)."""
    name = getattr(func, "__name__", None)
    if name in ("__get__", "__set__", "__delete__"):
        owner = getattr(func, "__self__", None)
        prop = getattr(owner, "__name__", None)
        if prop is not None and (getattr(torch.Tensor, prop, None) is owner
                                 or getattr(torch._C.TensorBase, prop, None) is owner):
            return None, f"{name}:{prop}"
        return None, None
    return _tensor_method_table().get(id(func)), None


def _takes_callable(target: Any, args: tuple, kwargs: dict) -> bool:
    """A Python-level torch function (``F.triplet_margin_with_distance_loss``) called with a
    user callable (a module or function) among its arguments: a graph node cannot hold the
    callable, so the function's body is traced instead.  So is ``F.multi_head_attention_forward``
    (a composite of ops with rules)."""
    if not inspect.isfunction(target):
        return False
    if target in _TRACE_THROUGH:
        return True
    return any(callable(v) and not isinstance(v, (torch.Tensor, type))
               for v in pytree.tree_leaves((args, kwargs)))


def _call_body(target: Any, args: tuple, kwargs: dict) -> Any:
    """Run ``target``'s Python body, skipping its own ``__torch_function__`` dispatch (the ops
    inside it are still recorded one by one)."""
    body = types.FunctionType(target.__code__, {**target.__globals__, **_NO_OVERRIDE},
                              target.__name__, target.__defaults__, target.__closure__)
    body.__kwdefaults__ = target.__kwdefaults__
    return body(*args, **kwargs)


def _hashable(x: Any) -> bool:
    try:
        hash(x)
    except TypeError:
        return False
    return True


def _stateless(m: torch.nn.Module) -> bool:
    return next(m.parameters(), None) is None and next(m.buffers(), None) is None


def _has_tensor(x: Any) -> bool:
    return any(isinstance(v, torch.Tensor) for v in pytree.tree_leaves(x))


def _is_view_of(out: Any, base: Any) -> bool:
    """``out`` shares ``base``'s storage as a view (PyTorch's own view tracking)."""
    if not (isinstance(out, torch.Tensor) and isinstance(base, torch.Tensor)):
        return False
    if out is base:
        return False
    try:
        return out.untyped_storage()._cdata == base.untyped_storage()._cdata
    except Exception:
        return False


def _bind(names: tuple[str, ...], args: tuple, kwargs: dict,
          defaults: tuple | None = None) -> tuple:
    """Positional-or-keyword arguments ``names`` of a view op's recorded call."""
    out = []
    for k, name in enumerate(names):
        if k < len(args):
            out.append(args[k])
        elif name in kwargs:
            out.append(kwargs[name])
        elif defaults is not None:
            out.append(defaults[k])
        else:
            raise KeyError(name)
    return tuple(out)


def _split_dim(name: str, args: tuple, kwargs: dict, ndim: int) -> int | None:
    if name == "hsplit":
        return 1 if ndim > 1 else 0
    if name == "vsplit":
        return 0
    if "dim" in kwargs:
        return kwargs["dim"] % ndim
    if len(args) >= 2 and isinstance(args[1], int):
        return args[1] % ndim
    return 0


_KNOWN_NUMEL = 1 << 14


def _is_data_dependent(e: Exception) -> bool:
    from torch._subclasses.fake_tensor import (DataDependentOutputException,
                                               DynamicOutputShapeException)
    return isinstance(e, (DataDependentOutputException, DynamicOutputShapeException)) \
        or "DataDependent" in type(e).__name__ or "DynamicOutputShape" in type(e).__name__


def _from_python_data(args: tuple, kwargs: dict) -> bool:
    """A factory call whose values come from Python data (``torch.tensor([2, 5, 3])``,
    ``torch.arange(n)``), not uninitialized memory."""
    return bool(args) and isinstance(args[0], (list, tuple, int, float, bool))


def _same_index(a: Any, b: Any) -> bool:
    """Two indexing expressions are the same (tensors compared by identity)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is b
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same_index(x, y) for x, y in zip(a, b))
    if isinstance(a, slice) and isinstance(b, slice):
        return all(_same_index(x, y) for x, y in ((a.start, b.start), (a.stop, b.stop),
                                                 (a.step, b.step)))
    return type(a) is type(b) and a == b


def _storage(node: fx.Node) -> Any:
    v = node.meta.get("val")
    if isinstance(v, torch.Tensor):
        try:
            return v.untyped_storage()._cdata
        except Exception:
            return None
    return None


def _set_loc(node: fx.Node, loc: SourceLoc) -> None:
    node.meta["fxad_loc"] = loc
    node.meta["stack_trace"] = (
        f'  File "{loc.filename}", line {loc.lineno}, in {loc.function}\n    {loc.code}\n')


def _snapshot(v: Any) -> Any:
    """A node's ``val``: the fake value with its own metadata (a later in-place change of the
    user-visible object's shape does not reach it) and without autograd history."""
    def one(t: Any) -> Any:
        if isinstance(t, torch.Tensor):
            with torch._C.DisableTorchFunction(), torch.no_grad():
                return t.detach()
        return t
    if isinstance(v, torch.Tensor):
        return one(v)
    if isinstance(v, (tuple, list)):
        items = [one(t) for t in v]
        if type(v) in (tuple, list):
            return type(v)(items)
        try:  # torch.return_types structseqs and namedtuples
            return type(v)(items)
        except TypeError:
            return type(v)(*items)
    return v


_SCALAR_TYPES = (bool, int, float, complex, str, torch.dtype, torch.device, torch.memory_format,
                 torch.layout, type(None), type(Ellipsis))


class _Mode(TorchFunctionMode):
    """Hands every torch API call of the user's program to the :class:`_Capture`."""

    def __init__(self, cap: "_Capture") -> None:
        super().__init__()
        self.cap = cap

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        return self.cap.handle(func, tuple(args), dict(kwargs or {}))


class _Capture:
    """State of one capture: the graph being built and which node each tensor object is."""

    def __init__(self, root: torch.nn.Module, function_root: bool,
                 leaf_types: tuple[type, ...]) -> None:
        self.graph = fx.Graph()
        self.root = root
        self.function_root = function_root
        self.leaf_types = leaf_types
        self.mode = _Mode(self)
        self.env: dict[int, fx.Node] = {}         # id(tensor object) -> node
        self.keep: list[Any] = []                 # keeps recorded objects alive (stable ids)
        self.attr_paths: dict[int, str] = {}      # id(real tensor) -> attribute path on root
        self.attr_nodes: dict[str, fx.Node] = {}
        self.module_paths: dict[int, str] = {}    # id(module) -> path on root
        # functionalization (see _commit): which object is a view of which, and how
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
        self.value_inputs: set = set()            # inputs / constants whose values it read
        self.const_objs: dict[int, torch.Tensor] = {}
        self.module_stack: dict[str, tuple[str, type]] = {}  # modules being called
        self.checkpoint_stack: list[int] = []     # torch.utils.checkpoint regions entered
        self.checkpoint_count = 0
        self._index_root(root, "")

    # -- what is addressable on the root ----------------------------------------------------
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

    # -- tensors <-> nodes ------------------------------------------------------------------
    def track(self, obj: Any, node: fx.Node) -> None:
        self.env[id(obj)] = node
        self.keep.append(obj)

    def node_of(self, t: torch.Tensor) -> fx.Node:
        n = self.env.get(id(t))
        if n is not None:
            if id(t) in self.parent:
                root = self.root_of(t)
                if self.seen.get(id(t), 0) != self.version.get(id(root), 0):
                    n = self._replay(t)  # an alias of a tensor mutated since: rebuild it
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
            ph.meta["val"] = _snapshot(t) if isinstance(t, FakeTensor) else to_fake(t)
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

    # -- functionalization ------------------------------------------------------------------
    def root_of(self, t: Any) -> Any:
        while id(t) in self.parent:
            t = self.parent[id(t)][0]
        return t

    def note_views(self, out: Any, kind: str, target: Any, args: tuple, kwargs: dict) -> None:
        """Remember how outputs that are views of ``args[0]`` are computed from it, so that
        they can be rebuilt after a mutation of the storage they share, and a mutation of
        them written back into their base."""
        if not args or not isinstance(args[0], FakeTensor) or id(args[0]) not in self.env:
            return
        base = args[0]
        step = (kind, target, args, kwargs)
        if isinstance(out, torch.Tensor):
            if _is_view_of(out, base):
                self.parent[id(out)] = (base, step + (None,))
                self.seen[id(out)] = self.version.get(id(self.root_of(base)), 0)
        elif isinstance(out, (tuple, list)):
            for i, o in enumerate(out):
                if isinstance(o, torch.Tensor) and _is_view_of(o, base):
                    self.parent[id(o)] = (base, step + (i,))
                    self.seen[id(o)] = self.version.get(id(self.root_of(base)), 0)

    def _replay(self, t: Any) -> fx.Node:
        base, (kind, target, args, kwargs, item) = self.parent[id(t)]
        what = describe_target(kind, target)
        node = self.graph.create_node(kind, target, self.arg(args, what), self.arg(kwargs, what))
        node.meta["val"] = compute_meta(self.root, kind, target, node.args, node.kwargs)
        node.meta["fxad_view_replay"] = True
        if item is not None:
            parent = node
            node = self.graph.create_node("call_function", operator.getitem, (parent, item), {})
            node.meta["val"] = parent.meta["val"][item]
        self._stamp(node)
        self.env[id(t)] = node
        self.seen[id(t)] = self.version.get(id(self.root_of(t)), 0)
        return node

    def _stamp(self, node: fx.Node) -> None:
        loc = user_source_loc()
        if loc is not None:
            _set_loc(node, loc)
        if self.module_stack:
            node.meta["nn_module_stack"] = dict(self.module_stack)

    def _emit(self, kind: str, target: Any, args: tuple, kwargs: dict | None = None
              ) -> fx.Node:
        """A node fxad adds itself (args already node arguments), with its value."""
        kwargs = kwargs or {}
        node = self.graph.create_node(kind, target, args, kwargs)
        node.meta["val"] = compute_meta(self.root, kind, target, args, kwargs)
        node.meta["fxad_functionalized"] = True
        self._stamp(node)
        return node

    def _commit(self, x: Any, new: fx.Node, what: str) -> None:
        """``x`` now holds ``new``: write it back through every view between ``x`` and the
        tensor that owns the storage (PyTorch's functionalization: the base is rebuilt with
        the matching ``*_scatter`` op), so that the base and all its other views see the
        mutation; a mutated program input is written back at the end of the graph."""
        chain = []
        cur = x
        while id(cur) in self.parent:
            par, step = self.parent[id(cur)]
            chain.append((cur, par, step))
            cur = par
        root = cur
        loc = user_source_loc()
        first = len(self.graph.nodes)
        child_new = new
        for child, par, step in chain:
            if not isinstance(par, FakeTensor):
                raise InplaceError(
                    f"{what} modifies a view of a buffer or parameter of the module in place",
                    op=what, loc=user_source_loc(),
                    hint="update the whole buffer (self.buf.add_(...)), or compute a new "
                         "tensor")
            child_new = self._scatter(step, self.node_of(par), child_new, par, child, what)
        if loc is not None:  # the functional code of one in-place statement, for codegen
            new.meta["fxad_inplace"] = loc
            n = new.prev
            while n.meta.get("fxad_loc") == loc and n.op != "placeholder" \
                    and "fxad_inplace" not in n.meta:
                n.meta["fxad_inplace"] = loc
                n = n.prev
            for n in list(self.graph.nodes)[first:]:
                n.meta["fxad_inplace"] = loc
        self.env[id(x)] = new
        self.keep.append(x)
        version = self.version.get(id(root), 0) + 1
        self.version[id(root)] = version
        self.seen[id(x)] = version
        if root is not x:
            self.env[id(root)] = child_new
        self.seen[id(root)] = version
        if id(root) in self.input_roots:
            self.mutated_inputs[id(root)] = (root, self.input_roots[id(root)])

    def _scatter(self, step: tuple, par_node: fx.Node, new: fx.Node, par: Any, child: Any,
                 what: str) -> fx.Node:
        """The parent's new value when its view ``child`` (made by ``step``) becomes
        ``new``."""
        kind, target, args, kwargs, item = step
        name = target if kind == "call_method" else getattr(target, "__name__", "")
        rest = self.arg(tuple(args[1:]), what)
        kw = self.arg(dict(kwargs), what)
        pshape = tuple(par.shape)
        if name == "detach" or (name == "data" and item is None):
            # a detached alias: the write shows in the base's value, but, as in autograd,
            # no derivative flows through it (the base keeps its own history)
            delta = self._emit("call_function", operator.sub, (new, par_node))
            delta = self._emit("call_method", "detach", (delta,))
            return self._emit("call_function", operator.add, (par_node, delta))
        if name in ("alias", "view_as") and tuple(child.shape) == pshape \
                or name in ("contiguous",):
            return new
        if item is None and target is operator.getitem:
            from ..ops import setitem as functional_setitem
            return self._emit("call_function", functional_setitem, (par_node, rest[0], new))
        if name == "select":
            dim, index = _bind(("dim", "index"), rest, kw)
            return self._emit("call_function", torch.select_scatter, (par_node, new, dim, index))
        if name == "narrow":
            dim, start, length = _bind(("dim", "start", "length"), rest, kw)
            if isinstance(start, int):
                return self._emit("call_function", torch.slice_scatter,
                                  (par_node, new, dim, start, start + length))
        if name == "diagonal":
            offset, dim1, dim2 = _bind(("offset", "dim1", "dim2"), rest, kw, (0, 0, 1))
            return self._emit("call_function", torch.diagonal_scatter,
                              (par_node, new, offset, dim1, dim2))
        if name in ("view", "reshape", "view_as", "reshape_as", "flatten", "unflatten",
                    "squeeze", "unsqueeze") and item is None \
                and child.numel() == par.numel():
            return self._emit("call_function", torch.reshape, (new, pshape))
        if name in ("transpose", "swapaxes", "swapdims") and item is None:
            d0, d1 = _bind(("dim0", "dim1"), rest, kw)
            return self._emit("call_function", torch.transpose, (new, d0, d1))
        if name in ("t", "T", "mT") and item is None:
            return self._emit("call_function", torch.transpose, (new, -2, -1) if par.dim() > 1
                              else (new, 0, 0))
        if name == "permute" and item is None:
            dims = rest[0] if len(rest) == 1 and isinstance(rest[0], (tuple, list)) else rest
            dims = [d % par.dim() for d in dims]
            inverse = tuple(sorted(range(len(dims)), key=lambda k: dims[k]))
            return self._emit("call_function", torch.permute, (new, inverse))
        if name in ("movedim", "moveaxis") and item is None:
            src, dst = _bind(("source", "destination"), rest, kw)
            return self._emit("call_function", torch.movedim, (new, dst, src))
        if name == "unbind" and item is not None:
            dim = _bind(("dim",), rest, kw, (0,))[0]
            return self._emit("call_function", torch.select_scatter, (par_node, new, dim, item))
        if name in ("split", "chunk", "split_with_sizes", "tensor_split", "hsplit", "vsplit") \
                and item is not None:
            dim = _split_dim(name, rest, kw, par.dim())
            if dim is not None:
                out_val = compute_meta(self.root, kind, target, (par_node,) + tuple(rest), kw)
                start = sum(int(o.shape[dim]) for o in out_val[:item])
                return self._emit("call_function", torch.slice_scatter,
                                  (par_node, new, dim, start, start + int(child.shape[dim])))
        # any other view: write through the positions it reads (an index map of the parent
        # pushed through the same view op)
        return self._scatter_by_positions(step, par_node, new, par, what)

    def _scatter_by_positions(self, step: tuple, par_node: fx.Node, new: fx.Node, par: Any,
                              what: str) -> fx.Node:
        kind, target, args, kwargs, item = step
        positions = self._emit("call_function", torch.arange, (par.numel(),),
                               {"device": par.device})
        positions = self._emit("call_function", torch.reshape, (positions, tuple(par.shape)))
        rest = self.arg(tuple(args[1:]), what)
        view = self._emit(kind, target, (positions,) + tuple(rest), self.arg(dict(kwargs), what))
        if item is not None:
            view = self._emit("call_function", operator.getitem, (view, item))
        flat_pos = self._emit("call_function", torch.reshape, (view, (-1,)))
        flat_new = self._emit("call_function", torch.reshape, (new, (-1,)))
        flat_par = self._emit("call_function", torch.reshape, (par_node, (-1,)))
        put = self._emit("call_function", torch.index_put, (flat_par, (flat_pos,), flat_new))
        return self._emit("call_function", torch.reshape, (put, tuple(par.shape)))

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
        if isinstance(a, (torch.SymInt, torch.SymFloat, torch.SymBool)) \
                and getattr(_STATE, "symbolic", False):
            return a  # a size in a symbolic run (fxad.dynamic), whose graph is not kept
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
        if isinstance(a, torch.Generator):
            raise CaptureError(
                f"{what} is called with a torch.Generator, which generated code cannot hold",
                op=what, loc=user_source_loc(),
                hint="draw from the default generator (seeded with torch.manual_seed) inside "
                     "the traced code")
        raise CaptureError(f"{what} is called with an argument of type {type(a).__name__}, "
                           "which a graph cannot hold", op=what, loc=user_source_loc(),
                           hint="pass tensors, numbers, strings, dtypes or devices to torch "
                                "functions in the traced code")

    # -- recording ----------------------------------------------------------------------------
    def compute(self, func: Callable, args: tuple, kwargs: dict, what: str) -> Any:
        """Run ``func`` on fake values, turning failures into fxad errors."""
        from ..graph.shapes import OUTPUT_META
        fargs, fkwargs = self.to_fake_arg(args), self.to_fake_arg(kwargs)
        run = OUTPUT_META.get(func, func) if _hashable(func) else func
        self.suspended += 1  # the patched entry points (modules, autograd.Function) pass through
        try:
            with torch._C.DisableTorchFunction():
                try:
                    return run(*fargs, **fkwargs)
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
            if (_is_data_dependent(e) or "data is not allocated" in str(e)) \
                    and self._knows_some(args, kwargs):
                try:
                    return self._compute_with_values(func, args, kwargs)
                except Exception:  # noqa: BLE001 - report the original failure
                    pass
            raise _op_error(what, e) from e
        finally:
            self.suspended -= 1

    # -- known values ---------------------------------------------------------------------
    def _value(self, t: torch.Tensor) -> torch.Tensor | None:
        """The real value of ``t`` if capture knows it: a known fake, or a small real tensor
        the program holds that is neither a parameter nor an attribute of the module (those
        can change between calls)."""
        if id(t) in self.known:
            return self.known[id(t)]
        if isinstance(t, FakeTensor) or isinstance(t, torch.nn.Parameter) \
                or t.numel() > _KNOWN_NUMEL or t.device.type != "cpu":
            return None
        path = self.attr_paths.get(id(t))
        if path is not None and not path.startswith("_tensor_constant"):
            return None
        return t

    def _knows_some(self, *a: Any) -> bool:
        return any(isinstance(v, torch.Tensor) and self._value(v) is not None
                   for v in pytree.tree_leaves(a))

    def _compute_with_values(self, func: Callable, args: tuple, kwargs: dict) -> Any:
        """An op whose output shape needs the values of its integer arguments
        (``_pack_padded_sequence(input, lengths)``): run it with the known arguments' values
        and the others as meta tensors, and return fake results (real values recorded)."""
        from torch.utils._python_dispatch import _disable_current_modes
        device = next((v.device for v in pytree.tree_leaves((args, kwargs))
                       if isinstance(v, torch.Tensor) and (v.is_floating_point()
                                                           or self._value(v) is None)), None)

        def conv(v: Any) -> Any:
            if not isinstance(v, torch.Tensor):
                return v
            if self._value(v) is not None and not (v.is_floating_point() or v.is_complex()):
                return self._value(v)  # the integer arguments whose values decide shapes
            return torch.empty_strided(tuple(v.shape), tuple(v.stride()), dtype=v.dtype,
                                       device="meta")

        with _disable_current_modes(), torch._C.DisableTorchFunction():
            rargs, rkwargs = pytree.tree_map(conv, (args, kwargs))
            out = func(*rargs, **rkwargs)
        # the result's shape depends on those values: the inputs they came from are guarded
        ints = [v for v in pytree.tree_leaves((args, kwargs)) if isinstance(v, torch.Tensor)
                and not (v.is_floating_point() or v.is_complex()) and self._value(v) is not None]
        self.value_inputs |= self._sources(ints)
        mode = fake_mode()

        def back(v: Any) -> Any:
            if not isinstance(v, torch.Tensor):
                return v
            if v.device.type == "meta":
                with torch._C.DisableTorchFunction(), mode:
                    return torch.empty_strided(tuple(v.shape), tuple(v.stride()), dtype=v.dtype,
                                               device=device or "cpu")
            fv = to_fake(v.clone())
            self.known[id(fv)] = v
            self.known_src[id(fv)] = self._sources(args, kwargs)
            self.keep.append(fv)
            return fv

        return pytree.tree_map(back, out)

    def _sources(self, *a: Any) -> frozenset:
        """The inputs (their positions) and constant tensors (``("const", id)``) a known
        value is computed from."""
        out: frozenset = frozenset()
        for v in pytree.tree_leaves(a):
            if isinstance(v, torch.Tensor):
                if id(v) in self.known_src:
                    out = out | self.known_src[id(v)]
                elif not isinstance(v, FakeTensor):
                    self.const_objs[id(v)] = v
                    out = out | {("const", id(v))}
        return out

    def note_known(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        """``out``'s real value when every tensor the op reads is known (small integer inputs,
        constants, what was computed from them), for data-dependent questions about it."""
        name = getattr(func, "__name__", "")
        if name.startswith(("rand", "empty", "normal", "bernoulli", "multinomial", "poisson",
                            "dropout", "uniform", "exponential", "geometric", "cauchy")):
            return
        tensors = [v for v in pytree.tree_leaves((args, kwargs)) if isinstance(v, torch.Tensor)]
        if any(self._value(v) is None for v in tensors):
            return
        outs = [v for v in pytree.tree_leaves(out) if isinstance(v, torch.Tensor)]
        if not outs or any(v.numel() > _KNOWN_NUMEL or v.is_floating_point() and
                           v.numel() > 64 for v in outs):
            return
        if not tensors and not _from_python_data(args, kwargs):
            return
        from torch.utils._python_dispatch import _disable_current_modes

        def real(v: Any) -> Any:
            return self._value(v) if isinstance(v, torch.Tensor) else v

        try:
            rargs, rkwargs = pytree.tree_map(real, (args, kwargs))
            with _disable_current_modes(), torch._C.DisableTorchFunction():
                rout = func(*rargs, **rkwargs)
        except Exception:  # noqa: BLE001 - not knowable: stays unknown
            return
        src = self._sources(args, kwargs)
        for fv, rv in zip(pytree.tree_leaves(out), pytree.tree_leaves(rout)):
            if isinstance(fv, torch.Tensor) and isinstance(rv, torch.Tensor) \
                    and tuple(fv.shape) == tuple(rv.shape):
                self.known[id(fv)] = rv
                self.known_src[id(fv)] = src
                node = self.env.get(id(fv))
                if node is not None:
                    node.meta["fxad_value"] = rv

    def record(self, kind: str, target: Any, args: tuple, kwargs: dict, val: Any,
               what: str) -> fx.Node:
        loc = user_source_loc()
        node = self.graph.create_node(kind, target, self.arg(args, what), self.arg(kwargs, what))
        node.meta["val"] = _snapshot(val)
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
                    item.meta["val"] = _snapshot(v)
                    item.meta["fxad_auto_getitem"] = True
                    for k in ("fxad_loc", "stack_trace", "fxad_no_grad", "nn_module_stack",
                              "fxad_checkpoint"):
                        if k in node.meta:
                            item.meta[k] = node.meta[k]
                    self.track(v, item)
                elif isinstance(v, (tuple, list)) and _has_tensor(v):
                    item = self.graph.create_node("call_function", operator.getitem, (node, i), {})
                    item.meta["val"] = _snapshot(v)
                    item.meta["fxad_auto_getitem"] = True
                    self.bind_outputs(v, item)

    # -- the torch-function handler -----------------------------------------------------------
    def handle(self, func: Any, args: tuple, kwargs: dict) -> Any:  # noqa: C901
        if self.suspended:
            return func(*self.to_fake_arg(args), **self.to_fake_arg(kwargs))
        method, prop = _method_name(func)
        what = f"Tensor.{method}" if method else describe_target("call_function", func)
        if prop is not None:
            return self._property(func, prop, args, kwargs)
        if method in _DATA_METHODS or func in _DATA_FUNCTIONS:
            known, answer = self._known_answer(func, args, kwargs)
            if known:
                return answer
            self._data_dependent(method or getattr(func, "__name__", "op"), args)
        if method == "__setitem__":
            return self._setitem(func, args, kwargs)
        if method in ("register_hook", "register_post_accumulate_grad_hook", "backward"):
            raise CaptureError(
                f"Tensor.{method} inside the traced program is not supported: fxad writes the "
                "derivative code itself, so a hook or a nested backward would be ignored",
                op=f"Tensor.{method}", loc=user_source_loc(),
                hint="remove it from the traced code; to change a gradient, register a rule "
                     "(fxad.register_vjp) or use a custom torch.autograd.Function")
        if method == "retain_grad":
            return None
        if method == "__iter__":
            t = args[0]
            if t.dim() == 0:
                raise TypeError("iteration over a 0-d tensor")
            return iter([self.handle(torch.Tensor.__getitem__, (t, i), {})
                         for i in range(t.shape[0])])
        if kwargs.get("out") is not None:
            raise InplaceError(
                f"{what}(..., out=...) writes into an existing tensor",
                op=what, loc=user_source_loc(), hint="assign the result instead: y = op(...)")
        # -- in-place forms
        if method in _IDUNDER and args and isinstance(args[0], torch.Tensor):
            return self._inplace(func, args, kwargs, ("call_function", _IDUNDER[method]),
                                 f"Tensor.{method}")
        if method is not None and method.endswith("_") and not method.startswith("_") \
                and method not in _NOT_INPLACE:
            return self._inplace(func, args, kwargs, ("call_method", method[:-1]), what)
        if method is None and getattr(func, "__name__", "").endswith("_") \
                and not func.__name__.endswith("__") and args \
                and isinstance(args[0], torch.Tensor):
            oop = _out_of_place_function(func)
            if oop is not None:
                return self._inplace(func, args, kwargs, oop, what)
        if kwargs.get("inplace") is True and args and isinstance(args[0], torch.Tensor):
            oop_kwargs = {**kwargs, "inplace": False}
            return self._inplace(func, args, kwargs, ("call_function", func), what,
                                 oop_kwargs=oop_kwargs)
        if method in _NOT_INPLACE:  # requires_grad_() & co.: run on the fake, no node
            return func(*self.to_fake_arg(args), **self.to_fake_arg(kwargs))
        # -- Python composites traced through
        if method is None and _takes_callable(func, args, kwargs):
            with self.mode:
                return _call_body(func, args, kwargs)
        # -- an ordinary call
        versions = [(a, a._version) for a in pytree.tree_leaves((args, kwargs))
                    if isinstance(a, FakeTensor) and id(a) in self.env]
        out = self.compute(func, args, kwargs, what)
        for a, v in versions:
            if a._version != v:  # an op that writes into a traced tensor, unannounced
                raise InplaceError(
                    f"{what} modifies one of its tensor arguments in place, which fxad cannot "
                    "record", op=what, loc=user_source_loc(),
                    hint="call the out-of-place form of the op, or clone the argument first")
        if not _has_tensor(out):
            return out  # metadata (x.size(), torch.result_type(...)): specialized, no node
        if isinstance(out, torch.Tensor) and id(out) in self.env:
            return out  # x.contiguous(), x.to(x.dtype): PyTorch returns the same tensor
        kind, target, nargs = _node_form(func, method, args)
        node = self.record(kind, target, nargs, kwargs, out, what)
        self.bind_outputs(out, node)
        self.note_views(out, kind, target, nargs, kwargs)
        self.note_known(func, args, kwargs, out)
        for v in pytree.tree_leaves(out):  # values computed with known arguments' values
            if isinstance(v, torch.Tensor) and id(v) in self.known and id(v) in self.env:
                self.env[id(v)].meta["fxad_value"] = self.known[id(v)]
        return out

    def _known_answer(self, func: Any, args: tuple, kwargs: dict) -> tuple[bool, Any]:
        """(True, answer) for a question about data fxad knows (``int(batch_sizes[0])`` of a
        packed sequence built from constant lengths); the inputs it came from are then guarded
        on their values."""
        tensors = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        if not tensors or any(self._value(t) is None for t in tensors):
            return False, None
        from torch.utils._python_dispatch import _disable_current_modes
        real = pytree.tree_map(lambda v: self._value(v) if isinstance(v, torch.Tensor)
                               else v, (args, kwargs))
        with _disable_current_modes(), torch._C.DisableTorchFunction():
            answer = func(*real[0], **real[1])
        for src in self._sources(tensors):
            self.value_inputs.add(src)
        return True, answer

    def _data_dependent(self, name: str, args: tuple) -> None:
        t = next((a for a in args if isinstance(a, torch.Tensor)), None)
        desc = f"`{self.node_of(t).name}`" if t is not None and id(t) in self.env else "a tensor"
        if name == "__bool__":
            raise DataDependentError(
                f"Python control flow depends on the value of tensor {desc}",
                op="bool(Tensor)", loc=user_source_loc(), hint=_COND_HINT)
        raise DataDependentError(
            f"{name}() needs the data of {desc}, which is not available while tracing (fxad "
            "specializes on shapes only)", op=f"Tensor.{name}", loc=user_source_loc(),
            hint="keep the value as a tensor (x * t instead of x * t.item()); a Python number "
                 "that must stay a number can be passed as an argument of the traced function, "
                 "which fxad specializes on")

    def _property(self, func: Any, prop: str, args: tuple, kwargs: dict) -> Any:
        kind, name = prop.split(":")
        t = args[0]
        if kind == "__get__" and name in _VIEW_PROPERTIES and isinstance(t, torch.Tensor):
            if name == "T":
                return self.handle(torch.Tensor.permute, (t, tuple(reversed(range(t.dim())))), {})
            if name == "mT":
                return self.handle(torch.Tensor.transpose, (t, -2, -1), {})
            if name in ("H", "mH"):
                tt = self.handle(torch.Tensor.transpose, (t, -2, -1), {}) \
                    if name == "mH" or t.dim() == 2 else t
                return self.handle(torch.conj, (tt,), {}) if t.is_complex() else tt
            if name in ("real", "imag"):
                return self.handle(getattr(torch, name), (t,), {})
            if name == "data":
                return self.handle(torch.Tensor.detach, (t,), {})
        if kind == "__set__" and name not in ("requires_grad", "grad", "retains_grad"):
            raise CaptureError(f"setting Tensor.{name} inside the traced program is not "
                               "supported", op=f"Tensor.{name}", loc=user_source_loc(),
                               hint="compute a new tensor instead")
        if kind == "__set__" and name == "requires_grad" and isinstance(t, torch.Tensor) \
                and len(args) > 1 and args[1] is True and t.requires_grad:
            # ``h.requires_grad = True`` (transformers' feature encoders do this "for gradient
            # checkpointing"): h already carries a derivative here, because fxad sees floating
            # inputs as differentiable.  Eager code with an input that does not require grad
            # makes h a leaf that does; the derivatives to every parameter are the same either
            # way, so this is a no-op (eager raises only when the input itself requires grad)
            return None
        try:
            out = func(*self.to_fake_arg(args), **self.to_fake_arg(kwargs))
        except RuntimeError as e:
            raise CaptureError(f"Tensor.{name} ({kind.strip('_')}) failed while tracing: {e}",
                               op=f"Tensor.{name}", loc=user_source_loc(),
                               hint="use x.detach() for a value that must not carry a "
                                    "derivative") from e
        if isinstance(out, torch.Tensor) and id(out) not in self.env and kind == "__get__":
            if name == "grad":  # a parameter's .grad: not part of the program's value
                raise CaptureError("reading Tensor.grad inside the traced program is not "
                                   "supported", op="Tensor.grad", loc=user_source_loc(),
                                   hint="pass gradients in as inputs")
        return out

    # -- in-place operations ------------------------------------------------------------------
    def _setitem(self, func: Any, args: tuple, kwargs: dict) -> None:
        from ..ops import setitem as functional_setitem
        x, index, value = args
        self._check_mutable(x, "Tensor.__setitem__")
        if id(x) not in self.env:
            return self._side_effect(func, args, kwargs, "__setitem__")
        if self._is_current_item(value, x, index):
            # ``y[i] += v`` is ``t = y[i]; t += v; y[i] = t``: the in-place add already wrote
            # through the view ``t``, and storing ``t`` back is a no-op, as in eager
            self.compute(func, args, kwargs, "Tensor.__setitem__")
            return None
        if isinstance(index, torch.Tensor) and index.dim() == 0 and index.dtype == torch.bool:
            # x[flag] = v with a 0-d boolean tensor: every element or none, whatever the data
            # (a static shape): torch.where(flag, v, x)
            val = self.compute(torch.where, (index, value, x), {}, "Tensor.__setitem__")
            if tuple(val.shape) != tuple(x.shape):
                raise InplaceError("x[flag] = v with a value that does not broadcast to x",
                                   op="Tensor.__setitem__", loc=user_source_loc())
            new = self.record("call_function", torch.where, (index, value, x), {}, val,
                              "Tensor.__setitem__")
            if val.dtype != x.dtype:
                new = self._emit("call_method", "to", (new, x.dtype))
            self._commit(x, new, "Tensor.__setitem__")
            return None
        val = self.compute(functional_setitem, (x, index, value), {}, "Tensor.__setitem__")
        self.compute(func, args, kwargs, "Tensor.__setitem__")  # PyTorch's own checks
        new = self.record("call_function", functional_setitem, (x, index, value), {}, val,
                          "Tensor.__setitem__")
        self._commit(x, new, "Tensor.__setitem__")
        return None

    def _is_current_item(self, value: Any, x: Any, index: Any) -> bool:
        if not isinstance(value, torch.Tensor) or id(value) not in self.parent:
            return False
        par, (kind, target, args, kwargs, item) = self.parent[id(value)]
        if par is not x or target is not operator.getitem or item is not None:
            return False
        root = self.root_of(value)
        return self.seen.get(id(value), 0) == self.version.get(id(root), 0) \
            and _same_index(args[1], index)

    def _inplace(self, func: Any, args: tuple, kwargs: dict, oop: tuple[str, Any], what: str,
                 oop_kwargs: dict | None = None) -> Any:
        x = args[0]
        self._check_mutable(x, what)
        if id(x) not in self.env:
            return self._side_effect(func, args, kwargs, getattr(func, "__name__", what))
        kind, target = oop
        okw = dict(kwargs if oop_kwargs is None else oop_kwargs)
        if kind == "call_function" and target in _IDUNDER.values():
            okw = {}
        name = getattr(func, "__name__", "")
        if kind == "call_method" and (not hasattr(torch.Tensor, target)
                                      or name in _RANDOM_INPLACE):
            # (an in-place draw has an out-of-place namesake, x.bernoulli(p), that draws into
            # a contiguous tensor: a different stream for strided x)
            return self._inplace_special(func, name, args, kwargs, what)
        oop_fn = getattr(torch.Tensor, target) if kind == "call_method" else target
        val = self.compute(oop_fn, args, okw, what)  # before x changes
        # the in-place op itself, on the fake value: eager's errors and result metadata
        out = self.compute(func, args, kwargs, what)
        new = self.record(kind, target, args, okw, val, what)
        if isinstance(val, torch.Tensor) and isinstance(x, torch.Tensor) \
                and val.dtype != x.dtype:
            # in-place ops keep self's dtype (x.mul_(float) on a half x stays half)
            cast = self.graph.create_node("call_method", "to", (new, x.dtype), {})
            cast.meta.update({k: v for k, v in new.meta.items() if k != "val"})
            cast.meta["val"] = _snapshot(out if isinstance(out, torch.Tensor) else x)
            new = cast
        if isinstance(out, torch.Tensor) and tuple(out.shape) != tuple(val.shape):
            # an in-place op that changes the shape (x.t_(), x.unsqueeze_(0)): x is a new
            # tensor value, not a write into its storage
            self.parent.pop(id(x), None)
            self.track(x, new)
            return out
        self._commit(x, new, what)
        return out if out is not None else x

    def _inplace_special(self, func: Any, name: str, args: tuple, kwargs: dict,
                         what: str) -> Any:
        """In-place methods without an out-of-place method: ``zero_``, ``fill_``, ``copy_``
        and the in-place random draws (``uniform_``, ``normal_``, ``bernoulli_``...)."""
        x = args[0]
        out = self.compute(func, args, kwargs, what)  # eager's checks, on the fake value
        xn = self.node_of(x)
        if name == "zero_":
            new = self._emit("call_function", torch.zeros_like, (xn,))
        elif name == "fill_":
            v = self.arg(args[1] if len(args) > 1 else kwargs["value"], what)
            if isinstance(v, fx.Node):
                v = self._emit("call_method", "to", (v, x.dtype))
                new = self._emit("call_method", "expand", (v, tuple(x.shape)))
            else:
                new = self._emit("call_function", torch.full_like, (xn, v))
        elif name == "copy_":
            src = self.arg(args[1] if len(args) > 1 else kwargs["src"], what)
            if not isinstance(src, fx.Node):
                raise InplaceError(f"{what} needs a tensor source", op=what,
                                   loc=user_source_loc())
            if src.meta["val"].dtype != x.dtype:
                src = self._emit("call_method", "to", (src, x.dtype))
            new = src if tuple(src.meta["val"].shape) == tuple(x.shape) else \
                self._emit("call_method", "expand", (src, tuple(x.shape)))
        elif name in _RANDOM_INPLACE:
            # a fresh tensor of x's layout filled by the same kernel: the same random
            # numbers as eager PyTorch under the same seed; no derivative flows through
            fresh = self._emit("call_function", torch.empty_like, (xn,))
            new = self._emit("call_method", name, (fresh,) + self.arg(tuple(args[1:]), what),
                             self.arg(dict(kwargs), what))
            new.meta["fxad_no_grad"] = True
        else:
            raise InplaceError(f"{what} has no out-of-place form that fxad can record",
                               op=what, loc=user_source_loc(),
                               hint="compute a new tensor with an out-of-place op instead")
        new.meta["fxad_functionalized"] = False
        self._commit(x, new, what)
        return out if out is not None else x

    def _side_effect(self, func: Any, args: tuple, kwargs: dict, name: str) -> Any:
        """An in-place update of a buffer (BatchNorm's ``num_batches_tracked.add_(1)``): kept
        as the in-place call, exactly as eager PyTorch runs it; not on a derivative path."""
        x = args[0]
        out = self.compute(func, args, kwargs, f"Tensor.{name}")
        method, _ = _method_name(func)
        if method is None:
            raise InplaceError(f"{describe_target('call_function', func)} modifies a buffer "
                               "in place", op=name, loc=user_source_loc(),
                               hint="use the method form (buffer.add_(1)) or compute a new "
                                    "tensor")
        node = self.record("call_method", method, args, kwargs, out, f"Tensor.{method}")
        node.meta["fxad_side_effect"] = True
        return x

    def _check_mutable(self, x: Any, what: str) -> None:
        loc = user_source_loc()
        if not isinstance(x, torch.Tensor) or id(x) in self.env:
            return
        path = self.attr_paths.get(id(x))
        if isinstance(x, torch.nn.Parameter) and x.requires_grad:
            raise InplaceError(
                f"{what} modifies the trainable parameter `{path or 'parameter'}` in place",
                op=what, loc=loc, hint="compute a new tensor instead")
        if path is None:
            raise InplaceError(f"{what} modifies a tensor from outside the traced program "
                               "in place", op=what, loc=loc,
                               hint="clone it first (t = t.clone()) or compute a new tensor")

    # -- modules ------------------------------------------------------------------------------
    def call_module(self, mod: torch.nn.Module, call: Callable, args: tuple,
                    kwargs: dict) -> Any:
        if self.suspended:
            return call(mod, *args, **kwargs)
        path = self.module_paths.get(id(mod))
        if path is None:
            if _stateless(mod) and not isinstance(mod, self.leaf_types):
                return call(mod, *args, **kwargs)
            if not self.function_root:
                raise CaptureError(
                    f"the {type(mod).__name__} module called here is not a submodule of the "
                    "traced module (it was created inside the traced code or belongs to "
                    "another object), so its parameters cannot be addressed",
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


_COND_HINT = (
    "fxad traces one path for the example inputs' shapes; for a choice between values use "
    "torch.where(pred, a, b), and for a choice between code paths use torch.cond, e.g.\n"
    "        def positive(x): return x.sin()\n"
    "        y = torch.cond(x.sum() > 0, positive, lambda x: x.cos(), (x,))")


def _op_error(what: str, e: Exception) -> CaptureError:
    from torch._subclasses.fake_tensor import (DataDependentOutputException,
                                               DynamicOutputShapeException)
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


def _out_of_place_function(func: Any) -> tuple[str, Any] | None:
    """``torch.relu_`` → the method ``relu``; ``F.elu_`` → ``F.elu``."""
    name = func.__name__[:-1]
    if getattr(torch, func.__name__, None) is func or getattr(F, func.__name__, None) is func \
            or getattr(torch._C._nn, func.__name__, None) is func:
        if hasattr(torch.Tensor, name) or hasattr(torch.Tensor, func.__name__):
            return ("call_method", name)  # torch.zero_(x) is x.zero_()
        for ns in (torch, F):
            f = getattr(ns, name, None)
            if callable(f):
                return ("call_function", f)
    return None


def _node_form(func: Any, method: str | None, args: tuple) -> tuple[str, Any, tuple]:
    """torch.fx's node form of a call: methods as ``call_method``, Python operators as
    ``operator`` functions, everything else as ``call_function``."""
    if method is None:
        return "call_function", func, args
    if method in _DUNDER:
        fn, rev = _DUNDER[method]
        return "call_function", fn, (args[1], args[0]) if rev else args
    if method in _UNARY_DUNDER:
        return "call_function", _UNARY_DUNDER[method], args
    if method == "__getitem__":
        return "call_function", operator.getitem, args
    return "call_method", method, args


# ---------------------------------------------------------------------------------------------
# Patches active during capture
# ---------------------------------------------------------------------------------------------

@contextlib.contextmanager
def _capture_environment(cap: _Capture) -> Iterator[None]:
    """``torch.compiler.is_compiling()`` true; module calls, custom ``autograd.Function`` classes,
    checkpoint regions and the Python-level convolution gradients routed through the active
    capture.  Nested captures (a custom Function's backward) only switch the active one."""
    prev = getattr(_STATE, "capture", None)
    if prev is not None:
        _STATE.capture = cap
        try:
            yield
        finally:
            _STATE.capture = prev
        return
    with _patches(getattr(cap, "user_globals", ())):
        _STATE.capture = cap
        try:
            yield
        finally:
            _STATE.capture = None


@contextlib.contextmanager
def _patches(user_globals: Iterable[dict] = ()) -> Iterator[None]:
    import torch.nn.grad as nn_grad
    import torch.utils.checkpoint as ckpt

    from .custom import apply_custom_function, checkpoint_region, patched_checkpoint_generator

    orig_call = torch.nn.Module.__call__

    def module_call(mod: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        active = getattr(_STATE, "capture", None)
        if active is None:
            return orig_call(mod, *args, **kwargs)
        return active.call_module(mod, orig_call, args, kwargs)

    def leaf(orig: Callable) -> Callable:
        """``orig`` recorded as one node when called with tensors."""
        def call(*args: Any, **kwargs: Any) -> Any:
            active = getattr(_STATE, "capture", None)
            if active is None or active.suspended or not _has_tensor((args, kwargs)):
                return orig(*args, **kwargs)
            what = describe_target("call_function", orig)
            out = active.compute(orig, args, kwargs, what)
            node = active.record("call_function", orig, args, kwargs, out, what)
            active.bind_outputs(out, node)
            return out
        call.__name__ = orig.__name__
        call.__wrapped__ = orig  # type: ignore[attr-defined]
        return call

    function_cls = torch.autograd.function.Function
    orig_apply = function_cls.__dict__["apply"]

    def apply(cls: type, *args: Any, **kwargs: Any) -> Any:
        active = getattr(_STATE, "capture", None)
        if active is None or active.suspended:
            return orig_apply.__get__(None, cls)(*args, **kwargs)
        if cls is getattr(ckpt, "CheckpointFunction", None):  # reentrant checkpoint
            function, _preserve, *rest = args
            with checkpoint_region(active):
                return function(*rest)
        return apply_custom_function(active, cls, args, kwargs)

    from .control import control_flow_patches
    patched: list[tuple[Any, str, Any, Any]] = control_flow_patches()  # (ns, name, old, new)
    # a capture started while a derivative engine writes code (a rule differentiating a
    # control-flow branch) must see the real factories, not the engine's recording ones
    for name in FACTORIES:
        cur = getattr(torch, name)
        real = getattr(cur, "__wrapped__", cur)
        if real is not cur:
            patched.append((torch, name, cur, real))
    grads = {}
    for name in CONV_GRADS:
        cur = getattr(nn_grad, name, None)
        if cur is not None:
            grads[name] = getattr(cur, "__wrapped__", cur)
            if grads[name] is not cur:
                patched.append((nn_grad, name, cur, grads[name]))
    patched.append((torch.nn.Module, "__call__", orig_call, module_call))
    patched.append((function_cls, "apply", orig_apply, classmethod(apply)))
    gen = getattr(ckpt, "_checkpoint_without_reentrant_generator", None)
    if gen is not None:
        patched.append((ckpt, "_checkpoint_without_reentrant_generator", gen,
                        patched_checkpoint_generator(gen)))
    for name, orig in grads.items():
        patched.append((nn_grad, name, orig, leaf(orig)))
    # user functions kept as one node: torch.fx.wrap'd ones and those with a registered rule
    globs = [(glob, name, fn) for glob, name, fn in _leaf_functions()]

    # the control-flow functions imported by name into the user's modules
    # (``from torch._higher_order_ops.scan import scan``)
    replaced = {id(orig): new for ns, name, orig, new in patched
                if ns.__class__.__name__ == "module"
                and name in ("cond", "while_loop", "scan", "map", "associative_scan")}
    patched.extend(namespace_patches(user_globals, replaced))

    compiler = torch.compiler
    old_flag = getattr(compiler, "_is_compiling_flag", None)
    old_fn = compiler.is_compiling
    try:
        for ns, name, _, new in patched:
            setattr(ns, name, new)
        for glob, name, fn in globs:
            glob[name] = leaf(fn)
        if old_flag is not None:
            compiler._is_compiling_flag = True
        compiler.is_compiling = lambda: True  # type: ignore[assignment]
        yield
    finally:
        for ns, name, orig, _ in reversed(patched):
            setattr(ns, name, orig)
        for glob, name, fn in reversed(globs):
            glob[name] = fn
        if old_flag is not None:
            compiler._is_compiling_flag = old_flag
        compiler.is_compiling = old_fn  # type: ignore[assignment]


def namespace_patches(spaces: Iterable[Any], replaced: dict[int, Any]
                      ) -> list[tuple[Any, str, Any, Any]]:
    """Patch-list entries for the names in module globals (dicts) and closure cells bound to
    an object in ``replaced`` (``id(original) -> replacement``)."""
    out: list[tuple[Any, str, Any, Any]] = []
    for space in {id(g): g for g in spaces}.values():
        if isinstance(space, dict):
            for name, val in list(space.items()):
                if id(val) in replaced and callable(val):
                    out.append((_DictSlot(space), name, val, replaced[id(val)]))
        else:  # a closure cell
            try:
                val = space.cell_contents
            except ValueError:
                continue
            if id(val) in replaced:
                out.append((_CellSlot(space), "cell_contents", val, replaced[id(val)]))
    return out


class _CellSlot:
    """``setattr(slot, "cell_contents", v)`` on a closure cell (for the patch list)."""

    def __init__(self, cell: Any) -> None:
        object.__setattr__(self, "_c", cell)

    def __setattr__(self, name: str, value: Any) -> None:
        self._c.cell_contents = value


class _DictSlot:
    """``setattr``/``getattr`` on a module's globals dict (for the patch list)."""

    def __init__(self, d: dict) -> None:
        object.__setattr__(self, "_d", d)

    def __setattr__(self, name: str, value: Any) -> None:
        self._d[name] = value

    def __getattr__(self, name: str) -> Any:
        return self._d[name]


def _leaf_functions() -> list[tuple[dict, str, Any]]:
    """(module globals, name, function) of the Python functions to record as single nodes:
    those passed to ``torch.fx.wrap`` and user functions with a registered derivative rule
    (:func:`fxad.register_vjp`), patched in the module that defines them."""
    out: list[tuple[dict, str, Any]] = []
    seen: set[tuple[int, str]] = set()
    try:
        from torch.fx._symbolic_trace import _wrapped_fns_to_patch
        for (_, name), glob in list(_wrapped_fns_to_patch.items()):
            fn = glob.get(name)
            if inspect.isfunction(fn) and (id(glob), name) not in seen:
                seen.add((id(glob), name))
                out.append((glob, name, fn))
    except ImportError:  # pragma: no cover - other torch versions
        pass
    from ..rules.registry import all_rules
    for key, rule in all_rules().items():
        if not inspect.isfunction(key) or rule.builtin \
                or (getattr(key, "__module__", "") or "").startswith("torch"):
            continue
        glob, name = key.__globals__, key.__name__
        if glob.get(name) is key and (id(glob), name) not in seen:
            seen.add((id(glob), name))
            out.append((glob, name, key))
    return out


# ---------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------

def _input_names(params: list[inspect.Parameter], n: int) -> list[str]:
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
    if len(names) < n:
        raise InputError(f"{n} example inputs given but the function takes {len(names)} "
                         "positional arguments")
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


def _inputs(cap: _Capture, names: list[str], examples: Sequence[Any]) -> list[Any]:
    values: list[Any] = []
    for name, example in zip(names, examples):
        ph = cap.graph.placeholder(name)
        ph.meta["val"] = to_fake(example)
        ph.meta["fxad_input"] = True
        if isinstance(example, torch.Tensor):
            v = _program_value(example)
            cap.track(v, ph)
            cap.input_roots[id(v)] = ph
            if not (example.is_floating_point() or example.is_complex()) \
                    and example.device.type == "cpu" and example.numel() <= _KNOWN_NUMEL \
                    and not isinstance(example, FakeTensor):
                # a small integer input: its value is known, and guarded if the program
                # reads it (lengths of a packed sequence)
                cap.known[id(v)] = example.detach().clone()
                cap.known_src[id(v)] = frozenset({len(values)})
                ph.meta["fxad_value"] = cap.known[id(v)]
            values.append(v)
        elif isinstance(example, (tuple, list, dict)) and _has_tensor(example):
            values.append(_unpack(cap, ph, example))
        else:
            values.append(example)
    return values


def _unpack(cap: _Capture, node: fx.Node, example: Any) -> Any:
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


# ---------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------

def capture(f: Callable | torch.nn.Module, example_inputs: Sequence[Any], *,
            leaf_modules: Iterable[type] = ()) -> fx.GraphModule:
    """Trace ``f`` on ``example_inputs`` into a torch-level GraphModule (not yet normalized).

    Args:
        f: a function of tensors (pytrees allowed) or an ``nn.Module``.
        example_inputs: positional example inputs; tensors give shapes/dtypes only.
        leaf_modules: module classes kept as ``call_module`` nodes.

    Returns:
        GraphModule whose placeholders are named after ``f``'s parameters and whose nodes carry
        ``meta['val']`` (fake values) and ``meta['fxad_loc']`` (user source line).

    Raises:
        CaptureError: an op fails on the example shapes, data-dependent control flow, etc.
    """
    if isinstance(f, fx.GraphModule) and all("val" in n.meta for n in f.graph.nodes
                                            if n.op not in ("placeholder", "output")):
        return _recapture_graphmodule(f, example_inputs)
    if callable(f) and not inspect.isfunction(f) and not isinstance(f, torch.nn.Module):
        f = _as_function(f, len(example_inputs))
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
    cap = _Capture(root, not isinstance(f, torch.nn.Module), tuple(leaf_modules))
    cap.user_globals = _user_globals(f)
    names = _input_names(params, len(example_inputs))
    values = _inputs(cap, names, example_inputs)
    state = _module_state(root)
    try:
        with _capture_environment(cap), fake_mode(), torch.enable_grad(), cap.mode:
            result = f(*values)
        out_args = cap.arg(result, "return")
    finally:
        rebound = _restore_module_state(state)
    _warn_rebound(cap, rebound)
    for obj, ph in cap.mutated_inputs.values():
        # the program mutated its input: write the final value back, as PyTorch would
        # (after everything else; the derivative engines keep it last)
        node = cap.graph.create_node("call_method", "copy_", (ph, cap.node_of(obj)), {})
        node.meta["val"] = ph.meta["val"]
        node.meta["fxad_side_effect"] = True
        node.meta["fxad_input_mutation"] = ph.name
    cap.graph.output(out_args)
    for n in list(cap.graph.nodes):  # items of multi-output ops the program never used
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
    return gm


def _module_state(root: torch.nn.Module) -> dict:
    """Every tensor the modules of ``root`` hold (parameters, buffers, plain tensor
    attributes), by module path: what :func:`_restore_module_state` puts back."""
    state: dict = {}
    for path, mod in root.named_modules(remove_duplicate=False):
        entries = {}
        for kind, d in (("_parameters", mod._parameters), ("_buffers", mod._buffers),
                        ("__dict__", mod.__dict__)):
            for name, v in d.items():
                if kind != "__dict__" or isinstance(v, torch.Tensor):
                    entries[(kind, name)] = v
        state[path] = (mod, entries)
    return state


def _restore_module_state(state: dict) -> list[tuple[str, Any, Any]]:
    """Undo what the traced program assigned to the attributes of the modules it was given
    (``self.cache = self.cache.to(x.dtype)``): the user's module must never keep a traced
    (fake) value.  Modules attached during capture (a function's closure modules) are not
    touched.  Returns ``(path, old, new)`` for each tensor attribute the program rebound
    (``old`` None: added by the program)."""
    rebound: list[tuple[str, Any, Any]] = []
    for path, (mod, entries) in state.items():
        seen: set = set()
        for kind in ("_parameters", "_buffers", "__dict__"):
            d = getattr(mod, kind)
            for name, v in list(d.items()):
                where = f"{path}.{name}".lstrip(".")
                if (kind, name) not in entries:
                    if not isinstance(v, FakeTensor):  # only traced values are undone
                        continue
                    del d[name]  # a traced tensor the program stored on the module
                    if name not in seen:
                        rebound.append((where, None, v))
                elif v is not entries[(kind, name)]:
                    d[name] = entries[(kind, name)]
                    if name not in seen:
                        rebound.append((where, entries[(kind, name)], v))
                seen.add(name)
        for (kind, name), old in entries.items():  # deleted (or moved) by the program
            d = getattr(mod, kind)
            if name not in d:
                d[name] = old
    return rebound


def _warn_rebound(cap: _Capture, rebound: list[tuple[str, Any, Any]]) -> None:
    """Say where the generated code differs from eager: eager PyTorch keeps a tensor the
    program assigned to a module attribute, fxad's code does not store it (it recomputes the
    value from the module's own attribute on every call).  Silent only where the new value
    is the old one converted to the dtype/device/layout it already had (transformers' CTRL:
    ``self.pos_encoding = self.pos_encoding.to(device=..., dtype=...)``), which leaves the
    attribute's value as it was."""
    import warnings

    changed = [path for path, old, new in rebound if not _same_value(cap, old, new)]
    if changed:
        warnings.warn(
            "the traced program assigns to module attributes (" + ", ".join(
                f"`{p}`" for p in changed) + "): eager PyTorch keeps the new value on the "
            "module, fxad's generated code does not (each call computes the value from the "
            "module's attribute as it was when traced, and the module is left unchanged); "
            "update such state outside the differentiated function", UserWarning,
            stacklevel=3)


_VALUE_PRESERVING = {"to", "type", "contiguous", "float", "double", "half", "bfloat16", "detach",
                     "clone", "cpu", "cuda", torch.Tensor.to, torch.clone, torch.detach}


def _same_value(cap: _Capture, old: Any, new: Any) -> bool:
    """Whether ``new`` is ``old`` passed through conversions that leave it as it was (same
    dtype, device, shape and strides at every step)."""
    if not isinstance(old, torch.Tensor) or not isinstance(new, torch.Tensor):
        return old is new
    if new is old:
        return True
    node = cap.env.get(id(new))
    while isinstance(node, fx.Node) and node.op in ("call_method", "call_function") \
            and node.target in _VALUE_PRESERVING and node.args \
            and isinstance(node.args[0], fx.Node):
        src, val = node.args[0], node.meta.get("val")
        sv = src.meta.get("val")
        if not (isinstance(val, torch.Tensor) and isinstance(sv, torch.Tensor)) or \
                (val.dtype, val.device, tuple(val.shape), val.stride()) != \
                (sv.dtype, sv.device, tuple(sv.shape), sv.stride()):
            return False
        node = src
    return isinstance(node, fx.Node) and node.op == "get_attr" \
        and node.target == cap.attr_paths.get(id(old))


def _user_globals(f: Any) -> list[dict]:
    """The module globals of the traced code: the function's, or every submodule's
    ``forward``'s (where names imported from torch may need patching during capture)."""
    out: list[Any] = []
    fns = [f] if not isinstance(f, torch.nn.Module) else \
        [type(m).forward for m in f.modules()]
    for fn in fns:
        fn = inspect.unwrap(fn)
        glob = getattr(fn, "__globals__", None)
        if isinstance(glob, dict) and not str(glob.get("__name__", "")).startswith("torch"):
            out.append(glob)
            out.extend(getattr(fn, "__closure__", None) or ())
    return out


def _as_function(method: Any, n: int) -> Callable:
    """A bound method (``model.logits``), a builtin (``torch.sin``) or another callable as a
    function of its arguments; a module it is bound to is reached through the closure, its
    parameters constants of the function."""
    def bound(*args: Any) -> Any:
        return method(*args)

    try:
        sig = inspect.signature(method)
        if any(p.kind is p.VAR_POSITIONAL for p in sig.parameters.values()) \
                or len(sig.parameters) < n:
            raise ValueError
    except (TypeError, ValueError):  # builtins often have no usable signature
        sig = inspect.Signature([inspect.Parameter(
            "x" if n == 1 else f"x{i}", inspect.Parameter.POSITIONAL_ONLY) for i in range(n)])
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
        elif n.op != "output":
            new.meta["val"] = compute_meta(gm, n.op, n.target, new.args, new.kwargs)
        env[n] = new
    out = fx.GraphModule(gm, new_graph, class_name=type(gm).__name__)
    out.meta.update(gm.meta)
    return out


__all__ = ["capture", "capturing"]
