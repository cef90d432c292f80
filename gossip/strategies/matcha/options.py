"""MATCHA's options (with a compressor too: CHOCO differences on per-edge public copies)."""

from __future__ import annotations

from dataclasses import dataclass

from gossip.options import at_least, in_unit_interval, option
from gossip.strategies.dpsgd.compression import ChocoOptions
from gossip.strategies.robust import RobustOptions


@dataclass(frozen=True)
class MatchaOptions(RobustOptions, ChocoOptions, tag="matcha"):
    """Options of ``matcha``."""

    examples = ({"budget": 0.5}, {"budget": 1.0, "seed": 3},
                {"budget": 0.6, "compressor": "topk", "density": 0.3},
                {"budget": 0.6, "robust": "clip", "tau": 1.0})
    #: A round mixes with the partners of its active matchings, often a single one.
    robust_rules = ("clip",)

    budget: float = option(0.5, "communication budget C_b in (0, 1]: expected active "
                                "matchings per round at most C_b times their number",
                           check=in_unit_interval)
    seed: int = option(0, "seed of the activation schedule, the same on every peer",
                       check=at_least(0))

    def robust_refusal(self, rule: str) -> str:
        return ("matcha mixes with the partners of one round's matchings, often a single one, "
                "too few to trim: use robust=clip")

    def robust_conflict(self) -> str | None:
        if self.compressor is not None:
            return ("with a compressor, matcha's per-edge public copies are not mixed robustly "
                    "(dpsgd's CHOCO is): drop the compressor or use dpsgd")
        return None
