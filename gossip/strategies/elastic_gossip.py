"""A gossip strategy on the agreed views of an elastic run (spec elastic.md section 5;
docs/ARCHITECTURE.md, Elastic runs).

``Peer(elastic=True)`` wraps a strategy that declares ``mixes_on_views`` (dpsgd, CHOCO) in
``ElasticGossip``. Consensus is not bitwise, so no round is adopted or redone, and a
change needs no agreement at the moment it happens:

* Between views each member keeps today's local rule: a neighbour that died, or left after
  its last round (``ctl.leave``: gone, not dead), is dropped by the members that mix with
  it, its weight folded into their own (dpsgd; CHOCO keeps its last public copy in s_i
  instead, see choco.py), which keeps W symmetric and doubly stochastic on the living.
* The view's coordinator (its lowest live id) proposes, at the start of one of its rounds
  r, the next view: the members known gone left out, the peers asking to join added (each
  given a donor), activated at round r + 2 diam + 2 (diam: the current view's graph's
  diameter; a member is at most diam rounds ahead of another, and the proposal reaches it
  directly). Every member installs it at the start of that round and rebuilds its graph
  by the topology's rule with Metropolis-Hastings weights (``regroup``,
  ``Topology.view_graph``).
* A joiner takes its donor's model, optimizer and the strategy's ``handover_state`` (CHOCO:
  its public copy x̂; never an error-feedback residual) after the round before the
  activation; see ``ElasticRounds.enter`` and ``hand_over``, which this shares.
"""

from __future__ import annotations

import torch

from gossip.strategies.elastic import ElasticRounds
from gossip.transport.epochs import Epochs, View


class ElasticGossip(ElasticRounds):
    """``inner`` (a strategy with ``mixes_on_views``) on the views of ``epochs``; every
    other attribute is the inner strategy's.

    Args:
        inner: The strategy; ``regroup(slot, members, epoch)`` rebuilds its graph.
        epochs: The transport's views (``Membership.elastic``).
        timeout: Seconds a joiner waits for its admission and state.
    """

    def __init__(self, inner, epochs: Epochs, *, timeout: float):
        super().__init__(inner, epochs, timeout=timeout)
        self._margin: tuple[int, int] | None = None  # (epoch, its margin)

    @property
    def margin(self) -> int:
        """Rounds between a view's proposal and its activation: 2 diam + 2 of the
        installed view's graph (a hop a round, both ways, and a round's slack)."""
        view = self.view
        if self._margin is None or self._margin[0] != view.epoch:
            self._margin = (view.epoch,
                            2 * self.inner.topology.view_diameter(view.members) + 2)
        return self._margin[1]

    def synchronize(self, x: torch.Tensor, round: int, *,
                    out: torch.Tensor | None = None) -> torch.Tensor:
        before = self.view
        view = self.epochs.admit(round, timeout=self.timeout, margin=self.margin,
                                 departures=True)
        if view is not None:
            self._regroup(view, before)
        result = self.inner.synchronize(x, round, out=out)
        self.kept = (round, result)  # the last round completed here (a leave says it)
        return result

    def donor_lost(self, view: View) -> bool:
        """The members install ``view`` whatever happened to the donor (no agreement), and
        would wait in its first round for this peer: it leaves the view before that round
        instead (they drop it as a departure, not a death) and ends without a round."""
        self.epochs.withdraw(view)
        return True

    def finish(self) -> None:
        """Nothing to run with the others (no round is adopted); a view due after the
        last round is dropped (its joiner, if its state came, runs no round)."""
        self.inner.finish()
        if not self.left:
            self.epochs.cancel(self.view.round - 1 if self.kept is None else self.kept[0])
