"""The source rewrite behind :mod:`fxad.capture.autograph`: a function's ``if`` statements
as calls of autograph's helpers.

:func:`rewrite` parses a function's source (:mod:`ast`) and replaces each ``if`` statement
that can become a conditional by ``if_stmt(test, true_fn, false_fn, names, locals(), line)``,
its branches nested functions of the variables they assign; ``not``/``and``/``or`` in tests
and ``a if c else b`` become ``not_``/``and_``/``or_``/``if_exp``; ``continue`` in a loop
body becomes an ``else`` block or a flag (:func:`_fold_continue`, :func:`_flag_continue`);
every read of a variable a converted ``if`` assigns becomes ``use(v)``
(:class:`_ReadsChecked`), and the object of every in-place change inside a branch goes
through ``mutated(obj, ...)`` first (:class:`_MutationsChecked`).  The new code object keeps
the function's free variables, ``super()`` cell, private-name mangling and name (its branch
functions carry the function's name too).  What cannot be rewritten raises
:class:`CannotRewrite` with the reason.
"""
from __future__ import annotations

import ast
import inspect
import textwrap
import types
from typing import Any, Sequence

__all__ = ["CannotRewrite", "META", "REWRITTEN", "HELPERS", "rewrite"]

# the name the rewritten code imports fxad.capture.autograph as
HELPERS = "_fxad_autograph"
_HELPERS = HELPERS
# methods that change a list, dict or set in place (not names of tensor methods: `x.add(y)`
# and `x.sort()` compute new tensors)
_MUTATORS = {"append", "extend", "insert", "pop", "remove", "clear", "update", "setdefault",
             "discard", "popitem", "__setitem__"}
# every code object made by a rewrite (the functions and their branch functions)
REWRITTEN: set[types.CodeType] = set()


class CannotRewrite(Exception):
    pass


class _Meta:
    def __init__(self) -> None:
        self.lines: set[int] = set()       # test lines of the converted ifs
        self.refused: dict[tuple[int, int], str] = {}


META: dict[types.CodeType, _Meta] = {}


def rewrite(func: types.FunctionType) -> types.CodeType:
    code = func.__code__
    if code.co_flags & (inspect.CO_GENERATOR | inspect.CO_COROUTINE
                        | inspect.CO_ASYNC_GENERATOR):
        raise CannotRewrite(f"`{code.co_name}` is a generator or coroutine")
    try:
        lines, start = inspect.getsourcelines(code)
    except (OSError, TypeError) as e:
        raise CannotRewrite(f"the source of `{code.co_name}` is not available ({e})") from e
    tree = ast.parse(textwrap.dedent("".join(lines)))
    fdef = tree.body[0] if tree.body else None
    if not isinstance(fdef, ast.FunctionDef) or fdef.name != code.co_name:
        raise CannotRewrite(f"the source of `{code.co_name}` could not be parsed as its def")
    ast.increment_lineno(tree, start - 1)
    meta = _Meta()
    _Converter(code.co_filename, code.co_name, fdef, meta).run()
    if not meta.lines:
        why = next(iter(meta.refused.values()), "no `if` in it can be converted")
        raise CannotRewrite(why)
    new = _compile(fdef, code)
    META[new] = meta
    _mark(new)
    return new


def _mark(code: types.CodeType) -> None:
    REWRITTEN.add(code)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            _mark(c)


def _compile(fdef: ast.FunctionDef, code: types.CodeType) -> types.CodeType:
    """Compile ``fdef`` so that its code object has ``code``'s free variables (a factory
    function binds them; a class of the method's own class name gives ``super()`` its
    ``__class__`` cell and private names their mangling)."""
    fdef.decorator_list = []
    fdef.returns = None
    for a in fdef.args.posonlyargs + fdef.args.args + fdef.args.kwonlyargs \
            + [fdef.args.vararg, fdef.args.kwarg]:
        if a is not None:
            a.annotation = None
    imp = ast.ImportFrom(module="fxad.capture", names=[ast.alias("autograph", _HELPERS)],
                         level=0)
    fdef.body.insert(0, _here(imp, fdef.lineno))
    parts = code.co_qualname.split(".")
    owner = parts[-2] if len(parts) >= 2 and parts[-2].isidentifier() else None
    inner: ast.stmt = fdef
    if owner is not None:
        inner = ast.ClassDef(name=owner, bases=[], keywords=[], body=[fdef], decorator_list=[])
        ret: ast.expr = ast.Subscript(ast.Attribute(ast.Name(owner, ast.Load()), "__dict__",
                                                    ast.Load()),
                                      ast.Constant(_mangled(fdef.name, owner)), ast.Load())
    else:
        ret = ast.Name(fdef.name, ast.Load())
    free = [n for n in code.co_freevars if n != "__class__"]
    factory = ast.FunctionDef(
        name="_fxad_factory",
        args=ast.arguments(posonlyargs=[], args=[ast.arg(n) for n in free], vararg=None,
                           kwonlyargs=[], kw_defaults=[], kwarg=None, defaults=[]),
        body=[inner, ast.Return(ret)], decorator_list=[], returns=None)
    module = ast.Module(body=[_here(factory, fdef.lineno)], type_ignores=[])
    scope: dict[str, Any] = {}
    exec(compile(module, code.co_filename, "exec", dont_inherit=True), scope)  # noqa: S102
    fn = scope["_fxad_factory"](*[None] * len(free))
    new = fn.__code__
    if new.co_freevars != code.co_freevars:
        raise CannotRewrite(f"the rewritten `{code.co_name}` reads other variables of its "
                             "enclosing scope than the original")
    return _branches_named(new, code.co_name).replace(co_qualname=code.co_qualname)


def _branches_named(code: types.CodeType, name: str) -> types.CodeType:
    """``code`` with its branch functions (``_fxad_if<k>_true``, nested at any depth) named
    ``name``, the user's function, as tracebacks and fxad's messages show them."""
    consts = tuple(_branches_named(c, name) if isinstance(c, types.CodeType) else c
                   for c in code.co_consts)
    if code.co_name.startswith("_fxad_if"):
        code = code.replace(co_name=name, co_qualname=name)
    return code.replace(co_consts=consts)


def _mangled(name: str, owner: str) -> str:
    if name.startswith("__") and not name.endswith("__") and owner.strip("_"):
        return f"_{owner.lstrip('_')}{name}"
    return name


def _assigned(stmts: Sequence[ast.stmt]) -> list[str]:
    """Names the statements bind (in order of first binding), not those of nested scopes."""
    out: list[str] = []

    def add(name: str) -> None:
        if name not in out:
            out.append(name)

    def visit(node: ast.AST) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            add(node.name)
            for d in node.decorator_list:
                visit(d)
            return
        if isinstance(node, (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp,
                             ast.GeneratorExp)):
            return
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            add(node.id)
        elif isinstance(node, ast.NamedExpr):
            add(node.target.id)
        elif isinstance(node, ast.alias):
            add((node.asname or node.name).split(".")[0])
        elif isinstance(node, ast.ExceptHandler) and node.name:
            add(node.name)
        for child in ast.iter_child_nodes(node):
            visit(child)

    for s in stmts:
        visit(s)
    return out


def _obstacle(stmts: Sequence[ast.stmt], declared: set[str]) -> str | None:
    """Why these branch statements cannot become a function body, or None."""
    def visit(node: ast.AST, loop: int) -> str | None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            return None
        if isinstance(node, ast.Return):
            return "a branch returns from the function"
        if isinstance(node, (ast.Break, ast.Continue)) and not loop:
            return f"a branch uses `{type(node).__name__.lower()}` out of its loop"
        if isinstance(node, (ast.Yield, ast.YieldFrom, ast.Await)):
            return "a branch yields or awaits"
        if isinstance(node, (ast.Global, ast.Nonlocal)):
            return "a branch declares global or nonlocal names"
        if isinstance(node, ast.Delete):
            return "a branch deletes a name or an item"
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                for sub in ast.walk(t):
                    if isinstance(sub, ast.Name) and sub.id in declared:
                        return f"a branch assigns the global or nonlocal name `{sub.id}`"
        inner = loop + isinstance(node, (ast.For, ast.While, ast.AsyncFor))
        # a loop's `else:` block is outside the loop (an `a if c else b` has an expression)
        after = node.orelse if isinstance(getattr(node, "orelse", None), list) else ()
        for child in ast.iter_child_nodes(node):
            why = visit(child, inner if child not in after else loop)
            if why:
                return why
        return None

    for s in stmts:
        why = visit(s, 0)
        if why:
            return why
    return None


def _here(node: Any, line: int) -> Any:
    """Give ``node`` and its sub-nodes without a location the one-line location ``line``
    (a location over several lines would put attribute loads and calls on its last line,
    where tracebacks and fxad's messages would then point)."""
    for n in ast.walk(node):
        if "lineno" in n._attributes and getattr(n, "lineno", None) is None:
            n.lineno = n.end_lineno = line
            n.col_offset = n.end_col_offset = 0
    return node


def _thunk(e: ast.expr) -> ast.Lambda:
    lam = ast.Lambda(args=ast.arguments(posonlyargs=[], args=[], vararg=None, kwonlyargs=[],
                                        kw_defaults=[], kwarg=None, defaults=[]), body=e)
    return _here(lam, e.lineno)


def _helper(name: str, args: list[ast.expr], like: ast.AST) -> ast.Call:
    call = ast.Call(func=ast.Attribute(ast.Name(_HELPERS, ast.Load()), name, ast.Load()),
                    args=args, keywords=[])
    return _here(call, like.lineno)


class _Converter:
    """Rewrites the body of one function (not its nested functions)."""

    def __init__(self, filename: str, funcname: str, fdef: ast.FunctionDef,
                 meta: _Meta) -> None:
        self.filename, self.funcname, self.fdef, self.meta = filename, funcname, fdef, meta
        self.declared = {n for s in ast.walk(fdef) if isinstance(s, (ast.Global, ast.Nonlocal))
                         for n in s.names}
        tested = {n.id for s in ast.walk(fdef) if isinstance(s, (ast.If, ast.IfExp))
                  for n in ast.walk(s.test) if isinstance(n, ast.Name)}
        self.tested = tested
        self.count = 0
        self.tracked: set[str] = set()  # the names a converted `if` assigns

    def run(self) -> None:
        self.fdef.body = self.block(self.fdef.body)
        if self.tracked:
            _ReadsChecked(self.tracked).visit(self.fdef)
        first = (self.fdef.args.posonlyargs + self.fdef.args.args)[:1]
        if first:  # zero-argument super() inside a branch function: explicit arguments
            for n in ast.walk(self.fdef):
                if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) \
                        and n.func.id == "super" and not n.args and not n.keywords:
                    n.args = [_here(ast.Name("__class__", ast.Load()), n.lineno),
                              _here(ast.Name(first[0].arg, ast.Load()), n.lineno)]

    def line(self, node: ast.AST) -> ast.Tuple:
        return ast.Tuple([ast.Constant(self.filename), ast.Constant(node.lineno),
                          ast.Constant(self.funcname)], ast.Load())

    # expressions
    def expr(self, e: ast.expr, boolean: bool) -> ast.expr:
        """``e`` with conditional expressions rewritten, and (``boolean``: a value used
        as a truth value) ``not``/``and``/``or`` too."""
        if isinstance(e, (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp,
                          ast.GeneratorExp, ast.NamedExpr)):
            return e
        if isinstance(e, ast.IfExp):
            self.meta.lines.add(e.test.lineno)
            return _helper("if_exp", [self.expr(e.test, True), _thunk(self.expr(e.body, False)),
                                      _thunk(self.expr(e.orelse, False)), self.line(e.test)], e)
        if boolean and isinstance(e, ast.UnaryOp) and isinstance(e.op, ast.Not):
            return _helper("not_", [self.expr(e.operand, True)], e)
        if boolean and isinstance(e, ast.BoolOp):
            name = "and_" if isinstance(e.op, ast.And) else "or_"
            return _helper(name, [_thunk(self.expr(v, True)) for v in e.values], e)
        for field, value in ast.iter_fields(e):
            if isinstance(value, ast.expr):
                setattr(e, field, self.expr(value, False))
            elif isinstance(value, list):
                setattr(e, field, [self.expr(v, False) if isinstance(v, ast.expr) else v
                                   for v in value])
        return e

    # statements
    def block(self, stmts: list[ast.stmt], loop_body: bool = False) -> list[ast.stmt]:
        if loop_body:  # `continue` skips the rest of this list only at a loop body's top
            stmts = _fold_continue(stmts)
            if _continues(stmts):
                self.count += 1
                flag = f"_fxad_continue{self.count}"
                stmts = [_here(_assign(flag, False), stmts[0].lineno)] + _flag_continue(
                    stmts, flag)
        out: list[ast.stmt] = []
        for s in stmts:
            out.extend(self.stmt(s))
        return out

    def stmt(self, s: ast.stmt) -> list[ast.stmt]:
        if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            return [s]
        if isinstance(s, ast.If):
            return self.convert_if(s)
        if isinstance(s, (ast.For, ast.While, ast.AsyncFor)):
            s.body = self.block(s.body, loop_body=True)
            s.orelse = self.block(s.orelse)
            if isinstance(s, ast.While):
                s.test = self.expr(s.test, False)
            else:
                s.iter = self.expr(s.iter, False)
            return [s]
        for field in ("body", "orelse", "finalbody"):
            if isinstance(getattr(s, field, None), list):
                setattr(s, field, self.block(getattr(s, field)))
        if isinstance(s, ast.Try):
            for h in s.handlers:
                h.body = self.block(h.body)
        if isinstance(s, ast.Assign):
            boolean = any(isinstance(t, ast.Name) and t.id in self.tested for t in s.targets)
            s.value = self.expr(s.value, boolean)
        elif isinstance(s, (ast.Expr, ast.Return, ast.AugAssign, ast.AnnAssign)) \
                and s.value is not None:
            s.value = self.expr(s.value, False)
        return [s]

    def convert_if(self, s: ast.If) -> list[ast.stmt]:
        why = _obstacle(s.body + s.orelse, self.declared)
        if why is None and any(isinstance(n, ast.NamedExpr) for n in ast.walk(s.test)):
            why = "its test assigns a name (`:=`)"
        if why is not None:
            self.meta.refused[(s.lineno, s.test.end_lineno or s.lineno)] = \
                f"this `if` cannot become torch.cond: {why}"
            s.body = self.block(s.body)
            s.orelse = self.block(s.orelse)
            return [s]
        self.count += 1
        k = self.count
        names = _assigned(s.body + s.orelse)
        self.tracked.update(names)
        for stmts in (s.body, s.orelse):
            _MutationsChecked(stmts, self.filename, self.funcname).check()
        body = self.block(s.body)
        orelse = self.block(s.orelse)
        for ln in range(s.test.lineno, (s.test.end_lineno or s.test.lineno) + 1):
            self.meta.lines.add(ln)
        test = self.expr(s.test, True)

        def branch(name: str, stmts: list[ast.stmt]) -> ast.FunctionDef:
            # (read through locals(): a nested converted `if` may have left one unbound)
            ret = ast.Return(_helper("values_of", [
                ast.Call(ast.Name("locals", ast.Load()), [], []),
                ast.Tuple([ast.Constant(n) for n in names], ast.Load())], s))
            fn = ast.FunctionDef(
                name=name, args=ast.arguments(posonlyargs=[], args=[ast.arg(n) for n in names],
                                              vararg=None, kwonlyargs=[], kw_defaults=[],
                                              kwarg=None, defaults=[]),
                body=(stmts or [ast.Pass()]) + [ret], decorator_list=[], returns=None)
            return _here(fn, s.lineno)

        t_name, f_name = f"_fxad_if{k}_true", f"_fxad_if{k}_false"
        call = _helper("if_stmt", [test, ast.Name(t_name, ast.Load()), ast.Name(f_name, ast.Load()),
                                   ast.Tuple([ast.Constant(n) for n in names], ast.Load()),
                                   ast.Call(ast.Name("locals", ast.Load()), [], []),
                                   self.line(s.test)], s)
        target = ast.Tuple([ast.Name(n, ast.Store()) for n in names], ast.Store())
        out: list[ast.stmt] = [branch(t_name, body), branch(f_name, orelse),
                               _here(ast.Assign([target], call), s.lineno)]
        for n in names:  # a variable the taken branch left unbound is unbound again
            test_unbound = _helper("unbound", [_raw(ast.Name(n, ast.Load()))], s)
            out.append(_here(ast.If(test_unbound, [ast.Delete(
                [ast.Name(n, ast.Del())])], []), s.lineno))
        return out


def _raw(name: ast.Name) -> ast.Name:
    """A read the rewrite itself makes (a branch returning its variables, the test for an
    unbound one): it passes an :class:`Undefined` on instead of raising."""
    name.fxad_raw = True  # type: ignore[attr-defined]
    return name


class _ReadsChecked(ast.NodeTransformer):
    """Every read of a name some converted ``if`` assigns becomes ``use(name)``, so that a
    variable the branches leave different (:class:`Undefined`) raises at any read: Python
    answers ``v is None``, ``type(v)``, ``isinstance(v, T)`` and passes ``v`` on without
    asking the object, and each of those would otherwise decide on the one value capture
    saw."""

    def __init__(self, names: set[str]) -> None:
        self.names = names

    def visit_Name(self, node: ast.Name) -> ast.AST:
        if isinstance(node.ctx, ast.Load) and node.id in self.names \
                and not getattr(node, "fxad_raw", False):
            return _helper("use", [node], node)
        return node


_FRESH_CALLS = {"list", "dict", "set", "tuple", "OrderedDict", "defaultdict"}


def _fresh(value: ast.expr) -> bool:
    """``value`` makes a new container (a literal, a comprehension, ``list(...)``)."""
    if isinstance(value, (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp,
                          ast.SetComp)):
        return True
    return isinstance(value, ast.Call) and isinstance(value.func, ast.Name) \
        and value.func.id in _FRESH_CALLS


class _MutationsChecked:
    """In the statements of one branch, the object of every in-place change (``lst.append``,
    ``d[k] = v``, ``obj.x = v``) goes through :func:`mutated` first, except a container the
    branch makes itself: a name whose first mention is an assignment of a new container at
    the branch's top level, and whose every assignment is one."""

    def __init__(self, stmts: list[ast.stmt], filename: str, funcname: str) -> None:
        self.stmts, self.filename, self.funcname = stmts, filename, funcname
        assigns: dict[str, list[bool]] = {}
        for node in (n for st in stmts for n in ast.walk(st)):
            if isinstance(node, ast.Assign):
                for t in node.targets:
                    for sub in ast.walk(t):
                        if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store):
                            assigns.setdefault(sub.id, []).append(
                                isinstance(t, ast.Name) and _fresh(node.value))
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign, ast.NamedExpr, ast.For)) \
                    and isinstance(node.target, ast.Name):
                assigns.setdefault(node.target.id, []).append(False)
        self.own: set[str] = set()
        seen: set[str] = set()
        for st in stmts:
            mentioned = {n.id for n in ast.walk(st) if isinstance(n, ast.Name)}
            if isinstance(st, ast.Assign) and len(st.targets) == 1 \
                    and isinstance(st.targets[0], ast.Name) and _fresh(st.value):
                name = st.targets[0].id
                if name not in seen and all(assigns.get(name, [False])):
                    self.own.add(name)
            seen |= mentioned

    def check(self) -> None:
        for st in self.stmts:
            for node in ast.walk(st):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                        and node.func.attr in _MUTATORS:
                    node.func.value = self.wrap(node.func.value, ast.unparse(node.func) + "(...)")
                targets = node.targets if isinstance(node, ast.Assign) else \
                    [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
                for t in targets:
                    for sub in ast.walk(t):
                        if isinstance(sub, (ast.Attribute, ast.Subscript)) \
                                and isinstance(sub.ctx, ast.Store):
                            sub.value = self.wrap(sub.value, ast.unparse(sub) + " = ...")

    def wrap(self, obj: ast.expr, what: str) -> ast.expr:
        if isinstance(obj, ast.Name) and obj.id in self.own:
            return obj
        line = ast.Tuple([ast.Constant(self.filename), ast.Constant(obj.lineno),
                          ast.Constant(self.funcname)], ast.Load())
        return _helper("mutated", [obj, line, ast.Constant(what)], obj)


def _fold_continue(stmts: list[ast.stmt]) -> list[ast.stmt]:
    """``if c: A; continue`` followed by ``B`` in a loop body -> ``if c: A else: B``."""
    for i, s in enumerate(stmts):
        if isinstance(s, ast.If) and not s.orelse and s.body \
                and isinstance(s.body[-1], ast.Continue) \
                and _obstacle(s.body[:-1], set()) is None:
            rest = _fold_continue(stmts[i + 1:])
            folded = ast.If(test=s.test, body=s.body[:-1] or [ast.Pass()], orelse=rest)
            return stmts[:i] + [ast.copy_location(folded, s)]
    return stmts


def _continues(stmts: Sequence[ast.AST]) -> bool:
    """A ``continue`` of the enclosing loop among ``stmts`` (not in nested loops or defs)."""
    for s in stmts:
        if isinstance(s, ast.Continue):
            return True
        if isinstance(s, (ast.If, ast.With)):
            if _continues(s.body) or _continues(getattr(s, "orelse", [])):
                return True
    return False


def _assign(name: str, value: bool) -> ast.Assign:
    return ast.Assign([ast.Name(name, ast.Store())], ast.Constant(value))


def _flag_continue(stmts: list[ast.stmt], flag: str) -> list[ast.stmt]:
    """``continue`` (inside ``if``/``with`` blocks of a loop body) written as ``flag = True``
    with the statements after it run under ``if not flag:``, as AutoGraph does: the ``if``
    around a ``continue`` can then become a conditional."""
    out: list[ast.stmt] = []
    for i, s in enumerate(stmts):
        if isinstance(s, ast.Continue):
            out.append(_here(_assign(flag, True), s.lineno))
            return out  # the rest of this block never runs
        if isinstance(s, (ast.If, ast.With)) and _continues([s]):
            s.body = _flag_continue(s.body, flag)
            if isinstance(s, ast.If):
                s.orelse = _flag_continue(s.orelse, flag)
            out.append(s)
            rest = _flag_continue(stmts[i + 1:], flag)
            if rest:
                test = ast.UnaryOp(ast.Not(), ast.Name(flag, ast.Load()))
                out.append(_here(ast.If(test, rest, []), rest[0].lineno))
            return out
        out.append(s)
    return out
