"""Consensus from model snapshots (an asynchronous run's): ticks of the wall clock, the
distance as the probe defines it, against numpy."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gossip.training.snapshots import SnapshotWriter, consensus_over_time, final_consensus


def test_ticks_group_the_peers_snapshots_and_match_numpy(tmp_path):
    rng = np.random.default_rng(0)
    models = rng.standard_normal((3, 4, 11))  # 3 peers x 4 moments x 11 parameters
    writers = [SnapshotWriter(tmp_path, rank, period=0.5) for rank in range(3)]
    for moment, wall in enumerate([10.0, 10.2, 10.6, 11.1]):  # ticks 20, 20, 21, 22
        for rank, writer in enumerate(writers):
            if rank == 2 and moment == 3:
                continue  # rank 2 stopped before tick 22: that tick has one peer fewer
            writer.maybe(torch.from_numpy(models[rank, moment]), wall + 0.01 * rank)
    writers[0].maybe(torch.zeros(11), 11.2)  # alone on its tick: no row
    for rank, writer in enumerate(writers):
        writer.final(torch.from_numpy(models[rank, 3]))

    def oracle(x):
        return float(np.mean(np.sum((x - x.mean(0)) ** 2, axis=1)))

    rows = consensus_over_time(tmp_path)
    assert [(row["tick"], row["peers"]) for row in rows] == [
        (20, 3), (21, 3), (22, 2), (None, 3)]
    expected = [oracle(models[:, 0]), oracle(models[:, 2]), oracle(models[:2, 3]),
                oracle(models[:, 3])]  # a tick keeps its first snapshot (moment 0, not 1)
    assert [row["consensus"] for row in rows] == pytest.approx(expected, rel=1e-12)


def test_no_directory_no_rows(tmp_path):
    assert consensus_over_time(tmp_path / "absent") == []


def test_the_final_consensus_alone_is_the_last_row(tmp_path):
    writers = [SnapshotWriter(tmp_path, rank, period=1.0) for rank in range(3)]
    for rank, writer in enumerate(writers):
        writer.maybe(torch.full((4,), float(rank)), 5.0)
        writer.maybe(torch.full((4,), 2.0 * rank), 6.0)
    assert final_consensus(tmp_path) == consensus_over_time(tmp_path)[-1]
    assert final_consensus(tmp_path)["tick"] == 6  # no final files: the last shared tick
    for rank, writer in enumerate(writers):
        writer.final(torch.full((4,), 3.0 * rank))
    assert final_consensus(tmp_path) == consensus_over_time(tmp_path)[-1]
    assert final_consensus(tmp_path)["tick"] is None
    assert final_consensus(tmp_path / "absent") is None
