"""Workload value types: tensors with sizes and memory categories, ops with costs and memory events."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

# Memory categories reported per rank (DESIGN.md's breakdown_at_peak keys).
PARAMETERS = "parameters"
GRADIENTS = "gradients"
OPTIMIZER_STATES = "optimizer_states"
ACTIVATIONS = "activations"
COMMUNICATION_BUFFERS = "communication_buffers"
OTHER = "other"
CATEGORIES = (PARAMETERS, GRADIENTS, OPTIMIZER_STATES, ACTIVATIONS, COMMUNICATION_BUFFERS, OTHER)
CATEGORY_LABELS = {name: name.replace("_", " ") for name in CATEGORIES}   # for people: "optimizer states"

# Bytes per element of the dtypes memsim knows.
DTYPE_BYTES = {"fp64": 8, "fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1, "int8": 1, "uint8": 1, "bool": 1, "int64": 8, "int32": 4}

# Op classes used by the cost model to pick an efficiency.
GEMM = "gemm"                  # dense matmul (linear layers, LM head, attention scores in eager mode)
ATTENTION = "attention"        # fused attention kernel (flash / SDPA)
ELEMENTWISE = "elementwise"    # pointwise: activation functions, dropout, residual add, scale, cast
NORM = "norm"                  # LayerNorm / RMSNorm
SOFTMAX = "softmax"            # softmax and log-softmax / cross-entropy reductions
EMBEDDING = "embedding"        # gathers and scatters (embedding lookup and its backward)
OPTIMIZER = "optimizer"        # optimizer update kernels
COPY = "copy"                  # memory copies (contiguous, transpose, cast to another buffer)
COLLECTIVE = "collective"      # a communication kernel (NCCL): see Op.collective, Op.group, Op.comm_bytes
SPARSE_GEMM = "sparse_gemm"    # a 2:4 semi-structured sparse matmul (sparse tensor cores); flops are dense-equivalent
TRANSFER = "transfer"          # offload traffic (program.Transfer): Op.collective the route, Op.comm_bytes its bytes
HOST = "host"                  # work on the host CPU (offloaded optimizer step): Op.collective the host kernel
OP_CLASSES = (GEMM, ATTENTION, ELEMENTWISE, NORM, SOFTMAX, EMBEDDING, OPTIMIZER, COPY, COLLECTIVE, TRANSFER, HOST,
              SPARSE_GEMM)
OFFLOAD_CLASSES = (TRANSFER, HOST)
WAIT = "wait"                  # a TRANSFER op with this route moves nothing: the compute stream waits for Op.group

# Collectives (NCCL / torch.distributed names) and the process groups they run on.
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "send", "recv")
GROUPS = ("tp", "dp", "pp")

# Where an op runs relative to the compute stream (Op.placement). "" = by its class: a data-parallel all_reduce or
# reduce_scatter overlaps the backward (the compute stream waits for it before the optimizer step), every other
# collective is waited for at once, and every other op runs on the compute stream.
OVERLAPPED = "overlapped"     # a collective the compute stream waits for only before the optimizer step
BLOCKING = "blocking"         # a collective the compute stream waits for at once
ON_COMM_STREAM = "comm"       # a kernel a communication library runs on its group's communication stream
PLACEMENTS = ("", OVERLAPPED, BLOCKING, ON_COMM_STREAM)

# Phases of a training iteration.
FORWARD = "fwd"
BACKWARD_INPUT = "bwd_input"      # gradient with respect to the op's inputs (B / I in pipeline notation)
BACKWARD_WEIGHT = "bwd_weight"    # gradient with respect to its weights (W in pipeline notation)
RECOMPUTE = "recompute"           # forward ops replayed during backward (activation checkpointing)
OPTIMIZER_STEP = "optimizer"
PHASES = (FORWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, RECOMPUTE, OPTIMIZER_STEP)


def moved_ids(ids: tuple[int, ...], shift: int, low: int) -> tuple[int, ...]:
    """`ids` with those >= low moved by shift (a micro-batch copy's ids from its template's); `ids` itself when
    nothing can move (no shift, no ids, one id below low)."""
    if not shift or not ids:
        return ids
    if len(ids) == 1:                    # most memory calls: one tensor
        v = ids[0]
        return (v + shift,) if v >= low else ids
    return tuple([v + shift if v >= low else v for v in ids])


@dataclass(frozen=True, slots=True)
class Tensor:
    """A buffer the program allocates and frees: its size, dtype and memory category.

    `persistent` tensors (parameters, optimizer states, gradient buffers that live across
    iterations) are allocated once before the first iteration and never freed.
    """

    id: int
    name: str
    nbytes: int
    category: str
    dtype: str = "fp32"
    shape: tuple[int, ...] = ()
    persistent: bool = False


@dataclass(frozen=True, slots=True)
class Op:
    """One kernel (or fused group of kernels) with what it costs and what memory it takes and releases.

    Memory semantics, in program order: every tensor in `allocs` is allocated when the op starts,
    the op runs, then every tensor in `frees` is released. A tensor freed by the same op that
    allocated it is a transient workspace.
    """

    name: str                      # e.g. "layer3.mlp.fc1"
    op_class: str                  # one of OP_CLASSES
    phase: str                     # one of PHASES
    flops: float = 0.0             # floating-point operations (multiply-add = 2)
    bytes_read: int = 0            # bytes read from device memory, no cache assumed
    bytes_written: int = 0         # bytes written to device memory
    dtype: str = "fp32"            # compute dtype (selects the FLOP rate)
    gemm_mnk: tuple[int, int, int] | None = None   # (m, n, k) of the dominant matmul, batched dims folded into m
    gemm_batch: int = 1            # number of independent matmuls of that shape (batched matmul)
    inputs: tuple[int, ...] = ()   # tensor ids read (for L2 reuse of just-produced tensors)
    outputs: tuple[int, ...] = ()  # tensor ids written
    allocs: tuple[int, ...] = ()   # tensor ids allocated at op start
    frees: tuple[int, ...] = ()    # tensor ids freed at op end
    layer: int = -1                # transformer layer index, -1 for embedding/head/optimizer
    microbatch: int = 0
    collective: str = ""           # COLLECTIVE: one of COLLECTIVES; TRANSFER: its route or WAIT; HOST: its kernel
    group: str = ""                # COLLECTIVE (or placement ON_COMM_STREAM): the process group, one of GROUPS;
                                   # TRANSFER, HOST: the stream it runs on ("" the compute stream, "dp" the
                                   # data-parallel one, else a stream name)
    comm_bytes: int = 0            # COLLECTIVE: the buffer size as NCCL sees it (nccl-tests' size); TRANSFER: bytes
    host_allocs: tuple[int, ...] = ()   # TRANSFER: host tensors (offload) allocated at its start
    host_frees: tuple[int, ...] = ()    # TRANSFER: host tensors freed at its end
    placement: str = ""            # one of PLACEMENTS: where the op runs relative to the compute stream
    tensors: int = 1               # tensors one call walks (a multi-tensor optimizer kernel: all of them): host work


def slot_constructor(cls: type, names: tuple[str, ...]) -> Callable:
    """A function of `names` (the first fields of the frozen, slotted dataclass `cls`, in order) that returns
    cls(*values) with every later field at its default, without the frozen dataclass's per-field
    object.__setattr__ (~6x cheaper for an Op): a twin class of cls's slot layout is filled, then made a `cls` by
    assigning `__class__`. For the hot paths: the replay makes every op and tensor of an iteration, the lowering
    (parallel/program.py) millions of collectives, messages and memory calls (tests/test_fast_graph.py and
    tests/test_lowering_compiled.py compare the values with the constructors')."""
    fields = dataclasses.fields(cls)
    if tuple(f.name for f in fields[:len(names)]) != names or any(
            f.default is dataclasses.MISSING for f in fields[len(names):]):
        raise TypeError(f"{cls.__name__}: {names} are not its first fields, or a later one has no plain default")
    namespace = {"_twin": type(f"_{cls.__name__}Slots", (), {"__slots__": cls.__slots__}), "_cls": cls}
    namespace.update({f"_default_{f.name}": f.default for f in fields[len(names):]})
    body = [f"    made.{f.name} = {f.name if f.name in names else '_default_' + f.name}" for f in fields]
    exec("\n".join([f"def make({', '.join(names)}):", "    made = _twin()", *body, "    made.__class__ = _cls",
                    "    return made"]), namespace)
    return namespace["make"]


new_op = slot_constructor(Op, ("name", "op_class", "phase", "flops", "bytes_read", "bytes_written", "dtype",
                               "gemm_mnk", "gemm_batch", "inputs", "outputs", "allocs", "frees", "layer",
                               "microbatch"))
new_tensor = slot_constructor(Tensor, tuple(f.name for f in dataclasses.fields(Tensor)))
