"""MATCHA: gossip over the graph's matchings, each activated with an optimized probability
(exact.py), or with CHOCO's compressed differences on per-edge copies (choco.py); both run
the same activation schedule (schedule.py)."""

from gossip.strategies.base import STRATEGIES
from gossip.strategies.matcha.choco import ChocoMatcha
from gossip.strategies.matcha.exact import Matcha
from gossip.strategies.matcha.options import MatchaOptions

__all__ = ["ChocoMatcha", "Matcha", "MatchaOptions"]


@STRATEGIES.register("matcha", options=MatchaOptions)
def matcha(options: MatchaOptions) -> type:
    """D-PSGD over the graph's matchings, each active with an optimized probability drawn from
    a shared seed; with a compressor, CHOCO differences on per-edge public copies."""
    return Matcha if options.compressor is None else ChocoMatcha
