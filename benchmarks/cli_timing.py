"""Time one `python3 -m simulator.cli run FILE --json` in a source tree: wall seconds and peak resident memory of its
whole process tree (the engine and its memory workers), shared by bench_targets.py and bench_microbatches.py."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

SAMPLE_S = 0.1          # how often the process tree's resident set is read


@dataclass
class Timed:
    """One run: wall seconds, the largest total RSS of its process tree seen (bytes), exit status, stdout's md5."""

    wall_s: float
    peak_rss_bytes: int
    returncode: int | None      # None: stopped at the time limit
    md5: str
    error: str = ""


def _children(pid: int) -> list[int]:
    """The direct children of `pid` (Linux: /proc/PID/task/TID/children)."""
    out: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as handle:
                out += [int(word) for word in handle.read().split()]
    except OSError:
        pass
    return out


def _rss_bytes(pid: int) -> int:
    """VmRSS of `pid` in bytes (0 once it has gone)."""
    try:
        with open(f"/proc/{pid}/status") as handle:
            for line in handle:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def tree_rss_bytes(root: int) -> int:
    """The summed RSS of `root` and all its descendants (pages a forked worker shares with the engine count in
    both, as `ps` shows them)."""
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        total += _rss_bytes(pid)
        todo += _children(pid)
    return total


def run_cli(tree: Path, scenario: Path, timeout_s: float, extra: tuple[str, ...] = ()) -> Timed:
    """`python3 -m simulator.cli run SCENARIO --json` with `tree` as the working directory (so `simulator` is that
    tree's), stdout to a file; its wall time and the peak RSS of its process tree, sampled every SAMPLE_S."""
    command = [sys.executable, "-m", "simulator.cli", "run", str(scenario), "--json", *extra]
    env = dict(os.environ, PYTHONPATH=str(tree))
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        start = time.perf_counter()
        process = subprocess.Popen(command, cwd=tree, env=env, stdout=out, stderr=err)
        peak = [0]
        done = threading.Event()

        def sample() -> None:
            while not done.is_set():
                peak[0] = max(peak[0], tree_rss_bytes(process.pid))
                done.wait(SAMPLE_S)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            returncode: int | None = process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            returncode = None
        except BaseException:         # interrupted: leave no simulation running
            process.kill()
            done.set()
            raise
        wall = time.perf_counter() - start
        done.set()
        sampler.join()
        out.seek(0)
        err.seek(0)
        digest = hashlib.md5(out.read()).hexdigest()
        message = err.read().decode(errors="replace").strip().splitlines()
    return Timed(wall, peak[0], returncode, digest, message[-1] if message and returncode else "")


@contextlib.contextmanager
def compared_trees(old: str, repository: Path) -> Iterator[dict[str, Path]]:
    """{"new": repository} plus {"old": a detached git worktree of `old`} (unless old is "none"), removed on exit;
    SIGTERM exits through it, so a stopped benchmark leaves no worktree behind."""
    trees = {"new": repository}
    if old == "none":
        yield trees
        return
    folder = Path(tempfile.mkdtemp(prefix="memsim-old-"))
    path = folder / "tree"
    subprocess.run(["git", "-C", str(repository), "worktree", "add", "--detach", str(path), old],
                   check=True, capture_output=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        yield {**trees, "old": path}
    finally:
        subprocess.run(["git", "-C", str(repository), "worktree", "remove", "--force", str(path)],
                       capture_output=True)
        shutil.rmtree(folder, ignore_errors=True)
