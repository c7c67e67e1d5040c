"""Multi-rank lowering: per representative rank, compute + communication streams from a pipeline schedule.

Conventions (what is modelled and how):
* Compute stream runs each schedule action's ops: F = the forward ops of that micro-batch and chunk,
  B = its backward ops. A stage chunk whose schedule splits backwards has them split into I (input
  gradients, with the send to the previous stage) and W (weight gradients) by
  workload/weight_split.py, which also places every free at the tensor's last use in that order; B of
  such a chunk runs I then W. The micro-batch's inputs are freed after I, or after W when W reads them
  (always after W under torch's retained graph: weight_split.RETAIN_GRAPH). A stage output the runtime
  keeps (MicrobatchStage.output: torch, DeepSpeed) is freed after B or I.
* Pipeline messages: after F the stage output is sent to the next stage, after B the input gradient
  to the previous one (SEND_STREAM, one stream per peer and kind so that sends to different peers do
  not queue behind each other); the input gradient, and a stage output the runtime does not keep for
  the backward (Megatron-LM), are freed by the send stream once the send has completed; a Recv
  (RECV_STREAM) is posted right before the action that needs it (as torch.distributed.pipelining does) and
  allocates the received tensor; the compute stream waits for it.
* Tensor-parallel collectives (group "tp") run on COMM_STREAM and the compute stream waits for them
  (Megatron's are blocking). Data-parallel reductions (group "dp", all_reduce / reduce_scatter) run
  on COMM_STREAM overlapped with backward; the compute stream waits for them before the optimizer
  step. Data-parallel all_gathers (ZeRO parameters) are waited for at once. A collective waited for at
  once, on a stream with no overlapped reduction outstanding, is one `Blocking` instruction of the
  compute stream (program.py); the others are Signal / WaitFor pairs around the comm stream's Collective.
* With pp > 1 the stage workload carries its data-parallel ops (workload/stage.py): bucket reductions
  during the backward of the stage's last micro-batch (per chunk), on their own stream (DP_STREAM:
  Megatron's DP and TP communicators run concurrently), overlapped with the rest of the backward;
  the optimizer step waits for all; ZeRO-1 all_gathers the updated parameters after the step;
  ZeRO-2/3 are refused. With tied embeddings, the first and last stage then all_reduce the word
  embedding's gradient (V/tp x h elements) over their "embedding group" (Megatron's
  finalize_model_grads), blocking, before the step.
* Persistent tensors (parameters, buffers) are allocated at set-up; optimizer states at the first step.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from itertools import repeat
from operator import add, itemgetter

from simulator.errors import PlanError
from simulator.hardware.catalog import DeviceSpec
from simulator.parallel.lower import COMPUTE, lower_single_rank, timed_ops
from simulator.parallel import overlap_templates
from simulator.parallel.offload_lowering import lower_offload
from simulator.parallel.overlap import NO_OVERLAP_CHANGE, OverlapOptions
from simulator.parallel.plan import ParallelPlan
from simulator.parallel.program import (COMM_STREAM, RECV_STREAM, SEND_STREAM, Alloc, Blocking, Collective, Free,
                                        Instruction, Mark, Period, Program, Run, Signal, WaitFor,
                                        alloc, checked_collective, free, recv, send, signal, wait_for)
from simulator.parallel.schedule_check import CommStep, program as schedule_program
from simulator.parallel.schedules import Action, Schedule
from simulator.parallel.tp_overlap import Overlap, plan_overlaps, split_gemm
from simulator.workload.graph import (BLOCKING, COLLECTIVE, FORWARD, GEMM, OFFLOAD_CLASSES, ON_COMM_STREAM,
                                      OPTIMIZER_STEP, OVERLAPPED, Op, Tensor, moved_ids)
from simulator.workload.loss_scaler import skipped_step
from simulator.workload.primitives import KernelProfile
from simulator.workload.stage import MicrobatchStage, StageSpec, StageWorkload, build_stage
from simulator.workload.stage_reuse import relabel_layers
from simulator.workload.training import IterationWorkload, Recipe
from simulator.workload.transformer import Shape
from simulator.workload.weight_split import RETAIN_GRAPH

new_run = new_blocking = tuple.__new__    # Run(...), Blocking(...) without the named tuples' Python-level __new__
DP_STREAM = f"{COMM_STREAM}.dp"      # data-parallel reductions of pipeline stages (module docstring)


@dataclass(frozen=True)
class _TimedOps:
    """A recorded micro-batch's forward or backward ops with their durations, shared by its copies.

    `segments`: (plain, special) pairs in order, `plain` a stretch of (op, duration) that only runs on the
    compute stream, `special` the op that follows it needing `_Streams.runs` (a collective or an
    optimizer-phase op), or None at the end. `ops` / `durations`: `pairs` as two columns, so that a
    micro-batch's runs are made in one pass.
    """

    pairs: tuple[tuple[Op, float], ...]
    segments: tuple[tuple[tuple[tuple[Op, float], ...], tuple[Op, float] | None], ...]
    ops: tuple[Op, ...] = ()
    durations: tuple[float, ...] = ()

    @classmethod
    def of(cls, runs: list[Run]) -> _TimedOps:
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
class _Streams:
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

    def microbatch(self, timed: _TimedOps, iteration: int, shift: int, low: int) -> None:
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

    def _templated(self, timed: _TimedOps, overlaps: tuple[Overlap, ...], iteration: int, shift: int,
                   low: int) -> bool:
        """`overlapped` for a moved copy from the template of its ops (parallel/overlap_templates.py), lowered once
        per (ops, iteration, low, reductions outstanding); False (nothing done) when they cannot have one."""
        key = (id(timed), iteration, low, bool(self.pending))
        found = self.templates.get(key)
        if found is None or found[0] is not timed:
            template = None
            if overlap_templates.templatable(timed.ops):
                scratch = _Streams(self.rank, self.plan, pending=list(self.pending), dp_stream=self.dp_stream,
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

    def _compile(self, timed: _TimedOps, low: int | None) -> tuple | None:
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

    def _general(self, timed: _TimedOps, iteration: int, shift: int, low: int) -> None:
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


def _interleaving(timed: _TimedOps, specials: tuple) -> tuple:
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


def lower_data_tensor_parallel(workload: IterationWorkload, device: DeviceSpec, plan: ParallelPlan, rank: int,
                               warmup_iterations: int, iterations: int, accumulation_steps: int,
                               overlap: OverlapOptions = NO_OVERLAP_CHANGE) -> Program:
    """pp = 1: the whole-model program of `rank` (lower_single_rank) with its collectives on COMM_STREAM."""
    single = lower_single_rank(workload, device, warmup_iterations, iterations, accumulation_steps, rank=rank)
    instructions = list(single.streams[COMPUTE])
    if workload.last_microbatch and accumulation_steps > 1:
        # The last micro-batch synchronizes gradients (DDP no_sync on the others): swap its ops in.
        last = timed_ops(workload.last_microbatch, workload.tensors, device, 0)
        later_ids = {id(op) for op in workload.later_microbatch}
        swapped: list[Instruction] = []
        microbatch = 0
        k = 0
        while k < len(instructions):
            ins = instructions[k]
            if isinstance(ins, Alloc) and ins.reason.startswith("micro-batch "):
                microbatch = int(ins.reason.split()[1])
            if isinstance(ins, Run) and microbatch == accumulation_steps - 1 and id(ins.op) in later_ids:
                while k < len(instructions) and isinstance(instructions[k], Run):
                    k += 1
                swapped += [_retag(run, ins.iteration) for run in last]
                continue
            swapped.append(ins)
            k += 1
        instructions = swapped
    streams = _Streams(rank, plan, overlap=overlap, device=device)
    gathers: list[Run] = []
    if overlap.overlap_param_gather:
        # As lower_stage_rank: each iteration posts the parameter all_gather at its start, waited for after the first
        # micro-batch's forward.
        gathers = list({id(i.op): i for i in instructions if isinstance(i, Run) and _is_param_gather(i.op)}.values())
        instructions = [i for i in instructions if not (isinstance(i, Run) and _is_param_gather(i.op))]
    if workload.host is not None:
        streams.host_caps = dict(workload.host.caps)
    pending_runs: list[Run] = []
    for instruction in instructions:
        if isinstance(instruction, Run):
            if streams.gathering and instruction.op.phase != FORWARD:
                streams.emit(pending_runs)
                pending_runs = []
                streams.compute += [wait_for(event) for event in streams.gathering]
                streams.gathering.clear()
            pending_runs.append(instruction)
            continue
        if pending_runs:
            streams.emit(pending_runs)
            pending_runs = []
        if gathers and isinstance(instruction, Mark) and instruction.label == "iteration_start":
            streams.compute.append(instruction)
            streams.gathering += [streams.beside(_retag(run, instruction.iteration), 1.0, True) for run in gathers]
            continue
        if isinstance(instruction, (Mark, Free)) and (streams.pending or streams.deferred):
            streams.flush()
        streams.compute.append(instruction)
    if pending_runs:
        streams.emit(pending_runs)
    return streams.program(device, 0, workload.tensors, single.host_tensors)


def stage_specs(plan: ParallelPlan) -> dict[tuple[int, int], StageSpec]:
    """(stage, chunk) -> the layers it holds, from the plan's partition."""
    if not plan.stages:
        raise PlanError("parallel plan has no stage partition (make_plan builds it)")
    last = max(span.index for span in plan.stages)
    return {(span.stage, span.chunk): StageSpec(span.start, span.stop, span.index == 0, span.index == last)
            for span in plan.stages}


def stage_backward_order(schedule: Schedule, stage: int, chunk: int) -> tuple[int, int, bool]:
    """(first backward, last backward, split into I and W) of a (stage, chunk): build_stage's arguments.

    .grad is created by the backward that starts first; gradients are reduced after the one that ends last.
    """
    actions = [a for a in schedule.ranks[stage] if a.chunk == chunk]
    backwards = [a.microbatch for a in actions if a.kind in ("B", "I")]
    ends = [a.microbatch for a in actions if a.kind in ("B", "W")]
    return (backwards[0] if backwards else 0, ends[-1] if ends else schedule.microbatches - 1,
            any(a.kind == "I" for a in actions))


def build_stage_workloads(shape: Shape, recipe: Recipe, profile: KernelProfile, plan: ParallelPlan,
                          schedule: Schedule) -> dict[tuple[int, int], StageWorkload]:
    """Every (stage, chunk) workload in model order; a stage's input has the previous one's output shape."""
    specs = stage_specs(plan)
    spans = sorted(plan.stages, key=lambda span: span.index)
    result: dict[tuple[int, int], StageWorkload] = {}
    middles: dict[tuple, StageWorkload] = {}
    previous: tuple[tuple[int, ...], str] | None = None
    for span in spans:
        first_backward, last_backward, split = stage_backward_order(schedule, span.stage, span.chunk)
        spec = specs[(span.stage, span.chunk)]
        # A middle stage like one built already (as many layers, the same input and backward order) is that
        # one with its layer numbers moved (workload/stage_reuse.py): no second recording.
        key = (spec.stop - spec.start, previous, first_backward, last_backward, split)
        like = None if spec.first or spec.last else middles.get(key)
        if like is not None:
            workload = relabel_layers(like, spec.start)
        else:
            workload = build_stage(shape, recipe, profile, spec, schedule.microbatches, first_backward, previous,
                                   sync_microbatch=last_backward, split_weight=split)
            if not (spec.first or spec.last):
                middles[key] = workload
        result[(span.stage, span.chunk)] = workload
        previous = (workload.output_shape, workload.output_dtype)
    return result


def lower_stage_rank(plan: ParallelPlan, schedule: Schedule, stage: int,
                     workloads: dict[tuple[int, int], StageWorkload], device: DeviceSpec,
                     warmup_iterations: int, iterations: int, dp: int = 0, tp: int = 0,
                     schedule_steps: tuple[tuple[Action | CommStep, ...], ...] | None = None,
                     timing_cache: dict[tuple, float] | None = None,
                     overlap: OverlapOptions = NO_OVERLAP_CHANGE, templates: bool = True) -> Program:
    """The program of rank (dp, stage, tp); by default the stage's representative (dp = tp = 0).

    `schedule_steps`: `schedule_check.program(schedule)` (every stage's) when the caller lowers several
    ranks; computed here otherwise. `timing_cache`: timed_ops' cache, shared by the caller's ranks.
    """
    rank = plan.rank_of(dp=dp, pp=stage, tp=tp)
    chunks = sorted(chunk for (s, chunk) in workloads if s == stage)
    tensors: dict[int, object] = {}
    # Tensor ids of the chunks of one rank are made disjoint by an offset per chunk.
    offset = 0
    mine: dict[int, StageWorkload] = {}
    for chunk in chunks:
        if mine:
            offset = max(tensors) + 1
        workload = workloads[(stage, chunk)]
        if offset:
            workload = _shift(workload, offset)
        mine[chunk] = workload
        # One chunk's tensors are the program's as they are (read only; a copy costs ~10^5 inserts per rank).
        tensors = {**tensors, **workload.tensors} if tensors else workload.tensors
    cache = timing_cache if timing_cache is not None else {}
    timed = {chunk: _timed_microbatches(w, device, cache) for chunk, w in mine.items()}
    steps = {chunk: timed_ops(w.optimizer, w.tensors, device, 0) for chunk, w in mine.items()}
    gathers: dict[int, list[Run]] = {chunk: [] for chunk in chunks}
    if overlap.overlap_param_gather:
        # The distributed optimizer's all_gather of updated parameters runs during the next forward: in every
        # iteration it is posted at the start, beside the first forward action (the previous step's, in steady state).
        for chunk in chunks:
            gathers[chunk] = [run for run in steps[chunk] if _is_param_gather(run.op)]
            steps[chunk] = [run for run in steps[chunk] if not _is_param_gather(run.op)]
    streams = _Streams(rank, plan, dp_stream=DP_STREAM, overlap=overlap, device=device)
    if not templates:
        streams.templates_on = False
    streams.compute.append(Alloc(tuple(t for w in mine.values() for t in w.persistent), "model set-up"))
    # One set of cuBLAS workspaces per rank (its first chunk's), allocated at the first forward and the first
    # backward GEMM the rank runs, whichever chunk that belongs to.
    first = mine[min(mine)]
    forward_names = {o.name for o in first.microbatches[0].forward}
    # The forward handle's group comes first (training.workspace_first_use); a backward group whose first GEMM is a
    # recomputed forward one has a forward op's name, so it is keyed by its order, not by its name.
    for name, ids in first.first_use:
        forward = name in forward_names and True not in streams.first_gemm
        streams.first_gemm[forward] = streams.first_gemm.get(forward, ()) + tuple(ids)
    lowered = (schedule_steps if schedule_steps is not None else schedule_program(schedule))[stage]
    streams.consumer_position = _positions(schedule)
    total = warmup_iterations + iterations
    for it in range(total):
        if it == warmup_iterations:
            streams.compute.append(Mark("measure", it))
        streams.compute.append(Mark("iteration_start", it))
        for chunk in chunks:
            streams.gathering += [streams.beside(_retag(run, it), 1.0, True) for run in gathers[chunk]]
        for step in lowered:
            if isinstance(step, CommStep):
                _comm(streams, step, plan, mine, schedule, it)
                continue
            _action(streams, step, mine, timed, it)
            if streams.gathering and step.kind == "F":
                streams.compute += [wait_for(event) for event in streams.gathering]
                streams.gathering.clear()
        streams.post_sends()
        streams.sends_done()
        streams.flush()
        _tied_embedding_all_reduce(streams, mine, plan, it)
        for chunk in chunks:
            workload = mine[chunk]
            if it == 0:
                streams.compute.append(Alloc(workload.optimizer_state_ids, "optimizer state (first step)"))
            streams.runs([_retag(run, it) for run in steps[chunk]])
            streams.compute.append(Free(workload.gradients, "zero_grad(set_to_none=True)"))
        streams.compute.append(Mark("iteration_end", it))
    return streams.program(device, stage, tensors)


def _timed_microbatches(workload: StageWorkload, device: DeviceSpec,
                        cache: dict[tuple, float]) -> list[tuple[_TimedOps, _TimedOps, _TimedOps]]:
    """(forward, backward, weight) timed ops per micro-batch; a copy (`shift` != 0) shares its template's, whose
    durations are its own (same ops and sizes; the L2 reuse only looks at adjacent ops of one micro-batch)."""
    by_ops: dict[int, _TimedOps] = {}      # id(op tuple) -> its timing (copies share their template's tuple)

    def timed(ops: tuple[Op, ...]) -> _TimedOps:
        found = by_ops.get(id(ops))
        if found is None:
            found = by_ops[id(ops)] = _TimedOps.of(timed_ops(list(ops), workload.tensors, device, 0, cache))
        return found

    return [(timed(mb.forward), timed(mb.backward), timed(mb.weight)) for mb in workload.microbatches]


def _action(streams: _Streams, action: Action, mine: dict[int, StageWorkload], timed, it: int) -> None:
    if streams.unsent:
        streams.sends_done()
    workload = mine[action.chunk]
    mb = workload.microbatches[action.microbatch]
    forward, backward, weight = timed[action.chunk][action.microbatch]
    if action.kind == "F":
        if mb.shift:
            # A copy's forward: where a repeated period of memory calls may start (engine/repeats.py).
            region = streams.regions.get(action.chunk)
            if region is None:
                region = streams.regions[action.chunk] = _copy_region(workload)
            streams.compute.append(Period(f"F{action.chunk}", mb.shift, *region))
        if mb.inputs:
            streams.compute.append(alloc(mb.inputs, f"micro-batch {action.microbatch} inputs"))
        streams.microbatch(forward, it, mb.shift, mb.low)
        return
    if action.kind in ("B", "I"):
        streams.microbatch(backward, it, mb.shift, mb.low)
    if action.kind in ("B", "W"):
        streams.microbatch(weight, it, mb.shift, mb.low)      # nothing unless the chunk's backwards are split
    done = mb.inputs + ((mb.stage_input,) if mb.stage_input is not None else ())
    if action.kind == "I":
        # What W still reads (everything, where I keeps the autograd graph) is freed after W, the rest now.
        late = set(done) if workload.meta.get("weight_split") == RETAIN_GRAPH else _weight_touched(mb)
        streams.held[(action.chunk, action.microbatch)] = tuple(t for t in done if t in late)
        done = tuple(t for t in done if t not in late)
    elif action.kind == "W":
        done = streams.held.pop((action.chunk, action.microbatch))
    if mb.output is not None and action.kind != "W":
        done = (mb.output,) + done            # the stage output the runtime kept for this backward
    if done:
        streams.compute.append(free(done, f"micro-batch {action.microbatch} done"))


def _is_param_gather(op: Op) -> bool:
    """The distributed optimizer's data-parallel all_gather of updated parameters (in the optimizer's ops)."""
    return op.op_class == COLLECTIVE and op.group == "dp" and op.collective == "all_gather"


def _weight_touched(mb: MicrobatchStage) -> set[int]:
    """The tensor ids (this micro-batch's) that its W ops read, write or free."""
    ids = tuple({t for op in mb.weight for t in op.inputs + op.outputs + op.allocs + op.frees})
    return set(moved_ids(ids, mb.shift, mb.low) if mb.shift else ids)


def _copy_region(workload: StageWorkload) -> tuple[int, int]:
    """[low, high): the tensor ids of the template micro-batch and its copies (workload/stage.py lays them out
    as consecutive blocks of one span; shared and later ids lie outside)."""
    first = next(mb for mb in workload.microbatches if mb.shift)
    template = first.copy_of                     # copy j's block starts (j - template) spans after the template's
    span = first.shift // (first.index - template)
    return first.low, first.low + span * (len(workload.microbatches) - template)


_SEND_STREAMS = {kind: f"{SEND_STREAM}.{kind}" for kind in ("activation", "gradient")}


def _comm(streams: _Streams, step: CommStep, plan: ParallelPlan, mine: dict[int, StageWorkload],
          schedule: Schedule, it: int) -> None:
    transfer = step.transfer
    peer = streams.peers.get(step.peer)
    if peer is None:
        coords = plan.coords(streams.rank)
        peer = streams.peers[step.peer] = plan.rank_of(dp=coords.dp, pp=step.peer, tp=coords.tp)
    producer = transfer.producer
    kind = transfer.kind
    tag = f"{kind}:{producer.stage}:{producer.microbatch}:{it}"     # the message's tag (both ends)
    # Both ends carry the same name, which is how the Chrome trace pairs them into a flow arrow.
    name = f"{kind} from stage {producer.stage} microbatch {producer.microbatch}"
    compute = streams.compute
    count = streams.count
    if step.op == "send":
        mb = mine[producer.chunk if producer.chunk is not None else _chunk_of(streams, schedule, producer.stage)] \
            .microbatches[producer.microbatch]
        if kind == "activation":
            size, sent = mb.output_bytes, mb.sent_output
        else:
            size, sent = mb.input_grad_bytes, mb.input_grad
        ready = f"send.{tag}#{count + 1}"                                # streams.event(...)
        compute.append(signal(ready))
        stream: list[Instruction] = [wait_for(ready), send(name, peer, float(size), tag, it)]
        stream_name = _SEND_STREAMS.get(kind) or f"{SEND_STREAM}.{kind}"
        streams.stream(stream_name)                        # created in program order, filled by post_sends
        sends = streams.sends.get(stream_name)
        if sends is None:
            sends = streams.sends[stream_name] = []
        consumer = transfer.consumer
        sends.append((streams.consumer_position[(consumer.stage, consumer.kind, consumer.microbatch)], len(sends),
                      stream))
        if sent is not None:
            # The runtime holds the tensor until its send has completed (the request keeps it alive).
            stream.append(free((sent,), f"{kind} sent"))
        if streams.overlap.overlap_p2p_comm:
            streams.count = count + 1
            return
        # A blocking send: the stage's next action waits for it (after the recvs posted for that action, as
        # Megatron's batched send_forward_recv_backward waits for both).
        done = f"sent.{tag}#{count + 2}"
        streams.count = count + 2
        stream.append(signal(done))
        streams.unsent.append(done)
        return
    consumer = transfer.consumer
    chunk = consumer.chunk if consumer.chunk is not None else _chunk_of(streams, schedule, consumer.stage)
    workload = mine[chunk]
    mb = workload.microbatches[consumer.microbatch]
    received = mb.stage_input if kind == "activation" else mb.grad_output
    post, done = f"post.{tag}#{count + 1}", f"recv.{tag}#{count + 2}"
    streams.count = count + 2
    compute.append(signal(post))
    streams.stream(RECV_STREAM).extend([wait_for(post), recv(name, peer, float(workload.tensors[received].nbytes),
                                                             tag, (received,), it), signal(done)])
    compute.append(wait_for(done))


_LAST_POSITIONS: list = [None, None]     # (schedule, its positions): the ranks of one run share them


def _positions(schedule: Schedule) -> dict[tuple, int]:
    """Action key -> its position on its rank's list (computed once for the ranks of one lowering)."""
    if _LAST_POSITIONS[0] is not schedule:
        _LAST_POSITIONS[:] = [schedule, {a.key: i for actions in schedule.ranks for i, a in enumerate(actions)}]
    return _LAST_POSITIONS[1]


def _chunk_of(streams: _Streams, schedule: Schedule, stage: int) -> int:
    """schedule.chunk_of(stage), once per stage."""
    chunk = streams.chunks.get(stage)
    if chunk is None:
        chunk = streams.chunks[stage] = schedule.chunk_of(stage)
    return chunk


def _tied_embedding_all_reduce(streams: _Streams, mine: dict[int, StageWorkload], plan: ParallelPlan,
                               it: int) -> None:
    """First and last stage: all_reduce the tied word embedding's gradient over the embedding group."""
    size = max((int(w.meta.get("tied_embedding_grad_bytes", 0)) for w in mine.values()), default=0)
    if size == 0 or plan.pp == 1:
        return
    coords = plan.coords(streams.rank)
    group = (plan.rank_of(dp=coords.dp, pp=0, tp=coords.tp),
             plan.rank_of(dp=coords.dp, pp=plan.pp - 1, tp=coords.tp))
    ready, done = streams.event("embedding.grad.ready"), streams.event("embedding.grad.done")
    streams.compute.append(Signal(ready))
    reduce = Collective("pp.tied_embedding_grad_all_reduce", "all_reduce", group, float(size), (), (), it)
    streams.stream(COMM_STREAM).extend([WaitFor(ready), reduce, Signal(done)])
    streams.compute.append(WaitFor(done))


def _retag(run: Run, iteration: int) -> Run:
    return run if iteration == 0 else Run(run.op, run.duration_s, iteration, run.shift, run.low)


def _shift(workload: StageWorkload, offset: int) -> StageWorkload:
    """The workload with every tensor id moved by `offset` (for a second chunk on the same rank).

    Op tuples shared by micro-batch copies are moved once and stay shared; a copy's `low` moves with
    its template's ids (its `shift` is unchanged).
    """
    def ids(values):
        return tuple(v + offset for v in values)

    def op(o):
        return replace(o, inputs=ids(o.inputs), outputs=ids(o.outputs), allocs=ids(o.allocs), frees=ids(o.frees))

    moved: dict[int, tuple[Op, ...]] = {}      # id(op tuple) -> the moved tuple

    def ops(values: tuple[Op, ...]) -> tuple[Op, ...]:
        found = moved.get(id(values))
        if found is None:
            found = moved[id(values)] = tuple(op(o) for o in values)
        return found

    # A copy's id maps to its template's Tensor (StageWorkload.tensors; nothing reads `.id` of a copy's entry): each
    # Tensor object is moved once, and the ids that shared it share the moved one (a Tensor per id cost ~1.5 us, 10^6
    # ids at GPT-3 530B).
    values = workload.tensors.values()
    moved_tensors = {key: Tensor(t.id + offset, t.name, t.nbytes, t.category, t.dtype, t.shape, t.persistent)
                     for key, t in dict(zip(map(id, values), values)).items()}
    tensors = dict(zip(map(add, workload.tensors, repeat(offset)), map(moved_tensors.__getitem__, map(id, values))))
    microbatches = tuple(replace(mb, forward=ops(mb.forward), backward=ops(mb.backward), weight=ops(mb.weight),
                                 inputs=ids(mb.inputs),
                                 stage_input=None if mb.stage_input is None else mb.stage_input + offset,
                                 grad_output=None if mb.grad_output is None else mb.grad_output + offset,
                                 output=None if mb.output is None else mb.output + offset,
                                 sent_output=None if mb.sent_output is None else mb.sent_output + offset,
                                 input_grad=None if mb.input_grad is None else mb.input_grad + offset,
                                 low=mb.low + offset if mb.shift else 0)
                         for mb in workload.microbatches)
    return replace(workload, tensors=tensors, persistent=ids(workload.persistent),
                   optimizer_state_ids=ids(workload.optimizer_state_ids), microbatches=microbatches,
                   optimizer=[op(o) for o in workload.optimizer], gradients=ids(workload.gradients),
                   first_use=tuple((name, ids(group)) for name, group in workload.first_use))


def lower_multi(shape: Shape, recipe: Recipe, profile: KernelProfile, plan: ParallelPlan, schedule: Schedule,
                device: DeviceSpec, warmup_iterations: int, iterations: int,
                workload: IterationWorkload | None = None, full: bool = False,
                overlap: OverlapOptions = NO_OVERLAP_CHANGE,
                skipped_steps: bool = False, templates: bool = True) -> tuple[list[Program], dict]:
    """One Program per representative rank of `plan` (one per pipeline stage), or per rank with `full`.

    Args:
        shape, recipe, profile: the model, training options (tp, dp, zero) and kernel profile.
        plan: the parallel plan (with its stage partition).
        schedule: the pipeline schedule (pp ranks, recipe.accumulation_steps micro-batches).
        device: the GPU of every rank.
        warmup_iterations, iterations: as for lower_single_rank.
        workload: with pp = 1, the whole-model iteration (training.build_iteration) to lower.
        full: lower every rank of the plan (no symmetry reduction); programs come in rank order, rank 0
            (stage 0's representative) first.
        overlap: which communication overlaps compute (parallel/overlap.py resolve_overlap).
        skipped_steps: pp > 1: every stage's optimizer step is skipped (an fp16 overflow: only the loss scaler's
            kernels run); with pp = 1 the caller passes such a `workload`.
        templates: make overlapped micro-batch copies from their template (parallel/overlap_templates.py; the
            programs are the same either way; False: each lowered op by op).

    Returns:
        (programs, workloads): programs ordered by stage (by rank with `full`); workloads by stage (IterationWorkload for pp = 1,
        else a dict (stage, chunk) -> StageWorkload).

    Raises:
        PlanError: ZeRO-2/3 with pp > 1, or pp = 1 without `workload`.
    """
    if plan.pp == 1:
        if workload is None:
            raise PlanError("lower_multi: pp = 1 needs the whole-model workload")
        ranks = range(plan.world_size) if full else (0,)
        programs = [lower_data_tensor_parallel(workload, device, plan, rank, warmup_iterations, iterations,
                                               recipe.accumulation_steps, overlap) for rank in ranks]
        return programs, {0: workload}
    if recipe.dp > 1 and recipe.zero_stage > 1:
        raise PlanError(f"parallel.zero_stage = {recipe.zero_stage}: ZeRO-2/3 with parallel.pp = {plan.pp} > 1 is not "
                        f"supported (DeepSpeed's PipelineEngine refuses it too; allowed with pp > 1: 0, 1)")
    workloads = build_stage_workloads(shape, recipe, profile, plan, schedule)
    if skipped_steps:
        workloads = {key: replace(w, optimizer=skipped_step(w.optimizer)) for key, w in workloads.items()}
    schedule_steps = schedule_program(schedule)
    cache: dict[tuple, float] = {}
    if not full:
        programs = [lower_stage_rank(plan, schedule, stage, workloads, device, warmup_iterations, iterations,
                                     schedule_steps=schedule_steps, timing_cache=cache, overlap=overlap,
                                     templates=templates)
                    for stage in range(plan.pp)]
        return programs, workloads
    programs = []
    for rank in range(plan.world_size):
        c = plan.coords(rank)
        programs.append(lower_stage_rank(plan, schedule, c.pp, workloads, device, warmup_iterations, iterations,
                                         dp=c.dp, tp=c.tp, schedule_steps=schedule_steps, timing_cache=cache,
                                         overlap=overlap, templates=templates))
    return programs, workloads
