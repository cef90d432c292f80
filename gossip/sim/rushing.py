"""The simulator's oracle for rushing attackers: every honest model of the round, first.

The spec's omniscient attacker sees each honest peer's model of a round before it sends its
own. Real attackers know only what their neighbours send them (gossip/attacks/sender.py);
the simulator runs every peer in one process, so it can do better: each honest peer's
transport is wrapped in ``Publishing``, which puts the model of each message of its
strategies on a ``Board`` as it goes out (the probe's too, dropped with its round), and an attacker's ``Oracle`` waits (in virtual
time) until the models it needs are there: its destinations' and their honest neighbours'.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch


class Board:
    """The round's published models, by (kind, round) and rank, until every attacker has
    moved past that round."""

    def __init__(self, world, topology, attackers):
        self.world, self.topology, self.attackers = world, topology, frozenset(attackers)
        self.models: dict[tuple[str, int], dict[int, torch.Tensor]] = {}
        self.waiting: list = []
        self.asked: dict[int, int] = {}  # attacker -> the last round it read

    def publish(self, rank: int, kind: str, round: int, x: torch.Tensor) -> None:
        entry = self.models.setdefault((kind, round), {})
        if rank in entry:  # the same model, to another neighbour
            return
        entry[rank] = x.detach().reshape(-1).clone()
        waiting, self.waiting = self.waiting, []
        for task in waiting:
            self.world.scheduler.wake(task)

    def read(self, attacker: int, kind: str, round: int, ranks: set[int],
             timeout: float) -> dict[int, torch.Tensor]:
        """The models of ``ranks`` in ``round``, once each is published or its peer ended."""
        scheduler = self.world.scheduler
        deadline = scheduler.now + timeout
        entry = self.models.setdefault((kind, round), {})
        while (any(r not in entry and r not in self.world.ended_at for r in ranks)
               and scheduler.now < deadline):
            self.waiting.append(scheduler.current)
            scheduler.park(deadline)
        known = {r: entry[r] for r in ranks if r in entry}
        self.asked[attacker] = round
        if len(self.asked) == len(self.attackers):  # every attacker past older rounds
            oldest = min(self.asked.values())
            for key in [key for key in self.models if key[1] < oldest]:
                del self.models[key]
        return known


class Oracle:
    """One attacker's view of the board (``Attack.oracle``)."""

    def __init__(self, board: Board, rank: int, timeout: float):
        self.board, self.rank, self.timeout = board, rank, timeout

    def models(self, kind: str, round: int, destinations) -> dict[int, torch.Tensor]:
        board = self.board
        ranks = set(destinations) | {j for d in destinations for j in board.topology.neighbors(d)
                                     if j not in board.attackers}
        return board.read(self.rank, kind, round, ranks, self.timeout)


class Publishing:
    """An honest peer's transport that also publishes the model of each message its
    strategies send (the first float tensor) on the board; the transport's own messages
    never pass here. Everything else is the transport's own."""

    def __init__(self, transport, board: Board):
        self.inner, self.board = transport, board

    def send(self, dst: int, msg, *, track: bool = False):
        if msg.buffers and msg.buffers[0].is_floating_point():
            self.board.publish(self.inner.rank, msg.kind, msg.round, msg.buffers[0])
        return self.inner.send(dst, msg, track=track)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def rushing(board: Board | None, transport, attack, timeout: float):
    """Simulated peer's ``(transport, attack)`` with ``board`` (None: as they are): an
    honest peer publishes its models, an attacker reads the board."""
    if board is None:
        return transport, attack
    if attack is None:
        return Publishing(transport, board), None
    return transport, dataclasses.replace(attack, oracle=Oracle(board, transport.rank, timeout))
