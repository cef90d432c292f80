"""Directed and time-varying graphs for push-based gossip (push-sum): whom each peer sends
to in step k. A pure function of the graph and k, so peers agree without talking.

The topology file keeps the peers and their undirected graph; a push graph is built on top
of it: the topology's graph in both directions, explicit directed edges, or a schedule
(``one-peer-exponential``) that changes every step.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import networkx as nx
import numpy as np

from gossip.errors import TopologyError
from gossip.topology.address import is_int

#: The schedules ``push_graph`` builds by name.
SCHEDULES = ("graph", "one-peer-exponential")


class PushGraph(ABC):
    """Who sends to whom in each step, on ranks ``0..size-1``; the pattern repeats every
    ``period`` steps."""

    def __init__(self, size: int, period: int = 1):
        self.size, self.period = size, period

    @abstractmethod
    def out_neighbors(self, rank: int, step: int) -> tuple[int, ...]:
        """The peers ``rank`` sends to in ``step``, sorted."""

    def in_neighbors(self, rank: int, step: int) -> tuple[int, ...]:
        """The peers that send to ``rank`` in ``step``, sorted."""
        return tuple(i for i in range(self.size) if rank in self.out_neighbors(i, step))

    def partners(self, rank: int) -> tuple[int, ...]:
        """Every peer ``rank`` ever sends to or hears from, sorted."""
        steps = range(self.period)
        return tuple(sorted({j for k in steps for j in (*self.out_neighbors(rank, k),
                                                          *self.in_neighbors(rank, k))}))

    def push_matrix(self, step: int) -> np.ndarray:
        """Push-sum's column-stochastic P of ``step``: column i spreads 1/(d_out(i) + 1) over
        peer i itself and each of its out-neighbours."""
        p = np.zeros((self.size, self.size))
        for i in range(self.size):
            targets = (i, *self.out_neighbors(i, step))
            p[list(targets), i] = 1.0 / len(targets)
        return p


class OnePeerExponential(PushGraph):
    """Step k: every peer sends to rank + 2^(k mod (floor(log2(size - 1)) + 1)) (mod size),
    one peer per step (Assran et al., SGP). With a power-of-two size, log2(size) steps
    average exactly."""

    def __init__(self, size: int):
        super().__init__(size, (size - 1).bit_length() if size > 1 else 1)  # ⌊log2(n-1)⌋+1

    def offset(self, step: int) -> int:
        return (1 << (step % self.period)) % self.size

    def out_neighbors(self, rank: int, step: int) -> tuple[int, ...]:
        offset = self.offset(step)
        return () if offset == 0 else ((rank + offset) % self.size,)

    def in_neighbors(self, rank: int, step: int) -> tuple[int, ...]:
        offset = self.offset(step)
        return () if offset == 0 else ((rank - offset) % self.size,)


class StaticDigraph(PushGraph):
    """The same directed edges in every step; ``(a, b)``: a sends to b.

    Raises:
        TopologyError: naming the edge at fault, or the peers no path reaches (push-sum
            needs a strongly connected graph to reach consensus).
    """

    def __init__(self, size: int, edges: Sequence[Sequence[int]]):
        super().__init__(size)
        graph = nx.DiGraph()
        graph.add_nodes_from(range(size))
        for index, edge in enumerate(edges):
            where = f"edges[{index}]"
            if (not isinstance(edge, (list, tuple)) or len(edge) != 2
                    or not all(is_int(r) and 0 <= r < size for r in edge)):
                raise TopologyError(f"{where}: expected a pair [from, to] of ranks 0..{size - 1}"
                                    f", got {edge!r}")
            a, b = edge
            if a == b:
                raise TopologyError(f"{where}: self-loop on rank {a}")
            if graph.has_edge(a, b):
                raise TopologyError(f"{where}: duplicate edge {a}->{b}")
            graph.add_edge(a, b)
        if size > 1 and not nx.is_strongly_connected(graph):
            parts = sorted(sorted(c) for c in nx.strongly_connected_components(graph))
            raise TopologyError(f"edges: the directed graph is not strongly connected "
                                f"(components {parts}): push-sum cannot reach consensus")
        self._out = {r: tuple(sorted(graph.successors(r))) for r in range(size)}
        self._in = {r: tuple(sorted(graph.predecessors(r))) for r in range(size)}

    def out_neighbors(self, rank: int, step: int) -> tuple[int, ...]:
        return self._out[rank]

    def in_neighbors(self, rank: int, step: int) -> tuple[int, ...]:
        return self._in[rank]


def push_graph(schedule: str, topology, edges: Sequence[Sequence[int]] | None = None) -> PushGraph:
    """The push graph for ``topology``'s peers: explicit directed ``edges`` if given, else
    ``schedule``: ``graph`` (the topology's edges both ways) or ``one-peer-exponential``."""
    if edges is not None:
        return StaticDigraph(topology.size, edges)
    if schedule == "one-peer-exponential":
        return OnePeerExponential(topology.size)
    if schedule == "graph":
        return StaticDigraph(topology.size, [e for a, b in topology.edges()
                                             for e in ((a, b), (b, a))])
    raise TopologyError(f"schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
