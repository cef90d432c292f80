"""gossip.device without a GPU: the host pool's reuse, the pipelining order, the staging
of a tensor through reused host buffers and the piecewise exchange, with CPU tensors and a
recording copier standing in for a device; the CUDA tests run when CUDA is present."""

from __future__ import annotations

import threading

import pytest
import torch

from gossip.device import HostCopier, HostPool, HostStaging, pipelined
from gossip.device.copier import Done
from gossip.device.exchange import recv_device, send_device
from gossip.device.pipeline import pieces
from gossip.errors import ConfigError, ProtocolError
from gossip.transport import LoopbackHub, Message

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (no GPU here)")


class RecordingCopier(HostCopier):
    """A HostCopier that logs what it is asked to do, in order."""

    def __init__(self, log: list):
        self.log = log

    def after_device_work(self):
        self.log.append("after_device_work")

    def start(self, dst, src):
        self.log.append(("copy", src.numel()))
        return super().start(dst, src)

    def before_device_use(self, event):
        self.log.append("before_device_use")


def test_pool_hands_out_its_slots_round_robin_and_never_allocates_again():
    pool = HostPool(64, depth=3, pin=False)
    views = [pool.acquire(torch.float32, 16) for _ in range(7)]
    assert [index for index, _ in views] == [0, 1, 2, 0, 1, 2, 0]
    assert views[0][1].data_ptr() == views[3][1].data_ptr() == views[6][1].data_ptr()
    assert pool.allocations == 3 and not pool.pinned
    with pytest.raises(ValueError, match="does not fit"):
        pool.acquire(torch.float32, 17)
    with pytest.raises(ConfigError, match="depth"):
        HostPool(64, depth=1)


def test_a_busy_slot_waits_for_its_send_before_it_is_reused():
    pool, waited = HostPool(8, depth=2, pin=False), []
    index, _ = pool.acquire(torch.uint8, 8)
    pool.release_after(index, lambda: waited.append(index))
    pool.acquire(torch.uint8, 8)  # the other slot: nothing to wait for
    assert waited == []
    assert pool.acquire(torch.uint8, 8)[0] == index and waited == [index]
    pool.drain()
    assert waited == [index]  # released once only


@pytest.mark.parametrize("ahead", [1, 2])
def test_the_copy_of_the_next_piece_starts_before_this_piece_is_sent(ahead):
    log = []
    pipelined(pieces(10, 3), lambda i, lo, hi: log.append(("copy", i, lo, hi)) or i,
              lambda i, handle: log.append(("send", i, handle)), ahead=ahead)
    copies = [entry for entry in log if entry[0] == "copy"]
    assert [c[2:] for c in copies] == [(0, 3), (3, 6), (6, 9), (9, 10)]
    for i in range(4):
        sent = log.index(("send", i, i))
        assert log.index(("copy", i, *pieces(10, 3)[i])) < sent
        if i + ahead < 4:  # piece i + ahead is already being copied while i goes out
            assert log.index(("copy", i + ahead, *pieces(10, 3)[i + ahead])) < sent


def test_staging_reuses_one_host_buffer_and_orders_the_copies():
    log, rounds = [], []
    staging = HostStaging(pin=False, copier_for=lambda device: RecordingCopier(log))
    x = torch.arange(7, dtype=torch.float32)

    def double(host, out):
        rounds.append(host.data_ptr())
        log.append("run")
        return torch.mul(host, 2, out=out)

    for _ in range(3):
        out = torch.empty_like(x)
        assert staging.stage(x, double, out) is out
        torch.testing.assert_close(out, x * 2, rtol=0, atol=0)
    fresh = staging.stage(x, double)
    torch.testing.assert_close(fresh, x * 2, rtol=0, atol=0)
    assert staging.allocations == 1 and len(set(rounds)) == 1
    assert log[:5] == ["after_device_work", ("copy", 7), "run", ("copy", 7), "before_device_use"]
    assert staging.run(x, lambda host, out: host + 1).equal(x + 1)  # CPU: no staging
    assert staging.allocations == 1


def _exchange(numel: int, slot_bytes: int, sent: torch.Tensor | None = None,
              tamper=None) -> torch.Tensor:
    hub = LoopbackHub(2)
    ends = [hub.transport(rank) for rank in range(2)]
    for end in ends:
        end.accept_kinds(["dev"])
    x = torch.randn(numel, generator=torch.Generator().manual_seed(3)) if sent is None else sent
    out = torch.full_like(x, float("nan"))
    errors = []

    def sender():
        transport = ends[0]
        if tamper is not None:
            transport.send(1, tamper)
            return
        send_device(transport, 1, x, pool=HostPool(slot_bytes, depth=2, pin=False),
                    copier=HostCopier(), kind="dev", round=0)

    thread = threading.Thread(target=sender, daemon=True)
    thread.start()
    try:
        recv_device(ends[1], 0, out, pool=HostPool(slot_bytes, depth=2, pin=False),
                    copier=HostCopier(), kind="dev", round=0)
    except ProtocolError as exc:
        errors.append(exc)
    finally:
        thread.join(10)
        for end in ends:
            end.close()
    assert not thread.is_alive()
    if errors:
        raise errors[0]
    return x, out


def test_a_tensor_crosses_piece_by_piece_bit_for_bit():
    x, out = _exchange(1001, slot_bytes=4 * 97)  # 11 pieces, the last one short
    assert torch.equal(x, out)


def test_a_piece_that_does_not_fit_the_receivers_tensor_is_rejected():
    bad = Message(kind="dev", round=0, meta={"lo": 0, "hi": 5, "n": 9},
                  buffers=(torch.zeros(5),))
    with pytest.raises(ProtocolError, match="piece 0:5 of 9 where 0:4 of 10"):
        _exchange(10, slot_bytes=16, tamper=bad)


def test_the_device_path_of_topk_selects_what_the_host_path_selects():
    """The torch ops top-k runs on a GPU, checked here on CPU tensors against the numpy
    scan the host uses."""
    from gossip.compress.selection import _sampled_torch, topk_select

    x = torch.randn(300_001, generator=torch.Generator().manual_seed(5))
    idx, values = _sampled_torch(x, 3001, torch.Generator().manual_seed(1), 1 << 14)
    host_idx, host_values = topk_select(x, 3001, method="exact")
    assert torch.equal(idx, host_idx) and torch.equal(values, host_values)


def test_done_needs_no_waiting():
    Done().synchronize()
    assert Done().query()


@CUDA
def test_staging_a_cuda_tensor_round_trips_and_keeps_its_buffer():
    staging = HostStaging()
    x = torch.randn(1 << 20, device="cuda")
    for _ in range(2):
        out = staging.run(x, lambda host, out: torch.mul(host, 3, out=out))
        assert out.device == x.device
        torch.testing.assert_close(out, x * 3)
    assert staging.allocations == 1 and staging.pin


@CUDA
def test_a_cuda_tensor_crosses_piece_by_piece():
    from gossip.device import CudaCopier

    hub = LoopbackHub(1)
    transport = hub.transport(0)
    transport.accept_kinds(["dev"])
    try:
        x = torch.randn(3 << 20, device="cuda")
        out = torch.empty_like(x)
        # One peer sending to itself: every piece fits the loopback queue.
        send_device(transport, 0, x, pool=HostPool(1 << 20, pin=True),
                    copier=CudaCopier(x.device), kind="dev", round=0)
        recv_device(transport, 0, out, pool=HostPool(1 << 20, pin=True),
                    copier=CudaCopier(x.device), kind="dev", round=0)
        torch.cuda.synchronize()
        assert torch.equal(x, out)
    finally:
        transport.close()
