"""Shape-carrying proxies and the graph emitter shared by capture and the AD transforms.

Every node fxad creates gets ``node.meta["val"]``: a :class:`FakeTensor` (no storage, real
shape/dtype/device), a tuple/list of them, or a plain Python value.  Shape queries on a
:class:`TensorProxy` (``x.shape``, ``x.size(0)``, ``x.dim()``, ``len(x)``, ``x.dtype``) answer
from that fake value, so code that branches on shapes traces and specializes on the example
shapes.  Anything that needs tensor *data* (``bool(x)``, ``x.item()``, ``x.tolist()``) raises
:class:`~fxad.errors.DataDependentError` naming the user's source line.

Node meta keys written here:

``val``
    fake value of the node's result (see above).
``fxad_loc``
    :class:`~fxad.errors.SourceLoc` of the user's line that created the node (capture only).
``stack_trace``
    the same location in the format torch.fx uses, so FX tooling shows it too.
``fxad_bwd_of``
    set by the reverse transform on backward nodes: name of the forward node they differentiate.
"""
from __future__ import annotations

import contextlib
import operator
import os
import sys
import threading
from typing import Any, Iterator

import torch
import torch._refs
import torch._refs.nn.functional
import torch._refs.special
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils import _pytree as pytree

from ..errors import CaptureError, DataDependentError, SourceLoc
from .fastmeta import fast_meta
from .shapes import OUTPUT_META
from .sizes import check_squeeze
from ..naming import describe_target  # noqa: F401  (re-exported: capture's own name for it)

_FAKE_MODE: FakeTensorMode | None = None
_LOCK = threading.Lock()


def fake_mode() -> FakeTensorMode:
    """The process-wide fake mode all fxad metadata lives in (static shapes, no ShapeEnv)."""
    global _FAKE_MODE
    with _LOCK:
        if _FAKE_MODE is None:
            _FAKE_MODE = FakeTensorMode(allow_non_fake_inputs=True)
        return _FAKE_MODE


def to_fake(value: Any) -> Any:
    """Map every real tensor in a pytree to a fake tensor with the same metadata."""
    mode = fake_mode()

    def conv(v: Any) -> Any:
        if isinstance(v, FakeTensor):
            return v
        if isinstance(v, torch.Tensor):
            return mode.from_tensor(v, static_shapes=True)
        return v

    with torch._C.DisableTorchFunction():
        return pytree.tree_map(conv, value)


def is_tensor_val(v: Any) -> bool:
    return isinstance(v, torch.Tensor)


def is_float_val(v: Any) -> bool:
    """True for floating-point (or complex) tensors: the values fxad differentiates."""
    return isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex())


def is_dtype_cast(n: fx.Node) -> bool:
    """``x.to(dtype)`` with nothing else (no device, no memory format)."""
    return (n.op == "call_method" and n.target == "to" and len(n.args) == 2
            and isinstance(n.args[1], torch.dtype) and not n.kwargs)


def widens(n: fx.Node) -> bool:
    """``n``'s value and that of its first argument are floating tensors, ``n``'s of more
    bytes per element (a cast to a wider floating dtype, read from ``meta['val']``)."""
    src = n.args[0] if n.args else None
    v, a = n.meta.get("val"), src.meta.get("val") if isinstance(src, fx.Node) else None
    return (isinstance(v, torch.Tensor) and isinstance(a, torch.Tensor)
            and v.is_floating_point() and a.is_floating_point()
            and v.element_size() > a.element_size())


_FXAD_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
_STDLIB_DIR = os.path.dirname(contextlib.__file__)
# fxad's own machinery (not its demo models), torch, and the standard library proper
_SKIP_DIRS = tuple(os.path.join(d, "") for d in (
    os.path.join(_FXAD_DIR, "capture"), os.path.join(_FXAD_DIR, "ad"),
    os.path.join(_FXAD_DIR, "graph"),
    os.path.join(_FXAD_DIR, "rules"), os.path.join(_FXAD_DIR, "simplify"),
    os.path.join(_FXAD_DIR, "codegen"), os.path.join(_FXAD_DIR, "check"),
    os.path.join(_FXAD_DIR, "training"), _TORCH_DIR))
_SKIP_FILES = tuple(os.path.join(_FXAD_DIR, f) for f in (
    "api.py", "higher.py", "pipeline.py", "symbolic.py", "guards.py", "ops.py", "__init__.py",
    "coverage.py"))
_SITE_MARKERS = (os.sep + "site-packages" + os.sep, os.sep + "dist-packages" + os.sep)


def _skipped(fname: str) -> bool:
    if fname.startswith(_SKIP_DIRS) or fname in _SKIP_FILES or fname.startswith("<frozen"):
        return True
    # the standard library, but not third-party code installed under it
    return fname.startswith(os.path.join(_STDLIB_DIR, "")) \
        and not any(m in fname for m in _SITE_MARKERS)


def user_source_loc() -> SourceLoc | None:
    """Innermost stack frame outside fxad, torch and the standard library."""
    import linecache

    frame = sys._getframe(1)
    while frame is not None:
        fname = os.path.abspath(frame.f_code.co_filename)
        if not _skipped(fname):
            code = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
            return SourceLoc(frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name, code)
        frame = frame.f_back
    return None


# ---------------------------------------------------------------------------------------------
# Proxy
# ---------------------------------------------------------------------------------------------

# Attributes that read metadata and return concrete Python values.
_META_ATTRS = {
    "shape", "dtype", "device", "ndim", "is_cuda", "is_cpu", "is_meta", "layout",
    "requires_grad", "is_leaf", "is_sparse", "is_quantized", "is_nested", "names",
}
# Methods that read metadata and return concrete Python values.
_META_METHODS = {
    "size", "dim", "ndimension", "numel", "nelement", "stride", "is_contiguous",
    "is_floating_point", "is_complex", "is_signed", "element_size", "get_device",
    "storage_offset", "has_names", "is_inference",
}
_DATA_METHODS = {"item", "tolist", "numpy", "data_ptr", "__index__", "__int__", "__float__"}


class TensorProxy(fx.Proxy):
    """An FX proxy that knows its value's fake tensor (``node.meta['val']``)."""

    @property
    def meta(self) -> Any:
        return self.node.meta.get("val")

    def __repr__(self) -> str:
        v = self.meta
        if isinstance(v, torch.Tensor):
            return f"TensorProxy({self.node.name}: {str(v.dtype).removeprefix('torch.')}{list(v.shape)})"
        return f"TensorProxy({self.node.name})"

    def __getattr__(self, k: str) -> Any:
        if k.startswith("__") and k.endswith("__"):
            raise AttributeError(k)
        v = self.node.meta.get("val")
        if isinstance(v, torch.Tensor):
            if k in _META_ATTRS:
                return getattr(v, k)
            if k in _META_METHODS:
                return getattr(v, k)
            if k in _DATA_METHODS:
                raise DataDependentError(
                    f"`{self.node.name}.{k}()` needs the tensor's data, which is not available "
                    "while tracing (fxad specializes on shapes only)",
                    op=f"Tensor.{k}", loc=user_source_loc(),
                    hint="keep the value as a tensor in the derivative code (a rule that "
                         "needs a tensor's value must compute with it, e.g. torch.where); "
                         "a Python number can be passed as an argument, which fxad "
                         "specializes on",
                )
        return fx.proxy.Attribute(self, k)

    def __rdiv__(self, other: Any) -> Any:
        # legacy ``Tensor.__rdiv__``; torch.fx maps it to a nonexistent ``operator.div``
        return self.tracer.create_proxy("call_function", operator.truediv, (other, self), {})

    def __len__(self) -> int:
        v = self.meta
        if isinstance(v, torch.Tensor):
            if v.dim() == 0:
                raise TypeError("len() of a 0-d tensor")
            return v.shape[0]
        if isinstance(v, (tuple, list)):
            return len(v)
        raise CaptureError(f"len() of {self.node.name} with unknown length",
                           loc=user_source_loc())

    def __iter__(self) -> Iterator[Any]:
        v = self.meta
        if isinstance(v, torch.Tensor):
            if v.dim() == 0:
                raise TypeError("iteration over a 0-d tensor")
            return iter([self[i] for i in range(v.shape[0])])
        if isinstance(v, (tuple, list)):
            return iter([self[i] for i in range(len(v))])
        raise CaptureError(f"cannot iterate over {self.node.name}", loc=user_source_loc())

    def __bool__(self) -> bool:
        raise DataDependentError(
            f"Python control flow depends on the value of tensor `{self.node.name}`",
            op="bool(Tensor)", loc=user_source_loc(),
            hint="derivative code is written once for all data: choose values with "
                 "torch.where(pred, a, b), or code paths with torch.cond",
        )

    def __index__(self) -> int:
        raise DataDependentError(
            f"tensor `{self.node.name}` used as a Python integer", op="Tensor.__index__",
            loc=user_source_loc(),
            hint="use a Python int computed from shapes (x.shape[0]), or pass the integer as "
                 "an argument of the traced function, which fxad specializes on")

    def __setitem__(self, index: Any, value: Any) -> None:
        setitem = getattr(self.tracer, "setitem", None)
        if setitem is None:
            raise CaptureError("item assignment is not supported here", loc=user_source_loc())
        setitem(self, index, value)

    def keys(self) -> Any:
        v = self.meta
        if isinstance(v, dict):
            return v.keys()
        return fx.proxy.Attribute(self, "keys")()

    # `x.T`, `x.mT` are graph ops; fx.Proxy would create getattr nodes for them.
    @property
    def T(self) -> Any:  # noqa: N802
        return self.tracer.create_proxy("call_method", "permute", (self, tuple(reversed(range(self.meta.dim())))), {})

    @property
    def mT(self) -> Any:  # noqa: N802
        return self.tracer.create_proxy("call_method", "transpose", (self, -2, -1), {})

    @property
    def H(self) -> Any:  # noqa: N802 - conjugate transpose of a 2-D tensor
        t = self.tracer.create_proxy("call_function", torch.t, (self,), {})
        return t if not self.meta.is_complex() else \
            self.tracer.create_proxy("call_function", torch.conj, (t,), {})

    @property
    def mH(self) -> Any:  # noqa: N802
        t = self.mT
        return t if not self.meta.is_complex() else \
            self.tracer.create_proxy("call_function", torch.conj, (t,), {})

    @property
    def data(self) -> Any:
        return self.tracer.create_proxy("call_method", "detach", (self,), {})


def reference_of(func: Any) -> Any:
    """PyTorch's Python reference implementation (``torch._refs``) of a torch function or
    tensor method, or None: it computes output metadata on symbolic sizes where a C++ kernel
    cannot ("SymIntArrayRef expected to contain only concrete integers")."""
    name = getattr(func, "__name__", "")
    for table in (torch._refs, torch._refs.nn.functional, torch._refs.special):
        ref = getattr(table, name, None)
        if callable(ref):
            return ref
    return None


def _symbolic_gap(e: Exception) -> bool:
    return "expected to contain only concrete integers" in str(e)


def _val_of(a: Any) -> Any:
    if isinstance(a, fx.Node):
        return a.meta.get("val")
    if isinstance(a, torch.Tensor) and not isinstance(a, FakeTensor):
        return to_fake(a)
    return a


def compute_meta(graph_owner: torch.nn.Module | None, kind: str, target: Any,
                 args: tuple, kwargs: dict) -> Any:
    """Run ``target`` on fake values of ``args``/``kwargs`` (Nodes replaced by their ``val``).

    Raises whatever the op raises (a shape error, an unsupported dynamic-shape op).
    """
    _STATE.in_meta = getattr(_STATE, "in_meta", 0) + 1
    try:
        # never through a torch-function mode (capture's own) or a subclass override
        with torch._C.DisableTorchFunction():
            return _compute_meta(graph_owner, kind, target, args, kwargs)
    finally:
        _STATE.in_meta -= 1



def substitute(gm: fx.GraphModule, old: fx.Node, target: Any, args: tuple, kwargs: dict,
               dead: list[fx.Node]) -> bool:
    """Replace ``old`` by a new call ``target(*args, **kwargs)`` inserted before it (its
    metadata from ``old``, its value from the fake computation), then erase the nodes of
    ``dead`` that nothing reads any more, in order (outputs first).  Returns False, leaving
    the graph as it was, where the fake computation fails."""
    try:
        v = compute_meta(gm, "call_function", target, args, kwargs)
    except Exception:  # noqa: BLE001 - leave the code as written
        return False
    g = old.graph
    with g.inserting_before(old):
        new = g.create_node("call_function", target, args, kwargs)
    new.meta = dict(old.meta)
    new.meta["val"] = v
    old.replace_all_uses_with(new)
    for n in dead:
        if not n.users and not getattr(n, "_erased", False):
            g.erase_node(n)
    return True


def in_meta_computation() -> bool:
    """True while fxad runs an op on fake values (patched factories must not record then)."""
    return getattr(_STATE, "in_meta", 0) > 0


_STATE = threading.local()


def _compute_meta(graph_owner: torch.nn.Module | None, kind: str, target: Any,
                  args: tuple, kwargs: dict) -> Any:
    fargs = fx.node.map_aggregate(args, _val_of)
    fkwargs = fx.node.map_aggregate(kwargs, _val_of)
    mode = fake_mode()
    if kind == "call_function":
        try:
            with mode:
                if target in OUTPUT_META:  # the op's fake execution would need data
                    return OUTPUT_META[target](*fargs, **fkwargs)
                out = fast_meta(target, fargs, fkwargs)  # symbolic sizes: see fastmeta
                if out is not NotImplemented:
                    return out
                try:
                    return target(*fargs, **fkwargs)
                except RuntimeError as e:
                    ref = reference_of(target) if _symbolic_gap(e) else None
                    if ref is None:
                        raise
                    return ref(*fargs, **fkwargs)
        except Exception as e:
            known = _with_known_values(target, args, kwargs, e, graph_owner)
            if known is None:
                raise
            return known
    if kind == "call_method" or kind == "call_function":
        check_squeeze(getattr(target, "__name__", target) if kind == "call_function"
                      else target, fargs, fkwargs)
    if kind == "call_method":
        self_v, *rest = fargs
        if isinstance(target, str) and target.endswith("_") and not target.endswith("__") \
                and isinstance(self_v, torch.Tensor):
            with mode:  # in-place: do not mutate the metadata of the input node
                self_v = self_v.clone()
        with mode:
            out = fast_meta(("method", target), fargs, fkwargs)
            if out is not NotImplemented:
                return out
            try:
                return getattr(self_v, target)(*rest, **fkwargs)
            except RuntimeError as e:
                ref = reference_of(getattr(torch.Tensor, target, None)) \
                    if _symbolic_gap(e) else None
                if ref is None:
                    raise
                return ref(self_v, *rest, **fkwargs)
    if kind == "call_module":
        assert graph_owner is not None
        mod = graph_owner.get_submodule(target)
        with mode:
            return mod(*fargs, **fkwargs)
    if kind == "get_attr":
        assert graph_owner is not None
        return to_fake(fetch_attr(graph_owner, target))
    raise AssertionError(kind)


def _known_value(a: fx.Node, owner: torch.nn.Module | None) -> Any:
    """The value capture recorded for ``a``, or a small integer tensor constant it reads."""
    known = a.meta.get("fxad_value")
    if isinstance(known, torch.Tensor):
        return known
    if a.op == "get_attr" and owner is not None:
        try:
            obj = fetch_attr(owner, a.target)
        except (AttributeError, KeyError):
            return None
        if isinstance(obj, torch.Tensor) and not isinstance(obj, (FakeTensor, torch.nn.Parameter)) \
                and not (obj.is_floating_point() or obj.is_complex()) and obj.numel() <= 1 << 14:
            return obj
    return None


def _with_known_values(target: Any, args: tuple, kwargs: dict, error: Exception,
                       owner: torch.nn.Module | None = None) -> Any:
    """An op whose output shape needs the values of integer arguments capture recorded
    (``meta['fxad_value']``, e.g. a packed sequence's batch sizes): run it on those values and
    meta tensors for the rest, and return fake results; None when that does not apply."""
    msg = str(error)
    if not ("DataDependent" in type(error).__name__ or "DynamicOutputShape" in
            type(error).__name__ or "data is not allocated" in msg):
        return None
    values = [a for a in pytree.tree_leaves((args, kwargs))
              if isinstance(a, fx.Node) and _known_value(a, owner) is not None]
    if not values:
        return None
    from torch.utils._python_dispatch import _disable_current_modes
    device = None

    def conv(a: Any) -> Any:
        nonlocal device
        if not isinstance(a, fx.Node):
            return a
        known = _known_value(a, owner)
        v = a.meta.get("val")
        if isinstance(known, torch.Tensor) and not (known.is_floating_point()
                                                     or known.is_complex()):
            return known
        if isinstance(v, torch.Tensor):
            device = device or v.device
            return torch.empty_strided(tuple(v.shape), tuple(v.stride()), dtype=v.dtype,
                                       device="meta")
        return v

    with _disable_current_modes(), torch._C.DisableTorchFunction():
        out = target(*fx.node.map_aggregate(args, conv), **fx.node.map_aggregate(kwargs, conv))
    mode = fake_mode()

    def back(v: Any) -> Any:
        if not isinstance(v, torch.Tensor):
            return v
        if v.device.type == "meta":
            with mode:
                return torch.empty_strided(tuple(v.shape), tuple(v.stride()), dtype=v.dtype,
                                           device=device or "cpu")
        return to_fake(v)

    return pytree.tree_map(back, out)


def fetch_attr(root: torch.nn.Module, target: str) -> Any:
    """``root.<target>`` without going through ``nn.Module.__getattr__`` (patched while tracing)."""
    obj: Any = root
    for atom in target.split("."):
        d = obj.__dict__
        for table in ("_parameters", "_buffers", "_modules"):
            if atom in d.get(table, {}):
                obj = d[table][atom]
                break
        else:
            obj = d[atom] if atom in d else object.__getattribute__(obj, atom)
    return obj


class Emitter(fx.proxy.TracerBase):
    """Appends nodes to a graph through :class:`TensorProxy` objects, computing fake values.

    Used by the AD transforms and by simplifier passes to write torch-level code: calling
    ``torch.cos(p)`` on a proxy ``p`` appends ``cos = torch.cos(p)`` with its metadata.

    Args:
        graph: the graph to append to (at its current insertion point).
        root: module that owns the graph's ``get_attr``/``call_module`` targets.
    """

    def __init__(self, graph: fx.Graph, root: torch.nn.Module | None = None) -> None:
        super().__init__()
        self.graph = graph
        self.root = root
        self.record_stack_traces = False
        self.node_meta_defaults: dict[str, Any] = {}
        # `fx.Tracer` attributes consulted by TracerBase.
        self.scope = fx.proxy.Scope("", None)
        self.module_stack: dict = {}
        self.node_name_to_scope: dict = {}
        self.check_mutable_operations = False
        self.trace_asserts = False
        self._known: tuple | None = None

    def proxy(self, node: fx.Node) -> TensorProxy:
        return TensorProxy(node, self)

    def create_node(self, kind, target, args, kwargs, name=None, type_expr=None):  # type: ignore[override]
        node = self.graph.create_node(kind, target, args, kwargs, name, type_expr)
        node.meta.update(self.node_meta_defaults)
        return node

    def create_proxy(self, kind, target, args, kwargs, name=None, type_expr=None,  # type: ignore[override]
                     proxy_factory_fn=None):
        args_ = self.create_arg(args)
        kwargs_ = self.create_arg(kwargs)
        val = None
        known = self._known
        if known is not None and kind == known[0] and target is known[1] \
                and _same_args(args_, known[2]) and _same_args(kwargs_, known[3]):
            val = known[4]
        elif kind not in ("placeholder", "output"):
            try:
                val = compute_meta(self.root, kind, target, args_, kwargs_)
            except (CaptureError,):
                raise
            except Exception as e:  # shape errors and the like, in user code or a rule
                raise CaptureError(
                    f"{describe_target(kind, target)} failed on the traced shapes: "
                    f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
                    op=describe_target(kind, target), loc=user_source_loc(),
                ) from e
        node = self.create_node(kind, target, args_, kwargs_, name, type_expr)
        if kind not in ("placeholder", "output"):
            node.meta["val"] = val
        return self.proxy(node)

    def value(self, node: fx.Node) -> TensorProxy:
        """Wrap an existing node of this graph as a proxy."""
        return TensorProxy(node, self)

    @contextlib.contextmanager
    def known_value(self, kind: str, target: Any, args: Any, kwargs: Any, val: Any
                    ) -> Iterator[None]:
        """Inside: a call of ``target`` on exactly ``args``/``kwargs`` (the same nodes and
        size objects, equal constants) takes ``val`` as its value instead of computing it
        on fake tensors again.  The engines pass a source node's value while its rule
        rewrites it (the forward computation, written again into the derivative graph)."""
        old = self._known
        self._known = (kind, target, self.create_arg(args), self.create_arg(kwargs), val)
        try:
            yield
        finally:
            self._known = old

    @contextlib.contextmanager
    def meta_defaults(self, **meta: Any) -> Iterator[None]:
        """Stamp ``meta`` on every node created inside the block."""
        old = dict(self.node_meta_defaults)
        self.node_meta_defaults.update(meta)
        try:
            yield
        finally:
            self.node_meta_defaults = old

    def iter(self, obj: fx.Proxy) -> Iterator:  # pragma: no cover - TensorProxy overrides
        return iter(obj)

    def to_bool(self, obj: fx.Proxy) -> bool:  # pragma: no cover - TensorProxy overrides
        return bool(obj)


def _same_args(a: Any, b: Any) -> bool:
    """``a`` and ``b`` are the same call arguments: the same nodes, tensors and symbolic
    sizes (by identity: comparing sizes would record a guard), equal constants of one type."""
    if type(a) is not type(b):
        return False
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same_args(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_args(a[k], b[k]) for k in a)
    if isinstance(a, (fx.Node, torch.Tensor, torch.SymInt, torch.SymFloat, torch.SymBool)):
        return a is b
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - not comparable: not the same
        return False


def unwrap(x: Any) -> Any:
    """Proxy → Node in a pytree (for building node args by hand)."""
    return pytree.tree_map(lambda v: v.node if isinstance(v, fx.Proxy) else v, x)


def getitem(p: Any, i: Any) -> Any:
    return operator.getitem(p, i)


def take_name(node: fx.Node, name: str) -> None:
    """Give ``node`` the name of a node that was just erased (FX never frees names, so a
    replacement would otherwise print as ``mean_1``).  Falls back to FX's unique name."""
    ns = node.graph._graph_namespace
    if any(n.name == name for n in (node.prev, node.next) if n is not node) or name == node.name:
        return
    taken = {n.name for n in node.graph.nodes}
    if name in taken:
        return
    try:
        ns._used_names.discard(name)
    except AttributeError:  # pragma: no cover - other torch versions
        pass
    node._rename(name)


class AttachedMeta(dict):
    """The ``meta`` of a graph module fxad keeps as a plain attribute of another module (the
    branches of a ``torch.cond`` and their derivatives, kept on the user's module and on the
    generated modules built on it): fxad's build-time records (closures that rebuild, the
    captured forward, input specs), which neither pickling nor copying needs.  A pickled
    module (``torch.save(model)``, ``GraphModule.to_folder``) gets none, so the module
    holding it pickles; a deep copy shares the records instead of copying the graphs in
    them."""

    def __reduce__(self) -> tuple:
        return (dict, ())

    def __deepcopy__(self, memo: dict) -> "AttachedMeta":
        return AttachedMeta(self)


def attach(root: torch.nn.Module, stem: str, gm: torch.fx.GraphModule,
           others: tuple = ()) -> str:
    """Keep ``gm`` on ``root`` (and on each of ``others``) as the plain attribute (not a
    registered submodule) ``_fxad_<stem>_<k>``, ``k`` the first free on all of them; its
    ``meta`` becomes an :class:`AttachedMeta`.  Returns the attribute's name."""
    roots = (root, *others)
    k = 0
    while any(hasattr(r, f"_fxad_{stem}_{k}") for r in roots):
        k += 1
    name = f"_fxad_{stem}_{k}"
    if not isinstance(gm.meta, AttachedMeta):
        gm.meta = AttachedMeta(gm.meta)
    for r in roots:
        object.__setattr__(r, name, gm)
    return name
