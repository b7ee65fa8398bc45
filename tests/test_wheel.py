"""The installed package, not the checkout: the wheel holds every module and each imports
from a fresh environment outside the source tree (tests/installed_wheel.py)."""
import subprocess
import zipfile

from tests.installed_wheel import clean_env, project_modules

IMPORT_ALL = """
import importlib, sys, traceback
modules = sys.argv[1:]
import compile_stack
assert compile_stack.__file__.startswith(sys.prefix), compile_stack.__file__
for name in modules:
    try:
        importlib.import_module(name)
    except Exception:
        print(name, traceback.format_exc().splitlines()[-1])
"""


def test_wheel_holds_every_module(installed_wheel):
    wheel, _ = installed_wheel
    names = [n for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".py")]
    in_wheel = sorted(n[:-3].replace("/", ".").removesuffix(".__init__") for n in names)
    assert in_wheel == sorted(project_modules())


def test_every_module_imports_from_the_installed_wheel(installed_wheel, tmp_path):
    _, python = installed_wheel
    result = subprocess.run([str(python), "-c", IMPORT_ALL, *project_modules()], cwd=tmp_path,
                            capture_output=True, text=True, timeout=300, env=clean_env(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout == "", f"modules that fail to import:\n{result.stdout}"
