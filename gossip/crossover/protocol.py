"""The arbiter's messages: one msgpack map per ZeroMQ message, never pickle.

Client to arbiter: ``{v: 1, op, device, job, rank, round, pid, host}`` with op ``hello`` (join
the device's rotation), ``acquire``, ``release``, ``withdraw`` (stop waiting: the acquire
timed out), ``ping`` (alive while waiting; with the round waited for), ``bye`` (leave). Every
message names its sender (device, job, rank, pid, host): an arbiter restarted at the same
address learns its clients again from them. Arbiter to client: ``{v: 1, op: grant, round}``,
``{v: 1, op: revoked, round}`` (held past max_hold_s: wait again before more device work) or
``{v: 1, op: status, why}`` (who blocks the device, the answer to a ping). Every field is
checked before use.
"""

from __future__ import annotations

from typing import Any

import msgpack

from gossip.errors import ProtocolError

VERSION = 1
MAX_BYTES = 4096
MAX_NAME = 256  # characters of a device, job or host name
CLIENT_OPS = ("hello", "acquire", "release", "withdraw", "ping", "bye")
SERVER_OPS = ("grant", "revoked", "status")
_INTS = ("rank", "round", "pid")


def encode(op: str, **fields: Any) -> bytes:
    return msgpack.packb({"v": VERSION, "op": op, **fields}, use_bin_type=True)


def decode(frame: bytes, ops: tuple[str, ...]) -> dict[str, Any]:
    """The checked message of ``frame`` whose op is one of ``ops``.

    Raises:
        ProtocolError: what is wrong with it.
    """
    if len(frame) > MAX_BYTES:
        raise ProtocolError(f"message of {len(frame)} bytes (at most {MAX_BYTES})")
    try:
        msg = msgpack.unpackb(frame, raw=False, strict_map_key=True, max_bin_len=0,
                              max_ext_len=0)
    except Exception as exc:  # noqa: BLE001 - msgpack raises several unrelated types
        raise ProtocolError(f"not valid msgpack: {exc}") from None
    if not isinstance(msg, dict):
        raise ProtocolError(f"expected a map, got {type(msg).__name__}")
    if type(msg.get("v")) is not int or msg["v"] != VERSION:
        raise ProtocolError(f"version {msg.get('v')!r} (expected {VERSION})")
    if msg.get("op") not in ops:
        raise ProtocolError(f"op {msg.get('op')!r} (expected one of {', '.join(ops)})")
    for key in _INTS:
        if key in msg and (type(msg[key]) is not int or msg[key] < 0):
            raise ProtocolError(f"{key} {msg[key]!r} is not a non-negative integer")
    for key in ("device", "job", "why", "host"):
        if key in msg and (not isinstance(msg[key], str) or len(msg[key]) > MAX_NAME):
            raise ProtocolError(f"{key} {msg[key]!r} is not a short string")
    return msg


def require(msg: dict[str, Any], *keys: str) -> None:
    """ProtocolError unless ``msg`` has every one of ``keys``."""
    missing = [k for k in keys if k not in msg]
    if missing:
        raise ProtocolError(f"{msg['op']} without {', '.join(missing)}")
