"""Digests of op lists, to pin that new options leave the one-device workload unchanged."""

from __future__ import annotations

import hashlib

# Op-list digests (names, classes, phases, alloc and free sizes, persistent tensors) of two small
# models as built before tensor and data parallelism existed (commit b7f9421): tp = dp = 1 must
# reproduce them exactly.
SINGLE_DEVICE_DIGESTS = {
    "gpt": "51319770d19b20bba68a6ac3a5d6f52fbfebc0d7c259ad391f4333912410c8da",
    "llama": "075ef3703aaf85e1cc4a7b178d85d5cea23e8f8dbd154a0a3ca64f6a7e840e53",
}


def workload_digest(workload) -> str:
    """sha256 of what a workload allocates and frees, op by op, and of its persistent tensors."""
    rows = [(op.name, op.op_class, op.phase, tuple(workload.tensors[i].nbytes for i in op.allocs),
             tuple(workload.tensors[i].nbytes for i in op.frees))
            for op in workload.first_microbatch + workload.later_microbatch + workload.optimizer]
    persistent = [(workload.tensors[i].name, workload.tensors[i].nbytes) for i in workload.persistent]
    return hashlib.sha256(repr((rows, persistent)).encode()).hexdigest()
