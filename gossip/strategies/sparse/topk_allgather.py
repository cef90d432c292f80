"""TopK-AllGather, the sparse baseline: every peer sends its local top-k to every other peer
and each sums all P sets.

Per peer and round: (P - 1) messages of k pairs out and as many in, one step of latency.
The result has up to P·k non-zeros; every peer's residual is its input minus what it sent,
so mass is conserved exactly.
"""

from __future__ import annotations

import torch

from gossip.strategies.sparse.base import SparseStrategy
from gossip.strategies.sparse.options import TopKAllGatherOptions
from gossip.strategies.sparse.sets import select
from gossip.strategies.sparse.traffic import topk_allgather_traffic
from gossip.strategies.sparse.wire import encode_block, pack, unpack


class TopKAllGather(SparseStrategy):
    """Every peer's top-k of x + residual all-gathered and summed: the sparse baseline."""

    options_class = TopKAllGatherOptions

    @classmethod
    def traffic(cls, rank, size, numel, dtype, options):
        """Every set carries k entries (exact while none of them is 0; index bytes exact for
        ``indices="int32"``)."""
        return topk_allgather_traffic(rank, size, numel, dtype, options)

    def _run(self, work, n, dest, round, timings) -> None:
        k = self._k(n)
        with timings("select"):
            idx, val = select(work, k, self._generator)
        with timings("encode"):
            mine = encode_block(0, idx, val, n, self.indices)
            msg = pack(self.tag, round, [mine], n=n, step=0)
        for dst in range(self.size):
            if dst != self.rank:
                self._send(dst, msg, timings)
        with timings("select"):
            work[torch.from_numpy(idx)] = 0  # the residual: what we did not send
        with timings("reduce"):
            dest.zero_()
        total = dest.numpy()
        # Rank order on every peer: the same additions in the same order, identical results.
        for src in range(self.size):
            if src == self.rank:
                block = mine
            else:
                reply = self._recv(src, self.tag, round, timings)
                with timings("decode"):
                    (block,) = unpack(reply, rank=self.rank, n=n, step=0, blocks=[0], length=n,
                                      limit=k, dtype=dest.dtype)
            with timings("reduce"):
                # Divided per set: no second pass over the whole tensor.
                total[block.idx] += block.val / self.size  # distinct indices within a set
