"""Stochastic gradient push (push-sum gossip) on directed and time-varying graphs."""

from gossip.strategies.base import STRATEGIES
from gossip.strategies.sgp.options import SGPOptions
from gossip.strategies.sgp.pushsum import PushSum

__all__ = ["PushSum", "SGPOptions"]


@STRATEGIES.register("sgp", options=SGPOptions)
def sgp(options: SGPOptions) -> type:
    """Stochastic gradient push (Assran et al. 2019): push-sum with a column-stochastic mix,
    so directed and time-varying graphs work; the model is the de-biased x / w."""
    return PushSum
