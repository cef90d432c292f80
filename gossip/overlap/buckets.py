"""The bucket plan: which parameters' gradients travel together, fixed when a model is
attached, the same on every rank (a pure function of the parameters' shapes and the caps).

Buckets follow backward's order, the reverse of the parameters' (the output layer's
gradients are ready first). Bucket 0 has its own, smaller cap so the first send starts early;
a parameter larger than a cap is a bucket alone. Since the flat gradient buffer is laid out
in the parameters' order, each bucket is one contiguous slice of it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gossip.errors import ConfigError

MIB = 1 << 20
DEFAULT_BUCKET_MB = 4.0
DEFAULT_FIRST_BUCKET_MB = 1.0


@dataclass(frozen=True)
class Bucket:
    """Parameters ``indices`` (into the attached parameter list, backward's order), which
    fill the flat buffer's ``[start, stop)``."""

    index: int
    indices: tuple[int, ...]
    start: int
    stop: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


def check_caps(bucket_mb: float, first_bucket_mb: float) -> None:
    for name, value in (("bucket_mb", bucket_mb), ("first_bucket_mb", first_bucket_mb)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ConfigError(f"{name} must be a positive number of MiB (inf: one bucket), "
                              f"got {value!r}")


def plan_buckets(numels: list[int], itemsize: int, *, bucket_mb: float = DEFAULT_BUCKET_MB,
                 first_bucket_mb: float = DEFAULT_FIRST_BUCKET_MB) -> list[Bucket]:
    """Buckets for parameters of ``numels`` elements of ``itemsize`` bytes each (in the
    model's order): greedy in reverse order, up to ``first_bucket_mb`` MiB for bucket 0 and
    ``bucket_mb`` for the others. ``bucket_mb=inf`` gives one bucket."""
    check_caps(bucket_mb, first_bucket_mb)
    offsets = [0]
    for n in numels:
        offsets.append(offsets[-1] + n)
    # inf is one bucket: the first bucket's own cap would split it again above 1 MiB.
    first_cap = bucket_mb if math.isinf(bucket_mb) else min(first_bucket_mb, bucket_mb)
    buckets: list[Bucket] = []
    group: list[int] = []
    size = 0
    for i in reversed(range(len(numels))):
        cap = (first_cap if not buckets else bucket_mb) * MIB
        nbytes = numels[i] * itemsize
        if group and size + nbytes > cap:
            buckets.append(_bucket(len(buckets), group, offsets))
            group, size = [], 0
        group.append(i)
        size += nbytes
    if group:
        buckets.append(_bucket(len(buckets), group, offsets))
    return buckets


def _bucket(index: int, group: list[int], offsets: list[int]) -> Bucket:
    # group is in reverse order: its last index is the lowest offset.
    return Bucket(index, tuple(group), offsets[group[-1]], offsets[group[0] + 1])


def describe(buckets: list[Bucket], itemsize: int) -> str:
    """One line: how many buckets and their sizes in MiB (logged at attach)."""
    sizes = ", ".join(f"{b.numel * itemsize / MIB:.2f}" for b in buckets)
    return f"{len(buckets)} bucket{'s' if len(buckets) != 1 else ''} of [{sizes}] MiB"

