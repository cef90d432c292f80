"""What the sparse all-reduce strategies share: residual state, the round's frame, options."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Mapping
from typing import Any

import torch

from gossip.compress.sparse import k_for
from gossip.errors import ConfigError
from gossip.strategies.base import Strategy
from gossip.strategies.sparse.options import SparseOptions
from gossip.strategies.sparse.timings import Timings
from gossip.transport import Message

#: Working dtypes (numpy has no bfloat16).
DTYPES = (torch.float32, torch.float64, torch.float16)


class SparseStrategy(Strategy):
    """Residual bookkeeping of the sparse all-reduce strategies; a subclass writes ``_run``,
    one round on the working buffer.

    The result is the mean (sum / P) of a sparse aggregate of the peers' ``x + residual``;
    whatever a peer put in and the aggregate left out stays in the peers' residuals, so
    ``sum over peers of (x + old residual) == P * result + sum of new residuals``. Options:
    SparseOptions (with error_feedback off, the residual is still computed and exposed every
    round, but the next round starts from its input alone).
    """

    options_class = SparseOptions
    operates_on = "grads"
    needs_every_peer = True

    def __init__(self, *, rank, topology, transport, options: SparseOptions | None = None):
        super().__init__(rank=rank, topology=topology, transport=transport, options=options)
        self.density = self.options.density
        self.error_feedback = self.options.error_feedback
        self.tag = self.options.tag
        self.indices = self.options.indices
        self.timings = Timings()  # of the last synchronize
        self._work: torch.Tensor | None = None  # x + residual, then the new residual
        self._numel = 0
        # The members' ids in rank order, and their view's epoch (elastic runs: regroup).
        self.members, self.epoch = list(range(self.size)), None
        self.stale = 0  # messages of older views dropped
        # Sample positions of the selection; any seed gives the same (exact) top-k.
        self._generator = torch.Generator().manual_seed(1 + rank)

    # -- state -------------------------------------------------------------------------

    @property
    def residual(self) -> torch.Tensor | None:
        """What this peer's last round left out (flat), or None before the first round."""
        return None if self._work is None else self._work[:self._numel]

    def state_dict(self) -> dict[str, Any]:
        return {"residual": None if self._work is None else self.residual.clone()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        residual = state.get("residual")
        if residual is None:
            self._work, self._numel = None, 0
            return
        residual = residual.reshape(-1)
        self._numel = residual.numel()
        self._work = torch.zeros(self._padded(self._numel), dtype=residual.dtype)
        self._work[:self._numel].copy_(residual)

    # -- one round -----------------------------------------------------------------------

    def synchronize(self, x: torch.Tensor, round: int, *,
                    out: torch.Tensor | None = None) -> torch.Tensor:
        if x.dtype not in DTYPES:
            raise ConfigError(f"{type(self).__name__} averages float32, float64 or float16 "
                              f"tensors, got {x.dtype}")
        flat, dest = x.reshape(-1), self._output(x, out)
        self.timings = timings = Timings()
        waited = self.transport.stats.wait_s
        with timings("total"):
            if flat.numel():
                with timings("load"):
                    work = self._load(flat)
                self._run(work, flat.numel(), dest, round, timings)
        timings["wait"] = self.transport.stats.wait_s - waited
        return dest.view_as(x)

    def _load(self, flat: torch.Tensor) -> torch.Tensor:
        """The working buffer holding ``x + residual`` (or ``x`` without error feedback)."""
        n = flat.numel()
        work = self._work
        if work is not None and self._numel != n:
            raise ConfigError(f"{type(self).__name__} got a tensor of {n} elements; its "
                              f"residual has {self._numel} (use one instance per tensor)")
        if work is not None and work.dtype != flat.dtype:
            work = self._work = work.to(flat.dtype)
        if work is None:
            work = self._work = torch.zeros(self._padded(n), dtype=flat.dtype)
            self._numel = n
            work[:n].copy_(flat)
        elif self.error_feedback:
            work[:n].add_(flat)
        else:
            work[:n].copy_(flat)
        return work

    def _padded(self, n: int) -> int:
        """Length of the working buffer for a tensor of ``n``."""
        return n

    def _k(self, n: int) -> int:
        return k_for(self.density, n)

    def _send(self, dst: int, msg: Message, timings: Timings) -> None:
        # Fresh buffers that nothing modifies later: no need to track the delivery.
        with timings("send"):
            self.transport.send(dst, msg)

    def _recv(self, src: int, kind: str, round: int, timings: Timings) -> Message:
        with timings("recv"):
            msg = self.transport.recv(src=src, kind=kind, round=round)
            while self.epoch is not None and msg.meta.get("e", -1) < self.epoch:
                self.stale += 1  # an older view's: dropped
                msg = self.transport.recv(src=src, kind=kind, round=round)
            return msg

    def regroup(self, slot: int, members, epoch: int) -> None:
        """Run on the view ``epoch`` of ``members`` (ids, in rank order) from now on (for a
        subclass that declares ``survives_death``)."""
        self.members, self.size, self.epoch = list(members), len(members), epoch

    @abstractmethod
    def _run(self, work: torch.Tensor, n: int, dest: torch.Tensor, round: int,
             timings: Timings) -> None:
        """Write the mean of the sparse aggregate to ``dest`` and leave the new residual in
        ``work`` (which held this peer's input)."""
