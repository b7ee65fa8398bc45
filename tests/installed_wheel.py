"""The package as a user gets it: a wheel built from the source tree, installed without its
dependencies in a fresh virtual environment outside the tree.

The environment takes torch and triton from the one running the tests: a ``.pth`` file lists
this interpreter's site-packages (plain lines: the ``.pth`` files there, such as an editable
install's finder of the source tree, are not run), so nothing is downloaded and the import of
``compile_stack`` can only find the wheel's copy.
"""
import shutil
import site
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = {"tests"}  # top-level packages that are not the project's


def _not_source(folder: str, names: list[str]) -> set[str]:
    """What a checkout has beside its sources: hidden folders, caches, build outputs."""
    return {n for n in names if n.startswith(".") or n in ("__pycache__", "build", "dist", "out")
            or n.endswith(".egg-info")}


def project_modules(root: Path = ROOT) -> list[str]:
    """Every module of the checkout's packages (folders with an ``__init__.py``, their .py files,
    at any depth) and its top-level modules named in pyproject.toml, as dotted names."""
    modules = ["run_step"]
    for top in sorted(p for p in root.iterdir() if (p / "__init__.py").is_file() and p.name not in TESTS):
        for path in sorted(top.rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            modules.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return modules


def install_wheel(where: Path) -> tuple[Path, Path]:
    """Build the wheel from a copy of the checkout and install it in a new venv under ``where``;
    (the wheel, the venv's python)."""
    source, dist, venv = where / "source", where / "dist", where / "venv"
    shutil.copytree(ROOT, source, ignore=_not_source)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                    "--quiet", "--wheel-dir", str(dist), str(source)], check=True, capture_output=True, text=True)
    (wheel,) = dist.glob("*.whl")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index",
                    "--quiet", str(wheel)], check=True, capture_output=True, text=True)
    venv_site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               check=True, capture_output=True, text=True).stdout.strip()
    (Path(venv_site) / "outer_env.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    return wheel, python


def clean_env(tmp: Path) -> dict:
    """A user's shell: no PYTHONPATH to the checkout, empty compile caches under ``tmp``."""
    return {"PATH": "/usr/bin:/bin", "HOME": str(tmp), "COMPILE_STACK_CACHE": str(tmp / "cache"),
            "TORCHINDUCTOR_CACHE_DIR": str(tmp / "inductor"), "TRITON_CACHE_DIR": str(tmp / "triton")}
