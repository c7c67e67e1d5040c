"""Global-memory staging of PyTorch's CUDA reduction kernel when it sums a (rows, width) tensor over its rows.

A bias gradient (``grad_output.sum(0)``) or a norm weight's gradient is such a column reduction. When each
output has many rows to sum, torch's reduction config (aten/src/ATen/native/cuda/Reduce.cuh,
``setReduceConfig``) splits the rows over several thread blocks per output ("ctas_per_output"); their partial
sums go through a staging buffer and a semaphore array that the caching allocator hands out and takes back
around the kernel. The buffer is large -- 48 MiB for a 768-wide bias over 8,192 rows, up to ~140 MiB -- so
it changes which cached blocks later requests find, and thus reserved memory.

The sizes follow the config logic for contiguous outputs (outputs vectorized by 4 when the width allows) and
match every one of 135 measured (dtype, rows, width) cases on an H200 (validation/data/cuda/reductions.json,
tests/test_reductions.py). The accumulator is 4 bytes (float) for fp32, bf16 and fp16 inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_REDUCE_THREADS = 512       # threads per block of the reduction kernel (non-complex types)
WARP = 32
MIN_VALUES_PER_THREAD = 16
MAX_VALUES_PER_THREAD = 256
ACC_BYTES = 4                  # float accumulator of fp32 / bf16 / fp16 sums
SEMAPHORE_BYTES = 4            # one int per output block column


@dataclass(frozen=True)
class Staging:
    """The transient buffers one column reduction allocates (0 bytes: no cross-block reduction)."""

    buffer_bytes: int
    semaphore_bytes: int


NO_STAGING = Staging(0, 0)


def _last_pow2(n: int) -> int:
    return max(1, 1 << (int(n).bit_length() - 1))


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def column_sum_staging(rows: int, width: int, sm_count: int, max_threads_per_sm: int) -> Staging:
    """Staging bytes of summing a contiguous (rows, width) tensor over its rows on an NVIDIA GPU.

    Args:
        rows: the reduced extent (tokens of the micro-batch for a bias gradient).
        width: the number of outputs (the bias length).
        sm_count: multiprocessors of the GPU.
        max_threads_per_sm: resident threads per multiprocessor (0: not modelled, no staging).
    """
    if rows <= 0 or width <= 0 or max_threads_per_sm <= 0 or sm_count <= 0:
        return NO_STAGING
    vec = 4 if width % 4 == 0 else 2 if width % 2 == 0 else 1
    max_threads = MAX_REDUCE_THREADS // vec
    dim0, dim1 = width // vec, rows
    dim0_pow2 = _last_pow2(dim0) if dim0 < max_threads else max_threads
    dim1_pow2 = _last_pow2(dim1) if dim1 < max_threads else max_threads
    block_width = min(dim0_pow2, WARP)
    block_height = min(dim1_pow2, max_threads // block_width)
    block_width = min(dim0_pow2, max_threads // block_height)
    num_threads = block_width * block_height
    # Outputs are spread over the lanes of a warp; rows over the warps of a block when each thread keeps enough.
    if rows < min(block_height * 16, MAX_VALUES_PER_THREAD):
        return NO_STAGING
    values_per_thread = _ceil_div(rows, block_height)
    grid_x = _ceil_div(_ceil_div(width, vec), block_width)
    target_grid = sm_count * (max_threads_per_sm // num_threads)
    if values_per_thread < MAX_VALUES_PER_THREAD or grid_x > target_grid:
        return NO_STAGING
    ctas = max(min(_ceil_div(target_grid, grid_x), _ceil_div(values_per_thread, MIN_VALUES_PER_THREAD)),
               _ceil_div(values_per_thread, MAX_VALUES_PER_THREAD))
    if ctas <= 1:
        return NO_STAGING
    return Staging(ACC_BYTES * width * ctas * block_width * vec, SEMAPHORE_BYTES * grid_x)
