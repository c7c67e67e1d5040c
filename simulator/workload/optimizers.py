"""Optimizer states and step kernels, sized as torch.optim / bitsandbytes implement them.

Each optimizer says which persistent state tensors it keeps per parameter (created at the first
step, so they sit in memory from then on) and which ops one step runs, with the temporaries that
raise the step's peak: the single-tensor AdamW loop allocates `sqrt(v)` and `sqrt(v) / c` per
parameter (the previous parameter's `denom` is released only when the next one is assigned), the
foreach AdamW allocates `sqrt(v)` for every parameter at once, fused kernels allocate nothing. The
unfused Adam(W) paths run torch's kernels one by one (lerp, mul, addcmul, sqrt, div, add, addcdiv, and
AdamW's weight decay first): 20 passes over fp32 states for AdamW, as the H200 profile of
validation/data/cuda-large shows (85.5 ms of foreach kernels for 4.28 billion parameters).
"""

from __future__ import annotations

from dataclasses import dataclass

from simulator.workload.graph import DTYPE_BYTES, OPTIMIZER, OPTIMIZER_STATES, OTHER, OPTIMIZER_STEP, Op, Tensor

ADAM_8BIT_BLOCK = 2048           # bitsandbytes blockwise quantization block size
ADAM_8BIT_MIN_SIZE = 4096        # bitsandbytes keeps tensors smaller than this in 32-bit


@dataclass(frozen=True)
class MasterParam:
    """A parameter as the optimizer sees it: the tensor it updates and its gradient."""

    name: str
    shape: tuple[int, ...]
    numel: int
    dtype: str            # dtype of the tensor the optimizer updates (fp32 master or the param itself)
    grad_dtype: str


class IdSource:
    """Hands out tensor ids after those the model used."""

    def __init__(self, start: int):
        self.next = start

    def __call__(self) -> int:
        value = self.next
        self.next += 1
        return value


def _state(ids: IdSource, name: str, numel: int, dtype: str, shape: tuple[int, ...] = ()) -> Tensor:
    return Tensor(ids(), name, numel * DTYPE_BYTES[dtype], OPTIMIZER_STATES, dtype, shape or (numel,),
                  persistent=True)


def optimizer_states(kind: str, params: list[MasterParam], ids: IdSource, step_on_device: bool) -> list[Tensor]:
    """The persistent state tensors of `kind` for `params`, in creation order."""
    states: list[Tensor] = []
    for p in params:
        if kind in ("adamw", "adam"):
            if step_on_device:
                states.append(_state(ids, f"{p.name}.step", 1, "fp32"))
            states.append(_state(ids, f"{p.name}.exp_avg", p.numel, p.dtype, p.shape))
            states.append(_state(ids, f"{p.name}.exp_avg_sq", p.numel, p.dtype, p.shape))
        elif kind == "adam-8bit":
            if p.numel < ADAM_8BIT_MIN_SIZE:
                states.append(_state(ids, f"{p.name}.state1", p.numel, "fp32", p.shape))
                states.append(_state(ids, f"{p.name}.state2", p.numel, "fp32", p.shape))
            else:
                blocks = -(-p.numel // ADAM_8BIT_BLOCK)
                states.append(_state(ids, f"{p.name}.state1", p.numel, "uint8", p.shape))
                states.append(_state(ids, f"{p.name}.state2", p.numel, "uint8", p.shape))
                states.append(_state(ids, f"{p.name}.absmax1", blocks, "fp32"))
                states.append(_state(ids, f"{p.name}.absmax2", blocks, "fp32"))
        elif kind == "sgd-momentum":
            states.append(_state(ids, f"{p.name}.momentum_buffer", p.numel, p.dtype, p.shape))
        elif kind == "adafactor":
            if step_on_device:
                states.append(_state(ids, f"{p.name}.step", 1, "fp32"))
            if len(p.shape) >= 2:
                rows = p.numel // p.shape[-1]
                states.append(_state(ids, f"{p.name}.row_var", rows, p.dtype))
                states.append(_state(ids, f"{p.name}.col_var", p.numel // p.shape[-2], p.dtype))
            else:
                states.append(_state(ids, f"{p.name}.variance", p.numel, p.dtype, p.shape))
    return states


def _update_op(name: str, p: MasterParam, reads: int, writes: int, flops_per: float,
               allocs: tuple[int, ...] = (), frees: tuple[int, ...] = (), tensors: int = 1) -> Op:
    e = DTYPE_BYTES[p.dtype]
    return Op(name, OPTIMIZER, OPTIMIZER_STEP, flops=flops_per * p.numel, bytes_read=reads * p.numel * e,
              bytes_written=writes * p.numel * e, dtype=p.dtype, allocs=allocs, frees=frees, tensors=tensors)


def _adam_moments(kind: str, label: str, p: MasterParam, tensors: int = 1) -> list[Op]:
    """The passes before sqrt(v) in torch's single-tensor and foreach Adam(W), one kernel each: AdamW's
    decoupled weight decay (`param.mul_(1 - lr * weight_decay)`; torch.optim.AdamW's default weight_decay is
    0.01, Adam's 0), `exp_avg.lerp_(grad, 1 - beta1)`, `exp_avg_sq.mul_(beta2)` and
    `exp_avg_sq.addcmul_(grad, grad, 1 - beta2)` (which reads grad once)."""
    ops = [_update_op(f"{kind}.{label}.weight_decay", p, 1, 1, 1.0, tensors=tensors)] if kind == "adamw" else []
    return ops + [_update_op(f"{kind}.{label}.lerp", p, 2, 1, 3.0, tensors=tensors),
                  _update_op(f"{kind}.{label}.mul", p, 1, 1, 1.0, tensors=tensors),
                  _update_op(f"{kind}.{label}.addcmul", p, 2, 1, 3.0, tensors=tensors)]


def step_ops(kind: str, implementation: str, params: list[MasterParam], ids: IdSource,
             tensors: dict[int, Tensor]) -> list[Op]:
    """The ops of one optimizer step, registering their temporaries in `tensors`.

    `implementation` is "single-tensor", "foreach" or "fused" (torch's three code paths).
    """

    def temp(name: str, p: MasterParam) -> int:
        tensor = Tensor(ids(), name, p.numel * DTYPE_BYTES[p.dtype], OTHER, p.dtype, p.shape)
        tensors[tensor.id] = tensor
        return tensor.id

    ops: list[Op] = []
    if kind in ("adamw", "adam") and implementation == "single-tensor":
        previous_denom: int | None = None
        for p in params:
            ops += _adam_moments(kind, p.name, p)
            sqrt = temp(f"{kind}.{p.name}.sqrt", p)
            ops.append(_update_op(f"{kind}.{p.name}.sqrt", p, 1, 1, 1.0, allocs=(sqrt,)))
            denom = temp(f"{kind}.{p.name}.denom", p)
            frees = (sqrt,) + ((previous_denom,) if previous_denom is not None else ())
            ops.append(_update_op(f"{kind}.{p.name}.div", p, 1, 1, 1.0, allocs=(denom,), frees=frees))
            ops.append(_update_op(f"{kind}.{p.name}.add_eps", p, 1, 1, 1.0))
            ops.append(_update_op(f"{kind}.{p.name}.addcdiv", p, 3, 1, 3.0))
            previous_denom = denom
        if previous_denom is not None:
            last = ops[-1]
            ops[-1] = Op(last.name, last.op_class, last.phase, last.flops, last.bytes_read,
                         last.bytes_written, last.dtype, frees=(previous_denom,))
    elif kind in ("adamw", "adam") and implementation == "foreach":
        total = MasterParam("all", (), sum(p.numel for p in params), params[0].dtype if params else "fp32", "fp32")
        n = len(params)
        ops += _adam_moments(kind, "foreach", total, n)
        sqrts = tuple(temp(f"{kind}.{p.name}.exp_avg_sq_sqrt", p) for p in params)
        ops.append(_update_op(f"{kind}.foreach.sqrt", total, 1, 1, 1.0, allocs=sqrts, tensors=n))
        ops.append(_update_op(f"{kind}.foreach.div", total, 1, 1, 1.0, tensors=n))
        ops.append(_update_op(f"{kind}.foreach.add_eps", total, 1, 1, 1.0, tensors=n))
        ops.append(_update_op(f"{kind}.foreach.addcdiv", total, 3, 1, 3.0, frees=sqrts, tensors=n))
    elif kind in ("adamw", "adam", "adam-8bit"):
        # Fused kernels (torch fused AdamW, Megatron's and DeepSpeed's FusedAdam, bitsandbytes 8-bit Adam): one
        # pass, no temporaries.
        reads, writes = (4, 3) if kind != "adam-8bit" else (2, 1)
        total = MasterParam("all", (), sum(p.numel for p in params), params[0].dtype if params else "fp32", "fp32")
        ops.append(_update_op(f"{kind}.fused", total, reads, writes, 12.0, tensors=len(params)))
    elif kind in ("sgd", "sgd-momentum"):
        for p in params:
            reads, writes = (3, 2) if kind == "sgd-momentum" else (2, 1)
            ops.append(_update_op(f"{kind}.{p.name}", p, reads, writes, 2.0))
    elif kind == "adafactor":
        for p in params:
            estimate = temp(f"adafactor.{p.name}.var_estimate", p)
            ops.append(_update_op(f"adafactor.{p.name}.factors", p, 2, 0, 4.0))
            ops.append(_update_op(f"adafactor.{p.name}.update", p, 3, 2, 6.0, allocs=(estimate,),
                                  frees=(estimate,)))
    return ops
