"""ZeRO-3 offload (DeepSpeed stage3.py): the optimizer on the host or NVMe (ZeRO-Infinity), parameters on the host or
NVMe between uses, fetched ahead by DeepSpeed's prefetch bucket.

What DeepSpeed does (deepspeed/runtime/zero/stage3.py, partition_parameters.py) and what this pass makes of a ZeRO-3
rank's workload (workload/data_parallel.py), with `pin_memory: true` and its other defaults:

* The rank's flat partition is split into sub-groups of SUB_GROUP_ELEMENTS (zero config `sub_group_size`); per
  sub-group the host holds the fp32 master (`fp32_partitioned_groups_flat`, pinned) and its fp32 gradient, and
  DeepSpeedCPUAdam's moments (pageable, made at the first step); one fp32 gradient buffer of the whole partition
  (`grad_partitions_flat_buffer`, on the optimizer's device: the host, pinned). With `offload_optimizer = nvme` the
  master, its gradient and the moments live on the drives instead and OPTIMIZER_SWAP_BUFFERS pinned fp32 buffers of a
  sub-group stage them (offload_optimizer `buffer_count`).
* Backward: after each bucket's reduce_scatter (on the reduce stream: ZeRO-3's overlap_comm defaults to true),
  partition_grads copies the rank's share into the host gradient buffer (`grad_buffer.copy_(grad_partition,
  non_blocking=True)`: converted to fp32 on the GPU, 4 bytes per element D2H), brings it back to the GPU
  (`grad_buffer.to(device)`: 4 bytes H2D) and copies it into the fp32 master gradient (4 bytes D2H). With NVMe the
  last copy lands in a pinned swap buffer and is written to the drives (swap_out_gradients: 4 bytes).
* Step, sub-group by sub-group on the host (NVMe: swap the master, moments and gradient in, 16 bytes per element):
  unscale_and_clip_grads (8 bytes per element), DeepSpeedCPUAdam (28), the fp32 -> 16-bit conversion of the
  blocking `fp16_partitioned_groups_flat[i].data.copy_(fp32 ...)` (6, on the CPU), then its copy: H2D into the GPU
  partition (2 bytes), or nothing more when parameters are offloaded to the host, or a write to the drives (2 bytes)
  when they are on NVMe; NVMe optimizer: the master and moments written back (12 bytes).
* Offloaded parameters: the 16-bit partition is on the host (pinned, one flat buffer per sub-group) or on the drives
  (with PARAM_SWAP_BUFFERS pinned buffers of PARAM_SWAP_BUFFER_ELEMENTS, offload_param's defaults). Every segment's
  all_gather is preceded by an H2D copy of its shards (NVMe: read into a swap buffer first) on a copy stream, issued
  when the segments fetched ahead of it hold fewer than `prefetch_bucket_elements` elements (stage3_prefetch_bucket_size;
  0: right before its gather, nothing hidden); the gather waits for it and frees the copied shards.
Not modelled: the host thread blocking on the synchronous copies (the engine is GPU-bound), the GPU conversion
kernels' time (their temporaries are counted), pipelined swapping (`pipeline_read`/`pipeline_write`, off by default).
"""

from __future__ import annotations

from dataclasses import replace

from simulator.offload.host_memory import NVME, PAGEABLE, PINNED, HostTensor
from simulator.offload.optimizer import HOST_STREAM, after_reductions, strip_gpu_optimizer, transfer_op, wait_op
from simulator.offload.state import ADAM, ADAM_HOST_BYTES_PER_ELEMENT, STREAM, HostState, OffloadConfig
from simulator.workload.graph import (BACKWARD_INPUT, COLLECTIVE, DTYPE_BYTES, GRADIENTS, HOST, OPTIMIZER_STATES,
                                      OPTIMIZER_STEP, OTHER, PARAMETERS, Op, Tensor)
from simulator.workload.loss_scaler import kept_with_offload

SUB_GROUP_ELEMENTS = 1_000_000_000     # DeepSpeed zero config `sub_group_size` default (1e9)
OPTIMIZER_SWAP_BUFFERS = 4             # offload_optimizer `buffer_count` default
PARAM_SWAP_BUFFERS = 5                 # offload_param `buffer_count` default
PARAM_SWAP_BUFFER_ELEMENTS = 100_000_000   # offload_param `buffer_size` default (1e8)
FETCH_STREAM = "offload.fetch"         # parameter fetches (partition_parameters' all-gather handles)


def sub_groups(elements: int) -> list[int]:
    """Element counts of the sub-groups of a partition of `elements` (the last one the rest)."""
    full, rest = divmod(elements, SUB_GROUP_ELEMENTS)
    return [SUB_GROUP_ELEMENTS] * full + ([rest] if rest else [])


def fetch_distance(numels: list[int], j: int, bucket: int) -> int:
    """How many gathers before gather `j` its parameters are fetched: while the gathers in between hold fewer than
    `bucket` elements (DeepSpeed's prefetch loop, `numel_prefetching < prefetch_bucket_size`); 0 when bucket is 0."""
    if bucket <= 0:
        return 0
    distance, ahead = 1, 0
    while j - distance - 1 >= 0:
        ahead += numels[j - distance]
        if ahead >= bucket:
            break
        distance += 1
    return min(distance, j)


def _host_op(name: str, kernel: str, read: int, written: int) -> Op:
    return Op(name, HOST, OPTIMIZER_STEP, bytes_read=read, bytes_written=written, dtype="fp32", collective=kernel,
              group=HOST_STREAM)


def offload_zero3(workload, config: OffloadConfig, ids, host: HostState):
    """The ZeRO-3 workload with its optimizer and (config.params) parameters offloaded (module docstring).

    Args:
        workload: the rank's IterationWorkload after data parallelism with zero_stage 3 (framework deepspeed).
        config: the rank's offload options and host rates.
        ids: the workload's tensor IdSource.
        host: the rank's HostState, filled here.

    Returns:
        A new IterationWorkload.
    """
    dts = workload.meta["dtypes"]
    p16, dp, shard = DTYPE_BYTES[dts.param], workload.meta["dp"], workload.meta["dp_shard_numel"]
    tensors, grad_shards = strip_gpu_optimizer(workload)
    nvme_optimizer, params = config.optimizer == "nvme", config.params
    state_medium = NVME if nvme_optimizer else PINNED
    groups = sub_groups(shard)

    def host_tensor(name: str, nbytes: int, category: str, medium: str, when: str = "persistent") -> int:
        return host.add(HostTensor(ids(), name, nbytes, category, medium), when)

    host_tensor("offload.grad_partitions_flat_buffer", 4 * shard, GRADIENTS, PINNED)
    for k, n in enumerate(groups):
        host_tensor(f"offload.fp32_partitioned_groups_flat.{k}", 4 * n, OPTIMIZER_STATES, state_medium)
        host_tensor(f"offload.fp32_partitioned_groups_flat.{k}.grad", 4 * n, GRADIENTS, state_medium)
        for moment in ("exp_avg", "exp_avg_sq"):
            host_tensor(f"offload.cpu_adam.{k}.{moment}", 4 * n, OPTIMIZER_STATES,
                        NVME if nvme_optimizer else PAGEABLE, "persistent" if nvme_optimizer else "first_step")
        if params != "none":
            host_tensor(f"offload.fp16_partitioned_groups_flat.{k}", p16 * n, PARAMETERS,
                        NVME if params == "nvme" else PINNED)
    for k in range(OPTIMIZER_SWAP_BUFFERS if nvme_optimizer else 0):
        host_tensor(f"offload.optimizer_swap_buffer.{k}", 4 * max(groups), OPTIMIZER_STATES, PINNED)
    for k in range(PARAM_SWAP_BUFFERS if params == "nvme" else 0):
        host_tensor(f"offload.param_swap_buffer.{k}", p16 * PARAM_SWAP_BUFFER_ELEMENTS, PARAMETERS, PINNED)

    def copies(op: Op, elements: int) -> list[Op]:
        temp = Tensor(ids(), f"{op.name}.grad_buffer", 4 * elements, OTHER, "fp32", (elements,))
        tensors[temp.id] = temp
        common = {"layer": op.layer, "microbatch": op.microbatch}
        out = [transfer_op(f"{op.name}.to_grad_buffer", "d2h", 4 * elements, BACKWARD_INPUT, "dp", **common),
               transfer_op(f"{op.name}.grad_buffer_to_gpu", "h2d", 4 * elements, BACKWARD_INPUT, "dp",
                           allocs=(temp.id,), **common),
               transfer_op(f"{op.name}.to_fp32_grad", "d2h", 4 * elements, BACKWARD_INPUT, "dp", frees=(temp.id,),
                           **common)]
        if nvme_optimizer:
            out.append(transfer_op(f"{op.name}.swap_out_gradients", "nvme_write", 4 * elements, BACKWARD_INPUT, "dp",
                                   **common))
        return out

    persistent = workload.persistent
    param_ids: set[int] = set()

    def fetched(ops: list[Op]) -> list[Op]:
        gathers = [i for i, op in enumerate(ops) if op.op_class == COLLECTIVE and op.collective == "all_gather"]
        numels = [ops[i].comm_bytes // p16 for i in gathers]
        ahead: dict[int, list[Op]] = {}
        for j, index in enumerate(gathers):
            op = ops[index]
            param_ids.update(op.inputs)
            nbytes = -(-op.comm_bytes // dp)
            temp = Tensor(ids(), f"{op.name}.fetched_shards", nbytes, PARAMETERS, dts.param, (nbytes // p16,))
            tensors[temp.id] = temp
            fetch = [transfer_op(f"{op.name}.fetch", "h2d", nbytes, op.phase, FETCH_STREAM, allocs=(temp.id,),
                                 layer=op.layer, microbatch=op.microbatch)]
            if params == "nvme":
                fetch.insert(0, transfer_op(f"{op.name}.swap_in", "nvme_read", nbytes, op.phase, FETCH_STREAM,
                                            layer=op.layer, microbatch=op.microbatch))
            ahead.setdefault(gathers[j - fetch_distance(numels, j, config.prefetch_bucket_elements)], []).extend(fetch)
            ops[index] = replace(op, frees=op.frees + (temp.id,))
        out: list[Op] = []
        for i, op in enumerate(ops):
            out += ahead.get(i, ())
            if i in gathers:
                out.append(wait_op(f"wait:{op.name}.fetch", FETCH_STREAM, op.phase))
            out.append(op)
        return out

    def rewrite(ops: list[Op]) -> list[Op]:
        ops = after_reductions(ops, grad_shards, dp, copies)
        return fetched(list(ops)) if params != "none" else ops

    first, later, last = (rewrite(ops) for ops in (workload.first_microbatch, workload.later_microbatch,
                                                    workload.last_microbatch))
    if params != "none":
        persistent = tuple(t for t in persistent if t not in param_ids)    # the 16-bit shards live off the GPU
    step = kept_with_offload(workload.optimizer)
    for k, n in enumerate(groups):
        if nvme_optimizer:
            step.append(transfer_op(f"offload.sub_group{k}.swap_in", "nvme_read", 16 * n, OPTIMIZER_STEP, HOST_STREAM))
        step += [_host_op(f"offload.sub_group{k}.unscale_and_clip_grads", STREAM, 4 * n, 4 * n),
                 _host_op(f"offload.sub_group{k}.cpu_adam", ADAM, 16 * n, (ADAM_HOST_BYTES_PER_ELEMENT - 16) * n),
                 _host_op(f"offload.sub_group{k}.fp32_to_fp16", STREAM, 4 * n, p16 * n)]
        if params == "none":
            step.append(transfer_op(f"offload.sub_group{k}.fp16_to_gpu", "h2d", p16 * n, OPTIMIZER_STEP, HOST_STREAM))
        elif params == "nvme":
            step.append(transfer_op(f"offload.sub_group{k}.swap_out_params", "nvme_write", p16 * n, OPTIMIZER_STEP,
                                    HOST_STREAM))
        if nvme_optimizer:
            step.append(transfer_op(f"offload.sub_group{k}.swap_out", "nvme_write", 12 * n, OPTIMIZER_STEP,
                                    HOST_STREAM))
    step.append(wait_op("offload.wait_host_step", HOST_STREAM, OPTIMIZER_STEP))
    host.caps = {ADAM: config.adam_bytes_per_s, STREAM: config.stream_bytes_per_s}
    meta = dict(workload.meta)
    meta["offload_optimizer"] = config.optimizer
    return replace(workload, tensors=tensors, persistent=persistent, optimizer_state_ids=(), first_microbatch=first,
                   later_microbatch=later, last_microbatch=last, optimizer=step,
                   gradients=tuple(t for t in workload.gradients if t not in grad_shards), meta=meta, host=host)
