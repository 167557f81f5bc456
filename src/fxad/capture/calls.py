"""How each torch call is classified and put in node form: which calls are operators,
in-place forms, data reads, view properties, Python composites traced through; the method
name of a ``torch.Tensor`` attribute; torch.fx's node form of a call.  Read by the dispatch
(:mod:`fxad.capture.mode`) and the in-place recording (:mod:`fxad.capture.inplace`); no
capture state here."""
from __future__ import annotations

import inspect
import operator
import types
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.utils import _pytree as pytree

from ..originals import torch_function

# composites of ops that have rules, whose single-node form would need a fallback
_TRACE_THROUGH = frozenset({F.multi_head_attention_forward})

_NO_OVERRIDE = {name: (lambda *a, **k: False) for name in (
    "has_torch_function", "has_torch_function_unary", "has_torch_function_variadic")}

# Tensor dunder methods -> (operator function, operands reversed)
DUNDER: dict[str, tuple[Callable, bool]] = {}
for _op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or",
            "xor", "lshift", "rshift"):
    _fn = getattr(operator, _op + "_" if _op in ("and", "or") else _op)
    DUNDER[f"__{_op}__"] = (_fn, False)
    DUNDER[f"__r{_op}__"] = (_fn, True)
DUNDER["__div__"] = (operator.truediv, False)
DUNDER["__rdiv__"] = (operator.truediv, True)
for _op in ("eq", "ne", "lt", "le", "gt", "ge"):
    DUNDER[f"__{_op}__"] = (getattr(operator, _op), False)
UNARY_DUNDER = {"__neg__": operator.neg, "__pos__": operator.pos, "__abs__": operator.abs,
                "__invert__": operator.invert}
# in-place dunders -> the out-of-place operator
IDUNDER = {f"__i{k[2:]}": v[0] for k, v in DUNDER.items()
           if not k.startswith("__r") and k[2:-2] not in ("eq", "ne", "lt", "le", "gt", "ge")}

# calls that need tensor data
DATA_METHODS = {"item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__complex__",
                "__index__", "__array__", "__contains__", "data_ptr", "equal", "allclose",
                "is_nonzero", "__array_wrap__"}
DATA_FUNCTIONS = {torch.equal, torch.allclose, torch.is_nonzero}
# methods that read a tensor's memory layout as Python values (guarded on the inputs' layouts)
LAYOUT_METHODS = {"is_contiguous", "stride", "storage_offset", "is_non_overlapping_and_dense",
                  "dim_order"}
# methods that end in "_" but are not in-place value updates
NOT_INPLACE = {"requires_grad_", "share_memory_", "retain_grad", "pin_memory_"}
# in-place random draws: they overwrite every element (no out-of-place method)
RANDOM_INPLACE = {"uniform_", "normal_", "bernoulli_", "exponential_", "random_",
                  "geometric_", "cauchy_", "log_normal_"}
# properties that are views of the tensor: recorded as the equivalent calls
VIEW_PROPERTIES = {"T", "mT", "H", "mH", "real", "imag", "data"}


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


def method_name(func: Any) -> tuple[str | None, str | None]:
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


def takes_callable(target: Any, args: tuple, kwargs: dict) -> bool:
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


def call_body(target: Any, args: tuple, kwargs: dict) -> Any:
    """Run ``target``'s Python body, skipping its own ``__torch_function__`` dispatch (the ops
    inside it are still recorded one by one)."""
    body = types.FunctionType(target.__code__, {**target.__globals__, **_NO_OVERRIDE},
                              target.__name__, target.__defaults__, target.__closure__)
    body.__kwdefaults__ = target.__kwdefaults__
    return body(*args, **kwargs)


def node_form(func: Any, method: str | None, args: tuple) -> tuple[str, Any, tuple]:
    """torch.fx's node form of a call: methods as ``call_method``, Python operators as
    ``operator`` functions, everything else as ``call_function``."""
    if method is None:
        return "call_function", func, args
    if method in DUNDER:
        fn, rev = DUNDER[method]
        return "call_function", fn, (args[1], args[0]) if rev else args
    if method in UNARY_DUNDER:
        return "call_function", UNARY_DUNDER[method], args
    if method == "__getitem__":
        return "call_function", operator.getitem, args
    return "call_method", method, args


def out_of_place_function(func: Any) -> tuple[str, Any] | None:
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
