"""A rank's memory calls as the executor makes them, as words naming instructions, applied to its RankMemory later.

No duration depends on memory (an out-of-memory allocation is recorded and the limit lifted), so the executor
does not call the allocator model: it appends one word and one time per call to the rank's log, and the calls
are made afterwards, in the same order, by `apply` — in this process when the engine has ended, or by a worker
process while the engine runs (engine/memory_worker.py). A word is `index << 12 | stream << 4 | code`: the
instruction at `index` of the program's `stream`-th stream makes the call `code` names (an op's allocation or
free, an Alloc, a collective's allocation, a period boundary, ...), with the time beside it.
"""

from __future__ import annotations

from array import array

from simulator.parallel.program import Blocking, Program

# What the instruction a word names does (the codes are the word's low 4 bits).
RUN_ALLOC = 0          # a Run's op allocates (at its start)
RUN_FREE = 1           # a Run's op frees (at its end)
ALLOC = 2              # an Alloc instruction
FREE = 3               # a Free instruction
RECV_ALLOC = 4         # a Recv's buffer
COLL_ALLOC = 5         # a Collective's allocs (or a Blocking instruction's collective's)
COLL_FREE = 6          # a Collective's frees at its end (or a Blocking instruction's)
BOUNDARY = 7           # a Period instruction
MEASURE = 8            # Mark("measure"): peaks reset
STRETCH = 9            # not a call: the next calls are a replayed stretch's (engine/stretches.py), see below
TRANSFER_ALLOC = 10    # an offload Transfer's device allocs (at its start)
TRANSFER_FREE = 11     # an offload Transfer's device frees (at its end)
SENT_FREE = 12         # a Free right after a Send (or such a Free) on another stream than compute: placed by time
STREAM_SHIFT = 4
INDEX_SHIFT = 12
MAX_STREAMS = 1 << (INDEX_SHIFT - STREAM_SHIFT)    # streams per program
RECORD_BITS = 24       # a STRETCH word: STRETCH | record << 12 | calls << 36, its time the stretch's shift
COUNT_SHIFT = INDEX_SHIFT + RECORD_BITS


def where(stream_id: int, index: int) -> int:
    """The word of instruction `index` of stream `stream_id`, without its code."""
    return index << INDEX_SHIFT | stream_id << STREAM_SHIFT


class MemoryLog:
    """One rank's memory calls not made yet: parallel columns of words and times."""

    __slots__ = ("words", "times", "blocks")

    def __init__(self) -> None:
        self.words = array("q")
        self.times = array("d")
        # [position, calls] of the STRETCH words logged by replayed stretches (in order) where a SENT_FREE may
        # still come inside (MemoryLog.add_sent_free)
        self.blocks: list[list[int]] = []

    def __len__(self) -> int:
        return len(self.words)

    def add(self, word: int, time_s: float) -> None:
        self.words.append(word)
        self.times.append(time_s)

    def take(self, cut: int | None = None) -> tuple[array, array]:
        """The calls logged so far (the first `cut`), leaving the rest (in place: the executor holds the columns'
        appends)."""
        if cut is None:
            cut = len(self.words)
        words, times = self.words[:cut], self.times[:cut]
        del self.words[:cut], self.times[:cut]
        blocks = self.blocks
        if blocks:
            self.blocks = [[at - cut, calls] for at, calls in blocks if at >= cut]
        return words, times

    def note_blocks(self, headers: tuple, now_s: float) -> None:
        """Note the STRETCH words about to be appended at offsets `headers` ((offset, calls), a stretch record's),
        forgetting the blocks that ended before `now_s` (a later SENT_FREE comes at env.now or later)."""
        if len(self.blocks) > 64:
            self._forget_blocks_before(now_s)
        at = len(self.words)
        self.blocks += [[at + offset, calls] for offset, calls in headers]

    def _forget_blocks_before(self, time_s: float) -> None:
        """Drop the blocks whose last call is before `time_s`: no later SENT_FREE can land among their calls."""
        blocks, times = self.blocks, self.times
        passed = 0
        while passed < len(blocks) and times[blocks[passed][0] + blocks[passed][1]] < time_s:
            passed += 1
        del blocks[:passed]

    def add_sent_free(self, word: int, time_s: float) -> None:
        """Log a SENT_FREE call at `time_s` (env.now) where the order by time puts it: after every call before
        `time_s`, before every other call at `time_s` or later (a compute stream that ran ahead logged those
        already), after the SENT_FREE calls at `time_s` of streams numbered up to its own. The executor's
        other calls are logged in the order of their times, so this place depends only on the calls and times,
        not on when the Send's end was known (docs/engine.md, "Running past a pending Send"). Inside a replayed
        stretch's calls, their STRETCH word goes: they are made one by one (what its replay gives)."""
        words, times = self.words, self.times
        i = len(times)
        stream = (word >> STREAM_SHIFT) & 255
        while i:
            before = words[i - 1]
            code = before & 15
            if code == STRETCH:               # its time is a shift; its calls after it were all passed
                i -= 1
                continue
            if times[i - 1] < time_s or code == SENT_FREE and times[i - 1] == time_s \
                    and (before >> STREAM_SHIFT) & 255 <= stream:
                break
            i -= 1
        if self.blocks:
            self._forget_blocks_before(time_s)       # (later SENT_FREEs come at env.now or later)
            blocks = self.blocks
            after = len(blocks)
            while after and blocks[after - 1][0] >= i:
                after -= 1
            if after and blocks[after - 1][0] + blocks[after - 1][1] >= i:
                # i falls among its calls: they are made one by one. The blocks after it keep their places (its
                # STRETCH word goes before them, the Free comes in).
                at = blocks.pop(after - 1)[0]
                del words[at], times[at]
                i -= 1
            else:
                for block in blocks[after:]:
                    block[0] += 1
        if i == len(times):
            words.append(word)
            times.append(time_s)
        else:
            words.insert(i, word)
            times.insert(i, time_s)

    def settled(self, now_s: float) -> int:
        """How many calls from the start no later SENT_FREE can come before (it comes at `now_s` or later): up
        to the last period boundary before `now_s` (a chunk for the memory worker ends at a boundary)."""
        count = len(self.words)
        if not count:
            return 0
        import numpy as np     # here, not at import: a large run's engine starts sooner
        words = np.frombuffer(self.words, dtype=np.int64, count=count)
        times = np.frombuffer(self.times, dtype=np.float64, count=count)
        found = np.flatnonzero(((words & 15) == BOUNDARY) & (times < now_s))
        return int(found[-1]) + 1 if len(found) else 0


def stretch_word(record: int, calls: int) -> int:
    """The STRETCH word before the `calls` calls of a replay of stretch record number `record`."""
    return STRETCH | record << INDEX_SHIFT | calls << COUNT_SHIFT


def apply(memory, program: Program, words, times) -> None:
    """Make the logged calls on `memory` (a RankMemory) in order, as the executor would have made them.

    A STRETCH word announces the calls of a replayed stretch (the record's number, how many calls, the stretch's
    shift as its time). Replayed from the same position of the same repeated period with the same shift relative
    to it, the same record's calls match the same recorded calls, so once they were seen to replay the period
    one by one (RankMemory.learn_stretch), later ones take the outcome at once (RankMemory.replay_stretch).
    """
    names = list(program.streams)
    streams = [program.streams[name] for name in names]
    run_allocate, run_free = memory.run_allocate, memory.run_free
    i, count = 0, len(words)
    learning = None                # (end, key, skipping, renamed) of a stretch whose calls are made one by one
    limit = count
    while i < count:
        if learning is not None and i == learning[0]:
            memory.learn_stretch(*learning[1:])
            learning, limit = None, count
        if memory._skipping is not None:
            i = memory.replay_runs(words, times, i, streams, limit)    # a period's Run calls, in one loop
        else:
            i = memory.make_runs(words, times, i, streams, limit)      # Run calls, in one loop
        if i == limit:
            continue
        word, time_s = words[i], times[i]
        i += 1
        code = word & 15
        if code == STRETCH:
            calls = word >> COUNT_SHIFT
            key = memory.stretch_key((word >> INDEX_SHIFT) & ((1 << RECORD_BITS) - 1), int(time_s))
            if key is None:
                continue
            known = memory.stretch_calls.get(key)
            if known is not None and known.count == calls:
                memory.replay_stretch(known, times, i)
                i += calls
            else:
                learning, limit = (i + calls, key, memory._skipping, len(memory._skipping.renamed)), i + calls
            continue
        stream_id = (word >> STREAM_SHIFT) & 255
        instruction = streams[stream_id][word >> INDEX_SHIFT]
        if code == RUN_ALLOC:
            op = instruction.op
            run_allocate(op.allocs, instruction.shift, instruction.low, names[stream_id], time_s, op.name)
        elif code == RUN_FREE:
            op = instruction.op
            run_free(op.frees, instruction.shift, instruction.low, time_s, op.name)
        elif code == COLL_ALLOC or code == COLL_FREE:
            if type(instruction) is Blocking:
                collective, name = instruction
            else:
                collective, name = instruction, names[stream_id]
            if code == COLL_ALLOC:
                memory.collective_allocate(collective, name, time_s)
            else:
                memory.collective_free(collective, time_s)
        elif code == ALLOC:
            memory.allocate(instruction.tensors, names[stream_id], time_s, instruction.reason)
        elif code == FREE or code == SENT_FREE:
            memory.free(instruction.tensors, time_s, instruction.reason)
        elif code == RECV_ALLOC:
            memory.allocate(instruction.allocs, names[stream_id], time_s, instruction.name)
        elif code == TRANSFER_ALLOC:
            memory.allocate(instruction.allocs, names[stream_id], time_s, instruction.name)
        elif code == TRANSFER_FREE:
            memory.free(instruction.frees, time_s, instruction.name)
        elif code == BOUNDARY:
            memory.boundary(instruction)
        elif code == MEASURE:
            memory.start_measuring()
        else:
            raise ValueError(f"memory log word {word}: unknown code {code}")
    if learning is not None and i == learning[0]:
        memory.learn_stretch(*learning[1:])
