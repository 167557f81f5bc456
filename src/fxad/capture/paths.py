"""Random decisions captured path by path, joined into nested ``torch.cond``.

An ``if`` on a random draw becomes one ``torch.cond`` (:mod:`fxad.capture.autograph`) when
its two branches end in the same Python state: the same variables bound, tensors of the same
shapes, no change to an object that outlives the branch.  LayerDrop loops often break that:
x-transformers' ``if random() < layer_dropout: continue`` skips a body that appends to
lists the rest of the program reads and binds ``first_self_attn_inter`` on one path only;
Informer's skipped layer also skips a convolution that halves the sequence.  Python cannot run
a branch twice from one state, so such a decision is captured *path by path*:

* the decision's site (file, line) is marked; capture runs the program again, once per
  sequence of outcomes of the marked decisions met on the way (:class:`Forks`: the first
  decisions forced, the next one taken true and its other outcome queued), each run an
  ordinary capture of one path, Python state and all;
* the paths agree node for node up to their first differing decision (capture is
  deterministic), so they join into one graph (:func:`merge_paths`): the common part, then a
  ``cond`` on the decision's predicate whose branches are *the rest of the program* on each
  side (themselves joined the same way at the next decision), returning the program's
  outputs.  So one build follows the draw of every call.
* Python's and NumPy's draws made after a decision are made before its ``cond`` (they do
  not depend on tensors; the paths must make the same draws, in the same order), and the
  parameters the branches read become operands of the ``cond``, so their gradients flow.

Paths grow as 2^decisions: past :data:`MAX_PATHS` the capture is refused naming the first
decision's line.  The branches hold the rest of the program, so they must not hold effects
a ``cond`` branch cannot (a print, a seeding, a value guard, a write to an input after the
decision; a buffer update, as BatchNorm's, is no obstacle): refused naming their line, as
are paths whose outputs differ in structure, shape or dtype.  A path on which the program
raises (a Python error, or a torch call that fails on its shapes) becomes a branch that
raises the same exception when a call takes it (:func:`fxad.ops.program_error`), with a
warning at build time; where every path raises, the capture raises.
"""
from __future__ import annotations

import contextlib
import operator
import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.fx as fx

from ..errors import CaptureError, DataDependentError, FxadError, SourceLoc
from ..graph.proxy import fetch_attr
from ..ops import cond as cond_op
from ..ops import program_error
from ..simplify._util import draws_random
from .control import _fresh, updates_buffer
from .effects import _FXAD_DIR, _TORCH_DIR, numpy_draw, python_draw
from .normalize import normalize

__all__ = ["MAX_PATHS", "Decision", "Forks", "ForkSite", "current_forks", "forks_scope",
           "capture_paths", "merge_paths", "program_error_of"]

# most paths captured for one program (2^6: six decisions captured path by path)
MAX_PATHS = 64


@dataclass
class Decision:
    """One decision taken at a site captured path by path."""

    site: tuple[str, int]      # (file, line) of the `if`
    loc: SourceLoc | None
    outcome: bool
    split: int                 # nodes in the graph when the decision was taken
    pred: int                  # the predicate's position among them


@dataclass
class Forks:
    """The sites captured path by path (``sites``), the outcomes forced on the decisions met
    there (``forced``, in order), the decisions taken so far (``taken``) and the session of
    the top-level capture (decisions inside a ``cond`` body or a checkpoint region are not
    forked)."""

    sites: set = field(default_factory=set)
    forced: tuple = ()
    taken: list = field(default_factory=list)
    session: Any = None

    def take(self, cap: Any, pred_node: fx.Node, site: tuple[str, int],
             loc: SourceLoc | None) -> bool:
        """The outcome of the next decision at a forked site, recorded with where the graph
        splits."""
        k = len(self.taken)
        outcome = self.forced[k] if k < len(self.forced) else True
        nodes = list(cap.graph.nodes)
        self.taken.append(Decision(site, loc, outcome, len(nodes), nodes.index(pred_node)))
        return outcome


class ForkSite(Exception):
    """Capture must run path by path at ``site``: a ``torch.cond`` there cannot carry what
    the branches leave different (``why``)."""

    def __init__(self, site: tuple[str, int], loc: SourceLoc | None, why: str) -> None:
        super().__init__(f"capture restarts path by path at {site[0]}:{site[1]}")
        self.site, self.loc, self.why = site, loc, why


_STACK: list[Forks] = []


def current_forks() -> Forks | None:
    """The :class:`Forks` of the capture running now (None outside capture)."""
    return _STACK[-1] if _STACK else None


@contextlib.contextmanager
def forks_scope(forks: Forks) -> Iterator[Forks]:
    _STACK.append(forks)
    try:
        yield forks
    finally:
        _STACK.pop()


@dataclass
class _Path:
    outcomes: tuple
    gm: fx.GraphModule | None
    taken: list
    error: BaseException | None = None   # what the program raised on this path


class _Raises:
    """A subtree of paths on which the program raises (``path.error``)."""

    def __init__(self, path: _Path) -> None:
        self.path = path


def program_error_of(e: BaseException) -> BaseException | None:
    """The error the traced program itself raised, if ``e`` is one: an exception raised
    outside fxad's package (the program's Python, or a torch function it called), or a
    :class:`~fxad.errors.CaptureError` for a torch call that failed on the example shapes
    with a Python exception (``torch.stack([])``); ``None`` for fxad's own errors."""
    if isinstance(e, FxadError):
        cause = e.__cause__
        if isinstance(e, CaptureError) and not isinstance(e, DataDependentError) \
                and cause is not None and type(cause).__module__ == "builtins" \
                and program_error_of(cause):
            loc = getattr(e, "loc", None)
            if loc is not None:  # the program's line that called torch
                cause._fxad_line = f"{loc.filename}:{loc.lineno}"  # type: ignore[union-attr]
            return cause
        return None
    tb = e.__traceback__
    last = None
    while tb is not None:
        last = tb.tb_frame.f_code.co_filename
        tb = tb.tb_next
    return e if last is not None and not os.path.abspath(last).startswith(_FXAD_DIR) else None


def _program_line(e: BaseException) -> str:
    """The innermost line of ``e``'s traceback in neither torch's nor fxad's code."""
    if getattr(e, "_fxad_line", None):
        return e._fxad_line  # type: ignore[attr-defined]
    tb, found = e.__traceback__, None
    while tb is not None:
        name = os.path.abspath(tb.tb_frame.f_code.co_filename)
        if not name.startswith((_TORCH_DIR, _FXAD_DIR)):
            found = f"{name}:{tb.tb_lineno}"
        tb = tb.tb_next
    return found or "an unknown line"


def capture_paths(run: Callable[[tuple], tuple[Any, list[Decision], Any]],
                  first: ForkSite) -> fx.GraphModule:
    """Every path of the program: ``run(forced)`` captures the one whose forked decisions
    begin with the outcomes ``forced`` (the later ones taken true) and returns the graph, the
    decisions taken and ``None``, or ``None``, the decisions taken and the exception the
    program raised on that path (after at least one decision: the generated code raises it
    where a call takes that path, with a warning now); the paths are joined by
    :func:`merge_paths`.

    Raises:
        DataDependentError: more than :data:`MAX_PATHS` paths, naming ``first``'s line.
    """
    paths: list[_Path] = []
    todo: list[tuple] = [()]
    while todo:
        forced = todo.pop()
        gm, taken, error = run(forced)
        outcomes = tuple(d.outcome for d in taken)
        todo.extend(outcomes[:j] + (not outcomes[j],) for j in range(len(forced), len(taken)))
        paths.append(_Path(outcomes, gm, taken, error))
        if len(paths) + len(todo) > MAX_PATHS:
            raise DataDependentError(
                f"a Python `if` on a random draw leaves Python state different on its two "
                f"paths ({first.why}), so fxad captures the program once per path; this call "
                f"meets {len(taken)} such decisions, more than {MAX_PATHS} paths in all",
                op="if", loc=first.loc,
                hint="make the branches end alike (the same variables bound, tensors of the "
                     "same shapes, no change to lists or objects from outside the branch), "
                     "or write the choice as torch.cond")
    return merge_paths(paths)


# -- joining the paths -------------------------------------------------------------------------

_SLOT = object()


def merge_paths(paths: list[_Path]) -> fx.GraphModule:
    """One graph for ``paths`` (captures of one program that differ only in forked
    decisions): their common part, a ``cond`` at each decision, the rest of the program
    in its branches.  The graph module's attributes are those of every path (renamed where
    two paths hold different objects under one name)."""
    ok = [p for p in paths if p.gm is not None]
    if not ok:  # the program raises on every path: as eager code would
        raise paths[0].error  # type: ignore[misc]
    for p in paths:
        if p.error is not None:
            warnings.warn(
                f"the traced program raises {type(p.error).__name__} ({p.error}) at "
                f"{_program_line(p.error)} when its random decisions at "
                f"{', '.join(sorted({_where(d.loc) for d in p.taken}))} come out "
                f"{', '.join(str(d.outcome) for d in p.taken)}; the generated code raises it "
                "on a call that takes that path, as the program does", stacklevel=6)
    attrs: dict[str, Any] = {}
    graphs = [_rebased(p.gm, attrs) if p.gm is not None else _Raises(p) for p in paths]
    # a module's derivative code reads its attributes from the module itself: the branch
    # graphs (and any attribute renamed here) are kept on it, as capture keeps its own
    source = ok[0].gm.meta.get("fxad_source_module")
    joiner = _Joiner(attrs, source if isinstance(source, torch.nn.Module) else None)
    graph = joiner.merge(list(zip(paths, graphs)), 0)
    assert isinstance(graph, fx.Graph)
    for n in list(graph.nodes):  # items of multi-output ops no path used
        if n.meta.get("fxad_auto_getitem") and not n.users:
            graph.erase_node(n)
    first = ok[0].gm
    if joiner.source is not None:
        for name, obj in attrs.items():
            if "." not in name and not hasattr(joiner.source, name):
                object.__setattr__(joiner.source, name, obj)
    gm = fx.GraphModule(attrs, graph, class_name=type(first).__name__)
    gm.meta.update(first.meta)
    gm.meta["fxad_value_inputs"] = sorted({i for p in ok
                                           for i in p.gm.meta.get("fxad_value_inputs", ())})
    consts: list = []
    for p in ok:
        for obj, value in p.gm.meta.get("fxad_value_constants", ()):
            if not any(obj is o for o, _ in consts):
                consts.append((obj, value))
    gm.meta["fxad_value_constants"] = consts
    gm.meta["fxad_paths"] = len(paths)
    return gm


def _rebased(gm: fx.GraphModule, attrs: dict[str, Any]) -> fx.Graph:
    """A copy of ``gm``'s graph whose attribute names index ``attrs`` (an object already
    there under another name keeps that name; a name taken by another object is changed)."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in gm.graph.nodes:
        new = graph.node_copy(n, lambda a: env[a])
        if n.op in ("get_attr", "call_module"):
            obj = fetch_attr(gm, n.target)
            name = next((k for k, v in attrs.items() if v is obj), None)
            if name is None:
                name, k = n.target, 0
                while name in attrs:
                    k += 1
                    name = f"{n.target.replace('.', '_')}_path{k}"
                attrs[name] = obj
            new.target = name
        env[n] = new
    return graph


class _Joiner:
    def __init__(self, attrs: dict[str, Any], source: torch.nn.Module | None) -> None:
        self.attrs = attrs
        self.source = source

    def merge(self, items: list[tuple[_Path, Any]], k: int) -> fx.Graph | _Raises:
        """The graph of the paths ``items``, which share their first ``k`` outcomes (a
        :class:`_Raises` where the program raises on all of them)."""
        if len(items) == 1 and len(items[0][0].taken) == k:
            return items[0][1]
        dec = items[0][0].taken[k]
        yes = [it for it in items if it[0].outcomes[k]]
        no = [it for it in items if not it[0].outcomes[k]]
        if not yes or not no or any(len(p.taken) <= k for p, _ in items):
            raise AssertionError("paths captured path by path do not form a tree")
        g_true, g_false = self.merge(yes, k + 1), self.merge(no, k + 1)
        if isinstance(g_true, _Raises) and isinstance(g_false, _Raises):
            return g_true
        return self.join(g_true, g_false, dec)

    def join(self, g_true: fx.Graph | _Raises, g_false: fx.Graph | _Raises,
             dec: Decision) -> fx.Graph:
        """``g_true`` and ``g_false`` (equal in their first ``dec.split`` nodes) as one graph:
        that common part, then ``cond(pred, rest of g_true, rest of g_false)``.  A side on
        which the program raises takes the other side's common part and raises in its
        branch."""
        raises = g_true if isinstance(g_true, _Raises) else \
            g_false if isinstance(g_false, _Raises) else None
        raising_side = None if raises is None else "true" if raises is g_true else "false"
        if raises is not None:
            ok = g_false if raises is g_true else g_true
            assert isinstance(ok, fx.Graph)
            g_true = g_false = ok
        nt, nf = list(g_true.nodes), list(g_false.nodes)
        s = dec.split
        graph = fx.Graph()
        env_t: dict[fx.Node, fx.Node] = {}
        env_f: dict[fx.Node, fx.Node] = {}
        for a, b in zip(nt[:s], nf[:s]):
            if a.op != b.op or a.op == "output" or (a.op != "get_attr" and a.target != b.target):
                raise DataDependentError(
                    "the program computes something else before a random decision on each "
                    f"run (`{a.format_node()}` against `{b.format_node()}`), so fxad cannot "
                    "join the runs of its paths", op="if", loc=dec.loc,
                    hint="keep the program deterministic apart from its random draws")
            new = graph.node_copy(a, lambda x: env_t[x])
            env_t[a] = env_f[b] = new
        pred = env_t[nt[dec.pred]]
        rest_t = [n for n in nt[s:] if n.op != "output"]
        rest_f = [n for n in nf[s:] if n.op != "output"]
        self._hoist(graph, rest_t, env_t, rest_f, env_f, dec)
        body_t = [n for n in rest_t if n not in env_t]
        body_f = [n for n in rest_f if n not in env_f]
        for n in body_t + body_f:  # (a torch draw is no obstacle: a cond replays its RNG)
            if n.meta.get("fxad_side_effect") and not draws_random(n) \
                    and not n.meta.get("fxad_buffer_write") and n.target is not program_error:
                loc = n.meta.get("fxad_loc")
                raise DataDependentError(
                    f"`{n.format_node()}` runs after a random decision that fxad captures path "
                    f"by path (at {_where(dec.loc)}): the rest of the program becomes a "
                    "branch of a torch.cond, which cannot hold an effect (a print, a seeding, "
                    "a value guard, a write to an input)", op="if", loc=loc or dec.loc,
                    hint="make the branches of the `if` end alike (the same variables bound, "
                         "tensors of the same shapes, no change to objects from outside), or "
                         "move the effect before the decision")
        out_t, out_f = nt[-1].args[0], nf[-1].args[0]
        leaves_t: list[fx.Node] = []
        leaves_f: list[fx.Node] = []
        skel_t = fx.node.map_arg(out_t, lambda n: leaves_t.append(n) or _SLOT)
        skel_f = fx.node.map_arg(out_f, lambda n: leaves_f.append(n) or _SLOT)
        if not _same_skeleton(skel_t, skel_f):
            raise DataDependentError(
                "the program returns values of different structure after the two outcomes "
                f"of a random decision ({out_t!r} and {out_f!r})", op="if", loc=dec.loc,
                hint="return the same structure on every path")
        direct: dict[int, fx.Node] = {}
        outs: list[tuple[fx.Node, fx.Node]] = []
        for j, (a, b) in enumerate(zip(leaves_t, leaves_f)):
            if a in env_t and env_t[a] is env_f.get(b):
                direct[j] = env_t[a]
                continue
            va, vb = a.meta.get("val"), b.meta.get("val")
            if not (isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor)
                    and va.shape == vb.shape and va.dtype == vb.dtype):
                raise DataDependentError(
                    f"output {j} of the program is {_describe(va)} after one outcome of a "
                    f"random decision and {_describe(vb)} after the other", op="if",
                    loc=dec.loc, hint="return tensors of the same shapes and dtypes on every "
                                      "path")
            outs.append((a, b))
        produced: list[fx.Node] = []
        if raises is not None:  # the tensor outputs through the cond: one side raises
            direct = {j: env_t[a] for j, a in enumerate(leaves_t)
                      if not isinstance(a.meta.get("val"), torch.Tensor)}
            outs = [(a, a) for j, a in enumerate(leaves_t) if j not in direct]
        if outs:
            operands = self._operands(graph, body_t, env_t, body_f, env_f, outs)
            tn = self._branch(graph, body_t, env_t, [a for a, _ in outs], operands, "true",
                              raises if raising_side == "true" else None)
            fn_ = self._branch(graph, body_f, env_f, [b for _, b in outs], operands, "false",
                               raises if raising_side == "false" else None)
            node = graph.create_node("call_function", cond_op, (pred, tn, fn_, tuple(operands)),
                                     {})
            vals = [_fresh(a.meta["val"]) for a, _ in outs]
            node.meta["val"] = vals[0] if len(vals) == 1 else tuple(vals)
            if dec.loc is not None:
                node.meta["fxad_loc"] = dec.loc
            if any(draws_random(n) or n.meta.get("fxad_draws_random") for n in body_t + body_f):
                node.meta["fxad_draws_random"] = True
            if len(vals) == 1:
                produced = [node]
            else:
                for i, v in enumerate(vals):
                    item = graph.create_node("call_function", operator.getitem, (node, i), {})
                    item.meta["val"] = v
                    produced.append(item)
        it = iter(produced)
        final = [direct[j] if j in direct else next(it) for j in range(len(leaves_t))]
        it2 = iter(final)
        graph.output(fx.node.map_aggregate(skel_t, lambda x: next(it2) if x is _SLOT else x))
        return graph

    def _hoist(self, graph: fx.Graph, rest_t: list, env_t: dict, rest_f: list, env_f: dict,
               dec: Decision) -> None:
        """Python's and NumPy's draws of both rests made before the ``cond`` (the same draws
        in the same order on both paths), and the tensors the rests read as attributes
        (parameters, buffers, constants) fetched before it: operands, not body nodes."""
        draws_t = [n for n in rest_t if _python_draw(n)]
        draws_f = [n for n in rest_f if _python_draw(n)]
        if [(n.target, n.args) for n in draws_t] != [(n.target, n.args) for n in draws_f]:
            raise DataDependentError(
                "the two outcomes of a random decision that fxad captures path by path make "
                "different draws from Python's (or NumPy's) generator afterwards, so the draws "
                "cannot be made before the torch.cond that holds the rest of the program",
                op="if", loc=dec.loc,
                hint="draw the same numbers on every path (draw before the `if`)")
        for a, b in zip(draws_t, draws_f):
            new = graph.node_copy(a, lambda x: env_t[x])
            env_t[a] = env_f[b] = new
        fetched: dict[str, fx.Node] = {}
        for rest, env in ((rest_t, env_t), (rest_f, env_f)):
            for n in rest:
                if n.op == "get_attr" and not isinstance(self.attrs.get(n.target),
                                                         fx.GraphModule):
                    if n.target not in fetched:
                        fetched[n.target] = graph.node_copy(n)
                    env[n] = fetched[n.target]

    @staticmethod
    def _operands(graph: fx.Graph, body_t: list, env_t: dict, body_f: list, env_f: dict,
                  outs: list) -> list[fx.Node]:
        """The nodes of ``graph`` either body (or output) reads, in graph order."""
        used: set[fx.Node] = set()
        for body, env in ((body_t, env_t), (body_f, env_f)):
            for n in body:
                used.update(env[a] for a in n.all_input_nodes if a in env)
        for a, b in outs:
            used.update(env[x] for x, env in ((a, env_t), (b, env_f)) if x in env)
        return [n for n in graph.nodes if n in used]

    def _branch(self, graph: fx.Graph, body: list, env: dict, results: list,
                operands: list, side: str, raises: _Raises | None = None) -> fx.Node:
        """The branch graph (``operands`` in, ``results`` out; where the program raises on
        the side, zeros of the results' shapes after a :func:`fxad.ops.program_error` that
        raises it) kept as an attribute, and the ``get_attr`` node of ``graph`` that reads
        it."""
        sub = fx.Graph()
        inputs: dict[fx.Node, fx.Node] = {}
        for i, op in enumerate(operands):
            ph = sub.placeholder(f"arg{i}")
            ph.meta["val"] = op.meta.get("val")
            inputs[op] = ph
        local: dict[fx.Node, fx.Node] = {}

        def arg(x: fx.Node) -> fx.Node:
            return local[x] if x in local else inputs[env[x]]

        if raises is None:
            for n in body:
                local[n] = sub.node_copy(n, arg)
            got = [arg(r) for r in results]
        else:
            got = []
            for r in results:
                v = r.meta["val"]
                z = sub.create_node("call_function", torch.zeros, (tuple(v.shape),),
                                    {"dtype": v.dtype, "device": v.device})
                z.meta.update(val=_fresh(v), fxad_no_grad=True)
                got.append(z)
            e = raises.path.error
            message = f"{e} (raised at {_program_line(e)}, on this path of the program's " \
                      "random decisions)"
            err = sub.create_node("call_function", program_error,
                                  (got[0], type(e).__name__, message), {})
            err.meta.update(val=got[0].meta["val"], fxad_no_grad=True, fxad_side_effect=True)
            got[0] = err
        sub.output(got[0] if len(got) == 1 else tuple(got))
        k = 0
        while f"_fxad_path_{side}_{k}" in self.attrs or hasattr(self.source,
                                                                 f"_fxad_path_{side}_{k}"):
            k += 1
        name = f"_fxad_path_{side}_{k}"
        with torch._C.DisableTorchFunction():
            gm = fx.GraphModule(self.attrs, sub, class_name=f"{side}_branch")
            normalize(gm)
        gm.meta["fxad_subgraph"] = f"{side}_branch"
        self.attrs[name] = gm
        node = graph.create_node("get_attr", name, (), {})
        node.meta["val"] = gm
        return node


def _python_draw(n: fx.Node) -> bool:
    return n.op == "call_function" and n.target in (python_draw, numpy_draw)


def _same_skeleton(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_skeleton(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_skeleton(a[k], b[k]) for k in a)
    if a is _SLOT or b is _SLOT:
        return a is b
    try:
        return bool(a == b)
    except Exception:
        return False


def _describe(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return f"a tensor of {str(v.dtype)[6:]}{list(v.shape)}"
    return repr(v)


def _where(loc: SourceLoc | None) -> str:
    return f"{loc.filename}:{loc.lineno}" if loc is not None else "an unknown line"
