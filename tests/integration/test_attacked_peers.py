"""Attackers among real dpsgd peers (threads over ZeroMQ on loopback): the honest peers mix
exactly what a numpy oracle of each attack says the attacker sent them, and an attacked run
replays bitwise from its seed.

Each peer synchronizes ``data[round, rank]`` in each round, so honest peer i's result is
``W_ii x_i + sum_j W_ij m_ji``, with ``m_ji`` the attacker's payload where j attacks.
"""

from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from scipy.stats import norm

from gossip.attacks import Attack, Attacks
from gossip.cli import main
from gossip.config import TrainConfig
from gossip.metrics import read_jsonl
from gossip.peer import Peer
from gossip.sim import SimWorld
from gossip.sim import simulate_run
from gossip.sim.runner import peer_threads
from gossip.sim.rushing import Board, rushing
from gossip.topology import Topology
from gossip.training.synchronous import train
from support import assert_same, make_local_topology, peer_data, run_in_threads
from support.peers import peer_once_all_bound

SIGMA, Z, EPS, K = 0.5, 1.5, 0.7, 2


def run(topology, attacks: dict[int, Attack], data: torch.Tensor) -> torch.Tensor:
    rounds, size = data.shape[:2]
    results = torch.empty_like(data)
    all_bound = threading.Barrier(size, timeout=10)

    def peer_main(rank: int) -> None:
        with peer_once_all_bound(rank, topology, "dpsgd", all_bound, timeout=10,
                                 attack=attacks.get(rank)) as peer:
            for r in range(rounds):
                results[r, rank] = peer.synchronize(data[r, rank].clone(), r)

    run_in_threads(size, peer_main, timeout=60)
    return results


def oracle_payload(kind: str, b: int, t: int, r: int, x: np.ndarray, topology,
                   attackers: set[int], seed: int) -> np.ndarray:
    """What attacker ``b`` sends to ``t`` in round ``r`` (``x[r, rank]``), from the spec
    (what it received: t's and those of t's honest neighbours that are also b's)."""
    own = x[r, b]
    if kind == "signflip":
        return -own
    if kind == "gaussian":
        return own + SIGMA * np.random.default_rng([seed, b, r, t]).standard_normal(own.size)
    if kind == "stale":
        return x[max(r - K, 0), b]
    known = {j for j in topology.neighbors(b) if j not in attackers}
    honest = [j for j in topology.neighbors(t) if j in known]
    models = np.stack([x[r, t]] + [x[r, j] for j in sorted(honest)])
    if kind == "alie" and len(models) == 1:  # no spread: the model itself
        return models[0]
    if kind == "alie":
        return models.mean(0) - Z * models.std(0, ddof=1)
    if kind == "ipm":
        return -EPS * models.mean(0)
    assert kind == "dissensus"
    w = topology.mixing_matrix()
    pull = sum(w[t][j] * (x[r, j] - x[r, t]) for j in honest)
    return x[r, t] - EPS * pull / sum(w[t][j] for j in topology.neighbors(t) if j in attackers)


def expected(topology, attacks: dict[int, str], data: torch.Tensor, seed: int) -> np.ndarray:
    x = data.numpy()
    w = topology.mixing_matrix()
    out = np.zeros_like(x)
    for r in range(x.shape[0]):
        for i in range(topology.size):
            out[r, i] = w[i][i] * x[r, i]
            for j in topology.neighbors(i):
                sent = (oracle_payload(attacks[j], j, i, r, x, topology, set(attacks), seed)
                        if j in attacks and i not in attacks else x[r, j])
                out[r, i] += w[i][j] * sent
    return out


PARAMS = {"signflip": {}, "gaussian": {"sigma": SIGMA}, "alie": {"z": Z},
          "ipm": {"epsilon": EPS}, "dissensus": {"epsilon": EPS}, "stale": {"k": K}}


@pytest.mark.parametrize("graph", ["complete", "ring"])
@pytest.mark.parametrize("kind", list(PARAMS))
def test_honest_peers_receive_the_attack(kind, graph, local_topology):
    topology = local_topology(graph, 5)
    attackers = {1: kind}
    attacks = {1: Attack.named(kind, seed=11, attackers=attackers, **PARAMS[kind])}
    data = peer_data(4, 5, (9,), torch.float64, seed=3)
    results = run(topology, attacks, data)
    honest = [0, 2, 3, 4]
    want = expected(topology, attackers, data, seed=11)
    np.testing.assert_allclose(results[:, honest].numpy(), want[:, honest], rtol=1e-12,
                               atol=1e-12)
    assert not np.allclose(want[:, honest], expected(topology, {}, data, 0)[:, honest])


def test_colluders_never_wait_for_each_other_and_replay_bitwise(local_topology):
    """Two neighbouring rushing attackers on a ring; the run twice gives the same bits."""
    topology = local_topology("ring", 5)
    attackers = {1: "ipm", 2: "gaussian"}
    attacks = {1: Attack.named("ipm", seed=5, attackers={1, 2}, epsilon=EPS),
               2: Attack.named("gaussian", seed=5, attackers={1, 2}, sigma=SIGMA)}
    data = peer_data(3, 5, (7,), torch.float64, seed=4)
    first = run(topology, attacks, data)
    honest = [0, 3, 4]
    np.testing.assert_allclose(first[:, honest].numpy(),
                               expected(topology, attackers, data, seed=5)[:, honest],
                               rtol=1e-12, atol=1e-12)
    assert_same(first, run(local_topology("ring", 5), attacks, data))


def test_dissensus_at_one_leaves_its_target_unchanged(local_topology):
    """Invariant 5 of the spec: with epsilon = 1 and every honest neighbour of the target
    known (a complete graph), plain gossip leaves every honest model where it was."""
    topology = local_topology("complete", 5)
    attacks = {1: Attack.named("dissensus", attackers={1}, epsilon=1.0)}
    data = peer_data(2, 5, (6,), torch.float64, seed=8)
    results = run(topology, attacks, data)
    honest = [0, 2, 3, 4]
    torch.testing.assert_close(results[:, honest], data[:, honest], rtol=1e-12, atol=1e-12)


def test_oracle_z_matches_the_library():
    from gossip.attacks.kinds import baruch_z

    n, f = 25, 5
    s = n // 2 + 1 - f
    assert baruch_z(n, f) == pytest.approx(norm.ppf((n - f - s) / (n - f)))


# -- attacked training, real and simulated ---------------------------------------------------

COMPARED = ("round", "loss", "accuracy", "consensus", "avg_accuracy", "bytes_sent")


def real_training(topology, config: TrainConfig) -> list[list[dict]]:
    """Every peer a thread over ZeroMQ, as `gossip peer` runs it: its lines."""
    all_bound = threading.Barrier(topology.size, timeout=60)

    def peer_main(rank: int) -> list[dict]:
        torch.set_num_threads(peer_threads())
        lines: list[dict] = []
        with peer_once_all_bound(rank, topology, config.strategy, all_bound, timeout=60,
                                 attack=config.attack.for_rank(rank, seed=config.seed),
                                 **config.options) as peer:
            train(peer, config, on_round=lines.append)
        return lines

    return run_in_threads(topology.size, peer_main, timeout=120)


@pytest.mark.parametrize("attack, graph", [("1:labelflip", "ring"), ("3:stale,k=2", "ring"),
                                           ("1:alie,z=1", "complete")])
def test_simulated_attacked_training_is_the_real_one(attack, graph):
    """The simulator runs the same attacker (a rushing one knows more there, except on a
    complete graph); and the attack changes the honest peers' run."""
    config = TrainConfig.from_dict({"rounds": 3, "eval_every": 1, "batch_size": 16,
                                    "seed": 7, "attack": attack})
    topology = make_local_topology(graph, 5)
    real = real_training(topology, config)
    sim = simulate_run(config, topology, "unused", write=False)
    assert sim.failed == {}
    for rank, lines in enumerate(real):
        assert [{k: line[k] for k in COMPARED} for line in sim.records[rank]] == \
            [{k: line[k] for k in COMPARED} for line in lines]
    clean = simulate_run(dataclasses.replace(config, attack=Attacks()), topology, "unused",
                         write=False)
    attacker = next(iter(config.attack.by_rank))
    honest = [rank for rank in range(5) if rank != attacker]
    assert any(clean.records[r][-1]["loss"] != sim.records[r][-1]["loss"] for r in honest)


def test_the_attack_flags_reach_the_simulated_peers(tmp_path):
    """With lr 0 the peers only mix one shared model, so consensus stays 0 unless someone
    attacks; the run directory's config keeps the attackers."""
    def simulate(*args: str):
        return CliRunner().invoke(main, ["simulate", "--quiet", "--peers", "5", "--rounds", "2",
                                         "--lr", "0", "--batch-size", "16",
                                         "--run-dir", str(tmp_path), *args])

    flags = ["2:signflip", "4:gaussian,sigma=0.1,seed=3"]
    result = simulate(*[arg for flag in flags for arg in ("--attack", flag)])
    assert result.exit_code == 0, result.output
    assert TrainConfig.from_yaml(tmp_path / "config.yaml").attack == Attacks.parse(flags)
    assert read_jsonl(tmp_path / "peer-0.jsonl")[-1]["consensus"] > 0
    refused = simulate("--attack", "9:signflip")
    assert refused.exit_code == 1 and "rank 9 is not in the run" in refused.output


def test_a_simulated_rushing_attacker_sees_every_honest_model():
    """On a ring the attacker is no neighbour of its targets' other neighbours, yet in the
    simulator dissensus at epsilon = 1 leaves both its targets' models unchanged (invariant
    5), while the peers it does not reach mix as plain gossip does."""
    topology = Topology.ring(5)
    data = peer_data(3, 5, (6,), torch.float64, seed=2)
    attacks = Attacks.parse("1:dissensus,epsilon=1")
    world = SimWorld(5)
    board = Board(world, topology, attacks.by_rank)
    results = torch.empty_like(data)

    def main(rank: int):
        def run():
            transport, attack = rushing(board, world.transport(rank, timeout=10),
                                        attacks.for_rank(rank, seed=0), 10)
            with Peer(rank, topology, "dpsgd", transport=transport, attack=attack) as peer:
                for r in range(3):
                    results[r, rank] = peer.synchronize(data[r, rank].clone(), r)
        return run

    tasks = [world.spawn(rank, main(rank)) for rank in range(5)]
    world.scheduler.run()
    assert [task.error for task in tasks] == [None] * 5
    torch.testing.assert_close(results[:, [0, 2]], data[:, [0, 2]], rtol=1e-12, atol=1e-12)
    w = topology.mixing_matrix()
    for i in (3, 4):
        want = sum(w[i][j] * data[:, j] for j in (i - 1, i, (i + 1) % 5))
        torch.testing.assert_close(results[:, i], want, rtol=1e-12, atol=1e-12)
    assert board.models == {} or min(r for _, r in board.models) >= 2  # older rounds dropped
