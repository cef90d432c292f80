"""Ring all-reduce: the exact bandwidth-optimal ring (exact.py) and its compressed forms
(compressed.py), sharing the ring's layout (layout.py)."""

from gossip.strategies.base import STRATEGIES
from gossip.strategies.ring.compressed import CompressedRingAllReduce, SharedRandomKRingAllReduce
from gossip.strategies.ring.exact import RingAllReduce
from gossip.strategies.ring.options import RingOptions

__all__ = ["CompressedRingAllReduce", "RingAllReduce", "RingOptions",
           "SharedRandomKRingAllReduce"]


@STRATEGIES.register("ring-allreduce", options=RingOptions)
def ring_allreduce(options: RingOptions) -> type:
    """Mean over all peers by reduce-scatter + all-gather around a ring, any P."""
    if options.compressor is None:
        return RingAllReduce
    if options.compressor.shared_support:
        return SharedRandomKRingAllReduce
    return CompressedRingAllReduce
