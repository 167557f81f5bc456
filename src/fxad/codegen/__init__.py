"""Code generation: readable names, provenance comments and torch-API spellings.

:func:`name_cotangents` renames cotangent nodes ``d_<primal>`` (a part of a cotangent that
is added to the rest, ``d_<primal>_part``) and the items of multi-output ops
(:mod:`fxad.codegen.names`); :func:`install` makes a graph's generated Python (``gm.code``,
``to_folder``) read as a person writes it:

* functions by their public name (``torch.nn.functional.gelu``, not
  ``torch._C._nn.gelu``; ``torch.split``, not ``torch.functional.split``);
* above each backward block, ``# backward of: <forward statement>  [file.py:line]``
  (``# tangent of: ...`` above forward-mode tangent code);
* a multi-output call as one tuple-unpacking statement,
  ``layer_norm, mean, rstd = torch.native_layer_norm(...)``, and a fused forward kernel whose
  extra outputs nothing reads as the function the user called (:mod:`fxad.codegen.unpack`);
* no argument equal to the op's default (:mod:`fxad.codegen.defaults`);
* a side effect whose result nothing reads as the bare call (``torch.manual_seed(123)``,
  ``print('y', y)``), torch's RNG functions by their ``torch.`` names, and NumPy's replayed
  draws as ``numpy.random.rand(4, 3)`` (``numpy`` is a torch.fx custom builtin: saved code
  imports it).

Only the printing changes (the graph keeps its nodes and arguments), and the printed code is
the code that runs: :func:`install` sets up the graph's code generation before its
``GraphModule`` compiles it.  The transformer relies on the ``# COUNTER: i`` markers FX puts
in the body (torch >= 2.1); without them the code is unchanged apart from the spellings and
the arguments.
"""
from __future__ import annotations

import operator
import re
import types
import weakref
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

try:
    import numpy
    import numpy.random as np_random
except ImportError:  # pragma: no cover - torch without NumPy
    numpy = np_random = None  # type: ignore[assignment]

from ..simplify._util import is_random, resolve
from .defaults import printed_arguments
from .names import AUTO_NAME, name_outputs
from .unpack import Plan, plain_call, plans, render

_COUNTER = re.compile(r"# COUNTER: (\d+)")
_PRIVATE_NN = re.compile(r"\btorch\._C\._nn\.(\w+)\b")
_PRIVATE_VAR = re.compile(r"\btorch\._C\._VariableFunctions\.(\w+)\b")
# torch.fft.rfft is the binding torch._C._fft.fft_rfft (likewise linalg, special)
_PRIVATE_NS = re.compile(r"\btorch\._C\._(fft|linalg|special)\.(?:fft|linalg|special)_(\w+)\b")
# NumPy's draws replayed in the code (fxad.capture.effects): FX names the function
# numpy_random_rand; printed numpy.random.rand, with numpy imported by the code
_NUMPY_RANDOM = re.compile(r"\bnumpy_random_(\w+)\(")
# torch.manual_seed & co. live in torch.random; the torch namespace holds the same functions
_TORCH_RANDOM = re.compile(r"\btorch\.random\.(manual_seed|get_rng_state|set_rng_state|seed)\(")


def _public_ns(m: re.Match) -> str:
    ns, name = m.group(1), m.group(2)
    if hasattr(getattr(torch, ns), name):
        return f"torch.{ns}.{name}"
    return m.group(0)


def _public_name(m: re.Match) -> str:
    name = m.group(1)
    if hasattr(F, name):
        return f"torch.nn.functional.{name}"
    return m.group(0)


def _numpy_random(m: re.Match) -> str:
    name = m.group(1)
    if np_random is not None and hasattr(np_random, name):
        return f"numpy.random.{name}("
    return m.group(0)


def public_spelling(line: str) -> str:
    """Rewrite private module paths of public functions in one line of generated code."""
    line = _NUMPY_RANDOM.sub(_numpy_random, line)
    line = _TORCH_RANDOM.sub(r"torch.\1(", line)
    line = _PRIVATE_NN.sub(_public_name, line)
    line = _PRIVATE_VAR.sub(lambda m: f"torch.{m.group(1)}", line)
    line = _PRIVATE_NS.sub(_public_ns, line)
    return line.replace("torch.functional.", "torch.")


def _statement(lines: list[str]) -> str:
    """The first code line of a node's emitted text, without FX's `x = None` deletions."""
    for ln in lines:
        s = ln.strip()
        if s and not s.startswith("#"):
            return s.split(";  ")[0]
    return ""


class BodyTransformer:
    """Callable installed as the graph's body transformer (see module docstring).  It holds
    its graph weakly, and code generation points it at the graph being generated: a graph
    copied with ``copy.deepcopy`` (which copies its code generator without the memo of the
    copy) shares no reference cycle with its original and prints its own nodes."""

    def __init__(self, graph: fx.Graph, *, annotate: Any = None) -> None:
        self.graph = graph
        self.annotate = annotate  # optional node -> str appended to its line (fxad.show)

    @property
    def graph(self) -> fx.Graph:
        graph = self._graph()
        if graph is None:  # pragma: no cover - a generator outliving its graph
            raise RuntimeError("the graph this code generator belonged to is gone")
        return graph

    @graph.setter
    def graph(self, graph: fx.Graph) -> None:
        self._graph = weakref.ref(graph)

    def __call__(self, body: list[str]) -> list[str]:
        try:
            return self._transform(body)
        finally:  # no node kept between generations (a deep copy would copy its graph)
            self._by_name, self._first_fwd = {}, {}

    def _transform(self, body: list[str]) -> list[str]:
        nodes = list(self.graph.nodes)
        self._by_name = {n.name: n for n in nodes}
        self._first_fwd: dict[str, str] = {}
        for n in nodes:
            of = n.meta.get("fxad_fwd_of")
            if of is not None and "fxad_bwd_of" not in n.meta:
                self._first_fwd.setdefault(of, n.name)
        # group body entries by node
        groups: list[tuple[int | None, list[str]]] = []
        cur: tuple[int | None, list[str]] = (None, [])
        for entry in body:
            m = _COUNTER.fullmatch(entry.strip())
            if m:
                groups.append(cur)
                cur = (int(m.group(1)), [])
            else:
                cur[1].append(public_spelling(entry))
        groups.append(cur)
        absorbed, single = self._unpack(groups, nodes)
        stmt_of: dict[str, str] = {}
        out: list[str] = []
        prev_block: Any = None
        for idx, entries in groups:
            node = nodes[idx] if idx is not None and idx < len(nodes) else None
            if node is not None and node in absorbed:
                # an item the unpacking statement of its call binds: no line of its own
                stmt_of[node.name] = stmt_of.get(absorbed[node].name, "")
                out.append(f"# COUNTER: {idx}\n")
                continue
            if node is not None and node.meta.get("fxad_side_effect") and not node.users \
                    and node.op == "call_function" and node.meta.get("val") is None:
                entries = _bare_call(entries)  # print(...), torch.manual_seed(...): no name
            if node is not None:
                stmt = _statement(entries)
                stmt_of[node.name] = stmt
                block = _block(node)
                if block is not None and block != prev_block and node.op != "placeholder":
                    out.append(self._header(block, node, stmt_of))
                elif block is None and node.meta.get("fxad_inplace") is not None:
                    # the functional form of an in-place statement of the user's
                    block = ("inplace", node.meta["fxad_inplace"])
                    if block != prev_block:
                        loc = node.meta["fxad_inplace"]
                        out.append(f"# in place: {loc.code}  [{loc.short()}]\n")
                prev_block = block if node.op != "placeholder" else prev_block
                if self.annotate is not None and entries:
                    note = self.annotate(single.get(node, node))
                    if note:
                        entries = _append_note(entries, note)
            out.append(f"# COUNTER: {idx}\n" if idx is not None else "")
            out.extend(entries)
        return [e for e in out if e != ""]

    def _unpack(self, groups: list[tuple[int | None, list[str]]], nodes: list[fx.Node],
                ) -> tuple[dict[fx.Node, fx.Node], dict[fx.Node, fx.Node]]:
        """Rewrite the lines of each multi-output call that prints as one statement
        (:func:`fxad.codegen.unpack.plans`) in ``groups``; returns the items whose lines the
        statements replace (item -> call) and, for a call printed as the plain function, the
        item it computes (call -> item)."""
        where = {nodes[idx]: k for k, (idx, _) in enumerate(groups)
                 if idx is not None and idx < len(nodes)}
        absorbed: dict[fx.Node, fx.Node] = {}
        single: dict[fx.Node, fx.Node] = {}
        plain = self.graph._codegen.__dict__.get("_fxad_plain", set())
        for root, plan in plans(self.graph, plain).items():
            done = _unpacked(plan, groups, where)
            if done is None:
                if root in plain:  # (not expected) the call holds its one item itself
                    for m in plan.members:
                        k = where.get(m)
                        if k is not None:
                            groups[k] = (groups[k][0], [re.sub(r"\[0\]", "", e, count=1)
                                                        for e in groups[k][1]])
                continue
            text, plain = done
            groups[where[root]] = (groups[where[root]][0], [text])
            for m in plan.members:
                groups[where[m]] = (groups[where[m]][0], [])
                absorbed[m] = root
            if plain:
                single[root] = plan.members[0]
        return absorbed, single

    def _header(self, block: tuple[str, str], node: fx.Node, stmt_of: dict[str, str]) -> str:
        kind, block = block  # type: ignore[assignment]
        # the statement that computed the forward value: the first node the rule's forward
        # wrote (``native_layer_norm = torch.native_layer_norm(...)`` rather than the
        # ``layer_norm = native_layer_norm[0]`` that picks the value out of its result)
        first = self._first_fwd.get(block)
        if first is not None and _is_draw(self._by_name.get(first)):
            # a random op's rule draws its noise first (``empty_like(x).bernoulli_(0.7)``):
            # name the statement that computes the value instead
            first = self._value_source(block)
        fwd = (stmt_of.get(first, "") if first else "") or stmt_of.get(block, block)
        text = f"# {kind} of: {fwd}" if fwd else f"# {kind} of {block}"
        loc = node.meta.get("fxad_jvp_src" if kind == "tangent" else "fxad_bwd_src")
        if loc is None:
            fwd_node = self._by_name.get(block)
            loc = fwd_node.meta.get("fxad_loc") if fwd_node is not None else None
        if loc is not None:
            text += f"  [{loc.short()}]"
        return text + "\n"


    def _value_source(self, block: str) -> str:
        """The node computing forward value ``block``: the value itself, or the node it picks
        its result out of (``rrelu = rrelu_with_noise_functional[0]``)."""
        node = self._by_name.get(block)
        if node is not None and node.op == "call_function" and node.target is operator.getitem \
                and isinstance(node.args[0], fx.Node) \
                and node.args[0].meta.get("fxad_fwd_of") == block:
            return node.args[0].name
        return block


_ASSIGN = re.compile(r"(?P<ind>[ \t]*)(?P<lhs>\w+) = (?P<rhs>.*?)"
                     r"(?:;  (?P<dels>(?:\w+ = )+)None)?\n?", re.S)
_ITEM_LINE = re.compile(r"(?P<ind>[ \t]*)(?P<lhs>\w+) = (?P<src>\w+)\[(?P<idx>\d+)\]"
                        r"(?:;  (?P<dels>(?:\w+ = )+)None)?\n?")


def _bare_call(entries: list[str]) -> list[str]:
    """``print_1 = print(y);  print_1 = y = None`` → ``print(y);  y = None``: an effect whose
    result nothing reads, printed as the plain call."""
    comments = [e for e in entries if e.lstrip().startswith("#")]
    m = _ASSIGN.fullmatch("".join(e for e in entries if not e.lstrip().startswith("#")))
    if m is None:
        return entries
    dels = [d for d in _deleted(m) if d != m.group("lhs")]
    tail = f";  {' = '.join(dels)} = None" if dels else ""
    return comments + [f"{m.group('ind')}{m.group('rhs')}{tail}\n"]


def _deleted(m: re.Match) -> list[str]:
    return [x for x in (m.group("dels") or "").split(" = ") if x]


def _unpacked(plan: Plan, groups: list[tuple[int | None, list[str]]],
              where: dict[fx.Node, int]) -> tuple[str, bool] | None:
    """The one statement of ``plan`` from the lines FX printed for its call and items, and
    whether it is the plain function's; None when the lines are not the plain assignments
    expected (they stay as printed)."""
    if plan.root not in where or any(m not in where for m in plan.members):
        return None
    head = _ASSIGN.fullmatch("".join(groups[where[plan.root]][1]))
    if head is None or _ITEM_LINE.fullmatch(head.group(0)) is not None:
        return None
    printed: dict[fx.Node, str] = {plan.root: head.group("lhs")}
    dels = _deleted(head)
    for m in plan.members:
        item = _ITEM_LINE.fullmatch("".join(groups[where[m]][1]))
        if item is None or item.group("src") != printed.get(m.args[0]) \
                or int(item.group("idx")) != m.args[1]:
            return None
        printed[m] = item.group("lhs")
        dels += _deleted(item)
    unbound = {printed[plan.root]} | {printed[m] for m in plan.unbound}
    dels = [d for d in dict.fromkeys(dels) if d not in unbound]
    rhs = head.group("rhs")
    plain = plan.single is not None
    target = printed[plan.single] if plain else render(plan.pattern, printed)
    tail = f";  {' = '.join(dels)} = None" if dels else ""
    return f"{head.group('ind')}{target} = {rhs}{tail}\n", plain


def _is_draw(node: fx.Node | None) -> bool:
    """A node that allocates or fills random noise (``torch.empty_like``, ``x.new_empty``,
    ``torch.rand``, an in-place random method)."""
    if node is None:
        return False
    # the in-place random methods are random ops in their records; x.new_empty allocates
    return is_random(node) or (node.op == "call_method" and node.target == "new_empty")


def _block(node: fx.Node) -> tuple[str, str] | None:
    """The provenance block of a node: ``("tangent", fwd)`` for forward-mode tangent code
    (``meta['fxad_jvp_of']``), ``("backward", fwd)`` for reverse-mode code."""
    if node.meta.get("fxad_jvp_of") is not None:
        return ("tangent", node.meta["fxad_jvp_of"])
    if node.meta.get("fxad_bwd_of") is not None:
        return ("backward", node.meta["fxad_bwd_of"])
    return None


def _append_note(entries: list[str], note: str) -> list[str]:
    """Append ``  # note`` to the end of the node's statement (its last body entry)."""
    for i in range(len(entries) - 1, -1, -1):
        if entries[i].endswith("\n") and not entries[i].strip().startswith("#"):
            entries = list(entries)
            entries[i] = entries[i][:-1] + f"  # {note}\n"
            return entries
    return entries


def install(graph: fx.Graph, *, annotate: Any = None) -> None:
    """Set up ``graph``'s code generation (see the module docstring): name the items of
    multi-output ops (unless a ``GraphModule`` already compiled the graph: its code keeps the
    names it has), attach the body transformer (replacing any previous one) and leave out
    default arguments.  Call it before building the graph's ``GraphModule``."""
    if graph.owning_module is None:
        name_outputs(graph)
    cg = graph._codegen
    cg._body_transformer = BodyTransformer(graph, annotate=annotate)
    if not isinstance(cg.__dict__.get("_gen_python_code"), types.MethodType):
        cg._gen_python_code = types.MethodType(_gen_python_code, cg)


def _gen_python_code(self: fx.graph.CodeGen, nodes: Any, *args: Any, **kwargs: Any) -> Any:
    """FX's code generation with each call printed as :func:`printed_call` says; the nodes
    are restored afterwards."""
    # FX's plain printing (not print_readable's verbose, colored or profiled code): a
    # fused kernel may print as its plain function, the body transformer unpacking it
    plain_ok = not any(kwargs.get(k) for k in ("verbose", "colored", "record_func"))
    changed = [(n, new) for n in nodes
               if (new := printed_call(n, plain=plain_ok)) is not None]
    saved = [(n, n.target, n._args, n._kwargs) for n, _ in changed]
    # the calls printed as their plain function, for the body transformer (which runs
    # inside FX's code generation, while the nodes are changed)
    self.__dict__["_fxad_plain"] = {n for n, new in changed if new[0] is not n.target}
    graph = getattr(nodes, "graph", None)  # FX passes the graph's node list
    transformer = getattr(self, "_body_transformer", None)
    if isinstance(transformer, BodyTransformer) and isinstance(graph, fx.Graph):
        transformer.graph = graph  # (a deep copy's generator still names the original)
    try:
        for n, new in changed:
            n.target, n._args, n._kwargs = new
        return type(self)._gen_python_code(self, nodes, *args, **kwargs)
    finally:
        for n, target, a, k in saved:
            n.target, n._args, n._kwargs = target, a, k
        self.__dict__.pop("_fxad_plain", None)


def printed_call(node: fx.Node, *, plain: bool = True) -> tuple[Any, tuple, dict] | None:
    """``(target, args, kwargs)`` ``node`` prints with: the plain function for a fused
    forward kernel whose extra outputs nothing reads (:func:`fxad.codegen.unpack.plain_call`)
    and without the arguments equal to the op's defaults
    (:func:`fxad.codegen.defaults.printed_arguments`); None when it prints as it is.
    ``plain=False``: never as the plain function."""
    if node.op not in ("call_function", "call_method"):
        return None
    target, args, kwargs = node.target, tuple(node.args), dict(node.kwargs)
    try:
        form = plain_call(node) if plain else None
    except Exception:  # noqa: BLE001  (printing never fails: the node prints as it is)
        form = None
    if form is not None:
        target, args, kwargs = form[0], tuple(form[1]), dict(form[2])
    old = (node.target, node._args, node._kwargs)
    try:
        node.target, node._args, node._kwargs = target, args, kwargs
        trimmed = printed_arguments(node)
    except Exception:  # noqa: BLE001
        trimmed = None
    finally:
        node.target, node._args, node._kwargs = old
    if trimmed is not None:
        args, kwargs = trimmed
    elif form is None:
        return None
    return target, tuple(args), dict(kwargs)


def name_cotangents(graph: fx.Graph, output_names: dict[fx.Node, str]) -> None:
    """Give cotangent nodes readable names.

    Args:
        graph: VJP graph.
        output_names: nodes returned as gradients → the name they should carry
            (``d_x``, ``d_l1_weight``); other nodes with ``meta['fxad_cot_of'] = v`` become
            ``d_v`` (unless computed by the forward: a forward value that is also a
            cotangent keeps its name), an item of a multi-output result added to ``d_v``
            ``d_v_part``, and the
            other items of multi-output ops get the names of
            :func:`fxad.codegen.names.name_outputs`.  Placeholders keep their names; clashes
            get FX's numeric suffix.
    """
    taken: set[fx.Node] = set()
    for node, name in output_names.items():
        if node.op in ("placeholder", "get_attr") or node in taken:
            continue
        if node.name != name:
            node._rename(name)
        taken.add(node)
    for node in graph.nodes:
        if node in taken or node.op != "call_function" and node.op != "call_method":
            continue
        if "fxad_bwd_of" not in node.meta or "fxad_fwd_of" in node.meta:
            continue  # a forward value that is also a cotangent keeps its name
        of = node.meta.get("fxad_cot_of")
        if of:
            of = resolve(graph, of)
        if of and not node.name.startswith("d_"):
            node._rename(f"d_{of}")
    # a part of a cotangent: an item of a backward kernel's result added to the rest
    for node in graph.nodes:
        if node.op == "call_function" and node.target is operator.getitem \
                and AUTO_NAME.fullmatch(node.name) and len(node.users) == 1:
            (user,) = node.users
            if user.op == "call_function" and user.target is operator.add \
                    and user.meta.get("fxad_cot_of") and user.name.startswith("d_"):
                node._rename(f"{user.name}_part")
    name_outputs(graph)


def shape_note(node: fx.Node) -> str:
    """``f32[64,128]`` for a tensor node (used by :func:`fxad.show`)."""
    v = node.meta.get("val")
    if isinstance(v, torch.Tensor):
        return f"{_DT.get(v.dtype, str(v.dtype).replace('torch.', ''))}[{','.join(map(str, v.shape))}]"
    if isinstance(v, (tuple, list)) and v and all(isinstance(x, torch.Tensor) for x in v):
        return "(" + ", ".join(
            f"{_DT.get(x.dtype, str(x.dtype))}[{','.join(map(str, x.shape))}]" for x in v) + ")"
    return ""


_DT = {torch.float32: "f32", torch.float64: "f64", torch.float16: "f16", torch.bfloat16: "bf16",
       torch.int64: "i64", torch.int32: "i32", torch.bool: "b8", torch.uint8: "u8",
       torch.int8: "i8", torch.complex64: "c64", torch.complex128: "c128"}


def _register_numpy() -> None:
    """``numpy`` importable by generated code that replays NumPy's draws (saved code
    imports it: ``import numpy``)."""
    try:
        from torch.fx.graph import _register_custom_builtin
    except ImportError:  # pragma: no cover - very old torch
        return
    if numpy is not None:
        _register_custom_builtin("numpy", "import numpy", numpy)


_register_numpy()
