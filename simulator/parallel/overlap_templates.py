"""Lowered overlapped micro-batches as templates: one lowering per (ops, iteration, low), moved per copy."""

from __future__ import annotations

from collections import deque
from itertools import repeat
from operator import add, itemgetter

from simulator.parallel.program import Alloc, Blocking, Collective, Free, Run, Signal, WaitFor
from simulator.workload.graph import COLLECTIVE, OFFLOAD_CLASSES, ON_COMM_STREAM, OPTIMIZER_STEP

# A micro-batch copy moves the ids at or above `low` by its shift. The template is lowered with this shift, far
# above any tensor id, so an id of the template is a moved one exactly when it is >= MARK.
MARK = 1 << 52
_RUN, _SIGNAL, _WAIT, _ALLOC, _FREE, _SAME, _COLLECTIVE = range(7)     # a plan's makers, in this order
new_run = new_blocking = tuple.__new__
_new_instance = object.__new__
# The slots' own setters: a frozen dataclass's __init__ sets each field through object.__setattr__ (several
# times slower); made in bulk with map, a Signal costs no Python call (as program.signal, one by one).
_SETTERS = {kind: tuple(kind.__dict__[name].__set__ for name in kind.__slots__)
            for kind in (Signal, WaitFor, Alloc, Free, Collective)}


def templatable(ops) -> bool:
    """Whether lowering these ops through `_Streams.overlapped` depends only on the ops, the iteration, `low`,
    the shift and whether reductions are outstanding: no optimizer-step, offload or communication-stream op and
    no data-parallel collective (those read or change the streams' state)."""
    for op in ops:
        if op.phase == OPTIMIZER_STEP or op.op_class in OFFLOAD_CLASSES or op.placement == ON_COMM_STREAM:
            return False
        if op.op_class == COLLECTIVE and op.group == "dp":
            return False
    return True


def record(scratch, runs: list, overlaps) -> tuple | None:
    """The template of `runs` (made with shift MARK) lowered by `scratch` (a fresh _Streams of the same rank
    and options): (the label of each event it made, by number, the compute stream's plan, the other streams'
    plans), or None when an instruction or a change of the streams' state is not one a copy could repeat."""
    pending = list(scratch.pending)
    scratch.overlapped(runs, overlaps)
    if (scratch.pending != pending or scratch.deferred or scratch.unsent or scratch.sends or scratch.copies
            or scratch.offload_last or scratch.gathering):
        return None
    labels = [""] * scratch.count          # events are numbered from 1 on the fresh scratch streams
    compute = _plan(scratch.compute, labels)
    other = tuple((name, _plan(instructions, labels)) for name, instructions in scratch.other.items())
    if compute is None or any(plan is None for _, plan in other):
        return None
    return tuple(labels), compute, other


def _moved(ids: tuple[int, ...]) -> int:
    return sum(1 for v in ids if v >= MARK)


def _plan(instructions: list, labels: list[str]) -> tuple | None:
    """How to make `instructions` (lowered with shift MARK) for another copy, kind by kind: (which kind each
    instruction is, in order, as a picker of the kinds' makers; the runs' ops, durations, iterations and lows;
    pickers of the Signals' and the WaitFors' events from a copy's (by number less one); makers of the moved
    Allocs and Frees; the shared instructions; a maker of the moved collectives). Records each event's label in
    `labels`. None when an instruction is not one this module knows how to move."""
    kinds: list[int] = []
    runs: tuple[list, ...] = ([], [], [], [])
    events: tuple[list[int], list[int]] = ([], [])
    memory: tuple[list, list] = ([], [])
    same: list = []
    collectives: list[tuple] = []
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
                return None                       # one number, two labels: not made by _Streams.event
            labels[index] = label + "#"
            code = _SIGNAL if kind is Signal else _WAIT
            events[code - _SIGNAL].append(index)
            kinds.append(code)
        elif kind is Blocking or kind is Collective:
            collective = instruction[0] if kind is Blocking else instruction
            if _moved(collective.allocs) or _moved(collective.frees):
                collectives.append((collective, instruction[1] if kind is Blocking else None))
                kinds.append(_COLLECTIVE)
            elif collective.moved is not None:
                return None
            else:
                same.append(instruction)          # instructions are values: every copy shares it
                kinds.append(_SAME)
        elif kind is Alloc or kind is Free:
            if _moved(instruction.tensors):
                code = _ALLOC if kind is Alloc else _FREE
                memory[code - _ALLOC].append(instruction)
                kinds.append(code)
            else:
                same.append(instruction)
                kinds.append(_SAME)
        else:
            return None
    return (_picker(kinds), tuple(map(tuple, runs)), tuple(_picker(numbers) if numbers else None
                                                           for numbers in events),
            tuple(_memory_maker(kind, made) for kind, made in zip((Alloc, Free), memory)), tuple(same),
            _collective_maker(collectives))


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
    return lambda shift: [_ids(ids, shift) for ids in tuples]


def _slotted(kind: type, count: int, *columns) -> list:
    """kind(*fields) for each of `count` rows of the columns (a frozen slots dataclass, its __post_init__ not run:
    the fields are an instance's of the template), made in bulk by the slots' setters."""
    made = list(map(_new_instance, repeat(kind, count)))
    for setter, column in zip(_SETTERS[kind], columns):
        deque(map(setter, made, column), 0)
    return made


def _memory_maker(kind: type, instructions: list):
    """A function of the shift giving the moved Allocs (or Frees) `instructions` for that copy (None: there are none)."""
    if not instructions:
        return None
    tensors, reasons = _mover([ins.tensors for ins in instructions]), tuple(ins.reason for ins in instructions)
    return lambda shift: _slotted(kind, len(reasons), tensors(shift), reasons)


def _collective_maker(collectives: list[tuple]):
    """A function of the shift giving the moved collectives (each a Blocking where its stream is not None) for
    that copy: column by column, their `moved` with the copy's shift (None where the template's is None)."""
    count = len(collectives)
    if not count:
        return lambda shift: ()
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
        posts = _slotted(Collective, count, *fixed, allocs(shift), frees(shift), iterations, moved(shift))
        if None not in streams:
            return map(new_blocking, repeat(Blocking), zip(posts, streams))
        return [post if stream is None else new_blocking(Blocking, (post, stream))
                for post, stream in zip(posts, streams)]
    return make


def _events(kind: type, pick, events: list[str]):
    """Iterator over the Signals (or WaitFors) of the events `pick` takes from a copy's `events` (None: none)."""
    if pick is None:
        return None
    names = pick(events)
    return iter(_slotted(kind, len(names), names))


def _make(plan: tuple, events: list[str], shift: int):
    """Iterator over the plan's instructions for the copy moved by `shift` whose events are `events` (by number
    less one): one iterator per kind of instruction, each drawn from in instruction order (`pick`)."""
    pick, (ops, durations, iterations, lows), (signals, waits), (allocs, frees), same, collectives = plan
    makers = (map(new_run, repeat(Run), zip(ops, durations, iterations, repeat(shift), lows)),
              _events(Signal, signals, events), _events(WaitFor, waits, events),
              iter(allocs(shift)) if allocs else None,
              iter(frees(shift)) if frees else None,
              iter(same),
              iter(collectives(shift)))
    return map(next, pick(makers))


def apply(template: tuple, streams, shift: int) -> None:
    """Append the template's instructions for the copy moved by `shift` to `streams` (a _Streams), with its
    events numbered after the streams' own, as `overlapped` would have made them."""
    labels, compute, other = template
    count = streams.count
    # Each event's name made once, shared by its Signal and its WaitFor (equal strings either way).
    events = list(map(add, labels, map(str, range(count + 1, count + len(labels) + 1))))
    streams.compute += _make(compute, events, shift)
    for name, plan in other:
        streams.stream(name).extend(_make(plan, events, shift))
    streams.count = count + len(labels)
