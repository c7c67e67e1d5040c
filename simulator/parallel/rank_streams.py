"""A rank's instruction streams while lower_multi.py builds them: runs, collectives, messages and micro-batch copies."""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import repeat
from operator import add, itemgetter

from simulator.hardware.catalog import DeviceSpec
from simulator.parallel.lower import COMPUTE
from simulator.parallel import overlap_templates
from simulator.parallel.offload_lowering import lower_offload
from simulator.parallel.overlap import NO_OVERLAP_CHANGE, OverlapOptions
from simulator.parallel.plan import ParallelPlan
from simulator.parallel.program import (COMM_STREAM, Alloc, Blocking, Collective, Instruction, Program, Run, Signal,
                                        WaitFor, alloc, checked_collective, free, send, signal, wait_for)
from simulator.parallel.tp_overlap import Overlap, plan_overlaps, split_gemm
from simulator.workload.graph import (BLOCKING, COLLECTIVE, FORWARD, GEMM, OFFLOAD_CLASSES, ON_COMM_STREAM,
                                      OPTIMIZER_STEP, OVERLAPPED, Op, moved_ids)

new_run = new_blocking = tuple.__new__    # Run(...), Blocking(...) without the named tuples' Python-level __new__


@dataclass(frozen=True)
class TimedOps:
    """A recorded micro-batch's forward or backward ops with their durations, shared by its copies.

    `segments`: (plain, special) pairs in order, `plain` a stretch of (op, duration) that only runs on the
    compute stream, `special` the op that follows it needing `RankStreams.runs` (a collective or an
    optimizer-phase op), or None at the end. `ops` / `durations`: `pairs` as two columns, so that a
    micro-batch's runs are made in one pass.
    """

    pairs: tuple[tuple[Op, float], ...]
    segments: tuple[tuple[tuple[tuple[Op, float], ...], tuple[Op, float] | None], ...]
    ops: tuple[Op, ...] = ()
    durations: tuple[float, ...] = ()

    @classmethod
    def of(cls, runs: list[Run]) -> TimedOps:
        """Group the timed runs of one op list."""
        pairs = tuple((run.op, run.duration_s) for run in runs)
        segments = []
        plain: list[tuple[Op, float]] = []
        for pair in pairs:
            if pair[0].op_class == COLLECTIVE or pair[0].phase == OPTIMIZER_STEP or pair[0].op_class in OFFLOAD_CLASSES \
                    or pair[0].placement == ON_COMM_STREAM:
                segments.append((tuple(plain), pair))
                plain = []
            else:
                plain.append(pair)
        if plain:
            segments.append((tuple(plain), None))
        return cls(pairs, tuple(segments), tuple(op for op, _ in pairs), tuple(duration_s for _, duration_s in pairs))


@dataclass
class RankStreams:
    """The instruction lists of one rank under construction, with event counters."""

    rank: int
    plan: ParallelPlan
    fuse_blocking = True      # a class switch, not a field: False writes every collective as Signal / WaitFor (tests)
    templates_on = True       # a class switch: False lowers every overlapped micro-batch op by op (tests compare)
    compute: list[Instruction] = field(default_factory=list)
    other: dict[str, list[Instruction]] = field(default_factory=dict)
    pending: list[str] = field(default_factory=list)     # dp reductions the compute stream has not waited for
    dp_stream: str = COMM_STREAM                          # the stream of data-parallel collectives
    count: int = 0
    # Lazily allocated cuBLAS workspaces: True (first forward GEMM) / False (first other GEMM) -> tensor ids.
    first_gemm: dict[bool, tuple[int, ...]] = field(default_factory=dict)
    groups: dict[str, tuple[int, ...]] = field(default_factory=dict)     # axis -> this rank's group
    regions: dict[int, tuple[int, int]] = field(default_factory=dict)    # chunk -> ids of micro-batch copies
    lowered: dict[int, tuple] = field(default_factory=dict)              # id(op) -> _lower_collective(op)
    unmoved: dict[tuple[int, int], Collective] = field(default_factory=dict)   # (id(op), iteration) -> its post
    held: dict[tuple[int, int], tuple[int, ...]] = field(default_factory=dict)  # (chunk, mb) -> freed after its W
    # (id(timed ops), low) -> (them, _compile's, iteration -> _unmoved_blockings')
    compiled: dict[tuple, tuple] = field(default_factory=dict)
    peers: dict[int, int] = field(default_factory=dict)           # pipeline stage -> this rank's peer on it
    chunks: dict[int, int] = field(default_factory=dict)          # pipeline stage -> its chunk on its rank
    copies: list[tuple] = field(default_factory=list)   # Program.copies of the compute stream
    blocks: dict[str | None, list[tuple]] = field(default_factory=dict)  # Program.blocks (None: compute stream)
    overlap: OverlapOptions = NO_OVERLAP_CHANGE         # what the run overlaps (parallel/overlap.py)
    deferred: list[Collective] = field(default_factory=list)   # reductions posted after the backward
    unsent: list[str] = field(default_factory=list)     # blocking sends the next action waits for
    gathering: list[str] = field(default_factory=list)  # parameter all_gathers the first forward runs beside
    device: DeviceSpec | None = None                    # the rank's GPU (SMs a GEMM keeps beside communication)
    plans: dict[int, tuple] = field(default_factory=dict)    # id(timed ops) -> (them, their Overlaps)
    halves: dict[int, tuple] = field(default_factory=dict)   # id(op) -> (op, split_gemm's halves)
    # (id(timed ops), iteration, low, reductions outstanding) -> (them, overlap_templates.record's or None)
    templates: dict[tuple, tuple] = field(default_factory=dict)
    offload_last: dict[str, str] = field(default_factory=dict)   # offload stream -> its last transfer's done event
    offload_done: dict[str, str] = field(default_factory=dict)   # offload transfer name -> its last post's done event
    host_caps: dict[str, float] = field(default_factory=dict)    # host kernel -> bytes/s (offload HostState.caps)
    # Sends wait on their stream in the order the receiver consumes them (its recvs are posted in its action order,
    # and a Send is matched by its Recv): action key -> its position on its rank; the iteration's sends by stream.
    consumer_position: dict[tuple, int] = field(default_factory=dict)
    sends: dict[str, list[tuple[int, int, list]]] = field(default_factory=dict)

    def event(self, label: str) -> str:
        self.count += 1
        return f"{label}#{self.count}"

    def stream(self, name: str) -> list[Instruction]:
        return self.other.setdefault(name, [])

    def collective(self, run: Run) -> None:
        """Lower a COLLECTIVE op run to a Collective on COMM_STREAM, ordered with the compute stream."""
        self.post(run.op, run.duration_s, run.iteration, run.shift, run.low)

    def post(self, op: Op, duration_s: float, iteration: int, shift: int, low: int) -> None:
        """`collective` of Run(op, duration_s, iteration, shift, low), without making the Run unless needed.

        The Collective has no shift: a micro-batch copy's allocs / frees are moved here. What depends on
        the op only (group, stream, event labels) is worked out once per op.
        """
        lowered = self.lowered.get(id(op))
        if lowered is None or lowered[0] is not op:
            lowered = self.lowered[id(op)] = self._lower_collective(op)
        _, group, comm, name, ready_label, done_label, kind, size_bytes, overlapped = lowered
        if group is None:
            self.compute.append(Run(op, duration_s, iteration, shift, low))
            return
        if kind is None:
            # A kernel of the communication library on the group's stream, after what the compute stream did so far.
            count = self.count
            ready, done = f"{ready_label}#{count + 1}", f"{done_label}#{count + 2}"
            self.count = count + 2
            self.compute.append(signal(ready))
            comm += [wait_for(ready), Run(op, duration_s, iteration, shift, low), signal(done)]
            self.pending.append(done)
            return
        allocs, frees = op.allocs, op.frees
        if shift:
            allocs, frees = moved_ids(allocs, shift, low), moved_ids(frees, shift, low)
        if allocs == op.allocs and frees == op.frees:
            # Instructions are values: every micro-batch's post of this op in this iteration is the same one.
            key = (id(op), iteration)
            collective = self.unmoved.get(key)
            if collective is None:
                collective = self.unmoved[key] = Collective(op.name, kind, group, size_bytes, allocs, frees,
                                                            iteration)
        else:
            # _lower_collective checked name, kind, group and size once per op.
            collective = checked_collective(op.name, kind, group, size_bytes, allocs, frees, iteration,
                                            (op.allocs, op.frees, shift, low))
        if overlapped and not self.overlap.overlap_grad_reduce:
            if self.overlap.grad_reduce_wait == "end":
                self.deferred.append(collective)      # Megatron: every bucket after the backward
                return
            overlapped = False                        # DeepSpeed: waited for where the bucket fills
        if self.fuse_blocking and not overlapped and not (self.pending and name == self.dp_stream):
            # Waited for at once on a stream with nothing outstanding: one Blocking instruction (program.py).
            self.compute.append(new_blocking(Blocking, (collective, name)))
            return
        count = self.count
        ready = f"{ready_label}#{count + 1}"
        done = f"{done_label}#{count + 2}"
        self.count = count + 2
        self.compute.append(signal(ready))
        comm += [wait_for(ready), collective, signal(done)]
        if overlapped:
            self.pending.append(done)
        else:
            self.compute.append(wait_for(done))

    def _lower_collective(self, op: Op) -> tuple:
        """(op, group or None when it is this rank alone, stream and its name, event labels, kind (None for a kernel
        placed on the communication stream), size, overlapped)."""
        axis = op.group if op.group in ("tp", "dp") else "tp"
        group = self.groups.get(axis)
        if group is None:
            group = self.groups[axis] = self.plan.group_of(self.rank, axis)
        if len(group) == 1:
            return (op, None, None, "", "", "", "", 0.0, False)
        name = self.dp_stream if axis == "dp" else COMM_STREAM
        comm = self.stream(name)
        if op.op_class != COLLECTIVE:      # placement ON_COMM_STREAM: `post` runs it on the stream, overlapped
            return (op, group, comm, name, f"{op.name}.ready", f"{op.name}.done", None, 0.0, True)
        overlapped = axis == "dp" and (op.placement == OVERLAPPED or (
            op.collective in ("all_reduce", "reduce_scatter") and op.placement != BLOCKING))
        kind, size_bytes = op.collective or "all_reduce", float(op.comm_bytes)
        Collective(op.name, kind, group, size_bytes)     # validates what post's checked_collective copies
        return (op, group, comm, name, f"{op.name}.ready", f"{op.name}.done", kind, size_bytes, overlapped)

    def flush(self) -> None:
        """The compute stream waits for every outstanding data-parallel reduction (posting the deferred ones)."""
        if self.deferred:
            ready, done = self.event("dp.grad_sync.ready"), self.event("dp.grad_sync.done")
            self.compute.append(signal(ready))
            self.stream(self.dp_stream).extend([wait_for(ready), *self.deferred, signal(done)])
            self.pending.append(done)
            self.deferred.clear()
        self.compute += [wait_for(event) for event in self.pending]
        self.pending.clear()

    def post_sends(self) -> None:
        """The iteration's sends onto their streams, each stream in its receiver's order (stable: a schedule whose
        stages take messages in the order they are sent keeps it)."""
        for name, sends in self.sends.items():
            stream = self.stream(name)
            for _, _, instructions in sorted(sends, key=lambda send: send[:2]):
                stream.extend(instructions)
        self.sends.clear()

    def sends_done(self) -> None:
        """The compute stream waits for the blocking sends posted since the last action (overlap_p2p_comm off)."""
        self.compute += [wait_for(event) for event in self.unsent]
        self.unsent.clear()

    def microbatch(self, timed: TimedOps, iteration: int, shift: int, low: int) -> None:
        """Append one micro-batch's runs of `timed` (its template's ops, tensor ids moved by shift / low).

        Only the instructions are made per micro-batch: the runs in one pass over the ops, the collectives among
        them from what `_compile` worked out once per (ops, low). Ops before the last lazily allocated
        workspace, and op lists with a collective whose lowering depends on the streams' state (an overlapped
        one, one on the data-parallel stream) or an optimizer-phase op, take the general path (`_general`).
        """
        if self.tp_overlaps_on():
            planned = self.plans.get(id(timed))
            if planned is None or planned[0] is not timed:
                planned = self.plans[id(timed)] = (timed, self.overlaps_of(timed.ops))
            if planned[1]:
                if shift and self.templates_on and not self.first_gemm and self._templated(
                        timed, planned[1], iteration, shift, low):
                    return
                self.overlapped([new_run(Run, (op, duration_s, iteration, shift, low)) for op, duration_s in timed.pairs],
                                planned[1])
                return
        if self.first_gemm:
            self.runs([Run(op, duration_s, iteration, shift, low) for op, duration_s in timed.pairs])
            return
        key = (id(timed), low if shift else None)
        compiled = self.compiled.get(key)
        if compiled is None or compiled[0] is not timed:
            specials = self._compile(timed, low if shift else None)
            compiled = self.compiled[key] = (timed, specials, {}, specials and _interleaving(timed, specials))
        _, specials, fixed_by_iteration, interleaving = compiled
        if specials is None:
            self._general(timed, iteration, shift, low)
            return
        # The ops as runs but for the collectives, each a Blocking in its op's place: the unmoved ones shared by
        # every copy (per iteration), the moved ones made for this shift; interleaved as `_interleaving` says.
        unmoved, moved = specials
        fixed = fixed_by_iteration.get(iteration)
        if fixed is None:
            fixed = fixed_by_iteration[iteration] = self._unmoved_blockings(unmoved, iteration, shift, low)
        pick, ops, durations, blockings = interleaving
        start = len(self.compute)
        self.compute += map(next, pick((map(new_run, repeat(Run), zip(ops, durations, repeat(iteration),
                                                                         repeat(shift), repeat(low))),
                                        iter(fixed), blockings(shift, low, iteration))))
        self.copies.append((start, len(self.compute), timed, iteration, low, specials))

    def _templated(self, timed: TimedOps, overlaps: tuple[Overlap, ...], iteration: int, shift: int,
                   low: int) -> bool:
        """`overlapped` for a moved copy from the template of its ops (parallel/overlap_templates.py), lowered once
        per (ops, iteration, low, reductions outstanding); False (nothing done) when they cannot have one."""
        key = (id(timed), iteration, low, bool(self.pending))
        found = self.templates.get(key)
        if found is None or found[0] is not timed:
            template = None
            if overlap_templates.templatable(timed.ops):
                scratch = RankStreams(self.rank, self.plan, pending=list(self.pending), dp_stream=self.dp_stream,
                                   groups=self.groups, overlap=self.overlap, device=self.device, halves=self.halves)
                template = overlap_templates.record(scratch, [
                    new_run(Run, (op, duration_s, iteration, overlap_templates.MARK, low))
                    for op, duration_s in timed.pairs], overlaps)
            found = self.templates[key] = (timed, template)
        if found[1] is None:
            return False
        overlap_templates.apply(found[1], self, shift)
        return True

    def _unmoved_blockings(self, unmoved: tuple, iteration: int, shift: int, low: int) -> tuple:
        """The Blocking of each collective of `unmoved` (`_compile`'s) in `iteration`: instructions are values, so
        every copy of the template shares them, and `post` the collectives (made as it makes them: the first
        post's moved, equal, tuples)."""
        blockings = []
        for index, op, kind, group, size_bytes, name in unmoved:
            collective = self.unmoved.get((id(op), iteration))
            if collective is None:
                allocs, frees = op.allocs, op.frees
                if shift:
                    allocs, frees = moved_ids(allocs, shift, low), moved_ids(frees, shift, low)
                collective = self.unmoved[(id(op), iteration)] = Collective(op.name, kind, group, size_bytes,
                                                                            allocs, frees, iteration)
            blockings.append(new_blocking(Blocking, (collective, name)))
        return tuple(blockings)

    def _compile(self, timed: TimedOps, low: int | None) -> tuple | None:
        """The collectives of `timed` lowered to a Blocking, for copies with this `low` (None: not moved), as
        (unmoved, moved): unmoved (index in `timed.pairs`, op, kind, group, size, stream) when its ids do not move,
        moved (index, op name, kind, group, size, stream, op allocs, op frees, how each moves: `_moves`) when
        they do. A collective of this rank alone is left out (it lowers to its run). None when a collective's
        lowering depends on the streams' state, or `timed` has an optimizer-phase op (then `_general` lowers
        them)."""
        if not self.fuse_blocking:
            return None
        unmoved, moved = [], []
        for index, (op, _) in enumerate(timed.pairs):
            if op.op_class != COLLECTIVE:
                if op.phase == OPTIMIZER_STEP or op.op_class in OFFLOAD_CLASSES or op.placement == ON_COMM_STREAM:
                    return None
                continue
            lowered = self.lowered.get(id(op))
            if lowered is None or lowered[0] is not op:
                lowered = self.lowered[id(op)] = self._lower_collective(op)
            _, group, _, name, _, _, kind, size_bytes, overlapped = lowered
            if group is None:
                continue
            if overlapped or name == self.dp_stream:
                return None          # overlapped, or waits on pending reductions: post decides per call
            if low is not None and any(v >= low for v in op.allocs + op.frees):
                moved.append((index, op.name, kind, group, size_bytes, name, op.allocs, op.frees,
                              _moves(op.allocs, low), _moves(op.frees, low)))
            else:
                unmoved.append((index, op, kind, group, size_bytes, name))
        return tuple(unmoved), tuple(moved)

    def _general(self, timed: TimedOps, iteration: int, shift: int, low: int) -> None:
        """`microbatch` op by op: plain stretches, then each special through `post` or `runs`."""
        compute = self.compute
        for plain, special in timed.segments:
            if plain:
                compute += [new_run(Run, (op, duration_s, iteration, shift, low)) for op, duration_s in plain]
            if special is None:
                continue
            op, duration_s = special
            if op.op_class == COLLECTIVE or op.placement == ON_COMM_STREAM:
                self.post(op, duration_s, iteration, shift, low)
            else:
                self.runs([Run(op, duration_s, iteration, shift, low)])

    def tp_overlaps_on(self) -> bool:
        """Whether any tensor-parallel collective may run beside a GEMM (parallel/tp_overlap.py)."""
        return self.device is not None and (self.overlap.tp_comm_overlap or self.overlap.tp_backward_overlap)

    def overlaps_of(self, ops: tuple[Op, ...] | list[Op]) -> tuple[Overlap, ...]:
        """tp_overlap.plan_overlaps for this rank's tensor-parallel group and GPU."""
        group = self.groups.get("tp")
        if group is None:
            group = self.groups["tp"] = self.plan.group_of(self.rank, "tp")
        return plan_overlaps(ops, self.overlap, len(group), self.device)

    def emit(self, runs: list[Run]) -> None:
        """`runs`, with the collectives tp_overlap pairs with GEMMs run beside them."""
        overlaps = self.overlaps_of([run.op for run in runs]) if self.tp_overlaps_on() else ()
        if overlaps:
            self.overlapped(runs, overlaps)
        else:
            self.runs(runs)

    def overlapped(self, runs: list[Run], overlaps: tuple[Overlap, ...]) -> None:
        """Lower `runs` with each Overlap's collective on its stream while its GEMM runs (tp_overlap.py)."""
        by_gemm = {o.gemm: o for o in overlaps}
        by_collective = {o.collective: o for o in overlaps}
        beside: dict[int, str] = {}          # collective index -> event of its part running beside the GEMM
        for index, run in enumerate(runs):
            overlap = by_collective.get(index)
            if overlap is not None:
                if overlap.collective_first:
                    beside[index] = self.beside(run, 1.0, True)
                    continue
                self.compute.append(wait_for(beside.pop(index)))
                if overlap.ahead < 1:
                    self.post_part(run, 1 - overlap.ahead)
                else:
                    self.memory_of(run)
                continue
            overlap = by_gemm.get(index)
            if overlap is None:
                self.runs([run])
                continue
            op, duration_s, iteration, shift, low = run
            cached = self.halves.get(id(op))
            if cached is None or cached[0] is not op:
                cached = self.halves[id(op)] = (op, split_gemm(op))
            head, tail = cached[1]
            scaled = duration_s * overlap.gemm_scale
            if overlap.collective_first:
                first = 1 - overlap.gemm_after
                self.runs([new_run(Run, (head if overlap.gemm_after else op, scaled * first, iteration, shift, low))])
                self.compute.append(wait_for(beside.pop(overlap.collective)))
                if overlap.gemm_after:
                    self.compute.append(new_run(Run, (tail, duration_s * overlap.gemm_after, iteration, shift, low)))
                continue
            if overlap.gemm_before:
                self.runs([new_run(Run, (head, scaled * overlap.gemm_before, iteration, shift, low))])
            beside[overlap.collective] = self.beside(runs[overlap.collective], overlap.ahead, False)
            rest = tail if overlap.gemm_before else op
            self.runs([new_run(Run, (rest, scaled * (1 - overlap.gemm_before), iteration, shift, low))])

    def beside(self, run: Run, fraction: float, memory: bool) -> str:
        """Post `fraction` of the collective `run` stands for on its stream now, with its memory calls or none;
        the event it signals when done."""
        collective, name, comm = self.collective_of(run, fraction, memory, ".beside" if fraction < 1 else "")
        ready, done = self.event(f"{run.op.name}.ready"), self.event(f"{run.op.name}.done")
        self.compute.append(signal(ready))
        comm += [wait_for(ready), collective, signal(done)]
        return done

    def post_part(self, run: Run, fraction: float) -> None:
        """The rest (`fraction` of the bytes) of an overlapped collective, with its memory, waited for at once."""
        collective, name, comm = self.collective_of(run, fraction, True, "")
        if self.fuse_blocking and not (self.pending and name == self.dp_stream):
            self.compute.append(new_blocking(Blocking, (collective, name)))
            return
        ready, done = self.event(f"{run.op.name}.ready"), self.event(f"{run.op.name}.done")
        self.compute.append(signal(ready))
        comm += [wait_for(ready), collective, signal(done)]
        self.compute.append(wait_for(done))

    def memory_of(self, run: Run) -> None:
        """The memory calls of a collective whose bytes all moved beside a GEMM, where the collective stands."""
        op, _, _, shift, low = run
        allocs, frees = (moved_ids(op.allocs, shift, low), moved_ids(op.frees, shift, low)) if shift else \
            (op.allocs, op.frees)
        if allocs:
            self.compute.append(alloc(allocs, f"{op.name} (ran beside its GEMM)"))
        if frees:
            self.compute.append(free(frees, f"{op.name} (ran beside its GEMM)"))

    def collective_of(self, run: Run, fraction: float, memory: bool, suffix: str) -> tuple:
        """(Collective for `fraction` of `run`'s collective, with its moved memory or none, its stream's name and
        instruction list)."""
        op, _, iteration, shift, low = run
        lowered = self.lowered.get(id(op))
        if lowered is None or lowered[0] is not op:
            lowered = self.lowered[id(op)] = self._lower_collective(op)
        _, group, comm, name, _, _, kind, size_bytes, _ = lowered
        allocs, frees = (op.allocs, op.frees) if memory else ((), ())
        if shift and memory:
            allocs, frees = moved_ids(allocs, shift, low), moved_ids(frees, shift, low)
        return Collective(op.name + suffix, kind, group, size_bytes * fraction, allocs, frees, iteration), name, comm

    def runs(self, runs: list[Run]) -> None:
        """Append runs to the compute stream: collectives go to their stream, workspaces at first use."""
        for run in runs:
            if run.op.op_class == COLLECTIVE or run.op.placement == ON_COMM_STREAM:
                self.collective(run)
            elif run.op.op_class in OFFLOAD_CLASSES:
                lower_offload(self, run, self.host_caps)
            else:
                if run.op.phase == OPTIMIZER_STEP and (self.pending or self.deferred):
                    self.flush()
                if self.first_gemm and run.op.op_class == GEMM:
                    ids = self.first_gemm.pop(run.op.phase == FORWARD, None)
                    if ids:
                        self.compute.append(Alloc(ids, f"{run.op.name} (first use)"))
                self.compute.append(run)

    def program(self, device: DeviceSpec, stage: int, tensors, host_tensors: dict | None = None) -> Program:
        streams = {COMPUTE: tuple(self.compute)}
        for name in sorted(self.other):
            streams[name] = tuple(self.other[name])
        blocks = {COMPUTE if name is None else name: tuple(parts) for name, parts in self.blocks.items()}
        return Program(self.rank, device.name, stage, tensors, streams, tuple(self.copies), host_tensors or {},
                       blocks)


def _interleaving(timed: TimedOps, specials: tuple) -> tuple:
    """How `microbatch` makes a compiled copy of `timed` from three iterators: (a picker of the iterator each
    instruction comes from, in order: runs, unmoved Blockings, moved Blockings; the ops and durations of the runs)."""
    unmoved, moved = specials
    source = [0] * len(timed.ops)
    for index in (entry[0] for entry in unmoved):
        source[index] = 1
    for index in (entry[0] for entry in moved):
        source[index] = 2
    plain = [k for k, code in enumerate(source) if code == 0]
    pick = itemgetter(*source) if len(source) > 1 else (lambda makers: tuple(makers[code] for code in source))
    return pick, tuple(timed.ops[k] for k in plain), tuple(timed.durations[k] for k in plain), _moved_blockings(moved)


def _moved_blockings(moved: tuple):
    """A function of (shift, low, iteration) giving an iterator over the Blocking instructions of `_compile`'s moved
    collectives for that copy, made column by column (overlap_templates.instances); one-id tuples by `zip`."""
    if not moved:
        return lambda shift, low, iteration: iter(())
    fixed = [tuple(entry[k] for entry in moved) for k in (1, 2, 3, 4)]     # op name, kind, group, size
    streams = tuple(entry[5] for entry in moved)
    allocs, frees = tuple(entry[6] for entry in moved), tuple(entry[7] for entry in moved)

    def mover(tuples: tuple, modes: tuple):
        if all(mode == 0 for mode in modes):
            return lambda shift, low: tuples
        if all(mode == 1 for mode in modes):
            bases = tuple(ids[0] for ids in tuples)
            return lambda shift, low: zip(map(add, bases, repeat(shift)))
        return lambda shift, low: [(ids[0] + shift,) if mode == 1 else ids if mode == 0
                                   else tuple([v + shift if v >= low else v for v in ids])
                                   for ids, mode in zip(tuples, modes)]

    move_allocs, move_frees = mover(allocs, tuple(e[8] for e in moved)), mover(frees, tuple(e[9] for e in moved))
    count = len(moved)

    def make(shift: int, low: int, iteration: int):
        posts = overlap_templates.instances(Collective, count, *fixed, move_allocs(shift, low),
                                            move_frees(shift, low), repeat(iteration),
                                            zip(allocs, frees, repeat(shift), repeat(low)))
        return map(new_blocking, repeat(Blocking), zip(posts, streams))
    return make


def _moves(ids: tuple[int, ...], low: int) -> int:
    """How `moved_ids(ids, shift, low)` is made for any shift: 0 none moves (equal to `ids`), 1 `ids` is one
    id that moves, 2 id by id."""
    if not any(v >= low for v in ids):
        return 0
    return 1 if len(ids) == 1 else 2

