"""Tensor-parallel collectives overlapped with the GEMM beside them: which pairs, how, and how much the GEMM slows.

Which collective overlaps which GEMM follows the layer structure of workload/tp_ops.py (the op names it gives)
and Transformer Engine's userbuffers (transformer_engine/pytorch/module/base.py `initialize_ub`, TE 2.x):

* `ring` (tp_comm_overlap; TE "ring_exchange": qkv_fprop, fc1_fprop, proj_dgrad, fc2_dgrad): the sequence-
  parallel all_gather in front of a column-parallel GEMM (forward and recompute), and the gradient all_gather in
  front of a row-parallel layer's dgrad GEMM. The all_gather runs beside the GEMM's first (tp - 1) / tp; the GEMM
  of the chunk that arrives last runs after it. The exchange runs on copy engines and one SM, and the GEMM keeps
  every SM (`num_sm` 1, `set_sm_margin` False, `use_ce` True).
* `pipeline` (tp_comm_overlap; TE "pipeline": proj_fprop, fc2_fprop): the reduce_scatter after a row-parallel
  GEMM, split into `num_splits` = 4 chunks: the GEMM's first chunk runs alone, the reduce_scatter of the first
  three chunks beside the GEMM's last three, the last chunk's reduce_scatter after the GEMM.
* `bulk` (tp_comm_overlap, TE "bulk": qkv_dgrad, qkv_wgrad, fc1_dgrad, fc1_wgrad; or tp_backward_overlap, the
  async collectives of Megatron-Core's and Transformer Engine's column-parallel backward): the input all_gather
  beside the dgrad GEMM, and the dgrad reduce_scatter (all_reduce without sequence parallelism) beside the wgrad
  GEMM, whole.

A GEMM sharing the GPU with a communication kernel runs on the SMs the kernel leaves it: pipeline and bulk kernels
hold `DeviceSpec.comm_kernel_sms` (TE's default `num_sm` 16 with `set_sm_margin`; NCCL's channels for the async
collectives), the ring exchange `RING_SMS` (TE's `num_sm` 1 for ring_exchange). The GEMM's time is its roofline
time on that share of the SMs (hardware/cost.py op_time_s with sm_fraction).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from simulator.hardware.catalog import DeviceSpec
from simulator.hardware.cost import op_time_s
from simulator.parallel.overlap import OverlapOptions
from simulator.workload.graph import BACKWARD_WEIGHT, COLLECTIVE, FORWARD, GEMM, RECOMPUTE, Op

PIPELINE_SPLITS = 4      # TE get_default_config: "num_splits": 4 for the pipeline method
RING_SMS = 1             # TE get_default_config: "num_sm": 1 for ring_exchange (copy engines move the bytes)
_WGRAD_SEARCH = 3        # a bulk reduce_scatter looks this many ops back for its wgrad GEMM (an accumulate between)


@dataclass(frozen=True)
class Overlap:
    """One collective run beside one GEMM of the same op list (indices into it).

    `ahead`: share of the collective's bytes that runs beside the GEMM (the rest, with the collective's memory,
    blocks where the collective stands). `gemm_before`: share of the GEMM that runs before the collective starts
    (pipeline: its first chunk) and `gemm_after`: after the collective must have ended (ring: the last chunk).
    `gemm_scale`: the GEMM's duration factor while the collective holds SMs.
    """

    collective: int
    gemm: int
    method: str              # "ring" | "pipeline" | "bulk"
    ahead: float
    gemm_before: float
    gemm_after: float
    gemm_scale: float

    @property
    def collective_first(self) -> bool:
        """Whether the collective comes before its GEMM in the op list (all_gather in front of the GEMM)."""
        return self.collective < self.gemm


def gemm_scale(op: Op, device: DeviceSpec, sms: int) -> float:
    """How much longer `op` takes when a communication kernel holds `sms` of the device's SMs (>= 1)."""
    if sms <= 0 or device.sm_count <= sms:
        return 1.0
    alone = op_time_s(op, device)
    return op_time_s(op, device, sm_fraction=(device.sm_count - sms) / device.sm_count) / alone if alone else 1.0


def _tp_collective(op: Op) -> bool:
    return op.op_class == COLLECTIVE and op.group == "tp"


def plan_overlaps(ops: Sequence[Op], options: OverlapOptions, tp: int, device: DeviceSpec) -> tuple[Overlap, ...]:
    """The overlapped (collective, GEMM) pairs of one op list, in op order; () when nothing overlaps.

    Args:
        ops: a micro-batch's forward, backward or weight ops (workload/stage.py, training.py).
        options: the run's overlap switches.
        tp: the tensor-parallel group size.
        device: the GPU (SM count, the SMs a communication kernel holds).

    Returns:
        The pairs; each GEMM and each collective is in at most one.
    """
    if tp <= 1 or not (options.tp_comm_overlap or options.tp_backward_overlap):
        return ()
    found: list[Overlap] = []
    used: set[int] = set()
    bulk_sms = device.comm_kernel_sms

    def pair(collective: int, gemm: int, method: str, ahead: float, before: float, after: float, sms: int) -> None:
        if gemm in used or collective in used:
            return
        used.update((gemm, collective))
        found.append(Overlap(collective, gemm, method, ahead, before, after, gemm_scale(ops[gemm], device, sms)))

    for index, op in enumerate(ops):
        if not _tp_collective(op):
            continue
        name, kind = op.name, op.collective
        following = ops[index + 1] if index + 1 < len(ops) else None
        before_gemm = following is not None and following.op_class == GEMM
        layer_op = name.startswith("layers.")      # Transformer Engine layers; the LM head is Megatron's own
        if options.tp_comm_overlap and layer_op and kind == "all_gather" and before_gemm and (
                (op.phase in (FORWARD, RECOMPUTE) and name.endswith(".column_input.all_gather"))
                or name.endswith(".reduce_scatter.all_gather")):
            pair(index, index + 1, "ring", 1.0, 0.0, 1.0 / tp, RING_SMS)
        elif options.tp_comm_overlap and layer_op and kind == "reduce_scatter" and op.phase in (FORWARD, RECOMPUTE) \
                and index > 0 and ops[index - 1].op_class == GEMM:
            splits = PIPELINE_SPLITS
            pair(index, index - 1, "pipeline", (splits - 1) / splits, 1.0 / splits, 0.0, bulk_sms)
        elif kind == "all_gather" and name.endswith(".all_gather_input") and before_gemm:
            pair(index, index + 1, "bulk", 1.0, 0.0, 0.0, bulk_sms)
        elif kind in ("reduce_scatter", "all_reduce") and ".column_input." in name and op.phase not in (
                FORWARD, RECOMPUTE):
            for back in range(index - 1, max(-1, index - 1 - _WGRAD_SEARCH), -1):
                if ops[back].op_class == GEMM and ops[back].phase == BACKWARD_WEIGHT:
                    pair(index, back, "bulk", 1.0, 0.0, 0.0, bulk_sms)
                    break
    return tuple(sorted(found, key=lambda o: o.collective))




def split_gemm(op: Op) -> tuple[Op, Op]:
    """`op` as two runs of one kernel: the first allocates what it allocates, the second frees what it frees."""
    return replace(op, frees=()), replace(op, allocs=())


__all__ = ["Overlap", "PIPELINE_SPLITS", "RING_SMS", "gemm_scale", "plan_overlaps", "split_gemm"]
