"""SparDL (Zhao et al., ICDE 2024): Spar-Reduce-Scatter with re-sparsification after every
accumulation, Spar-All-Gather, global residual collection.

The tensor (x + residual) is zero-padded to P·B, B = ceil(n / P), and cut into P blocks;
peer b owns block b. Per-block budget k_b = max(1, ceil(density · B)).

* Spar-Reduce-Scatter (reverse Bruck, ceil(log2 P) steps): in step s a peer selects the
  top-k_b of each of m_s blocks -- after adding everything received for them so far -- and
  sends them in one message to the peer D_s ahead; it receives m_s blocks from the peer D_s
  behind. Steps (D, m): (2^(n-1), P - 2^(n-1)), then (2^(n-2-i), 2^(n-2-i)). Every non-owner
  sends each block exactly once; the owner ends with all P contributions and selects the
  final top-k_b of its block.
* Spar-All-Gather (Bruck, ceil(log2 P) steps): in step s a peer forwards the final blocks it
  holds (its own first) to the peer 2^s behind; the last step is cut for non-powers of two.
  Blocks are forwarded as received bytes, never re-encoded.
* Global residual collection: a peer's new residual is its input, except at the globally
  kept coordinates of each block, where it is what the peer dropped there (0 where it sent
  the coordinate on, its accumulated value where it received but did not send it on). Every
  contribution is thus in the result or in exactly one residual: mass is conserved.

Per peer and round: about 2(P - 1)·k_b pairs out and in, 2·ceil(log2 P) messages each way.
"""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np
import torch

from gossip.errors import ProtocolError
from gossip.strategies.sparse.base import GlobalSelection
from gossip.strategies.sparse.options import SparDLOptions
from gossip.strategies.sparse.sets import member, select
from gossip.strategies.sparse.traffic import spardl_traffic
from gossip.strategies.sparse.wire import Block, encode_block, pack, unpack


def reduce_scatter_schedule(size: int) -> list[tuple[int, int]]:
    """(distance D, blocks m) of each Spar-Reduce-Scatter step; the m sum to P - 1."""
    if size <= 1:
        return []
    steps = math.ceil(math.log2(size))
    top = 1 << (steps - 1)
    return [(top, size - top)] + [(1 << i, 1 << i) for i in range(steps - 2, -1, -1)]


def all_gather_schedule(size: int) -> list[tuple[int, int]]:
    """(distance D, blocks m) of each Bruck all-gather step; the m sum to P - 1."""
    steps = math.ceil(math.log2(size)) if size > 1 else 0
    return [(1 << s, min(2 << s, size) - (1 << s)) for s in range(steps)]


class _Dropped:
    """What this peer keeps of one block it selected from: the coordinates it sent on and
    the accumulated values at coordinates it received but did not send on."""

    __slots__ = ("held", "held_val", "sent")

    def __init__(self, sent: np.ndarray, held: np.ndarray, held_val: np.ndarray):
        self.sent, self.held, self.held_val = sent, held, held_val


def _union(sets: list[np.ndarray]) -> np.ndarray:
    """Sorted union of sorted index sets (np.unique hashes first: slower on sorted runs)."""
    if len(sets) == 1:
        return sets[0]
    both = np.concatenate(sets)
    both.sort(kind="stable")  # merges the sorted runs
    return both[np.concatenate(([True], both[1:] != both[:-1]))] if both.size else both


class SparDL(GlobalSelection):
    """Spar-Reduce-Scatter + Spar-All-Gather with global residual collection (density per
    block: k_b = max(1, ceil(d·B)), B = ceil(n/P)).

    In an elastic run the blocks and schedules are on the view's slots (any P). A round some
    member completed had every block's final set made, so every member had sent its whole
    reduce-scatter and kept what it dropped of each block; its residual then lacks only the
    globally kept coordinates: ``adopted`` completes it from the set the donor carries.
    """

    options_class = SparDLOptions
    survives_death = True

    @classmethod
    def traffic(cls, rank, size, numel, dtype, options):
        """Every block carries k_b entries (exact while no selected entry is 0; index bytes
        exact for ``indices="int32"``, else the compact code of evenly spread indices)."""
        return spardl_traffic(rank, size, numel, dtype, options,
                              reduce_scatter_schedule(size), all_gather_schedule(size))

    def _padded(self, n: int) -> int:
        return -(-n // self.size) * self.size

    def _run(self, work, n, dest, round, timings) -> None:
        rs, ag = self.kinds
        p, r, members = self.size, self.slot, self.members
        length = work.numel() // p
        k = self._k(length)
        blocks = work.view(p, length)
        received: dict[int, list[Block]] = defaultdict(list)
        dropped: dict[int, _Dropped] = {}

        def expect(msg, step, ids):
            with timings("decode"):
                got = unpack(msg, rank=self.rank, n=n, step=step, blocks=ids, length=length,
                             limit=k, dtype=dest.dtype)
            for block in got:  # padding is 0, never selected: only a broken peer sends it
                if block.idx.size and block.id * length + block.idx[-1] >= n:
                    raise ProtocolError(f"rank {self.rank}: peer {msg.src} sent {msg.kind} "
                                        f"round {round}: block {block.id} has index "
                                        f"{int(block.idx[-1])} in the padding (n = {n})")
            return got

        for step, (d, m) in enumerate(reduce_scatter_schedule(p)):
            out = []
            for j in range(m):
                b = (r + d + j) % p
                idx, val = self._select(blocks[b], received.pop(b, ()), k, dropped, b, timings)
                with timings("encode"):
                    out.append(encode_block(b, idx, val, length, self.indices))
            with timings("encode"):
                msg = pack(rs, round, out, n=n, step=step, epoch=self.epoch)
            self._send(members[(r + d) % p], msg, timings)
            msg = self._recv(members[(r - d) % p], rs, round, timings)
            for block in expect(msg, step, [(r + j) % p for j in range(m)]):
                received[block.id].append(block)
        idx, val = self._select(blocks[r], received.pop(r, ()), k, dropped, r, timings)
        with timings("encode"):
            final = {r: encode_block(r, idx, val, length, self.indices)}
        residual = blocks.numpy()
        self._settles(round, lambda global_idx: self._collect(
            residual, global_idx.reshape(-1), dropped, length))
        for step, (d, m) in enumerate(all_gather_schedule(p)):
            with timings("encode"):
                msg = pack(ag, round, [final[(r + j) % p] for j in range(m)], n=n, step=step,
                           epoch=self.epoch)
            self._send(members[(r - d) % p], msg, timings)
            msg = self._recv(members[(r + d) % p], ag, round, timings)
            for block in expect(msg, step, [(r + d + j) % p for j in range(m)]):
                final[block.id] = block
        with timings("reduce"):
            dest.zero_()
            mean = dest.numpy()
            kept = []
            for b in range(p):  # every kept index is < n (padding is 0, never selected)
                mean[b * length + final[b].idx] = final[b].val / p
                kept.append(b * length + final[b].idx)
            self._settled(round, np.concatenate(kept))

    def _select(self, own: torch.Tensor, received: list[Block], k: int,
                dropped: dict[int, _Dropped], b: int, timings) -> tuple[np.ndarray, np.ndarray]:
        """Top-k of block ``b`` (own values plus what was received for it); records what
        this peer drops of it."""
        if not received:
            with timings("select"):
                idx, val = select(own, k, self._generator)
            dropped[b] = _Dropped(idx, idx[:0], val[:0])
            return idx, val
        # Accumulate in place and restore the touched entries afterwards (an exact copy
        # back, not a subtraction): no dense temporary per block.
        total = own.numpy()
        with timings("reduce"):
            got = _union([block.idx for block in received])
            saved = total[got]
            for block in received:
                total[block.idx] += block.val  # distinct indices within a block
        with timings("select"):
            idx, val = select(own, k, self._generator)
        with timings("reduce"):
            held = got[~member(got, idx)]
            dropped[b] = _Dropped(idx, held, total[held])
            total[got] = saved
        return idx, val

    @staticmethod
    def _collect(blocks: np.ndarray, global_idx: np.ndarray, dropped: dict[int, _Dropped],
                 length: int) -> None:
        """Global residual collection into ``blocks`` (this peer's ``x + residual``, one row
        per block), from the round's kept coordinates ``global_idx`` (sorted, flat)."""
        cuts = np.searchsorted(global_idx, np.arange(1, blocks.shape[0]) * length)
        for b, kept in enumerate(np.split(global_idx, cuts)):
            kept, mine, row = kept - b * length, dropped[b], blocks[b]
            row[mine.sent[member(mine.sent, kept)]] = 0    # sent on: counted in the result
            at = member(mine.held, kept)
            row[mine.held[at]] = mine.held_val[at]         # received, dropped: ours to keep
