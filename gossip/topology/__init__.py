"""Peer graphs: addresses, generators, mixing weights and YAML files."""

from gossip.topology.address import PeerAddress
from gossip.topology.generators import GENERATORS
from gossip.topology.graph import Topology
from gossip.topology.weights import metropolis_hastings, second_eigenvalue, spectral_gap

__all__ = [
    "GENERATORS",
    "PeerAddress",
    "Topology",
    "metropolis_hastings",
    "second_eigenvalue",
    "spectral_gap",
]
