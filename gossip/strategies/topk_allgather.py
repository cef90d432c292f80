"""TopK-AllGather, the sparse baseline: every peer sends its local top-k to every other peer
and each sums all P sets.

Per peer and round: (P - 1) messages of k pairs out and as many in, one step of latency.
The result has up to P·k non-zeros; every peer's residual is its input minus what it sent,
so mass is conserved exactly.
"""

from __future__ import annotations

import torch

from gossip.strategies.base import STRATEGIES
from gossip.strategies.sparse_common import (
    SparseStrategy,
    encode_block,
    pack,
    select,
    unpack,
)


@STRATEGIES.register("topk-allgather")
class TopKAllGather(SparseStrategy):
    """Mean over peers of each peer's top-k of ``x + residual``.

    Args:
        density: Fraction of entries each peer sends, in (0, 1]; k = max(1, ceil(d·n)).
        error_feedback: Carry what was not sent into the next round (see SparseStrategy).
        tag: Message kind, distinct per instance sharing one transport.
        indices: Index wire encoding, ``"compact"`` or ``"int32"``.
    """

    def __init__(self, *, rank, topology, transport, density: float = 0.01,
                 error_feedback: bool = True, tag: str = "tkag", indices: str = "compact"):
        super().__init__(rank=rank, topology=topology, transport=transport, density=density,
                         error_feedback=error_feedback, tag=tag, indices=indices)

    @property
    def kinds(self) -> tuple[str, ...]:
        return (self.tag,)

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
