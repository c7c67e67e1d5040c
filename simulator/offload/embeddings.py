"""A DLRM's embedding tables in host memory (`model.embedding_placement = "host"`): lookups over PCIe, update on the host.

What the "CPU embedding layer" of dlrm_s_pytorch (tables on the CPU, the MLPs on the GPU) does each micro-batch,
and what this pass adds to the rank's workload (workload/dlrm.py leaves the pooled vectors as a GPU leaf):

* Host tensors: every table (fp32, pageable, category parameters) and, with `adamw`, SparseAdam's dense exp_avg
  and exp_avg_sq (pageable, allocated at the first step; SGD keeps no state). A pinned staging buffer holds the
  pooled (b, T·d) vectors on their way to the GPU and one holds their gradient on the way back (torch's pinned
  caching host allocator: reserved once, reused).
* Forward, first: the host gathers b·L rows of every table and sums them per sample (a host kernel at the rank's
  share of the CPU's streaming rate, on the host stream); the GPU waits for it, then copies the pooled vectors in
  (H2D on the compute stream, the copy `pooled.to(device)` makes).
* Backward, right after the interaction's backward yields the pooled vectors' gradient: D2H of that gradient on the
  compute stream (`.grad.cpu()`), then, on the host stream while the GPU finishes the backward, the sparse update:
  each looked-up row reads its gradient share and is read and written (with adamw also both moments). The GPU waits
  for the host before the optimizer step (the next lookup must see updated rows).
Every byte moved is a flow on the GPU's PCIe route to its host memory, sharing it with any other traffic there.
"""

from __future__ import annotations

from dataclasses import replace

from simulator.offload.host_memory import PAGEABLE, PINNED, HostTensor
from simulator.offload.optimizer import HOST_STREAM, transfer_op, wait_op
from simulator.offload.state import STREAM, HostState, OffloadConfig
from simulator.workload.graph import ACTIVATIONS, BACKWARD_INPUT, FORWARD, GRADIENTS, HOST, OPTIMIZER_STATES, PARAMETERS, Op

STATE_TENSORS = {"sgd": (), "adamw": ("exp_avg", "exp_avg_sq")}   # SparseAdam keeps two dense moments per table
GRADIENT_OP = "interaction.cat.bwd"     # the backward op that yields the pooled vectors' gradient (workload/dlrm.py)


def _host_op(name: str, phase: str, read: int, written: int, *, host_allocs=(), host_frees=(), microbatch=0) -> Op:
    return Op(name, HOST, phase, bytes_read=read, bytes_written=written, dtype="fp32", collective=STREAM,
              group=HOST_STREAM, host_allocs=tuple(host_allocs), host_frees=tuple(host_frees), microbatch=microbatch)


def offload_embeddings(workload, config: OffloadConfig, optimizer: str, ids, host: HostState):
    """The DLRM workload with its tables on the host (module docstring).

    Args:
        workload: the rank's IterationWorkload; meta["host_embeddings"] = (DLRMShape, micro-batch size).
        config: the rank's offload options and host rates.
        optimizer: training.optimizer (what the host keeps per table).
        ids: the workload's tensor IdSource.
        host: the rank's HostState, filled here.
    """
    shape, b = workload.meta["host_embeddings"]
    e = 4                                                    # fp32 tables
    for k, rows in enumerate(shape.rows):
        host.add(HostTensor(ids(), f"emb_l.{k}.weight", rows * shape.dim * e, PARAMETERS, PAGEABLE), "persistent")
        for state in STATE_TENSORS[optimizer]:
            host.add(HostTensor(ids(), f"emb_l.{k}.{state}", rows * shape.dim * e, OPTIMIZER_STATES, PAGEABLE),
                     "first_step")
    pooled = b * shape.tables * shape.dim * e
    rows_bytes = b * shape.tables * shape.lookups * shape.dim * e
    index_bytes = b * shape.tables * shape.lookups * 8
    passes = 1 + len(STATE_TENSORS[optimizer])               # the row and each moment: read and written
    staging_in = host.add(HostTensor(ids(), "embeddings.pooled.pinned", pooled, ACTIVATIONS, PINNED), "")
    staging_out = host.add(HostTensor(ids(), "embeddings.grad.pinned", pooled, GRADIENTS, PINNED), "")

    def with_host(ops: list[Op]) -> list[Op]:
        if not ops:
            return ops
        mb = ops[0].microbatch
        out = [_host_op("embeddings.gather_and_pool", FORWARD, rows_bytes + index_bytes, pooled,
                        host_allocs=(staging_in,), microbatch=mb),
               wait_op("embeddings.wait_lookup", HOST_STREAM, FORWARD),
               transfer_op("embeddings.pooled_to_gpu", "h2d", pooled, FORWARD, host_frees=(staging_in,),
                           microbatch=mb)]
        for op in ops:
            out.append(op)
            if op.name == GRADIENT_OP:
                out += [transfer_op("embeddings.grad_to_host", "d2h", pooled, BACKWARD_INPUT, host_allocs=(staging_out,),
                                    microbatch=mb),
                        _host_op("embeddings.sparse_update", BACKWARD_INPUT, pooled + index_bytes + passes * rows_bytes,
                                 passes * rows_bytes, host_frees=(staging_out,), microbatch=mb)]
        return out

    host.caps = dict(host.caps, **{STREAM: config.stream_bytes_per_s})
    meta = dict(workload.meta)
    meta["embedding_placement"] = "host"
    return replace(workload, first_microbatch=with_host(workload.first_microbatch),
                   later_microbatch=with_host(workload.later_microbatch),
                   last_microbatch=with_host(workload.last_microbatch), meta=meta)
