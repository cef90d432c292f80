"""MATCHA gossip: each round, mix only over the matchings a shared seed activates."""

from __future__ import annotations

import numbers

import torch

from gossip.errors import ConfigError
from gossip.strategies.base import STRATEGIES, Strategy
from gossip.topology import matcha
from gossip.transport import Message


@STRATEGIES.register("matcha")
class Matcha(Strategy):
    """``x_i <- x_i + alpha * sum_{j active partner} (x_j - x_i)``, i.e. row i of
    ``W(k) = I - alpha L(k)`` applied to the peers' values.

    Every peer computes the same plan (matchings, probabilities, alpha) from the topology
    and the same activations from ``(seed, round)``, so no extra messages are needed. A
    round in which this peer is in no active matching returns ``x`` without messages.

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

    @property
    def kinds(self) -> tuple[str, ...]:
        return (self.tag,)

    def round_partners(self, round: int) -> tuple[int, ...]:
        """This peer's partners in ``round``, in matching order (distinct: each edge is
        in exactly one matching)."""
        return tuple(self.partners[j] for j in self.plan.active(round, self.seed)
                     if self.partners[j] is not None)

    def synchronize(self, x: torch.Tensor, round: int, *,
                    out: torch.Tensor | None = None) -> torch.Tensor:
        flat, dest = x.reshape(-1), self._output(x, out)
        partners = self.round_partners(round)
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
            reply = self.transport.recv(src=q, kind=self.tag, round=round)
            acc.add_(self._expect(reply, flat.numel()), alpha=alpha)
        for delivery in sent:
            delivery.wait()
        if acc is not dest:
            dest.copy_(acc)
        return dest.view_as(x)
