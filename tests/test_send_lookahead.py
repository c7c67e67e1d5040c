"""The compute stream runs ahead past a pending Send whose Free follows (EngineOptions.send_lookahead): the Free is
logged by its time (MemoryLog.add_sent_free), and every output equals the one without the shortcut."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import simulator.api as api
from simulator.engine import memory_worker
from simulator.engine.allocator import ExactAllocator
from simulator.engine.executor import EngineOptions, simulate_programs
from simulator.engine.memory_log import BOUNDARY, RUN_ALLOC, SENT_FREE, STRETCH, MemoryLog, stretch_word, where
from simulator.engine.rank_state import RankState
from simulator.network import load_topology
from simulator.parallel.program import Free, Program, Recv, Run, Send, Signal, WaitFor
from simulator.scenario import scenario_from_dict
from simulator.workload.graph import ACTIVATIONS, Op, Tensor
from test_scale_inline import _doc, _everything


def _log(entries) -> MemoryLog:
    log = MemoryLog()
    for word, time_s in entries:
        log.add(word, time_s)
    return log


def test_a_sent_free_goes_after_earlier_calls_and_before_the_rest():
    run = [where(0, i) | RUN_ALLOC for i in range(4)]
    log = _log(zip(run, [1.0, 2.0, 2.0, 3.0]))
    log.add_sent_free(where(2, 7) | SENT_FREE, 2.0)          # a tie: before the calls of its time
    assert list(log.times) == [1.0, 2.0, 2.0, 2.0, 3.0] and log.words[1] == where(2, 7) | SENT_FREE
    log.add_sent_free(where(1, 5) | SENT_FREE, 2.0)          # another stream's at that time: by stream number
    log.add_sent_free(where(3, 9) | SENT_FREE, 2.0)
    log.add_sent_free(where(2, 8) | SENT_FREE, 2.0)          # the same stream's next: after its first
    assert list(log.words[1:5]) == [where(1, 5) | SENT_FREE, where(2, 7) | SENT_FREE, where(2, 8) | SENT_FREE,
                                    where(3, 9) | SENT_FREE]
    log.add_sent_free(where(2, 10) | SENT_FREE, 5.0)         # after everything
    assert log.words[-1] == where(2, 10) | SENT_FREE


def test_a_sent_free_among_a_replayed_stretch_drops_its_stretch_word():
    calls = [where(0, i) | RUN_ALLOC for i in range(3)]
    log = _log([(where(0, 9) | BOUNDARY, 0.5)])
    log.note_blocks(((0, 3), (4, 1)), 0.5)                  # one replay's two STRETCH words (Stretches._apply)
    for word, time_s in [(stretch_word(0, 3), 7.0)] + list(zip(calls, [1.0, 2.0, 3.0])) \
            + [(stretch_word(1, 1), 7.0), (calls[0], 4.0)]:
        log.add(word, time_s)
    assert log.blocks == [[1, 3], [5, 1]]
    log.add_sent_free(where(1, 4) | SENT_FREE, 1.5)
    assert [w & 15 for w in log.words] == [BOUNDARY, RUN_ALLOC, SENT_FREE, RUN_ALLOC, RUN_ALLOC, STRETCH,
                                           RUN_ALLOC]
    assert log.blocks == [[5, 1]]                            # the second block is intact, where it now stands
    log.add_sent_free(where(1, 6) | SENT_FREE, 3.5)          # before the second block: it stays
    assert log.words[6] & 15 == STRETCH and log.blocks == [[6, 1]]
    assert log.settled(0.6) == 1 and log.settled(0.5) == 0


def _states(monkeypatch) -> list[RankState]:
    made = []
    init = RankState.__init__

    def spy(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(RankState, "__init__", spy)
    return made


# (the 1F1B plans' Sends are matched before the compute stream would pass them: nothing to defer there)
PLANS = [
    (1, 16, {"tp": 2, "pp": 4, "dp": 1}, False),
    (4, 24, {"tp": 8, "pp": 4, "dp": 1, "sequence_parallel": True}, False),
    (2, 16, {"tp": 8, "pp": 2, "dp": 1, "schedule": "interleaved-1f1b", "virtual_stages": 2}, True),
    (1, 16, {"tp": 1, "pp": 4, "dp": 2, "schedule": "zb-h1"}, True),
    (1, 16, {"tp": 2, "pp": 4, "dp": 1, "schedule": "zb-h2"}, True),
]


@pytest.mark.parametrize("nodes, global_batch, parallel, defers", PLANS)
def test_outputs_equal_without_running_past_sends(monkeypatch, nodes, global_batch, parallel, defers):
    doc = _doc(nodes, global_batch, **parallel)
    doc["model"]["hidden_size"] = 1024
    states = _states(monkeypatch)
    fast = _everything(api.simulate(scenario_from_dict(doc)))
    assert (sum(state.deferred_quiet for state in states) > 0) == defers      # the shortcut was taken
    assert _everything(api.simulate(scenario_from_dict(doc), shortcuts=False)) == fast
    monkeypatch.setattr(api, "EngineOptions", lambda: EngineOptions(send_lookahead=False))
    assert _everything(api.simulate(scenario_from_dict(doc))) == fast


def test_chunks_for_the_memory_workers_end_before_a_pending_sends_free(monkeypatch):
    # Small chunks: a rank's log is sent at nearly every period boundary, only up to the last one before env.now.
    monkeypatch.setattr(memory_worker, "CHUNK_CALLS", 16)
    cuts = []
    settled = MemoryLog.settled

    def spy(self, now_s):
        cut = settled(self, now_s)
        cuts.append(cut < len(self))
        return cut

    monkeypatch.setattr(MemoryLog, "settled", spy)
    doc = _doc(4, 24, tp=8, pp=4, dp=1, sequence_parallel=True)
    here = _everything(api.simulate(scenario_from_dict(doc), memory_workers=0))
    assert _everything(api.simulate(scenario_from_dict(doc), memory_workers=2)) == here
    assert any(cuts)                              # some calls were held back
    assert _everything(api.simulate(scenario_from_dict(doc), memory_workers=2, shortcuts=False)) == here


def _pair(size: float, first: float, busy: tuple[float, ...], late: float) -> list[Program]:
    """Rank 0 makes a tensor in `first`, its send stream sends it to rank 1 and frees it once sent, while its
    compute stream runs `busy` ops; rank 1 posts the receive only after a `late` op, so the Send waits for it
    (rendezvous) while rank 0 runs on."""
    tensors = {0: Tensor(0, "x", int(size), ACTIVATIONS), 1: Tensor(1, "y", int(size), ACTIVATIONS)}
    tensors.update({10 + k: Tensor(10 + k, f"u{k}", 1 << 20, ACTIVATIONS) for k in range(len(busy))})
    sender = {"compute": (Run(Op("make", "gemm", "fwd", allocs=(0,)), first), Signal("ready"))
              + tuple(Run(Op(f"busy{k}", "gemm", "fwd", allocs=(10 + k,), frees=(10 + k,)), seconds)
                      for k, seconds in enumerate(busy)),
              "pp_send": (WaitFor("ready"), Send("x", 1, size, "x"), Free((0,), "sent"), Signal("sent"))}
    receiver = {"compute": (Run(Op("late", "gemm", "fwd"), late), Signal("post"), WaitFor("got"),
                            Run(Op("use", "gemm", "fwd", frees=(1,)), 1e-6)),
                "pp_recv": (WaitFor("post"), Recv("x", 0, size, "x", (1,)), Signal("got"))}
    return [Program(0, "gpu", 0, tensors, sender), Program(1, "gpu", 0, tensors, receiver)]


def _outputs(programs, options: EngineOptions):
    trace = simulate_programs(programs, [ExactAllocator(80 * 2**30) for _ in programs], [80 * 2**30] * 2, options,
                              load_topology("dgx-a100"))
    return [(r.memory, r.spans, r.peak_allocated, r.peak_time_s, r.peak_op, r.allocator_events)
            for r in trace.ranks], trace.communication, trace.end_time_s


def test_a_free_tied_with_compute_calls_is_placed_alike(monkeypatch):
    # The Send ends at exactly the end of a busy op of rank 0's compute stream, which ran past it (the Free is
    # logged after that op's calls and the next one's): the Free goes before the calls of its time, on and off.
    size, first, late = 2.0**24, 1e-3, 2e-3
    spans = _outputs(_pair(size, first, (5e-3,), late), EngineOptions())[0][0][1]
    sent = [span.end_s for span in spans if span.stream == "pp_send"][0]
    duration = sent - first
    while first + duration != sent:
        duration = math.nextafter(duration, sent if first + duration < sent else 0.0)
    programs = _pair(size, first, (duration, 1e-3, 2e-3), late)
    ties = []
    add = MemoryLog.add_sent_free

    def spy(self, word, time_s):
        ties.append(list(self.times).count(time_s))
        add(self, word, time_s)

    monkeypatch.setattr(MemoryLog, "add_sent_free", spy)
    states = _states(monkeypatch)
    fast = _outputs(programs, EngineOptions())
    assert sum(state.deferred_quiet for state in states) > 0 and ties == [2]     # busy0's free, busy1's alloc
    assert _outputs(programs, EngineOptions(send_lookahead=False)) == fast
    assert _outputs(programs, EngineOptions(run_ahead=False, rank_lookahead=False, send_lookahead=False)) == fast


_steps = st.lists(st.sampled_from([1e-6, 4e-6, 1e-4, 1e-3, 5e-3]), min_size=1, max_size=12)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(first=st.sampled_from([0.0, 1e-6, 1e-3]), busy=_steps, late=st.sampled_from([0.0, 1e-4, 2e-3]),
       size=st.sampled_from([2.0**12, 2.0**20, 2.0**26]))
def test_pairs_equal_without_running_past_sends(first, busy, late, size):
    programs = _pair(size, first, tuple(busy), late)
    fast = _outputs(programs, EngineOptions())
    assert _outputs(programs, EngineOptions(run_ahead=False, rank_lookahead=False, send_lookahead=False)) == fast
