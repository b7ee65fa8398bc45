"""Gradient accumulation: each loop body that calls ``backward()`` runs as a function of its own.

Dynamo cannot resume after a graph break inside a loop, and ``loss.backward()``
is one: it runs the step's whole frame eagerly. The model still compiles on
its own, but a loss the loop computes runs uncompiled and apart from the LM
head, so the full logits are made (20 GiB at the full size) and no pass fuses
the loss::

    for inputs, targets in micro_batches:
        loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten()) / n
        loss.backward()

``outlined`` recompiles the step from its source with each such body moved
into a function defined before its loop, which the loop calls; the names the
body assigns are shared through ``nonlocal`` (``global`` where the step
declares them so), so the step computes what it did. The loop's frame still
runs eagerly, and Dynamo compiles each call of the body as a frame of its
own: forward and loss as one graph, the backward derived from it.

A body is left as written when it could leave its loop other than by running
to its end or by ``continue`` (``break``, ``return``, ``yield``, ``await``),
or declares names itself; a step without source (a lambda, a C function), or
whose source no longer compiles to the code that runs (its file edited since it
was imported), is left as written. The new function has the step's closure
cells, globals, defaults and line numbers.
"""
import ast
import copy
import inspect
import sys
import textwrap
import types
from collections.abc import Callable

BODY_PREFIX = "_cstack_accumulation_body"
SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)
COMPREHENSIONS = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)
LOOPS = (ast.For, ast.While, ast.AsyncFor)
# FunctionDef's field since Python 3.12.
TYPE_PARAMS = {"type_params": []} if sys.version_info >= (3, 12) else {}


def outlined(step: Callable) -> Callable | None:
    """``step`` with each loop body that calls ``backward()`` run as a function of its own; None
    when it has no such loop or cannot be rewritten (see the module's docstring)."""
    fn = getattr(step, "__func__", step)
    if not isinstance(fn, types.FunctionType) or "__class__" in fn.__code__.co_freevars:
        return None
    try:
        lines, first = inspect.getsourcelines(fn)
        tree = ast.parse(textwrap.dedent("".join(lines)))
    except (OSError, TypeError, SyntaxError):
        return None
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.FunctionDef) or tree.body[0].name != fn.__name__:
        return None
    func = tree.body[0]
    func.decorator_list = []
    original = copy.deepcopy(func)
    declared_global = {n for node in _own_nodes(func.body) if isinstance(node, ast.Global) for n in node.names}
    rewriter = _LoopRewriter(func, declared_global)
    func.body = rewriter.statements(func.body)
    if not rewriter.bodies:
        return None
    as_written = _compiled(original, fn, first)
    if as_written is None or _names_and_constants(as_written) != _names_and_constants(fn.__code__):
        return None  # the source on disk is not what runs (edited since, or another function's)
    if rewriter.shared:  # bound in the step (after its declarations), so the bodies' ``nonlocal`` finds them; never run
        func.body.append(ast.If(test=ast.Constant(False), orelse=[], body=[
            ast.Assign(targets=[ast.Name(name, ast.Store())], value=ast.Constant(None))
            for name in sorted(rewriter.shared)]))
    new_code = _compiled(func, fn, first)
    cells = dict(zip(fn.__code__.co_freevars, fn.__closure__ or ()))
    if new_code is None or not set(new_code.co_freevars) <= set(cells):
        return None
    new = types.FunctionType(new_code, fn.__globals__, fn.__name__, fn.__defaults__,
                             tuple(cells[name] for name in new_code.co_freevars))
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__qualname__, new.__module__, new.__doc__ = fn.__qualname__, fn.__module__, fn.__doc__
    new.__dict__.update(fn.__dict__)
    owner = getattr(step, "__self__", None)
    return types.MethodType(new, owner) if owner is not None and step is not fn else new


def _compiled(func: ast.FunctionDef, fn: types.FunctionType, first: int) -> types.CodeType | None:
    """The code of ``func`` compiled where ``fn`` was: in ``fn``'s file at its lines, nested in a
    function whose locals are ``fn``'s free variables (so they stay free); None if it does not compile."""
    factory = ast.FunctionDef(name="_cstack_factory", args=ast.arguments(
        posonlyargs=[], args=[ast.arg(name) for name in fn.__code__.co_freevars], kwonlyargs=[], kw_defaults=[],
        defaults=[]), body=[func], decorator_list=[], returns=None, **TYPE_PARAMS)
    module = ast.fix_missing_locations(ast.Module(body=[factory], type_ignores=[]))
    ast.increment_lineno(module, first - 1)
    try:
        code = compile(module, fn.__code__.co_filename, "exec")
    except SyntaxError:
        return None
    return _nested_code(_nested_code(code, "_cstack_factory"), fn.__name__)


def _names_and_constants(code: types.CodeType) -> tuple:
    """What a function's source fixes of its code however it was compiled (an import hook such as
    pytest's assertion rewriting changes the bytecode, not these), its nested functions' included."""
    nested = [c for c in code.co_consts if isinstance(c, types.CodeType)]
    constants = [repr(c) for c in code.co_consts if not isinstance(c, types.CodeType)]
    return (code.co_name, code.co_varnames, code.co_names, code.co_freevars, code.co_cellvars, sorted(constants),
            [_names_and_constants(c) for c in nested])


def body_codes(code: types.CodeType | None) -> list[types.CodeType]:
    """The code of each loop body ``outlined`` made a function of its own in a step of ``code``."""
    return [c for c in (code.co_consts if code is not None else ())
            if isinstance(c, types.CodeType) and c.co_name.startswith(BODY_PREFIX)]


def _nested_code(code: types.CodeType | None, name: str) -> types.CodeType | None:
    if code is None:
        return None
    return next((c for c in code.co_consts if isinstance(c, types.CodeType) and c.co_name == name), None)


class _LoopRewriter:
    """Rewrites a function's statements, innermost loops first; records the bodies it outlined and
    the names they share with the function."""

    def __init__(self, func: ast.FunctionDef, declared_global: set[str]):
        self.func = func
        self.declared_global = declared_global
        self.bodies = 0
        self.shared: set[str] = set()

    def statements(self, stmts: list[ast.stmt]) -> list[ast.stmt]:
        out = []
        for stmt in stmts:
            out += self.statement(stmt)
        return out

    def statement(self, stmt: ast.stmt) -> list[ast.stmt]:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            return [stmt]  # a scope of its own
        for field in ("body", "orelse", "finalbody"):
            if isinstance(getattr(stmt, field, None), list):
                setattr(stmt, field, self.statements(getattr(stmt, field)))
        for handler in getattr(stmt, "handlers", ()):
            handler.body = self.statements(handler.body)
        for case in getattr(stmt, "cases", ()):
            case.body = self.statements(case.body)
        if isinstance(stmt, (ast.For, ast.While)) and self._outlinable(stmt.body):
            return self._outline(stmt)
        return [stmt]

    def _used_outside(self, loop: ast.For | ast.While) -> set[str]:
        """Names the function (its parameters, nested scopes and other loops included) uses outside
        ``loop``'s body."""
        inside = {id(n) for stmt in loop.body for n in ast.walk(stmt)}
        params = self.func.args
        names = {a.arg for a in (*params.posonlyargs, *params.args, *params.kwonlyargs, params.vararg, params.kwarg)
                 if a is not None}
        return names | {n.id for n in ast.walk(self.func) if isinstance(n, ast.Name) and id(n) not in inside}

    @staticmethod
    def _outlinable(body: list[ast.stmt]) -> bool:
        """The body calls ``backward()`` outside any loop of its own and leaves only by its end or
        ``continue``."""
        own = list(_own_nodes(body))
        if any(isinstance(n, (ast.Return, ast.Yield, ast.YieldFrom, ast.Await, ast.Global, ast.Nonlocal))
               for n in own):
            return False
        outside_loops = list(_own_nodes(body, SCOPES + LOOPS))
        if any(isinstance(n, ast.Break) for n in outside_loops):
            return False
        return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "backward"
                   for n in outside_loops)

    def _outline(self, loop: ast.For | ast.While) -> list[ast.stmt]:
        name = f"{BODY_PREFIX}{self.bodies}"
        self.bodies += 1
        assigned = _assigned_names(loop.body) & (self._used_outside(loop) | _carried(loop.body) | self.declared_global)
        body = [_ContinueToReturn().visit(s) for s in loop.body]
        declarations = []
        if assigned - self.declared_global:
            declarations.append(ast.Nonlocal(names=sorted(assigned - self.declared_global)))
            self.shared |= assigned - self.declared_global
        if assigned & self.declared_global:
            declarations.append(ast.Global(names=sorted(assigned & self.declared_global)))
        definition = ast.FunctionDef(
            name=name, args=ast.arguments(posonlyargs=[], args=[], kwonlyargs=[], kw_defaults=[], defaults=[]),
            body=declarations + body, decorator_list=[], returns=None, **TYPE_PARAMS)
        ast.copy_location(definition, loop)
        call = ast.copy_location(ast.Expr(ast.Call(ast.Name(name, ast.Load()), [], [])), loop.body[0])
        loop.body = [call]
        return [definition, loop]


class _ContinueToReturn(ast.NodeTransformer):
    """``continue`` of the outlined body's own loop becomes ``return`` from its function."""

    def visit_Continue(self, node):
        return ast.copy_location(ast.Return(value=None), node)

    def _scope(self, node):
        return node  # a nested loop's or function's continue is its own

    visit_For = visit_While = visit_AsyncFor = visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _scope
    visit_ClassDef = _scope


def _own_nodes(stmts: list[ast.stmt], skip: tuple = SCOPES):
    """The nodes of ``stmts``, not descending into the kinds of node in ``skip`` (by default
    nested function and class scopes)."""
    todo = list(stmts)
    while todo:
        node = todo.pop()
        yield node
        if not isinstance(node, skip):
            todo.extend(ast.iter_child_nodes(node))


def _carried(body: list[ast.stmt]) -> set[str]:
    """Names the body may read before it assigns them (from the iteration before, or from before the
    loop): read in a nested scope of it, or in or before the first of its own statements that surely
    assigns them (a plain assignment not reading them)."""
    carried = {n.id for node in _own_nodes(body) if isinstance(node, SCOPES)
               for n in ast.walk(node) if isinstance(n, ast.Name)}
    assigned: set[str] = set()
    for stmt in body:
        carried |= _read_names(stmt) - assigned
        if isinstance(stmt, (ast.Assign, ast.AnnAssign)):
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            assigned |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)
                         and isinstance(n.ctx, ast.Store)}
    return carried


def _read_names(stmt: ast.stmt) -> set[str]:
    """Names a statement reads (``x += 1`` and ``del x`` read ``x``)."""
    names = {n.id for n in ast.walk(stmt) if isinstance(n, ast.Name) and isinstance(n.ctx, (ast.Load, ast.Del))}
    return names | {n.target.id for n in ast.walk(stmt) if isinstance(n, ast.AugAssign)
                    and isinstance(n.target, ast.Name)}


def _assigned_names(stmts: list[ast.stmt]) -> set[str]:
    """Names the statements bind in their own scope (comprehensions have theirs, but for ``:=``)."""
    names = {node.target.id for node in _own_nodes(stmts) if isinstance(node, ast.NamedExpr)}
    for node in _own_nodes(stmts, SCOPES + COMPREHENSIONS):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            names.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.ExceptHandler) and node.name:
            names.add(node.name)
    return names
