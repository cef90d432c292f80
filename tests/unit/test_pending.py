"""The unclaimed-message buffer (gossip/transport/pending.py): matching, its index, its bounds."""

from __future__ import annotations

import time

import pytest

from gossip.errors import PeerTimeout
from gossip.transport import LoopbackHub, Message
from gossip.transport.pending import PendingMessages


def msg(kind="gossip", round=0, src=1, tag=None) -> Message:
    return Message(kind=kind, round=round, src=src, meta={"tag": tag})


def test_oldest_match_first_with_and_without_a_source():
    pending = PendingMessages()
    for tag, (src, round) in enumerate([(1, 0), (2, 0), (1, 0), (2, 1)]):
        pending.keep(msg(round=round, src=src, tag=tag), 10)
    assert pending.take(2, "gossip", 0).meta["tag"] == 1
    assert pending.take(None, "gossip", 0).meta["tag"] == 0
    assert pending.take(None, "gossip", 0).meta["tag"] == 2
    assert pending.take(None, "gossip", 0) is None
    assert pending.take(None, None, None).meta["tag"] == 3  # the scan for wildcards
    assert len(pending) == 0 and pending.bytes == 0


@pytest.mark.slow  # times 4 x 1000 receives
def test_a_receive_costs_the_same_however_many_messages_wait():
    """20,000 never-claimed messages (well within the byte allowance) made every receive
    scan them all: dpsgd rounds 3-13x slower."""
    def time_receives(junk: int) -> float:
        hub = LoopbackHub(2)
        t0, t1 = hub.transport(0), hub.transport(1)
        for i in range(junk):  # rounds that never come
            t1.send(0, Message("gossip", 10**6 + i))
        t1.send(0, Message("gossip", 0))
        t0.recv(src=1, kind="gossip", round=0, timeout=5)  # reads (and keeps) the junk
        start = time.perf_counter()
        for round in range(1, 1001):
            t1.send(0, Message("gossip", round))
            t0.recv(src=1, kind="gossip", round=round, timeout=5)
        assert len(t0.inbox) == junk
        return time.perf_counter() - start

    clean = min(time_receives(0) for _ in range(2))
    crowded = min(time_receives(20_000) for _ in range(2))
    assert crowded < 2 * clean, (crowded, clean)  # scanning: ~100x


def test_messages_long_behind_the_current_round_are_refused_and_expired():
    pending = PendingMessages(rounds_behind=4)
    pending.keep(msg(round=3), 10)
    pending.keep(msg(round=6), 10)
    assert pending.advance(7) == []  # rounds >= 3 may still be asked for
    dropped = pending.advance(9)  # rounds < 5 can never be asked for again
    assert [m.round for m in dropped] == [3] and len(pending) == 1
    assert pending.refusal(msg(round=4), 10) is not None
    assert "more than 4 rounds behind" in pending.refusal(msg(round=4), 10)
    assert pending.refusal(msg(round=5), 10) is None
    assert pending.refusal(msg(round=10**6), 10) is None  # ahead: a neighbour may run ahead


def test_count_and_byte_caps():
    pending = PendingMessages(max_messages=3, max_bytes=100)
    for round in range(3):
        pending.keep(msg(round=round), 10)
    assert "buffer full (3 messages, 30 bytes)" in pending.refusal(msg(round=9), 10)
    pending.take(1, "gossip", 0)
    assert pending.refusal(msg(round=9), 10) is None
    assert "buffer full" in pending.refusal(msg(round=9), 81)


def test_transport_rejects_what_it_cannot_keep_and_expires_what_falls_behind():
    hub = LoopbackHub(2)
    t0 = hub.transport(0, max_pending_messages=5)
    t1 = hub.transport(1)
    for round in range(100, 110):  # a flood of messages for rounds that never come
        t1.send(0, Message("gossip", round, buffers=()))
    t1.send(0, Message("gossip", 0))
    assert t0.recv(src=1, kind="gossip", round=0, timeout=1).round == 0
    assert len(t0.inbox) == 5 and t0.stats.messages_rejected == 5
    assert all("buffer full" in reason for reason in t0.stats.rejections)
    # Rejected messages are not received messages: the totals still add up by kind.
    assert t0.stats.messages_recv == 6
    t1.send(0, Message("gossip", 130))
    t1.send(0, Message("gossip", 2))  # 128 rounds behind by the time it is read
    assert t0.recv(src=1, kind="gossip", round=130, timeout=1).round == 130
    assert t0.stats.messages_expired == 5 and len(t0.inbox) == 0
    with pytest.raises(PeerTimeout):
        t0.recv(src=1, kind="gossip", round=131, timeout=0.1)
    assert "more than 16 rounds behind" in t0.stats.rejections[-1]
