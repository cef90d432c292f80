"""CURVE keypairs for peers: generate, read, validate, and pick one rank's keys.

Files, one pair per rank in a key directory: ``peer-R.key`` holds the Z85 secret key (mode
0600) and ``peer-R.key.pub`` the Z85 public key, one line each (no comments: ``#`` is a Z85
character).
A topology names every peer's public key (per peer, or ``keys: DIR``); a peer also needs its
own secret key, from ``--key FILE`` or the topology's key directory.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import zmq

from gossip.errors import ConfigError

KEY_CHARS = 40  # a 32-byte Curve25519 key in Z85
PUBLIC_SUFFIX = ".key.pub"
SECRET_SUFFIX = ".key"
_Z85 = frozenset("0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#")


def public_path(directory: str | Path, rank: int) -> Path:
    return Path(directory) / f"peer-{rank}{PUBLIC_SUFFIX}"


def secret_path(directory: str | Path, rank: int) -> Path:
    return Path(directory) / f"peer-{rank}{SECRET_SUFFIX}"


def check_key(field: str, value: object) -> str:
    """``value`` if it is a Z85 CURVE key, else ConfigError naming ``field``."""
    if not isinstance(value, str):
        raise ConfigError(f"{field}: expected a {KEY_CHARS}-character Z85 CURVE key, "
                          f"got {type(value).__name__}")
    if len(value) != KEY_CHARS:
        raise ConfigError(f"{field}: expected a {KEY_CHARS}-character Z85 CURVE key, got "
                          f"{len(value)} characters")
    bad = sorted(set(value) - _Z85)
    if bad:
        raise ConfigError(f"{field}: {bad[0]!r} is not a Z85 character")
    return value


def generate(directory: str | Path, ranks: Iterable[int], *, force: bool = False) -> list[Path]:
    """Write a fresh keypair per rank into ``directory``; returns the files written.

    Raises:
        ConfigError: a key file exists already (unless ``force``), or cannot be written.
    """
    directory = Path(directory)
    ranks = list(ranks)
    if not force:
        for rank in ranks:
            for path in (secret_path(directory, rank), public_path(directory, rank)):
                if path.exists():
                    raise ConfigError(f"{path}: exists already (pass --force to replace it)")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        written = []
        for rank in ranks:
            public, secret = (key.decode("ascii") for key in zmq.curve_keypair())
            written.append(_write(secret_path(directory, rank), secret, 0o600))
            written.append(_write(public_path(directory, rank), public, 0o644))
        return written
    except OSError as exc:
        raise ConfigError(f"{exc.filename or directory}: cannot write keys: "
                          f"{exc.strerror or exc}") from None


def _write(path: Path, key: str, mode: int) -> Path:
    # Created with its final mode, so the secret is never readable by others, not even briefly.
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "w", encoding="ascii") as f:
        f.write(key + "\n")
    return path


def read_public_key(path: str | Path) -> str:
    """The Z85 public key in ``path``; ConfigError naming the file if missing or malformed."""
    return _read_key(Path(path))


def read_secret_key(path: str | Path) -> str:
    """The Z85 secret key in ``path``; refused if others may read the file (like ssh)."""
    path = Path(path)
    key = _read_key(path)
    mode = path.stat().st_mode
    if mode & (stat.S_IRGRP | stat.S_IROTH):
        raise ConfigError(f"{path}: secret key readable by others (mode {stat.S_IMODE(mode):04o});"
                          f" run chmod 600 {path}")
    return key


def _read_key(path: Path) -> str:
    try:
        text = path.read_text(encoding="ascii")
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such key file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read key: {getattr(exc, 'strerror', None) or exc}") \
            from None
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if len(lines) != 1:
        raise ConfigError(f"{path}: expected one Z85 key line, found {len(lines)}")
    return check_key(str(path), lines[0])


def public_of(secret: str) -> str:
    """The public key that belongs to a Z85 secret key."""
    return zmq.curve_public(secret.encode("ascii")).decode("ascii")


@dataclass(frozen=True, repr=False)
class CurveKeys:
    """What one rank's transport needs for CURVE: its keypair and every rank's public key.

    Attributes:
        rank: The rank these keys are for.
        secret: Its Z85 secret key (never printed: repr leaves it out).
        peers: Z85 public key of every rank, by rank (``peers[rank]`` is its own).
    """

    rank: int
    secret: str
    peers: tuple[str, ...]

    def __post_init__(self):
        ranks = {key: rank for rank, key in enumerate(self.peers)}
        if len(ranks) != len(self.peers) or not 0 <= self.rank < len(self.peers):
            raise ConfigError(f"CurveKeys: rank {self.rank} of {len(self.peers)} peers, "
                              f"or two peers share a public key")
        object.__setattr__(self, "_ranks", ranks)

    @property
    def public(self) -> str:
        return self.peers[self.rank]

    def rank_of(self, public: str) -> int | None:
        """The rank whose public key is ``public``, or None for a stranger."""
        return self._ranks.get(public)

    def __repr__(self) -> str:
        return f"CurveKeys(rank={self.rank}, public={self.public!r}, peers={len(self.peers)})"


def for_rank(topology, rank: int, key_file: str | Path | None = None) -> CurveKeys | None:
    """The CURVE keys of ``rank`` in ``topology``, or None if the topology lists no keys.

    The secret key comes from ``key_file``, else from the topology's key directory.

    Raises:
        ConfigError: no secret key to be found, a key file is bad, the secret key is not the
            one whose public key the topology lists for ``rank``, or ``key_file`` is given for
            a topology without keys (the peer would run unencrypted).
    """
    if not topology.keyed:
        if key_file is not None:
            raise ConfigError(f"--key {key_file}: the topology lists no public keys, so peers "
                              f"would not use it (add public_key per peer or keys: DIR)")
        return None
    if key_file is None:
        if topology.key_dir is None:
            raise ConfigError(f"rank {rank}: the topology lists public keys but no key "
                              f"directory: pass --key FILE with this peer's secret key")
        key_file = secret_path(topology.key_dir, rank)
    secret = read_secret_key(key_file)
    public = public_of(secret)
    expected = topology.peers[rank].public_key
    if public != expected:
        raise ConfigError(f"{key_file}: not rank {rank}'s secret key (its public key {public} "
                          f"differs from peers[{rank}].public_key {expected})")
    return CurveKeys(rank, secret, tuple(peer.public_key for peer in topology.peers))
