"""The traced module's own attributes, kept as they were.

The program runs on the user's module, and may assign to its attributes
(``self.cache = self.cache.to(x.dtype)``); the module must never keep a traced (fake)
value.  :func:`module_state` notes every tensor the modules hold before capture,
:func:`restore_module_state` puts them back after, and :func:`warn_rebound` says where the
generated code therefore differs from eager PyTorch.

The code of a build is specialized on the modules' plain Python attributes:
:class:`Settings` versions them for ``fxad.compile``, checked on every call, and
:func:`recording_reads` notes which attributes the code read while a build was captured,
so that an attribute no build read (a trainer's step counter) is not compared.
"""
from __future__ import annotations

import argparse
import contextlib
import contextvars
import copy
import dataclasses
import enum
import operator
import os
import sys
import types
import warnings
from typing import Any, Iterator

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor

from ..guards import ModeWarning, caller_stacklevel


def module_state(root: torch.nn.Module) -> dict:
    """Every tensor the modules of ``root`` hold (parameters, buffers, plain tensor
    attributes), by module path: what :func:`restore_module_state` puts back."""
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


def restore_module_state(state: dict) -> list[tuple[str, Any, Any]]:
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


def warn_rebound(cap: Any, rebound: list[tuple[str, Any, Any]]) -> None:
    """Say where the generated code differs from eager: eager PyTorch keeps a tensor the
    program assigned to a module attribute, fxad's code does not store it (it recomputes the
    value from the module's own attribute on every call).  Silent only where the new value
    is the old one converted to the dtype/device/layout it already had (transformers' CTRL:
    ``self.pos_encoding = self.pos_encoding.to(device=..., dtype=...)``), which leaves the
    attribute's value as it was."""
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


def _same_value(cap: Any, old: Any, new: Any) -> bool:
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


# Python values a module's code may decide on, compared by value on every call
_ATOMS = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device,
          torch.layout, torch.memory_format, enum.Enum)
_LONGEST = 64  # a longer container (a label table) is data, not a setting: not compared


def _frozen(v: Any, depth: int = 0) -> Any:
    """``v`` as a hashable value to compare, or ``_SKIP`` when it is not a plain setting; a
    tensor attribute (a buffer, a plain tensor the code reads as a constant) by identity: a
    new tensor object is a change (the code of a build holds the one it was built with, so
    its identifier is not reused while that build exists)."""
    if isinstance(v, _ATOMS):
        return v
    if depth == 0 and isinstance(v, torch.Tensor) and not isinstance(v, torch.nn.Parameter):
        return ("tensor", id(v))
    if depth < 2 and isinstance(v, (tuple, list, set, frozenset, dict)) and len(v) <= _LONGEST:
        items = list(v.items()) if isinstance(v, dict) else list(v)
        out = tuple(_frozen(x, depth + 1) for x in items) if not isinstance(v, dict) else \
            tuple((_frozen(k, depth + 1), _frozen(x, depth + 1)) for k, x in items)
        flat = [y for x in out for y in (x if isinstance(v, dict) else (x,))]
        if not any(y is _SKIP for y in flat):
            return (type(v).__name__, frozenset(out) if isinstance(v, (set, frozenset)) else out)
    return _SKIP


_SKIP = object()
# nn.Module's own bookkeeping (hooks, parameter tables, the training flag): not settings
_MODULE_INTERNALS = frozenset(vars(torch.nn.Module()))
# the hooks a module call runs (the module's own, then every module's): which are registered
_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
_MODULE_HOOKS = torch.nn.modules.module


def _global_hooks() -> list[dict]:
    return [d for d in (getattr(_MODULE_HOOKS, f"_global{h}", None) for h in _HOOKS)
            if isinstance(d, dict)]


def python_settings(mods: list[torch.nn.Module], relevant: dict | None = None) -> tuple:
    """The plain Python values the code of the modules ``mods`` may decide on, as a
    hashable tuple: every attribute of each module holding a number, bool, string, ``None``,
    dtype, device or enum, or a short tuple, list, set or dict of those (``self.scale``,
    ``self.use_relu``), and the same of every configuration object a module attribute holds
    (transformers' ``self.config``, a dataclass, a namespace: :func:`_holds_settings`), each
    once.  ``relevant`` (:attr:`Settings.relevant`): of a module's own attributes, only
    those its code read while a build was captured."""
    return _kept(_settings(mods), mods, relevant)


def _kept(entries: list, mods: list[torch.nn.Module], relevant: dict | None) -> tuple:
    """:func:`python_settings` from the entries of :func:`_settings`: a module's own
    attributes only where its code read them (``relevant``)."""
    return tuple((i, name, f if kind == "attr" else ("object", f))
                 for i, name, kind, f, own in entries
                 if not own or _read(relevant, mods[i], name))


def _read(relevant: dict | None, m: torch.nn.Module, name: str) -> bool:
    """Whether the code of ``m`` read its attribute ``name`` while some build was captured
    (every attribute counts where that is not known)."""
    names = None if relevant is None else relevant.get(id(m))
    return names is None or name in names


def _settings(mods: list[torch.nn.Module]) -> list[tuple[int, str, str, Any, bool]]:
    """``(module index, name, kind, frozen value, own)`` of every setting; ``own``: a plain
    value in the module's ``__dict__`` (compared only where read, :func:`_kept`)."""
    out: list = []
    seen: set[int] = set()
    for i, m in enumerate(mods):
        for own, items in ((True, m.__dict__.items()), (False, m._buffers.items())):
            for name, v in items:
                if name in _MODULE_INTERNALS:
                    continue
                f = _frozen(v)
                if f is not _SKIP:
                    out.append((i, name, "attr", f, own))
                elif _holds_settings(v) and id(v) not in seen:
                    seen.add(id(v))
                    out.append((i, name, "object", tuple(
                        (k, g) for k, x in vars(v).items() if (g := _frozen(x)) is not _SKIP),
                        False))
        for name in _HOOKS:
            d = getattr(m, name, None)
            if d:  # a hook registered on it (by handle: handles are never reused)
                out.append((i, name, "attr", ("hooks", tuple(d)), False))
    for k, d in enumerate(_global_hooks()):
        if d:
            out.append((-1, f"global{_HOOKS[k]}", "attr", ("hooks", tuple(d)), False))
    return out


def _holds_settings(v: Any) -> bool:
    """``v`` is a configuration object whose attributes are settings: a dataclass instance,
    a ``SimpleNamespace`` / ``argparse.Namespace``, or an instance of a class named
    ``...Config...`` (transformers' ``PretrainedConfig``); not other objects a module may
    hold (a trainer, an optimizer, a scheduler), whose state changes from step to step."""
    if isinstance(v, (torch.Tensor, torch.nn.Module, type)) or callable(v) \
            or not hasattr(v, "__dict__"):
        return False
    return dataclasses.is_dataclass(v) or isinstance(v, (types.SimpleNamespace,
                                                         argparse.Namespace)) \
        or any("Config" in c.__name__ for c in type(v).__mro__)


class Settings:
    """The version of :func:`python_settings` of a model's modules, checked cheaply on every
    call of ``fxad.compile``: by identity of each plain value (a new value is a new object;
    containers compared by value), computed again only when one changed.  Versions are
    small integers, the same for the same values."""

    def __init__(self) -> None:
        self._ids: dict[tuple, int] = {}
        self.frozen: dict[int, tuple] = {}
        self._mods: list | None = None
        self._watch: list = []
        self._hooks: list[tuple[dict, tuple]] = []
        self._current = -1
        #: by ``id(module)``: the attributes of its own its code read while builds were
        #: captured (:func:`recording_reads`); a module missing, or None: every attribute
        #: (before the first build, and for code whose reads cannot be recorded)
        self.relevant: dict[int, frozenset | None] | None = None

    def learn(self, reads: dict[int, set | None]) -> bool:
        """Add the attribute reads of one build (:func:`recording_reads`); returns whether
        the attributes compared changed (the versions are then computed anew)."""
        new = dict(self.relevant or {})
        for mid, names in reads.items():
            old = new.get(mid, frozenset()) if self.relevant is not None else frozenset()
            new[mid] = None if names is None or old is None else old | frozenset(names)
        if new == self.relevant:
            return False
        self.relevant = new
        self._mods = None
        return True

    def snapshot(self, mods: list[torch.nn.Module]) -> list:
        """Every setting's value now (before a capture, which may change some), for
        :meth:`version_of` once the capture's reads are known."""
        return _settings(mods)

    def version_of(self, snapshot: list, mods: list[torch.nn.Module]) -> int:
        """The version the values of ``snapshot`` have under the attributes compared now."""
        frozen = _kept(snapshot, mods, self.relevant)
        v = self._ids.setdefault(frozen, len(self._ids))
        self.frozen[v] = frozen
        return v

    def version(self, mods: list[torch.nn.Module]) -> int:
        if mods is self._mods and self._same():
            return self._current
        frozen = python_settings(mods, self.relevant)
        self._current = self._ids.setdefault(frozen, len(self._ids))
        self.frozen[self._current] = frozen
        self._mods = mods
        self._hooks = [(d, tuple(d)) for d in [getattr(m, h) for m in mods for h in _HOOKS
                                               if isinstance(getattr(m, h, None), dict)]
                       + _global_hooks()]
        self._watch = []
        seen: set[int] = set()
        dicts = [(m.__dict__, _MODULE_INTERNALS, m) for m in mods] + [
            (m._buffers, frozenset(), None) for m in mods] + [
            (vars(v), frozenset(), None) for m in mods for v in m.__dict__.values()
            if _holds_settings(v)]
        for d, internal, owner in dicts:
            if id(d) in seen:
                continue
            seen.add(id(d))
            plain = [(k, v) for k, v in d.items()
                     if k not in internal and _frozen(v) is not _SKIP
                     and (owner is None or _read(self.relevant, owner, k))]
            self._watch.append((d, len(d), tuple(k for k, _ in plain), tuple(v for _, v in plain),
                                [(k, copy.deepcopy(v)) for k, v in plain
                                 if isinstance(v, (list, dict, set))]))
        return self._current

    def _same(self) -> bool:
        if any(tuple(d) != keys for d, keys in self._hooks):
            return False
        for d, n, keys, vals, mutable in self._watch:
            if len(d) != n or not all(map(operator.is_, map(d.get, keys), vals)):
                return False
            if mutable and any(d.get(k) != c for k, c in mutable):  # plain values: ==
                return False
        return True


# torch's and fxad's own code reads modules' __dict__ (hooks, state), which is not the program's
_LIBRARY_DIRS = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(__file__)))
_READS: contextvars.ContextVar[dict | None] = contextvars.ContextVar("fxad_reads", default=None)


def _recorder(cls: type) -> Any:
    """A ``__getattribute__`` for ``cls`` that notes, while :func:`recording_reads` runs,
    each read of an attribute an instance holds in its own ``__dict__`` (a read of
    ``__dict__`` itself: every attribute)."""
    def __getattribute__(self: Any, name: str) -> Any:
        reads = _READS.get()
        if reads is not None:
            names = reads.get(id(self), _SKIP)
            if names is not _SKIP and names is not None:
                if name == "__dict__":
                    if not sys._getframe(1).f_code.co_filename.startswith(_LIBRARY_DIRS):
                        reads[id(self)] = None  # the program's code reads it: every attribute
                elif name in object.__getattribute__(self, "__dict__"):
                    names.add(name)
        return super(cls, self).__getattribute__(name)

    __getattribute__.fxad_recorder = True  # type: ignore[attr-defined]
    return __getattribute__


@contextlib.contextmanager
def recording_reads(mods: list[torch.nn.Module]) -> Iterator[dict[int, set | None]]:
    """Within: the attributes of their own that the modules ``mods`` read, noted by
    ``id(module)`` in the dict yielded (None: every attribute, where a class has a
    ``__getattribute__`` of its own or the code read ``__dict__``); their classes'
    ``__getattribute__`` is replaced meanwhile and put back after.  What
    :meth:`Settings.learn` takes: attributes a build's code never read cannot have decided
    it, so a change of one (a step counter a trainer sets) needs no build."""
    reads: dict[int, set | None] = {id(m): set() for m in mods}
    patched = []
    for cls in {type(m) for m in mods}:
        own = cls.__dict__.get("__getattribute__")
        if own is not None:
            if not getattr(own, "fxad_recorder", False):  # its own: reads not known
                reads.update({id(m): None for m in mods if type(m) is cls})
            continue
        try:
            cls.__getattribute__ = _recorder(cls)
        except TypeError:  # a class that takes no new attribute
            reads.update({id(m): None for m in mods if type(m) is cls})
            continue
        patched.append(cls)
    outer = _READS.get()
    token = _READS.set(reads)
    try:
        yield reads
    finally:
        _READS.reset(token)
        for cls in patched:
            del cls.__getattribute__
        if outer is not None:  # a capture inside a capture: the outer one read them too
            for mid, names in reads.items():
                if mid in outer and outer[mid] is not None:
                    if names is None:
                        outer[mid] = None
                    else:
                        outer[mid] |= names


def changed_settings(old: tuple, new: tuple, names: list[str]) -> list[str]:
    """The attributes whose value differs between two :func:`python_settings` of the same
    modules (``names``: the modules' paths), as ``path.attr (old -> new)``.  Attributes
    both compare come first: one only side has may just not have been read by the code
    that side was computed for (:attr:`Settings.relevant`)."""
    before = {(i, n): v for i, n, v in old}
    after = {(i, n): v for i, n, v in new}
    out = []
    both = [k for k in before if k in after]
    one = [k for k in before if k not in after] + [k for k in after if k not in before]
    for (i, n) in [*both, *one]:
        w, v = before.get((i, n)), after.get((i, n))
        if w == v:
            continue
        where = n if i < 0 else f"{names[i]}.{n}".lstrip(".")
        kind = next((x[0] for x in (v, w) if isinstance(x, tuple) and x[:1] in
                     (("hooks",), ("tensor",), ("object",))), None)
        if kind == "hooks":
            out.append(f"{where} (hooks changed)")
        elif kind == "tensor":
            out.append(f"{where} (another tensor)")
        elif kind == "object" and isinstance(v, tuple) and isinstance(w, tuple):
            inner, now = dict(w[1]), dict(v[1])
            out += [f"{where}.{k} ({inner.get(k)!r} -> {now.get(k)!r})"
                    for k in [*inner, *(k for k in now if k not in inner)]
                    if inner.get(k) != now.get(k)]
        else:
            out.append(f"{where} ({w!r} -> {v!r})")
    return out


def install_settings_check(gm: torch.nn.Module, roots: list[torch.nn.Module]) -> None:
    """Warn (a :class:`fxad.guards.ModeWarning`) on every call of the generated module
    ``gm`` made after a Python attribute of a module in ``roots`` (or of the configuration
    object one holds) changed: the code was specialized on the values at capture
    (:func:`python_settings`; ``fxad.compile`` builds again instead)."""
    mods = list({id(m): m for r in roots for m in r.modules()}.values())
    if not mods:
        return
    settings = Settings()
    built = settings.version(mods)

    def hook(_gm: Any, _args: Any) -> None:
        if torch.compiler.is_compiling():  # torch.compile guards the attributes itself
            return
        now = settings.version(mods)
        if now == built:
            return
        names = [n for r in roots for n, _ in r.named_modules(remove_duplicate=False)]
        changed = changed_settings(settings.frozen[built], settings.frozen[now], names)
        warnings.warn(
            f"this fxad graph was captured with {type(roots[0]).__name__}'s Python attributes "
            "as they were then, and some changed since (" + ", ".join(changed[:3]) + "): the "
            "code is specialized on their values; capture again after changing them "
            "(fxad.compile does so by itself)", ModeWarning, stacklevel=caller_stacklevel())

    gm.register_forward_pre_hook(hook)
