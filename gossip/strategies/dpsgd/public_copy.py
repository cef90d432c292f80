"""CHOCO's state in the memory-efficient form, and the round's passes over it fused.

x̂_i (``public``) and s_i = sum_j w_ij x̂_j (``mixed``) change only where a payload has
entries. The round then needs x_i + gamma (s_i - x̂_i) everywhere; computed whole, that is
two passes over the model and a model-sized temporary. ``step_into`` runs the same two
elementwise ops on cache-sized chunks instead: one pass, no temporary, and bit for bit the
same result (elementwise ops round the same whatever the chunking). The difference x_i - x̂_i
that is compressed goes into a buffer kept across rounds (top-k takes it chunk by chunk in
the pass that scans it and writes nothing model-sized); a sparsifier's own payload is
applied from its selection, without decoding the indices it just encoded.

On large models a sparsifier's payloads (our own, then each neighbour's) are not scattered
into x̂_i and s_i as they come: they are validated and kept, and ``step_into`` adds each
chunk's share once the chunk is streamed into cache, just before it steps that chunk. A
scatter-add into a tensor larger than the cache misses at nearly every entry; inside the
step's pass the lines are already there. Every element still sees the same adds in the same
order, so the result is the same bits. Reading ``public`` or ``mixed`` applies whatever is
still kept first.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch

from gossip.compress import Compressor, Payload
from gossip.compress.base import check_out
from gossip.compress.sparse import Sparse, scatter_add

#: Elements per chunk of the fused step. 1 MiB of float32 per tensor: the chunks of x, x̂, s
#: and the gap still sit in the last-level cache, and each torch call (~5 us) is paid 4x less
#: often than at 64k, where the calls cost more than the L2 saved (25M floats: the step 19.8
#: -> 14.4 ms alone, 33.8 -> 23.3 ms with four payloads kept). A power of two: torch's fp16
#: and bf16 add rounds a vector's scalar tail differently, so chunk edges stay on vectors'.
CHUNK = 1 << 18
#: Tensors from this many elements keep a sparsifier's payloads for the step's pass; smaller
#: ones (x̂_i and s_i in the last-level cache: 1M float32 measured no faster kept, the extra
#: pass per chunk cost what the scatter saved) add them at once.
KEEP_FROM = 1 << 22


class SparseAdd(NamedTuple):
    """``target += alpha * payload``, kept until the step's pass (or a read) applies it."""

    target: torch.Tensor
    sparse: Sparse
    alpha: float

    def apply(self) -> None:
        scatter_add(self.sparse, self.target, alpha=self.alpha)

    def split(self, chunk: int) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """Indices and values cut at every multiple of ``chunk`` (indices are sorted)."""
        idx = self.sparse.indices.to(self.target.device)
        values = self.sparse.values.to(self.target.device, self.target.dtype)
        ends = torch.arange(chunk, max(chunk, self.target.numel()), chunk, device=idx.device)
        bounds = torch.searchsorted(idx, ends)
        return idx.tensor_split(bounds), values.tensor_split(bounds)


class PublicCopy:
    """x̂_i and s_i of one flat tensor, plus the reused difference buffer."""

    def __init__(self, like: torch.Tensor, *, public: torch.Tensor | None = None,
                 mixed: torch.Tensor | None = None):
        self._public = torch.zeros_like(like) if public is None else public
        self._mixed = torch.zeros_like(like) if mixed is None else mixed
        self._kept: list[SparseAdd] = []  # sparse payloads not yet added, in arrival order
        self.difference = torch.empty_like(like)  # x_i - x̂_i, reused every round
        self._gap = torch.empty(min(CHUNK, like.numel()), dtype=like.dtype, device=like.device)

    @property
    def public(self) -> torch.Tensor:
        """x̂_i, every payload added."""
        self.settle()
        return self._public

    @property
    def mixed(self) -> torch.Tensor:
        """s_i, every payload added."""
        self.settle()
        return self._mixed

    def settle(self) -> None:
        """Add the payloads still kept, one scatter-add each (in the order they came)."""
        kept, self._kept = self._kept, []
        for add in kept:
            add.apply()

    def compress(self, compressor: Compressor, flat: torch.Tensor, *, key: str,
                 round: int) -> tuple[Payload, Sparse | None]:
        """The payload of Q(x_i - x̂_i) and, for a sparsifier, its decoded form."""
        public = self.public
        if compressor.sparse:  # top-k takes the difference in the same pass as its scan
            return compressor.compress_difference(  # type: ignore[attr-defined]
                flat, public, self.difference, key=key, round=round)
        diff = torch.sub(flat, public, out=self.difference)
        return compressor.compress(diff, key=key, round=round), None

    def add_own(self, compressor: Compressor, payload: Payload, sparse: Sparse | None, *,
                self_weight: float, scale: float) -> None:
        """Apply our own payload: x̂_i += Q, s_i += w_ii Q (as the neighbours apply it); a
        sparsifier's is kept for the step, from the selection (SparseCompressor.add_to's
        scatter-add, without decoding)."""
        for target, weight in ((self._public, 1.0), (self._mixed, self_weight)):
            if sparse is None:
                self.settle()
                compressor.add_to(payload, target, alpha=weight * scale)
            else:
                self._keep(target, sparse, weight * scale)

    def add_neighbour(self, compressor: Compressor, payload: Payload, *, weight: float,
                      scale: float) -> None:
        """s_i += w_ij Q_j for a neighbour's payload (validated now: ProtocolError if bad; a
        sparsifier's is kept for the step)."""
        if compressor.sparse:
            self._keep(self._mixed, compressor.unpack(payload),  # type: ignore[attr-defined]
                       weight * scale)
        else:
            compressor.add_to(payload, self.mixed, alpha=weight * scale)

    def _keep(self, target: torch.Tensor, sparse: Sparse, alpha: float) -> None:
        check_out(target, sparse.header.numel)
        add = SparseAdd(target, sparse, alpha)
        if target.numel() < KEEP_FROM:
            add.apply()
        else:
            self._kept.append(add)

    def step_into(self, flat: torch.Tensor, gamma: float, dest: torch.Tensor) -> torch.Tensor:
        """dest = x_i + gamma (s_i - x̂_i), chunk by chunk (``dest`` may be ``flat``), each
        chunk's share of the kept payloads added to x̂_i and s_i just before."""
        kept, self._kept = self._kept, []
        difference = _chunk_difference(self._mixed, self._public, self._gap)
        pieces = [(add.target, *add.split(CHUNK), add.alpha) for add in kept]
        for c, lo in enumerate(range(0, flat.numel(), CHUNK)):
            hi = min(lo + CHUNK, flat.numel())
            if pieces:
                # Stream the chunk of both copies into cache first (the prefetcher follows a
                # sequential pass, not the scatter), then scatter into it.
                difference(lo, hi)
                for target, indices, values, alpha in pieces:
                    if indices[c].numel():
                        target.index_add_(0, indices[c], values[c], alpha=alpha)
            torch.add(flat[lo:hi], difference(lo, hi), alpha=gamma, out=dest[lo:hi])
        return dest


def _chunk_difference(mixed: torch.Tensor, public: torch.Tensor,
                      gap: torch.Tensor) -> Callable[[int, int], torch.Tensor]:
    """``(lo, hi) -> gap[:hi - lo] = mixed[lo:hi] - public[lo:hi]``. On CPU float32/64 by
    numpy: the same IEEE subtraction, and slicing a numpy array costs a fifth of slicing a
    tensor (at 25M floats, 200 subtractions a round)."""
    if all(t.device.type == "cpu" and t.dtype in (torch.float32, torch.float64)
           for t in (mixed, public, gap)):
        m, p, g = mixed.numpy(), public.numpy(), gap.numpy()

        def difference(lo: int, hi: int) -> torch.Tensor:
            np.subtract(m[lo:hi], p[lo:hi], out=g[:hi - lo])
            return gap[:hi - lo]
    else:
        def difference(lo: int, hi: int) -> torch.Tensor:
            return torch.sub(mixed[lo:hi], public[lo:hi], out=gap[:hi - lo])
    return difference


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
