"""MATCHA gossip: each round, mix only over the matchings a shared seed activates."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from gossip.strategies.base import Strategy
from gossip.strategies.matcha.options import MatchaOptions
from gossip.strategies.matcha.schedule import MatchaSchedule
from gossip.strategies.robust import Mixed
from gossip.transport import Message


class Matcha(Strategy):
    """``x_i <- x_i + alpha * sum_{j active partner} (x_j - x_i)``, i.e. row i of
    ``W(k) = I - alpha L(k)`` applied to the peers' values.

    A round in which this peer is in no active matching returns ``x`` without messages. A
    dead neighbour's edge is never active again: its weight ``alpha`` stays on our own value
    (``1 - alpha * live partners``), which keeps W(k) symmetric and doubly stochastic on the
    survivors without any agreement between them. With ``robust=clip``, each partner's
    difference x_j - x_i is clipped first (gossip/strategies/robust.py).
    """

    options_class = MatchaOptions
    operates_on = "params"
    preserves_mean = True
    symmetric_exchange = True
    can_rejoin = True

    def __init__(self, *, rank, topology, transport, options: MatchaOptions | None = None):
        super().__init__(rank=rank, topology=topology, transport=transport, options=options)
        self.tag = self.options.tag
        self.schedule = MatchaSchedule(rank=rank, topology=topology, transport=transport,
                                       budget=self.options.budget, seed=self.options.seed,
                                       tag=self.tag)
        self.plan = self.schedule.plan
        self.robust = self.options.aggregator_for(topology)
        held = self.capabilities_for(self.options)
        self.preserves_mean, self.checks_own_result = (held["preserves_mean"],
                                                       held["checks_own_result"])
        self.robust_stats: Mixed | None = None  # what robust mixing did in the latest round

    @classmethod
    def capabilities_for(cls, options: MatchaOptions) -> dict[str, Any]:
        return options.robust_capabilities(super().capabilities_for(options))

    def record_fields(self, round: int) -> dict[str, Any]:
        return {} if self.robust is None else (self.robust_stats or Mixed(0.0, 0)).fields()

    @property
    def dropped(self) -> dict[int, int]:
        return self.schedule.dropped

    def round_partners(self, round: int) -> tuple[int, ...]:
        return self.schedule.round_partners(round)

    def state_dict(self) -> dict[str, Any]:
        return {"dropped": dict(self.schedule.dropped)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.schedule.load_dropped(state.get("dropped", {}))

    def rejoin_round(self, rounds: Mapping[int, int]) -> int:
        return self.schedule.first_waiting_round(rounds)

    def synchronize(self, x: torch.Tensor, round: int, *,
                    out: torch.Tensor | None = None) -> torch.Tensor:
        flat, dest = x.reshape(-1), self._output(x, out)
        schedule = self.schedule
        partners = schedule.live_partners(round)
        self.robust_stats = None
        if not partners:  # isolated this round: keep x, send nothing
            if dest.data_ptr() != flat.data_ptr():
                dest.copy_(flat)
            return dest.view_as(x)
        msg = Message(kind=self.tag, round=round, meta={"n": flat.numel()}, buffers=(flat,))
        # Send to all partners before receiving: no pair waits on another (no deadlock).
        sent = [self.transport.send(q, msg, track=True) for q in partners]
        alpha = self.plan.alpha
        # Our own value is still being read by the sockets: accumulate apart, unless out is new.
        acc = dest if out is None else torch.empty_like(flat)
        robust, received = self.robust, []
        if robust is None:
            torch.mul(flat, 1.0 - len(partners) * alpha, out=acc)
        # Matching order keeps the floating-point sum deterministic.
        for q in partners:
            reply = schedule.recv_from(q, round)
            if reply is None:
                if robust is None:
                    acc.add_(flat, alpha=alpha)  # the edge's weight stays with us
            elif robust is None:
                acc.add_(self._expect(reply, flat.numel()), alpha=alpha)
            else:
                received.append(self._expect(reply, flat.numel()))
        if robust is not None:
            self.robust_stats = robust.mix(flat, received, [alpha] * len(received),
                                    1.0 - len(received) * alpha, out=acc)
        schedule.await_sends(partners, sent, round)
        if acc is not dest:
            dest.copy_(acc)
        return dest.view_as(x)
