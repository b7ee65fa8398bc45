"""Where compiled artifacts live, and the small records the package keeps beside them.

- One cache directory for everything compiled (Inductor's FX-graph and
  AOTAutograd caches, and Triton's kernel cache): ``$COMPILE_STACK_CACHE``,
  default ``~/.cache/compile_stack``. ``use_cache_dir(fresh=True)`` deletes what
  the package put there first (``CACHE_SUBDIRS``), for a measured cold start;
  anything else in the directory is left alone. Inductor and Triton take their
  cache directories from environment variables only: the CLI, which owns its
  process, sets them for good (``use_cache_dir``); a step compiled with
  ``cache_dir=`` sets them only while it compiles and runs (``cache_dir_in_force``),
  leaving the user's environment as it was.
- What the package records beside the caches for a later start (pass reports,
  plan records, host buffers, the host's vector ISAs) is small JSON, written atomically
  (``write_record``) and read as None when missing or damaged (``read_record``).
"""
import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path

CACHE_ENV = "COMPILE_STACK_CACHE"


def default_cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV, Path.home() / ".cache" / "compile_stack"))


# What the package creates under the cache directory: Inductor's caches (with the pass
# records compile_stack/backend/pass_records.py keeps beside them) and Triton's kernel cache.
# ``use_cache_dir(fresh=True)`` deletes these and nothing else.
CACHE_SUBDIRS = ("inductor", "triton")


def _delete(path: Path) -> None:
    """Remove one cache entry: a directory tree, or a file or link (never followed)."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


def use_cache_dir(path: Path | None = None, fresh: bool = False) -> Path:
    """Point Inductor's and Triton's caches at ``path`` for the rest of the process (the CLI's):
    ``prepare_cache_dir``, then its variables set."""
    path = prepare_cache_dir(path, fresh)
    os.environ.update(_variables(path))
    return path


@contextlib.contextmanager
def cache_dir_in_force(path: Path):
    """Inductor's and Triton's caches at ``path`` (made by ``prepare_cache_dir``) while active;
    the variables as they were afterwards."""
    saved = {name: os.environ.get(name) for name in _variables(path)}
    os.environ.update(_variables(path))
    try:
        yield path
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _variables(path: Path) -> dict[str, str]:
    return {CACHE_ENV: str(path), "TORCHINDUCTOR_CACHE_DIR": str(path / "inductor"),
            "TRITON_CACHE_DIR": str(path / "triton")}


def prepare_cache_dir(path: Path | None = None, fresh: bool = False) -> Path:
    """``path`` (default: ``default_cache_dir()``) made ready for the caches, their old entries
    deleted first if ``fresh``.

    ``fresh`` deletes only the package's own subfolders (``CACHE_SUBDIRS``), so
    pointing ``--cache-dir`` at a directory that holds other files loses none.
    A path that is not a writable directory raises ValueError naming ``cache_dir``.
    """
    path = Path(path).expanduser() if path is not None else default_cache_dir()
    expected = "a writable directory (compile caches are written there)"
    if path.exists() and not path.is_dir():
        raise ValueError(f"cache_dir: expected {expected}, got {str(path)!r}, which is not a directory")
    try:
        if fresh:
            for sub in CACHE_SUBDIRS:
                _delete(path / sub)
        for sub in ("inductor", "triton"):
            (path / sub).mkdir(parents=True, exist_ok=True)
        # mkdir succeeds on existing read-only directories: write a file in each to be sure.
        for where in (path, path / "inductor", path / "triton"):
            with tempfile.TemporaryFile(dir=where):
                pass
    except OSError as e:
        raise ValueError(f"cache_dir: expected {expected}, got {str(path)!r} ({e})") from e
    return path


def write_record(path: Path, data) -> None:
    """``data`` as JSON at ``path`` beside the caches, atomically (ranks of a distributed run share
    the directory); nothing where it cannot be written: a record only spares a later start work."""
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()


def read_record(path: Path):
    """The JSON a ``write_record`` left at ``path``; None if there is none or it does not parse."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
