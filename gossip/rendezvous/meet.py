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


def meet(rendezvous: Rendezvous, rank: int, topology: Topology, transport, *,
         spares: int = 0) -> Topology:
    """Open ``transport`` (built with ``transport_args``), publish its address, read every
    other peer's and point the transport at them; returns ``topology`` with the peers at
    those addresses (graph, name and keys unchanged).

    With ``spares`` (an elastic run) the topology's last ``spares`` ranks are the ids of
    peers joining later through the store: a member reads the job's first members only
    (``Locator`` finds a joiner once it asks); a joiner (its id from ``next_id``) publishes
    its address and reads the first members'.

    Raises:
        ConfigError: the topology's size is not the launcher's (spares aside).
        RendezvousError: the store is not reachable, or a peer did not come in time.
    """
    members = topology.size - spares
    joiner = rank >= members
    size = members if joiner else rendezvous.size_of()
    if size != members:
        raise ConfigError(f"topology {topology.name or ''} has {members} peers"
                          f"{f' and {spares} spare id(s)' if spares else ''} but the launcher "
                          f"started {size} ({rendezvous.size_origin()}, rendezvous "
                          f"{rendezvous.uri})")
    rendezvous.store(rank, size)  # reachable before we bind anything
    transport.open()
    try:
        bound = transport.endpoints[rank]
        host, port = bound.removeprefix("tcp://").rsplit(":", 1)
        own = Contact(host.strip("[]"), int(port), *this_machine())
        if joiner:
            rendezvous.publish("address", rank, size, own.encode())
            rendezvous.entered(rank, size)
            published = rendezvous.read("address", range(members))
        else:
            published = rendezvous.exchange("address", rank, size, own.encode())
            rendezvous.announce_size(rank, size)
        contacts = [Contact.decode(r, data) for r, data in enumerate(published)]
        contacts += [own if r == rank else None for r in range(members, topology.size)]
        transport.locate([UNKNOWN if c is None else c.endpoint for c in contacts],
                         {r for r, c in enumerate(contacts)
                          if c is not None and c.machine == own.machine})
    except BaseException:
        transport.close()
        raise
    peers = [topology.peers[r] if c is None
             else PeerAddress(r, c.host, c.port, topology.peers[r].public_key)
             for r, c in enumerate(contacts)]
    return Topology(topology.graph, peers, name=topology.name, key_dir=topology.key_dir,
                    roles=topology.roles)


class Locator:
    """Where the elastic run's joiners listen, read from the store as they come: a member
    learns a joiner's address when it asks (or a view names it), then reaches it there.

    Args:
        rendezvous: The job's (open: this peer met the others).
        transport: This peer's; ``repoint`` points it at an address.
        members: The ids the job started with (located at the meeting).
    """

    def __init__(self, rendezvous: Rendezvous, transport, members: int):
        self.rendezvous, self.transport = rendezvous, transport
        self.located = set(range(members)) | {transport.rank}
        self.machine = this_machine()

    def knows(self, member: int) -> bool:
        """Whether ``member``'s address is known (an id no joiner took yet has none)."""
        return member in self.located

    def __call__(self, ids) -> None:
        """Point the transport at each of ``ids`` not located yet.

        Raises:
            RendezvousError: one of them published no address in time.
        """
        new = sorted(set(ids) - self.located)
        if not new:
            return
        for member, data in zip(new, self.rendezvous.read("address", new)):
            contact = Contact.decode(member, data)
            self.transport.repoint(member, contact.endpoint,
                                   local=contact.machine == self.machine)
            self.located.add(member)
