"""The fp16 loss scaler of each framework: its device state, its kernels around the optimizer step, skipped steps.

* torch — ``torch.amp.GradScaler`` (torch/amp/grad_scaler.py, torch 2.13), dynamic only: ``_scale`` (fp32) and
  ``_growth_tracker`` (int32) live on the device from the first ``scale()``. ``unscale_`` makes
  ``inv_scale = _scale.double().reciprocal().float()`` (three kernels) and ``found_inf = torch.full((), 0.)``, then
  ``torch._amp_foreach_non_finite_check_and_unscale_`` reads and rewrites every gradient. An optimizer whose step
  unscales itself (``_step_supports_amp_scaling``: torch's fused Adam(W)) gets ``_check_inf_per_device`` instead:
  the same pass with an inverse scale of 1, and ``found_inf`` summed into a new tensor. ``update()`` runs
  ``torch._amp_update_scale_`` and releases the temporaries. torch has no static loss scale (refused).
* megatron — ``DynamicGradScaler`` / ``ConstantGradScaler`` (megatron/core/optimizer/grad_scaler.py): the scale and,
  when dynamic, min_scale, growth_factor and backoff_factor as 1-element fp32 device tensors (its growth and
  hysteresis trackers are Python ints); the optimizer's ``found_inf`` (fp32). Each step: ``found_inf.fill_(0)``,
  the inverse scale (three kernels), ``_amp_foreach_non_finite_check_and_unscale_`` over the fp32 main gradients.
* deepspeed — ``DynamicLossScaler`` / ``LossScaler`` keep the scale on the host (no device state); FP16_Optimizer's
  ``has_overflow`` checks each gradient (``float(x.float().sum())``: an fp32 copy and a sum) and
  ``unscale_and_clip_grads`` rescales the gradients in place; ZeRO's optimizer checks its gradient shard and
  all_reduces the overflow flag (MAX) over the data-parallel group.

A multi-tensor kernel is launched once per ``multi_tensor_apply`` batch: at most 110 tensors and 320 chunks of
65,536 elements each (aten/src/ATen/native/cuda/MultiTensorApply.cuh, depth 1). Every op here is named
``grad_scaler.*``: an iteration whose step is skipped (an overflow) runs these ops and nothing else of the step,
in every framework (Megatron-LM and DeepSpeed skip on overflow with a constant scale too). The loss multiplication
of ``scale()`` (one 4-byte kernel per micro-batch) and the Megatron backoff kernels of a skipped step are not
simulated; Megatron's MAX all_reduce of ``found_inf`` over its model-parallel group is not simulated either.
"""

from __future__ import annotations

from dataclasses import dataclass

from simulator.errors import PlanError
from simulator.workload.graph import BLOCKING, COLLECTIVE, DTYPE_BYTES, OPTIMIZER, OPTIMIZER_STEP, OTHER, Op, Tensor
from simulator.workload.optimizers import IdSource, MasterParam

PREFIX = "grad_scaler"
MAX_TENSORS_PER_LAUNCH = 110     # depth_to_max_tensors[0]
MAX_CHUNKS_PER_LAUNCH = 320      # depth_to_max_blocks[0]
CHUNK_ELEMENTS = 65536           # kChunkSize


def check_loss_scale(precision: str, framework: str, loss_scale: str | float, skipped_fraction: float) -> None:
    """Refuse a loss-scale setting nothing simulates (one line naming the keys).

    Raises:
        PlanError: a static scale under torch, a scale or skipped steps without fp16-mixed.
    """
    static = loss_scale != "dynamic"
    if precision != "fp16-mixed":
        if static:
            raise PlanError(f"training.loss_scale = {loss_scale!r} applies to training.precision = 'fp16-mixed' "
                            f"only (is {precision!r}); allowed here: 'dynamic'")
        if skipped_fraction > 0:
            raise PlanError(f"training.skipped_steps_fraction = {skipped_fraction!r}: only the fp16 loss scaler "
                            f"skips steps; it needs training.precision = 'fp16-mixed' (is {precision!r})")
    if static and framework == "torch":
        raise PlanError(f"training.loss_scale = {loss_scale!r}: torch's GradScaler only scales dynamically; a static "
                        f"loss scale is Megatron-LM's or DeepSpeed's (training.framework = 'megatron' or 'deepspeed')")


def multi_tensor_launches(numels: list[int]) -> int:
    """Kernel launches of one depth-1 ``multi_tensor_apply`` over tensors of these sizes: a launch when its tensor
    list is full (after a tensor's last chunk), when its chunk list is full, or at the very last chunk; a tensor cut
    by a full chunk list carries over into the next launch."""
    launches = in_list = in_launch = 0
    sizes = [n for n in numels if n > 0]
    for index, n in enumerate(sizes):
        in_list += 1
        chunks = -(-n // CHUNK_ELEMENTS)
        for chunk in range(chunks):
            in_launch += 1
            last_of_tensor = chunk == chunks - 1
            if (in_list == MAX_TENSORS_PER_LAUNCH and last_of_tensor) or in_launch == MAX_CHUNKS_PER_LAUNCH \
                    or (index == len(sizes) - 1 and last_of_tensor):
                launches += 1
                in_launch = 0
                in_list = 0 if last_of_tensor else 1
    return launches


@dataclass(frozen=True)
class LossScaler:
    """One framework's fp16 loss scaler: its persistent device tensors and how to make its step kernels."""

    framework: str
    dynamic: bool
    state: tuple[int, ...]

    def ops(self, params: list[MasterParam], ids: IdSource, tensors: dict[int, Tensor], *, self_unscaling: bool,
            dp_overflow_reduce: bool = False) -> tuple[list[Op], list[Op]]:
        """(the kernels before the optimizer's own, those after it) for gradients `params` (numel, grad_dtype).

        `self_unscaling`: torch's fused Adam(W) unscales inside its kernel. `dp_overflow_reduce`: DeepSpeed ZeRO's
        overflow flag all_reduce over the data-parallel group.
        """
        def temp(name: str, dtype: str) -> int:
            t = Tensor(ids(), f"{PREFIX}.{name}", DTYPE_BYTES[dtype], OTHER, dtype, (1,))
            tensors[t.id] = t
            return t.id

        def tiny(name: str, allocs: tuple[int, ...] = (), frees: tuple[int, ...] = ()) -> Op:
            return Op(f"{PREFIX}.{name}", OPTIMIZER, OPTIMIZER_STEP, flops=1.0, bytes_read=4, bytes_written=4,
                      dtype="fp32", allocs=allocs, outputs=allocs, frees=frees)

        def inverse_scale(before: list[Op]) -> int:
            """``_scale.double().reciprocal().float()``: each temporary released once the next exists."""
            as_double, reciprocal, inv = temp("scale_double", "fp64"), temp("reciprocal", "fp64"), temp(
                "inv_scale", "fp32")
            before += [tiny("scale.double", (as_double,)), tiny("reciprocal", (reciprocal,), (as_double,)),
                       tiny("inv_scale", (inv,), (reciprocal,))]
            return inv

        before: list[Op] = []
        after: list[Op] = []
        if self.framework == "deepspeed":
            before += _overflow_checks(params, ids, tensors)
            if dp_overflow_reduce:
                before.append(Op(f"{PREFIX}.overflow_all_reduce", COLLECTIVE, OPTIMIZER_STEP, bytes_read=4,
                                 bytes_written=4, dtype="fp32", collective="all_reduce", group="dp", comm_bytes=4,
                                 placement=BLOCKING))
            before += _foreach(params, "unscale_and_clip", reads=1, writes=1)
            return before, after
        if self.framework == "megatron":
            before.append(tiny("found_inf.fill"))
            inv = inverse_scale(before)
            before += _foreach(params, "check_and_unscale", reads=1, writes=1, frees=(inv,))
            return before, after
        # torch: unscale_ (or _check_inf_per_device) makes the inverse scale and found_inf, and
        # _MultiDeviceReplicator.get copies both to the gradients' device (``.to(device, copy=True)``); the copy of
        # found_inf stays in the optimizer's state until update().
        if self_unscaling:
            dummy, found_inf = temp("dummy_inv_scale", "fp32"), temp("found_inf", "fp32")
        else:
            dummy, found_inf = inverse_scale(before), temp("found_inf", "fp32")
        dummy_copy, found_copy = temp("inv_scale.copy", "fp32"), temp("found_inf.copy", "fp32")
        before += [tiny("dummy_inv_scale.full", (dummy,))] if self_unscaling else []
        before += [tiny("found_inf.full", (found_inf,)), tiny("inv_scale.to", (dummy_copy,)),
                   tiny("found_inf.to", (found_copy,))]
        before += _foreach(params, "check_inf" if self_unscaling else "check_and_unscale", reads=1, writes=1,
                           frees=(dummy_copy, dummy, found_inf))
        released = (found_copy,)
        if self_unscaling:
            # step(): found_inf summed into a new tensor and grad_scale = scale * 1, both deleted after the step.
            summed, scale = temp("found_inf.sum", "fp32"), temp("grad_scale", "fp32")
            before += [tiny("found_inf.sum", (summed,)), tiny("grad_scale", (scale,))]
            released += (summed, scale)
        after.append(tiny("update_scale", frees=released))
        return before, after


def _foreach(params: list[MasterParam], name: str, *, reads: int, writes: int, frees: tuple[int, ...] = ()) -> list[Op]:
    """A depth-1 multi-tensor kernel over the gradients, one op per launch, bytes split evenly."""
    numels = [p.numel for p in params]
    grad_bytes = sum(p.numel * DTYPE_BYTES[p.grad_dtype] for p in params)
    launches = multi_tensor_launches(numels)
    elements = sum(numels)
    ops = []
    for k in range(launches):
        share_bytes = grad_bytes // launches + (grad_bytes % launches if k == launches - 1 else 0)
        share_elements = elements // launches + (elements % launches if k == launches - 1 else 0)
        ops.append(Op(f"{PREFIX}.{name}" + (f".{k}" if launches > 1 else ""), OPTIMIZER, OPTIMIZER_STEP,
                      flops=2.0 * share_elements, bytes_read=reads * share_bytes, bytes_written=writes * share_bytes,
                      dtype="fp32", frees=frees if k == launches - 1 else ()))
    return ops


def _overflow_checks(params: list[MasterParam], ids: IdSource, tensors: dict[int, Tensor]) -> list[Op]:
    """DeepSpeed's ``_has_inf_or_nan`` per gradient: ``x.float()`` (an fp32 copy) and its ``sum()``."""
    ops = []
    for p in params:
        copy = Tensor(ids(), f"{PREFIX}.{p.name}.float", p.numel * 4, OTHER, "fp32", (p.numel,))
        tensors[copy.id] = copy
        total = Tensor(ids(), f"{PREFIX}.{p.name}.sum", 4, OTHER, "fp32", (1,))
        tensors[total.id] = total
        ops.append(Op(f"{PREFIX}.{p.name}.float", OPTIMIZER, OPTIMIZER_STEP, flops=float(p.numel),
                      bytes_read=p.numel * DTYPE_BYTES[p.grad_dtype], bytes_written=p.numel * 4, dtype="fp32",
                      allocs=(copy.id,), outputs=(copy.id,)))
        ops.append(Op(f"{PREFIX}.{p.name}.sum", OPTIMIZER, OPTIMIZER_STEP, flops=float(p.numel),
                      bytes_read=p.numel * 4, bytes_written=4, dtype="fp32", allocs=(total.id,),
                      frees=(copy.id, total.id)))
    return ops


def make_loss_scaler(framework: str, loss_scale: str | float, ids: IdSource, tensors: dict[int, Tensor]) -> LossScaler:
    """The framework's scaler with its persistent device tensors registered in `tensors` (module docstring)."""
    dynamic = loss_scale == "dynamic"
    names: list[tuple[str, str]] = []
    if framework == "torch":
        names = [("scale", "fp32"), ("growth_tracker", "int32")]
    elif framework == "megatron":
        names = [("scale", "fp32")] + ([("min_scale", "fp32"), ("growth_factor", "fp32"),
                                        ("backoff_factor", "fp32")] if dynamic else []) + [("found_inf", "fp32")]
    state = []
    for name, dtype in names:
        t = Tensor(ids(), f"{PREFIX}.{name}", DTYPE_BYTES[dtype], OTHER, dtype, (1,), persistent=True)
        tensors[t.id] = t
        state.append(t.id)
    return LossScaler(framework, dynamic, tuple(state))


def kept_with_offload(optimizer: list[Op]) -> list[Op]:
    """What of the loss scaler stays on the GPU when DeepSpeed offloads the optimizer: the overflow flag's all_reduce;
    the overflow check and the unscale run on the host's fp32 gradients (offload/optimizer.py, offload/zero3.py)."""
    return [op for op in optimizer if op.name.startswith(PREFIX + ".") and op.op_class == COLLECTIVE]


def skipped_step(optimizer: list[Op]) -> list[Op]:
    """What an iteration whose step is skipped (an overflow) runs of `optimizer`: the loss scaler's kernels."""
    return [op for op in optimizer if op.name.startswith(PREFIX + ".")]
