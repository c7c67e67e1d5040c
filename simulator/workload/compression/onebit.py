"""1bit: DeepSpeed's 1-bit Adam — ``OnebitAdam.step`` with ``NcclBackend.compressed_allreduce``
(deepspeed/runtime/fp16/onebit/adam.py, deepspeed/runtime/comm/nccl.py), its states, kernels and collectives.

What 1-bit Adam updates: under fp16 DeepSpeed's FP16_Optimizer hands it one flat fp32 copy of every parameter
(``fp32_groups_flat``), in fp32 it updates each parameter. For each such tensor of n elements, with N data-parallel
ranks, the error buffers are padded to Ψp = n rounded up to a multiple of N x divider, divider = 8N / gcd(N, 8).

Compressed stage (step >= freeze_step; the engine's backward all_reduce is off): the local gradient goes into the
momentum (``exp_avg.mul_(beta1).add_(grad)``), then ``compressed_allreduce(exp_avg, worker_error, server_error)``:

1. pad the momentum to Ψp (``torch.cat``: a new buffer, which becomes exp_avg's storage), add the worker error,
   take its scale (norm / sqrt(Ψp)) and store the new worker error (buffer - scale x sign, five temporaries);
2. pack the signs to bits (``sign_``, ``bool``, ``uint8``, ``cupy.packbits``: Ψp / 8 bytes), all_to_all them
   (rank r receives everyone's chunk r) and all_gather the N fp32 scales;
3. unpack the received bits to fp32 (Ψp elements), scale and sum them into the rank's Ψp / N chunk, add the
   server error, store the new server error, pack the chunk's signs (Ψp / 8N bytes);
4. all_gather the packed chunks (Ψp / 8 bytes: torch's list all_gather goes through a flat buffer and copies out)
   and the N server scales; unpack (Ψp fp32) and copy into the momentum.

Then the update with the frozen variance: ``update = exp_avg / (exp_avg_sq.sqrt() + eps)``, AdamW's weight decay
``update += weight_decay * p`` and ``p.add_(-lr * update)``, each an out-of-place temporary. Every collective is
waited for at once (the step runs them in line). Warm-up stage (step < freeze_step): the gradient was all_reduced
in the backward as without compression; the step updates both moments and applies the same update.

States (category optimizer_states: they are ``optimizer.state[p]``): exp_avg (Ψp after the first compressed step,
n in warm-up), exp_avg_sq, worker_error (Ψp) and server_error (Ψp / N) in the compressed stage, and under fp16 the
flat fp32 master. cupy's arrays (packed bits, receive buffers, unpacked bits) live in cupy's own memory pool;
memsim allocates them through the allocator model like the rest.
"""

from __future__ import annotations

import math

from simulator.workload.compression.kernels import Kernels, align
from simulator.workload.graph import BLOCKING, OPTIMIZER_STATES, OPTIMIZER_STEP, OTHER, Tensor
from simulator.workload.optimizers import IdSource, MasterParam

F32 = 4


def divider(dp: int) -> int:
    """``OnebitAdam.divider``: int(N x 8 / gcd(N, 8))."""
    return dp * 8 // math.gcd(dp, 8)


def padded_numel(numel: int, dp: int) -> int:
    """``state['corrected_tensor_size']``: numel rounded up to a multiple of N x divider."""
    return align(numel, dp * divider(dp))


def onebit_tensors(master: list[MasterParam], flat_master: bool) -> list[MasterParam]:
    """The tensors 1-bit Adam updates: one flat fp32 group under DeepSpeed's fp16 optimizer, else each parameter."""
    if not flat_master:
        return master
    total = sum(p.numel for p in master)
    return [MasterParam("fp32_groups_flat.0", (total,), total, "fp32", "fp32")]


def _sign_error(k: Kernels, tag: str, size: int) -> None:
    """``error.set_(buffer - scale * buffer.sign().add_(1).bool().float().add_(-0.5).mul_(2.0))``."""
    signs = k.unary(f"{tag}.sign", size, F32, F32, out=f"{tag}.sign")
    k.unary(f"{tag}.sign_add", size, F32, F32)
    flags = k.unary(f"{tag}.bool", size, F32, 1, out=f"{tag}.bool", out_dtype="bool", frees=(signs,))
    ones = k.unary(f"{tag}.float", size, 1, F32, out=f"{tag}.float", frees=(flags,))
    k.unary(f"{tag}.float_add", size, F32, F32)
    k.unary(f"{tag}.float_mul", size, F32, F32)
    scaled = k.unary(f"{tag}.scale", size, F32, F32, out=f"{tag}.scaled", frees=(ones,))
    new_error = k.tensor(f"{tag}.new_error", size, "fp32")
    # The new error replaces the old one (set_): freed at once here, which leaves the same bytes allocated.
    k.kernel(f"{tag}.error", 2 * size * F32, size * F32, flops=float(size), allocs=(new_error,),
             frees=(scaled, new_error))


def _pack(k: Kernels, tag: str, size: int, frees: tuple[int, ...] = ()) -> int:
    """``buffer.sign_().add_(1).bool().to(torch.uint8)`` then ``cupy.packbits``: the packed bits' tensor id."""
    k.unary(f"{tag}.sign_", size, F32, F32)
    k.unary(f"{tag}.sign_add", size, F32, F32)
    flags = k.unary(f"{tag}.bool", size, F32, 1, out=f"{tag}.flags", out_dtype="bool")
    octets = k.unary(f"{tag}.uint8", size, 1, 1, out=f"{tag}.uint8", out_dtype="uint8", frees=(flags,))
    packed = k.tensor(f"{tag}.packed", size // 8, "uint8")
    k.kernel(f"{tag}.packbits", size, size // 8, flops=float(size), allocs=(packed,), frees=(octets,) + frees)
    return packed


def _unpack(k: Kernels, tag: str, size: int, frees: tuple[int, ...] = ()) -> int:
    """``cupy.unpackbits(bits).float().add_(-0.5).mul_(2.0).mul_(scales)``: the fp32 tensor's id."""
    bits = k.tensor(f"{tag}.unpacked", size, "uint8")
    k.kernel(f"{tag}.unpackbits", size // 8, size, flops=float(size), allocs=(bits,), frees=frees)
    values = k.unary(f"{tag}.float", size, 1, F32, out=f"{tag}.float", frees=(bits,))
    for step in ("add", "mul", "scale"):
        k.unary(f"{tag}.{step}", size, F32, F32)
    return values


def _compressed_allreduce(k: Kernels, n: int, padded: int, dp: int, exp_avg: int, worker: int, server: int) -> None:
    """``NcclBackend.compressed_allreduce`` on an n-element momentum (module docstring, steps 1-4)."""
    chunk = padded // dp
    buffer = exp_avg
    if padded != n:
        zeros = k.unary("pad_zeros", padded - n, 0, F32, out="pad_zeros", flops_per=0.0)
        buffer = k.tensor("buffer_m", padded, "fp32")
        k.kernel("cat", padded * F32, padded * F32, allocs=(buffer,), frees=(zeros,))
    k.kernel("add_worker_error", 2 * padded * F32, padded * F32, flops=float(padded), inputs=(buffer, worker))
    k.kernel("worker_norm", padded * F32, F32, flops=2.0 * padded)
    _sign_error(k, "worker", padded)
    packed = _pack(k, "worker", padded)
    received = k.unary("recvbuf_sign", padded // 8, 0, 1, out="recvbuf_sign", out_dtype="uint8", flops_per=0.0)
    stacked = k.unary("stack_signs", padded // 8, 1, 1, out="stacked_signs", out_dtype="uint8", flops_per=0.0)
    k.collective("all_to_all_signs", "all_to_all", padded // 8, BLOCKING, inputs=(stacked,), frees=(stacked,))
    scales = k.tensor("recvbuf_scale", dp, "fp32")
    k.collective("all_gather_scales", "all_gather", dp * F32, BLOCKING, allocs=(scales,), dtype="fp32")
    unpacked = _unpack(k, "server", padded, frees=(packed,))
    compensated = k.tensor("compensated_server_m", chunk, "fp32")
    k.kernel("server_sum", padded * F32, chunk * F32, flops=float(padded), allocs=(compensated,), frees=(unpacked,))
    k.kernel("add_server_error", 2 * chunk * F32, chunk * F32, flops=float(chunk), inputs=(compensated, server))
    k.kernel("server_norm", chunk * F32, F32, flops=2.0 * chunk)
    _sign_error(k, "server", chunk)
    server_packed = _pack(k, "server_chunk", chunk, frees=(compensated,))
    gathered = k.unary("recvbuf_sign_server", padded // 8, 0, 1, out="recvbuf_sign_server", out_dtype="uint8",
                       flops_per=0.0, frees=(received,))
    flat = k.tensor("all_gather_flat", padded // 8, "uint8")
    k.collective("all_gather_signs", "all_gather", padded // 8, BLOCKING, allocs=(flat,), inputs=(server_packed,))
    k.kernel("all_gather_copy_out", padded // 8, padded // 8, frees=(flat, server_packed))
    server_scales = k.tensor("recvbuf_scale_server", dp, "fp32")
    k.collective("all_gather_server_scales", "all_gather", dp * F32, BLOCKING, allocs=(server_scales,),
                 dtype="fp32")
    restacked = k.unary("stack_server_signs", padded // 8, 1, 1, out="stacked_server_signs", out_dtype="uint8",
                        flops_per=0.0)
    result = _unpack(k, "result", padded, frees=(restacked, gathered))
    frees = (result, scales, server_scales) + ((buffer,) if buffer != exp_avg else ())
    # With padding, the new buffer becomes exp_avg's storage and the old one is released (`exp_avg.set_`).
    k.kernel("copy_into_momentum", padded * F32, padded * F32, frees=frees, inputs=(result,))


def _update(k: Kernels, n: int) -> None:
    """``update = exp_avg / (exp_avg_sq.sqrt() + eps)``; ``update += wd * p``; ``p.add_(-lr * update)``."""
    root = k.unary("sqrt", n, F32, F32, out="sqrt")
    denom = k.unary("add_eps", n, F32, F32, out="denom", frees=(root,))
    update = k.unary("div", n, 2 * F32, F32, out="update", frees=(denom,))
    decay = k.unary("weight_decay", n, F32, F32, out="decay")
    k.unary("add_decay", n, 2 * F32, F32, frees=(decay,))
    step = k.unary("lr_scale", n, F32, F32, out="lr_update", frees=(update,))
    k.unary("apply", n, 2 * F32, F32, frees=(step,))


def onebit_optimizer(master: list[MasterParam], flat_master: bool, dp: int, compressing: bool, ids: IdSource,
                     tensors: dict[int, Tensor]) -> tuple[list[Tensor], list]:
    """1-bit Adam's state tensors (creation order) and step ops over `master` (registers both in `tensors`).

    Args:
        master: what the optimizer would update, in parameter order (fp32 masters, or the fp32 parameters).
        flat_master: DeepSpeed's fp16 optimizer: one flat fp32 master replaces the per-parameter ones.
        dp: data-parallel ranks N.
        compressing: the compressed stage (else the warm-up stage).
    """
    states: list[Tensor] = []
    ops: list = []
    for p in onebit_tensors(master, flat_master):
        n = p.numel
        padded = padded_numel(n, dp) if compressing else n
        state = Kernels(f"onebit_adam.{p.name}", ids, tensors, OPTIMIZER_STEP, category=OPTIMIZER_STATES)
        names = []
        if flat_master:
            names.append(("master", n))
        names += [("exp_avg", padded), ("exp_avg_sq", n)]
        if compressing:
            names += [("worker_error", padded), ("server_error", padded // dp)]
        ids_of = {name: state.tensor(name, numel, "fp32", persistent=True) for name, numel in names}
        states += [tensors[ids_of[name]] for name, _ in names]
        k = Kernels(f"onebit_adam.{p.name}", ids, tensors, OPTIMIZER_STEP, category=OTHER)
        k.unary("exp_avg.mul", n, F32, F32)
        k.unary("exp_avg.add", n, 2 * F32, F32, flops_per=2.0)
        if compressing:
            comm = Kernels(f"onebit_adam.{p.name}", ids, tensors, OPTIMIZER_STEP)
            _compressed_allreduce(comm, n, padded, dp, ids_of["exp_avg"], ids_of["worker_error"],
                                  ids_of["server_error"])
            k.ops += comm.ops
        else:
            k.unary("exp_avg_sq.mul", n, F32, F32)
            k.unary("exp_avg_sq.addcmul", n, 3 * F32, F32, flops_per=3.0)
        _update(k, n)
        ops += k.ops
    return states, ops
