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
    """Every peer's top-k of x + residual all-gathered and summed: the sparse baseline.

    With ``robust``, each peer aggregates the P sets as whole vectors (zeros where a set has
    no entry) robustly instead (gossip/strategies/robust.py), in rank order, from the same
    last aggregate: every peer still gets the same result. A residual keeps its meaning
    (what its peer did not send); only the sum over peers is no longer conserved.
    """

    options_class = TopKAllGatherOptions
    # A round's residual depends on this peer's input alone (its own top-k), so a round the
    # others completed leaves it as on completion, and a redo restores it (ElasticRounds).
    survives_death = True

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.robust = self.options.gathered()
        self.checks_own_result = self.capabilities_for(self.options)["checks_own_result"]
        self.last_aggregate: torch.Tensor | None = None  # robust: centered-clip's start
        self.flagged = 0  # robust: sets left out as non-finite in the latest round

    @classmethod
    def capabilities_for(cls, options):
        held = options.gathered_capabilities(super().capabilities_for(options))
        # robust aggregation starts from the last aggregate: not carried over a view yet
        return {**held, "survives_death": options.gathered() is None}

    def record_fields(self, round):
        return {} if self.robust is None else {"robust_flagged": self.flagged}

    def state_dict(self):
        state = super().state_dict()
        if self.robust is not None:
            state["aggregate"] = self.last_aggregate
        return state

    def load_state_dict(self, state):
        super().load_state_dict(state)
        self.last_aggregate = state.get("aggregate")

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
            msg = pack(self.tag, round, [mine], n=n, step=0, epoch=self.epoch)
        for dst in self.members:
            if dst != self.rank:
                self._send(dst, msg, timings)
        with timings("select"):
            work[torch.from_numpy(idx)] = 0  # the residual: what we did not send
        with timings("reduce"):
            dest.zero_()
        total = dest.numpy()
        gathered = []  # robust: each peer's set as a whole vector
        # Rank order on every peer: the same additions in the same order, identical results.
        for src in self.members:
            if src == self.rank:
                block = mine
            else:
                reply = self._recv(src, self.tag, round, timings)
                with timings("decode"):
                    (block,) = unpack(reply, rank=self.rank, n=n, step=0, blocks=[0], length=n,
                                      limit=k, dtype=dest.dtype)
            with timings("reduce"):
                if self.robust is not None:
                    vector = torch.zeros_like(dest)
                    vector.numpy()[block.idx] = block.val
                    gathered.append(vector)
                else:  # divided per set: no second pass over the whole tensor
                    total[block.idx] += block.val / self.size  # distinct indices in a set
        if self.robust is not None:
            with timings("reduce"):
                aggregate, flagged = self.robust.aggregate(gathered, self.last_aggregate)
                dest.copy_(aggregate)
                self.last_aggregate, self.flagged = aggregate, flagged
