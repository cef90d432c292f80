"""Gradient / model compression: sparsifiers, quantizers and the wrappers that compose them.

``create(name, **options)`` builds one registered compressor; ``build`` adds the wrappers::

    c = compress.build("topk", density=0.01, error_feedback=True, warmup_rounds=4)
    p = c.compress(grad, key="layer1", round=step)   # send Message(kind, step, p.meta, p.buffers)
    c.add_to(compress.Payload(msg.meta, msg.buffers), acc)   # receiver: acc += what was sent
"""

from __future__ import annotations

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
from gossip.compress.compose import WrapperOptions, build
from gossip.compress.feedback import ErrorFeedback, MomentumCorrection
from gossip.compress.indices import decode_indices, encode_indices
from gossip.compress.sparse import DensitySparsifier, Sparse, SparseCompressor
from gossip.compress.wrappers import Clip, DensityWarmup, Wrapper

__all__ = [
    "COMPRESSORS",
    "Clip",
    "Compressor",
    "DensitySparsifier",
    "DensityWarmup",
    "ErrorFeedback",
    "MomentumCorrection",
    "Payload",
    "Sparse",
    "SparseCompressor",
    "Wrapper",
    "WrapperOptions",
    "build",
    "compressor_options",
    "create",
    "decode_indices",
    "encode_indices",
]

