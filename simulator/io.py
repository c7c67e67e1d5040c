"""Atomic output: a file written beside its target and renamed over it; a set of files swapped in as a folder."""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

# Temporaries (files and staging folders) this process has made and not yet moved into place or removed. A signal
# can land between the call that makes one and the `try` that would remove it; `remove_temporaries` (the CLI calls
# it on its way out) removes what such a signal left.
_TEMPORARIES: set[str] = set()
_HELD = {signal.SIGINT, signal.SIGTERM}


def _made(create):
    """`create()`'s path, registered as a temporary with SIGINT and SIGTERM held meanwhile (so that none lands
    between the two)."""
    mask = getattr(signal, "pthread_sigmask", None)
    previous = mask(signal.SIG_BLOCK, _HELD) if mask else None
    try:
        made = create()
        _TEMPORARIES.add(made[1] if isinstance(made, tuple) else made)
        return made
    finally:
        if mask:
            mask(signal.SIG_SETMASK, previous)


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
    fd, tmp = _made(lambda: tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o644)   # mkstemp creates 0600; outputs are meant to be shared
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
        self.staging = Path(_made(lambda: tempfile.mkdtemp(prefix=f".{self.target.name}.", suffix=".tmp",
                                                           dir=self.target.parent)))
        os.chmod(self.staging, 0o755)     # mkdtemp creates 0700; outputs are meant to be shared
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
        try:
            if self.target.is_dir():
                self._keep_others()
                if _exchange(self.staging, self.target):
                    self.discard()                                     # now the old set
                    return
                aside = Path(tempfile.mkdtemp(prefix=f".{self.target.name}.", suffix=".old", dir=self.target.parent))
                os.rename(self.target, aside / "set")
                os.rename(self.staging, self.target)
                _settled(self.staging)
                shutil.rmtree(aside, ignore_errors=True)
                return
            os.rename(self.staging, self.target)
            _settled(self.staging)
        except BaseException:
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
