"""The send-side wrapper that makes a peer an attacker without changing any strategy.

``Attacker`` wraps the peer's transport: the peer runs its strategy as every other peer does,
over the same sockets and keys, but each message of the strategy's kinds carries the attack's
payload for its destination instead of the model; control messages, goodbyes and the
consensus probe go out as they are (they never pass through ``send`` here).

Kinds that need the neighbours' models are rushing: the attacker holds back its messages of a
round until its strategy first reads in that round (gossip sends to every neighbour, then
receives; every round-keyed read starts with ``recv`` or ``at_round``), receives the round's
model from each honest destination first (symmetric gossip: every destination sends to it
too), puts those messages back for its strategy, computes each destination's payload and
sends. Attackers never wait for each other. What an attacker knows is thus what it receives:
the destination's model and those of the destination's honest neighbours that are also its
own.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from typing import Any

import torch

from gossip.attacks.kinds import View
from gossip.attacks.spec import Attack, refusal
from gossip.errors import ConfigError, PeerGone
from gossip.strategies.base import CAPABILITIES
from gossip.transport import Message


class Held:
    """The handle of a message held back until the round's models came (``Delivery``'s
    interface): waiting sends it first."""

    def __init__(self, attacker: Attacker):
        self.attacker, self.delivery = attacker, None

    def wait(self, timeout: float | None = None) -> None:
        self.attacker.release()
        self.delivery.wait(timeout)


class Received:
    """What a rushing attacker knows on real peers: the round's model of each honest
    destination, received from it first and put back for the strategy."""

    def __init__(self, transport):
        self.transport = transport

    def models(self, kind: str, round: int, destinations) -> dict[int, torch.Tensor]:
        known = {}
        for dst in destinations:
            try:
                reply = self.transport.recv(src=dst, kind=kind, round=round)
            except PeerGone as exc:  # the strategy's own receive will meet it
                if exc.rank != dst:
                    raise
                continue
            self.transport.inbox.put_back(reply)
            known[dst] = reply.buffers[0]
        return known


class Attacker:
    """``transport`` wrapped so that the strategy's messages carry ``attack``'s payloads.

    Everything but ``send``, ``recv`` and ``at_round`` is the wrapped transport's own.

    Args:
        transport: The peer's transport.
        attack: Its attack, resolved for the run (``Attack.resolved``).
        topology: The run's topology (the destinations' neighbours and weights).
    """

    def __init__(self, transport, attack: Attack, topology):
        self.inner, self.attack, self.topology = transport, attack, topology
        self.aimed: frozenset[str] = frozenset()
        self.mixing = topology.mixing_matrix()
        self.held: list[tuple[int, Message, bool, Held]] = []
        self.history: dict[str, deque[tuple[int, torch.Tensor]]] = {}
        self.knowledge = attack.oracle or Received(transport)

    def aim(self, strategy) -> None:
        """Attack ``strategy``'s messages from now on (its kinds).

        Raises:
            ConfigError: the attack does not fit the strategy (``spec.refusal``).
        """
        why = refusal(self.attack.kind, type(strategy).__name__,
                      {key: getattr(strategy, key) for key in CAPABILITIES})
        if why:
            raise ConfigError(why)
        self.aimed |= frozenset(strategy.kinds)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def send(self, dst: int, msg: Message, *, track: bool = False):
        if msg.kind not in self.aimed or not msg.buffers or not msg.buffers[0].is_floating_point():
            return self.inner.send(dst, msg, track=track)
        if self.attack.kind.needs == "neighbours":
            handle = Held(self)
            self.held.append((dst, msg, track, handle))
            return handle
        return self.inner.send(dst, self.attacked(dst, msg, self.view(dst, msg)), track=track)

    def recv(self, **match) -> Message:
        self.release()
        return self.inner.recv(**match)

    def at_round(self, round: int) -> None:
        self.release()
        self.inner.at_round(round)

    def release(self) -> None:
        """Send the held messages: receive the round's models of the honest destinations
        first (never those of attackers), then each destination's payload."""
        held, self.held = self.held, []
        destinations: dict[tuple[str, int], list[int]] = {}
        for dst, msg, _, _ in held:
            if dst not in self.attack.attackers:
                destinations.setdefault((msg.kind, msg.round), []).append(dst)
        models = {key: self.knowledge.models(*key, dsts) for key, dsts in destinations.items()}
        for dst, msg, track, handle in held:
            view = self.view(dst, msg, models.get((msg.kind, msg.round), {}))
            payload = msg if view.target is None else self.attacked(dst, msg, view)
            handle.delivery = self.inner.send(dst, payload, track=track)

    def view(self, dst: int, msg: Message, known: dict[int, torch.Tensor] | None = None) -> View:
        """What this attacker knows when it sends ``msg`` to ``dst``."""
        own, attack = msg.buffers[0].reshape(-1), self.attack
        weights = {j: float(self.mixing[dst][j]) for j in self.topology.neighbors(dst)}
        view = View(rank=self.inner.rank, dst=dst, round=msg.round, seed=attack.seed, own=own,
                    weights=weights, attackers=attack.attackers)
        if attack.kind.needs == "history":
            view = dataclasses.replace(view, old=self.remember(msg.kind, msg.round, own))
        if known is not None and dst in known:
            honest = {j: known[j].reshape(-1) for j in weights
                      if j in known and j not in attack.attackers}
            view = dataclasses.replace(view, target=known[dst].reshape(-1), honest=honest)
        return view

    def remember(self, kind: str, round: int, own: torch.Tensor) -> torch.Tensor:
        """Keep ``own`` as the model of ``round``; the kept one of round ``round - k``
        (the oldest kept before then)."""
        k = self.attack.kind.k
        kept = self.history.setdefault(kind, deque(maxlen=k + 1))
        if not kept or kept[-1][0] != round:
            kept.append((round, own.clone()))
        return kept[0][1]

    def attacked(self, dst: int, msg: Message, view: View) -> Message:
        """``msg`` with the attack's payload for ``dst`` instead of the model."""
        payload = self.attack.kind.payload(view).reshape(msg.buffers[0].shape)
        return dataclasses.replace(msg, buffers=(payload, *msg.buffers[1:]), wire=())
