"""compile_stack.settings: the cache directory (what --fresh-cache deletes, unwritable paths) and the memory budget."""
import os

import pytest

from compile_stack import caches
from compile_stack.backend import settings
from torch_internals import inductor


@pytest.fixture(autouse=True)
def _restore_env(monkeypatch):
    """use_cache_dir sets these variables: put them back after each test."""
    for name in (caches.CACHE_ENV, "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        monkeypatch.setenv(name, os.environ.get(name, ""))


def test_use_cache_dir_points_the_caches_there(tmp_path):
    path = caches.use_cache_dir(tmp_path / "cache")
    assert path == tmp_path / "cache"
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(path / "inductor") and (path / "inductor").is_dir()
    assert os.environ["TRITON_CACHE_DIR"] == str(path / "triton") and (path / "triton").is_dir()
    assert caches.default_cache_dir() == path


def test_fresh_deletes_only_what_the_package_created(tmp_path):
    """--fresh-cache empties the package's subfolders; other files in the directory survive."""
    path = tmp_path / "cache"
    caches.use_cache_dir(path)
    for sub in caches.CACHE_SUBDIRS:
        (path / sub / "deep").mkdir(parents=True, exist_ok=True)
        (path / sub / "deep" / "entry").write_text("compiled")
    (path / "notes.txt").write_text("x")
    (path / "mine").mkdir()
    (path / "mine" / "data.bin").write_bytes(b"keep")
    caches.use_cache_dir(path, fresh=True)
    assert (path / "notes.txt").read_text() == "x"
    assert (path / "mine" / "data.bin").read_bytes() == b"keep"
    for sub in ("inductor", "triton"):
        assert (path / sub).is_dir() and not any((path / sub).iterdir())


def test_fresh_on_a_new_directory(tmp_path):
    path = caches.use_cache_dir(tmp_path / "a" / "b", fresh=True)
    assert (path / "inductor").is_dir() and (path / "triton").is_dir()


def test_fresh_unlinks_a_linked_subfolder_without_following_it(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "precious").write_text("keep")
    path = tmp_path / "cache"
    path.mkdir()
    (path / "triton").symlink_to(elsewhere)
    caches.use_cache_dir(path, fresh=True)
    assert (elsewhere / "precious").read_text() == "keep"
    assert (path / "triton").is_dir() and not (path / "triton").is_symlink()


def test_a_file_as_cache_dir_is_refused(tmp_path):
    path = tmp_path / "cache"
    path.write_text("not a directory")
    with pytest.raises(ValueError, match=r"^cache_dir: expected a writable directory.*not a directory"):
        caches.use_cache_dir(path, fresh=True)
    assert path.read_text() == "not a directory"


def test_a_cache_dir_under_a_file_is_refused(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=r"^cache_dir: expected a writable directory.*, got '.*file/cache'"):
        caches.use_cache_dir(tmp_path / "file" / "cache")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes to read-only directories")
def test_a_read_only_cache_dir_is_refused(tmp_path):
    path = tmp_path / "cache"
    caches.use_cache_dir(path)
    path.chmod(0o500)
    (path / "inductor").chmod(0o500)
    try:
        with pytest.raises(ValueError, match=r"^cache_dir: expected a writable directory"):
            caches.use_cache_dir(path)
    finally:
        path.chmod(0o700)
        (path / "inductor").chmod(0o700)


def test_an_unwritable_cache_dir_is_refused(tmp_path, monkeypatch):
    """Whatever the user (root ignores permissions): a failed write is a ValueError naming cache_dir."""
    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(caches.tempfile, "TemporaryFile", refuse)
    with pytest.raises(ValueError, match=r"^cache_dir: expected a writable directory.*, got .*Permission denied"):
        caches.use_cache_dir(tmp_path / "cache")


def test_memory_budget_range():
    with pytest.raises(ValueError, match=r"^memory_budget:"):
        with settings.memory_budget(1.5):
            pass



def test_a_gpu_graph_compiles_its_cpu_kernels_without_probing_the_hosts_isa(monkeypatch):
    """A GPU graph's C++ kernels are scalar bookkeeping: no ISA probe (a build and a Python process
    per ISA, ~30 s of each start on the H200 host); what it found (nothing) is forgotten after it,
    so a CPU graph compiled later still gets the host's vector ISA."""
    import torch
    from torch._inductor import cpu_vec_isa
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        assert settings.on_gpu([torch.empty(2, device="cuda"), 3])
    assert not settings.on_gpu([torch.empty(2), 3.0])

    probes = []
    monkeypatch.setattr(cpu_vec_isa.VecISA, "check_build", lambda self, code: probes.append(self) or False)
    inductor.forget_vec_isas()  # a CPU graph compiled earlier in the session would have them answered
    with settings.inductor_config(on_gpu=True):
        assert not cpu_vec_isa.pick_vec_isa()
        assert cpu_vec_isa.valid_vec_isa_list.cache_info().currsize == 1
    assert probes == []
    assert cpu_vec_isa.valid_vec_isa_list.cache_info().currsize == 0
