"""A sent message's handle: when may its tensors be modified again?"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from gossip.clock import Clock
from gossip.errors import PeerTimeout


@dataclass(frozen=True)
class SendWatch:
    """What waiting for sent messages asks of their transport (one per transport).

    Attributes:
        rank: The sender's rank.
        clock: The transport's clock.
        timeout: Seconds ``Delivery.wait`` waits by default.
        describe: How to name a rank in an error.
        check: ``check(dst, kind)``: read what is known about the peers' connections and
            raise PeerGone if a ``kind`` message to ``dst`` will never be read.
    """

    rank: int
    clock: Clock
    timeout: float
    describe: Callable[[int], str]
    check: Callable[[int, str], None]


class Delivery:
    """Handle of a sent message: ``wait()`` returns once its tensors may be modified again."""

    # A message to a peer that died stays queued for its reconnect, so waiting for it checks
    # the peer's liveness this often.
    LIVENESS_POLL_S = 0.1

    def __init__(self, watch: SendWatch, dst: int, trackers: list, kind: str = ""):
        self._watch, self._dst, self._trackers = watch, dst, trackers
        self._kind = kind

    def wait(self, timeout: float | None = None) -> None:
        """Raises PeerGone if the destination is declared dead meanwhile (its copy of the
        message is then never read; the tensors may be modified all the same)."""
        watch = self._watch
        limit = watch.timeout if timeout is None else timeout
        deadline = watch.clock.monotonic() + limit
        for tracker in self._trackers:
            while not tracker.wait(min(self.LIVENESS_POLL_S,
                                       max(deadline - watch.clock.monotonic(), 0.0))):
                watch.check(self._dst, self._kind)
                if watch.clock.monotonic() >= deadline:
                    raise PeerTimeout(f"rank {watch.rank}: message to "
                                      f"{watch.describe(self._dst)} not sent within {limit:g} s")
