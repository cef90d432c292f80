"""CHOCO-Gossip (Koloskova et al. 2019): gossip with compressed model differences.

Each peer keeps a public copy x̂_i that every neighbour replicates bit for bit, and sends only
Q(x_i - x̂_i). Because the compressed quantity is the difference to the public copy, whatever
Q drops stays in the next difference, so peers still reach consensus with top-k or sign;
compressing the models themselves (naive sparsified averaging) stalls far from it.

Fixed mixing weights allow the memory-efficient form: instead of one replica per neighbour,
keep s_i = sum_j w_ij x̂_j (self included), updated by the same compressed messages.
The update x_i += gamma * (s_i - x̂_i) preserves the peers' average for any Q.

With a ``robust`` option the neighbours' public copies are kept one by one instead (deg(i)
tensors), still updated by the raw payloads bit for bit, and the mixing term is the robust
aggregate over them: x_i += gamma * (R(x̂_i, x̂_j) - x̂_i), for clipping
x_i += gamma * sum_j w_ij CLIP(x̂_j - x̂_i, tau). A payload holding a non-finite value is left
out of its replica and flagged.

In an elastic run (``regroup``: gossip/strategies/elastic_gossip.py) a new view's first
round starts with x̂_i sent whole to every neighbour of the new graph, s_i rebuilt from
theirs, so the copies agree bitwise whatever edges moved; a neighbour gone between views
keeps its last x̂_j in s_i (its payloads count as zero) until the next view leaves it out.
"""

from __future__ import annotations

import torch

from gossip.compress import Payload
from gossip.errors import ConfigError, PeerGone, ProtocolError
from gossip.strategies.base import Strategy
from gossip.strategies.dpsgd.compression import default_gamma, shrink
from gossip.strategies.dpsgd.neighbourhood import Neighbourhood
from gossip.strategies.dpsgd.options import DPSGDOptions
from gossip.strategies.dpsgd.public_copy import PublicCopy, Replicas
from gossip.strategies.robust import Mixed
from gossip.transport import Message

PUBLIC = "public"  # the kind suffix of a public copy sent whole at a new view's first round


class ChocoGossip(Strategy):
    """One CHOCO-Gossip step with every neighbour of the (static) graph (``dpsgd`` with a
    compressor, which compresses x_i - x̂_i; gamma: the consensus step, by default from the
    compressor's quality)."""

    options_class = DPSGDOptions
    operates_on = "params"
    preserves_mean = True
    symmetric_exchange = True
    mixes_on_views = True

    def __init__(self, *, rank, topology, transport, options: DPSGDOptions | None = None):
        super().__init__(rank=rank, topology=topology, transport=transport, options=options)
        if self.options.compressor is None:
            raise ConfigError("CHOCO-Gossip needs a compressor")
        self.tag = self.options.tag
        mixing = Neighbourhood(topology, rank)
        self.neighbors, self.self_weight, self.weights = (mixing.neighbors, mixing.self_weight,
                                                          mixing.weights)
        self.compressor = self.options.compressor
        self.gamma = self.options.gamma
        self._state: PublicCopy | None = None  # x̂_i, s_i and the buffers reused each round
        self.robust = self.options.aggregator_for(topology)
        self.replicas: Replicas | None = None  # robust: each neighbour's x̂_j
        self.robust_stats: Mixed | None = None  # what robust mixing did in the latest round
        self.on_views = False  # an elastic run's (regroup): a gone neighbour is frozen
        self.resync = False  # on a new view: exchange the public copies whole first
        self.gone: set[int] = set()  # on views: neighbours gone since the view (frozen)
        if self.robust is not None:
            held = self.capabilities_for(self.options)
            self.preserves_mean, self.checks_own_result, self.mixes_on_views = (
                held["preserves_mean"], held["checks_own_result"], held["mixes_on_views"])

    @classmethod
    def capabilities_for(cls, options: DPSGDOptions) -> dict:
        return options.robust_capabilities(super().capabilities_for(options))

    @property
    def kinds(self) -> tuple[str, ...]:
        return (*super().kinds, f"{self.tag}.{PUBLIC}")

    def regroup(self, slot: int, members, epoch: int) -> None:
        """Mix on the view ``epoch`` of ``members`` (ids) from now on (an elastic run): the
        graph the topology's rule gives them, Metropolis-Hastings weights; the next round
        first sends x̂_i whole to every neighbour and rebuilds s_i from theirs."""
        mixing = Neighbourhood(self.topology, self.rank, members)
        self.neighbors, self.self_weight, self.weights = (mixing.neighbors, mixing.self_weight,
                                                          mixing.weights)
        self.transport.connect(self.neighbors)
        self.gone, self.resync, self.on_views = set(), True, True

    def handover_state(self) -> dict:
        """A joiner's x̂ and step size are its donor's (its neighbours get x̂ whole at the
        view's first round)."""
        return {} if self.public is None else {"public": self.public, "gamma": self.gamma}

    def take_handover(self, state) -> None:
        if "public" in state:
            public = state["public"].reshape(-1)
            self.gamma = state["gamma"]
            self._state = PublicCopy(public, public=public.clone(),
                                     mixed=torch.zeros_like(public))
            self._shrink = shrink(self.compressor, public.numel())
            self.resync = True

    def share_public(self, round: int) -> None:
        """x̂_i whole to every neighbour of the new view, and s_i = w_ii x̂_i + sum_j w_ij
        x̂_j from theirs (in neighbour order); a neighbour gone meanwhile is dropped, its
        weight folded into ours."""
        kind, public = f"{self.tag}.{PUBLIC}", self.public
        msg = Message(kind=kind, round=round, meta={"n": public.numel()}, buffers=(public,))
        dead = self.transport.membership.firsthand()
        sent = {j: self.transport.send(j, msg, track=True) for j in self.neighbors
                if j not in dead}
        mixed, dropped = torch.mul(public, self.self_weight), set()
        for j in self.neighbors:
            try:
                value = self.transport.recv(src=j, kind=kind, round=round).buffers[0]
            except PeerGone as exc:
                if exc.rank != j:
                    raise
                dropped.add(j)
                mixed.add_(public, alpha=self.weights[j])
                continue
            if value.numel() != public.numel() or value.dtype != public.dtype:
                raise ProtocolError(f"rank {self.rank}: peer {j} sent its public copy as "
                                    f"{value.numel()} x {value.dtype}, expected "
                                    f"{public.numel()} x {public.dtype}")
            mixed.add_(value.reshape(-1), alpha=self.weights[j])
        for j in dropped:
            self.self_weight += self.weights.pop(j)
        self.neighbors = tuple(j for j in self.neighbors if j not in dropped)
        self._wait_sent(sent)
        self._state.mixed.copy_(mixed)

    def _wait_sent(self, sent: dict) -> None:
        """Wait for the sends to ``sent``'s neighbours; on views, one that is gone meanwhile
        joins ``gone`` (else PeerGone)."""
        for j, delivery in sent.items():
            try:
                delivery.wait()
            except PeerGone as exc:
                if not self.on_views or exc.rank != j:
                    raise
                self.gone.add(j)

    def synchronize(self, x: torch.Tensor, round: int, *,
                    out: torch.Tensor | None = None) -> torch.Tensor:
        flat, dest = x.reshape(-1), self._output(x, out)
        if self.resync:
            self.resync = False
            if self._state is not None:
                self.share_public(round)
        state = self._ensure_state(flat)
        payload, own = state.compress(self.compressor, flat, key=self.tag, round=round)
        msg = Message(kind=self.tag, round=round, meta=dict(payload.meta),
                      buffers=payload.buffers)
        dead = self.transport.membership.firsthand() if self.on_views else set()
        self.gone |= dead & set(self.neighbors)
        mixing = [j for j in self.neighbors if j not in self.gone]
        # Tracked: a cast payload may be a view of the difference buffer reused next round.
        sent = {j: self.transport.send(j, msg, track=True) for j in mixing}
        # Apply our own payload exactly as the neighbours do, so their replicas stay equal.
        state.add_own(self.compressor, payload, own, self_weight=self.self_weight,
                      scale=self._shrink)
        flagged = 0  # robust: neighbours whose payload held a non-finite value
        for j in mixing:  # fixed order: deterministic floating-point sums
            try:
                reply = self.transport.recv(src=j, kind=self.tag, round=round)
            except PeerGone as exc:
                if self.on_views and exc.rank == j:  # its last x̂_j stays in s_i until the
                    self.gone.add(j)                 # next view (which leaves it out)
                    continue
                # s_i holds the neighbours' public copies only as one weighted sum, so a dead
                # neighbour's share cannot be taken out of it: stop rather than mix wrongly.
                raise PeerGone(f"{exc}; CHOCO-Gossip keeps only the weighted sum of its "
                               f"neighbours' public copies and cannot drop peer {exc.rank}: "
                               f"stopping", rank=exc.rank) from None
            payload = Payload(reply.meta, reply.buffers)
            try:
                if self.replicas is None:
                    state.add_neighbour(self.compressor, payload, weight=self.weights[j],
                                        scale=self._shrink)
                elif not self.replicas.add(self.compressor, j, payload, scale=self._shrink):
                    flagged += 1
            except ProtocolError as exc:
                raise ProtocolError(f"rank {self.rank}: peer {j} sent a bad {self.tag} "
                                    f"payload in round {round}: {exc}") from None
        self._wait_sent(sent)
        if self.replicas is None:
            state.step_into(flat, self.gamma, dest.view(-1))
        else:
            self._step_robustly(flat, dest.view(-1), flagged)
        return dest.view_as(x)

    def _step_robustly(self, flat: torch.Tensor, dest: torch.Tensor, flagged: int) -> None:
        """dest = x_i + gamma (R - x̂_i), R the robust aggregate of the public copies."""
        public, target = self.public, self._target
        mixed = self.robust.mix(public, [self.replicas.copies[j] for j in self.neighbors],
                                [self.weights[j] for j in self.neighbors], self.self_weight,
                                out=target)
        self.robust_stats = Mixed(mixed.share, mixed.flagged + flagged)
        torch.add(flat, target.sub_(public), alpha=self.gamma, out=dest)

    def record_fields(self, round: int) -> dict:
        return {} if self.robust_stats is None else self.robust_stats.fields()

    @property
    def public(self) -> torch.Tensor | None:
        """x̂_i (None before the first round)."""
        return None if self._state is None else self._state.public

    @property
    def mixed(self) -> torch.Tensor | None:
        """s_i = sum_j w_ij x̂_j (None before the first round)."""
        return None if self._state is None else self._state.mixed

    def _ensure_state(self, flat: torch.Tensor) -> PublicCopy:
        if self._state is None:
            self._state = PublicCopy(flat)
            if self.gamma is None:
                self.gamma = default_gamma(self.compressor, flat.numel())
            self._shrink = shrink(self.compressor, flat.numel())
            self._start_replicas(flat)
        elif self.public.shape != flat.shape or self.public.dtype != flat.dtype:
            raise ConfigError(f"rank {self.rank}: CHOCO keeps public copies of one tensor of "
                              f"{self.public.numel()} {self.public.dtype}; got {flat.numel()} "
                              f"{flat.dtype} (use one strategy instance per tensor)")
        return self._state

    def _start_replicas(self, like: torch.Tensor, copies=None) -> None:
        if self.robust is not None:
            self.replicas = Replicas(like, self.neighbors, copies)
            self._target = torch.empty_like(like)  # the robust aggregate, reused

    def state_dict(self) -> dict:
        """Public copy, neighbourhood mix (robust: each neighbour's copy) and step size:
        what a restarted peer needs."""
        state = {"public": self.public, "mixed": self.mixed, "gamma": self.gamma}
        if self.replicas is not None:
            state["replicas"] = dict(self.replicas.copies)
        return state

    def load_state_dict(self, state) -> None:
        """Restore ``state_dict``. Only a whole job restarted together can use it: in a
        running job the neighbours' replicas of our public copy have moved on since (so
        ``rejoin_round`` refuses)."""
        self.gamma = state["gamma"]
        self._state = None
        if state["public"] is not None:
            self._state = PublicCopy(state["public"], public=state["public"],
                                     mixed=state["mixed"])
            self._shrink = shrink(self.compressor, self.public.numel())
            self._start_replicas(self.public, state.get("replicas"))
