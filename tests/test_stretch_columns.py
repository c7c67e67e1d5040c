"""The stretch records' C-speed matching and application (engine/stretches.py) and communication spans kept as
their instructions (engine/timelines.py) give what the field-by-field loops and the span tuples gave."""

from __future__ import annotations

import math

from hypothesis import given, settings, strategies as st

from simulator.engine.stretch_record import picker as _picker
from simulator.engine.stretch_record import runs_match
from simulator.engine.timelines import SpanColumns
from simulator.parallel.program import Collective, Recv, Run, Send, Signal
from simulator.report.metrics import span_sums
from simulator.trace.records import COMM_PHASE, Span
from simulator.workload.graph import Op
from test_span_logs import log_of

_OPS = [Op("a", "gemm", "fwd", flops=1.0), Op("b", "gemm", "bwd_input", flops=2.0)]
_TWIN = Op("a", "gemm", "fwd", flops=1.0)        # equal to _OPS[0], not the same object: must not match


def _match_loop(recorded: list, stretch: list, shift: int) -> bool:
    """The previous check, field by field (runs as (position, op, duration, iteration, low))."""
    for position, op, duration_s, iteration, low in recorded:
        run = stretch[position]
        if type(run) is not Run or run.op is not op or run.duration_s != duration_s or run.shift != shift \
                or run.iteration != iteration or run.low != low:
            return False
    return True


def _columns(recorded: list) -> tuple:
    positions, ops, durations, iterations, lows = zip(*recorded)
    return _picker(positions), ops, durations, iterations, lows


_duration = st.sampled_from([0.0, -0.0, 0, 1e-3, 2e-3, 1e-3 + 1e-18, math.inf])
_run = st.tuples(st.sampled_from(_OPS), _duration, st.integers(0, 1), st.integers(0, 1))


@settings(max_examples=150, deadline=None)
@given(runs=st.lists(_run, min_size=1, max_size=6), shift=st.integers(0, 2), data=st.data())
def test_runs_match_equals_the_field_loop(runs, shift, data):
    # A recorded stretch (runs between signals), and a later one changed in one field, or not at all.
    stretch: list = []
    recorded = []
    for op, duration, iteration, low in runs:
        if data.draw(st.booleans()):
            stretch.append(Signal("x"))
        recorded.append((len(stretch), op, duration, iteration, low))
        stretch.append(Run(op, duration, iteration, shift, low))
    later = list(stretch)
    at = data.draw(st.sampled_from([position for position, *_ in recorded]))
    op, duration, iteration, _, low = later[at]
    change = data.draw(st.sampled_from(["none", "op", "twin", "duration", "iteration", "shift", "low", "type",
                                        "nan"]))
    later[at] = {"none": later[at], "op": Run(_OPS[1] if op is _OPS[0] else _OPS[0], duration, iteration, shift, low),
                 "twin": Run(_TWIN, duration, iteration, shift, low),
                 "duration": Run(op, duration + 1.0, iteration, shift, low),
                 "iteration": Run(op, duration, iteration + 1, shift, low),
                 "shift": Run(op, duration, iteration, shift + 1, low),
                 "low": Run(op, duration, iteration, shift, low + 1),
                 "type": Signal("y"), "nan": Run(op, math.nan, iteration, shift, low)}[change]
    for seq in (tuple(later), later):
        assert runs_match(_columns(recorded), seq, shift) == _match_loop(recorded, seq, shift)
    assert runs_match(_columns(recorded), tuple(stretch), shift)


@given(items=st.lists(st.floats(allow_nan=False), max_size=8), data=st.data())
def test_picker_gives_the_items_at_the_indices(items, data):
    indices = data.draw(st.lists(st.integers(0, len(items) - 1), max_size=5)) if items else []
    assert list(_picker(indices)(items)) == [items[i] for i in indices]
    assert tuple(_picker(indices)(tuple(items))) == tuple(items[i] for i in indices)


def test_communication_spans_kept_as_instructions():
    # The Span of a Collective, Send and Recv kept as the instruction equals the one of its field tuples.
    op = Op("layer.fc1", "gemm", "fwd", flops=2e9, bytes_read=10, bytes_written=6)
    collective = Collective("tp.all_gather", "all_gather", (0, 1), 4096.0, iteration=1)
    send, recv = Send("act", 1, 512.0, "t", iteration=2), Recv("grad", 1, 256.0, "u", iteration=3)
    spans = SpanColumns(0, [("compute", log_of([Run(op, 1e-3, 1), 0.5, 0.501])),
                            ("comm", log_of([collective, 0.2, 0.3, ((0, "comm", "old", "all_reduce", COMM_PHASE),
                                                                    (0.0, 8, 0)), 0.3, 0.4])),
                            ("pp", log_of([send, 0.6, 0.7, recv, 0.7, 0.9]))])
    assert list(spans) == [
        Span(0, "compute", "layer.fc1", "gemm", "fwd", 0.5, 0.501, 2e9, 16, 1),
        Span(0, "comm", "tp.all_gather", "all_gather", COMM_PHASE, 0.2, 0.3, 0.0, 4096, 1),
        Span(0, "comm", "old", "all_reduce", COMM_PHASE, 0.3, 0.4, 0.0, 8, 0),
        Span(0, "pp", "act", "send", COMM_PHASE, 0.6, 0.7, 0.0, 512, 2),
        Span(0, "pp", "grad", "recv", COMM_PHASE, 0.7, 0.9, 0.0, 256, 3)]


_PHASES = ["fwd", "bwd_input", "recompute", "other", COMM_PHASE]


@settings(max_examples=100, deadline=None)
@given(streams=st.lists(st.lists(st.tuples(st.sampled_from(_PHASES), st.floats(0, 10), st.floats(0, 1e-3)),
                                 max_size=20), min_size=1, max_size=3),
       bounds=st.tuples(st.floats(0, 5), st.floats(5, 12)))
def test_column_sums_with_instruction_infos_equal_the_span_loop(streams, bounds):
    # Streams that mix runs and collectives kept as instructions, or hold only collectives (skipped whole).
    columns = []
    for s, spans in enumerate(streams):
        flat: list = []
        for phase, start, duration in spans:
            info = Collective("ar", "all_reduce", (0, 1), 64.0) if phase == COMM_PHASE \
                else Run(Op(f"op.{phase}", "gemm", phase), duration)
            flat += (info, start, start + duration)
        columns.append((f"s{s}", log_of(flat)))
    recorded = SpanColumns(0, columns)
    assert span_sums(recorded, *bounds) == span_sums(list(recorded), *bounds)
