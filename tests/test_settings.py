"""compile_stack.settings: the cache directory (what --fresh-cache deletes, unwritable paths) and the memory budget."""
import os

import pytest

from compile_stack import settings


@pytest.fixture(autouse=True)
def _restore_env(monkeypatch):
    """use_cache_dir sets these variables: put them back after each test."""
    for name in (settings.CACHE_ENV, "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        monkeypatch.setenv(name, os.environ.get(name, ""))


def test_use_cache_dir_points_the_caches_there(tmp_path):
    path = settings.use_cache_dir(tmp_path / "cache")
    assert path == tmp_path / "cache"
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(path / "inductor") and (path / "inductor").is_dir()
    assert os.environ["TRITON_CACHE_DIR"] == str(path / "triton") and (path / "triton").is_dir()
    assert settings.default_cache_dir() == path


def test_fresh_deletes_only_what_the_package_created(tmp_path):
    """--fresh-cache empties the package's subfolders; other files in the directory survive."""
    path = tmp_path / "cache"
    settings.use_cache_dir(path)
    for sub in settings.CACHE_SUBDIRS:
        (path / sub / "deep").mkdir(parents=True, exist_ok=True)
        (path / sub / "deep" / "entry").write_text("compiled")
    (path / "notes.txt").write_text("x")
    (path / "mine").mkdir()
    (path / "mine" / "data.bin").write_bytes(b"keep")
    settings.use_cache_dir(path, fresh=True)
    assert (path / "notes.txt").read_text() == "x"
    assert (path / "mine" / "data.bin").read_bytes() == b"keep"
    for sub in ("inductor", "triton"):
        assert (path / sub).is_dir() and not any((path / sub).iterdir())


def test_fresh_on_a_new_directory(tmp_path):
    path = settings.use_cache_dir(tmp_path / "a" / "b", fresh=True)
    assert (path / "inductor").is_dir() and (path / "triton").is_dir()


def test_fresh_unlinks_a_linked_subfolder_without_following_it(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "precious").write_text("keep")
    path = tmp_path / "cache"
    path.mkdir()
    (path / "triton").symlink_to(elsewhere)
    settings.use_cache_dir(path, fresh=True)
    assert (elsewhere / "precious").read_text() == "keep"
    assert (path / "triton").is_dir() and not (path / "triton").is_symlink()


def test_a_file_as_cache_dir_is_refused(tmp_path):
    path = tmp_path / "cache"
    path.write_text("not a directory")
    with pytest.raises(ValueError, match=r"^cache_dir: expected a writable directory.*not a directory"):
        settings.use_cache_dir(path, fresh=True)
    assert path.read_text() == "not a directory"


def test_a_cache_dir_under_a_file_is_refused(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=r"^cache_dir: expected a writable directory.*, got '.*file/cache'"):
        settings.use_cache_dir(tmp_path / "file" / "cache")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes to read-only directories")
def test_a_read_only_cache_dir_is_refused(tmp_path):
    path = tmp_path / "cache"
    settings.use_cache_dir(path)
    path.chmod(0o500)
    (path / "inductor").chmod(0o500)
    try:
        with pytest.raises(ValueError, match=r"^cache_dir: expected a writable directory"):
            settings.use_cache_dir(path)
    finally:
        path.chmod(0o700)
        (path / "inductor").chmod(0o700)


def test_an_unwritable_cache_dir_is_refused(tmp_path, monkeypatch):
    """Whatever the user (root ignores permissions): a failed write is a ValueError naming cache_dir."""
    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(settings.tempfile, "TemporaryFile", refuse)
    with pytest.raises(ValueError, match=r"^cache_dir: expected a writable directory.*, got .*Permission denied"):
        settings.use_cache_dir(tmp_path / "cache")


def test_memory_budget_range():
    with pytest.raises(ValueError, match=r"^memory_budget:"):
        with settings.memory_budget(1.5):
            pass
