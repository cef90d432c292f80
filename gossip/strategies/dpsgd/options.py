"""D-PSGD's options (CHOCO-Gossip's too: dpsgd with a compressor)."""

from __future__ import annotations

from dataclasses import dataclass

from gossip.errors import ConfigError
from gossip.options import option
from gossip.strategies.dpsgd.compression import ChocoOptions
from gossip.strategies.robust import RobustOptions

#: Staleness is bounded by what the transport keeps of rounds past (transport/pending.py).
MAX_STALENESS = 15


@dataclass(frozen=True)
class DPSGDOptions(RobustOptions, ChocoOptions, tag="gossip"):
    """Options of ``dpsgd``."""

    examples = ({}, {"compressor": "topk", "density": 0.3}, {"compressor": "qsgd"},
                {"compressor": "sign", "gamma": 0.4}, {"staleness": 2},
                {"robust": "clip", "tau": 1.0}, {"robust": "clip", "tau_rule": "second"},
                {"robust": "median"}, {"compressor": "topk", "density": 0.3, "robust": "clip",
                                       "tau": 1.0})

    staleness: int = option(
        0, "bounded staleness s: mix each neighbour's newest model of rounds r-s..r, wait only "
           "when there is none (0: lockstep D-PSGD)",
        check=lambda s: None if 0 <= s <= MAX_STALENESS else f"must be in 0..{MAX_STALENESS}")
    compensate: bool = option(
        True, "with staleness: mix a neighbour's model of round t < r as x_j(t) + x_i(r) - "
              "x_i(t), its difference to ours then (false: x_j(t) as it is, which pulls "
              "ours back in time)")

    def __post_init__(self):
        super().__post_init__()
        if self.staleness and self.compressor is not None:
            raise ConfigError("staleness: CHOCO (dpsgd with a compressor) keeps its neighbours' "
                              "public copies in step and cannot mix stale ones")

    def robust_conflict(self) -> str | None:
        if self.staleness:
            return ("robust rules compare the neighbours' models of one round; staleness "
                    "mixes older ones: use staleness=0")
        return None
