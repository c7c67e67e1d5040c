"""Lowering: turn a rank's iteration workload into a timed instruction list per stream."""

from __future__ import annotations

from simulator.hardware.catalog import DeviceSpec
from simulator.hardware.cost import op_time_s
from simulator.parallel.host_issue import host_issued
from simulator.parallel.program import Alloc, Free, HostAlloc, Instruction, Mark, Program, Run
from simulator.workload.graph import COLLECTIVE, OFFLOAD_CLASSES, Op, Tensor
from simulator.workload.training import IterationWorkload

COMPUTE = "compute"
OP_TIMES_KEPT = 1 << 16   # op signatures this process keeps timed (all devices); past it, forgotten and recomputed

_op_times: dict[DeviceSpec, dict[tuple, float]] = {}


def op_times() -> dict[DeviceSpec, dict[tuple, float]]:
    """This process's op times (device -> timed_ops' cache), shared by every lowering of one rank and by whoever is
    handed it (explore/fit.py's estimates, whose times its forked simulations inherit). An op's time is a pure
    function of its signature and the device (hardware/cost.py), so a time kept is the time recomputed."""
    # list(): a copy taken at once, as lowerings in other threads (an executor's) may add a device meanwhile
    if len(_op_times) + sum(len(times) for times in list(_op_times.values())) > OP_TIMES_KEPT:
        _op_times.clear()          # in place: whoever holds the mapping goes on with it
    return _op_times


def timed_ops(ops: list[Op], tensors: dict[int, Tensor], device: DeviceSpec,
              iteration: int, cache: dict[tuple, float] | None = None) -> list[Run]:
    """Cost each op on `device`; an input the previous op just wrote is read from L2 if it fits.

    Collective ops (tensor-parallel all_reduce / all_gather / reduce_scatter) take 0 s here: this
    single-rank lowering has no topology or group. The network model
    (simulator/network/collectives.py: `collective_time_s` over the group's GPUs on the cluster's
    topology) prices them when multi-rank lowering lands; until then `memsim run` refuses tp > 1.

    `cache` (one per device), when given, keeps each distinct op signature's time: the many identical
    ops of a pipeline stage's micro-batches (and of stages alike) are costed once.

    The list starts with the host in step with the GPU; each run also lasts what the GPU waits for the host
    thread to launch it (parallel/host_issue.py).
    """
    runs: list[Run] = []
    previous_outputs: dict[int, int] = {}
    produced = 0                      # their bytes
    l2 = device.l2_bytes
    untimed = (COLLECTIVE, *OFFLOAD_CLASSES)
    for op in ops:
        hits = 0
        if previous_outputs and produced <= l2:
            get = previous_outputs.get
            for tid in op.inputs:
                hits += get(tid, 0)
            if hits > op.bytes_read:
                hits = op.bytes_read
        if op.op_class in untimed:
            duration_s = 0.0          # timed by the network model (collectives, offload traffic and host work)
        elif cache is None:
            duration_s = op_time_s(op, device, hits)
        else:
            # what op_time_s reads of an op (all but its name, which only its errors show, tensor ids, layer and
            # micro-batch) and its L2 hits: the ops of equal layers and pipeline stages share their times
            key = (op.op_class, op.phase, op.flops, op.bytes_read, op.bytes_written, op.dtype, op.gemm_mnk,
                   op.gemm_batch, hits)
            duration_s = cache.get(key)
            if duration_s is None:
                duration_s = cache[key] = op_time_s(op, device, hits)
        runs.append(Run(op, duration_s, iteration))
        outputs = op.outputs
        if len(outputs) == 1:         # most ops: one output
            tid = outputs[0]
            tensor = tensors.get(tid)
            previous_outputs = {tid: tensor.nbytes} if tensor is not None else {}
            produced = tensor.nbytes if tensor is not None else 0
        else:
            previous_outputs = {tid: tensors[tid].nbytes for tid in outputs if tid in tensors}
            produced = sum(previous_outputs.values())
    return host_issued(runs, device)


def lower_single_rank(workload: IterationWorkload, device: DeviceSpec, warmup_iterations: int,
                      iterations: int, accumulation_steps: int, rank: int = 0, stage: int = 0) -> Program:
    """One rank, one compute stream: set-up, warm-up iterations, then the measured iterations.

    Optimizer states are created at the first optimizer step (as torch.optim does lazily), so the
    measured iterations start in the steady state of a real run.
    """
    tensors = workload.tensors
    program: list[Instruction] = [Alloc(workload.persistent, "model set-up")]
    host = workload.host
    if host is not None and host.persistent:
        program.append(HostAlloc(host.persistent, "offload set-up"))
    cache = op_times().setdefault(device, {})
    first = timed_ops(workload.first_microbatch, tensors, device, 0, cache)
    later = timed_ops(workload.later_microbatch, tensors, device, 0, cache) if accumulation_steps > 1 else []
    step = timed_ops(workload.optimizer, tensors, device, 0, cache)
    total = warmup_iterations + iterations
    for it in range(total):
        if it == warmup_iterations:
            program.append(Mark("measure", it))
        program.append(Mark("iteration_start", it))
        for microbatch in range(accumulation_steps):
            program.append(Alloc(workload.microbatch_inputs, f"micro-batch {microbatch} inputs"))
            runs = first if microbatch == 0 else later
            if it == 0 and microbatch == 0 and workload.first_use:
                program.extend(_with_first_use(runs, first_use_by_name(workload.first_use)))
            else:
                program.extend(_retag(runs, it))
            program.append(Free(workload.microbatch_inputs, f"micro-batch {microbatch} done"))
        if it == 0:
            program.append(Alloc(workload.optimizer_state_ids, "optimizer state (first step)"))
            if host is not None and host.first_step:
                program.append(HostAlloc(host.first_step, "host optimizer state (first step)"))
        program.extend(_retag(step, it))
        program.append(Free(workload.gradients, "zero_grad(set_to_none=True)"))
        program.append(Mark("iteration_end", it))
    return Program(rank, device.name, stage, tensors, {COMPUTE: tuple(program)},
                   host_tensors=host.tensors if host is not None else {})


def first_use_by_name(first_use: tuple[tuple[str, tuple[int, ...]], ...]) -> dict[str, tuple[int, ...]]:
    """Lazily allocated tensor groups by the op name they wait for. Two groups can wait for ops of one name (a
    stage of one fully recomputed layer: its first forward GEMM and the first GEMM of its backward, the
    recomputed one, share a name): both are then allocated at the first op of that name, none dropped."""
    merged: dict[str, tuple[int, ...]] = {}
    for name, ids in first_use:
        merged[name] = merged.get(name, ()) + tuple(ids)
    return merged


def _with_first_use(runs: list[Run], first_use: dict[str, tuple[int, ...]]) -> list[Instruction]:
    """The runs with each lazily allocated tensor group allocated right before the first op of its name."""
    out: list[Instruction] = []
    for run in runs:
        ids = first_use.pop(run.op.name, None)
        if ids:
            out.append(Alloc(ids, f"{run.op.name} (first use)"))
        out.append(run)
    return out


def _retag(runs: list[Run], iteration: int) -> list[Run]:
    if iteration == 0:
        return runs
    return [Run(r.op, r.duration_s, iteration) for r in runs]
