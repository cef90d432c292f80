"""D-PSGD's options (CHOCO-Gossip's too: dpsgd with a compressor)."""

from __future__ import annotations

from dataclasses import dataclass

from gossip.strategies.gossip.compression import ChocoOptions
from gossip.strategies.options import option


@dataclass(frozen=True)
class DPSGDOptions(ChocoOptions):
    """Options of ``dpsgd``."""

    examples = ({}, {"compressor": "topk", "density": 0.3}, {"compressor": "qsgd"},
                {"compressor": "sign", "gamma": 0.4})

    tag: str = option("gossip", "message kind, distinct per instance on one transport")
