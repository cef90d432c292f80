"""MATCHA with compressed differences: CHOCO-Gossip on a graph that changes every round.

CHOCO's memory-efficient s-form (strategies/dpsgd/choco.py) relies on fixed weights and on
every neighbour hearing every update of a peer's public copy. Under MATCHA an edge that is off carries no
message, so one public copy per peer would drift apart between the neighbours that heard an
update and those that did not. Here each edge (i, j) has its own pair of public copies,
x̂_i^(j) (what j knows of i) and x̂_j^(i), held bit for bit by both ends and advanced only in
rounds where the edge is active. For each active partner j:

    q_i = Q(x_i - x̂_i^(j)) is sent;  x̂_i^(j) += q_i;  x̂_j^(i) += q_j (received)
    x_i += gamma * alpha * sum_j (x̂_j^(i) - x̂_i^(j))

The two ends of an edge add opposite amounts, so the peers' average is preserved for any Q;
with Q the identity and gamma 1 it is exact MATCHA.
Memory: two copies per neighbour. A neighbour found dead is dropped with its edge: the
survivors' edges still cancel pairwise, so they keep reaching consensus.
"""

from __future__ import annotations

import torch

from gossip.compress import Payload
from gossip.errors import ConfigError, ProtocolError
from gossip.strategies.base import Strategy
from gossip.strategies.dpsgd.compression import default_gamma, shrink
from gossip.strategies.matcha.options import MatchaOptions
from gossip.strategies.matcha.schedule import MatchaSchedule
from gossip.transport import Message


class ChocoMatcha(Strategy):
    """One MATCHA round whose messages are compressed differences to per-edge public copies
    (``matcha`` with a compressor, which compresses x_i - x̂_i^(j) once per active edge; its
    key names the edge). A restarted peer cannot rejoin: the partners' replicas of its copies
    have moved on."""

    options_class = MatchaOptions
    operates_on = "params"
    preserves_mean = True
    symmetric_exchange = True

    def __init__(self, *, rank, topology, transport, options: MatchaOptions | None = None):
        super().__init__(rank=rank, topology=topology, transport=transport, options=options)
        if self.options.compressor is None:
            raise ConfigError("MATCHA with CHOCO differences needs a compressor")
        self.tag = self.options.tag
        self.schedule = MatchaSchedule(rank=rank, topology=topology, transport=transport,
                                       budget=self.options.budget, seed=self.options.seed,
                                       tag=self.tag)
        self.plan = self.schedule.plan
        self.compressor = self.options.compressor
        self.gamma = self.options.gamma
        self.mine: dict[int, torch.Tensor] = {}  # j -> x̂_i^(j), our copy as j holds it
        self.theirs: dict[int, torch.Tensor] = {}  # j -> x̂_j^(i)
        self._tensor: tuple[int, torch.dtype] | None = None  # (numel, dtype) of every round

    @property
    def dropped(self) -> dict[int, int]:
        return self.schedule.dropped

    def synchronize(self, x: torch.Tensor, round: int, *,
                    out: torch.Tensor | None = None) -> torch.Tensor:
        flat, dest = x.reshape(-1), self._output(x, out)
        self._check_like(flat)
        schedule = self.schedule
        partners = schedule.live_partners(round)
        sent = []
        for j in partners:
            mine = self._copy(self.mine, j, flat)
            payload = self.compressor.compress(flat - mine, key=f"{self.tag}.{j}", round=round)
            sent.append(self.transport.send(j, Message(kind=self.tag, round=round,
                                                       meta=dict(payload.meta),
                                                       buffers=payload.buffers)))
            self._apply(payload, mine)  # exactly as j applies it to its replica
        step = torch.zeros_like(flat)
        for j in partners:  # matching order: deterministic floating-point sums
            reply = schedule.recv_from(j, round)
            if reply is None:  # j died: the edge is gone, and with it its contributions
                continue
            theirs = self._copy(self.theirs, j, flat)
            try:
                self._apply(Payload(reply.meta, reply.buffers), theirs)
            except ProtocolError as exc:
                raise ProtocolError(f"rank {self.rank}: peer {j} sent a bad {self.tag} "
                                    f"payload in round {round}: {exc}") from None
            step.add_(theirs).sub_(self.mine[j])
        schedule.await_sends(partners, sent, round)
        torch.add(flat, step, alpha=self.gamma * self.plan.alpha, out=dest)
        return dest.view_as(x)

    def _check_like(self, flat: torch.Tensor) -> None:
        if self._tensor is None:
            self._tensor = (flat.numel(), flat.dtype)
            if self.gamma is None:
                self.gamma = default_gamma(self.compressor, flat.numel())
            self._shrink = shrink(self.compressor, flat.numel())
        elif self._tensor != (flat.numel(), flat.dtype):
            raise ConfigError(f"rank {self.rank}: CHOCO keeps public copies of one tensor of "
                              f"{self._tensor[0]} {self._tensor[1]}; got {flat.numel()} "
                              f"{flat.dtype} (use one strategy instance per tensor)")

    @staticmethod
    def _copy(copies: dict[int, torch.Tensor], j: int, flat: torch.Tensor) -> torch.Tensor:
        """The public copy for edge j, zero until the edge's first activation (on both ends)."""
        if j not in copies:
            copies[j] = torch.zeros_like(flat)
        return copies[j]

    def _apply(self, payload: Payload, target: torch.Tensor) -> None:
        self.compressor.add_to(payload, target, alpha=self._shrink)

    def state_dict(self) -> dict:
        """Per-edge public copies, step size and dropped neighbours."""
        return {"dropped": dict(self.schedule.dropped), "mine": self.mine,
                "theirs": self.theirs, "gamma": self.gamma}

    def load_state_dict(self, state) -> None:
        """Restore ``state_dict``. Only a whole job restarted together can use it: in a
        running job the partners' replicas of our copies have moved on (``rejoin_round``
        refuses)."""
        self.schedule.load_dropped(state.get("dropped", {}))
        self.mine, self.theirs = dict(state["mine"]), dict(state["theirs"])
        self.gamma = state["gamma"]
        for copy in self.mine.values():
            self._check_like(copy)
            break
