"""An all-peer strategy that survives a death: the survivors agree on a view without the dead
peer and go on (docs/ARCHITECTURE.md, Elastic runs).

``Peer(elastic=True)`` wraps a strategy that declares ``survives_death`` in ``ElasticRounds``.
A round runs on the installed view (gossip/transport/epochs.py). When it raises PeerGone (a
member died), this member agrees on the next view with the others, giving the last round it
completed; the view says which round comes next:

* a round some survivor completed is adopted bitwise by those that had not (the dead peer's
  share included): its result comes from ``View.donor``, which keeps its last result until
  the round after it completes;
* a round nobody completed is redone by every survivor on the new view (the mean over them).

Never both, so every survivor's results stay bitwise equal. The round's input is left as it
came (the strategy writes into a buffer of its own) and the strategy's state (a residual) is
restored as it was before the round (``state_dict``), so a redo starts from them again; an
adopted round keeps the state the interrupted one left (a strategy declares
``survives_death`` only where that is the state of a completed round: its residual depends
on its own input alone).

A member that leaves (``leave``) tells the others after its last round; they count it gone
from the next round on (not dead) and agree on a view without it the same way. Before a
member closes (``finish``) it runs one more round (of zeros) with the others: a member
still in the last round when a peer died then finds its donor there.
"""

from __future__ import annotations

from typing import Any

import torch

from gossip.errors import CollectiveAborted, PeerGone, ProtocolError
from gossip.strategies.base import Strategy
from gossip.transport import Message
from gossip.transport.epochs import Epochs, View

ADOPT = "adopt"  # the kind (after the strategy's tag) carrying an adopted round's result


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
        self.kept: tuple[int, torch.Tensor] | None = None  # (round, its result)
        self.recovered: dict[int, str] = {}  # round -> "adopted" (from a donor) or "redone"
        self.left = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    @property
    def kinds(self) -> tuple[str, ...]:
        return (*self.inner.kinds, self.adopt_kind)

    @property
    def view(self) -> View:
        return self.epochs.view

    def average_gradients(self, total: torch.Tensor, count: int, round: int, *,
                          out: torch.Tensor | None = None) -> torch.Tensor:
        # the default's, calling this synchronize (the inner one's would call its own)
        return Strategy.average_gradients(self, total, count, round, out=out)

    def synchronize(self, x: torch.Tensor, round: int, *,
                    out: torch.Tensor | None = None) -> torch.Tensor:
        saved = self.inner.state_dict()  # e.g. a residual: a redo starts from it again
        while True:
            try:
                if self.view.round > round:  # some survivor completed it: take its result
                    result = self._adopt(x, round)
                else:
                    result = self.inner.synchronize(x, round, out=torch.empty_like(x))
                break
            except (PeerGone, CollectiveAborted):
                view = self.epochs.reform(round - 1, self.timeout)
                self.inner.regroup(view.slot(self.epochs.rank), view.members, view.epoch)
                self._give(view)
                if view.round == round:
                    self.inner.load_state_dict(saved)
                    self.recovered[round] = "redone"
        self.kept = (round, result)
        if out is None:
            return result.clone()
        return out.copy_(result.view_as(out))

    def leave(self) -> None:
        """Leave after the last round completed here: the others go on without this member
        from the next round, without counting it dead."""
        self.epochs.leave(-1 if self.kept is None else self.kept[0])
        self.left = True

    def finish(self) -> None:
        """A last round of zeros with every member (see the module docstring); the
        strategy's state is left as the training's last round left it."""
        self.inner.finish()
        if self.left or self.kept is None:
            return
        last, result = self.kept
        state = self.inner.state_dict()
        self.synchronize(torch.zeros_like(result), last + 1)  # the strategy's own length
        self.inner.load_state_dict(state)

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
                                                   buffers=(self.kept[1].reshape(-1),)))

    def _adopt(self, x: torch.Tensor, round: int) -> torch.Tensor:
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
        self.recovered[round] = "adopted"
        return result.view_as(x)
