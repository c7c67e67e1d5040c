"""Spans and memory samples as flat lists while the engine runs: Span / MemorySample objects are made when read.

A cluster-scale run records millions of spans and samples. Making an object for each costs more than the
simulation step that produced it (a big heap makes every allocation slow), and a `--json` report only sums
spans and never reads samples. So each stream's spans are kept as one flat list of (info, start_s, end_s)
triples, info being the Run instruction, the communication instruction (Collective, Send, Recv: the span's
kind is the collective's, "send" or "recv"), or a (fields before start_s, fields after end_s) pair, and a rank's
samples as one flat list of (time_s, allocated, reserved, by_category) quadruples; the trace holds sequences
that build the objects on first read (`Recorded`). The report sums span durations straight from the columns.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import repeat
from operator import attrgetter

import numpy as np

from simulator.parallel.program import Collective, Recv, Run, Send
from simulator.trace.records import COMM_PHASE, MemorySample, Span

new_tuple = tuple.__new__
_op_phase = attrgetter("op.phase")
_SPAN_KINDS = {Send: "send", Recv: "recv"}      # a Collective's span kind is its own


def comm_span_fields(rank: int, stream: str, info) -> tuple:
    """A communication span's fields but its times, before and after them, from its info in the columns (the
    instruction, or the two tuples themselves)."""
    if type(info) is tuple:
        return info
    kind = info.kind if type(info) is Collective else _SPAN_KINDS[type(info)]
    return (rank, stream, info.name, kind, COMM_PHASE), (0.0, int(info.size_bytes), info.iteration)


def _phase(info) -> str:
    """The phase of a span's info in the columns."""
    if type(info) is Run:
        return info.op.phase
    return info[0][4] if type(info) is tuple else COMM_PHASE


class Recorded(Sequence):
    """A read-only list built on first read (then kept)."""

    def __init__(self) -> None:
        self._items: list | None = None

    def _build(self) -> list:
        raise TypeError("Recorded is abstract")        # subclasses make their list

    @property
    def items(self) -> list:
        if self._items is None:
            self._items = self._build()
        return self._items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index):
        return self.items[index]

    def __iter__(self):
        return iter(self.items)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Recorded):
            return self.items == other.items
        return self.items == other

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.items!r})"


class SpanColumns(Recorded):
    """One rank's spans, stream after stream, from each stream's flat (info, start_s, end_s) list."""

    def __init__(self, rank: int, streams: list[tuple[str, list]]):
        super().__init__()
        self.rank = rank
        self.streams = streams

    def _build(self) -> list[Span]:
        rank = self.rank
        spans: list[Span] = []
        for stream, flat in self.streams:
            for info, start_s, end_s in zip(flat[0::3], flat[1::3], flat[2::3]):
                if type(info) is Run:
                    op = info.op
                    spans.append(new_tuple(Span, (rank, stream, op.name, op.op_class, op.phase, start_s, end_s,
                                                  op.flops, op.bytes_read + op.bytes_written, info.iteration)))
                else:
                    head, tail = comm_span_fields(rank, stream, info)
                    spans.append(new_tuple(Span, head + (start_s, end_s) + tail))
        return spans

    def phase_sums(self, start_s: float, end_s: float, keys: dict[str, str], default: str) -> tuple[dict, float]:
        """The report's sums: over spans that are not communication and lie in [start_s, end_s], in span order,
        the durations added up per `keys[phase]` (`default` for other phases) and in all; the same float
        additions, in the same order, as a loop over the Span objects (numpy's cumsum adds in order)."""
        names = list(dict.fromkeys(keys.values()))
        if default not in names:
            names.append(default)
        code = {phase: names.index(key) for phase, key in keys.items()}
        code[COMM_PHASE] = -1
        fallback = names.index(default)
        codes: list[int] = []
        starts: list[float] = []
        ends: list[float] = []
        for _, flat in self.streams:
            infos = flat[0::3]
            try:
                phases = list(map(_op_phase, infos))         # a stream of runs only, at C speed
            except AttributeError:
                if Run not in set(map(type, infos)):
                    continue                                 # communication only: nothing to add
                phases = list(map(_phase, infos))
            codes += map(code.get, phases, repeat(fallback))
            starts += flat[1::3]
            ends += flat[2::3]
        sums = {name: 0.0 for name in names}
        if not codes:
            return sums, 0.0
        count = len(codes)
        code_of = np.fromiter(codes, dtype=np.int64, count=count)
        begin = np.fromiter(starts, dtype=np.float64, count=count)
        finish = np.fromiter(ends, dtype=np.float64, count=count)
        keep = (code_of >= 0) & (start_s <= begin) & (finish <= end_s)
        durations = finish[keep] - begin[keep]
        kept = code_of[keep]
        for index, name in enumerate(names):
            mine = durations[kept == index]
            if len(mine):
                sums[name] = float(np.cumsum(mine)[-1])
        return sums, float(np.cumsum(durations)[-1]) if len(durations) else 0.0


class SampleColumns(Recorded):
    """One rank's memory samples from its flat (time_s, allocated, reserved, by_category) list."""

    def __init__(self, flat: list):
        super().__init__()
        self.flat = flat

    def _build(self) -> list[MemorySample]:
        flat = self.flat
        return [new_tuple(MemorySample, fields) for fields in zip(flat[0::4], flat[1::4], flat[2::4], flat[3::4])]
