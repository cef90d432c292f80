"""Parameter-server roles in topology files: the implied graph, and one-line errors that
name the field at fault."""

from __future__ import annotations

import pytest

from gossip.errors import TopologyError
from gossip.topology import Topology


def peers(*roles):
    return [{"rank": r, "host": "127.0.0.1", "port": 7000 + r,
             **({"role": role} if role else {})} for r, role in enumerate(roles)]


def test_servers_imply_a_graph_linking_every_worker_to_every_server():
    topology = Topology.from_dict({"size": 4, "servers": [0, 2]})
    assert topology.roles.servers == (0, 2) and topology.roles.workers == (1, 3)
    assert topology.edges() == [(0, 1), (0, 3), (1, 2), (2, 3)]
    assert Topology.from_dict(topology.to_dict()) == topology  # written back per peer


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
