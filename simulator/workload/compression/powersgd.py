"""powersgd:R — torch's ``powerSGD_hook`` (torch/distributed/algorithms/ddp_comm_hooks/powerSGD_hook.py, torch 2.13)
on each DDP bucket, with PowerSGDState's defaults (use_error_feedback, warm_start, min_compression_rate = 2,
orthogonalization_epsilon = 0, batch_tensors_with_same_shape = False).

Compressed stage (iteration >= start_powerSGD_iter), per bucket of B bytes:

* each gradient is viewed as an (n, m) matrix (n = its first dimension); with r = min(n, m, R) it is compressed
  when (n + m) r x 2 < n m (`_should_compress`); vectors and small matrices are sent uncompressed;
* the hook adds the bucket's error (``error_dict``), clones the bucket, concatenates the uncompressed tensors,
  orthogonalises every Q (kept from the last iteration: warm start), computes P = M Q (``torch.bmm``) and
  all_reduces the uncompressed tensors; its future callbacks copy them back, all_reduce the P factors,
  orthogonalise them, compute Q = M^T P, all_reduce the Q factors and decompress M = P Q^T into the bucket, then
  store the new error (the clone minus the result).
* ``decompress`` calls ``torch.cuda.synchronize(device)`` and NCCL futures complete when enqueued, so the callbacks
  run inside the hook call: the autograd thread, and with it the backward, waits for the whole chain. memsim runs
  the chain on the compute stream with every collective waited for at once.
* orthogonalisation: Gram-Schmidt column by column for r <= 2 (norm, divide, and for all but the last column a
  product, a sum, a product and a subtraction: torch's `_orthogonalize_gram_schmidt`); QR for r > 2 in fp32
  (``torch.linalg.qr``: a Householder factorisation and the forming of Q, 2 m r^2 - 2 r^3 / 3 flops each).

State kept across iterations (category communication_buffers, they belong to the hook, not the optimizer): the
error (B bytes), the P and Q memories (sum of n r and m r elements). Warm-up stage (iteration < start_powerSGD_iter):
``default._allreduce_fut``, the bucket divided by N then all_reduced as plain DDP does (overlapped), no state.
"""

from __future__ import annotations

from simulator.workload.compression import BucketParam, Compression, GradientCodec
from simulator.workload.compression.kernels import Kernels
from simulator.workload.graph import BACKWARD_INPUT, BLOCKING, DTYPE_BYTES, Tensor
from simulator.workload.optimizers import IdSource

MIN_COMPRESSION_RATE = 2      # PowerSGDState default


def matrix_of(p: BucketParam) -> tuple[int, int]:
    """The (n, m) matrix the hook views a gradient as: ``tensor.view(tensor.shape[0], -1)``."""
    rows = p.shape[0] if p.shape else p.numel
    return rows, p.numel // rows if rows else 0


def compressed(n: int, m: int, rank: int) -> tuple[bool, int]:
    """(whether the hook compresses an n x m matrix at this rank, the rank it uses): `_should_compress`."""
    r = min(n, m, rank)
    return (n + m) * r * MIN_COMPRESSION_RATE < n * m, r


def _orthogonalize(k: Kernels, name: str, rows: int, r: int, dtype: str) -> None:
    """`_orthogonalize` of one (1, rows, r) matrix, kernel by kernel."""
    e = DTYPE_BYTES[dtype]
    if r > 2 and dtype == "fp32":
        small = k.tensor(f"{name}.qr_r", r * r, dtype)
        flops = 2.0 * rows * r * r - 2.0 * r ** 3 / 3.0
        k.kernel(f"{name}.geqrf", rows * r * e, rows * r * e + r * r * e, flops=flops, allocs=(small,))
        k.kernel(f"{name}.orgqr", rows * r * e, rows * r * e, flops=flops, frees=(small,))
        return
    for i in range(r):
        norm = k.tensor(f"{name}.norm{i}", 1, dtype)
        k.kernel(f"{name}.col{i}.norm", rows * e, e, flops=2.0 * rows, allocs=(norm,))
        k.kernel(f"{name}.col{i}.div", rows * e, rows * e, flops=float(rows), frees=(norm,))
        rest = r - i - 1
        if rest:
            product = k.unary(f"{name}.col{i}.mul", rows * rest, 2 * e, e, out=f"{name}.prod{i}", out_dtype=dtype)
            total = k.tensor(f"{name}.sum{i}", rest, dtype)
            k.kernel(f"{name}.col{i}.sum", rows * rest * e, rest * e, flops=float(rows * rest), allocs=(total,),
                     frees=(product,))
            scaled = k.unary(f"{name}.col{i}.scale", rows * rest, e, e, out=f"{name}.scaled{i}", out_dtype=dtype,
                             frees=(total,))
            k.unary(f"{name}.col{i}.sub", rows * rest, 2 * e, e, frees=(scaled,))


def powersgd_codec(compression: Compression, dp: int, buckets: list[list[BucketParam]], grad_dtype: str,
                   bucket_buffers: list[int | None], ids: IdSource, tensors: dict[int, Tensor]) -> GradientCodec:
    """The hook's ops for each bucket (module docstring); warm-up stage: divide, then the overlapped all_reduce."""
    e = DTYPE_BYTES[grad_dtype]
    codec = GradientCodec()
    persistent: list[int] = []
    for index, bucket in enumerate(buckets):
        numel = sum(p.numel for p in bucket)
        nbytes = numel * e
        buffer = bucket_buffers[index]
        inputs = (buffer,) if buffer is not None else ()
        k = Kernels(f"powersgd.bucket{index}", ids, tensors, BACKWARD_INPUT)
        if not compression.compressing:
            k.unary("div", numel, e, e)
            k.collective("all_reduce", "all_reduce", nbytes, "", inputs=inputs, dtype=grad_dtype)
            codec.bucket_ops[index] = tuple(k.ops)
            continue
        matrices = []          # (param, n, m, r) of the compressed gradients, in bucket order
        plain: list[BucketParam] = []
        for p in bucket:
            n, m = matrix_of(p)
            worth, r = compressed(n, m, compression.rank)
            if worth:
                matrices.append((p, n, m, r))
            else:
                plain.append(p)
        plain_numel = sum(p.numel for p in plain)
        error = k.tensor("error", numel, grad_dtype, persistent=True)
        p_memory = k.tensor("p_memory", sum(n * r for _, n, _, r in matrices), grad_dtype, persistent=True)
        q_memory = k.tensor("q_memory", sum(m * r for _, _, m, r in matrices), grad_dtype, persistent=True)
        persistent += [error, p_memory, q_memory]
        # The hook body (autograd thread, compute stream).
        k.kernel("add_error", 2 * nbytes, nbytes, flops=float(numel), inputs=inputs + (error,))
        copy = k.unary("clone", numel, e, e, out="input_copy", out_dtype=grad_dtype)
        # torch.cat of the uncompressed tensors (an empty tensor, no kernel, when there are none).
        gathered = k.unary("cat_uncompressed", plain_numel, e, e, out="uncompressed", out_dtype=grad_dtype) \
            if plain else None
        temps = (copy,) + ((gathered,) if gathered is not None else ())
        for p, n, m, r in matrices:
            _orthogonalize(k, f"{p.name}.q", m, r, grad_dtype)
        for p, n, m, r in matrices:
            k.gemm(f"{p.name}.p_bmm", n, r, m, grad_dtype)
        k.collective("all_reduce_uncompressed", "all_reduce", plain_numel * e, BLOCKING, inputs=temps[1:],
                     dtype=grad_dtype)
        # unpack_uncompressed_tensors_and_allreduce_ps
        if plain:
            k.unary("uncompressed.div", plain_numel, e, e)
        for p in plain:
            k.unary(f"{p.name}.copy_back", p.numel, e, e)
        k.collective("all_reduce_p", "all_reduce", tensors[p_memory].nbytes, BLOCKING, inputs=(p_memory,),
                     dtype=grad_dtype)
        # compute_qs
        for p, n, m, r in matrices:
            _orthogonalize(k, f"{p.name}.p", n, r, grad_dtype)
        for p, n, m, r in matrices:
            k.gemm(f"{p.name}.q_bmm", m, r, n, grad_dtype)
        k.collective("all_reduce_q", "all_reduce", tensors[q_memory].nbytes, BLOCKING, inputs=(q_memory,),
                     dtype=grad_dtype)
        # decompress
        k.unary("q.div", tensors[q_memory].nbytes // e, e, e)
        for p, n, m, r in matrices:
            k.gemm(f"{p.name}.decompress_bmm", n, m, r, grad_dtype)
        # error_dict[bucket] = input_tensor_cp - input_tensor: the new error replaces the old one (freed at once
        # here, which leaves the same bytes allocated), the clone and the concatenation are released.
        new_error = k.tensor("new_error", numel, grad_dtype)
        k.kernel("error_feedback", 2 * nbytes, nbytes, flops=float(numel), allocs=(new_error,),
                 frees=(new_error,) + temps)
        codec.bucket_ops[index] = tuple(k.ops)
    codec.persistent = tuple(persistent)
    return codec
