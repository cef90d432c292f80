"""The arbiter process: one per machine, every device of it, clients over ZeroMQ (a ROUTER
socket; each client a DEALER: one rank of one job on one device). `gossip arbiter` runs it;
the run launcher starts one for jobs that share devices."""

from __future__ import annotations

import logging
import math
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import zmq

from gossip.crossover import protocol
from gossip.crossover.grants import GrantLog
from gossip.crossover.rotation import Grant, Request, Rotation, check_limits
from gossip.errors import ConfigError, ProtocolError

log = logging.getLogger("gossip.crossover")
TICK_S = 0.05  # how often leases and client processes are checked without any message
# At a stop, messages still arriving are read until this long passes without one (a client
# does not await its release: sent just before the stop, it may still be crossing the socket).
STOP_QUIET_S = 0.1
STOP_DRAIN_S = 1.0  # ... and never for longer than this


@dataclass
class Client:
    device: str
    job: str
    rank: int
    pid: int | None
    last_seen: float


class ArbiterServer:
    """Grants each device's compute phase by its ``Rotation``.

    Args:
        address: Where to bind (``ipc://PATH`` reaches every network namespace of the
            machine; ``tcp://HOST:PORT``).
        patience_s: See ``Rotation``.
        max_hold_s: A grant held longer is revoked and its job leaves the rotation.
        dead_after: A client silent this long while the device waits for it (its turn,
            others asking) is dropped; a client whose process is gone (same machine) at once.
        grant_log: The JSONL file of grants.
    """

    def __init__(self, address: str, *, patience_s: float = math.inf,
                 max_hold_s: float = math.inf, dead_after: float = 60.0,
                 grant_log: str | Path | None = None):
        check_limits(patience_s=patience_s, max_hold_s=max_hold_s)
        self.patience_s, self.max_hold_s, self.dead_after = patience_s, max_hold_s, dead_after
        self.log = GrantLog(grant_log)
        self.rotations: dict[str, Rotation] = {}
        self.clients: dict[bytes, Client] = {}
        self.rejected = 0
        if address.startswith("ipc://"):
            _refuse_if_listening(address)
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_BYTES)
        try:
            self._socket.bind(address)
        except zmq.ZMQError:
            self.close()
            raise
        self.address = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)

    def serve(self, stop: threading.Event) -> None:
        """Answer clients until ``stop`` is set."""
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        while not stop.is_set():
            if poller.poll(TICK_S * 1000):
                self._drain()
            self._tick()
        # The releases sent before the stop go into the grant log, those in flight too.
        deadline = time.monotonic() + STOP_DRAIN_S
        while self._socket.poll(STOP_QUIET_S * 1000) and time.monotonic() < deadline:
            self._drain()

    def _drain(self) -> None:
        while self._socket.poll(0):
            self._handle(self._socket.recv_multipart(copy=True))

    def close(self) -> None:
        self._socket.close(linger=0)
        self._context.term()

    # -- messages --------------------------------------------------------------------------

    def _handle(self, frames: list[bytes]) -> None:
        identity = frames[0]
        try:
            if len(frames) != 2:
                raise ProtocolError(f"{len(frames) - 1} frames (expected 1)")
            msg = protocol.decode(frames[1], protocol.CLIENT_OPS)
            self._apply(identity, msg)
        except ProtocolError as exc:
            self.rejected += 1
            log.warning("arbiter: rejected a message: %s", exc)

    def _apply(self, identity: bytes, msg: dict) -> None:
        now, op = time.time(), msg["op"]
        client = self.clients.get(identity)
        if op == "hello" or client is None:
            # Every message names its sender, so a client this arbiter does not know (it
            # was restarted at the same address; the client reconnected) is taken at its word.
            protocol.require(msg, "device", "job", "rank")
            here = msg.get("host") == socket.gethostname()  # else its pid means nothing
            client = Client(msg["device"], msg["job"], msg["rank"],
                            msg.get("pid") if here else None, now)
            for other, known in list(self.clients.items()):  # a rank's newer connection
                if (known.device, known.job, known.rank) == (client.device, client.job,
                                                             client.rank):
                    del self.clients[other]                   # replaces its older one
            self.clients[identity] = client
            self._rotation(client.device).join(client.job, client.rank)
        client.last_seen = now
        rotation = self._rotation(client.device)
        if op == "acquire":
            protocol.require(msg, "round")
            rotation.request(Request(client.job, client.rank, msg["round"], now))
        elif op == "release":
            self.log.write(rotation.release(client.job, client.rank, now))
        elif op == "withdraw":
            self.log.write(rotation.withdraw(client.job, client.rank, now))
        elif op == "ping":
            # A waiting client's ping carries its round: an arbiter that lost the request
            # (restarted since) takes it again.
            member = (client.job, client.rank)
            if ("round" in msg and member not in rotation.waiting
                    and not rotation.holds(*member)):
                rotation.request(Request(client.job, client.rank, msg["round"], now))
            self._send(identity, "status", why=rotation.blocking())
        elif op == "bye":
            self.log.write(rotation.leave(client.job, client.rank, now))
            del self.clients[identity]

    # -- time ------------------------------------------------------------------------------

    def _tick(self) -> None:
        now = time.time()
        for identity, client in list(self.clients.items()):
            rotation = self._rotation(client.device)
            why = self._why_dead(client, rotation, now)
            if why:
                log.warning("arbiter: device %s: job %s rank %d %s; it leaves the rotation",
                            client.device, client.job, client.rank, why)
                self.log.write(rotation.revoke(client.job, client.rank, now, why))
                del self.clients[identity]
        for rotation in self.rotations.values():
            revoked = self.log.expire(rotation, now, self.max_hold_s)
            if revoked is not None:  # the holder waits again before its next device work
                self._send_to(revoked, "revoked", round=revoked.round)
            grant = rotation.next_grant(now)
            if grant is not None:
                self._send_to(grant, "grant", round=grant.round)

    def _why_dead(self, client: Client, rotation: Rotation, now: float) -> str | None:
        if client.pid is not None and not _alive(client.pid):
            return f"process {client.pid} is gone"
        member = (client.job, client.rank)
        waited_for = (rotation.holder is None and rotation.turn == member
                      and rotation.waiting and member not in rotation.waiting)
        if waited_for and now - client.last_seen > self.dead_after:
            return f"silent for {now - client.last_seen:.1f} s while the device waited for it"
        return None

    def _send_to(self, grant: Grant, op: str, **fields) -> None:
        """Send to the client of ``grant``'s rank."""
        for identity, client in self.clients.items():
            if (client.device, client.job, client.rank) == (grant.device, grant.job,
                                                             grant.rank):
                self._send(identity, op, **fields)
                return

    def _send(self, identity: bytes, op: str, **fields) -> None:
        try:
            self._socket.send_multipart([identity, protocol.encode(op, **fields)],
                                        flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # the client went away: its process check drops it
            log.info("arbiter: could not answer a client: %s", exc)

    def _rotation(self, device: str) -> Rotation:
        if device not in self.rotations:
            self.rotations[device] = Rotation(device, patience_s=self.patience_s)
        return self.rotations[device]


def _refuse_if_listening(address: str) -> None:
    """ConfigError if an arbiter already listens at ``ipc://PATH`` (zmq's bind would
    silently replace its socket file: jobs on the two would compute on one device at once).
    A file nobody listens at, which a killed arbiter leaves, is taken over."""
    path = address.removeprefix("ipc://")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except OSError:
        return
    finally:
        probe.close()
    raise ConfigError(f"arbiter {address}: {path} is in use (another arbiter listens there)")


def _alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[-1].split()[0] != b"Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    except OSError:
        return True
