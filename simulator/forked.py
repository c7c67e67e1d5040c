"""Work done in forked processes on the other cores, its answer read back through a pipe (Linux, one thread only).

    job = Forked(fn, a, b)          # fn(a, b) starts in a child process
    ...                             # this process goes on meanwhile
    value = job.result()            # fn's return value; Unanswered if the child raised or died
    job.cancel()                    # or: stop it (the child and every process it forked)

    fork_map(fn, items, processes)  # [fn(x) for x in items], each in a child, up to `processes` at a time

A child computes with a copy of this process's memory what this process would compute, so its answer is the same
(fn must be deterministic); its stdout and stderr go to /dev/null, and it never returns into the caller's code.
Forking is used only where engine/memory_worker.py forks: on Linux, in a process with one thread (a fork of one
with others can leave a lock held in the child), with two cores or more available to it; work split to gain time
on idle cores at some extra CPU (`spare_core`) only while the load average leaves one idle.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
import threading
from collections import deque
from typing import Any, Callable, Iterable


class Unanswered(Exception):
    """A forked job gave no answer (it raised, was cancelled or died): compute it here instead."""


def cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1


def fork_available() -> bool:
    """Whether this system forks safely at all: Linux (fork is unsafe on macOS, absent on Windows)."""
    return hasattr(os, "fork") and sys.platform.startswith("linux")


def fork_safe() -> bool:
    """Whether forking a worker is safe and worth it here: Linux, one thread, two cores or more."""
    return fork_available() and threading.active_count() == 1 and cores() >= 2


def spare_core() -> bool:
    """Whether forking is safe and a core is likely idle: the 1-minute load average below the cores (work that a
    helper process does beside this one costs more CPU in all than doing it here, which pays only on idle cores)."""
    return fork_safe() and os.getloadavg()[0] < cores()


def write_answer(fd: int, answer: tuple[bool, Any]) -> None:
    """In a forked child: write its answer, (whether it computed it, the value or None / the error), to the pipe
    `fd` and close it (a Forked's result or a memory worker's parent reads it with pickle.loads)."""
    with os.fdopen(fd, "wb") as out:
        out.write(pickle.dumps(answer, protocol=pickle.HIGHEST_PROTOCOL))


class Forked:
    """fn(*args) computed in a forked child process. `own_group`: the child leads a process group of its own, so
    that `cancel` also stops the processes it forks (they stay in its group)."""

    def __init__(self, fn: Callable, *args: Any, own_group: bool = False):
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:                                  # the child: never returns
            status = 1
            try:
                os.close(read)
                if own_group:
                    os.setpgid(0, 0)
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, 1)
                os.dup2(devnull, 2)
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                try:
                    answer = (True, fn(*args))
                except Exception:                     # the caller computes it again and sees the error there
                    answer = (False, None)
                write_answer(write, answer)
                status = 0
            finally:
                os._exit(status)
        os.close(write)
        if own_group:
            try:
                os.setpgid(pid, pid)                  # as the child does: whichever runs first
            except OSError:
                pass
        self.pid: int | None = pid
        self.own_group = own_group
        self._read = read

    def result(self) -> Any:
        """The child's answer (waits for it); Unanswered if it has none."""
        if self.pid is None:
            raise Unanswered("cancelled")
        with os.fdopen(self._read, "rb") as answer:
            data = answer.read()
        self._reap()
        try:
            ok, value = pickle.loads(data)
        except Exception as error:                    # no answer, or a truncated one: the child died
            raise Unanswered("no answer") from error
        if not ok:
            raise Unanswered("the job raised")
        return value

    def cancel(self) -> None:
        """Stop the child (and its group) if it still runs; nothing after `result`."""
        if self.pid is None:
            return
        try:
            if self.own_group:
                os.killpg(self.pid, signal.SIGKILL)
            else:
                os.kill(self.pid, signal.SIGKILL)
        except OSError:                               # it has ended already
            pass
        os.close(self._read)
        self._reap()

    def _reap(self) -> None:
        try:
            os.waitpid(self.pid, 0)
        except ChildProcessError:
            pass
        self.pid = None


def fork_map(fn: Callable, items: Iterable, processes: int) -> list:
    """[fn(x) for x in items], each item in a child forked as soon as `items` yields it (a generator may compute
    the next one meanwhile), at most `processes` children at once (the oldest is waited for); computed here where
    forking is not safe, or where its child gives no answer."""
    if processes < 1 or not fork_safe():
        return [fn(item) for item in items]
    out: list = []
    running: deque[tuple[int, Any, Forked]] = deque()
    try:
        for item in items:
            if len(running) >= processes:
                _collect(fn, running.popleft(), out)
            out.append(None)
            running.append((len(out) - 1, item, Forked(fn, item)))
        while running:
            _collect(fn, running.popleft(), out)
    finally:
        for *_, child in running:
            child.cancel()
    return out


def _collect(fn: Callable, job: tuple[int, Any, Forked], out: list) -> None:
    index, item, child = job
    try:
        out[index] = child.result()
    except Unanswered:
        out[index] = fn(item)
