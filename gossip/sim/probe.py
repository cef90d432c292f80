"""The consensus probe computed by the simulator instead of exchanged (``--probe oracle``).

The real probe (gossip/training/consensus.py) is a ring all-reduce over every peer: 2(P-1) messages
per peer, two million of them per probe at P = 1,000, which would take a simulation far
longer than the training it measures. The simulator can see every model, so it computes the
same quantities directly: the peers meet (as the all-reduce makes them), the last to arrive
averages the parameters in float64 in rank order, and everyone gets the consensus distance
and the average model's accuracy. It costs no virtual time and sends nothing, and its values
equal the exchanged probe's up to float64 rounding (not bitwise: a different summation).
"""

from __future__ import annotations

import torch
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from gossip.tasks import evaluate
from gossip.training.consensus import some_rank_only_serves


class Meetings:
    """Each probed round's parameter vectors, by rank, until every live peer has given its;
    the mean is over the ranks not ``left_out`` (a run's attackers, as the real probe)."""

    def __init__(self, world, *, left_out: frozenset[int] = frozenset()):
        self.world, self.left_out = world, left_out
        self.rounds: dict[int, dict] = {}

    def meet(self, round: int, rank: int, x: torch.Tensor, timeout: float, members):
        """Give ``x``; returns the mean model (float64) once every one of ``members`` (the
        ranks, or an elastic run's view: the same for all of them in a round) gave theirs,
        or None if a peer ended (it never will)."""
        world, scheduler = self.world, self.world.scheduler
        meeting = self.rounds.setdefault(round, {"vectors": {}, "waiting": [], "mean": None})
        meeting["vectors"][rank] = x
        if len(meeting["vectors"]) == len(members):
            vectors = meeting["vectors"]
            stacked = torch.stack([vectors[r] for r in sorted(members)
                                   if r not in self.left_out])
            meeting["mean"] = (stacked.mean(dim=0), (stacked * stacked).sum(dim=1).mean())
            del self.rounds[round]
            for task in meeting["waiting"]:
                scheduler.wake(task)
            return meeting["mean"]
        meeting["waiting"].append(scheduler.current)
        deadline = scheduler.now + timeout
        while meeting["mean"] is None and not world.ended_at and scheduler.now < deadline:
            scheduler.park(deadline)
        return meeting["mean"]


class OracleProbe:
    """A ``ConsensusProbe`` stand-in for one simulated peer (same ``measure``)."""

    def __init__(self, meetings: Meetings, peer, task):
        self.meetings, self.peer, self.task = meetings, peer, task

    @torch.no_grad()
    def measure(self, model: torch.nn.Module, round: int) -> tuple[float | None, float | None]:
        if not self.peer.all_peers_can_meet(round) or self.meetings.world.ended_at or \
                some_rank_only_serves(self.peer.topology):  # it would never meet
            return None, None
        params = list(model.parameters())
        own = parameters_to_vector(params).clone()
        view = self.peer.view
        members = range(self.meetings.world.size) if view is None else view.members
        mean = self.meetings.meet(round, self.peer.rank, own.double(), self.peer.timeout,
                                  members)
        if mean is None:
            return None, None
        avg, mean_sq = mean
        distance = max(mean_sq.item() - avg.dot(avg).item(), 0.0)
        vector_to_parameters(avg.to(own.dtype), params)
        _, avg_accuracy = evaluate(model, self.task.test, self.task.loss_fn)
        vector_to_parameters(own, params)
        return distance, avg_accuracy
