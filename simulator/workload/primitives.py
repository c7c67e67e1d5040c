"""PyTorch ops as tape nodes: what each allocates, saves for backward, and its backward kernels cost.

Each method mirrors one ATen op (or a short composite written the way the reference models write
it) on the device's kernels (`KernelProfile`): on CPU a dropout mask has the input's dtype and SDPA
with dropout falls back to the math path; on CUDA the mask is a bool and flash supports dropout.
Shapes are tuples; `b, s, h` = micro-batch, sequence, hidden.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from simulator.workload.graph import (
    ATTENTION,
    BACKWARD_WEIGHT,
    COLLECTIVE,
    COPY,
    DTYPE_BYTES,
    ELEMENTWISE,
    EMBEDDING,
    GEMM,
    NORM,
    OTHER,
    PARAMETERS,
    SOFTMAX,
)
from simulator.workload.reductions import column_sum_staging
from simulator.workload.tape import FLOAT_DTYPES, Grad, Kernel, Ref, Tape, numel
from simulator.workload.tp_ops import CollectiveSpec, TensorParallelOps, annotate_collectives

__all__ = ["KernelProfile", "Ops", "CollectiveSpec", "annotate_collectives", "promote_types"]


@dataclass(frozen=True)
class KernelProfile:
    """Device-dependent kernel behaviour that changes what autograd saves."""

    dropout_mask_dtype: str = "bool"       # "bool" (CUDA fused dropout) or "input" (CPU: input dtype)
    flash_with_dropout: bool = True        # CUDA flash supports dropout; CPU SDPA falls back to math
    device_kind: str = "gpu"
    library_workspace_bytes: int = 0       # cuBLAS workspace, allocated through the caching allocator
    backward_workspace_bytes: int = 0      # the autograd thread's cuBLAS workspace (CUDA backward)
    sm_count: int = 0                      # with max_threads_per_sm: sizes CUDA reductions' staging buffers
    max_threads_per_sm: int = 0            # 0: no staging modelled (CPU, ROCm)

    def column_sum_workspace(self, rows: int, width: int) -> tuple[tuple[tuple[int, ...], str], ...]:
        """The transient (shape, dtype) buffers of summing a (rows, width) gradient over its rows."""
        staging = column_sum_staging(rows, width, self.sm_count, self.max_threads_per_sm)
        return tuple(((n,), "uint8") for n in (staging.buffer_bytes, staging.semaphore_bytes) if n)


def promote_types(a: str, b: str) -> str:
    """torch.result_type of two tensor operands: the wider float (fp32 over bf16/fp16; bf16 with fp16 is fp32);
    a float over a non-float; otherwise the first operand's dtype."""
    if a == b:
        return a
    if a in FLOAT_DTYPES and b in FLOAT_DTYPES:
        return "fp32"
    if b in FLOAT_DTYPES:
        return b
    return a


def _ew_kernel(suffix: str, out: Ref, reads: int, grads: tuple[Grad, ...], flops_per: float = 1.0,
               phase: str | None = None) -> Kernel:
    n = numel(out.shape)
    written = sum(numel(g.shape or out.shape) * DTYPE_BYTES[g.dtype or out.dtype] for g in grads
                  if g.alias is None)
    kwargs = {"phase": phase} if phase else {}
    return Kernel(suffix, ELEMENTWISE, flops=flops_per * n, bytes_read=reads, bytes_written=written,
                  dtype=out.dtype, grads=grads, **kwargs)


class Ops(TensorParallelOps):
    """Records PyTorch ops on a tape with autocast and device-kernel semantics.

    With `tp` > 1 it also records Megatron-LM's tensor-parallel communication (see the
    "tensor parallelism" section): `collectives` maps the name of every communication op to its
    CollectiveSpec, and `comm_buffers` holds the persistent all_gather buffers of sequence
    parallelism (Megatron's global memory buffer), to be allocated with the parameters.
    """

    def __init__(self, tape: Tape, profile: KernelProfile, autocast_dtype: str | None = None,
                 fp8_linear: bool = False, tp: int = 1, sequence_parallel: bool = False,
                 comm_buffers: dict[tuple[int, str], Ref] | None = None):
        self.tape = tape
        self.profile = profile
        tape.inplace_grad_accumulation = profile.device_kind == "gpu"
        self.autocast = autocast_dtype
        # fp8-mixed (Transformer Engine style): linears cast weights (cached) and inputs (saved) to fp8.
        self.fp8 = fp8_linear
        self._cast_cache: dict[tuple[int, str], Ref] = {}
        self.tp = tp
        self.sp = sequence_parallel and tp > 1     # Megatron turns sequence parallelism off at tp = 1
        self.collectives: dict[str, CollectiveSpec] = {}
        self._comm_buffers: dict[tuple[int, str], Ref] = {} if comm_buffers is None else comm_buffers
        # PEFT (workload/peft.py): linears save and compute only what the gradients required need.
        self.frozen_aware = False

    # ---------------------------------------------------------------- storages
    def param(self, name: str, shape: tuple[int, ...], dtype: str) -> Ref:
        return self.tape.storage(name, shape, dtype, PARAMETERS, requires_grad=True, is_param=True)

    def buffer(self, name: str, shape: tuple[int, ...], dtype: str) -> Ref:
        return self.tape.storage(name, shape, dtype, OTHER)

    def clear_autocast_cache(self) -> None:
        """Autocast's weight-cast cache is dropped when the outermost autocast region exits."""
        self._cast_cache = {}

    # ---------------------------------------------------------------- casts
    def cast(self, x: Ref, dtype: str, name: str) -> Ref:
        """x.to(dtype): a copy (nothing saved); backward casts the gradient back (a new buffer)."""
        if x.dtype == dtype:
            return x
        (out,) = self.tape.node(name, COPY, (x,), ((name, x.shape, dtype),), backward=(
            Kernel("bwd", COPY, bytes_read=numel(x.shape) * DTYPE_BYTES[dtype],
                   bytes_written=x.nbytes, dtype=dtype, grads=(Grad(0),)),))
        return out

    def _autocast_weight(self, w: Ref, name: str, dtype: str | None = None) -> Ref:
        """Autocast casts a leaf weight once per region and caches the copy (it is also saved)."""
        dtype = dtype or self.autocast
        if dtype is None or w.dtype == dtype:
            return w
        cached = self._cast_cache.get((w.id, dtype))
        if cached is None:
            cached = self.cast(w, dtype, f"{name}.autocast")
            self.tape.keep_until_end(cached)
            self._cast_cache[(w.id, dtype)] = cached
        return cached

    def _autocast_input(self, x: Ref, name: str) -> Ref:
        if self.autocast is None or x.dtype == self.autocast:
            return x
        return self.cast(x, self.autocast, f"{name}.autocast_input")

    def autocast_operand(self, x: Ref, name: str) -> Ref:
        """The operand a lower-precision autocast op (matmul, SDPA) sees: a float tensor of another dtype is
        cast to the autocast dtype (a copy with x's layout, alive until the op returns; saved where the op
        saves its inputs), anything else passes unchanged."""
        if self.autocast is None or x.dtype == self.autocast or x.dtype not in FLOAT_DTYPES:
            return x
        return self.cast(x, self.autocast, f"{name}.autocast")

    # ---------------------------------------------------------------- dense
    def linear(self, x: Ref, w: Ref, bias: Ref | None, name: str, saved_shard: Ref | None = None) -> Ref:
        """F.linear: y = x @ w.T + bias; saves x and w; backward = dgrad (+ wgrad, bias grad).

        `saved_shard` (sequence parallelism, Megatron's LinearWithGradAccumulationAndAsyncCommunication):
        x is the all_gathered input; the linear saves the sequence shard instead and all_gathers it
        again at the start of its backward (into the same persistent buffer).
        """
        # Autocast casts the bias, then the weight (both cached for the region), then the input.
        if bias is not None:
            bias = self._autocast_weight(bias, f"{name}.bias")
        w = self._autocast_weight(w, name, "fp8" if self.fp8 else None)
        x = self._autocast_input(x, name)
        dt = x.dtype                       # output and gradient dtype
        compute = dt
        if self.fp8:
            x = self.cast(x, "fp8", f"{name}.fp8_input")   # the fp8 copy is what backward keeps
            compute = "fp8"
        out_features, in_features = w.shape
        rows = numel(x.shape[:-1])
        flops = 2.0 * rows * in_features * out_features
        e = DTYPE_BYTES[dt]
        out_shape = x.shape[:-1] + (out_features,)
        wgrads = [Grad(1, dtype=dt)] + ([Grad(2)] if bias is not None else [])
        # The bias gradient is grad_output summed over the rows: a CUDA column reduction with staging buffers.
        bias_workspace = self.profile.column_sum_workspace(rows, out_features) if bias is not None else ()
        kernels = (
            Kernel("dgrad", GEMM, flops=flops, bytes_read=rows * out_features * e + w.nbytes,
                   bytes_written=rows * in_features * e, dtype=compute,
                   gemm_mnk=(rows, in_features, out_features), grads=(Grad(0, dtype=dt),)),
            Kernel("wgrad", GEMM, flops=flops, bytes_read=rows * out_features * e + x.nbytes,
                   bytes_written=out_features * in_features * e, dtype=compute,
                   gemm_mnk=(out_features, in_features, rows), grads=tuple(wgrads),
                   phase=BACKWARD_WEIGHT, workspace=bias_workspace),
        )
        if bias is None and self.tp == 1:
            # Without a bias F.linear is a matmul whose autograd node (MmBackward0) computes the weight's
            # gradient before the input's (measured on CPU, torch 2.13, and CUDA, torch 2.11); addmm (with a
            # bias) and Megatron's tensor-parallel linears compute the input's first.
            kernels = kernels[::-1]
        if saved_shard is not None:
            regather = Kernel("all_gather_input", COLLECTIVE, bytes_read=saved_shard.nbytes,
                              bytes_written=x.nbytes, dtype=x.dtype)
            self._collective(f"{name}.all_gather_input", "all_gather", x.nbytes)
            kernels = (regather,) + kernels
        inputs = (x, w) + ((bias,) if bias is not None else ())
        saved = (x if saved_shard is None else saved_shard, w)
        if self.frozen_aware:
            # Autograd saves a matmul operand only for the other operand's gradient and computes only the
            # gradients required (a frozen weight: no wgrad, x not saved; an input without grad: no dgrad).
            st = self.tape._storages
            x_grad, w_grad = st[x.id].requires_grad, st[w.id].requires_grad
            saved = ((x,) if w_grad else ()) + ((w,) if x_grad else ())
            kernels = tuple(k for k in kernels if (k.suffix == "wgrad" and w_grad) or (k.suffix == "dgrad" and x_grad))
        (out,) = self.tape.node(name, GEMM, inputs, ((name, out_shape, dt),), saves=saved,
                                flops=flops, dtype=compute, gemm_mnk=(rows, out_features, in_features),
                                backward=kernels)
        return out

    def bmm(self, a: Ref, b: Ref, out_shape: tuple[int, ...], batch: int, m: int, n: int, k: int,
            name: str) -> Ref:
        """Batched matmul of contiguous operands; saves both; backward allocates both gradients."""
        dt = a.dtype
        flops = 2.0 * batch * m * n * k
        kernels = (Kernel("bwd", GEMM, flops=2 * flops, bytes_read=a.nbytes + b.nbytes +
                          numel(out_shape) * DTYPE_BYTES[dt], bytes_written=a.nbytes + b.nbytes,
                          dtype=dt, gemm_mnk=(m, k, n), gemm_batch=batch, grads=(Grad(0), Grad(1))),)
        (out,) = self.tape.node(name, GEMM, (a, b), ((name, out_shape, dt),), saves=(a, b),
                                flops=flops, dtype=dt, gemm_mnk=(m, n, k), gemm_batch=batch,
                                backward=kernels)
        return out

    def contiguous(self, x: Ref, name: str) -> Ref:
        """A copy of a non-contiguous view; its backward passes the gradient through as a view."""
        (out,) = self.tape.node(name, COPY, (x,), ((name, x.shape, x.dtype),),
                                backward=(Kernel("bwd", COPY, grads=(Grad(0, alias=0),)),))
        return out

    # ---------------------------------------------------------------- pointwise
    def add(self, a: Ref, b: Ref, name: str, out_dtype: str | None = None) -> Ref:
        """a + b (b may broadcast over leading dims): saves nothing; gradients pass through.

        The output has the promoted dtype (or `out_dtype`); autograd casts a gradient to its input's dtype
        (a new buffer). A broadcast b of another dtype is summed down in the promoted dtype first (a temporary).
        """
        dt = out_dtype or promote_types(a.dtype, b.dtype)
        grad_b = Grad(1, alias=0) if b.shape == a.shape and b.dtype == dt else Grad(1)
        grad_a = Grad(0, alias=0) if a.dtype == dt else Grad(0)
        temps = ((b.shape, dt),) if b.shape != a.shape and b.dtype != dt else ()
        kernel = _ew_kernel("bwd", a, 0, (grad_a, grad_b), 0.0)
        if temps:
            kernel = replace(kernel, workspace=temps)
        (out,) = self.tape.node(name, ELEMENTWISE, (a, b), ((name, a.shape, dt),), flops=numel(a.shape),
                                dtype=dt, backward=(kernel,))
        return out

    def mul(self, a: Ref, b: Ref, name: str) -> Ref:
        """a * b: saves each operand the other one's gradient needs.

        With operands of different float dtypes the product has the promoted dtype (torch type promotion:
        bf16 q times fp32 RoPE tables is fp32). Each input's gradient is computed in the promoted dtype (a
        temporary) and cast to the input's dtype by the autograd engine.
        """
        shape = a.shape if numel(a.shape) >= numel(b.shape) else b.shape
        dt = promote_types(a.dtype, b.dtype)
        st = self.tape._storages
        saves = []
        if st[b.id].requires_grad:
            saves.append(a)
        if st[a.id].requires_grad:
            saves.append(b)
        grads = tuple(Grad(i) for i, r in enumerate((a, b)) if st[r.id].requires_grad)
        # A broadcast operand's gradient is computed at full size, then summed down (a temporary); summing over
        # leading dims (a norm weight) is a CUDA column reduction with its own staging buffers. An operand of a
        # narrower dtype gets its gradient in the promoted dtype first, then a cast (measured: torch 2.13 CPU).
        temps: tuple[tuple[tuple[int, ...], str], ...] = ()
        cast_read = cast_written = 0
        for r in (a, b):
            if not st[r.id].requires_grad:
                continue
            if r.shape != shape:
                temps += ((shape, dt),)
                if r.shape == shape[len(shape) - len(r.shape):]:
                    temps += self.profile.column_sum_workspace(numel(shape) // numel(r.shape), numel(r.shape))
                if r.dtype != dt:
                    temps += ((r.shape, dt),)
            elif r.dtype != dt:
                temps += ((shape, dt),)
            if r.dtype != dt:
                cast_read += numel(r.shape) * DTYPE_BYTES[dt]
                cast_written += numel(r.shape) * DTYPE_BYTES[r.dtype]
        n = numel(shape) * DTYPE_BYTES[dt]
        kernel = Kernel("bwd", ELEMENTWISE, flops=numel(shape) * len(grads), bytes_read=2 * n + cast_read,
                        bytes_written=n * len(grads) + cast_written, dtype=dt, grads=grads, workspace=temps)
        (out,) = self.tape.node(name, ELEMENTWISE, (a, b), ((name, shape, dt),), saves=tuple(saves),
                                flops=numel(shape), dtype=dt, backward=(kernel,))
        return out

    def add_scalar(self, x: Ref, name: str) -> Ref:
        """x + python_scalar: nothing saved; the gradient passes through unchanged."""
        (out,) = self.tape.node(name, ELEMENTWISE, (x,), ((name, x.shape, x.dtype),), flops=numel(x.shape),
                                dtype=x.dtype, backward=(Kernel("bwd", ELEMENTWISE, grads=(Grad(0, alias=0),)),))
        return out

    def scale(self, x: Ref, name: str) -> Ref:
        """x * python_scalar: nothing saved; backward multiplies the gradient (a new buffer)."""
        (out,) = self.tape.node(name, ELEMENTWISE, (x,), ((name, x.shape, x.dtype),), flops=numel(x.shape),
                                dtype=x.dtype, backward=(_ew_kernel("bwd", x, x.nbytes, (Grad(0),)),))
        return out

    def div_by_scalar_tensor(self, x: Ref, name: str) -> Ref:
        """x / torch.full([], c, dtype=x.dtype): allocates the 0-d divisor, which div saves."""
        (divisor,) = self.tape.node(f"{name}.divisor", ELEMENTWISE, (), ((f"{name}.divisor", (), x.dtype),),
                                    requires_grad=False)
        (out,) = self.tape.node(name, ELEMENTWISE, (x, divisor), ((name, x.shape, x.dtype),), saves=(divisor,),
                                flops=numel(x.shape), dtype=x.dtype,
                                backward=(_ew_kernel("bwd", x, x.nbytes, (Grad(0),)),))
        return out

    def unary(self, x: Ref, name: str, flops_per: float, save_output: bool = False,
              backward_temps: int = 0) -> Ref:
        """A pointwise function: saves its input (or its output). Fused backward kernels (gelu, silu)
        allocate only the gradient; composite formulas (pow: grad * 2 * x.pow(1); rsqrt:
        -0.5 * grad * out.pow(3)) allocate `backward_temps` full-size temporaries too."""
        out_spec = ((name, x.shape, x.dtype),)
        saves = (0,) if save_output else (x,)
        kernel = Kernel("bwd", ELEMENTWISE, flops=flops_per * numel(x.shape), bytes_read=2 * x.nbytes,
                        bytes_written=x.nbytes * (1 + backward_temps), dtype=x.dtype, grads=(Grad(0),),
                        workspace=((x.shape, x.dtype),) * backward_temps)
        (out,) = self.tape.node(name, ELEMENTWISE, (x,), out_spec, saves=saves,
                                flops=flops_per * numel(x.shape), dtype=x.dtype, backward=(kernel,))
        return out

    def neg(self, x: Ref, name: str) -> Ref:
        """-x: nothing saved; backward negates the gradient (a new buffer)."""
        return self.scale(x, name)

    def cat(self, parts: tuple[Ref, ...], out_shape: tuple[int, ...], name: str) -> Ref:
        """torch.cat: a new buffer; backward slices the gradient (views, no allocation)."""
        dt = parts[0].dtype
        grads = tuple(Grad(i, alias=0) for i in range(len(parts)))
        (out,) = self.tape.node(name, COPY, parts, ((name, out_shape, dt),), dtype=dt,
                                backward=(Kernel("bwd", COPY, grads=grads),))
        return out

    def reduce_mean(self, x: Ref, out_shape: tuple[int, ...], name: str) -> Ref:
        """x.mean(dim, keepdim=True): nothing saved; backward expands and divides (a new full buffer)."""
        (out,) = self.tape.node(name, ELEMENTWISE, (x,), ((name, out_shape, x.dtype),),
                                flops=numel(x.shape), dtype=x.dtype,
                                backward=(_ew_kernel("bwd", x, x.nbytes, (Grad(0),)),))
        return out

    def dropout(self, x: Ref, p: float, name: str) -> Ref:
        """Dropout in training: p == 0 returns the input; else a mask (saved) and the output."""
        if p <= 0.0:
            return x
        if self.profile.dropout_mask_dtype == "bool":
            # CUDA native_dropout: output and a bool mask in one kernel; backward = grad * mask * scale.
            out, _mask = self.tape.node(name, ELEMENTWISE, (x,), ((name, x.shape, x.dtype),
                                        (f"{name}.mask", x.shape, "bool")), saves=(1,),
                                        flops=2 * numel(x.shape), dtype=x.dtype,
                                        backward=(_ew_kernel("bwd", x, 2 * x.nbytes, (Grad(0),)),))
            return out
        # CPU: noise = empty_like(x).bernoulli_(1-p).div_(1-p); out = x * noise (saves the noise).
        (noise,) = self.tape.node(f"{name}.noise", ELEMENTWISE, (x,), ((f"{name}.mask", x.shape, x.dtype),),
                                  flops=2 * numel(x.shape), dtype=x.dtype, bytes_read=0,
                                  requires_grad=False)
        (out,) = self.tape.node(name, ELEMENTWISE, (x, noise), ((name, x.shape, x.dtype),), saves=(noise,),
                                flops=numel(x.shape), dtype=x.dtype,
                                backward=(_ew_kernel("bwd", x, 2 * x.nbytes, (Grad(0),)),))
        return out

    def softmax(self, x: Ref, name: str, out_dtype: str | None = None, log: bool = False) -> Ref:
        """softmax(x, -1, dtype): saves its output; backward allocates the input gradient.

        With a `dtype` other than x's, ATen converts x first (`x.to(dtype)`: a copy that lives until _softmax
        returns; its backward casts the gradient back to x's dtype), except for fp16 input to fp32 on a GPU,
        where one half-to-float kernel reads x directly and its backward writes an fp16 gradient. On a GPU
        softmax's backward (not log_softmax's) first forms grad * output, a temporary of the gradient's size
        (measured: CUDA, torch 2.11).
        """
        gpu = self.profile.device_kind == "gpu"
        dt = out_dtype or x.dtype
        if dt != x.dtype and not (gpu and x.dtype == "fp16" and dt == "fp32"):
            x = self.cast(x, dt, f"{name}.to_{dt}")
        temps = ((x.shape, dt),) if gpu and not log else ()
        (out,) = self.tape.node(name, SOFTMAX, (x,), ((name, x.shape, dt),), saves=(0,),
                                flops=5 * numel(x.shape), dtype=dt,
                                backward=(Kernel("bwd", SOFTMAX, flops=4 * numel(x.shape),
                                                 bytes_read=2 * numel(x.shape) * DTYPE_BYTES[dt],
                                                 bytes_written=x.nbytes, dtype=dt, grads=(Grad(0),),
                                                 workspace=temps),))
        return out

    def masked_fill(self, x: Ref, mask_bytes_shape: tuple[int, ...], name: str) -> Ref:
        """scores.masked_fill(~mask, -inf): `~mask` allocates a bool copy that backward keeps."""
        (inverted,) = self.tape.node(f"{name}.invert_mask", ELEMENTWISE, (), ((f"{name}.mask", mask_bytes_shape, "bool"),),
                                     flops=numel(mask_bytes_shape), dtype="bool", requires_grad=False)
        (out,) = self.tape.node(name, ELEMENTWISE, (x, inverted), ((name, x.shape, x.dtype),),
                                saves=(inverted,), flops=numel(x.shape), dtype=x.dtype,
                                backward=(_ew_kernel("bwd", x, x.nbytes, (Grad(0),)),))
        return out

    # ---------------------------------------------------------------- normalization
    def layer_norm(self, x: Ref, w: Ref, bias: Ref | None, name: str) -> Ref:
        """native_layer_norm: output, mean and rstd (b, s, 1) fp32; saves input, mean, rstd."""
        stats_shape = x.shape[:-1] + (1,)
        stats_dtype = "fp32" if x.dtype in ("fp32", "bf16", "fp16") else x.dtype
        grads = (Grad(0), Grad(1)) + ((Grad(2),) if bias is not None else ())
        inputs = (x, w) + ((bias,) if bias is not None else ())
        kernel = Kernel("bwd", NORM, flops=8 * numel(x.shape), bytes_read=2 * x.nbytes,
                        bytes_written=x.nbytes, dtype=x.dtype, grads=grads)
        out, _mean, _rstd = self.tape.node(
            name, NORM, inputs, ((name, x.shape, x.dtype), (f"{name}.mean", stats_shape, stats_dtype),
                                 (f"{name}.rstd", stats_shape, stats_dtype)),
            saves=(x, 1, 2), flops=8 * numel(x.shape), dtype=x.dtype, bytes_written=x.nbytes,
            backward=(kernel,))
        return out

    def rms_norm(self, x: Ref, w: Ref, eps_name: str) -> Ref:
        """HF LlamaRMSNorm: fp32 copy, pow, mean, +eps, rsqrt, mul, cast back, * weight."""
        name = eps_name
        xf = self.cast(x, "fp32", f"{name}.to_fp32")
        squared = self.unary(xf, f"{name}.pow", 1.0, backward_temps=2)
        variance = self.reduce_mean(squared, x.shape[:-1] + (1,), f"{name}.mean")
        shifted = self.add_scalar(variance, f"{name}.add_eps")
        inv = self.unary(shifted, f"{name}.rsqrt", 2.0, save_output=True, backward_temps=2)
        normed = self.mul(xf, inv, f"{name}.mul")
        back = self.cast(normed, x.dtype, f"{name}.to_input_dtype")
        out = self.mul(w, back, f"{name}.weight")
        self.tape.hold(x, variance, normed)    # argument and locals live until forward returns
        return out

    # ---------------------------------------------------------------- embeddings and loss
    def embedding(self, weight: Ref, idx: Ref, name: str) -> Ref:
        """Embedding lookup: saves the indices; backward allocates a dense (V, h) gradient."""
        rows = numel(idx.shape)
        h = weight.shape[1]
        out_shape = idx.shape + (h,)
        kernel = Kernel("bwd", EMBEDDING, flops=rows * h, bytes_read=rows * h * DTYPE_BYTES[weight.dtype],
                        bytes_written=weight.nbytes, dtype=weight.dtype, grads=(Grad(0),),
                        phase=BACKWARD_WEIGHT)
        (out,) = self.tape.node(name, EMBEDDING, (weight, idx), ((name, out_shape, weight.dtype),),
                                saves=(idx,), bytes_read=rows * h * DTYPE_BYTES[weight.dtype] + idx.nbytes,
                                dtype=weight.dtype, backward=(kernel,))
        return out

    def cross_entropy(self, logits: Ref, targets: Ref, name: str) -> Ref:
        """F.cross_entropy = log_softmax (saved output) + nll_loss (mean, saves its input) -> scalar loss.

        Under autocast the two devices differ: CPU autocast runs cross_entropy_loss in fp32 (the logits are
        cast, log_softmax is fp32); CUDA autocast leaves log_softmax in the logits' dtype (cross_entropy
        passes it an explicit dtype) and casts only nll_loss's input to fp32, which nll_loss saves.
        """
        x = logits
        if self.autocast is not None and x.dtype != "fp32" and self.profile.device_kind == "cpu":
            x = self.cast(x, "fp32", f"{name}.autocast_fp32")
        logp = self.softmax(x, f"{name}.log_softmax", log=True)
        if self.autocast is not None and logp.dtype != "fp32":
            logp = self.cast(logp, "fp32", f"{name}.nll_loss.autocast_fp32")
        rows = numel(targets.shape)
        kernel = Kernel("bwd", ELEMENTWISE, flops=rows, bytes_read=targets.nbytes,
                        bytes_written=logp.nbytes, dtype=logp.dtype, grads=(Grad(0),))
        loss, _total_weight = self.tape.node(
            f"{name}.nll_loss", ELEMENTWISE, (logp, targets),
            ((f"{name}.loss", (), logp.dtype), (f"{name}.total_weight", (), logp.dtype)),
            saves=(logp, targets, 1), flops=rows, dtype=logp.dtype,
            bytes_read=rows * DTYPE_BYTES[logp.dtype] + targets.nbytes, backward=(kernel,))
        return loss

    # ---------------------------------------------------------------- attention
    def sdpa_flash(self, q: Ref, k: Ref, v: Ref, out_shape: tuple[int, ...], lse_shape: tuple[int, ...],
                   flops: float, name: str) -> Ref:
        """Fused flash attention: output and logsumexp (fp32); saves q, k, v, output, logsumexp.

        On a GPU (measured: cuDNN SDPA, torch 2.11, H200) it also saves the dropout RNG's seed and offset (two
        int64 scalars), and its backward takes a b·h·s·(4·d + 4) + 256-byte workspace: an fp32 dq
        accumulator plus an fp32 row sum of dO·O per query (flash-attention 2's dq_accum and softmax_d have
        the same size).
        """
        dt = q.dtype
        io = q.nbytes + k.nbytes + v.nbytes
        out_bytes = numel(out_shape) * DTYPE_BYTES[dt]
        gpu = self.profile.device_kind == "gpu"
        workspace = ()
        if gpu:
            b, heads, s, d = q.shape
            workspace = (((b * heads * s * (4 * d + 4) + 256,), "uint8"),)
        kernel = Kernel("bwd", ATTENTION, flops=2.5 * flops, bytes_read=io + 2 * out_bytes,
                        bytes_written=io, dtype=dt, grads=(Grad(0), Grad(1), Grad(2)), workspace=workspace)
        outputs = ((name, out_shape, dt), (f"{name}.logsumexp", lse_shape, "fp32"))
        if gpu:
            outputs += ((f"{name}.philox_seed", (), "int64"), (f"{name}.philox_offset", (), "int64"))
        refs = self.tape.node(name, ATTENTION, (q, k, v), outputs, saves=(q, k, v, *range(len(outputs))),
                              flops=flops, dtype=dt, bytes_written=out_bytes, backward=(kernel,))
        return refs[0]
