"""Meeting through a rendezvous: bind an ephemeral port, publish where, learn where the
others are, and the topology at those addresses."""

from __future__ import annotations

from gossip.errors import ConfigError
from gossip.rendezvous.contact import Contact, machine_tag, this_machine
from gossip.rendezvous.store import Rendezvous
from gossip.topology import PeerAddress, Topology

#: Stands for the other peers' endpoints until the rendezvous says where they are.
UNKNOWN = "tcp://0.0.0.0:0"


def transport_args(rendezvous: Rendezvous, rank: int, size: int) -> dict:
    """The ZmqTransport arguments of a peer about to meet: bind this machine's advertised IP
    on an ephemeral port, Unix-socket twins named by this machine's tag."""
    host = rendezvous.own_host()
    bind = f"tcp://[{host}]:*" if ":" in host else f"tcp://{host}:*"
    return {"endpoints": [bind if r == rank else UNKNOWN for r in range(size)],
            "machine": machine_tag(this_machine())}


def meet(rendezvous: Rendezvous, rank: int, topology: Topology, transport) -> Topology:
    """Open ``transport`` (built with ``transport_args``), publish its address, read every
    other peer's and point the transport at them; returns ``topology`` with the peers at
    those addresses (graph, name and keys unchanged).

    Raises:
        ConfigError: the topology's size is not the launcher's.
        RendezvousError: the store is not reachable, or a peer did not come in time.
    """
    size = rendezvous.size_of()
    if size != topology.size:
        raise ConfigError(f"topology {topology.name or ''} has {topology.size} peers but the "
                          f"launcher started {size} ({rendezvous.size_origin()}, rendezvous "
                          f"{rendezvous.uri})")
    rendezvous.store(rank, size)  # reachable before we bind anything
    transport.open()
    try:
        bound = transport.endpoints[rank]
        host, port = bound.removeprefix("tcp://").rsplit(":", 1)
        own = Contact(host.strip("[]"), int(port), *this_machine())
        contacts = [Contact.decode(r, data) for r, data in enumerate(
            rendezvous.exchange("address", rank, size, own.encode()))]
        transport.locate([c.endpoint for c in contacts],
                         {r for r, c in enumerate(contacts) if c.machine == own.machine})
    except BaseException:
        transport.close()
        raise
    peers = [PeerAddress(r, c.host, c.port, topology.peers[r].public_key)
             for r, c in enumerate(contacts)]
    return Topology(topology.graph, peers, name=topology.name, key_dir=topology.key_dir,
                    roles=topology.roles)
