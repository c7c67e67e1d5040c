"""Lowered overlapped micro-batches as templates: one lowering per (ops, iteration, low), moved per copy."""

from __future__ import annotations

from simulator.parallel.program import (Alloc, Blocking, Collective, Free, Run, Signal, WaitFor, checked_collective,
                                        signal, wait_for)
from simulator.workload.graph import COLLECTIVE, OFFLOAD_CLASSES, ON_COMM_STREAM, OPTIMIZER_STEP

# A micro-batch copy moves the ids at or above `low` by its shift. The template is lowered with this shift, far
# above any tensor id, so an id of the template is a moved one exactly when it is >= MARK.
MARK = 1 << 52
_RUN, _SIGNAL, _WAIT, _BLOCKING, _COLLECTIVE, _ALLOC, _FREE, _SAME = range(8)
new_run = new_blocking = tuple.__new__


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


def _moved(ids: tuple[int, ...]) -> int:
    return sum(1 for v in ids if v >= MARK)


def _recipe(instruction) -> tuple | None:
    """How to make `instruction` (lowered with shift MARK) for another copy; None: not an instruction this
    module knows how to move."""
    kind = type(instruction)
    if kind is Run:
        op, duration_s, iteration, _, low = instruction
        return (_RUN, ((op, duration_s, iteration, low),))
    if kind is Signal or kind is WaitFor:
        label, _, number = instruction.event.rpartition("#")
        if not (label and number.isdigit()):
            return None
        return (_SIGNAL if kind is Signal else _WAIT, label + "#", int(number))
    if kind is Blocking or kind is Collective:
        collective = instruction[0] if kind is Blocking else instruction
        if not (_moved(collective.allocs) or _moved(collective.frees)):
            if collective.moved is not None:
                return None
            return (_SAME, instruction)               # instructions are values: every copy shares it
        return (_BLOCKING if kind is Blocking else _COLLECTIVE, collective,
                instruction[1] if kind is Blocking else None)
    if kind is Alloc or kind is Free:
        if not _moved(instruction.tensors):
            return (_SAME, instruction)
        return (_ALLOC if kind is Alloc else _FREE, instruction.tensors, instruction.reason)
    return None


def record(scratch, runs: list, overlaps) -> tuple | None:
    """The template of `runs` (made with shift MARK) lowered by `scratch` (a fresh _Streams of the same rank
    and options): (events made, compute stream recipes, other streams' recipes), or None when an instruction
    or a change of the streams' state is not one a copy could repeat."""
    pending = list(scratch.pending)
    scratch.overlapped(runs, overlaps)
    if (scratch.pending != pending or scratch.deferred or scratch.unsent or scratch.sends or scratch.copies
            or scratch.offload_last or scratch.gathering):
        return None
    compute = _recipes(scratch.compute)
    other = tuple((name, _recipes(instructions)) for name, instructions in scratch.other.items())
    if compute is None or any(recipes is None for _, recipes in other):
        return None
    return scratch.count, compute, other


def _recipes(instructions: list) -> tuple | None:
    """The recipes of `instructions`, consecutive runs in one (None: one cannot be moved)."""
    recipes: list[tuple] = []
    for instruction in instructions:
        recipe = _recipe(instruction)
        if recipe is None:
            return None
        if recipe[0] == _RUN and recipes and recipes[-1][0] == _RUN:
            recipes[-1] = (_RUN, recipes[-1][1] + recipe[1])
        else:
            recipes.append(recipe)
    return tuple(recipes)


def _ids(ids: tuple[int, ...], shift: int) -> tuple[int, ...]:
    return tuple([v - MARK + shift if v >= MARK else v for v in ids])


def _make(recipes: tuple, count: int, shift: int) -> list:
    made = []
    add = made.append
    for recipe in recipes:
        code = recipe[0]
        if code == _RUN:
            made += [new_run(Run, (op, duration_s, iteration, shift, low)) for op, duration_s, iteration, low
                     in recipe[1]]
        elif code == _SIGNAL:
            add(signal(f"{recipe[1]}{recipe[2] + count}"))
        elif code == _WAIT:
            add(wait_for(f"{recipe[1]}{recipe[2] + count}"))
        elif code == _SAME:
            add(recipe[1])
        elif code == _ALLOC or code == _FREE:
            add((Alloc if code == _ALLOC else Free)(_ids(recipe[1], shift), recipe[2]))
        else:
            _, c, name = recipe
            moved = c.moved if c.moved is None else (c.moved[0], c.moved[1], shift, c.moved[3])
            collective = checked_collective(c.name, c.kind, c.group, c.size_bytes, _ids(c.allocs, shift),
                                            _ids(c.frees, shift), c.iteration, moved)
            add(new_blocking(Blocking, (collective, name)) if code == _BLOCKING else collective)
    return made


def apply(template: tuple, streams, shift: int) -> None:
    """Append the template's instructions for the copy moved by `shift` to `streams` (a _Streams), with its
    events numbered after the streams' own, as `overlapped` would have made them."""
    events, compute, other = template
    count = streams.count
    streams.compute += _make(compute, count, shift)
    for name, recipes in other:
        streams.stream(name).extend(_make(recipes, count, shift))
    streams.count = count + events

