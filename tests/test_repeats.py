"""Replaying repeated periods of memory calls (engine/repeats.py) gives exactly the allocator's results."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from simulator.engine.allocator import make_allocator
from simulator.engine.executor import EngineOptions, simulate_programs
from simulator.parallel.program import Alloc, Free, Mark, Period, Program, Run
from simulator.workload.graph import ACTIVATIONS, PARAMETERS, Op, Tensor

GIB = 1 << 30


def _op(name: str, allocs=(), frees=()) -> Op:
    return Op(name, "elementwise", "forward", 0.0, 0, 0, "bf16", None, 1, (), (), tuple(allocs), tuple(frees))


def _program(sizes: list[int], depth: int, microbatches: int, template: int, named_inputs: bool,
             odd_microbatch: int | None) -> Program:
    """A 1F1B-like rank: micro-batch j allocates its tensors in a forward and frees them `depth` micro-batches
    later; from `template` on, micro-batches are copies (ids moved by a constant) preceded by a Period."""
    tensors: dict[int, Tensor] = {0: Tensor(0, "weight", 3 << 20, PARAMETERS, "bf16", (1,), persistent=True)}
    span = len(sizes) + 1
    base = 1
    low = base + template * span
    high = base + microbatches * span
    forward = [_op(f"fwd{k}", allocs=(base + k,)) for k in range(len(sizes))]
    scratch = _op("scratch", allocs=(base + len(sizes),), frees=(base + len(sizes),))
    backward = _op("bwd", frees=tuple(base + k for k in range(len(sizes))))
    for j in range(microbatches):
        for k, size in enumerate(sizes + [sizes[0] // 3 + 1]):
            tid = base + j * span + k
            tensors[tid] = Tensor(tid, f"t{k}", size, ACTIVATIONS, "bf16", (1,))
    compute: list = [Alloc((0,), "model set-up"), Mark("iteration_start", 0)]

    def run(op: Op, j: int) -> Run:
        return Run(op, 1e-3, 0, j * span, base)

    for j in range(microbatches + depth):
        if j < microbatches:
            if j >= template:
                compute.append(Period("F", j * span, low, high))
            if named_inputs:
                compute.append(Alloc((base + j * span,), f"micro-batch {j} inputs"))
                ops = forward[1:]
            else:
                ops = forward
            compute += [run(op, j) for op in ops] + [run(scratch, j)]
            if j == odd_microbatch:
                compute.append(Free((base + j * span + 1,), "early free"))
        if j >= depth:
            i = j - depth
            frees = backward.frees if i != odd_microbatch else tuple(t for t in backward.frees if t != base + 1)
            compute.append(Run(replace(backward, frees=frees), 2e-3, 0, i * span, base))
    compute.append(Mark("iteration_end", 0))
    return Program(0, "A100", 0, tensors, {"compute": tuple(compute)})


def _run(program: Program, repeats: bool, allocator: str, record_events: bool):
    alloc = make_allocator(allocator, 80 * GIB, record_events=record_events)
    trace = simulate_programs([program], [alloc], [80 * GIB], EngineOptions(repeats=repeats))
    rank = trace.ranks[0]
    return (rank.memory, rank.allocator_events, rank.final_segments, rank.peak_allocated, rank.peak_reserved,
            rank.peak_time_s, rank.peak_op, rank.breakdown_at_peak, rank.category_peaks, trace.end_time_s)


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(1, 40 << 20), min_size=1, max_size=5), depth=st.integers(0, 4),
       microbatches=st.integers(1, 14), template=st.integers(0, 3), named_inputs=st.booleans(),
       odd=st.one_of(st.none(), st.integers(0, 13)), allocator=st.sampled_from(["caching", "exact"]),
       record_events=st.booleans())
def test_replayed_periods_equal_the_allocator(sizes, depth, microbatches, template, named_inputs, odd,
                                              allocator, record_events):
    odd = odd if len(sizes) > 1 + named_inputs else None     # an early free needs a second forward tensor
    program = _program(sizes, depth, microbatches, min(template, microbatches), named_inputs, odd)
    assert _run(program, True, allocator, record_events) == _run(program, False, allocator, record_events)


def test_a_steady_state_is_replayed_not_recomputed(monkeypatch):
    """The allocator sees far fewer calls with repeats (so the test above compares two different paths)."""
    program = _program([5 << 20, 7 << 20, 300], 2, 40, 1, True, None)
    calls = {True: 0, False: 0}
    from simulator.engine.caching_allocator import CachingAllocator
    original = CachingAllocator.malloc

    def counting(self, *args, **kwargs):
        calls[current] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(CachingAllocator, "malloc", counting)
    results = {}
    for current in (False, True):
        results[current] = _run(program, current, "caching", True)
    assert results[True] == results[False]
    assert calls[False] == 40 * 4 + 1
    assert calls[True] < calls[False] // 3
