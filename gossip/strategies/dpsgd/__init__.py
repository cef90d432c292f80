"""Gossip on the topology's static graph: exact D-PSGD (exact.py), with bounded staleness
(stale.py) and, with a compressor, CHOCO-Gossip (choco.py), sharing the neighbours' weights
(neighbourhood.py)."""

from gossip.strategies.base import STRATEGIES
from gossip.strategies.dpsgd.choco import ChocoGossip
from gossip.strategies.dpsgd.exact import DPSGD
from gossip.strategies.dpsgd.options import DPSGDOptions
from gossip.strategies.dpsgd.stale import StaleDPSGD

__all__ = ["DPSGD", "ChocoGossip", "DPSGDOptions", "StaleDPSGD"]


@STRATEGIES.register("dpsgd", options=DPSGDOptions)
def dpsgd(options: DPSGDOptions) -> type:
    """D-PSGD on the topology's graph with Metropolis-Hastings weights; with a compressor,
    CHOCO-Gossip; with ``staleness`` > 0, stale-synchronous D-PSGD."""
    if options.compressor is not None:
        return ChocoGossip
    return StaleDPSGD if options.staleness else DPSGD
