"""Two jobs training at once on shared devices (real peers over loopback ZeroMQ, threads of
this process, the in-process arbiter): the scheduler changes only timing, so each job's
final model is bitwise its solo run's; compute phases alternate and never overlap."""

from __future__ import annotations

import threading

import pytest
import torch

from gossip.config import TrainConfig
from gossip.crossover import LocalArbiter
from gossip.crossover.flock import SlicedDevice
from gossip.crossover.grants import overlaps, read_grants, turn_breaks
from gossip.crossover.trainer import DeviceTrainer
from gossip.training.synchronous import Trainer

from support import make_local_topology, peer_once_all_bound

JOBS = {"a": TrainConfig.from_dict({"strategy": "dpsgd", "rounds": 4, "batch_size": 8,
                                    "eval_every": 10, "seed": 1,
                                    "delays": {"compute": 0.01}}),
        "b": TrainConfig.from_dict({"strategy": "ring-allreduce", "rounds": 4,
                                    "batch_size": 8, "eval_every": 10, "seed": 2,
                                    "delays": {"compute": 0.01}})}
PEERS = 3


def run_jobs(jobs, arbiter=None, *, open_lock=None):
    """Every job's peers as threads; returns each (job, rank)'s final flat model and
    records. ``open_lock(job, rank)``, if given, is each rank's device instead of
    ``arbiter``'s."""
    models, records, errors = {}, {}, []
    steps_held = {(job, rank): [] for job in jobs for rank in range(PEERS)}

    def peer_main(job, config, topology, all_bound, rank):
        try:
            with peer_once_all_bound(rank, topology, config.strategy, all_bound) as peer:
                lines, lock = [], None
                if open_lock is not None:
                    lock = open_lock(job, rank)
                    trainer = DeviceTrainer(peer, config, device=lock, on_round=lines.append)
                elif arbiter is None:
                    trainer = Trainer(peer, config, on_round=lines.append)
                else:
                    lock = arbiter.lock(f"dev{rank}", job, rank, timeout=30)
                    trainer = DeviceTrainer(peer, config, device=lock, on_round=lines.append)
                    trainer.optimizer.register_step_pre_hook(
                        lambda *_, job=job, rank=rank: steps_held[job, rank].append(
                            arbiter._rotation(f"dev{rank}").holder is not None
                            and arbiter._rotation(f"dev{rank}").holder.job == job))
                try:
                    trainer.run()
                finally:
                    if lock is not None:
                        lock.close()
                models[job, rank] = torch.cat([p.detach().reshape(-1)
                                               for p in trainer.model.parameters()])
                records[job, rank] = lines
        except BaseException as exc:  # noqa: BLE001 - surfaced below
            errors.append(exc)

    threads = []
    for job, config in jobs.items():
        topology = make_local_topology("ring", PEERS)
        all_bound = threading.Barrier(PEERS, timeout=20)
        threads += [threading.Thread(target=peer_main, args=(job, config, topology, all_bound, r))
                    for r in range(PEERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    return models, records, steps_held


@pytest.mark.slow
def test_jobs_sharing_devices_train_bitwise_as_alone(tmp_path):
    solo, solo_records, _ = run_jobs(JOBS)
    arbiter = LocalArbiter(grant_log=tmp_path / "grants.jsonl")
    shared, shared_records, steps_held = run_jobs(JOBS, arbiter)
    # dpsgd's local step is device work in its turn; ring-allreduce steps after averaging
    assert all(steps_held["a", r] == [True] * 4 for r in range(PEERS)), steps_held
    assert all(steps_held["b", r] == [False] * 4 for r in range(PEERS)), steps_held
    for key, model in solo.items():
        assert torch.equal(model, shared[key]), key
    grants = read_grants(tmp_path / "grants.jsonl")
    assert len(grants) == 2 * PEERS * 4
    assert overlaps(grants) == [] and turn_breaks(grants, JOBS) == 0
    for line in shared_records["a", 0]:
        assert line["device_hold_s"] >= 0.01 and line["device_wait_s"] >= 0
        assert line["round_start_wall"] <= line["wall"]
    assert "device_hold_s" not in solo_records["a", 0][0]


def test_layer_delay_on_a_sliced_device_is_held_in_slices(tmp_path):
    # The emulated layer time is device time: the naive arm's slices hold it (the trainer
    # bound the delay to the peer's clock before the device's clock replaced it:
    # device_hold_s was 0.0 every round and no slice was ever taken).
    config = TrainConfig.from_dict({"strategy": "dpsgd", "rounds": 2, "batch_size": 8,
                                    "eval_every": 10, "seed": 1, "layer_delay": 0.002})
    log = tmp_path / "grants.jsonl"
    _, records, _ = run_jobs({"a": config}, open_lock=lambda job, rank: SlicedDevice(
        tmp_path / "locks", f"dev{rank}", job, rank, slice_s=0.01, grant_log=log))
    for rank in range(PEERS):
        # forward and twice that in backward, for at least one layer
        assert all(line["device_hold_s"] >= 3 * 0.002 for line in records["a", rank])
    assert read_grants(log) and overlaps(read_grants(log)) == []
