"""Test session setup.

Without a GPU, Triton kernels run in Triton's CPU interpreter: the variable
must be set before any kernel is defined, so it is set here, first.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from triton.runtime import interpreter  # noqa: E402


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)
    yield


@pytest.fixture
def scalar_loop_bounds(monkeypatch):
    """Let the interpreter use per-program scalars as range() bounds under NumPy >= 2.4.

    The interpreter keeps scalars as 1-element arrays and converts them with int(), which
    NumPy 2.4 refuses for arrays of rank 1; compiled kernels are unaffected.
    """
    patch_tensor = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    monkeypatch.setattr(interpreter, "_patch_lang_tensor", patched)


_compile_check = []  # tests/test_gpu_compile.py's module once its processes are started


def pytest_collection_finish(session):
    """Start the GPU compile check's processes now if its tests are selected (tests/test_gpu_compile.py).

    Not in a pytest-xdist worker: each collects every test but runs only its share, so the test
    starts its compile when it runs (``compile_report``) while the other worker goes on."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    for item in session.items:
        if item.module.__name__.rpartition(".")[2] == "test_gpu_compile" and hasattr(item, "callspec"):
            item.module.start_compile(item.callspec.params["arch"])
            _compile_check[:] = [item.module]


def pytest_sessionfinish(session):
    for module in _compile_check:
        module.stop_compiles()


@pytest.fixture(scope="session")
def installed_wheel(tmp_path_factory):
    """(wheel, python of a fresh venv with it installed): tests/installed_wheel.py."""
    from tests.installed_wheel import install_wheel

    return install_wheel(tmp_path_factory.mktemp("wheel"))
