"""What an arbiter's address and the names its messages carry may be: checked where a
config is read (connect.py), a client is built (client.py) and the arbiter binds."""

from __future__ import annotations

from typing import Any

from gossip.crossover import protocol
from gossip.errors import ConfigError

SCHEMES = ("ipc://", "tcp://", "flock:", "slices:")
MAX_SOCKET_PATH = 107  # bytes of a Unix socket's path (sun_path, less its NUL)


def check_address(address: Any, *, what: str, bind: bool = False) -> None:
    """ConfigError unless ``address`` is a whole address of ``SCHEMES`` (only ``ipc://`` and
    ``tcp://`` when ``bind``: the arbiter's own; a bound port may be ``*``)."""
    schemes = SCHEMES[:2] if bind else SCHEMES
    if not isinstance(address, str) or not address.startswith(schemes):
        raise ConfigError(f"{what} {address!r}: expected an address starting with "
                          f"{', '.join(schemes)}")
    scheme, _, rest = address.partition(":")
    if scheme == "tcp":
        host, _, port = rest.removeprefix("//").rpartition(":")
        if not (host and (port.isdigit() and 0 < int(port) < 65536 or bind and port == "*")):
            raise ConfigError(f"{what} {address!r}: expected tcp://HOST:PORT "
                              f"(a port from 1 to 65535)")
    elif scheme == "ipc":
        path = rest.removeprefix("//")
        if not path:
            raise ConfigError(f"{what} {address!r}: expected ipc://PATH")
        if len(path.encode()) > MAX_SOCKET_PATH:
            raise ConfigError(f"{what} {address!r}: a socket's path has at most "
                              f"{MAX_SOCKET_PATH} bytes")
    elif not rest:
        raise ConfigError(f"{what} {address!r}: expected {scheme}:DIR")


def check_name(name: Any, *, what: str) -> None:
    """ConfigError unless ``name`` is a name the arbiter's messages can carry (``{rank}``
    counted as a rank of up to 6 digits)."""
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{what} {name!r}: expected a name")
    if len(name.replace("{rank}", "0" * 6)) > protocol.MAX_NAME:
        raise ConfigError(f"{what} {name[:20]!r}...: {len(name)} characters (at most "
                          f"{protocol.MAX_NAME})")
