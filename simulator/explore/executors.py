"""Where sweep and search work runs: one interface over in-process, a local process pool and Dask.

`open_executor("local:4")` (a process pool of 4; `local` = one per core, `local:1` = in this process),
`open_executor("dask-local:4")` (a dask.distributed LocalCluster of 4 single-threaded worker processes) and
`open_executor("dask://HOST:PORT")` (a running scheduler) all give an `Executor`:

- `map(fn, items)`: the results in the order of `items`;
- `imap_unordered(fn, items)`: (index, result) pairs as the results arrive;
- `close(interrupted=False)`: release the workers (on an interrupt, stop them without waiting).

`fn` must be a module-level function and `items` picklable. Results never depend on the executor: every
caller orders them by index before writing anything. A worker process that dies mid-task loses nothing: the
local pool restarts and resubmits what was unfinished (up to MAX_POOL_RESTARTS times), and Dask's scheduler
reruns a lost worker's tasks elsewhere (its `distributed.scheduler.allowed-failures`, default 3).
"""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any, Protocol

from simulator.errors import ExecutorError

MAX_POOL_RESTARTS = 3          # local pool: how many times dead worker processes are replaced in one call
CONNECT_TIMEOUT_S = 3.0        # dask://: how long to try reaching the scheduler
_SPEC = re.compile(r"^(?:(?P<local>local)(?::(?P<n>\d+))?|dask-local:(?P<dn>\d+)|dask://(?P<host>[^:/\s]+):(?P<port>\d+))$")
ALLOWED = "local, local:N, dask-local:N or dask://HOST:PORT (N >= 1 workers)"


class Executor(Protocol):
    """Runs a function over items on some workers."""

    description: str
    workers: int
    in_process: bool          # whether fn runs in this process

    def map(self, fn: Callable[[Any], Any], items: Iterable[Any]) -> list[Any]: ...

    def imap_unordered(self, fn: Callable[[Any], Any], items: Iterable[Any]) -> Iterator[tuple[int, Any]]: ...

    def close(self, interrupted: bool = False) -> None: ...


@dataclass(frozen=True)
class ExecutorSpec:
    """A parsed --executor value."""

    kind: str                  # "local" | "dask-local" | "dask"
    workers: int | None        # None: one per core (local) or the scheduler's (dask)
    address: str | None = None

    @property
    def text(self) -> str:
        """The spec as the user writes it."""
        if self.kind == "dask":
            return f"dask://{self.address}"
        return self.kind if self.workers is None else f"{self.kind}:{self.workers}"


def parse_executor(text: str) -> ExecutorSpec:
    """Parse an --executor value.

    Raises:
        ExecutorError: not one of the allowed forms.
    """
    match = _SPEC.match(text.strip()) if isinstance(text, str) else None
    if match is None:
        raise ExecutorError(f"--executor {text!r}: must be {ALLOWED}")
    if match["host"] is not None:
        return ExecutorSpec("dask", None, f"{match['host']}:{match['port']}")
    count = match["n"] if match["local"] else match["dn"]
    workers = None if count is None else int(count)
    if workers is not None and not 1 <= workers <= 4096:
        raise ExecutorError(f"--executor {text!r}: the worker count must be from 1 to 4096")
    return ExecutorSpec("local" if match["local"] else "dask-local", workers)


def available_cores() -> int:
    """Cores this process may run on (its CPU affinity), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:          # not on Linux
        return max(1, os.cpu_count() or 1)


def open_executor(text: str | None = None) -> Executor:
    """Start the executor an --executor value names (None: "local").

    Raises:
        ExecutorError: a malformed spec, dask.distributed missing, or a scheduler not reachable in
            CONNECT_TIMEOUT_S seconds.
    """
    spec = parse_executor("local" if text is None else text)
    if spec.kind == "local":
        workers = available_cores() if spec.workers is None else spec.workers
        return InlineExecutor() if workers == 1 else ProcessExecutor(workers)
    return DaskExecutor.start(spec)


class InlineExecutor:
    """Runs everything in this process, one item after another (`local:1`)."""

    description = "local:1 (in this process)"
    workers = 1
    in_process = True

    def map(self, fn, items):
        return [fn(item) for item in items]

    def imap_unordered(self, fn, items):
        for index, item in enumerate(items):
            yield index, fn(item)

    def close(self, interrupted: bool = False) -> None:
        pass


def _ignore_interrupts() -> None:
    """Pool workers leave Ctrl-C to the parent, which stops them once it has saved what finished; SIGTERM (what
    the parent stops them with) ends them at once, not as the memsim command's handler does (cli.main)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


class ProcessExecutor:
    """A pool of worker processes on this machine (`local:N`)."""

    in_process = False

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self.description = f"local:{workers} (process pool)"
        self._pool: ProcessPoolExecutor | None = None

    def _fresh_pool(self) -> ProcessPoolExecutor:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        self._pool = ProcessPoolExecutor(max_workers=self.workers, initializer=_ignore_interrupts)
        return self._pool

    def map(self, fn, items):
        items = list(items)
        results: list[Any] = [None] * len(items)
        for index, result in self.imap_unordered(fn, items):
            results[index] = result
        return results

    def imap_unordered(self, fn, items):
        items = list(items)
        pending = set(range(len(items)))
        restarts = 0
        while pending:
            pool = self._pool or self._fresh_pool()
            futures = {pool.submit(fn, items[index]): index for index in sorted(pending)}
            try:
                while futures:
                    done, _ = wait(futures, return_when=FIRST_COMPLETED)
                    for future in sorted(done, key=futures.__getitem__):
                        index = futures.pop(future)
                        result = future.result()
                        pending.discard(index)
                        yield index, result
            except BrokenProcessPool:
                restarts += 1
                if restarts > MAX_POOL_RESTARTS:
                    raise ExecutorError(f"--executor {self.description}: worker processes died {restarts} times "
                                        f"(killed, or out of memory?); {len(pending)} items unfinished") from None
                self._fresh_pool()

    def close(self, interrupted: bool = False) -> None:
        if self._pool is None:
            return
        if interrupted:
            import multiprocessing

            self._pool.shutdown(wait=False, cancel_futures=True)
            for child in multiprocessing.active_children():
                child.terminate()
        else:
            self._pool.shutdown(wait=True)
        self._pool = None


class DaskExecutor:
    """Tasks on a dask.distributed cluster: a LocalCluster it starts (`dask-local:N`) or a scheduler (`dask://`)."""

    in_process = False

    def __init__(self, client, cluster, description: str, workers: int) -> None:
        self._client, self._cluster = client, cluster
        self.description, self.workers = description, workers

    @classmethod
    def start(cls, spec: ExecutorSpec) -> DaskExecutor:
        """Connect to (or start) the cluster `spec` names."""
        try:
            import logging

            from distributed import Client, LocalCluster
        except ImportError:
            raise ExecutorError(f"--executor {spec.text}: dask.distributed is not installed "
                                f"(pip install 'memsim[cluster]')") from None
        if spec.kind == "dask-local":
            try:
                cluster = LocalCluster(n_workers=spec.workers, threads_per_worker=1, processes=True,
                                       dashboard_address=None, silence_logs=logging.ERROR)
            except (OSError, RuntimeError, TimeoutError) as error:
                raise ExecutorError(f"--executor {spec.text}: the Dask LocalCluster did not start "
                                    f"({' '.join(str(error).split())[:160]})") from None
            return cls(Client(cluster), cluster, f"{spec.text} (dask LocalCluster)", spec.workers)
        try:
            client = Client(f"tcp://{spec.address}", timeout=CONNECT_TIMEOUT_S)
        except (OSError, TimeoutError) as error:
            reason = " ".join(str(error).split()) or type(error).__name__
            raise ExecutorError(f"--executor {spec.text}: cannot reach the Dask scheduler within "
                                f"{CONNECT_TIMEOUT_S:g} s ({reason[:160]})") from None
        workers = max(1, sum(info.get("nthreads", 1) for info in client.scheduler_info()["workers"].values()))
        return cls(client, None, f"{spec.text} (dask scheduler)", workers)

    def map(self, fn, items):
        return self._client.gather(self._client.map(fn, list(items), pure=False))

    def imap_unordered(self, fn, items):
        from distributed import as_completed

        futures = self._client.map(fn, list(items), pure=False)
        index_of = {future.key: index for index, future in enumerate(futures)}
        try:
            for future, result in as_completed(futures, with_results=True):
                yield index_of[future.key], result
        except Exception as error:
            if type(error).__name__ == "KilledWorker":
                raise ExecutorError(f"--executor {self.description}: a task killed every worker that ran it "
                                    f"({error})") from None
            raise

    def close(self, interrupted: bool = False) -> None:
        try:
            self._client.close(timeout=2 if interrupted else 10)
        finally:
            if self._cluster is not None:
                self._cluster.close(timeout=2 if interrupted else 10)
