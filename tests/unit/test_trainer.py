"""The Trainer's phases, on one peer whose transport runs in virtual time: every time the
loop records is read from the peer's clock, so injected delays are its only durations."""

from __future__ import annotations

import dataclasses

import pytest

from gossip.clock import ManualClock
from gossip.config import TrainConfig
from gossip.peer import Peer
from gossip.records import Record
from gossip.topology import Topology
from gossip.training import Trainer, Work, train
from gossip.transport import LoopbackHub

SCHEMA = [f.name for f in dataclasses.fields(Record)][:-3]  # without the optional fields
CONFIG = TrainConfig.from_dict({"strategy": "dpsgd", "rounds": 3, "batch_size": 16,
                                "minibatches": 2, "eval_every": 2,
                                "delays": {"compute": 0.25}})


def virtual_peer(clock: ManualClock) -> Peer:
    transport = LoopbackHub(1).transport(0, clock=clock, timeout=10)
    return Peer(0, Topology.generate("complete", 1), "dpsgd", transport=transport)


def test_train_writes_one_record_per_round_timed_on_the_peer_clock(tmp_path):
    clock, lines = ManualClock(start=10.0, epoch=1.7e9), []
    with virtual_peer(clock) as peer:
        last = train(peer, CONFIG, on_round=lines.append)
    assert last == lines[-1]
    assert [line["round"] for line in lines] == [0, 1, 2]
    for rnd, line in enumerate(lines):
        assert list(line) == SCHEMA
        # Two mini-batches of 0.25 s injected delay each; nothing else takes virtual time.
        assert line["time"] == pytest.approx(0.5 * (rnd + 1))
        assert line["wall"] == pytest.approx(1.7e9 + 0.5 * (rnd + 1))
        assert line["compute_s"] == line["delay_s"] == pytest.approx(0.5)
        assert line["comm_s"] == line["wait_s"] == 0.0
        assert (line["minibatches"], line["samples"]) == (2, 16)
    # The probe runs every eval_every rounds and in the last one.
    assert [line["consensus"] is None for line in lines] == [False, True, False]
    assert lines[0]["consensus"] == 0.0 and lines[0]["avg_accuracy"] == lines[0]["accuracy"]


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
