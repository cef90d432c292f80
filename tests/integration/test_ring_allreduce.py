"""Ring all-reduce between real peers over ZeroMQ on loopback, each peer a thread.

Oracle: every peer returns X.mean(0) of the round's inputs, bitwise the same on all peers.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
import zmq

from gossip.peer import Peer
from gossip.transport import Message, codec
from gossip.transport.endpoints import local_ipc
from support import Neighbour

SIZES = [1, 2, 3, 4, 5, 7, 8]


def lengths(size: int) -> list[int]:
    """Empty, shorter than P, and not divisible by P."""
    return sorted({0, 1, 2, max(size - 1, 1), size + 1, 3 * size + 2})


@pytest.mark.parametrize("size, n", [(size, n) for size in SIZES for n in lengths(size)])
def test_mean_over_rounds(size, n, local_topology, run_rounds, make_data, oracle):
    data = make_data(3, size, (n,), torch.float32, seed=100 * size + n)
    run = run_rounds(local_topology("ring", size), "ring-allreduce", data)
    oracle.assert_mean_everywhere(run.results, data)


@pytest.mark.parametrize("inplace", [False, True], ids=["out=None", "out=x"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("piece_bytes", [64, 256])
@pytest.mark.parametrize("size", [2, 3, pytest.param(7, marks=pytest.mark.slow)])
def test_several_pieces_per_segment(size, piece_bytes, dtype, inplace, local_topology,
                                    run_rounds, make_data, oracle):
    n = 97 * size + size - 1  # ~97 elements per segment: 2 to 13 pieces each
    data = make_data(2, size, (n,), dtype, seed=size)
    run = run_rounds(local_topology("ring", size), "ring-allreduce", data,
                     inplace=inplace, piece_bytes=piece_bytes)
    oracle.assert_mean_everywhere(run.results, data)
    # Segments differ by at most one element; each is cut into pieces of <= piece_bytes.
    per_piece = piece_bytes // data.element_size()
    seg_lengths = [n // size + (i < n % size) for i in range(size)]
    pieces = sum(-(-length // per_piece) for length in seg_lengths)
    assert pieces >= 2 * size, "want several pieces per segment"
    # Per round, 2(P-1) hops for every piece; then a goodbye to each distinct neighbour.
    goodbyes = size * len({1, size - 1})
    assert sum(s["messages_sent"] for s in run.stats) == 2 * 2 * (size - 1) * pieces + goodbyes


@pytest.mark.parametrize("inplace", [False, True], ids=["out=None", "out=x"])
@pytest.mark.parametrize("shape", [(), (3, 5), (2, 0, 3)], ids=str)
def test_keeps_shape(shape, inplace, local_topology, run_rounds, make_data, oracle):
    data = make_data(2, 3, shape, torch.float64, seed=7)
    run = run_rounds(local_topology("ring", 3), "ring-allreduce", data, inplace=inplace)
    assert run.results.shape == data.shape
    oracle.assert_mean_everywhere(run.results, data)


@pytest.mark.parametrize("inplace", [False, True], ids=["out=None", "out=x"])
def test_large_segments_sent_zero_copy(inplace, local_topology, run_rounds, make_data, oracle):
    """Segments above codec.ZERO_COPY_MIN_BYTES go out without a copy, in place too."""
    size = 3
    n = size * (codec.ZERO_COPY_MIN_BYTES // 4 + 1000) + 1
    data = make_data(2, size, (n,), torch.float32, seed=3)
    run = run_rounds(local_topology("ring", size), "ring-allreduce", data, inplace=inplace)
    oracle.assert_mean_everywhere(run.results, data)


def test_single_peer_returns_a_copy(local_topology):
    with Peer(0, local_topology("ring", 1), "ring-allreduce", timeout=5) as peer:
        x = torch.arange(5.0)
        y = peer.synchronize(x, 0)
        assert torch.equal(y, x) and y.data_ptr() != x.data_ptr()
        z = peer.synchronize(x, 1, out=x)
        assert z.data_ptr() == x.data_ptr() and torch.equal(x, torch.arange(5.0))
    assert peer.stats["messages_sent"] == 0


def test_result_may_be_overwritten_once_synchronize_returns(local_topology, run_peers,
                                                             monkeypatch):
    """Rank 0 is a real Peer; rank 1 is played by bare zmq sockets that follow the ring
    protocol but read slowly (RCVHWM=1), as a busy peer may. Rank 0 overwrites its in-place
    result as soon as synchronize returns, which the Strategy contract allows (x may be
    modified again at once, and out=x is x). Rank 1 must still receive the true mean.
    Regression: all-gather pieces of `out` were sent zero-copy and not awaited.
    Over the socket: frames through shared memory are copies, which cannot go wrong so.
    """
    monkeypatch.setenv("GOSSIP_SHARED_MEMORY", "0")
    topology = local_topology("ring", 2)
    # 16 pieces of 1 MiB per segment, each above the zero-copy bound: far more than the
    # kernel socket buffers (4 MiB each way at most) hold.
    piece_bytes = 1 << 20
    n = 2 * 16 * piece_bytes // 4
    half = n // 2
    x0, x1 = torch.arange(n, dtype=torch.float32), 3 * torch.arange(n, dtype=torch.float32)
    mean = 2 * torch.arange(n, dtype=torch.float32)  # exact in float32
    overwritten = threading.Event()

    def real_rank0() -> None:
        with Peer(0, topology, "ring-allreduce", timeout=10, piece_bytes=piece_bytes) as peer:
            x = x0.clone()
            peer.synchronize(x, 0, out=x)
            x.fill_(float("nan"))
            overwritten.set()

    def emulated_rank1() -> list[torch.Tensor]:
        ctx = zmq.Context()
        try:
            outbox = Neighbour(topology.address(1), ctx)  # what rank 1 sends goes out here
            pull = ctx.socket(zmq.DEALER)  # rank 1's receiving socket for rank 0
            pull.setsockopt(zmq.LINGER, 0)
            pull.setsockopt(zmq.RCVHWM, 1)
            pull.setsockopt(zmq.ROUTING_ID, b"1-emulated")
            pull.connect(local_ipc(topology.address(0)))
            pull.send(codec.encode(Message("hello", -1, meta={
                "endpoint": topology.address(1)}), src=1)[0])

            def send(kind: str, step: int, j: int, tensor: torch.Tensor) -> None:
                msg = Message(kind, 0, meta={"n": n, "s": step, "j": j}, buffers=(tensor,))
                header, frames = codec.encode(msg, src=1)
                outbox.send(0, [header] + [f.numpy() for f in frames])

            def recv(kind: str) -> Message:
                assert pull.poll(10_000), f"no {kind} from rank 0"
                msg = codec.decode([bytearray(f) for f in pull.recv_multipart()])
                assert msg.kind == kind
                return msg

            per_piece = piece_bytes // 4
            pieces = [(lo, lo + per_piece) for lo in range(0, half, per_piece)]
            for j, (lo, hi) in enumerate(pieces):  # reduce-scatter: our segment 1
                send("ring.rs", 0, j, x1[half + lo:half + hi])
            for j, (lo, hi) in enumerate(pieces):  # rank 0's segment 0 -> we own its mean
                part = recv("ring.rs").buffers[0]
                send("ring.ag", 0, j, ((part + x1[lo:hi]) / 2))
            # Let rank 0 return and overwrite its result before we read on; a correct rank 0
            # waits for its last pieces to be read instead (it may not return before that).
            overwritten.wait(0.5)
            received = [recv("ring.ag").buffers[0].clone() for _ in pieces]
            header, _ = codec.encode(Message("bye", -1), src=1)
            outbox.send(0, [header])
            return received
        finally:
            ctx.destroy(linger=1000)
            Path(local_ipc(topology.address(1)).removeprefix("ipc://")).unlink(missing_ok=True)

    results = run_peers(2, lambda rank: emulated_rank1() if rank else real_rank0())
    segment1 = torch.cat(results[1])
    assert torch.equal(segment1, mean[half:]), (
        f"{segment1.isnan().sum().item()} of {half} values rank 1 received were overwritten")
