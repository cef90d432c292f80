"""Shared memory between peers on one machine (gossip/transport/shm.py).

The segment allocator and the envelope checks on their own, then real ZeroMQ transports on
127.0.0.1 that hand large frames over through shared memory once the handshake is done.
"""

from __future__ import annotations

import errno
import gc
import logging
import os
import tempfile
from contextlib import suppress

import numpy as np
import pytest
import torch
import zmq

from gossip.errors import PeerTimeout
from gossip.keys import CurveKeys
from gossip.ports import free_ports
from gossip.transport import Message, ZmqTransport, codec, shm_segments
from support import Neighbour, read_until

KiB = 1024
BIG = codec.ZERO_COPY_MIN_BYTES  # the smallest frame that goes through shared memory


# -- the sender's segment ---------------------------------------------------------------


@pytest.fixture
def outbox():
    box = shm_segments.Outbox(1 << 20)
    yield box
    box.close()


def place(box: shm_segments.Outbox, nbytes: int) -> int | None:
    where = box.put(torch.full((nbytes,), 7, dtype=torch.uint8))
    return None if where is None else where[0]


def test_records_are_aligned_and_hold_the_bytes(outbox):
    frame = torch.arange(BIG + 1000, dtype=torch.int64).to(torch.uint8)
    offset, nbytes = outbox.put(frame)
    assert nbytes == BIG + 1000 and offset % shm_segments.ALIGN == 0
    assert bytes(outbox._map[offset:offset + nbytes]) == frame.numpy().tobytes()


def test_small_frames_stay_in_the_socket_message(outbox):
    assert place(outbox, BIG - 1) is None and place(outbox, BIG) is not None


def test_freed_space_is_reused_lowest_first_and_full_means_none(outbox):
    quarter = (1 << 20) // 4 - shm_segments.RECORD_HEADER  # the largest frame a segment takes
    first = [place(outbox, quarter) for _ in range(3)]
    assert all(offset is not None for offset in first)
    assert place(outbox, quarter) is None  # 3 records + the token leave less than a record
    outbox.free(first[:1])
    assert place(outbox, quarter) == first[0]  # wrapped to the front
    assert place(outbox, BIG) is None  # in use: front, then the other two behind it
    outbox.free(first[1:])
    second = place(outbox, BIG)
    assert second == first[1]  # the oldest live record was freed: reused in order


def test_frames_too_large_for_a_segment_are_refused(outbox):
    assert place(outbox, (1 << 20) // 4 + 1) is None


def test_a_machine_out_of_memory_means_the_socket_not_a_crash(monkeypatch, caplog):
    box = shm_segments.Outbox(64 << 20)
    try:
        assert place(box, BIG) is not None  # reserves the first 16 MiB
        calls = []

        def no_memory(*args):
            calls.append(args)
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(os, "posix_fallocate", no_memory)
        assert place(box, 10 << 20) is not None  # within what is reserved
        assert place(box, 10 << 20) is None and len(calls) == 1
        assert "cannot reserve" in caplog.text
        assert place(box, 1 << 20) is not None  # still fits
        assert place(box, 10 << 20) is None and len(calls) == 1  # not asked again
    finally:
        box.close()


# -- the receiver's side ----------------------------------------------------------------


def offered(box: shm_segments.Outbox, inbox: shm_segments.Inbox, src: int = 1) -> None:
    assert inbox.attach(src, box.offer()) is None


def envelope_frames(box: shm_segments.Outbox, tensors: list[torch.Tensor]) -> list:
    msg = Message("gossip", 0, buffers=tuple(tensors))
    header, frames = codec.encode(msg, 1)
    entries = [(i, *box.put(f)) for i, f in enumerate(frames, 1)]
    return [box.envelope(entries), header] + [b""] * len(frames)


def state(box: shm_segments.Outbox, data_offset: int) -> int:
    return int(box._states[(data_offset - shm_segments.RECORD_HEADER) // 8])


def test_a_received_frame_is_freed_once_nothing_refers_to_it(outbox):
    inbox = shm_segments.Inbox()
    offered(outbox, inbox)
    x = torch.arange(BIG // 8 + 1, dtype=torch.float64)
    frames = envelope_frames(outbox, [x])
    offset = shm_segments._ENTRY.unpack_from(frames[0], len(shm_segments.MAGIC) + shm_segments._HEAD.size)[1]
    msg = codec.decode(inbox.open(frames))
    assert torch.equal(msg.buffers[0], x) and state(outbox, offset) == shm_segments.BUSY
    view = msg.buffers[0][10:20]
    del msg, frames
    gc.collect()
    assert state(outbox, offset) == shm_segments.BUSY  # a view still refers to it
    assert view[0].item() == 10.0
    del view
    assert state(outbox, offset) == shm_segments.FREE


def test_a_frame_outlives_its_senders_segment():
    box, inbox = shm_segments.Outbox(1 << 20), shm_segments.Inbox()
    offered(box, inbox)
    x = torch.linspace(-1, 1, BIG // 4 + 5)
    msg = codec.decode(inbox.open(envelope_frames(box, [x])))
    box.close()
    inbox.close()
    assert torch.equal(msg.buffers[0], x)  # the receiver's mapping keeps the memory


def test_an_offer_of_anything_but_a_gossip_segment_is_refused(outbox):
    inbox = shm_segments.Inbox()
    with tempfile.TemporaryFile() as other:
        other.truncate(1 << 20)
        offer = {**outbox.offer(), "fd": other.fileno()}
        assert "not a gossip segment" in inbox.attach(1, offer)
    wrong_token = {**outbox.offer(), "token": os.urandom(16).hex()}
    assert "token" in inbox.attach(1, wrong_token)
    assert "not 1 bytes" in inbox.attach(1, {**outbox.offer(), "size": 1})
    assert "ValueError" in inbox.attach(1, {**outbox.offer(), "token": "xyz"})
    assert "KeyError" in inbox.attach(1, {"pid": 1})
    assert "FileNotFoundError" in inbox.attach(1, {**outbox.offer(), "fd": 987654})
    if os.getuid() == 0:  # only root can give a segment away
        os.fchown(outbox.fd, 12345, -1)
        assert "belongs to uid 12345" in inbox.attach(1, outbox.offer())


@pytest.mark.parametrize("damage, reason", [
    (lambda f: [f[0][:10]] + f[1:], "truncated"),
    (lambda f: [f[0] + b"\0"] + f[1:], "does not hold 1 entries"),
    (lambda f: [f[0], f[1], b"x"], "not an empty placeholder"),
    (lambda f: [f[0], f[1]], "not an empty placeholder"),  # index past the frames
    (lambda f: [entry(f[0], offset=shm_segments.ALIGN)] + f[1:], "outside the sender's segment"),
    (lambda f: [entry(f[0], offset=4 * shm_segments.ALIGN + 8)] + f[1:], "outside"),  # misaligned
    (lambda f: [entry(f[0], nbytes=1 << 20)] + f[1:], "outside the sender's segment"),
    (lambda f: [entry(f[0], nbytes=0)] + f[1:], "outside the sender's segment"),
    (lambda f: [f[0][:21] + b"\1" * 16 + f[0][37:]] + f[1:], "cannot map"),  # token
])
def test_a_broken_envelope_is_refused_by_name(outbox, damage, reason):
    inbox = shm_segments.Inbox()
    offered(outbox, inbox)
    frames = envelope_frames(outbox, [torch.ones(BIG)])
    with pytest.raises(Exception, match=reason):
        inbox.open(damage(frames))


def entry(envelope: bytes, **fields) -> bytes:
    """``envelope`` with its first entry's fields replaced."""
    at = len(shm_segments.MAGIC) + shm_segments._HEAD.size
    index, offset, nbytes = shm_segments._ENTRY.unpack_from(envelope, at)
    values = {"index": index, "offset": offset, "nbytes": nbytes, **fields}
    packed = shm_segments._ENTRY.pack(values["index"], values["offset"], values["nbytes"])
    return envelope[:at] + packed + envelope[at + shm_segments._ENTRY.size:]


# -- between transports -------------------------------------------------------------------


@pytest.fixture
def transports():
    opened = []

    def open_(size: int, **kwargs) -> list[ZmqTransport]:
        endpoints = [f"tcp://127.0.0.1:{port}" for port in free_ports(size)]
        opened.extend(ZmqTransport(rank, endpoints, timeout=5.0, **kwargs).open()
                      for rank in range(size))
        return opened[-size:]

    yield open_
    for transport in opened:
        transport.close()


def handshake(src: ZmqTransport, dst: ZmqTransport) -> None:
    """Let ``src`` offer ``dst`` shared memory and read the answer."""
    src.send(dst.rank, Message("hello", 0, buffers=(torch.zeros(BIG),)))
    dst.recv(src=src.rank, kind="hello")
    read_until(src, lambda: src.shares_memory_with(dst.rank),
               f"peer {dst.rank} to accept peer {src.rank}'s offer")


def in_shared_memory(msg: Message) -> list[bool]:
    return [isinstance(frame, np.ndarray) for _, _, frame in msg.wire]


def test_large_frames_go_through_shared_memory_exactly(transports):
    t0, t1 = transports(2)
    handshake(t0, t1)
    tensors = (torch.randn(BIG // 4 + 3), torch.arange(BIG // 8 + 1, dtype=torch.float64),
               torch.ones(5),  # small: stays in the socket message
               torch.rand(BIG + 17) > 0.5, torch.randint(-9, 9, (3, BIG // 24 + 1)))
    t0.send(1, Message("gossip", 1, meta={"k": 1}, buffers=tensors))
    msg = t1.recv(kind="gossip", round=1)
    assert in_shared_memory(msg) == [True, True, False, True, True]
    for got, sent in zip(msg.buffers, tensors, strict=True):
        assert got.dtype == sent.dtype and torch.equal(got, sent)
    assert t1.stats.messages_rejected == 0
    assert t0.stats.by_kind["gossip"]["bytes_sent"] == t1.stats.by_kind["gossip"]["bytes_recv"]


def test_a_frame_changed_in_place_and_sent_on_arrives_changed(transports):
    t0, t1, t2 = transports(3)
    handshake(t0, t1)
    handshake(t1, t2)
    x = torch.arange(BIG, dtype=torch.float32)
    t0.send(1, Message("gossip", 1, buffers=(x,)))
    got = t1.recv(kind="gossip")
    got.buffers[0].mul_(2)  # received frames are the receiver's own, writable memory
    t1.send(2, Message("gossip", 1, buffers=got.buffers, wire=got.wire))
    got.buffers[0].fill_(-1)  # a copy went: the sender may change it at once
    final = t2.recv(kind="gossip")
    assert in_shared_memory(final) == [True]
    assert torch.equal(final.buffers[0], 2 * x)


def test_a_receiver_keeping_frames_makes_the_rest_go_over_the_socket(transports, monkeypatch):
    monkeypatch.setattr(shm_segments, "SEGMENT_BYTES", 4 << 20)  # room for 7 frames of 512 KiB
    t0, t1 = transports(2)
    handshake(t0, t1)
    kept = []
    for i in range(12):
        t0.send(1, Message("gossip", i, buffers=(torch.full((128 * KiB,), float(i)),)))
        kept.append(t1.recv(kind="gossip", round=i))
    for i, got in enumerate(kept):
        assert torch.equal(got.buffers[0], torch.full((128 * KiB,), float(i)))
    del got
    held = [in_shared_memory(msg)[0] for msg in kept]
    assert 0 < sum(held) < len(held) and held == sorted(held, reverse=True)
    kept.clear()  # frees every record: all go through shared memory again
    for i in range(12, 24):
        t0.send(1, Message("gossip", i, buffers=(torch.full((128 * KiB,), float(i)),)))
        msg = t1.recv(kind="gossip", round=i)
        assert in_shared_memory(msg) == [True]
        assert torch.equal(msg.buffers[0], torch.full((128 * KiB,), float(i)))


def test_a_restarted_receiver_gets_a_fresh_segment(transports, monkeypatch):
    """Records the old process held are never freed; its successor (rejoining with
    ctl.join) must not inherit the clogged segment."""
    monkeypatch.setattr(shm_segments, "SEGMENT_BYTES", 4 << 20)
    t0, t1 = transports(2)
    handshake(t0, t1)
    held = []  # what the old process held when it died: never freed
    for i in range(8):
        t0.send(1, Message("gossip", i, buffers=(torch.full((128 * KiB,), float(i)),)))
        held.append(t1.recv(kind="gossip", round=i))
    endpoints = t1.endpoints
    t1.close()
    with ZmqTransport(1, endpoints, timeout=5.0).open() as successor:
        successor.send(0, Message("ctl.join", 0, meta={"round": 0}))

        def joined() -> bool:  # the join waits for rank 0's socket to say hello: both read
            with suppress(PeerTimeout):
                successor.recv(kind="gossip", round=-5, timeout=0.02)
            return "ctl.join" in t0.stats.by_kind

        read_until(t0, joined, "rank 0 to read the join")
        assert not t0.shares_memory_with(1)
        handshake(t0, successor)
        for i in range(8):
            t0.send(1, Message("gossip", i, buffers=(torch.full((128 * KiB,), float(i)),)))
            msg = successor.recv(kind="gossip", round=i)
            assert in_shared_memory(msg) == [True]
            assert torch.equal(msg.buffers[0], torch.full((128 * KiB,), float(i)))


def test_an_answer_to_no_offer_changes_nothing(transports, caplog):
    caplog.set_level(logging.INFO, logger="gossip.transport")
    t0, t1 = transports(2)
    t1.send(0, Message("shm.accept", -1, meta={"token": "00" * 16}))
    read_until(t0, lambda: "shm.accept" in t0.stats.by_kind, "rank 0 to read the answer")
    assert not t0.shares_memory_with(1) and "ignored shm.accept from peer 1" in caplog.text
    handshake(t0, t1)  # a real offer still goes through


def test_a_receiver_without_shared_memory_refuses_and_all_goes_over_the_socket():
    endpoints = [f"tcp://127.0.0.1:{port}" for port in free_ports(2)]
    with ZmqTransport(0, endpoints, timeout=5.0).open() as t0, \
            ZmqTransport(1, endpoints, timeout=5.0, shared_memory=False).open() as t1:
        for i in range(3):
            t0.send(1, Message("gossip", i, buffers=(torch.full((BIG,), float(i)),)))
            msg = t1.recv(kind="gossip", round=i)
            assert in_shared_memory(msg) == [False]
            assert torch.equal(msg.buffers[0], torch.full((BIG,), float(i)))
            if i == 0:  # the rest go after the refusal
                read_until(t0, lambda: "shm.refuse" in t0.stats.by_kind, "the refusal")
        assert not t0.shares_memory_with(1) and t0._shm._outboxes[1] is None
        assert t0.stats.by_kind["shm.offer"]["messages_sent"] == 1  # offered once, no more
        assert t0.stats.by_kind["shm.refuse"]["messages_recv"] == 1
        assert t0.stats.messages_rejected == t1.stats.messages_rejected == 0


def test_a_platform_without_memfd_sends_large_frames_over_the_socket(transports, monkeypatch):
    """macOS has no os.memfd_create: the first large frame to a local peer raised
    AttributeError (only OSError fell back to the socket); now nothing offers a segment."""
    monkeypatch.delattr(os, "memfd_create")
    t0, t1 = transports(2)
    t0.send(1, Message("gossip", 0, buffers=(torch.full((BIG,), 3.0),)))
    msg = t1.recv(kind="gossip", round=0)
    assert in_shared_memory(msg) == [False] and torch.equal(msg.buffers[0],
                                                            torch.full((BIG,), 3.0))
    assert not t0.shared_memory and "shm.offer" not in t0.stats.by_kind


def test_only_unkeyed_peers_on_loopback_over_ipc_are_offered_shared_memory():
    endpoints = ["tcp://127.0.0.1:1", "tcp://127.0.0.1:2"]
    assert ZmqTransport(0, endpoints).shared_memory
    assert not ZmqTransport(0, endpoints, local_ipc=False).shared_memory
    keys = CurveKeys(0, zmq.curve_keypair()[1].decode(),
                     tuple(zmq.curve_keypair()[0].decode() for _ in endpoints))
    assert not ZmqTransport(0, endpoints, keys=keys).shared_memory
    remote = ZmqTransport(0, ["tcp://10.0.0.1:1", "tcp://10.0.0.2:2"])  # maybe netns
    assert remote._shm.outbox(1, [torch.zeros(BIG, dtype=torch.uint8)]) is None
    assert remote._shm._outboxes == {1: None}  # nothing offered, nothing to wait for


def test_the_environment_turns_shared_memory_off(monkeypatch):
    monkeypatch.setenv("GOSSIP_SHARED_MEMORY", "0")
    assert not ZmqTransport(0, ["tcp://127.0.0.1:1", "tcp://127.0.0.1:2"]).shared_memory


def test_a_broken_envelope_is_rejected_and_the_peer_goes_on(reasons):
    endpoints = [f"tcp://127.0.0.1:{port}" for port in free_ports(2)]
    neighbour = Neighbour(endpoints[1])  # a raw outbox as rank 1: what it sends, rank 0 reads
    t0 = ZmqTransport(0, endpoints, timeout=5.0).open()
    box = shm_segments.Outbox(1 << 20)
    try:
        frames = envelope_frames(box, [torch.ones(BIG)])
        neighbour.send(0, [entry(frames[0], nbytes=1 << 30)] + frames[1:])
        neighbour.send(0, frames)  # never offered, but mappable: a restarted receiver
        neighbour.send(0, [shm_segments.MAGIC])
        msg = t0.recv(kind="gossip")
        assert torch.equal(msg.buffers[0], torch.ones(BIG))
        read_until(t0, lambda: t0.stats.messages_rejected >= 2, "the last envelope's rejection")
        assert t0.stats.messages_rejected == 2
        assert reasons.seen("outside the sender's segment") and reasons.seen("truncated")
    finally:
        t0.close()
        neighbour.close()
        box.close()
