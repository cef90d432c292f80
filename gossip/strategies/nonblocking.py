"""Non-blocking SGD (He & Dube, arXiv 2211.00889): combine whatever mini-batches are done.

Each round a peer computes up to ``b`` mini-batches (the training loop drives them). The
first peer to finish all ``b`` broadcasts STOP(round) to every peer; the others finish the
mini-batch they are computing and stop, so fast peers never wait for a straggler's whole
batch. Then the inner strategy combines the finished work, weighted by samples:

* gradient inner (``ring-allreduce``): all-reduce ``[acc, c]`` (one extra element) and step
  along ``A / C`` -- the mean gradient over every mini-batch finished anywhere, identical
  on all peers;
* gossip inner (``dpsgd``, ``matcha``): each peer steps along ``acc / c``, the mean gradient
  of the samples it finished (an unbiased local estimate, not shrunk for stragglers), then
  mixes parameters as the inner strategy does.

A peer that finished nothing (``c = 0``) still joins the exchange: it sends zeros (all-reduce)
or its unchanged parameters (gossip), so nobody deadlocks. With no stragglers every peer
finishes ``b`` and this is exactly blocking SGD with a batch of ``b`` mini-batches.
See ``shared/specs/nonblocking.md``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from gossip.errors import PeerTimeout
from gossip.options import TaggedOptions, option
from gossip.strategies.base import EXACT_MEAN, STRATEGIES, Strategy
from gossip.strategies.wrapping import inner_options, inner_refusal
from gossip.transport import Message

# STOP(round) messages that arrive after their round ended are drained this many rounds back.
_DRAIN_ROUNDS = 3


@dataclass(frozen=True)
class NonBlockingOptions(TaggedOptions, tag="nb", kinds=("stop",)):
    """Options of ``nonblocking``; ``inner_options`` become the inner strategy's own."""

    examples = ({"inner": EXACT_MEAN}, {"inner": "dpsgd"},
                {"inner": "matcha", "inner_options": {"budget": 0.6}})

    inner: str = option(EXACT_MEAN, "the strategy that combines: an exact all-reduce or a "
                                    "gossip (params) strategy")
    inner_options: Any = option(None, "the inner strategy's options, e.g. {budget: 0.5}")

    def __post_init__(self):
        super().__post_init__()
        inner, _ = inner_options("nonblocking", self.inner, self.inner_options,
                                 own=NonBlockingOptions)
        object.__setattr__(self, "inner_options", inner)

    @classmethod
    def accepts_inner(cls, capabilities: Mapping[str, Any]) -> str | None:
        """Why nonblocking cannot wrap a strategy with these capabilities (None: it can):
        its STOPs close lockstep rounds, and a gradient inner's count travels as one extra
        element that only an exact mean keeps exact."""
        return inner_refusal(capabilities, asynchronous=False)


@STRATEGIES.register("nonblocking")
class NonBlocking(Strategy):
    """Synchronize on the mini-batches finished when the first peer finishes all of its:
    stragglers stop stalling everyone (wraps an exact all-reduce or a gossip strategy)."""

    options_class = NonBlockingOptions
    stops_rounds_early = True
    wraps = True

    def __init__(self, *, rank, topology, transport, options: NonBlockingOptions | None = None):
        super().__init__(rank=rank, topology=topology, transport=transport, options=options)
        self.inner = STRATEGIES.create(self.options.inner, rank=rank, topology=topology,
                                       transport=transport, options=self.options.inner_options)
        # Capabilities are the inner strategy's (it does the combining); none can rejoin.
        for key, value in self.capabilities_for(self.options).items():
            setattr(self, key, value)
        (self.stop_kind,) = self.options.kinds
        self._stopped = -1  # latest round whose STOP we have seen (or sent)
        self._drained_at = -1  # the round that last drained late STOPs

    @classmethod
    def capabilities_for(cls, options: NonBlockingOptions) -> dict[str, Any]:
        inner = STRATEGIES.strategy_class(options.inner, options.inner_options)
        return {**inner.capabilities_for(options.inner_options), "can_rejoin": False,
                "survives_death": False, "mixes_on_views": False, "stops_rounds_early": True,
                "wraps": True}

    @property
    def kinds(self) -> tuple[str, ...]:
        return (*self.inner.kinds, *self.options.kinds)

    # A dead peer: the inner strategy decides (gossip drops it, all-reduce stops), and STOPs
    # are no longer sent to it. A restarted peer cannot rejoin a running job (rejoin_round
    # raises): its STOPs of the rounds it replays would close rounds the others finished.

    def serve(self) -> None:
        self.inner.serve()

    def poll(self) -> None:
        self.inner.poll()

    def finish(self) -> None:
        self.inner.finish()

    def state_dict(self) -> dict[str, Any]:
        return {"inner": self.inner.state_dict(), "stopped": self._stopped,
                "drained_at": self._drained_at}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.inner.load_state_dict(state.get("inner", {}))
        self._stopped = int(state.get("stopped", -1))
        self._drained_at = int(state.get("drained_at", -1))

    # -- the STOP signal ------------------------------------------------------------------
    def computed_all(self, round: int) -> None:
        """The first peer to finish all its mini-batches tells everyone to combine now."""
        if not self.stop_requested(round):
            self.request_stop(round)

    def stop_requested(self, round: int) -> bool:
        """Whether some peer has finished all its mini-batches of ``round``; never blocks."""
        self._drain(round)
        if self._stopped == round:
            return True
        try:
            self.transport.recv(kind=self.stop_kind, round=round, timeout=0)
        except PeerTimeout:
            return False
        self._stopped = round
        return True

    def request_stop(self, round: int) -> None:
        """Tell every peer that ``round`` can be combined (this peer finished its batch).

        Sent to all peers, not only graph neighbours, so every peer closes the round at the
        same point. Skipped when a STOP for ``round`` was already seen: duplicates are
        harmless, only wasted bytes.
        """
        if self._stopped == round:
            return
        self._stopped = round
        msg = Message(kind=self.stop_kind, round=round)
        lost = self.transport.membership.lost  # their queues would only fill up
        for dst in range(self.size):
            if dst != self.rank and dst not in lost:
                self.transport.send(dst, msg)

    def _drain(self, round: int) -> None:
        """Discard STOPs of the last few rounds, once per round: several peers may finish
        at once, and unclaimed messages would pile up in the transport's buffer, which
        every recv scans."""
        if self._drained_at == round:
            return
        self._drained_at = round
        for old in range(max(round - _DRAIN_ROUNDS, 0), round):
            while True:
                try:
                    self.transport.recv(kind=self.stop_kind, round=old, timeout=0)
                except PeerTimeout:
                    break

    # -- combining ------------------------------------------------------------------------
    def synchronize(self, x: torch.Tensor, round: int, *,
                    out: torch.Tensor | None = None) -> torch.Tensor:
        """The inner strategy's round: gossip inner, ``x`` are the parameters after the
        local step along this peer's finished mini-batches; gradient inner, the mean of the
        peers' ``x`` (``average_gradients`` weights it by mini-batches instead)."""
        if self.operates_on == "params":
            return self.inner.synchronize(x, round, out=out)
        return self.average_gradients(x, 1, round, out=out)

    def average_gradients(self, total: torch.Tensor, count: int, round: int, *,
                          out: torch.Tensor | None = None) -> torch.Tensor:
        """Gradient inner: ``total`` is the sum of this peer's ``count`` finished
        mini-batch gradients (0 of them too); returns the sum over peers divided by the total
        count, the same on every peer (zeros if no peer finished anything)."""
        flat = total.reshape(-1)
        extended = torch.empty(flat.numel() + 1, dtype=flat.dtype)
        extended[:-1].copy_(flat)
        extended[-1] = count
        mean = self.inner.synchronize(extended, round, out=extended)
        finished = mean[-1].item()  # mini-batches finished anywhere, over P
        dest = self._output(total, out)
        if finished > 0:
            torch.div(mean[:-1], finished, out=dest)
        else:
            dest.zero_()
        return dest.view_as(total)
