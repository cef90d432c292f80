"""Strategies decide by a compressor's declared capabilities, never by its name: each
compressor's decision, plain and wrapped, listed."""

from __future__ import annotations

import pytest

from gossip.compress import COMPRESSORS, build
from gossip.errors import ConfigError
from gossip.strategies.dpsgd.compression import default_gamma
from gossip.strategies.ring import (CompressedRingAllReduce, RingOptions,
                                    SharedRandomKRingAllReduce, ring_allreduce)

NUMEL = 1000
#: name -> (the ring that carries it, or None: refused; CHOCO's default step on NUMEL values)
DECISIONS = {
    "none": (CompressedRingAllReduce, "dense"),
    "bf16": (CompressedRingAllReduce, "dense"),
    "fp16": (CompressedRingAllReduce, "dense"),
    "qsgd": (CompressedRingAllReduce, "dense"),
    "sign": (CompressedRingAllReduce, "dense"),
    "terngrad": (CompressedRingAllReduce, "dense"),
    "randomk": (SharedRandomKRingAllReduce, 0.5),
    "threshold": (None, 2.0),
    "topk": (None, 2.0),
}


def test_every_compressor_is_listed():
    assert sorted(DECISIONS) == sorted(COMPRESSORS.names())


@pytest.mark.parametrize("wrapped", [{}, {"error_feedback": True}])
@pytest.mark.parametrize("name", sorted(DECISIONS))
def test_each_compressors_decisions(name, wrapped):
    compressor = build(name, **wrapped)
    ring, step = DECISIONS[name]
    if ring is None:
        with pytest.raises(ConfigError, match="cannot carry the sparsifier"):
            RingOptions(compressor=compressor)
    else:
        assert ring_allreduce(RingOptions(compressor=compressor)) is ring
    omega = compressor.quality(NUMEL)
    expected = min(1.0, max(omega, 0.4)) if step == "dense" else min(1.0, step * omega)
    assert default_gamma(compressor, NUMEL) == expected
