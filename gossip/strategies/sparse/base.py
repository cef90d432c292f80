"""What the sparse all-reduce strategies share: residual state, the round's frame, options."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from gossip.compress.sparse import k_for
from gossip.errors import ConfigError, ProtocolError
from gossip.strategies.base import Strategy
from gossip.strategies.sparse.options import SparseOptions
from gossip.strategies.sparse.timings import Timings
from gossip.transport import Message

#: Working dtypes (numpy has no bfloat16).
DTYPES = (torch.float32, torch.float64, torch.float16)
_NO_INDEX = np.zeros(0, dtype=np.int64)


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
        # The members' ids in rank order, this peer's index among them (its place in the
        # schedule), and their view's epoch (elastic runs: regroup).
        self.members, self.slot, self.epoch = list(range(self.size)), rank, None
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
        if work is not None and work.numel() != self._padded(n) and self._numel == n:
            work = self._work = self._repadded(work, n)  # a view of another size (spardl)
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

    def _repadded(self, work: torch.Tensor, n: int) -> torch.Tensor:
        """``work``'s first ``n`` entries in a buffer of ``_padded(n)`` (the rest 0)."""
        fresh = torch.zeros(self._padded(n), dtype=work.dtype)
        fresh[:n].copy_(work[:n])
        return fresh

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
        """Run on the view ``epoch`` of ``members`` (ids, in rank order) from now on, as
        ``slot`` (for a subclass that declares ``survives_death``)."""
        self.members, self.slot = list(members), slot
        self.size, self.epoch = len(members), epoch

    @abstractmethod
    def _run(self, work: torch.Tensor, n: int, dest: torch.Tensor, round: int,
             timings: Timings) -> None:
        """Write the mean of the sparse aggregate to ``dest`` and leave the new residual in
        ``work`` (which held this peer's input)."""


class GlobalSelection(SparseStrategy):
    """A sparse all-reduce whose selection depends on the others' sets (gtop-k, SparDL): a
    peer's residual needs the round's global index set, so a round adopted in an elastic run
    (gossip/strategies/elastic.py) travels with it (``carried``) and the adopting peer
    completes its residual from it (``adopted``). A subclass calls ``_settles`` once its part
    that needs the others is done and ``_settled`` at the end of the round."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        # (round, completes this peer's residual of that round from its global index set)
        self._settle: tuple[int, Callable[[np.ndarray], None]] | None = None
        self._global = _NO_INDEX  # the global index set of the last round completed here

    def _settles(self, round: int, settle: Callable[[np.ndarray], None]) -> None:
        """This peer's part of ``round`` that needs the others is done: ``settle(G)``, with
        G the round's global index set, completes its residual as completion does."""
        self._settle = (round, settle)

    def _settled(self, round: int, global_idx: np.ndarray) -> None:
        """Complete ``round`` here, its global index set known."""
        settle = self._settle
        self._settle = None
        settle[1](global_idx)
        self._global = global_idx.astype(np.int64, copy=True)  # not a received frame's memory

    def carried(self) -> tuple[torch.Tensor, ...]:
        """The global index set of the round completed last (flat indices, sorted): what an
        adopted round's result travels with."""
        return (torch.from_numpy(self._global),)

    def adopted(self, round: int, carried) -> None:
        """``round`` completed elsewhere; its global index set ``carried`` completes this
        peer's residual exactly as its own completion would. Every member had done its
        part of a round somebody completed (the settle step), so the rest depends on the
        global set alone.

        Raises:
            ProtocolError: the set is malformed, or this peer had not done its part.
        """
        numel = self._numel
        if len(carried) != 1 or carried[0].dtype != torch.int64 or carried[0].dim() != 1:
            raise ProtocolError(f"rank {self.rank}: round {round} adopted without its global "
                                f"index set (got {[(c.dtype, c.numel()) for c in carried]})")
        idx = carried[0].numpy()
        if idx.size and (idx[0] < 0 or idx[-1] >= numel or (idx[1:] <= idx[:-1]).any()):
            raise ProtocolError(f"rank {self.rank}: round {round} adopted with a global index "
                                f"set not sorted, distinct and within [0, {numel})")
        if self._settle is None or self._settle[0] != round:
            raise ProtocolError(f"rank {self.rank}: round {round} adopted, but this peer had "
                                f"not done its part of it (a round somebody completed needs "
                                f"every member's)")
        self._settled(round, idx)

