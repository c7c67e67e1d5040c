"""The network model: topologies as graphs, a flow-level network with max-min fair sharing, collectives as flows."""

from simulator.network.collectives import (
    CollectiveResult,
    CollectiveSchedule,
    choose_algorithm,
    collective_time_s,
    lower_collective,
    run_collective,
)
from simulator.network.flows import Delivery, Flow, FlowNetwork
from simulator.network.topology import Route, Topology, list_topologies, load_topology

__all__ = ["CollectiveResult", "CollectiveSchedule", "Delivery", "Flow", "FlowNetwork", "Route", "Topology",
           "choose_algorithm", "collective_time_s", "list_topologies", "load_topology", "lower_collective",
           "run_collective"]
