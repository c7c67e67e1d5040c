"""Convolutional-network ops as tape nodes (NCHW): conv2d, batch norm, in-place ReLU and add, max-pool, mean-pool.

Each function records one ATen op the way torchvision's ResNet runs it, with what autograd saves and what its
backward allocates (measured against torch 2.13 on CPU: validation/data/cpu/memory/resnet-*.json):

* conv2d (ConvolutionBackward0) saves its input and weight; one backward node computes the input gradient
  (skipped when the input needs none: the first conv) and the weight gradient. Its time is an implicit GEMM:
  M = b·Ho·Wo, N = Cout, K = Cin·kh·kw (the input gradient: M = b·H·W, N = Cin, K = Cout·kh·kw / stride²,
  the same FLOPs). fp32 convolutions on a GPU run as TF32, torch's default
  (`torch.backends.cudnn.allow_tf32 = True`); the workspace cuDNN takes from the caching allocator depends on
  the algorithm it picks at run time and is not modelled.
* batch_norm in training saves its input, the per-channel mean and inverse std (fp32) and updates the running
  statistics in place; under autocast it runs in the input's dtype (no autocast list names it).
* relu_ / add_ (torchvision's `inplace=True` ReLU and `out += identity`) allocate nothing: their output is the
  input's storage. ReLU saves that output, which is why the ReLU after a batch norm costs no memory.
* max_pool2d_with_indices saves its input and the int64 indices; adaptive_avg_pool2d to 1x1 is `mean(-1, -2)`.
"""

from __future__ import annotations

from simulator.workload.graph import BACKWARD_WEIGHT, DTYPE_BYTES, ELEMENTWISE, GEMM, NORM
from simulator.workload.primitives import Ops
from simulator.workload.tape import Grad, Kernel, Ref, numel


def _out_side(side: int, kernel: int, stride: int, padding: int) -> int:
    return (side + 2 * padding - kernel) // stride + 1


def conv2d(ops: Ops, x: Ref, w: Ref, stride: int, padding: int, name: str) -> Ref:
    """F.conv2d without bias (x: (b, Cin, H, W), w: (Cout, Cin, kh, kw)); saves x and w."""
    w = ops._autocast_weight(w, name)
    x = ops._autocast_input(x, name)
    dt = x.dtype
    b, cin, height, width = x.shape
    cout, _, kh, kw = w.shape
    ho, wo = _out_side(height, kh, stride, padding), _out_side(width, kw, stride, padding)
    out_shape = (b, cout, ho, wo)
    m, n, k = b * ho * wo, cout, cin * kh * kw
    flops = 2.0 * m * n * k
    compute = "tf32" if dt == "fp32" and ops.profile.device_kind == "gpu" else dt
    e = DTYPE_BYTES[dt]
    out_bytes = numel(out_shape) * e
    kernels = []
    if ops.tape._storages[x.id].requires_grad:
        kernels.append(Kernel("dgrad", GEMM, flops=flops, bytes_read=out_bytes + w.nbytes, bytes_written=x.nbytes,
                              dtype=compute, gemm_mnk=(b * height * width, cin, max(1, cout * kh * kw // stride ** 2)),
                              grads=(Grad(0),)))
    # The weight gradient reduces over b·Ho·Wo into a small (Cout, Cin·kh·kw) output; cuDNN's wgrad kernels split
    # that reduction across the SMs, so it is timed at the forward GEMM's shape (assumed; not measured on a GPU).
    kernels.append(Kernel("wgrad", GEMM, flops=flops, bytes_read=out_bytes + x.nbytes, bytes_written=w.nbytes,
                          dtype=compute, gemm_mnk=(m, n, k), grads=(Grad(1, dtype=dt),), phase=BACKWARD_WEIGHT))
    (out,) = ops.tape.node(name, GEMM, (x, w), ((name, out_shape, dt),), saves=(x, w), flops=flops,
                           dtype=compute, gemm_mnk=(m, n, k), bytes_read=x.nbytes + w.nbytes,
                           backward=tuple(kernels))
    return out


def batch_norm(ops: Ops, x: Ref, w: Ref, bias: Ref, name: str) -> Ref:
    """F.batch_norm in training (running statistics updated in place): output, save_mean, save_invstd (C,) fp32;
    saves x and the two statistics; backward allocates the input, weight and bias gradients."""
    channels = x.shape[1]
    stats = "fp32" if x.dtype in ("fp32", "bf16", "fp16") else x.dtype
    kernel = Kernel("bwd", NORM, flops=8 * numel(x.shape), bytes_read=2 * x.nbytes, bytes_written=x.nbytes,
                    dtype=x.dtype, grads=(Grad(0), Grad(1), Grad(2)))
    out, _mean, _invstd = ops.tape.node(
        name, NORM, (x, w, bias), ((name, x.shape, x.dtype), (f"{name}.save_mean", (channels,), stats),
                                   (f"{name}.save_invstd", (channels,), stats)),
        saves=(x, 1, 2), flops=8 * numel(x.shape), dtype=x.dtype, bytes_read=2 * x.nbytes,
        bytes_written=x.nbytes, backward=(kernel,))
    return out


def _in_place(ops: Ops, out: Ref, target: Ref) -> Ref:
    """Make `out` (a node's output) the storage of `target`: an in-place op allocates nothing."""
    ops.tape._storages[out.id].base = ops.tape.root(target)
    return out


def relu_(ops: Ops, x: Ref, name: str) -> Ref:
    """nn.ReLU(inplace=True): x.relu_(); saves its result (x's storage); backward allocates the input gradient."""
    kernel = Kernel("bwd", ELEMENTWISE, flops=numel(x.shape), bytes_read=2 * x.nbytes, bytes_written=x.nbytes,
                    dtype=x.dtype, grads=(Grad(0),))
    (out,) = ops.tape.node(name, ELEMENTWISE, (x,), ((name, x.shape, x.dtype),), saves=(0,),
                           flops=numel(x.shape), dtype=x.dtype, bytes_read=x.nbytes, bytes_written=x.nbytes,
                           backward=(kernel,))
    return _in_place(ops, out, x)


def add_(ops: Ops, x: Ref, other: Ref, name: str) -> Ref:
    """x += other (same shape and dtype): saves nothing; the gradient passes to both unchanged."""
    kernel = Kernel("bwd", ELEMENTWISE, grads=(Grad(0, alias=0), Grad(1, alias=0)))
    (out,) = ops.tape.node(name, ELEMENTWISE, (x, other), ((name, x.shape, x.dtype),), flops=numel(x.shape),
                           dtype=x.dtype, bytes_read=2 * x.nbytes, bytes_written=x.nbytes, backward=(kernel,))
    return _in_place(ops, out, x)


def max_pool2d(ops: Ops, x: Ref, kernel_size: int, stride: int, padding: int, name: str) -> Ref:
    """F.max_pool2d in training (max_pool2d_with_indices): output and int64 indices; saves x and the indices;
    backward allocates a zeroed input gradient and scatters into it."""
    b, c, height, width = x.shape
    out_shape = (b, c, _out_side(height, kernel_size, stride, padding), _out_side(width, kernel_size, stride, padding))
    n = numel(out_shape)
    e = DTYPE_BYTES[x.dtype]
    kernel = Kernel("bwd", ELEMENTWISE, flops=n, bytes_read=n * (e + 8), bytes_written=x.nbytes, dtype=x.dtype,
                    grads=(Grad(0),))
    out, _indices = ops.tape.node(
        name, ELEMENTWISE, (x,), ((name, out_shape, x.dtype), (f"{name}.indices", out_shape, "int64")),
        saves=(x, 1), flops=n * kernel_size * kernel_size, dtype=x.dtype, bytes_read=x.nbytes,
        bytes_written=n * (e + 8), backward=(kernel,))
    return out


def global_avg_pool(ops: Ops, x: Ref, name: str) -> Ref:
    """nn.AdaptiveAvgPool2d(1) then flatten: `x.mean((-1, -2), keepdim=True)` viewed as (b, C); backward expands
    the gradient and divides (a new buffer of x's shape)."""
    b, c = x.shape[:2]
    pooled = ops.reduce_mean(x, (b, c, 1, 1), name)
    return ops.tape.view(pooled, (b, c), f"{name}.flatten")


__all__ = ["conv2d", "batch_norm", "relu_", "add_", "max_pool2d", "global_avg_pool"]
