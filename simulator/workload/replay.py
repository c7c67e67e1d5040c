"""Replay a recorded Tape the way PyTorch executes it: forward, backward, recompute, exact frees.

See workload/tape.py for the rules; this module holds the mutable bookkeeping of one replay
(live storages, saved-tensor counts, gradient buffers and their references).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from simulator.workload.graph import (
    ACTIVATIONS,
    BACKWARD_INPUT,
    ELEMENTWISE,
    FORWARD,
    GRADIENTS,
    OTHER,
    RECOMPUTE,
    DTYPE_BYTES,
    Op,
    Tensor,
    new_op,
    new_tensor,
)
from simulator.workload.tape import FLOAT_DTYPES, Ref, Tape, _Node, _Region, numel


class ParamGradPolicy(Protocol):
    """How a parameter's gradient lands (supplied by the training layer).

    `has_grad(param)` is True when the parameter already holds a gradient (gradient accumulation or
    a tied weight used twice): the incoming gradient is then added in place and freed.
    `became_grad(param, tensor)` records the storage that became `.grad`.
    """

    def has_grad(self, param: Ref) -> bool: ...

    def became_grad(self, param: Ref, grad: Tensor) -> None: ...


@dataclass
class _Trail:
    """Gradient bookkeeping a backward node leaves for right after it: accumulations, releases."""

    allocs: list[int] = field(default_factory=list)
    frees: list[int] = field(default_factory=list)
    bytes: int = 0


class Replay:
    """Executes a Tape in PyTorch's order and emits Ops with allocs and frees."""

    def __init__(self, tape: Tape, loss: Ref, policy: ParamGradPolicy):
        self.tape = tape
        self.loss = loss
        self.policy = policy
        self.ops: list[Op] = []
        self.tensors: dict[int, Tensor] = {}
        self.next_id = tape.next_tensor_id
        self.saved_count: dict[int, int] = {}       # storage id -> outstanding saved references
        self.py_alive: set[int] = set()             # forward storages whose Python life has not ended
        self.live: set[int] = set()                 # allocated, not yet freed (non-persistent)
        self.grad_of: dict[int, int] = {}           # storage id -> id of its accumulated gradient
        self.grad_refs: dict[int, int] = {}         # gradient id -> buffer slots referencing it
        self.param_pending: dict[int, int] = {}     # parameter id -> gradients still to arrive
        self.param_buffer: dict[int, int] = {}      # parameter id -> gradient buffered so far
        self.remap: dict[int, int] = {}             # original id -> recomputed id
        self.packed: dict[int, int] = {}            # activation id -> its int8 copy (compression)
        self.unpacked: dict[int, int] = {}          # int8 copy id -> activation id

    # -- helpers
    def _tensor(self, tid: int, name: str, shape: tuple[int, ...], dtype: str, category: str) -> Tensor:
        tensor = new_tensor(tid, name, numel(shape) * DTYPE_BYTES[dtype], category, dtype, shape, False)
        self.tensors[tid] = tensor
        return tensor

    def _new_id(self) -> int:
        tid = self.next_id
        self.next_id += 1
        return tid

    def _emit(self, name: str, op_class: str, phase: str, *, flops: float, bytes_read: int,
              bytes_written: int, dtype: str, gemm_mnk, gemm_batch: int, inputs, outputs,
              allocs, frees, layer: int) -> None:
        self.ops.append(new_op(name, op_class, phase, flops, bytes_read, bytes_written, dtype, gemm_mnk,
                               gemm_batch, tuple(inputs), tuple(outputs), tuple(allocs), tuple(frees),
                               layer, self.tape.microbatch))

    def _maybe_free(self, tid: int, frees: list[int]) -> None:
        if tid in self.live and tid not in self.py_alive and self.saved_count.get(tid, 0) == 0:
            self.live.discard(tid)
            frees.append(tid)

    # -- forward
    def _mem(self, ref_id: int) -> int:
        """The storage id holding a ref's memory now: its base for views, the recomputed copy."""
        base = self.tape._storages[ref_id].base
        root = ref_id if base is None else base
        return self.remap.get(root, root)

    def _forward_node(self, node: _Node, phase: str, frees_after: dict[int, list[int]],
                      keep_saved: bool, extra_saved: tuple[Ref, ...] = ()) -> None:
        """Run one forward (or recomputed) node; `extra_saved` are references packed right after it
        (the inputs of the op where recomputation stops), counted before any free happens."""
        st = self.tape._storages
        allocs: list[int] = []
        outputs: list[int] = []
        for ref in node.outputs:
            if st[ref.id].base is not None:
                continue                      # a view: no memory of its own
            tid = ref.id
            if phase == RECOMPUTE:
                tid = self._new_id()
                self.remap[ref.id] = tid
            self._tensor(tid, st[ref.id].name, ref.shape, ref.dtype, st[ref.id].category)
            allocs.append(tid)
            outputs.append(tid)
            self.live.add(tid)
            self.py_alive.add(tid)
        workspace = []
        for shape, dtype in node.workspace:
            tid = self._new_id()
            self._tensor(tid, f"{node.name}.workspace", shape, dtype, OTHER)
            allocs.append(tid)
            workspace.append(tid)
        compress: list[tuple[int, int]] = []
        saver = self.tape.saver
        packing: set[int] = set()         # storages a save_on_cpu pack reads after the op (offload/activations.py)
        if keep_saved and saver is not None and node.saved:
            packing = saver.pack(self, node)
        elif keep_saved:
            for ref in node.saved:
                tid = self._saved_storage(ref, compress)
                self.saved_count[tid] = self.saved_count.get(tid, 0) + 1
        for ref in extra_saved:
            tid = self._mem(ref.id)
            self.saved_count[tid] = self.saved_count.get(tid, 0) + 1
        quantized = {source for source, _ in compress} | packing
        frees: list[int] = list(workspace)
        for tid in frees_after.get(node.index, ()):
            actual = self.remap.get(tid, tid)
            self.py_alive.discard(actual)
            if actual not in quantized:       # a compressed (or packed) tensor lives until it is quantized (copied)
                self._maybe_free(actual, frees)
        inputs = [self._mem(r.id) for r in node.inputs]
        self._emit(node.name, node.op_class, phase, flops=node.flops, bytes_read=node.bytes_read,
                   bytes_written=node.bytes_written, dtype=node.dtype, gemm_mnk=node.gemm_mnk,
                   gemm_batch=node.gemm_batch, inputs=inputs, outputs=outputs, allocs=allocs,
                   frees=frees, layer=node.layer)
        if packing:
            freeable: list[int] = []
            for tid in sorted(packing):
                self._maybe_free(tid, freeable)
            saver.pack_ops(self, node, phase, freeable)
        for source, packed in compress:
            # int8 activation compression: quantize the saved tensor right after it is produced.
            frees = []
            self._maybe_free(source, frees)
            n = self.tensors[packed].nbytes
            self._emit(f"{node.name}.quantize_int8", ELEMENTWISE, phase, flops=3.0 * n,
                       bytes_read=self.tensors[source].nbytes, bytes_written=n, dtype="int8",
                       gemm_mnk=None, gemm_batch=1, inputs=[source], outputs=[packed],
                       allocs=[packed], frees=frees, layer=node.layer)

    def _saved_storage(self, ref: Ref, compress: list[tuple[int, int]]) -> int:
        """The storage a saved reference keeps alive: the tensor itself, or its int8 copy."""
        tid = self._mem(ref.id)
        if not self.tape.compress_saved:
            return tid
        tensor = self.tensors.get(tid)
        if tensor is None or tensor.category != ACTIVATIONS or tensor.dtype not in FLOAT_DTYPES \
                or len(tensor.shape) < 2:
            return tid
        packed = self.packed.get(tid)
        if packed is None:
            packed = self._new_id()
            rows = numel(tensor.shape[:-1])
            nbytes = numel(tensor.shape) + 4 * rows           # int8 values + one fp32 scale per row
            self.tensors[packed] = Tensor(packed, f"{tensor.name}.int8", nbytes, ACTIVATIONS, "int8",
                                          tensor.shape)
            self.packed[tid] = packed
            self.unpacked[packed] = tid
            self.live.add(packed)
            compress.append((tid, packed))
        return packed

    def _python_frees(self, nodes: list[_Node], end: int) -> dict[int, list[int]]:
        """Map node index -> storages whose Python life ends after that node (within `nodes`)."""
        st = self.tape._storages
        result: dict[int, list[int]] = {}
        for node in nodes:
            for ref in node.outputs:
                if st[ref.id].base is not None:
                    continue
                last = min(st[ref.id].last_forward_use, end)
                result.setdefault(last, []).append(ref.id)
        return result

    # -- backward
    def _inc(self, grad_id: int) -> None:
        self.grad_refs[grad_id] = self.grad_refs.get(grad_id, 0) + 1

    def _dec(self, grad_id: int, frees: list[int]) -> None:
        """Drop one reference to a gradient storage; free it when none is left."""
        count = self.grad_refs[grad_id] - 1
        self.grad_refs[grad_id] = count
        if count == 0 and grad_id in self.live:
            self.live.discard(grad_id)
            frees.append(grad_id)

    def _receive_grad(self, target: Ref, grad_id: int, frees: list[int], trail: "_Trail") -> None:
        """A gradient arrived for `target`: buffer it, accumulate it, or hand it to `.grad`.

        Measured on CPU (torch 2.13): autograd's InputBuffer adds a second gradient out of place
        (`old + new`, a new buffer; both inputs released); on CUDA (torch 2.11, H200) it adds in place
        into a buffer it holds the only reference to (InputBuffer::accumulate's `old.add_(new)`, or
        `new.add_(old)`), allocating nothing. A parameter's buffer is handed to
        AccumulateGrad once its last gradient arrived: stolen as `.grad`, or added in place into
        an existing `.grad` (gradient accumulation) and released.
        """
        st = self.tape._storages[target.id]
        if not st.requires_grad:
            self._dec(grad_id, frees)
            return
        if not st.is_param:
            old = self.grad_of.get(target.id)
            self.grad_of[target.id] = grad_id if old is None else self._accumulate(old, grad_id, trail)
            return
        self.param_pending[target.id] -= 1
        old = self.param_buffer.pop(target.id, None)
        buffered = grad_id if old is None else self._accumulate(old, grad_id, trail)
        if self.param_pending[target.id] > 0:
            self.param_buffer[target.id] = buffered
            return
        if self.policy.has_grad(target):
            self._dec(buffered, trail.frees)           # `.grad += buffered`, in place
        elif self.grad_refs[buffered] > 1:
            clone = self._new_id()
            source = self.tensors[buffered]
            self.tensors[clone] = new_tensor(clone, source.name, source.nbytes, GRADIENTS, source.dtype,
                                             source.shape, False)
            trail.allocs.append(clone)
            self._dec(buffered, trail.frees)
            self.policy.became_grad(target, self.tensors[clone])
        else:
            # Stolen as `.grad`; from now on the training loop owns (and frees) it.
            self._retag(buffered, GRADIENTS)
            self.live.discard(buffered)
            self.grad_refs.pop(buffered)
            self.policy.became_grad(target, self.tensors[buffered])

    def _accumulate(self, old: int, new: int, trail: "_Trail") -> int:
        """`old + new`: in place into a solely held buffer where the device does so, else into a new buffer;
        the inputs not kept are released."""
        source = self.tensors[old]
        if self.tape.inplace_grad_accumulation:
            for keep, drop in ((old, new), (new, old)):
                if self.grad_refs.get(keep) == 1 and keep in self.live:
                    self._dec(drop, trail.frees)
                    trail.bytes += 3 * source.nbytes
                    return keep
        tid = self._new_id()
        self._tensor(tid, source.name, source.shape, source.dtype, OTHER)
        self.live.add(tid)
        self.grad_refs[tid] = 1
        trail.allocs.append(tid)
        self._dec(old, trail.frees)
        self._dec(new, trail.frees)
        trail.bytes += 3 * source.nbytes
        return tid

    def _retag(self, tid: int, category: str) -> None:
        old = self.tensors[tid]
        self.tensors[tid] = new_tensor(old.id, old.name, old.nbytes, category, old.dtype, old.shape,
                                       old.persistent)

    def _backward_node(self, node: _Node) -> None:
        st = self.tape._storages
        grad_out = [self.grad_of.get(ref.id) for ref in node.outputs]
        if all(g is None for g in grad_out):
            return
        produced: list[tuple[int, int]] = []
        saver = self.tape.saver
        offloaded = saver is not None and saver.offloaded(self, node)
        dequantized = saver.unpack(self, node) if offloaded else self._dequantize(node)
        for k, kernel in enumerate(node.kernels):
            allocs: list[int] = []
            outputs: list[int] = []
            for grad in kernel.grads:
                target = node.inputs[grad.index]
                if grad.alias is not None:
                    source = grad_out[grad.alias]
                    if source is not None:
                        self._inc(source)
                        produced.append((grad.index, source))
                    continue
                if not st[target.id].requires_grad:
                    continue
                tid = self._new_id()
                # A parameter's gradient is "gradients" only once it becomes .grad (see _receive_grad).
                self._tensor(tid, f"grad({st[target.id].name})", grad.shape or target.shape,
                             grad.dtype or target.dtype, OTHER)
                self.live.add(tid)
                self.grad_refs[tid] = 1
                allocs.append(tid)
                outputs.append(tid)
                produced.append((grad.index, tid))
            workspace = []
            for shape, dtype in kernel.workspace:
                tid = self._new_id()
                self._tensor(tid, f"{node.name}.{kernel.suffix}.workspace", shape, dtype, OTHER)
                allocs.append(tid)
                workspace.append(tid)
            frees: list[int] = list(workspace)
            if k == len(node.kernels) - 1:
                frees.extend(dict.fromkeys(dequantized.values()))
                # Autograd releases the node's incoming gradients and saved variables after it runs.
                for ref, g in zip(node.outputs, grad_out):
                    if g is not None:
                        del self.grad_of[ref.id]
                        self._dec(g, frees)
                for ref in node.saved if not offloaded else ():
                    tid = self._mem(ref.id)
                    tid = self.packed.get(tid, tid)
                    self.saved_count[tid] -= 1
                    self._maybe_free(tid, frees)
                trail = _Trail()
                for index, g in produced:
                    self._receive_grad(node.inputs[index], g, frees, trail)
            inputs = [g for g in grad_out if g is not None]
            for ref in node.saved:
                tid = self._mem(ref.id)
                inputs.append(dequantized.get(tid, tid))
            self._emit(f"{node.name}.{kernel.suffix}", kernel.op_class, kernel.phase,
                       flops=kernel.flops, bytes_read=kernel.bytes_read,
                       bytes_written=kernel.bytes_written, dtype=kernel.dtype,
                       gemm_mnk=kernel.gemm_mnk, gemm_batch=kernel.gemm_batch, inputs=inputs,
                       outputs=outputs, allocs=allocs, frees=frees, layer=node.layer)
        if trail.allocs or trail.frees:
            self._emit(f"{node.name}.accumulate_grad", ELEMENTWISE, BACKWARD_INPUT,
                       flops=trail.bytes / 12.0, bytes_read=2 * trail.bytes // 3,
                       bytes_written=trail.bytes // 3, dtype=node.dtype, gemm_mnk=None, gemm_batch=1,
                       inputs=[], outputs=list(trail.allocs), allocs=trail.allocs, frees=trail.frees,
                       layer=node.layer)

    def _dequantize(self, node: _Node) -> dict[int, int]:
        """Unpack a node's int8-compressed saved tensors into temporaries for its backward."""
        temps: dict[int, int] = {}    # activation id -> its dequantized temporary
        if not self.packed:
            return temps                      # nothing compressed (yet)
        for ref in node.saved:
            packed = self.packed.get(self._mem(ref.id))
            if packed is None or self.unpacked[packed] in temps:
                continue                      # not compressed, or a view of one already unpacked
            source = self.tensors[self.unpacked[packed]]
            tid = self._new_id()
            self._tensor(tid, f"{source.name}.dequantized", source.shape, source.dtype, OTHER)
            temps[self.unpacked[packed]] = tid
            self._emit(f"{node.name}.dequantize_int8", ELEMENTWISE, BACKWARD_INPUT,
                       flops=2.0 * source.nbytes, bytes_read=self.tensors[packed].nbytes,
                       bytes_written=source.nbytes, dtype=source.dtype, gemm_mnk=None, gemm_batch=1,
                       inputs=[packed], outputs=[tid], allocs=[tid], frees=[], layer=node.layer)
        return temps

    def _recompute_region(self, region: _Region) -> None:
        """Replay a region's forward until its last saved tensor exists (torch's early stop).

        Inputs are saved before an op runs and outputs after, so when the last saving op saves
        only inputs, recomputation stops before running it.
        """
        nodes = [self.tape._nodes[i] for i in region.nodes]
        saving = [n for n in nodes if n.saved and n.kernels]
        if not saving:
            return
        last = saving[-1]
        outputs = {ref.id for ref in last.outputs}
        end = last.index if any(ref.id in outputs for ref in last.saved) else last.index - 1
        replay = [n for n in nodes if n.index <= end]
        if not replay:
            return
        state = None
        if self.tape.rng_state_bytes:
            state = self._new_id()
            self._tensor(state, "checkpoint.rng_state", (self.tape.rng_state_bytes,), "uint8", OTHER)
            self._emit("checkpoint.get_rng_state", "copy", RECOMPUTE, flops=0.0, bytes_read=0,
                       bytes_written=self.tape.rng_state_bytes, dtype="uint8", gemm_mnk=None,
                       gemm_batch=1, inputs=(), outputs=(state,), allocs=(state,), frees=(),
                       layer=replay[0].layer)
        frees_after = self._python_frees(replay, replay[-1].index)
        # When recomputation stops before the last saving op, that op's inputs were packed
        # (saved) before it would have run: count them before the final frees happen.
        stop_saves = last.saved if end < last.index else ()
        for node in replay:
            self._forward_node(node, RECOMPUTE, frees_after, keep_saved=True,
                               extra_saved=stop_saves if node is replay[-1] else ())
        if state is not None:
            self._attach_frees([state])

    # -- driver
    def run(self) -> tuple[list[Op], dict[int, Tensor]]:
        tape = self.tape
        nodes = tape._nodes
        regions = tape._regions
        region_inputs: dict[int, tuple[int, ...]] = {}
        # Checkpoint frames keep their region's inputs alive until the region's backward is done.
        for r, region in enumerate(regions):
            if region.nodes:
                ids = tuple(self._mem(ref.id) for ref in region.inputs)
                region_inputs[r] = ids
                for tid in ids:
                    self.saved_count[tid] = self.saved_count.get(tid, 0) + 1
        st = tape._storages
        for node in nodes:
            for kernel in node.kernels:
                for grad in kernel.grads:
                    target = node.inputs[grad.index]
                    if st[target.id].is_param:
                        self.param_pending[target.id] = self.param_pending.get(target.id, 0) + 1
        frees_after = self._python_frees(nodes, len(nodes) - 1)
        for node in nodes:
            self._forward_node(node, FORWARD, frees_after, keep_saved=node.region < 0)
        # Backward: the loss gradient is a fresh ones-like scalar.
        seed = self._new_id()
        self._tensor(seed, "grad(loss)", self.loss.shape, self.loss.dtype, OTHER)
        self.live.add(seed)
        self.grad_refs[seed] = 1
        self.grad_of[self.loss.id] = seed
        self._emit("loss.backward_seed", "elementwise", BACKWARD_INPUT, flops=0.0, bytes_read=0,
                   bytes_written=self.loss.nbytes, dtype=self.loss.dtype, gemm_mnk=None,
                   gemm_batch=1, inputs=(), outputs=(seed,), allocs=(seed,), frees=(), layer=-1)
        self.py_alive.discard(self.loss.id)
        recomputed: set[int] = set()
        for node in reversed(nodes):
            if not node.kernels:
                continue
            if node.region >= 0 and node.region not in recomputed:
                recomputed.add(node.region)
                self._recompute_region(regions[node.region])
            self._backward_node(node)
            if node.region >= 0 and node.index == regions[node.region].nodes[0]:
                frees: list[int] = []
                for tid in region_inputs[node.region]:
                    self.saved_count[tid] -= 1
                    self._maybe_free(tid, frees)
                if frees:
                    self._attach_frees(frees)
        # Whatever is still alive (loss, outputs kept to the end, leftover buffers) is freed now.
        rest = sorted(self.live)
        if rest:
            self._attach_frees(rest)
        return self.ops, self.tensors

    def _attach_frees(self, frees: list[int]) -> None:
        last = self.ops[-1]
        self.ops[-1] = new_op(last.name, last.op_class, last.phase, last.flops, last.bytes_read,
                              last.bytes_written, last.dtype, last.gemm_mnk, last.gemm_batch, last.inputs,
                              last.outputs, last.allocs, last.frees + tuple(frees), last.layer,
                              last.microbatch)
        for tid in frees:
            self.live.discard(tid)
