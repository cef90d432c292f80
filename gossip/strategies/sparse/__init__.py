"""Sparse all-reduce: TopK-AllGather (the baseline), gTop-k and SparDL, on one residual
bookkeeping (base.py), sparse-set arithmetic (sets.py) and wire format (wire.py)."""

from gossip.strategies.base import STRATEGIES
from gossip.strategies.sparse.base import SparseStrategy
from gossip.strategies.sparse.gtopk import GTopK
from gossip.strategies.sparse.options import SparseOptions
from gossip.strategies.sparse.spardl import SparDL
from gossip.strategies.sparse.topk_allgather import TopKAllGather

__all__ = ["GTopK", "SparDL", "SparseOptions", "SparseStrategy", "TopKAllGather"]

STRATEGIES.register("topk-allgather")(TopKAllGather)
STRATEGIES.register("gtopk")(GTopK)
STRATEGIES.register("spardl")(SparDL)
