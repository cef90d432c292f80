"""The graph of an elastic run's view (gossip/topology/views.py): a generator re-evaluated
over the members' sorted ids, an explicit graph induced on them; the generator travels in
the topology file the launcher writes."""

from __future__ import annotations

import math

import networkx as nx
import pytest

from gossip.errors import TopologyError
from gossip.topology import Topology
from gossip.topology.generators import near_torus
from gossip.topology.views import view_mixing


def relabelled(graph: nx.Graph, ids) -> set[frozenset]:
    ids = sorted(ids)
    return {frozenset((ids[a], ids[b])) for a, b in graph.edges()}


def edges(graph: nx.Graph) -> set[frozenset]:
    return {frozenset(edge) for edge in graph.edges()}


def exponential(n: int) -> nx.Graph:
    return nx.Graph([(i, (i + 2 ** k) % n) for i in range(n) for k in range(n.bit_length())
                     if 2 ** k < n])


ORACLES = {"ring": nx.cycle_graph, "exponential": exponential, "complete": nx.complete_graph,
           "line": nx.path_graph}


@pytest.mark.parametrize("kind, members", [
    ("ring", (0, 2, 3, 7, 9)), ("exponential", range(1, 12)), ("complete", (4, 1, 6)),
    ("line", (0, 5, 6))])
def test_a_generator_is_re_evaluated_over_the_sorted_ids(kind, members):
    graph = Topology.generate(kind, 12).view_graph(members)
    assert sorted(graph.nodes) == sorted(members)
    assert edges(graph) == relabelled(ORACLES[kind](len(list(members))), members)


def test_a_torus_keeps_its_rows_at_its_size_and_is_near_a_square_at_others():
    topology = Topology.generate("torus", rows=2, cols=8)
    assert edges(topology.view_graph(range(2, 18))) == relabelled(topology.graph, range(2, 18))
    assert edges(topology.view_graph(range(12))) == edges(Topology.generate(
        "torus", rows=3, cols=4).graph)  # 3 x 4
    for n in (5, 7, 11, 13):  # no divisor near sqrt(n): i ~ i±1, i±ceil(sqrt n)
        hop = math.ceil(math.sqrt(n))
        expected = {frozenset((i, (i + h) % n)) for i in range(n) for h in (1, hop)}
        assert edges(near_torus(n)) == expected
        assert all(d <= 4 for _, d in near_torus(n).degree()) and nx.is_connected(near_torus(n))


def test_an_explicit_graph_is_induced_on_the_members_and_joined_up_if_split():
    topology = Topology.from_dict({"size": 6, "edges": [[0, 1], [1, 2], [2, 3], [3, 0],
                                                         [4, 0], [5, 4]]})
    assert topology.generator is None
    assert edges(topology.view_graph((0, 1, 2, 3, 4))) == {
        frozenset(e) for e in ((0, 1), (1, 2), (2, 3), (3, 0), (0, 4))}
    # without 0, {1, 2, 3} and {4, 5} are apart: one edge between their lowest ids
    assert edges(topology.view_graph((1, 2, 3, 4, 5))) == {
        frozenset(e) for e in ((1, 2), (2, 3), (4, 5), (1, 4))}


def test_view_mixing_is_metropolis_hastings_on_the_slots():
    graph = Topology.generate("ring", 8).view_graph((1, 3, 4, 6))
    ids, matrix = view_mixing(graph)
    assert ids == (1, 3, 4, 6)
    assert matrix.sum(axis=1) == pytest.approx([1.0] * 4) and (matrix == matrix.T).all()
    assert matrix[0, 1] == pytest.approx(1 / 3) and matrix[0, 2] == 0.0


def test_the_generator_travels_in_the_written_file_and_must_give_its_edges(tmp_path):
    topology = Topology.generate("torus", rows=2, cols=3).relocated(host="127.0.0.2")
    topology.to_yaml(tmp_path / "t.yaml")
    back = Topology.from_yaml(tmp_path / "t.yaml")
    assert back == topology and back.generator == {"kind": "torus", "rows": 2, "cols": 3}
    assert Topology.from_dict({"size": 4, "graph": {"kind": "ring"}}).generator == {
        "kind": "ring"}
    with pytest.raises(TopologyError, match="generator: exponential does not give these "
                                            "edges"):
        Topology.from_dict({"size": 5, "edges": [[0, 1], [1, 2], [2, 3], [3, 4], [4, 0]],
                            "generator": {"kind": "exponential"}})
    with pytest.raises(TopologyError, match="give 'generator' only beside 'edges'"):
        Topology.from_dict({"size": 4, "graph": {"kind": "ring"},
                            "generator": {"kind": "ring"}})
