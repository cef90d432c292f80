"""ZAP handler: which CURVE client keys a peer's receiving socket lets in.

libzmq asks the handler bound at ``inproc://zeromq.zap.01`` in the socket's context about
every incoming CURVE handshake. Ours lets in exactly the topology's public keys and names
the key's rank as the connection's User-Id, which every message from it then carries, so the
transport can check that a message's ``src`` is the rank that sent it. A thread answers, as
handshakes happen in libzmq's I/O thread whatever the application is doing.
"""

from __future__ import annotations

import logging
import threading
from collections import deque

import zmq
from zmq.utils import z85

from gossip.keys import CurveKeys

log = logging.getLogger("gossip.transport")

ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # fixed by the ZAP specification (RFC 27)
DOMAIN = b"gossip"


class ZapHandler:
    """Answers a context's ZAP requests from a thread until ``close()``.

    Args:
        context: The context of the sockets to guard (one handler per context).
        keys: The topology's keys: ``keys.peers`` are the client keys let in.

    Attributes:
        denials: ``(address, z85 key)`` of recent refused clients, oldest first, for the
            transport to name in its rejection reasons.
    """

    def __init__(self, context: zmq.Context, keys: CurveKeys):
        self.keys = keys
        self.denials: deque[tuple[str, str]] = deque(maxlen=64)
        self._zap = context.socket(zmq.REP)
        self._zap.linger = 0
        self._zap.bind(ZAP_ENDPOINT)
        # A pair of sockets to wake the thread for closing: sockets are not thread-safe.
        stop_at = f"inproc://gossip-zap-stop-{id(self)}"
        self._stop = context.socket(zmq.PAIR)
        self._stop.linger = 0
        self._stop.bind(stop_at)
        self._stopped = context.socket(zmq.PAIR)
        self._stopped.linger = 0
        self._stopped.connect(stop_at)
        self._thread = threading.Thread(target=self._run, name=f"zap-{keys.rank}", daemon=True)
        self._thread.start()

    def close(self, timeout: float = 5.0) -> None:
        if self._stop is None:
            return
        self._stop.send(b"")
        self._thread.join(timeout)
        self._stop.close()
        self._stop = None

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._zap, zmq.POLLIN)
        poller.register(self._stopped, zmq.POLLIN)
        try:
            while self._stopped not in dict(poller.poll()):
                request = self._zap.recv_multipart()
                try:
                    answer = self.reply(request)
                except Exception:
                    log.exception("rank %d: ZAP request failed; refusing it", self.keys.rank)
                    answer = [b"1.0", request[1], b"500", b"internal error", b"", b""]
                self._zap.send_multipart(answer)
        finally:
            self._zap.close()
            self._stopped.close()

    def reply(self, request: list[bytes]) -> list[bytes]:
        """The ZAP reply to ``request``: 200 with the rank as User-Id, or 400."""
        if len(request) < 6:  # not from libzmq; answer anyway so the socket stays usable
            return [b"1.0", request[1] if len(request) > 1 else b"", b"400", b"bad request",
                    b"", b""]
        version, request_id, _domain, address, _identity, mechanism, *credentials = request
        if mechanism != b"CURVE" or len(credentials) != 1 or len(credentials[0]) != 32:
            # Unreachable while the socket is a CURVE server; refuse rather than trust.
            return [version, request_id, b"400", b"CURVE required", b"", b""]
        public = z85.encode(credentials[0]).decode("ascii")
        rank = self.keys.rank_of(public)
        if rank is None:
            self.denials.append((address.decode("utf-8", "replace"), public))
            return [version, request_id, b"400", b"unknown key", b"", b""]
        return [version, request_id, b"200", b"OK", str(rank).encode(), b""]
