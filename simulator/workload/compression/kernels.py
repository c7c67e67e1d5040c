"""A codec's kernels as ops: elementwise passes, GEMMs and collectives with the temporaries they allocate and free."""

from __future__ import annotations

from dataclasses import dataclass, field

from simulator.workload.graph import (
    COLLECTIVE, COMMUNICATION_BUFFERS, DTYPE_BYTES, ELEMENTWISE, GEMM, ON_COMM_STREAM, Op, Tensor,
)
from simulator.workload.optimizers import IdSource

GROUP = "dp"


def align(value: int, multiple: int) -> int:
    """`value` rounded up to a multiple of `multiple`."""
    return -(-value // multiple) * multiple


@dataclass
class Kernels:
    """Appends one codec's ops in program order and registers the tensors they name in `tensors`.

    Every op gets `phase` and `placement`; tensors default to `category`. Sizes are bytes, counts elements.
    """

    prefix: str
    ids: IdSource
    tensors: dict[int, Tensor]
    phase: str
    placement: str = ""
    category: str = COMMUNICATION_BUFFERS
    ops: list[Op] = field(default_factory=list)

    def tensor(self, name: str, numel: int, dtype: str, *, persistent: bool = False, category: str | None = None,
               nbytes: int | None = None) -> int:
        """A new tensor of `numel` elements of `dtype` (or `nbytes` bytes); returns its id."""
        size = numel * DTYPE_BYTES[dtype] if nbytes is None else nbytes
        t = Tensor(self.ids(), f"{self.prefix}.{name}", size, category or self.category, dtype, (numel,),
                   persistent=persistent)
        self.tensors[t.id] = t
        return t.id

    def kernel(self, name: str, read_bytes: float, write_bytes: float, *, flops: float = 0.0,
               allocs: tuple[int, ...] = (), frees: tuple[int, ...] = (), inputs: tuple[int, ...] = (),
               dtype: str = "fp32", op_class: str = ELEMENTWISE, placement: str | None = None) -> Op:
        """One kernel that reads and writes device memory (bytes), allocating `allocs` first, freeing `frees` after."""
        where = self.placement if placement is None else placement
        op = Op(f"{self.prefix}.{name}", op_class, self.phase, flops=float(flops), bytes_read=int(read_bytes),
                bytes_written=int(write_bytes), dtype=dtype, inputs=inputs, outputs=allocs, allocs=allocs,
                frees=frees, group=GROUP if where == ON_COMM_STREAM else "", placement=where)
        self.ops.append(op)
        return op

    def gemm(self, name: str, m: int, n: int, k: int, dtype: str, *, allocs: tuple[int, ...] = (),
             frees: tuple[int, ...] = ()) -> Op:
        """A matmul of an (m x k) by a (k x n) matrix into (m x n), each operand read once."""
        e = DTYPE_BYTES[dtype]
        op = Op(f"{self.prefix}.{name}", GEMM, self.phase, flops=2.0 * m * n * k, bytes_read=(m * k + k * n) * e,
                bytes_written=m * n * e, dtype=dtype, gemm_mnk=(m, n, k), allocs=allocs, outputs=allocs,
                frees=frees, placement=self.placement)
        self.ops.append(op)
        return op

    def collective(self, name: str, kind: str, size_bytes: int, placement: str, *, allocs: tuple[int, ...] = (),
                   frees: tuple[int, ...] = (), inputs: tuple[int, ...] = (), dtype: str = "uint8") -> Op:
        """A data-parallel collective of `size_bytes` in nccl-tests' convention (all_gather: its output; all_to_all:
        the send buffer; all_reduce: the buffer)."""
        op = Op(f"{self.prefix}.{name}", COLLECTIVE, self.phase, bytes_read=int(size_bytes),
                bytes_written=int(size_bytes), dtype=dtype, inputs=inputs, outputs=allocs, allocs=allocs,
                frees=frees, collective=kind, group=GROUP, comm_bytes=int(size_bytes), placement=placement)
        self.ops.append(op)
        return op

    def unary(self, name: str, numel: int, in_bytes: int, out_bytes: int, *, out: str | None = None,
              out_dtype: str = "fp32", frees: tuple[int, ...] = (), flops_per: float = 1.0) -> int | None:
        """An elementwise pass over `numel` elements reading `in_bytes` and writing `out_bytes` per element; with
        `out`, into a new tensor of that name (its id is returned), else in place."""
        allocs = (self.tensor(out, numel, out_dtype),) if out is not None else ()
        self.kernel(name, numel * in_bytes, numel * out_bytes, flops=flops_per * numel, allocs=allocs, frees=frees)
        return allocs[0] if allocs else None
