"""MATCHA's plan: activation probabilities, mixing weight and schedule over a matching
decomposition.

The base graph is split into matchings (matchings.py: a proper edge colouring, identical on
every peer).
Matching j is active in round k with probability p_j, independently; the p_j maximise the
algebraic connectivity of the expected Laplacian under a communication budget, and the
mixing weight alpha minimises ``rho = ||E[W^T W] - J||_2`` for ``W(k) = I - alpha L(k)``
(both solved in matcha_solver.py). Activations are a pure function of ``(seed, round)``,
so peers agree without messages.
Wang, Sahu, Yang, Joshi, Kar: "MATCHA: Speeding Up Decentralized SGD via Matching
Decomposition Sampling", arXiv 1905.09435.
"""

from __future__ import annotations

import functools
import numbers
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import networkx as nx
import numpy as np

from gossip.errors import ConfigError, TopologyError
from gossip.topology.graph import Topology
from gossip.topology.matcha_solver import (
    expected_matrices,
    gram,
    matching_laplacians,
    optimal_alpha,
    optimal_probabilities,
)
from gossip.topology.matchings import Edge, Matching, canonical_edges, decompose

# Peers running as threads of one process would all solve the same problem at once.
_PLAN_LOCK = threading.Lock()


def check_budget(budget: Any) -> float:
    """``budget`` as a float in (0, 1]; else ConfigError naming it."""
    if isinstance(budget, bool) or not isinstance(budget, numbers.Real) or not (
            0.0 < float(budget) <= 1.0):
        raise ConfigError(f"budget: MATCHA's communication budget must be in (0, 1], "
                          f"got {budget!r}")
    return float(budget)


@dataclass(frozen=True)
class MatchaPlan:
    """Everything a MATCHA peer needs, identical on every peer.

    Attributes:
        size: Number of peers P.
        matchings: Disjoint matchings whose union is the edge set, pairs ``(a, b)``, a < b.
        probabilities: Activation probability of each matching.
        alpha: Mixing weight: ``W(k) = I - alpha L(k)``.
        rho: ``||E[W^T W] - J||_2`` at alpha (< 1 means expected contraction).
        budget: Communication budget C_b: ``sum(p) <= C_b * M``.
        lambda2: Algebraic connectivity of the expected Laplacian ``sum p_j L_j``.
        lambda_max: Its largest eigenvalue.
    """

    size: int
    matchings: tuple[Matching, ...]
    probabilities: tuple[float, ...]
    alpha: float
    rho: float
    budget: float
    lambda2: float
    lambda_max: float

    def __post_init__(self):
        check_budget(self.budget)
        if len(self.probabilities) != len(self.matchings):
            raise ConfigError(f"probabilities: {len(self.probabilities)} values for "
                              f"{len(self.matchings)} matchings")
        for j, p in enumerate(self.probabilities):
            if not 0.0 <= p <= 1.0:
                raise ConfigError(f"probabilities[{j}]: {p} is not in [0, 1]")
        seen: set[Edge] = set()
        for j, matching in enumerate(self.matchings):
            ranks = [r for edge in matching for r in edge]
            if len(set(ranks)) != len(ranks):
                raise TopologyError(f"matchings[{j}]: a rank is in two pairs, not a matching")
            for a, b in matching:
                if not 0 <= a < b < self.size:
                    raise TopologyError(f"matchings[{j}]: pair ({a}, {b}) is not a < b "
                                        f"in 0..{self.size - 1}")
                if (a, b) in seen:
                    raise TopologyError(f"matchings[{j}]: edge {a}-{b} is in two matchings")
                seen.add((a, b))

    @property
    def edges(self) -> list[Edge]:
        return sorted(edge for matching in self.matchings for edge in matching)

    @property
    def expected_matchings(self) -> float:
        """Expected active matchings (communication time units) per round; D-PSGD: M."""
        return float(sum(self.probabilities))

    def partners(self, rank: int) -> tuple[int | None, ...]:
        """``rank``'s partner in each matching (None where it is not matched)."""
        out: list[int | None] = []
        for matching in self.matchings:
            out.append(next((b if a == rank else a for a, b in matching if rank in (a, b)),
                            None))
        return tuple(out)

    def active(self, round: int, seed: int = 0) -> tuple[int, ...]:
        """Indices of the matchings active in ``round``: a pure function of
        ``(seed, round)``, so every peer computes any round without state or messages."""
        for name, value in (("round", round), ("seed", seed)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
                raise ConfigError(f"{name}: expected a non-negative integer, got {value!r}")
        if not self.matchings:
            return ()
        # A generator of its own per (seed, round): never shared with data loading.
        draws = np.random.default_rng([int(seed), int(round)]).random(len(self.matchings))
        return tuple(j for j, (u, p) in enumerate(zip(draws, self.probabilities)) if u < p)

    def laplacians(self) -> np.ndarray:
        """``[M, P, P]`` Laplacians of the matchings."""
        return matching_laplacians(self.size, self.matchings)

    def laplacian(self, active: Iterable[int]) -> np.ndarray:
        """``L(k) = sum_{j active} L_j``."""
        lap = self.laplacians()
        return lap[list(active)].sum(axis=0) if len(lap) else np.zeros((self.size, self.size))

    def mixing_matrix(self, round: int, seed: int = 0) -> np.ndarray:
        """``W(k) = I - alpha L(k)`` for the matchings active in ``round``."""
        return np.eye(self.size) - self.alpha * self.laplacian(self.active(round, seed))

    def expected_laplacian(self) -> np.ndarray:
        return expected_matrices(self.laplacians(), np.asarray(self.probabilities))[0]

    def expected_mixing_matrix(self) -> np.ndarray:
        """``E[W(k)] = I - alpha L_bar``: symmetric, doubly stochastic."""
        return np.eye(self.size) - self.alpha * self.expected_laplacian()

    def expected_gram(self) -> np.ndarray:
        """``E[W(k)^T W(k)]``."""
        mean, var = expected_matrices(self.laplacians(), np.asarray(self.probabilities))
        return gram(self.alpha, mean, var)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready summary."""
        return {
            "budget": self.budget,
            "matchings": [[list(edge) for edge in matching] for matching in self.matchings],
            "probabilities": list(self.probabilities),
            "alpha": self.alpha,
            "rho": self.rho,
            "lambda2": self.lambda2,
            "lambda_max": self.lambda_max,
            "expected_matchings_per_round": self.expected_matchings,
            "dpsgd_matchings_per_round": len(self.matchings),
        }

    def describe(self) -> str:
        """Multi-line summary for ``gossip topology show --budget``."""
        count = len(self.matchings)
        lines = [f"MATCHA, budget C_b = {self.budget:g}: {count} matchings"]
        width = len(str(max(count - 1, 0)))
        for j, (matching, p) in enumerate(zip(self.matchings, self.probabilities)):
            pairs = " ".join(f"{a}-{b}" for a, b in matching)
            lines.append(f"  matching {j:>{width}}  p = {p:.4f}  {pairs}")
        sent = sum(2 * len(m) * p for m, p in zip(self.matchings, self.probabilities))
        lines += [
            f"alpha: {self.alpha:.4f}",
            f"rho = ||E[W^T W] - J||_2: {self.rho:.4f}",
            f"expected Laplacian: lambda2 {self.lambda2:.4f}, lambda_max {self.lambda_max:.4f}",
            (f"expected matchings per round: {self.expected_matchings:.3f} "
             f"(D-PSGD, all matchings: {count})"),
            f"expected messages per round: {sent:.3f} (D-PSGD: {2 * len(self.edges)})",
        ]
        if self.budget < 1.0:
            full = plan_for_matchings(self.size, self.matchings, 1.0)
            lines.append(f"all matchings every round (C_b = 1): alpha {full.alpha:.4f}, "
                         f"rho {full.rho:.4f}")
        return "\n".join(lines)


def plan(graph: Any, budget: float, *, matchings: Sequence[Sequence[Sequence[int]]] | None = None
         ) -> MatchaPlan:
    """The MATCHA plan for a Topology or a connected ``nx.Graph`` on ``0..P-1``.

    Args:
        graph: A ``gossip.Topology`` or an undirected ``nx.Graph``.
        budget: Communication budget C_b in (0, 1].
        matchings: A decomposition to use instead of :func:`decompose` (e.g. a hand-made
            one); it must partition the edge set into matchings.

    Raises:
        ConfigError: budget outside (0, 1].
        TopologyError: disconnected or malformed graph, or matchings that do not partition it.
    """
    budget = check_budget(budget)
    size, edges = _graph_edges(graph)
    if matchings is None:
        chosen = decompose(edges)
    else:
        chosen = tuple(tuple(sorted((min(a, b), max(a, b)) for a, b in m)) for m in matchings)
        covered = sorted(edge for m in chosen for edge in m)
        if covered != sorted(edges):
            raise TopologyError("matchings: their union must be the edge set, each edge once")
    with _PLAN_LOCK:
        return plan_for_matchings(size, chosen, budget)


@functools.lru_cache(maxsize=64)
def plan_for_matchings(size: int, matchings: tuple[Matching, ...], budget: float) -> MatchaPlan:
    """The plan for a given decomposition (cached: every peer of a process shares it)."""
    budget = check_budget(budget)
    laps = matching_laplacians(size, matchings)
    probabilities = optimal_probabilities(laps, budget * len(matchings))
    mean, var = expected_matrices(laps, probabilities)
    alpha, rho_value = optimal_alpha(mean, var)
    eig = np.linalg.eigvalsh(mean) if size > 1 else np.zeros(2)
    return MatchaPlan(size=size, matchings=matchings,
                      probabilities=tuple(float(p) for p in probabilities), alpha=alpha,
                      rho=rho_value, budget=budget, lambda2=float(max(eig[1], 0.0)),
                      lambda_max=float(eig[-1]))


def _graph_edges(graph: Any) -> tuple[int, list[Edge]]:
    if isinstance(graph, Topology):
        return graph.size, graph.edges()
    if not isinstance(graph, nx.Graph) or graph.is_directed() or graph.is_multigraph():
        raise TopologyError(f"graph: expected a Topology or an undirected simple nx.Graph, "
                            f"got {type(graph).__name__}")
    size = graph.number_of_nodes()
    if set(graph.nodes) != set(range(size)):
        raise TopologyError(f"graph: nodes must be 0..{size - 1}")
    if size == 0 or not nx.is_connected(graph):
        raise TopologyError("graph: MATCHA needs a connected graph")
    return size, canonical_edges(graph.edges())
