"""Split a training set's indices among peers (iid or label-skewed non-iid)."""

from __future__ import annotations

import numpy as np
import torch

from gossip.errors import ConfigError

SCHEMES = ("iid", "dirichlet")

# Re-draws of the Dirichlet proportions before falling back to moving samples into
# empty shards; re-drawing keeps the split a genuine Dirichlet draw in the common case.
_MAX_REDRAWS = 100


def partition(
    labels: np.ndarray | torch.Tensor,
    num_peers: int,
    *,
    scheme: str = "iid",
    alpha: float = 0.5,
    seed: int = 0,
) -> list[np.ndarray]:
    """Assign every example index to exactly one peer.

    Args:
        labels: Class label of each example, shape ``(n,)``; for ``"iid"`` any targets
            whose first dimension indexes the examples (a text task's next bytes).
        num_peers: Number of shards, 1 <= num_peers <= n.
        scheme: ``"iid"``: a shuffled equal split (sizes differ by at most 1).
            ``"dirichlet"``: for each class, the class's examples are divided among
            peers in proportions drawn from Dir(alpha) — the standard non-iid split;
            smaller ``alpha`` gives more skewed label distributions.
        alpha: Dirichlet concentration, > 0 (used by ``"dirichlet"``).
        seed: Makes the result deterministic.

    Returns:
        ``num_peers`` sorted int64 index arrays, disjoint and together covering
        ``range(n)``; each is non-empty.

    Raises:
        ConfigError: Unknown ``scheme``, ``alpha`` <= 0, ``num_peers`` out of range, or
            ``"dirichlet"`` of examples without one label each.
    """
    if isinstance(labels, torch.Tensor):
        labels = labels.detach().cpu().numpy()
    labels = np.asarray(labels)
    n = labels.shape[0] if labels.ndim else 1
    if scheme == "dirichlet" and labels.size != n:
        raise ConfigError(f"partition dirichlet splits by class label, and these examples have "
                          f"{labels.size // max(n, 1)} targets each, not one: use iid")
    labels = labels.reshape(n, -1)[:, 0] if n else labels.reshape(-1)
    if scheme not in SCHEMES:
        raise ConfigError(f"unknown partition scheme {scheme!r}; available: {', '.join(SCHEMES)}")
    if not alpha > 0:  # also rejects NaN
        raise ConfigError(f"alpha must be > 0, got {alpha}")
    if not 1 <= num_peers <= n:
        raise ConfigError(
            f"num_peers must be between 1 and the number of samples ({n}), got {num_peers}"
        )
    rng = np.random.default_rng(seed)
    if scheme == "iid":
        shards = np.array_split(rng.permutation(n), num_peers)
    else:
        shards = _dirichlet(labels, num_peers, alpha, rng)
    return [np.sort(s).astype(np.int64) for s in shards]


def _dirichlet(
    labels: np.ndarray, num_peers: int, alpha: float, rng: np.random.Generator
) -> list[np.ndarray]:
    """Dirichlet label-skew split; guarantees no shard is empty."""
    classes = np.unique(labels)
    for _ in range(_MAX_REDRAWS):
        parts: list[list[np.ndarray]] = [[] for _ in range(num_peers)]
        for c in classes:
            idx = rng.permutation(np.flatnonzero(labels == c))
            props = rng.dirichlet(np.full(num_peers, alpha))
            cuts = (np.cumsum(props)[:-1] * idx.size).astype(int)
            for peer, chunk in enumerate(np.split(idx, cuts)):
                parts[peer].append(chunk)
        shards = [np.concatenate(p) for p in parts]
        if min(s.size for s in shards) > 0:
            return shards
    # Tiny alpha with many peers can keep leaving some peer empty; donate one example
    # from the currently largest shard (always >= 2 examples since num_peers <= n).
    for peer in range(num_peers):
        if shards[peer].size == 0:
            donor = max(range(num_peers), key=lambda p: shards[p].size)
            shards[peer] = shards[donor][-1:]
            shards[donor] = shards[donor][:-1]
    return shards
