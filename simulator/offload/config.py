"""The offload keys of a scenario checked against what is simulated, and resolved into a rank's OffloadConfig."""

from __future__ import annotations

from typing import TYPE_CHECKING

from simulator.errors import PlanError, TopologyError
from simulator.offload.state import ADAM_HOST_BYTES_PER_ELEMENT, OffloadConfig

if TYPE_CHECKING:
    from simulator.scenario.schema import Scenario

OFFLOAD_KEYS = ("offload_optimizer", "offload_params", "offload_activations")
OPTIMIZER_STAGES = {"cpu": (2, 3), "nvme": (3,)}   # zero_stage values simulated with offload_optimizer = key


def offloading(scenario: Scenario) -> bool:
    """Whether any parallel.offload_* key is set (not "none") or a DLRM keeps its tables on the host."""
    return any(getattr(scenario.parallel, key) != "none" for key in OFFLOAD_KEYS) or host_embeddings(scenario)


def host_embeddings(scenario: Scenario) -> bool:
    """Whether model.embedding_placement = "host" (a DLRM's tables in host memory: offload/embeddings.py)."""
    return scenario.model.embedding_placement == "host"


def check_offload(scenario: Scenario, accumulation_steps: int) -> None:
    """Refuse offload settings that are not simulated or contradict each other, with one line naming the keys.

    Raises:
        PlanError: the first rule broken.
    """
    p, t, src = scenario.parallel, scenario.training, scenario.source
    if not offloading(scenario):
        return

    def fail(message: str) -> None:
        raise PlanError(f"{src}: {message}")

    if p.offload_activations == "nvme":
        fail("parallel.offload_activations = 'nvme': activations are offloaded to host memory only (torch's "
             "save_on_cpu, Megatron's activation offload); allowed: 'none', 'cpu'")
    if p.offload_params != "none":
        key = f"parallel.offload_params = {p.offload_params!r}"
        if p.zero_stage != 3:
            fail(f"{key} with parallel.zero_stage = {p.zero_stage}: parameters are offloaded by ZeRO-3 (DeepSpeed's "
                 f"offload_param); allowed: zero_stage = 3")
        if p.offload_optimizer == "none":
            fail(f"{key} with parallel.offload_optimizer = 'none': parameter offload is simulated together with "
                 f"optimizer offload (ZeRO-Infinity); set parallel.offload_optimizer = 'cpu' or 'nvme'")
    if p.pp > 1:
        fail(f"parallel.pp = {p.pp}: offload is simulated for pp = 1 (parallel.offload_* with pipeline stages "
             f"is not); allowed with offload: pp = 1")
    if p.offload_activations == "cpu":
        key = "parallel.offload_activations = 'cpu'"
        if t.framework == "megatron":
            fail(f"{key} with training.framework = 'megatron': Megatron's activation offload (TransformerEngine's "
                 f"cpu_offload, layer by layer on copy streams) is not simulated; torch and deepspeed use torch's "
                 f"save_on_cpu(pin_memory=True)")
        if t.recompute != "none":
            fail(f"{key} with training.recompute = {t.recompute!r}: save_on_cpu around checkpointed regions is not "
                 f"simulated; allowed with activation offload: recompute = 'none'")
        if t.activation_compression != "none":
            fail(f"{key} with training.activation_compression = {t.activation_compression!r}: the two are "
                 f"exclusive (each replaces the saved tensors); allowed: one of them")
    if p.offload_optimizer == "none":
        return
    key = f"parallel.offload_optimizer = {p.offload_optimizer!r}"
    if t.framework != "deepspeed":
        fail(f"{key} with training.framework = {t.framework!r}: optimizer offload is DeepSpeed's ZeRO-Offload; "
             f"set training.framework = 'deepspeed'")
    stages = OPTIMIZER_STAGES[p.offload_optimizer]
    if p.zero_stage not in stages:
        fail(f"{key} with parallel.zero_stage = {p.zero_stage}: ZeRO-Offload is simulated on ZeRO stage "
             f"{', '.join(map(str, stages))} (DeepSpeed's stage_1_and_2.py for 2, stage3.py for 3; NVMe needs "
             f"ZeRO-3); allowed: {', '.join(map(str, stages))}")
    if t.optimizer != "adamw":
        fail(f"{key} with training.optimizer = {t.optimizer!r}: the host runs DeepSpeedCPUAdam; allowed: 'adamw'")
    if t.precision not in ("bf16-mixed", "fp16-mixed"):
        fail(f"{key} with training.precision = {t.precision!r}: ZeRO-Offload keeps 16-bit parameters on the GPU and "
             f"the fp32 master on the host; allowed: 'bf16-mixed', 'fp16-mixed'")
    if accumulation_steps > 1:
        fail(f"{key}: training.global_batch_size = {t.global_batch_size} gives {accumulation_steps} gradient "
             f"accumulation steps; ZeRO-Offload's accumulation through the host (async_accumulate_grad_in_cpu_via_gpu) "
             f"is not simulated; allowed: global_batch_size = micro_batch_size x dp")


def offload_config(scenario: Scenario, topology, world_size: int) -> OffloadConfig | None:
    """The rank's OffloadConfig on `topology` (None without offload): its share of the server's CPU rates.

    Raises:
        TopologyError: the topology lacks what the offload needs (host memory size, [host] rates, drives), naming
            the scenario keys.
    """
    if not offloading(scenario):
        return None
    from simulator.network.host import drives_of_node, host_capacity_bytes, host_spec

    p = scenario.parallel
    where = f"{scenario.source}: cluster.topology = {scenario.cluster.topology!r}"
    try:
        host_capacity_bytes(topology)
        rates = host_spec(topology) if p.offload_optimizer != "none" or host_embeddings(scenario) else None
    except TopologyError as error:
        raise TopologyError(f"{where}: {error}") from None
    if "nvme" in (p.offload_optimizer, p.offload_params) and not drives_of_node(topology, 0):
        key = "offload_optimizer" if p.offload_optimizer == "nvme" else "offload_params"
        raise TopologyError(f"{where} has no NVMe drive: parallel.{key} = 'nvme' needs one (topologies with drives: "
                            f"{', '.join(_with_drives())})")
    ranks_on_node = min(world_size, topology.gpus_per_node)
    adam = stream = 0.0
    if rates is not None:
        adam = rates.cpu_adam_elements_per_s * ADAM_HOST_BYTES_PER_ELEMENT / ranks_on_node
        stream = rates.cpu_stream_bytes_per_s / ranks_on_node
    return OffloadConfig(p.offload_optimizer, p.offload_params, p.offload_activations,
                         prefetch_bucket_elements=p.prefetch_bucket_size, adam_bytes_per_s=adam,
                         stream_bytes_per_s=stream, embeddings="host" if host_embeddings(scenario) else "device")


def _with_drives() -> list[str]:
    from simulator.network.topology import list_topologies, load_topology

    return [name for name in list_topologies() if load_topology(name).server.components_of("nvme")]
