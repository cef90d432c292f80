"""The Topology: who the peers are, where they listen and whom they talk to."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import networkx as nx
import numpy as np

from gossip import keys
from gossip.errors import ConfigError, TopologyError
from gossip.topology import generators, io, views, weights
from gossip.topology.address import PeerAddress, check_peers, is_int
from gossip.topology.roles import Roles

# describe() prints the P x P matrix only while it stays readable.
_DESCRIBE_MAX_MATRIX = 32


def _format_component(nodes) -> str:
    return "{" + ",".join(str(node) for node in sorted(nodes)) + "}"


def _check_graph(graph: Any, size: int) -> nx.Graph:
    """A frozen copy of ``graph`` with nodes inserted in rank order."""
    if not isinstance(graph, nx.Graph) or graph.is_directed() or graph.is_multigraph():
        raise TopologyError(f"graph: expected an undirected simple nx.Graph, got {type(graph).__name__}")
    ranks = set(range(size))
    for node in graph.nodes:
        if node not in ranks or not is_int(node):
            raise TopologyError(f"graph: node {node!r} is not a peer (ranks must be 0..{size - 1})")
    for rank in range(size):
        if rank not in graph:
            raise TopologyError(f"graph: no node for peer rank {rank}")
    for node, _ in nx.selfloop_edges(graph):
        raise TopologyError(f"graph: self-loop on rank {node}")
    if not nx.is_connected(graph):
        parts = sorted((sorted(c) for c in nx.connected_components(graph)), key=lambda c: c[0])
        text = [_format_component(part) for part in parts]
        raise TopologyError(
            f"graph is disconnected: components {', '.join(text[:-1])} and {text[-1]}"
        )
    clean = nx.Graph()
    clean.add_nodes_from(range(size))
    clean.add_edges_from(sorted((min(a, b), max(a, b)) for a, b in graph.edges()))
    return nx.freeze(clean)


VIEWS_KEPT = 4  # views of an elastic run a topology keeps (each member asks of the same)


class Topology:
    """Immutable description of a peer-to-peer graph: nodes are ranks ``0..P-1``.

    Args:
        graph: Connected undirected graph on nodes ``0..P-1`` (copied and frozen).
        peers: One PeerAddress per rank, in any order.
        name: Human label, e.g. ``"ring-8"``.
        key_dir: Directory holding the peers' ``peer-R.key`` secret keys (a peer finds its own
            there); the public keys themselves are the peers' ``public_key``.
        roles: Parameter-server roles (workers and servers); None: none given.
        generator: The generator spec (``{"kind": ..., **params}``) the graph came from, by
            which an elastic run's views regrow it (``view_graph``); None: explicit edges.

    Raises:
        TopologyError: Naming the field for any invalid peer, duplicate rank or address,
            missing rank, foreign node, self-loop or disconnected graph.
    """

    def __init__(self, graph: nx.Graph, peers: Sequence[PeerAddress], *, name: str | None = None,
                 key_dir: str | Path | None = None, roles: Roles | None = None,
                 generator: dict | None = None):
        if name is not None and not isinstance(name, str):
            raise TopologyError(f"name: expected a string, got {name!r}")
        self._peers = check_peers(tuple(peers))
        if key_dir is not None and not self.keyed:
            raise TopologyError(f"keys: {key_dir} given but the peers have no public keys")
        self._key_dir = Path(key_dir).resolve() if key_dir is not None else None
        self._graph = _check_graph(graph, len(self._peers))
        self._name = name
        self._neighbors = {
            rank: tuple(sorted(self._graph.neighbors(rank))) for rank in range(self.size)
        }
        self._edges = tuple(sorted(self._graph.edges()))
        self._mixing: np.ndarray | None = None
        self._views: dict[tuple[int, ...], views.ViewShape] = {}  # the newest VIEWS_KEPT
        if roles is not None and not {*roles.servers, *roles.workers} <= set(range(self.size)):
            raise TopologyError(f"roles: ranks outside 0..{self.size - 1}")
        self._roles = roles
        self._generator = None if generator is None else dict(generator)

    # -- plain data -----------------------------------------------------------------

    @property
    def graph(self) -> nx.Graph:
        """The frozen graph (mutating it raises)."""
        return self._graph

    @property
    def peers(self) -> tuple[PeerAddress, ...]:
        """Peer addresses indexed by rank."""
        return self._peers

    @property
    def name(self) -> str | None:
        return self._name

    @property
    def size(self) -> int:
        """Number of peers P."""
        return len(self._peers)

    @property
    def roles(self) -> Roles | None:
        """Parameter-server roles, if the topology gives any."""
        return self._roles

    @property
    def generator(self) -> dict | None:
        """The generator spec the graph came from (None: explicit edges)."""
        return None if self._generator is None else dict(self._generator)

    def view_graph(self, members) -> nx.Graph:
        """The graph of an elastic run's view of ``members`` (ids), on those ids: the
        generator re-evaluated at their number over their sorted order, or the explicit
        graph induced on them (gossip/topology/views.py); frozen."""
        return self._view(members).graph

    def view_mixing(self, members) -> tuple[tuple[int, ...], np.ndarray]:
        """The ids of the view of ``members`` in slot order and its Metropolis-Hastings
        matrix on those slots (read-only)."""
        return self._view(members).mixing

    def view_diameter(self, members) -> int:
        """The diameter of the view of ``members``'s graph."""
        return self._view(members).diameter

    def _view(self, members) -> views.ViewShape:
        key = tuple(sorted(members))
        shape = self._views.get(key)
        if shape is None:
            shape = views.ViewShape(views.view_graph(self._graph, self._generator, key))
            if len(self._views) >= VIEWS_KEPT:
                del self._views[next(iter(self._views))]
            self._views[key] = shape
        return shape

    def trains(self, rank: int) -> bool:
        """Whether ``rank`` trains: every rank does unless the roles make it a server only
        (it then runs ``Peer.serve`` and writes no records)."""
        return self._roles is None or rank in self._roles.workers

    @property
    def keyed(self) -> bool:
        """Whether peers authenticate and encrypt with CURVE (every peer has a public key)."""
        return self._peers[0].public_key is not None

    @property
    def key_dir(self) -> Path | None:
        """Absolute directory of the peers' key files, if the keys came from one."""
        return self._key_dir

    def with_keys(self, directory: str | Path) -> Topology:
        """Same peers and graph with every rank's public key read from ``directory``
        (``peer-R.key.pub``, as ``gossip keys generate`` writes them).

        Raises:
            TopologyError: a key file is missing or malformed, naming it.
        """
        try:
            public = [keys.read_public_key(keys.public_path(directory, rank))
                      for rank in range(self.size)]
        except ConfigError as exc:
            raise TopologyError(f"keys: {exc}") from None
        peers = [PeerAddress(p.rank, p.host, p.port, public[p.rank]) for p in self._peers]
        return Topology(self._graph, peers, name=self._name, key_dir=directory,
                        roles=self._roles, generator=self._generator)

    def _rank(self, rank: int) -> int:
        if not is_int(rank) or not 0 <= rank < self.size:
            raise TopologyError(f"rank {rank!r} is not a peer (ranks are 0..{self.size - 1})")
        return int(rank)

    def neighbors(self, rank: int) -> tuple[int, ...]:
        """Sorted neighbour ranks of ``rank``."""
        return self._neighbors[self._rank(rank)]

    def degree(self, rank: int) -> int:
        return len(self.neighbors(rank))

    def address(self, rank: int) -> str:
        """ZeroMQ endpoint ``tcp://host:port`` of ``rank``."""
        return self._peers[self._rank(rank)].endpoint

    def edges(self) -> list[tuple[int, int]]:
        """Sorted edge list, each as ``(a, b)`` with ``a < b``."""
        return list(self._edges)

    def mixing_matrix(self) -> np.ndarray:
        """Metropolis-Hastings mixing matrix (float64); a fresh copy of a cached array."""
        if self._mixing is None:
            self._mixing = weights.metropolis_hastings(self._graph)
        return self._mixing.copy()

    def spectral_gap(self) -> float:
        """``1 - |lambda_2|`` of the mixing matrix (1.0 for a single peer)."""
        return weights.spectral_gap(self.mixing_matrix())

    # -- construction ---------------------------------------------------------------

    @classmethod
    def from_yaml(cls, path: str | Path, *, size: int | None = None) -> Topology:
        """Load and validate a topology file; errors start with ``path``, and an unnamed
        file takes the file's stem as its name. ``size`` as for ``from_dict``."""
        return cls.from_dict(io.read(path), source=str(path), base_dir=Path(path).parent,
                             size=size)

    @classmethod
    def from_dict(cls, data: Any, *, source: str = "<dict>",
                  base_dir: str | Path = ".", size: int | None = None) -> Topology:
        """Validate a parsed topology mapping (a relative ``keys`` directory is relative to
        ``base_dir``). With ``size`` (a launcher's) a mapping of only the graph (``graph:`` or
        ``edges:``) is enough; its peers' addresses are placeholders for a rendezvous.

        Raises:
            TopologyError: ``"<source>: <field>: <problem>"`` on the first problem found.
        """
        try:
            parts = io.parse(data, size=size)
            topology = cls(parts.graph, parts.peers, name=parts.name, roles=parts.roles,
                           generator=parts.generator)
            keys = io.key_dir(data, topology, Path(base_dir))
            return topology if keys is None else topology.with_keys(keys)
        except ConfigError as exc:
            raise TopologyError(f"{source}: {exc}") from None

    def to_dict(self) -> dict[str, Any]:
        """Explicit form (name, peers, edges) that ``from_dict`` accepts back."""
        return io.to_dict(self)

    def to_yaml(self, path: str | Path) -> None:
        io.dump(self, path)

    @classmethod
    def ring(cls, n: int, *, host: str = "127.0.0.1", base_port: int = 7000) -> Topology:
        return cls.generate("ring", n, host=host, base_port=base_port)

    @classmethod
    def generate(
        cls,
        kind: str,
        n: int | None = None,
        *,
        host: str = "127.0.0.1",
        base_port: int = 7000,
        **params,
    ) -> Topology:
        """Generated graph with rank ``i`` at ``host:base_port+i``, named ``kind-P``.

        Raises:
            ConfigError: Unknown kind or bad parameters (see ``generators.build``).
        """
        graph = generators.build(kind, n, **params)
        size = graph.number_of_nodes()
        peers = [PeerAddress(rank, host, base_port + rank) for rank in range(size)]
        return cls(graph, peers, name=f"{kind}-{size}", generator={"kind": kind, **params})

    def relocated(self, *, host: str | None = None, ports: Sequence[int] | None = None) -> Topology:
        """Same graph and name at new addresses (e.g. free ports found by the launcher).

        Args:
            host: New host for every peer; unchanged when None.
            ports: New port per rank (length P); unchanged when None.
        """
        if ports is not None and len(ports) != self.size:
            raise TopologyError(f"ports: expected {self.size} ports, got {len(ports)}")
        peers = [
            PeerAddress(
                peer.rank,
                peer.host if host is None else host,
                peer.port if ports is None else ports[peer.rank],
                peer.public_key,
            )
            for peer in self._peers
        ]
        return Topology(self._graph, peers, name=self._name, key_dir=self._key_dir,
                        roles=self._roles, generator=self._generator)

    # -- presentation ---------------------------------------------------------------

    def describe(self) -> str:
        """Multi-line human summary for ``gossip topology show``."""
        matrix = self.mixing_matrix()
        lam2 = weights.second_eigenvalue(matrix)
        lines = [f"topology {self._name or '(unnamed)'}: P={self.size}, {len(self._edges)} edges", "peers:"]
        if self.keyed:
            lines[0] += ", CURVE keys" + (f" in {self._key_dir}" if self._key_dir else "")
        width = len(str(self.size - 1))
        for peer in self._peers:
            lines.append(
                f"  rank {peer.rank:>{width}}  {peer.host}:{peer.port}  degree {self.degree(peer.rank)}"
                f"  neighbours {list(self.neighbors(peer.rank))}"
                + (f"  {self._roles.role(peer.rank)}" if self._roles is not None else "")
            )
        lines.append("edges: " + (" ".join(f"{a}-{b}" for a, b in self._edges) or "(none)"))
        if self.size <= _DESCRIBE_MAX_MATRIX:
            lines.append("mixing matrix (Metropolis-Hastings):")
            lines.extend("  " + " ".join(f"{value:.3f}" for value in row) for row in matrix)
        else:
            lines.append(f"mixing matrix (Metropolis-Hastings): omitted for P > {_DESCRIBE_MAX_MATRIX}")
        lines.append(f"spectral gap: {weights.spectral_gap(matrix):.4f}")
        lines.append(f"second largest |eigenvalue|: {lam2:.4f}")
        return "\n".join(lines)

    # -- value semantics ------------------------------------------------------------

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Topology):
            return NotImplemented
        return _identity(self) == _identity(other)

    def __hash__(self) -> int:
        return hash(_identity(self))

    def __repr__(self) -> str:
        return f"Topology(name={self._name!r}, size={self.size}, edges={len(self._edges)})"


def _identity(topology: Topology) -> tuple:
    """What equal topologies share, read through their public view."""
    return (topology.name, topology.peers, tuple(topology.edges()), topology.roles)
