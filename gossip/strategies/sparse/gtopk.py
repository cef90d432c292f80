"""gTop-k (Shi et al., ICDCS 2019): a global top-k by pairwise merging along a binomial tree.

Every peer selects its local top-k of ``x + residual``. Reduce: in step D = 1, 2, 4, ... a
rank with ``r % 2D == D`` sends its set to ``r - D`` and is done; a rank with ``r % 2D == 0``
receives from ``r + D`` (if that rank exists) and keeps the top-k of the union (sum on
coinciding indices). Rank 0 ends with the global set G, which a binomial broadcast hands to
everyone. For any P (not only powers of two): ceil(log2 P) reduce steps and as many
broadcast steps; a receiver whose partner ``r + D >= P`` skips the step, so every local set
reaches rank 0 through exactly one chain of merges. The result is G / P: at most k
non-zeros, identical on all peers, and not in general the top-k of the dense sum. For powers
of two the tree is the reference's (0<-1, 2<-3, ...; then 0<-2, ...). Rank 0 receives and
sends ceil(log2 P) k-sets per round, a leaf one each.

Residuals (``residual_mode``):

* ``"conserve"`` (default): a peer's residual is what it did not send, plus, at a peer that
  merges, the summed entries the merge dropped. Why this conserves mass for every P: an
  input entry either stays out of its peer's local set (in that peer's residual) or travels
  up its one chain of merges, summed with others on the same index; each merge either keeps
  the sum (it travels on) or cuts it (into the merging peer's residual, once). What reaches
  rank 0 is G, so sum of inputs == G + sum of residuals == P * result + sum of residuals.
* ``"reference"``: the published rule. A peer's residual is what it did not send plus those
  of its sent entries whose index is not in G; entries dropped at an intermediate merge whose
  index another branch brought into G are lost. Exact for P <= 2, loses mass for P >= 3.
  Kept to reproduce the paper.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

from gossip.strategies.sparse.base import GlobalSelection
from gossip.strategies.sparse.options import GTopKOptions
from gossip.strategies.sparse.sets import keep_topk, member, merge_sum, select
from gossip.strategies.sparse.traffic import gtopk_traffic
from gossip.strategies.sparse.wire import encode_block, pack, unpack


def reduce_steps(rank: int, size: int) -> Iterator[tuple[str, int, int]]:
    """This rank's part of the binomial reduce towards rank 0, in order: (action, peer,
    level) with ("recv", r + D) merges and at most one final ("send", r - D); D = 2**level."""
    d, level = 1, 0
    while d < size:
        if rank % (2 * d) == d:
            yield "send", rank - d, level
            return
        if rank + d < size:
            yield "recv", rank + d, level
        d, level = 2 * d, level + 1


def broadcast_steps(rank: int, size: int) -> Iterator[tuple[str, int]]:
    """This rank's part of the binomial broadcast from rank 0: at most one ("recv", r - D),
    then ("send", r + D) for the smaller distances."""
    d = 1 << max(math.ceil(math.log2(size)) - 1, 0) if size > 1 else 0
    while d >= 1:
        if rank % (2 * d) == d:
            yield "recv", rank - d
        elif rank % (2 * d) == 0 and rank + d < size:
            yield "send", rank + d
        d //= 2


class GTopK(GlobalSelection):
    """Global top-k by pairwise merging along a binomial tree, O(k log P) per peer.

    In an elastic run the tree is on the view's slots. A round some member completed had
    every member's reduce done (its set reached slot 0 through its chain), and a member's
    residual then lacks only what the global set decides (``reference``; ``conserve``'s is
    final): ``adopted`` completes it from the set the donor carries.
    """

    options_class = GTopKOptions
    survives_death = True

    def __init__(self, *, rank, topology, transport, options: GTopKOptions | None = None):
        super().__init__(rank=rank, topology=topology, transport=transport, options=options)
        self.residual_mode = self.options.residual_mode

    @classmethod
    def traffic(cls, rank, size, numel, dtype, options):
        """Every set carries k entries (exact while none of them is 0; index bytes exact for
        ``indices="int32"``)."""
        return gtopk_traffic(rank, size, numel, dtype, options, list(reduce_steps(rank, size)),
                             list(broadcast_steps(rank, size)))

    def _run(self, work, n, dest, round, timings) -> None:
        up, down = self.kinds
        k = self._k(n)
        residual = work.numpy()
        with timings("select"):
            idx, val = select(work, k, self._generator)
            residual[idx] = 0  # provisional: everything not sent
        local = idx, val
        conserve = self.residual_mode == "conserve"
        slot, members = self.slot, self.members
        msg = None  # the set as it last travelled, forwarded as is in the broadcast
        for action, peer, step in reduce_steps(slot, self.size):
            if action == "send":
                with timings("encode"):
                    block = encode_block(0, idx, val, n, self.indices)
                    mine = pack(up, round, [block], n=n, step=step, epoch=self.epoch)
                self._send(members[peer], mine, timings)
                break
            theirs = self._recv_set(up, round, members[peer], n, k, step, dest.dtype, timings)
            with timings("reduce"):
                (idx, val), (lost, lost_val) = keep_topk(*merge_sum(idx, val, theirs.idx,
                                                                    theirs.val), k)
                if conserve:
                    residual[lost] += lost_val  # indices in a set are distinct

        def settle(global_idx):  # the reference rule: sent entries G left out come back
            if not conserve:
                sent, sent_val = local
                back = ~member(sent, global_idx)
                residual[sent[back]] += sent_val[back]

        self._settles(round, settle)
        # Broadcast messages are forwarded unchanged, so all carry step 0.
        for action, peer in broadcast_steps(slot, self.size):
            if action == "recv":
                msg = self._recv(members[peer], down, round, timings)
                with timings("decode"):
                    (block,) = unpack(msg, rank=self.rank, n=n, step=0, blocks=[0], length=n,
                                      limit=k, dtype=dest.dtype)
                idx, val = block.idx, block.val
                continue
            if msg is None:  # slot 0: encode the global set once for all its children
                with timings("encode"):
                    block = encode_block(0, idx, val, n, self.indices)
                    msg = pack(down, round, [block], n=n, step=0, epoch=self.epoch)
            self._send(members[peer], msg, timings)
        with timings("reduce"):
            self._settled(round, idx)
            dest.zero_()
            dest.numpy()[idx] = val / self.size

    def _recv_set(self, kind, round, src, n, k, step, dtype, timings):
        msg = self._recv(src, kind, round, timings)
        with timings("decode"):
            (block,) = unpack(msg, rank=self.rank, n=n, step=step, blocks=[0], length=n,
                              limit=k, dtype=dtype)
        return block

