"""D-PSGD's options (CHOCO-Gossip's too: dpsgd with a compressor)."""

from __future__ import annotations

from dataclasses import dataclass

from gossip.compress import Compressor
from gossip.errors import ConfigError
from gossip.strategies.gossip.compression import check_choco_compressor
from gossip.strategies.options import Options, in_unit_interval, option


@dataclass(frozen=True)
class DPSGDOptions(Options):
    """Options of ``dpsgd``."""

    examples = ({}, {"compressor": "topk", "density": 0.3}, {"compressor": "qsgd"},
                {"compressor": "sign", "gamma": 0.4})

    tag: str = option("gossip", "message kind, distinct per instance on one transport")
    compressor: Compressor | None = option(
        None, "CHOCO-Gossip: exchange compressed differences to public copies (see "
              "`gossip compressors`)")
    gamma: float | None = option(None, "CHOCO's consensus step in (0, 1] (default: from the "
                                       "compressor's quality)", check=in_unit_interval)

    def __post_init__(self):
        super().__post_init__()
        if self.compressor is None and self.gamma is not None:
            raise ConfigError("gamma is CHOCO's consensus step: it needs a compressor")
        if self.compressor is not None:
            check_choco_compressor(self.compressor)
