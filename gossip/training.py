"""The local training loop of one peer: batches, synchronized steps, evaluation, metrics."""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

import torch
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from gossip.config import TrainConfig
from gossip.metrics import MetricsWriter
from gossip.peer import Peer
from gossip.tasks import BatchStream, create_task, evaluate, partition

PROBE_TAG = "probe"  # ring all-reduce used only to measure consensus; its bytes are not counted
# torch's global RNG is shared by the threads of a process (peers run as threads in tests):
# seeding and initializing must not interleave, or peers start from different models.
_INIT_LOCK = threading.Lock()


def train(peer: Peer, config: TrainConfig, *, metrics: MetricsWriter | None = None,
          on_round: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Train the configured task on an open ``peer``; returns the last round's record.

    Every peer builds the same model (same seed) and the same data split, then trains on
    its own shard. Each round writes one metrics record: round, time, loss, accuracy,
    bytes_sent, bytes_recv, compute_s, comm_s, wait_s, and every ``eval_every`` rounds the
    consensus distance (mean squared distance of the peers' models to their average) and
    the test accuracy of that average model.
    """
    task = create_task(config.task, seed=config.seed)
    with _INIT_LOCK:
        torch.manual_seed(config.seed)
        model = task.build_model()
    shards = partition(task.train.y, peer.topology.size, scheme=config.partition,
                       alpha=config.alpha, seed=config.seed)
    batches = BatchStream(task.train, shards[peer.rank], batch_size=config.batch_size,
                          seed=config.seed * 1000 + peer.rank)
    optimizer = torch.optim.SGD(model.parameters(), lr=config.lr, momentum=config.momentum)
    probe = peer.add_strategy("ring-allreduce", tag=PROBE_TAG)
    probe_bytes = {"bytes_sent": 0, "bytes_recv": 0}
    start = time.perf_counter()
    record: dict[str, Any] = {}
    for rnd in range(config.rounds):
        before = peer.stats
        t0 = time.perf_counter()
        model.train()
        x, y = batches.next()
        optimizer.zero_grad(set_to_none=False)
        loss = task.loss_fn(model(x), y)
        loss.backward()
        t1 = time.perf_counter()
        peer.step(model, optimizer)
        t2 = time.perf_counter()
        after = peer.stats
        _, accuracy = evaluate(model, task.test, task.loss_fn)
        record = {
            "round": rnd,
            "time": time.perf_counter() - start,
            "loss": loss.item(),
            "accuracy": accuracy,
            "bytes_sent": after["bytes_sent"] - probe_bytes["bytes_sent"],
            "bytes_recv": after["bytes_recv"] - probe_bytes["bytes_recv"],
            "compute_s": t1 - t0,
            "comm_s": t2 - t1,
            "wait_s": after["wait_s"] - before["wait_s"],
            "consensus": None,
            "avg_accuracy": None,
        }
        if rnd % config.eval_every == 0 or rnd == config.rounds - 1:
            record["consensus"], record["avg_accuracy"] = _consensus(model, probe, rnd, task)
            probed = peer.stats
            for key in probe_bytes:
                probe_bytes[key] += probed[key] - after[key]
        if metrics is not None:
            metrics.write(record)
        if on_round is not None:
            on_round(record)
    return record


@torch.no_grad()
def _consensus(model, probe, rnd: int, task) -> tuple[float, float]:
    """Mean squared distance of the peers' parameters to their average, and the average
    model's test accuracy, from one all-reduce of [params, ||params||^2] in float64."""
    params = [p for p in model.parameters()]
    x = parameters_to_vector(params).double()
    mean = probe.synchronize(torch.cat([x, x.dot(x).reshape(1)]), rnd)
    avg, mean_sq = mean[:-1], mean[-1].item()
    distance = max(mean_sq - avg.dot(avg).item(), 0.0)
    own = parameters_to_vector(params).clone()
    vector_to_parameters(avg.to(own.dtype), params)
    _, avg_accuracy = evaluate(model, task.test, task.loss_fn)
    vector_to_parameters(own, params)
    return distance, avg_accuracy
