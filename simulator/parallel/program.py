"""Per-rank programs: the instructions each stream of each rank executes, in order."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

from simulator.errors import PlanError
from simulator.workload.graph import Op, Tensor, moved_ids, slot_constructor

COLLECTIVE_KINDS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast")
TRANSFER_ROUTES = ("d2h", "h2d", "nvme_read", "nvme_write", "host")
COMM_STREAM = "comm"          # collectives (DDP buckets, ZeRO, TP when overlapped)
SEND_STREAM = "pp_send"       # pipeline sends
RECV_STREAM = "pp_recv"       # pipeline receives


class Run(NamedTuple):
    """Execute `op` on the stream: allocate its `allocs`, take `duration_s`, then free its `frees`.

    A micro-batch copy shares its template's Op: tensor ids of `op.allocs` / `op.frees` at or above `low`
    are moved by `shift` (ids below `low` are shared tensors: parameters, gradients). `shift = 0`: as is.
    A named tuple, not a frozen dataclass like the other instructions: a cluster-scale lowering makes
    millions, and a frozen dataclass's constructor costs several times as much.
    """

    op: Op
    duration_s: float
    iteration: int = 0
    shift: int = 0
    low: int = 0

    def allocs(self) -> tuple[int, ...]:
        """The tensor ids this run allocates."""
        return moved_ids(self.op.allocs, self.shift, self.low) if self.shift else self.op.allocs

    def frees(self) -> tuple[int, ...]:
        """The tensor ids this run frees."""
        return moved_ids(self.op.frees, self.shift, self.low) if self.shift else self.op.frees




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


@dataclass(frozen=True, slots=True)
class Period:
    """Where a repeated period of memory calls may start (engine/repeats.py): the start of a micro-batch
    copy's forward. Tensor ids in [low, high) belong to micro-batch copies; this one's are moved by `shift`
    from its template's. `key` names the place in the schedule (only equal keys are compared)."""

    key: str
    shift: int
    low: int
    high: int


def _check_size(what: str, name: str, size_bytes: object) -> None:
    if isinstance(size_bytes, bool) or not isinstance(size_bytes, (int, float)) \
            or not math.isfinite(size_bytes) or size_bytes < 0:
        raise PlanError(f"{what} {name!r}: size_bytes = {size_bytes!r} must be a finite number >= 0")


def _check_rank(what: str, name: str, key: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise PlanError(f"{what} {name!r}: {key} = {value!r} must be a global rank (an integer >= 0)")


@dataclass(frozen=True, slots=True)
class Collective:
    """A collective over `group` (global ranks, each once): allocate `allocs`, communicate, free `frees`.

    Every simulated member posts the same (kind, name, iteration) on its own stream; the k-th post of that
    key on one rank matches the k-th post on the others. `size_bytes` follows nccl-tests (the all_reduce
    buffer, all_gather's output, reduce_scatter's input, all_to_all's send buffer, broadcast's buffer; the
    root of a broadcast is group[0]).
    """

    name: str
    kind: str
    group: tuple[int, ...]
    size_bytes: float
    allocs: tuple[int, ...] = ()
    frees: tuple[int, ...] = ()
    iteration: int = 0
    # A micro-batch copy's post: (its template op's allocs, frees, shift, low), from which allocs and frees
    # were moved; lets the engine match replayed memory calls by identity (engine/memory.py run_allocate).
    moved: tuple | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.kind not in COLLECTIVE_KINDS:
            raise PlanError(f"collective {self.name!r}: kind = {self.kind!r} must be one of "
                            f"{', '.join(COLLECTIVE_KINDS)}")
        if _VALID_GROUPS.get(id(self.group)) is not self.group:
            if not isinstance(self.group, tuple) or not self.group:
                raise PlanError(f"collective {self.name!r}: group = {self.group!r} must be a non-empty tuple of "
                                f"ranks")
            for rank in self.group:
                _check_rank("collective", self.name, "group", rank)
            if len(set(self.group)) != len(self.group):
                raise PlanError(f"collective {self.name!r}: group = {self.group!r} must list every rank once")
            # A lowering posts the same few group objects hundreds of thousands of times: check each once.
            _VALID_GROUPS[id(self.group)] = self.group
        _check_size("collective", self.name, self.size_bytes)


_VALID_GROUPS: dict[int, tuple[int, ...]] = {}     # id -> the checked group (kept alive, so ids are not reused)


@dataclass(frozen=True, slots=True)
class Send:
    """Send `size_bytes` to rank `peer` (blocking until the matching Recv(peer=this rank, tag) is posted)."""

    name: str
    peer: int
    size_bytes: float
    tag: str
    iteration: int = 0

    def __post_init__(self) -> None:
        _check_rank("send", self.name, "peer", self.peer)
        _check_size("send", self.name, self.size_bytes)


@dataclass(frozen=True, slots=True)
class Recv:
    """Receive `size_bytes` from rank `peer` into `allocs` (allocated when posted); blocks until delivered."""

    name: str
    peer: int
    size_bytes: float
    tag: str
    allocs: tuple[int, ...] = ()
    iteration: int = 0

    def __post_init__(self) -> None:
        _check_rank("recv", self.name, "peer", self.peer)
        _check_size("recv", self.name, self.size_bytes)


@dataclass(frozen=True, slots=True)
class Transfer:
    """Offload traffic of this rank, a flow set on the shared network: `size_bytes` over `route`.

    Routes: "d2h" (the rank's GPU to its host memory, over PCIe), "h2d" (back), "nvme_write" (host memory to the
    node's drives, striped evenly over them), "nvme_read" (back), "host" (CPU work on the host, as `size_bytes` of
    DRAM traffic from the CPU to its memory at most `cap_bytes_per_s`: the CPU's own rate). `allocs` (device
    tensors) and `host_allocs` (Program.host_tensors) are allocated when it starts, `frees` and `host_frees`
    freed when it ends (network/host.py says where a GPU's host side is).
    """

    name: str
    route: str
    size_bytes: float
    cap_bytes_per_s: float | None = None
    allocs: tuple[int, ...] = ()
    frees: tuple[int, ...] = ()
    host_allocs: tuple[int, ...] = ()
    host_frees: tuple[int, ...] = ()
    iteration: int = 0

    def __post_init__(self) -> None:
        if self.route not in TRANSFER_ROUTES:
            raise PlanError(f"transfer {self.name!r}: route = {self.route!r} must be one of "
                            f"{', '.join(TRANSFER_ROUTES)}")
        _check_size("transfer", self.name, self.size_bytes)
        cap = self.cap_bytes_per_s
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap > 0
                                or not math.isfinite(cap)):
            raise PlanError(f"transfer {self.name!r}: cap_bytes_per_s = {cap!r} must be a positive rate or None")


@dataclass(frozen=True, slots=True)
class HostAlloc:
    """Allocate host tensors (Program.host_tensors) outside any transfer: offload state at set-up."""

    tensors: tuple[int, ...]
    reason: str


@dataclass(frozen=True, slots=True)
class HostFree:
    """Free host tensors outside any transfer."""

    tensors: tuple[int, ...]
    reason: str


# Constructors for the lowering's hot path: the same values as Signal(e), WaitFor(e) and Collective(...), built
# without the frozen dataclasses' per-field object.__setattr__ (3-4x cheaper; a cluster-scale lowering makes
# millions). `checked_collective` skips Collective's validation: only for fields an earlier Collective checked.
_new_instance = object.__new__
_set_event = (Signal.__dict__["event"].__set__, WaitFor.__dict__["event"].__set__)


def signal(event: str) -> Signal:
    """Signal(event), built fast."""
    instance = _new_instance(Signal)
    _set_event[0](instance, event)
    return instance


def wait_for(event: str) -> WaitFor:
    """WaitFor(event), built fast."""
    instance = _new_instance(WaitFor)
    _set_event[1](instance, event)
    return instance


# Collective(...) with name, kind, group and size_bytes already validated by an equal Collective
# (workload/graph.py slot_constructor: a twin of its slot layout filled, then made a Collective).
checked_collective = slot_constructor(Collective, ("name", "kind", "group", "size_bytes", "allocs", "frees",
                                                   "iteration", "moved"))
_new_send = slot_constructor(Send, ("name", "peer", "size_bytes", "tag", "iteration"))
_new_recv = slot_constructor(Recv, ("name", "peer", "size_bytes", "tag", "allocs", "iteration"))

_CHECKED_MESSAGES: set[tuple[int, float]] = set()    # (peer, size_bytes) a Send or Recv constructor validated


def _check_message(kind: type, name: str, peer: int, size_bytes: float) -> None:
    """Raise what kind(...)'s validation raises for this peer and size, checking each (int, float) pair once."""
    if type(peer) is int and type(size_bytes) is float and (peer, size_bytes) in _CHECKED_MESSAGES:
        return
    _check_rank(kind.__name__.lower(), name, "peer", peer)
    _check_size(kind.__name__.lower(), name, size_bytes)
    if type(peer) is int and type(size_bytes) is float:
        _CHECKED_MESSAGES.add((peer, size_bytes))


def send(name: str, peer: int, size_bytes: float, tag: str, iteration: int) -> Send:
    """Send(name, peer, size_bytes, tag, iteration), built fast (as checked_collective; validated as Send is)."""
    _check_message(Send, name, peer, size_bytes)
    return _new_send(name, peer, size_bytes, tag, iteration)


def recv(name: str, peer: int, size_bytes: float, tag: str, allocs: tuple[int, ...], iteration: int) -> Recv:
    """Recv(name, peer, size_bytes, tag, allocs, iteration), built fast (validated as Recv is)."""
    _check_message(Recv, name, peer, size_bytes)
    return _new_recv(name, peer, size_bytes, tag, allocs, iteration)


alloc, free = (slot_constructor(kind, ("tensors", "reason")) for kind in (Alloc, Free))   # kind(tensors, reason)


class Blocking(NamedTuple):
    """A collective the compute stream waits for at once (Megatron's tensor-parallel ones), posted on `stream`.

    The same as compute Signal(ready) -> `stream`: WaitFor(ready), `collective`, Signal(done) -> compute
    WaitFor(done), when `stream` has nothing outstanding the compute stream has not waited for: one
    instruction instead of five (a cluster-scale lowering makes hundreds of thousands). The collective's
    span, transfer time and memory calls belong to `stream`. A named tuple, as Run.
    """

    collective: Collective
    stream: str


Instruction = (Run | Alloc | Free | Signal | WaitFor | Mark | Period | Collective | Send | Recv | Blocking | Transfer
               | HostAlloc | HostFree)


def posted_collectives(streams: dict[str, tuple | list], stream: str) -> list[Collective]:
    """The collectives posted on `stream`: its own Collective instructions, then the compute stream's Blocking
    ones on it (each list in program order)."""
    own = [ins for ins in streams.get(stream, ()) if type(ins) is Collective]
    compute = streams.get("compute", ())
    return own + [ins.collective for ins in compute if type(ins) is Blocking and ins.stream == stream]


COMM_INSTRUCTIONS = (Collective, Send, Recv)


@dataclass(frozen=True)
class Program:
    """What one rank runs: its device, its tensors and one instruction list per stream."""

    rank: int
    device: str
    stage: int
    tensors: dict[int, Tensor]
    streams: dict[str, tuple[Instruction, ...]]
    # Micro-batch copies the lowering made in one pass on the compute stream, by start: (start, end, template,
    # iteration, low, blocking): instructions [start, end) are the template's ops as Runs with that iteration
    # and low and one shift, its collectives as the Blocking instructions `blocking` (an object) describes. Equal
    # parts of two copies with the same template, iteration, low and blocking are the same instructions but for
    # the shift (engine/stretches.py matches a stretch by them; engine/rank_state.py skips them, as they hold no
    # Signal, WaitFor or Period).
    copies: tuple[tuple, ...] = ()
    # Tensors in host memory (offload), by id (disjoint from `tensors`' ids): what HostAlloc, HostFree and a
    # Transfer's host_allocs / host_frees name. Their bytes count against the host's memory, not the device's.
    host_tensors: dict = field(default_factory=dict)
    # Per stream, the parts overlapped micro-batch copies made from a template (parallel/overlap_templates.py), by
    # start: (start, end, key, sync): instructions [start, end) are a copy of the template's part for this stream,
    # `key` the same object for every copy of that part, `sync` the positions (from start) of its Signals and
    # WaitFors. It holds no Period; copies with one key hold the same instructions but for tensor ids, shifts
    # and event names (engine/rank_state.py reads only their Signals and WaitFors; engine/network_model.py scans
    # one copy per key).
    blocks: dict[str, tuple[tuple, ...]] = field(default_factory=dict)
