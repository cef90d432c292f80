"""CHOCO's state in the memory-efficient form, updated where the payloads touch it.

x̂_i (``public``) and s_i = sum_j w_ij x̂_j (``mixed``) change only where a payload has
entries, so a sparsifier's round touches about k of their d entries. The consensus step
needs s_i - x̂_i everywhere; recomputing it costs a full pass (and a d-sized temporary) every
round, so ``gap`` keeps it instead, refreshed only at the touched indices. Elementwise
subtraction rounds the same wherever it runs, so ``gap`` is bit for bit ``mixed - public``.
Dense payloads (quantizers, casts) touch everything: then one full subtraction at the end.
"""

from __future__ import annotations

import torch

from gossip.compress import Compressor, Payload
from gossip.compress.base import check_out
from gossip.compress.sparse import Sparse

_NUMPY_DTYPES = (torch.float16, torch.float32, torch.float64)


class PublicCopy:
    """x̂_i, s_i and s_i - x̂_i of one flat tensor, plus the reused difference buffer."""

    def __init__(self, like: torch.Tensor, *, public: torch.Tensor | None = None,
                 mixed: torch.Tensor | None = None):
        self.public = torch.zeros_like(like) if public is None else public
        self.mixed = torch.zeros_like(like) if mixed is None else mixed
        self.gap = torch.sub(self.mixed, self.public)
        self.difference = torch.empty_like(like)  # x_i - x̂_i, reused every round
        self._stale = False  # a dense payload changed mixed or public everywhere

    def difference_to(self, flat: torch.Tensor) -> torch.Tensor:
        """x_i - x̂_i, into the reused buffer (valid until the next call)."""
        return torch.sub(flat, self.public, out=self.difference)

    def compress(self, compressor: Compressor, flat: torch.Tensor, *, key: str,
                 round: int) -> tuple[Payload, Sparse | None]:
        """The payload of Q(x_i - x̂_i) and, for a sparsifier, its decoded form."""
        diff = self.difference_to(flat)
        if compressor.sparse:
            return compressor.compress_unpacked(diff, key=key, round=round)  # type: ignore
        return compressor.compress(diff, key=key, round=round), None

    def add_own(self, compressor: Compressor, payload: Payload, sparse: Sparse | None, *,
                self_weight: float, scale: float) -> None:
        """Apply our own payload: x̂_i += Q, s_i += w_ii Q (as the neighbours apply it)."""
        self._add(compressor, payload, sparse, self.public, scale)
        self._add(compressor, payload, sparse, self.mixed, self_weight * scale)

    def add_neighbour(self, compressor: Compressor, payload: Payload, *, weight: float,
                      scale: float) -> None:
        """s_i += w_ij Q_j for a neighbour's payload (validated: ProtocolError if bad)."""
        sparse = compressor.unpack(payload) if compressor.sparse else None  # type: ignore
        self._add(compressor, payload, sparse, self.mixed, weight * scale)

    def step(self) -> torch.Tensor:
        """s_i - x̂_i after this round's payloads."""
        if self._stale:
            torch.sub(self.mixed, self.public, out=self.gap)
            self._stale = False
        return self.gap

    def _add(self, compressor: Compressor, payload: Payload, sparse: Sparse | None,
             target: torch.Tensor, alpha: float) -> None:
        if sparse is None:
            compressor.add_to(payload, target, alpha=alpha)
            self._stale = True
            return
        check_out(target, sparse.header.numel)
        idx = sparse.indices.to(target.device)
        # The same scatter-add as SparseCompressor.add_to, then gap refreshed where it acted.
        target.index_add_(0, idx, sparse.values.to(target.device, target.dtype), alpha=alpha)
        self._refresh(idx)

    def _refresh(self, idx: torch.Tensor) -> None:
        """gap = mixed - public at ``idx``: numpy's gather/scatter on the CPU (about 10x
        faster than torch's advanced indexing for 10k indices), torch's elsewhere."""
        if self.gap.device.type == "cpu" and self.gap.dtype in _NUMPY_DTYPES:
            at = idx.numpy()
            self.gap.numpy()[at] = self.mixed.numpy()[at] - self.public.numpy()[at]
            return
        self.gap.index_copy_(0, idx, torch.index_select(self.mixed, 0, idx).sub_(
            torch.index_select(self.public, 0, idx)))
