"""Unit tests for gossip.topology: generators, weights, Topology and YAML files."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import networkx as nx
import numpy as np
import pytest
import yaml

from gossip.errors import ConfigError, TopologyError
from gossip.topology import GENERATORS, PeerAddress, Topology, metropolis_hastings
from gossip.topology.generators import build
from gossip.topology.weights import second_eigenvalue, spectral_gap

TOPOLOGIES = Path(__file__).resolve().parents[2] / "topologies"
SHIPPED = sorted(TOPOLOGIES.glob("*.yaml"))


def degrees(graph: nx.Graph) -> Counter:
    """Degree histogram {degree: how many nodes}."""
    return Counter(d for _, d in graph.degree())


def assert_simple(graph: nx.Graph, n: int) -> None:
    assert sorted(graph.nodes) == list(range(n))
    assert nx.number_of_selfloops(graph) == 0


# -- generators -------------------------------------------------------------------


@pytest.mark.parametrize(
    "n, hist, edges",
    [(1, {0: 1}, 0), (2, {1: 2}, 1), (3, {2: 3}, 3), (7, {2: 7}, 7), (8, {2: 8}, 8)],
)
def test_ring(n, hist, edges):
    graph = build("ring", n)
    assert_simple(graph, n)
    assert degrees(graph) == hist and graph.number_of_edges() == edges


@pytest.mark.parametrize(
    "n, hist, edges", [(1, {0: 1}, 0), (2, {1: 2}, 1), (5, {1: 2, 2: 3}, 4), (11, {1: 2, 2: 9}, 10)]
)
def test_line(n, hist, edges):
    graph = build("line", n)
    assert_simple(graph, n)
    assert degrees(graph) == hist and graph.number_of_edges() == edges


@pytest.mark.parametrize("n", [1, 2, 5, 7, 8])
def test_complete(n):
    graph = build("complete", n)
    assert_simple(graph, n)
    assert degrees(graph) == {n - 1: n} and graph.number_of_edges() == n * (n - 1) // 2


@pytest.mark.parametrize("n, hist", [(1, {0: 1}), (2, {1: 2}), (5, {4: 1, 1: 4}), (13, {12: 1, 1: 12})])
def test_star(n, hist):
    graph = build("star", n)
    assert_simple(graph, n)
    assert degrees(graph) == hist and graph.degree(0) == n - 1


@pytest.mark.parametrize(
    "n, hist, edges",
    [
        (1, {0: 1}, 0),
        (2, {1: 2}, 1),
        (3, {2: 3}, 3),  # hops 1, 2: hop 2 is hop 1 backwards
        (4, {3: 4}, 6),  # hops 1, 2: hop 2 pairs opposite corners
        (5, {4: 5}, 10),  # hops 1, 2, 4: hop 4 is hop 1 backwards
        (7, {6: 7}, 21),  # hops 1, 2, 4 (= -3): complete
        (8, {5: 8}, 20),  # hops 1, 2, 4: hop 4 is its own inverse
        (16, {7: 16}, 56),
    ],
)
def test_exponential(n, hist, edges):
    graph = build("exponential", n)
    assert_simple(graph, n)
    assert degrees(graph) == hist and graph.number_of_edges() == edges


@pytest.mark.parametrize(
    "rows, cols, hist, edges",
    [
        (1, 1, {0: 1}, 0),
        (1, 2, {1: 2}, 1),
        (1, 5, {2: 5}, 5),  # a ring
        (2, 2, {2: 4}, 4),  # a 4-cycle, no duplicate wrap edges
        (2, 4, {3: 8}, 12),
        (3, 3, {4: 9}, 18),
        (3, 5, {4: 15}, 30),
        (4, 1, {2: 4}, 4),
    ],
)
def test_torus(rows, cols, hist, edges):
    graph = build("torus", rows=rows, cols=cols)  # n implied
    assert_simple(graph, rows * cols)
    assert degrees(graph) == hist and graph.number_of_edges() == edges
    assert nx.utils.graphs_equal(graph, build("torus", rows * cols, rows=rows, cols=cols))


@pytest.mark.parametrize("n", [1, 2, 7, 13])
def test_erdos_renyi_connected_and_deterministic(n):
    graph = build("erdos_renyi", n, p=0.3, seed=4)
    assert_simple(graph, n)
    assert nx.is_connected(graph)
    assert sorted(graph.edges) == sorted(build("erdos_renyi", n, p=0.3, seed=4).edges)


def test_erdos_renyi_gives_up():
    with pytest.raises(ConfigError, match="erdos_renyi: no connected graph"):
        build("erdos_renyi", 5, p=0.0)


def test_registry_lists_all_kinds():
    assert GENERATORS.names() == sorted(
        ["complete", "erdos_renyi", "exponential", "line", "ring", "star", "torus"]
    )
    assert GENERATORS.create("ring", n=3).number_of_edges() == 3


@pytest.mark.parametrize(
    "call, fragment",
    [
        (lambda: build("hypercube", 4), "available: complete, erdos_renyi"),
        (lambda: build("torus", 8, rows=2), "missing parameter 'cols'"),
        (lambda: build("ring", 4, rows=2), "unexpected parameter 'rows'"),
        (lambda: build("erdos_renyi", 4), "missing parameter 'p'"),
        (lambda: build("ring"), "missing parameter 'n'"),
        (lambda: build("ring", 0), "n must be a positive integer"),
        (lambda: build("torus", 6, rows=2, cols=4), "does not match n = 6"),
        (lambda: build("torus", rows=2, cols="4"), "cols must be a positive integer"),
        (lambda: build("erdos_renyi", 4, p=1.5), "p must be a probability"),
    ],
)
def test_generator_errors_name_the_parameter(call, fragment):
    with pytest.raises(ConfigError) as info:
        call()
    assert fragment in str(info.value)


# -- weights ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "graph",
    [build("ring", 6), build("star", 5), build("line", 4), build("erdos_renyi", 9, p=0.4)],
    ids=["ring", "star", "line", "erdos_renyi"],
)
def test_metropolis_hastings_properties(graph):
    w = metropolis_hastings(graph)
    assert w.dtype == np.float64
    np.testing.assert_allclose(w, w.T)
    np.testing.assert_allclose(w.sum(axis=0), 1.0)
    np.testing.assert_allclose(w.sum(axis=1), 1.0)
    assert (w >= 0).all()
    # Zero exactly where there is no edge (off the diagonal).
    adjacency = nx.to_numpy_array(graph, nodelist=range(len(w))) > 0
    off = ~np.eye(len(w), dtype=bool)
    assert ((w[off] > 0) == adjacency[off]).all()


def test_metropolis_hastings_matches_hand_oracle():
    # Path 0-1-2 plus pendant 3 on 1: degrees 1, 3, 1, 1.
    graph = nx.Graph([(0, 1), (1, 2), (1, 3)])
    expected = np.array(
        [
            [3 / 4, 1 / 4, 0, 0],
            [1 / 4, 1 / 4, 1 / 4, 1 / 4],
            [0, 1 / 4, 3 / 4, 0],
            [0, 1 / 4, 0, 3 / 4],
        ]
    )
    np.testing.assert_allclose(metropolis_hastings(graph), expected)
    # Triangle with a tail 2-3: degrees 2, 2, 3, 1.
    graph = nx.Graph([(0, 1), (0, 2), (1, 2), (2, 3)])
    expected = np.array(
        [
            [1 - 1 / 3 - 1 / 4, 1 / 3, 1 / 4, 0],
            [1 / 3, 1 - 1 / 3 - 1 / 4, 1 / 4, 0],
            [1 / 4, 1 / 4, 1 - 3 / 4, 1 / 4],
            [0, 0, 1 / 4, 3 / 4],
        ]
    )
    np.testing.assert_allclose(metropolis_hastings(graph), expected)


@pytest.mark.parametrize("n", [2, 3, 4, 7])
def test_spectral_gap_complete_is_one(n):
    assert spectral_gap(metropolis_hastings(build("complete", n))) == pytest.approx(1.0)


@pytest.mark.parametrize("n", [3, 4, 5, 8, 11])
def test_spectral_gap_ring_matches_numpy_and_closed_form(n):
    w = metropolis_hastings(build("ring", n))
    eig = np.sort(np.abs(np.linalg.eigvals(w)))[::-1]
    # Circulant (1/3)(I + S + S^-1): eigenvalues 1/3 + 2/3 cos(2 pi k / n).
    closed = max(abs(1 / 3 + 2 / 3 * np.cos(2 * np.pi * k / n)) for k in range(1, n))
    assert second_eigenvalue(w) == pytest.approx(eig[1]) == pytest.approx(closed)
    assert spectral_gap(w) == pytest.approx(1 - closed)


def test_spectral_gap_single_peer():
    assert spectral_gap(np.ones((1, 1))) == 1.0
    assert Topology.ring(1).spectral_gap() == 1.0


# -- Topology ---------------------------------------------------------------------


def test_topology_accessors():
    topo = Topology.ring(5, host="10.0.0.1", base_port=9000)
    assert topo.size == 5 and topo.name == "ring-5"
    assert topo.neighbors(0) == (1, 4) and topo.degree(3) == 2
    assert topo.address(2) == "tcp://10.0.0.1:9002"
    assert topo.peers[4] == PeerAddress(4, "10.0.0.1", 9004)
    assert topo.edges() == [(0, 1), (0, 4), (1, 2), (2, 3), (3, 4)]
    assert PeerAddress(0, "::1", 7000).endpoint == "tcp://[::1]:7000"
    with pytest.raises(TopologyError, match="rank 5 is not a peer"):
        topo.neighbors(5)


def test_topology_is_immutable():
    topo = Topology.ring(4)
    with pytest.raises(nx.NetworkXError):
        topo.graph.add_edge(0, 2)
    w = topo.mixing_matrix()
    w[0, 0] = 42.0  # the caller's copy, not the cache
    assert topo.mixing_matrix()[0, 0] == pytest.approx(1 / 3)
    with pytest.raises(AttributeError):
        topo.name = "other"


def test_topology_copies_input_graph():
    graph = nx.Graph([(0, 1), (1, 2)])
    topo = Topology(graph, [PeerAddress(r, "h", 7000 + r) for r in (2, 0, 1)])
    graph.add_edge(0, 2)
    assert topo.edges() == [(0, 1), (1, 2)]
    assert [p.rank for p in topo.peers] == [0, 1, 2]  # sorted by rank


def test_generate_torus_implied_n():
    topo = Topology.generate("torus", rows=2, cols=4, base_port=8000)
    assert topo.size == 8 and topo.address(7) == "tcp://127.0.0.1:8007"
    assert all(topo.degree(r) == 3 for r in range(8))


def test_relocated_keeps_graph():
    topo = Topology.from_yaml(TOPOLOGIES / "irregular-7.yaml")
    moved = topo.relocated(host="10.1.1.1", ports=[9100 + r for r in range(7)])
    assert moved.edges() == topo.edges() and moved.name == topo.name
    assert moved.address(3) == "tcp://10.1.1.1:9103"
    np.testing.assert_array_equal(moved.mixing_matrix(), topo.mixing_matrix())
    assert topo.relocated(ports=[5000 + r for r in range(7)]).peers[0].host == "127.0.0.1"
    assert topo.relocated() == topo
    with pytest.raises(TopologyError, match="ports: expected 7 ports"):
        topo.relocated(ports=[1, 2])
    with pytest.raises(TopologyError, match="duplicate address"):
        topo.relocated(ports=[9000] * 7)


def test_describe():
    text = Topology.from_yaml(TOPOLOGIES / "ring-4.yaml").describe()
    assert "ring-4" in text and "P=4" in text
    assert "rank 0  127.0.0.1:7000  degree 2  neighbours [1, 3]" in text
    assert "0-1 0-3 1-2 2-3" in text
    assert "0.333 0.333 0.000 0.333" in text
    assert "spectral gap: 0.6667" in text and "second largest |eigenvalue|: 0.3333" in text


@pytest.mark.parametrize(
    "graph, peers, fragment",
    [
        (nx.Graph([(0, 1)]), [PeerAddress(0, "h", 1), PeerAddress(0, "h", 2)], "duplicate rank 0"),
        (nx.Graph([(0, 1)]), [PeerAddress(0, "h", 1), PeerAddress(2, "h", 2)], "missing peer rank 1"),
        (nx.Graph([(0, 1)]), [PeerAddress(0, "h", 1), PeerAddress(1, "h", 1)], "duplicate address h:1"),
        (nx.Graph([(0, 3)]), [PeerAddress(0, "h", 1), PeerAddress(1, "h", 2)], "node 3 is not a peer"),
        (nx.Graph([(0, 0), (0, 1)]), [PeerAddress(0, "h", 1), PeerAddress(1, "h", 2)], "self-loop"),
        (nx.DiGraph([(0, 1)]), [PeerAddress(0, "h", 1), PeerAddress(1, "h", 2)], "undirected"),
        (nx.Graph([(0, 1)]), [PeerAddress(0, "h", 1), PeerAddress(1, "", 2)], "peers[1].host"),
        (nx.Graph([(0, 1)]), [PeerAddress(0, "h", 1), PeerAddress(1, "h", 0)], "peers[1].port"),
        (nx.Graph([(0, 1)]), [PeerAddress(0, "h", 1), PeerAddress(True, "h", 2)], "peers[1].rank"),
        (nx.Graph(), [], "at least one peer"),
    ],
)
def test_constructor_validation(graph, peers, fragment):
    with pytest.raises(TopologyError) as info:
        Topology(graph, peers)
    assert fragment in str(info.value)


# -- YAML files -------------------------------------------------------------------


def test_shipped_files_exist():
    names = {path.name for path in SHIPPED}
    assert {
        "ring-4.yaml",
        "ring-8.yaml",
        "torus-2x4.yaml",
        "complete-4.yaml",
        "exponential-8.yaml",
        "irregular-7.yaml",
    } <= names


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_file_loads_and_round_trips(path, tmp_path):
    topo = Topology.from_yaml(path)
    assert topo.name == path.stem
    assert nx.is_connected(topo.graph)
    assert Topology.from_dict(topo.to_dict()) == topo
    topo.to_yaml(tmp_path / "copy.yaml")
    assert Topology.from_yaml(tmp_path / "copy.yaml") == topo


def test_irregular_7_is_irregular():
    topo = Topology.from_yaml(TOPOLOGIES / "irregular-7.yaml")
    assert topo.size == 7
    assert {topo.degree(r) for r in range(7)} >= {1, 2, 3, 4}


def test_short_forms():
    by_hosts = Topology.from_dict(
        {"hosts": ["a", "b", "c"], "base_port": 6000, "graph": {"kind": "line"}}
    )
    assert [p.endpoint for p in by_hosts.peers] == ["tcp://a:6000", "tcp://b:6001", "tcp://c:6002"]
    by_size = Topology.from_dict({"size": 2, "edges": [[0, 1]]})
    assert by_size.address(1) == "tcp://127.0.0.1:7001" and by_size.name is None
    single = Topology.from_dict({"size": 1, "edges": []})
    assert single.size == 1 and single.mixing_matrix().tolist() == [[1.0]]


def test_unnamed_file_takes_stem(tmp_path):
    path = tmp_path / "my-ring.yaml"
    path.write_text("size: 3\ngraph: {kind: ring}\n")
    assert Topology.from_yaml(path).name == "my-ring"


def _peers(*ports, ranks=None):
    ranks = ranks if ranks is not None else range(len(ports))
    return [{"rank": r, "host": "127.0.0.1", "port": p} for r, p in zip(ranks, ports)]


RING3 = {"graph": {"kind": "ring"}}

BAD_DOCS = [
    # (document, expected message fragment after "<path>: ")
    ({"peers": _peers(7000, 7001, 70000), **RING3}, "peers[2].port: 70000 is not a valid port (1-65535)"),
    ({"peers": _peers(7000, "x"), **RING3}, "peers[1].port: expected an integer"),
    ({"peers": _peers(7000, 7001, ranks=[0, "1"]), **RING3}, "peers[1].rank: expected an integer"),
    (
        {"peers": [{"rank": 0, "host": "", "port": 7000}], "edges": []},
        "peers[0].host: expected a non-empty string",
    ),
    (
        {"peers": _peers(7000, 7001, 7002, 7003, 7004, ranks=[0, 3, 1, 2, 3]), **RING3},
        "duplicate rank 3 in peers[1] and peers[4]",
    ),
    (
        {"peers": _peers(7000, 7001, 7002, 7003, 7004, ranks=[0, 1, 3, 4, 5]), **RING3},
        "missing peer rank 2 (ranks must be 0..4)",
    ),
    (
        {"peers": _peers(7000, 7000), **RING3},
        "duplicate address 127.0.0.1:7000 (ranks 0 and 1)",
    ),
    ({"peers": [{"rank": 0, "host": "h"}], "edges": []}, "peers[0].port: missing"),
    ({"peers": [{"rank": 0, "host": "h", "port": 1, "x": 1}], "edges": []}, "peers[0]: unknown key 'x'"),
    ({"peers": ["h:1"], "edges": []}, "peers[0]: expected a mapping"),
    ({"size": 4, "edges": [[0, 1], [2, 3]]}, "graph is disconnected: components {0,1} and {2,3}"),
    ({"size": 5, "edges": [[0, 1], [2, 3]]}, "components {0,1}, {2,3} and {4}"),
    ({"size": 4, "edges": [[0, 1], [1, 2], [2, 3], [3, 9]]}, "edges[3]: rank 9 is not a peer"),
    ({"size": 4, "edges": [[1, 1]]}, "edges[0]: self-loop on rank 1"),
    ({"size": 3, "edges": [[0, 1], [1, 2], [1, 0]]}, "edges[2]: duplicate of edges[0]"),
    ({"size": 3, "edges": [[0, 1, 2]]}, "edges[0]: expected a pair"),
    ({"size": 3, "edges": [[0, "a"]]}, "edges[0]: expected integer ranks"),
    ({"size": 3, "edges": "0-1"}, "edges: expected a list"),
    ({"size": 3, **RING3, "colour": "red"}, "unknown key 'colour'"),
    ({"size": 3}, "one of 'graph' (a generator) or 'edges'"),
    ({"size": 3, **RING3, "edges": [[0, 1]]}, "either 'graph' or 'edges'"),
    ({"graph": {"kind": "ring"}}, "one of 'peers', 'hosts' or 'size' is required"),
    ({"size": 3, "hosts": ["a"], **RING3}, "give only one of"),
    ({"peers": _peers(7000), "base_port": 1, "edges": []}, "base_port: not allowed"),
    ({"size": 0, **RING3}, "size: expected a positive integer"),
    ({"size": 3, "base_port": 65534, **RING3}, "base_port: 65534 + 3 peers"),
    ({"size": 3, "base_port": 0, **RING3}, "base_port: 0 is not a valid port"),
    ({"hosts": ["a", 5], **RING3}, "hosts[1]: expected a non-empty host string"),
    ({"size": 3, "host": "", **RING3}, "host: expected a non-empty host string"),
    ({"size": 6, "graph": {"kind": "torus", "rows": 2, "cols": 4}}, "does not match n = 6"),
    ({"size": 8, "graph": {"kind": "torus", "rows": 2}}, "graph: torus: missing parameter 'cols'"),
    ({"size": 8, "graph": {"kind": "ring", "p": 2}}, "graph: ring: unexpected parameter 'p'"),
    ({"size": 8, "graph": {"kind": "blob"}}, "graph: unknown graph kind 'blob'; available: complete"),
    ({"size": 8, "graph": {"rows": 2}}, "graph.kind: expected a generator name"),
    ({"size": 8, "graph": {"kind": "ring", "n": 7}}, "graph.n: 7 does not match the 8 peers"),
    ({"size": 3, "name": 5, **RING3}, "name: expected a string"),
    ([1, 2], "expected a mapping at the top level"),
]


@pytest.mark.parametrize("doc, fragment", BAD_DOCS, ids=[f for _, f in BAD_DOCS])
def test_yaml_validation_errors(doc, fragment, tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(TopologyError) as info:
        Topology.from_yaml(path)
    message = str(info.value)
    assert message.startswith(f"{path}: ")
    assert fragment in message
    assert "\n" not in message


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("size: 3\ngraph: {kind: ring\n", "invalid YAML at line 3"),
        ("size: 3\npeers: [\n  - a: b: c\n", "invalid YAML at line"),
        ("size: 3\nsize: 4\ngraph: {kind: ring}\n", "invalid YAML at line 2: duplicate key 'size'"),
        ("", "file is empty"),
    ],
)
def test_malformed_yaml(text, fragment, tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text(text)
    with pytest.raises(TopologyError) as info:
        Topology.from_yaml(path)
    assert str(info.value).startswith(f"{path}: ") and fragment in str(info.value)
    assert "\n" not in str(info.value)


def test_missing_file(tmp_path):
    path = tmp_path / "nope.yaml"
    with pytest.raises(TopologyError, match="nope.yaml: no such file"):
        Topology.from_yaml(path)


def test_from_dict_uses_source():
    with pytest.raises(TopologyError, match=r"^cli: size: expected a positive integer"):
        Topology.from_dict({"size": -1, "edges": []}, source="cli")
    with pytest.raises(TopologyError, match=r"^<dict>: "):
        Topology.from_dict({"size": -1, "edges": []})
