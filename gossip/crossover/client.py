"""``ArbiterClient``: a ``DeviceLock`` granted by the arbiter process over ZeroMQ."""

from __future__ import annotations

import logging
import os
import socket

import zmq

from gossip.clock import REAL_TIME, Clock
from gossip.crossover import protocol
from gossip.crossover.base import DeviceLock
from gossip.crossover.address import check_address, check_name
from gossip.errors import PeerTimeout, ProtocolError

log = logging.getLogger("gossip.crossover")
PING_S = 1.0  # while waiting: proves this client alive, asks who blocks the device


class ArbiterClient(DeviceLock):
    """One rank's handle on ``device`` at the arbiter listening on ``address``; it joins
    the device's rotation now and leaves it on ``close``."""

    def __init__(self, address: str, device: str, job: str, rank: int, *,
                 timeout: float = 60.0, clock: Clock = REAL_TIME):
        super().__init__(device, job, rank, timeout=timeout, clock=clock)
        check_address(address, what="arbiter", bind=False)
        for what, name in (("device", self.device), ("job", self.job)):
            check_name(name, what=what)
        self.address = address
        self._round: int | None = None  # the round of the grant held (None: none)
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_BYTES)
        self._socket.connect(address)
        self._blocking = "no answer from the arbiter"  # its last status
        self._host = socket.gethostname()
        self._send("hello")

    def acquire(self, round: int) -> None:
        clock = self.clock
        deadline = clock.monotonic() + self.timeout
        self._round = None
        self._send("acquire", round=round)
        while True:
            left = deadline - clock.monotonic()
            if left <= 0:
                self._send("withdraw", round=round)  # else the device would wait for us
                self._ask_who_blocks()
                raise PeerTimeout(f"device {self.device} (arbiter {self.address}): job "
                                  f"{self.job} rank {self.rank} waited {self.timeout:g} s for "
                                  f"round {round}; {self._blocking}")
            if not self._socket.poll(min(left, PING_S) * 1000):
                self._send("ping", round=round)  # the round: a restarted arbiter asks again
                continue
            if (msg := self._read()) is None:
                continue
            if msg["op"] == "status":
                self._blocking = msg.get("why", self._blocking)
            elif msg["op"] == "grant" and msg.get("round") == round:
                self._round = round
                return

    def _read(self) -> dict | None:
        """The arbiter's message waiting on the socket; None for a malformed one (logged)."""
        try:
            return protocol.decode(self._socket.recv(), protocol.SERVER_OPS)
        except ProtocolError as exc:
            log.warning("device %s: ignored a message from the arbiter: %s", self.device, exc)
            return None

    def _ask_who_blocks(self, wait_s: float = 0.5) -> None:
        """Update ``_blocking`` from the arbiter's answer to a ping (if one comes soon). The
        arbiter answers in order, so a grant that raced our withdraw (and that it released)
        arrives before the answer: it is read and dropped here, not taken for a later one."""
        self._send("ping")
        deadline = self.clock.monotonic() + wait_s
        while (left := deadline - self.clock.monotonic()) > 0 and self._socket.poll(left * 1000):
            if (msg := self._read()) is None:
                continue
            if msg["op"] == "status":
                self._blocking = msg.get("why", self._blocking)
                return

    def sleep(self, seconds: float) -> None:
        """Emulated device time, paused while the grant is revoked: a holder past
        ``max_hold_s`` learns it here and waits for the device again before the rest."""
        if self.clock.virtual or self._round is None:  # virtual time; no grant held
            self.clock.sleep(seconds)
            return
        left = seconds
        while left > 0:
            start = self.clock.monotonic()
            ready = self._socket.poll(left * 1000)
            left -= self.clock.monotonic() - start
            if not ready:
                continue
            if (msg := self._read()) is None:
                continue
            if msg["op"] == "revoked" and msg.get("round") == self._round:
                log.warning("device %s: job %s rank %d: the arbiter revoked the grant of "
                            "round %d (held past its max hold); waiting for the device again",
                            self.device, self.job, self.rank, self._round)
                self.acquire(self._round)

    def release(self, round: int) -> None:
        self._round = None
        self._send("release", round=round)

    def close(self) -> None:
        if not self._socket.closed:
            self._send("bye")
            self._socket.close(linger=1000)  # the bye must get out
            self._context.term()

    def _send(self, op: str, **fields) -> None:
        self._socket.send(protocol.encode(op, device=self.device, job=self.job, rank=self.rank,
                                          pid=os.getpid(), host=self._host, **fields))
