"""ZeRO-Offload: the optimizer states and step of a ZeRO-2 rank on the host (DeepSpeed stage_1_and_2.py, cpu_offload).

What DeepSpeed does, and what this pass makes of a ZeRO-2 rank's workload (workload/data_parallel.py):

* Host tensors (DeepSpeedZeroOptimizer.__init__, `pin_memory: true`): the fp32 master partition
  (`single_partition_of_fp32_groups`, pinned), its fp32 gradient (`.grad`, pinned, made in
  initialize_optimizer_states), a 16-bit copy of the partition (`param_buffer_of_bit16_for_cpu_offload_groups`,
  pinned; DeepSpeed PR #7309) and a 16-bit buffer of the largest parameter (`temp_grad_buffer_for_cpu_offload`,
  pinned); DeepSpeedCPUAdam's exp_avg and exp_avg_sq (fp32, pageable: torch.zeros_like at the first step). On the
  GPU: the largest parameter's 16-bit `temp_grad_buffer_for_gpu_offload`; no master, moments or gradient shard.
* Backward: after each bucket's reduction (reduce_ipg_grads, on the reduction stream with overlap_comm) every
  parameter's share is converted to fp32 on the GPU (`.to(fp32)`, a temporary) and copied to the host fp32
  gradient (async_inplace_copy_grad_to_fp32_buffer_from_gpu, non_blocking). Here: one D2H transfer per bucket of its
  fp32 bytes on the data-parallel stream, holding the largest parameter's fp32 temporary meanwhile (the per-parameter
  copies run back to back on one stream: one flow of their total size takes the same time but their route latency,
  0.6 us each; the conversion kernels' time is not modelled, their memory is).
* Step (step, cpu_offload branch), after the reduction stream is synchronised: unscale_and_clip_grads scales the
  fp32 gradient in place (host, 8 bytes per element), DeepSpeedCPUAdam updates the partition (host, 28 bytes per
  element), the updated fp32 partition is converted into the 16-bit host buffer (host, 6 bytes per element) and
  copied into the GPU's 16-bit partition (H2D, non_blocking on the current stream: the compute stream runs it);
  then the partitions are all_gathered (dp > 1).
"""

from __future__ import annotations

from dataclasses import replace

from simulator.offload.host_memory import PAGEABLE, PINNED, HostTensor
from simulator.offload.state import ADAM, ADAM_HOST_BYTES_PER_ELEMENT, STREAM, HostState, OffloadConfig
from simulator.workload.graph import (BACKWARD_INPUT, COLLECTIVE, COMMUNICATION_BUFFERS, DTYPE_BYTES, GRADIENTS, HOST,
                                      OPTIMIZER_STATES, OPTIMIZER_STEP, OTHER, PARAMETERS, TRANSFER, WAIT, Op, Tensor)
from simulator.workload.loss_scaler import kept_with_offload

HOST_STREAM = "host"         # the stream the host's work runs on (one CPU thread pool, in order)


def _host_op(name: str, kernel: str, read: int, written: int) -> Op:
    return Op(name, HOST, OPTIMIZER_STEP, bytes_read=read, bytes_written=written, dtype="fp32",
              collective=kernel, group=HOST_STREAM)


def transfer_op(name: str, route: str, nbytes: int, phase: str, placement: str = "", *, allocs=(), frees=(),
                host_allocs=(), host_frees=(), layer: int = -1, microbatch: int = 0, inputs=()) -> Op:
    """An op of class TRANSFER: `nbytes` over `route` on `placement` ("" the compute stream)."""
    return Op(name, TRANSFER, phase, bytes_read=nbytes, bytes_written=nbytes, dtype="uint8", inputs=tuple(inputs),
              allocs=tuple(allocs), frees=tuple(frees), layer=layer, microbatch=microbatch, collective=route,
              group=placement, comm_bytes=nbytes, host_allocs=tuple(host_allocs), host_frees=tuple(host_frees))


def wait_op(name: str, placement: str, phase: str) -> Op:
    """The compute stream waits for the last transfer posted on `placement` (graph.WAIT)."""
    return Op(name, TRANSFER, phase, dtype="uint8", collective=WAIT, group=placement)


def offload_optimizer(workload, config: OffloadConfig, largest_param_numel: int, ids, host: HostState):
    """The ZeRO-2 workload (apply_data_parallel's) with its optimizer on the host (module docstring).

    Args:
        workload: the rank's IterationWorkload after data parallelism with zero_stage 2 (framework deepspeed).
        config: the rank's offload options and host rates.
        largest_param_numel: elements of the largest parameter this rank holds (DeepSpeed's temporary buffers).
        ids: the workload's tensor IdSource (new device and host tensors take ids from it).
        host: the rank's HostState, filled here.

    Returns:
        A new IterationWorkload.
    """
    dts = workload.meta["dtypes"]
    param_bytes, dp = DTYPE_BYTES[dts.param], workload.meta["dp"]
    shard = workload.meta["dp_shard_numel"]
    tensors, grad_shards = strip_gpu_optimizer(workload)

    def host_tensor(name: str, nbytes: int, category: str, medium: str, when: str) -> int:
        return host.add(HostTensor(ids(), name, nbytes, category, medium), when)

    host_tensor("offload.fp32_partition", 4 * shard, OPTIMIZER_STATES, PINNED, "persistent")
    host_tensor("offload.fp32_partition.grad", 4 * shard, GRADIENTS, PINNED, "persistent")
    host_tensor("offload.bit16_partition_buffer", param_bytes * shard, PARAMETERS, PINNED, "persistent")
    host_tensor("offload.temp_grad_buffer_for_cpu_offload", param_bytes * largest_param_numel, GRADIENTS, PINNED,
                "persistent")
    host_tensor("offload.cpu_adam.exp_avg", 4 * shard, OPTIMIZER_STATES, PAGEABLE, "first_step")
    host_tensor("offload.cpu_adam.exp_avg_sq", 4 * shard, OPTIMIZER_STATES, PAGEABLE, "first_step")
    gpu_buffer = Tensor(ids(), "offload.temp_grad_buffer_for_gpu_offload", param_bytes * largest_param_numel,
                        COMMUNICATION_BUFFERS, dts.param, (largest_param_numel,), persistent=True)
    tensors[gpu_buffer.id] = gpu_buffer
    largest_share = -(-largest_param_numel // dp)

    def copies(op: Op, elements: int) -> list[Op]:
        temp = Tensor(ids(), f"{op.name}.to_fp32", 4 * largest_share, OTHER, "fp32", (largest_share,))
        tensors[temp.id] = temp
        return [transfer_op(f"{op.name}.grad_to_host", "d2h", 4 * elements, BACKWARD_INPUT, "dp",
                            allocs=(temp.id,), frees=(temp.id,), layer=op.layer, microbatch=op.microbatch)]

    def with_copies(ops: list[Op]) -> list[Op]:
        return after_reductions(ops, grad_shards, dp, copies)

    step = kept_with_offload(workload.optimizer)
    step += [_host_op("offload.unscale_and_clip_grads", STREAM, 4 * shard, 4 * shard),
             _host_op("offload.cpu_adam", ADAM, 16 * shard, (ADAM_HOST_BYTES_PER_ELEMENT - 16) * shard),
             _host_op("offload.fp32_to_bit16", STREAM, 4 * shard, param_bytes * shard),
             wait_op("offload.wait_host_step", HOST_STREAM, OPTIMIZER_STEP),
             transfer_op("offload.bit16_partition_to_gpu", "h2d", param_bytes * shard, OPTIMIZER_STEP)]
    step += [op for op in workload.optimizer if op.op_class == COLLECTIVE]     # ZeRO-2's all_gather of partitions
    host.caps = {ADAM: config.adam_bytes_per_s, STREAM: config.stream_bytes_per_s}
    meta = dict(workload.meta)
    meta["offload_optimizer"] = "cpu"
    return replace(workload, tensors=tensors, persistent=workload.persistent + (gpu_buffer.id,),
                   optimizer_state_ids=(), first_microbatch=with_copies(workload.first_microbatch),
                   later_microbatch=with_copies(workload.later_microbatch),
                   last_microbatch=with_copies(workload.last_microbatch), optimizer=step,
                   gradients=tuple(t for t in workload.gradients if t not in grad_shards), meta=meta, host=host)


def strip_gpu_optimizer(workload) -> tuple[dict, set[int]]:
    """The workload's tensors without its GPU optimizer states, step temporaries and ZeRO gradient shard (now on the
    host), and the shard's ids."""
    tensors = dict(workload.tensors)
    old_states = set(workload.optimizer_state_ids) | {t for op in workload.optimizer for t in op.allocs}
    grad_shards = set(workload.gradients)
    for tid in old_states | grad_shards:
        tensors.pop(tid, None)
    return tensors, grad_shards


def after_reductions(ops: list[Op], grad_shards: set[int], dp: int, copies) -> list[Op]:
    """`ops` with every data-parallel gradient reduction no longer allocating the GPU gradient shard and followed by
    `copies(reduction op, elements of this rank's share)`."""
    out: list[Op] = []
    for op in ops:
        out.append(op)
        if op.op_class == COLLECTIVE and op.group == "dp" and op.phase == BACKWARD_INPUT \
                and op.collective in ("reduce_scatter", "all_reduce"):
            out[-1] = op = replace(op, allocs=tuple(t for t in op.allocs if t not in grad_shards),
                                   outputs=tuple(t for t in op.outputs if t not in grad_shards))
            out += copies(op, -(-(op.comm_bytes // DTYPE_BYTES[op.dtype]) // dp))
    return out
