"""Digests of op lists, to pin that new options leave the one-device workload unchanged."""

from __future__ import annotations

import hashlib

# Op-list digests (names, classes, phases, alloc and free sizes, persistent and lazily allocated tensors)
# of two small models on a GPU, as the one-device builder makes them: tp = dp = 1 must reproduce them
# exactly. Set before tensor and data parallelism existed (commit b7f9421); updated deliberately for the
# behaviour measured on an H200 and on CPU (validation/data/cuda, validation/data/cpu: loss under CUDA
# autocast, reduction staging, cuDNN attention's RNG tensors and workspace, in-place gradient accumulation,
# the weight gradient first without a bias, both cuBLAS workspaces at their first GEMM, autocast type
# promotion in RoPE and attention, the softmax conversion copy and its GPU backward temporary).
SINGLE_DEVICE_DIGESTS = {
    "gpt": "91fc6eabfd8911ad8c05b927d1621fd78fa937925a1fe78ef07580f03f824a01",
    "llama": "44a00d416a0b7df442e840735c1986438efd8b49f7d1e9f0cb305a8a842aabd6",
}


def workload_digest(workload) -> str:
    """sha256 of what a workload allocates and frees, op by op, and of its persistent tensors."""
    rows = [(op.name, op.op_class, op.phase, tuple(workload.tensors[i].nbytes for i in op.allocs),
             tuple(workload.tensors[i].nbytes for i in op.frees))
            for op in workload.first_microbatch + workload.later_microbatch + workload.optimizer]
    persistent = [(workload.tensors[i].name, workload.tensors[i].nbytes) for i in workload.persistent]
    lazy = [(name, tuple(workload.tensors[i].nbytes for i in ids)) for name, ids in workload.first_use]
    return hashlib.sha256(repr((rows, persistent, lazy)).encode()).hexdigest()
