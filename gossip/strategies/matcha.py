"""MATCHA gossip: each round, mix only over the matchings a shared seed activates."""

from __future__ import annotations

import logging
import numbers
from collections.abc import Mapping
from typing import Any

import torch

from gossip.compress import Compressor
from gossip.errors import ConfigError, PeerGone, RejoinError
from gossip.strategies.base import STRATEGIES, Strategy
from gossip.topology import matcha
from gossip.transport import Message

log = logging.getLogger("gossip.strategies")


@STRATEGIES.register("matcha")
def matcha_strategy(*, rank, topology, transport, budget: float = 0.5, seed: int = 0,
                    tag: str = "matcha", compressor: Compressor | None = None,
                    gamma: float | None = None) -> Strategy:
    """Exact MATCHA, or with a compressor CHOCO's compressed differences on per-edge public
    copies (matcha_choco.py) with consensus step ``gamma``."""
    if compressor is None:
        if gamma is not None:
            raise ConfigError("gamma is CHOCO's consensus step: it needs a compressor")
        return Matcha(rank=rank, topology=topology, transport=transport, budget=budget,
                      seed=seed, tag=tag)
    from gossip.strategies.choco import check_choco_compressor
    from gossip.strategies.matcha_choco import ChocoMatcha

    check_choco_compressor(compressor)
    return ChocoMatcha(rank=rank, topology=topology, transport=transport, budget=budget,
                       seed=seed, tag=tag, compressor=compressor, gamma=gamma)


class Matcha(Strategy):
    """``x_i <- x_i + alpha * sum_{j active partner} (x_j - x_i)``, i.e. row i of
    ``W(k) = I - alpha L(k)`` applied to the peers' values.

    Every peer computes the same plan (matchings, probabilities, alpha) from the topology
    and the same activations from ``(seed, round)``, so no extra messages are needed. A
    round in which this peer is in no active matching returns ``x`` without messages.

    An edge to a neighbour the transport declares dead is never active again: its weight
    ``alpha`` stays on our own value (``1 - alpha * live partners``), which keeps W(k)
    symmetric and doubly stochastic on the survivors without any agreement between them.

    Args:
        budget: Communication budget C_b in (0, 1]: expected active matchings per round
            are at most ``C_b * M`` (1: every matching every round, i.e. D-PSGD with
            ``W = I - alpha L``).
        seed: Seed of the activation schedule, the same on every peer.
        tag: Message kind, distinct per instance sharing one transport.

    Raises:
        ConfigError: budget outside (0, 1] or a negative or non-integer seed.
    """

    operates_on = "params"

    def __init__(self, *, rank, topology, transport, budget: float = 0.5, seed: int = 0,
                 tag: str = "matcha"):
        super().__init__(rank=rank, topology=topology, transport=transport)
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0:
            raise ConfigError(f"seed: expected a non-negative integer, got {seed!r}")
        self.plan = matcha.plan(topology, budget)
        self.seed = int(seed)
        self.tag = tag
        self.partners = self.plan.partners(rank)
        self.dropped: dict[int, int] = {}  # dead neighbour -> round it was dropped in
        # At once, so a neighbour dying before its edge is first active is noticed too.
        transport.connect(sorted({q for q in self.partners if q is not None}))

    @property
    def kinds(self) -> tuple[str, ...]:
        return (self.tag,)

    def round_partners(self, round: int) -> tuple[int, ...]:
        """This peer's partners in ``round``, in matching order (distinct: each edge is
        in exactly one matching)."""
        return tuple(self.partners[j] for j in self.plan.active(round, self.seed)
                     if self.partners[j] is not None and self.partners[j] not in self.dropped)

    def drop(self, q: int, round: int) -> None:
        """Take dead neighbour ``q`` out for good: its edge is never active again."""
        if q not in self.dropped:
            self.dropped[q] = round
            log.warning("rank %d: dropped dead neighbour %d in round %d; its edge's weight "
                        "stays on this peer's own value", self.rank, q, round)

    def _live_partners(self, round: int) -> tuple[int, ...]:
        """``round_partners`` after dropping the neighbours the transport knows are dead."""
        for q in set(self.partners) & self.transport.membership.firsthand():
            self.drop(q, round)
        return self.round_partners(round)

    def _recv_from(self, q: int, round: int) -> Message | None:
        """``q``'s message of ``round``, or None if ``q`` is found dead meanwhile (dropped)."""
        try:
            return self.transport.recv(src=q, kind=self.tag, round=round)
        except PeerGone as exc:
            if exc.rank != q:
                raise
            self.drop(q, round)
            return None

    def _await_sends(self, partners: tuple[int, ...], sent: list, round: int) -> None:
        """Wait until the partners' messages are sent, dropping one found dead meanwhile
        (its message then counted for this round)."""
        for q, delivery in zip(partners, sent):
            if q in self.dropped:  # it will never read it
                continue
            try:
                delivery.wait()
            except PeerGone as exc:
                if exc.rank != q:
                    raise
                self.drop(q, round)

    def state_dict(self) -> dict[str, Any]:
        return {"dropped": dict(self.dropped)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for q, round in dict(state.get("dropped", {})).items():
            self.drop(int(q), int(round))

    def rejoin_round(self, rounds: Mapping[int, int]) -> int:
        """The earliest round in which a neighbour will wait for us: for each, the first
        round from the one it is at in which our edge is active."""
        firsts = []
        for q in {q for q in self.partners if q is not None} - set(self.dropped):
            if q in rounds:
                # Bounded: an edge whose matching is never drawn never waits for us.
                first = next((k for k in range(rounds[q], rounds[q] + 10_000)
                              if q in self.round_partners(k)), None)
                if first is not None:
                    firsts.append(first)
        if not firsts:
            raise RejoinError(f"rank {self.rank}: no neighbour takes this peer back (they "
                              f"dropped it as dead before it returned: give them a --dead-after "
                              f"longer than a restart)")
        return min(firsts)

    def synchronize(self, x: torch.Tensor, round: int, *,
                    out: torch.Tensor | None = None) -> torch.Tensor:
        flat, dest = x.reshape(-1), self._output(x, out)
        partners = self._live_partners(round)
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
        torch.mul(flat, 1.0 - len(partners) * alpha, out=acc)
        # Matching order keeps the floating-point sum deterministic.
        for q in partners:
            reply = self._recv_from(q, round)
            if reply is None:
                acc.add_(flat, alpha=alpha)  # the edge's weight stays with us
            else:
                acc.add_(self._expect(reply, flat.numel()), alpha=alpha)
        self._await_sends(partners, sent, round)
        if acc is not dest:
            dest.copy_(acc)
        return dest.view_as(x)
