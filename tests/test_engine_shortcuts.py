"""The engine's shortcuts (rank lookahead, repeated-period replay, the network analysis of copies) change no result
of real pipeline scenarios."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import simulator.api as api
from simulator.engine.allocator import ExactAllocator
from simulator.engine.executor import EngineOptions, simulate_programs
from simulator.network import load_topology
from simulator.parallel.program import Collective, Free, Program, Recv, Run, Send, Signal, WaitFor
from simulator.scenario import scenario_from_dict
from simulator.workload.graph import ACTIVATIONS, Op, Tensor
from test_scale_inline import _doc, _everything


CASES = [
    (1, 16, {"tp": 2, "pp": 2, "dp": 2}),
    (1, 16, {"tp": 4, "pp": 2, "sequence_parallel": True}),
    (4, 24, {"tp": 8, "pp": 4, "dp": 1, "sequence_parallel": True}),
    (4, 24, {"tp": 8, "pp": 2, "dp": 2, "sequence_parallel": True}),
    (2, 16, {"tp": 8, "pp": 2, "dp": 1, "schedule": "interleaved-1f1b", "virtual_stages": 2}),
    (1, 16, {"tp": 2, "pp": 4, "dp": 1, "schedule": "gpipe"}),
    (1, 16, {"tp": 1, "pp": 4, "dp": 2, "schedule": "zb-h1"}),
    (1, 16, {"tp": 2, "pp": 2, "dp": 2, "zero_stage": 1}),
]


@pytest.mark.parametrize("nodes, global_batch, parallel", CASES)
def test_shortcuts_change_nothing(monkeypatch, nodes, global_batch, parallel):
    # Both shortcuts off is the plain engine (the replay alone: tests/test_repeats.py; run-ahead with rank
    # lookahead against none: tests/test_scale_engine.py).
    doc = _doc(nodes, global_batch, **parallel)
    fast = _everything(api.simulate(scenario_from_dict(doc)))
    monkeypatch.setattr(api, "EngineOptions", lambda: EngineOptions(rank_lookahead=False, repeats=False))
    slow = _everything(api.simulate(scenario_from_dict(doc)))
    assert fast == slow


def test_repeats_replay_the_steady_state(monkeypatch):
    """A 1F1B stage with many micro-batches replays most of its memory calls (so the test above compares two
    different computations)."""
    from simulator.engine.memory import RankMemory
    replayed = []
    real = RankMemory._replay

    def spy(self, *args):
        replayed.append(True)
        return real(self, *args)

    monkeypatch.setattr(RankMemory, "_replay", spy)
    api.simulate(scenario_from_dict(_doc(4, 32, tp=8, pp=4, dp=1, sequence_parallel=True)))
    assert len(replayed) > 1000


_steps = st.lists(st.tuples(st.sampled_from(["run", "message", "collective", "free"]),
                            st.sampled_from([0.0, 1e-6, 4e-6, 1e-3]), st.integers(0, 2), st.integers(0, 2),
                            st.sampled_from([2.0**12, 2.0**20, 2.0**26])), min_size=1, max_size=30)


def _random_programs(steps) -> list[Program]:
    """Three ranks of one DGX A100: compute runs that keep or free their tensor, messages in one global order
    (the sender's send stream sends; the receiver's compute posts a recv that allocates and waits for it),
    and collectives over all three ranks on a comm stream (allocating, freeing) the compute stream waits for
    or not."""
    compute: dict[int, list] = {r: [] for r in range(3)}
    other: dict[int, dict[str, list]] = {r: {"send": [], "recv": [], "comm": []} for r in range(3)}
    tensors: dict[int, Tensor] = {}
    held: dict[int, list[int]] = {r: [] for r in range(3)}
    for k, (kind, seconds, a, b, size) in enumerate(steps):
        if kind == "run":
            tensors[k] = Tensor(k, f"t{k}", int(size) + a, ACTIVATIONS)
            keep = b > 0
            compute[a].append(Run(Op(f"op{k}", "gemm", "fwd", allocs=(k,), frees=() if keep else (k,)), seconds))
            if keep:
                held[a].append(k)
        elif kind == "free" and held[a]:
            compute[a].append(Free((held[a].pop(0),), f"free{k}"))
        elif kind == "message" and a != b:
            tensors[k] = Tensor(k, f"m{k}", int(size), ACTIVATIONS)
            compute[a].append(Signal(f"ready{k}"))
            other[a]["send"] += [WaitFor(f"ready{k}"), Send(f"msg{k}", b, size, f"tag{k}")]
            compute[b] += [Signal(f"post{k}"), WaitFor(f"done{k}")]
            other[b]["recv"] += [WaitFor(f"post{k}"), Recv(f"msg{k}", a, size, f"tag{k}", (k,)), Signal(f"done{k}")]
            held[b].append(k)
        elif kind == "collective":
            for r in range(3):
                tid = 1000 * (r + 1) + k
                tensors[tid] = Tensor(tid, f"c{k}", int(size) // 8, ACTIVATIONS)
                compute[r].append(Signal(f"go{k}"))
                other[r]["comm"] += [WaitFor(f"go{k}"), Collective(f"ar{k}", "all_reduce", (0, 1, 2), size,
                                                                   (tid,), (tid,)), Signal(f"end{k}")]
                if b > 0:
                    compute[r].append(WaitFor(f"end{k}"))
    programs = []
    for r in range(3):
        streams = {"compute": tuple(compute[r] + [Free(tuple(held[r]), "end")] if held[r] else compute[r])}
        streams.update({name: tuple(ins) for name, ins in other[r].items() if ins})
        programs.append(Program(r, "gpu", 0, tensors, streams))
    return programs


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=_steps)
def test_rank_lookahead_changes_nothing_on_random_programs(steps):
    topology = load_topology("dgx-a100")
    programs = _random_programs(steps)
    results = []
    for lookahead in (True, False):
        trace = simulate_programs(programs, [ExactAllocator(80 * 2**30) for _ in programs], [80 * 2**30] * 3,
                                  EngineOptions(rank_lookahead=lookahead), topology)
        results.append(([(r.memory, r.spans, r.peak_allocated, r.peak_time_s) for r in trace.ranks],
                        trace.communication, trace.end_time_s))
    assert results[0] == results[1]


@pytest.mark.parametrize("nodes, global_batch, parallel", CASES[2:5])
def test_network_analysis_of_copies_once(monkeypatch, nodes, global_batch, parallel):
    """The network model's analysis, which scans one micro-batch copy per `blocking`, finds the shadows and the
    link-isolated collectives that scanning every instruction finds."""
    from simulator.engine import network_analysis, network_model

    found = []
    analyze = network_model.NetworkModel._analyze

    def recording(self, programs, isolate):
        analyze(self, programs, isolate)
        scanned = sum(len(part) for p in programs for _, part in network_analysis._streams_to_scan(p))
        every = sum(len(part) for p in programs for part in p.streams.values())
        found.append((self._kept, dict(self._isolated), scanned < every))

    monkeypatch.setattr(network_model.NetworkModel, "_analyze", recording)
    api.simulate(scenario_from_dict(_doc(nodes, global_batch, **parallel)))
    monkeypatch.setattr(network_analysis, "_streams_to_scan", lambda program: list(program.streams.items()))
    api.simulate(scenario_from_dict(_doc(nodes, global_batch, **parallel)))
    (kept, isolated, skipped), (all_kept, all_isolated, _) = found
    assert skipped and isolated
    assert (kept, isolated) == (all_kept, all_isolated)
