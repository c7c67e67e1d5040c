"""Which communication a run overlaps with compute: the scenario's overlap keys resolved per framework, and checked.

Each `parallel.*overlap*` key is "auto" (the framework's default, below, each with its source) or an explicit
true / false. What each one changes in the programs is in parallel/lower_multi.py and parallel/tp_overlap.py;
docs/multi-gpu.md ("Communication overlap") describes it.

Framework defaults (read 2026-12-02):
* tp_comm_overlap: false everywhere. Megatron-LM `--tp-comm-overlap` is `store_true` (megatron/training/
  arguments.py); NeMo's recipes switch it on (`ub_tp_comm_overlap: True`), so published NeMo runs say so
  explicitly. It needs sequence parallelism and each tensor-parallel group on one node over NVLink / NVSwitch
  (Transformer Engine's examples/pytorch/comm_gemm_overlap README, "Requirements"). torch: async TP is a
  torch.compile / torchtitan option, off by default. DeepSpeed has none.
* tp_backward_overlap: megatron true — Megatron-Core's `LinearWithGradAccumulationAndAsyncCommunication` and
  Transformer Engine's `_Linear.backward` launch the column-parallel input all_gather (sequence parallelism) with
  `async_op=True` before the dgrad GEMM and the dgrad reduce_scatter (or all_reduce without sequence
  parallelism) before the wgrad GEMM. torch (DTensor TP) and DeepSpeed: the collectives block.
* overlap_grad_reduce: torch true (DDP's autograd hooks reduce each bucket as it fills; there is no way to turn it
  off). megatron false (`--overlap-grad-reduce` is `store_true`, default False). DeepSpeed: `overlap_comm`
  defaults to `stage == 3` (deepspeed/runtime/zero/config.py `overlap_comm_valid`).
* overlap_param_gather: false everywhere (Megatron `--overlap-param-gather` `store_true`; DeepSpeed ZeRO-1/2 and
  torch's ZeroRedundancyOptimizer all_gather after the step). Needs ZeRO-1/2 (the distributed optimizer).
* overlap_p2p_comm: megatron true with the interleaved schedule only (`--no-overlap-p2p-communication` is
  `store_false`, and only `forward_backward_pipelining_with_interleaving` reads it; the non-interleaved 1F1B's
  send_forward / recv_backward calls block), torch true (torch.distributed.pipelining posts isend / irecv and
  waits for them later), deepspeed false (PipelineEngine's p2p is synchronous). Blocking sends are modelled for
  gpipe and 1f1b only: with other schedules auto is true and false is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

from simulator.errors import ScenarioError

OVERLAP_KEYS = ("tp_comm_overlap", "tp_backward_overlap", "overlap_grad_reduce", "overlap_param_gather",
                "overlap_p2p_comm")


@dataclass(frozen=True)
class OverlapOptions:
    """The resolved overlap switches of one run (every field a bool).

    `grad_reduce_wait` says where a non-overlapped bucket reduction is waited for: "end" (Megatron: every bucket
    after the backward, `finish_grad_sync`) or "bucket" (DeepSpeed: where it fills).
    """

    tp_comm_overlap: bool = False
    tp_backward_overlap: bool = False
    overlap_grad_reduce: bool = True
    overlap_param_gather: bool = False
    overlap_p2p_comm: bool = True
    grad_reduce_wait: str = "end"


NO_OVERLAP_CHANGE = OverlapOptions()     # what memsim modelled before these keys existed (tests, one device)


BLOCKING_P2P_SCHEDULES = ("gpipe", "1f1b")     # where a blocking send is modelled (lower_multi._comm)


def _defaults(framework: str, zero_stage: int, schedule: str) -> dict[str, bool]:
    blocking = schedule in BLOCKING_P2P_SCHEDULES
    if framework == "megatron":
        return {"tp_comm_overlap": False, "tp_backward_overlap": True, "overlap_grad_reduce": False,
                "overlap_param_gather": False, "overlap_p2p_comm": not blocking}
    if framework == "deepspeed":
        return {"tp_comm_overlap": False, "tp_backward_overlap": False, "overlap_grad_reduce": zero_stage == 3,
                "overlap_param_gather": False, "overlap_p2p_comm": not blocking}
    return {"tp_comm_overlap": False, "tp_backward_overlap": False, "overlap_grad_reduce": True,
            "overlap_param_gather": False, "overlap_p2p_comm": True}


def resolve_overlap(scenario, nvlink: bool, plan=None) -> OverlapOptions:
    """The run's overlap switches: each "auto" key as the framework does it, explicit ones checked.

    Args:
        scenario: the Scenario (training.framework, parallel.*).
        nvlink: whether the cluster's GPUs have a GPU-to-GPU fabric (Transformer Engine's userbuffers need one).
        plan: the ParallelPlan on the cluster (None: not checked yet): userbuffers need each tensor-parallel group
            inside one node.

    Returns:
        OverlapOptions.

    Raises:
        ScenarioError: an overlap the framework or hardware does not have (one line naming the key and the rule).
    """
    p, framework, src = scenario.parallel, scenario.training.framework, scenario.source
    values = _defaults(framework, p.zero_stage if p.dp > 1 else 0, p.schedule)
    explicit = {key: getattr(p, key) for key in OVERLAP_KEYS if getattr(p, key) != "auto"}

    def bad(key: str, rule: str) -> ScenarioError:
        return ScenarioError(f"{src}: parallel.{key} = {str(explicit[key]).lower()}: {rule}")

    if explicit.get("tp_comm_overlap"):
        if framework == "deepspeed":
            raise bad("tp_comm_overlap", "framework 'deepspeed' has no tensor-parallel communication overlap "
                                         "(allowed: false)")
        if p.tp > 1 and not p.sequence_parallel:
            raise bad("tp_comm_overlap", "needs parallel.sequence_parallel = true (Transformer Engine overlaps the "
                                         "sequence-parallel all_gather / reduce_scatter, not all_reduce)")
        if p.tp > 1 and not nvlink:
            raise bad("tp_comm_overlap", "needs GPUs joined by NVLink (userbuffers exchange chunks through peer "
                                         "GPU memory; this cluster's GPUs have no GPU-to-GPU link)")
        if p.tp > 1 and plan is not None and plan.gpus_per_node is not None:
            spread = max(len({plan.node_of(rank) for rank in group}) for group in plan.groups("tp"))
            if spread > 1:
                raise bad("tp_comm_overlap", f"needs every tensor-parallel group inside one node (userbuffers over "
                                             f"NVLink); here a tp group of {p.tp} spans {spread} nodes of "
                                             f"{plan.gpus_per_node} GPUs")
    if explicit.get("tp_backward_overlap") and framework == "deepspeed":
        raise bad("tp_backward_overlap", "framework 'deepspeed' (Megatron-DeepSpeed's tensor-parallel layers) "
                                         "blocks on its backward collectives (allowed: false)")
    if explicit.get("overlap_grad_reduce") is False and framework == "torch":
        raise bad("overlap_grad_reduce", "torch DDP and FSDP always reduce gradients during the backward "
                                         "(allowed: true)")
    if explicit.get("overlap_param_gather") and not (p.dp > 1 and p.zero_stage in (1, 2)):
        raise bad("overlap_param_gather", f"needs parallel.dp > 1 and parallel.zero_stage 1 or 2 (the distributed "
                                          f"optimizer's all_gather of updated parameters; here dp = {p.dp}, "
                                          f"zero_stage = {p.zero_stage})")
    if explicit.get("overlap_p2p_comm") is False and p.pp > 1 and p.schedule not in BLOCKING_P2P_SCHEDULES:
        raise bad("overlap_p2p_comm", f"blocking sends are modelled for the {' and '.join(BLOCKING_P2P_SCHEDULES)} "
                                      f"schedules only, not {p.schedule!r} (Megatron batches each step's sends and "
                                      f"receives into one call there, which memsim does not model; allowed: true)")
    values.update(explicit)
    return OverlapOptions(**values, grad_reduce_wait="bucket" if framework == "deepspeed" else "end")


__all__ = ["NO_OVERLAP_CHANGE", "OVERLAP_KEYS", "OverlapOptions", "resolve_overlap"]
