"""CHOCO's state in the memory-efficient form, and the round's passes over it fused.

x̂_i (``public``) and s_i = sum_j w_ij x̂_j (``mixed``) change only where a payload has
entries. The round then needs x_i + gamma (s_i - x̂_i) everywhere; computed whole, that is
two passes over the model and a model-sized temporary. ``step_into`` runs the same two
elementwise ops on cache-sized chunks instead: one pass, no temporary, and bit for bit the
same result (elementwise ops round the same whatever the chunking). The difference x_i - x̂_i
that is compressed goes into a buffer kept across rounds (top-k writes it in the pass that
scans it); a sparsifier's own payload is applied from its selection, without decoding the
indices it just encoded.
"""

from __future__ import annotations

import torch

from gossip.compress import Compressor, Payload
from gossip.compress.sparse import Sparse, scatter_add

#: Elements per chunk of the fused step: 3 x 256 KiB of float32 stay in a core's L2.
CHUNK = 1 << 16


class PublicCopy:
    """x̂_i and s_i of one flat tensor, plus the reused difference buffer."""

    def __init__(self, like: torch.Tensor, *, public: torch.Tensor | None = None,
                 mixed: torch.Tensor | None = None):
        self.public = torch.zeros_like(like) if public is None else public
        self.mixed = torch.zeros_like(like) if mixed is None else mixed
        self.difference = torch.empty_like(like)  # x_i - x̂_i, reused every round
        self._gap = torch.empty(min(CHUNK, like.numel()), dtype=like.dtype, device=like.device)

    def compress(self, compressor: Compressor, flat: torch.Tensor, *, key: str,
                 round: int) -> tuple[Payload, Sparse | None]:
        """The payload of Q(x_i - x̂_i) and, for a sparsifier, its decoded form."""
        if compressor.sparse:  # top-k takes the difference in the same pass as its scan
            return compressor.compress_difference(  # type: ignore[attr-defined]
                flat, self.public, self.difference, key=key, round=round)
        diff = torch.sub(flat, self.public, out=self.difference)
        return compressor.compress(diff, key=key, round=round), None

    def add_own(self, compressor: Compressor, payload: Payload, sparse: Sparse | None, *,
                self_weight: float, scale: float) -> None:
        """Apply our own payload: x̂_i += Q, s_i += w_ii Q (as the neighbours apply it)."""
        for target, weight in ((self.public, 1.0), (self.mixed, self_weight)):
            if sparse is None:
                compressor.add_to(payload, target, alpha=weight * scale)
            else:  # SparseCompressor.add_to's scatter-add, from the selection
                scatter_add(sparse, target, alpha=weight * scale)

    def add_neighbour(self, compressor: Compressor, payload: Payload, *, weight: float,
                      scale: float) -> None:
        """s_i += w_ij Q_j for a neighbour's payload (validated: ProtocolError if bad)."""
        compressor.add_to(payload, self.mixed, alpha=weight * scale)

    def step_into(self, flat: torch.Tensor, gamma: float, dest: torch.Tensor) -> torch.Tensor:
        """dest = x_i + gamma (s_i - x̂_i), chunk by chunk (``dest`` may be ``flat``)."""
        mixed, public, gap = self.mixed, self.public, self._gap
        for lo in range(0, flat.numel(), CHUNK):
            hi = min(lo + CHUNK, flat.numel())
            part = gap[:hi - lo]
            torch.sub(mixed[lo:hi], public[lo:hi], out=part)
            torch.add(flat[lo:hi], part, alpha=gamma, out=dest[lo:hi])
        return dest


class Replicas:
    """Each neighbour's public copy x̂_j on its own, as robust mixing needs them (the s-form
    keeps only their weighted sum): deg(i) tensors more."""

    def __init__(self, like: torch.Tensor, neighbors, copies=None):
        self.copies = {j: torch.zeros_like(like) for j in neighbors} if copies is None else {
            int(j): copy for j, copy in copies.items()}

    def add(self, compressor: Compressor, j: int, payload: Payload, *, scale: float) -> bool:
        """x̂_j += Q_j, the raw payload as j applied it; False (and nothing added) when it
        holds a non-finite value (validated: ProtocolError if malformed)."""
        if not all(torch.isfinite(b).all() for b in payload.buffers if b.is_floating_point()):
            return False
        compressor.add_to(payload, self.copies[j], alpha=scale)
        return True
