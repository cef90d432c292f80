"""Gradient / model compression: sparsifiers, quantizers and the wrappers that compose them.

``create(name, **options)`` builds one registered compressor; ``build`` adds the wrappers::

    c = compress.build("topk", density=0.01, error_feedback=True, warmup_rounds=4)
    p = c.compress(grad, key="layer1", round=step)   # send Message(kind, step, p.meta, p.buffers)
    c.add_to(compress.Payload(msg.meta, msg.buffers), acc)   # receiver: acc += what was sent
"""

from __future__ import annotations

from typing import Any

from gossip.compress import (  # noqa: F401  (register)
    cast,
    qsgd,
    randomk,
    sign,
    terngrad,
    threshold,
    topk,
)
from gossip.compress.base import (
    COMPRESSORS,
    Compressor,
    Payload,
    compressor_options,
    create,
)
from gossip.compress.feedback import ErrorFeedback, MomentumCorrection
from gossip.compress.indices import decode_indices, encode_indices
from gossip.compress.sparse import Sparse, SparseCompressor
from gossip.compress.wrappers import Clip, DensityWarmup, Wrapper
from gossip.errors import ConfigError

__all__ = [
    "COMPRESSORS",
    "Clip",
    "Compressor",
    "DensityWarmup",
    "ErrorFeedback",
    "MomentumCorrection",
    "Payload",
    "Sparse",
    "SparseCompressor",
    "Wrapper",
    "build",
    "compressor_options",
    "create",
    "decode_indices",
    "encode_indices",
]


def build(name: str, *, error_feedback: bool = False, momentum: float | None = None,
          clip_norm: float | None = None, warmup_rounds: int = 0,
          warmup_start: float | None = None, **options: Any) -> Compressor:
    """``create(name, **options)`` wrapped, innermost first, in the requested wrappers.

    Order: DensityWarmup around the sparsifier, then MomentumCorrection or ErrorFeedback
    (they remember what the warmed-up compressor did not send), Clip outermost (clipping the
    fresh gradient, not the accumulated residual).

    Args:
        error_feedback: Keep what was not sent and add it to the next round's input.
        momentum: DGC momentum correction with this factor (instead of error feedback).
        clip_norm: Clip each gradient to this L2 norm before compressing it.
        warmup_rounds: Raise a sparsifier's density from warmup_start to its own over these
            rounds.
        warmup_start: The density warm-up's first density (default 0.25).

    Raises:
        ConfigError: Unknown name/option, invalid values, warm-up on a compressor without a
            density, ``warmup_start`` without warm-up rounds, or momentum correction together
            with error feedback (both accumulate the unsent mass: it would be sent twice).
    """
    if not isinstance(error_feedback, bool):
        raise ConfigError(f"error_feedback must be true or false, got {error_feedback!r}")
    if momentum is not None and error_feedback:
        raise ConfigError("momentum correction already feeds back what was not sent; "
                          "do not combine it with error_feedback")
    if warmup_start is not None and not warmup_rounds:
        raise ConfigError("warmup_start needs warmup_rounds > 0")
    compressor = create(name, **options)
    if warmup_rounds:
        compressor = DensityWarmup(compressor, rounds=warmup_rounds,
                                   start=0.25 if warmup_start is None else warmup_start)
    if momentum is not None:
        compressor = MomentumCorrection(compressor, momentum=momentum)
    elif error_feedback:
        compressor = ErrorFeedback(compressor)
    if clip_norm is not None:
        compressor = Clip(compressor, max_norm=clip_norm)
    return compressor
