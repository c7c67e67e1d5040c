"""Lowered overlapped micro-batches as templates: one lowering per (ops, iteration, low), moved per copy."""

from __future__ import annotations

from collections import deque
from itertools import repeat
from operator import add, itemgetter

from simulator.parallel.program import (Alloc, Blocking, Collective, Free, Run, Signal, WaitFor, alloc,
                                        checked_collective, free, signal, wait_for)
from simulator.workload.graph import COLLECTIVE, OFFLOAD_CLASSES, ON_COMM_STREAM, OPTIMIZER_STEP

# A micro-batch copy moves the ids at or above `low` by its shift. The template is lowered with this shift, far
# above any tensor id, so an id of the template is a moved one exactly when it is >= MARK.
MARK = 1 << 52
# The makers a copy's instructions come from, in this order: its runs, then (over all its streams) its Signals,
# WaitFors, moved Allocs, moved Frees and moved collectives, then the shared instructions.
_RUN, _SIGNAL, _WAIT, _ALLOC, _FREE, _COLLECTIVE, _SAME = range(7)
_KINDS = (Signal, WaitFor, Alloc, Free)      # the classes of makers _SIGNAL.._FREE
new_run = new_blocking = tuple.__new__
_new_instance = object.__new__
# The slots' own setters: a frozen dataclass's __init__ sets each field through object.__setattr__ (several
# times slower); called from map, setting a slot costs no Python call (program.signal does it one by one).
_SETTERS = {kind: tuple(kind.__dict__[name].__set__ for name in kind.__slots__) for kind in (*_KINDS, Collective)}
# Below this many instances of a class in a copy, each is made by its fast constructor (program.py) instead: the
# bulk path's fixed cost (a few C calls per field) outweighs its saving (GPT-3 530B's templates are ~70 instructions).
_BULK = 8
_ONE_BY_ONE = {Signal: signal, WaitFor: wait_for, Alloc: alloc, Free: free, Collective: checked_collective}


def templatable(ops) -> bool:
    """Whether lowering these ops through `rank_streams.RankStreams.overlapped` depends only on the ops, the iteration, `low`,
    the shift and whether reductions are outstanding: no optimizer-step, offload or communication-stream op and
    no data-parallel collective (those read or change the streams' state)."""
    for op in ops:
        if op.phase == OPTIMIZER_STEP or op.op_class in OFFLOAD_CLASSES or op.placement == ON_COMM_STREAM:
            return False
        if op.op_class == COLLECTIVE and op.group == "dp":
            return False
    return True


def record(scratch, runs: list, overlaps) -> tuple | None:
    """The template of `runs` (made with shift MARK) lowered by `scratch` (a fresh RankStreams of the same rank
    and options): (the label of each event it made, by number; makers of a copy's events, moved Allocs / Frees
    and moved collectives, over all its streams; each stream's plan: its name (None: the compute stream), which
    maker each instruction comes from, its runs' columns and its shared instructions), or None when an
    instruction or a change of the streams' state is not one a copy could repeat."""
    pending = list(scratch.pending)
    scratch.overlapped(runs, overlaps)
    if (scratch.pending != pending or scratch.deferred or scratch.unsent or scratch.sends or scratch.copies
            or scratch.blocks or scratch.offload_last or scratch.gathering):
        return None
    labels = [""] * scratch.count          # events are numbered from 1 on the fresh scratch streams
    # Over the streams in order: the Signals' and WaitFors' event numbers less one, the moved Allocs and Frees, the
    # moved collectives (with their Blocking stream or None).
    made: dict[type, list] = {kind: [] for kind in (*_KINDS, Collective)}
    plans = []
    for name, instructions in ((None, scratch.compute), *scratch.other.items()):
        plan = _plan(instructions, labels, made)
        if plan is None:
            return None
        plans.append((name,) + plan)
    return (tuple(labels), *(_events_maker(kind, made[kind]) for kind in (Signal, WaitFor)),
            *(_memory_maker(kind, made[kind]) for kind in (Alloc, Free)), _collective_maker(made[Collective]),
            tuple(plans))


def _moved(ids: tuple[int, ...]) -> int:
    return sum(1 for v in ids if v >= MARK)


def _plan(instructions: list, labels: list[str], made: dict[type, list]) -> tuple | None:
    """(a picker of the maker each of `instructions` (lowered with shift MARK) comes from in a copy, in order; the
    runs' ops, durations, iterations and lows; the shared instructions; the positions of its Signals and WaitFors,
    as Program.blocks lists them). Appends its events' numbers less one, moved
    Allocs / Frees and moved collectives to `made` (by class), each event's label to `labels`. None when an
    instruction is not one this module knows how to move."""
    kinds: list[int] = []
    runs: tuple[list, ...] = ([], [], [], [])
    same: list = []
    for instruction in instructions:
        kind = type(instruction)
        if kind is Run:
            op, duration_s, iteration, _, low = instruction
            for column, value in zip(runs, (op, duration_s, iteration, low)):
                column.append(value)
            kinds.append(_RUN)
        elif kind is Signal or kind is WaitFor:
            label, _, number = instruction.event.rpartition("#")
            if not (label and number.isdigit() and 0 < int(number) <= len(labels)):
                return None
            index = int(number) - 1
            if labels[index] not in ("", label + "#"):
                return None                       # one number, two labels: not made by RankStreams.event
            labels[index] = label + "#"
            made[kind].append(index)
            kinds.append(_SIGNAL if kind is Signal else _WAIT)
        elif kind is Blocking or kind is Collective:
            collective = instruction[0] if kind is Blocking else instruction
            if _moved(collective.allocs) or _moved(collective.frees):
                made[Collective].append((collective, instruction[1] if kind is Blocking else None))
                kinds.append(_COLLECTIVE)
            elif collective.moved is not None:
                return None
            else:
                same.append(instruction)          # instructions are values: every copy shares it
                kinds.append(_SAME)
        elif kind is Alloc or kind is Free:
            if _moved(instruction.tensors):
                made[kind].append(instruction)
                kinds.append(_ALLOC if kind is Alloc else _FREE)
            else:
                same.append(instruction)
                kinds.append(_SAME)
        else:
            return None
    return (_picker(kinds), tuple(map(tuple, runs)), tuple(same),
            tuple(i for i, kind in enumerate(kinds) if kind == _SIGNAL or kind == _WAIT))


def _picker(indices: list[int]):
    """A callable giving the tuple of the items of its argument at `indices` (itemgetter of one index gives the
    item itself, not a tuple)."""
    if len(indices) > 1:
        return itemgetter(*indices)
    indices = tuple(indices)
    return lambda items: tuple(items[index] for index in indices)


def _ids(ids: tuple[int, ...], shift: int) -> tuple[int, ...]:
    return tuple([v - MARK + shift if v >= MARK else v for v in ids])


def _mover(tuples: list[tuple[int, ...]]):
    """A function of a copy's shift giving the id tuples of `tuples` moved for it (_ids), in order, as an iterable:
    the tuples themselves when none moves, one-id tuples made without a Python call when each is one moved id."""
    tuples = tuple(tuples)
    if not any(map(_moved, tuples)):
        return lambda shift: tuples
    if all(len(ids) == 1 and ids[0] >= MARK for ids in tuples):
        bases = tuple(ids[0] - MARK for ids in tuples)
        return lambda shift: zip(map(add, bases, repeat(shift)))
    if all(len(ids) == 1 or not _moved(ids) for ids in tuples):
        pairs = tuple((ids, ids[0] - MARK if _moved(ids) else None) for ids in tuples)
        return lambda shift: [ids if base is None else (base + shift,) for ids, base in pairs]
    return lambda shift: [_ids(ids, shift) for ids in tuples]


def instances(kind: type, count: int, *columns) -> list:
    """kind(*fields) for each of `count` rows of the columns (a frozen slots dataclass, its __post_init__ not run:
    the fields are an instance's of the template): in bulk by the slots' setters, one by one when there are few."""
    if count < _BULK:
        return list(map(_ONE_BY_ONE[kind], *columns))
    made = list(map(_new_instance, repeat(kind, count)))
    for setter, column in zip(_SETTERS[kind], columns):
        deque(map(setter, made, column), 0)
    return made


def _events_maker(kind: type, numbers: list[int]):
    """A function of a copy's event names (by number less one) giving an iterator over its Signals (or WaitFors)."""
    if not numbers:
        return lambda names: None
    pick, count = _picker(numbers), len(numbers)
    return lambda names: iter(instances(kind, count, pick(names)))


def _memory_maker(kind: type, instructions: list):
    """A function of the shift giving an iterator over the moved Allocs (or Frees) `instructions` for that copy."""
    if not instructions:
        return lambda shift: None
    tensors, reasons = _mover([ins.tensors for ins in instructions]), tuple(ins.reason for ins in instructions)
    return lambda shift: iter(instances(kind, len(reasons), tensors(shift), reasons))


def _collective_maker(collectives: list[tuple]):
    """A function of the shift giving an iterator over the moved collectives (each a Blocking where its stream is not
    None) for that copy: column by column, their `moved` with the copy's shift (None where the template's is None)."""
    count = len(collectives)
    if not count:
        return lambda shift: None
    made = [collective for collective, _ in collectives]
    fixed = [tuple(getattr(c, name) for c in made) for name in ("name", "kind", "group", "size_bytes")]
    allocs, frees = _mover([c.allocs for c in made]), _mover([c.frees for c in made])
    iterations = tuple(c.iteration for c in made)
    heads = [c.moved for c in made]
    if all(head is None for head in heads):
        def moved(shift):
            return repeat(None)
    elif all(head is not None for head in heads):
        firsts, seconds, lows = (tuple(head[k] for head in heads) for k in (0, 1, 3))

        def moved(shift):
            return zip(firsts, seconds, repeat(shift), lows)
    else:
        def moved(shift):
            return [None if head is None else (head[0], head[1], shift, head[3]) for head in heads]
    streams = tuple(stream for _, stream in collectives)

    def make(shift: int):
        posts = instances(Collective, count, *fixed, allocs(shift), frees(shift), iterations, moved(shift))
        if None not in streams:
            return map(new_blocking, repeat(Blocking), zip(posts, streams))
        return iter([post if stream is None else new_blocking(Blocking, (post, stream))
                     for post, stream in zip(posts, streams)])
    return make


def apply(template: tuple, streams, shift: int) -> None:
    """Append the template's instructions for the copy moved by `shift` to `streams` (a RankStreams), with its
    events numbered after the streams' own, as `overlapped` would have made them.

    Each kind of instruction is made in bulk for all streams, then each stream draws from the kinds' iterators in
    its instruction order (`pick`), the streams in the order the template's were recorded. Each stream's part is
    listed in `streams.blocks` (Program.blocks: where its Signals and WaitFors stand, for the engine's set-up).
    """
    labels, signals, waits, allocs, frees, collectives, plans = template
    count = streams.count
    # Each event's name made once, shared by its Signal and its WaitFor (equal strings either way).
    names = list(map(add, labels, map(str, range(count + 1, count + len(labels) + 1))))
    shared = (signals(names), waits(names), allocs(shift), frees(shift), collectives(shift))
    blocks = streams.blocks
    for plan in plans:
        name, pick, (ops, durations, iterations, lows), same, sync = plan
        made = map(next, pick((map(new_run, repeat(Run), zip(ops, durations, iterations, repeat(shift), lows)),
                               *shared, iter(same))))
        stream = streams.compute if name is None else streams.stream(name)
        start = len(stream)
        stream += made
        # (the plan, the same object for every copy of this template: its key)
        blocks.setdefault(name, []).append((start, len(stream), plan, sync))
    streams.count = count + len(labels)
