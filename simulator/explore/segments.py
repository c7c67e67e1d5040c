"""Runs of ops summarised as numbers (time, memory level change and excursion, blocking collectives) and
combined: in sequence, repeated, and a stage's layers extrapolated from a three-layer recording.

A `Segment` is exact for what it keeps: running two segments one after the other changes the allocated bytes
by the sum of their deltas, and the highest level above the start is the first's excursion or the first's
delta plus the second's excursion. A stage of L layers is its recording's ops before the layers, its first
layer, L - 2 copies of a middle layer and its last layer, then the ops after the layers: the layers of one
stage are the same modules, so a middle layer's ops cost, allocate and free the same (no test compares the
extrapolation with a stage recorded layer by layer; tests/test_estimate_agreement.py checks the estimates it
gives against simulations). Their time is the host-issue clock's over the
extrapolated op list (`Issue`, `issued`): what the GPU waits for the host that launches its kernels grows with the
layers, so it is not a recorded layer's (tests/test_estimate_agreement.py checks it against simulations).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

from simulator.workload.graph import (BACKWARD_INPUT, BACKWARD_WEIGHT, BLOCKING, COLLECTIVE, FORWARD, OPTIMIZER_STEP,
                                      OVERLAPPED, RECOMPUTE, Op, Tensor)

PHASE_KEYS = {FORWARD: "forward_s", BACKWARD_INPUT: "backward_s", BACKWARD_WEIGHT: "backward_s",
              RECOMPUTE: "recompute_s", OPTIMIZER_STEP: "optimizer_s"}
MODEL_PHASES = (FORWARD, BACKWARD_INPUT, BACKWARD_WEIGHT)


@dataclass(frozen=True)
class Segment:
    """A run of ops as numbers.

    Attributes:
        phase_s: seconds of compute per time-breakdown key (forward_s, backward_s, recompute_s, optimizer_s).
        delta_bytes: allocated bytes after the run minus before.
        excursion_bytes: the highest allocated level during the run minus the level before it (>= 0).
        collectives: blocking collectives the compute stream waits for, {(group, kind, bytes): count}.
        overlapped: data-parallel reductions posted and not waited for, in order: (kind, bytes, seconds of
            compute from the run's start to the post).
        model_flops: FLOPs of forward and backward ops (the MFU numerator; recompute and optimizer excluded).
    """

    phase_s: tuple[tuple[str, float], ...] = ()
    delta_bytes: int = 0
    excursion_bytes: int = 0
    collectives: tuple[tuple[tuple[str, str, int], int], ...] = ()
    overlapped: tuple[tuple[str, int, float], ...] = ()
    model_flops: float = 0.0

    @property
    def compute_s(self) -> float:
        """Seconds of compute (every phase)."""
        return sum(seconds for _, seconds in self.phase_s)

    def then(self, other: Segment) -> Segment:
        """This run followed by `other`."""
        offset = self.compute_s
        return Segment(_add_phases(self.phase_s, other.phase_s), self.delta_bytes + other.delta_bytes,
                       max(self.excursion_bytes, self.delta_bytes + other.excursion_bytes),
                       _add_counts(self.collectives, other.collectives),
                       self.overlapped + tuple((k, b, t + offset) for k, b, t in other.overlapped),
                       self.model_flops + other.model_flops)

    def repeated(self, times: int) -> Segment:
        """This run `times` times in a row (0: nothing)."""
        if times <= 0:
            return Segment()
        if times == 1:
            return self
        step = self.compute_s
        overlapped = tuple((k, b, t + step * i) for i in range(times) for k, b, t in self.overlapped)
        return Segment(tuple((key, s * times) for key, s in self.phase_s), self.delta_bytes * times,
                       self.excursion_bytes + max(0, (times - 1) * self.delta_bytes),
                       tuple((key, n * times) for key, n in self.collectives), overlapped, self.model_flops * times)

    def allocating(self, nbytes: int) -> Segment:
        """This run preceded by allocating `nbytes` (inputs, a received tensor)."""
        return Segment(delta_bytes=nbytes, excursion_bytes=max(0, nbytes)).then(self)

    def freeing(self, nbytes: int) -> Segment:
        """This run followed by freeing `nbytes`."""
        return self.then(Segment(delta_bytes=-nbytes))


def _add_phases(a: tuple[tuple[str, float], ...], b: tuple[tuple[str, float], ...]) -> tuple[tuple[str, float], ...]:
    if not a:
        return b
    if not b:
        return a
    total = dict(a)
    for key, seconds in b:
        total[key] = total.get(key, 0.0) + seconds
    return tuple(sorted(total.items()))


def _add_counts(a, b):
    if not a:
        return b
    if not b:
        return a
    total = Counter(dict(a))
    total.update(dict(b))
    return tuple(sorted(total.items()))


def chain(segments) -> Segment:
    """Segments one after the other."""
    result = Segment()
    for segment in segments:
        result = result.then(segment)
    return result


def summarize(ops: list[Op] | tuple[Op, ...], durations: list[float], tensors: dict[int, Tensor],
              waited_groups: tuple[str, ...] = ("tp", "dp"), beside: list | None = None) -> Segment:
    """The Segment of `ops` with their `durations` (timed_ops'): collectives of `waited_groups` are blocking,
    other collectives (overlapped data-parallel reductions) are listed in `overlapped`.

    A data-parallel all_gather (ZeRO-3 parameters) is waited for at once, as the lowering does; all_reduce and
    reduce_scatter of group dp are overlapped. `beside[i]`, when not None, is (share of the bytes run beside a
    GEMM, seconds of compute it runs beside) for a tensor-parallel collective paired with a GEMM
    (parallel/tp_overlap.py): it is listed as (group, kind, bytes, share, seconds), and waits only for what the
    compute beside it does not cover (assemble._collectives_s).
    """
    n = len(ops)
    if n == 0:
        return Segment()
    allocs = np.fromiter((sum(tensors[t].nbytes for t in op.allocs) for op in ops), dtype=np.int64, count=n)
    frees = np.fromiter((sum(tensors[t].nbytes for t in op.frees) for op in ops), dtype=np.int64, count=n)
    after = np.cumsum(allocs - frees)
    before = after - (allocs - frees)
    excursion = int(max(0, (before + allocs).max()))
    phases: dict[str, float] = {}
    collectives: Counter = Counter()
    overlapped = []
    elapsed = 0.0
    flops = 0.0
    for k, (op, duration_s) in enumerate(zip(ops, durations)):
        if op.op_class == COLLECTIVE:
            group = op.group if op.group in ("tp", "dp") else "tp"
            kind = op.collective or "all_reduce"
            paired = beside[k] if beside is not None else None
            if paired is not None:
                collectives[(group, kind, int(op.comm_bytes), paired[0], paired[1])] += 1
                continue
            if _is_overlapped(op):
                overlapped.append((kind, int(op.comm_bytes), elapsed))
            elif group in waited_groups:
                collectives[(group, kind, int(op.comm_bytes))] += 1
            continue
        key = PHASE_KEYS.get(op.phase, "forward_s")
        phases[key] = phases.get(key, 0.0) + duration_s
        elapsed += duration_s
        if op.phase in MODEL_PHASES:
            flops += op.flops
    return Segment(tuple(sorted(phases.items())), int(after[-1]), excursion, tuple(sorted(collectives.items())),
                   tuple(overlapped), flops)


def _is_overlapped(op: Op) -> bool:
    """A data-parallel reduction posted and not waited for, as the lowering decides (lower_multi._lower_collective):
    Op.placement first, else by kind."""
    group = op.group if op.group in ("tp", "dp") else "tp"
    kind = op.collective or "all_reduce"
    return group == "dp" and (op.placement == OVERLAPPED or (
        kind in ("all_reduce", "reduce_scatter") and op.placement != BLOCKING))


PHASE_ORDER = ("backward_s", "forward_s", "optimizer_s", "recompute_s")


@dataclass(frozen=True)
class Issue:
    """The host-issue clock's inputs for one run of ops (parallel/host_issue.py), so that a stage's actions can be
    timed as the lowering times them with any number of layers: the host falls behind the GPU (or gets ahead)
    over the whole list, not over the three recorded layers. Per op: its kernel seconds (0 for a collective or
    an offload copy, which do not wait here), its launch's host seconds, where a new lowering list starts (host
    and GPU back in step), its phase key (PHASE_ORDER) and, for a data-parallel reduction posted and not waited
    for, its (kind, bytes)."""

    kernel_s: np.ndarray
    host_s: np.ndarray
    gpu: np.ndarray
    restart: np.ndarray
    phase: np.ndarray
    posts: tuple[tuple[int, tuple[str, int]], ...]     # (index in this run, (kind, bytes))

    @staticmethod
    def of(ops, kernels: list[float], costs: list[tuple[float, float]], restarts: set[int],
           indices) -> "Issue":
        """The Issue of ops[i] for i in `indices` (`kernels`, `costs`: per op of the whole list; `restarts`: indices
        where a lowering list starts)."""
        from simulator.parallel.host_issue import on_gpu

        indices = list(indices)
        gpu = np.array([on_gpu(ops[i]) for i in indices], dtype=bool)
        kernel = np.array([kernels[i] for i in indices], dtype=float) * gpu
        host = np.array([costs[i][0] + costs[i][1] for i in indices], dtype=float)
        restart = np.array([i in restarts for i in indices], dtype=bool)
        phase = np.array([PHASE_ORDER.index(PHASE_KEYS.get(ops[i].phase, "forward_s")) for i in indices],
                         dtype=np.int64)
        posts = tuple((k, (ops[i].collective or "all_reduce", int(ops[i].comm_bytes))) for k, i in enumerate(indices)
                      if ops[i].op_class == COLLECTIVE and _is_overlapped(ops[i]))
        return Issue(kernel, host, gpu, restart, phase, posts)


def issued(runs: list[Issue], margin_s: float = 0.0, per_run: bool = False):
    """The runs one after the other on the host-issue clock, from a moment the GPU is `margin_s` ahead of the host
    (0: in step): (phase_s, overlapped reductions with their post times, the GPU's margin over the host at the
    end); `per_run`: each run's seconds instead. The closed form of host_issue.host_issued's recursion E_i = max(E_(i-1), H_i) + k_i, with the host
    clock H the running sum of host seconds: E_i = C_i + max(E_0, max over j <= i of H_j - C_(j-1)), C the
    running sum of kernel seconds."""
    kernel = np.concatenate([r.kernel_s for r in runs])
    host = np.concatenate([r.host_s for r in runs])
    gpu = np.concatenate([r.gpu for r in runs])
    restart = np.concatenate([r.restart for r in runs])
    phase = np.concatenate([r.phase for r in runs])
    durations = np.zeros(len(kernel))
    cuts = [0] + [int(i) for i in np.flatnonzero(restart) if i > 0] + [len(kernel)]
    margin = margin_s
    for a, b in zip(cuts, cuts[1:]):
        if a > 0:
            margin = 0.0                                  # a new list: host and GPU in step
        k, h = kernel[a:b], np.cumsum(host[a:b])
        c = np.cumsum(k)
        lead = np.maximum.accumulate(np.where(gpu[a:b], h - (c - k), -np.inf))
        ends = c + np.maximum(lead, margin)
        durations[a:b] = np.diff(ends, prepend=margin)
        margin = float(ends[-1] - h[-1]) if b > a else margin
    if per_run:
        bounds = np.cumsum([0] + [len(r.kernel_s) for r in runs])
        return [float(durations[a:b].sum()) for a, b in zip(bounds, bounds[1:])]
    sums = np.bincount(phase[gpu], weights=durations[gpu], minlength=len(PHASE_ORDER))
    present = np.bincount(phase[gpu], minlength=len(PHASE_ORDER))
    phase_s = tuple((key, float(sums[n])) for n, key in enumerate(PHASE_ORDER) if present[n])
    elapsed = np.cumsum(durations)
    overlapped, base = [], 0
    for r in runs:
        overlapped += [(kind, nbytes, float(elapsed[base + k])) for k, (kind, nbytes) in r.posts]
        base += len(r.kernel_s)
    return phase_s, tuple(overlapped), margin


@dataclass(frozen=True)
class Blocks:
    """One action's ops as the runs a stage's layers repeat: before the layers, each recorded layer, after.

    `layers` holds one Segment per recorded layer in list order (ascending layers in a forward, descending in a
    backward); `for_layers(L)` gives the action of a stage of L layers.
    """

    before: Segment
    layers: tuple[Segment, ...]
    after: Segment
    # Bytes the runs before and after the layers allocate minus free of the middle recorded layer's tensors (the
    # autocast cache of the layers' weights, released at the end of a forward): every middle layer has them.
    before_middle_bytes: int = 0
    after_middle_bytes: int = 0
    # The host-issue clock's inputs of before, each layer and after (None: the recorded times are kept, as where
    # tensor-parallel overlap scales a GEMM's issued time).
    issue: tuple[Issue, ...] | None = None

    def for_layers(self, count: int, margin_s: float = 0.0) -> Segment:
        """The action's Segment with `count` layers: exact when `count` is what was recorded, else (three
        recorded) the first layer, count - 2 middle ones and the last. With `issue`, its time is the host-issue
        clock's over those ops from a GPU `margin_s` ahead of the host (the lowering's list may have begun
        before this action: a whole-model micro-batch's forward and backward are one list)."""
        if count == len(self.layers):
            segment = self.before.then(chain(self.layers)).then(self.after)
        elif len(self.layers) == 3 and count > 3:
            first, mid, last = self.layers
            middle = first.then(mid.repeated(count - 2)).then(last)
            extra = count - 3
            segment = _with_more(self.before, extra * self.before_middle_bytes).then(middle).then(
                _with_more(self.after, extra * self.after_middle_bytes))
        else:
            raise ValueError(f"Blocks recorded with {len(self.layers)} layers cannot give {count}")
        if self.issue is None:
            return segment
        phase_s, overlapped, _ = issued(self.issue_runs(count), margin_s)
        return Segment(phase_s, segment.delta_bytes, segment.excursion_bytes, segment.collectives, overlapped,
                       segment.model_flops)

    def issue_runs(self, count: int) -> list[Issue]:
        """The Issue runs of the action with `count` layers, in order (None without `issue`)."""
        before, *layers, after = self.issue
        if count != len(layers):
            layers = [layers[0]] + [layers[1]] * (count - 2) + [layers[2]]
        return [before] + layers + [after]

    def run_seconds(self, count: int, margin_s: float = 0.0) -> list[float] | None:
        """Seconds of each run of the action with `count` layers (before, each layer, after) on the host-issue
        clock (None without `issue`)."""
        return None if self.issue is None else issued(self.issue_runs(count), margin_s, per_run=True)

    def end_margin_s(self, count: int, margin_s: float = 0.0) -> float:
        """How far the GPU is ahead of the host at the end of the action with `count` layers (0 without `issue`)."""
        return 0.0 if self.issue is None else issued(self.issue_runs(count), margin_s)[2]


def _with_more(segment: Segment, nbytes: int) -> Segment:
    """`segment` allocating `nbytes` more (freeing when negative): a free at its end, an allocation at its start."""
    if nbytes == 0:
        return segment
    excursion = segment.excursion_bytes + max(0, nbytes)
    return Segment(segment.phase_s, segment.delta_bytes + nbytes, excursion, segment.collectives,
                   segment.overlapped, segment.model_flops)


def run_layers(ops) -> list[int]:
    """The layer whose run each op belongs to. A ZeRO-3 gather is posted before the op that starts the module
    before the one it gathers for (it prefetches): it belongs with the op that follows it, so that every middle
    layer's run holds one gather, as the modules of a stage repeat."""
    layers = [-2 if op.op_class == COLLECTIVE and op.group == "dp" else op.layer for op in ops]
    following = -1
    for k in range(len(layers) - 1, -1, -1):
        if layers[k] == -2:
            layers[k] = following
        else:
            following = layers[k]
    return layers


def blocks_of(ops: list[Op] | tuple[Op, ...], durations: list[float], tensors: dict[int, Tensor],
              beside: list | None = None, issue: tuple | None = None) -> Blocks:
    """Cut an action's ops into the runs before the layers, per layer, and after (ops of no layer between two
    layers' ops go with the run they follow). `beside`: as for summarize. `issue`: (kernel seconds, host
    costs as host_issue.host_costs gives them, indices where a lowering list starts) per op, for Blocks.issue."""
    layers = run_layers(ops)
    layered = [i for i, layer in enumerate(layers) if layer >= 0]

    def issues(parts) -> tuple[Issue, ...] | None:
        return None if issue is None else tuple(Issue.of(ops, *issue, part) for part in parts)

    if not layered:
        return Blocks(summarize(ops, durations, tensors, beside=beside), (), Segment(),
                      issue=issues([range(len(ops)), range(0)]))
    first, last = layered[0], layered[-1]
    runs: list[list[int]] = []
    current = None
    for i in range(first, last + 1):
        layer = layers[i]
        if layer >= 0 and layer != current:
            runs.append([])
            current = layer
        runs[-1].append(i)

    def part(indices) -> Segment:
        return summarize([ops[i] for i in indices], [durations[i] for i in indices], tensors,
                         beside=None if beside is None else [beside[i] for i in indices])

    middle = sorted({layers[i] for i in layered})
    middle_layer = middle[1] if len(middle) == 3 else None

    def middle_bytes(indices) -> int:
        if middle_layer is None:
            return 0
        prefix = f"layers.{middle_layer}."
        total = 0
        for i in indices:
            total += sum(tensors[t].nbytes for t in ops[i].allocs if prefix in tensors[t].name)
            total -= sum(tensors[t].nbytes for t in ops[i].frees if prefix in tensors[t].name)
        return total

    before, after = range(first), range(last + 1, len(ops))
    return Blocks(part(before), tuple(part(run) for run in runs), part(after), middle_bytes(before),
                  middle_bytes(after), issues([before, *runs, after]))
