"""Atomic output: a file written beside its target and renamed over it; a set of files swapped in as a folder."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Callable, TypeVar

T = TypeVar("T")

# Temporaries (files and staging folders) this process has made and not yet moved into place or removed. Each is
# registered before it is made, so a signal landing anywhere leaves it where `remove_temporaries` (the CLI calls it
# on its way out) finds it. Holding signals around the making is not enough: a signal sent to the process can be
# delivered to another thread (numpy's BLAS starts one) that does not hold them, and Python then raises in the main
# thread at once.
_TEMPORARIES: set[str] = set()


def _temporary(parent: str | os.PathLike, prefix: str, suffix: str, make: Callable[[str], T]) -> tuple[str, T]:
    """A new temporary `parent/<prefix><random><suffix>` made by `make(path)` (which raises FileExistsError where
    the name is taken), registered before it exists; the path and what `make` returned."""
    while True:
        path = os.path.join(os.fspath(parent), f"{prefix}{os.urandom(6).hex()}{suffix}")
        _TEMPORARIES.add(path)
        try:
            return path, make(path)
        except FileExistsError:        # another process's temporary: not ours to remove
            _TEMPORARIES.discard(path)


def _new_file(path: str) -> int:
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)


def _new_folder(path: str) -> None:
    os.mkdir(path, 0o700)


def _settled(path: str | os.PathLike) -> None:
    _TEMPORARIES.discard(os.fspath(path))


def remove_temporaries() -> None:
    """Remove every temporary this process made and left (after a signal that landed before its clean-up)."""
    for path in sorted(_TEMPORARIES):
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            try:
                os.unlink(path)
            except OSError:
                pass
        _TEMPORARIES.discard(path)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write `data` to `path` so that readers see either the old file or the whole new one."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp, fd = _temporary(target.parent, f".{target.name}.", ".tmp", _new_file)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o644)   # made 0600 (as mkstemp does); outputs are meant to be shared
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    finally:
        _settled(tmp)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write UTF-8 text atomically (see atomic_write_bytes)."""
    atomic_write_bytes(path, text.encode("utf-8"))


class OutputSet:
    """A folder of files that replaces the old folder whole: `--out DIR` holds either the old set or the new one.

    Files are written into a temporary sibling folder `.DIR.<random>.tmp`; `commit()` swaps it into place with one
    atomic exchange of the two folders (Linux renameat2 RENAME_EXCHANGE), so a reader or a second run never sees
    a mix of two runs. Files in DIR that the new set does not write are kept (hard-linked, or moved if they are
    folders). Where the exchange is unavailable, DIR is renamed aside and the new folder renamed into place: for
    that instant DIR does not exist. An exception or signal before the swap (SIGINT; SIGTERM once the CLI maps it
    to KeyboardInterrupt) removes the temporary folder; SIGKILL can leave it behind, never a partial DIR.

        with OutputSet(out) as output:
            write(output.path("report.json"))
    """

    def __init__(self, target: str | os.PathLike):
        self.target = Path(os.path.abspath(target))
        self.target.parent.mkdir(parents=True, exist_ok=True)
        self.staging = Path(_temporary(self.target.parent, f".{self.target.name}.", ".tmp", _new_folder)[0])
        os.chmod(self.staging, 0o755)     # made 0700 (as mkdtemp does); outputs are meant to be shared
        self.names: list[str] = []

    def path(self, name: str) -> Path:
        """Where to write the set's file `name` (inside the staging folder)."""
        self.names.append(name)
        return self.staging / name

    def final(self, name: str) -> Path:
        """Where `name` will be once the set is committed."""
        return self.target / name

    def __enter__(self) -> "OutputSet":
        return self

    def __exit__(self, kind, error, traceback) -> None:
        if kind is None:
            self.commit()
        else:
            self.discard()

    def discard(self) -> None:
        shutil.rmtree(self.staging, ignore_errors=True)
        _settled(self.staging)

    def commit(self) -> None:
        """Swap the staging folder into place and remove the old set."""
        aside = None
        try:
            if self.target.is_dir():
                self._keep_others()
                if _exchange(self.staging, self.target):
                    self.discard()                                     # now the old set
                    return
                aside = Path(_temporary(self.target.parent, f".{self.target.name}.", ".old", _new_folder)[0])
                os.rename(self.target, aside / "set")
                os.rename(self.staging, self.target)
                _settled(self.staging)
                shutil.rmtree(aside, ignore_errors=True)
                _settled(aside)
                return
            os.rename(self.staging, self.target)
            _settled(self.staging)
        except BaseException:
            if aside is not None and (aside / "set").is_dir() and not self.target.exists():
                os.rename(aside / "set", self.target)     # interrupted between the two renames: the old set back
            self.discard()
            raise

    def _keep_others(self) -> None:
        """Files of the old folder that are not part of the new set go into it too."""
        for entry in os.scandir(self.target):
            if entry.name in self.names or (self.staging / entry.name).exists() or (
                    entry.name.startswith(".") and entry.name.endswith(".tmp")):   # a killed writer's temporary
                continue
            if entry.is_dir(follow_symlinks=False):
                os.rename(entry.path, self.staging / entry.name)
            else:
                try:
                    os.link(entry.path, self.staging / entry.name, follow_symlinks=False)
                except OSError:
                    shutil.copy2(entry.path, self.staging / entry.name, follow_symlinks=False)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Atomically exchange two paths (Linux renameat2); False where that is not available."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint)
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    errno = ctypes.get_errno()
    if errno in (38, 22, 95):       # ENOSYS, EINVAL (file system without exchange), EOPNOTSUPP
        return False
    raise OSError(errno, os.strerror(errno), str(b))
