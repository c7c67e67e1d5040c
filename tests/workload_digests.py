"""Digests of op lists, to pin that new options leave the one-device workload unchanged."""

from __future__ import annotations

import hashlib

# Op-list digests (names, classes, phases, alloc and free sizes, persistent and lazily allocated tensors)
# of two small models on a GPU, as the one-device builder makes them: tp = dp = 1 must reproduce them
# exactly. Set before tensor and data parallelism existed (commit b7f9421); updated deliberately for the
# behaviour measured on an H200 and on CPU (validation/data/cuda, validation/data/cpu: loss under CUDA
# autocast, reduction staging, cuDNN attention's RNG tensors and workspace, in-place gradient accumulation,
# the weight gradient first without a bias, both cuBLAS workspaces at their first GEMM, autocast type
# promotion in RoPE and attention, the softmax conversion copy and its GPU backward temporary; AdamW's
# kernels one by one as the H200 profile of validation/data/cuda-large shows them).
SINGLE_DEVICE_DIGESTS = {
    "gpt": "fd82b83bb471a9de1c7852704ab89a035ffab423f4ad0d859d627ddf33e71b78",
    "llama": "7712528f4a0d056639f7e2d0f7532cc32bc32f404fe342dabd890bab85a489f6",
}


def workload_digest(workload) -> str:
    """sha256 of what a workload allocates and frees, op by op, and of its persistent tensors."""
    rows = [(op.name, op.op_class, op.phase, tuple(workload.tensors[i].nbytes for i in op.allocs),
             tuple(workload.tensors[i].nbytes for i in op.frees))
            for op in workload.first_microbatch + workload.later_microbatch + workload.optimizer]
    persistent = [(workload.tensors[i].name, workload.tensors[i].nbytes) for i in workload.persistent]
    lazy = [(name, tuple(workload.tensors[i].nbytes for i in ids)) for name, ids in workload.first_use]
    return hashlib.sha256(repr((rows, persistent, lazy)).encode()).hexdigest()
