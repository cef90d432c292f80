"""The Trainer's phases, on one peer whose transport runs in virtual time: every time the
loop records is read from the peer's clock, so injected delays are its only durations."""

from __future__ import annotations

import dataclasses

import pytest

from gossip.clock import ManualClock
from gossip.config import TrainConfig
from gossip.peer import Peer
from gossip.topology import Topology
from gossip.training.records import (ELASTIC_FIELDS, OVERLAP_FIELDS, ROBUST_FIELDS,
                                     TASK_FIELDS, Record)
from gossip.training.synchronous import Trainer, Work, train
from gossip.transport import LoopbackHub

OPTIONAL = ("resumed_from", "lost_work", *OVERLAP_FIELDS, "device_wait_s", "device_hold_s",
            "round_start_wall", "staleness", *ROBUST_FIELDS, *TASK_FIELDS, *ELASTIC_FIELDS)
SCHEMA = [f.name for f in dataclasses.fields(Record) if f.name not in OPTIONAL]
CONFIG = TrainConfig.from_dict({"strategy": "dpsgd", "rounds": 3, "batch_size": 16,
                                "minibatches": 2, "eval_every": 2,
                                "delays": {"compute": 0.25}})


def virtual_peer(clock: ManualClock, strategy: str = "dpsgd") -> Peer:
    transport = LoopbackHub(1).transport(0, clock=clock, timeout=10)
    return Peer(0, Topology.generate("complete", 1), strategy, transport=transport)


def test_train_writes_one_record_per_round_timed_on_the_peer_clock(tmp_path):
    clock, lines = ManualClock(start=10.0, epoch=1.7e9), []
    with virtual_peer(clock) as peer:
        last = train(peer, CONFIG, on_round=lines.append)
    assert last == lines[-1]
    assert [line["round"] for line in lines] == [0, 1, 2]
    for round, line in enumerate(lines):
        assert list(line) == SCHEMA
        # Two mini-batches of 0.25 s injected delay each; nothing else takes virtual time.
        assert line["time"] == pytest.approx(0.5 * (round + 1))
        assert line["wall"] == pytest.approx(1.7e9 + 0.5 * (round + 1))
        assert line["compute_s"] == line["delay_s"] == pytest.approx(0.5)
        assert line["comm_s"] == line["wait_s"] == 0.0
        assert (line["minibatches"], line["samples"]) == (2, 16)
    # The probe runs every eval_every rounds and in the last one.
    assert [line["consensus"] is None for line in lines] == [False, True, False]
    assert lines[0]["consensus"] == 0.0 and lines[0]["avg_accuracy"] == lines[0]["accuracy"]


def test_test_every_scores_the_model_in_its_rounds_and_the_last():
    config = dataclasses.replace(CONFIG, rounds=5, test_every=3)
    with virtual_peer(ManualClock()) as peer:
        lines = []
        train(peer, config, on_round=lines.append)
    assert [line["accuracy"] is None for line in lines] == [False, True, True, False, False]
    assert all(0 <= line["accuracy"] <= 1 for line in lines if line["accuracy"] is not None)


def test_each_phase_on_its_own():
    clock = ManualClock()
    with virtual_peer(clock) as peer:
        trainer = Trainer(peer, CONFIG)
        before = peer.stats
        work = trainer.compute(0)
        assert work == Work(2, work.loss_sum, 0.5, 0.5) and work.loss_sum > 0
        assert trainer.drawn == 2  # indexes the straggler draws, saved in checkpoints
        assert trainer.synchronize(0, work) == 0.0 and peer.round == 1
        record = trainer.record(0, work, 0.0, before=before, after=peer.stats)
        assert (record.round, record.consensus, record.resumed_from) == (0, None, None)
        assert record.loss == pytest.approx(work.loss_sum / 2)
        assert trainer.probe(0) == (0.0, record.accuracy)  # one peer: its own average


def test_an_overlapped_round_records_its_metrics_and_checkpoints_every_bucket(tmp_path):
    """Ring all-reduce of one peer over buckets, on an emulated device in virtual time."""
    from gossip import checkpoint

    config = TrainConfig.from_dict({
        "strategy": "ring-allreduce", "rounds": 2, "batch_size": 8, "minibatches": 2,
        "task": "deep-mlp", "task_options": {"width": 32, "depth": 4}, "layer_delay": 0.01,
        "overlap": True, "bucket_mb": 0.005, "checkpoint_every": 2, "eval_every": 5})
    clock, lines = ManualClock(), []
    with virtual_peer(clock, "ring-allreduce") as peer:
        train(peer, config, on_round=lines.append, checkpoint_path=tmp_path / "peer-0.ckpt")
    for line in lines:
        assert list(line) == SCHEMA + list(OVERLAP_FIELDS)
        # 2 mini-batches x 4 layers x (10 ms forward + 20 ms backward), all virtual.
        assert line["compute_s"] == pytest.approx(0.24)
        assert line["iter_s"] == pytest.approx(0.24)
        assert line["buckets"] == 4 and line["exposed_comm_s"] >= 0
    state = checkpoint.load(tmp_path / "peer-0.ckpt")
    assert len(state["strategy_state"]["buckets"]) == 4  # one entry per bucket
