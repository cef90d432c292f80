"""An all-peer strategy that survives a death: the survivors agree on a view without the dead
peer and go on (docs/ARCHITECTURE.md, Elastic runs).

``Peer(elastic=True)`` wraps a strategy that declares ``survives_death`` in ``ElasticRounds``.
A round runs on the installed view (gossip/transport/epochs.py). When it raises PeerGone (a
member died), this member agrees on the next view with the others, giving the last round it
completed; the view says which round comes next:

* a round some survivor completed is adopted bitwise by those that had not (the dead peer's
  share included): its result comes from ``View.donor``, which keeps its last result (and
  the strategy's ``carried()`` of it) until the round after it completes;
* a round nobody completed is redone by every survivor on the new view (the mean over them).

Never both, so every survivor's results stay bitwise equal. The round's input is left as it
came (the strategy writes into a buffer of its own) and the strategy's state (a residual) is
restored as it was before the round (``state_dict``), so a redo starts from them again; an
adopted round keeps the state the interrupted one left, completed by the strategy's
``adopted(round, carried)`` as a completed round leaves it (a residual that depends on the
peer's input alone needs nothing; gtop-k's and SparDL's need the round's global index set,
which the donor's result carries).

A peer joins (``enter``, on a spare id of the topology) by asking the members; the
coordinator proposes a view with it, activated two rounds on (epochs.py); its donor sends it
the training's state after the round before (``hand_over``: bytes the caller makes, checked
by their blake2b on arrival), and it runs from the activation round on. The strategy's own
state is not sent: the strategies that survive a death keep none but error-feedback
residuals, which are never copied (a copy would count the donor's unsent mass twice), so a
joiner starts with none.

A member that leaves (``leave``) tells the others after its last round; they count it gone
from the next round on (not dead) and agree on a view without it the same way. Before a
member closes (``finish``) it runs one more round (of zeros) with the others: a member
still in the last round when a peer died then finds its donor there.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import torch

from gossip.errors import CollectiveAborted, PeerGone, PeerTimeout, ProtocolError
from gossip.strategies.base import Strategy
from gossip.transport import Message
from gossip.transport.epochs import Epochs, View

ADOPT = "adopt"  # the kind (after the strategy's tag) carrying an adopted round's result
HANDOVER = "handover"  # the kind carrying a joiner's state from its donor
WAKE_S = 0.2  # how often a joiner waiting for its state looks for a newer view admitting it


class ElasticRounds:
    """``inner`` (a strategy with ``survives_death``) run on the views of ``epochs``; every
    other attribute is the inner strategy's.

    Args:
        inner: The strategy; ``regroup(slot, members, epoch)`` moves it onto a view.
        epochs: The transport's views (``Membership.elastic``).
        timeout: Seconds an agreement, or an adopted result, may take.
    """

    def __init__(self, inner, epochs: Epochs, *, timeout: float):
        self.inner, self.epochs, self.timeout = inner, epochs, timeout
        self.adopt_kind = f"{inner.options.tag}.{ADOPT}"
        self.handover_kind = f"{inner.options.tag}.{HANDOVER}"
        if epochs.rank in epochs.view.members:  # epoch 0 leaves the spare ids out
            inner.regroup(epochs.view.slot(epochs.rank), epochs.view.members, epochs.view.epoch)
        # (round, its result, what the result carries to an adopter: strategy.carried())
        self.kept: tuple[int, torch.Tensor, tuple[torch.Tensor, ...]] | None = None
        self.recovered: dict[int, str] = {}  # round -> "adopted" (from a donor) or "redone"
        self.left = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    @property
    def kinds(self) -> tuple[str, ...]:
        return (*self.inner.kinds, self.adopt_kind, self.handover_kind)

    @property
    def view(self) -> View:
        return self.epochs.view

    def average_gradients(self, total: torch.Tensor, count: int, round: int, *,
                          out: torch.Tensor | None = None) -> torch.Tensor:
        # the default's, calling this synchronize (the inner one's would call its own)
        return Strategy.average_gradients(self, total, count, round, out=out)

    def synchronize(self, x: torch.Tensor, round: int, *,
                    out: torch.Tensor | None = None) -> torch.Tensor:
        before = self.view
        admitted = self.epochs.admit(round, timeout=self.timeout)
        if admitted is not None:
            self._regroup(admitted, before)
        saved = self.inner.state_dict()  # e.g. a residual: a redo starts from it again
        while True:
            try:
                if self.view.round > round:  # some survivor completed it: take its result
                    result, carried = self._adopt(x, round)
                else:
                    result = self.inner.synchronize(x, round, out=torch.empty_like(x))
                    carried = self.inner.carried()
                break
            except (PeerGone, CollectiveAborted):
                before = self.view
                view = self.epochs.reform(round - 1, self.timeout)
                self._regroup(view, before)
                self._give(view)
                if view.round == round:
                    self.inner.load_state_dict(saved)
                    self.recovered[round] = "redone"
        self.kept = (round, result, carried)
        if out is None:
            return result.clone()
        return out.copy_(result.view_as(out))

    def leave(self) -> None:
        """Leave after the last round completed here: the others go on without this member
        from the next round, without counting it dead."""
        self.epochs.leave(-1 if self.kept is None else self.kept[0])
        self.left = True

    def hand_over(self, round: int, state: Callable[[], bytes]) -> list[int]:
        """After completing ``round``: as the donor of a join activated at the next round,
        send ``state()`` (made once) to its joiners; returns them."""
        view = self.epochs.scheduled
        if view is None or view.round != round + 1:
            return []
        joiners = sorted(j for j, donor in view.joins.items() if donor == self.epochs.rank)
        if joiners:
            data = state()
            # the members gone so far, which a joiner's own view does not tell (their
            # notices went to the members of the time): it then waits for none of them
            membership = self.inner.transport.membership
            gone = {"left": [[m, last] for m, last in sorted(self.epochs.leaving.items())],
                    "lost": sorted(membership.lost)}
            for dst in joiners:
                self.inner.transport.send(dst, Message(
                    self.handover_kind, round,
                    meta={"e": view.epoch, "hash": _digest(data), **gone},
                    buffers=(torch.frombuffer(bytearray(data), dtype=torch.uint8),)))
        return joiners

    def enter(self, stop: Callable[[], bool] = lambda: False) -> tuple[int, bytes] | None:
        """As a spare id: join the running members; returns the round to run from and the
        state its donor sent (``hand_over``), checked against its blake2b; None if the
        members ended the run before admitting this peer, or ``stop()`` before a view
        admitted it (asked to leave: it gives up).

        Raises:
            PeerTimeout: no view admitted this peer, or its donor sent nothing, in time.
            ProtocolError: the state does not match its hash.
        """
        epochs, transport = self.epochs, self.inner.transport
        deadline = transport.clock.monotonic() + self.timeout
        epochs.ask()
        # Asked, not worked with: their deaths reach it from the coordinator (it is in the
        # audience), not first-hand from every epoch-0 member (each death at 1,000 peers)
        transport.unlink(epochs.first)
        while True:
            left = deadline - transport.clock.monotonic()
            view = epochs.admission(max(left, 0.0), stop)
            if view is None:
                return None
            donor = view.joins[epochs.rank]
            transport.connect([donor])  # its death is noticed here (it may be no first member)
            try:
                msg = transport.recv(src=donor, kind=self.handover_kind, round=view.round - 1,
                                     timeout=max(min(WAKE_S, left), 1e-3))
            except PeerGone:  # the donor died or left before sending
                if self.donor_lost(view):
                    return None
                epochs.forget(view)  # the members agree without it, then admit it again
                continue
            except PeerTimeout:
                if epochs.ended():
                    return None
                if transport.clock.monotonic() >= deadline:
                    raise PeerTimeout(f"rank {epochs.rank}: peer {donor} sent no state for "
                                      f"view {view.epoch} within {self.timeout:g} s") from None
                continue  # a newer view may admit this peer instead
            if msg.meta.get("e") != view.epoch:
                continue  # a dropped view's
            data = msg.buffers[0].numpy().tobytes()
            if msg.meta.get("hash") != _digest(data):
                raise ProtocolError(f"rank {epochs.rank}: the state peer {donor} sent for view "
                                    f"{view.epoch} does not match its blake2b")
            before = epochs.view  # its own, alone
            epochs.install(view)
            self._note_gone(msg.meta, donor, view.round - 1)
            self._regroup(view, before)
            return view.round, data

    def donor_lost(self, view: View) -> bool:
        """As a joiner whose donor ``view`` named died before sending its state: True if it
        gives up. Here it waits: a death makes the members agree on a view without the
        donor, which drops ``view`` everywhere, and a later one admits this peer."""
        return False

    def finish(self) -> None:
        """A last round of zeros with every member (see the module docstring); the
        strategy's state is left as the training's last round left it."""
        self.inner.finish()
        if self.left or self.kept is None:
            return
        last, result, _ = self.kept
        self.epochs.cancel(last)  # a join due after the last round: nobody runs it
        state = self.inner.state_dict()
        self.synchronize(torch.zeros_like(result), last + 1)  # the strategy's own length
        self.inner.load_state_dict(state)

    def _regroup(self, view: View, before: View) -> None:
        """Run the strategy on ``view``, installed in place of ``before``. Links to the
        members it dropped are closed, the others' unlinked: the strategy links its
        partners again (the neighbours it connects to, the peers it sends to), so only they
        notice a death first-hand and leaving says goodbye to them alone. Peers still
        asking to join keep theirs (they wait for this member's goodbye)."""
        transport = self.inner.transport
        transport.close_links(set(before.members) - set(view.members))
        transport.unlink((transport.linked | transport.contacts) - self.epochs.asking)
        self.inner.regroup(view.slot(self.epochs.rank), view.members, view.epoch)

    def _note_gone(self, meta, donor: int, round: int) -> None:
        """As a joiner: count gone the members its donor knew gone (``hand_over``)."""
        for member, last in meta.get("left", []):
            self.epochs.note_left(int(member), int(last))
        for member in meta.get("lost", []):
            self.inner.transport.membership.note_lost(
                int(member), round, f"lost before this peer joined (peer {donor}'s word)")

    def _give(self, view: View) -> None:
        """As the view's donor: send the round it adopts to the members that had not
        completed it."""
        if view.donor != self.epochs.rank:
            return
        if self.kept is None or self.kept[0] != view.round - 1:
            raise ProtocolError(f"rank {self.epochs.rank}: donor of round {view.round - 1} in "
                                f"view {view.epoch}, but it kept round "
                                f"{None if self.kept is None else self.kept[0]}")
        for dst in view.behind:
            self.inner.transport.send(dst, Message(self.adopt_kind, view.round - 1,
                                                   meta={"e": view.epoch},
                                                   buffers=(self.kept[1].reshape(-1),
                                                            *self.kept[2])))

    def _adopt(self, x: torch.Tensor, round: int) -> tuple[torch.Tensor, tuple]:
        view = self.view
        msg = self.inner.transport.recv(src=view.donor, kind=self.adopt_kind, round=round,
                                        timeout=self.timeout)
        result = msg.buffers[0]
        if msg.meta.get("e") != view.epoch or result.numel() != x.numel() \
                or result.dtype != x.dtype:
            raise ProtocolError(f"rank {self.epochs.rank}: peer {view.donor} sent round {round} "
                                f"of view {msg.meta.get('e')} as {result.numel()} x "
                                f"{result.dtype}, expected view {view.epoch}, {x.numel()} x "
                                f"{x.dtype}")
        carried = msg.buffers[1:]
        self.inner.adopted(round, carried)
        self.recovered[round] = "adopted"
        return result.view_as(x), carried


def _digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()
