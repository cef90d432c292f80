"""Options of ``local`` (local SGD): the period, the warm-up, the groups, the optimizer state,
the outer optimizer (DiLoCo) and the fragments (streaming DiLoCo).

The inner strategy's options nest (``inner_options``), as ``nonblocking``'s do.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gossip.errors import ConfigError
from gossip.options import TaggedOptions, at_least, option, positive
from gossip.strategies.base import EXACT_MEAN
from gossip.strategies.wrapping import inner_options, inner_refusal


def _groups(value: Any) -> str | None:
    if value == "hosts":
        return None
    if not isinstance(value, (list, tuple)) or not value:
        return "must be 'hosts' or a non-empty list of lists of ranks"
    seen: set[int] = set()
    for group in value:
        if not isinstance(group, (list, tuple)) or not group:
            return f"must be lists of ranks, got the group {group!r}"
        for rank in group:
            if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
                return f"must hold ranks (integers >= 0), got {rank!r}"
            if rank in seen:
                return f"must not share ranks: rank {rank} is in two groups"
            seen.add(rank)
    return None


def _momentum(value: float) -> str | None:
    return None if 0 <= value < 1 else "must be in [0, 1)"


@dataclass(frozen=True)
class LocalOptions(TaggedOptions, tag="local"):
    """Options of ``local``; ``inner_options`` become the inner strategy's own."""

    examples = ({"period": 2}, {"inner": "dpsgd", "period": 2, "warmup_rounds": 1},
                {"period": 2, "outer_lr": 0.7, "outer_momentum": 0.9, "nesterov": True,
                 "fragments": 2})
    # DiLoCo, averaging every step so that the matrix's two rounds take an outer step
    variants = ({"period": 1, "outer_lr": 0.7, "outer_momentum": 0.9, "nesterov": True},)

    inner: str = option(EXACT_MEAN, "the strategy that averages the parameters every period: "
                                    "ring-allreduce (exact), dpsgd or matcha (decentralized), "
                                    "ps")
    inner_options: Any = option(None, "the inner strategy's options, e.g. {mode: sync}")
    period: int = option(4, "H: local steps per average (1 with plain SGD is mini-batch SGD)",
                         check=at_least(1))
    warmup_rounds: int = option(0, "post-local SGD: average the gradients exactly in the first "
                                   "this many rounds, then local SGD", check=at_least(0))
    group_period: int | None = option(None, "hierarchical: average inside each group every "
                                            "this many steps (divides period; none: off)",
                                      check=at_least(1))
    groups: Any = option("hosts", "the groups of group_period: 'hosts' (peers sharing a host) "
                                  "or lists of ranks covering every rank once")
    optimizer_state: str = option("keep", "the optimizer's state at an average: keep it local, "
                                          "reset it, or average it with the model",
                                  choices=("keep", "reset", "average"))
    outer_lr: float = option(1.0, "DiLoCo: the outer SGD's learning rate on the averaged "
                                  "pseudo-gradient (1 with no momentum: plain averaging)",
                             check=positive)
    outer_momentum: float = option(0.0, "DiLoCo: the outer SGD's momentum, the same on "
                                        "every peer", check=_momentum)
    nesterov: bool = option(False, "DiLoCo: Nesterov momentum for the outer SGD")
    fragments: int = option(1, "streaming DiLoCo: K contiguous slices of the model, one "
                               "averaged every period/K steps in turn (divides period)",
                            check=at_least(1))

    def __post_init__(self):
        super().__post_init__()
        why = _groups(self.groups)
        if why:
            raise ConfigError(f"local: groups {why}")
        if self.group_period is not None and (self.group_period >= self.period
                                              or self.period % self.group_period):
            raise ConfigError(f"local: group_period must divide period and be shorter (the "
                              f"periods nest), got group_period {self.group_period} with "
                              f"period {self.period}")
        if self.period % self.fragments:
            raise ConfigError(f"local: fragments must divide period (each fragment is averaged "
                              f"once a period), got fragments {self.fragments} with period "
                              f"{self.period}")
        if self.nesterov and not self.outer_momentum:
            raise ConfigError("local: nesterov needs an outer_momentum above 0")
        inner, held = inner_options("local", self.inner, self.inner_options, own=LocalOptions)
        if self.outer and not held["exact_mean"]:
            raise ConfigError(f"local: outer_lr/outer_momentum need an inner strategy that "
                              f"returns the exact mean (exact_mean), so that G and its "
                              f"momentum stay equal on every peer; {self.inner!r} with these "
                              f"options does not (use ring-allreduce or ps sync)")
        if self.outer and self.optimizer_state == "average":
            raise ConfigError("local: optimizer_state average with an outer optimizer: the "
                              "inner optimizer's state stays per peer (use keep or reset)")
        if held["synchronous"] is False and (self.warmup_rounds or self.group_period):
            raise ConfigError(f"local: warmup_rounds and group_period average in lockstep "
                              f"rounds, which the asynchronous inner {self.inner!r} has not")
        object.__setattr__(self, "inner_options", inner)

    @property
    def outer(self) -> bool:
        """Whether an outer SGD steps G (DiLoCo); lr 1 without momentum is plain averaging."""
        return self.outer_lr != 1 or self.outer_momentum != 0

    @classmethod
    def accepts_inner(cls, capabilities: Mapping[str, Any]) -> str | None:
        """Why local cannot wrap a strategy with these capabilities (None: it can); an
        asynchronous one runs every period's exchange, its poll and finish forwarded."""
        return inner_refusal(capabilities, asynchronous=True)
