"""Waiting for something to happen: poll a condition until a deadline, then fail naming it.

A test that sleeps "long enough" is slow when the machine is idle and flaky when it is not;
one that waits for the event it needs is neither.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import pytest

T = TypeVar("T")


def wait_until(predicate: Callable[[], T], timeout: float, what: str, *,
               interval: float = 0.002, max_interval: float = 0.05) -> T:
    """Call ``predicate`` until it returns something truthy and return that; fail the test
    naming ``what`` if it has not within ``timeout`` seconds.

    Polls at ``interval`` at first, backing off to ``max_interval``: quick to notice, and
    cheap on two busy cores while the wait is long.
    """
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result:
            return result
        left = deadline - time.monotonic()
        if left <= 0:
            pytest.fail(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(min(interval, left))
        interval = min(2 * interval, max_interval)


def read_until(transport, done: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    """Let ``transport`` take in what arrives (rejections, goodbyes, shared-memory offers and
    answers are handled inside ``recv``) until ``done()``; fail naming ``what`` at the
    deadline, or if a message is delivered: none is expected meanwhile."""
    from gossip.errors import PeerTimeout

    def step() -> bool:
        if done():
            return True
        try:
            msg = transport.recv(timeout=0.02)
        except PeerTimeout:
            return done()
        pytest.fail(f"while waiting for {what}, {msg.kind} round {msg.round} from peer "
                    f"{msg.src} was delivered")

    wait_until(step, timeout, what, interval=0.0)


def wait_connected(sock, timeout: float, what: str) -> None:
    """Wait until the ZeroMQ socket ``sock`` has completed a handshake with a peer (what it
    queued streams out from then on); fail naming ``what`` at the deadline."""
    import zmq
    from zmq.utils.monitor import recv_monitor_message

    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    try:
        if not monitor.poll(int(timeout * 1000)):
            pytest.fail(f"timed out after {timeout:g} s waiting for {what}")
        recv_monitor_message(monitor)
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)


def pace_joins(peer, round: int, progress, done: list, joins: dict, timeout: float) -> None:
    """As rank 0 of an elastic run with joins, after ``round``: say so (``done[0]``, under
    ``progress``, a Condition the joiners wait on) and go on only once the ask of every
    joiner due at this round arrived (``joins``: joiner -> round), so it is admitted mid-run
    whatever the machine's load."""
    with progress:
        done[0] = round
        progress.notify_all()
    asked = peer.transport.membership.epochs.asking
    for joiner in (j for j, at in joins.items() if at == round):
        wait_until(lambda: peer.transport.inbox.wait(0.01) and False
                   or joiner in asked or joiner in peer.view.members,
                   timeout, f"rank {joiner}'s ask")
