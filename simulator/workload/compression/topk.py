"""topk:F — GRACE's ``TopKCompressor`` with ``ResidualMemory`` and the ``Allgather`` communicator over Horovod
(sands-lab/grace, grace_dl/torch: compressor/topk.py, memory/residual.py, communicator/allgather.py).

There is no sparse all_reduce: every rank all_gathers the others' values and indices. Per gradient of n elements,
k = max(1, int(n F)), when the gradient is complete (Horovod's per-parameter hook, during backward):

* ``Memory.compensate``: ``beta * residual + gamma * tensor`` (two scaled copies and their sum: three kernels);
* ``sparsify``: ``torch.topk(tensor.abs(), k, sorted=False)`` and ``torch.gather`` of the values. torch's
  multi-block top-k (aten/src/ATen/native/cuda/TensorTopK.cu) is a radix select over the 32-bit keys in 8-bit
  digits, one pass over the input per digit, then a pass that gathers the k winners: five reads of the input;
* ``ResidualMemory.update``: the gradient decompressed (``torch.zeros`` + ``scatter_``) and subtracted: the new
  residual, which replaces the old one;
* two asynchronous all_gathers (Horovod's background thread, overlapped with the backward): the values in the
  gradient's dtype and the indices as int64 (``torch.topk``'s index dtype), N k elements each.

In the optimizer step (``synchronize``): for each gradient, N dense decompressions (``zeros`` + ``scatter_``, all
kept in a list), Python's ``sum`` of them (one new tensor per addition) and the division by N, which becomes the
new ``.grad``. The residuals persist (category communication_buffers: they are the compressor's, not the
optimizer's). A tensor that replaces another (the residual, ``.grad``) is freed right after it is made, which
leaves the same bytes allocated as the release of the one it replaces.
"""

from __future__ import annotations

from simulator.workload.compression import BucketParam, GradientCodec
from simulator.workload.compression.kernels import Kernels
from simulator.workload.graph import BACKWARD_INPUT, DTYPE_BYTES, OPTIMIZER_STEP, OVERLAPPED, Tensor
from simulator.workload.optimizers import IdSource

INDEX_DTYPE = "int64"          # torch.topk's indices, sent as they are
RADIX_PASSES = 4               # 32-bit keys in 8-bit digits
INDEX_BYTES = DTYPE_BYTES[INDEX_DTYPE]


def selected(numel: int, fraction: float) -> int:
    """k of GRACE's ``sparsify``: max(1, int(numel x fraction))."""
    return max(1, int(numel * fraction))


def topk_codec(fraction: float, dp: int, params: list[BucketParam], grad_dtype: str, ids: IdSource,
               tensors: dict[int, Tensor]) -> GradientCodec:
    """Per gradient: compress at its landing, all_gather (overlapped), decompress in the optimizer step."""
    e = DTYPE_BYTES[grad_dtype]
    codec = GradientCodec()
    persistent: list[int] = []
    step: list = []
    for p in params:
        n, kk = p.numel, selected(p.numel, fraction)
        land = Kernels(f"topk.{p.name}", ids, tensors, BACKWARD_INPUT)
        residual = land.tensor("residual", n, grad_dtype, persistent=True)
        persistent.append(residual)
        scaled_residual = land.unary("beta_residual", n, e, e, out="beta_residual", out_dtype=grad_dtype)
        scaled_grad = land.unary("gamma_grad", n, e, e, out="gamma_grad", out_dtype=grad_dtype)
        compensated = land.tensor("compensated", n, grad_dtype)
        land.kernel("compensate", 2 * n * e, n * e, flops=float(n), allocs=(compensated,),
                    frees=(scaled_residual, scaled_grad))
        magnitude = land.unary("abs", n, e, e, out="abs", out_dtype=grad_dtype)
        values = land.tensor("topk_values", kk, grad_dtype)
        indices = land.tensor("indices", kk, INDEX_DTYPE)
        land.kernel("topk", (RADIX_PASSES + 1) * n * e, kk * (e + INDEX_BYTES), flops=(RADIX_PASSES + 1.0) * n,
                    allocs=(values, indices), frees=(magnitude,))
        sent = land.tensor("values", kk, grad_dtype)
        land.kernel("gather", kk * (INDEX_BYTES + e), kk * e, allocs=(sent,), frees=(values,))
        dense = land.unary("decompress.zeros", n, 0, e, out="decompressed", out_dtype=grad_dtype, flops_per=0.0)
        land.kernel("decompress.scatter", kk * (INDEX_BYTES + e), kk * e)
        new_residual = land.tensor("new_residual", n, grad_dtype)
        land.kernel("residual", 2 * n * e, n * e, flops=float(n), allocs=(new_residual,),
                    frees=(dense, compensated, new_residual))
        got_values = land.tensor("gathered_values", dp * kk, grad_dtype)
        got_indices = land.tensor("gathered_indices", dp * kk, INDEX_DTYPE)
        land.collective("all_gather_values", "all_gather", dp * kk * e, OVERLAPPED, allocs=(got_values,),
                        frees=(sent,), inputs=(sent,), dtype=grad_dtype)
        land.collective("all_gather_indices", "all_gather", dp * kk * INDEX_BYTES, OVERLAPPED,
                        allocs=(got_indices,), frees=(indices,), inputs=(indices,), dtype=INDEX_DTYPE)
        codec.landing_ops[p.id] = tuple(land.ops)
        k = Kernels(f"topk.{p.name}", ids, tensors, OPTIMIZER_STEP)
        parts = []
        for r in range(dp):
            parts.append(k.unary(f"rank{r}.zeros", n, 0, e, out=f"rank{r}.dense", out_dtype=grad_dtype,
                                 flops_per=0.0))
            k.kernel(f"rank{r}.scatter", kk * (INDEX_BYTES + e), kk * e, inputs=(got_values, got_indices))
        total = k.unary("sum0", n, e, e, out="sum0", out_dtype=grad_dtype)
        for r in range(1, dp):
            total = k.unary(f"sum{r}", n, 2 * e, e, out=f"sum{r}", out_dtype=grad_dtype, frees=(total,))
        mean = k.tensor("mean", n, grad_dtype)
        k.kernel("divide", n * e, n * e, flops=float(n), allocs=(mean,),
                 frees=(total, mean, got_values, got_indices) + tuple(parts))
        step += k.ops
    codec.persistent = tuple(persistent)
    codec.step_ops = tuple(step)
    return codec
