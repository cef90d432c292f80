"""Options of ``ps`` (parameter server)."""

from __future__ import annotations

from dataclasses import dataclass

from gossip.errors import ConfigError
from gossip.options import TaggedOptions, at_least, in_unit_interval, option, positive
from gossip.strategies.robust import GatheredRobustOptions

MODES = ("sync", "async", "ssp")


@dataclass(frozen=True)
class PSOptions(GatheredRobustOptions, TaggedOptions, tag="ps"):
    """Options of ``ps``."""

    examples = ({"mode": "sync"}, {"mode": "ssp", "staleness": 1},
                {"mode": "sync", "robust": "centered-clip", "tau": 1.0})

    mode: str = option("sync", "sync: servers average pushed gradients in a fixed order; "
                               "async: workers push parameter deltas and pull the model; "
                               "ssp: async with pulls at most `staleness` clocks stale",
                       choices=MODES)
    backup: int = option(0, "sync: a step uses the first W - backup pushes and drops the "
                            "late ones (backup workers)", check=at_least(0))
    participation: float = option(1.0, "sync: the fraction of workers that push each round, "
                                       "drawn from (seed, round); all pull",
                                  check=in_unit_interval)
    staleness: int = option(2, "ssp: a pull at clock c waits until every worker has pushed "
                               "c - staleness times", check=at_least(0))
    scale: float | None = option(None, "async/ssp: factor on each pushed delta (default 1/W: "
                                       "W pushes move the model as far as one sync step)",
                                check=positive)
    seed: int = option(0, "seed of the participation draws")

    def __post_init__(self):
        super().__post_init__()
        if self.mode != "sync" and (self.backup or self.participation != 1.0):
            raise ConfigError(f"backup and participation are options of mode sync, not "
                              f"{self.mode}")
        if self.backup and self.participation != 1.0:
            raise ConfigError("give backup or participation, not both")

    def robust_conflict(self) -> str | None:
        # async/ssp apply each delta alone, the moment it arrives: no set to aggregate.
        if self.mode != "sync":
            return f"a robust aggregate needs the pushes of a step together (mode sync), " \
                   f"not mode {self.mode}"
        return None
