"""A peer's neighbours on the topology's static graph and their Metropolis-Hastings
weights; a dead neighbour's weight moves onto the peer's own."""

from __future__ import annotations

import logging


log = logging.getLogger("gossip.strategies")


class Neighbourhood:
    """Row ``rank`` of the topology's mixing matrix, as neighbours and weights.

    A neighbour dropped as dead is gone for good and its weight W_ij joins W_ii. Each
    survivor does this for its own row alone, with no agreement needed, and the matrix stays
    symmetric and doubly stochastic on the survivors, so they still average to consensus.
    Re-running Metropolis-Hastings on the smaller graph would change the weights of peers two
    hops away too, which all would have to switch in the same round.
    """

    def __init__(self, topology, rank: int, members=None):
        """Row ``rank`` of the topology's matrix; with ``members`` (ids: an elastic run's
        view), of Metropolis-Hastings on the graph the topology's rule gives them
        (``Topology.view_graph``)."""
        if members is None:
            ids, row = range(topology.size), topology.mixing_matrix()[rank]
        else:
            ids, matrix = topology.view_mixing(members)
            row = matrix[ids.index(rank)]
        slot = {member: index for index, member in enumerate(ids)}
        self.rank = rank
        self.neighbors: tuple[int, ...] = tuple(
            member for member, weight in zip(ids, row) if weight and member != rank)
        self.self_weight = float(row[slot[rank]])
        self.weights = {j: float(row[slot[j]]) for j in self.neighbors}
        self.dropped: dict[int, int] = {}  # dead neighbour -> round it was dropped in

    def drop(self, j: int, round: int) -> float:
        """Take dead (or, in an elastic run, departed) neighbour ``j`` out for good; returns
        its weight, now part of ours."""
        weight = self.weights.pop(j)
        self.self_weight += weight
        self.neighbors = tuple(n for n in self.neighbors if n != j)
        self.dropped[j] = round
        log.warning("rank %d: dropped gone neighbour %d in round %d; its weight %.4g moves to "
                    "this peer's own (now %.4g)", self.rank, j, round, weight, self.self_weight)
        return weight
