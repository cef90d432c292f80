"""Ring all-reduce: the exact bandwidth-optimal ring (exact.py), its compressed forms
(compressed.py), sharing the ring's layout (layout.py), and PowerSGD (powersgd.py), whose
low-rank factors two exact rings average."""

from gossip.strategies.base import STRATEGIES
from gossip.strategies.ring.compressed import CompressedRingAllReduce, SharedRandomKRingAllReduce
from gossip.strategies.ring.exact import RingAllReduce
from gossip.strategies.ring.options import PowerSGDOptions, RingOptions
from gossip.strategies.ring.powersgd import PowerSGD

__all__ = ["CompressedRingAllReduce", "PowerSGD", "PowerSGDOptions", "RingAllReduce",
           "RingOptions", "SharedRandomKRingAllReduce"]


@STRATEGIES.register("ring-allreduce", options=RingOptions)
def ring_allreduce(options: RingOptions) -> type:
    """Mean over all peers by reduce-scatter + all-gather around a ring, any P."""
    if options.compressor is None:
        return RingAllReduce
    if options.compressor.shared_support:
        return SharedRandomKRingAllReduce
    return CompressedRingAllReduce


STRATEGIES.register("powersgd")(PowerSGD)
