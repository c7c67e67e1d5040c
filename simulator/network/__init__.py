"""The network model: topologies as graphs, a flow-level network with max-min fair sharing, collectives as flows."""
