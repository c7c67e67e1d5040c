"""Where a collective that ran alone on its links stands at a later time: the state to hand to a shared network."""

from __future__ import annotations

from simulator.network.collectives import CollectiveSchedule
from simulator.network.flows import Flow, FlowNetwork, RoutingModel


def state_at(topology: RoutingModel, schedule: CollectiveSchedule, start_s: float,
             now_s: float) -> tuple[int, float | None, tuple[Flow, ...]]:
    """The state at `now_s` of `schedule` started at `start_s` and run alone since (as `simulate_schedule` runs it).

    Args:
        topology: the routing model.
        schedule: the lowered collective or transfer.
        start_s: when it started.
        now_s: the time asked (>= start_s).

    Returns:
        (phase, ready_s, flows): the phase it is in (len(phases): finished); when it still waits for that phase's
        latency, the time its flows start (else None); the flows of the phase still sending, with the bytes they
        have left (those delivered by now_s, at now_s included, are dropped).
    """
    network = FlowNetwork(topology, start_s=start_s)
    for index, phase in enumerate(schedule.phases):
        ready = network.now_s + phase.latency_s
        if ready > now_s:
            return index, ready, ()
        network.advance(ready)
        network.start_many(phase.flows, with_latency=False)
        while True:
            event = network.next_event_s()
            if event is None:
                break                   # the phase's flows are all delivered (at network.now_s)
            if event > now_s:
                network.advance(now_s)
                return index, None, tuple(Flow(flow.src, flow.dst, left, flow.max_bytes_per_s, flow.tag)
                                          for flow, left in network.sending())
            network.advance(event)
    return len(schedule.phases), None, ()


def alone_steps(topology: RoutingModel, schedule: CollectiveSchedule) -> tuple[tuple[float, float | None], ...] | None:
    """Per phase (latency, seconds its flows send) when each phase's flows, run alone, all end at one event of the
    flow network (else None): then the phases run alone from a start time t end at `alone_end_s(steps, t)`, by the
    float operations a shared FlowNetwork does for them (its phase starts after `latency`, each flow's end is the
    start plus bytes / rate, the events of one phase's flows are one event at the least of them)."""
    network = FlowNetwork(topology)
    steps = []
    for phase in schedule.phases:
        network.advance(network.now_s + phase.latency_s)
        if not phase.flows:
            steps.append((phase.latency_s, None))
            continue
        if any(flow.size_bytes == 0 for flow in phase.flows):
            return None
        ids = network.start_many(phase.flows, with_latency=False)
        rates = network.rates()
        if len(rates) != len(ids) or not all(rate > 0.0 for rate in rates.values()):
            return None
        sends = min(float(flow.size_bytes) / rates[flow_id] for flow_id, flow in zip(ids, phase.flows))
        event = network.next_event_s()
        network.advance(event)
        if network.active_count:
            return None         # some flows end at a later event (rates change on the way)
        steps.append((phase.latency_s, sends))
    return tuple(steps)


def alone_end_s(steps: tuple[tuple[float, float | None], ...], start_s: float) -> float:
    """When phases with `alone_steps`'s answer `steps`, started at `start_s`, end run alone."""
    now = start_s
    for latency, sends in steps:
        now = now + latency
        if sends is not None:
            now = now + sends
    return now
