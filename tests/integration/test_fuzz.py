"""Hostile and broken input against a live peer that keeps training.

Two peers run D-PSGD rounds in threads over real ZeroMQ while a neighbour (a raw outbox at a
third endpoint both connect to, support/hostile.py) sends rank 0
at least 10,000 malformed messages (500 in the fast lane): hypothesis-generated headers
and frames, then seeded mutations of a valid message (truncated, bit flips, wrong version,
unknown kind, huge shapes, dtypes not allowed, frame/shape mismatch, extra or missing frames,
NaN/Inf payloads), and a few frames over the socket's size limit. Each must be rejected
with a logged reason (they come in order, so a mutation's reason is checked against what it
broke), the peer must neither crash nor hang, and every round must still equal the oracle.

What counts as malformed is decided by ``codec.decode`` with the live peer's settings: a
mutation that happens to be well-formed (a bit flip that only changes the round) is not sent, as without
keys anyone may send well-formed messages (test_security.py covers that).
"""

from __future__ import annotations

import math
import random
import threading

import msgpack
import pytest
import torch
import zmq
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from gossip.errors import PeerTimeout, ProtocolError
from gossip.peer import Peer
from gossip.transport import ZmqTransport, codec
from gossip.ports import free_ports
from support import (Neighbour, Reasons, peer_once_all_bound, read_until, wait_connected,
                     wait_until)


N = 16  # elements per gossip message
MAX_MESSAGE_BYTES = 1 << 20
HYPOTHESIS_BATCH = 40


def value(round: int, rank: int) -> torch.Tensor:
    """What ``rank`` gossips in round ``round``: exact in float32, distinct per round and rank."""
    return torch.arange(N, dtype=torch.float32) * (rank + 1) + round


class LiveCluster:
    """Ranks 0 and 1 gossiping round after round in threads until told how many to run."""

    def __init__(self, topology, **transport_options):
        self.topology = topology
        self.limit = math.inf  # rounds to run; set by finish()
        self.done = [0, 0]  # rounds completed per rank
        self.errors: list[BaseException] = []
        self.stats: list[dict] = [{}, {}]
        self.transports = [None, None]
        self._options = transport_options
        self._bound = threading.Barrier(3, timeout=10)
        self.neighbour = Neighbour(f"tcp://127.0.0.1:{free_ports(1)[0]}")
        self._threads = [threading.Thread(target=self._main, args=(rank,), daemon=True,
                                          name=f"peer-{rank}") for rank in (0, 1)]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()
        self._bound.wait()

    def _main(self, rank: int) -> None:
        try:
            endpoints = [self.topology.address(r) for r in range(2)] + [self.neighbour.endpoint]
            transport = ZmqTransport(rank, endpoints, timeout=20.0, **self._options).open()
            self.transports[rank] = transport
            with Peer(rank, self.topology, "dpsgd", timeout=20.0, transport=transport) as peer:
                self._bound.wait()
                weights = self.topology.mixing_matrix()
                round = 0
                while round < self.limit:
                    got = peer.synchronize(value(round, rank), round)
                    want = weights[rank, 0] * value(round, 0) + weights[rank, 1] * value(round, 1)
                    torch.testing.assert_close(got, want, rtol=0, atol=0)
                    round += 1
                    self.done[rank] = round
            self.stats[rank] = peer.stats
        except BaseException as exc:  # noqa: BLE001 - reported by check()
            self.errors.append(exc)

    def check(self) -> None:
        """Fail at once if a peer raised (an assertion of a wrong result included)."""
        if self.errors:
            raise self.errors[0]
        for thread in self._threads:
            assert thread.is_alive() or self.limit < math.inf, f"{thread.name} stopped"

    def finish(self, extra_rounds: int = 3, timeout: float = 30.0) -> None:
        """Let both run a few more rounds (they are at most one apart), then stop."""
        self.check()
        self.limit = max(self.done) + extra_rounds
        for thread in self._threads:
            thread.join(timeout)
            assert not thread.is_alive(), f"{thread.name} hung"
        self.check()


@pytest.fixture
def cluster(local_topology):
    live = LiveCluster(local_topology("ring", 2), max_message_bytes=MAX_MESSAGE_BYTES)
    live.start()
    yield live
    if live.limit == math.inf:  # the test failed midway: stop the peers
        live.limit = 0
    live.neighbour.close()


class Fuzzer:
    """Sends raw frames to rank 0 and checks each is rejected, in order, with a reason."""

    def __init__(self, cluster: LiveCluster, reasons: Reasons):
        self.cluster, self.reasons = cluster, reasons
        self.target = cluster.transports[0]
        self.sent = 0
        self.skipped = 0  # well-formed by chance, so not hostile
        self.expected: list[tuple[int, str]] = []  # (index, text its reason must contain)

    def malformed(self, frames: list[bytes]) -> bool:
        """Whether the live peer must reject ``frames``: the codec with its settings says so."""
        try:
            # Writable copies, as a socket delivers them (and torch wants them).
            codec.decode([bytearray(f) for f in frames], kinds=self.target.kinds | {"bye"},
                         peers=3, finite=True,
                         max_message_bytes=MAX_MESSAGE_BYTES)
        except Exception:  # noqa: BLE001 - any failure is a rejection
            return True
        return False

    def send(self, frames: list[bytes], reason: str | None = None) -> bool:
        if not self.malformed(frames):
            self.skipped += 1
            return False
        if reason is not None:
            self.expected.append((self.sent, reason))
        self.cluster.neighbour.send(0, frames)
        self.sent += 1
        return True

    def settle(self, timeout: float = 20.0) -> None:
        """Wait until rank 0 has rejected everything sent; fail if it crashed or hangs."""
        def all_rejected() -> bool:
            self.cluster.check()
            return len(self.reasons.reasons) >= self.sent

        wait_until(all_rejected, timeout, f"rank 0 to reject all {self.sent} messages sent",
                   max_interval=0.005)
        assert len(self.reasons.reasons) == self.sent, self.reasons.reasons[self.sent:]
        for index, text in self.expected:
            assert text in self.reasons.reasons[index], (index, text,
                                                         self.reasons.reasons[index])
        self.expected.clear()

    def close(self) -> None:
        self.cluster.neighbour.close()


# -- hypothesis: arbitrary headers and frames ---------------------------------------------------

scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1), st.floats(),
                    st.text(max_size=8), st.binary(max_size=8))
msgpack_values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=4), inner, max_size=3)),
    max_leaves=6)
dtypes = st.one_of(st.sampled_from([*codec.DTYPES, "complex64", "float128", "object", ""]),
                   msgpack_values)
shapes = st.one_of(st.lists(st.integers(0, 2**45), max_size=9),
                   st.lists(st.integers(-3, 4), max_size=3), msgpack_values)
specs = st.one_of(st.fixed_dictionaries({"dtype": dtypes, "shape": shapes}), msgpack_values)
BROKEN = {  # field -> what a broken or hostile sender may put there
    "v": msgpack_values,
    "kind": st.one_of(st.sampled_from(["Gossip", "x" * 70, "ring.rs", ""]), msgpack_values),
    "round": msgpack_values,
    "src": st.one_of(st.integers(-2**63, 2**64 - 1), msgpack_values),
    "meta": msgpack_values,
    "tensors": st.one_of(st.lists(specs, max_size=3), msgpack_values),
}


# A valid header, as a strategy built once (building strategies per draw is slow).
valid_headers = st.fixed_dictionaries({
    "v": st.just(codec.VERSION),
    "kind": st.sampled_from(["gossip", "bye"]),
    "round": st.integers(-5, 50),
    "src": st.integers(0, 1),
    "meta": st.dictionaries(st.text(max_size=4), scalars, max_size=3),
    "tensors": st.lists(st.fixed_dictionaries({"dtype": st.sampled_from(list(codec.DTYPES)),
                                               "shape": st.lists(st.integers(0, 6), max_size=3)}),
                        max_size=2),
})
broken_fields = st.sets(st.sampled_from(sorted(BROKEN)), max_size=2)
small_frames = st.lists(st.binary(max_size=64), max_size=3)
NAN = {dtype: torch.tensor([math.nan], dtype=dtype).view(torch.uint8).numpy().tobytes()
       for dtype in codec.DTYPES.values() if dtype.is_floating_point}


@st.composite
def headers(draw) -> dict:
    """A valid header with up to two fields broken or missing."""
    header = draw(valid_headers)
    for key in draw(broken_fields):
        if draw(st.booleans()):
            del header[key]
        else:
            header[key] = draw(BROKEN[key])
    return header


header_like = headers()


@st.composite
def hostile_messages(draw) -> list[bytes]:
    """A header (near-valid, any msgpack value, or raw bytes) and frames: random bytes, or for
    a usable header sized to its tensor specs, maybe with a NaN planted."""
    kind = draw(st.sampled_from(["header", "header", "value", "bytes"]))
    if kind == "bytes":
        return [draw(st.binary(max_size=64)), *draw(small_frames)]
    header = draw(header_like if kind == "header" else msgpack_values)
    sizes = frame_sizes(header)
    if sizes is None or not draw(st.integers(0, 3)):
        return [msgpack.packb(header, use_bin_type=True), *draw(small_frames)]
    frames = []
    for (dtype, size) in sizes:
        frame = bytearray(draw(st.binary(min_size=size, max_size=size)))
        if size and dtype in NAN and draw(st.booleans()):
            at = draw(st.integers(0, size // dtype.itemsize - 1)) * dtype.itemsize
            frame[at:at + dtype.itemsize] = NAN[dtype]
        frames.append(bytes(frame))
    return [msgpack.packb(header, use_bin_type=True), *frames]


def frame_sizes(header) -> list[tuple[torch.dtype, int]] | None:
    """The dtype and frame length of each tensor ``header`` specifies, if small and usable."""
    specs = header.get("tensors") if isinstance(header, dict) else None
    if not isinstance(specs, list):
        return None
    sizes = []
    for spec in specs:
        if not isinstance(spec, dict):
            return None
        dtype, shape = codec.DTYPES.get(str(spec.get("dtype"))), spec.get("shape")
        if (dtype is None or not isinstance(shape, list)
                or not all(isinstance(d, int) and 0 <= d <= 64 for d in shape)):
            return None
        size = math.prod(shape) * dtype.itemsize
        if size > 256:
            return None
        sizes.append((dtype, size))
    return sizes


@pytest.mark.parametrize("examples, total", [
    (3, 500), pytest.param(50, 10_000, marks=pytest.mark.slow)], ids=["500", "10000"])
def test_live_peer_rejects_hostile_messages_and_keeps_training(cluster, reasons, examples,
                                                               total):
    fuzz = Fuzzer(cluster, reasons)
    rounds_before = max(cluster.done)
    try:
        @settings(max_examples=examples, deadline=None, database=None,
                  derandomize=True, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck))
        @given(st.lists(hostile_messages(), min_size=HYPOTHESIS_BATCH,
                        max_size=HYPOTHESIS_BATCH))
        def arbitrary(batch):
            for frames in batch:
                fuzz.send(frames)
            fuzz.settle()

        arbitrary()
        from_hypothesis = fuzz.sent  # some of the generated messages are well-formed
        assert from_hypothesis >= 0.6 * examples * HYPOTHESIS_BATCH, fuzz.skipped
        mutate(fuzz, random.Random(0), total - fuzz.sent)
        oversize(cluster, reasons, fuzz)
        assert fuzz.sent >= total, (from_hypothesis, fuzz.sent, fuzz.skipped)
        assert min(cluster.done) > rounds_before, "no training round while under fire"
        cluster.finish()
    finally:
        fuzz.close()
    stats = cluster.stats[0]
    assert stats["messages_rejected"] == len(reasons.reasons) == fuzz.sent
    assert cluster.done[0] == cluster.done[1] >= 3
    assert stats["by_kind"]["gossip"]["messages_recv"] == cluster.done[0]


# -- seeded mutations of a valid message --------------------------------------------------------


def valid(rng: random.Random, dtype: str = "float32") -> tuple[dict, list[bytes]]:
    tensor = torch.randn(N, generator=torch.Generator().manual_seed(rng.randrange(2**31)))
    tensor = tensor.to(codec.DTYPES[dtype])
    header = {"v": codec.VERSION, "kind": "gossip", "round": rng.randrange(1000), "src": 1,
              "meta": {"n": N}, "tensors": [{"dtype": dtype, "shape": [N]}]}
    return header, [tensor.view(torch.uint8).numpy().tobytes()]


def pack(header, payload: list[bytes]) -> list[bytes]:
    return [msgpack.packb(header, use_bin_type=True), *payload]


def nonfinite(rng, header, payload):
    dtype = rng.choice(["float32", "float64", "float16", "bfloat16"])
    header, payload = valid(rng, dtype)
    tensor = torch.frombuffer(bytearray(payload[0]), dtype=codec.DTYPES[dtype])
    tensor[rng.randrange(N)] = rng.choice([math.nan, math.inf, -math.inf])
    return pack(header, [tensor.view(torch.uint8).numpy().tobytes()]), "holds NaN or Inf"


def flip_bits(rng, header, payload):
    frames = pack(header, payload)
    head = bytearray(frames[0])
    for _ in range(rng.randint(1, 4)):
        head[rng.randrange(len(head))] ^= 1 << rng.randrange(8)
    return [bytes(head), *payload], None


# Each mutation: (rng, valid header, valid payload) -> (frames, text the reason must contain).
MUTATIONS = {
    "truncated header": lambda rng, h, p: (
        [pack(h, p)[0][:rng.randrange(1, len(pack(h, p)[0]))], *p], None),
    "bit flips": flip_bits,
    "wrong version": lambda rng, h, p: (
        pack({**h, "v": rng.choice([0, 2, 99, "1", None])}, p), "unsupported protocol version"),
    "unknown kind": lambda rng, h, p: (
        pack({**h, "kind": rng.choice(["ring.rs", "probe.x", "evil"])}, p),
        "unexpected message kind"),
    "bad kind": lambda rng, h, p: (
        pack({**h, "kind": rng.choice(["Gossip", "", "x" * 65, "a b", 7])}, p),
        "invalid message kind"),
    "huge shape": lambda rng, h, p: (
        pack({**h, "tensors": [{"dtype": "float32", "shape": rng.choice(
            [[2**39], [10**6, 10**6], [2**20] * 3])}]}, p), "bytes, frame has 64"),
    "dtype not allowed": lambda rng, h, p: (
        pack({**h, "tensors": [{"dtype": rng.choice(["complex64", "float128", "object", "<f4"]),
                                "shape": [N]}]}, p), "not allowed"),
    "frame/shape mismatch": lambda rng, h, p: (
        pack(h, [p[0][:-rng.randint(1, 8)] if rng.random() < 0.5
                 else p[0] + b"\0" * rng.randint(1, 8)]), "needs 64 bytes, frame has"),
    "extra frames": lambda rng, h, p: (
        pack(h, p + [b"\0" * 4] * rng.randint(1, 3)), "1 tensors but"),
    "missing frame": lambda rng, h, p: (pack(h, []), "1 tensors but 0 frames came"),
    "negative dim": lambda rng, h, p: (
        pack({**h, "tensors": [{"dtype": "float32", "shape": [-N]}]}, p), "bad shape"),
    "src not a peer": lambda rng, h, p: (
        pack({**h, "src": rng.choice([2, 7, 2**40])}, p), "is not a peer"),
    "bad round": lambda rng, h, p: (
        pack({**h, "round": rng.choice([1.5, "3", None, [1]])}, p), "bad round/src"),
    "meta not a map": lambda rng, h, p: (pack({**h, "meta": [1, 2]}, p), "meta is not a map"),
    "too many tensors": lambda rng, h, p: (
        pack({**h, "tensors": [{"dtype": "uint8", "shape": [1]}] * 65}, [b"\0"] * 65),
        "at most 64 entries"),
    "header too large": lambda rng, h, p: (
        pack({**h, "meta": {"pad": "x" * (codec.MAX_HEADER_BYTES + 1)}}, p), "header of"),
    "header not a map": lambda rng, h, p: (
        [msgpack.packb(rng.choice([[1, 2], 5, "gossip", None])), *p], "header is not a map"),
    "not msgpack": lambda rng, h, p: ([b"\xc1" + rng.randbytes(rng.randint(0, 30)), *p],
                                      "not valid msgpack"),
    "empty header frame": lambda rng, h, p: ([b"", *p], "not valid msgpack"),
    "random frames": lambda rng, h, p: (
        [rng.randbytes(rng.randint(0, 80)) for _ in range(rng.randint(1, 4))], None),
    "NaN/Inf payload": nonfinite,
}


def mutate(fuzz: Fuzzer, rng: random.Random, count: int, batch: int = 500) -> None:
    """``count`` mutations of valid messages, each kind in turn; checks each reason."""
    names = list(MUTATIONS)
    sent = 0
    while sent < count:
        for _ in range(batch):
            header, payload = valid(rng)
            frames, reason = MUTATIONS[names[sent % len(names)]](rng, header, payload)
            if fuzz.send(frames, reason):
                sent += 1
        fuzz.settle()


def oversize(cluster: LiveCluster, reasons: Reasons, fuzz: Fuzzer, count: int = 3) -> None:
    """Frames over the socket's limit: libzmq drops each with its connection (the peer
    connects a fresh socket, which the neighbour waits for before the next)."""
    for i in range(count):
        header, _ = valid(random.Random(i))
        cluster.neighbour.send(0, pack(header, [b"\0" * (MAX_MESSAGE_BYTES + 1)]))
        fuzz.sent += 1
        fuzz.expected.append((fuzz.sent - 1, "ZMQ_MAXMSGSIZE"))
        fuzz.settle()


# -- NaN/Inf policy --------------------------------------------------------------------------


def test_nan_from_a_neighbour_never_reaches_the_model(local_topology, run_peers):
    """A stranger races NaN/Inf for every round, claiming to be the neighbour: rejected, and
    the model (the dpsgd result) stays exact."""
    topology = local_topology("ring", 2)
    rounds, weights = 20, topology.mixing_matrix()
    ready = threading.Barrier(2, timeout=10)
    results = torch.empty(rounds, 2, N)
    rejected = [0, 0]
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)  # what a stranger can reach: rank 0's outbox
    sock.linger = 0
    sock.connect(topology.address(0))
    for round in range(rounds):  # queued before rank 0 exists, so they come first
        header, _ = valid(random.Random(round))
        poison = torch.full((N,), math.nan if round % 2 else math.inf)
        sock.send_multipart(pack({**header, "round": round},
                                 [poison.view(torch.uint8).numpy().tobytes()]))

    def peer_main(rank: int) -> None:
        with peer_once_all_bound(rank, topology, "dpsgd", ready, timeout=10.0) as peer:
            if rank == 0:  # the stranger reconnects: its poison streams in ahead of round 0's
                wait_connected(sock, 10.0, "the stranger to reach rank 0")
            for round in range(rounds):
                results[round, rank] = peer.synchronize(value(round, rank), round)
            if rank == 0:  # read whatever poison is left, for an exact count
                read_until(peer.transport, lambda: peer.transport.stats.messages_rejected
                           >= rounds, "rank 0 to reject all the stranger's poison")
            rejected[rank] = peer.stats["messages_rejected"]

    try:
        run_peers(2, peer_main, timeout=30.0)
    finally:
        ctx.destroy(linger=0)
    assert torch.isfinite(results).all()
    for round in range(rounds):
        want = weights[0, 0] * value(round, 0) + weights[0, 1] * value(round, 1)
        assert torch.equal(results[round, 0], want.float())
    assert rejected == [rounds, 0]


def test_a_neighbour_gone_nan_is_named_instead_of_mixed_in(local_topology, run_peers):
    """An honest neighbour whose model diverged: its NaN is rejected, not averaged in, and
    the wait for it ends in a PeerTimeout that says why. (Rank 1 stays until then: had it
    left, its goodbye would end the wait at once, a PeerGone saying the same.)"""
    topology = local_topology("ring", 2)
    errors: list[str] = ["", ""]
    out = [None, None]
    gave_up = threading.Event()

    def peer_main(rank: int) -> None:
        with Peer(rank, topology, "dpsgd", timeout=1.0) as peer:
            x = torch.full((N,), math.nan) if rank == 1 else torch.ones(N)
            try:
                out[rank] = peer.synchronize(x, 0)
            except PeerTimeout as exc:
                errors[rank] = str(exc)
                gave_up.set()
            if rank == 1:
                gave_up.wait(30)

    run_peers(2, peer_main, timeout=30.0)
    assert out[0] is None
    assert "1 message(s) rejected meanwhile, the last: gossip round 0 from peer 1: tensor 0 " \
           "(float32) holds NaN or Inf" in errors[0]
    assert torch.isnan(out[1]).all()  # its own NaN is its own business


@pytest.mark.parametrize("poison", [math.nan, math.inf])
def test_ring_allreduce_refuses_a_nan_mean_on_every_peer(local_topology, run_peers, poison):
    """Ring all-reduce checks its result once instead of every frame: one peer's NaN/Inf
    reaches every peer's mean, and every peer raises instead of returning it."""
    topology = local_topology("ring", 3)
    errors: list[str] = ["", "", ""]

    def peer_main(rank: int) -> None:
        with Peer(rank, topology, "ring-allreduce", timeout=10.0) as peer:
            x = torch.ones(N + 1)
            if rank == 1:
                x[N // 2] = poison
            try:
                peer.synchronize(x, 4)
            except ProtocolError as exc:
                errors[rank] = str(exc)

    run_peers(3, peer_main, timeout=30.0)
    for rank in range(3):
        assert f"rank {rank}: the all-reduced mean of round 4 holds NaN or Inf" in errors[rank]
