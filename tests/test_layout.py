"""The house rules of the source tree, checked on every run.

- Each unit (a top-level package, or a job package of ``compile_stack``) imports only the units
  below it in ``LAYERS``: kernels know nothing of passes, passes nothing of the backend, the
  library nothing of the reference workload or the harness.
- No import cycle between modules (function-local imports included).
- Private torch APIs only through ``torch_internals``.
- No library module over ``MAX_LINES`` lines.
"""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("torch_internals", "custom_ops", "passes", "compile_stack")
# Lowest first; a unit may import any unit listed before it.
LAYERS = (
    "torch_internals",
    "custom_ops",
    "passes",
    "compile_stack.caches",
    "compile_stack.memory_plan",
    "compile_stack.backend",
    "compile_stack.capture",
    "compile_stack.distributed",
    "compile_stack",  # the public API
    "compile_stack.workloads",  # the reference model: an example of user code
    "compile_stack.harness",  # the CLI and benchmarks' shared code
)
MAX_LINES = 420
PRIVATE_TORCH = ("torch._", "torch.utils._", "torch.fx._")


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = _modules()


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[0] if parts[0] != "compile_stack" or len(parts) == 1 else ".".join(parts[:2])


def _imports(path: Path) -> list[tuple[str, int]]:
    """The project modules ``path`` imports, anywhere in it, with their line numbers."""
    targets = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                name = f"{node.module}.{alias.name}"
                targets.append((name if name in MODULES else node.module, node.lineno))
    return [(t, line) for t, line in targets if t.split(".")[0] in PACKAGES]


def _private_torch_uses(path: Path) -> list[tuple[str, int]]:
    """Private torch names ``path`` imports or spells out (``torch._dynamo.x``)."""
    uses = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            uses += [(a.name, node.lineno) for a in node.names if a.name.startswith(PRIVATE_TORCH)]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(PRIVATE_TORCH):
            uses.append((node.module, node.lineno))
        elif isinstance(node, ast.Attribute):
            dotted, value = [node.attr], node.value
            while isinstance(value, ast.Attribute):
                dotted.insert(0, value.attr)
                value = value.value
            if isinstance(value, ast.Name) and value.id == "torch" and dotted[0].startswith("_") \
                    and not dotted[0].startswith("__"):
                uses.append(("torch." + ".".join(dotted), node.lineno))
    return uses


def test_every_unit_is_in_a_layer():
    assert {_unit(m) for m in MODULES} <= set(LAYERS)


def test_units_import_only_lower_layers():
    wrong = []
    for module, path in MODULES.items():
        unit = _unit(module)
        for target, line in _imports(path):
            other = _unit(target)
            if other != unit and LAYERS.index(other) > LAYERS.index(unit):
                wrong.append(f"{path.relative_to(ROOT)}:{line} ({unit}) imports {target} ({other})")
    assert not wrong, "imports against the layers:\n" + "\n".join(wrong)


def test_no_import_cycles():
    graph = {m: {t for t, _ in _imports(p) if t in MODULES and t != m} for m, p in MODULES.items()}
    state, cycles = {}, []

    def visit(module, stack):
        state[module] = "open"
        stack.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                cycles.append(" -> ".join(stack[stack.index(target):] + [target]))
            elif target not in state:
                visit(target, stack)
        stack.pop()
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [])
    # A package importing its own submodules is not a cycle of behaviour; a submodule importing
    # its package's ``__init__`` for a name defined there is.
    real = [c for c in cycles if not all(b.startswith(a + ".") or a.startswith(b + ".")
                                         for a, b in zip(c.split(" -> "), c.split(" -> ")[1:]))]
    assert not real, "import cycles:\n" + "\n".join(real)


def test_private_torch_only_through_torch_internals():
    wrong = [f"{path.relative_to(ROOT)}:{line}: {name}"
             for module, path in MODULES.items() if _unit(module) != "torch_internals"
             for name, line in _private_torch_uses(path)]
    assert not wrong, "private torch APIs outside torch_internals:\n" + "\n".join(wrong)


def test_no_module_is_too_long():
    sizes = {module: len(path.read_text().splitlines()) for module, path in MODULES.items()}
    long = [f"{module}: {n} lines" for module, n in sorted(sizes.items()) if n > MAX_LINES]
    assert not long, f"modules over {MAX_LINES} lines (split them by concept):\n" + "\n".join(long)
