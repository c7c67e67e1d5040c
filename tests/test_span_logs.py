"""The engine's typed span and interval columns (engine/logs.py): appended span by span or in bulk they hold the
same spans, phase codes and intervals, and the report's sums and the communication totals read from them equal the
loops over the Python objects, bit for bit."""

from __future__ import annotations

from array import array

from hypothesis import given, settings, strategies as st

from simulator.engine.results import RankCommunication, covered
from simulator.engine.logs import (COMM_CODE, PHASE_CODES, IntervalLog, SpanLog, doubles, info_phase, packer,
                                   phase_array, positive)
from simulator.engine.timelines import SpanColumns
from simulator.parallel.program import Collective, Run, Send
from simulator.report.metrics import span_sums
from simulator.trace.records import COMM_PHASE
from simulator.workload.graph import Op


def log_of(flat: list) -> SpanLog:
    """A SpanLog of flat (info, start_s, end_s) triples, added one by one."""
    log = SpanLog()
    for info, start_s, end_s in zip(flat[0::3], flat[1::3], flat[2::3]):
        log.add(info, start_s, end_s)
    return log


_OPS = [Op(f"op.{phase}", "gemm", phase, flops=1.0) for phase in ("fwd", "bwd_input", "recompute", "zz_new")]
_info = st.one_of(st.sampled_from(_OPS).map(lambda op: Run(op, 1e-3)),
                  st.just(Collective("ar", "all_reduce", (0, 1), 64.0)), st.just(Send("act", 1, 8.0, "t")))
_span = st.tuples(_info, st.floats(-1, 10, allow_nan=False), st.floats(0, 1e-3, allow_nan=False))


@settings(max_examples=100, deadline=None)
@given(spans=st.lists(_span, max_size=30), cut=st.integers(0, 30))
def test_bulk_extend_equals_adding_one_by_one(spans, cut):
    flat = [x for info, start, duration in spans for x in (info, start, start + duration)]
    one = log_of(flat)
    bulk = log_of(flat[:3 * cut])
    rest = spans[cut:]
    infos = tuple(info for info, _, _ in rest)
    pack = packer(len(rest))
    bulk.extend(infos, pack(*(start for _, start, _ in rest)), pack(*(start + d for _, start, d in rest)),
                phase_array(infos))
    assert bulk.since(0) == one.since(0) and len(bulk) == len(spans)
    assert list(one.phases) == [PHASE_CODES[info_phase(info)] for info, _, _ in spans]
    assert all((code == COMM_CODE) == (type(info) is not Run) for code, (info, _, _) in zip(one.phases, spans))
    assert one.since(cut)[1].tolist() == [start for _, start, _ in spans[cut:]]


@settings(max_examples=100, deadline=None)
@given(streams=st.lists(st.lists(_span, max_size=20), min_size=1, max_size=3),
       bounds=st.tuples(st.floats(-1, 5), st.floats(5, 12)))
def test_column_sums_equal_the_span_loop_with_phases_first_seen_late(streams, bounds):
    # Phase "zz_new" may get its code only here; the report maps it to the default key like the loop does.
    columns = [(f"s{s}", log_of([x for info, start, d in spans for x in (info, start, start + d)]))
               for s, spans in enumerate(streams)]
    recorded = SpanColumns(1, columns)
    assert span_sums(recorded, *bounds) == span_sums(list(recorded), *bounds)


_time = st.floats(0, 100, allow_nan=False)


@settings(max_examples=100, deadline=None)
@given(pairs=st.lists(st.tuples(_time, _time), max_size=30))
def test_intervals_positive_and_sorted_as_the_tuples(pairs):
    starts, ends = tuple(a for a, _ in pairs), tuple(b for _, b in pairs)
    kept = [pair for pair in pairs if pair[1] > pair[0]]
    assert list(zip(*positive(starts, ends))) == kept
    log = IntervalLog()
    log.extend(*map(doubles, positive(starts, ends)))
    assert len(log) == len(kept) and list(zip(*log.since(0))) == kept
    assert log.since(0) == (array("d", [a for a, _ in kept]), array("d", [b for _, b in kept]))
    assert log.sorted_pairs().tolist() == [list(pair) for pair in sorted(kept)]
    total = 0.0
    reach = float("-inf")
    for a, b in sorted(kept):
        a = max(a, reach)
        if b > a:
            total += b - a
        reach = max(reach, b)
    communication = RankCommunication(log.sorted_pairs(), log.sorted_pairs())
    assert communication.total_s == total == covered(log.sorted_pairs(), float("-inf"), float("inf"))
    assert communication == RankCommunication(log.sorted_pairs(), log.sorted_pairs())
    assert kept == [] or communication != RankCommunication(log.sorted_pairs()[:-1], log.sorted_pairs())
    assert RankCommunication().total_s == 0.0 and RankCommunication() == RankCommunication()


def test_comm_phase_has_its_code():
    assert PHASE_CODES[COMM_PHASE] == COMM_CODE
    collective = Collective("ar", "all_reduce", (0, 1), 64.0)
    one, other = SpanLog(), SpanLog()
    one.add(collective, 0.5, 1.5)
    other.add_comm(collective, 0.5, 1.5)
    assert one.since(0) == other.since(0)
    assert info_phase(((0, "s", "x", "all_reduce", COMM_PHASE), (0.0, 8, 0))) == COMM_PHASE
