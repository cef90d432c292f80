"""MATCHA's options (with a compressor too)."""

from __future__ import annotations

from dataclasses import dataclass

from gossip.compress import Compressor
from gossip.errors import ConfigError
from gossip.strategies.gossip.compression import check_choco_compressor
from gossip.strategies.options import Options, at_least, in_unit_interval, option


@dataclass(frozen=True)
class MatchaOptions(Options):
    """Options of ``matcha``."""

    examples = ({"budget": 0.5}, {"budget": 1.0, "seed": 3},
                {"budget": 0.6, "compressor": "topk", "density": 0.3})

    budget: float = option(0.5, "communication budget C_b in (0, 1]: expected active "
                                "matchings per round at most C_b times their number",
                           check=in_unit_interval)
    seed: int = option(0, "seed of the activation schedule, the same on every peer",
                       check=at_least(0))
    tag: str = option("matcha", "message kind, distinct per instance on one transport")
    compressor: Compressor | None = option(
        None, "CHOCO's compressed differences on per-edge public copies (see "
              "`gossip compressors`)")
    gamma: float | None = option(None, "CHOCO's consensus step in (0, 1] (default: from the "
                                       "compressor's quality)", check=in_unit_interval)

    def __post_init__(self):
        super().__post_init__()
        if self.compressor is None and self.gamma is not None:
            raise ConfigError("gamma is CHOCO's consensus step: it needs a compressor")
        if self.compressor is not None:
            check_choco_compressor(self.compressor)
