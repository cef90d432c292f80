"""Simulated runs against real ones: the same seed gives bitwise the same losses,
accuracies and consensus, and exactly the same bytes per kind, as peers over ZeroMQ."""

from __future__ import annotations

import threading

import pytest
import torch

from gossip.config import TrainConfig
from gossip.sim import NetworkModel, Simulation, simulate_run
from gossip.sim.runner import peer_threads
from gossip.topology import Topology
from gossip.training.synchronous import train

from support.peers import make_local_topology, peer_once_all_bound, run_in_threads

# The synchronous strategies: their results do not depend on timing.
SYNCHRONOUS = {
    "dpsgd": {},
    "matcha": {},
    "ring-allreduce": {},
    "choco": {"compressor": "topk", "density": 0.1},  # dpsgd with a compressor
    "spardl": {"density": 0.05},
}
# Bytes received are not compared per round: a real peer counts a message when it reads
# it, and one of the next round arriving early is read while it waits for another, so
# where a round's count ends depends on timing; the totals (by kind) are compared.
COMPARED = ("round", "loss", "accuracy", "consensus", "avg_accuracy", "bytes_sent",
            "minibatches", "samples", "lost_peers")


def config_for(name: str) -> TrainConfig:
    options = SYNCHRONOUS[name]
    return TrainConfig.from_dict({"strategy": "dpsgd" if name == "choco" else name,
                                  "rounds": 2, "eval_every": 1, "batch_size": 16,
                                  "options": options, "seed": 7})


def real_run(topology: Topology, config: TrainConfig) -> list[tuple[list[dict], dict]]:
    """Every peer a thread of this process over ZeroMQ; per rank its lines and stats."""
    all_bound = threading.Barrier(topology.size, timeout=60)

    def peer_main(rank: int):
        torch.set_num_threads(peer_threads())  # as `gossip launch` starts a peer (this thread)
        lines: list[dict] = []
        with peer_once_all_bound(rank, topology, config.strategy, all_bound, timeout=60,
                                 **config.options) as peer:
            train(peer, config, on_round=lines.append)
            return lines, peer.stats

    return run_in_threads(topology.size, peer_main, timeout=120)


def without_bye(stats: dict) -> dict:
    return {kind: counts for kind, counts in stats["by_kind"].items() if kind != "bye"}


@pytest.mark.slow
@pytest.mark.parametrize("size", [3, 5])
@pytest.mark.parametrize("name", list(SYNCHRONOUS))
def test_simulated_run_is_bitwise_the_real_one(name, size):
    config = config_for(name)
    topology = make_local_topology("ring", size)
    real = real_run(topology, config)
    sim = simulate_run(config, topology, "unused", Simulation(
        network=NetworkModel(rate="100mbit", latency=1e-4)), write=False)
    assert sim.failed == {}
    for rank, (lines, stats) in enumerate(real):
        simulated = sim.records[rank]
        assert len(simulated) == len(lines) == config.rounds
        for ours, theirs in zip(simulated, lines):
            assert {k: ours[k] for k in COMPARED} == {k: theirs[k] for k in COMPARED}
        # Bytes and messages per kind, each way, exactly (the probe's included); not the
        # goodbyes: a faster neighbour's may already have been read, or not.
        assert without_bye(sim.stats[rank]) == without_bye(stats)
        assert simulated[-1]["bytes_recv"] == lines[-1]["bytes_recv"]
        assert sim.stats[rank]["messages_rejected"] == stats["messages_rejected"] == 0
