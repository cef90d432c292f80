"""MATCHA with compressed differences: CHOCO-Gossip on a graph that changes every round.

CHOCO's memory-efficient s-form (choco.py) relies on fixed weights and on every neighbour
hearing every update of a peer's public copy. Under MATCHA an edge that is off carries no
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

from gossip.compress import Compressor, Payload
from gossip.errors import ConfigError, ProtocolError
from gossip.strategies.base import Strategy
from gossip.strategies.choco import default_gamma
from gossip.strategies.matcha import Matcha
from gossip.transport import Message


class ChocoMatcha(Matcha):
    """One MATCHA round whose messages are compressed differences to per-edge public copies.

    Args:
        compressor: Compresses x_i - x̂_i^(j), once per active edge (its key names the edge).
            Unbiased compressors are scaled by their quality, as in ChocoGossip.
        gamma: Consensus step size in (0, 1]; default: ``default_gamma(compressor)``.
        budget, seed, tag: As for Matcha.
    """

    def __init__(self, *, rank, topology, transport, compressor: Compressor,
                 gamma: float | None = None, budget: float = 0.5, seed: int = 0,
                 tag: str = "matcha"):
        super().__init__(rank=rank, topology=topology, transport=transport, budget=budget,
                         seed=seed, tag=tag)
        if gamma is not None and not 0 < gamma <= 1:
            raise ConfigError(f"gamma (CHOCO consensus step) must be in (0, 1], got {gamma}")
        self.compressor = compressor
        self.gamma = gamma
        self.mine: dict[int, torch.Tensor] = {}  # j -> x̂_i^(j), our copy as j holds it
        self.theirs: dict[int, torch.Tensor] = {}  # j -> x̂_j^(i)
        self._tensor: tuple[int, torch.dtype] | None = None  # (numel, dtype) of every round

    def synchronize(self, x: torch.Tensor, round: int, *,
                    out: torch.Tensor | None = None) -> torch.Tensor:
        flat, dest = x.reshape(-1), self._output(x, out)
        self._check_like(flat)
        partners = self._live_partners(round)
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
            reply = self._recv_from(j, round)
            if reply is None:  # j died: the edge is gone, and with it its contributions
                continue
            theirs = self._copy(self.theirs, j, flat)
            try:
                self._apply(Payload(reply.meta, reply.buffers), theirs)
            except ProtocolError as exc:
                raise ProtocolError(f"rank {self.rank}: peer {j} sent a bad {self.tag} "
                                    f"payload in round {round}: {exc}") from None
            step.add_(theirs).sub_(self.mine[j])
        self._await_sends(partners, sent, round)
        torch.add(flat, step, alpha=self.gamma * self.plan.alpha, out=dest)
        return dest.view_as(x)

    def _check_like(self, flat: torch.Tensor) -> None:
        if self._tensor is None:
            self._tensor = (flat.numel(), flat.dtype)
            if self.gamma is None:
                self.gamma = default_gamma(self.compressor, flat.numel())
            self._shrink = (self.compressor.quality(flat.numel()) if self.compressor.unbiased
                            else 1.0)
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
        return {**super().state_dict(), "mine": self.mine, "theirs": self.theirs,
                "gamma": self.gamma}

    def load_state_dict(self, state) -> None:
        """Restore ``state_dict``. Only a whole job restarted together can use it: in a
        running job the partners' replicas of our copies have moved on (``rejoin_round``
        refuses)."""
        super().load_state_dict(state)
        self.mine, self.theirs = dict(state["mine"]), dict(state["theirs"])
        self.gamma = state["gamma"]
        for copy in self.mine.values():
            self._check_like(copy)
            break

    def rejoin_round(self, rounds) -> int:
        return Strategy.rejoin_round(self, rounds)  # refuses: see load_state_dict
