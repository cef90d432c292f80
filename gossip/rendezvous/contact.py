"""What a peer publishes in the store: where it listens, and which machine it runs on.

Peers with the same host name, boot id and network namespace share a kernel and a network
stack: they reach each other over a Unix socket and shared memory (the same-host fast
path). The namespace is part of it so that the netns virtual cluster's peers, one machine
pretending to be several, talk over their emulated links as separate machines would.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
from dataclasses import asdict, dataclass
from pathlib import Path

from gossip.errors import RendezvousError

_FIELDS = ("host", "port", "hostname", "boot_id", "netns")


@dataclass(frozen=True)
class Contact:
    """One peer's published address: {host, port} to connect to, and its machine."""

    host: str
    port: int
    hostname: str
    boot_id: str
    netns: str

    @property
    def machine(self) -> tuple[str, str, str]:
        return (self.hostname, self.boot_id, self.netns)

    @property
    def endpoint(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"tcp://{host}:{self.port}"

    def encode(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def decode(cls, rank: int, data: bytes) -> Contact:
        """Raises RendezvousError naming ``rank`` if ``data`` is not a contact."""
        try:
            fields = json.loads(data)
            contact = cls(**{name: fields[name] for name in _FIELDS})
            ok = isinstance(contact.port, int) and 1 <= contact.port <= 65535 and all(
                isinstance(getattr(contact, name), str) and getattr(contact, name)
                for name in _FIELDS if name != "port")
        except (ValueError, TypeError, KeyError):
            ok = False
        if not ok:
            raise RendezvousError(f"rank {rank} published a malformed address {data[:200]!r}")
        return contact


def this_machine() -> tuple[str, str, str]:
    """(host name, boot id, network namespace) of this process."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:  # not Linux: the host name alone
        boot = "unknown"
    netns = "unknown"
    for path in ("/proc/thread-self/ns/net", "/proc/self/ns/net"):  # a thread may have its own
        try:
            netns = str(os.stat(path).st_ino)
            break
        except OSError:
            continue
    return socket.gethostname(), boot, netns


def machine_tag(machine: tuple[str, str, str]) -> str:
    """A short name of a machine for file names (the Unix-socket paths of its peers)."""
    return hashlib.sha1("|".join(machine).encode()).hexdigest()[:12]


def source_address(host: str, port: int) -> str:
    """The IP this machine sends from towards ``host`` (what peers elsewhere can reach us
    at, as the store host sees us); nothing is sent.

    Raises:
        RendezvousError: ``host`` does not resolve or no route leads there.
    """
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.connect(address)
            return probe.getsockname()[0]
    except OSError as exc:
        raise RendezvousError(f"cannot find this machine's address towards the store host "
                              f"{host!r}: {exc.strerror or exc} (give --advertise IP)") from None


def resolve(host: str) -> str:
    """``host`` as an IP address (an --advertise value may be a name)."""
    try:
        return socket.getaddrinfo(host, None)[0][4][0]
    except OSError as exc:
        raise RendezvousError(f"--advertise {host!r}: does not resolve "
                              f"({exc.strerror or exc})") from None
