"""Symbolic capture of a function or ``nn.Module`` on example inputs.

The tracer is a :class:`torch.fx.Tracer` whose proxies carry fake tensors (see
:mod:`fxad.capture.proxy`).  No real computation runs: every op is executed once on
``FakeTensor`` values to learn its result's shape and dtype.

Policies:

* ``torch.nn`` modules are traced *through* down to ``torch.nn.functional`` calls, so their
  derivative rules are the functional ones (``F.linear``, ``F.layer_norm``, ``F.conv2d``...).
  Modules whose class is in ``leaf_modules`` stay ``call_module`` nodes and need a rule
  registered for their class (:func:`fxad.register_vjp`).
* Parameters become ``get_attr`` nodes named after their path (``l1.weight`` → ``l1_weight``);
  so do registered buffers.
* Non-tensor inputs (ints, floats, bools, None, strings) are specialized: the graph keeps a
  placeholder for them so the call signature is unchanged, but the traced code used the example
  value.
* Tensor constructors (``torch.zeros(n)``, ``torch.arange(T)``, ...) are recorded as graph
  nodes rather than baked in as constants.
"""
from __future__ import annotations

import contextlib
import inspect
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.utils import _pytree as pytree

from ..errors import CaptureError, InplaceError, InputError, SourceLoc
from .proxy import TensorProxy, compute_meta, fetch_attr, in_meta_computation, describe_target, to_fake, user_source_loc

# Factory functions recorded as graph nodes (their arguments are concrete during capture).
_FACTORIES = (
    "zeros", "ones", "empty", "full", "arange", "linspace", "logspace", "eye",
    "rand", "randn", "randint", "randperm", "tril_indices", "triu_indices",
)


_CONV_GRADS = tuple(f"conv{n}d_{w}" for n in (1, 2, 3) for w in ("input", "weight"))


@contextlib.contextmanager
def _record_factories(tracer: "CaptureTracer") -> Iterator[None]:
    originals = {name: getattr(torch, name) for name in _FACTORIES}

    def make(name: str, orig: Callable) -> Callable:
        def factory(*args: Any, **kwargs: Any) -> Any:
            if in_meta_computation():
                return orig(*args, **kwargs)
            return tracer.create_proxy("call_function", orig, args, kwargs)
        factory.__name__ = name
        factory.__wrapped__ = orig  # type: ignore[attr-defined]
        return factory

    # the convolution gradient functions are Python composites of an aten kernel: recorded
    # as one node each (they have rules), like the generated code that calls them
    import torch.nn.grad as nn_grad
    grads = {name: getattr(nn_grad, name) for name in _CONV_GRADS if hasattr(nn_grad, name)}

    def make_grad(orig: Callable) -> Callable:
        def conv_grad(*args: Any, **kwargs: Any) -> Any:
            if in_meta_computation() or not any(isinstance(a, fx.Proxy) for a in
                                                pytree.tree_leaves((args, kwargs))):
                return orig(*args, **kwargs)
            return tracer.create_proxy("call_function", orig, args, kwargs)
        conv_grad.__name__ = orig.__name__
        conv_grad.__wrapped__ = orig  # type: ignore[attr-defined]
        return conv_grad

    try:
        for name, orig in originals.items():
            setattr(torch, name, make(name, orig))
        for name, orig in grads.items():
            setattr(nn_grad, name, make_grad(orig))
        yield
    finally:
        for name, orig in originals.items():
            setattr(torch, name, orig)
        for name, orig in grads.items():
            setattr(nn_grad, name, orig)


# composites of ops that have rules, whose single-node form would need a fallback
_TRACE_THROUGH = frozenset({F.multi_head_attention_forward})


def _takes_callable(target: Any, args: tuple, kwargs: dict) -> bool:
    """A Python-level torch function (``F.triplet_margin_with_distance_loss``) called with a
    user callable (a module or function) among its arguments: a graph node cannot hold the
    callable, so the function's body is traced instead.  So is ``F.multi_head_attention_forward``
    (a composite of ops with rules)."""
    if not inspect.isfunction(target):
        return False
    if target in _TRACE_THROUGH:
        return True
    return any(callable(v) and not isinstance(v, (torch.Tensor, fx.Proxy, type))
               for v in pytree.tree_leaves((args, kwargs)))


_NO_OVERRIDE = {name: (lambda *a, **k: False) for name in (
    "has_torch_function", "has_torch_function_unary", "has_torch_function_variadic")}


def _call_body(target: Any, args: tuple, kwargs: dict) -> Any:
    """Run ``target``'s Python body on the proxies, skipping its own ``__torch_function__``
    dispatch (the ops inside it are still recorded one by one)."""
    import types
    body = types.FunctionType(target.__code__, {**target.__globals__, **_NO_OVERRIDE},
                              target.__name__, target.__defaults__, target.__closure__)
    body.__kwdefaults__ = target.__kwdefaults__
    return body(*args, **kwargs)


def _stateless(m: torch.nn.Module) -> bool:
    return next(m.parameters(), None) is None and next(m.buffers(), None) is None


def _has_tensor(x: Any) -> bool:
    return any(isinstance(v, torch.Tensor) for v in pytree.tree_leaves(x))


class CaptureTracer(fx.Tracer):
    """FX tracer with shape-carrying proxies; see the module docstring for its policies."""

    def __init__(self, example_inputs: Sequence[Any], leaf_modules: Iterable[type] = ()) -> None:
        super().__init__(autowrap_modules=(), param_shapes_constant=False)
        self.example_inputs = list(example_inputs)
        self.leaf_types = tuple(leaf_modules)
        self.proxy_buffer_attributes = True
        self.record_stack_traces = False
        self.input_names: list[str] = []
        self.mutations: list[tuple[fx.Node, fx.Node, str, SourceLoc | None]] = []
        # set by capture(): the root is fxad's own empty module (f is a plain function), so
        # modules the function closes over can be attached to it under fresh names
        self.function_root = False

    # -- proxies ---------------------------------------------------------------------------
    def proxy(self, node: fx.Node) -> TensorProxy:
        return TensorProxy(node, self)

    def create_proxy(self, kind, target, args, kwargs, name=None, type_expr=None,  # type: ignore[override]
                     proxy_factory_fn=None):
        if kind in ("call_function", "call_method") and kwargs.get("out") is not None:
            raise InplaceError(
                f"{describe_target(kind, target)}(..., out=...) writes into an existing tensor",
                op=describe_target(kind, target), loc=user_source_loc(),
                hint="assign the result instead: y = op(...)")
        query = _metadata_query(kind, target, args)
        if query is not None:  # x.is_floating_point(), torch.is_complex(x): answered now
            return query(args[0].meta, *args[1:], **kwargs)
        if kind == "call_method" and _is_inplace_method(target) and args \
                and isinstance(args[0], TensorProxy):
            return self._inplace_method(target, args, kwargs)
        if kind == "call_function" and _is_inplace_method(getattr(target, "__name__", None)) \
                and getattr(torch, getattr(target, "__name__", ""), None) is target and args \
                and isinstance(args[0], TensorProxy):  # torch.relu_(x) and friends
            return self._inplace_method(target.__name__, args, kwargs)
        if kind == "call_function" and kwargs.get("inplace") is True and args \
                and isinstance(args[0], TensorProxy):
            kwargs = {**kwargs, "inplace": False}
            new = self._record(kind, target, args, kwargs, name)
            return self._rebind(args[0], new, describe_target(kind, target))
        if kind == "call_function" and _takes_callable(target, args, kwargs):
            return _call_body(target, args, kwargs)
        return self._record(kind, target, args, kwargs, name)

    # -- in-place operations -------------------------------------------------------------------
    def _inplace_method(self, target: str, args: tuple, kwargs: dict) -> TensorProxy:
        self_p: TensorProxy = args[0]
        node = self_p.node
        if node.op == "get_attr" and not _is_trainable_param(self.root, node.target):
            # a buffer update such as BatchNorm's `num_batches_tracked.add_(1)`: keep the side
            # effect exactly as eager PyTorch runs it; it is not on a differentiation path.
            p = self._record("call_method", target, args, kwargs, None)
            p.node.meta["fxad_side_effect"] = True
            return p
        oop = _OUT_OF_PLACE.get(target, target[:-1])
        if isinstance(oop, str):
            new = self._record("call_method", oop, args, kwargs, None)
        else:
            new = oop(self, args, kwargs)
        return self._rebind(self_p, new, f"Tensor.{target}")

    def setitem(self, x: TensorProxy, index: Any, value: Any) -> None:
        from ..ops import setitem as functional_setitem
        new = self._record("call_function", functional_setitem, (x, index, value), {}, "setitem")
        self._rebind(x, new, "Tensor.__setitem__")

    def _rebind(self, old: TensorProxy, new: TensorProxy, what: str) -> TensorProxy:
        """Make the Python object ``old`` stand for the result of the out-of-place ``new``."""
        loc = user_source_loc()
        onode = old.node
        if onode.op == "placeholder" or _storage(onode) in self._input_storages():
            raise InplaceError(
                f"{what} modifies the input `{onode.name}` (or a view of it) in place",
                op=what, loc=loc,
                hint="write the result to a new variable (y = x + 1) instead of mutating the input")
        if onode.op == "get_attr":
            raise InplaceError(f"{what} modifies the trainable parameter `{onode.target}` in place",
                               op=what, loc=loc, hint="compute a new tensor instead")
        self.mutations.append((onode, new.node, what, loc))
        old.node = new.node
        return old

    def _input_storages(self) -> set:
        return {_storage(n) for n in self.graph.nodes if n.op == "placeholder"} - {None}

    def _check_aliases(self) -> None:
        """Refuse mutations whose effect would be visible through another alias (a view)."""
        order = {n: i for i, n in enumerate(self.graph.nodes)}
        for old, new, what, loc in self.mutations:
            sid = _storage(old)
            if sid is None:
                continue
            for n in self.graph.nodes:
                if order[n] >= order[new]:
                    break
                if n is old or _storage(n) != sid:
                    continue
                late = [u for u in n.users if order[u] > order[new]]
                if late:
                    raise InplaceError(
                        f"{what} mutates `{old.name}`, which shares memory with `{n.name}`; "
                        f"`{n.name}` is used afterwards (by `{late[0].name}`), so an out-of-place "
                        "rewrite would change the result",
                        op=what, loc=loc,
                        hint="mutate the base tensor with indexing (base[idx] = value), or clone "
                             "before mutating")

    def _record(self, kind, target, args, kwargs, name):  # noqa: C901
        loc = user_source_loc()
        args_ = self.create_arg(args)
        kwargs_ = self.create_arg(kwargs)
        val = None
        if kind not in ("placeholder", "output", "get_attr"):
            try:
                val = compute_meta(self.root, kind, target, args_, kwargs_)
            except CaptureError:
                raise
            except Exception as e:
                msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
                dyn = "DynamicOutputShape" in type(e).__name__ or "data-dependent" in str(e) \
                    or "DataDependent" in type(e).__name__
                raise CaptureError(
                    f"{describe_target(kind, target)} cannot be traced on the example shapes: "
                    f"{type(e).__name__}: {msg}",
                    op=describe_target(kind, target), loc=loc,
                    hint=("the output shape depends on tensor data; fxad needs static shapes "
                          "(mark the enclosing module as a leaf and register a rule)") if dyn else
                         "check the shapes of the example inputs",
                ) from e
        node = self.create_node(kind, target, args_, kwargs_, name, None)
        if kind not in ("placeholder", "output"):
            if kind != "get_attr":
                node.meta["val"] = val
            if loc is not None:
                _set_loc(node, loc)
        return self.proxy(node)

    def create_node(self, kind, target, args, kwargs, name=None, type_expr=None):  # type: ignore[override]
        node = super().create_node(kind, target, args, kwargs, name, type_expr)
        if kind == "get_attr":  # parameters, buffers and tensor constants
            node.meta["val"] = compute_meta(self.root, kind, target, (), {})
        return node

    # -- policies ----------------------------------------------------------------------------
    def call_module(self, m, forward, args, kwargs):  # type: ignore[override]
        if in_meta_computation():  # computing a leaf module's fake output: just run it
            return forward(*args, **kwargs)
        if not self.is_leaf_module(m, "") and _stateless(m) and not self._in_root(m):
            # a parameter-free module made outside the traced module (a distance function
            # passed as an argument): nothing to address, so trace its forward inline
            return forward(*args, **kwargs)
        return super().call_module(m, forward, args, kwargs)

    def _in_root(self, m: torch.nn.Module) -> bool:
        """``m`` is a submodule of the traced root (FX's module-path table when it has one)."""
        if self.submodule_paths:
            return m in self.submodule_paths
        return any(mod is m for mod in self.root.modules())

    def path_of_module(self, mod: torch.nn.Module) -> str:
        try:
            return super().path_of_module(mod)
        except NameError:
            if self.function_root:
                # a module the traced function closes over (``lambda x: model(x).sum()``):
                # attach it to the graph's root; its parameters are constants of the function
                base = type(mod).__name__.lower() or "module"
                name, k = base, 1
                while hasattr(self.root, name):
                    name, k = f"{base}_{k}", k + 1
                self.root.add_module(name, mod)
                self.submodule_paths = None
                return name
            raise CaptureError(
                f"the {type(mod).__name__} module called here is not a submodule of the traced "
                "module (it was created inside the traced code or belongs to another object), "
                "so its parameters cannot be addressed",
                op=type(mod).__name__, loc=user_source_loc(),
                hint="create it in __init__ and assign it to self (or call the matching "
                     "torch.nn.functional function)") from None

    def getattr(self, attr, attr_val, parameter_proxy_cache):  # type: ignore[override]
        if in_meta_computation():
            return attr_val
        return super().getattr(attr, attr_val, parameter_proxy_cache)

    def is_leaf_module(self, m: torch.nn.Module, module_qualified_name: str) -> bool:
        return bool(self.leaf_types) and isinstance(m, self.leaf_types)

    def create_arg(self, a: Any) -> Any:  # type: ignore[override]
        if self.function_root and isinstance(a, torch.nn.Parameter) \
                and not any(a is p for p in self.root.parameters()):
            # a parameter the traced function closes over (``lambda x: x @ w``): attach it
            # to the graph's root under a fresh name; a constant of the function
            k = 0
            while hasattr(self.root, f"param_{k}"):
                k += 1
            self.root.register_parameter(f"param_{k}", a)
        return super().create_arg(a)

    def create_args_for_root(self, root_fn, is_module, concrete_args=None):  # type: ignore[override]
        fn = inspect.unwrap(root_fn)
        sig = inspect.signature(fn)
        params = list(sig.parameters.values())
        if is_module:
            params = params[1:]
        names = _input_names(params, len(self.example_inputs))
        values: list[Any] = []
        self.input_names = []
        for name, example in zip(names, self.example_inputs):
            ph = self.create_proxy("placeholder", name, (), {})
            ph.node.meta["val"] = to_fake(example)
            ph.node.meta["fxad_input"] = True
            self.input_names.append(ph.node.name)
            if isinstance(example, (tuple, list, dict)) and _has_tensor(example):
                values.append(_unpack(ph, example))  # a real container of proxies
            else:
                values.append(ph if _has_tensor(example) else example)
        root = self.root

        def run(*_ignored):  # no annotations: fx copies the return annotation
            with _record_factories(self):
                if is_module:
                    return root_fn(root, *values)
                return root_fn(*values)

        run.__globals__  # noqa: B018 - fx reads __globals__ of the returned fn
        return run, []


_METADATA_QUERIES = {"is_floating_point", "is_complex", "is_signed", "is_contiguous",
                     "element_size", "ndimension", "nelement", "get_device", "is_inference"}


def _metadata_query(kind: str, target: Any, args: tuple) -> Any:
    """For calls that only read tensor metadata (dtype, layout), the function to run on the
    fake value instead of recording a node."""
    if not args or not isinstance(args[0], TensorProxy):
        return None
    name = target if kind == "call_method" else getattr(target, "__name__", None)
    if name not in _METADATA_QUERIES:
        return None
    if kind == "call_function" and target is not getattr(torch, name, None) \
            and target is not getattr(torch.Tensor, name, None):
        return None
    return lambda v, *a, **k: getattr(v, name)(*a, **k)


def _unpack(p: TensorProxy, example: Any) -> Any:
    """The container ``example`` rebuilt with proxies ``p[k]...`` for its tensor leaves, so the
    user's code sees a real dict/list/tuple (``torch.func.functional_call(m, params, ...)``)."""
    if isinstance(example, dict):
        return {k: _unpack(p[k], v) for k, v in example.items()}
    if isinstance(example, (tuple, list)):
        items = [_unpack(p[i], v) for i, v in enumerate(example)]
        return type(example)(items) if type(example) in (tuple, list) else type(example)(*items)
    return p if isinstance(example, torch.Tensor) else example


def _is_inplace_method(name: Any) -> bool:
    return isinstance(name, str) and name.endswith("_") and not name.startswith("_")


def _storage(node: fx.Node) -> Any:
    v = node.meta.get("val")
    if isinstance(v, torch.Tensor):
        try:
            return v.untyped_storage()._cdata
        except Exception:
            return None
    return None


def _is_trainable_param(root: torch.nn.Module, target: str) -> bool:
    obj = fetch_attr(root, target)
    return isinstance(obj, torch.nn.Parameter) and obj.requires_grad


def _zero_(tr: CaptureTracer, args: tuple, kwargs: dict) -> TensorProxy:
    return tr._record("call_function", torch.zeros_like, (args[0],), {}, None)


def _fill_(tr: CaptureTracer, args: tuple, kwargs: dict) -> TensorProxy:
    return tr._record("call_function", torch.full_like, (args[0], args[1]), {}, None)


def _copy_(tr: CaptureTracer, args: tuple, kwargs: dict) -> TensorProxy:
    x, src = args[0], args[1]
    if isinstance(src, TensorProxy):
        src = tr._record("call_method", "to", (src, x.meta.dtype), {}, None)
        return tr._record("call_method", "expand", (src, tuple(x.meta.shape)), {}, None)
    return tr._record("call_function", torch.full_like, (x, src), {}, None)


# in-place method -> out-of-place method name, or a builder
_OUT_OF_PLACE: dict[str, Any] = {"zero_": _zero_, "fill_": _fill_, "copy_": _copy_}


def _set_loc(node: fx.Node, loc: SourceLoc) -> None:
    node.meta["fxad_loc"] = loc
    node.meta["stack_trace"] = (
        f'  File "{loc.filename}", line {loc.lineno}, in {loc.function}\n    {loc.code}\n')


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
    tracer = CaptureTracer(example_inputs, leaf_modules)
    if callable(f) and not inspect.isfunction(f) and not isinstance(f, torch.nn.Module):
        # a bound method (``model.logits``), a builtin (``torch.sin``) or another callable: a
        # function of its arguments; a module it is bound to is reached through the closure,
        # its parameters constants of the function
        method = f

        def bound(*args: Any) -> Any:
            return method(*args)

        try:
            sig = inspect.signature(method)
            if any(p.kind is p.VAR_POSITIONAL for p in sig.parameters.values()) \
                    or len(sig.parameters) < len(example_inputs):
                raise ValueError
        except (TypeError, ValueError):  # builtins often have no usable signature
            sig = inspect.Signature([inspect.Parameter(
                "x" if len(example_inputs) == 1 else f"x{i}", inspect.Parameter.POSITIONAL_ONLY)
                for i in range(len(example_inputs))])
        bound.__signature__ = sig  # type: ignore[attr-defined]
        bound.__name__ = getattr(method, "__name__", "f")
        f = bound
    if isinstance(f, torch.nn.Module):
        root: torch.nn.Module = f
        name = type(f).__name__
    elif callable(f):
        root = torch.nn.Module()
        name = getattr(f, "__name__", "f")
        tracer.function_root = True
    else:
        raise InputError(f"fxad expects a function or nn.Module, got {type(f).__name__}")
    try:
        graph = tracer.trace(f)
    except fx.proxy.TraceError as e:
        raise CaptureError(str(e), loc=user_source_loc()) from e
    tracer._check_aliases()
    gm = fx.GraphModule(tracer.root, graph, class_name=name)
    gm.meta["fxad_training"] = bool(f.training) if isinstance(f, torch.nn.Module) else None
    gm.meta["fxad_source_module"] = f if isinstance(f, torch.nn.Module) else None
    return gm


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
