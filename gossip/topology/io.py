"""Topology files: read YAML, parse its mapping into plain parts, write a Topology back.

``Topology.from_yaml`` / ``from_dict`` build the Topology from the parts, and every error is
a one-line TopologyError starting with the source (file path) and naming the offending
field, e.g. ``topologies/x.yaml: peers[2].port: ...``. This module does not import the
Topology: it writes any object with its ``name``, ``peers``, ``keyed``, ``key_dir``,
``roles``, ``size``, ``edges()`` and ``generator``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import networkx as nx
import yaml

from gossip.errors import ConfigError, TopologyError
from gossip.topology import generators, roles
from gossip.topology.address import PeerAddress, is_int

_KEYS = ("name", "peers", "hosts", "size", "host", "base_port", "graph", "edges", "generator",
         "keys", "servers")
_PEER_KEYS = ("rank", "host", "port", "public_key", "role")
_REQUIRED_PEER_KEYS = ("rank", "host", "port")
_DEFAULT_HOST = "127.0.0.1"
_DEFAULT_BASE_PORT = 7000


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate mapping keys instead of keeping the last one."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


class TopologyParts(NamedTuple):
    """What a Topology is built from, as far as a mapping's fields are checked on their own
    (the peers and graph together are the Topology's to check)."""

    name: str | None
    peers: list[PeerAddress]
    graph: nx.Graph
    roles: roles.Roles | None = None
    #: The generator spec (``{kind, params}``) the graph came from; None for explicit edges.
    generator: dict | None = None


def read(path: str | Path) -> Any:
    """The mapping in the topology file at ``path``; unnamed files take the file stem.

    Raises:
        TopologyError: ``"<path>: <problem>"``: no such file, unreadable, invalid YAML, empty.
    """
    source = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise TopologyError(f"{source}: no such file") from None
    except OSError as exc:
        raise TopologyError(f"{source}: cannot read: {exc.strerror or exc}") from None
    try:
        data = yaml.load(text, Loader=_StrictLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        reason = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise TopologyError(f"{source}: invalid YAML{where}: {reason}") from None
    if data is None:
        raise TopologyError(f"{source}: file is empty")
    if isinstance(data, dict) and "name" not in data:
        data = {**data, "name": Path(path).stem}
    return data


def parse(data: Any, *, size: int | None = None) -> TopologyParts:
    """The parts of a topology mapping. With ``size`` (a launcher's, for peers that meet
    through a rendezvous) the mapping may hold only the graph: its peers are placeholders
    at 127.0.0.1 until the rendezvous says where they are. A generator takes ``size``; an
    edge list has its own (its highest rank + 1), for the caller, who knows where ``size``
    came from, to compare.

    Raises:
        TopologyError: ``"<field>: <problem>"`` on the first problem found.
    """
    if not isinstance(data, dict):
        raise TopologyError(f"expected a mapping at the top level, got {type(data).__name__}")
    for key in data:
        if key not in _KEYS:
            raise TopologyError(f"unknown key {key!r} (allowed: {', '.join(_KEYS)})")
    name = data.get("name")
    if name is not None and not isinstance(name, str):
        raise TopologyError(f"name: expected a string, got {name!r}")
    if size is not None and not any(key in data for key in ("peers", "hosts", "size")):
        own = _edges_size(data["edges"]) if "edges" in data and "graph" not in data else None
        data = {**data, "size": own or size}
    peers = _parse_peers(data)
    found = roles.parse(data, len(peers))
    if found is not None and "graph" not in data and "edges" not in data:
        return TopologyParts(name, peers, found.implied_graph(len(peers)), found)
    graph = _parse_graph(data, len(peers))
    if found is not None:
        roles.check_graph(found, graph, "graph" if "graph" in data else "edges")
    return TopologyParts(name, peers, graph, found, _generator(data, graph))


def key_dir(data: dict, topology, base_dir: Path) -> Path | None:
    """The directory of public keys the mapping ``data`` names for ``topology`` (built from
    its parts), relative to ``base_dir`` unless absolute; None if it names none."""
    if "keys" not in data:
        return None
    value = data["keys"]
    if not isinstance(value, str) or not value.strip():
        raise TopologyError(f"keys: expected a directory of peer-R.key.pub files, got {value!r}")
    if topology.keyed:
        raise TopologyError("keys: give either 'keys' (a directory) or a public_key per peer, "
                            "not both")
    directory = base_dir / Path(value).expanduser()
    if not directory.is_dir():
        raise TopologyError(f"keys: {directory} is not a directory (create one with `gossip "
                            f"keys generate --out {value} --peers {topology.size}`)")
    return directory


def _port(field: str, value: Any) -> int:
    if not is_int(value):
        raise TopologyError(f"{field}: expected an integer, got {value!r}")
    if not 1 <= value <= 65535:
        raise TopologyError(f"{field}: {value} is not a valid port (1-65535)")
    return int(value)


def _host(field: str, value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise TopologyError(f"{field}: expected a non-empty host string, got {value!r}")
    return value


def _parse_peers(data: dict) -> list[PeerAddress]:
    forms = [key for key in ("peers", "hosts", "size") if key in data]
    if not forms:
        raise TopologyError("one of 'peers', 'hosts' or 'size' is required (a file with "
                            "only the graph needs --rendezvous: the launcher gives the size)")
    if len(forms) > 1:
        raise TopologyError(f"give only one of 'peers', 'hosts' or 'size', not {' and '.join(forms)}")
    form = forms[0]
    if form == "peers":
        for key in ("host", "base_port"):
            if key in data:
                raise TopologyError(f"{key}: not allowed with explicit 'peers' (give each peer its own)")
        return _explicit_peers(data["peers"])
    if form == "hosts":
        if "host" in data:
            raise TopologyError("host: not allowed with 'hosts' (use one or the other)")
        hosts = data["hosts"]
        if not isinstance(hosts, list) or not hosts:
            raise TopologyError(f"hosts: expected a non-empty list of hosts, got {hosts!r}")
        hosts = [_host(f"hosts[{i}]", value) for i, value in enumerate(hosts)]
    else:
        size = data["size"]
        if not is_int(size) or size < 1:
            raise TopologyError(f"size: expected a positive integer, got {size!r}")
        hosts = [_host("host", data.get("host", _DEFAULT_HOST))] * size
    base_port = _port("base_port", data.get("base_port", _DEFAULT_BASE_PORT))
    if base_port + len(hosts) - 1 > 65535:
        raise TopologyError(f"base_port: {base_port} + {len(hosts)} peers runs past port 65535")
    return [PeerAddress(rank, host, base_port + rank) for rank, host in enumerate(hosts)]


def _explicit_peers(entries: Any) -> list[PeerAddress]:
    if not isinstance(entries, list) or not entries:
        raise TopologyError(f"peers: expected a non-empty list, got {entries!r}")
    peers = []
    for index, entry in enumerate(entries):
        where = f"peers[{index}]"
        if not isinstance(entry, dict):
            raise TopologyError(f"{where}: expected a mapping with rank, host, port, got {entry!r}")
        for key in entry:
            if key not in _PEER_KEYS:
                raise TopologyError(f"{where}: unknown key {key!r} (allowed: {', '.join(_PEER_KEYS)})")
        for key in _REQUIRED_PEER_KEYS:
            if key not in entry:
                raise TopologyError(f"{where}.{key}: missing")
        # Types and ranges are checked by Topology with the same peers[i] field names.
        peers.append(PeerAddress(entry["rank"], entry["host"], entry["port"],
                                 entry.get("public_key")))
    return peers


def _parse_graph(data: dict, size: int) -> nx.Graph:
    if "graph" in data and "edges" in data:
        raise TopologyError("give either 'graph' or 'edges', not both")
    if "graph" in data:
        return _generated(data["graph"], size)
    if "edges" in data:
        return _explicit_edges(data["edges"], size)
    raise TopologyError("one of 'graph' (a generator) or 'edges' (explicit list) is required")


def _generator(data: dict, graph: nx.Graph) -> dict | None:
    """The generator a graph came from: ``graph:``'s, or the ``generator:`` written beside
    the ``edges:`` it gave (``to_dict``), which must give those very edges."""
    if "graph" in data:
        if "generator" in data:
            raise TopologyError("give 'generator' only beside 'edges' (a 'graph' is one)")
        return {key: value for key, value in data["graph"].items() if key != "n"}
    spec = data.get("generator")
    if spec is None:
        return None
    if not isinstance(spec, dict) or not isinstance(spec.get("kind"), str):
        raise TopologyError(f"generator: expected a mapping like {{kind: ring}}, got {spec!r}")
    try:
        regenerated = _generated(spec, graph.number_of_nodes())
    except TopologyError as exc:
        raise TopologyError(f"generator: {exc}") from None
    if sorted(map(sorted, regenerated.edges())) != sorted(map(sorted, graph.edges())):
        raise TopologyError(f"generator: {spec['kind']} does not give these edges")
    return dict(spec)


def _generated(spec: Any, size: int) -> nx.Graph:
    if not isinstance(spec, dict):
        raise TopologyError(f"graph: expected a mapping like {{kind: ring}}, got {spec!r}")
    params = dict(spec)
    kind = params.pop("kind", None)
    if not isinstance(kind, str):
        kinds = ", ".join(generators.GENERATORS.names())
        raise TopologyError(f"graph.kind: expected a generator name ({kinds}), got {kind!r}")
    if "n" in params and params.pop("n") != size:
        raise TopologyError(f"graph.n: {spec['n']!r} does not match the {size} peers")
    try:
        graph = generators.build(kind, size, **params)
    except ConfigError as exc:
        raise TopologyError(f"graph: {exc}") from None
    if graph.number_of_nodes() != size:  # guards generators that pick their own n
        raise TopologyError(f"graph: {kind} has {graph.number_of_nodes()} nodes but there are {size} peers")
    return graph


def _edges_size(edges: Any) -> int | None:
    """How many peers an edge list joins (its highest rank + 1); None if it is not a list of
    pairs of ranks (``_explicit_edges`` says what is wrong)."""
    try:
        ranks = [rank for a, b in edges for rank in (a, b)]
    except (TypeError, ValueError):
        return None
    if not ranks or not all(is_int(rank) and rank >= 0 for rank in ranks):
        return None
    return max(ranks) + 1


def _explicit_edges(edges: Any, size: int) -> nx.Graph:
    if not isinstance(edges, list):
        raise TopologyError(f"edges: expected a list of [a, b] pairs, got {edges!r}")
    graph = nx.Graph()
    graph.add_nodes_from(range(size))
    first: dict[tuple[int, int], int] = {}
    for index, edge in enumerate(edges):
        where = f"edges[{index}]"
        if not isinstance(edge, list) or len(edge) != 2:
            raise TopologyError(f"{where}: expected a pair [a, b], got {edge!r}")
        for rank in edge:
            if not is_int(rank):
                raise TopologyError(f"{where}: expected integer ranks, got {rank!r}")
            if not 0 <= rank < size:
                raise TopologyError(f"{where}: rank {rank} is not a peer (ranks are 0..{size - 1})")
        a, b = edge
        if a == b:
            raise TopologyError(f"{where}: self-loop on rank {a}")
        key = (min(a, b), max(a, b))
        if key in first:
            raise TopologyError(f"{where}: duplicate of edges[{first[key]}] ({key[0]}-{key[1]})")
        first[key] = index
        graph.add_edge(*key)
    return graph


def to_dict(topology) -> dict[str, Any]:
    """Explicit form: name (if any), one mapping per peer, the roles (if any: a ``servers``
    list in shard order, or a role per peer), and the edge list."""
    data: dict[str, Any] = {}
    if topology.name is not None:
        data["name"] = topology.name
    # Keys from a directory are written as that (absolute) directory, so a peer started from
    # the written file still finds its secret key there.
    explicit_keys = topology.keyed and topology.key_dir is None
    given = getattr(topology, "roles", None)
    servers, role = (None, {}) if given is None else roles.to_fields(given, topology.size)
    data["peers"] = [
        {"rank": peer.rank, "host": peer.host, "port": peer.port,
         **({"public_key": peer.public_key} if explicit_keys else {}),
         **({"role": role[peer.rank]} if role else {})}
        for peer in topology.peers
    ]
    if topology.key_dir is not None:
        data["keys"] = str(topology.key_dir)
    if servers is not None:
        data["servers"] = servers
    data["edges"] = [[a, b] for a, b in topology.edges()]
    if topology.generator is not None:  # an elastic run's views regrow by it
        data["generator"] = dict(topology.generator)
    return data


def dump(topology, path: str | Path) -> None:
    """Write ``topology`` to ``path`` in the explicit form, one peer/edge per line."""
    text = yaml.safe_dump(to_dict(topology), sort_keys=False, default_flow_style=None)
    Path(path).write_text(text, encoding="utf-8")
