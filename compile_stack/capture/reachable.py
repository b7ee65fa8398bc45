"""What the user's step reaches by name: its optimizers and models, and the module ints it assigns.

The step closes over its objects (closure cells, globals of a script, a bound
method's object); ``compile_step`` finds them there rather than asking the
user to pass them, and names the module-level counters a hand-written update
bumps so Dynamo traces them as symbols.
"""
import dis
import functools
import re
import types
from collections.abc import Callable

import torch


def is_optimizer(obj) -> bool:
    """A torch optimizer, or a hand-written one: a ``step`` and a ``zero_grad`` method, not a module."""
    if isinstance(obj, torch.optim.Optimizer):
        return True
    if isinstance(obj, (type, torch.nn.Module, torch.Tensor)) or callable(obj):
        return False
    return callable(getattr(obj, "step", None)) and callable(getattr(obj, "zero_grad", None))


def find_reachable(fn: Callable, wanted: Callable[[object], bool]) -> list:
    """The objects ``fn`` reaches by name (its closure cells, the globals its code names, and a
    bound method's object's attributes) for which ``wanted`` holds, each once."""
    owner = getattr(fn, "__self__", None) if not _is_callable_object(fn) else fn
    fn = inspect_target(fn)
    found = []
    candidates = list(vars(owner).values()) if owner is not None and hasattr(owner, "__dict__") else []
    candidates += [cell.cell_contents for cell in (fn.__closure__ or ()) if _has_contents(cell)]
    candidates += [fn.__globals__[name] for name in _global_names(fn.__code__) if name in fn.__globals__]
    for obj in candidates:
        if wanted(obj) and all(obj is not seen for seen in found):
            found.append(obj)
    return found


def inspect_target(fn: Callable) -> Callable:
    """The plain function behind ``fn`` (a bound method's, a partial's, a callable object's ``__call__``),
    whose closure we read."""
    while True:
        if isinstance(fn, functools.partial):
            fn = fn.func
        elif hasattr(fn, "__func__"):
            fn = fn.__func__
        elif hasattr(fn, "__wrapped__"):
            fn = fn.__wrapped__
        elif _is_callable_object(fn):
            fn = type(fn).__call__
        else:
            return fn


def _is_callable_object(fn) -> bool:
    """An instance of a class whose ``__call__`` is a Python function (the step as a callable object)."""
    return not isinstance(fn, type) and isinstance(getattr(type(fn), "__call__", None), types.FunctionType)


def _has_contents(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # an empty cell: a name bound later
        return False
    return True


def _global_names(code) -> set[str]:
    """Global names a code object and the functions nested in it read."""
    return {name for c in _nested_codes(code) for name in c.co_names}


def global_counter_sources(fn: Callable) -> str:
    """Dynamo sources of the module's ints that the step, or a function of its module it names,
    assigns (``global t; t += 1`` in a hand-written update), to trace as symbols from the first
    compile: Dynamo bakes a global int in as a constant, so each new value would recompile the
    step until its recompile limit left the rest of it eager. Regular expressions, as
    ``step_counter_sources`` returns them."""
    fn = inspect_target(fn)
    module = getattr(fn, "__globals__", None)
    if module is None:
        return ""
    names, seen, todo = set(), set(), [fn]
    while todo:
        code = todo.pop().__code__
        if code in seen:
            continue
        seen.add(code)
        names |= {i.argval for c in _nested_codes(code) for i in dis.get_instructions(c)
                  if i.opname == "STORE_GLOBAL" and type(module.get(i.argval)) is int}
        todo += [f for name in _global_names(code) if isinstance(f := module.get(name), types.FunctionType)
                 and f.__globals__ is module]
    return ",".join(rf"G\['{re.escape(name)}'\]$" for name in sorted(names))


def _nested_codes(code) -> list:
    """A code object and the code objects nested in it (closures, comprehensions)."""
    return [code, *(c for const in code.co_consts if isinstance(const, type(code)) for c in _nested_codes(const))]
