"""Per-rank programs: the instructions each stream of each rank executes, in order."""

from __future__ import annotations

from dataclasses import dataclass

from simulator.workload.graph import Op, Tensor


@dataclass(frozen=True, slots=True)
class Run:
    """Execute `op` on the stream: allocate its `allocs`, take `duration_s`, then free its `frees`."""

    op: Op
    duration_s: float
    iteration: int = 0


@dataclass(frozen=True, slots=True)
class Alloc:
    """Allocate tensors outside any op (parameters and optimizer states at set-up)."""

    tensors: tuple[int, ...]
    reason: str


@dataclass(frozen=True, slots=True)
class Free:
    """Free tensors outside any op (zero_grad(set_to_none=True), end of an iteration)."""

    tensors: tuple[int, ...]
    reason: str


@dataclass(frozen=True, slots=True)
class Signal:
    """Record an event other streams can wait for (cudaEventRecord)."""

    event: str


@dataclass(frozen=True, slots=True)
class WaitFor:
    """Block this stream until `event` was signalled (cudaStreamWaitEvent)."""

    event: str


@dataclass(frozen=True, slots=True)
class Mark:
    """A named point in time (iteration start/end) recorded into the trace."""

    label: str
    iteration: int


Instruction = Run | Alloc | Free | Signal | WaitFor | Mark


@dataclass(frozen=True)
class Program:
    """What one rank runs: its device, its tensors and one instruction list per stream."""

    rank: int
    device: str
    stage: int
    tensors: dict[int, Tensor]
    streams: dict[str, tuple[Instruction, ...]]
