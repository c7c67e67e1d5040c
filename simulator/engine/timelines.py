"""Spans and memory samples as typed columns while the engine runs: Span / MemorySample objects are made when read.

A cluster-scale run records millions of spans and samples. Making an object for each costs more than the
simulation step that produced it (a big heap makes every allocation slow), and a `--json` report only sums
spans and never reads samples. So each stream's spans are kept as a SpanLog (engine/logs.py): per span its
info, the Run instruction, the communication instruction (Collective, Send, Recv: the span's kind is the
collective's, "send" or "recv"), or a (fields before start_s, fields after end_s) pair, its times as doubles and
its phase code; a rank's samples as one flat list of (time_s, allocated, reserved, by_category) quadruples. The
trace holds sequences that build the objects on first read (`Recorded`); the report sums span durations straight
from the typed columns.
"""

from __future__ import annotations

from collections.abc import Sequence

from simulator.engine.logs import COMM_CODE, PHASE_CODES, SpanLog
from simulator.parallel.program import Collective, Recv, Run, Send, Transfer
from simulator.trace.records import COMM_PHASE, MemorySample, Span

new_tuple = tuple.__new__
_SPAN_KINDS = {Send: "send", Recv: "recv"}      # a Collective's span kind is its own


def comm_span_fields(rank: int, stream: str, info) -> tuple:
    """A communication span's fields but its times, before and after them, from its info in the columns (the
    instruction, or the two tuples themselves)."""
    if type(info) is tuple:
        return info
    kind = info.kind if type(info) is Collective else info.route if type(info) is Transfer else _SPAN_KINDS[type(info)]
    return (rank, stream, info.name, kind, COMM_PHASE), (0.0, int(info.size_bytes), info.iteration)


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
    """One rank's spans, stream after stream, from each stream's SpanLog (engine/logs.py)."""

    def __init__(self, rank: int, streams: list[tuple[str, SpanLog]]):
        super().__init__()
        self.rank = rank
        self.streams = streams

    def _build(self) -> list[Span]:
        rank = self.rank
        spans: list[Span] = []
        for stream, log in self.streams:
            for info, start_s, end_s in zip(log.infos, log.starts, log.ends):
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
        sums = {name: 0.0 for name in names}
        logs = [log for _, log in self.streams if len(log)]
        if not logs:
            return sums, 0.0
        import numpy as np    # here, not at import: a large run's engine starts sooner (numpy is needed after it)
        # phase code -> index in names (-1: communication), over every code given so far
        table = np.full(len(PHASE_CODES), names.index(default), dtype=np.int64)
        for phase, code in PHASE_CODES.items():
            if phase in keys:
                table[code] = names.index(keys[phase])
        table[COMM_CODE] = -1
        code_of = table[np.concatenate([np.frombuffer(log.phases, dtype=np.uint16) for log in logs])]
        begin = np.concatenate([np.frombuffer(log.starts) for log in logs])
        finish = np.concatenate([np.frombuffer(log.ends) for log in logs])
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
