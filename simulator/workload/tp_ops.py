"""Megatron-LM tensor- and sequence-parallel ops as tape nodes: the communication a TP rank records.

A mixin of `simulator.workload.primitives.Ops` (it uses the Ops' tape, `tp`, `collectives`, the
communication buffers and the dense ops): column/row-parallel regions (f and g), sequence-parallel
gathers and scatters into Megatron's global memory buffer, the vocabulary-parallel embedding and
cross-entropy. Every communication op is registered in `collectives` with its NCCL size.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from simulator.workload.graph import (
    COLLECTIVE,
    COMMUNICATION_BUFFERS,
    COPY,
    DTYPE_BYTES,
    ELEMENTWISE,
    SOFTMAX,
    Op,
)
from simulator.workload.tape import Grad, Kernel, Ref, numel


@dataclass(frozen=True)
class CollectiveSpec:
    """What a recorded communication op does: the collective, its process group and NCCL's size."""

    collective: str
    group: str
    comm_bytes: int


def annotate_collectives(ops: list[Op], specs: dict[str, CollectiveSpec]) -> list[Op]:
    """Copy the collective, group and bytes of `specs` (keyed by op name) onto the ops they name.

    The tape's replay knows op names and classes only; forward and recomputed ops of a node share
    its name, backward kernels are named `node.suffix`.
    """
    if not specs:
        return ops
    out = []
    for op in ops:
        spec = specs.get(op.name)
        if spec is not None and op.op_class == COLLECTIVE:
            op = replace(op, collective=spec.collective, group=spec.group, comm_bytes=spec.comm_bytes)
        out.append(op)
    return out


class TensorParallelOps:
    """The tensor-parallel half of `Ops` (see the module docstring)."""

    @property
    def comm_buffers(self) -> list[Ref]:
        """The persistent communication buffers created so far (allocate them with the parameters)."""
        return list(self._comm_buffers.values())

    def _collective(self, op_name: str, kind: str, nbytes: int) -> None:
        self.collectives[op_name] = CollectiveSpec(kind, "tp", nbytes)

    def _alias(self, x: Ref, name: str, op_class: str, kernel: Kernel, moved_bytes: int = 0) -> Ref:
        """An op whose output is x itself (identity or in-place): no allocation."""
        (out,) = self.tape.node(name, op_class, (x,), ((name, x.shape, x.dtype),), bytes_read=moved_bytes,
                                bytes_written=moved_bytes, dtype=x.dtype, backward=(kernel,))
        self.tape._storages[out.id].base = self.tape.root(x)
        return out

    def copy_to_tp(self, x: Ref, name: str) -> Ref:
        """Megatron's f (copy_to_tensor_model_parallel_region): identity forward, in-place
        all_reduce of the input gradient in backward."""
        self._collective(f"{name}.all_reduce", "all_reduce", x.nbytes)
        kernel = Kernel("all_reduce", COLLECTIVE, bytes_read=x.nbytes, bytes_written=x.nbytes,
                        dtype=x.dtype, grads=(Grad(0, alias=0),))
        return self._alias(x, name, COPY, kernel)

    def reduce_from_tp(self, x: Ref, name: str) -> Ref:
        """Megatron's g (reduce_from_tensor_model_parallel_region): in-place all_reduce forward,
        identity backward."""
        self._collective(name, "all_reduce", x.nbytes)
        return self._alias(x, name, COLLECTIVE, Kernel("bwd", COPY, grads=(Grad(0, alias=0),)), x.nbytes)

    def _sequence_shape(self, shape: tuple[int, ...], factor: float) -> tuple[int, ...]:
        return (shape[0], int(shape[1] * factor)) + tuple(shape[2:])

    def gather_to_buffer(self, x: Ref, name: str) -> Ref:
        """Sequence parallelism before a column-parallel linear: all_gather (b, s/t, ...) into a
        persistent (b, s, ...) buffer (Megatron's global memory buffer, one per shape and dtype);
        backward reduce_scatters the full gradient into a new (b, s/t, ...) one."""
        shape = self._sequence_shape(x.shape, self.tp)
        key = (numel(shape), x.dtype)
        buffer = self._comm_buffers.get(key)
        if buffer is None:
            buffer = self.tape.storage(f"sequence_parallel.all_gather_buffer.{x.dtype}", shape, x.dtype,
                                       COMMUNICATION_BUFFERS)
            self._comm_buffers[key] = buffer
        full = numel(shape) * DTYPE_BYTES[x.dtype]
        self._collective(name, "all_gather", full)
        self._collective(f"{name}.reduce_scatter", "reduce_scatter", full)
        kernel = Kernel("reduce_scatter", COLLECTIVE, bytes_read=full, bytes_written=x.nbytes, dtype=x.dtype,
                        grads=(Grad(0),))
        (out,) = self.tape.node(name, COLLECTIVE, (x,), ((name, shape, x.dtype),), bytes_written=full,
                                dtype=x.dtype, backward=(kernel,))
        self.tape._storages[out.id].base = buffer.id
        return out

    def gather_sequence(self, x: Ref, name: str) -> Ref:
        """gather_from_sequence_parallel_region: all_gather into a new (b, s, ...) tensor; backward
        reduce_scatters the gradient into a new shard."""
        shape = self._sequence_shape(x.shape, self.tp)
        full = numel(shape) * DTYPE_BYTES[x.dtype]
        self._collective(name, "all_gather", full)
        self._collective(f"{name}.reduce_scatter", "reduce_scatter", full)
        kernel = Kernel("reduce_scatter", COLLECTIVE, bytes_read=full, bytes_written=x.nbytes, dtype=x.dtype,
                        grads=(Grad(0),))
        (out,) = self.tape.node(name, COLLECTIVE, (x,), ((name, shape, x.dtype),), dtype=x.dtype,
                                backward=(kernel,))
        return out

    def reduce_scatter_sequence(self, x: Ref, name: str) -> Ref:
        """Sequence parallelism after a row-parallel linear: reduce_scatter (b, s, ...) partial sums
        into a new (b, s/t, ...) tensor; backward all_gathers the gradient into a new full one."""
        shape = self._sequence_shape(x.shape, 1 / self.tp)
        self._collective(name, "reduce_scatter", x.nbytes)
        self._collective(f"{name}.all_gather", "all_gather", x.nbytes)
        kernel = Kernel("all_gather", COLLECTIVE, bytes_read=x.nbytes // self.tp, bytes_written=x.nbytes,
                        dtype=x.dtype, grads=(Grad(0),))
        (out,) = self.tape.node(name, COLLECTIVE, (x,), ((name, shape, x.dtype),), dtype=x.dtype,
                                backward=(kernel,))
        return out

    def scatter_sequence(self, x: Ref, name: str) -> Ref:
        """scatter_to_sequence_parallel_region: keep this rank's s/t slice (a contiguous copy, no
        communication); backward all_gathers the gradient into a new full tensor."""
        shape = self._sequence_shape(x.shape, 1 / self.tp)
        self._collective(f"{name}.all_gather", "all_gather", x.nbytes)
        kernel = Kernel("all_gather", COLLECTIVE, bytes_read=x.nbytes // self.tp, bytes_written=x.nbytes,
                        dtype=x.dtype, grads=(Grad(0),))
        (out,) = self.tape.node(name, COPY, (x,), ((name, shape, x.dtype),), bytes_read=x.nbytes // self.tp,
                                dtype=x.dtype, backward=(kernel,))
        return out

    def vocab_parallel_embedding(self, weight: Ref, idx: Ref, name: str, reduce_scatter: bool) -> Ref:
        """VocabParallelEmbedding on a (V/t, h) shard: mask of out-of-shard ids (bool), shifted ids
        (int64, saved by the lookup), lookup, in-place zeroing of masked rows (saves the mask), then
        all_reduce of the (b, s, h) output, or reduce_scatter to (b, s/t, h) with `reduce_scatter`."""
        (mask,) = self.tape.node(f"{name}.input_mask", ELEMENTWISE, (idx,),
                                 ((f"{name}.input_mask", idx.shape, "bool"),),
                                 flops=2 * numel(idx.shape), dtype="int64", requires_grad=False)
        (shifted,) = self.tape.node(f"{name}.masked_input", ELEMENTWISE, (idx, mask),
                                    ((f"{name}.masked_input", idx.shape, idx.dtype),),
                                    flops=2 * numel(idx.shape), dtype=idx.dtype, requires_grad=False)
        out = self.embedding(weight, shifted, name)
        zero = Kernel("bwd", ELEMENTWISE, flops=numel(out.shape), bytes_read=out.nbytes + mask.nbytes,
                      bytes_written=out.nbytes, dtype=out.dtype, grads=(Grad(0),))
        (zeroed,) = self.tape.node(f"{name}.mask_output", ELEMENTWISE, (out, mask), ((f"{name}.mask_output",
                                   out.shape, out.dtype),), saves=(mask,), flops=numel(out.shape),
                                   bytes_read=out.nbytes + mask.nbytes, bytes_written=out.nbytes, dtype=out.dtype,
                                   backward=(zero,))
        self.tape._storages[zeroed.id].base = self.tape.root(out)
        if reduce_scatter:
            return self.reduce_scatter_sequence(zeroed, f"{name}.reduce_scatter")
        return self.reduce_from_tp(zeroed, f"{name}.all_reduce")

    def vocab_parallel_cross_entropy(self, logits: Ref, targets: Ref, name: str) -> Ref:
        """Megatron's _VocabParallelCrossEntropy on (rows, V/t) logits, then the mean over tokens.

        Forward: an fp32 copy of the logits (the logits themselves when already fp32: the function
        works in place), the per-token max (all_reduce MAX), the target mask and shifted targets,
        the predicted logit and the sum of exp (two all_reduce SUM); exp and division in place turn
        the copy into the softmax. Saved: the softmax (rows, V/t) fp32, the target mask (bool) and
        the shifted targets (int64). Backward writes the input gradient into the saved softmax;
        autograd then casts it to the logits' dtype (a new buffer; with fp32 logits memsim also
        counts a new buffer where Megatron reuses the softmax: an over-count of rows x V/t x 4
        bytes during that one kernel).
        """
        rows = numel(targets.shape)
        scalars = rows * DTYPE_BYTES["fp32"]
        (logits_max,) = self.tape.node(f"{name}.logits_max", SOFTMAX, (logits,),
                                       ((f"{name}.logits_max", (rows,), "fp32"),),
                                       flops=numel(logits.shape), dtype="fp32", requires_grad=False)
        self.tape.node(f"{name}.max_all_reduce", COLLECTIVE, (logits_max,), (), bytes_written=scalars,
                       dtype="fp32", requires_grad=False)
        self._collective(f"{name}.max_all_reduce", "all_reduce", scalars)
        in_place = logits.dtype == "fp32"
        n = numel(logits.shape)
        kernel = Kernel("bwd", SOFTMAX, flops=3 * n, bytes_read=n * 4 + targets.nbytes,
                        bytes_written=logits.nbytes, dtype="fp32", grads=(Grad(0),))
        softmax, _mask, _shifted, predicted, sum_exp, losses = self.tape.node(
            name, SOFTMAX, (logits, targets, logits_max),
            ((f"{name}.softmax", logits.shape, "fp32"), (f"{name}.target_mask", (rows,), "bool"),
             (f"{name}.masked_target", (rows,), "int64"), (f"{name}.predicted_logits", (rows,), "fp32"),
             (f"{name}.sum_exp_logits", (rows,), "fp32"), (f"{name}.losses", (rows,), "fp32")),
            saves=(0, 1, 2), flops=6 * n, dtype="fp32", backward=(kernel,))
        if in_place:
            self.tape._storages[softmax.id].base = self.tape.root(logits)
        for part, ref in (("predicted", predicted), ("sum_exp", sum_exp)):
            self.tape.node(f"{name}.{part}_all_reduce", COLLECTIVE, (ref,), (), bytes_written=scalars,
                           dtype="fp32", requires_grad=False)
            self._collective(f"{name}.{part}_all_reduce", "all_reduce", scalars)
        return self.reduce_mean(losses, (), f"{name}.mean")
