"""Parameter-server roles in a topology: which ranks train (workers) and which serve a
shard of the model (servers); a rank may be both.

A file gives them as ``servers: [0, ...]`` (those ranks serve and do not train; shard k
lives on the k-th listed, in the file's order) or as a ``role`` per explicit peer
(``worker``, ``server`` or ``both``; shards in rank order). Without a ``graph`` or
``edges`` the graph is implied: every worker linked to every server.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import networkx as nx

from gossip.errors import TopologyError
from gossip.topology.address import is_int

ROLES = ("worker", "server", "both")


@dataclass(frozen=True)
class Roles:
    """Ranks by role: shard k lives on ``servers[k]`` (the order a ``servers:`` list gives,
    else rank order); workers in rank order."""

    servers: tuple[int, ...]
    workers: tuple[int, ...]

    @classmethod
    def colocated(cls, size: int) -> Roles:
        """Every rank a worker and the server of one shard (no roles given)."""
        return cls(tuple(range(size)), tuple(range(size)))

    def role(self, rank: int) -> str:
        serves, trains = rank in self.servers, rank in self.workers
        return "both" if serves and trains else "server" if serves else "worker"

    def implied_graph(self, size: int) -> nx.Graph:
        """Every worker linked to every server."""
        graph = nx.Graph()
        graph.add_nodes_from(range(size))
        graph.add_edges_from((w, s) for w in self.workers for s in self.servers if w != s)
        return graph


def parse(data: dict, size: int) -> Roles | None:
    """The roles a topology mapping gives (None: none given).

    Raises:
        TopologyError: naming the field: ``servers`` (not a list, empty, a rank out of range
            or listed twice), ``peers[i].role``, both forms at once, no server, no worker.
    """
    listed = "servers" in data
    per_peer = isinstance(data.get("peers"), list) and any(
        isinstance(p, dict) and "role" in p for p in data["peers"])
    if listed and per_peer:
        raise TopologyError("give either 'servers' or a 'role' per peer, not both")
    if listed:
        servers = _servers(data["servers"], size)
        workers = tuple(r for r in range(size) if r not in servers)
        if not workers:
            raise TopologyError("servers: every peer is a server: no worker is left to train "
                                "(give a peer role: both to train and serve)")
        return Roles(servers, workers)
    if not per_peer:
        return None
    roles = {}
    for index, peer in enumerate(data["peers"]):
        role = peer.get("role", "worker")
        if role not in ROLES:
            raise TopologyError(f"peers[{index}].role: must be one of {', '.join(ROLES)}, "
                                f"got {role!r}")
        roles[peer["rank"]] = role
    servers = tuple(sorted(r for r, role in roles.items() if role != "worker"))
    workers = tuple(sorted(r for r, role in roles.items() if role != "server"))
    if not servers:
        raise TopologyError("peers: no peer has role server or both (a parameter-server "
                            "topology needs at least one)")
    if not workers:
        raise TopologyError("peers: no peer has role worker or both: nobody trains")
    return Roles(servers, workers)


def check_graph(roles: Roles, graph: nx.Graph, field: str) -> None:
    """Every worker must be linked to every server in a graph given explicitly.

    Raises:
        TopologyError: ``<field>: worker W has no edge to server S``.
    """
    for w in roles.workers:
        for s in roles.servers:
            if w != s and not graph.has_edge(w, s):
                raise TopologyError(f"{field}: worker {w} has no edge to server {s} (every "
                                    f"worker pushes to and pulls from every server)")


def to_fields(roles: Roles, size: int) -> tuple[list[int] | None, dict[int, str]]:
    """How a file says ``roles``: a ``servers:`` list (in shard order) when no rank both
    trains and serves, else a role per rank (``{rank: role}``), whose shards are in rank
    order.

    Raises:
        TopologyError: a rank trains and serves and the servers are not in rank order (no
            file form keeps that shard order).
    """
    if set(roles.workers) == set(range(size)) - set(roles.servers):
        return list(roles.servers), {}
    if list(roles.servers) != sorted(roles.servers):
        raise TopologyError(f"roles: servers {list(roles.servers)} are not in rank order and "
                            f"a rank both trains and serves: a file cannot keep that shard "
                            f"order (per-peer roles serve shards in rank order)")
    return None, {rank: roles.role(rank) for rank in range(size)}


def _servers(value: Any, size: int) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise TopologyError(f"servers: expected a list of ranks, got {value!r}")
    if not value:
        raise TopologyError("servers: no server listed (give the ranks that serve, e.g. [0])")
    seen: list[int] = []
    for index, rank in enumerate(value):
        if not is_int(rank):
            raise TopologyError(f"servers[{index}]: expected a rank, got {rank!r}")
        if not 0 <= rank < size:
            raise TopologyError(f"servers[{index}]: rank {rank} is not a peer (ranks are "
                                f"0..{size - 1})")
        if rank in seen:
            raise TopologyError(f"servers[{index}]: rank {rank} is listed twice")
        seen.append(rank)
    return tuple(seen)  # the user's order: shard k lives on servers[k]
