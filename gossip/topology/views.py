"""The graph and mixing weights of an elastic run's view (spec elastic.md section 5).

A view of a gossip run holds some of the topology's ranks (ids). Its graph is rebuilt by the
topology's rule, the same on every member:

* a generated topology (``graph: {kind: ring}``, ``--graph``): the generator re-evaluated at
  the view's size over its members in id order (slot s is the s-th smallest id), with the
  same parameters; a torus at a size its rows x cols do not give is ``near_torus``'s;
* an explicit edge list: the graph induced on the members. Newcomers attach where the file
  says: an elastic run's spare ranks are part of the topology, and a topology is connected,
  so each spare names its own edges. A view that splits the induced graph (its members'
  edges all went with leavers or the dead) is joined up by one edge between the lowest ids
  of consecutive parts, in the order of those ids.

Its mixing matrix is Metropolis-Hastings on that graph: symmetric and doubly stochastic on
the members. ``ViewShape`` computes each once per member set: every member of a view asks
the same (a simulated run's 1,000 peers in one process ask 1,000 times, and the diameter
alone is O(P (P + E)) per ask).
"""

from __future__ import annotations

import functools

import networkx as nx
import numpy as np

from gossip.topology import generators
from gossip.topology.weights import metropolis_hastings


def view_graph(graph: nx.Graph, generator: dict | None, members) -> nx.Graph:
    """The graph of the view of ``members`` on their ids (see the module docstring);
    ``graph`` is the topology's, ``generator`` its spec (None: explicit edges)."""
    ids = sorted(members)
    if generator is None:
        return _induced(graph, ids)
    params = dict(generator)
    slots = generators.build_at(params.pop("kind"), len(ids), **params)
    return nx.relabel_nodes(slots, dict(enumerate(ids)))


class ViewShape:
    """A view's graph (frozen), its Metropolis-Hastings matrix (read-only) and diameter,
    each computed on first use."""

    def __init__(self, graph: nx.Graph):
        self.graph = nx.freeze(graph)

    @functools.cached_property
    def mixing(self) -> tuple[tuple[int, ...], np.ndarray]:
        """``view_mixing`` of the graph; the matrix is shared: it cannot be written."""
        ids, matrix = view_mixing(self.graph)
        matrix.setflags(write=False)
        return ids, matrix

    @functools.cached_property
    def diameter(self) -> int:
        return nx.diameter(self.graph)


def view_mixing(graph: nx.Graph) -> tuple[tuple[int, ...], np.ndarray]:
    """The ids of a view's ``graph`` in slot order and its Metropolis-Hastings matrix on
    those slots."""
    ids = tuple(sorted(graph.nodes))
    slots = nx.relabel_nodes(graph, {member: slot for slot, member in enumerate(ids)})
    return ids, metropolis_hastings(slots)


def _induced(graph: nx.Graph, ids: list[int]) -> nx.Graph:
    view = nx.Graph()
    view.add_nodes_from(ids)
    view.add_edges_from(graph.subgraph(ids).edges())
    lowest = sorted(min(part) for part in nx.connected_components(view))
    view.add_edges_from(zip(lowest, lowest[1:]))
    return view
