"""``build``: a registered compressor in the wrappers its options ask for (error feedback,
momentum correction, clipping, density warm-up), and those options, declared once."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gossip.compress.base import Compressor, create
from gossip.compress.feedback import ErrorFeedback, MomentumCorrection
from gossip.compress.wrappers import Clip, DensityWarmup
from gossip.errors import ConfigError
from gossip.options import Options, option


@dataclass(frozen=True)
class WrapperOptions(Options):
    """Options every compressor takes: error feedback, momentum correction, clipping, density
    warm-up.

    Their ranges are checked by the wrappers they build (``Clip``, ``MomentumCorrection``,
    ``DensityWarmup``), which users may also build by hand.
    """

    error_feedback: bool = option(False, "keep what was not sent and add it to the next "
                                         "round's input")
    momentum: float | None = option(None, "DGC momentum correction with this factor, in "
                                          "[0, 1) (instead of error feedback)")
    clip_norm: float | None = option(None, "clip each gradient to this L2 norm before "
                                           "compressing it")
    warmup_rounds: int = option(0, "raise a sparsifier's density from warmup_start to its own "
                                   "over these rounds")
    warmup_start: float | None = option(None, "the density warm-up's first density (default "
                                              "0.25)")

    def __post_init__(self):
        super().__post_init__()
        if self.momentum is not None and self.error_feedback:
            raise ConfigError("momentum correction already feeds back what was not sent; "
                              "do not combine it with error_feedback")
        if self.warmup_start is not None and not self.warmup_rounds:
            raise ConfigError("warmup_start needs warmup_rounds > 0")

    def wrap(self, compressor: Compressor) -> Compressor:
        """``compressor`` in the wrappers asked for, innermost first.

        Order: DensityWarmup around the sparsifier, then MomentumCorrection or ErrorFeedback
        (they remember what the warmed-up compressor did not send), Clip outermost (clipping
        the fresh gradient, not the accumulated residual).
        """
        if self.warmup_rounds:
            compressor = DensityWarmup(compressor, rounds=self.warmup_rounds,
                                       start=0.25 if self.warmup_start is None
                                       else self.warmup_start)
        if self.momentum is not None:
            compressor = MomentumCorrection(compressor, momentum=self.momentum)
        elif self.error_feedback:
            compressor = ErrorFeedback(compressor)
        if self.clip_norm is not None:
            compressor = Clip(compressor, max_norm=self.clip_norm)
        return compressor


def build(name: str, /, **options: Any) -> Compressor:
    """``create(name, ...)`` with its own options, wrapped as the ``WrapperOptions`` among
    ``options`` ask (``build("topk", density=0.01, error_feedback=True)``).

    Raises:
        ConfigError: Unknown name/option, invalid values, warm-up on a compressor without a
            density, ``warmup_start`` without warm-up rounds, or momentum correction together
            with error feedback (both accumulate the unsent mass: it would be sent twice).
    """
    wrappers = WrapperOptions(**{key: options.pop(key) for key in WrapperOptions.names()
                                 if key in options})
    return wrappers.wrap(create(name, **options))
