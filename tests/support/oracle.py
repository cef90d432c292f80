"""Reference results computed in float64 with numpy, and random per-peer input data."""

from __future__ import annotations

import numpy as np
import torch

from gossip.topology import Topology

# Tolerances of a float result against a float64 oracle.
TOLERANCE = {
    torch.float32: {"rtol": 1e-5, "atol": 1e-6},
    torch.float64: {"rtol": 1e-12, "atol": 1e-12},
}


class Oracle:
    """Reference results computed in float64 with numpy, and the comparison with them."""

    @staticmethod
    def mean(data: torch.Tensor) -> torch.Tensor:
        """``data[round, rank, ...]`` -> ``mean over ranks`` per round, float64."""
        return torch.from_numpy(data.double().numpy().mean(axis=1))

    @staticmethod
    def mix(topology: Topology, data: torch.Tensor) -> torch.Tensor:
        """``(W @ X)[rank]`` per round for ``data[round, rank, n]``, float64."""
        return torch.from_numpy(np.einsum("ij,rjn->rin", topology.mixing_matrix(),
                                          data.double().numpy()))

    @staticmethod
    def matcha_active(plan, seed: int, round: int) -> list[int]:
        """The matchings active in ``round``, drawn as documented: ``default_rng([seed,
        round])``, one uniform per matching, active iff below its probability."""
        draws = np.random.default_rng([seed, round]).random(len(plan.matchings))
        return [j for j, p in enumerate(plan.probabilities) if draws[j] < p]

    @classmethod
    def matcha_mixing(cls, plan, seed: int, round: int) -> np.ndarray:
        """W(k) = I - alpha * sum of the active matchings' Laplacians, built pair by pair."""
        w = np.eye(plan.size)
        for j in cls.matcha_active(plan, seed, round):
            for a, b in plan.matchings[j]:
                w[a, b] = w[b, a] = plan.alpha
                w[a, a] -= plan.alpha
                w[b, b] -= plan.alpha
        return w

    @classmethod
    def matcha_partners(cls, plan, seed: int, round: int, rank: int) -> list[int]:
        """``rank``'s partners in ``round``, in matching order."""
        return [b if a == rank else a for j in cls.matcha_active(plan, seed, round)
                for a, b in plan.matchings[j] if rank in (a, b)]

    @classmethod
    def matcha_mix(cls, plan, seed: int, data: torch.Tensor) -> torch.Tensor:
        """``W(k) @ data[k]`` for every round k, float64; ``data[round, rank, ...]``."""
        flat = data.double().flatten(2).numpy()
        mixed = np.stack([cls.matcha_mixing(plan, seed, k) @ flat[k] for k in range(len(flat))])
        return torch.from_numpy(mixed).view(data.shape)

    @staticmethod
    def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
        torch.testing.assert_close(actual.double(), expected.double(),
                                   **TOLERANCE[actual.dtype])

    @classmethod
    def assert_mean_everywhere(cls, results: torch.Tensor, data: torch.Tensor) -> None:
        """``results[round, rank]`` is the mean over ranks of ``data[round]`` on every rank,
        and all ranks hold bitwise the same value."""
        cls.assert_close(results, cls.mean(data).unsqueeze(1).expand(results.shape))
        for rank in range(1, results.shape[1]):
            assert torch.equal(results[:, rank], results[:, 0]), f"rank {rank} differs"

    @classmethod
    def assert_mixed(cls, topology: Topology, results: torch.Tensor,
                     data: torch.Tensor) -> None:
        """``results[round, rank]`` is ``(W @ data[round])[rank]`` (any trailing shape)."""
        cls.assert_close(results.flatten(2), cls.mix(topology, data.flatten(2)))


def peer_data(n_rounds: int, size: int, shape: tuple[int, ...], dtype: torch.dtype,
              seed: int = 0) -> torch.Tensor:
    """Distinct random values per round and rank: ``[n_rounds, size, *shape]``."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn((n_rounds, size, *shape), generator=generator, dtype=torch.float64)
    return values.to(dtype)


def assert_same(a, b) -> None:
    """``a`` and ``b`` equal to the bit: tensors (dtype too), and dicts, lists and values
    holding them (checkpoint state, strategy state)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), (a, b)
        for key in a:
            assert_same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b, (a, b)
