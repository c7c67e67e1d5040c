"""Activations offloaded to host memory as torch.autograd.graph.save_on_cpu(pin_memory=True) does it.

torch/autograd/graph.py, save_on_cpu: every tensor autograd saves passes through the pack hook, which allocates a
pinned host tensor of the saved tensor's size (`torch.empty(size, pin_memory=True)`) and copies into it
(`packed.copy_(tensor)`: blocking, on the current stream); autograd keeps the host copy instead of the GPU tensor,
which is freed as soon as Python is done with it. The backward node's unpack hook copies it back
(`tensor.to(device, non_blocking=True)`, on the current stream, into a new GPU tensor that lives while the node
runs). Each saved reference is packed on its own (a tensor saved by two nodes is copied twice), weights included.
Here: a D2H transfer on the compute stream after the op that saves (it frees what the op's Python frees would have
freed, once the copy is done), an H2D transfer before the node's backward kernels into a temporary freed after them.
The host copy is released when it has been copied back (autograd drops it when the node has run, a kernel's time
later: the host's peak, at the end of the forward, is the same).
"""

from __future__ import annotations

from simulator.offload.host_memory import PINNED, HostTensor
from simulator.workload.graph import ACTIVATIONS, BACKWARD_INPUT, DTYPE_BYTES, Op, TRANSFER
from simulator.workload.tape import numel


class HostSaver:
    """The saved-tensor hooks of save_on_cpu(pin_memory=True) for a Replay (workload/replay.py calls it)."""

    def __init__(self) -> None:
        self.host_tensors: dict[int, HostTensor] = {}
        self._packed: dict[int, list[tuple[object, int]]] = {}   # node index -> [(saved ref, host tensor id)]

    def pack(self, replay, node) -> set[int]:
        """Pack every saved reference of forward `node` to a host copy; the storages whose frees must wait for it."""
        sources: set[int] = set()
        packed = self._packed[(replay.tape.microbatch, node.index)] = []
        for ref in node.saved:
            tid = replay.next_id
            replay.next_id += 1
            name = replay.tape._storages[ref.id].name
            self.host_tensors[tid] = HostTensor(tid, f"{name}.saved_on_cpu", numel(ref.shape) * DTYPE_BYTES[ref.dtype],
                                                ACTIVATIONS, PINNED)
            packed.append((ref, tid))
            sources.add(replay._mem(ref.id))
        return sources

    def pack_ops(self, replay, node, phase: str, freeable: list[int]) -> None:
        """Emit the D2H copies of `node`'s saved references (after its op); the last one frees `freeable`."""
        packed = self._packed[(replay.tape.microbatch, node.index)]
        for k, (ref, host_id) in enumerate(packed):
            nbytes = self.host_tensors[host_id].nbytes
            frees = tuple(freeable) if k == len(packed) - 1 else ()
            replay.ops.append(Op(f"{node.name}.save_on_cpu.{k}", TRANSFER, phase, bytes_read=nbytes,
                                 bytes_written=nbytes, dtype=ref.dtype, inputs=(replay._mem(ref.id),), frees=frees,
                                 layer=node.layer, microbatch=replay.tape.microbatch, collective="d2h",
                                 comm_bytes=nbytes, host_allocs=(host_id,)))

    def offloaded(self, replay, node) -> bool:
        """Whether `node`'s saved references were packed to the host (its saved counts were not taken)."""
        return (replay.tape.microbatch, node.index) in self._packed

    def unpack(self, replay, node) -> dict[int, int]:
        """Emit the H2D copies of `node`'s packed references before its backward: saved storage id -> the GPU
        temporary its kernels read (freed after them by the caller)."""
        temps: dict[int, int] = {}
        for k, (ref, host_id) in enumerate(self._packed.get((replay.tape.microbatch, node.index), ())):
            tid = replay._new_id()
            name = replay.tape._storages[ref.id].name
            replay._tensor(tid, f"{name}.from_cpu", ref.shape, ref.dtype, ACTIVATIONS)
            nbytes = self.host_tensors[host_id].nbytes
            replay.ops.append(Op(f"{node.name}.unpack_from_cpu.{k}", TRANSFER, BACKWARD_INPUT, bytes_read=nbytes,
                                 bytes_written=nbytes, dtype=ref.dtype, outputs=(tid,), allocs=(tid,),
                                 layer=node.layer, microbatch=replay.tape.microbatch, collective="h2d",
                                 comm_bytes=nbytes, host_frees=(host_id,)))
            temps.setdefault(replay._mem(ref.id), tid)
            temps[-1 - k] = tid              # every temporary, also a second one of the same storage
        return temps
