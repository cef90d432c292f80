"""Where the peers listen: PeerAddress, and the checks a list of them must pass."""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gossip import keys
from gossip.errors import ConfigError, TopologyError


@dataclass(frozen=True)
class PeerAddress:
    """Where peer ``rank`` listens, and its Z85 CURVE public key when the cluster uses keys."""

    rank: int
    host: str
    port: int
    public_key: str | None = None

    @property
    def endpoint(self) -> str:
        """ZeroMQ endpoint, ``tcp://host:port`` (IPv6 hosts bracketed)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"tcp://{host}:{self.port}"


def is_int(value: Any) -> bool:
    """An integer, and not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_peer(index: int, peer: Any) -> None:
    where = f"peers[{index}]"
    if not isinstance(peer, PeerAddress):
        raise TopologyError(f"{where}: expected a PeerAddress, got {type(peer).__name__}")
    if not is_int(peer.rank):
        raise TopologyError(f"{where}.rank: expected an integer, got {peer.rank!r}")
    if not isinstance(peer.host, str) or not peer.host.strip():
        raise TopologyError(f"{where}.host: expected a non-empty string, got {peer.host!r}")
    if not is_int(peer.port):
        raise TopologyError(f"{where}.port: expected an integer, got {peer.port!r}")
    if not 1 <= peer.port <= 65535:
        raise TopologyError(f"{where}.port: {peer.port} is not a valid port (1-65535)")


def check_peers(peers: Sequence[PeerAddress]) -> tuple[PeerAddress, ...]:
    """Validated peers sorted by rank; ranks must be exactly ``0..P-1``.

    Raises:
        TopologyError: naming the field (``peers[i].port``) of the first problem found.
    """
    if not peers:
        raise TopologyError("peers: a topology needs at least one peer")
    first_index: dict[int, int] = {}
    for index, peer in enumerate(peers):
        _check_peer(index, peer)
        if peer.rank in first_index:
            raise TopologyError(
                f"duplicate rank {peer.rank} in peers[{first_index[peer.rank]}] and peers[{index}]"
            )
        first_index[peer.rank] = index
    # P distinct ranks with none missing from 0..P-1 leaves none out of range.
    for rank in range(len(peers)):
        if rank not in first_index:
            raise TopologyError(f"missing peer rank {rank} (ranks must be 0..{len(peers) - 1})")
    ordered = tuple(sorted(peers, key=lambda peer: peer.rank))
    owner: dict[tuple[str, int], int] = {}
    for peer in ordered:
        key = (peer.host, peer.port)
        if key in owner:
            raise TopologyError(
                f"duplicate address {peer.host}:{peer.port} (ranks {owner[key]} and {peer.rank})"
            )
        owner[key] = peer.rank
    _check_public_keys(peers)
    return ordered


def _check_public_keys(peers: Sequence[PeerAddress]) -> None:
    """Every peer has a distinct valid key, or none has one (a half-keyed cluster would
    leave some sockets open to anyone)."""
    keyed = [index for index, peer in enumerate(peers) if peer.public_key is not None]
    if not keyed:
        return
    owner: dict[str, int] = {}
    for index, peer in enumerate(peers):
        where = f"peers[{index}].public_key"
        if peer.public_key is None:
            raise TopologyError(f"{where}: missing (peers[{keyed[0]}] has one: give every "
                                f"peer a key, or none)")
        try:
            keys.check_key(where, peer.public_key)
        except ConfigError as exc:
            raise TopologyError(str(exc)) from None
        if peer.public_key in owner:
            raise TopologyError(f"{where}: same key as peers[{owner[peer.public_key]}] (every "
                                f"peer needs its own keypair)")
        owner[peer.public_key] = index
