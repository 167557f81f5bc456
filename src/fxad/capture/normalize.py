"""Canonicalization: one torch function per op before differentiation.

After :func:`normalize`:

* Python arithmetic stays operator calls (``operator.add`` prints as ``a + b``), and the
  function/method spellings of the same ops map onto them: ``torch.add(x, y)``, ``x.add(y)``,
  ``torch.mul``, ``x.div(y)``, ``torch.neg``, ``torch.pow``, ``torch.matmul``, ``x.matmul(y)``.
  ``torch.add(x, y, alpha=a)`` becomes ``x + y * a``.
* Tensor methods become the matching ``torch.*`` function when one exists with the same
  semantics (``x.sin()`` → ``torch.sin(x)``, ``x.sum(1)`` → ``torch.sum(x, 1)``).
* Varargs shape methods get one spelling: ``x.view(a, b)`` / ``x.reshape(a, b)`` /
  ``x.view_as(y)`` → ``torch.reshape(x, (a, b))``; ``x.permute(1, 0)`` →
  ``torch.permute(x, (1, 0))``; ``x.expand(a, -1)`` / ``x.expand_as(y)`` → ``x.expand((a, b))``
  with concrete sizes; ``x.repeat(2, 1)`` → ``x.repeat((2, 1))``; ``x.flip(0)`` →
  ``torch.flip(x, (0,))``.
* Casts become ``x.to(dtype)`` (``float()``, ``double()``, ``half()``, ``type_as``).
* ``torch.nn.functional.relu/tanh/sigmoid/softmax/log_softmax`` (the Python wrappers) become
  ``torch.relu`` / ``torch.tanh`` / ``torch.sigmoid`` / ``torch.softmax`` / ``torch.log_softmax``.
* ``x.new_zeros(shape)`` and friends become ``torch.zeros(shape, dtype=..., device=...)``.
* NumPy's keyword names, which PyTorch's C++-bound functions and methods take as aliases,
  become PyTorch's: ``x.mean(axis=2, keepdims=True)`` → ``torch.mean(x, dim=2, keepdim=True)``.

In-place operations are already rewritten out-of-place during capture (see
:mod:`fxad.capture.tracer`).  Each rewrite is checked: the new node's fake value must have
the old node's shape and dtype, or the node is left as it was.
"""
from __future__ import annotations

import builtins
import operator
import types
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..graph.proxy import compute_meta, take_name
from ..graph.sizes import known_equal
from ..originals import torch_function

_METHOD_TO_OPERATOR: dict[str, Callable] = {
    "add": operator.add, "__add__": operator.add, "sub": operator.sub, "__sub__": operator.sub,
    "mul": operator.mul, "__mul__": operator.mul, "multiply": operator.mul,
    "div": operator.truediv, "divide": operator.truediv, "true_divide": operator.truediv,
    "__truediv__": operator.truediv, "neg": operator.neg, "negative": operator.neg,
    "__neg__": operator.neg, "pow": operator.pow, "__pow__": operator.pow,
    "matmul": operator.matmul, "__matmul__": operator.matmul,
}
_FUNC_TO_OPERATOR: dict[Any, Callable] = {
    torch.add: operator.add, torch.sub: operator.sub, torch.subtract: operator.sub,
    torch.mul: operator.mul, torch.multiply: operator.mul, torch.div: operator.truediv,
    torch.divide: operator.truediv, torch.true_divide: operator.truediv,
    torch.neg: operator.neg, torch.negative: operator.neg, torch.pow: operator.pow,
    torch.matmul: operator.matmul,
}
_F_TO_TORCH: dict[Any, Any] = {
    F.relu: torch.relu, F.tanh: torch.tanh, F.sigmoid: torch.sigmoid,
    F.softmax: torch.softmax, F.log_softmax: torch.log_softmax,
    # torch.meshgrid([a, b]) reaches the tracer as the C++ binding; name the public function
    torch._C._VariableFunctions.meshgrid: torch.meshgrid,
}
_CASTS = {"float": torch.float32, "double": torch.float64, "half": torch.float16,
          "bfloat16": torch.bfloat16}
# methods whose torch.* namesake differs in meaning or does not exist as a plain function
_KEEP_METHODS = {
    "to", "contiguous", "expand", "repeat", "size", "type", "item", "tolist", "numel", "dim",
    "new_zeros", "new_ones", "new_full", "new_empty", "new_tensor", "sum_to_size", "unfold",
    "clone", "index_put", "masked_scatter", "__getitem__", "stride", "storage_offset",
}
_NEW_FACTORIES = {"new_zeros": torch.zeros, "new_ones": torch.ones, "new_empty": torch.empty,
                  "new_full": torch.full}


def _shape_arg(args: tuple) -> tuple:
    if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)):
        return tuple(args[0])
    return tuple(args)


def _val(a: Any) -> Any:
    return a.meta.get("val") if isinstance(a, fx.Node) else a


# NumPy's keyword names that PyTorch's C++ argument parser takes for its own (``x.mean(axis=2,
# keepdims=True)``): one spelling for the rules, which bind PyTorch's names
_NUMPY_NAMES = {"axis": "dim", "keepdims": "keepdim", "x": "input", "a": "input",
                "x1": "input", "x2": "other"}


def _numpy_names_renamed(node: fx.Node) -> dict:
    """``node.kwargs`` with NumPy's keyword names as PyTorch's, for a call of a C++-bound
    torch function or Tensor method (a Python-defined one keeps its own names)."""
    kwargs = dict(node.kwargs)
    if not any(k in _NUMPY_NAMES for k in kwargs):
        return kwargs
    t = getattr(torch.Tensor, node.target, None) if node.op == "call_method" else node.target
    if not isinstance(t, (types.BuiltinFunctionType, types.MethodDescriptorType)) \
            or not (getattr(t, "__module__", None) or "torch").startswith("torch"):
        return kwargs
    return {(_NUMPY_NAMES[k] if k in _NUMPY_NAMES and _NUMPY_NAMES[k] not in kwargs else k): v
            for k, v in kwargs.items()}


def _canonical(node: fx.Node) -> tuple[str, Any, tuple, dict] | None:
    """The canonical (op, target, args, kwargs) for ``node``, or None when already canonical."""
    kwargs = _numpy_names_renamed(node)
    canon = _canonical_call(node, kwargs)
    if canon is None and kwargs != dict(node.kwargs):
        return node.op, node.target, node.args, kwargs
    return canon


def _canonical_call(node: fx.Node,  # noqa: C901
                    kwargs: dict) -> tuple[str, Any, tuple, dict] | None:
    op, t, args = node.op, node.target, node.args
    if op == "call_method":
        name = t
        if name in _METHOD_TO_OPERATOR:
            return _arith("call_function", _METHOD_TO_OPERATOR[name], args, kwargs)
        if name in ("view", "reshape"):
            if len(args) == 2 and isinstance(args[1], torch.dtype):
                return None  # x.view(dtype): a bit reinterpretation, keep
            return ("call_function", torch.reshape, (args[0], _shape_arg(args[1:])), {})
        if name in ("view_as", "reshape_as"):
            return ("call_function", torch.reshape, (args[0], tuple(_val(args[1]).shape)), {})
        if name in ("permute", "flip"):  # x.flip(0), x.flip([0]) or x.flip(dims=[0])
            dims = _shape_arg(args[1:]) if "dims" not in kwargs else tuple(kwargs["dims"])
            return ("call_function", torch_function(name), (args[0], dims), {})
        if name in ("expand", "expand_as"):
            out = tuple(_val(node).shape)
            if name == "expand" and tuple(args[1:]) == (out,) and not kwargs:
                return None
            return ("call_method", "expand", (args[0], out), {})
        if name == "repeat":
            sizes = _shape_arg(args[1:])
            if tuple(args[1:]) == (sizes,):
                return None
            return ("call_method", "repeat", (args[0], sizes), {})
        if name in _CASTS and len(args) == 1 and not kwargs:
            return ("call_method", "to", (args[0], _CASTS[name]), {})
        if name == "type" and (len(args) > 1 or "dtype" in kwargs) \
                and isinstance(_val(node), torch.Tensor):
            # x.type(torch.float32) / x.type("torch.DoubleTensor"): a cast to the dtype (and,
            # for a "torch.cuda.*" name, the device) the output has
            out, src = _val(node), _val(args[0])
            if isinstance(src, torch.Tensor) and out.device == src.device:
                return ("call_method", "to", (args[0], out.dtype), {})
            return ("call_method", "to", (args[0],), {"device": out.device, "dtype": out.dtype})
        if name == "type_as":
            return ("call_method", "to", (args[0], _val(args[1]).dtype), {})
        if name in _NEW_FACTORIES:
            base = _val(args[0])
            kw = {"dtype": kwargs.pop("dtype", base.dtype), "device": kwargs.pop("device", base.device)}
            kw.update(kwargs)
            rest = args[1:]
            if name == "new_full":
                return ("call_function", torch.full, (tuple(rest[0]), rest[1]), kw)
            return ("call_function", _NEW_FACTORIES[name], (_shape_arg(rest),), kw)
        if name == "where" and len(args) >= 2:
            # x.where(cond, y) is torch.where(cond, x, y)
            rest = tuple(args[2:]) if len(args) > 2 else (kwargs.pop("other"),) \
                if "other" in kwargs else ()
            return ("call_function", torch.where, (args[1], args[0]) + rest, kwargs)
        if name in _KEEP_METHODS or name.startswith("_"):
            return None
        fn = torch_function(name)  # PyTorch's own, whatever a library put there since
        if fn is not None and callable(fn) and not isinstance(fn, type):
            return ("call_function", fn, tuple(args), kwargs)
        return None
    if op == "call_function":
        if t is builtins.getattr and len(args) == 2 and isinstance(args[1], str):
            # `torch.max(x, 1).values`: named field of a torch.return_types tuple -> index
            v = _val(args[0])
            fields = getattr(type(v), "_fields", None) or _structseq_fields(v)
            if fields and args[1] in fields:
                return (op, operator.getitem, (args[0], fields.index(args[1])), {})
            if isinstance(v, torch.Tensor) and args[1] in ("real", "imag"):
                # `z.real` / `z.imag`: the torch functions (views of a complex tensor)
                return (op, torch_function(args[1]), (args[0],), {})
            return None
        if t in _FUNC_TO_OPERATOR:
            if t in (torch.div, torch.Tensor.div) and kwargs.get("rounding_mode") is not None:
                return None
            return _arith(op, _FUNC_TO_OPERATOR[t], args, kwargs)
        if t in _F_TO_TORCH:
            kwargs.pop("inplace", None)
            if t in (F.softmax, F.log_softmax):
                kwargs.pop("_stacklevel", None)
                if kwargs.get("dtype", 0) is None:
                    kwargs.pop("dtype")
                dim = kwargs.pop("dim", args[1] if len(args) > 1 else None)
                if dim is None:
                    return None  # implicit-dim legacy form: leave for the F.* rule
                return (op, _F_TO_TORCH[t], (args[0], dim), kwargs)
            return (op, _F_TO_TORCH[t], tuple(args[:1]), kwargs)
        if getattr(t, "__name__", None) in _METHOD_TO_OPERATOR and isinstance(
                t, type(torch.Tensor.add)) and t is getattr(torch.Tensor, t.__name__, None):
            return _arith(op, _METHOD_TO_OPERATOR[t.__name__], args, kwargs)
    return None


def _structseq_fields(v: Any) -> tuple[str, ...] | None:
    n = getattr(type(v), "n_fields", None)
    if n is None:
        return None
    names = [k for k in dir(type(v)) if not k.startswith("_") and k not in
             ("count", "index", "n_fields", "n_sequence_fields", "n_unnamed_fields")]
    try:
        return tuple(sorted(names, key=lambda k: [x is getattr(v, k) for x in v].index(True)))
    except ValueError:
        return None


def _arith(op: str, target: Callable, args: tuple, kwargs: dict) -> tuple | None:
    kwargs = dict(kwargs)
    if "other" in kwargs and len(args) == 1:
        args = (args[0], kwargs.pop("other"))
    if "input" in kwargs and not args:
        args = (kwargs.pop("input"),) + tuple(args)
    if "exponent" in kwargs and len(args) == 1:
        args = (args[0], kwargs.pop("exponent"))
    alpha = kwargs.pop("alpha", 1)
    if kwargs:
        return None
    if alpha != 1:
        if target not in (operator.add, operator.sub):
            return None
        return ("alpha", target, tuple(args), {"alpha": alpha})
    return (op, target, tuple(args), {})


def normalize(gm: fx.GraphModule) -> fx.GraphModule:
    """Canonicalize ``gm``'s graph in place (see module docstring) and recompile it."""
    g = gm.graph
    for node in list(g.nodes):
        if node.op not in ("call_function", "call_method"):
            continue
        canon = _canonical(node)
        if canon is None:
            continue
        op, target, args, kwargs = canon
        with g.inserting_before(node):
            if op == "alpha":
                scaled = _make(gm, g, "call_function", operator.mul, (args[1], kwargs["alpha"]), {},
                               node, check=False)
                if scaled is None:
                    continue
                new = _make(gm, g, "call_function", target, (args[0], scaled), {}, node)
            else:
                new = _make(gm, g, op, target, args, kwargs, node)
        if new is None:
            continue
        name = node.name
        node.replace_all_uses_with(new)
        g.erase_node(node)
        take_name(new, name)
    g.lint()
    gm.recompile()
    return gm


def _make(gm: fx.GraphModule, g: fx.Graph, op: str, target: Any, args: tuple, kwargs: dict,
          like: fx.Node, check: bool = True) -> fx.Node | None:
    try:
        val = compute_meta(gm, op, target, args, kwargs)
    except Exception:
        return None
    old = like.meta.get("val")
    if check and isinstance(old, torch.Tensor):
        if not isinstance(val, torch.Tensor) or val.dtype != old.dtype \
                or not known_equal(tuple(val.shape), tuple(old.shape)):
            return None
    new = g.create_node(op, target, args, kwargs)
    new.meta = {k: v for k, v in like.meta.items()}
    new.meta["val"] = val
    return new
