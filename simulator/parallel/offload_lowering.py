"""Offload ops (graph.TRANSFER, graph.HOST) lowered to Transfer instructions on their streams, ordered by events.

An op placed on the compute stream (`Op.group` empty) is one Transfer there: the stream waits for it, as torch's
copies on the current stream are waited for (save_on_cpu's pack and unpack, DeepSpeed's parameter copy after the
step). Any other placement posts it on that stream ("dp": the data-parallel stream, after the reduction it follows,
as DeepSpeed's overlap_comm puts the gradient copies on its reduction stream): the compute stream signals where the
op stands in program order, the stream waits for that signal, runs the transfer and signals its end. The compute
stream waits for that end at the next synchronisation (lower_multi's flush: before the optimizer step, a Free or a
Mark), or earlier where a WAIT op for that stream stands (a copy the next op reads: an activation reloaded for its
backward, the host's optimizer step before the parameters come back; "wait:NAME" waits for transfer NAME only: a
parameter prefetched ahead of others). A HOST op is a "host" Transfer: DRAM traffic
from the CPU capped at the rank's share of the CPU's rate (HostState.caps).
"""

from __future__ import annotations

from typing import Protocol

from simulator.errors import PlanError
from simulator.parallel.program import Instruction, Run, Transfer, signal, wait_for
from simulator.workload.graph import HOST, OPTIMIZER_STEP, WAIT

COMPUTE = "compute"


class OffloadStreams(Protocol):
    """What lower_offload reads and writes of a rank's streams (rank_streams.RankStreams)."""

    compute: list[Instruction]
    dp_stream: str
    pending: list[str]
    offload_last: dict[str, str]
    offload_done: dict[str, str]

    def event(self, label: str) -> str: ...

    def stream(self, name: str) -> list[Instruction]: ...

    def flush(self) -> None: ...


def lower_offload(streams: OffloadStreams, run: Run, caps: dict[str, float]) -> None:
    """Append the instructions of one offload op's run to `streams` (module docstring); `caps`: host kernel ->
    bytes/s of this rank's share of the host CPU."""
    op = run.op
    placement = op.group or COMPUTE
    if placement == "dp":
        placement = streams.dp_stream
    if op.collective == WAIT:
        # "wait:NAME" waits for the last post of transfer NAME, any other WAIT for the stream's last transfer
        done = streams.offload_done.get(op.name[5:]) if op.name.startswith("wait:") else \
            streams.offload_last.get(placement)
        if done is not None:
            streams.compute.append(wait_for(done))
        return
    if op.op_class == HOST:
        cap = caps.get(op.collective)
        if cap is None:
            raise PlanError(f"host op {op.name!r}: kernel {op.collective!r} has no host rate (known: "
                            f"{', '.join(sorted(caps)) or 'none'})")
        transfer = Transfer(op.name, "host", float(op.bytes_read + op.bytes_written), cap, run.allocs(), run.frees(),
                            op.host_allocs, op.host_frees, run.iteration)
    else:
        transfer = Transfer(op.name, op.collective, float(op.comm_bytes), None, run.allocs(), run.frees(),
                            op.host_allocs, op.host_frees, run.iteration)
    if op.phase == OPTIMIZER_STEP and streams.pending:
        streams.flush()                 # the step starts once the gradients are where it reads them
    if placement == COMPUTE:
        streams.compute.append(transfer)
        return
    ready, done = streams.event(f"{op.name}.ready"), streams.event(f"{op.name}.done")
    streams.compute.append(signal(ready))
    streams.stream(placement).extend([wait_for(ready), transfer, signal(done)])
    streams.pending.append(done)
    streams.offload_last[placement] = done
    streams.offload_done[op.name] = done
