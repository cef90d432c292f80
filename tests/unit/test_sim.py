"""The simulator's parts in virtual time: timeouts and dead peers without real waiting,
the network model's arithmetic, determinism, and one-line errors for bad parameters."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from gossip.config import TrainConfig
from gossip.errors import ConfigError, PeerGone, PeerTimeout
from gossip.faults import DelayModel
from gossip.sim import GOODPUT, NetworkModel, Simulation, SimWorld, parse_compute, simulate_run
from gossip.topology import Topology
from gossip.transport import Message


def run_peers(world: SimWorld, *mains) -> list:
    """Run ``mains[rank]()`` as the world's peers; the results (or exceptions) by rank."""
    tasks = [world.spawn(rank, main) for rank, main in enumerate(mains)]
    world.scheduler.run()
    return [task.error if task.error is not None else task.result for task in tasks]


def test_a_receive_times_out_in_virtual_time_without_waiting():
    world = SimWorld(2)
    sim = world.transport(0, timeout=3600.0, kinds=["x"])
    world.transport(1, kinds=["x"])

    def waits():
        sim.recv(src=1, kind="x", round=0)

    started = time.perf_counter()
    [error, _] = run_peers(world, waits, lambda: None)
    assert isinstance(error, PeerTimeout) and "within 3600 s" in str(error)
    assert world.scheduler.now == 3600.0
    assert time.perf_counter() - started < 60  # an hour of virtual time, no real wait


def test_messages_arrive_after_transfer_and_latency_as_private_copies():
    world = SimWorld(2, network=NetworkModel(rate="8mbit", latency=0.5))
    a, b = (world.transport(r, kinds=["x"]) for r in range(2))
    import torch

    sent = torch.arange(250_000, dtype=torch.float32)  # 1 MB

    def sender():
        a.send(1, Message(kind="x", round=0, buffers=(sent,)))
        sent.zero_()  # the message was copied at the send

    def receiver():
        msg = b.recv(src=0, kind="x", round=0)
        msg.buffers[0].add_(1)  # the receiver's own writable memory
        return world.scheduler.now, msg.buffers[0]

    _, (arrived, got) = run_peers(world, sender, receiver)
    nbytes = b.stats.bytes_recv
    assert arrived == pytest.approx(nbytes / (1e6 * GOODPUT) + 0.5)
    assert torch.equal(got, torch.arange(250_000, dtype=torch.float32) + 1)


def test_a_killed_peer_is_declared_dead_after_dead_after_virtual_seconds():
    world = SimWorld(2)
    a = world.transport(0, kinds=["x"], dead_after=2.5, timeout=60.0)
    world.transport(1, kinds=["x"])
    a.connect([1])

    def waits():
        try:
            a.recv(src=1, kind="x", round=0)
        except PeerGone as exc:
            return world.scheduler.now, str(exc)

    def silent():
        world.scheduler.sleep(100.0)  # killed long before

    world.kill_at(1, 4.0)
    [(noticed, why), killed] = run_peers(world, waits, silent)
    assert noticed == 4.0 + 2.5 and "peer 1 is dead" in why
    assert killed is None and a.membership.lost[1].firsthand


def test_fifo_links_queue_fair_links_share():
    def arrivals(sharing: str) -> list[float]:
        world = SimWorld(3, network=NetworkModel(rate=8_000_000, sharing=sharing, goodput=1.0))
        times = []
        for dst in (1, 2):  # two 1 MB flows leaving peer 0's uplink at once
            world.links.send(0, dst, 1_000_000, lambda: times.append(world.scheduler.now))
        world.scheduler.run()
        return times

    assert arrivals("fifo") == pytest.approx([1.0, 2.0])  # one after the other
    assert arrivals("fair") == pytest.approx([2.0, 2.0])  # half the uplink each


@pytest.mark.parametrize("sharing", ["fifo", "fair"])
def test_a_pairs_messages_arrive_in_order_on_its_one_connection(sharing):
    world = SimWorld(3, network=NetworkModel(rate=8_000_000, sharing=sharing, goodput=1.0))
    times = {}
    for name, dst, nbytes in (("big", 1, 1_000_000), ("small", 1, 1_000), ("other", 2, 1_000_000)):
        world.links.send(0, dst, nbytes, lambda n=name: times.setdefault(n, world.scheduler.now))
    world.scheduler.run()
    assert list(times).index("big") < list(times).index("small")
    assert times["big"] <= times["small"]
    if sharing == "fair":
        # Peer 0's uplink is shared by its two connections, not by its three messages:
        # the small one starts once the big one has gone, then has the uplink to itself.
        assert times == pytest.approx({"big": 2.0, "other": 2.0, "small": 2.001})


@pytest.mark.slow
def test_a_pieced_ring_all_reduce_runs_on_fair_links():
    # Several pieces per message pair: they must arrive in the order they were sent.
    config = TrainConfig.from_dict({"strategy": "ring-allreduce", "rounds": 1, "batch_size": 8,
                                    "eval_every": 1, "seed": 2, "options": {"piece_bytes": 4000}})
    simulation = Simulation(network=NetworkModel(rate="100mbit", sharing="fair"))
    run = simulate_run(config, Topology.generate("ring", 3), "unused", simulation, write=False)
    assert run.failed == {}
    assert all(len(run.records[rank]) == 1 for rank in range(3))


def test_a_fifo_uplink_is_not_held_up_by_a_busy_downlink():
    world = SimWorld(3, network=NetworkModel(rate=8_000_000, goodput=1.0))
    times = {}
    world.links.send(0, 2, 1_000_000, lambda: times.setdefault("0->2", world.scheduler.now))
    world.links.send(1, 2, 1_000_000, lambda: times.setdefault("1->2", world.scheduler.now))
    world.links.send(1, 0, 1_000_000, lambda: times.setdefault("1->0", world.scheduler.now))
    world.scheduler.run()
    # Peer 2's downlink takes one message at a time; peer 1's uplink sends its second
    # message while its first still queues there.
    assert times == pytest.approx({"0->2": 1.0, "1->2": 2.0, "1->0": 2.0})


def test_a_kill_after_the_peer_ended_is_no_death():
    """--kill 1:0.3 in a run that ends sooner: peer 1 finished, and is not reported as
    killed (it was, and left out of the summary's table)."""
    config = TrainConfig.from_dict({"strategy": "ring-allreduce", "rounds": 2,
                                    "batch_size": 8, "seed": 3})
    run = simulate_run(config, Topology.generate("ring", 3), "unused",
                       Simulation(kills={1: 1000.0}), write=False)
    assert run.virtual_s < 1000.0 and run.killed == [] and run.failed == {}
    assert len(run.records[1]) == 2


@pytest.mark.slow
def test_same_seed_same_run():
    config = TrainConfig.from_dict({"strategy": "dpsgd", "rounds": 2, "batch_size": 8,
                                    "eval_every": 1, "seed": 3,
                                    "delays": {"compute": 0.01, "straggler_prob": 0.5,
                                               "straggler_mean": 0.02}})
    simulation = Simulation(network=NetworkModel(rate="10mbit", latency=0.001))
    runs = [simulate_run(config, Topology.generate("ring", 3), "unused", simulation,
                         write=False) for _ in range(2)]
    assert runs[0].records == runs[1].records  # times included: they are virtual
    assert runs[0].events == runs[1].events
    assert runs[0].records[0][-1]["time"] > 0.02


@pytest.mark.parametrize("kwargs, message", [
    ({"rate": "fast"}, "fast"),
    ({"latency": -1}, "network latency: expected seconds >= 0, got -1"),
    ({"latency": float("nan")}, "network latency"),
    ({"sharing": "random"}, "network sharing: 'random' is not one of fifo, fair"),
    ({"goodput": 1.5}, "network goodput"),
    ({"rates": {-2: "1gbit"}}, "network rates: -2 is not a rank"),
])
def test_bad_network_parameters_are_named(kwargs, message):
    with pytest.raises(ConfigError, match=None) as info:
        NetworkModel(**kwargs)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_checkpoints_are_refused_not_silently_skipped():
    config = TrainConfig.from_dict({"rounds": 2, "checkpoint_every": 1})
    with pytest.raises(ConfigError, match="checkpoint_every: checkpoints and rejoins are not"):
        simulate_run(config, Topology.generate("ring", 3), "unused", write=False)


def test_bad_compute_models_are_named():
    assert parse_compute("measured:2").factor == 2.0
    drawn = parse_compute("lognormal:0.01:0.5").delays(DelayModel(rank=1, seed=3))
    assert drawn.minibatch_delay(4, 0.0) == drawn.minibatch_delay(4, 0.0) > 0  # seeded
    assert drawn.minibatch_delay(4, 0.0) != drawn.minibatch_delay(5, 0.0)
    for text in ("measured:0", "measured:x", "cpu", "lognormal:0", "lognormal:-1:0.5"):
        with pytest.raises(ConfigError, match="--compute"):
            parse_compute(text)


@pytest.mark.slow
def test_cli_rejects_a_bad_rate_in_one_line(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "gossip", "simulate", "--peers", "3", "--rate", "fast",
         "--run-dir", str(tmp_path / "run")], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1
    assert "fast" in result.stderr


@pytest.mark.slow
def test_oracle_probe_equals_the_exchanged_one_and_measured_compute_takes_time():
    config = TrainConfig.from_dict({"strategy": "dpsgd", "rounds": 2, "batch_size": 8,
                                    "eval_every": 1, "seed": 5})
    topology = Topology.generate("ring", 4)
    exchanged = simulate_run(config, topology, "unused", write=False)
    oracle = simulate_run(config, topology, "unused", Simulation(
        probe="oracle", compute=parse_compute("measured")), write=False)
    for rank in range(4):
        for a, b in zip(exchanged.records[rank], oracle.records[rank]):
            assert a["loss"] == b["loss"]  # the compute model changes times only
            assert b["consensus"] == pytest.approx(a["consensus"], rel=1e-9, abs=1e-15)
            assert b["avg_accuracy"] == a["avg_accuracy"]
            assert a["compute_s"] == 0.0 < b["compute_s"]  # the real math's CPU time
        # The probe's messages are gone, the algorithm's are all there.
        probes = [[k for k in run.stats[rank]["by_kind"] if k.startswith("probe.")]
                  for run in (exchanged, oracle)]
        assert probes[0] and not probes[1]
        assert oracle.records[rank][-1]["bytes_sent"] == exchanged.records[rank][-1]["bytes_sent"]


def test_a_server_waits_for_workers_computing_longer_than_the_timeout_in_virtual_time():
    """Bug 3 in the simulator, as over ZeroMQ: a server-only rank waits while its workers
    compute 10 virtual seconds between pushes, longer than the 2 s timeout. They are alive
    (their processes have not ended), so nobody times out or is declared dead."""
    import torch

    from gossip.peer import Peer

    data = {**Topology.generate("complete", 3).to_dict(), "servers": [2]}
    del data["edges"]  # implied: every worker linked to every server
    topology = Topology.from_dict(data)
    world = SimWorld(3)

    def worker(rank: int):
        def main():
            with Peer(rank, topology, "ps",
                      transport=world.transport(rank, timeout=2.0, dead_after=1.0)) as peer:
                x = torch.full((4,), float(rank), dtype=torch.float64)
                for round in range(3):
                    world.scheduler.sleep(10.0)  # a step's compute: nothing is sent meanwhile
                    x = peer.synchronize(x, round)
                return x, dict(peer.transport.membership.lost)
        return main

    def server():
        with Peer(2, topology, "ps",
                  transport=world.transport(2, timeout=2.0, dead_after=1.0)) as peer:
            peer.serve()
            return dict(peer.transport.membership.lost)

    [w0, w1, served] = run_peers(world, worker(0), worker(1), server)
    assert served == {}, served
    for result in (w0, w1):
        assert not isinstance(result, Exception), result
        x, lost = result
        assert lost == {} and torch.equal(x, torch.full((4,), 0.5, dtype=torch.float64))
    assert world.scheduler.now >= 30.0
