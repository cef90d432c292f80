"""Where a peer's sockets bind and connect: its TCP endpoint, and that endpoint's Unix-socket
twin when the peer is on this machine."""

from __future__ import annotations

import ipaddress
import tempfile
from urllib.parse import urlsplit

_LOOPBACK = {"127.0.0.1", "localhost", "::1"}


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
