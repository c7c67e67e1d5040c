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
    COMMUNICATION_BUFFERS,
    COPY,
    DTYPE_BYTES,
    ELEMENTWISE,
    EMBEDDING,
    GEMM,
    NORM,
    OTHER,
    PARAMETERS,
    SOFTMAX,
    Op,
)
from simulator.workload.tape import Grad, Kernel, Ref, Tape, numel


@dataclass(frozen=True)
class KernelProfile:
    """Device-dependent kernel behaviour that changes what autograd saves."""

    dropout_mask_dtype: str = "bool"       # "bool" (CUDA fused dropout) or "input" (CPU: input dtype)
    flash_with_dropout: bool = True        # CUDA flash supports dropout; CPU SDPA falls back to math
    device_kind: str = "gpu"
    library_workspace_bytes: int = 0       # cuBLAS workspace, allocated through the caching allocator


def _ew_kernel(suffix: str, out: Ref, reads: int, grads: tuple[Grad, ...], flops_per: float = 1.0,
               phase: str | None = None) -> Kernel:
    n = numel(out.shape)
    written = sum(numel(g.shape or out.shape) * DTYPE_BYTES[g.dtype or out.dtype] for g in grads
                  if g.alias is None)
    kwargs = {"phase": phase} if phase else {}
    return Kernel(suffix, ELEMENTWISE, flops=flops_per * n, bytes_read=reads, bytes_written=written,
                  dtype=out.dtype, grads=grads, **kwargs)


@dataclass(frozen=True)
class CollectiveSpec:
    """What a recorded communication op does: the collective, its process group and NCCL's size."""

    collective: str
    group: str
    comm_bytes: int


def annotate_collectives(ops: list[Op], specs: dict[str, CollectiveSpec]) -> list[Op]:
    """Copy the collective, group and bytes of `specs` (keyed by op name) onto the ops they name.

    The tape's replay knows op names and classes only; forward and recomputed ops of a node share
    its name, backward kernels are named `node.suffix`.
    """
    if not specs:
        return ops
    out = []
    for op in ops:
        spec = specs.get(op.name)
        if spec is not None and op.op_class == COLLECTIVE:
            op = replace(op, collective=spec.collective, group=spec.group, comm_bytes=spec.comm_bytes)
        out.append(op)
    return out


class Ops:
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
        self.autocast = autocast_dtype
        # fp8-mixed (Transformer Engine style): linears cast weights (cached) and inputs (saved) to fp8.
        self.fp8 = fp8_linear
        self._cast_cache: dict[tuple[int, str], Ref] = {}
        self.tp = tp
        self.sp = sequence_parallel and tp > 1     # Megatron turns sequence parallelism off at tp = 1
        self.collectives: dict[str, CollectiveSpec] = {}
        self._comm_buffers: dict[tuple[int, str], Ref] = {} if comm_buffers is None else comm_buffers

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
        kernels = (
            Kernel("dgrad", GEMM, flops=flops, bytes_read=rows * out_features * e + w.nbytes,
                   bytes_written=rows * in_features * e, dtype=compute,
                   gemm_mnk=(rows, in_features, out_features), grads=(Grad(0, dtype=dt),)),
            Kernel("wgrad", GEMM, flops=flops, bytes_read=rows * out_features * e + x.nbytes,
                   bytes_written=out_features * in_features * e, dtype=compute,
                   gemm_mnk=(out_features, in_features, rows), grads=tuple(wgrads),
                   phase=BACKWARD_WEIGHT),
        )
        if saved_shard is not None:
            regather = Kernel("all_gather_input", COLLECTIVE, bytes_read=saved_shard.nbytes,
                              bytes_written=x.nbytes, dtype=x.dtype)
            self._collective(f"{name}.all_gather_input", "all_gather", x.nbytes)
            kernels = (regather,) + kernels
        inputs = (x, w) + ((bias,) if bias is not None else ())
        saved = (x if saved_shard is None else saved_shard, w)
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
        """a + b (b may broadcast over leading dims): saves nothing; gradients pass through."""
        dt = out_dtype or a.dtype
        grad_b = Grad(1, alias=0) if b.shape == a.shape and b.dtype == dt else Grad(1)
        grad_a = Grad(0, alias=0) if a.dtype == dt else Grad(0)
        (out,) = self.tape.node(name, ELEMENTWISE, (a, b), ((name, a.shape, dt),), flops=numel(a.shape),
                                dtype=dt, backward=(_ew_kernel("bwd", a, 0, (grad_a, grad_b), 0.0),))
        return out

    def mul(self, a: Ref, b: Ref, name: str) -> Ref:
        """a * b: saves each operand the other one's gradient needs."""
        shape = a.shape if numel(a.shape) >= numel(b.shape) else b.shape
        dt = a.dtype
        st = self.tape._storages
        saves = []
        if st[b.id].requires_grad:
            saves.append(a)
        if st[a.id].requires_grad:
            saves.append(b)
        grads = tuple(Grad(i) for i, r in enumerate((a, b)) if st[r.id].requires_grad)
        # A broadcast operand's gradient is computed at full size, then summed down (a temporary).
        temps = tuple((shape, dt) for r in (a, b) if st[r.id].requires_grad and r.shape != shape)
        n = numel(shape) * DTYPE_BYTES[dt]
        kernel = Kernel("bwd", ELEMENTWISE, flops=numel(shape) * len(grads), bytes_read=2 * n,
                        bytes_written=n * len(grads), dtype=dt, grads=grads, workspace=temps)
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

    def softmax(self, x: Ref, name: str, out_dtype: str | None = None) -> Ref:
        """softmax(x, -1, dtype): saves its output; backward allocates the input gradient."""
        dt = out_dtype or x.dtype
        (out,) = self.tape.node(name, SOFTMAX, (x,), ((name, x.shape, dt),), saves=(0,),
                                flops=5 * numel(x.shape), dtype=dt,
                                backward=(Kernel("bwd", SOFTMAX, flops=4 * numel(x.shape),
                                                 bytes_read=2 * numel(x.shape) * DTYPE_BYTES[dt],
                                                 bytes_written=x.nbytes, dtype=dt,
                                                 grads=(Grad(0, dtype=dt),)),))
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
        """F.cross_entropy = log_softmax (saved output) + nll_loss (mean) -> scalar loss."""
        x = logits
        if self.autocast is not None and x.dtype != "fp32":
            x = self.cast(x, "fp32", f"{name}.autocast_fp32")
        logp = self.softmax(x, f"{name}.log_softmax")
        rows = numel(targets.shape)
        kernel = Kernel("bwd", ELEMENTWISE, flops=rows, bytes_read=targets.nbytes,
                        bytes_written=logp.nbytes, dtype=logp.dtype, grads=(Grad(0),))
        loss, _total_weight = self.tape.node(
            f"{name}.nll_loss", ELEMENTWISE, (logp, targets),
            ((f"{name}.loss", (), logp.dtype), (f"{name}.total_weight", (), logp.dtype)),
            saves=(targets, 1), flops=rows, dtype=logp.dtype,
            bytes_read=rows * DTYPE_BYTES[logp.dtype] + targets.nbytes, backward=(kernel,))
        return loss

    # ---------------------------------------------------------------- attention
    def sdpa_flash(self, q: Ref, k: Ref, v: Ref, out_shape: tuple[int, ...], lse_shape: tuple[int, ...],
                   flops: float, name: str) -> Ref:
        """Fused flash attention: output and logsumexp (fp32); saves q, k, v, output, logsumexp."""
        dt = q.dtype
        io = q.nbytes + k.nbytes + v.nbytes
        out_bytes = numel(out_shape) * DTYPE_BYTES[dt]
        kernel = Kernel("bwd", ATTENTION, flops=2.5 * flops, bytes_read=io + 2 * out_bytes,
                        bytes_written=io, dtype=dt, grads=(Grad(0), Grad(1), Grad(2)))
        out, _lse = self.tape.node(name, ATTENTION, (q, k, v), ((name, out_shape, dt),
                                   (f"{name}.logsumexp", lse_shape, "fp32")), saves=(q, k, v, 0, 1),
                                   flops=flops, dtype=dt, bytes_written=out_bytes, backward=(kernel,))
        return out

    # ---------------------------------------------------------------- tensor parallelism (Megatron-LM)
    @property
    def comm_buffers(self) -> list[Ref]:
        """The persistent communication buffers created so far (allocate them with the parameters)."""
        return list(self._comm_buffers.values())

    def _collective(self, op_name: str, kind: str, nbytes: int) -> None:
        self.collectives[op_name] = CollectiveSpec(kind, "tp", nbytes)

    def _alias(self, x: Ref, name: str, op_class: str, kernel: Kernel, moved_bytes: int = 0) -> Ref:
        """An op whose output is x itself (identity or in-place): no allocation."""
        (out,) = self.tape.node(name, op_class, (x,), ((name, x.shape, x.dtype),), bytes_read=moved_bytes,
                                bytes_written=moved_bytes, dtype=x.dtype, backward=(kernel,))
        self.tape._storages[out.id].base = self.tape.root(x)
        return out

    def copy_to_tp(self, x: Ref, name: str) -> Ref:
        """Megatron's f (copy_to_tensor_model_parallel_region): identity forward, in-place
        all_reduce of the input gradient in backward."""
        self._collective(f"{name}.all_reduce", "all_reduce", x.nbytes)
        kernel = Kernel("all_reduce", COLLECTIVE, bytes_read=x.nbytes, bytes_written=x.nbytes,
                        dtype=x.dtype, grads=(Grad(0, alias=0),))
        return self._alias(x, name, COPY, kernel)

    def reduce_from_tp(self, x: Ref, name: str) -> Ref:
        """Megatron's g (reduce_from_tensor_model_parallel_region): in-place all_reduce forward,
        identity backward."""
        self._collective(name, "all_reduce", x.nbytes)
        return self._alias(x, name, COLLECTIVE, Kernel("bwd", COPY, grads=(Grad(0, alias=0),)), x.nbytes)

    def _sequence_shape(self, shape: tuple[int, ...], factor: float) -> tuple[int, ...]:
        return (shape[0], int(shape[1] * factor)) + tuple(shape[2:])

    def gather_to_buffer(self, x: Ref, name: str) -> Ref:
        """Sequence parallelism before a column-parallel linear: all_gather (b, s/t, ...) into a
        persistent (b, s, ...) buffer (Megatron's global memory buffer, one per shape and dtype);
        backward reduce_scatters the full gradient into a new (b, s/t, ...) one."""
        shape = self._sequence_shape(x.shape, self.tp)
        key = (numel(shape), x.dtype)
        buffer = self._comm_buffers.get(key)
        if buffer is None:
            buffer = self.tape.storage(f"sequence_parallel.all_gather_buffer.{x.dtype}", shape, x.dtype,
                                       COMMUNICATION_BUFFERS)
            self._comm_buffers[key] = buffer
        full = numel(shape) * DTYPE_BYTES[x.dtype]
        self._collective(name, "all_gather", full)
        self._collective(f"{name}.reduce_scatter", "reduce_scatter", full)
        kernel = Kernel("reduce_scatter", COLLECTIVE, bytes_read=full, bytes_written=x.nbytes, dtype=x.dtype,
                        grads=(Grad(0),))
        (out,) = self.tape.node(name, COLLECTIVE, (x,), ((name, shape, x.dtype),), bytes_written=full,
                                dtype=x.dtype, backward=(kernel,))
        self.tape._storages[out.id].base = buffer.id
        return out

    def gather_sequence(self, x: Ref, name: str) -> Ref:
        """gather_from_sequence_parallel_region: all_gather into a new (b, s, ...) tensor; backward
        reduce_scatters the gradient into a new shard."""
        shape = self._sequence_shape(x.shape, self.tp)
        full = numel(shape) * DTYPE_BYTES[x.dtype]
        self._collective(name, "all_gather", full)
        self._collective(f"{name}.reduce_scatter", "reduce_scatter", full)
        kernel = Kernel("reduce_scatter", COLLECTIVE, bytes_read=full, bytes_written=x.nbytes, dtype=x.dtype,
                        grads=(Grad(0),))
        (out,) = self.tape.node(name, COLLECTIVE, (x,), ((name, shape, x.dtype),), dtype=x.dtype,
                                backward=(kernel,))
        return out

    def reduce_scatter_sequence(self, x: Ref, name: str) -> Ref:
        """Sequence parallelism after a row-parallel linear: reduce_scatter (b, s, ...) partial sums
        into a new (b, s/t, ...) tensor; backward all_gathers the gradient into a new full one."""
        shape = self._sequence_shape(x.shape, 1 / self.tp)
        self._collective(name, "reduce_scatter", x.nbytes)
        self._collective(f"{name}.all_gather", "all_gather", x.nbytes)
        kernel = Kernel("all_gather", COLLECTIVE, bytes_read=x.nbytes // self.tp, bytes_written=x.nbytes,
                        dtype=x.dtype, grads=(Grad(0),))
        (out,) = self.tape.node(name, COLLECTIVE, (x,), ((name, shape, x.dtype),), dtype=x.dtype,
                                backward=(kernel,))
        return out

    def scatter_sequence(self, x: Ref, name: str) -> Ref:
        """scatter_to_sequence_parallel_region: keep this rank's s/t slice (a contiguous copy, no
        communication); backward all_gathers the gradient into a new full tensor."""
        shape = self._sequence_shape(x.shape, 1 / self.tp)
        self._collective(f"{name}.all_gather", "all_gather", x.nbytes)
        kernel = Kernel("all_gather", COLLECTIVE, bytes_read=x.nbytes // self.tp, bytes_written=x.nbytes,
                        dtype=x.dtype, grads=(Grad(0),))
        (out,) = self.tape.node(name, COPY, (x,), ((name, shape, x.dtype),), bytes_read=x.nbytes // self.tp,
                                dtype=x.dtype, backward=(kernel,))
        return out

    def vocab_parallel_embedding(self, weight: Ref, idx: Ref, name: str, reduce_scatter: bool) -> Ref:
        """VocabParallelEmbedding on a (V/t, h) shard: mask of out-of-shard ids (bool), shifted ids
        (int64, saved by the lookup), lookup, in-place zeroing of masked rows (saves the mask), then
        all_reduce of the (b, s, h) output, or reduce_scatter to (b, s/t, h) with `reduce_scatter`."""
        (mask,) = self.tape.node(f"{name}.input_mask", ELEMENTWISE, (idx,),
                                 ((f"{name}.input_mask", idx.shape, "bool"),),
                                 flops=2 * numel(idx.shape), dtype="int64", requires_grad=False)
        (shifted,) = self.tape.node(f"{name}.masked_input", ELEMENTWISE, (idx, mask),
                                    ((f"{name}.masked_input", idx.shape, idx.dtype),),
                                    flops=2 * numel(idx.shape), dtype=idx.dtype, requires_grad=False)
        out = self.embedding(weight, shifted, name)
        zero = Kernel("bwd", ELEMENTWISE, flops=numel(out.shape), bytes_read=out.nbytes + mask.nbytes,
                      bytes_written=out.nbytes, dtype=out.dtype, grads=(Grad(0),))
        (zeroed,) = self.tape.node(f"{name}.mask_output", ELEMENTWISE, (out, mask), ((f"{name}.mask_output",
                                   out.shape, out.dtype),), saves=(mask,), flops=numel(out.shape),
                                   bytes_read=out.nbytes + mask.nbytes, bytes_written=out.nbytes, dtype=out.dtype,
                                   backward=(zero,))
        self.tape._storages[zeroed.id].base = self.tape.root(out)
        if reduce_scatter:
            return self.reduce_scatter_sequence(zeroed, f"{name}.reduce_scatter")
        return self.reduce_from_tp(zeroed, f"{name}.all_reduce")

    def vocab_parallel_cross_entropy(self, logits: Ref, targets: Ref, name: str) -> Ref:
        """Megatron's _VocabParallelCrossEntropy on (rows, V/t) logits, then the mean over tokens.

        Forward: an fp32 copy of the logits (the logits themselves when already fp32: the function
        works in place), the per-token max (all_reduce MAX), the target mask and shifted targets,
        the predicted logit and the sum of exp (two all_reduce SUM); exp and division in place turn
        the copy into the softmax. Saved: the softmax (rows, V/t) fp32, the target mask (bool) and
        the shifted targets (int64). Backward writes the input gradient into the saved softmax;
        autograd then casts it to the logits' dtype (a new buffer; with fp32 logits memsim also
        counts a new buffer where Megatron reuses the softmax: an over-count of rows x V/t x 4
        bytes during that one kernel).
        """
        rows = numel(targets.shape)
        scalars = rows * DTYPE_BYTES["fp32"]
        (logits_max,) = self.tape.node(f"{name}.logits_max", SOFTMAX, (logits,),
                                       ((f"{name}.logits_max", (rows,), "fp32"),),
                                       flops=numel(logits.shape), dtype="fp32", requires_grad=False)
        self.tape.node(f"{name}.max_all_reduce", COLLECTIVE, (logits_max,), (), bytes_written=scalars,
                       dtype="fp32", requires_grad=False)
        self._collective(f"{name}.max_all_reduce", "all_reduce", scalars)
        in_place = logits.dtype == "fp32"
        n = numel(logits.shape)
        kernel = Kernel("bwd", SOFTMAX, flops=3 * n, bytes_read=n * 4 + targets.nbytes,
                        bytes_written=logits.nbytes, dtype="fp32", grads=(Grad(0),))
        softmax, _mask, _shifted, predicted, sum_exp, losses = self.tape.node(
            name, SOFTMAX, (logits, targets, logits_max),
            ((f"{name}.softmax", logits.shape, "fp32"), (f"{name}.target_mask", (rows,), "bool"),
             (f"{name}.masked_target", (rows,), "int64"), (f"{name}.predicted_logits", (rows,), "fp32"),
             (f"{name}.sum_exp_logits", (rows,), "fp32"), (f"{name}.losses", (rows,), "fp32")),
            saves=(0, 1, 2), flops=6 * n, dtype="fp32", backward=(kernel,))
        if in_place:
            self.tape._storages[softmax.id].base = self.tape.root(logits)
        for part, ref in (("predicted", predicted), ("sum_exp", sum_exp)):
            self.tape.node(f"{name}.{part}_all_reduce", COLLECTIVE, (ref,), (), bytes_written=scalars,
                           dtype="fp32", requires_grad=False)
            self._collective(f"{name}.{part}_all_reduce", "all_reduce", scalars)
        return self.reduce_mean(losses, (), f"{name}.mean")
