"""A run with attackers is measured on its honest peers (issue 29): the consensus probe
leaves the attackers' models out of the distance and the average model, and the analysis
leaves their records out of the curves and the table (gossip/experiment/analysis.py)."""

from __future__ import annotations

import contextlib
import json
import threading
from types import SimpleNamespace

import pytest
import torch
import yaml

from gossip.experiment.analysis import load_curve, summarize
from gossip.tasks.base import Split, evaluate
from gossip.training.consensus import ConsensusProbe


class MeanOfAll:
    """An exact all-reduce mean among threads, one per peer."""

    def __init__(self, size: int):
        self.given: dict[int, torch.Tensor] = {}
        self.barrier = threading.Barrier(size)

    def synchronize(self, x: torch.Tensor, round: int, rank: int) -> torch.Tensor:
        self.given[rank] = x.clone()
        self.barrier.wait()
        return torch.stack(list(self.given.values())).mean(dim=0)


def probe_all(weights: list[torch.Tensor], left_out: frozenset[int]):
    """Each peer's probe result, the peers' models ``nn.Linear(2, 2)`` with ``weights``."""
    task = SimpleNamespace(test=Split(torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]),
                                      torch.tensor([0, 1, 1])),
                           loss_fn=torch.nn.functional.cross_entropy)
    reduce = MeanOfAll(len(weights))
    results, models = {}, []

    def peer(rank: int):
        fake = SimpleNamespace(rank=rank, communicating=contextlib.nullcontext,
                               all_peers_can_meet=lambda round: True, view=None,
                               topology=SimpleNamespace(roles=None),
                               strategy=SimpleNamespace(synchronous=True))
        fake.add_strategy = lambda *a, **k: SimpleNamespace(
            synchronize=lambda x, r: reduce.synchronize(x, r, rank))
        probe = ConsensusProbe(fake, task, left_out=left_out)
        results[rank] = probe.measure(models[rank], 0)

    for w in weights:
        model = torch.nn.Linear(2, 2, bias=False)
        with torch.no_grad():
            model.weight.copy_(w)
        models.append(model)
    threads = [threading.Thread(target=peer, args=(rank,)) for rank in range(len(weights))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, models, task


@pytest.mark.parametrize("left_out", [frozenset(), frozenset({1})])
def test_the_probe_measures_the_peers_not_left_out(left_out):
    weights = [torch.tensor([[1.0, 0.0], [0.0, 1.0]]), torch.tensor([[-50.0, 9.0], [7.0, -3.0]]),
               torch.tensor([[0.5, 0.5], [-1.0, 2.0]])]
    results, models, task = probe_all(weights, left_out)
    counted = torch.stack([w.reshape(-1).double() for r, w in enumerate(weights)
                           if r not in left_out])
    avg = counted.mean(dim=0)
    distance = float(((counted - avg) ** 2).sum(dim=1).mean())
    average = torch.nn.Linear(2, 2, bias=False)
    with torch.no_grad():
        average.weight.copy_(avg.reshape(2, 2))
    accuracy = evaluate(average, task.test, task.loss_fn)[1]
    for rank in range(3):  # every peer, the left-out one too, gets the same figures
        assert results[rank][0] == pytest.approx(distance, rel=1e-12)
        assert results[rank][1] == accuracy
        assert torch.equal(models[rank].weight, weights[rank])  # its own model back


def write_run(run_dir, attack, accuracies, consensus):
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(yaml.safe_dump(
        {"train": {"strategy": "dpsgd", "attack": attack}}))
    for rank, accuracy in enumerate(accuracies):
        late = 5.0 if rank == 1 else 0.0  # peer 1 finishes each round last
        lines = [{"round": r, "time": 1.0 + r + late, "wall": 101.0 + r + late,
                  "loss": float(rank),
                  "accuracy": accuracy, "bytes_sent": 10, "samples": 8, "minibatches": 1,
                  "consensus": consensus[r]} for r in range(len(consensus))]
        (run_dir / f"peer-{rank}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


def test_the_attackers_records_are_left_out_of_the_curves_and_the_table(tmp_path):
    # peer 1 attacks (as the run's config says): its accuracy, loss and clock do not count
    write_run(tmp_path / "attacked", {1: {"kind": "signflip"}}, [0.9, 0.1, 0.7],
              [0.5, None, 0.25])
    write_run(tmp_path / "clean", {}, [0.9, 0.1, 0.7], [0.5, None, 0.25])
    attacked = load_curve(tmp_path / "attacked", smooth=1)
    clean = load_curve(tmp_path / "clean", smooth=1)
    assert attacked.attackers == (1,) and clean.attackers == ()
    assert attacked.accuracy.tolist() == pytest.approx([0.8] * 3)
    assert clean.accuracy.tolist() == pytest.approx([0.9 / 3 + 0.1 / 3 + 0.7 / 3] * 3)
    assert attacked.raw_loss.tolist() == pytest.approx([1.0] * 3)  # ranks 0 and 2
    assert attacked.time.tolist() == [1.0, 2.0, 3.0]  # not waiting for rank 1's records
    assert clean.time.tolist() == [6.0, 7.0, 8.0]
    assert attacked.consensus.tolist()[::2] == [0.5, 0.25]
    rows = summarize([attacked, clean], target=None)
    assert [(r["attackers"], r["consensus"]) for r in rows] == [("1", 0.25), (None, 0.25)]
    assert "attackers" not in summarize([clean], target=None)[0]  # no attacks: no column


def test_the_simulators_oracle_probe_leaves_the_attackers_out_too():
    """``--probe oracle`` computes from every model directly what the exchanged probe
    all-reduces: with an attacker, both give the honest peers' consensus (counting the
    attacker's model in one of them would tell them apart)."""
    from gossip.config import TrainConfig
    from gossip.sim import Simulation, simulate_run
    from gossip.topology import Topology

    config = TrainConfig.from_dict({"strategy": "dpsgd", "rounds": 2, "batch_size": 8,
                                    "eval_every": 1, "seed": 5, "attack": "1:gaussian,sigma=3"})
    topology = Topology.generate("ring", 4)
    exchanged = simulate_run(config, topology, "unused", write=False)
    oracle = simulate_run(config, topology, "unused", Simulation(probe="oracle"), write=False)
    for rank in range(4):
        for a, b in zip(exchanged.records[rank], oracle.records[rank]):
            assert b["consensus"] == pytest.approx(a["consensus"], rel=1e-9, abs=1e-15)
            assert b["avg_accuracy"] == a["avg_accuracy"]
