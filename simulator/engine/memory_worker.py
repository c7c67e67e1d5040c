"""Makes the ranks' logged memory calls in forked worker processes while the engine runs (other cores' work).

The executor never waits for memory (engine/memory_log.py), so on a machine with two cores or more a large run
forks workers once the ranks are set up, each owning some of the ranks: a worker holds a copy of its ranks'
RankMemory and program, the engine sends it each of those ranks' log in chunks through a pipe (two 8-byte
columns per call) as it grows, and at the end the worker sends back their MemoryOutcomes. The engine never waits
for a worker while it runs: what a full pipe does not take waits in the engine's queue for the next send — views
of the chunks the engine keeps anyway, so the queue holds no more than the log itself (a
worker behind with heavy ranks had held the engine ~1.4 s of 6.5 at GPT-3 175B on 1,024 GPUs, its other worker
idle meanwhile); the rest is written once the engine has ended. The calls are the
same, made in the same order per rank, so the results are those of making them in the engine's process
(tests/test_memory_log.py compares them). The engine keeps what it sent, so if a worker dies without an answer
its ranks' calls are made in-process instead; an error the calls raise (a program freeing an unknown tensor) is
raised by the engine as it was by the worker.
"""

from __future__ import annotations

import os
import pickle
import select
import struct
from array import array
from collections import deque
from typing import TYPE_CHECKING

from simulator.engine.memory_log import apply
from simulator.forked import cores, fork_available, fork_safe, write_answer
from simulator.trace.records import AllocatorEvent

if TYPE_CHECKING:
    from simulator.engine.memory import MemoryOutcome
    from simulator.engine.rank_state import RankState

CHUNK_CALLS = 8192                 # a rank's log is sent when it holds this many calls (at a period boundary)
MAX_WORKERS = 8
# The most a caller may ask for: past the hardware threads of the largest servers (768: two 192-core EPYC 9965,
# AMD, 2024), a worker is a process with nothing to run on.
MAX_CHOSEN_WORKERS = 1024
WORKER_NICENESS = 10
# Smaller runs make their calls in-process. Measured on 2 cores (`memsim run --json`, wall): at 89 k
# instructions (LLaMA-7B PP4 on 4 × 4090) and 190 k (LLaMA-70B on 64 H100) workers gained nothing; at 247 k
# (GPT-3 175B, global batch 256) 4.1-4.7 s instead of 5.8-6.6 s; at 1.4 M (global batch 1,536) ~30%.
MIN_INSTRUCTIONS = 100_000
PIPE_BYTES = 1 << 20               # the pipe's buffer, where the system allows it (Linux: F_SETPIPE_SZ)
_HEADER = struct.Struct("<iq")     # rank index (-1: no more), number of calls


def workers_for(choice: int | None, instructions: int, ranks: int) -> int:
    """How many workers to fork (0: make the calls in-process). `choice` (EngineOptions.memory_workers): that many,
    at most one per rank; None: for a large run (`instructions` in all programs) in a process with one thread
    (forking one with others, a notebook's kernel, can leave a lock held in the child) and two cores or more
    available to it, one per core beyond the engine's but at least two (the engine's core then shares the
    work), at most one per rank and MAX_WORKERS. Always 0 off Linux (fork is unsafe on macOS, absent on
    Windows)."""
    if choice == 0 or not fork_available():
        return 0
    if choice is not None:
        return min(choice, ranks)
    if instructions < MIN_INSTRUCTIONS or not fork_safe():
        return 0
    return min(max(cores() - 1, 2), ranks, MAX_WORKERS)


class _Worker:
    """One forked worker: its process, the engine's end of its two pipes and what its calls pipe has not taken yet."""

    def __init__(self, states: list[RankState], others: list[_Worker]):
        calls_read, calls_write = os.pipe()
        outcome_read, outcome_write = os.pipe()
        _widen(calls_write)
        self.pid = os.fork()
        if self.pid == 0:                          # the worker: never returns
            for other in others:                   # the pipes of workers forked before it are not its own
                other.release_fds()
            os.close(calls_write)
            os.close(outcome_read)
            _serve(states, calls_read, outcome_write)
        os.close(calls_read)
        os.close(outcome_write)
        os.set_blocking(calls_write, False)
        self.calls = calls_write
        self.outcomes = os.fdopen(outcome_read, "rb")
        self.pending: deque[memoryview] = deque()      # bytes written to the pipe when it takes them
        self.alive = True

    def release_fds(self) -> None:
        """In a later worker: close this worker's pipe ends, inherited from the engine (its EOF depends on it)."""
        for fd in (self.calls, self.outcomes.fileno()):
            os.close(fd)

    def write(self, *parts) -> None:
        """Queue `parts` (bytes-like) for the worker and write what the pipe takes now."""
        if self.alive:
            self.pending.extend(memoryview(part).cast("B") for part in parts)
            self.drain()

    def drain(self) -> bool:
        """Write queued bytes until the pipe is full; True when none are left."""
        pending = self.pending
        while pending:
            part = pending[0]
            try:
                written = os.write(self.calls, part)
            except BlockingIOError:
                return False
            except OSError:                        # the worker is gone: its ranks' calls are made in-process
                self.alive = False
                pending.clear()
                return True
            if written == len(part):
                pending.popleft()
            else:
                pending[0] = part[written:]
        return True

    def answer(self) -> dict | None:
        """Take the worker's answer once every call was written and the pipe closed (None if it gave none)."""
        if not self.alive:
            return None
        try:
            data = self.outcomes.read()
        except OSError:
            return None
        try:
            done, value = pickle.loads(data)
        except Exception:                          # no answer, or cut short: the worker died writing it
            return None
        if not done:
            raise value
        return value

    def close(self) -> None:
        """Stop the worker if it still runs (the engine failed) and reap it."""
        if not self.pid:
            return
        self.end()
        try:
            self.outcomes.close()
        except OSError:
            pass
        try:
            os.kill(self.pid, 9)
        except ProcessLookupError:
            pass
        os.waitpid(self.pid, 0)
        self.pid = 0
        self.alive = False

    def end(self) -> None:
        """Close the calls pipe (the worker reads its end of file); once only."""
        if self.calls >= 0:
            os.close(self.calls)
            self.calls = -1


class MemoryWorkers:
    """The workers making the ranks' memory calls, each rank's owned by one (balanced by instruction count)."""

    def __init__(self, states: list[RankState], sizes: list[int], count: int):
        """`count` workers for `states`, whose programs hold `sizes` instructions."""
        self.states = states
        self.sent: list[list[tuple[array, array]]] = [[] for _ in states]     # per rank, the chunks sent
        self.answered = 0                    # ranks the workers answered for, once finished (the rest made here)
        loads = [0] * count
        owned: list[list[int]] = [[] for _ in range(count)]
        for i in sorted(range(len(states)), key=lambda i: (-sizes[i], i)):
            least = loads.index(min(loads))
            owned[least].append(i)
            loads[least] += sizes[i]
        self.workers: list[_Worker] = []
        self.owner: dict[int, _Worker] = {}
        for ranks in owned:
            worker = _Worker(states, self.workers)
            self.workers.append(worker)
            self.owner.update((i, worker) for i in ranks)
        for i, state in enumerate(states):
            state.flush_log = self._flusher(i)

    def _flusher(self, i: int):
        state = self.states[i]

        def flush() -> None:
            log = state.log
            if len(log) >= CHUNK_CALLS:
                # A Send's Free still to come is logged at env.now or later, before the calls of that time on
                # (MemoryLog.add_sent_free): only the calls before it are final.
                self.send(i, log.settled(state.env.now))
        return flush

    def send(self, i: int, cut: int | None = None) -> None:
        """Send rank i's logged calls (the first `cut`) to its worker (the engine keeps them in case the worker
        dies)."""
        words, times = self.states[i].log.take(cut)
        if words:
            self.sent[i].append((words, times))
            self.owner[i].write(_HEADER.pack(i, len(words)), words, times)
            for worker in self.workers:            # a worker that was behind may take more now
                if worker.pending:
                    worker.drain()

    def finish(self) -> list[MemoryOutcome]:
        """Send what is left and take every rank's outcome (made here for ranks whose worker gave none)."""
        for i in range(len(self.states)):
            self.send(i)
        for worker in self.workers:
            worker.write(_HEADER.pack(-1, 0))
        self._write_all()
        outcomes: dict[int, MemoryOutcome] = {}
        for worker in self.workers:
            answer = worker.answer()
            worker.close()
            if answer is not None:
                for outcome in answer.values():
                    outcome.events = [AllocatorEvent(*row) for row in outcome.events]
                outcomes.update(answer)
        self.answered = len(outcomes)
        for i, state in enumerate(self.states):
            if i not in outcomes:
                for words, times in self.sent[i]:
                    apply(state.memory, state.program, words, times)
                outcomes[i] = state.memory.outcome()
        return [outcomes[i] for i in range(len(self.states))]

    def _write_all(self) -> None:
        """Write every worker's queued bytes, to each as soon as its pipe takes them, then close the pipes."""
        waiting = [worker for worker in self.workers if not worker.drain()]
        while waiting:
            _, ready, _ = select.select([], [worker.calls for worker in waiting], [])
            waiting = [worker for worker in waiting if worker.calls not in ready or not worker.drain()]
        for worker in self.workers:
            worker.end()

    def close(self) -> None:
        """Stop every worker still running and reap it."""
        for worker in self.workers:
            worker.close()


def _widen(fd: int) -> None:
    try:
        import fcntl
        fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
    except (ImportError, AttributeError, OSError):
        pass                               # the default buffer only makes the engine wait more often


def _serve(states: list[RankState], calls_fd: int, outcome_fd: int) -> None:
    """A worker's life: make each chunk's calls on its rank's memory, then answer with those ranks' outcomes."""
    status = 1
    try:
        # The engine is the critical path: on a machine with fewer cores than processes, it runs first.
        os.nice(WORKER_NICENESS)
        calls = os.fdopen(calls_fd, "rb")
        served: set[int] = set()
        try:
            while True:
                i, count = _HEADER.unpack(calls.read(_HEADER.size))
                if i < 0:
                    break
                words, times = array("q"), array("d")
                words.frombytes(calls.read(8 * count))
                times.frombytes(calls.read(8 * count))
                apply(states[i].memory, states[i].program, words, times)
                served.add(i)
            answer = (True, {i: states[i].memory.outcome(event_rows=True) for i in served})
        except Exception as error:                          # raised by the engine instead
            answer = (False, error)
        write_answer(outcome_fd, answer)
        status = 0
    finally:
        os._exit(status)
