"""An op package imports no other op's package: what two ops share is a module of custom_ops/ itself
(checks.py, flags.py), public to both."""
import ast
import pathlib

import custom_ops

ROOT = pathlib.Path(custom_ops.__file__).parent
OPS = sorted(p.name for p in ROOT.iterdir() if (p / "__init__.py").exists())


def imported_modules(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def test_no_op_imports_another_op():
    assert {"adamw", "linear_cross_entropy"} <= set(OPS)
    crossings = []
    for op in OPS:
        for path in sorted((ROOT / op).rglob("*.py")):
            for name in imported_modules(path):
                parts = name.split(".")
                if parts[0] == "custom_ops" and len(parts) > 1 and parts[1] in OPS and parts[1] != op:
                    crossings.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not crossings
