"""2:4 semi-structured sparsity in training: torchao's ``SemiSparseLinear`` on the MLP linears of every block.

torchao (pytorch/ao, torchao/sparsity/training: ``SemiSparseLinear``, ``semi_structured_sparsify``) keeps the dense
weight as the parameter the optimizer updates, and in every forward prunes it to 2:4 and compresses it
(``torch._sparse_semi_structured_tile``: the packed weight, its packed transpose and a bitmask), then runs
``F.linear`` on the sparse tensor: the forward GEMM (x W^T) and the input gradient (dY W) run on the sparse
tensor cores, the weight gradient (dY^T x) is dense and passes straight through to the dense weight. Its
ViT-Large recipe sparsifies the MLP linears, as memsim does here.

Bytes of a compressed (m, k) weight of e-byte elements: the kept half of the values, m k e / 2, and the metadata,
a 2-bit position per kept value, m k / 8 bytes (torch's CUTLASS layout: an int16 of metadata per 16 dense
elements, torch/sparse/_semi_structured_conversions.py ``sparse_semi_structured_from_dense_cutlass``; cuSPARSELt
keeps values and metadata in one buffer, ``SparseSemiStructuredTensorCUSPARSELT``, whose size the library
reports and may pad). For bf16: 1.125 bytes per weight element instead of 2. The bitmask holds a bit per dense
element (m k / 8 bytes). The forward saves the sparse tensor (both packs and the bitmask) for its backward:
in training 2:4 adds memory, it does not save any, because the dense weight stays.

The sparse GEMMs run at `DeviceSpec.sparse_gemm_speedup` times the dense tensor rate (2 on Ampere, Ada and
Hopper: their datasheets' "with sparsity" figures), with the dense GEMM's shape efficiency (assumed: no
measurement of sparse GEMMs was made).
"""

from __future__ import annotations

from simulator.errors import PlanError
from simulator.workload.graph import BACKWARD_WEIGHT, DTYPE_BYTES, ELEMENTWISE, GEMM, SPARSE_GEMM
from simulator.workload.tape import Grad, Kernel, Ref, numel

SHAPE_MULTIPLE = 16     # cuSPARSELt's bf16/fp16 constraint on a sparse operand's rows and columns


def compressed_weight_bytes(rows: int, cols: int, dtype: str) -> int:
    """Bytes of one compressed 2:4 copy of a (rows, cols) weight: kept values plus metadata."""
    dense = rows * cols
    return dense * DTYPE_BYTES[dtype] // 2 + dense // 8


def check_sparsity(sparsity: str, *, precision: str, tp: int, device: str, speedup: float,
                   mlp_shapes: list[tuple[int, int]]) -> None:
    """Refuse a 2:4 setting that torchao's semi-structured training cannot run (one line naming the keys).

    Raises:
        PlanError: not bf16, tensor parallelism, a device without sparse tensor cores and kernels, a shape off
            cuSPARSELt's multiple of 16.
    """
    if sparsity == "none":
        return
    value = f"training.sparsity = {sparsity!r}"
    if precision != "bf16":
        raise PlanError(f"{value} sparsifies 16-bit weights in every forward (torchao SemiSparseLinear on a bf16 "
                        f"model): it needs training.precision = 'bf16' (is {precision!r})")
    if tp > 1:
        raise PlanError(f"{value} with parallel.tp = {tp}: Megatron-LM's sharded linears have no 2:4 path; "
                        f"allowed: tp = 1")
    if speedup <= 1.0:
        raise PlanError(f"{value}: device {device!r} has no sparse tensor cores that torch's 2:4 kernels (CUTLASS, "
                        f"cuSPARSELt) run on; NVIDIA Ampere, Ada and Hopper GPUs have them")
    for rows, cols in mlp_shapes:
        if rows % SHAPE_MULTIPLE or cols % SHAPE_MULTIPLE:
            raise PlanError(f"{value}: an MLP weight of shape ({rows}, {cols}) is not a multiple of "
                            f"{SHAPE_MULTIPLE} in both dimensions, which cuSPARSELt's 16-bit sparse operands need")


def sparse_linear(ops, x: Ref, w: Ref, bias: Ref | None, name: str) -> Ref:
    """``F.linear(x, semi_structured_sparsify(w), bias)`` for a bf16 x and w: the per-forward compression, the
    sparse forward GEMM, a sparse input-gradient GEMM and a dense weight-gradient GEMM (module docstring)."""
    tape = ops.tape
    out_features, in_features = w.shape
    dt = x.dtype
    e = DTYPE_BYTES[dt]
    packed_bytes = compressed_weight_bytes(out_features, in_features, w.dtype)
    mask_bytes = out_features * in_features // 8
    packed, packed_t, bitmask = tape.node(
        f"{name}.sparsify", ELEMENTWISE, (w,),
        ((f"{name}.packed", (packed_bytes,), "uint8"), (f"{name}.packed_t", (packed_bytes,), "uint8"),
         (f"{name}.bitmask", (mask_bytes,), "uint8")),
        flops=4.0 * out_features * in_features, bytes_read=w.nbytes,
        bytes_written=2 * packed_bytes + mask_bytes, dtype=w.dtype, requires_grad=False)
    rows = numel(x.shape[:-1])
    flops = 2.0 * rows * in_features * out_features
    out_shape = x.shape[:-1] + (out_features,)
    wgrads = [Grad(1, dtype=dt)] + ([Grad(2)] if bias is not None else [])
    bias_workspace = ops.profile.column_sum_workspace(rows, out_features) if bias is not None else ()
    kernels = (
        Kernel("dgrad", SPARSE_GEMM, flops=flops, bytes_read=rows * out_features * e + packed_bytes,
               bytes_written=rows * in_features * e, dtype=dt, gemm_mnk=(rows, in_features, out_features),
               grads=(Grad(0, dtype=dt),)),
        Kernel("wgrad", GEMM, flops=flops, bytes_read=rows * out_features * e + x.nbytes,
               bytes_written=out_features * in_features * e, dtype=dt, gemm_mnk=(out_features, in_features, rows),
               grads=tuple(wgrads), phase=BACKWARD_WEIGHT, workspace=bias_workspace),
    )
    inputs = (x, w) + ((bias,) if bias is not None else ())
    (out,) = tape.node(name, SPARSE_GEMM, inputs, ((name, out_shape, dt),), saves=(x, packed, packed_t, bitmask),
                       flops=flops, bytes_read=x.nbytes + packed_bytes + (bias.nbytes if bias is not None else 0),
                       dtype=dt, gemm_mnk=(rows, out_features, in_features), backward=kernels)
    tape.hold(packed, packed_t, bitmask)       # the sparse tensor object lives until the linear returns
    return out
