"""Memory calls logged by the executor and made afterwards (engine/memory_log.py), in this process or by forked
workers (engine/memory_worker.py): the same results either way, errors raised as in-process, a dead worker's
ranks made here, and the log words naming the instructions that make the calls."""

from __future__ import annotations

import os
import threading

import pytest
from hypothesis import given, settings, strategies as st
from typer.testing import CliRunner

import simulator.api as api
from simulator.cli import app
from simulator.engine import memory_worker
from simulator.engine.allocator import make_allocator
from simulator.engine.executor import EngineOptions, simulate_programs
from simulator.engine.memory_log import INDEX_SHIFT, MAX_STREAMS, STREAM_SHIFT, where
from simulator.parallel.program import Free, Program, Run
from simulator.scenario import scenario_from_dict
from simulator.workload.graph import ACTIVATIONS, Op, Tensor
from test_scale_inline import _doc, _everything

pytestmark = pytest.mark.skipif(not memory_worker.workers_for(1, 0, 2), reason="needs os.fork on Linux")

MIB = 2**20


def _with_workers(monkeypatch, count: int | None, **options):
    monkeypatch.setattr(api, "EngineOptions", lambda: EngineOptions(memory_workers=count, **options))


def _answered(monkeypatch) -> list[int]:
    """The number of ranks the workers of each simulation answered for (not made in the engine afterwards)."""
    answered: list[int] = []
    finish = memory_worker.MemoryWorkers.finish

    def counted(self):
        outcomes = finish(self)
        answered.append(self.answered)
        return outcomes
    monkeypatch.setattr(memory_worker.MemoryWorkers, "finish", counted)
    return answered


@pytest.mark.parametrize("nodes, global_batch, parallel, record_events", [
    (4, 32, {"tp": 8, "pp": 4, "dp": 1, "sequence_parallel": True}, False),     # periods and stretches replayed
    (1, 8, {"tp": 2, "pp": 2, "dp": 2}, True),          # allocator events recorded, shadows on shared links
])
def test_workers_give_the_in_process_result(monkeypatch, nodes, global_batch, parallel, record_events):
    doc = _doc(nodes, global_batch, **parallel)
    doc["run"]["record_events"] = record_events
    _with_workers(monkeypatch, 0)
    here = _everything(api.simulate(scenario_from_dict(doc)))
    _with_workers(monkeypatch, 1)
    answered = _answered(monkeypatch)
    assert _everything(api.simulate(scenario_from_dict(doc))) == here
    assert answered == [len(here[1])]          # every rank's outcome came from the worker, none made here after
    assert any(rank[1] for rank in here[1]) and (any(rank[3] for rank in here[1]) or not record_events)


def _program(tensors: dict[int, Tensor], compute: tuple) -> Program:
    return Program(0, "gpu", 0, tensors, {"compute": compute})


def _run(programs: list[Program], capacity: int, workers: int):
    allocators = [make_allocator("caching", capacity, record_events=True) for _ in programs]
    return simulate_programs(programs, allocators, [capacity] * len(programs), EngineOptions(memory_workers=workers))


def _oom_program() -> Program:
    tensors = {i: Tensor(i, f"t{i}", (i + 1) * 64 * MIB, ACTIVATIONS) for i in range(6)}
    compute = tuple(Run(Op(f"op{i}", "gemm", "fwd", allocs=(i,)), 1e-3) for i in range(6)) \
        + (Free((0, 1, 2), "done"),)
    return _program(tensors, compute)


def test_an_out_of_memory_is_reported_the_same_by_a_worker():
    here, there = _run([_oom_program()], 512 * MIB, 0), _run([_oom_program()], 512 * MIB, 1)
    assert here.ranks[0].oom is not None and here.ranks[0].oom == there.ranks[0].oom
    assert (here.ranks[0].peak_allocated, here.ranks[0].allocator_events, here.ranks[0].final_segments) \
        == (there.ranks[0].peak_allocated, there.ranks[0].allocator_events, there.ranks[0].final_segments)


def test_an_error_of_the_memory_calls_is_raised_by_the_engine():
    # Freeing a tensor that was never allocated: a program error, raised the same way from a worker.
    tensors = {0: Tensor(0, "t0", MIB, ACTIVATIONS)}
    program = _program(tensors, (Run(Op("op", "gemm", "fwd"), 1e-3), Free((0,), "bad")))
    errors = []
    for workers in (0, 1):
        with pytest.raises(Exception) as caught:
            _run([program], 80 * 2**30, workers)
        errors.append((type(caught.value), caught.value.args))
    assert errors[0] == errors[1]


def test_a_dead_worker_leaves_its_ranks_to_the_engine(monkeypatch):
    monkeypatch.setattr(memory_worker, "_serve", lambda *args: os._exit(3))
    here, there = _run([_oom_program()], 512 * MIB, 0), _run([_oom_program()], 512 * MIB, 1)
    assert (here.ranks[0].oom, here.ranks[0].allocator_events, here.ranks[0].peak_reserved) \
        == (there.ranks[0].oom, there.ranks[0].allocator_events, there.ranks[0].peak_reserved)


def test_several_workers_share_the_ranks(monkeypatch):
    # More ranks than workers, and chunks sent while the engine runs (a small chunk size).
    monkeypatch.setattr(memory_worker, "CHUNK_CALLS", 4)
    doc = _doc(4, 8, tp=8, pp=4, dp=1, sequence_parallel=True)
    _with_workers(monkeypatch, 0)
    here = _everything(api.simulate(scenario_from_dict(doc)))
    assert _everything(api.simulate(scenario_from_dict(doc), memory_workers=3)) == here


def test_a_worker_behind_queues_its_calls_in_the_engine(monkeypatch):
    # A one-page pipe and a slow worker: the pipe fills, the engine goes on with the rest queued (partial writes
    # included), and the queue is written once the engine has ended; the results are the in-process ones.
    import time

    slow_apply = memory_worker.apply
    monkeypatch.setattr(memory_worker, "apply", lambda *args: (time.sleep(0.002), slow_apply(*args)))
    monkeypatch.setattr(memory_worker, "CHUNK_CALLS", 4)
    monkeypatch.setattr(memory_worker, "PIPE_BYTES", 4096)
    full = []
    drain = memory_worker._Worker.drain
    monkeypatch.setattr(memory_worker._Worker, "drain", lambda self: full.append(not drain(self)) or not full[-1])
    # The queue copies nothing: each queued part is a view of a chunk the engine keeps anyway (MemoryWorkers.sent,
    # in case the worker dies) or a chunk's header, so what a full pipe leaves queued is bounded by the log itself.
    queued = []
    send = memory_worker.MemoryWorkers.send

    def checked_send(self, i, cut=None):
        send(self, i, cut)
        kept = {id(column) for chunks in self.sent for chunk in chunks for column in chunk}
        queued.append(max((len(w.pending) for w in self.workers), default=0))
        for worker in self.workers:
            for part in worker.pending:
                assert id(part.obj) in kept or len(part.obj) == memory_worker._HEADER.size
    monkeypatch.setattr(memory_worker.MemoryWorkers, "send", checked_send)
    doc = _doc(4, 8, tp=8, pp=4, dp=1, sequence_parallel=True)
    here = _everything(api.simulate(scenario_from_dict(doc), memory_workers=0))
    assert _everything(api.simulate(scenario_from_dict(doc), memory_workers=2)) == here
    assert any(full) and max(queued) > 0


_TINY = """
name = "tiny"
[model]
architecture = "gpt"
num_layers = 4
hidden_size = 128
num_attention_heads = 8
vocab_size = 512
seq_length = 32
[training]
micro_batch_size = 1
global_batch_size = 8
precision = "bf16-mixed"
framework = "megatron"
recompute = "full"
[parallel]
tp = 8
pp = 4
sequence_parallel = true
[cluster]
topology = "dgx-a100"
nodes = 4
"""


def test_auto_uses_workers_only_for_large_runs_in_a_single_thread():
    cores = len(os.sched_getaffinity(0))
    assert threading.active_count() == 1
    assert memory_worker.workers_for(None, memory_worker.MIN_INSTRUCTIONS - 1, 16) == 0
    assert memory_worker.workers_for(None, memory_worker.MIN_INSTRUCTIONS, 16) == (
        0 if cores < 2 else min(max(cores - 1, 2), memory_worker.MAX_WORKERS))
    stop = threading.Event()
    other = threading.Thread(target=stop.wait)
    other.start()
    try:
        assert memory_worker.workers_for(None, memory_worker.MIN_INSTRUCTIONS, 16) == 0
        assert memory_worker.workers_for(2, 0, 16) == 2          # asked for: forked anyway
    finally:
        stop.set()
        other.join()
    assert memory_worker.workers_for(0, 10**9, 16) == 0
    assert memory_worker.workers_for(5, 0, 16) == 5 and memory_worker.workers_for(5, 0, 2) == 2


def test_the_command_line_sets_the_workers(tmp_path):
    # --memory-workers 0 and 3 give the same report; a negative count is refused with exit status 2.
    scenario = tmp_path / "tiny.toml"
    scenario.write_text(_TINY)
    runs = [CliRunner().invoke(app, ["run", str(scenario), "--json", "--memory-workers", count])
            for count in ("0", "3", "-1")]
    assert runs[0].exit_code == runs[1].exit_code == 0 and runs[0].stdout == runs[1].stdout
    assert runs[2].exit_code == 2 and "memory-workers" in runs[2].output


@settings(max_examples=200, deadline=None)
@given(stream=st.integers(0, MAX_STREAMS - 1), index=st.integers(0, 2**50), code=st.integers(0, 15))
def test_a_word_names_its_stream_instruction_and_code(stream, index, code):
    word = where(stream, index) | code
    assert (word & 15, (word >> STREAM_SHIFT) & (MAX_STREAMS - 1), word >> INDEX_SHIFT) == (code, stream, index)
    assert where(stream, index) + where(0, 7) == where(stream, index + 7)      # how stretch records move words
