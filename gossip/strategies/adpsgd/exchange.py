"""AD-PSGD's lock-free pairwise exchange (sync-modes spec, section 3).

The requester sends a copy x_s of its model to a random neighbour; the responder replies
with its current x_r and sets x_r += (x_s - x_r) / 2; the requester, when the reply
arrives, sets x += (x_r - x_s) / 2. The two moves are equal and opposite, so the sum of the
models changes only by the peers' own steps, and with no step in between the pair ends at
exactly its average. Nobody waits for anybody: a peer has at most one request out, answers
requests whenever it polls, and goes on computing while its own is under way.

Ending: ``finish`` stops starting exchanges, waits for its last reply (answering others
meanwhile), tells its neighbours ``done`` and answers them until each has said ``done``
too, so peers that stop at different times all exit, and no exchange is cut in half. A
neighbour busy computing is waited for as long as it is alive (``Silence``), however long it
takes. A dead neighbour is skipped: never chosen again, not waited for; an exchange under way
with it is abandoned (its half on the dead side is lost with it). A neighbour that left (its
goodbye came, e.g. it took no step) is not waited for either.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Mapping
from typing import Any

import networkx as nx
import torch

from gossip.errors import ConfigError, PeerTimeout, ProtocolError
from gossip.strategies.adpsgd.options import ADPSGDOptions
from gossip.strategies.base import Strategy
from gossip.transport import Message
from gossip.transport.windowed import Silence

log = logging.getLogger("gossip.strategies")
WAIT_S = 0.05  # how long ``finish`` waits for a message before checking liveness again


class ADPSGD(Strategy):
    """Asynchronous pairwise gossip on the topology's graph. ``synchronize`` mixes into the
    tensor it is given (kept: later polls move it too), starting an exchange when none of
    ours is under way; ``poll`` answers and applies what has arrived."""

    options_class = ADPSGDOptions
    operates_on = "params"
    synchronous = False
    keeps_tensor = True

    def __init__(self, *, rank, topology, transport, options: ADPSGDOptions | None = None):
        super().__init__(rank=rank, topology=topology, transport=transport, options=options)
        self.request_kind, self.reply_kind, self.done_kind, self.hello_kind = self.options.kinds
        self.neighbors = topology.neighbors(rank)
        self.active = self._starts_exchanges(topology)
        self.rng = random.Random(self.options.seed * 1_000_003 + rank)
        self.model: torch.Tensor | None = None  # the tensor exchanges move
        self.outstanding: tuple[int, int, torch.Tensor] | None = None  # (peer, id, x_s)
        self.next_id = 0
        self.done_from: set[int] = set()
        self.hello_from: set[int] = set()
        self.finished = False
        self.exchanges = 0  # replies applied: completed exchanges this peer started
        self.answered = 0  # requests answered
        transport.connect(self.neighbors)

    def _starts_exchanges(self, topology) -> bool:
        if not self.options.bipartite:
            return True
        if not nx.is_bipartite(topology.graph):
            odd = next(c for c in nx.cycle_basis(topology.graph) if len(c) % 2)
            raise ConfigError(f"bipartite: the graph of {topology.name or 'the topology'} is "
                              f"not 2-colourable (odd cycle {'-'.join(map(str, odd))}); drop "
                              f"bipartite or use a bipartite graph")
        colour = nx.bipartite.color(topology.graph)
        return colour[self.rank] == colour[0]  # rank 0's side asks

    def synchronize(self, x: torch.Tensor, round: int, *,
                    out: torch.Tensor | None = None) -> torch.Tensor:
        flat, dest = x.reshape(-1), self._output(x, out)
        if dest.data_ptr() != flat.data_ptr():
            dest.copy_(flat)
        if self.model is None:
            self.model = dest
            self._greet()
        self.model = dest
        self.poll()
        if self.outstanding is None and self.active and not self.finished:
            self._request()
        return dest.view_as(x)

    def poll(self) -> None:
        """Answer the requests and apply the replies that have arrived; never waits."""
        inbox = self.transport.inbox
        while True:
            request = inbox.take_arrived(self.request_kind)
            if request is not None:
                self._answer(request)
            reply = inbox.take_arrived(self.reply_kind)
            if reply is not None:
                self._apply(reply)
            done = inbox.take_arrived(self.done_kind)
            if done is not None:
                self.done_from.add(done.src)
            hello = inbox.take_arrived(self.hello_kind)
            if hello is not None:
                self.hello_from.add(hello.src)
            if request is None and reply is None and done is None and hello is None:
                break
        self._forget_dead()

    def finish(self) -> None:
        """Start no more exchanges, complete ours, then answer the neighbours until each
        said it is done too (or is dead)."""
        if self.finished:
            return
        self.finished = True
        if self.model is None:  # never took part (nor greeted): nobody waits for this peer
            return
        self._until(lambda: self.outstanding is None, "its last exchange's reply",
                    lambda: self.outstanding[:1] if self.outstanding else ())
        for j in self._alive():
            self.transport.send(j, Message(kind=self.done_kind, round=0))
        self._until(lambda: not set(self._alive()) - self.done_from, "every neighbour's done",
                    lambda: set(self._alive()) - self.done_from)

    def _greet(self) -> None:
        """Start together: tell the neighbours this peer is up and wait until each said so
        too (or is dead), so that no peer trains alone while the others are starting."""
        for j in self._alive():
            self.transport.send(j, Message(kind=self.hello_kind, round=0))
        self._until(lambda: not set(self._alive()) - self.hello_from, "every neighbour's hello",
                    lambda: set(self._alive()) - self.hello_from)

    # -- the exchange ------------------------------------------------------------------------

    def _request(self) -> None:
        partners = self._alive()
        if not partners:
            return
        j = self.rng.choice(partners)
        sent = self.model.clone()  # x_s: the model moves on while the request is out
        self.outstanding = (j, self.next_id, sent)
        self.transport.send(j, Message(kind=self.request_kind, round=self.next_id,
                                       meta={"n": sent.numel()}, buffers=(sent,)))
        self.next_id += 1

    def _answer(self, request: Message) -> None:
        theirs = self._expect(request, self.model.numel())
        mine = self.model.clone()  # x_r as it is now
        self.transport.send(request.src, Message(kind=self.reply_kind, round=request.round,
                                                 meta={"n": mine.numel()}, buffers=(mine,)))
        self.model.add_(theirs.sub(mine).mul_(0.5))  # x_r += (x_s - x_r) / 2
        self.answered += 1

    def _apply(self, reply: Message) -> None:
        if self.outstanding is None or reply.src != self.outstanding[0] \
                or reply.round != self.outstanding[1]:
            raise ProtocolError(f"rank {self.rank}: peer {reply.src} replied to exchange "
                                f"{reply.round}, which this peer has not asked it for")
        _, _, sent = self.outstanding
        theirs = self._expect(reply, sent.numel())
        self.model.add_(theirs.sub(sent).mul_(0.5))  # x += (x_r - x_s) / 2
        self.outstanding = None
        self.exchanges += 1

    # -- liveness ------------------------------------------------------------------------------

    def _alive(self) -> list[int]:
        """The neighbours still in the run: not dead, and not gone with a goodbye."""
        gone = self.transport.membership.firsthand() | self.transport.departed
        return [j for j in self.neighbors if j not in gone]

    def _forget_dead(self) -> None:
        if self.outstanding is not None and self.outstanding[0] not in self._alive():
            log.warning("rank %d: neighbour %d died during an exchange; this peer keeps its "
                        "model (the exchange's half on the other side is lost with it)",
                        self.rank, self.outstanding[0])
            self.outstanding = None

    def _until(self, ready, what: str, waiting_on) -> None:
        """Serve the neighbours until ``ready()``, waiting as long as one of
        ``waiting_on()`` is alive (a slow neighbour is no dead one); gives up after
        ``timeout`` seconds of silence from all of them (``Silence``)."""
        transport = self.transport
        silence = Silence(transport)
        while True:
            self.poll()
            if ready():
                return
            if silence.over(waiting_on()):
                raise PeerTimeout(f"rank {self.rank}: adpsgd: no {what}, no other message "
                                  f"and no sign of life within {transport.timeout:g} s")
            if transport.inbox.wait(min(WAIT_S, silence.left())):
                silence.heard()

    def state_dict(self) -> dict[str, Any]:
        return {"next_id": self.next_id}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.next_id = int(state.get("next_id", 0))
