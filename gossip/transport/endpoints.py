"""Where a peer's sockets bind and connect: its TCP endpoint, and that endpoint's Unix-socket
twin when the peer is on this machine."""

from __future__ import annotations

import ipaddress
import logging
import tempfile
from urllib.parse import urlsplit

_LOOPBACK = {"127.0.0.1", "localhost", "::1"}

log = logging.getLogger(__name__)


def local_ipc(endpoint: str) -> str | None:
    """The Unix-socket twin of a loopback TCP endpoint, else None.

    Peers on a loopback address are on this machine, and a Unix socket moves bytes with less
    kernel work than TCP (like MPI's shared-memory path within a node). Both ends derive the
    path from the port alone, so they agree without talking.
    """
    parts = urlsplit(endpoint)
    if parts.scheme != "tcp" or parts.hostname not in _LOOPBACK:
        return None
    return f"ipc://{tempfile.gettempdir()}/gossip-{parts.port}.sock"


def is_ipv6(endpoint: str) -> bool:
    """Whether ``endpoint`` is TCP to an IPv6 address (``tcp://[::1]:7000``)."""
    parts = urlsplit(endpoint)
    try:
        return parts.scheme == "tcp" and ipaddress.ip_address(parts.hostname or "").version == 6
    except ValueError:  # a host name or a wildcard
        return False


def bind_address(endpoint: str) -> str:
    """Bind to the endpoint's IP; a host name binds every interface (it may not resolve here)."""
    parts = urlsplit(endpoint)
    if parts.scheme != "tcp":
        return endpoint
    try:
        ipaddress.ip_address(parts.hostname or "")
        return endpoint
    except ValueError:
        return f"{parts.scheme}://*:{parts.port}"


class Endpoints:
    """Every rank's endpoint, and which peers are reached over their Unix-socket twin.

    Without a ``machine`` tag a peer on a loopback address has a twin (``local_ipc``). Peers
    that met through a rendezvous have a tag of their machine instead: each binds a twin
    named by tag and port whatever its IP (so an ephemeral port ``tcp://IP:*`` is fine),
    and reaches over theirs the ranks ``locate`` says share its machine.
    """

    def __init__(self, rank: int, endpoints, machine: str | None = None):
        self.rank, self.machine = rank, machine
        self.all = list(endpoints)
        self._local = {rank}

    def __getitem__(self, rank: int) -> str:
        return self.all[rank]

    def __len__(self) -> int:
        return len(self.all)

    def bound(self, endpoint: str) -> None:
        """This rank's endpoint as bound (its ephemeral port filled in)."""
        self.all[self.rank] = endpoint

    def twin(self, rank: int) -> str | None:
        """The Unix-socket twin of ``rank``'s endpoint if it is on this machine, else None."""
        if self.machine is None:
            return local_ipc(self.all[rank])
        if rank not in self._local:
            return None
        port = self.all[rank].rsplit(":", 1)[1]
        return f"ipc://{tempfile.gettempdir()}/gossip-{self.machine}-{port}.sock"

    def locate(self, endpoints, local: set[int]) -> None:
        """The other ranks' endpoints, and which of them are on this machine."""
        own = self.all[self.rank]
        self.all = list(endpoints)
        self.all[self.rank] = own
        self._local = set(local) | {self.rank}

    def move(self, rank: int, endpoint: str, *, local: bool) -> bool:
        """``rank`` now listens at ``endpoint``; whether that changed anything."""
        if rank == self.rank or (endpoint == self.all[rank] and local == (rank in self._local)):
            return False
        # an operator wants to know where a restart went (port 0: a joiner's first address)
        if endpoint != self.all[rank] and not self.all[rank].endswith(":0"):
            log.warning("rank %d: peer %d restarted at %s (was %s): reaching it there",
                        self.rank, rank, endpoint, self.all[rank])
        self.all[rank] = endpoint
        self._local.discard(rank)
        if local:
            self._local.add(rank)
        return True
