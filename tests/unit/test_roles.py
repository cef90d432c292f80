"""Parameter-server roles in topology files: the implied graph, and one-line errors that
name the field at fault."""

from __future__ import annotations

import pytest

from gossip.errors import TopologyError
from gossip.topology import Topology
from gossip.topology.roles import Roles


def peers(*roles):
    return [{"rank": r, "host": "127.0.0.1", "port": 7000 + r,
             **({"role": role} if role else {})} for r, role in enumerate(roles)]


def test_servers_imply_a_graph_linking_every_worker_to_every_server():
    topology = Topology.from_dict({"size": 4, "servers": [0, 2]})
    assert topology.roles.servers == (0, 2) and topology.roles.workers == (1, 3)
    assert topology.edges() == [(0, 1), (0, 3), (1, 2), (2, 3)]
    assert Topology.from_dict(topology.to_dict()) == topology


def test_servers_keep_the_order_given_shard_k_on_the_kth_listed(tmp_path):
    """The README's promise: shard k lives on servers[k] as the user listed them, also in
    the topology.yaml a launch writes and its peers read back."""
    topology = Topology.from_dict({"size": 5, "servers": [3, 0, 1]})
    assert topology.roles.servers == (3, 0, 1) and topology.roles.workers == (2, 4)
    topology.to_yaml(tmp_path / "topology.yaml")
    again = Topology.from_yaml(tmp_path / "topology.yaml")
    assert again.roles == topology.roles and again.edges() == topology.edges()


def test_per_peer_roles_that_a_file_cannot_order_are_refused_when_written():
    """A rank that trains and serves needs per-peer roles, whose shards are in rank order."""
    topology = Topology.from_dict({"size": 3, "graph": {"kind": "complete"}})
    mixed = Topology(topology.graph, topology.peers, roles=Roles((2, 0), (0, 1)))
    with pytest.raises(TopologyError, match=r"roles: servers \[2, 0\] are not in rank order"):
        mixed.to_dict()
    ordered = Topology(topology.graph, topology.peers, roles=Roles((0, 2), (0, 1)))
    assert Topology.from_dict(ordered.to_dict()).roles == ordered.roles


def test_per_peer_roles_let_a_rank_train_and_serve():
    topology = Topology.from_dict({"peers": peers("both", None, "server")})
    assert topology.roles.servers == (0, 2) and topology.roles.workers == (0, 1)


@pytest.mark.parametrize("data, message", [
    ({"size": 3, "servers": []}, "servers: no server listed"),
    ({"size": 3, "servers": [3]}, r"servers\[0\]: rank 3 is not a peer \(ranks are 0..2\)"),
    ({"size": 3, "servers": [1, 1]}, r"servers\[1\]: rank 1 is listed twice"),
    ({"size": 2, "servers": [0, 1]}, "servers: every peer is a server: no worker"),
    ({"peers": peers("worker", None), "edges": [[0, 1]]}, "peers: no peer has role server"),
    ({"peers": peers("boss", None)}, r"peers\[0\].role: must be one of worker, server, both"),
    ({"size": 4, "servers": [0], "graph": {"kind": "ring"}},
     "graph: worker 2 has no edge to server 0"),
    ({"peers": peers("server", None, None), "edges": [[0, 1], [1, 2]]},
     "edges: worker 2 has no edge to server 0"),
])
def test_bad_roles_are_one_line_errors_naming_the_field(data, message):
    with pytest.raises(TopologyError, match=message) as caught:
        Topology.from_dict(data)
    assert "\n" not in str(caught.value)
