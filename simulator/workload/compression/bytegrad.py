"""int8: Bagua's ByteGrad in its flat mode (``ByteGradAlgorithm(hierarchical=False)``), per gradient bucket.

Bagua (BaguaSys/bagua, rust/bagua-core/bagua-core-internal/src/comm_ops/centralized_low_precision_synchronous.rs)
runs, on its communication stream, for each flattened bucket of n elements padded to a multiple of the world size
N (``BaguaBucket(alignment=world_size)``), chunk c = n / N:

1. compress the bucket to N MinMax-uint8 chunks (a min/max reduction per chunk, then the quantisation);
2. all_to_all the compressed buffer (rank r receives everyone's chunk r);
3. decompress the N received chunks into the bucket, average them into chunk r (``reduce_mean_inplace``);
4. compress chunk r alone; all_gather the compressed buffer; decompress all N chunks into the bucket.

A compressed buffer is ``MinMaxUInt8CompressionParameters::get_compressed_buffer_size``: per chunk the uint8
values padded to 32 bytes plus 32 bytes holding the fp32 min and max (datatypes/mod.rs). Both compressed buffers
come from Bagua's device memory pool and live until the bucket is done; memsim allocates them through the
allocator model. The temporary storage of the min/max reduction (cub, a few kB) is not counted.

The gradients themselves live in the flattened buckets (persistent, category gradients): with Bagua there is no
DDP bucket copy and no `.grad` to free at zero_grad (workload/training.py gives int8 the persistent layout).
"""

from __future__ import annotations

from simulator.workload.compression import BucketParam, GradientCodec
from simulator.workload.compression.kernels import Kernels, align
from simulator.workload.graph import BACKWARD_INPUT, DTYPE_BYTES, ON_COMM_STREAM, OVERLAPPED, Tensor
from simulator.workload.optimizers import IdSource

ALIGN_BYTES = 32            # MinMaxUInt8CompressionParameters: every chunk and its header are 32-byte aligned
HEADER_BYTES = 2 * 4        # a chunk's fp32 min and max


def compressed_bytes(chunk_numel: int, chunks: int) -> int:
    """Bytes of a compressed buffer of `chunks` chunks of `chunk_numel` elements (Bagua's formula)."""
    return chunks * (align(chunk_numel, ALIGN_BYTES) + align(HEADER_BYTES, ALIGN_BYTES))


def bytegrad_codec(dp: int, buckets: list[list[BucketParam]], grad_dtype: str, ids: IdSource,
                   tensors: dict[int, Tensor]) -> GradientCodec:
    """Each bucket's compress / all_to_all / average / all_gather / decompress, on the communication stream."""
    e = DTYPE_BYTES[grad_dtype]
    codec = GradientCodec()
    for index, bucket in enumerate(buckets):
        numel = align(sum(p.numel for p in bucket), dp)
        chunk = numel // dp
        wire = compressed_bytes(chunk, dp)
        grads = tuple(p.grad for p in bucket if p.grad is not None)
        k = Kernels(f"bytegrad.bucket{index}", ids, tensors, BACKWARD_INPUT, placement=ON_COMM_STREAM)
        first = k.tensor("compressed", wire, "uint8")
        # The min/max reduction reads the bucket, the quantisation reads it again and writes the chunks.
        k.kernel("compress", 2 * numel * e, wire, flops=3.0 * numel, allocs=(first,), inputs=grads)
        k.collective("all_to_all", "all_to_all", wire, OVERLAPPED, inputs=(first,))
        k.kernel("decompress", wire, numel * e, flops=2.0 * numel, inputs=(first,))
        k.kernel("reduce_mean", numel * e, chunk * e, flops=float(numel))
        second = k.tensor("compressed_chunk", wire, "uint8")
        k.kernel("compress_chunk", 2 * chunk * e, compressed_bytes(chunk, 1), flops=3.0 * chunk, allocs=(second,))
        k.collective("all_gather", "all_gather", wire, OVERLAPPED, inputs=(second,))
        k.kernel("decompress_gathered", wire, numel * e, flops=2.0 * numel, frees=(first, second), inputs=(second,))
        codec.bucket_ops[index] = tuple(k.ops)
    return codec
