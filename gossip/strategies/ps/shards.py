"""Who serves which part of the vector, and who pushes in which round."""

from __future__ import annotations

import random

from gossip.errors import ConfigError
from gossip.topology.roles import Roles


def roles_of(topology) -> Roles:
    """The topology's roles; without any, every peer trains and serves one shard."""
    return topology.roles if topology.roles is not None else Roles.colocated(topology.size)


def bounds(numel: int, shards: int) -> list[tuple[int, int]]:
    """The [lo, hi) range of each of ``shards`` contiguous shards (lengths differ by at most
    one, as the ring's segments)."""
    cuts = [numel * k // shards for k in range(shards + 1)]
    return list(zip(cuts[:-1], cuts[1:]))


def participants(workers: tuple[int, ...], fraction: float, seed: int,
                 round: int) -> tuple[int, ...]:
    """The workers that push in ``round``: a draw from (seed, round) every peer makes alike."""
    if fraction >= 1.0:
        return workers
    count = max(1, round_half_up(fraction * len(workers)))
    return tuple(sorted(random.Random(seed * 1_000_003 + round).sample(workers, count)))


def round_half_up(value: float) -> int:
    return int(value + 0.5)


def check_backup(backup: int, workers: tuple[int, ...]) -> None:
    if backup >= len(workers):
        raise ConfigError(f"ps: backup must be less than the {len(workers)} worker(s), got "
                          f"{backup}")
