"""The consensus probe: how far apart the peers' models are, measured exactly by an
all-reduce of its own whose bytes the training's byte counts leave out."""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from gossip.errors import CollectiveAborted, PeerGone
from gossip.peer import Peer
from gossip.strategies import EXACT_MEAN
from gossip.tasks import Task, evaluate

PROBE_TAG = "probe"  # the probe's message kinds start with "probe."
log = logging.getLogger("gossip.training")  # part of the training's log, as it always was


def some_rank_only_serves(topology) -> bool:
    """Whether a rank of ``topology`` only serves (roles): it never joins a probe."""
    roles = topology.roles  # O(1): the oracle probe asks every peer every probe
    return roles is not None and len(roles.workers) < topology.size


class ConsensusProbe:
    """Measures the peers' consensus with an exact-mean strategy added to ``peer``.

    ``left_out`` ranks (a run's attackers) still join the all-reduce, which needs every
    peer, but add nothing to it: distance and average model are the other peers' own."""

    def __init__(self, peer: Peer, task: Task, *, left_out: frozenset[int] = frozenset()):
        self.peer, self.task = peer, task
        self.left_out = left_out
        self.strategy = peer.add_strategy(EXACT_MEAN, tag=PROBE_TAG)
        self.epoch: int | None = None  # an elastic run's view it runs on (regroup)

    def measure(self, model: torch.nn.Module, round: int) -> tuple[float | None, float | None]:
        """The consensus distance and the average model's test accuracy, or (None, None)
        when the probe cannot run: it is an all-reduce over every peer, so a lost peer (or a
        rejoin under way) ends it, and training goes on."""
        if not self.peer.all_peers_can_meet(round) or some_rank_only_serves(
                self.peer.topology) or not self.peer.strategy.synchronous:
            # A lost peer; ranks that only serve (they never probe); or no global round:
            # a peer in the probe would stop answering the others (an async server).
            return None, None
        view = self.peer.view
        if view is not None and view.epoch != self.epoch:  # over the view's members
            self.strategy.regroup(view.slot(self.peer.rank), view.members, view.epoch)
            self.epoch = view.epoch
        try:
            return self._measure(model, round)
        except (PeerGone, CollectiveAborted) as exc:
            log.info("rank %d: no consensus probe in round %d: %s", self.peer.rank, round, exc)
            return None, None

    @torch.no_grad()
    def _measure(self, model: torch.nn.Module, round: int) -> tuple[float, float]:
        """Mean squared distance of the peers' parameters to their average, and the average
        model's test accuracy, from one all-reduce of [params, ||params||^2] in float64
        (with ranks left out: [params, ||params||^2, 1], zeros from those, over its last)."""
        params = [p for p in model.parameters()]
        x = parameters_to_vector(params).double()
        parts = [x, x.dot(x).reshape(1)]
        if self.left_out:
            parts.append(torch.ones(1, dtype=x.dtype))
            if self.peer.rank in self.left_out:
                parts = [torch.zeros_like(part) for part in parts]
        with self.peer.communicating():
            mean = self.strategy.synchronize(torch.cat(parts), round)
        if self.left_out:
            mean = mean[:-1] / mean[-1]  # the mean over the counted peers only
        avg, mean_sq = mean[:-1], mean[-1].item()
        distance = max(mean_sq - avg.dot(avg).item(), 0.0)
        own = parameters_to_vector(params).clone()
        vector_to_parameters(avg.to(own.dtype), params)
        _, avg_accuracy = evaluate(model, self.task.test, self.task.loss_fn)
        vector_to_parameters(own, params)
        return distance, avg_accuracy


def algorithm_bytes(stats: dict[str, Any]) -> tuple[int, int]:
    """Bytes sent and received so far (``Peer.stats``), without the consensus probe's: it
    measures the run, it is not part of the algorithm. Counted per kind by the transport, so
    a probe message that arrives before this peer's own probe (from a faster peer) is still
    left out."""
    probe = [counts for kind, counts in stats["by_kind"].items()
             if kind.startswith(f"{PROBE_TAG}.")]
    return (stats["bytes_sent"] - sum(c["bytes_sent"] for c in probe),
            stats["bytes_recv"] - sum(c["bytes_recv"] for c in probe))
