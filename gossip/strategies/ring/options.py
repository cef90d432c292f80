"""The ring all-reduce's options."""

from __future__ import annotations

from dataclasses import dataclass

from gossip.compress import Compressor
from gossip.errors import ConfigError
from gossip.options import TaggedOptions, at_least, option


@dataclass(frozen=True)
class RingOptions(TaggedOptions, tag="ring", kinds=("rs", "ag")):
    """Options of ``ring-allreduce``."""

    examples = ({}, {"piece_bytes": 256}, {"compressor": "fp16"},
                {"compressor": "qsgd", "error_feedback": True},
                {"compressor": "randomk", "density": 0.5})

    piece_bytes: int = option(64 << 20, "largest message, in bytes of the input: smaller "
                              "pieces pipeline, larger ones cost less per message",
                              check=at_least(64))
    compressor: Compressor | None = option(
        None, "a cast or quantizer summed on the way round, or randomk with the same "
              "indices on every peer (see `gossip compressors`)")

    def __post_init__(self):
        super().__post_init__()
        c = self.compressor
        if c is not None and c.sparse and not c.shared_support:
            raise ConfigError(
                f"ring-allreduce cannot carry the sparsifier {c.name!r}: its sparse sets "
                f"differ between peers and grow as they are summed around the ring; use "
                f"topk-allgather, gtopk or spardl (option density=...) for sparse all-reduce")


@dataclass(frozen=True)
class PowerSGDOptions(TaggedOptions, tag="powersgd", kinds=("p.rs", "p.ag", "q.rs", "q.ag")):
    """Options of ``powersgd``; its two exact rings are tagged ``TAG.p`` and ``TAG.q``."""

    examples = ({}, {"matrix_rank": 2, "start_iter": 0, "min_compression_rate": 0.0,
                     "warm_start": False, "seed": 3})

    # Not ``rank``: that names the peer (``Peer(rank, ..., **options)``).
    matrix_rank: int = option(1, "rank r of each weight matrix's factors P (n x r) and Q "
                                 "(m x r)", check=at_least(1))
    start_iter: int = option(10, "rounds of warm-up that send the plain ring mean first "
                                 "(about 10% of the steps)", check=at_least(0))
    min_compression_rate: float = option(2.0, "compress an n x m matrix only if this times "
                                              "r(n+m) < nm (0: every matrix)",
                                         check=at_least(0))
    warm_start: bool = option(True, "start each round's power step from the last round's Q")
    seed: int = option(0, "seed of each fresh Q, the same on every peer")
