"""An elastic run's data shard follows the view, (seed, epoch, slot), not the member id: a
joiner's id may lie past any partition, and after a change the members' shards still
cover the split once."""

from __future__ import annotations

import dataclasses

import torch

from gossip.config import TrainConfig
from gossip.peer import Peer
from gossip.tasks import create_task
from gossip.tasks.base import BatchStream
from gossip.tasks.partition import partition
from gossip.topology import Topology
from gossip.training.synchronous import Trainer
from gossip.transport import LoopbackHub
from gossip.transport.epochs import View

CONFIG = TrainConfig.from_dict({"strategy": "ring-allreduce", "rounds": 3, "batch_size": 16,
                                "elastic": True, "spares": 1})


def first_batch(config, shards, shard, seed):
    task = create_task(config.task, seed=config.seed, **config.task_options)
    split = partition(task.train.y, shards, scheme=config.partition, alpha=config.alpha,
                      seed=config.seed)
    return BatchStream(task.train, split[shard], batch_size=config.batch_size,
                       seed=seed).next()


def test_the_shard_is_the_views_slot_and_changes_with_the_view():
    hub, seed = LoopbackHub(4), CONFIG.seed
    with Peer(2, Topology.generate("ring", 4), "ring-allreduce", transport=hub.transport(2),
              elastic=True, spares=1) as peer:
        trainer = Trainer(peer, CONFIG)
        # epoch 0: the 3 members' partition (not the topology's 4), as a static run's
        for got, want in zip(trainer.batches.next(), first_batch(CONFIG, 3, 2, seed * 1000 + 2)):
            assert torch.equal(got, want)
        # epoch 2 without member 1: slot 1 of 2 shards, drawn in the order of (seed, 2, 1)
        peer.transport.membership.epochs.install(View(2, (0, 2), round=1))
        trainer.reshard()
        order = (seed * 1_000_003 + 2) * 1000 + 1
        for got, want in zip(trainer.batches.next(), first_batch(CONFIG, 2, 1, order)):
            assert torch.equal(got, want)
        assert trainer.data_epoch == 2


def test_a_joiner_draws_nothing_before_its_view_admits_it():
    hub = LoopbackHub(4)
    config = dataclasses.replace(CONFIG, join=True)
    with Peer(3, Topology.generate("ring", 4), "ring-allreduce", transport=hub.transport(3),
              elastic=True, spares=1) as peer:
        trainer = Trainer(peer, config)
        assert trainer.batches is None and trainer.data_epoch is None
        peer.transport.membership.epochs.install(View(1, (0, 1, 2, 3), round=4))
        trainer.reshard()
        assert trainer.batches is not None and trainer.data_epoch == 1
