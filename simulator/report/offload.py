"""The offload part of the JSON report: host memory per rank and per node (against the node's capacity) and the
bytes each offload route moved per iteration."""

from __future__ import annotations

from simulator.offload.host_memory import HostMemory, node_peak_bytes
from simulator.parallel.program import Transfer
from simulator.trace.records import COMM_PHASE

ROUTE_KEYS = {"d2h": "d2h_bytes", "h2d": "h2d_bytes", "nvme_read": "nvme_read_bytes",
              "nvme_write": "nvme_write_bytes", "host": "host_dram_bytes"}


def host_outcomes(programs, trace) -> list:
    """Each simulated rank's HostOutcome (offload/host_memory.py), in program order."""
    return [HostMemory(program.host_tensors).replay(rank_trace.host_events)
            for program, rank_trace in zip(programs, trace.ranks)]


def node_host_memory(plan, programs, outcomes, topology, full: bool, capacity: int | None = None) -> list[dict]:
    """Per node: the host memory its ranks need together at most, the node's capacity, whether it fits.

    Under the symmetry reduction a rank not simulated runs its stage representative's program at the same times, so
    a node's level is the sum of its ranks' representatives' levels (exact where the reduction applies); with
    `full` every rank is its own. `capacity`: the node's host memory (None: the topology's).
    """
    from simulator.network.host import host_capacity_bytes

    if capacity is None:
        capacity = host_capacity_bytes(topology)
    by_rank = {program.rank: k for k, program in enumerate(programs)}
    per_node = topology.gpus_per_node
    nodes = []
    for node in range(-(-plan.world_size // per_node)):
        counts: dict[int, int] = {}
        for rank in range(node * per_node, min((node + 1) * per_node, plan.world_size)):
            source = rank if full else plan.rank_of(dp=0, pp=plan.stage_of(rank), tp=0)
            counts[by_rank[source]] = counts.get(by_rank[source], 0) + 1
        peak, when = node_peak_bytes([(outcomes[k].timeline, count) for k, count in sorted(counts.items())])
        nodes.append({"node": node, "ranks": sum(counts.values()), "peak_bytes": int(peak), "peak_time_s": when,
                      "capacity_bytes": int(capacity), "fits": peak <= capacity})
    return nodes


def route_bytes(rank_trace, warmup_iterations: int, iterations: int) -> dict[str, float]:
    """Bytes each offload route moved per measured iteration on one rank (its transfer spans)."""
    totals = {key: 0.0 for key in ROUTE_KEYS.values()}
    for span in rank_trace.spans:
        if span.phase == COMM_PHASE and span.kind in ROUTE_KEYS and span.iteration >= warmup_iterations:
            totals[ROUTE_KEYS[span.kind]] += span.bytes
    return {key: value / max(1, iterations) for key, value in totals.items()}


def has_transfers(program) -> bool:
    """Whether a program posts any offload transfer."""
    return any(type(ins) is Transfer for instructions in program.streams.values() for ins in instructions)


class OffloadSummary:
    """What an offloading run adds to its report: host memory by rank and node, traffic by route (report.fill)."""

    def __init__(self, scenario, cluster, plan, programs, trace, full: bool):
        self.outcomes = {program.rank: outcome for program, outcome in zip(programs, host_outcomes(programs, trace))}
        self.nodes = node_host_memory(plan, programs, list(self.outcomes.values()), cluster.topology, full,
                                      scenario.cluster.host_memory)
        run = scenario.run
        self.bytes = route_bytes(trace.ranks[0], run.warmup_iterations, run.iterations)
        self.capacity = self.nodes[0]["capacity_bytes"] if self.nodes else None

    def fill(self, report: dict, scenario) -> None:
        """Add the host memory keys to `report` (a build_multi_report result), its `offload` section and the host's
        part of `fits`."""
        for rank in report["ranks"]:
            outcome = self.outcomes.get(rank["rank"])
            if outcome is None:
                continue
            rank.update({"host_peak_bytes": int(outcome.peak_bytes),
                         "host_pinned_bytes": int(outcome.pinned_reserved_bytes),
                         "nvme_peak_bytes": int(outcome.nvme_peak_bytes), "host_capacity_bytes": self.capacity,
                         "host_breakdown_at_peak": {k: int(v) for k, v in outcome.breakdown_at_peak.items()}})
        p, breakdown = scenario.parallel, report["time_breakdown"]
        report["offload"] = {"optimizer": p.offload_optimizer, "params": p.offload_params,
                             "activations": p.offload_activations,
                             "embeddings": scenario.model.embedding_placement or "device",
                             "traffic_s": breakdown["offload_traffic_s"], "host_compute_s": breakdown["host_compute_s"],
                             "exposed_s": breakdown["exposed_offload_s"],
                             **{key: float(value) for key, value in self.bytes.items()}}
        report["host_memory"] = self.nodes
        for node in self.nodes:
            if not node["fits"]:
                report["fits"] = False
                report["warnings"].append(
                    f"host memory of node {node['node']}: its {node['ranks']} rank(s) need {node['peak_bytes']} bytes "
                    f"at most, more than its {node['capacity_bytes']} bytes: the job does not fit")
